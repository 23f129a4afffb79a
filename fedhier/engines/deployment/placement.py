"""Where each client's SuperNode connects when the edges are servers: the run's grouping,
drawn before anything starts.

The cloud draws its grouping from the clients' profiles when the run starts
(:meth:`fedhier.hsgd.HierarchicalSGD.group`); with edge servers the clients must already sit
at their edges by then, so ``fedhier deploy local --edges`` draws the same grouping (and the
levels above, with ``--regions``) from the same data first (:func:`tree_placement`) and the
cloud checks that it agrees.
"""

from __future__ import annotations

import numpy as np

from fedhier.aggregate import client_weights
from fedhier.config import RunConfig
from fedhier.grouping import ClientInfo
from fedhier.topology import build_hierarchy


def tree_placement(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """The tree under ``cfg``'s grouping, as the cloud will draw it: int64 maps client ->
    edge, edge -> region, ... (:attr:`fedhier.topology.Hierarchy.parents`; a data-only
    grouping: ``RunConfig.validate`` refuses gradient-based ones with edge servers)."""
    from fedhier.engines.deployment.local import contiguous_edges
    from fedhier.run_setup import prepare

    tags = np.asarray(contiguous_edges(cfg.clients, cfg.num_edges), dtype=np.int64)
    if cfg.grouping == "edge-tag" and len(cfg.groups) == 1:  # no data needed
        return (tags,)
    fed = prepare(cfg)
    histograms = np.asarray(fed.label_histograms, dtype=np.int64)
    sizes = histograms.sum(axis=1)
    # edge-tag: the SuperNodes' tags, which fedhier deploy gives in contiguous blocks
    info = ClientInfo(label_histograms=histograms, num_examples=sizes,
                      edge_tags=tags if cfg.grouping == "edge-tag"
                      else np.full(len(sizes), -1, dtype=np.int64))
    hierarchy = build_hierarchy(cfg.periods, cfg.groups, cfg.grouping, info, cfg.seed,
                                weights=client_weights(cfg.weighting, sizes))
    return tuple(np.asarray(p, dtype=np.int64) for p in hierarchy.parents)


def client_placement(cfg: RunConfig) -> np.ndarray:
    """int64 [n]: the edge of each client under ``cfg``'s grouping (:func:`tree_placement`)."""
    return tree_placement(cfg)[0]
