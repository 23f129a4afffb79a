"""A grouping plugin written for docs/sweeps.md: clients sorted by their most common label
(ties broken by a seeded shuffle), then dealt round-robin to the edges, so that every edge
gets a spread of dominant labels. Used as ``grouping = "my_grouping:dealt_by_label"``."""

import numpy as np

from fedhier.tree.grouping.base import ClientInfo


def dealt_by_label(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """int64 [n] edge ids: sorted by dominant label, dealt round-robin."""
    dominant = info.label_histograms.argmax(1)
    shuffle = np.random.default_rng(seed).permutation(info.num_clients)
    order = shuffle[np.argsort(dominant[shuffle], kind="stable")]
    groups = np.empty(info.num_clients, dtype=np.int64)
    groups[order] = np.arange(info.num_clients) % num_groups
    return groups
