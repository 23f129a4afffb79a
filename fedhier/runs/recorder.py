"""RunRecorder: writes a run folder as a run proceeds; every engine reports through it.

Files: config.json (fully resolved), partition.json, groups.json, metrics.jsonl (one record
per cloud round, round 0 = the initial model), summary.json, model_initial.safetensors,
model_final.safetensors, curves.png; when clients move or are regrouped,
groups_history.json and groups_history.png (the client -> edge map over cloud rounds).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedhier.data.federation import Federation, resolved
from fedhier.diagnostics.measures import label_upward_divergence
from fedhier.local.train import resolve_device
from fedhier.runs.crash_points import crash_point
from fedhier.runs.folder import JsonStream, RunFolder, read_metrics
from fedhier.runs.progress import round_progress
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy

if TYPE_CHECKING:
    from fedhier.runs.checkpoint import Checkpoint

WEIGHTING_TEXT = {
    "samples": "clients weighted by their number of training rows (FedAvg practice)",
    "uniform": "clients weighted equally, f = (1/n) sum_j F_j (the papers' objective)",
}


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def describe(cfg: RunConfig, fed: Federation, engine: str) -> dict[str, Any]:
    """The fully resolved configuration written to config.json (an auto min_partition_size
    is recorded as the value the partition used)."""
    cfg = resolved(cfg, train_rows=len(fed.bundle.train))
    partition_note = cfg.partition
    if cfg.partition == "dirichlet":
        partition_note = (
            f"Dirichlet(alpha={cfg.alpha}) label partition via flwr-datasets "
            f"DirichletPartitioner, min_partition_size={cfg.min_partition_size}, "
            f"self_balancing={cfg.self_balancing}")
    return {
        **cfg.to_dict(),
        "engine": engine,
        "device_used": str(resolve_device(cfg.device)),  # what 'auto' picked, cuda's index
        "iterations": cfg.iterations,
        "weighting_meaning": WEIGHTING_TEXT[cfg.weighting],
        "dataset_source": fed.bundle.source,
        "input_shape": list(fed.bundle.input_shape),
        "num_classes": fed.bundle.num_classes,
        "train_rows": len(fed.bundle.train),
        "test_rows": len(fed.bundle.test),
        "partition_note": partition_note,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "flwr": _version("flwr"), "flwr_datasets": _version("flwr-datasets"),
                     "fedhier": _version("fedhier")},
    }


class RunRecorder:
    """Writes the run folder of one run and shows progress over cloud rounds."""

    def __init__(self, folder: RunFolder, cfg: RunConfig, fed: Federation, engine: str,
                 progress: bool = True, resume_round: int | None = None,
                 elapsed: float = 0.0) -> None:
        """A new run, or (``resume_round``) one continuing after that cloud round: then the
        existing files stay, metrics.jsonl is cut back to rounds <= resume_round, and
        wall_seconds continue from ``elapsed``."""
        self.folder = folder
        self.cfg = cfg
        self.engine = engine
        self.t_start = time.time() - elapsed
        self.last: dict[str, Any] = {}
        # a bar on a terminal, plain lines in a log (fedhier.runs.progress)
        self.bar = round_progress(cfg.rounds, resume_round or 0, enabled=progress)
        from fedhier.runs.trackers import current

        self.callbacks = current()  # trackers attached by the command line (--tracker)
        kept = ([r for r in read_metrics(folder.path) if r["round"] <= resume_round]
                if resume_round is not None else [])
        # a continued folder: the trackers replace what was logged after the last kept round
        purge_from = int(kept[-1]["iteration"]) + 1 if kept else \
            (0 if resume_round is not None or folder.resumed else None)
        for callback in self.callbacks:
            callback.on_start(folder.path, {**cfg.to_dict(), "engine": engine},
                              resumed=resume_round is not None, purge_from=purge_from)
        if resume_round is not None:
            folder.rewrite_metrics(kept)
            self.last = kept[-1] if kept else {}
            return
        if folder.resumed:  # a resumed folder without a checkpoint starts again at round 0
            folder.rewrite_metrics([])
        folder.write_json("config.json", describe(cfg, fed, engine))
        _, y_train = fed.bundle.train_arrays()
        folder.write_json("partition.json", {
            "scheme": cfg.partition,
            "clients": JsonStream(len(fed.partitions), lambda j: {
                "client": j, "rows": fed.partitions[j].tolist(),
                "num_examples": len(fed.partitions[j]),
                "label_counts": np.bincount(y_train[fed.partitions[j]],
                                            minlength=fed.bundle.num_classes).tolist()}),
            "holdout": [rows.tolist() for rows in fed.holdouts]})
        if fed.bundle.label_names:  # string labels: which class number stands for which
            folder.write_json("labels.json", {
                "classes": list(fed.bundle.label_names),
                "meaning": "class i (metrics, label_counts, predictions) is classes[i]; "
                           "labels sorted as strings"})

    @classmethod
    def for_run(cls, folder: RunFolder, cfg: RunConfig, fed: Federation, engine: str,
                progress: bool, resume: Checkpoint | None) -> RunRecorder:
        """A new run's recorder, or (``resume``) one continuing after the checkpoint's cloud
        round with its wall seconds."""
        return cls(folder, cfg, fed, engine, progress,
                   resume_round=resume.round if resume else None,
                   elapsed=resume.wall_seconds if resume else 0.0)

    def save_initial(self, state: Mapping[str, torch.Tensor]) -> None:
        self.folder.save_model("model_initial.safetensors", state)

    def write_groups(self, hierarchy: Hierarchy, info: ClientInfo, grouping: str,
                     seed: int) -> None:
        """groups.json: client -> edge, each edge's members, rows and label histogram."""
        edge_of = hierarchy.edge_of_client()
        edges = []
        # each edge's members (ascending) from one stable sort: O(n log n), not O(n x edges)
        order = np.argsort(edge_of, kind="stable")
        bounds = np.searchsorted(edge_of[order], np.arange(hierarchy.num_nodes(1) + 1))
        for edge in range(hierarchy.num_nodes(1)):
            members = order[bounds[edge]:bounds[edge + 1]]
            edges.append({"edge": edge, "clients": members.tolist(),
                          "num_examples": int(info.num_examples[members].sum()),
                          "label_histogram": info.label_histograms[members].sum(0).tolist()})
        proxy = (label_upward_divergence(info.label_histograms, edge_of, hierarchy.num_nodes(1))
                 if info.label_histograms.any() else None)  # None: no client reported labels
        self.folder.write_json("groups.json", {
            "grouping": grouping, "seed": seed, "groups_per_level": list(self.cfg.groups),
            "client_to_edge": edge_of.tolist(),
            "upper_levels": [p.tolist() for p in hierarchy.parents[1:]],
            "label_upward_divergence": proxy,
            "label_upward_divergence_meaning": (
                "sum_i P_i ||pi_i - pi||^2 over edges i: pi_i the edge's label distribution, "
                "pi the global one, P_i the edge's share of rows"),
            "edges": edges})
        from fedhier.runs.plots import plot_groups

        plot_groups(self.folder.path / "groups.json", self.folder.path / "groups.png")

    def record_round(self, record: dict[str, Any]) -> None:
        """Append one cloud round's metrics (wall_seconds is added here)."""
        record["wall_seconds"] = time.time() - self.t_start
        self.folder.append_metrics(record)
        self.last = dict(record)
        for callback in self.callbacks:
            callback.on_round(record)
        if record["round"] > 0:
            self.bar.update(1)
            self.bar.set_postfix(test_acc=f"{record['test_accuracy']:.4f}",
                                 test_loss=f"{record['test_loss']:.3f}")

    @property
    def elapsed(self) -> float:
        return time.time() - self.t_start

    def close(self) -> None:
        self.bar.close()

    def finish(self, final_state: Mapping[str, torch.Tensor],
               communication: Mapping[str, int]) -> dict[str, Any]:
        """Write the final model, summary.json and curves.png; returns the summary."""
        self.close()
        self.folder.save_model("model_final.safetensors", final_state)
        crash_point()
        last = self.last
        summary = {
            "final_test_accuracy": last["test_accuracy"],
            "final_test_loss": last["test_loss"],
            "final_train_loss": last.get("train_loss"),
            "rounds": self.cfg.rounds,
            "iterations": self.cfg.iterations,
            "edge_rounds": last["edge_rounds"],
            "wall_seconds": time.time() - self.t_start,
            "engine": self.engine,
            "weighting": self.cfg.weighting,
            "weighting_meaning": WEIGHTING_TEXT[self.cfg.weighting],
            "communication": dict(communication),
        }
        self.folder.write_json("summary.json", summary)
        for callback in self.callbacks:
            callback.on_finish(self.folder.path, summary)
        from fedhier.runs.plots import plot_groups_history, plot_runs

        plot_runs([self.folder.path], self.folder.path / "curves.png")
        history = groups_history(self.folder.path)
        if history is not None:
            self.folder.write_json("groups_history.json", history)
            plot_groups_history(self.folder.path / "groups_history.json",
                                self.folder.path / "groups_history.png")
        return summary


def groups_history(run_dir: Any) -> dict[str, Any] | None:
    """The client -> edge map after every cloud round, from groups.json (round 0) and the
    ``client_to_edge`` of metrics.jsonl (written in a round where the map changed: a move or
    a regrouping); None when it never changed."""
    from fedhier.runs.folder import read_json

    records = read_metrics(run_dir)
    if not any("client_to_edge" in r for r in records):
        return None
    current = list(read_json(run_dir, "groups.json")["client_to_edge"])
    rounds, maps, moves = [], [], []
    for record in records:
        current = list(record.get("client_to_edge", current))
        rounds.append(record["round"])
        maps.append(current)
        moves.extend(record.get("moves", []))
    return {"rounds": rounds, "client_to_edge": maps, "moves": moves,
            "meaning": "client_to_edge[i]: each client's edge after cloud round rounds[i] "
                       "(round 0: the initial grouping); moves: [edge round, client, from "
                       "edge, to edge], effective from that edge round"}
