"""An edge server's message handler: the cloud's tasks, run with the edge's own clients.

:class:`EdgeServer` answers the messages of :mod:`fedhier_strategies.edge.messages` from the
cloud, reaching its clients through ``grid`` (the Grid of the edge's own SuperLink) with a
:class:`~fedhier_strategies.grid_executor.GridExecutor` numbered by the clients' partition
ids. It holds no training state between messages (:mod:`fedhier.edge_tier`), so a restarted
edge server takes the next job as if nothing happened. The process around it (claiming tasks
from Flower's runtime APIs) is :mod:`fedhier.engines.deployment.edge_process`; tests run it in
one process on :class:`~fedhier.engines.inprocess_grid.InProcessGrid` s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedhier.config import RunConfig
from fedhier.edge_tier import run_edge_job
from fedhier.errors import ConfigError
from fedhier.run_setup import settings_for
from fedhier_clients.app import run_config_of
from fedhier_clients.records import to_tensors
from fedhier_strategies.edge.messages import (
    EDGE_ID,
    EDGE_KEYS,
    PARTITION_IDS,
    job_from_message,
    report_content,
)
from fedhier_strategies.grid_executor import GridExecutor


class EdgeServer:
    """Edge ``edge`` of a federation, serving the clients ``clients`` (partition ids).

    Args:
        grid: reaches this edge's clients (their SuperNodes are the grid's nodes).
        timeout: seconds to wait for the clients' replies (default: the run's round_timeout).
    """

    def __init__(self, edge: int, grid: Grid, clients: Sequence[int],
                 timeout: float | None = None) -> None:
        self.edge = edge
        self.grid = grid
        self.clients = sorted(int(c) for c in clients)
        self.timeout = timeout
        self._executor: GridExecutor | None = None
        self._config: RunConfig | None = None

    def executor(self, cfg: RunConfig) -> GridExecutor:
        """The executor of this edge's clients under run configuration ``cfg`` (profiled on
        first use)."""
        if self._executor is None or cfg != self._config:
            executor = GridExecutor(
                self.grid, ConfigRecord(cfg.to_run_config()),
                timeout=self.timeout or cfg.round_timeout,
                min_available_nodes=len(self.clients), clients=self.clients,
                num_clients=cfg.clients, policy=cfg.reply_policy())
            executor.profiles()
            self._executor, self._config = executor, cfg
        return self._executor

    def handle(self, msg: Message) -> RecordDict:
        """The reply content to one message from the cloud (raises on a bad message)."""
        config = cast(ConfigRecord, msg.content["config"])
        cfg = run_config_of(ConfigRecord({k: v for k, v in config.items()
                                          if k not in EDGE_KEYS}))
        kind = msg.metadata.message_type
        executor = self.executor(cfg)
        if kind == MessageType.QUERY:
            return self._profile(executor)
        if kind == MessageType.TRAIN:
            job = job_from_message(msg)
            if job.edge != self.edge:
                raise ConfigError(f"edge server {self.edge} got the job of edge {job.edge}")
            return report_content(run_edge_job(settings_for(cfg), executor, job))
        params = to_tensors(cast(ArrayRecord, msg.content["arrays"]))
        if kind == MessageType.EVALUATE:
            return self._evaluate(executor, params, int(config["server-round"]))  # type: ignore[arg-type]
        if kind == f"{MessageType.QUERY}.gradient":
            grads = executor.client_gradients(params)
            if grads is None:
                raise ConfigError(f"edge {self.edge}: a client did not send its gradient")
            return RecordDict({"gradient": ArrayRecord({"g": grads}),
                               "metrics": MetricRecord({EDGE_ID: self.edge,
                                                        PARTITION_IDS: self.clients})})
        raise ConfigError(f"edge server {self.edge} has no handler for '{kind}' messages")

    def _profile(self, executor: GridExecutor) -> RecordDict:
        info = executor.profiles()
        histograms = np.asarray(info.label_histograms, dtype=np.int64)
        return RecordDict({"metrics": MetricRecord({
            EDGE_ID: self.edge, PARTITION_IDS: self.clients,
            "num-examples": [int(v) for v in info.num_examples],
            "label-histogram": [int(v) for v in histograms.ravel()],
            "num-classes": int(histograms.shape[1])})})

    def _evaluate(self, executor: GridExecutor, params: dict[str, torch.Tensor],
                  cloud_round: int) -> RecordDict:
        evaluation = executor.evaluate(params, cloud_round)
        rows = np.asarray(self.clients)
        metrics = MetricRecord({EDGE_ID: self.edge, PARTITION_IDS: self.clients})
        if evaluation is not None:
            holdout = (np.full(len(rows), np.nan) if evaluation.holdout_accuracy is None
                       else evaluation.holdout_accuracy[rows])
            metrics["loss"] = evaluation.loss[rows].tolist()
            metrics["accuracy"] = evaluation.accuracy[rows].tolist()
            metrics["holdout-accuracy"] = holdout.tolist()
            if evaluation.num_examples is not None:
                metrics["num-examples"] = [int(v) for v in evaluation.num_examples[rows]]
        return RecordDict({"metrics": metrics})
