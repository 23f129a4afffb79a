"""Servers of their own at every level: the H-SGD round split between processes.

In every other engine the edges (and regions ...) are logical: the cloud keeps one model per
node and talks to every client in every edge round. With a *server tier* (``fedhier deploy
local --edges E [--regions R]``, docs/deployment.md#edge-servers) each node between the
clients and the cloud is a server of its own. A node of level l exchanges one model with its
parent per period of the parent's level (a *job*: the parent's model down, the node's
aggregate up) and runs the exchanges with its own children in between:

* an edge (level 1) runs the G_1 / I edge rounds of its job with its own clients
  (:func:`train_edges`, which asynchronous edges use for their jobs too) and aggregates its
  surviving clients at level 1;
* a node above (level l >= 2) sends each child a job per period of its own level
  (:func:`run_children`), aggregates their answers at level l between two jobs and answers
  its parent with the last ones' aggregate;
* the cloud (:class:`fedhier.round.tiers.servers.ServerRounds`, the loop's cloud-round part)
  starts the cloud round, runs its children as a node does (one job each per cloud round),
  sums their counters and losses and takes the cloud step over their aggregates
  (:meth:`HierarchicalSGD.aggregate_edges`).

Every node runs :class:`fedhier.round.loop.HierarchicalSGD` unchanged on the whole tree, so every
draw (participation, stragglers, faults, mini-batches, compute speeds), keyed by the seed, the
client and the round, is the one-process run's: the split run equals it up to the float
rounding of averaging the children's averages instead of all clients at once. Nodes hold no
state between jobs: each job carries the tree and the clients' row counts, so a restarted
process simply takes the next job. Per-edge periods run inside the jobs (each I_i divides the
period above the edges, so a job holds whole periods of every edge; the cloud counts each
edge's aggregations, :func:`schedule_keys`); clients' kept optimizer state stays with the
clients. Clients that move re-attach between job segments (:mod:`fedhier.round.tiers.moves`; their
kept state comes to the new edge in its job and is restored before they train),
asynchronous edges are :mod:`fedhier.round.tiers.asynchronous`; what the tier refuses is checked by
:func:`fedhier.settings.checks.check_edge_servers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.aggregators.averaging import aggregator, presence_weights
from fedhier.round.loop import (
    EdgeRoundWork,
    Executor,
    HierarchicalSGD,
    HSGDSettings,
    Params,
    TrainResult,
    aggregate_levels,
)
from fedhier.round.participants import EdgeRoundPlan
from fedhier.round.synchronous import SynchronousRounds
from fedhier.round.tiers.moves import (
    ClientStates,
    HandoffJobs,
    absorb_reports,
    apply_job_handoff,
    ends_period,
    exchanges,
    job_settings,
    with_own_edges,
)
from fedhier.round.traffic import BatchCommunication, Communication
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy


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


def complete_below(algorithm: HierarchicalSGD, work: EdgeRoundWork, plan: EdgeRoundPlan,
                   result: TrainResult, held_from: int,
                   ) -> tuple[dict[str, Any], tuple[Params, np.ndarray] | None]:
    """:meth:`HierarchicalSGD.complete`, except that an edge round that ends at level
    ``held_from`` or above is not aggregated: its settled survivors (name -> [s, *shape],
    int64 [s] clients) come back with the outcome, for the caller to aggregate (the parent
    server, the asynchronous cloud); None: aggregated here, or no survivor."""
    settled = algorithm.settle(work, plan, result)
    if not len(settled.survivors):
        return settled.outcome, None
    if settled.level >= held_from:
        return settled.outcome, (settled.models, settled.survivors)
    algorithm.aggregate(settled)
    return settled.outcome, None


def train_edges(algorithm: HierarchicalSGD, executor: Executor, edges: np.ndarray,
                cloud_round: int, rounds: range | None = None,
                held_from: int = 0) -> EdgeRunOutcome:
    """The edge rounds ``rounds`` (default: all of ``cloud_round``'s) restricted to the
    clients of ``edges`` (int64, sorted), from the edge models the algorithm holds. The last
    round's survivors are held, not aggregated, when it ends at the cloud (or at level
    ``held_from`` or above: :func:`complete_below`)."""
    edge_of = algorithm._hierarchy().edge_of_client()
    if rounds is None:
        rounds = algorithm.settings.edge_rounds_of(cloud_round)
    losses = np.zeros((len(rounds), 2))
    failed = failed_edge_count = 0
    held: tuple[Params, np.ndarray] | None = None
    held_from = held_from or algorithm._hierarchy().num_levels
    for k, edge_round in enumerate(rounds):
        work, plan = algorithm.plan(edge_round)
        mine = np.isin(edge_of[work.clients], edges)
        work = dataclasses.replace(work, clients=work.clients[mine], steps=work.steps[mine])
        if not len(work.clients) and not waits_carried(algorithm, np.isin(edge_of, edges)):
            continue
        result = executor.train(work, algorithm.start_models(work))
        outcome, held = complete_below(algorithm, work, plan, result, held_from)
        failed += outcome["failed_clients"]
        failed_edge_count += outcome["failed_edges"]
        if outcome["train_loss"] is not None:
            losses[k] = (outcome["train_loss"], outcome["loss_weight"])
    return EdgeRunOutcome(held, losses, failed, failed_edge_count)


def waits_carried(algorithm: HierarchicalSGD, clients: np.ndarray) -> bool:
    """Whether some of ``clients`` (bool [n]) hold a carried model not aggregated yet
    (per-edge periods): an edge round none of them is sent in still settles it, as the
    one-process round does, when its edge's period ends."""
    carry = getattr(algorithm.schedule, "has_carry", None)
    return carry is not None and len(carry) == len(clients) and bool(carry[clients].any())


@dataclass
class ServerJob:
    """What a parent sends a server (an edge, a region, ...) once per period of its level.

    Attributes:
        edge: the node, at ``level`` (1: an edge); cloud_round: 1-based; params: the
        parent's model (name -> tensor); edge_of_client: int64 [n], every client's edge;
        num_examples: int64 [n], every client's rows (the averaging weights); seconds:
        float64 [E], every edge's simulated clock; parents: the tree above the edges
        (``Hierarchy.parents[1:]``: edge -> region, ...); first_round, num_rounds: the
        job's edge rounds (1-based; 0, 0: all of the cloud round's);
        start_edge_of_client: int64 [n], a ``carry`` handoff at the job's first edge round
        (each client's start model's edge; None: none), carried: name -> [m, *shape] the
        models of the m edges ``carried_edges`` it names (:mod:`fedhier.round.tiers.moves`);
        states: the kept optimizer state (client -> record -> tensor name -> tensor) of the
        clients that moved into the node's subtree at the job's first edge round, taken
        from their old edges (:func:`fedhier.round.tiers.moves.moved_states`; {}: none).
    """

    edge: int
    cloud_round: int
    params: Params
    edge_of_client: np.ndarray
    num_examples: np.ndarray
    seconds: np.ndarray
    level: int = 1
    parents: tuple[np.ndarray, ...] = ()
    first_round: int = 0
    num_rounds: int = 0
    start_edge_of_client: np.ndarray | None = None
    carried: Params = field(default_factory=dict)
    carried_edges: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    states: ClientStates = field(default_factory=dict)


@dataclass
class EdgeReport:
    """A server's answer to an :class:`ServerJob`.

    Attributes:
        edge: the node; model: the aggregate of its subtree's survivors (name -> tensor),
        None when none survived or the node did not answer (``reached`` False); losses:
        float64 [R, 2] per edge round of the job (see :class:`EdgeRunOutcome`);
        failed_clients, failed_edges; client_edge_*, edge_cloud_*: the traffic in its
        subtree (:class:`fedhier.round.traffic.Communication`); seconds: float64 [E], its
        edges' simulated clocks when the report is ready (other entries unread); weight:
        the clients' total averaging weight behind ``model``; unreached: level -> the
        servers of that level in its subtree that missed a job (once per missed job);
        edge_models, edges: a job that ends inside its parent's period (a segment,
        :mod:`fedhier.round.tiers.moves`): the models (name -> [m, *shape]) of the node's m edges
        ``edges`` (int64 [m]), each continuing from its own (``model`` then None).
    """

    edge: int
    model: Params | None
    losses: np.ndarray
    failed_clients: int = 0
    failed_edges: int = 0
    client_edge_messages: int = 0
    client_edge_bytes: int = 0
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    reached: bool = True
    weight: float = 0.0
    edge_cloud_messages: int = 0
    edge_cloud_bytes: int = 0
    unreached: dict[int, list[int]] = field(default_factory=dict)
    edge_models: Params = field(default_factory=dict)
    edges: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add_traffic(self, traffic: Communication) -> None:
        """Add this report's traffic counters to ``traffic`` (a
        :class:`fedhier.round.traffic.Communication`: the parent's)."""
        traffic.client_edge_messages += self.client_edge_messages
        traffic.client_edge_bytes += self.client_edge_bytes
        traffic.edge_cloud_messages += self.edge_cloud_messages
        traffic.edge_cloud_bytes += self.edge_cloud_bytes


def job_hierarchy(settings: HSGDSettings, job: ServerJob) -> Hierarchy:
    """The tree of a job: its client -> edge map and the levels above."""
    return Hierarchy(settings.periods, (np.asarray(job.edge_of_client, dtype=np.int64),
                                        *(np.asarray(p, dtype=np.int64) for p in job.parents)),
                     num_edges=settings.groups[0])


def job_rounds(settings: HSGDSettings, job: ServerJob) -> range:
    """The edge rounds of ``job`` (1-based)."""
    first = job.first_round or settings.edge_rounds_of(job.cloud_round).start
    return range(first, first + (job.num_rounds or settings.edge_rounds_per_cloud_round))


def start_job(settings: HSGDSettings, executor: Executor, job: ServerJob) -> HierarchicalSGD:
    """A server's round for ``job``: set up on the job's tree and clients' row counts, at the
    job's cloud round, with every edge's simulated clock as the job carries it; its traffic
    counters count the job's subtree only."""
    algorithm = HierarchicalSGD(job_settings(settings), rounds=SynchronousRounds)
    n = len(job.edge_of_client)
    info = ClientInfo(label_histograms=np.zeros((n, 1), dtype=np.int64),
                      num_examples=np.asarray(job.num_examples, dtype=np.int64))
    hierarchy = job_hierarchy(settings, job)
    algorithm.setup(executor, job.params, info=info, hierarchy=hierarchy)
    algorithm.begin_cloud_round(executor, job.cloud_round)
    algorithm._clock().edge_time[:] = np.asarray(job.seconds, dtype=np.float64)
    apply_job_handoff(algorithm, job)
    edges = np.flatnonzero(hierarchy.edges_under(job.level) == job.edge)
    algorithm.communication = BatchCommunication(hierarchy, edges)
    return algorithm


def edge_aggregates(algorithm: HierarchicalSGD,
                    held: tuple[Params, np.ndarray] | None) -> tuple[Params, np.ndarray] | None:
    """The level-1 aggregates (name -> [m, *shape]) of the held survivors of a job's last
    edge round (:attr:`EdgeRunOutcome.held`) and their m edges (int64 [m]); None: none held."""
    if held is None:
        return None
    models, survivors = held
    hierarchy = algorithm._hierarchy()
    present = np.zeros(len(algorithm.weights), dtype=bool)
    present[survivors] = True
    weights = presence_weights(algorithm.weights, present, hierarchy.edge_of_client())
    return aggregate_levels(models, survivors, weights, hierarchy, 1,
                            algorithm.settings.aggregators, algorithm.node_models)


def run_edge_job(settings: HSGDSettings, executor: Executor, job: ServerJob) -> EdgeReport:
    """A server's half of its parent's period: from the parent's model, the edge rounds of
    ``job`` with its subtree (an edge: its clients through ``executor``; above: its children
    through ``executor.run_edge_jobs``), then the subtree's aggregate."""
    algorithm = start_job(settings, executor, job)
    hierarchy, clock = algorithm._hierarchy(), algorithm._clock()
    edges = np.flatnonzero(hierarchy.edges_under(job.level) == job.edge)
    rounds = job_rounds(settings, job)
    weight = float(algorithm.weights[np.isin(hierarchy.edge_of_client(), edges)].sum())
    own: dict[str, Any] = {}
    if job.level == 1:
        if job.states:  # clients that moved here: their kept state, before they train
            executor.restore_client_state(job.states)
        outcome = train_edges(algorithm, executor, edges, job.cloud_round, rounds,
                              held_from=2)
        averaged = edge_aggregates(algorithm, outcome.held)
        model = None if averaged is None else {k: v[0] for k, v in averaged[0].items()}
        if not ends_period(settings, 2, rounds.stop - 1):  # inside the parent's period
            model = {k: v[edges[0]].clone() for k, v in algorithm.edge_models.items()}
        losses, failed, failed_edge_count = (outcome.losses, outcome.failed_clients,
                                             outcome.failed_edges)
    else:
        if job.start_edge_of_client is not None or job.states:
            # a carry handoff, moved clients' kept state: its edges' first jobs
            executor = HandoffJobs(executor, job.start_edge_of_client,  # type: ignore[assignment]
                                   algorithm.edge_models, hierarchy.edge_of_client(),
                                   first_round=rounds.start, states=job.states)
        below = run_children(algorithm, executor, job.level, job.edge, job.cloud_round,
                             rounds)
        model = None
        if not ends_period(settings, job.level + 1, rounds.stop - 1):
            # a segment ends inside the parent's period: each edge's own model
            own = dict(edges=edges, edge_models={k: v[torch.as_tensor(edges)].clone()
                                                 for k, v in algorithm.edge_models.items()})
        elif below.models is not None:
            model = {k: v[0] for k, v in aggregate_node(algorithm, job.level, job.edge,
                                                        below.models, below.weights).items()}
        weight = float(below.weights.sum())
        losses, failed, failed_edge_count = below.losses, below.failed, below.failed_edges
    traffic = algorithm.communication
    return EdgeReport(job.edge, model, losses, failed, failed_edge_count,
                      traffic.client_edge_messages, traffic.client_edge_bytes,
                      clock.edge_time.copy(), weight=weight,
                      edge_cloud_messages=traffic.edge_cloud_messages,
                      edge_cloud_bytes=traffic.edge_cloud_bytes,
                      unreached={} if job.level == 1 else below.below_level(job.level),
                      **own)


# ------------------------------------------------------------------------ a node's children
@dataclass
class ChildrenOutcome:
    """What a node's children did in the edge rounds of one job of the node.

    Attributes:
        models: name -> [m, *shape], the last exchange's aggregates of the m children
            ``children`` (int64 [m], increasing) that had one (None: none had); weights:
            float64 [m], their clients' total weight; losses: float64 [R, 2] (see
            :class:`EdgeRunOutcome`); failed, failed_edges: summed over the edge rounds;
            unreached: the children that did not answer a job (once per job); deeper:
            level -> the servers further down that missed a job, from the children's reports.
    """

    models: Params | None
    children: np.ndarray
    weights: np.ndarray
    losses: np.ndarray
    failed: int = 0
    failed_edges: int = 0
    unreached: list[int] = field(default_factory=list)
    deeper: dict[int, list[int]] = field(default_factory=dict)

    def below_level(self, level: int) -> dict[int, list[int]]:
        """Level -> the servers under a level-``level`` node that missed a job."""
        out = {k: list(v) for k, v in self.deeper.items()}
        if self.unreached:
            out.setdefault(level - 1, []).extend(self.unreached)
        return out


def aggregate_node(algorithm: HierarchicalSGD, level: int, node: int, models: Params,
                   weights: np.ndarray) -> Params:
    """Level-``level`` node ``node``'s aggregate (name -> [1, *shape]) of its children's
    ``models`` (name -> [m, *shape], weights float64 [m]) with the level's rule, measured
    from the node's model where the rule needs one."""
    names = algorithm.settings.aggregators
    rule = aggregator(names[0] if len(names) == 1 else names[level - 1])
    device = next(iter(models.values())).device
    w = torch.as_tensor(weights, device=device)
    owner = torch.zeros(len(weights), dtype=torch.int64, device=device)
    return rule.apply(models, w, owner, 1, algorithm.node_models(level, np.array([node])))


def run_children(algorithm: HierarchicalSGD, executor: Executor, level: int, node: int,
                 cloud_round: int, rounds: range) -> ChildrenOutcome:
    """The edge rounds ``rounds`` of level-``level`` node ``node``'s subtree: one job per
    child and period of the node's level (:func:`fedhier.round.tiers.moves.exchanges`), each from
    the node's model; after one that ends a period of its level but not of its parent's, the
    node aggregates the answers (:meth:`HierarchicalSGD._aggregated`, counted and timed); the
    last answers are returned, not aggregated (the node's parent, or the cloud step, does).
    An exchange that ends inside the node's period (a segment of moving clients) leaves each
    edge at its own model (:func:`fedhier.round.tiers.moves.absorb_reports`)."""
    if not hasattr(executor, "run_edge_jobs"):
        raise ConfigError("servers above the clients need an executor that reaches them "
                          "(fedhier deploy local --edges)")
    s, hierarchy, clock = algorithm.settings, algorithm._hierarchy(), algorithm._clock()
    under = hierarchy.edges_under(level - 1)  # each edge's child-level ancestor
    children = np.unique(under[hierarchy.edges_under(level) == node])
    edge_of = hierarchy.edge_of_client()
    loss_sums = np.zeros((len(rounds), 2))
    out = ChildrenOutcome(None, np.zeros(0, dtype=np.int64), np.zeros(0), loss_sums)
    for exchange in exchanges(s, level, rounds):
        start, count = exchange.start, len(exchange)
        seconds = clock.edge_time.copy()  # one [E] array for all jobs, not one per child
        jobs = [with_own_edges(algorithm, ServerJob(
                    int(child), cloud_round,
                    {k: v[np.flatnonzero(under == child)[0]].clone()
                     for k, v in algorithm.edge_models.items()},
                    edge_of, algorithm._info().num_examples, seconds,
                    level - 1, tuple(hierarchy.parents[1:]), start, count), under)
                for child in children]
        reports = sorted(executor.run_edge_jobs(jobs), key=lambda r: r.edge)  # type: ignore[attr-defined]
        rows = slice(start - rounds.start, start - rounds.start + count)
        for report in reports:
            mine = np.flatnonzero(under == report.edge)
            if not report.reached:  # counted as if all its clients failed every edge round
                out.unreached.append(report.edge)
                out.failed += int(np.isin(edge_of, mine).sum()) * count
                out.failed_edges += len(mine) * count
                continue
            loss_sums[rows, 0] += report.losses[:, 0] * report.losses[:, 1]
            loss_sums[rows, 1] += report.losses[:, 1]
            out.failed += report.failed_clients
            out.failed_edges += report.failed_edges
            for below, nodes in report.unreached.items():
                out.deeper.setdefault(below, []).extend(nodes)
            report.add_traffic(algorithm.communication)
            clock.edge_time[mine] = report.seconds[mine]
        if not ends_period(s, level, exchange.stop - 1):
            absorb_reports(algorithm, reports, under)
        last = exchange.stop - 1
        aggregates = ends_period(s, level, last) and not ends_period(s, level + 1, last)
        answered = [r for r in reports if r.model is not None]
        out.models = None
        if not answered:
            if aggregates:  # no survivor under it (its clients moved away, or failed): it
                # keeps its model, but its edges still exchange with it, counted and timed
                # as the one-process run counts every node of the level's aggregation
                algorithm.communication.add_aggregation(hierarchy, level, algorithm.model_bytes)
                clock.aggregate(hierarchy, level, algorithm.model_bytes)
            continue
        out.children = np.array([r.edge for r in answered], dtype=np.int64)
        out.weights = np.array([r.weight for r in answered], dtype=np.float64)
        device = next(iter(algorithm.global_params.values())).device
        out.models = {k: torch.stack([r.model[k].to(device) for r in answered])  # type: ignore[index]
                      for k in algorithm.global_params}
        if aggregates:  # the node aggregates; its children take the result
            averaged = aggregate_node(algorithm, level, node, out.models, out.weights)
            algorithm._aggregated(averaged, np.array([node], dtype=np.int64), level)
    reported = loss_sums[:, 1] > 0
    loss_sums[reported, 0] /= loss_sums[reported, 1]
    return out


# ------------------------------------------------------------------------ the cloud's half
class EdgeTierExecutor(Executor, Protocol):
    """An executor whose clients sit behind servers: besides profiles, evaluation and
    queries it runs one :class:`ServerJob` per child server and returns the reports (a server
    that did not answer in time: ``reached`` False)."""

    def run_edge_jobs(self, jobs: list[ServerJob]) -> list[EdgeReport]: ...


def schedule_keys(algorithm: HierarchicalSGD, rounds: range) -> dict[str, Any]:
    """The record keys of the cloud round's schedule (per-edge periods: each edge's
    aggregations), counted over ``rounds`` as the one-process round counts them in
    :meth:`~fedhier.round.schedule.Schedule.settle`: once per edge round an edge aggregates
    in, whether or not its clients took part (its servers ran them)."""
    schedule = algorithm.schedule
    counts = getattr(schedule, "aggregations", None)
    if counts is not None:
        for edge_round in rounds:
            counts += schedule.levels(edge_round, len(counts)) > 0
    return schedule.end_cloud_round()


def server_name(level: int) -> str:
    """What a level's nodes are called below the cloud: client (0), edge, region, level-3..."""
    return ("client", "edge", "region")[level] if level < 3 else f"level-{level}"


def server_names(num_levels: int) -> list[str]:
    """The name of each level's nodes, 0 (clients) .. L (the cloud)."""
    return [server_name(level) for level in range(num_levels)] + ["cloud"]
