"""Sensitivity of the "does not hold" verdicts of docs/baselines.md: each claim re-tested over
the settings that differ from the paper (data, model, learning rate, rounds, mobility model),
>= 5 seeds, with 95% intervals of the paired differences (fedhier.studies.sweep.stats).

    python -m fedhier.studies.experiments.sensitivity hierfavg [--seeds 5] [--jobs 2] [--only A,B]
    python -m fedhier.studies.experiments.sensitivity mobility [--seeds 5] [--jobs 2] [--only ...]

writes ``runs/experiments/sensitivity-<claim>/results.md`` and ``results.json``; every
(setting, arm, seed) is an ordinary run folder under ``runs/`` there, reused when the
command is repeated (so settings can be run a few at a time with ``--only``).

- ``hierfavg``: Liu et al.'s "with κ1·κ2 = G fixed, smaller κ1 reaches the target in fewer
  cloud rounds" under edge-non-IID placement (max-divergence grouping, one class per
  client, 50 clients, 5 edges, G = 60), at κ1 = 60, 30, 6. Verdict: cloud rounds to the
  target (0.95 x the worst of the three arms' final mean accuracy) non-increasing from
  κ1 = 60 to 30 to 6 and strictly fewer at 6 than at 60 (the suite's rule on three κ1).
- ``mobility``: Chen et al.'s "mobility raises accuracy when edges are non-IID" (edge-non-IID
  start, never regrouped) and its converse, at move rate 0.5 against 0, under fedhier's
  mobility model (any edge, ``fresh``) and Chen et al.'s (a one-way ring road, the model
  travelling with the vehicle: ``carry``; a chance to move before every edge round:
  ``mobility_every edge-round``), and the mixtures. Verdict: the paired
  difference of final test accuracy (moving - static) has its 95% interval above 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedhier.settings.run_config import RunConfig
from fedhier.studies.experiments.runner import SuiteArm, run_arms
from fedhier.studies.sweep.stats import t_interval

ROOT = Path(__file__).resolve().parents[2]
RING5 = str(ROOT / "examples" / "mobility" / "ring5.csv")

#: Liu et al.'s setting at the CPU budget of docs/baselines.md (the published hierfavg run).
HIERFAVG_BASE = dict(dataset="fashion-mnist", clients=50, groups=(5,), partition="shards",
                     classes_per_client=1, grouping="max-divergence", global_period=60,
                     batch_size=20, lr=0.05, model="mlp", rounds=20)
#: setting key -> (what differs from the published run, overrides).
HIERFAVG_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "A": ("published: Fashion-MNIST, MLP, lr 0.05, 20 cloud rounds", {}),
    "B": ("data: digits", {"dataset": "digits"}),
    "C": ("data: digits; lr 0.01 (HierFL's README)", {"dataset": "digits", "lr": 0.01}),
    "D": ("data: digits; model: cnn", {"dataset": "digits", "model": "cnn"}),
    "E": ("data: digits; 40 cloud rounds", {"dataset": "digits", "rounds": 40}),
    "F": ("lr 0.01 (HierFL's README)", {"lr": 0.01}),
}
KAPPA1 = (60, 30, 6)

#: Chen et al.'s claim at the CPU budget of the published mobility-noniid run.
MOBILITY_BASE = dict(dataset="digits", clients=50, groups=(5,), partition="shards",
                     classes_per_client=1, local_period=5, global_period=20, batch_size=16,
                     lr=0.05, model="mlp", rounds=20)
#: mobility model key -> (label, overrides of a moving arm).
MOBILITY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "fresh-any": ("fedhier's: any edge, fresh", {"handoff": "fresh"}),
    "carry-any": ("any edge, model carried", {"handoff": "carry"}),
    "fresh-ring": ("one-way ring, fresh", {"handoff": "fresh", "reachability": RING5}),
    "carry-ring": ("one-way ring, model carried",
                   {"handoff": "carry", "reachability": RING5}),
    "chen": ("Chen et al.'s: one-way ring, carried, every edge round",
             {"handoff": "carry", "reachability": RING5, "mobility_every": "edge-round"}),
}
MOBILITY_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "A": ("digits, 20 cloud rounds", {}),
    "B": ("digits, 60 cloud rounds", {"rounds": 60}),
    "C": ("Fashion-MNIST, 20 cloud rounds (the published data)",
          {"dataset": "fashion-mnist", "batch_size": 16}),
}
RATE = 0.5


def _config(base: dict[str, Any], **changes: Any) -> RunConfig:
    return RunConfig.from_mapping({**base, **changes}, where="sensitivity")


def _interval_text(ci: dict[str, Any], digits: int = 1, scale: float = 1.0) -> str:
    if ci["mean"] is None:
        return "–"
    if ci["low"] is None:
        return f"{ci['mean'] * scale:+.{digits}f}"
    return (f"{ci['mean'] * scale:+.{digits}f} [{ci['low'] * scale:+.{digits}f}, "
            f"{ci['high'] * scale:+.{digits}f}]")


def _rounds_to(records: Sequence[dict[str, Any]], target: float) -> float:
    hit = next((r for r in records if r["round"] > 0 and r["test_accuracy"] >= target), None)
    return float("inf") if hit is None else float(hit["round"])


def hierfavg_sensitivity(keys: Sequence[str], seeds: Sequence[int], out: Path,
                         jobs: int) -> tuple[dict[str, Any], str]:
    rows, md = {}, [
        "Edge-non-IID placement (max-divergence grouping), one class per client, 50 clients "
        "on 5 edges, κ1·κ2 = 60, batch 20; per setting, cloud rounds to the target (0.95 × "
        f"the worst final mean of κ1 ∈ {list(KAPPA1)}), mean over seeds {list(seeds)}, and "
        "paired differences (seed by seed) with 95% t-intervals:", "",
        "| setting | target | rounds κ1=60 | κ1=30 | κ1=6 | κ1=30 − 60 | κ1=6 − 60 | "
        "final acc. κ1=60 / 30 / 6 | claim |", "|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        label, changes = HIERFAVG_SETTINGS[key]
        base = _config(HIERFAVG_BASE, **changes)
        arms = [SuiteArm(f"k{k}", f"κ1={k}", base.replace(local_period=k, global_period=60,
                                                    periods=())) for k in KAPPA1]
        results = run_arms(arms, seeds, out / "runs" / key, "vectorized", jobs)
        finals = {a.name: [results[a.name][s][-1]["test_accuracy"] for s in seeds]
                  for a in arms}
        target = round(0.95 * min(float(np.mean(v)) for v in finals.values()), 4)
        reach = {a.name: [_rounds_to(results[a.name][s], target) for s in seeds] for a in arms}
        missed = {k: sum(not np.isfinite(x) for x in v) for k, v in reach.items()}
        # a seed that never reaches the target counts as R + 1 rounds (a lower bound)
        reach = {k: [min(x, base.rounds + 1.0) for x in v] for k, v in reach.items()}
        mean = {k: float(np.mean(v)) for k, v in reach.items()}
        diffs = {k: t_interval([a - b for a, b in zip(reach[k], reach["k60"], strict=True)])
                 for k in ("k30", "k6")}
        holds = bool(mean["k30"] <= mean["k60"] and mean["k6"] <= mean["k30"]
                     and mean["k6"] < mean["k60"])
        rows[key] = {"label": label, "changes": changes, "target": target, "rounds": reach,
                     "not_reached": missed, "final_accuracy": finals, "differences": diffs,
                     "holds": holds}
        acc = " / ".join(f"{np.mean(finals[f'k{k}']):.3f}" for k in KAPPA1)
        cell = {k: f"{mean[k]:.1f}" + (f" ({missed[k]}†)" if missed[k] else "") for k in mean}
        md.append(f"| {key}: {label} | {target:.4f} | {cell['k60']} | {cell['k30']} | "
                  f"{cell['k6']} | {_interval_text(diffs['k30'])} | "
                  f"{_interval_text(diffs['k6'])} | {acc} | "
                  f"{'holds' if holds else '**does not hold**'} |")
    md += ["", "(n†): n seeds did not reach the target within the run's R cloud rounds; they "
           "count as R + 1 (a lower bound), so a difference involving them is a bound too."]
    return rows, "\n".join(md)


STARTS = {"non-IID": "max-divergence", "IID": "min-divergence"}


def mobility_sensitivity(keys: Sequence[str], seeds: Sequence[int], out: Path, jobs: int,
                         starts: Sequence[str] = tuple(STARTS)) -> tuple[dict[str, Any], str]:
    rows, md = {}, [
        "One class per client, 50 clients on 5 edges, I = 5, G = 20, batch 16, lr 0.05, MLP; "
        "edges start non-IID (max-divergence) or IID (min-divergence), never regrouped; "
        f"move rate {RATE} per cloud round against 0. Cells: final test accuracy of the "
        "moving arm minus the static one, paired by seed, in points (×100), mean [95% "
        f"interval] over seeds {list(seeds)}:", "",
        "| setting | start | " + " | ".join(v[0] for v in MOBILITY_MODELS.values()) + " |",
        "|---|---|" + "---|" * len(MOBILITY_MODELS)]
    for key in keys:
        label, changes = MOBILITY_SETTINGS[key]
        base = _config(MOBILITY_BASE, **changes)
        for start, grouping in ((k, STARTS[k]) for k in starts):
            arms = [SuiteArm("static", "rate 0", base.replace(grouping=grouping))]
            arms += [SuiteArm(name, lab,
                              base.replace(grouping=grouping, mobility_rate=RATE, **over))
                     for name, (lab, over) in MOBILITY_MODELS.items()]
            results = run_arms(arms, seeds, out / "runs" / key / start, "vectorized", jobs)
            finals = {a.name: [results[a.name][s][-1]["test_accuracy"] for s in seeds]
                      for a in arms}
            diffs = {name: t_interval([a - b for a, b in zip(finals[name], finals["static"],
                                                              strict=True)])
                     for name in MOBILITY_MODELS}
            rows[f"{key}-{start}"] = {"label": label, "changes": changes, "start": start,
                                      "final_accuracy": finals, "differences": diffs}
            cells = []
            for name in MOBILITY_MODELS:
                ci = diffs[name]
                mark = ("" if ci["low"] is None else " ↑" if ci["low"] > 0 else
                        " ↓" if ci["high"] < 0 else "")
                cells.append(_interval_text(ci, 1, 100) + mark)
            md.append(f"| {key}: {label} | {start} (static "
                      f"{np.mean(finals['static']):.3f}) | " + " | ".join(cells) + " |")
    md += ["", "↑ / ↓: the 95% interval lies above / below 0 (mobility raises / lowers the "
           "final accuracy); otherwise the difference is within the seeds' noise."]
    return rows, "\n".join(md)


SENSITIVITIES = {"hierfavg": (hierfavg_sensitivity, HIERFAVG_SETTINGS),
                 "mobility": (mobility_sensitivity, MOBILITY_SETTINGS)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhier.studies.experiments.sensitivity")
    parser.add_argument("claim", choices=sorted(SENSITIVITIES))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="setting keys, e.g. A,B (default all)")
    parser.add_argument("--out", default="")
    parser.add_argument("--starts", default=",".join(STARTS),
                        help="mobility: the edges' starts, non-IID and/or IID")
    args = parser.parse_args(argv)
    function, settings = SENSITIVITIES[args.claim]
    starts = [k for k in args.starts.split(",") if k]
    if args.claim == "mobility":
        if not starts or set(starts) - set(STARTS):
            print(f"fedhier: --starts takes {', '.join(STARTS)}", file=sys.stderr)
            return 2
        function = functools.partial(mobility_sensitivity, starts=starts)
    keys = [k for k in args.only.split(",") if k] or list(settings)
    unknown = [k for k in keys if k not in settings]
    if unknown or args.seeds < 1:
        print(f"fedhier: unknown setting {unknown} (choose from {', '.join(settings)}) or "
              "--seeds < 1", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/experiments/sensitivity-{args.claim}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows, md = function(keys, list(range(args.seeds)), out, args.jobs)
    seconds = time.time() - started
    previous = json.loads((out / "results.json").read_text()) if (
        out / "results.json").exists() else {"rows": {}}
    previous["rows"].update(rows)
    command = "python -m fedhier.studies.experiments.sensitivity " + " ".join(argv or sys.argv[1:])
    (out / "results.json").write_text(json.dumps({**previous, "command": command},
                                                 indent=1, default=str))
    suffix = "" if args.claim != "mobility" or len(starts) == 2 else "-" + "-".join(starts)
    (out / f"results-{'-'.join(keys)}{suffix}.md").write_text(
        f"Command: `{command}` ({seconds / 60:.1f} min wall clock, including runs reused "
        f"from an earlier invocation)\n\n{md}\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
