"""The cloud side of a fedhier run: one function every Flower engine's ServerApp calls.

``run_federation`` builds the initial model, drives :class:`HierFedAvg` on whatever Flower
Grid it is given (in-process, Simulation Engine, Deployment Engine), evaluates centrally on the
test set, and records the run folder through :class:`RunRecorder`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from fedhier.checkpoint import Checkpoint, save_checkpoint
from fedhier.cloud import make_cloud_strategy
from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.federation import Federation, federation_for
from fedhier.models import build_model
from fedhier.recorder import RunRecorder
from fedhier.results import RunFolder
from fedhier.rng import torch_seed
from fedhier.round_diagnostics import diagnostics_due, sample_diagnostics
from fedhier.strategies.hierfedavg import HierFedAvg
from fedhier.train import evaluate, resolve_device


def quiet_flower() -> None:
    """Keep Flower's per-round INFO logs out of the progress bar."""
    logging.getLogger("flwr").setLevel(logging.WARNING)


def prepare(cfg: RunConfig) -> Federation:
    """Load and partition the data; raises a one-line FedhierError on bad input."""
    fed = federation_for(cfg)
    token_input = fed.bundle.x_dtype.startswith("int")
    if token_input != (cfg.model == "lstm"):
        kind = "token ids (text)" if token_input else "real-valued features"
        raise ConfigError(f"dataset {cfg.dataset} has {kind}; model '{cfg.model}' does not fit: "
                          f"use {'lstm' if token_input else 'logreg, mlp or cnn'}")
    if fed.num_clients != cfg.clients:
        raise ConfigError(
            f"the partition has {fed.num_clients} clients but clients={cfg.clients}; set "
            f"--clients {fed.num_clients}")
    return fed


def initial_model(cfg: RunConfig, fed: Federation) -> torch.nn.Module:
    """The seeded initial global model."""
    return build_model(cfg.model, fed.bundle.input_shape, fed.bundle.num_classes,
                       seed=torch_seed(cfg.seed, "model-init"))


def test_metrics(model: torch.nn.Module, params: dict[str, torch.Tensor], fed: Federation,
                 device: torch.device) -> dict[str, Any]:
    """``test_loss`` and ``test_accuracy`` of ``params`` on the held-out test set."""
    x_test, y_test = fed.test_tensors(device)
    loss, accuracy = evaluate(model, params, x_test, y_test)
    return {"test_loss": loss, "test_accuracy": accuracy}


def pooled_train_tensors(fed: Federation,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All clients' training rows together (the pooled data of sample-level diversity)."""
    parts = [fed.client_tensors(j, device) for j in range(fed.num_clients)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def run_federation(grid: Grid, cfg: RunConfig, folder: RunFolder, *, engine: str,
                   progress: bool = True, resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run the configured hierarchical federation on ``grid``; returns summary.json's dict.

    Writes ``checkpoint.pt`` every ``cfg.checkpoint_every`` cloud rounds and, on Ctrl-C,
    after the last completed round before re-raising. ``resume`` continues from a checkpoint.
    """
    quiet_flower()
    fed = prepare(cfg)
    num_nodes = len(list(grid.get_node_ids()))
    if num_nodes and num_nodes != cfg.clients:
        raise ConfigError(
            f"the federation has {num_nodes} nodes but clients={cfg.clients}; they must match")
    device = resolve_device(cfg.device)
    model = initial_model(cfg, fed).to(device)
    recorder = RunRecorder(folder, cfg, fed, engine, progress,
                           resume_round=resume.round if resume else None,
                           elapsed=resume.wall_seconds if resume else 0.0)
    strategy = HierFedAvg(cfg.local_period, cfg.global_period, cfg.groups, periods=cfg.periods,
                          grouping=cfg.grouping, weighting=cfg.weighting, seed=cfg.seed,
                          min_available_nodes=cfg.clients,
                          cloud_strategy=make_cloud_strategy(cfg.cloud_strategy, cfg.server_lr,
                                                             cfg.server_momentum),
                          workload=cfg.workload(), min_clients_per_edge=cfg.min_clients_per_edge,
                          on_nan=cfg.on_nan, diagnostics_every=cfg.diagnostics_every,
                          regroup_every=cfg.regroup_every)
    initial_state = model.state_dict()
    if resume is None:
        recorder.save_initial(initial_state)
    else:
        initial_state = resume.global_state
        strategy.load_state_dict(resume.strategy_state)
        strategy.restore_clients_on_start(resume.client_states)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        params = {k: v.to(device) for k, v in arrays.to_torch_state_dict().items()}
        metrics = dict(test_metrics(model, params, fed, device))
        if diagnostics_due(server_round, cfg.diagnostics_every):
            x, y = pooled_train_tensors(fed, device)
            metrics.update(sample_diagnostics(model, params, x, y, cfg.diagnostics_max_samples,
                                              cfg.seed))
        return MetricRecord(metrics)

    run_config = ConfigRecord(cfg.to_run_config())
    # Clients keep momentum buffers between rounds: checkpoints need them (query.state).
    keeps_client_state = cfg.local_optimizer().has_state and cfg.optimizer_state == "keep"
    # The last fully recorded cloud round and its model, replaced in one assignment, so that
    # a Ctrl-C at any moment checkpoints a consistent pair.
    done: dict[str, Any] = {"round": resume.round if resume else 0, "arrays": None,
                            "strategy": None, "clients": {}}

    def checkpoint() -> None:
        save_checkpoint(folder.path, Checkpoint(
            round=done["round"], global_state=dict(done["arrays"].to_torch_state_dict()),
            strategy_state=done["strategy"], wall_seconds=recorder.elapsed,
            client_states=done["clients"]))

    def on_cloud_round(record: dict[str, Any]) -> None:
        if record["round"] == 0:
            assert strategy.hierarchy is not None and strategy.client_info is not None
            recorder.write_groups(strategy.hierarchy, strategy.client_info, cfg.grouping,
                                  cfg.seed)
        recorder.record_round(record)
        clients = (strategy.client_states(grid, run_config, cfg.round_timeout)
                   if keeps_client_state else {})
        snapshot = {"round": record["round"], "arrays": strategy.global_arrays,
                    "strategy": strategy.state_dict(), "clients": clients}
        done.update(snapshot)  # one dict update: no KeyboardInterrupt between the keys
        if cfg.checkpoint_every and record["round"] % cfg.checkpoint_every == 0:
            checkpoint()

    initial = ArrayRecord({k: v.detach().cpu() for k, v in initial_state.items()})
    try:
        result = strategy.start(grid, initial, num_rounds=cfg.rounds, timeout=cfg.round_timeout,
                                train_config=run_config, evaluate_config=run_config,
                                evaluate_fn=evaluate_fn, on_cloud_round=on_cloud_round,
                                first_round=done["round"] + 1)
    except KeyboardInterrupt:
        recorder.close()
        if done["arrays"] is not None and done["round"] > 0:
            checkpoint()
        raise
    finally:
        recorder.close()
    return recorder.finish(result.arrays.to_torch_state_dict(),
                           strategy.communication.as_dict())
