"""The cloud side of a fedhier run: one function every engine's ServerApp calls.

``run_federation`` builds the initial model, drives :class:`HierFedAvg` on whatever Flower
Grid it is given (in-process, Simulation Engine, Deployment Engine), evaluates centrally on the
test set, and writes the run folder.
"""

from __future__ import annotations

import logging
import platform
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from tqdm import tqdm

from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.federation import Federation, federation_for
from fedhier.models import build_model
from fedhier.results import RunFolder
from fedhier.rng import torch_seed
from fedhier.strategies.hierfedavg import HierFedAvg
from fedhier.train import evaluate, resolve_device

WEIGHTING_TEXT = {
    "samples": "clients weighted by their number of training rows (FedAvg practice)",
    "uniform": "clients weighted equally, f = (1/n) sum_j F_j (the papers' objective)",
}


def quiet_flower() -> None:
    """Keep Flower's per-round INFO logs out of the progress bar."""
    logging.getLogger("flwr").setLevel(logging.WARNING)


def prepare(cfg: RunConfig) -> Federation:
    """Load and partition the data; raises a one-line FedhierError on bad input."""
    fed = federation_for(cfg)
    if fed.num_clients != cfg.clients:
        raise ConfigError(
            f"the partition has {fed.num_clients} clients but clients={cfg.clients}; set "
            f"--clients {fed.num_clients}")
    return fed


def initial_model(cfg: RunConfig, fed: Federation) -> torch.nn.Module:
    """The seeded initial global model."""
    return build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes,
                       seed=torch_seed(cfg.seed, "model-init"))


def describe(cfg: RunConfig, fed: Federation) -> dict[str, Any]:
    """The fully resolved configuration written to config.json."""
    return {
        **cfg.to_dict(),
        "periods": list(cfg.periods),
        "iterations": cfg.iterations,
        "weighting_meaning": WEIGHTING_TEXT[cfg.weighting],
        "dataset_source": fed.bundle.source,
        "input_shape": list(fed.bundle.input_shape),
        "num_classes": fed.bundle.num_classes,
        "train_rows": len(fed.bundle.train),
        "test_rows": len(fed.bundle.test),
        "partition_note": (
            f"Dirichlet(alpha={cfg.alpha}) label partition via flwr-datasets "
            f"DirichletPartitioner, min_partition_size={cfg.min_partition_size}, "
            f"self_balancing={cfg.self_balancing}"
            if cfg.partition == "dirichlet" else cfg.partition),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "flwr": _version("flwr"), "flwr_datasets": _version("flwr-datasets"),
                     "fedhier": _version("fedhier")},
    }


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def write_groups(folder: RunFolder, strategy: HierFedAvg, fed: Federation) -> None:
    hierarchy = strategy.hierarchy
    info = strategy.client_info
    assert hierarchy is not None and info is not None
    edge_of = hierarchy.edge_of_client()
    edges = []
    for edge in range(hierarchy.num_nodes(1)):
        members = np.flatnonzero(edge_of == edge)
        edges.append({"edge": edge, "clients": members.tolist(),
                      "num_examples": int(info.num_examples[members].sum()),
                      "label_histogram": info.label_histograms[members].sum(0).tolist()})
    folder.write_json("groups.json", {"grouping": strategy.grouping, "seed": strategy.seed,
                                      "client_to_edge": edge_of.tolist(), "edges": edges})


def run_federation(grid: Grid, cfg: RunConfig, folder: RunFolder, *, engine: str,
                   progress: bool = True, timeout: float = 3600) -> dict[str, Any]:
    """Run the configured hierarchical federation on ``grid``; returns summary.json's dict."""
    t_start = time.time()
    quiet_flower()
    fed = prepare(cfg)
    num_nodes = len(list(grid.get_node_ids()))
    if num_nodes and num_nodes != cfg.clients:
        raise ConfigError(
            f"the federation has {num_nodes} nodes but clients={cfg.clients}; they must match")
    device = resolve_device(cfg.device)
    model = initial_model(cfg, fed).to(device)
    initial = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    folder.write_json("config.json", {**describe(cfg, fed), "engine": engine})
    _, y_train = fed.bundle.train_arrays()
    folder.write_json("partition.json", {
        "scheme": cfg.partition,
        "clients": [{"client": j, "rows": rows.tolist(), "num_examples": len(rows),
                     "label_counts": np.bincount(y_train[rows],
                                                 minlength=fed.bundle.num_classes).tolist()}
                    for j, rows in enumerate(fed.partitions)]})
    folder.save_model("model_initial.safetensors", model.state_dict())

    strategy = HierFedAvg(cfg.local_period, cfg.global_period, cfg.groups, grouping=cfg.grouping,
                          weighting=cfg.weighting, seed=cfg.seed, min_available_nodes=cfg.clients)
    x_test, y_test = fed.test_tensors(device)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        params = {k: v.to(device) for k, v in arrays.to_torch_state_dict().items()}
        loss, accuracy = evaluate(model, params, x_test, y_test)
        return MetricRecord({"test_loss": loss, "test_accuracy": accuracy})

    bar = tqdm(total=cfg.rounds, desc="cloud rounds", unit="round", disable=not progress,
               dynamic_ncols=True)
    last: dict[str, Any] = {}

    def on_cloud_round(record: dict[str, Any]) -> None:
        if record["round"] == 0:
            write_groups(folder, strategy, fed)
        record["wall_seconds"] = time.time() - t_start
        folder.append_metrics(record)
        last.update(record)
        if record["round"] > 0:
            bar.update(1)
            bar.set_postfix(test_acc=f"{record['test_accuracy']:.4f}",
                            test_loss=f"{record['test_loss']:.3f}")

    run_config = ConfigRecord(cfg.to_run_config())
    try:
        result = strategy.start(grid, initial, num_rounds=cfg.rounds, timeout=timeout,
                                train_config=run_config, evaluate_config=run_config,
                                evaluate_fn=evaluate_fn, on_cloud_round=on_cloud_round)
    finally:
        bar.close()
    folder.save_model("model_final.safetensors", result.arrays.to_torch_state_dict())
    summary = {
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "final_train_loss": last.get("train_loss"),
        "rounds": cfg.rounds,
        "iterations": cfg.iterations,
        "edge_rounds": last["edge_rounds"],
        "wall_seconds": time.time() - t_start,
        "engine": engine,
        "weighting": cfg.weighting,
        "weighting_meaning": WEIGHTING_TEXT[cfg.weighting],
        "communication": strategy.communication.as_dict(),
    }
    folder.write_json("summary.json", summary)
    from fedhier.plots import plot_runs

    plot_runs([folder.path], folder.path / "curves.png")
    return summary
