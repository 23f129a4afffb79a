"""The ``mobility-noniid`` suite: the mobility suite's extension to non-IID edges and to the
divergence-aware admission (Chen et al., arXiv 2306.10692; docs/baselines.md).

Arms, over the mobility suite's move rates (Markov moves, ``fresh`` handoff):

- ``iid-rate*``: edges start label-balanced (``min-divergence`` grouping), never regrouped;
- ``noniid-rate*``: edges start label-pure (``max-divergence``), never regrouped;
- ``random-rate*`` / ``mindiv-admit-rate*`` (rates > 0): the mobility suite's comparison
  (random vs min-divergence grouping, regrouped every ``max(1, R/5)`` cloud rounds), the
  min-divergence arm with ``--handoff fresh:min-divergence``.

The edges' divergence is the label upward divergence (:func:`fedhier.diagnostics.measures.
label_upward_divergence`, from each run's partition.json and its recorded client -> edge
maps): exact and free, where the mobility suite measures the gradient ε² (diagnostics).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedhier.diagnostics.measures import label_upward_divergence  # noqa: E402
from fedhier.runs.folder import read_json  # noqa: E402
from fedhier.settings.run_config import RunConfig  # noqa: E402
from fedhier.studies.experiments.runner import SuiteArm, run_arms  # noqa: E402
from fedhier.studies.experiments.seed_summary import mean_std  # noqa: E402
from fedhier.studies.experiments.suites import (  # noqa: E402
    MOVE_RATES,
    Report,
    _arm,
    _rounds_for,
    _summarise,
)

ADMIT = "fresh:min-divergence"


def _arms(base: RunConfig, total: int, rates: Sequence[float]) -> list[SuiteArm]:
    every = max(1, _rounds_for(total, base) // 5)
    moving = [r for r in rates if r > 0]
    arms = [_arm(f"{kind}-rate{r:g}", f"{label}, move rate {r:g}", base, total,
                 grouping=grouping, mobility_rate=r)
            for kind, grouping, label in (("iid", "min-divergence", "edge-IID start"),
                                          ("noniid", "max-divergence", "edge-non-IID start"))
            for r in rates]
    arms += [_arm(f"{kind}-rate{r:g}", f"{label}, rate {r:g}", base, total, grouping=grouping,
                  mobility_rate=r, regroup_every=every, handoff=handoff)
             for kind, grouping, handoff, label in (
                 ("random", "random", "fresh", f"random, regroup every {every}"),
                 ("mindiv-admit", "min-divergence", ADMIT,
                  f"min-divergence + admission, regroup every {every}"))
             for r in moving]
    return arms


def label_divergences(run_dir: Path, records: Sequence[dict[str, Any]]) -> list[float]:
    """The label upward divergence of the client -> edge map at the end of every recorded
    round (round 0: the initial grouping)."""
    hist = np.array([c["label_counts"] for c in read_json(run_dir, "partition.json")["clients"]])
    current = np.array(read_json(run_dir, "groups.json")["client_to_edge"])
    edges = int(current.max()) + 1
    out = []
    for record in records:
        if "client_to_edge" in record:
            current = np.array(record["client_to_edge"])
        out.append(label_upward_divergence(hist, current, max(edges, int(current.max()) + 1)))
    return out


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def mobility_noniid(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
                    total: int, rates: Sequence[float] = MOVE_RATES) -> Report:
    """Mobility with edge-IID vs edge-non-IID starts, and divergence-aware admission."""
    arms = _arms(base, total, rates)
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy",))
    div: dict[str, dict[str, Any]] = {}
    for arm in arms:
        per_seed = [label_divergences(out / "runs" / arm.name / f"seed{s}", results[arm.name][s])
                    for s in seeds]
        div[arm.name] = {"final": _mean_std([d[-1] for d in per_seed]),
                         "mean_over_rounds": _mean_std([float(np.mean(d[1:])) for d in per_seed])}
        summary[arm.name]["label_upward_divergence"] = div[arm.name]
    acc = {name: summary[name]["final"]["test_accuracy"] for name in summary}
    moving = [r for r in rates if r > 0]

    def gain(kind: str, r: float) -> float:
        return acc[f"{kind}-rate{r:g}"]["mean"] - acc[f"{kind}-rate0"]["mean"]

    def noise(kind: str, r: float) -> float:
        return acc[f"{kind}-rate{r:g}"]["std"] + acc[f"{kind}-rate0"]["std"]

    claims = {
        "mobility helps when edges are non-IID: with an edge-non-IID start every move rate > 0 "
        "ends with a higher final accuracy than rate 0, by more than the two stds":
            all(gain("noniid", r) > noise("noniid", r) for r in moving),
        "and not when they are IID: with an edge-IID start no move rate changes the final "
        "accuracy by more than the two stds":
            all(abs(gain("iid", r)) <= noise("iid", r) for r in moving),
        "restated with admission: min-divergence grouping + min-divergence admission keeps a "
        "lower final label upward divergence than random grouping at every move rate > 0":
            all(div[f"mindiv-admit-rate{r:g}"]["final"]["mean"]
                < div[f"random-rate{r:g}"]["final"]["mean"] for r in moving),
    }
    _plot(rates, acc, div, out)
    md = ["Final test accuracy and label upward divergence U (final; mean over rounds), mean ± "
          f"std over seeds ({base.clients} clients, {base.num_edges} edges, "
          f"{_rounds_for(total, base)} cloud rounds):", "",
          "| arm | final test accuracy | final U | U, mean over rounds |", "|---|---|---|---|"]
    for arm in arms:
        d = div[arm.name]
        md.append(f"| {arm.label} | {mean_std(acc[arm.name])} | {mean_std(d['final'])} | "
                  f"{mean_std(d['mean_over_rounds'])} |")
    md += ["", "![mobility non-IID](mobility_noniid.png)"]
    return Report({"arms": summary, "claims": claims}, "\n".join(md), claims)


def _plot(rates: Sequence[float], acc: dict[str, Any], div: dict[str, Any], out: Path) -> None:
    fig, (ax_acc, ax_div) = plt.subplots(1, 2, figsize=(11, 4))
    lines = {"iid": ("edge-IID start", rates), "noniid": ("edge-non-IID start", rates),
             "random": ("random, regrouped", [r for r in rates if r > 0]),
             "mindiv-admit": ("min-divergence + admission, regrouped",
                              [r for r in rates if r > 0])}
    for kind, (label, rs) in lines.items():
        names = [f"{kind}-rate{r:g}" for r in rs]
        ax_acc.errorbar(rs, [acc[n]["mean"] for n in names], yerr=[acc[n]["std"] for n in names],
                        marker="o", capsize=3, label=label)
        ax_div.errorbar(rs, [div[n]["final"]["mean"] for n in names],
                        yerr=[div[n]["final"]["std"] for n in names], marker="o", capsize=3,
                        label=label)
    ax_acc.set(xlabel="move rate per cloud round", ylabel="final test accuracy",
               title="Accuracy as clients move")
    ax_div.set(xlabel="move rate per cloud round", ylabel="final label upward divergence U",
               title="Edges' label divergence as clients move")
    for ax in (ax_acc, ax_div):
        ax.grid(alpha=0.3)
    ax_div.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "mobility_noniid.png", dpi=110)
    plt.close(fig)
