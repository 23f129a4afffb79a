"""A shard's cloud round in chunks of whole edges: client models exist only for the chunk.

The shard of engine ``vectorized-ray`` (:mod:`fedhier.engines.vectorized_ray.shard`) used to
train all its clients in every edge round as one ``[n, *shape]`` batch, so its memory grew as
its clients times the model (38.4 KB per client for W1). Here its edges are cut into runs of
whole edges of about ``client_chunk`` clients (:func:`edge_chunks`), and each run does all
the edge rounds of the cloud round before the next starts (:func:`train_edge_chunks`): a
chunk's models, mini-batch indices and momentum-free optimizer state are freed when it ends,
and what it leaves is one aggregate per edge. Per client the shard then keeps its rows, its
weight and its place in the schedule (int64 ids), not a model; with kept optimizer state
(``optimizer_state=keep``) also its momentum buffers, one model, which a chunk reads from the
shard's at its start and writes back at its end (``ChunkedShard.keep_chunk_state``), by the
shard's positions of its clients.

Why the numbers do not change: within a cloud round nothing crosses edges until the cloud
aggregates (two levels, synchronous, static edges: :func:`fedhier.engines.vectorized_ray.engine.
check_sharded`), so an edge's models depend only on its own clients. A chunk trains them with
the same executor, the same mini-batch width and the same mini-batch and fault draws (keyed
by client id); :meth:`HierarchicalSGD.complete` screens, scales and aggregates each edge over
its own survivors in client order (each edge's float64 sum has the same terms in the same
order); the simulated clock and the counters are sums over edges (an edge outside the chunk
adds exactly 0). So every edge's model is bit for bit the one-shot shard's
(tests/test_vectorized_chunks.py). Only the edge round's reported train loss, a weighted
mean, is combined from the chunks' means (the sum of loss x weight over the sum of weights):
it differs from the one-shot mean by float64 rounding (about 1e-16 relative).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fedhier.engines.vectorized.engine import BatchedExecutor
from fedhier.round.executor import device_of
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import EdgeRoundWork, HierarchicalSGD, Params
from fedhier.round.participants import EdgeRoundPlan
from fedhier.round.schedule import EqualPeriods
from fedhier.round.synchronous import SynchronousRounds
from fedhier.round.tiers.jobs import EdgeRunOutcome, complete_below, edge_aggregates
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy


class ChunkedShard(Protocol):
    """What :func:`train_edge_chunks` needs of a shard
    (:class:`fedhier.engines.vectorized_ray.shard.ShardExecutor`): its clients (int64 [n],
    increasing) and an executor for the clients at some of their positions (its client j
    is the one at ``positions[j]``)."""

    clients: np.ndarray

    def chunk(self, positions: np.ndarray) -> BatchedExecutor: ...

    def keep_chunk_state(self, positions: np.ndarray, chunk: BatchedExecutor) -> None:
        """Write the kept optimizer state ``chunk`` (:meth:`chunk` of ``positions``) left
        back into the shard's, in its numbering."""


def edge_chunks(edge_of_member: np.ndarray, size: int) -> list[np.ndarray]:
    """Runs of whole edges of at most ``size`` members each (an edge larger than ``size`` is
    a run of its own), in increasing edge order; a run of a single member joins the run
    before it (a batch of one client runs a different matrix kernel, see
    ``BatchedExecutor.chunks``).

    Args:
        edge_of_member: int64 [m], each member's edge.

    Returns:
        int64 arrays of member positions (increasing within each run), together every
        position once.
    """
    if not len(edge_of_member):
        return []
    edges, counts = np.unique(edge_of_member, return_counts=True)
    run_of_edge = np.zeros(len(edges), dtype=np.int64)
    run, total, sizes = 0, 0, [0]
    for i, count in enumerate(counts.tolist()):
        if total and total + count > size:
            run, total = run + 1, 0
            sizes.append(0)
        run_of_edge[i], total = run, total + count
        sizes[-1] = total
    for r in range(len(sizes) - 1, 0, -1):  # a run of one member joins the one before
        if sizes[r] == 1:
            run_of_edge[run_of_edge == r] = r - 1
            sizes[r - 1] += 1
            run_of_edge[run_of_edge > r] -= 1
            del sizes[r]
    if len(sizes) > 1 and sizes[0] == 1:
        run_of_edge[run_of_edge > 0] -= 1
        del sizes[0]
    run_of_member = run_of_edge[np.searchsorted(edges, edge_of_member)]
    order = np.argsort(run_of_member, kind="stable")  # positions increase within a run
    return np.split(order.astype(np.int64), np.cumsum(sizes)[:-1])


@dataclass
class ChunkExecutor(BatchedExecutor):
    """A :class:`BatchedExecutor` over one chunk that lives for one cloud round: it draws
    the mini-batch indices of that cloud round only ([G, c, width]), not a block ahead."""

    def index_blocks(self) -> int:
        return 1


@dataclass
class ChunkedPlans:
    """The edge rounds of one cloud round, planned once for the whole federation, and each
    round's participants of each chunk.

    Attributes:
        rounds: (work, plan) per edge round (:meth:`HierarchicalSGD.plan`).
        picks: per edge round, int64 [k] positions into ``work.clients`` sorted by chunk
            (increasing within a chunk), and int64 [C + 1] the bounds of each chunk's part.
    """

    rounds: list[tuple[EdgeRoundWork, EdgeRoundPlan]]
    picks: list[tuple[np.ndarray, np.ndarray]]

    @classmethod
    def build(cls, algorithm: HierarchicalSGD, rounds: range, chunk_of_client: np.ndarray,
              num_chunks: int, edge_of_client: np.ndarray) -> ChunkedPlans:
        """``chunk_of_client``: int64 [n], every client's chunk (-1: not in this shard);
        ``edge_of_client``: int64 [n], the map the chunks were cut by (it must hold in every
        round: chunks are whole edges)."""
        planned, picks = [], []
        for edge_round in rounds:
            work, plan = algorithm.plan(edge_round)
            if not np.array_equal(work.edge_of_client, edge_of_client):
                raise ValueError("chunks of whole edges need one client -> edge map for the "
                                 "job's edge rounds")
            if work.carried is not None:
                raise ValueError("chunks of whole edges carry no client models "
                                 "(per-edge periods)")
            chunk = chunk_of_client[work.clients]
            order = np.flatnonzero(chunk >= 0)
            order = order[np.argsort(chunk[order], kind="stable")]
            bounds = np.searchsorted(chunk[order], np.arange(num_chunks + 1))
            planned.append((work, plan))
            picks.append((order, bounds))
        return cls(planned, picks)

    def of_chunk(self, k: int, c: int) -> EdgeRoundWork:
        """Edge round ``k``'s work restricted to chunk ``c``'s participants (ids of the
        whole federation)."""
        work = self.rounds[k][0]
        order, bounds = self.picks[k]
        mine = order[bounds[c]:bounds[c + 1]]
        return dataclasses.replace(work, clients=work.clients[mine], steps=work.steps[mine])


@dataclass
class ChunkTree:
    """A chunk as a federation of its own: its c clients and e edges renumbered 0..c-1 and
    0..e-1 (in increasing id order, so every per-edge sum keeps its terms and their order),
    then any f other edges whose models some of its clients start from (a ``carry``
    handoff): the rows of its start models are ``sources`` = its edges, then those.

    Attributes:
        ids: int64 [c], the clients' ids in the whole federation (increasing).
        edges: int64 [e], their edges' ids (increasing).
        edge_of: int64 [c], each client's edge among ``edges``.
        sources: int64 [e + f], the edges whose models the start-model rows are.
    """

    ids: np.ndarray
    edges: np.ndarray
    edge_of: np.ndarray
    sources: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray, edge_of_client: np.ndarray,
           works: Sequence[EdgeRoundWork]) -> ChunkTree:
        """The chunk of clients ``ids`` (int64, increasing; whole edges of
        ``edge_of_client`` [n]) that runs ``works`` (ids of the whole federation)."""
        edges, local = np.unique(edge_of_client[ids], return_inverse=True)
        starts = [w.start_edge_of_client[ids] for w in works
                  if w.start_edge_of_client is not None]
        foreign = np.setdiff1d(np.concatenate(starts), edges) if starts else edges[:0]
        return cls(np.asarray(ids, dtype=np.int64), edges.astype(np.int64),
                   local.reshape(-1).astype(np.int64),
                   np.concatenate([edges, foreign]).astype(np.int64))

    def work(self, work: EdgeRoundWork) -> EdgeRoundWork:
        """``work`` (this chunk's participants, ids of the whole federation) in the chunk's
        numbering."""
        start = work.start_edge_of_client
        if start is not None:  # each client's start row among ``sources``
            order = np.argsort(self.sources, kind="stable")
            rows = order[np.searchsorted(self.sources, start[self.ids], sorter=order)]
            start = rows.astype(np.int64)
        return dataclasses.replace(work, clients=np.searchsorted(self.ids, work.clients),
                                   edge_of_client=self.edge_of, start_edge_of_client=start,
                                   ids=self.ids)

    def plan(self, plan: EdgeRoundPlan) -> EdgeRoundPlan:
        """The chunk's clients' part of ``plan`` (steps and FedNova scales [c])."""
        return EdgeRoundPlan(steps=plan.steps[self.ids], scale=plan.scale[self.ids])

    @staticmethod
    def fits(whole: HierarchicalSGD) -> bool:
        """Whether a chunk of ``whole`` can run as a federation of its own: two levels and
        one local period (else :class:`WholeTree`)."""
        return whole._hierarchy().num_levels == 2 and type(whole.schedule) is EqualPeriods

    def local(self, work: EdgeRoundWork) -> EdgeRoundWork:
        """``work`` (from :meth:`work`) as the chunk's executor takes it: as it is."""
        return work

    def algorithm(self, whole: HierarchicalSGD) -> HierarchicalSGD:
        """A :class:`HierarchicalSGD` of the chunk alone, in its numbering, in ``whole``'s
        state: the chunk's clients' weights and compute speeds, its edges' models and
        clocks (copies), the same settings and traffic counters (the object itself: an
        edge round adds to them). Every call it serves then costs O(chunk), not O(n)."""
        hierarchy = whole._hierarchy()
        if not self.fits(whole):
            raise ValueError("chunks of whole edges need two levels and one local period")
        part = HierarchicalSGD(whole.settings, rounds=SynchronousRounds)
        part.hierarchy = Hierarchy(hierarchy.periods, (self.edge_of,),
                                   num_edges=len(self.edges))
        part.info = ClientInfo(np.zeros((len(self.ids), 1), dtype=np.int64),
                               whole._info().num_examples[self.ids])
        part.weights = whole.weights[self.ids]
        part.global_params = whole.global_params
        part.model_bytes = whole.model_bytes
        part.upload_bytes = whole.upload_bytes
        part.communication = whole.communication
        clock = copy.copy(whole._clock())
        clock.step_seconds = clock.step_seconds[self.ids]
        clock.edge_factor = clock.edge_factor[self.edges]
        clock.edge_time = clock.edge_time[self.edges]
        part.clock = clock
        index = torch.as_tensor(self.sources, device=device_of(whole.edge_models))
        part.edge_models = {k: v.index_select(0, index) for k, v in whole.edge_models.items()}
        return part

    def write_back(self, part: HierarchicalSGD, whole: HierarchicalSGD) -> None:
        """The chunk's edges' models and clocks, as ``part`` left them, into ``whole``."""
        whole._clock().edge_time[self.edges] = part._clock().edge_time
        index = torch.as_tensor(self.edges, device=device_of(whole.edge_models))
        for key, value in whole.edge_models.items():
            value.index_copy_(0, index, part.edge_models[key][:len(self.edges)])

    def in_whole_ids(self, error: RunFailureError) -> RunFailureError:
        """``error`` (a run-stopping client or edge, named in the chunk's numbering) with
        the ids of the whole federation."""
        text = re.sub(r"\bclient (\d+) \(edge (\d+)\)", lambda m: (
            f"client {self.ids[int(m[1])]} (edge {self.edges[int(m[2])]})"), str(error))
        text = re.sub(r"^edge (\d+) kept", lambda m: f"edge {self.edges[int(m[1])]} kept",
                      text)
        return RunFailureError(text)


@dataclass
class WholeTree:
    """A chunk that runs in the whole federation's numbering (the :class:`ChunkTree`
    interface): for trees of three or more levels (a region's edges in engine
    ``vectorized-ray``), where each call of the whole algorithm costs O(n), not O(chunk).

    Attributes:
        ids: int64 [c], the chunk's clients' ids (increasing).
        edges: int64 [E], every edge's id (the whole numbering).
    """

    ids: np.ndarray
    edges: np.ndarray

    def work(self, work: EdgeRoundWork) -> EdgeRoundWork:
        return work

    def local(self, work: EdgeRoundWork) -> EdgeRoundWork:
        """``work`` for the chunk's executor, whose client j is ``ids[j]``."""
        start = work.start_edge_of_client
        return dataclasses.replace(
            work, clients=np.searchsorted(self.ids, work.clients),
            edge_of_client=work.edge_of_client[self.ids],
            start_edge_of_client=None if start is None else start[self.ids])

    def plan(self, plan: EdgeRoundPlan) -> EdgeRoundPlan:
        return plan

    def algorithm(self, whole: HierarchicalSGD) -> HierarchicalSGD:
        return whole

    def write_back(self, part: HierarchicalSGD, whole: HierarchicalSGD) -> None:
        """Nothing: the chunk trained in ``whole`` itself."""

    def in_whole_ids(self, error: RunFailureError) -> RunFailureError:
        return error


def train_edge_chunks(algorithm: HierarchicalSGD, executor: ChunkedShard, rounds: range,
                      size: int) -> tuple[EdgeRunOutcome, dict[int, Params]]:
    """The edge rounds ``rounds`` of one cloud round for a shard's clients, chunk by chunk
    of whole edges (:func:`edge_chunks`, ``size`` clients), from the edge models the
    algorithm holds; the last round (it ends at the cloud) is aggregated at each edge.
    Each chunk runs as a federation of its own (:class:`ChunkTree`), so a chunk's edge
    round costs O(its clients), not O(the federation); the chunk's edges' models and clocks
    then go back into ``algorithm``. Trees of three or more levels and per-edge periods run
    each chunk in the whole numbering (:class:`WholeTree`: O(n) per call).

    Returns:
        (the outcome as :func:`fedhier.round.tiers.jobs.train_edges` reports it, without ``held``;
        edge id -> its level-1 aggregate of the last round's survivors, for the edges that
        had one).
    """
    edge_of = algorithm._hierarchy().edge_of_client()
    chunks = edge_chunks(edge_of[executor.clients], size)
    chunk_of_client = np.full(len(edge_of), -1, dtype=np.int64)
    for c, positions in enumerate(chunks):
        chunk_of_client[executor.clients[positions]] = c
    plans = ChunkedPlans.build(algorithm, rounds, chunk_of_client, len(chunks), edge_of)
    losses = LossMeans(len(rounds))
    failed = failed_edge_count = 0
    aggregates: dict[int, Params] = {}
    for c, positions in enumerate(chunks):
        works = [plans.of_chunk(k, c) for k in range(len(rounds))]
        ids = executor.clients[positions]
        tree: ChunkTree | WholeTree = (
            ChunkTree.of(ids, edge_of, works) if ChunkTree.fits(algorithm)
            else WholeTree(ids, np.arange(algorithm._hierarchy().num_nodes(1))))
        part, trainer = tree.algorithm(algorithm), executor.chunk(positions)
        held = None
        for k, whole_work in enumerate(works):
            if not len(whole_work.clients):
                continue
            work = tree.work(whole_work)
            try:
                result = trainer.train(tree.local(work), part.start_models(work))
                outcome, held = complete_below(part, work, tree.plan(plans.rounds[k][1]),
                                               result, held_from=2)
            except RunFailureError as error:
                raise tree.in_whole_ids(error) from None
            failed += outcome["failed_clients"]
            failed_edge_count += outcome["failed_edges"]
            if outcome["train_loss"] is not None:
                losses.add(k, outcome["train_loss"], outcome["loss_weight"])
        tree.write_back(part, algorithm)
        executor.keep_chunk_state(positions, trainer)  # momentum buffers (keep), by client
        averaged = edge_aggregates(part, held)
        if averaged is not None:
            for i, edge in enumerate(tree.edges[averaged[1]].tolist()):
                aggregates[int(edge)] = {k: v[i].clone() for k, v in averaged[0].items()}
    return EdgeRunOutcome(None, losses.means(), failed, failed_edge_count), aggregates


class LossMeans:
    """Per edge round, the weighted mean of the chunks' train losses and their total weight
    (float64 [R, 2], :attr:`EdgeRunOutcome.losses`): the mean of a single chunk as it is,
    of several sum(loss x weight) / sum(weight)."""

    def __init__(self, rounds: int) -> None:
        self.first = np.zeros((rounds, 2))
        self.sums = np.zeros((rounds, 2))
        self.count = np.zeros(rounds, dtype=np.int64)

    def add(self, k: int, loss: float, weight: float) -> None:
        if not self.count[k]:
            self.first[k] = (loss, weight)
        self.count[k] += 1
        self.sums[k] += (loss * weight, weight)

    def means(self) -> np.ndarray:
        out = self.first.copy()
        several = self.count > 1
        out[several, 0] = self.sums[several, 0] / self.sums[several, 1]
        out[several, 1] = self.sums[several, 1]
        return out
