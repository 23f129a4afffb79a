"""The diagnostics recorded with a cloud round, computed the same way by every engine.

Engines differ only in how they get the clients' full local gradients (a query message to
each ClientApp, or a batched computation); the numbers come from these functions and the
formulas in :mod:`fedhier.diagnostics.measures` (docs/diagnostics.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fedhier.common.rng import generator
from fedhier.diagnostics.measures import (
    divergences,
    flat_gradient,
    gradient_diversity,
    sample_gradient_diversity,
)
from fedhier.round.aggregators.averaging import occupied_segments
from fedhier.tree.hierarchy import Hierarchy


def diagnostics_due(cloud_round: int, every: int) -> bool:
    """Diagnostics run at the initial model (round 0) and every ``every`` cloud rounds."""
    return every > 0 and cloud_round % every == 0


def diagnostic_rows(num_rows: int, max_samples: int, seed: int, client: int) -> np.ndarray:
    """The rows a client's full gradient is taken over: all, or a seeded subsample of
    ``max_samples`` (sorted) when ``max_samples`` > 0 is smaller."""
    if max_samples <= 0 or max_samples >= num_rows:
        return np.arange(num_rows, dtype=np.int64)
    picked = generator(seed, "diagnostic-rows", client).choice(num_rows, max_samples,
                                                               replace=False)
    return np.sort(picked).astype(np.int64)


def client_diagnostics(client_grads: torch.Tensor, weights: np.ndarray,
                       hierarchy: Hierarchy) -> dict[str, Any]:
    """Divergences of the clients' gradients [n, P] under the run's grouping and weights,
    plus the client-level gradient diversity (unweighted, over the n gradients). An edge
    without clients (client mobility) has no share of the weight and adds nothing; its
    ``downward_divergence_by_edge`` entry is None."""
    num_edges = hierarchy.num_nodes(1)
    occupied, compact = occupied_segments(hierarchy.edge_of_client(), num_edges)
    out = divergences(client_grads, torch.as_tensor(weights), torch.as_tensor(compact),
                      len(occupied))
    if len(occupied) < num_edges:
        by_edge: list[float | None] = [None] * num_edges
        for edge, value in zip(occupied.tolist(), out["downward_divergence_by_edge"],
                               strict=True):
            by_edge[edge] = value
        out["downward_divergence_by_edge"] = by_edge
    out["client_gradient_diversity"] = gradient_diversity(client_grads)
    return out


def sample_diagnostics(model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor,
                       y: torch.Tensor, max_samples: int, seed: int) -> dict[str, Any]:
    """Sample-level gradient diversity Δ over the pooled training rows (a seeded subsample of
    at most ``max_samples``, 0 = all) and the batch-size bound m·Δ."""
    delta, used = sample_gradient_diversity(model, params, x, y, max_samples or None, seed)
    return {"sample_gradient_diversity": delta, "batch_size_bound": used * delta,
            "diversity_samples": used}


def direct_client_gradients(model: nn.Module, params: dict[str, torch.Tensor], fed: Any,
                            max_samples: int, seed: int,
                            device: torch.device) -> torch.Tensor:
    """Every client's full local gradient [n, P], computed in this process on the same rows
    the ClientApp's ``query.gradient`` uses (for engines without messages, and the CLI)."""
    grads = []
    for client in range(fed.num_clients):
        x, y = fed.client_tensors(client, device)
        rows = torch.as_tensor(diagnostic_rows(len(y), max_samples, seed, client), device=device)
        grads.append(flat_gradient(model, params, x[rows], y[rows]))
    return torch.stack(grads)
