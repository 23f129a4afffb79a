"""Moving clients between the shards of engine ``vectorized-ray`` (mobility, regrouping).

The cloud decides every move and cuts a cloud round into segments at the edge rounds where
a client moves (:func:`fedhier.round.tiers.moves.run_segments`, as with edge servers as processes).
Between two segments it asks its executor to **re-attach** the moved clients
(:meth:`fedhier.engines.vectorized_ray.executor.RayShardExecutor.reattach`): edges stay on their
workers, so a client whose new edge is on another worker moves there. What moves is the
client, not its data: its id, its rows' indices into the pool every worker already holds
(the federation from Ray's object store) and its held-out rows' (a :class:`ClientMove`);
its averaging weight comes with every job (``ServerJob.num_examples``) and its mini-batch and
failure draws are keyed by its id and the round, so its "RNG position" needs no moving. The
old worker releases it (:func:`release`), the new one adopts it (:func:`adopt`): each
updates its shard's row index over the same pool (:func:`reshaped`), once per move, never
per round.

A shard then runs a segment's jobs as an edge server runs its job
(:mod:`fedhier.engines.vectorized_ray.segment`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedhier.data.federation import Federation
from fedhier.engines.vectorized.kernels import ClientRows
from fedhier.engines.vectorized_ray.shard import ShardExecutor, ShardRows


# ------------------------------------------------------------------------ a worker's side
@dataclass
class ClientMove:
    """A client leaving one shard for another: its id in the whole federation and its
    data reference, int64 indices into the shared pool of training rows (``rows``) and of
    held-out rows (``holdout``, None: the run holds none out)."""

    client: int
    rows: np.ndarray
    holdout: np.ndarray | None = None
    #: its kept optimizer state (``optimizer_state=keep``): name -> momentum buffer
    #: [*shape]; None: the shard it leaves keeps none (yet)
    state: dict[str, torch.Tensor] | None = None


def release(executor: ShardExecutor,
            clients: Sequence[int]) -> tuple[ShardExecutor, list[ClientMove]]:
    """``executor`` (a :class:`~fedhier.engines.vectorized_ray.shard.ShardExecutor`)
    without ``clients`` (ids it holds), and their moves (with their kept state)."""
    fed, kept = executor.inner.fed, executor.inner.momentum
    positions = executor.local(np.sort(np.asarray(clients, dtype=np.int64)))
    moves = [ClientMove(int(executor.clients[p]), fed.partitions[p],
                        fed.holdouts[p] if fed.holdouts else None,
                        {k: v[p].clone() for k, v in kept.items()} if kept else None)
             for p in positions.tolist()]
    keep = np.setdiff1d(np.arange(len(executor.clients)), positions).astype(np.int64)
    return reshaped(executor, keep, []), moves


def adopt(executor: ShardExecutor, moves: Sequence[ClientMove]) -> ShardExecutor:
    """``executor`` with the moved clients ``moves`` added."""
    return reshaped(executor, np.arange(len(executor.clients), dtype=np.int64), moves)


def reshaped(executor: ShardExecutor, keep: np.ndarray,
             moves: Sequence[ClientMove]) -> ShardExecutor:
    """The shard executor of ``executor``'s clients at positions ``keep`` (int64,
    increasing) and the clients of ``moves``, in id order, over the same pool, model and
    settings: the kept clients' row indices, batch sizes and batch weights taken as they are,
    the moved clients' built as :meth:`ClientRows.build` builds them, the padded width that of
    the new set (what :meth:`ShardExecutor.build` would give, bit for bit, in O(1) Python per
    moved client and vectorized copies per kept one); no row of the pool is copied."""
    inner, data, fed = executor.inner, executor.inner.data, executor.inner.fed
    ids = np.concatenate([executor.clients[keep],
                          np.array([m.client for m in moves], dtype=np.int64)])
    if not len(ids):  # an empty shard trains nobody until it adopts someone
        return ShardExecutor(dataclasses.replace(inner, momentum={}), ids,
                             executor.num_clients)
    empty = np.zeros(0, dtype=np.int64)
    held = [fed.partitions[p] for p in keep.tolist()] + [m.rows for m in moves]
    holdouts = ([fed.holdouts[p] for p in keep.tolist()]
                + [empty if m.holdout is None else m.holdout for m in moves]
                if fed.holdouts else [])
    rows = [data.rows[p] for p in keep.tolist()]
    batch = data.batch[keep]
    weights = [data.weight.index_select(0, torch.as_tensor(keep, device=data.weight.device))]
    if moves:
        new = ClientRows.build(Federation(bundle=fed.bundle, partitions=[m.rows for m in moves]),
                               inner.cfg.batch_size, inner.device)
        rows += new.rows
        batch = np.concatenate([batch, new.batch])
        weights.append(new.weight)
    width = int(batch.max())
    weight = torch.cat([w[:, :width] if w.shape[1] >= width
                        else torch.nn.functional.pad(w, (0, width - w.shape[1]))
                        for w in weights])
    order = np.argsort(ids, kind="stable")
    index = torch.as_tensor(order, device=weight.device)
    ids = ids[order]
    data = ShardRows(x=data.x, y=data.y, rows=[rows[i] for i in order.tolist()],
                     batch=batch[order], width=width, weight=weight.index_select(0, index),
                     client_ids=ids)
    shard = Federation(bundle=fed.bundle, partitions=[held[i] for i in order.tolist()],
                       holdouts=[holdouts[i] for i in order.tolist()] if holdouts else [])
    return ShardExecutor(dataclasses.replace(inner, fed=shard, data=data, client_ids=ids,
                                             buffers={}, next_momentum={}, _rows={},
                                             momentum=kept_state(inner.momentum, keep, moves,
                                                                 index)),
                         ids, executor.num_clients)


def kept_state(momentum: dict[str, torch.Tensor], keep: np.ndarray,
               moves: Sequence[ClientMove], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kept momentum buffers of a reshaped shard (name -> [m, *shape]): the rows
    ``keep`` of the old shard's ``momentum``, then each moved client's own (zeros for one
    that kept none: a buffer of zeros steps as a fresh one, to the bit), in the new
    shard's order (``order``, int64 [m], the new client k's place among those). {} when
    neither side keeps any."""
    states = [m.state for m in moves if m.state]
    template = momentum or (states[0] if states else {})
    if not template:
        return {}
    out = {}
    for key, like in template.items():
        shape = like.shape[1:] if momentum else like.shape
        rows = [momentum[key].index_select(0, torch.as_tensor(keep, device=like.device))
                if momentum else like.new_zeros(len(keep), *shape)]
        rows += [(m.state[key] if m.state else like.new_zeros(shape)).unsqueeze(0)
                 for m in moves]
        out[key] = torch.cat(rows).index_select(0, order.to(like.device))
    return out


# ------------------------------------------------------------------------ the driver's side
def move_between_workers(actors: Sequence[Any], worker_of_edge: np.ndarray,
                         edge_of_client: np.ndarray,
                         moves: dict[int, int]
                         ) -> tuple[dict[int, float], list[list[int]], int]:
    """Re-attach the clients of ``moves`` (client -> new edge; ``edge_of_client``, int64
    [n], is where each client is attached now, updated here): those whose new edge is on
    another worker are released by their old worker and adopted by the new one, all
    workers at once (first every release, then every adoption). Returns client -> seconds
    its move took (0 within a worker), [client, from worker, to worker] per client that
    changed workers, and the bytes of kept state the moves carried (old worker -> driver ->
    new worker: both hops)."""
    import ray

    clients = np.array(sorted(moves), dtype=np.int64)
    target = np.array([moves[c] for c in clients.tolist()], dtype=np.int64)
    old = worker_of_edge[edge_of_client[clients]]
    new = worker_of_edge[target]
    across = old != new
    edge_of_client[clients] = target
    seconds = dict.fromkeys(clients.tolist(), 0.0)
    if not across.any():
        return seconds, [], 0
    t0 = time.perf_counter()
    leaving = {int(w): clients[across & (old == w)].tolist() for w in np.unique(old[across])}
    released = dict(zip(leaving, ray.get([actors[w].release.remote(c)
                                          for w, c in leaving.items()]), strict=True))
    by_client = {m.client: m for batch in released.values() for m in batch}
    arriving = {int(w): [by_client[c] for c in clients[across & (new == w)].tolist()]
                for w in np.unique(new[across])}
    ray.get([actors[w].adopt.remote(m) for w, m in arriving.items()])
    wall = time.perf_counter() - t0
    seconds.update(dict.fromkeys(clients[across].tolist(), round(wall, 6)))
    state_bytes = 2 * sum(v.numel() * v.element_size() for m in by_client.values()
                          if m.state for v in m.state.values())
    return seconds, [[int(c), int(a), int(b)] for c, a, b in
                     zip(clients[across], old[across], new[across], strict=True)], state_bytes
