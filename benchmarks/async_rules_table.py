"""The asynchronous rules' stability table and figure of docs/hsgd.md ("Which rule, and why
one-report buffers rise").

Grid: rule (fedbuff, fedasync, shifted-mean, at their defaults: η_g = 1, α = 0.5,
polynomial:0.5) x K (1, 2, N = 4 edge reports per cloud aggregation) x staleness bound S
(1, 4; K = N: every report fresh, so one run) x mobility (0, rate 0.5) x levels (two:
``--groups 4 --periods 5,20``; three: ``--groups 4,2 --periods 5,10,20``) x dataset
(digits, full-batch steps at lr 0.5, the issue's case; Fashion-MNIST, mini-batches of 32
at lr 0.1) x 3 seeds. 20 clients, Dirichlet 0.1, min-divergence grouping, vectorized
engine. Every run trains the same 20 edge jobs: 5 N / K cloud aggregations. K = N under
fedbuff and shifted-mean is synchronous H-SGD bit for bit (tests/test_async_rules.py),
shown as the ``synchronous`` row.

Reported per cell: final test accuracy (mean ± std over seeds), the largest rise of the
train loss between two consecutive cloud aggregations (mean over seeds), and the highest
train loss above the initial one (max over seeds; 0 = never above).

Second part (``trajectories``): the issue's three-level ``--async-buffer 1`` case (digits,
5 cloud aggregations) at lr 0.1 and 0.5, with and without mobility, under every rule and
under fedbuff with η_g = K / N: each train-loss trajectory.

    nice -n 19 python benchmarks/async_rules_table.py --out /tmp/async-rules   # ~1 h, 2 cores
    nice -n 19 python benchmarks/async_rules_table.py --datasets digits --seeds 1  # quick

Runs are ordinary run folders under OUT/runs (fedhier.studies.experiments.runner: a finished run is
not run again). Writes OUT/async_rules.md and OUT/async_rules.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from fedhier.settings.run_config import RunConfig
from fedhier.studies.experiments.runner import SuiteArm, default_jobs, run_arms

EDGES = 4
RULES = ("fedbuff", "fedasync", "shifted-mean")
LEVELS = {"two": {"groups": (EDGES,), "periods": (5, 20)},
          "three": {"groups": (EDGES, 2), "periods": (5, 10, 20)}}
#: min_partition_size: the auto value (0 would resolve to it), given so that a finished run
#: is found again (config.json records the resolved value)
DATASETS = {"digits": {"batch_size": 0, "lr": 0.5, "min_partition_size": 3},
            "fashion-mnist": {"batch_size": 32, "lr": 0.1, "min_partition_size": 10}}
JOBS = 5  # cloud rounds of the synchronous run: every run trains 5 N edge jobs


def base(dataset: str, levels: str) -> RunConfig:
    return RunConfig(dataset=dataset, clients=20, alpha=0.1, grouping="min-divergence",
                     **DATASETS[dataset], **LEVELS[levels])


def grid_arms(dataset: str, levels: str) -> list[SuiteArm]:
    """Every cell of one (dataset, levels) block of the table."""
    arms = []
    for mobility in (0.0, 0.5):
        cfg = base(dataset, levels).replace(mobility_rate=mobility)
        tag = f"{dataset}-{levels}-m{mobility:g}"
        arms.append(SuiteArm(f"{tag}-sync", "synchronous", cfg.replace(rounds=JOBS)))
        arms.append(SuiteArm(f"{tag}-fedasync-K{EDGES}", f"fedasync K={EDGES}",
                        cfg.replace(rounds=JOBS, async_buffer=EDGES, async_rule="fedasync")))
        for rule in RULES:
            for k in (1, 2):
                for bound in (1, 4):
                    arms.append(SuiteArm(f"{tag}-{rule}-K{k}-S{bound}", f"{rule} K={k} S={bound}",
                                    cfg.replace(rounds=JOBS * EDGES // k, async_buffer=k,
                                                max_staleness=bound, async_rule=rule)))
    return arms


def trajectory_arms() -> list[SuiteArm]:
    """The issue's case: three levels, --async-buffer 1, 5 cloud aggregations, digits."""
    arms = []
    for lr in (0.1, 0.5):
        for mobility in (0.0, 0.5):
            cfg = base("digits", "three").replace(lr=lr, mobility_rate=mobility, rounds=JOBS)
            tag = f"case-lr{lr:g}-m{mobility:g}"
            arms.append(SuiteArm(f"{tag}-sync", "synchronous", cfg))
            for rule in RULES:
                arms.append(SuiteArm(f"{tag}-{rule}", rule, cfg.replace(async_buffer=1,
                                                                   async_rule=rule)))
            arms.append(SuiteArm(f"{tag}-fedbuff-eta", f"fedbuff η_g = 1/{EDGES}",
                            cfg.replace(async_buffer=1, async_server_lr=1 / EDGES)))
    return arms


def cell(runs: dict[int, list[dict]]) -> dict[str, float]:
    """Final accuracy mean/std, mean largest rise between aggregations, max peak over the
    initial train loss."""
    acc = [records[-1]["test_accuracy"] for records in runs.values()]
    rises, peaks = [], []
    for records in runs.values():
        loss = np.array([r["train_loss"] for r in records])
        rises.append(max(0.0, float(np.diff(loss).max())))
        peaks.append(max(0.0, float(loss[1:].max() - loss[0])))
    return {"acc": float(np.mean(acc)), "std": float(np.std(acc)), "rise": float(np.mean(rises)),
            "peak": float(np.max(peaks))}


def table(results: dict, dataset: str, levels: str) -> list[str]:
    lines = [f"**{dataset}, {levels} levels** (accuracy ± std / largest rise / peak over "
             "initial)", "",
             "| rule | K | S | static | mobility 0.5 |", "|---|---|---|---|---|"]
    rows = [("synchronous (= fedbuff, shifted-mean K=N)", "4", "-", "sync"),
            ("fedasync", "4", "-", f"fedasync-K{EDGES}")]
    rows += [(rule, str(k), str(s), f"{rule}-K{k}-S{s}") for rule in RULES for k in (1, 2)
             for s in (1, 4)]
    for label, k, s, key in rows:
        cells = []
        for mobility in (0.0, 0.5):
            c = cell(results[f"{dataset}-{levels}-m{mobility:g}-{key}"])
            cells.append(f"{c['acc']:.3f} ± {c['std']:.3f} / {c['rise']:.2f} / {c['peak']:.2f}")
        lines.append(f"| {label} | {k} | {s} | " + " | ".join(cells) + " |")
    return lines + [""]


def figure(results: dict, out: Path) -> None:
    """Train loss per cloud aggregation, digits, three levels, K = 1, S = 4, seed mean:
    each rule, static and mobile, against the synchronous run (x: edge jobs trained)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mobility in zip(axes, (0.0, 0.5), strict=True):
        tag = f"digits-three-m{mobility:g}"
        curves = {"synchronous": (results[f"{tag}-sync"], EDGES)}
        curves |= {f"{rule} K=1": (results[f"{tag}-{rule}-K1-S4"], 1) for rule in RULES}
        for label, (runs, per_round) in curves.items():
            loss = np.mean([[r["train_loss"] for r in recs] for recs in runs.values()], axis=0)
            ax.plot(np.arange(len(loss)) * per_round, loss, marker=".", label=label)
        first = next(iter(results[f"{tag}-sync"].values()))[0]["train_loss"]
        ax.axhline(first, color="grey", ls=":", lw=1, label="initial train loss")
        ax.set(title=f"digits, three levels, K = 1, S = 4, mobility {mobility:g}",
               xlabel="edge jobs trained", ylabel="train loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "async_rules.png", dpi=110)
    plt.close(fig)


def trajectories(results: dict) -> list[str]:
    lines = ["**The issue's case** (digits, three levels, `--async-buffer 1`, 5 cloud "
             "aggregations; train loss after each, seed "
             f"{min(next(iter(results.values())))}):", "",
             "| lr | mobility | rule | train loss per cloud aggregation | above initial |",
             "|---|---|---|---|---|"]
    for lr in (0.1, 0.5):
        for mobility in (0.0, 0.5):
            tag = f"case-lr{lr:g}-m{mobility:g}"
            for key, label in (("sync", "synchronous"), *((r, r) for r in RULES),
                               ("fedbuff-eta", f"fedbuff η_g = 1/{EDGES}")):
                records = next(iter(results[f"{tag}-{key}"].values()))
                loss = [r["train_loss"] for r in records]
                above = sum(x > loss[0] for x in loss[1:])
                lines.append(f"| {lr:g} | {mobility:g} | {label} | "
                             + ", ".join(f"{x:.2f}" for x in loss) + f" | {above} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("async-rules"))
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=default_jobs())
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    start = time.time()
    md = ["Asynchronous rules at their defaults (fedbuff η_g = 1, fedasync α = 0.5, "
          f"polynomial:0.5), {len(seeds)} seeds, every run trains {JOBS * EDGES} edge jobs.",
          ""]
    results: dict = {}
    for dataset in args.datasets.split(","):
        for levels in LEVELS:
            arms = grid_arms(dataset, levels)
            results |= run_arms(arms, seeds, args.out, "vectorized", args.jobs)
            md += table(results, dataset, levels)
    traj = run_arms(trajectory_arms(), seeds[:1], args.out, "vectorized", args.jobs)
    md += trajectories(traj)
    if "digits" in args.datasets.split(","):
        figure(results, args.out)
        md += ["![async rules](async_rules.png)", ""]
    md.append(f"Wall time: {time.time() - start:.0f} s ({args.jobs} jobs).")
    (args.out / "async_rules.md").write_text("\n".join(md) + "\n")
    (args.out / "async_rules.json").write_text(json.dumps(
        {name: cell(runs) for name, runs in results.items()}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
