"""Asynchronous edges on real processes: the cloud aggregates the first K edge reports it
really receives (``fedhier deploy local --edges E --async-buffer K``).

The round is :class:`fedhier.round.asynchrony.edges.BufferedRounds`'s (the simulation's: the K
accepted reports, staleness s = aggregations since the job's start model, the run's rule
(:mod:`fedhier.round.asynchrony.rules`), dropped past ``max_staleness``,
:mod:`fedhier.round.asynchrony.reports`), with three parts
replaced for edge servers (:mod:`fedhier.round.tiers.jobs`):

* **jobs run remotely**: an idle edge gets a job (:class:`fedhier.round.tiers.jobs.ServerJob`: the
  G / I edge rounds of cloud round ``version + 1`` from the current global model, what the
  simulation trains for it) pushed to its server without waiting
  (:class:`AsyncEdgeTierExecutor`: ``submit``); the job's result is unknown until its report
  comes back;
* **the arrival order is a fact**: the next report taken is the first one the cloud really
  receives (:class:`fedhier.round.asynchrony.arrival_order.ReceivedOrder`), and every cloud
  aggregation's order is written to the run folder's ``arrivals.jsonl``
  (:mod:`fedhier.round.asynchrony.arrival_order`). A replay (``--replay-arrivals``,
  ``AsyncEdges.replay``) or a ``--resume`` takes the reports in the recorded order instead, waiting
  for those edges (:class:`~fedhier.round.asynchrony.arrival_order.RecordedOrder`): the same model
  again;
* **reports are edge aggregates**: a server answers with its clients' level-1 aggregate and
  their total weight W_e, not every client's model; the merge is
  :func:`fedhier.round.asynchrony.reports.merge_reports` over one stand-in client per report
  carrying W_e, with the mean at level 1 (the edge already applied its rule): the simulation's new
  model up to the float rounding of averaging averages (as synchronous edge servers).

What differs from the simulation's records, by construction: a job's losses, failure
counts and client-edge traffic are known when its report arrives, so they count in the
cloud round that takes the report (the simulation counts them when the job starts), and no
per-round evaluation on the clients runs (its messages would wait behind the busy edges'
jobs; the cloud's central evaluation on the test set runs every round). The models, the
central metrics, ``async_reports`` and ``stale_dropped`` are the simulation's for the same
order. Per-edge periods run inside the jobs (each I_i divides the cloud period, so a job
holds whole periods of its edge, as a synchronous server's job does; the cloud counts each
edge's aggregations in its last job, :meth:`BufferedServerRounds._count_aggregations`). Two
levels only (clients, edges, cloud), static clients.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedhier.common.errors import ConfigError, Refusal
from fedhier.round.asynchrony.arrival_order import (
    ArrivalOrder,
    ArrivalsLog,
    ReceivedOrder,
    RecordedOrder,
    RecordingOrder,
    arrivals_path,
    read_arrivals,
)
from fedhier.round.asynchrony.edges import BufferedRounds, EdgeTraining
from fedhier.round.asynchrony.reports import merge_reports
from fedhier.round.loop import CloudStep, Executor, HierarchicalSGD, HSGDSettings
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.round.tiers.servers import check_connected


class AsyncEdgeTierExecutor(Executor, Protocol):
    """The cloud's executor of asynchronous edge servers
    (:class:`fedhier.strategies.edge.async_executor.AsyncEdgeServersExecutor`)."""

    def submit(self, jobs: list[ServerJob]) -> None:
        """Send each job to its server; return at once."""
        ...

    def receive(self, edges: frozenset[int]) -> int:
        """Block until the report of a job of one of ``edges`` is in; its edge (the first
        one in; a server past the timeout: a report with ``reached`` False)."""
        ...

    def report(self, edge: int) -> EdgeReport:
        """The report :meth:`receive` returned ``edge`` for (taken out)."""
        ...


#: What asynchronous edge servers refuse (docs/hsgd.md's table).
REFUSALS = (
    Refusal("asynchronous edge servers (`--edge-servers --async-buffer`) with `--regions`",
            "not yet on real processes: the regions' buffers run in the simulation only",
            ("--edge-servers", "--groups", "4,2", "--periods", "5,10,20", "--async-buffer", "1"),
            "asynchronous edge servers need two levels"),
    Refusal("asynchronous edge servers with `--diagnostics-every`",
            "not yet on real processes: the edges are busy with jobs between aggregations",
            ("--edge-servers", "--async-buffer", "2", "--diagnostics-every", "1"),
            "asynchronous edge servers do not query the clients"),
)

def check_async_edge_tier(settings: HSGDSettings | Any) -> None:
    """Refuse, in one line, what asynchronous edge servers do not run (``settings``: an
    HSGDSettings or a RunConfig)."""
    groups = tuple(settings.groups)
    if len(groups) > 1:
        raise ConfigError("asynchronous edge servers need two levels (no --regions): the "
                          "regions' buffers run in the simulation only (region_buffer)")
    if getattr(settings, "diagnostics_every", 0):
        raise ConfigError("asynchronous edge servers do not query the clients between "
                          "aggregations (their edges are busy): use diagnostics_every 0")


def edge_level_mean(aggregators: tuple[str, ...], levels: int) -> tuple[str, ...]:
    """The per-level rules of a merge over edge aggregates: the mean at the edges (each
    report is one edge's own aggregate already), the run's rules above."""
    return ("mean", *(aggregators[0] if len(aggregators) == 1 else aggregators[level - 1]
                      for level in range(2, levels + 1)))


class BufferedServerRounds(BufferedRounds):
    """The cloud rounds of asynchronous edge servers (the module docstring): the simulation's
    buffer (:class:`BufferedRounds`) over jobs that run remotely.

    Args:
        log: where each cloud aggregation's arrival order is written (None: nowhere);
        replay: cloud round -> the edges to take, in order (then the real order).
    """

    def __init__(self, sgd: HierarchicalSGD, *, log: ArrivalsLog | None = None,
                 replay: dict[int, list[int]] | None = None) -> None:
        check_async_edge_tier(sgd.settings)
        super().__init__(sgd)
        self.log = log
        self.replay = dict(replay or {})
        self.unsent: list[int] = []  # restored jobs in flight: sent again at the next collect
        self.reported_weight: dict[int, float] = {}  # edge -> W_e of its last report
        self._stats: dict[str, Any] = {"losses": [], "failed_clients": 0, "failed_edges": 0}
        self._recording: RecordingOrder | None = None

    def setup(self, executor: Executor) -> None:
        check_connected(self.sgd, executor)
        super().setup(executor)
        self.unsent = sorted(self.jobs)  # a resumed run's jobs in flight: their reports died
        remote: AsyncEdgeTierExecutor = executor  # type: ignore[assignment]
        order: ArrivalOrder = ReceivedOrder(lambda edges: self._receive(remote, edges))
        if self.replay:
            def wait(edge: int) -> None:  # the recorded edge's report, whenever it comes
                self._receive(remote, frozenset([edge]))

            order = RecordedOrder(self.replay, order, wait=wait)
        self._recording = RecordingOrder(order)
        self.arrivals = self._recording

    # ---------------------------------------------------------------- jobs out, reports in
    def _start_jobs(self, executor: Executor, stats: dict[str, Any]) -> None:
        """Every idle edge gets a job from the current global model, sent at once; its
        result comes with its report (:meth:`_receive`)."""
        clock = self.sgd._clock()
        edges = sorted(self.idle)
        edge_of = self.training_map()
        for edge in edges:
            clock.edge_time[edge] = self.idle[edge]
            for key, value in self.sgd.edge_models.items():
                value[edge] = self.sgd.global_params[key]
            self.jobs[edge] = EdgeTraining(edge, self.version, dict(self.sgd.global_params),
                                      float(self.idle[edge]), None,
                                      np.zeros(0, dtype=np.int64),
                                      np.flatnonzero(edge_of == edge))
        self.idle = {}
        self._count_aggregations(edges)
        self._send(executor, edges)

    def _count_aggregations(self, edges: list[int]) -> None:
        """Per-edge periods: each of ``edges`` has its job's aggregations counted (the
        record's ``edge_aggregations``, each edge's in its last job): every edge round of
        cloud round ``version + 1`` its period ends in, as
        :func:`fedhier.round.tiers.jobs.schedule_keys` counts a synchronous server's job."""
        periods = self._edge_periods()
        if periods is None or not edges:
            return
        num_edges = self.sgd._hierarchy().num_nodes(1)
        if len(periods.aggregations) != num_edges:
            periods.aggregations = np.zeros(num_edges, dtype=np.int64)
        counts = np.zeros(num_edges, dtype=np.int64)
        for edge_round in self.sgd.settings.edge_rounds_of(self.version + 1):
            counts += periods.levels(edge_round, num_edges) > 0
        periods.aggregations[edges] = counts[edges]

    def _send(self, executor: Executor, edges: list[int]) -> None:
        """Push the jobs of ``edges`` (``job.finish`` holds its start second until its
        report is in)."""
        hierarchy, clock = self.sgd._hierarchy(), self.sgd._clock()
        jobs = []
        for edge in edges:
            job = self.jobs[edge]
            seconds = clock.edge_time.copy()
            seconds[edge] = job.finish
            jobs.append(ServerJob(edge, job.version + 1, job.base, hierarchy.edge_of_client(),
                                  self.sgd._info().num_examples, seconds,
                                  parents=tuple(hierarchy.parents[1:])))
        executor.submit(jobs)  # type: ignore[attr-defined]

    def _receive(self, executor: AsyncEdgeTierExecutor, edges: frozenset[int]) -> int:
        """Wait for a report of one of ``edges``; fill its job in; returns its edge."""
        edge = executor.receive(edges)
        report = executor.report(edge)
        job, stats = self.jobs[edge], self._stats
        members = job.members if job.members is not None else np.zeros(0, dtype=np.int64)
        rounds = self.sgd.settings.edge_rounds_per_cloud_round
        if not report.reached:  # as a synchronous round counts a server that did not answer
            stats["failed_clients"] += len(members) * rounds
            stats["failed_edges"] += rounds
            return edge
        device = next(iter(self.sgd.global_params.values())).device
        if report.model is not None and len(members):
            job.models = {k: v.to(device).unsqueeze(0) for k, v in report.model.items()}
            job.survivors = members[:1].copy()
        job.finish = float(report.seconds[edge])
        self.sgd._clock().edge_time[edge] = job.finish
        self.reported_weight[edge] = float(report.weight)
        losses = np.asarray(report.losses, dtype=np.float64).reshape(-1, 2)
        stats["losses"].extend(losses[losses[:, 1] > 0, 0].tolist())
        stats["failed_clients"] += report.failed_clients
        stats["failed_edges"] += report.failed_edges
        report.add_traffic(self.sgd.communication)
        return edge

    def _collect(self, executor: Executor, stats: dict[str, Any],
                 ) -> tuple[list[tuple[EdgeTraining, int]], float, int]:
        """The simulation's buffer over the reports as they really come (or as recorded);
        the order is written to the arrivals file."""
        self._stats = stats
        if self.unsent:
            self._send(executor, self.unsent)
            self.unsent = []
        accepted, at_cloud, dropped = super()._collect(executor, stats)
        order = self._recording.take() if self._recording is not None else []
        if self.log is not None:
            self.log.write(self.version + 1, order, [job.edge for job, _ in accepted])
        return accepted, at_cloud, dropped

    def _aggregate(self, accepted: list[tuple[EdgeTraining, int]], cloud_round: int = 0) -> None:
        """The new global model from the accepted edge aggregates: one stand-in client per
        report (its first member) weighing the edge's W_e, the mean at level 1."""
        weights = np.zeros_like(self.sgd.weights)
        stand_ins: list[tuple[EdgeTraining, int]] = []
        for job, staleness in accepted:
            if job.models is None:
                continue
            rep = job.survivors[:1].copy()
            weights[rep] = self.reported_weight[job.edge]
            stand_ins.append((dataclasses.replace(job, members=rep, survivors=rep), staleness))
        hierarchy = self.sgd._hierarchy()
        new = merge_reports(stand_ins, self.sgd.global_params, weights, hierarchy,
                            edge_level_mean(self.sgd.settings.aggregators, hierarchy.num_levels),
                            self.sgd.node_models, self.sgd.cloud_step, cloud_round,
                            self.sgd.settings.asynchronous.rule)
        if new is not None:
            self.sgd.global_params = new


def async_edge_tier(settings: HSGDSettings, cloud_step: CloudStep | None,
                    folder: Path, resume: Any = None) -> HierarchicalSGD:
    """The cloud of asynchronous edge servers writing ``folder``'s arrivals file: a resumed
    run (``resume``: its checkpoint) replays the rounds recorded after the checkpoint, a
    replay (``settings.asynchronous.replay``: ``--replay-arrivals``) the file it names."""
    log = ArrivalsLog(arrivals_path(folder) if Path(folder).is_dir() else Path(folder))
    replay: dict[int, list[int]] = {}
    if resume is not None:
        replay = log.cut(int(resume.round))
    elif log.path.exists():
        log.path.unlink()  # a fresh run writes its own
    source = settings.asynchronous.replay
    if source and not replay:
        replay = read_arrivals(source)
    return HierarchicalSGD(settings, cloud_step,
                           rounds=functools.partial(BufferedServerRounds, log=log, replay=replay))


def with_replayed_arrivals(algorithm: HierarchicalSGD) -> HierarchicalSGD:
    """A simulated asynchronous run fed a recorded order (``--replay-arrivals``): its cloud
    takes the reports in that order for the rounds recorded, then by the simulated clock."""
    source = algorithm.settings.asynchronous.replay
    rounds = algorithm.rounds
    if source and isinstance(rounds, BufferedRounds) \
            and not isinstance(rounds, BufferedServerRounds):
        if rounds.regions is not None:
            raise ConfigError("replayed arrivals are of two-level runs (no region_buffer)")
        rounds.arrivals = RecordedOrder(read_arrivals(source), rounds.arrivals)
    return algorithm
