"""A server's message handler: its parent's tasks, run with its own subtree.

:class:`EdgeServer` answers the messages of :mod:`fedhier.strategies.edge.messages` from its
parent (the cloud, or a region), reaching its children through ``grid`` (the Grid of its own
SuperLink): an edge its clients with a
:class:`~fedhier.strategies.grid_executor.GridExecutor` numbered by the clients' partition
ids, a server above the edges its child servers with an
:class:`~fedhier.strategies.edge.cloud_executor.EdgeServersExecutor`. It holds no training
state between messages (:mod:`fedhier.round.tiers.jobs`), so a restarted server takes the next job
as if nothing happened; clients' kept optimizer state stays with the clients (their runtime's
``context.state``), the server only forwards its parent's queries for it (``query.state``,
``query.restore``: checkpoints, and moving clients' state, which comes back to a client's new
edge in its job and is restored before it trains). The process around it (claiming tasks
from Flower's runtime APIs) is :mod:`fedhier.engines.deployment.edge_process`; tests run it in
one process on :class:`~fedhier.engines.inprocess_grid.InProcessGrid` s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedhier.clients.app import run_config_of
from fedhier.clients.wire.packed_model import get_model
from fedhier.common.errors import ConfigError
from fedhier.round.tiers.jobs import ServerJob, run_edge_job
from fedhier.runs.prepare import settings_for
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.follow import (
    FOLLOW_TIMEOUT,
    clients_of,
    follow_clients,
    follow_subtree,
)
from fedhier.strategies.edge.messages import (
    ABSENT,
    DROPPED,
    EDGE_ID,
    EDGE_KEYS,
    PARTITION_IDS,
    PATH,
    job_from_message,
    report_content,
    state_clients,
    state_content,
    states_of,
)
from fedhier.strategies.grid_executor import GridExecutor

log = logging.getLogger("fedhier")

#: The share of its parent's wait a server spends waiting for its children (the rest: its own
#: work and the messages to and from its parent).
CHILD_SHARE = 0.8


def nested_timeout(timeout: float, periods: Sequence[int], level: int) -> float:
    """Seconds a level-``level`` server waits for its children's replies to one exchange, so
    that every server answers before its parent stops waiting: the cloud waits ``timeout``
    for a child's job; a level-l node's job spans ``periods[l] / periods[l-1]`` exchanges
    with its children, which together get ``CHILD_SHARE`` of its parent's wait."""
    for upper in range(len(periods) - 1, level - 1, -1):
        timeout *= CHILD_SHARE * periods[upper - 1] / periods[upper]
    return timeout


class EdgeServer:
    """Node ``edge`` of level ``level`` (1: an edge) of a federation, serving the clients
    ``clients`` (partition ids) under it.

    Args:
        grid: reaches its children (their SuperNodes are the grid's nodes): an edge's
            clients, or (``level`` >= 2) the servers ``children`` of level ``level`` - 1.
        timeout: seconds the cloud waits for a server's job (default: the run's
            round_timeout); this server waits :func:`nested_timeout` of it per exchange.
    """

    def __init__(self, edge: int, grid: Grid, clients: Sequence[int],
                 timeout: float | None = None, level: int = 1,
                 children: Sequence[int] = ()) -> None:
        self.edge = edge
        self.grid = grid
        self.clients = sorted(int(c) for c in clients)
        self.timeout = timeout
        self.level = level
        self.children = sorted(int(c) for c in children)
        if level > 1 and not self.children:
            raise ConfigError(f"server {edge} of level {level} needs its child servers")
        self._executor: GridExecutor | None = None
        self.seen: dict[int, int] = {}  # node -> client, every node it has known (follow)
        self.lost: set[int] = set()  # its clients not online here at the last job
        self._config: RunConfig | None = None

    def executor(self, cfg: RunConfig) -> GridExecutor:
        """The executor of this server's children under run configuration ``cfg``
        (profiled on first use)."""
        if self._executor is None or cfg != self._config:
            run_config = ConfigRecord(cfg.to_run_config())
            timeout = nested_timeout(self.timeout or cfg.round_timeout, cfg.periods,
                                     self.level)
            executor: GridExecutor
            if self.level == 1:
                executor = GridExecutor(
                    self.grid, run_config, timeout=timeout,
                    min_available_nodes=len(self.clients), clients=self.clients,
                    num_clients=cfg.clients, policy=cfg.reply_policy(),
                    keeps_client_state=cfg.keeps_client_state(), packed_models=True)
            else:
                from fedhier.strategies.edge.cloud_executor import EdgeServersExecutor

                executor = EdgeServersExecutor(
                    self.grid, run_config, len(self.children), cfg.clients, timeout,
                    level=self.level, children=self.children, clients=self.clients)
            from fedhier.strategies.edge.cloud_executor import STARTUP_SECONDS

            executor.timeout = max(timeout, STARTUP_SECONDS)  # as long to start as servers get
            executor.profiles()
            executor.timeout = timeout
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
            if (job.edge, job.level) != (self.edge, self.level):
                raise ConfigError(f"server {self.edge} (level {self.level}) got the job of "
                                  f"server {job.edge} (level {job.level})")
            if self.level == 1:
                self._follow(executor, job, config)
            if self.level > 1:  # clients moved between its edges, in or out of its subtree
                self.clients = follow_subtree(executor, job, self.edge)
            content = report_content(run_edge_job(settings_for(cfg), executor, job))
            cast(MetricRecord, content["metrics"])[DROPPED] = executor.take_dropped_replies()
            return content
        if kind == f"{MessageType.QUERY}.state":  # the clients keep it: ask them
            return state_content(executor.client_state(state_clients(msg.content)))
        if kind == f"{MessageType.QUERY}.restore":
            executor.restore_client_state(states_of(msg.content))
            return RecordDict({"metrics": MetricRecord({EDGE_ID: self.edge})})
        params = get_model(msg.content, "arrays")
        if kind == MessageType.EVALUATE:
            return self._evaluate(executor, params, int(config["server-round"]))  # type: ignore[arg-type]
        if kind == f"{MessageType.QUERY}.gradient":
            grads = executor.client_gradients(params)
            if grads is None:
                raise ConfigError(f"edge {self.edge}: a client did not send its gradient")
            return RecordDict({"gradient": ArrayRecord({"g": grads}),
                               "metrics": MetricRecord({EDGE_ID: self.edge,
                                                        PARTITION_IDS: self.clients})})
        raise ConfigError(f"server {self.edge} has no handler for '{kind}' messages")

    def _follow(self, executor: GridExecutor, job: ServerJob, config: ConfigRecord) -> None:
        """Serve the clients ``job``'s map puts here (clients moved): a newly arrived one is
        waited for (:data:`~fedhier.strategies.edge.follow.FOLLOW_TIMEOUT`), one still
        missing since an earlier job only looked for, one the cloud could not re-attach
        (``absent-clients``) not at all; those missing fail this job's edge rounds."""
        clients = clients_of(job.edge_of_client, self.edge)
        if clients == self.clients and not self.lost:
            return
        absent = [int(c) for c in config.get(ABSENT, [])]  # type: ignore[union-attr]
        waited = [c for c in clients if c not in self.lost]
        lost = follow_clients(executor, clients, self.seen, absent=absent,
                              timeout=FOLLOW_TIMEOUT if set(waited) - set(self.clients)
                              else 0.0)
        if set(lost) - self.lost:
            log.warning("edge %d: client(s) %s are not online here: they fail its edge "
                        "rounds until they are", self.edge, lost[:10])
        self.clients, self.lost = clients, set(lost)

    def _profile(self, executor: GridExecutor) -> RecordDict:
        info = executor.profiles()
        histograms = np.asarray(info.label_histograms, dtype=np.int64)
        sizes = np.asarray(info.num_examples, dtype=np.int64)
        metrics = MetricRecord({EDGE_ID: self.edge, PARTITION_IDS: self.clients})
        if self.level > 1:  # arrays by client of the federation: this server's rows
            rows = np.asarray(self.clients)
            histograms, sizes = histograms[rows], sizes[rows]
            path = np.stack([where[rows] for where in executor.ancestors], axis=1)  # type: ignore[attr-defined]
            metrics[PATH] = [int(v) for v in path.ravel()]
        metrics.update({"num-examples": [int(v) for v in sizes],
                        "label-histogram": [int(v) for v in histograms.ravel()],
                        "num-classes": int(histograms.shape[1])})
        return RecordDict({"metrics": metrics})

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
