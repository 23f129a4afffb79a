"""Edge servers that run their own edge rounds: the H-SGD round split between processes.

In every other engine the edges are logical: the cloud keeps one model per edge and talks to
every client in every edge round. With an *edge tier* (``fedhier deploy local --edges E``,
docs/deployment.md#edge-servers) each edge is a server of its own: once per cloud round the
cloud sends it the global model (an *edge job*), the edge runs the G / I edge rounds of that
cloud round with its own clients and answers with one model, its clients' aggregate. Only
E models go up and down the edge-cloud link per cloud round, instead of one per client and
edge round.

Both halves are the algorithm of :class:`fedhier.hsgd.HierarchicalSGD`, unchanged:

* the edge (:func:`run_edge_job`) plans and completes each edge round restricted to its own
  clients (:func:`train_edges`, which asynchronous edges use for their jobs too), with
  ``hold_cloud=True`` for the last one, and aggregates its surviving clients at level 1;
* the cloud (:class:`EdgeTierHierarchicalSGD`) starts the cloud round, collects the edges'
  reports (:class:`EdgeReport`) through an :class:`EdgeTierExecutor`, sums their counters
  and losses, and takes the cloud step over the edge aggregates
  (:meth:`HierarchicalSGD.aggregate_edges`).

Every draw (participation, stragglers, faults, mini-batches, compute speeds) is keyed by the
seed, the client and the round, so the split run equals the one-process run up to the float
rounding of averaging the edges' averages instead of all clients at once. Edges hold no state
between jobs: each job carries the client -> edge map and the clients' row counts, so an edge
process that is restarted simply takes the next job. Two-level hierarchies with a static
grouping only (checked by :func:`check_edge_tier`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.aggregate import presence_weights
from fedhier.errors import ConfigError
from fedhier.grouping import ClientInfo
from fedhier.hsgd import (
    Executor,
    HierarchicalSGD,
    HSGDSettings,
    Params,
    aggregate_levels,
)
from fedhier.topology import Hierarchy


def check_edge_tier(num_levels: int, mobile: bool, regroups: bool, asynchronous: bool,
                    edge_periods: bool) -> None:
    """Refuse, in one line, what edge servers do not run (yet)."""
    for failed, needs in ((num_levels != 2, "a two-level hierarchy (one local and one "
                                            "global period)"),
                          (mobile, "static clients (no mobility)"),
                          (regroups, "a fixed grouping (no regroup_every)"),
                          (asynchronous, "synchronous edges (no async_buffer)"),
                          (edge_periods, "one local period for every edge (no edge_periods)")):
        if failed:
            raise ConfigError(f"edge servers as processes need {needs}")


def _check(settings: HSGDSettings) -> None:
    check_edge_tier(len(settings.periods), settings.mobility.active,
                    bool(settings.regroup_every), settings.asynchronous.active,
                    bool(settings.edge_periods))


# ------------------------------------------------------------------------ the edge's half
@dataclass
class EdgeRunOutcome:
    """What some edges' clients did in the edge rounds of one cloud round.

    Attributes:
        held: the survivors of the last edge round, screened and scaled, not aggregated at
            the cloud: (name -> [s, *shape], int64 [s] client ids), or None (none survived).
        losses: float64 [R, 2], per edge round the clients' weighted mean train loss and
            their total weight (0, 0 where no client reported one).
        failed_clients, failed_edges: summed over the edge rounds.
    """

    held: tuple[Params, np.ndarray] | None
    losses: np.ndarray
    failed_clients: int
    failed_edges: int


def train_edges(algorithm: HierarchicalSGD, executor: Executor, edges: np.ndarray,
                cloud_round: int) -> EdgeRunOutcome:
    """The G / I edge rounds of ``cloud_round`` restricted to the clients of ``edges``
    (int64, sorted), from the edge models the algorithm holds; the last round's survivors
    are held, not aggregated at the cloud (``complete(..., hold_cloud=True)``)."""
    edge_of = algorithm._hierarchy().edge_of_client()
    per_round = algorithm.settings.edge_rounds_per_cloud_round
    losses = np.zeros((per_round, 2))
    failed = failed_edge_count = 0
    held: tuple[Params, np.ndarray] | None = None
    for k in range(1, per_round + 1):
        work, plan = algorithm.plan((cloud_round - 1) * per_round + k)
        mine = np.isin(edge_of[work.clients], edges)
        work = dataclasses.replace(work, clients=work.clients[mine], steps=work.steps[mine])
        if not len(work.clients):
            continue
        result = executor.train(work, algorithm.start_models(work))
        outcome = algorithm.complete(work, plan, result, hold_cloud=True)
        failed += outcome["failed_clients"]
        failed_edge_count += outcome["failed_edges"]
        if outcome["train_loss"] is not None:
            losses[k - 1] = (outcome["train_loss"], outcome["loss_weight"])
        held = outcome.get("held")
    return EdgeRunOutcome(held, losses, failed, failed_edge_count)


@dataclass
class EdgeJob:
    """What the cloud sends an edge server once per cloud round.

    Attributes:
        edge: the edge; cloud_round: 1-based; params: the global model (name -> tensor);
        edge_of_client: int64 [n], every client's edge; num_examples: int64 [n], every
        client's rows (the averaging weights); start_seconds: the edge's simulated clock.
    """

    edge: int
    cloud_round: int
    params: Params
    edge_of_client: np.ndarray
    num_examples: np.ndarray
    start_seconds: float


@dataclass
class EdgeReport:
    """An edge server's answer to an :class:`EdgeJob`.

    Attributes:
        edge: the edge; model: its surviving clients' aggregate (name -> tensor), None when
        none survived or the edge did not answer (``reached`` False); losses: float64
        [R, 2] (see :class:`EdgeRunOutcome`); failed_clients, failed_edges; client_edge_messages,
        client_edge_bytes: its traffic with its clients; seconds: its simulated clock
        when the report is ready.
    """

    edge: int
    model: Params | None
    losses: np.ndarray
    failed_clients: int = 0
    failed_edges: int = 0
    client_edge_messages: int = 0
    client_edge_bytes: int = 0
    seconds: float = 0.0
    reached: bool = True


def edge_hierarchy(settings: HSGDSettings, edge_of_client: np.ndarray) -> Hierarchy:
    """The two-level tree of an edge job's client -> edge map."""
    return Hierarchy(settings.periods, (np.asarray(edge_of_client, dtype=np.int64),),
                     num_edges=settings.groups[0])


def run_edge_job(settings: HSGDSettings, executor: Executor, job: EdgeJob) -> EdgeReport:
    """The edge server's half of a cloud round: its clients' G / I edge rounds from the
    global model (``executor`` reaches them), then their aggregate."""
    _check(settings)
    algorithm = HierarchicalSGD(settings)
    n = len(job.edge_of_client)
    info = ClientInfo(label_histograms=np.zeros((n, 1), dtype=np.int64),
                      num_examples=np.asarray(job.num_examples, dtype=np.int64))
    hierarchy = edge_hierarchy(settings, job.edge_of_client)
    algorithm.setup(executor, job.params, info=info, hierarchy=hierarchy)
    algorithm.begin_cloud_round(executor, job.cloud_round)
    clock = algorithm._clock()
    clock.edge_time[job.edge] = job.start_seconds
    edges = np.array([job.edge], dtype=np.int64)
    outcome = train_edges(algorithm, executor, edges, job.cloud_round)
    model = None
    if outcome.held is not None:
        models, survivors = outcome.held
        present = np.zeros(n, dtype=bool)
        present[survivors] = True
        weights = presence_weights(algorithm.weights, present, hierarchy.edge_of_client())
        averaged, _ = aggregate_levels(models, survivors, weights, hierarchy, 1,
                                       settings.aggregators, algorithm.node_models)
        model = {k: v[0] for k, v in averaged.items()}
    traffic = algorithm.communication
    return EdgeReport(job.edge, model, outcome.losses, outcome.failed_clients,
                      outcome.failed_edges, traffic.client_edge_messages,
                      traffic.client_edge_bytes, float(clock.edge_time[job.edge]))


# ------------------------------------------------------------------------ the cloud's half
class EdgeTierExecutor(Executor, Protocol):
    """An executor whose clients sit behind edge servers: besides profiles, evaluation and
    queries it runs one :class:`EdgeJob` per edge and returns the reports (an edge that did
    not answer in time: ``reached`` False)."""

    def run_edge_jobs(self, jobs: list[EdgeJob]) -> list[EdgeReport]: ...


class EdgeTierHierarchicalSGD(HierarchicalSGD):
    """The cloud of a run whose edges are servers of their own (the module docstring)."""

    def __init__(self, settings: HSGDSettings, cloud_step: Any = None) -> None:
        _check(settings)
        super().__init__(settings, cloud_step)

    def setup(self, executor: Executor, initial: Params, *, info: ClientInfo | None = None,
              hierarchy: Hierarchy | None = None) -> None:
        """As :meth:`HierarchicalSGD.setup`; then the grouping must put every client under
        the edge server it is connected to (``executor.edge_of_client``, when known)."""
        super().setup(executor, initial, info=info, hierarchy=hierarchy)
        connected = getattr(executor, "edge_of_client", None)
        grouped = self._hierarchy().edge_of_client()
        if connected is not None and not np.array_equal(connected, grouped):
            client = int(np.flatnonzero(np.asarray(connected) != grouped)[0])
            raise ConfigError(
                f"client {client} is connected to edge {int(connected[client])} but the "
                f"'{self.settings.grouping}' grouping puts it under edge {int(grouped[client])}"
                ": start each client at its edge (fedhier deploy local --edges does)")

    def cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Send every edge its job, wait for the reports, aggregate them at the cloud."""
        if not hasattr(executor, "run_edge_jobs"):
            raise ConfigError("edge servers need an executor that reaches them "
                              "(fedhier deploy local --edges)")
        self.begin_cloud_round(executor, cloud_round)
        hierarchy, clock, info = self._hierarchy(), self._clock(), self._info()
        edge_of = hierarchy.edge_of_client()
        num_edges = hierarchy.num_nodes(1)
        jobs = [EdgeJob(edge, cloud_round, dict(self.global_params), edge_of,
                        info.num_examples, float(clock.edge_time[edge]))
                for edge in range(num_edges)]
        reports = sorted(executor.run_edge_jobs(jobs), key=lambda r: r.edge)
        loss_sums = np.zeros((self.settings.edge_rounds_per_cloud_round, 2))
        failed = failed_edge_count = 0
        unreached = []
        for report in reports:
            if not report.reached:  # counted as if all its clients failed every edge round
                unreached.append(report.edge)
                failed += int((edge_of == report.edge).sum()) * len(loss_sums)
                failed_edge_count += len(loss_sums)
                continue
            loss_sums[:, 0] += report.losses[:, 0] * report.losses[:, 1]
            loss_sums[:, 1] += report.losses[:, 1]
            failed += report.failed_clients
            failed_edge_count += report.failed_edges
            self.communication.client_edge_messages += report.client_edge_messages
            self.communication.client_edge_bytes += report.client_edge_bytes
            clock.edge_time[report.edge] = report.seconds
        answered = [r for r in reports if r.model is not None]
        if answered:
            edges = np.array([r.edge for r in answered], dtype=np.int64)
            weights = np.bincount(edge_of, weights=self.weights, minlength=num_edges)[edges]
            device = next(iter(self.global_params.values())).device
            models = {k: torch.stack([r.model[k].to(device) for r in answered])  # type: ignore[index]
                      for k in self.global_params}
            self.aggregate_edges(cloud_round, models, edges, weights)
        reported = loss_sums[:, 1] > 0
        round_losses = loss_sums[reported, 0] / loss_sums[reported, 1]
        out: dict[str, Any] = {
            "local_train_loss": float(np.mean(round_losses)) if reported.any() else None,
            "failed_clients": failed, "failed_edges": failed_edge_count}
        if unreached:
            out["unreached_edges"] = unreached
        return out
