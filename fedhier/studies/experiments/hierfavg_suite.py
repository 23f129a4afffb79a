"""The ``hierfavg`` suite: Liu et al., "Client-Edge-Cloud Hierarchical Federated Learning"
(ICC 2020), in fedhier's terms (docs/baselines.md).

Every client holds one class (``--partition shards --classes-per-client 1``); the number of
local steps between cloud aggregations, κ1·κ2 = G, is fixed while the edge period κ1 = I
varies over G/κ2 for κ2 in 1, 2, 4, 6, 10 (those that divide G: 60, 30, 15, 10, 6 at G = 60);
two placements of the clients on the edges:

- edge-IID: the ``min-divergence`` grouping (each edge holds as many classes as it can, with
  5 clients per class and 10 clients per edge, every class once);
- edge-non-IID: the ``max-divergence`` grouping (each edge as label-pure as it can be, 2
  classes per edge at 50 clients / 5 edges).

Reported: accuracy against iterations and simulated seconds, and per arm the cloud rounds,
simulated seconds and bytes (client-edge + edge-cloud) to a target accuracy, per seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedhier.settings.run_config import RunConfig  # noqa: E402
from fedhier.studies.experiments.runner import run_arms  # noqa: E402
from fedhier.studies.experiments.seed_summary import mean_std  # noqa: E402
from fedhier.studies.experiments.suites import Report, _arm, _summarise  # noqa: E402

#: κ2 = edge aggregations per cloud round the suite tries (those that divide G).
KAPPA2 = (1, 2, 4, 6, 10)
#: placement -> (grouping, label).
PLACEMENTS = {"edge-iid": ("min-divergence", "edge-IID (min-divergence)"),
              "edge-noniid": ("max-divergence", "edge-non-IID (max-divergence)")}
#: The target accuracy is this fraction of the worst arm's final mean accuracy.
TARGET_FRACTION = 0.95


def _to_target(records: Sequence[dict[str, Any]], target: float) -> dict[str, float]:
    """Cloud rounds, simulated seconds and bytes of the first round reaching ``target``
    (inf where none does)."""
    hit = next((r for r in records if r["round"] > 0 and r["test_accuracy"] >= target), None)
    if hit is None:
        return {"rounds": float("inf"), "seconds": float("inf"), "bytes": float("inf")}
    return {"rounds": float(hit["round"]), "seconds": float(hit["sim_seconds"]),
            "bytes": float(hit["client_edge_bytes"] + hit["edge_cloud_bytes"])}


def _over_seeds(runs: dict[int, list[dict[str, Any]]], target: float) -> dict[str, Any]:
    """Mean, std and per-seed values of :func:`_to_target` (std inf when a seed never
    reaches)."""
    per = [_to_target(run, target) for run in runs.values()]
    out: dict[str, Any] = {}
    for key in ("rounds", "seconds", "bytes"):
        values = np.array([p[key] for p in per])
        out[key] = {"mean": float(values.mean()), "per_seed": values.tolist(),
                    "std": float(values.std()) if np.isfinite(values).all() else float("inf")}
    return out


def _plot(summary: dict[str, Any], kappa1: Sequence[int], reach: dict[str, Any],
          target: float, out: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey=True)
    for col, (place, (_, title)) in enumerate(PLACEMENTS.items()):
        for k in kappa1:
            c = summary[f"{place}-k{k}"]["curves"]
            label = f"κ1={k}"
            axes[0, col].plot(c["test_accuracy"]["iteration"], c["test_accuracy"]["mean"],
                              label=label)
            axes[1, col].plot(c["sim_seconds"]["mean"], c["test_accuracy"]["mean"],
                              label=label)
        axes[0, col].set(title=title, xlabel="local SGD iterations")
        axes[1, col].set(xlabel="simulated seconds")
    for ax in axes.flat:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0, 0].set(ylabel="test accuracy")
    axes[1, 0].set(ylabel="test accuracy")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hierfavg_curves.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for place, (_, title) in PLACEMENTS.items():
        mean = [reach[f"{place}-k{k}"]["rounds"]["mean"] for k in kappa1]
        ax.plot(list(kappa1), mean, marker="o", label=title)
    ax.set(xlabel="κ1 (local steps per edge aggregation), κ1·κ2 fixed",
           ylabel=f"cloud rounds to accuracy {target:.3f}", xscale="log",
           title="Cloud rounds to the target accuracy")
    ax.set_xticks(list(kappa1), [str(k) for k in kappa1])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "hierfavg_rounds.png", dpi=110)
    plt.close(fig)


def _fmt(value: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    if not np.isfinite(value["mean"]):
        return "not reached"
    return mean_std(value, digits, scale)


def hierfavg(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
             total: int) -> Report:
    """κ1 over G/κ2 with κ1·κ2 = G fixed, edge-IID against edge-non-IID placement."""
    g = base.global_period
    kappa1 = [g // k2 for k2 in KAPPA2 if g % k2 == 0]
    arms = [_arm(f"{place}-k{k}", f"{title}, κ1={k}, κ2={g // k}", base, total,
                 local_period=k, global_period=g, grouping=grouping, periods=())
            for place, (grouping, title) in PLACEMENTS.items() for k in kappa1]
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy", "sim_seconds", "client_edge_bytes",
                                         "edge_cloud_bytes"))
    final_acc = {name: summary[name]["final"]["test_accuracy"] for name in summary}
    target = round(TARGET_FRACTION * min(f["mean"] for f in final_acc.values()), 4)
    reach = {arm.name: _over_seeds(results[arm.name], target) for arm in arms}
    _plot(summary, kappa1, reach, target, out)

    def rounds(place: str, k: int) -> float:
        return float(reach[f"{place}-k{k}"]["rounds"]["mean"])

    claims: dict[str, bool] = {}
    for place, (_, title) in PLACEMENTS.items():
        seq = [rounds(place, k) for k in kappa1]  # κ1 from G down
        claims[f"{title}: with κ1·κ2 = {g} fixed, smaller κ1 needs no more cloud rounds to "
               f"accuracy {target:.4f} (non-increasing from κ1={kappa1[0]} to "
               f"{kappa1[-1]}) and strictly fewer at κ1={kappa1[-1]} than at κ1={kappa1[0]}"
               ] = all(b <= a for a, b in zip(seq, seq[1:], strict=False)) and seq[-1] < seq[0]
    split = [k for k in kappa1 if k < g]  # at κ1 = G (κ2 = 1) the placement cannot matter
    claims["edge-IID beats edge-non-IID: higher final test accuracy at every κ1 < G "
           f"({', '.join(map(str, split))})"] = all(
        final_acc[f"edge-iid-k{k}"]["mean"] > final_acc[f"edge-noniid-k{k}"]["mean"]
        for k in split)
    md = [f"Each client holds one class; {base.clients} clients on {base.num_edges} edges; "
          f"κ1·κ2 = G = {g} local steps per cloud round; {total // g} cloud rounds "
          f"(T = {total}); target accuracy {target:.4f} = {TARGET_FRACTION:g} x the worst "
          "arm's final mean. Mean ± std over seeds:", "",
          "| arm | final test accuracy | cloud rounds to target | simulated s to target | "
          "MB to target (client-edge + edge-cloud) |", "|---|---|---|---|---|"]
    for arm in arms:
        r = reach[arm.name]
        md.append(f"| {arm.label} | {mean_std(final_acc[arm.name])} | {_fmt(r['rounds'])} | "
                  f"{_fmt(r['seconds'])} | {_fmt(r['bytes'], 1e6, 0)} |")
    md += ["", "At κ1 = G (κ2 = 1) every edge aggregates once, right before the cloud: the "
           "two placements are the same algorithm (flat FedAvg), so the placement claim "
           "leaves that κ1 out.", "", "![curves](hierfavg_curves.png)", "",
           "![rounds](hierfavg_rounds.png)"]
    return Report({"arms": summary, "kappa1": kappa1, "target_accuracy": target,
                   "to_target": reach, "claims": claims}, "\n".join(md), claims)
