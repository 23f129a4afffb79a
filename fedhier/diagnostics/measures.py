"""Gradient diagnostics: divergences (Wang et al. 2022) and gradient diversity (Yin et al. 2018).

Pure functions of (model, parameters, data). Every formula is stated in the docstrings and in
docs/diagnostics.md; sums of squares are taken in float64.

Notation: n clients j with full local gradients ∇F_j (``client_grads`` [n, P]), normalised
client weights p_j (uniform: 1/n, as in the paper; ``samples``: m_j / m), N edges V_i with
P_i = Σ_{j∈V_i} p_j. Then

    ∇f   = Σ_j p_j ∇F_j                               (global gradient)
    ∇f_i = Σ_{j∈V_i} p_j ∇F_j / P_i                   (edge gradient)
    ε̃²   = Σ_j p_j ||∇F_j − ∇f||²                      (global divergence)
    ε²   = Σ_i P_i ||∇f_i − ∇f||²                      (upward divergence)
    ε_i² = Σ_{j∈V_i} (p_j / P_i) ||∇F_j − ∇f_i||²      (downward divergence of edge i)

and ε̃² = ε² + Σ_i P_i ε_i² exactly. Uniform weights give the paper's n_i/n and 1/n_i.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedhier.common.rng import generator
from fedhier.local.models import linear_chain
from fedhier.local.train import loss_fn
from fedhier.round.aggregators.averaging import segment_weighted_mean

Params = Mapping[str, torch.Tensor]


def _split_params(params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(floating-point entries, the other entries): gradients are taken w.r.t. the former."""
    diff = {k: v.detach() for k, v in params.items() if torch.is_floating_point(v)}
    const = {k: v.detach() for k, v in params.items() if not torch.is_floating_point(v)}
    return diff, const


def _check_rows(x: torch.Tensor, y: torch.Tensor) -> int:
    m = int(y.shape[0])
    if m == 0:
        raise ValueError("gradient of an empty data set: x and y have no rows")
    if int(x.shape[0]) != m:
        raise ValueError(f"x has {x.shape[0]} rows but y has {m}")
    return m


def flat_gradient(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor,
                  chunk: int = 4096) -> torch.Tensor:
    """Full-batch gradient of the mean cross-entropy, flattened: [P].

    ∇ (1/m) Σ_k CE(model(params, x_k), y_k), with x [m, ...], y [m]. Rows are processed in
    chunks of ``chunk``; chunk c contributes ∇(m_c · mean_c) / m = ∇(sum_c) / m, accumulated in
    float64, so the result equals the one-pass full-batch gradient. The gradient is taken
    w.r.t. every floating-point entry of ``params`` and flattened in ``params``' key order
    (non-float entries, e.g. integer counters, are held constant and left out), returned in the
    parameters' dtype.
    """
    m = _check_rows(x, y)
    diff, const = _split_params(params)
    if not diff:
        raise ValueError("params has no floating-point entries to differentiate")
    leaves = {k: v.requires_grad_(True) for k, v in diff.items()}
    total: torch.Tensor | None = None
    for start in range(0, m, chunk):
        xs, ys = x[start:start + chunk], y[start:start + chunk]
        loss = loss_fn(model, {**leaves, **const}, xs, ys) * (ys.shape[0] / m)
        grads = torch.autograd.grad(loss, tuple(leaves.values()))
        flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
        total = flat if total is None else total + flat
    assert total is not None
    dtype = next(iter(diff.values())).dtype
    return total.to(dtype)


def per_example_gradients(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor,
                          chunk: int = 256) -> torch.Tensor:
    """Per-example gradients [m, P]: row k is ∇ CE(model(params, x_k), y_k).

    Computed with ``torch.func.vmap(grad(...))`` over single examples, ``chunk`` rows at a
    time; columns in the same order as :func:`flat_gradient` (floating-point entries of
    ``params`` in key order). The mean of the rows is the full-batch gradient.
    """
    _check_rows(x, y)
    return torch.cat([torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
                      for grads in _per_example_chunks(model, params, x, y, chunk)])


def _per_example_chunks(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor,
                        chunk: int) -> Iterator[dict[str, torch.Tensor]]:
    """Per-example gradients ``chunk`` rows at a time: name -> [rows, *shape] (float32)."""
    diff, const = _split_params(params)

    def single_loss(p: dict[str, torch.Tensor], xi: torch.Tensor,
                    yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, {**p, **const}, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(single_loss), in_dims=(None, 0, 0))
    for start in range(0, int(y.shape[0]), chunk):
        yield per_example(diff, x[start:start + chunk], y[start:start + chunk])


def _linear_chain_sums(layers: list[tuple[str, str]], params: Params, x: torch.Tensor,
                       y: torch.Tensor, chunk: int = 4096) -> tuple[float, torch.Tensor]:
    """Σ_k ||g_k||² and Σ_k g_k (float64 [P]) of the per-example gradients of a Linear/ReLU
    chain, without forming them.

    Example k's gradient of layer i is δ_k a_kᵀ (weight) and δ_k (bias), with a_k the layer's
    input and δ_k the loss gradient at its output, so its squared norm is
    ||δ_k||² (||a_k||² + 1). Σ_k g_k is δᵀa and Σ_k δ_k. Same numbers as the vmap path
    (tests/test_diagnostics.py), about 50x faster on Fashion-MNIST's mlp.
    """
    sum_sq = 0.0
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for start in range(0, int(y.shape[0]), chunk):
            acts = [x[start:start + chunk].flatten(1)]  # layer inputs [c, features]
            for i, (w_key, b_key) in enumerate(layers):
                z = torch.addmm(params[b_key], acts[-1], params[w_key].T)
                acts.append(z.relu() if i + 1 < len(layers) else z)
            logits = acts.pop()
            delta = torch.softmax(logits, dim=1)
            delta[torch.arange(len(delta)), y[start:start + chunk]] -= 1.0  # d CE / d logits
            for i in range(len(layers) - 1, -1, -1):
                w_key, b_key = layers[i]
                a = acts[i]
                norms = torch.linalg.vecdot(delta, delta).to(torch.float64)
                inputs = torch.linalg.vecdot(a, a).to(torch.float64)
                sum_sq += float((norms * (inputs + 1.0)).sum())
                for key, part in ((w_key, delta.T @ a), (b_key, delta.sum(0))):
                    part64 = part.to(torch.float64)
                    totals[key] = totals[key] + part64 if key in totals else part64
                if i > 0:
                    delta = (delta @ params[w_key]) * (a > 0)
    total = torch.cat([totals[k].flatten() for k in params if k in totals])
    return sum_sq, total


def _diversity(sum_sq: float, total: torch.Tensor) -> float:
    denominator = float(torch.dot(total, total))
    if denominator == 0.0:
        raise ValueError(
            "gradient diversity is undefined: the gradients sum to zero (||Σ_k g_k||² = 0)")
    return sum_sq / denominator


def gradient_diversity(grads: torch.Tensor) -> float:
    """Gradient diversity Δ = Σ_k ||g_k||² / ||Σ_k g_k||² of grads [m, P] (Yin et al. 2018).

    Computed in float64. Δ ∈ [1/m, ∞): 1/m for identical gradients, 1 for orthogonal ones of
    equal norm. Raises ValueError when Σ_k g_k = 0 (Δ undefined).
    """
    g = grads.reshape(grads.shape[0], -1).to(torch.float64)
    return _diversity(float((g * g).sum()), g.sum(0))


def batch_size_bound(grads: torch.Tensor) -> float:
    """Batch-size bound B_S = m · Δ of grads [m, P] (Yin et al. 2018): m · gradient_diversity."""
    return int(grads.shape[0]) * gradient_diversity(grads)


def sample_gradient_diversity(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor,
                              max_samples: int | None, seed: int,
                              chunk: int = 64) -> tuple[float, int]:
    """Sample-level gradient diversity Δ over per-example gradients: returns (Δ, m used).

    Uses every row when ``max_samples`` is None or at least the number of rows, otherwise a
    subsample of ``max_samples`` rows drawn without replacement from
    ``generator(seed, "diversity-sample")`` (kept in row order). Per-example gradients are
    accumulated chunk by chunk (Σ_k ||g_k||² and Σ_k g_k in float64 across chunks), never
    stored as [m, P]. The batch-size bound is then m_used · Δ.
    """
    num_rows = _check_rows(x, y)
    if max_samples is not None and max_samples < 1:
        raise ValueError(
            f"max_samples must be at least 1 (or None for all rows), got {max_samples}")
    if max_samples is not None and max_samples < num_rows:
        picked = np.sort(generator(seed, "diversity-sample").choice(
            num_rows, size=max_samples, replace=False))
        rows = torch.as_tensor(picked, device=y.device)
        x, y = x[rows], y[rows]
    layers = linear_chain(model)
    if layers is not None:
        sum_sq, total = _linear_chain_sums(layers, params, x, y)
        return _diversity(sum_sq, total), int(y.shape[0])
    # Per chunk: row norms and the column sum in float32 (a few dozen rows each), then
    # accumulated in float64. Up-casting whole [rows, P] chunks instead costs 5x the time.
    sum_sq = 0.0
    totals: dict[str, torch.Tensor] = {}
    for grads in _per_example_chunks(model, params, x, y, chunk):
        for key, g in grads.items():
            flat = g.reshape(g.shape[0], -1)
            sum_sq += float(torch.linalg.vecdot(flat, flat).to(torch.float64).sum())
            part = flat.sum(0).to(torch.float64)
            totals[key] = totals[key] + part if key in totals else part
    total = torch.cat(list(totals.values()))
    return _diversity(sum_sq, total), int(y.shape[0])


def divergences(client_grads: torch.Tensor, client_weights: torch.Tensor,
                edge_of_client: torch.Tensor, num_edges: int) -> dict[str, Any]:
    """Global, upward and downward divergence of client gradients under a grouping.

    Args:
        client_grads: [n, P] full local gradient ∇F_j of each client at one model.
        client_weights: [n] non-negative client weights; normalised to p_j = w_j / Σ w
            (uniform weights give the paper's definitions, sample counts give p_j = m_j / m).
        edge_of_client: [n] int64 edge index of each client, in [0, num_edges).
        num_edges: N; every edge must hold positive total weight.

    Returns (floats, computed in float64):
        ``global_divergence``   ε̃² = Σ_j p_j ||∇F_j − ∇f||²,
        ``upward_divergence``   ε² = Σ_i P_i ||∇f_i − ∇f||²,
        ``downward_divergence`` Σ_i P_i ε_i²,
        ``downward_divergence_by_edge`` [ε_1², ..., ε_N²] with
            ε_i² = Σ_{j∈V_i} (p_j / P_i) ||∇F_j − ∇f_i||²,
        ``grad_norm`` ||∇f||,
    where ∇f = Σ_j p_j ∇F_j, P_i = Σ_{j∈V_i} p_j, ∇f_i = Σ_{j∈V_i} p_j ∇F_j / P_i. The
    identity ε̃² = ε² + Σ_i P_i ε_i² holds up to float64 rounding.
    """
    g = client_grads.reshape(client_grads.shape[0], -1).to(torch.float64)
    n = g.shape[0]
    w = torch.as_tensor(client_weights, dtype=torch.float64, device=g.device).reshape(-1)
    edges = torch.as_tensor(edge_of_client, dtype=torch.int64, device=g.device).reshape(-1)
    if w.shape[0] != n or edges.shape[0] != n:
        raise ValueError(f"{n} client gradients but {w.shape[0]} weights and "
                         f"{edges.shape[0]} edge indices")
    if bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError("client weights must be non-negative with a positive sum")
    if n and (int(edges.min()) < 0 or int(edges.max()) >= num_edges):
        raise ValueError(f"edge indices must lie in [0, {num_edges})")
    p = w / w.sum()
    share = torch.zeros(num_edges, dtype=torch.float64, device=g.device).index_add_(0, edges, p)
    if bool((share <= 0).any()):
        empty = torch.nonzero(share <= 0).reshape(-1).tolist()
        raise ValueError(f"edges {empty} hold no client weight: divergences are undefined")
    mean = (p[:, None] * g).sum(0)
    edge_means = segment_weighted_mean(g, p, edges, num_edges)
    client_sq = ((g - mean) ** 2).sum(1)
    within_sq = ((g - edge_means[edges]) ** 2).sum(1)
    edge_sq = ((edge_means - mean) ** 2).sum(1)
    within_by_edge = torch.zeros(num_edges, dtype=torch.float64, device=g.device).index_add_(
        0, edges, p * within_sq)
    return {
        "global_divergence": float((p * client_sq).sum()),
        "upward_divergence": float((share * edge_sq).sum()),
        "downward_divergence": float(within_by_edge.sum()),
        "downward_divergence_by_edge": (within_by_edge / share).tolist(),
        "grad_norm": float(torch.linalg.vector_norm(mean)),
    }


def label_distributions(label_histograms: np.ndarray) -> np.ndarray:
    """Each client's label distribution: histogram / row count, float64 [n, C] (0 if no rows)."""
    h = np.asarray(label_histograms, dtype=np.float64)
    return h / np.maximum(h.sum(1, keepdims=True), 1.0)


def label_upward_divergence(label_histograms: np.ndarray, edge_of_client: np.ndarray,
                            num_edges: int, weights: np.ndarray | None = None) -> float:
    """Label-based proxy of the upward divergence: Σ_i P_i ||π_i − π||².

    Args:
        label_histograms: int [n, C] rows per label of each client.
        edge_of_client: int [n] edge of each client.
        num_edges: N.
        weights: [n] client weights, or None for row counts (the histograms' row sums).

    With weights=None, π_i is edge i's label distribution (its summed histogram, normalised),
    π the global one, and P_i the edge's share of rows. With weights w_j, client j's label
    distribution π^(j) is weighted by p_j = w_j / Σ w: π_i = Σ_{j∈V_i} p_j π^(j) / P_i,
    π = Σ_j p_j π^(j), P_i = Σ_{j∈V_i} p_j (row weights reproduce the first case exactly).
    This is :func:`divergences`' ``upward_divergence`` with label distributions in place of
    gradients.
    """
    h = np.asarray(label_histograms)
    w = h.sum(1) if weights is None else np.asarray(weights)
    result = divergences(torch.from_numpy(label_distributions(h)),
                         torch.as_tensor(w, dtype=torch.float64),
                         torch.as_tensor(np.asarray(edge_of_client), dtype=torch.int64),
                         num_edges)
    return float(result["upward_divergence"])
