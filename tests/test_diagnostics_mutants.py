"""fedhier/diagnostics/measures.py, value by value: the mutants `make mutation` left alive.

Tiny float64 models (7 rows, 3 features, 3 classes) against gradients taken one example at a
time with plain autograd, and divergences worked out by hand.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from fedhier.common.rng import generator
from fedhier.diagnostics.measures import (
    _linear_chain_sums,
    batch_size_bound,
    divergences,
    flat_gradient,
    gradient_diversity,
    label_distributions,
    per_example_gradients,
    sample_gradient_diversity,
)
from fedhier.local.models import MLP, LogReg, linear_chain
from tests.helpers import assert_refused

X = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.2, -0.3], [-2.0, 1.0, 0.0], [0.1, 0.1, 0.1],
                  [3.0, -0.5, 1.0], [-1.0, -1.0, 0.5], [0.7, 2.2, -1.4]], dtype=torch.float64)
Y = torch.tensor([0, 2, 1, 1, 0, 2, 2])


def _params(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
            for k, v in model.state_dict().items()}


def _by_example(model: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """[m, P]: each row's gradient of its cross-entropy, by autograd one example at a time."""
    rows = []
    for k in range(len(Y)):
        leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
        logits = torch.func.functional_call(model, leaves, (X[k:k + 1],))
        grads = torch.autograd.grad(nn.functional.cross_entropy(logits, Y[k:k + 1]),
                                    tuple(leaves.values()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """Same shape, every entry within ``atol`` (torch.testing's first call costs seconds)."""
    assert got.shape == expected.shape
    assert float((got.double() - expected.double()).abs().max()) <= atol


_refused = functools.partial(assert_refused, error=ValueError)


class _Counted(LogReg):
    """A logreg with an integer buffer: held constant, left out of the gradient."""

    def __init__(self) -> None:
        super().__init__((3,), 3)
        self.register_buffer("count", torch.tensor(0))


def test_flat_gradient_closed_form():
    model = LogReg((3,), 3)
    params = _params(model, 0)
    # mean CE of logits W x + b: dW = (softmax - onehot)^T x / m, db = mean(softmax - onehot)
    delta = torch.softmax(X @ params["linear.weight"].T + params["linear.bias"], 1)
    delta[torch.arange(7), Y] -= 1
    expected = torch.cat([(delta.T @ X / 7).reshape(-1), delta.mean(0)])
    for chunk in (4096, 7, 3, 1):
        got = flat_gradient(model, params, X, Y, chunk=chunk)
        assert got.dtype == torch.float64
        _close(got, expected, 1e-14)
    single = flat_gradient(model, {k: v.float() for k, v in params.items()}, X.float(), Y)
    assert single.dtype == torch.float32
    _close(single.double(), expected, 1e-6)
    counted = _Counted()
    with_int = {**params, "count": torch.tensor(5)}
    _close(flat_gradient(counted, with_int, X, Y), expected, 1e-14)
    _refused(lambda: flat_gradient(counted, {"count": torch.tensor(5)}, X, Y),
             "params has no floating-point entries to differentiate")


def test_row_checks():
    model = LogReg((3,), 3)
    params = _params(model, 0)
    _refused(lambda: flat_gradient(model, params, X[:0], Y[:0]),
             "gradient of an empty data set: x and y have no rows")
    _refused(lambda: flat_gradient(model, params, X[:4], Y[:2]), "x has 4 rows but y has 2")
    _refused(lambda: per_example_gradients(model, params, X[:3], Y[:4]),
             "x has 3 rows but y has 4")


@pytest.mark.parametrize("chunk", [256, 3, 1])
def test_per_example_gradients_are_autograd_one_by_one(chunk):
    model = MLP((3,), 3, hidden=4)
    params = _params(model, 1)
    expected = _by_example(model, params)
    got = per_example_gradients(model, params, X, Y, chunk=chunk)
    _close(got, expected, 1e-12)
    _close(got.mean(0), flat_gradient(model, params, X, Y), 1e-12)


def test_diversity_by_hand():
    g = torch.tensor([[1.0, 0.0], [1.0, 2.0]])
    # Σ||g_k||² = 1 + 5 = 6, ||Σ g_k||² = ||(2, 2)||² = 8
    assert gradient_diversity(g) == 0.75
    assert batch_size_bound(g) == 1.5
    assert gradient_diversity(torch.tensor([[[3.0]], [[1.0]]])) == 10 / 16  # [m, 1, 1]
    _refused(lambda: gradient_diversity(torch.tensor([[1.0, -2.0], [-1.0, 2.0]])),
             "gradient diversity is undefined: the gradients sum to zero (||Σ_k g_k||² = 0)")


def _mlp_with_dead_units() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = MLP((3,), 3, hidden=5)
    params = _params(model, 2)
    hidden = X @ params["hidden.weight"].T + params["hidden.bias"]
    assert (hidden < 0).any() and (hidden > 0).any()  # ReLUs both off and on
    return model, params


def test_linear_chain_sums_are_those_of_the_per_example_gradients():
    model, params = _mlp_with_dead_units()
    layers = linear_chain(model)
    assert layers is not None
    reference = _by_example(model, params)
    for chunk in (4096, 3, 1):
        sum_sq, total = _linear_chain_sums(layers, params, X, Y, chunk=chunk)
        assert sum_sq == pytest.approx(float((reference ** 2).sum()), rel=1e-12)
        _close(total, reference.sum(0), 1e-12)


class _TanhNet(nn.Module):
    """Not a Linear/ReLU chain: the per-example (vmap) path."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("build", [_mlp_with_dead_units, lambda: (_TanhNet(),
                                                                  _params(_TanhNet(), 3))])
def test_sample_gradient_diversity_by_reference(build):
    model, params = build()
    reference = _by_example(model, params)
    full = float((reference ** 2).sum() / (reference.sum(0) ** 2).sum())
    for max_samples, chunk in ((None, 64), (7, 2), (50, 1)):
        delta, used = sample_gradient_diversity(model, params, X, Y, max_samples, seed=0,
                                                chunk=chunk)
        assert used == 7 and delta == pytest.approx(full, rel=1e-12)
    picked = np.sort(generator(4, "diversity-sample").choice(7, size=3, replace=False))
    sub = reference[picked]
    delta, used = sample_gradient_diversity(model, params, X, Y, 3, seed=4, chunk=2)
    assert used == 3
    assert delta == pytest.approx(float((sub ** 2).sum() / (sub.sum(0) ** 2).sum()), rel=1e-12)
    # six of seven rows: drawn without replacement (a draw with replacement repeats rows)
    picked = np.sort(generator(1, "diversity-sample").choice(7, size=6, replace=False))
    sub = reference[picked]
    assert sample_gradient_diversity(model, params, X, Y, 6, seed=1, chunk=4) == \
        pytest.approx((float((sub ** 2).sum() / (sub.sum(0) ** 2).sum()), 6), rel=1e-12)
    # one row: Δ = ||g||² / ||g||² = 1
    assert sample_gradient_diversity(model, params, X, Y, 1, seed=0) == pytest.approx((1.0, 1))
    for bad in (0, -2):
        _refused(lambda bad=bad: sample_gradient_diversity(model, params, X, Y, bad, seed=0),
                 f"max_samples must be at least 1 (or None for all rows), got {bad}")


# clients 0..3 with gradients (1,0), (3,0), (0,2), (0,6), weights 1, 1, 1, 3, edges 0, 0, 1, 1:
# p = 1/6, 1/6, 1/6, 1/2; ∇f = (2/3, 10/3); P = 1/3, 2/3; ∇f_0 = (2, 0), ∇f_1 = (0, 5).
# ε² = 1/3 (16/9 + 100/9) + 2/3 (4/9 + 25/9) = 58/9; ε_0² = 1, ε_1² = 1/4 * 9 + 3/4 * 1 = 3;
# Σ P_i ε_i² = 7/3; ε̃² = 58/9 + 7/3 = 79/9; ||∇f|| = sqrt(104) / 3.
GRADS = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 6.0]])
WEIGHTS = torch.tensor([1.0, 1.0, 1.0, 3.0])
EDGES = torch.tensor([0, 0, 1, 1])


def test_divergences_by_hand():
    got = divergences(GRADS, WEIGHTS, EDGES, 2)
    assert got["upward_divergence"] == pytest.approx(58 / 9, rel=1e-14)
    assert got["downward_divergence"] == pytest.approx(7 / 3, rel=1e-14)
    assert got["downward_divergence_by_edge"] == pytest.approx([1.0, 3.0], rel=1e-14)
    assert got["global_divergence"] == pytest.approx(79 / 9, rel=1e-14)
    assert got["grad_norm"] == pytest.approx(np.sqrt(104) / 3, rel=1e-14)
    assert set(got) == {"upward_divergence", "downward_divergence", "global_divergence",
                        "downward_divergence_by_edge", "grad_norm"}
    # the same with weights scaled, as numpy arrays, and gradients [n, 1, 2]
    again = divergences(GRADS.reshape(4, 1, 2), np.array([2.0, 2.0, 2.0, 6.0]),
                        np.array([0, 0, 1, 1]), 2)
    assert again["upward_divergence"] == pytest.approx(58 / 9, rel=1e-14)


@pytest.mark.parametrize("weights, edges, num_edges, message", [
    (WEIGHTS[:3], EDGES, 2, "4 client gradients but 3 weights and 4 edge indices"),
    (WEIGHTS, EDGES[:3], 2, "4 client gradients but 4 weights and 3 edge indices"),
    (torch.tensor([1.0, -1.0, 1.0, 1.0]), EDGES, 2,
     "client weights must be non-negative with a positive sum"),
    (torch.zeros(4), EDGES, 2, "client weights must be non-negative with a positive sum"),
    (WEIGHTS, torch.tensor([0, 0, 2, 1]), 2, "edge indices must lie in [0, 2)"),
    (WEIGHTS, torch.tensor([0, -1, 1, 1]), 2, "edge indices must lie in [0, 2)"),
    (torch.tensor([1.0, 1.0, 0.0, 0.0]), EDGES, 2,
     "edges [1] hold no client weight: divergences are undefined"),
    (WEIGHTS, EDGES, 4, "edges [2, 3] hold no client weight: divergences are undefined"),
])
def test_divergences_refuse(weights, edges, num_edges, message):
    _refused(lambda: divergences(GRADS, weights, edges, num_edges), message)


def test_label_distributions():
    dists = label_distributions(np.array([[2, 6], [0, 0], [1, 0]]))
    assert dists.tolist() == [[0.25, 0.75], [0.0, 0.0], [1.0, 0.0]]
    assert dists.dtype == np.float64


def test_divergences_are_computed_in_float64():
    """float32 gradients whose values float32 cannot hold exactly: every quantity as the
    formulas give it in float64 from those float32 values (a float32 computation is off by
    ~1e-8 relative)."""
    g32 = (GRADS / 3 + 0.1).float()
    g = g32.double().numpy()
    p = np.array([1.0, 1.0, 1.0, 3.0]) / 6
    edges = EDGES.numpy()
    mean = p @ g
    share = np.array([p[edges == e].sum() for e in (0, 1)])
    edge_means = np.stack([p[edges == e] @ g[edges == e] / share[e] for e in (0, 1)])
    down = [float(p[edges == e] / share[e] @ ((g[edges == e] - edge_means[e]) ** 2).sum(1))
            for e in (0, 1)]
    got = divergences(g32, WEIGHTS, EDGES, 2)
    assert got["upward_divergence"] == pytest.approx(
        float(share @ ((edge_means - mean) ** 2).sum(1)), rel=1e-13)
    assert got["downward_divergence_by_edge"] == pytest.approx(down, rel=1e-13)
    assert got["global_divergence"] == pytest.approx(float(p @ ((g - mean) ** 2).sum(1)),
                                                     rel=1e-13)
    # weights summing to 1 (or less) are fine: only their ratios count
    quarter = divergences(GRADS, torch.full((4,), 0.25), EDGES, 2)
    assert quarter["upward_divergence"] == pytest.approx(
        divergences(GRADS, torch.ones(4), EDGES, 2)["upward_divergence"], rel=1e-14)
    assert divergences(GRADS, WEIGHTS / 100, EDGES, 2)["upward_divergence"] == \
        pytest.approx(58 / 9, rel=1e-14)
