"""An edge server follows its clients as they move between edges (:mod:`fedhier.round.tiers.moves`).

A job carries every client's edge; an edge whose clients changed since its last job (a client
re-attached to it, or one that left) updates its client -> node map before it trains: a
client that left is forgotten, a node it does not know is asked its profile query and the
partition id it reports names the client it serves (a re-attached SuperNode may have a new
node id: Flower numbers a node per SuperLink). A server above the edges (a region) reaches
its edges, not its clients: it only takes its subtree's clients and their servers from the
job (:func:`follow_subtree`), for its answers by client (evaluation, gradients).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Message, MessageType, RecordDict

from fedhier.round.tiers.jobs import ServerJob
from fedhier.strategies.grid_executor import GridExecutor

#: Seconds an edge waits for a newly attached client's node to be listed and to answer.
FOLLOW_TIMEOUT = 60.0


def follow_clients(executor: GridExecutor, clients: list[int], seen: dict[int, int],
                   timeout: float = FOLLOW_TIMEOUT, absent: Iterable[int] = ()) -> list[int]:
    """Make ``executor`` (an edge's GridExecutor) serve ``clients`` (partition ids);
    returns those that did not come online within ``timeout`` seconds (not waited for at all:
    ``absent``, the clients the cloud could not re-attach here). Those are served by no
    node: each edge round they fail (they are sent nothing), until a later job finds them.

    ``seen``: node -> client of every node this edge has known (updated): a node of a client
    that left and is not coming back is not asked (it may still be listed while it stops).
    """
    clients = sorted(int(c) for c in clients)
    seen.update(executor.client_of_node)
    nodes = {c: n for c, n in executor.node_ids.items() if c in clients}
    skip = {int(c) for c in absent}
    missing = set(clients) - set(nodes) - skip
    deadline = time.time() + timeout
    while missing:
        fresh = [n for n in executor.grid.get_node_ids() if n not in nodes.values()
                 and seen.get(n, -1) in missing | {-1}]
        if fresh:
            messages = [Message(RecordDict({executor.configrecord_key: executor.train_config}),
                                message_type=MessageType.QUERY, dst_node_id=n) for n in fresh]
            replies = executor.grid.send_and_receive(messages, timeout=timeout)
            for message, reply in executor.sent.bind(messages, replies, "the profile query "
                                                     "of arriving clients", {}).answers:
                metrics = (None if reply.has_error() else
                           reply.content.metric_records.get("metrics"))
                pid = None if metrics is None else metrics.get("partition-id")
                node = message.metadata.dst_node_id
                if isinstance(pid, int) and pid in missing:
                    nodes[pid] = node
                    seen[node] = pid
                    missing.discard(pid)
        if missing and time.time() > deadline:
            break
        if missing:
            time.sleep(0.05)
    lost = sorted(set(clients) - set(nodes))
    executor.node_ids = {c: nodes[c] for c in clients if c in nodes}
    executor.client_of_node = {n: c for c, n in executor.node_ids.items()}
    executor.expected_clients = clients
    executor.min_available_nodes = len(executor.node_ids)
    return lost


def clients_of(edge_of_client: np.ndarray, edge: int) -> list[int]:
    """The clients a job's map puts at ``edge``."""
    return np.flatnonzero(np.asarray(edge_of_client) == edge).tolist()


def follow_subtree(executor: Any, job: ServerJob, node: int) -> list[int]:
    """The clients ``job``'s map puts under level-``job.level`` server ``node``; ``executor``
    (its :class:`~fedhier.strategies.edge.cloud_executor.EdgeServersExecutor`) serves them
    from now on, each under the servers the map puts it (``ancestors``, -1 elsewhere)."""
    where = np.asarray(job.edge_of_client, dtype=np.int64)
    path = [where]
    for parent in job.parents[:job.level - 1]:
        path.append(np.asarray(parent, dtype=np.int64)[path[-1]])
    mine = path[-1] == node
    for level, ancestors in enumerate(executor.ancestors):
        ancestors[:] = np.where(mine, path[level], -1)
    executor.served = np.flatnonzero(mine).tolist()
    return list(executor.served)
