"""Asynchronous edges on engine ``vectorized-ray``: the cloud of asynchronous edge servers
over the shard actors, taking the reports in the simulated clock's order.

The round is :class:`fedhier.round.tiers.asynchronous.BufferedServerRounds`' (the simulation's
K-buffer, staleness weights and drops, :mod:`fedhier.round.asynchrony.reports`; the merge of edge
aggregates), with two parts of its own:

* **the executor** (:class:`RayShardAsyncExecutor`, an
  :class:`~fedhier.round.tiers.asynchronous.AsyncEdgeTierExecutor`): ``submit`` sends each worker
  the jobs of its edges among those starting, as one Ray call (the edges of a worker that are
  still in flight are not in it: :func:`~fedhier.engines.vectorized_ray.subtree.run_jobs`
  trains the call's edges' clients only), and keeps the ObjectRefs; ``receive`` takes the
  reports of the earliest submission holding one of the edges asked for. Edges of one worker
  start at different cloud rounds (from different global models), so each start is a call of
  its own; a call is a whole job from its own start model
  (:func:`fedhier.round.tiers.jobs.start_job`: no state between calls), and an actor runs its calls
  one after the other. The cloud below receives every report in flight before it takes one, so
  in practice a worker's previous call is done when the next comes (the edges that start
  together still train in parallel across the workers). The edge rounds' train losses of one
  submission (the simulation's batch of edges that start together) are combined as the
  simulation reports them (one weighted mean per edge round,
  :class:`~fedhier.engines.vectorized.chunks.LossMeans`), on its first report;
* **the arrival order is the simulated clock's** (:class:`ShardsSimulatedOrder`, as in
  ``--engine vectorized``): before each choice every report in flight is received (its
  job's finish second is then known), and the report whose training ends first is taken.
  Reports are thus taken in the cloud round whose jobs started them, as the simulation
  counts them, and a checkpoint holds only received jobs (a ``--resume`` sends none again).

Numbers: the simulation's (``--engine vectorized --async-buffer K``) up to the float
rounding of averaging the edges' averages (1e-6; tests/test_vectorized_ray_async.py), with
per-edge periods too (a job holds whole periods of its edge). Two levels, static clients, no
kept optimizer state (:func:`check_sharded_async`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError, Refusal
from fedhier.engines.vectorized.chunks import LossMeans
from fedhier.engines.vectorized_ray.executor import (
    RayShardExecutor,
    models_down,
    models_up,
    shared_start_models,
)
from fedhier.round.asynchrony.arrival_order import RecordingOrder, SimulatedOrder
from fedhier.round.loop import Executor, HierarchicalSGD
from fedhier.round.tiers.asynchronous import BufferedServerRounds, check_async_edge_tier
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.settings.run_config import RunConfig

#: What engine ``vectorized-ray`` refuses with asynchronous edges (docs/hsgd.md's table).
REFUSALS = (
    Refusal("`--engine vectorized-ray --async-buffer` with mobility or `--regroup-every`",
            "not yet: jobs in flight keep their clients, and a worker holds whole edges; "
            "`--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--async-buffer", "2", "--mobility-rate", "0.5"),
            "engine vectorized-ray with async_buffer needs static clients"),
    Refusal("`--engine vectorized-ray --async-buffer` with `--optimizer-state keep`",
            "not yet: a checkpoint's jobs in flight run again on `--resume`, from kept state "
            "that already holds their training; `--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--async-buffer", "2", "--momentum", "0.5",
             "--optimizer-state", "keep"), "engine vectorized-ray with async_buffer needs "
            "optimizer_state=reset"),
    Refusal("`--engine vectorized-ray --async-buffer` on three or more levels (so also "
            "`--region-buffer`)",
            "not yet: the regions' buffers run in the one-process engines only; "
            "`--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--groups", "4,2", "--periods", "5,10,20",
             "--async-buffer", "1"), "engine vectorized-ray with async_buffer needs two levels"),
    Refusal("`--engine vectorized-ray --async-buffer` with `--diagnostics-every`",
            "not yet: the edges are busy with jobs between aggregations; "
            "`--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--async-buffer", "2", "--diagnostics-every", "1"),
            "engine vectorized-ray with async_buffer does not query the clients"),
)

def check_sharded_async(cfg: RunConfig) -> None:
    """Refuse, in one line, asynchronous edges the sharded engine does not run."""
    if not cfg.asynchronous().active:
        return
    if cfg.clients_move():
        raise ConfigError("engine vectorized-ray with async_buffer needs static clients (no "
                          "mobility, no regroup_every): jobs in flight keep their clients")
    if cfg.keeps_client_state():
        raise ConfigError("engine vectorized-ray with async_buffer needs optimizer_state="
                          "reset: a checkpoint's jobs in flight run again on --resume, "
                          "from kept state that already holds their training")
    try:
        check_async_edge_tier(cfg)
    except ConfigError as error:
        raise ConfigError(str(error).replace("asynchronous edge servers need",
                                             "engine vectorized-ray with async_buffer needs")
                          .replace("asynchronous edge servers do not",
                                   "engine vectorized-ray with async_buffer does not")
                          ) from None


@dataclass
class Submission:
    """The worker calls of one :meth:`RayShardAsyncExecutor.submit` (ObjectRefs of lists of
    reports) and their edges."""

    refs: list[Any]
    edges: frozenset[int]
    model_bytes: int  # one model's


@dataclass
class RayShardAsyncExecutor(RayShardExecutor):
    """The shard actors as asynchronous edge servers (the module docstring)."""

    in_flight: list[Submission] = dataclasses.field(default_factory=list)
    arrived: dict[int, EdgeReport] = dataclasses.field(default_factory=dict)

    def submit(self, jobs: list[ServerJob]) -> None:
        """One Ray call per worker and cloud round with the jobs of its edges; at once."""
        assert self.placement is not None, "the shards start at the cloud's setup"
        calls: dict[tuple[int, int], list[ServerJob]] = {}
        for job in shared_start_models(jobs):
            calls.setdefault((int(self.placement[job.edge]), job.cloud_round), []).append(job)
        refs = [self.actors[worker].run.remote(mine)
                for (worker, _), mine in sorted(calls.items())]
        size = self.whole.model_bytes(jobs[0].params)
        self.bytes_between += size * sum(models_down(mine) for mine in calls.values())
        self.in_flight.append(Submission(refs, frozenset(job.edge for job in jobs), size))

    def receive(self, edges: frozenset[int]) -> int:
        """The lowest of ``edges`` whose report is in, after waiting for the earliest
        submission that holds one (its reports all come in together)."""
        import ray

        while not edges & self.arrived.keys():
            submission = next((s for s in self.in_flight if s.edges & edges), None)
            if submission is None:
                raise RuntimeError(f"no job in flight for edges {sorted(edges)}")
            self.in_flight.remove(submission)
            reports = sorted((r for call in ray.get(submission.refs) for r in call),
                             key=lambda r: r.edge)
            self.bytes_between += submission.model_bytes * models_up(reports)
            for report in with_batch_losses(reports):
                self.arrived[report.edge] = report
        return min(edges & self.arrived.keys())

    def report(self, edge: int) -> EdgeReport:
        return self.arrived.pop(edge)


def with_batch_losses(reports: list[EdgeReport]) -> list[EdgeReport]:
    """``reports`` of one submission with their edge rounds' train losses combined as the
    simulation's batch reports them (per edge round, the weighted mean over all the batch's
    clients: :class:`LossMeans`), on the first report; the others carry none."""
    if not reports:
        return reports
    rounds = max(len(r.losses) for r in reports)
    means = LossMeans(rounds)
    for report in reports:
        for k, (loss, weight) in enumerate(np.asarray(report.losses).reshape(-1, 2).tolist()):
            if weight > 0:
                means.add(k, loss, weight)
    none = np.zeros((rounds, 2))
    return [dataclasses.replace(report, losses=means.means() if i == 0 else none)
            for i, report in enumerate(reports)]


class ShardsSimulatedOrder:
    """The simulated clock's order (:class:`~fedhier.round.asynchrony.arrival_order.SimulatedOrder`)
    over jobs that run remotely: ``receive_all()`` first brings every report in flight in (its job's
    finish second then known)."""

    def __init__(self, receive_all: Callable[[], None]) -> None:
        self.receive_all = receive_all
        self.simulated = SimulatedOrder()

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        self.receive_all()
        return self.simulated.next_edge(jobs, version)


class ShardedBufferedRounds(BufferedServerRounds):
    """The cloud rounds of engine ``vectorized-ray`` with asynchronous edges (the module
    docstring); the shards start at the loop's set-up (:meth:`RayShardExecutor.attach`)."""

    def __init__(self, sgd: HierarchicalSGD) -> None:
        super().__init__(sgd)
        self.outstanding: set[int] = set()  # edges whose job was sent, report not received

    def setup(self, executor: Executor) -> None:
        super().setup(executor)
        self.unsent = []  # a checkpoint's jobs were received before it: complete
        self._recording = RecordingOrder(ShardsSimulatedOrder(
            lambda: self._receive_all(executor)))  # type: ignore[arg-type]
        self.arrivals = self._recording

    def _send(self, executor: Executor, edges: list[int]) -> None:
        super()._send(executor, edges)
        self.outstanding.update(edges)

    def _receive_all(self, executor: RayShardAsyncExecutor) -> None:
        """Every report in flight, taken in (:meth:`BufferedServerRounds._receive`)."""
        while self.outstanding:
            self.outstanding.discard(self._receive(executor, frozenset(self.outstanding)))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["async"]["reported_weight"] = dict(self.reported_weight)
        return state

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.reported_weight = dict(state["async"].get("reported_weight", {}))

