"""One worker of engine ``vectorized-ray``: a shard of whole edges, trained as one batch.

A shard is the clients of some whole edges. Its worker holds their data rows (a
:class:`ShardRows`: the pool and the clients' row indices) and trains them with the one-process
engine's :class:`~fedhier.engines.vectorized.engine.BatchedExecutor`, wrapped in a
:class:`ShardExecutor` that speaks the whole federation's client ids. Once per cloud round it
runs the edge jobs of its edges (:func:`run_shard_jobs`: the G / I edge rounds run by run of
whole edges, :func:`fedhier.engines.vectorized.chunks.train_edge_chunks`, each edge's level-1
aggregate at the end of its run) and answers with one model per edge:
the edge half of :mod:`fedhier.round.tiers.jobs`, for many edges at once. With kept optimizer state
(``optimizer_state=keep``) the shard holds its clients' momentum buffers ``[m, *shape]``
(its inner executor's ``momentum``), which each run of whole edges reads and writes back
(:meth:`ShardExecutor.keep_chunk_state`). No Ray import here (the actor is
:mod:`fedhier.engines.vectorized_ray.worker`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedhier.data.federation import Federation
from fedhier.engines.vectorized.chunks import ChunkExecutor
from fedhier.engines.vectorized.engine import BatchedExecutor, training_for
from fedhier.engines.vectorized.kernels import INDEX_CLIENT_BLOCK, ClientRows
from fedhier.engines.vectorized_ray.segment import (
    segment_models,
    start_shard_jobs,
    train_shard,
)
from fedhier.local.train import clients_batch_indices
from fedhier.round.loop import (
    ClientEvaluation,
    EdgeRoundWork,
    HSGDSettings,
    Params,
    TrainResult,
)
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.round.traffic import BatchCommunication
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo


@dataclass
class ShardRows(ClientRows):
    """:class:`ClientRows` of a shard: client k is client ``client_ids[k]`` of the whole
    federation, whose id keys its mini-batch draws (so a client draws the same mini-batches
    on whichever worker trains it)."""

    client_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def of_shard(cls, fed: Federation, clients: np.ndarray, batch_size: int,
                 device: torch.device) -> ShardRows:
        """The rows of ``fed``'s clients ``clients`` (int64 [m], sorted)."""
        rows = ClientRows.build(shard_federation(fed, clients), batch_size, device)
        return cls(**{f.name: getattr(rows, f.name) for f in dataclasses.fields(ClientRows)},
                   client_ids=np.asarray(clients, dtype=np.int64))

    def minibatch_rows(self, seed: int, batch_size: int, start: int, steps: int) -> np.ndarray:
        """As :meth:`ClientRows.minibatch_rows`, each client's draws keyed by its id."""
        out = np.empty((steps, self.num_clients, self.width), dtype=self.index_dtype)
        for lo in range(0, self.num_clients, INDEX_CLIENT_BLOCK):
            block = self.rows[lo:lo + INDEX_CLIENT_BLOCK]
            locals_ = clients_batch_indices(
                seed, [len(rows) for rows in block], batch_size, start, steps,
                client_ids=self.client_ids[lo:lo + INDEX_CLIENT_BLOCK])
            for j, (rows, local) in enumerate(zip(block, locals_, strict=True), start=lo):
                b = local.shape[1]
                out[:, j, :b] = rows[local]
                out[:, j, b:] = rows[local[:, :1]]
        return out


def shard_federation(fed: Federation, clients: np.ndarray) -> Federation:
    """The federation of ``fed``'s clients ``clients`` (int64 [m]): the same data pool, their
    partitions (and held-out rows) only; no copy of the pool."""
    return Federation(bundle=fed.bundle, partitions=[fed.partitions[c] for c in clients],
                      holdouts=[fed.holdouts[c] for c in clients] if fed.holdouts else [])


@dataclass
class ShardExecutor:
    """The executor of a shard's clients, addressed by their ids in the whole federation of
    ``num_clients`` clients (what :class:`HierarchicalSGD` plans with): a
    :class:`BatchedExecutor` over the shard (``inner``), whose client k is ``clients[k]``."""

    inner: BatchedExecutor
    clients: np.ndarray  # int64 [m], sorted: the shard's clients' ids
    num_clients: int

    @classmethod
    def build(cls, cfg: RunConfig, fed: Federation, clients: np.ndarray,
              model: torch.nn.Module, device: torch.device) -> ShardExecutor:
        """The shard of ``fed``'s clients ``clients`` (int64, sorted) training ``model``.
        An empty shard (a resumed run's worker whose clients all moved away) holds client 0's
        rows as its executor's until it adopts clients (:mod:`.vectorized_ray_moves`)."""
        clients = np.asarray(clients, dtype=np.int64)
        held = clients if len(clients) else np.zeros(1, dtype=np.int64)
        inner = BatchedExecutor(cfg=cfg, model=model, fed=shard_federation(fed, held),
                                data=ShardRows.of_shard(fed, held, cfg.batch_size, device),
                                train_fn=training_for(model, device), device=device,
                                optimizer=cfg.local_optimizer(), faults=cfg.faults(),
                                client_ids=held)
        return cls(inner, clients, fed.num_clients)

    def chunk(self, positions: np.ndarray) -> ChunkExecutor:
        """The shard's clients at ``positions`` (int64, increasing) for one cloud round: a
        :class:`~fedhier.engines.vectorized.chunks.ChunkExecutor` whose client j is the one
        at ``positions[j]`` (its draws keyed by that client's id), with the same pool,
        mini-batch width and training; no copy of the rows."""
        inner, data = self.inner, self.inner.data
        ids = self.clients[positions]
        index = torch.as_tensor(positions, device=inner.device)
        rows = ShardRows(x=data.x, y=data.y, rows=[data.rows[p] for p in positions.tolist()],
                         batch=data.batch[positions], width=data.width,
                         weight=data.weight.index_select(0, index), client_ids=ids)
        return ChunkExecutor(cfg=inner.cfg, model=inner.model,
                             fed=shard_federation(inner.fed, positions), data=rows,
                             train_fn=inner.train_fn, device=inner.device,
                             optimizer=inner.optimizer, faults=inner.faults, client_ids=ids,
                             momentum={k: v.index_select(0, index)
                                       for k, v in inner.momentum.items()})

    def keep_chunk_state(self, positions: np.ndarray, chunk: BatchedExecutor) -> None:
        """The kept optimizer state (momentum buffers, ``optimizer_state=keep``) of the
        clients at ``positions`` as ``chunk`` (:meth:`chunk` of them) left it, back into the
        shard's ``[m, *shape]`` buffers (allocated at the first chunk that keeps any, zeros
        for clients that never trained: ``momentum * 0 + g`` is ``g`` to the bit, what a
        first step's fresh buffer holds). Nothing without kept state."""
        if not chunk.momentum:
            return
        inner = self.inner
        if not inner.momentum:
            m = len(self.clients)
            inner.momentum = {k: torch.zeros(m, *v.shape[1:], dtype=v.dtype, device=v.device)
                              for k, v in chunk.momentum.items()}
        index = torch.as_tensor(positions, device=inner.device)
        for key, value in chunk.momentum.items():
            inner.momentum[key].index_copy_(0, index, value)

    def local(self, clients: np.ndarray) -> np.ndarray:
        """int64: the shard's positions of the clients ``clients`` (ids, all in the shard)."""
        position = np.searchsorted(self.clients, clients)
        if len(clients) and (position.max() >= len(self.clients)
                             or not np.array_equal(self.clients[position], clients)):
            raise ValueError("work for clients outside this shard")
        return position.astype(np.int64)

    def profiles(self) -> ClientInfo:
        raise NotImplementedError("a shard is told its clients' profiles (ServerJob)")

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        """``work`` (whole-federation ids) run by the shard's batched executor; the result
        is in ``work.clients`` order."""
        start = work.start_edge_of_client
        return self.inner.train(dataclasses.replace(
            work, clients=self.local(work.clients),
            edge_of_client=work.edge_of_client[self.clients],
            start_edge_of_client=None if start is None else start[self.clients]), edge_models)

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        return None  # the cloud evaluates (fedhier.engines.vectorized_ray.engine)

    def client_gradients(self, params: Params) -> torch.Tensor | None:
        return None

    def model_bytes(self, params: Params) -> int:
        return self.inner.model_bytes(params)

    def client_state(self) -> Params:
        """The shard's clients' kept momentum buffers, name -> [m, *shape] in the order of
        ``clients`` ({} before any client kept state, or without kept state); copies (the
        shard writes into its own in place, :meth:`keep_chunk_state`)."""
        if not len(self.clients):
            return {}
        return {k: v.clone() for k, v in self.inner.momentum.items()}

    def restore_client_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put back buffers :meth:`client_state` returned (name -> [m, *shape], copies: the
        shard writes into its buffers in place, :meth:`keep_chunk_state`)."""
        self.inner.momentum = {k: v.to(self.inner.device).clone() for k, v in state.items()}


def run_shard_jobs(settings: HSGDSettings, executor: ShardExecutor,
                   jobs: Sequence[ServerJob]) -> list[EdgeReport]:
    """The edge half of a cloud round for the shard's edges (one level-1 job each, same
    cloud round and edge rounds): the edge rounds of all their clients in one batched
    computation per edge round, then each edge's aggregate of its survivors, as
    :func:`fedhier.round.tiers.jobs.run_edge_job` does for one edge. The shard's summed counters,
    losses and traffic ride on the first report (the cloud sums the reports)."""
    algorithm = start_shard_jobs(settings, executor, jobs)
    edges = np.array(sorted(job.edge for job in jobs), dtype=np.int64)
    algorithm.communication = BatchCommunication(algorithm._hierarchy(), edges)
    outcome, models = train_shard(settings, algorithm, executor, jobs,
                                  executor.inner.chunk_size())
    models = segment_models(settings, algorithm, jobs, models)
    edge_of = algorithm._hierarchy().edge_of_client()
    traffic = algorithm.communication
    seconds = algorithm._clock().edge_time.copy()  # one array for all reports ([E] each)
    weights = edge_weights(algorithm.weights, edge_of, edges)
    reports = []
    for i, edge in enumerate(edges.tolist()):
        lead = i == 0
        reports.append(EdgeReport(
            edge, models.get(edge),
            outcome.losses if lead else np.zeros_like(outcome.losses),
            outcome.failed_clients if lead else 0, outcome.failed_edges if lead else 0,
            traffic.client_edge_messages if lead else 0,
            traffic.client_edge_bytes if lead else 0, seconds,
            weight=weights[i],
            edge_cloud_messages=traffic.edge_cloud_messages if lead else 0,
            edge_cloud_bytes=traffic.edge_cloud_bytes if lead else 0))
    return reports


def edge_weights(weights: np.ndarray, edge_of_client: np.ndarray,
                 edges: np.ndarray) -> list[float]:
    """Each edge's total client weight, ``weights[edge_of_client == e].sum()`` for e in
    ``edges`` to the bit (the same numbers summed by numpy in the same order), in one sort
    instead of a scan of all clients per edge."""
    order = np.argsort(edge_of_client, kind="stable")
    sorted_edges = edge_of_client[order]
    lo = np.searchsorted(sorted_edges, edges, side="left")
    hi = np.searchsorted(sorted_edges, edges, side="right")
    by_edge = weights[order]
    return [float(by_edge[a:b].sum()) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
