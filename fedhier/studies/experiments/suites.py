"""The experiment suites that reproduce the papers' claims (algorithms.md §1-§4).

Each suite turns a base configuration into arms, runs them over seeds
(:mod:`fedhier.studies.experiments.runner`) and reports: results.json (every arm's curves and final
numbers, mean and std over seeds), results.md (the table and the claim check) and PNG figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedhier.settings.run_config import RunConfig  # noqa: E402
from fedhier.studies.experiments.runner import SuiteArm, run_arms  # noqa: E402
from fedhier.studies.experiments.seed_summary import curve, final, first_reaching, mean_std  # noqa: E402


@dataclass
class Report:
    """What a suite writes: results.json content, the markdown, and claim checks."""

    results: dict[str, Any]
    markdown: str
    claims: dict[str, bool]


def _rounds_for(total_iterations: int, cfg: RunConfig) -> int:
    return max(1, total_iterations // cfg.global_period)


def _arm(name: str, label: str, base: RunConfig, total: int, **changes: Any) -> SuiteArm:
    cfg = base.replace(**changes)
    return SuiteArm(name, label, cfg.replace(rounds=_rounds_for(total, cfg)))


def _summarise(arms: Sequence[SuiteArm], results: dict[str, dict[int, list[dict[str, Any]]]],
               keys: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in arms:
        runs = results[arm.name]
        out[arm.name] = {
            "label": arm.label,
            "config": {k: v for k, v in arm.config.to_dict().items() if k != "out"},
            "curves": {k: curve(runs, k) for k in keys if runs[next(iter(runs))][-1].get(k)
                       is not None},
            "final": {k: final(runs, k) for k in keys if runs[next(iter(runs))][-1].get(k)
                      is not None},
        }
    return out


def _plot_curves(summary: dict[str, Any], key: str, ylabel: str, path: Path,
                 title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in summary.values():
        if key not in arm["curves"]:
            continue
        c = arm["curves"][key]
        mean, std = np.array(c["mean"]), np.array(c["std"])
        ax.plot(c["iteration"], mean, label=arm["label"])
        ax.fill_between(c["iteration"], mean - std, mean + std, alpha=0.15)
    ax.set(xlabel="local SGD iterations", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(summary: dict[str, Any], keys: Sequence[tuple[str, str]]) -> str:
    head = "| arm | " + " | ".join(label for _, label in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    for arm in summary.values():
        cells = []
        for key, _ in keys:
            f = arm["final"].get(key)
            cells.append(mean_std(f) if f else "–")
        lines.append(f"| {arm['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- sandwich
def sandwich(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
             total: int) -> Report:
    """H-SGD(I, G) against local SGD with periods I and G, mini-batch and centralised SGD."""
    i, g = base.local_period, base.global_period
    n, b = base.clients, base.batch_size or 0
    arms = [
        _arm("local-I", f"local SGD P=I={i}", base, total, local_period=i, global_period=i,
             groups=(1,), periods=()),
        _arm("hsgd", f"H-SGD I={i}, G={g}, N={base.num_edges}", base, total),
        _arm("local-G", f"local SGD P=G={g}", base, total, local_period=g, global_period=g,
             groups=(1,), periods=()),
        _arm("minibatch", f"mini-batch SGD (I=G=1, batch {n}x{b})", base, total,
             local_period=1, global_period=1, groups=(1,), periods=()),
        _arm("central", f"centralised SGD (1 client, batch {n * b})", base, total,
             clients=1, groups=(1,), partition="iid", local_period=1, global_period=1,
             periods=(), batch_size=n * b),
    ]
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy", "test_loss", "train_loss"))
    _plot_curves(summary, "test_accuracy", "test accuracy", out / "sandwich_accuracy.png",
                 "Sandwich: H-SGD between local SGD with periods I and G")
    _plot_curves(summary, "train_loss", "training loss f(w)", out / "sandwich_loss.png",
                 "Training loss (global objective)")
    acc = {name: summary[name]["final"]["test_accuracy"] for name in summary}
    loss = {name: summary[name]["final"]["train_loss"] for name in summary}
    tol = max(acc[a]["std"] for a in ("local-I", "hsgd", "local-G"))
    ltol = max(loss[a]["std"] for a in ("local-I", "hsgd", "local-G"))
    claims = {"H-SGD final test accuracy between local SGD P=G and P=I (±1 std)":
              acc["local-G"]["mean"] - tol <= acc["hsgd"]["mean"] <= acc["local-I"]["mean"] + tol,
              "H-SGD final training loss between local SGD P=I and P=G (±1 std)":
              loss["local-I"]["mean"] - ltol <= loss["hsgd"]["mean"]
              <= loss["local-G"]["mean"] + ltol}
    target = 0.95 * min(acc[a]["mean"] for a in ("local-I", "hsgd", "local-G"))
    comm = []
    for name in ("local-I", "hsgd", "local-G", "minibatch"):
        cfg = next(a.config for a in arms if a.name == name)
        reached = first_reaching(summary[name]["curves"]["test_accuracy"], target)
        cloud_rounds = None if reached is None else reached // cfg.global_period
        comm.append((summary[name]["label"], reached, cloud_rounds))
    summary_json = {"arms": summary, "communication_target_accuracy": target,
                    "communication": [{"arm": c[0], "iterations": c[1], "cloud_rounds": c[2]}
                                      for c in comm], "claims": claims}
    md = [_table(summary, [("test_accuracy", "final test accuracy"),
                           ("test_loss", "final test loss"), ("train_loss", "final train loss")]),
          "", f"Communication view: cloud rounds (and iterations) to reach mean test accuracy "
          f"{target:.4f} (95% of the worst of the three H-SGD-family arms):", "",
          "| arm | iterations | cloud rounds |", "|---|---|---|"]
    md += [f"| {c[0]} | {c[1] if c[1] is not None else 'not reached'} | "
           f"{c[2] if c[2] is not None else '–'} |" for c in comm]
    md += ["", "![accuracy](sandwich_accuracy.png)", "![loss](sandwich_loss.png)"]
    return Report(summary_json, "\n".join(md), claims)


# --------------------------------------------------------------------------- grouping
def grouping(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
             total: int) -> Report:
    """min-divergence, random, contiguous and max-divergence grouping at fixed (I, G)."""
    every = max(1, _rounds_for(total, base) // 5)
    names = ("min-divergence", "random", "contiguous", "max-divergence")
    arms = [_arm(name, name, base, total, grouping=name, diagnostics_every=every)
            for name in names]
    results = run_arms(arms, seeds, out, engine, jobs)
    keys = ("test_accuracy", "test_loss", "upward_divergence", "downward_divergence")
    summary = _summarise(arms, results, keys)
    first = {name: float(np.mean([runs[0]["upward_divergence"] for runs in
                                  results[name].values()])) for name in names}
    _plot_curves(summary, "test_accuracy", "test accuracy", out / "grouping_accuracy.png",
                 "Grouping: test accuracy")
    _plot_curves(summary, "upward_divergence", "upward divergence ε²",
                 out / "grouping_upward.png", "Upward divergence during training")
    _plot_curves(summary, "downward_divergence", "downward divergence Σ P_i ε_i²",
                 out / "grouping_downward.png", "Downward divergence during training")
    acc = {name: summary[name]["final"]["test_accuracy"]["mean"] for name in names}
    claims = {"min-divergence beats max-divergence in final accuracy":
              acc["min-divergence"] > acc["max-divergence"],
              "initial upward divergence: min < random < max":
              first["min-divergence"] < first["random"] < first["max-divergence"]}
    md = [_table(summary, [("test_accuracy", "final test accuracy"),
                           ("upward_divergence", "final upward div."),
                           ("downward_divergence", "final downward div.")]), "",
          "Upward divergence at the initial model: " + ", ".join(
              f"{k} {v:.4f}" for k, v in first.items()), "",
          "![accuracy](grouping_accuracy.png)", "![upward](grouping_upward.png)",
          "![downward](grouping_downward.png)"]
    return Report({"arms": summary, "initial_upward_divergence": first, "claims": claims},
                  "\n".join(md), claims)


# --------------------------------------------------------------------------- periods
def periods(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
            total: int, local_periods: Sequence[int] = (1, 2, 5, 10),
            global_periods: Sequence[int] = (10, 20, 40)) -> Report:
    """Final accuracy over a grid of (I, G) with G a multiple of I: the heatmap."""
    arms = [_arm(f"I{i}-G{g}", f"I={i}, G={g}", base, total, local_period=i, global_period=g,
                 periods=())
            for i in local_periods for g in global_periods if g % i == 0]
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy", "train_loss"))
    grid = np.full((len(local_periods), len(global_periods)), np.nan)
    for a, arm in enumerate(local_periods):
        for b_, g in enumerate(global_periods):
            if f"I{arm}-G{g}" in summary:
                grid[a, b_] = summary[f"I{arm}-G{g}"]["final"]["test_accuracy"]["mean"]
    fig, ax = plt.subplots(figsize=(5, 4))
    image = ax.imshow(grid, cmap="viridis", origin="lower")
    ax.set(xticks=range(len(global_periods)), xticklabels=global_periods,
           yticks=range(len(local_periods)), yticklabels=local_periods,
           xlabel="cloud period G", ylabel="edge period I",
           title=f"Final test accuracy after {total} iterations")
    for a in range(grid.shape[0]):
        for b_ in range(grid.shape[1]):
            if not np.isnan(grid[a, b_]):
                ax.text(b_, a, f"{grid[a, b_]:.3f}", ha="center", va="center", fontsize=8,
                        color="white")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "periods_heatmap.png", dpi=110)
    plt.close(fig)
    md = [_table(summary, [("test_accuracy", "final test accuracy"),
                           ("train_loss", "final train loss")]), "",
          "![heatmap](periods_heatmap.png)"]
    return Report({"arms": summary, "grid": {"local_periods": list(local_periods),
                                             "global_periods": list(global_periods),
                                             "final_test_accuracy": grid.tolist()},
                   "claims": {}}, "\n".join(md), {})


# --------------------------------------------------------------------------- levels
def levels(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
           total: int) -> Report:
    """Two- versus three-level hierarchies at equal cloud period G."""
    i, g, n_edges = base.local_period, base.global_period, base.num_edges
    regions = max(1, n_edges // 2)
    middle = g // 2 if (g // 2) % i == 0 and g // 2 > i else i
    arms = [
        _arm("two-level", f"2 levels: I={i}, G={g}, {n_edges} edges", base, total),
        _arm("three-level", f"3 levels: {i},{middle},{g}; {n_edges} edges / {regions} regions",
             base, total, groups=(n_edges, regions), periods=(i, middle, g)),
        _arm("local-G", f"local SGD P=G={g}", base, total, local_period=g, global_period=g,
             groups=(1,), periods=()),
    ]
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy", "train_loss", "edge_cloud_messages",
                                         "client_edge_messages"))
    _plot_curves(summary, "test_accuracy", "test accuracy", out / "levels_accuracy.png",
                 "Two vs three levels at equal cloud period")
    md = [_table(summary, [("test_accuracy", "final test accuracy"),
                           ("train_loss", "final train loss"),
                           ("edge_cloud_messages", "messages above edges")]), "",
          "![levels](levels_accuracy.png)"]
    return Report({"arms": summary, "claims": {}}, "\n".join(md), {})


# --------------------------------------------------------------------------- time
#: Bandwidths of the cloud link (Mbit/s) the ``time`` suite sweeps, fast to slow.
CLOUD_MBPS = (1000.0, 100.0, 10.0, 1.0)


def seconds_to_reach(records: Sequence[dict[str, Any]], target: float) -> float:
    """Simulated seconds of the first round whose test accuracy reaches ``target`` (inf if
    none does)."""
    return next((float(r["sim_seconds"]) for r in records if r["test_accuracy"] >= target),
                float("inf"))


def seconds_over_seeds(runs: dict[int, list[dict[str, Any]]],
                       target: float) -> dict[str, float]:
    """Mean and std over seeds of :func:`seconds_to_reach` (inf when a seed never does)."""
    times = np.array([seconds_to_reach(run, target) for run in runs.values()])
    return {"mean": float(times.mean()),
            "std": float(times.std()) if np.isfinite(times).all() else float("inf")}


def time_to_accuracy(base: RunConfig, seeds: Sequence[int], out: Path, engine: str,
                     jobs: int, total: int,
                     cloud_mbps: Sequence[float] = CLOUD_MBPS) -> Report:
    """H-SGD(I, G) against flat FedAvg (period I) and flat local SGD (period G) in simulated
    time, as the cloud link slows down (``edge_cloud_mbps``).

    A flat arm puts every client under its own edge, so each of its aggregations sends all n
    client models over the cloud link (the edge hop carries one model: a relay); H-SGD sends
    the N edge models, every G steps, and pays for its clients on the shared client-edge
    links. Training is the same at every bandwidth; only the clock differs.
    """
    i, g, n = base.local_period, base.global_period, base.clients
    algorithms = {
        "flat-I": (f"flat FedAvg P=I={i}", {"groups": (n,), "local_period": i,
                                             "global_period": i, "periods": ()}),
        "hsgd": (f"H-SGD I={i}, G={g}, N={base.num_edges}", {}),
        "flat-G": (f"flat local SGD P=G={g}", {"groups": (n,), "local_period": g,
                                               "global_period": g, "periods": ()}),
    }
    arms = [_arm(f"{name}-{mbps:g}mbps", f"{label}, cloud {mbps:g} Mbit/s", base, total,
                 edge_cloud_mbps=mbps, **changes)
            for mbps in cloud_mbps for name, (label, changes) in algorithms.items()]
    results = run_arms(arms, seeds, out, engine, jobs)
    summary = _summarise(arms, results, ("test_accuracy", "sim_seconds", "edge_cloud_bytes"))
    worst = min(summary[f"{name}-{cloud_mbps[0]:g}mbps"]["final"]["test_accuracy"]["mean"]
                for name in algorithms)
    target = round(0.95 * worst, 4)
    reach: dict[str, dict[float, dict[str, float]]] = {name: {} for name in algorithms}
    for mbps in cloud_mbps:
        for name in algorithms:
            reach[name][mbps] = seconds_over_seeds(results[f"{name}-{mbps:g}mbps"], target)
    _plot_time(summary, reach, algorithms, cloud_mbps, target, out)
    fastest = {mbps: min(algorithms, key=lambda a: reach[a][mbps]["mean"])
               for mbps in cloud_mbps}
    claims = {f"H-SGD reaches {target:.4f} first at the slowest cloud link "
              f"({cloud_mbps[-1]:g} Mbit/s)": fastest[cloud_mbps[-1]] == "hsgd",
              "flat FedAvg's time to accuracy grows more than H-SGD's as the cloud link slows":
              reach["flat-I"][cloud_mbps[-1]]["mean"] - reach["flat-I"][cloud_mbps[0]]["mean"]
              > reach["hsgd"][cloud_mbps[-1]]["mean"] - reach["hsgd"][cloud_mbps[0]]["mean"]}

    def cell(value: dict[str, float]) -> str:
        if not np.isfinite(value["mean"]):
            return "not reached"
        return f"{value['mean']:.1f} ± {value['std']:.1f}"

    md = [f"Simulated seconds to reach test accuracy {target:.4f} (95% of the worst final "
          "mean accuracy of the three algorithms), mean ± std over seeds; fastest in bold:", "",
          "| cloud link (Mbit/s) | " + " | ".join(label for label, _ in algorithms.values())
          + " |", "|---|" + "---|" * len(algorithms)]
    for mbps in cloud_mbps:
        cells = [f"**{cell(reach[a][mbps])}**" if a == fastest[mbps] else cell(reach[a][mbps])
                 for a in algorithms]
        md.append(f"| {mbps:g} | " + " | ".join(cells) + " |")
    md += ["", "| algorithm | final test accuracy | MB sent above the edges |", "|---|---|---|"]
    for name, (label, _) in algorithms.items():
        f = summary[f"{name}-{cloud_mbps[0]:g}mbps"]["final"]
        md.append(f"| {label} | {mean_std(f['test_accuracy'])} | "
                  f"{f['edge_cloud_bytes']['mean'] / 1e6:.1f} |")
    md += ["", "![time to accuracy](time_to_accuracy.png)",
           "![accuracy vs time](time_curves.png)"]
    return Report({"arms": summary, "target_accuracy": target,
                   "seconds_to_target": {a: {f"{m:g}": v for m, v in r.items()}
                                         for a, r in reach.items()},
                   "claims": claims}, "\n".join(md), claims)


def _accuracy_over_time(ax: Any, curves: dict[str, dict[str, Any]], target: float) -> None:
    """Mean test accuracy against mean simulated seconds, one line per label, and the
    target accuracy as a dotted line."""
    for label, c in curves.items():
        ax.plot(c["sim_seconds"]["mean"], c["test_accuracy"]["mean"], label=label)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="simulated seconds", ylabel="test accuracy")
    ax.grid(alpha=0.3)


def _plot_time(summary: dict[str, Any], reach: dict[str, dict[float, dict[str, float]]],
               algorithms: dict[str, tuple[str, dict[str, Any]]], cloud_mbps: Sequence[float],
               target: float, out: Path) -> None:
    """time_to_accuracy.png (seconds to target against cloud bandwidth) and time_curves.png
    (mean accuracy against mean simulated seconds at the slowest and fastest links)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, (label, _) in algorithms.items():
        ax.plot(cloud_mbps, [reach[name][m]["mean"] for m in cloud_mbps], marker="o",
                label=label)
    ax.set(xscale="log", yscale="log", xlabel="cloud link bandwidth (Mbit/s)",
           ylabel=f"simulated seconds to test accuracy {target:.3f}",
           title="Time to accuracy as the cloud link slows")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "time_to_accuracy.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mbps in zip(axes, (cloud_mbps[0], cloud_mbps[-1]), strict=True):
        _accuracy_over_time(ax, {label: summary[f"{name}-{mbps:g}mbps"]["curves"]
                                 for name, (label, _) in algorithms.items()}, target)
        ax.set(xscale="log", title=f"Cloud link {mbps:g} Mbit/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "time_curves.png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- mobility
#: Per-cloud-round move probabilities the ``mobility`` suite sweeps.
MOVE_RATES = (0.0, 0.05, 0.2, 0.5)


def mobility(base: RunConfig, seeds: Sequence[int], out: Path, engine: str, jobs: int,
             total: int, rates: Sequence[float] = MOVE_RATES) -> Report:
    """Clients moving between edges (random vs min-divergence grouping, both regrouping),
    and asynchronous vs synchronous edges when one edge computes 4x slower."""
    rounds = _rounds_for(total, base)
    every = max(1, rounds // 5)
    groupings = ("random", "min-divergence")
    moving = [_arm(f"{g}-rate{rate:g}", f"{g}, move rate {rate:g}", base, total, grouping=g,
                   mobility_rate=rate, regroup_every=every, diagnostics_every=every)
              for g in groupings for rate in rates]
    n_edges = base.num_edges
    timing = {"sync": ("synchronous edges, edge 0 4x slower", 0),
              "async": (f"async K={n_edges - 1}, edge 0 4x slower", n_edges - 1)}
    # An async cloud round aggregates K of the N edges' reports, so the async arm gets twice
    # the cloud rounds: the comparison is in simulated seconds, not rounds.
    # The async arm names the shifted mean, the rule of its published numbers (results.md,
    # mobility-fmnist-a0.5), written before FedBuff became the default (docs/hsgd.md).
    timed = [_arm(name, label, base, total * (2 if k else 1), edge_slowdown="0:4",
                  async_buffer=k, async_rule="shifted-mean")
             for name, (label, k) in timing.items()]
    results = run_arms([*moving, *timed], seeds, out, engine, jobs)
    summary = _summarise([*moving, *timed], results,
                         ("test_accuracy", "upward_divergence", "sim_seconds"))
    final_of = {(g, rate): summary[f"{g}-rate{rate:g}"]["final"]
                for g in groupings for rate in rates}
    fig, (ax_acc, ax_up) = plt.subplots(1, 2, figsize=(11, 4))
    for g in groupings:
        for ax, key in ((ax_acc, "test_accuracy"), (ax_up, "upward_divergence")):
            mean = np.array([final_of[g, r][key]["mean"] for r in rates])
            std = np.array([final_of[g, r][key]["std"] for r in rates])
            ax.errorbar(rates, mean, yerr=std, marker="o", capsize=3, label=g)
    ax_acc.set(xlabel="move rate per cloud round", ylabel="final test accuracy",
               title="Accuracy as clients move")
    ax_up.set(xlabel="move rate per cloud round", ylabel="final upward divergence ε²",
              title="Upward divergence as clients move")
    for ax in (ax_acc, ax_up):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "mobility_rates.png", dpi=110)
    plt.close(fig)
    worst = min(summary[name]["final"]["test_accuracy"]["mean"] for name in timing)
    target = round(0.95 * worst, 4)
    reach = {}
    for name in timing:
        reach[name] = seconds_over_seeds(results[name], target)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    _accuracy_over_time(ax, {label: summary[name]["curves"]
                             for name, (label, _) in timing.items()}, target)
    ax.set(title="Synchronous vs asynchronous edges, one edge 4x slower")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "mobility_async.png", dpi=110)
    plt.close(fig)
    up = {key: final_of[key]["upward_divergence"]["mean"] for key in final_of}
    claims = {"min-divergence grouping keeps a lower final upward divergence than random at "
              "every move rate": all(up["min-divergence", r] < up["random", r] for r in rates),
              f"async edges reach {target:.4f} sooner than synchronous ones with one edge 4x "
              "slower": reach["async"]["mean"] < reach["sync"]["mean"]}
    md = ["Clients moving (Markov moves, fresh handoff; regrouping every "
          f"{every} cloud rounds), final numbers, mean ± std over seeds:", "",
          "| move rate | " + " | ".join(f"{g} accuracy | {g} upward div." for g in groupings)
          + " |", "|---|" + "---|" * (2 * len(groupings))]
    for rate in rates:
        cells = [mean_std(final_of[g, rate][k])
                 for g in groupings for k in ("test_accuracy", "upward_divergence")]
        md.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    md += ["", "![rates](mobility_rates.png)", "",
           f"Simulated seconds to test accuracy {target:.4f} (95% of the worse final mean "
           "accuracy of the two), with edge 0's clients computing 4x slower:", "",
           "| edges | seconds to target | final test accuracy | final sim_seconds |",
           "|---|---|---|---|"]
    for name, (label, _) in timing.items():
        f = summary[name]["final"]
        md.append(f"| {label} | {mean_std(reach[name], 1)} | {mean_std(f['test_accuracy'])} | "
                  f"{f['sim_seconds']['mean']:.1f} |")
    md += ["", "![async](mobility_async.png)"]
    return Report({"arms": summary, "target_accuracy": target, "seconds_to_target": reach,
                   "claims": claims}, "\n".join(md), claims)


SUITES: dict[str, Callable[..., Report]] = {
    "sandwich": sandwich, "grouping": grouping, "periods": periods, "levels": levels,
    "time": time_to_accuracy, "mobility": mobility,
}
