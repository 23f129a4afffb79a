"""A fedhier run on a Flower Grid: the ServerApp logic of every Flower engine.

``run_federation`` drives :class:`~fedhier.strategies.HierFedAvg` (the algorithm with a
:class:`~fedhier.strategies.grid_executor.GridExecutor`) on whatever Grid it is given
(in-process, Simulation Engine, Deployment Engine), evaluates centrally on the test set, and
records the run folder (:func:`fedhier.runs.driver.run_recorded`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid
from flwr.superlink.grid import HttpGrid

from fedhier.common.errors import ConfigError
from fedhier.engines.prompt_grid import PromptGrid
from fedhier.local.train import resolve_device
from fedhier.round.loop import HierarchicalSGD, Params
from fedhier.round.tiers.asynchronous import async_edge_tier, with_replayed_arrivals
from fedhier.round.tiers.servers import ServerRounds
from fedhier.runs.checkpoint import Checkpoint
from fedhier.runs.driver import run_recorded
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import (
    central_evaluation,
    initial_model,
    prepare,
    quiet_flower,
    settings_for,
)
from fedhier.runs.recorder import RunRecorder
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.cloud_step import make_cloud_strategy
from fedhier.strategies.edge.async_executor import AsyncEdgeServersExecutor
from fedhier.strategies.edge.cloud_executor import EdgeServersExecutor
from fedhier.strategies.grid_executor import GridExecutor
from fedhier.strategies.hierfedavg import HierFedAvg

#: Set on the cloud SuperLink by ``fedhier deploy local``: the folder of the processes' wire
#: meters (:mod:`fedhier.engines.deployment.wire`), whose totals each record then carries.
WIRE_RECORD_ENV = "FEDHIER_WIRE_RECORD"
#: Set on the cloud SuperLink by ``fedhier deploy local --resume RUN_DIR``: the ServerApp
#: continues that run folder from its checkpoint.
RESUME_ENV = "FEDHIER_RESUME"


def with_wire_bytes(evaluate_fn: Callable[[int, Params], dict[str, Any]], wire_dir: Path,
                    ) -> Callable[[int, Params], dict[str, Any]]:
    """``evaluate_fn`` whose metrics also hold ``wire_<link>_bytes``: the bytes sent plus
    received on each measured link so far, as the processes had reported them (every 0.25 s;
    the run's final totals are in wire.json)."""
    from fedhier.engines.deployment.wire import read_wire

    def evaluate(cloud_round: int, params: Params) -> dict[str, Any]:
        metrics = evaluate_fn(cloud_round, params)
        for link, totals in sorted(read_wire(wire_dir).items()):
            metrics[f"wire_{link.replace('-', '_')}_bytes"] = totals["sent"] + totals["received"]
        return metrics

    return evaluate


def strategy_for(cfg: RunConfig) -> HierFedAvg:
    """The HierFedAvg that runs ``cfg``."""
    strategy = HierFedAvg.from_settings(
        settings_for(cfg), min_available_nodes=cfg.clients,
        cloud_strategy=make_cloud_strategy(cfg.cloud_strategy, cfg.server_lr,
                                           cfg.server_momentum))
    # Clients keep momentum buffers between rounds: checkpoints need them (query.state).
    strategy.keeps_client_state = cfg.keeps_client_state()
    return strategy


def run_federation(grid: Grid, cfg: RunConfig, folder: RunFolder, *, engine: str,
                   progress: bool = True, resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run the configured hierarchical federation on ``grid``; returns summary.json's dict."""
    quiet_flower()
    fed = prepare(cfg)
    if isinstance(grid, HttpGrid):  # the Deployment Engine: poll for replies every 0.1 s
        grid = PromptGrid(grid)
    num_nodes = len(list(grid.get_node_ids()))
    expected = cfg.groups[-1] if cfg.edge_servers else cfg.clients  # the cloud's children
    if num_nodes and num_nodes != expected:
        what = f"{expected} servers under the cloud" if cfg.edge_servers else \
            f"clients={cfg.clients}"
        raise ConfigError(
            f"the federation has {num_nodes} nodes but {what}; they must match")
    device = resolve_device(cfg.device)
    model = initial_model(cfg, fed).to(device)
    recorder = RunRecorder.for_run(folder, cfg, fed, engine, progress, resume)
    strategy = strategy_for(cfg)
    run_config = ConfigRecord(cfg.to_run_config())
    algorithm: HierarchicalSGD = strategy.algorithm
    executor: GridExecutor
    if cfg.edge_servers and cfg.asynchronous().active:  # fedhier.round.tiers.asynchronous
        algorithm = async_edge_tier(strategy.settings, algorithm.cloud_step, folder.path,
                                    resume)
        executor = AsyncEdgeServersExecutor(grid, run_config, cfg.groups[-1], cfg.clients,
                                            cfg.round_timeout, level=len(cfg.periods))
    elif cfg.edge_servers:  # the edges run their clients' edge rounds (fedhier.round.tiers.jobs)
        algorithm = HierarchicalSGD(strategy.settings, algorithm.cloud_step,
                                    rounds=ServerRounds)
        executor = EdgeServersExecutor(grid, run_config, cfg.groups[-1], cfg.clients,
                                       cfg.round_timeout, level=len(cfg.periods))
    else:
        executor = strategy.executor_for(grid, run_config, cfg.round_timeout)
        strategy.executor = executor
        algorithm = with_replayed_arrivals(algorithm)  # a recorded order, if asked
    initial = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    evaluate_fn = central_evaluation(cfg, fed, model, device)
    if os.environ.get(WIRE_RECORD_ENV):
        evaluate_fn = with_wire_bytes(evaluate_fn, Path(os.environ[WIRE_RECORD_ENV]))
    return run_recorded(algorithm, executor, cfg, recorder, initial, evaluate_fn,
                        resume=resume)
