"""Where each client's SuperNode connects when the edges are servers: the run's grouping,
drawn before anything starts.

The cloud draws its grouping from the clients' profiles when the run starts
(:meth:`fedhier.round.loop.HierarchicalSGD.group`); with edge servers the clients must already sit
at their edges by then, so ``fedhier deploy local --edges`` draws the same grouping (and the
levels above, with ``--regions``) from the same data first (:func:`tree_placement`) and the
cloud checks that it agrees. A grouping by gradients draws from the clients' gradients at
the seeded initial model, which the cloud then collects through the servers
(``query.gradient``, forwarded by each server) and groups by.
"""

from __future__ import annotations

import numpy as np
import torch

from fedhier.data.federation import Federation
from fedhier.round.aggregators.averaging import client_weights
from fedhier.settings.run_config import RunConfig
from fedhier.tree.grouping import ClientInfo, grouping_needs
from fedhier.tree.grouping.base import contiguous_edges
from fedhier.tree.hierarchy import build_hierarchy


def tree_placement(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """The tree under ``cfg``'s grouping, as the cloud will draw it: int64 maps client ->
    edge, edge -> region, ... (:attr:`fedhier.tree.hierarchy.Hierarchy.parents`; a gradient
    grouping from the clients' gradients at the initial model, :func:`initial_gradients`)."""
    from fedhier.runs.prepare import prepare

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
                                client_grads=initial_gradients(cfg, fed),
                                weights=client_weights(cfg.weighting, sizes))
    return tuple(np.asarray(p, dtype=np.int64) for p in hierarchy.parents)


def initial_gradients(cfg: RunConfig, fed: Federation) -> torch.Tensor | None:
    """[n, P]: every client's gradient at the seeded initial model, on the rows its
    ``query.gradient`` handler uses, for a grouping that needs gradients (None otherwise):
    what the cloud collects through the servers when the run starts and groups by."""
    if "gradients" not in grouping_needs(cfg.grouping):
        return None
    from fedhier.diagnostics.in_rounds import direct_client_gradients
    from fedhier.runs.prepare import initial_model

    model = initial_model(cfg, fed)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    return direct_client_gradients(model, params, fed, cfg.diagnostics_max_samples, cfg.seed,
                                   torch.device("cpu"))


def client_placement(cfg: RunConfig) -> np.ndarray:
    """int64 [n]: the edge of each client under ``cfg``'s grouping (:func:`tree_placement`)."""
    return tree_placement(cfg)[0]
