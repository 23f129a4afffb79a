"""Random and contiguous groupings."""

from __future__ import annotations

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.common.rng import generator
from fedhier.tree.grouping.base import ClientInfo, balanced_sizes, declares


@declares()
def contiguous_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """Clients in index order cut into equal blocks (±1), as in the papers' authors' code.

    With a label-sorted partition this puts disjoint classes in each group: the largest
    possible upward divergence.
    """
    sizes = balanced_sizes(info.num_clients, num_groups)
    return np.repeat(np.arange(num_groups, dtype=np.int64), sizes)


@declares()
def random_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """A uniformly random assignment into equal groups (sizes differ by at most one)."""
    labels = contiguous_grouping(info, num_groups, seed)
    return generator(seed, "grouping-random").permutation(labels).astype(np.int64)


@declares("edge-tags")
def edge_tag_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """Each client in the edge its SuperNode is tagged with (``edge=k`` in its node config):
    the deployment's own placement. Levels above the edges are grouped contiguously."""
    if info.edge_tags is None:  # edges into regions: no tags at this level
        return contiguous_grouping(info, num_groups, seed)
    tags = np.asarray(info.edge_tags, dtype=np.int64)
    untagged = np.flatnonzero(tags < 0)
    if len(untagged):
        raise ConfigError(
            f"grouping 'edge-tag' needs every SuperNode tagged with --node-config 'edge=k'; "
            f"{len(untagged)} client(s) are not (e.g. partition {int(untagged[0])})")
    if set(tags.tolist()) != set(range(num_groups)):
        raise ConfigError(f"grouping 'edge-tag': the SuperNodes' edge tags "
                          f"{sorted(set(tags.tolist()))} must be exactly 0..{num_groups - 1} "
                          f"for {num_groups} edges (--groups)")
    return tags
