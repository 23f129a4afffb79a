"""Divergences and gradient diversity on real gradients (digits, an initial mlp, 40 clients)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fedhier.common.rng import generator
from fedhier.data import label_histogram, load_data, partition_clients
from fedhier.diagnostics.measures import (
    batch_size_bound,
    divergences,
    flat_gradient,
    gradient_diversity,
    label_upward_divergence,
    per_example_gradients,
    sample_gradient_diversity,
)
from fedhier.local.models import build_model
from fedhier.local.train import loss_fn, params_of
from fedhier.tree.grouping import ClientInfo, assign_groups

NUM_CLIENTS, NUM_EDGES = 40, 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class DigitsClients:
    model: torch.nn.Module
    params: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    parts: list[np.ndarray]
    info: ClientInfo
    grads: torch.Tensor  # [n, P] full local gradient of each client at the initial model
    # [n, n] float64 isometric embedding of grads (same pairwise distances, so the same
    # divergences for every grouping and weighting): fast for many groupings
    embedded: torch.Tensor

    def weights(self, kind: str) -> torch.Tensor:
        if kind == "uniform":
            return torch.ones(len(self.parts), dtype=torch.float64)
        return torch.as_tensor(self.info.num_examples, dtype=torch.float64)


@functools.cache
def digits_clients() -> DigitsClients:
    """Digits, Dirichlet(0.1) over 40 clients, an initial mlp and each client's gradient.

    min_partition_size=2: with alpha=0.1 flwr-datasets cannot give all 40 clients the default
    10 rows.
    """
    bundle = load_data("digits", seed=0)
    parts = partition_clients(bundle, "dirichlet", NUM_CLIENTS, seed=0, alpha=0.1,
                              min_partition_size=2)
    x_np, y_np = bundle.train_arrays()
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    model = build_model("mlp", bundle.input_shape, bundle.num_classes, seed=0)
    params = params_of(model)
    grads = torch.stack([flat_gradient(model, params, x[p], y[p]) for p in parts])
    hist = np.stack([label_histogram(y_np[p], bundle.num_classes) for p in parts])
    info = ClientInfo(label_histograms=hist,
                      num_examples=np.array([len(p) for p in parts], dtype=np.int64))
    embedded = torch.linalg.qr(grads.double().T).R.T
    return DigitsClients(model, params, x, y, parts, info, grads, embedded)


def edges_of(grouping: str, seed: int) -> torch.Tensor:
    return torch.as_tensor(assign_groups(grouping, digits_clients().info, NUM_EDGES, seed))


def backward_gradient(model: torch.nn.Module, params: dict[str, torch.Tensor],
                      x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: load params into the module, loss.backward(), read .grad."""
    model.load_state_dict(params)
    model.zero_grad()
    loss_fn(model, dict(model.named_parameters()), x, y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return torch.cat([g.reshape(-1) for g in grads if g is not None])


# ---------------------------------------------------------------- gradients


def test_flat_gradient_equals_backward():
    d = digits_clients()
    rows = d.parts[int(np.argmax(d.info.num_examples))]
    x, y = d.x[rows], d.y[rows]
    expected = backward_gradient(d.model, d.params, x, y)
    for chunk in (4096, 7):  # one pass, and many chunks of unequal size
        got = flat_gradient(d.model, d.params, x, y, chunk=chunk)
        assert got.shape == (sum(v.numel() for v in d.params.values()),)
        assert float((got - expected).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="empty"):
        flat_gradient(d.model, d.params, x[:0], y[:0])


def test_per_example_gradients_equal_single_backward_passes():
    d = digits_clients()
    x, y = d.x[:19], d.y[:19]
    got = per_example_gradients(d.model, d.params, x, y, chunk=5)
    expected = torch.stack([backward_gradient(d.model, d.params, x[k:k + 1], y[k:k + 1])
                            for k in range(len(y))])
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < 1e-6
    full = flat_gradient(d.model, d.params, x, y)
    assert float((got.mean(0) - full).abs().max()) < 1e-6


# ---------------------------------------------------------------- divergences


@pytest.mark.parametrize("kind", ["uniform", "samples"])
@pytest.mark.parametrize("grouping,seed", [("random", 0), ("random", 1), ("contiguous", 0)])
def test_variance_identity_on_real_gradients(kind, grouping, seed):
    d = digits_clients()
    result = divergences(d.grads, d.weights(kind), edges_of(grouping, seed), NUM_EDGES)
    total = result["global_divergence"]
    parts = result["upward_divergence"] + result["downward_divergence"]
    assert total > 0 and result["upward_divergence"] > 0 and result["downward_divergence"] > 0
    assert abs(total - parts) <= 1e-6 * total
    # downward = Σ_i P_i ε_i², with P_i the edges' weight shares
    p = d.weights(kind) / d.weights(kind).sum()
    shares = torch.zeros(NUM_EDGES, dtype=torch.float64).index_add_(
        0, edges_of(grouping, seed), p)
    by_edge = torch.tensor(result["downward_divergence_by_edge"], dtype=torch.float64)
    assert float((shares * by_edge).sum()) == pytest.approx(result["downward_divergence"],
                                                            rel=1e-12)


def test_divergences_match_the_paper_formulas_with_uniform_weights():
    d = digits_clients()
    edges = edges_of("random", 3)
    g = d.grads.double()
    mean = g.mean(0)
    expected_global = float(((g - mean) ** 2).sum(1).mean())
    up, down = 0.0, []
    for i in range(NUM_EDGES):
        members = g[edges == i]
        up += len(members) / len(g) * float(((members.mean(0) - mean) ** 2).sum())
        down.append(float(((members - members.mean(0)) ** 2).sum(1).mean()))
    result = divergences(d.grads, torch.ones(len(g)), edges, NUM_EDGES)
    assert result["global_divergence"] == pytest.approx(expected_global, rel=1e-10)
    assert result["upward_divergence"] == pytest.approx(up, rel=1e-10)
    assert result["downward_divergence_by_edge"] == pytest.approx(down, rel=1e-10)
    assert result["grad_norm"] == pytest.approx(float(mean.norm()), rel=1e-10)


@pytest.mark.parametrize("kind", ["uniform", "samples"])
def test_one_group_has_no_upward_and_singletons_no_downward_divergence(kind):
    d = digits_clients()
    n = len(d.parts)
    w = d.weights(kind)
    one = divergences(d.grads, w, torch.zeros(n, dtype=torch.int64), 1)
    assert one["upward_divergence"] <= 1e-12
    assert one["downward_divergence"] == pytest.approx(one["global_divergence"], rel=1e-12)
    alone = divergences(d.grads, w, torch.arange(n), n)
    assert alone["downward_divergence"] <= 1e-12
    assert max(alone["downward_divergence_by_edge"]) <= 1e-12
    assert alone["upward_divergence"] == pytest.approx(alone["global_divergence"], rel=1e-12)


@pytest.mark.parametrize("kind", ["uniform", "samples"])
def test_isometric_embedding_gives_the_same_divergences(kind):
    """Divergences depend on gradients only through distances: the n-dim QR embedding used
    for fast repeated evaluation gives the full-dimensional values."""
    d = digits_clients()
    for seed in range(3):
        full = divergences(d.grads, d.weights(kind), edges_of("random", seed), NUM_EDGES)
        fast = divergences(d.embedded, d.weights(kind), edges_of("random", seed), NUM_EDGES)
        for key in ("global_divergence", "upward_divergence", "downward_divergence"):
            assert fast[key] == pytest.approx(full[key], rel=1e-9)


def test_divergences_reject_an_empty_edge():
    d = digits_clients()
    with pytest.raises(ValueError, match="no client weight"):
        divergences(d.grads, torch.ones(len(d.parts)), torch.zeros(len(d.parts),
                                                                   dtype=torch.int64), 2)


def test_random_grouping_matches_expected_divergences():
    """E[ε²] = ε̃²(N−1)/(n−1), E[Σ_i (n_i/n) ε_i²] = ε̃²(n−N)/(n−1) (algorithms.md §3)."""
    d = digits_clients()
    n = len(d.parts)
    uniform = torch.ones(n)
    runs = [divergences(d.embedded, uniform, edges_of("random", seed), NUM_EDGES)
            for seed in range(400)]
    global_div = runs[0]["global_divergence"]
    up = np.mean([r["upward_divergence"] for r in runs])
    down = np.mean([r["downward_divergence"] for r in runs])
    assert up / (global_div * (NUM_EDGES - 1) / (n - 1)) == pytest.approx(1.0, abs=0.05)
    assert down / (global_div * (n - NUM_EDGES) / (n - 1)) == pytest.approx(1.0, abs=0.05)


# ---------------------------------------------------------------- diversity


@pytest.mark.parametrize("m", [1, 3, 10])
def test_diversity_closed_forms(m):
    orthogonal = 2.5 * torch.eye(m, 17)
    assert batch_size_bound(orthogonal) == pytest.approx(m, rel=1e-12)
    assert gradient_diversity(orthogonal) == pytest.approx(1.0, rel=1e-12)
    identical = torch.linspace(-1, 2, 17).repeat(m, 1)
    assert gradient_diversity(identical) == pytest.approx(1 / m, rel=1e-6)
    assert batch_size_bound(identical) == pytest.approx(1.0, rel=1e-6)


def test_diversity_of_a_zero_sum_is_an_error():
    g = torch.randn(3, 5)
    with pytest.raises(ValueError, match="sum to zero"):
        gradient_diversity(torch.cat([g, -g]))


def test_client_diversity_links_to_global_divergence():
    """n·Δ = 1 + ε̃²/||ḡ||² with uniform weights (algorithms.md §4)."""
    d = digits_clients()
    n = len(d.parts)
    result = divergences(d.grads, torch.ones(n), torch.zeros(n, dtype=torch.int64), 1)
    expected = 1 + result["global_divergence"] / result["grad_norm"] ** 2
    assert batch_size_bound(d.grads) == pytest.approx(expected, rel=1e-9)


def test_sample_gradient_diversity_matches_per_example_gradients():
    d = digits_clients()
    rows = d.parts[0]
    x, y = d.x[rows], d.y[rows]
    delta, used = sample_gradient_diversity(d.model, d.params, x, y, None, seed=0, chunk=16)
    per_example = per_example_gradients(d.model, d.params, x, y)
    assert used == len(rows)
    # per-chunk norms and sums are float32 reductions (the gradients' own precision)
    assert delta == pytest.approx(gradient_diversity(per_example), rel=1e-6)
    assert delta >= 1 / used

    x, y = d.x[:300], d.y[:300]
    delta, used = sample_gradient_diversity(d.model, d.params, x, y, 50, seed=4)
    assert used == 50
    picked = np.sort(generator(4, "diversity-sample").choice(300, size=50, replace=False))
    expected = gradient_diversity(per_example_gradients(d.model, d.params, x[picked], y[picked]))
    assert delta == pytest.approx(expected, rel=1e-6)
    assert sample_gradient_diversity(d.model, d.params, x, y, 50, seed=4) == (delta, used)
    assert sample_gradient_diversity(d.model, d.params, x, y, 50, seed=5)[0] != delta
    assert sample_gradient_diversity(d.model, d.params, x, y, 1000, seed=4)[1] == 300


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_sample_gradient_diversity_of_every_model_matches_per_example_gradients(name):
    """logreg and mlp take the closed form ||δ aᵀ||² = ||δ||² ||a||² (no per-example
    gradients), cnn the vmap path; all must equal Δ of the explicit per-example gradients."""
    bundle = load_data("digits", seed=0)
    x_np, y_np = bundle.train_arrays()
    x, y = torch.from_numpy(x_np[:500]), torch.from_numpy(y_np[:500])
    model = build_model(name, bundle.input_shape, bundle.num_classes, seed=1)
    params = params_of(model)
    params = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}  # ReLUs off and on
    delta, used = sample_gradient_diversity(model, params, x, y, None, seed=0)
    expected = gradient_diversity(per_example_gradients(model, params, x, y))
    assert used == 500
    assert delta == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- label proxy


def test_label_upward_divergence_by_hand():
    hist = np.array([[4, 0], [0, 2], [1, 1], [3, 1]])
    edges = np.array([0, 0, 1, 1])
    # edge 0: 4+0, 0+2 -> [4, 2]/6; edge 1: [4, 2]/6 as well -> identical mixes
    assert label_upward_divergence(hist, edges, 2) == pytest.approx(0.0, abs=1e-15)
    edges = np.array([0, 1, 0, 1])
    pi = np.array([8, 4]) / 12
    pi0, pi1 = np.array([5, 1]) / 6, np.array([3, 3]) / 6
    expected = 0.5 * ((pi0 - pi) ** 2).sum() + 0.5 * ((pi1 - pi) ** 2).sum()
    assert label_upward_divergence(hist, edges, 2) == pytest.approx(expected, rel=1e-12)
    rows = hist.sum(1)
    assert label_upward_divergence(hist, edges, 2, rows) == pytest.approx(expected, rel=1e-12)
    assert label_upward_divergence(hist, np.zeros(4, dtype=np.int64), 1) <= 1e-15
    # uniform client weights mix client label distributions equally
    dists = hist / rows[:, None]
    q0, q1, q = dists[[0, 2]].mean(0), dists[[1, 3]].mean(0), dists.mean(0)
    uniform = 0.5 * ((q0 - q) ** 2).sum() + 0.5 * ((q1 - q) ** 2).sum()
    assert label_upward_divergence(hist, edges, 2, np.ones(4)) == pytest.approx(uniform,
                                                                                 rel=1e-12)
