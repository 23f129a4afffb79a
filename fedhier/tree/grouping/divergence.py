"""Divergence-aware groupings: minimise or maximise the upward divergence of the edges.

Every grouping here optimises one objective, the weighted between-group scatter of client
feature vectors z_j with weights w_j (p_j = w_j / Σ w, P_i = Σ_{j∈V_i} p_j):

    U(V) = Σ_i P_i ||μ_i − μ||²,  μ_i = Σ_{j∈V_i} p_j z_j / P_i,  μ = Σ_j p_j z_j,

which is :func:`fedhier.diagnostics.measures.divergences`' ``upward_divergence`` of the z_j.

- ``min_divergence_grouping`` / ``max_divergence_grouping``: z_j = client j's label
  distribution, w_j = its rows, so U is
  :func:`fedhier.diagnostics.measures.label_upward_divergence`.
- ``gradient_grouping`` / ``make_gradient_grouping``: z_j = client j's measured gradient,
  w_j = the run's client weights, so U is the measured upward divergence ε².

One search, :func:`search_grouping`, serves all of them: a greedy pass (clients in a given
order, each to the open group whose resulting mean is closest to, or for maximising farthest
from, the global mean, within the capacities ``balanced_sizes(n, N)``), then local search by
pairwise swaps between groups (sweeps over the clients in the same order; for each client the
best swap partner in another group is taken if it improves U) until a sweep improves nothing
or ``max_sweeps`` sweeps ran. Swaps keep the group sizes, so the result has exactly
``balanced_sizes(n, N)`` clients per group. The search only needs the Gram matrix of the
centred, weighted features u_j = w_j (z_j − μ): with S_i = Σ_{j∈V_i} u_j and W_i = Σ_{j∈V_i} w_j,
U = Σ_i ||S_i||² / (W_i Σ w), and a swap's change is evaluated in O(n) for all partners at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedhier.common.rng import generator
from fedhier.tree.grouping.base import ClientInfo, Grouping, balanced_sizes, declares

if TYPE_CHECKING:  # torch is imported where it is used: the CLI answers without it
    import torch

MAX_SWEEPS = 100
PROJECTION_DIM = 256
_COLUMN_BLOCK = 8192


def _check_groups(num_clients: int, num_groups: int) -> None:
    if not 1 <= num_groups <= num_clients:
        raise ValueError(f"need 1 <= num_groups <= {num_clients} clients, got {num_groups}")


def _positive_weights(weights: np.ndarray) -> np.ndarray:
    """float64 weights with zeros raised to 1e-9 of the largest (all zero -> all one)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("client weights must be finite and non-negative")
    top = float(w.max(initial=0.0))
    return np.ones_like(w) if top == 0 else np.maximum(w, 1e-9 * top)


def weighted_gram(features: np.ndarray | torch.Tensor, weights: np.ndarray, seed: int,
                  max_dim: int = PROJECTION_DIM) -> np.ndarray:
    """Gram matrix [n, n] of u_j = w_j (z_j − μ), μ = Σ w_j z_j / Σ w_j, for features z [n, D].

    Exact (float64, columns processed in blocks) when D <= max_dim or n <= max_dim, i.e. when
    it costs no more than a projection. Otherwise the u_j are first mapped to ``max_dim``
    dimensions by a seeded Gaussian projection R [D, max_dim] / sqrt(max_dim) drawn from
    ``generator(seed, "gradient-grouping-projection")``: squared norms and inner products are
    then preserved in expectation, with relative error of order 1 / sqrt(max_dim)
    (Johnson-Lindenstrauss), so the search optimises an approximation of U.
    """
    import torch

    z = torch.as_tensor(features)
    z = z.reshape(z.shape[0], -1)
    n, dim = int(z.shape[0]), int(z.shape[1])
    w = torch.from_numpy(np.asarray(weights, dtype=np.float64))
    project = dim > max_dim and n > max_dim
    rng = generator(seed, "gradient-grouping-projection") if project else None
    acc = torch.zeros((n, max_dim) if project else (n, n), dtype=torch.float64)
    for start in range(0, dim, _COLUMN_BLOCK):
        block = z[:, start:start + _COLUMN_BLOCK].to(device="cpu", dtype=torch.float64)
        block = w[:, None] * (block - (w @ block) / w.sum())
        if rng is None:
            acc += block @ block.T
        else:  # float32 products: rounding far below the projection's own error
            r = rng.standard_normal((int(block.shape[1]), max_dim), dtype=np.float32)
            acc += (block.float() @ torch.from_numpy(r)).double() / np.sqrt(max_dim)
    return (acc @ acc.T if project else acc).numpy()


def search_grouping(gram: np.ndarray, weights: np.ndarray, num_groups: int, order: np.ndarray,
                    *, maximise: bool = False, max_sweeps: int = MAX_SWEEPS) -> np.ndarray:
    """Greedy assignment + pairwise-swap local search on U = Σ_i ||S_i||² / (W_i Σ w).

    Args:
        gram: [n, n] float64 Gram matrix of the centred weighted features (see
            :func:`weighted_gram`).
        weights: [n] positive client weights w_j (the same ones used in ``gram``).
        num_groups: N, 1 <= N <= n.
        order: a permutation of range(n): greedy insertion order and swap sweep order.
        maximise: maximise U instead of minimising it.
        max_sweeps: iteration cap on swap sweeps.

    Returns:
        int64 [n] group of each client; group i holds exactly ``balanced_sizes(n, N)[i]``.
    """
    g = np.asarray(gram, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    n = g.shape[0]
    _check_groups(n, num_groups)
    sizes = balanced_sizes(n, num_groups)
    sign = -1.0 if maximise else 1.0
    diag = np.diag(g).copy()

    # Greedy: S·u_k for every group and client (su), ||S_i||² (ss), W_i (wg).
    su = np.zeros((num_groups, n))
    ss = np.zeros(num_groups)
    wg = np.zeros(num_groups)
    count = np.zeros(num_groups, dtype=np.int64)
    assign = np.full(n, -1, dtype=np.int64)
    for j in np.asarray(order, dtype=np.int64):
        dist = sign * (ss + 2 * su[:, j] + diag[j]) / (wg + w[j]) ** 2
        dist[count >= sizes] = np.inf
        a = int(np.argmin(dist))
        ss[a] += 2 * su[a, j] + diag[j]
        su[a] += g[j]
        wg[a] += w[j]
        count[a] += 1
        assign[j] = a
    if num_groups == 1 or num_groups == n:
        return assign

    tol = 1e-12 * float(np.sum(diag / w)) + 1e-300
    clients = np.arange(n)
    for _ in range(max_sweeps):
        onehot = np.zeros((num_groups, n))
        onehot[assign, clients] = 1.0
        su = onehot @ g
        ss = np.einsum("in,in->i", su, onehot)
        wg = onehot @ w
        improved = False
        for j in np.asarray(order, dtype=np.int64):
            a = int(assign[j])
            su_self = su[assign, clients]  # S_{b(k)} · u_k
            base = diag[j] + diag - 2 * g[j]  # ||u_j - u_k||²
            num_a = ss[a] + base - 2 * su[a, j] + 2 * su[a]
            num_b = ss[assign] + base + 2 * su[assign, j] - 2 * su_self
            w_a = wg[a] - w[j] + w
            w_b = wg[assign] + w[j] - w
            delta = sign * (num_a / w_a + num_b / w_b - ss[a] / wg[a] - ss[assign] / wg[assign])
            delta[assign == a] = np.inf
            k = int(np.argmin(delta))
            if not delta[k] < -tol:
                continue
            b = int(assign[k])
            step = g[k] - g[j]
            su[a] += step
            su[b] -= step
            ss[a], ss[b] = num_a[k], num_b[k]
            wg[a], wg[b] = w_a[k], w_b[k]
            assign[j], assign[k] = b, a
            improved = True
        if not improved:
            break
    return assign


def _seeded_order(seed: int, purpose: str, *keys: np.ndarray) -> np.ndarray:
    """Clients sorted by ``keys`` (first key primary, ascending), ties in a seeded random order."""
    n = len(keys[0])
    shuffle = generator(seed, purpose).permutation(n)
    ranked = np.lexsort(tuple(k[shuffle] for k in reversed(keys)))
    return shuffle[ranked].astype(np.int64)


def _label_search(info: ClientInfo, num_groups: int, seed: int, maximise: bool) -> np.ndarray:
    _check_groups(info.num_clients, num_groups)
    from fedhier.diagnostics.measures import label_distributions

    dists = label_distributions(info.label_histograms)
    rows = _positive_weights(np.asarray(info.label_histograms).sum(1))
    if maximise:  # clients sharing a dominant label next to each other, largest first
        order = _seeded_order(seed, "grouping-max-divergence", dists.argmax(1), -rows)
    else:  # largest first
        order = _seeded_order(seed, "grouping-min-divergence", -rows)
    gram = weighted_gram(dists, rows, seed)
    return search_grouping(gram, rows, num_groups, order, maximise=maximise)


@declares("labels")
def min_divergence_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """Groups whose label mix matches the global mix: minimises the label upward divergence.

    Objective: :func:`fedhier.diagnostics.measures.label_upward_divergence` (row-weighted). Search:
    :func:`search_grouping`, clients largest first (ties in a seeded order). Balanced sizes.
    """
    return _label_search(info, num_groups, seed, maximise=False)


@declares("labels")
def max_divergence_grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
    """The adversarial opposite: groups as label-pure as possible (maximal label divergence).

    Maximises :func:`fedhier.diagnostics.measures.label_upward_divergence` (row-weighted) with
    :func:`search_grouping`, clients ordered by dominant label, then largest first (ties in a
    seeded order), so the greedy pass fills groups with same-label clients. Balanced sizes.
    """
    return _label_search(info, num_groups, seed, maximise=True)


def _grouping_weights(info: ClientInfo, weights: str | np.ndarray | torch.Tensor) -> np.ndarray:
    from fedhier.round.aggregators.averaging import client_weights

    if isinstance(weights, str):  # "uniform" or "samples", as the run's --weighting
        return _positive_weights(client_weights(weights, np.asarray(info.num_examples)))
    w = weights.detach().cpu().numpy() if hasattr(weights, "detach") else np.asarray(
        weights)
    if w.shape != (info.num_clients,):
        raise ValueError(f"need {info.num_clients} client weights, got shape {w.shape}")
    return _positive_weights(w)


def gradient_grouping(info: ClientInfo, num_groups: int, seed: int,
                      client_grads: torch.Tensor | np.ndarray,
                      weights: str | np.ndarray | torch.Tensor = "uniform", *,
                      maximise: bool = False, max_dim: int = PROJECTION_DIM) -> np.ndarray:
    """Groups minimising (or maximising) the measured upward divergence ε² of client gradients.

    Args:
        info: the clients (only ``num_examples`` is read, for ``weights="samples"``).
        num_groups, seed: as in :class:`fedhier.tree.grouping.base.Grouping`.
        client_grads: [n, P] full local gradient of each client at the current model.
        weights: "uniform" (p_j = 1/n), "samples" (p_j = m_j/m) or an array [n]: the client
            weights of ε² (:func:`fedhier.diagnostics.measures.divergences`).
        maximise: maximise ε² (adversarial grouping) instead of minimising it.
        max_dim: gradients are compared exactly when P <= max_dim or n <= max_dim, otherwise
            through a seeded Gaussian projection to max_dim dimensions (:func:`weighted_gram`).

    Search: :func:`search_grouping`; order largest weight first (ties, e.g. all with uniform
    weights, in a seeded order); when maximising, by the leading principal coordinate of the
    centred weighted gradients instead. Balanced sizes.
    """
    n = info.num_clients
    if int(client_grads.shape[0]) != n:
        raise ValueError(f"{client_grads.shape[0]} client gradients for {n} clients")
    _check_groups(n, num_groups)
    w = _grouping_weights(info, weights)
    gram = weighted_gram(client_grads, w, seed, max_dim)
    if maximise:
        _, vectors = np.linalg.eigh(gram)
        order = _seeded_order(seed, "grouping-gradient", vectors[:, -1])
    else:
        order = _seeded_order(seed, "grouping-gradient", -w)
    return search_grouping(gram, w, num_groups, order, maximise=maximise)


def make_gradient_grouping(client_grads: torch.Tensor | np.ndarray,
                           weights: str | np.ndarray | torch.Tensor = "uniform", *,
                           maximise: bool = False,
                           max_dim: int = PROJECTION_DIM) -> Grouping:
    """A :class:`~fedhier.tree.grouping.base.Grouping` closing over measured client gradients [n,
    P].

    See :func:`gradient_grouping` for the arguments.
    """

    def grouping(info: ClientInfo, num_groups: int, seed: int) -> np.ndarray:
        return gradient_grouping(info, num_groups, seed, client_grads, weights,
                                 maximise=maximise, max_dim=max_dim)

    return grouping


__all__ = [
    "gradient_grouping", "make_gradient_grouping", "max_divergence_grouping",
    "min_divergence_grouping", "search_grouping", "weighted_gram",
]
