"""Logical traffic of the hierarchy, counted the same way by every engine.

A model sent down or up one tier counts as one message of ``model_bytes`` bytes; a client's
upload counts ``upload_bytes`` (fewer with ``quantize_bits``: :func:`fedhier.local.quantization.
upload_bytes`). Edges are
logical servers: ``client_edge_*`` counts client <-> edge traffic, ``edge_cloud_*`` all traffic
above the edges (edge <-> region <-> ... <-> cloud).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fedhier.tree.hierarchy import Hierarchy


@dataclass
class Communication:
    """Cumulative message and byte counters of a run."""

    client_edge_messages: int = 0
    edge_cloud_messages: int = 0
    client_edge_bytes: int = 0
    edge_cloud_bytes: int = 0

    def add_edge_round(self, sent: int, received: int, model_bytes: int,
                       upload_bytes: int | None = None) -> None:
        """``sent`` models went down to clients and ``received`` came back up (each of
        ``upload_bytes``, default ``model_bytes``)."""
        up = model_bytes if upload_bytes is None else upload_bytes
        self.client_edge_messages += sent + received
        self.client_edge_bytes += sent * model_bytes + received * up

    def add_aggregation(self, hierarchy: Hierarchy, level: int, model_bytes: int) -> None:
        """An aggregation at ``level``: every node of tiers 1..level-1 sends up and receives."""
        for lower in range(1, level):
            self.add_edge_cloud(2 * hierarchy.num_nodes(lower), model_bytes)

    def add_edge_cloud(self, messages: int, model_bytes: int) -> None:
        """``messages`` models went between the edges and the tiers above."""
        self.edge_cloud_messages += messages
        self.edge_cloud_bytes += messages * model_bytes

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class BatchCommunication(Communication):
    """Traffic counters for a batch of edges training together: an aggregation above the
    edges counts the nodes that have an edge of the batch under them."""

    def __init__(self, hierarchy: Hierarchy, edges: np.ndarray) -> None:
        super().__init__()
        self.hierarchy, self.edges = hierarchy, edges

    def add_aggregation(self, hierarchy: Hierarchy, level: int, model_bytes: int) -> None:
        for lower in range(1, level):
            nodes = len(np.unique(self.hierarchy.edges_under(lower)[self.edges]))
            self.add_edge_cloud(2 * nodes, model_bytes)
