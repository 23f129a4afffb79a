"""Random and contiguous groupings."""

from __future__ import annotations

import numpy as np

from fedhier.grouping.base import ClientInfo, balanced_sizes
from fedhier.rng import generator


def contiguous_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """Clients in index order cut into equal blocks (±1), as in the papers' authors' code.

    With a label-sorted partition this puts disjoint classes in each group: the largest
    possible upward divergence.
    """
    sizes = balanced_sizes(info.num_clients, num_groups)
    return np.repeat(np.arange(num_groups, dtype=np.int64), sizes)


def random_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """A uniformly random assignment into equal groups (sizes differ by at most one)."""
    labels = contiguous_grouping(info, num_groups, seed)
    return generator(seed, "grouping-random").permutation(labels).astype(np.int64)
