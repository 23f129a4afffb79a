"""results.json, results.md and figures of a finished sweep (:mod:`fedhier.studies.sweep.stats`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhier.runs.folder import atomic_write_bytes, write_json
from fedhier.studies.sweep.spec import SweepSpec, arm_name
from fedhier.studies.sweep.stats import (
    LEVEL,
    band,
    choose,
    metric_names,
    paired,
    run_numbers,
    t_interval,
)
from fedhier.studies.sweep.trials import Trial

LABELS = {"final_test_accuracy": "final test accuracy",
          "to_target_iterations": "iterations to target",
          "to_target_rounds": "cloud rounds to target", "to_target_bytes": "bytes to target",
          "to_target_sim_seconds": "simulated s to target"}


def label(metric: str) -> str:
    if metric.startswith("accuracy_at_"):
        return f"test accuracy at iteration {metric.removeprefix('accuracy_at_')}"
    return LABELS.get(metric, metric)


def summarize(spec: SweepSpec, trials: Sequence[Trial],
              records: Mapping[str, list[dict[str, Any]]],
              folder: Path | None = None) -> dict[str, Any]:
    """Per arm: the chosen tuned value (by validation accuracy), each seed's numbers and the
    t-interval of every metric; paired differences against the baseline along ``compare``."""
    metrics = metric_names(spec.target_accuracy, spec.at_iterations)
    arms: dict[str, Any] = {}
    for arm in spec.arms:
        mine = [t for t in trials if t.arm == arm.name and t.name in records]
        by_value: dict[str, list[Trial]] = {}
        for t in mine:
            by_value.setdefault(arm_name(t.tuned) if t.tuned else "", []).append(t)
        tuning = None
        chosen = ""
        if spec.tuned:
            validation = {v: [run_numbers(records[t.name], None, ())["validation_accuracy"]
                              for t in ts] for v, ts in by_value.items()}
            chosen = choose(validation)
            tuning = {v: t_interval(vals) for v, vals in validation.items()}
        picked = sorted(by_value.get(chosen, []), key=lambda t: t.seed)
        per_seed = {t.seed: run_numbers(records[t.name], spec.target_accuracy,
                                        spec.at_iterations) for t in picked}
        stats = {m: t_interval([n[m] for n in per_seed.values()]) for m in metrics}
        if spec.target_accuracy is not None:
            stats["reached_target"] = sum(n["reached_target"] for n in per_seed.values())
        arms[arm.name] = {
            "values": arm.values, "chosen": dict(picked[0].tuned) if picked and spec.tuned
            else None, "tuning_validation_accuracy": tuning,
            "runs": {t.seed: str(t.run_dir.relative_to(folder) if folder else t.run_dir)
                     for t in picked},
            "per_seed": per_seed, "stats": stats,
            "band": band([records[t.name] for t in picked]) if picked else None}
    return {"level": LEVEL, "seeds": list(spec.seeds), "axes": list(spec.axes),
            "tuned": list(spec.tuned), "target_accuracy": spec.target_accuracy,
            "compare": spec.compare, "baseline": spec.baseline, "arms": arms,
            "paired": paired_differences(spec, arms, metrics)}


def paired_differences(spec: SweepSpec, arms: Mapping[str, Any],
                       metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Each arm minus its twin: the arm with ``compare`` = ``baseline`` and the same values
    on every other axis (for a zipped ``compare``: on every axis outside the zip)."""
    if spec.compare is None:
        return []
    group = set(spec.zipped) if spec.compare in spec.zipped else {spec.compare}
    out = []
    for arm in spec.arms:
        if arm.values[spec.compare] == spec.baseline:
            continue
        rest = {k: v for k, v in arm.values.items() if k not in group}
        base = next((a for a in spec.arms if a.values[spec.compare] == spec.baseline
                     and {k: v for k, v in a.values.items() if k not in group} == rest), None)
        if base is None:
            continue
        for m in metrics:
            a = {s: n[m] for s, n in arms[arm.name]["per_seed"].items()}
            b = {s: n[m] for s, n in arms[base.name]["per_seed"].items()}
            out.append({"arm": arm.name, "baseline": base.name, "metric": m, **paired(a, b)})
    return out


def _fmt(value: Any, metric: str) -> str:
    if value is None:
        return "–"
    if "bytes" in metric:
        return f"{value / 1e6:.3g} MB"
    if "accuracy" in metric:
        return f"{value:.4f}"
    return f"{value:.4g}"


def _cell(ci: Mapping[str, Any], metric: str, reached: int | None = None,
          total: int = 0) -> str:
    if ci["mean"] is None:
        text = "never reached" if metric.startswith("to_target") else "–"
    elif ci["low"] is None:
        text = f"{_fmt(ci['mean'], metric)} (n=1)"
    else:
        text = (f"{_fmt(ci['mean'], metric)} ± {_fmt(ci['std'], metric)} "
                f"[{_fmt(ci['low'], metric)}, {_fmt(ci['high'], metric)}]")
    if reached is not None and reached < total:
        text += f"; reached by {reached}/{total} seeds (never: {total - reached})"
    return text


def markdown(spec: SweepSpec, results: Mapping[str, Any], figures: Sequence[str]) -> str:
    """The tables of results.md: per arm mean ± std [95% t-interval], then paired ones."""
    metrics = metric_names(spec.target_accuracy, spec.at_iterations)
    n = len(spec.seeds)
    lines = [f"# Sweep results ({len(spec.arms)} arms x {n} seeds)", "",
             f"Each cell: mean ± sample std [{LEVEL:.0%} Student-t interval] over seeds "
             f"{', '.join(map(str, spec.seeds))}."]
    if spec.target_accuracy is not None:
        lines.append(f"Target test accuracy {spec.target_accuracy}: a run that never reaches "
                     "it is counted as such (\"reached by k/n\"); the interval is over the "
                     "runs that reached it.")
    if spec.tuned:
        lines.append(f"Tuned: {', '.join(spec.tuned)}, chosen per arm by the mean validation "
                     "accuracy (clients' held-out rows, client_holdout); the test numbers are "
                     "those of the chosen value alone.")
    lines += ["", "| arm |" + (" chosen |" if spec.tuned else "")
              + "".join(f" {label(m)} |" for m in metrics),
              "|---|" + ("---|" if spec.tuned else "") + "---|" * len(metrics)]
    for name, arm in results["arms"].items():
        cells = []
        for m in metrics:
            reached = arm["stats"].get("reached_target") if m.startswith("to_target") else None
            cells.append(_cell(arm["stats"][m], m, reached, len(arm["per_seed"])))
        chosen = (f" {arm_name(arm['chosen']) if arm['chosen'] else '–'} |"
                  if spec.tuned else "")
        lines.append(f"| {name} |{chosen}" + "".join(f" {c} |" for c in cells))
    if results["paired"]:
        lines += ["", f"Paired differences along `{spec.compare}` against "
                  f"`{spec.baseline}`, seed by seed (same seeds, same partitions):", "",
                  "\"seeds\": how many seeds both arms have the number for (to a target: the "
                  "seeds where both reached it).", "",
                  "| arm - baseline arm | metric | mean difference [95% t-interval] | seeds |",
                  "|---|---|---|---|"]
        for p in results["paired"]:
            lines.append(f"| {p['arm']} - {p['baseline']} | {label(p['metric'])} | "
                         f"{_cell(p, p['metric'])} | {len(p['seeds'])} |")
    lines += ["", *(f"![{f}]({f})" for f in figures), ""]
    return "\n".join(lines)


def plot_curves(spec: SweepSpec, results: Mapping[str, Any], path: Path) -> None:
    """Test accuracy against iterations per arm with its 95% t-band over seeds; one panel per
    setting of the axes other than ``compare`` (its values are the curves of a panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = (set(spec.zipped) if spec.compare in spec.zipped else {spec.compare}) \
        if spec.compare else set(spec.axes)
    panels: dict[str, list[str]] = {}
    for arm in spec.arms:
        key = arm_name({k: v for k, v in arm.values.items() if k not in group})
        panels.setdefault(key, []).append(arm.name)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 1, 4),
                             squeeze=False, sharey=True)
    for ax, (title, names) in zip(axes[0], panels.items(), strict=True):
        for name in names:
            b = results["arms"][name]["band"]
            if not b:
                continue
            values = next(a.values for a in spec.arms if a.name == name)
            legend = arm_name({k: v for k, v in values.items() if k in group}) or name
            ax.plot(b["iteration"], b["mean"], label=legend)
            ax.fill_between(b["iteration"], b["low"], b["high"], alpha=0.15)
        ax.set(xlabel="local SGD iterations", title=title if title != "base" else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"test accuracy (mean, {LEVEL:.0%} t-band)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def numeric_axes(spec: SweepSpec) -> list[str]:
    return [a for a in spec.axes if all(isinstance(arm.values[a], int | float)
                                        and not isinstance(arm.values[a], bool)
                                        for arm in spec.arms)]


def heatmap_grids(spec: SweepSpec, results: Mapping[str, Any]) -> dict[str, Any] | None:
    """Mean final test accuracy on the first two numeric axes (x, y), one grid [y, x] per
    setting of the other axes: {"x": (axis, values), "y": (axis, values), "grids": {...}};
    None with fewer than two numeric axes."""
    import numpy as np

    numeric = numeric_axes(spec)
    if len(numeric) < 2:
        return None
    x_axis, y_axis = numeric[:2]
    rest = [a for a in spec.axes if a not in (x_axis, y_axis)]
    xs = sorted({arm.values[x_axis] for arm in spec.arms})
    ys = sorted({arm.values[y_axis] for arm in spec.arms})
    grids: dict[str, Any] = {}
    for arm in spec.arms:
        key = arm_name({a: arm.values[a] for a in rest})
        grid = grids.setdefault(key, np.full((len(ys), len(xs)), np.nan))
        mean = results["arms"][arm.name]["stats"]["final_test_accuracy"]["mean"]
        grid[ys.index(arm.values[y_axis]), xs.index(arm.values[x_axis])] = \
            np.nan if mean is None else mean
    return {"x": (x_axis, xs), "y": (y_axis, ys), "grids": grids}


def plot_heatmap(spec: SweepSpec, results: Mapping[str, Any], path: Path) -> bool:
    """:func:`heatmap_grids` drawn, one panel per grid; False (nothing drawn) without two
    numeric axes."""
    heat = heatmap_grids(spec, results)
    if heat is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    (x_axis, xs), (y_axis, ys), panels = heat["x"], heat["y"], heat["grids"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (key, grid) in zip(axes[0], panels.items(), strict=True):
        image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(xs)), [f"{v:g}" for v in xs])
        ax.set_yticks(range(len(ys)), [f"{v:g}" for v in ys])
        ax.set(xlabel=x_axis, ylabel=y_axis,
               title=key if key != "base" else "final test accuracy")
        for (r, c), value in np.ndenumerate(grid):
            ax.text(c, r, f"{value:.3f}", ha="center", va="center", fontsize=7, color="w")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(spec: SweepSpec, trials: Sequence[Trial],
                 records: Mapping[str, list[dict[str, Any]]], folder: Path) -> dict[str, Any]:
    """Write results.json, results.md, curves.png (and heatmap.png); returns the results."""
    results = summarize(spec, trials, records, folder)
    figures = ["curves.png"]
    plot_curves(spec, results, folder / "curves.png")
    if plot_heatmap(spec, results, folder / "heatmap.png"):
        figures.append("heatmap.png")
    write_json(folder / "results.json", results)
    atomic_write_bytes(folder / "results.md", markdown(spec, results, figures).encode())
    return results
