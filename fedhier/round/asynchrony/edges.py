"""Asynchronous, buffered edges: the cloud aggregates the first K edge reports.

Each edge runs *jobs*: from the global model of some version v (the number of cloud
aggregations so far), its clients do the G / I edge rounds of a cloud round (aggregations
below the cloud on their usual schedule, with the edge round and step numbers of cloud round
v + 1, so mini-batches, participation, stragglers and faults are those of that round), and
the edge then uploads its clients' last models. On the simulated clock
(:mod:`fedhier.round.clock`) edges finish at different times; uploads queue on the cloud's
link; the cloud aggregates as soon as K reports have arrived, and sends the new model back
to those K edges, which start their next job from it. The others keep going.

A report that arrives s aggregations after its job's version is *stale* by s: over S
(``max_staleness``) it is dropped and its edge restarts from the current model; otherwise it
enters the new model by the run's rule (FedBuff, FedAsync or the shifted mean,
:mod:`fedhier.round.asynchrony.rules`, discounted by its staleness), through the run's aggregators
and cloud step (:mod:`fedhier.round.asynchrony.reports`). With K = N (every report fresh) this is
exactly the synchronous round of :class:`fedhier.round.loop.HierarchicalSGD`, bit for bit, under
every rule that reduces to it (FedBuff with η_g = 1, FedAsync with α = 1, the shifted mean).

**Membership** (who is in a job). At the start of each cloud round (after each
aggregation) a regrouping happens when due (``regroup_every``), and the mobility model
(rate or trace) draws the client -> edge map of each of the round's edge rounds from the
grouping, as in a synchronous round; the grouping then becomes the map at the round's end.
*Jobs in flight keep their clients*: a client still in a job of another edge stays with it
until its report is in. Every other client follows the round's maps inside the jobs that
start: it trains in edge round k with the edge the map of edge round k puts it at (when
that edge's job is among those starting; otherwise it waits for that edge's next job),
and a client that moved in edge round k > 1 starts it from its old edge's model under the
``carry`` handoff, from its new edge's under ``fresh``. With K = N all edges start together
each round: regrouping and mobility are synchronous H-SGD, bit for bit.

**Deeper trees**: the cloud buffers the first K edge reports to reach the edges' parents
(regions); each region holds its accepted reports and, once the last of them is in, sends
one aggregate up its parent's link, as a synchronous region does, and the new model comes
back down the same way. Inside the jobs the levels between aggregate on their schedule over
the edges whose jobs started together (from the same global model); an edge outside that
batch neither waits for nor joins such an aggregation. With K = N this is synchronous
H-SGD bit for bit, traffic and simulated time included. Regions that buffer their own
children's reports (``region_buffer``) are :mod:`fedhier.round.asynchrony.regions`.

Jobs train when they start (their result depends only on their start model, their round
numbers and their clients), so executors run them as ordinary edge rounds restricted to the
starting edges' clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.aggregators.averaging import aggregator
from fedhier.round.asynchrony.arrival_order import ArrivalOrder, SimulatedOrder
from fedhier.round.asynchrony.regions import RegionBuffers, region_buffers
from fedhier.round.asynchrony.reports import merge_reports
from fedhier.round.loop import CloudStep, Executor, HierarchicalSGD, HSGDSettings, Params
from fedhier.round.membership import Handoff, Membership, Regroup, RoundPace
from fedhier.round.schedule import EdgePeriods
from fedhier.round.tiers.jobs import train_edges
from fedhier.round.traffic import BatchCommunication
from fedhier.tree.hierarchy import Hierarchy


@dataclass
class EdgeTraining:
    """An edge's G local steps from the global model of ``version``.

    Attributes:
        edge: the edge; version: cloud aggregations before its start model;
        base: that start model (name -> [*shape]); finish: simulated second its training ends;
        models: its clients' last models that survived (name -> [s, *shape]; None: none did);
        survivors: int64 [s], those clients, sorted;
        members: int64 [m], the clients it trained (its edge's when it started), sorted
            (None in checkpoints written before membership could change: the edge's);
        reference: the edge's model before its last edge round (name -> [*shape]), kept
            only when an aggregator measures from a start model (``clip``), else None.
    """

    edge: int
    version: int
    base: Params
    finish: float
    models: Params | None
    survivors: np.ndarray
    members: np.ndarray | None = None
    reference: Params | None = None


class JobMoves:
    """The membership inside a batch of jobs that start together (a
    :class:`fedhier.round.membership.MembershipRule`): while :attr:`maps` is set, edge round k
    of the batch has its client -> edge map ``maps[k]``; a client that moved into its edge in
    edge round k > 1 starts it from its old edge's model under the ``carry`` handoff, and
    drops any model of its own under ``fresh``, as in a synchronous round."""

    def __init__(self, handoff: str) -> None:
        self.handoff = handoff
        self.maps: np.ndarray | None = None  # int64 [G / I, n] while a batch trains

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Regroup,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        return hierarchy, {}

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        if self.maps is None:
            return hierarchy, None
        k = (edge_round - 1) % pace.edge_rounds
        old, new = hierarchy.edge_of_client(), self.maps[k]
        moved = np.flatnonzero(new != old)
        carry = self.handoff == "carry"
        handoff = None
        if len(moved):
            start = None
            if carry and k:
                start = new.copy()
                start[moved] = old[moved]
            handoff = Handoff(start, np.zeros(0, dtype=np.int64) if carry else moved)
        return hierarchy.with_edge_map(new), handoff

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        return {}


class BufferedRounds:
    """The cloud rounds of asynchronous edges: each aggregates the first K edge reports (a
    :class:`fedhier.round.rounds.CloudRounds` part; see the module docstring). Inside a job
    the clients move as :class:`JobMoves` says (the loop's membership in such a run); the
    regrouping and the mobility maps are drawn here, at each aggregation."""

    def __init__(self, sgd: HierarchicalSGD) -> None:
        self.sgd = sgd
        settings = sgd.settings
        self.moves = JobMoves(settings.mobility.handoff)
        sgd.membership = Membership([self.moves])
        self.version = 0  # cloud aggregations so far
        self.jobs: dict[int, EdgeTraining] = {}  # edge -> its job in flight
        self.idle: dict[int, float] = {}  # edge -> simulated second it got the global model
        self.link_free = -math.inf  # the cloud link is busy uploading until then
        self.relay_free: dict[str, float] = {}  # "level:node" -> the same for a node's link
        self.now = 0.0  # simulated second of the last cloud aggregation's broadcast
        self._restored_edge_models: Params | None = None  # from a checkpoint
        #: int64 [R, n]: the mobility model's map of each edge round of the cloud round
        #: (None: static clients); a batch's maps follow it for clients not in a job
        self.round_maps: np.ndarray | None = None
        #: buffers of the nodes between the edges and the cloud (None: they relay)
        self.regions: RegionBuffers[EdgeTraining] | None = region_buffers(settings.asynchronous)
        #: which report the cloud takes next (fedhier.round.asynchrony.arrival_order; two-level
        #: trees)
        self.arrivals: ArrivalOrder = SimulatedOrder()

    @property
    def communication(self) -> Any:
        """The loop's traffic counters."""
        return self.sgd.communication

    @property
    def model_bytes(self) -> int:
        return self.sgd.model_bytes

    def _hierarchy(self) -> Hierarchy:
        return self.sgd._hierarchy()

    # ---------------------------------------------------------------- one cloud round
    def run(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Wait for K fresh-enough reports, aggregate them; returns the training keys."""
        membership = self._change_membership(executor, cloud_round)
        hierarchy = self.sgd._hierarchy()
        if self.sgd.cloud_step is not None:  # the model its next update starts from
            self.sgd.cloud_step.begin(cloud_round, self.sgd.global_params,
                                  hierarchy.num_nodes(hierarchy.num_levels - 1))
        stats: dict[str, Any] = {"losses": [], "failed_clients": 0, "failed_edges": 0}
        accepted, at_cloud, dropped = self._collect(executor, stats)
        self._aggregate(accepted, cloud_round)
        edges = [job.edge for job, _ in accepted]
        reached = self._send_down(edges, at_cloud)
        self.now = float(reached.max())
        for (job, _), when in zip(accepted, reached.tolist(), strict=True):
            self.idle[job.edge] = when
        self.version += 1
        losses = stats["losses"]
        out: dict[str, Any] = {
            "local_train_loss": float(np.mean(losses)) if losses else None,
            "failed_clients": stats["failed_clients"], "failed_edges": stats["failed_edges"],
            "async_reports": [[job.edge, staleness] for job, staleness in accepted],
            "stale_dropped": dropped, **membership}
        if (periods := self._edge_periods()) is not None:  # each edge's, in its last job
            out["edge_aggregations"] = periods.aggregations.tolist()
        return out

    def _collect(self, executor: Executor, stats: dict[str, Any],
                 ) -> tuple[list[tuple[EdgeTraining, int]], float, int]:
        """The cloud's buffer: the first K edge reports to reach their parents, each with its
        staleness; the simulated second the cloud has them all; how many were dropped."""
        if self.regions is not None:  # the regions buffer: the cloud counts their reports
            return self.regions.collect(self, executor, stats, self.now)
        s = self.sgd.settings.asynchronous
        accepted: list[tuple[EdgeTraining, int]] = []
        dropped = 0
        arrival = self.now
        arrivals: list[float] = []  # each accepted report's arrival at the edge's parent
        while len(accepted) < s.buffer:
            if self.idle:
                self._start_jobs(executor, stats)
            job = self.jobs.pop(self.arrivals.next_edge(self.jobs, self.version))
            arrival = self._send_up(job)
            staleness = self.version - job.version
            if staleness > s.max_staleness:  # too old: the edge starts over
                dropped += 1
                self._restart(job.edge, arrival)
                continue
            accepted.append((job, staleness))
            arrivals.append(arrival)
        edges = [job.edge for job, _ in accepted]
        return accepted, self._forward(edges, arrivals) if edges else arrival, dropped

    def _restart(self, edge: int, when: float) -> None:
        """``edge``'s report was dropped at second ``when``: the current model goes down to
        it, and it starts over once it has it."""
        self.idle[edge] = float(self._send_down([edge], when)[0])

    def _link(self, level: int, node: int) -> float:
        """When the link into level-``level`` node ``node`` is free (the cloud's: level L)."""
        if level == self.sgd._hierarchy().num_levels:
            return self.link_free
        return self.relay_free.get(f"{level}:{node}", -math.inf)

    def _queue_on(self, level: int, node: int, ready: float, count: bool = True) -> float:
        """One model ready at ``ready`` goes up the link into ``node`` (level ``level``)
        after the models already queued there; returns its arrival. ``count``: add it to the
        traffic now (else the caller does, when the report is taken in)."""
        arrivals, free = self.sgd._clock().upload_queue(np.array([ready]), self._link(level, node),
                                                    self.sgd.model_bytes)
        if level == self.sgd._hierarchy().num_levels:
            self.link_free = free
        else:
            self.relay_free[f"{level}:{node}"] = free
        if count:
            self.sgd.communication.add_edge_cloud(1, self.sgd.model_bytes)
        return float(arrivals[0])

    def _send_up(self, job: EdgeTraining, count: bool = True) -> float:
        """A report goes up to the edge's parent (the cloud in a two-level tree, else its
        region), queuing on that node's link; returns when it arrives there."""
        return self._queue_on(2, int(self.sgd._hierarchy().edges_under(2)[job.edge]), job.finish,
                              count)

    def _forward(self, edges: list[int], arrivals: list[float]) -> float:
        """Above the edges' parents, each node whose subtree holds accepted reports sends
        one aggregate up once the last of them is in, queuing on its parent's link (as a
        synchronous aggregation does); returns when the cloud has them all."""
        hierarchy = self.sgd._hierarchy()
        chosen = np.asarray(edges, dtype=np.int64)
        ready = np.asarray(arrivals, dtype=np.float64)  # at each edge's level-2 node
        for level in range(3, hierarchy.num_levels + 1):
            below = hierarchy.edges_under(level - 1)[chosen]
            nodes = np.unique(below)
            last = np.array([ready[below == node].max() for node in nodes])
            parent = hierarchy.edges_under(level)[chosen]
            for i in np.lexsort((nodes, last)).tolist():
                arrival = self._queue_on(level, int(parent[below == nodes[i]][0]), last[i])
                ready[below == nodes[i]] = arrival
        return float(ready.max())

    def _send_down(self, edges: list[int], start: float) -> np.ndarray:
        """float64 [len(edges)]: when the cloud's model, sent at ``start``, reaches each of
        ``edges``: every node sends it to those of its children that lead to ``edges``, one
        after another over its link (times summed from the edges up, as the synchronous
        clock sums them)."""
        hierarchy, clock = self.sgd._hierarchy(), self.sgd._clock()
        chosen = np.asarray(edges, dtype=np.int64)
        down = np.zeros(len(chosen))
        for level in range(2, hierarchy.num_levels + 1):
            sender = hierarchy.edges_under(level)[chosen]
            pairs = np.unique(np.stack([sender, hierarchy.edges_under(level - 1)[chosen]]),
                              axis=1)
            children = np.bincount(pairs[0], minlength=hierarchy.num_nodes(level))
            down = down + clock.model.transfer_seconds("edge-cloud", children[sender],
                                                       self.sgd.model_bytes)
            self.sgd.communication.add_edge_cloud(pairs.shape[1], self.sgd.model_bytes)
        return start + down

    def _aggregate(self, accepted: list[tuple[EdgeTraining, int]], cloud_round: int = 0) -> None:
        """The new global model from the accepted (job, staleness) reports
        (:func:`fedhier.round.asynchrony.reports.merge_reports`); it stays when none has a
        survivor."""
        grouping = self.sgd._hierarchy().edge_of_client()
        for job, _ in accepted:
            if job.members is None:
                job.members = np.flatnonzero(grouping == job.edge)
        sgd = self.sgd
        new = merge_reports(accepted, sgd.global_params, sgd.weights, sgd._hierarchy(),
                            sgd.settings.aggregators, sgd.node_models, sgd.cloud_step,
                            cloud_round, sgd.settings.asynchronous.rule)
        if new is not None:
            self.sgd.global_params = new

    def _change_membership(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """The grouping of ``cloud_round``: a regrouping when due, then the mobility model's
        maps of the round's edge rounds (:attr:`round_maps`; the grouping becomes the map at
        the round's end); returns the record keys a synchronous round writes for them."""
        s = self.sgd.settings
        mobility = s.mobility
        out: dict[str, Any] = {}
        if self.sgd.regroup_due(cloud_round):
            before = self.sgd._hierarchy()
            self.sgd.hierarchy = self.sgd.group(executor, self.sgd.global_params,
                                                s.seed + cloud_round - 1)
            if mobility.active and mobility.reachability is not None:
                self.sgd.hierarchy = self.sgd.hierarchy.with_edge_map(mobility.respect(
                    before.edge_of_client(), self.sgd.hierarchy.edge_of_client(),
                    self.sgd.hierarchy.num_nodes(1)))
            out = {"regrouped": True,
                   "client_to_edge": self.sgd._hierarchy().edge_of_client().tolist()}
        self.round_maps = None
        if not mobility.active:
            return out
        hierarchy = self.sgd._hierarchy()
        edge_rounds = s.edge_rounds_per_cloud_round
        start = hierarchy.edge_of_client()
        self.round_maps = mobility.maps(s.seed, cloud_round, edge_rounds, start,
                                        hierarchy.num_nodes(1), self.sgd._info().label_histograms)
        previous = np.vstack([start[None], self.round_maps[:-1]])
        moves = [[(cloud_round - 1) * edge_rounds + k + 1, int(c), int(previous[k, c]),
                  int(self.round_maps[k, c])]
                 for k in range(edge_rounds)
                 for c in np.flatnonzero(self.round_maps[k] != previous[k]).tolist()]
        out["moved_clients"] = len(moves)
        if moves:
            self.sgd.hierarchy = hierarchy.with_edge_map(self.round_maps[-1])
            out["moves"] = moves
            out["client_to_edge"] = self.round_maps[-1].tolist()
        return out

    def training_map(self) -> np.ndarray:
        """int64 [n]: each client's edge for a job starting now: its edge in the grouping,
        or, while it is in a job in flight, that job's edge."""
        edge_of = self.sgd._hierarchy().edge_of_client().copy()
        for job in self._pending():
            if job.members is not None:
                edge_of[job.members] = job.edge
        return edge_of

    def _pending(self) -> list[EdgeTraining]:
        """The jobs whose reports the cloud has not aggregated yet (their clients stay)."""
        return [*self.jobs.values(), *(self.regions.pending() if self.regions else [])]

    def _start_jobs(self, executor: Executor, stats: dict[str, Any]) -> None:
        """Train the jobs of every idle edge from the current global model: the G / I edge
        rounds of cloud round ``version + 1``, restricted to those edges' clients."""
        grouping, clock = self.sgd._hierarchy(), self.sgd._clock()
        edges = np.array(sorted(self.idle), dtype=np.int64)
        for edge in edges.tolist():
            clock.edge_time[edge] = self.idle[edge]
            for key, value in self.sgd.edge_models.items():
                value[edge] = self.sgd.global_params[key]
        self.idle = {}
        edge_of = self.training_map()
        if self.round_maps is not None:  # clients not in a job follow the round's moves
            busy = np.zeros(len(edge_of), dtype=bool)
            for job in self._pending():
                if job.members is not None:
                    busy[job.members] = True
            self.moves.maps = np.where(busy[None], edge_of[None], self.round_maps)
            edge_of = self.moves.maps[0]
        periods = self._edge_periods()
        if periods is not None:
            periods.restart(np.isin(edge_of, edges), edges, grouping.num_clients,
                            grouping.num_nodes(1))
        self.sgd.hierarchy = grouping.with_edge_map(edge_of)
        counts = None if periods is None else periods.aggregations.copy()
        try:
            outcome = self._train_batch(executor, edges)
            edge_of = self.sgd._hierarchy().edge_of_client()  # the map of the batch's last round
        finally:
            self.sgd.hierarchy, self.moves.maps = grouping, None
        if periods is not None and counts is not None:  # it counts every edge: keep the batch's
            others = np.setdiff1d(np.arange(len(counts)), edges)
            periods.aggregations[others] = counts[others]
        stats["failed_clients"] += outcome.failed_clients
        stats["failed_edges"] += outcome.failed_edges
        stats["losses"].extend(outcome.losses[outcome.losses[:, 1] > 0, 0].tolist())
        held = outcome.held
        keep_reference = any(aggregator(name).needs_reference
                             for name in self.sgd.settings.aggregators)
        for edge in edges.tolist():
            models, survivors = None, np.zeros(0, dtype=np.int64)
            if held is not None:
                rows = np.flatnonzero(edge_of[held[1]] == edge)
                if len(rows):
                    index = torch.as_tensor(rows, device=next(iter(held[0].values())).device)
                    models = {k: v.index_select(0, index) for k, v in held[0].items()}
                    survivors = held[1][rows]
            reference = ({k: v[edge].clone() for k, v in self.sgd.edge_models.items()}
                         if keep_reference else None)
            self.jobs[edge] = EdgeTraining(edge, self.version, dict(self.sgd.global_params),
                                      float(clock.edge_time[edge]), models, survivors,
                                      np.flatnonzero(edge_of == edge), reference)

    def _edge_periods(self) -> EdgePeriods | None:
        """The per-edge-period schedule (None: equal periods)."""
        return self.sgd.schedule if isinstance(self.sgd.schedule, EdgePeriods) else None

    def _train_batch(self, executor: Executor, edges: np.ndarray) -> Any:
        """:func:`train_edges` for a batch of edges starting together. Above the edges (a
        deeper tree) an aggregation inside the jobs is the batch's: the other edges neither
        hold it up on the clock nor count in its traffic."""
        hierarchy, clock = self.sgd._hierarchy(), self.sgd._clock()
        if hierarchy.num_levels <= 2:
            return train_edges(self.sgd, executor, edges, self.version + 1)
        others = np.setdiff1d(np.arange(hierarchy.num_nodes(1)), edges)
        times = clock.edge_time.copy()
        clock.edge_time[others] = -math.inf
        counted = self.sgd.communication
        self.sgd.communication = BatchCommunication(hierarchy, edges)
        try:
            return train_edges(self.sgd, executor, edges, self.version + 1)
        finally:
            batch, self.sgd.communication = self.sgd.communication, counted
            for key, value in batch.as_dict().items():
                setattr(counted, key, getattr(counted, key) + value)
            clock.edge_time[others] = times[others]

    # ---------------------------------------------------------------- time and checkpoints
    def elapsed_seconds(self) -> float:
        """The simulated second the last cloud aggregation reached its edges."""
        return self.now

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        state["async"] = {"version": self.version, "jobs": list(self.jobs.values()),
                          "idle": dict(self.idle), "link_free": self.link_free,
                          "relay_free": dict(self.relay_free),
                          "edge_aggregations": ([] if (periods := self._edge_periods()) is None
                                                else periods.aggregations.tolist()),
                          "now": self.now, "edge_models": dict(self.sgd.edge_models)}
        if self.regions is not None:
            state["async"]["regions"] = self.regions.state_dict()
        return state

    def load_state_dict(self, state: Any) -> None:
        saved = state.get("async")
        if saved is None:
            raise ConfigError("this checkpoint was written by a synchronous run; resume it "
                              "without async_buffer")
        self.version = saved["version"]
        self.jobs = {job.edge: job for job in saved["jobs"]}
        self.idle = dict(saved["idle"])
        self.link_free = saved["link_free"]
        self.relay_free = dict(saved.get("relay_free", {}))  # {}: checkpoints of two levels
        if (periods := self._edge_periods()) is not None:
            periods.aggregations = np.asarray(saved.get("edge_aggregations", []),
                                              dtype=np.int64)
        self.now = saved["now"]
        self._restored_edge_models = saved["edge_models"]
        if self.regions is not None:
            self.regions.load_state_dict(saved.get("regions"))

    def setup(self, executor: Executor) -> None:
        """After the loop's set-up: a fresh run has every edge idle at second 0 with the
        initial model, a resumed one its checkpointed edges."""
        restored = self._restored_edge_models
        grouping = self.sgd._hierarchy().edge_of_client()
        for job in self._pending():
            if job.members is None:
                job.members = np.flatnonzero(grouping == job.edge)
        if restored is not None:
            device = next(iter(self.sgd.global_params.values())).device
            self.sgd.edge_models = {k: v.to(device) for k, v in restored.items()}
            return
        edges = self.sgd._hierarchy().num_nodes(1)
        self.idle = dict.fromkeys(range(edges), 0.0)
        self.sgd.edge_models = {k: v.unsqueeze(0).repeat(edges, *([1] * v.dim()))
                            for k, v in self.sgd.global_params.items()}


def algorithm_for(settings: HSGDSettings,
                  cloud_step: CloudStep | None = None) -> HierarchicalSGD:
    """The round the settings ask for: synchronous H-SGD, or with asynchronous edges (the
    loop picks its part itself, :func:`fedhier.round.rounds.rounds_for`)."""
    return HierarchicalSGD(settings, cloud_step)
