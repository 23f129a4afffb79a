"""Figures drawn from run folders (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedhier.common.errors import ConfigError, FedhierError  # noqa: E402
from fedhier.runs.folder import read_json, read_metrics, writing  # noqa: E402

#: keys every metrics.jsonl record needs for a curve
CURVE_KEYS = ("iteration", "test_accuracy", "test_loss")
#: keys drawn when a run records them (simulated time, traffic above the edges)
COST_KEYS = ("sim_seconds", "edge_cloud_bytes")


def check_image_path(path: str | Path, flag: str) -> None:
    """A one-line ConfigError unless matplotlib can write ``path``'s format (no suffix:
    PNG)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if suffix and suffix not in formats:
        raise ConfigError(f"{flag} {path}: cannot draw a '.{suffix}' image; use .png, .pdf, "
                          f".svg or another of {', '.join(sorted(formats))}")


def _curve(run_dir: Path) -> dict[str, list[float]]:
    """A run folder's curves: key -> one value per recorded round (``CURVE_KEYS`` always;
    ``sim_seconds`` and ``edge_cloud_bytes`` when every round has them); one-line
    ConfigError if its metrics.jsonl lacks the CURVE_KEYS."""
    records = read_metrics(run_dir)
    if not records:
        raise ConfigError(f"{run_dir / 'metrics.jsonl'} has no rounds to plot")
    for record in records:
        missing = [k for k in CURVE_KEYS if not isinstance(record.get(k), int | float)]
        if missing:
            raise ConfigError(f"{run_dir / 'metrics.jsonl'}: round {record['round']} has no "
                              f"numeric {', '.join(missing)}")
    return {key: [r[key] for r in records] for key in (*CURVE_KEYS, *COST_KEYS)
            if all(isinstance(r.get(key), int | float) for r in records)}


def _label(run_dir: Path) -> str:
    try:
        cfg = read_json(run_dir, "config.json")
        return (f"{run_dir.name}: I={cfg['local_period']} G={cfg['global_period']} "
                f"N={cfg['groups']} {cfg['grouping']}")
    except (FedhierError, KeyError, TypeError):  # a damaged config.json: the folder's name
        return run_dir.name


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Test accuracy and loss against local iterations, and test accuracy against simulated
    seconds and against the bytes sent above the edges (runs that record them), one line
    per run."""
    curves = {Path(run_dir): _curve(Path(run_dir)) for run_dir in run_dirs}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax_acc, ax_loss), (ax_time, ax_bytes) = axes
    for run_dir, curve in curves.items():
        label = _label(run_dir)
        ax_acc.plot(curve["iteration"], curve["test_accuracy"], marker=".", label=label)
        ax_loss.plot(curve["iteration"], curve["test_loss"], marker=".", label=label)
        if "sim_seconds" in curve:
            ax_time.plot(curve["sim_seconds"], curve["test_accuracy"], marker=".", label=label)
        if "edge_cloud_bytes" in curve:
            ax_bytes.plot([b / 1e6 for b in curve["edge_cloud_bytes"]], curve["test_accuracy"],
                          marker=".", label=label)
    ax_acc.set(xlabel="local SGD iterations", ylabel="test accuracy", title="Test accuracy")
    ax_loss.set(xlabel="local SGD iterations", ylabel="test loss (cross-entropy)",
                title="Test loss")
    ax_time.set(xlabel="simulated seconds (sim_seconds)", ylabel="test accuracy",
                title="Accuracy against simulated time")
    ax_bytes.set(xlabel="MB sent above the edges (edge_cloud_bytes / 1e6)",
                 ylabel="test accuracy", title="Accuracy against cloud-link traffic")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    try:
        with writing(out):
            fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


#: Rows (edges, clients) a figure grows for; past this the figure keeps its size (a 100,000-client
#: run has 10,000 edges: one inch-row each would be a picture of gigabytes).
MAX_LABELLED_ROWS = 60


def plot_groups(groups_json: str | Path, out: str | Path) -> Path:
    """Heatmap of each edge's label composition (share of its rows per label)."""
    import json

    import numpy as np

    groups = json.loads(Path(groups_json).read_text())
    counts = np.array([e["label_histogram"] for e in groups["edges"]], dtype=np.float64)
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    proxy = groups.get("label_upward_divergence")
    proxy = float("nan") if proxy is None else proxy  # None: no client reported labels
    labelled = len(counts) <= MAX_LABELLED_ROWS  # else one row per edge, unlabelled
    height = 1.2 + 0.35 * min(len(counts), MAX_LABELLED_ROWS)
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * counts.shape[1], height))
    image = ax.imshow(shares, cmap="viridis", aspect="auto", vmin=0,
                      vmax=max(shares.max(), 1e-9))
    ax.set(xlabel="label", ylabel="edge (rows)" if labelled else f"edge 0..{len(counts) - 1}",
           xticks=range(counts.shape[1]),
           title=f"{groups['grouping']} grouping: label share per edge\n"
                 f"label upward divergence {proxy:.4f}")
    if labelled:
        ax.set(yticks=range(len(counts)),
               yticklabels=[f"{i} ({int(c.sum())})" for i, c in enumerate(counts)])
    fig.colorbar(image, ax=ax, label="share of the edge's rows")
    fig.tight_layout()
    out = Path(out)
    try:
        with writing(out):
            fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def plot_groups_history(history_json: str | Path, out: str | Path) -> Path:
    """Each client's edge after every cloud round (groups_history.json): clients as rows,
    cloud rounds as columns, one colour per edge."""
    import json

    import numpy as np

    history = json.loads(Path(history_json).read_text())
    maps = np.array(history["client_to_edge"], dtype=np.int64).T  # [n, rounds]
    edges = int(maps.max()) + 1 if maps.size else 1
    fig, ax = plt.subplots(figsize=(2.5 + 0.25 * min(maps.shape[1], 4 * MAX_LABELLED_ROWS),
                                    1.5 + 0.12 * min(maps.shape[0], 4 * MAX_LABELLED_ROWS)))
    image = ax.imshow(maps, cmap=plt.get_cmap("tab20", edges), aspect="auto",
                      interpolation="nearest", vmin=-0.5, vmax=edges - 0.5)
    ax.set(xlabel="cloud round", ylabel="client", title="client -> edge over cloud rounds")
    step = max(1, maps.shape[1] // 20)  # at most about 20 labelled rounds
    ax.set_xticks(range(0, maps.shape[1], step),
                  [str(r) for r in history["rounds"][::step]])
    fig.colorbar(image, ax=ax, label="edge",
                 ticks=range(0, edges, max(1, edges // MAX_LABELLED_ROWS)))
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
