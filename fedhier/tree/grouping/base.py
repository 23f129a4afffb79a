"""The grouping interface: what a client -> edge assignment function sees and returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np


@dataclass(frozen=True)
class ClientInfo:
    """What the cloud knows about the clients when it groups them.

    Attributes:
        label_histograms: int64 [n, num_classes], rows per label reported by each client.
        num_examples: int64 [n], each client's number of training rows.
        edge_tags: int64 [n], the ``edge`` each client's SuperNode is tagged with
            (``--node-config "... edge=k"``), -1 where untagged; None for the nodes of the
            levels above the clients.
    """

    label_histograms: np.ndarray
    num_examples: np.ndarray
    edge_tags: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return int(self.num_examples.shape[0])


class Grouping(Protocol):
    """A grouping assigns each of n clients to one of ``num_groups`` edges.

    Returns int64 [n] with every value in [0, num_groups) used at least once. It must be a
    pure function of its arguments (draw randomness from ``fedhier.common.rng.generator(seed,
    ...)``).
    """

    def __call__(self, info: ClientInfo, num_groups: int, seed: int) -> np.ndarray: ...


def balanced_sizes(num_clients: int, num_groups: int) -> np.ndarray:
    """Group sizes differing by at most one: the first n % N groups get one more."""
    sizes = np.full(num_groups, num_clients // num_groups, dtype=np.int64)
    sizes[: num_clients % num_groups] += 1
    return sizes


def contiguous_edges(nodes: int, groups: int) -> list[int]:
    """Edge of SuperNode i when nodes are cut into ``groups`` contiguous blocks (sizes
    differ by at most one, larger first): the same as ``--grouping contiguous``."""
    sizes = balanced_sizes(nodes, groups)
    return [edge for edge, size in enumerate(sizes.tolist()) for _ in range(size)]


#: What a grouping may need besides the number of clients, each from the clients' profiles or
#: messages (docs/contract.md): their label histograms and row counts, every client's full
#: gradient at the current model, or their SuperNodes' ``edge`` tags.
NEEDS = ("labels", "gradients", "edge-tags")

G = TypeVar("G", bound=Callable[..., np.ndarray])


def declares(*needs: str) -> Callable[[G], G]:
    """Mark a grouping function with what it needs (a subset of :data:`NEEDS`)."""
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"unknown grouping needs {sorted(unknown)}; choose from {NEEDS}")

    def mark(function: G) -> G:
        function.needs = frozenset(needs)  # type: ignore[attr-defined]
        return function

    return mark


def needs_of(grouping: Callable[..., np.ndarray]) -> frozenset[str]:
    """What ``grouping`` declared with :func:`declares`; undeclared (e.g. a plugin that does
    not say): the label histograms, the safe assumption."""
    return frozenset(getattr(grouping, "needs", {"labels"}))
