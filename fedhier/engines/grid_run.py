"""A fedhier run on a Flower Grid: the ServerApp logic of every Flower engine.

``run_federation`` drives :class:`~fedhier.strategies.HierFedAvg` (the algorithm with a
:class:`~fedhier.strategies.grid_executor.GridExecutor`) on whatever Grid it is given
(in-process, Simulation Engine, Deployment Engine), evaluates centrally on the test set, and
records the run folder (:func:`fedhier.server.run_recorded`).
"""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from fedhier.checkpoint import Checkpoint
from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.run_folder import RunFolder
from fedhier.run_recorder import RunRecorder
from fedhier.server import (
    central_evaluation,
    initial_model,
    prepare,
    quiet_flower,
    run_recorded,
    settings_for,
)
from fedhier.strategies.cloud_step import make_cloud_strategy
from fedhier.strategies.hierfedavg import HierFedAvg
from fedhier.train import resolve_device


def strategy_for(cfg: RunConfig) -> HierFedAvg:
    """The HierFedAvg that runs ``cfg``."""
    strategy = HierFedAvg.from_settings(
        settings_for(cfg), min_available_nodes=cfg.clients,
        cloud_strategy=make_cloud_strategy(cfg.cloud_strategy, cfg.server_lr,
                                           cfg.server_momentum))
    # Clients keep momentum buffers between rounds: checkpoints need them (query.state).
    strategy.keeps_client_state = (cfg.local_optimizer().has_state
                                   and cfg.optimizer_state == "keep")
    return strategy


def run_federation(grid: Grid, cfg: RunConfig, folder: RunFolder, *, engine: str,
                   progress: bool = True, resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run the configured hierarchical federation on ``grid``; returns summary.json's dict."""
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
    strategy = strategy_for(cfg)
    run_config = ConfigRecord(cfg.to_run_config())
    executor = strategy.executor_for(grid, run_config, cfg.round_timeout)
    strategy.executor = executor
    initial = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return run_recorded(strategy.algorithm, executor, cfg, recorder, initial,
                        central_evaluation(cfg, fed, model, device), resume=resume)
