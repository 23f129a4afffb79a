"""The driver's half of engine ``vectorized-ray``: where each edge (each child of the cloud)
runs, and the cloud's executor over the shard actors.

:func:`place_edges` cuts the cloud's children into contiguous runs, one per worker;
:class:`RayShardExecutor` sends each worker its edges' jobs (one Ray call per worker and
cloud round), re-attaches moving clients between workers and keeps the placement for a
resumed run, and starts the workers once the loop is set up
(:meth:`RayShardExecutor.attach`); the cloud's rounds are the edge tier's
(:class:`fedhier.round.tiers.servers.ServerRounds`). The engine itself (checks, run):
:mod:`fedhier.engines.vectorized_ray.engine`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedhier.data.federation import Federation
from fedhier.engines.vectorized.engine import BatchedExecutor
from fedhier.engines.vectorized_ray.moves import move_between_workers
from fedhier.engines.vectorized_ray.subtree import top_children
from fedhier.engines.vectorized_ray.worker import peak_rss_bytes, start_workers
from fedhier.round.loop import ClientEvaluation, EdgeRoundWork, Params, TrainResult
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy


def place_edges(edge_of_client: np.ndarray, num_edges: int, workers: int) -> np.ndarray:
    """int64 [E]: each edge's worker. Contiguous runs of edges, cut where the running count
    of clients crosses k / W of all of them, so the shards hold about equal numbers of
    clients (at most ``min(workers, E)`` shards, none empty of edges)."""
    counts = np.bincount(edge_of_client, minlength=num_edges)
    workers = max(1, min(workers, num_edges))
    before = np.cumsum(counts) - counts  # clients on edges before each edge
    total = max(int(counts.sum()), 1)
    worker = np.minimum((before * workers) // total, workers - 1).astype(np.int64)
    worker = np.maximum(worker, np.arange(num_edges) - (num_edges - workers))  # none empty
    return np.minimum(worker, np.arange(num_edges))


def shared_start_models(jobs: list[ServerJob]) -> list[ServerJob]:
    """``jobs`` with every start model equal to the first job's replaced by that one dict,
    so that a worker's call carries it once (Ray pickles a call's arguments together, and
    pickle writes an object met twice once): at a cloud round's start every edge holds the
    global model, so W models go down, not E."""
    first = jobs[0].params
    return [job if job.params is first
            or not all(torch.equal(job.params[k], v) for k, v in first.items())
            else dataclasses.replace(job, params=first) for job in jobs]


def models_down(jobs: list[ServerJob]) -> int:
    """Models one Ray call of ``jobs`` carries: its distinct start models
    (:func:`shared_start_models`) and the models of ``carry`` handoffs and of edges inside
    a region's period (``carried``)."""
    return len({id(job.params) for job in jobs}) + sum(len(job.carried_edges) for job in jobs)


def models_up(reports: list[EdgeReport]) -> int:
    """Models ``reports`` carry back: each aggregate, and each edge's own model a region
    answers with inside its parent's period (``edge_models``)."""
    return sum(r.model is not None for r in reports) + sum(len(r.edges) for r in reports)


@dataclass
class RayShardExecutor:
    """The cloud's executor (:class:`fedhier.round.tiers.jobs.EdgeTierExecutor`): edge jobs go to
    the shard actors, everything else to a batched executor over the whole federation in the
    driver (``whole``). Actors start at the first cloud round (the grouping places them)."""

    cfg: RunConfig
    fed: Federation
    whole: BatchedExecutor
    workers: int
    actors: list[Any] = dataclasses.field(default_factory=list)
    placement: np.ndarray | None = None  # int64 [E], each edge's worker
    bytes_between: int = 0  # model bytes sent driver <-> workers
    #: int64 [n]: each client's edge as its worker holds it (what re-attachment moves)
    edge_of_client: np.ndarray | None = None
    #: [client, from worker, to worker] per client moved between workers, in order
    worker_moves: list[list[int]] = dataclasses.field(default_factory=list)
    node_placement: np.ndarray | None = None  # int64: each child of the cloud's worker
    #: kept optimizer state restored from a checkpoint (name -> [n, *shape]), held until
    #: the workers start and take their clients' rows (:meth:`restore_client_state`)
    restored: Params = dataclasses.field(default_factory=dict)
    #: kept state sent between the driver and the workers (checkpoints, restores, moves)
    client_state_bytes: int = 0

    def profiles(self) -> ClientInfo:
        return self.whole.profiles()

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        """Not asked: the cloud of an edge tier sends edge jobs (:meth:`run_edge_jobs`)."""
        raise NotImplementedError("vectorized-ray trains through edge jobs, not train()")

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation:
        return self.whole.evaluate(params, cloud_round)

    def client_gradients(self, params: Params) -> torch.Tensor:
        return self.whole.client_gradients(params)

    def model_bytes(self, params: Params) -> int:
        return self.whole.model_bytes(params)

    def client_state(self) -> Params:
        """Every client's kept momentum buffers (``optimizer_state=keep``), name ->
        [n, *shape] by client id in the whole federation, gathered from the workers (each
        holds its clients', :meth:`ShardWorker.client_state`); zeros for a client that never
        kept any (it then steps as from a fresh buffer, to the bit); {} when no client keeps
        state. Called once per cloud round (the checkpoint's snapshot): it costs one model
        per client sent to the driver, and only with kept state."""
        if not self.cfg.keeps_client_state():
            return {}
        if not self.actors:
            return dict(self.restored)
        import ray

        answers = [(ids, state) for ids, state in
                   ray.get([actor.client_state.remote() for actor in self.actors]) if state]
        if not answers:
            return {}
        out = {k: torch.zeros(self.fed.num_clients, *v.shape[1:], dtype=v.dtype)
               for k, v in answers[0][1].items()}
        for ids, state in answers:
            index = torch.as_tensor(np.array(ids, dtype=np.int64))
            for key, value in state.items():
                out[key].index_copy_(0, index, value.cpu())
                self.client_state_bytes += value.numel() * value.element_size()
        return out

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to shard as the interrupted one did (plain ints and
        lists, in the checkpoint's strategy state): each edge's worker, fixed at the start
        (a resumed run that placed the edges again from the moved tree would sum in another
        order, or leave a worker without clients), each child of the cloud's (a region's
        with three or more levels), and the counters of ``sharding``."""
        if self.placement is None or self.node_placement is None:
            return {}
        return {"placement": [int(w) for w in self.placement],
                "node_placement": [int(w) for w in self.node_placement],
                "worker_moves": [list(m) for m in self.worker_moves],
                "bytes_between": int(self.bytes_between),
                "client_state_bytes": int(self.client_state_bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.placement = np.asarray(state["placement"], dtype=np.int64)
            self.node_placement = np.asarray(state.get("node_placement", state["placement"]),
                                             dtype=np.int64)  # older checkpoints: two levels
            self.worker_moves = [list(m) for m in state["worker_moves"]]
            self.bytes_between = int(state["bytes_between"])
            self.client_state_bytes = int(state.get("client_state_bytes", 0))

    def restore_client_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Give each worker its clients' rows of ``state`` (what :meth:`client_state`
        returned: name -> [n, *shape] by client id); before the workers start, held until
        :meth:`start`."""
        self.restored = {k: v.cpu() for k, v in state.items()}
        if self.actors:
            self.send_restored()

    def send_restored(self) -> None:
        """Each worker its clients' rows of the restored state (the clients where the
        placement and ``edge_of_client`` put them), then none held here."""
        import ray

        assert self.placement is not None and self.edge_of_client is not None
        if not self.restored:
            return
        worker_of_client = self.placement[self.edge_of_client]
        calls = []
        for w, actor in enumerate(self.actors):
            index = torch.as_tensor(np.flatnonzero(worker_of_client == w))
            mine = {k: v.index_select(0, index) for k, v in self.restored.items()}
            self.client_state_bytes += sum(v.numel() * v.element_size() for v in mine.values())
            calls.append(actor.restore_client_state.remote(mine))
        ray.get(calls)
        self.restored = {}

    def run_edge_jobs(self, jobs: list[ServerJob]) -> list[EdgeReport]:
        """Every edge's job, each shard's in one call to its actor; the reports of all."""
        import ray

        assert self.node_placement is not None, "the shards start at the first cloud round"
        by_worker: list[list[ServerJob]] = [[] for _ in self.actors]
        for job in shared_start_models(jobs):
            by_worker[int(self.node_placement[job.edge])].append(job)
        pending = [actor.run.remote(mine)
                   for actor, mine in zip(self.actors, by_worker, strict=True) if mine]
        reports = [report for batch in ray.get(pending) for report in batch]
        self.bytes_between += self.whole.model_bytes(jobs[0].params) * (
            sum(models_down(mine) for mine in by_worker) + models_up(reports))
        return reports

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        """Re-attach clients to other edges (:class:`fedhier.round.tiers.moves.Reattacher`): a
        client whose new edge is on another worker moves there, its data reference and
        not its data (:func:`~fedhier.engines.vectorized_ray.moves.move_between_workers`);
        client -> seconds its move took."""
        assert self.placement is not None and self.edge_of_client is not None
        seconds, moved, state_bytes = move_between_workers(self.actors, self.placement,
                                                           self.edge_of_client, moves)
        self.worker_moves += moved
        self.client_state_bytes += state_bytes
        return seconds

    def attach(self, hierarchy: Hierarchy) -> None:
        """The loop's set-up is done: start the shards from the tree in force (whole regions
        with three or more levels: :func:`top_children`), unless they run already; a
        regrouping or a move later is a re-attachment (:meth:`reattach`)."""
        if not self.actors:
            self.start(*top_children(hierarchy))

    def start(self, edge_of_client: np.ndarray, num_edges: int,
              node_of_edge: np.ndarray | None = None) -> None:
        """Place the cloud's children (the edges; ``node_of_edge``, int64 [E]: each edge's
        child of the cloud, a region) and start one actor per shard. A resumed run keeps the
        places it restored (:meth:`load_state_dict`): a worker may then start without
        clients."""
        self.edge_of_client = np.array(edge_of_client, dtype=np.int64)
        if self.node_placement is None:
            node_of_edge = np.arange(num_edges) if node_of_edge is None else node_of_edge
            self.node_placement = place_edges(node_of_edge[self.edge_of_client],
                                              int(node_of_edge.max()) + 1, self.workers)
            self.placement = self.node_placement[node_of_edge]  # each edge's worker (moves)
        assert self.placement is not None
        worker_of_client = self.placement[edge_of_client]
        shards = [np.flatnonzero(worker_of_client == w).astype(np.int64)
                  for w in range(int(self.placement.max()) + 1)]
        self.actors = start_workers(self.cfg, self.fed, shards)
        self.send_restored()  # a resumed run's kept optimizer state, by client id

    def stats(self) -> dict[str, Any]:
        """Per worker: clients, peak resident memory, node, seconds of training
        (:meth:`fedhier.engines.vectorized_ray.worker.ShardWorker.stats`); the driver's
        peak and CPU seconds; the model bytes moved between the driver and the workers, and the
        bytes of kept optimizer state the driver gathered for checkpoints or restored."""
        import ray

        workers = ray.get([actor.stats.remote() for actor in self.actors])
        driver = peak_rss_bytes()
        return {"workers": workers, "driver_peak_rss_bytes": driver,
                "driver_cpu_seconds": time.process_time(),
                "total_peak_rss_bytes": driver + sum(w["peak_rss_bytes"] for w in workers),
                "bytes_between_workers": self.bytes_between,
                "client_state_bytes": self.client_state_bytes}
