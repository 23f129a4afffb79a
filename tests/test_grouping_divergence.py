"""Divergence-aware groupings: balanced, seeded, and ordered min < random < max on digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhier.diagnostics.measures import divergences, label_upward_divergence
from fedhier.tree.grouping import ClientInfo, assign_groups, balanced_sizes
from fedhier.tree.grouping.divergence import (
    gradient_grouping,
    make_gradient_grouping,
    max_divergence_grouping,
    min_divergence_grouping,
    search_grouping,
    weighted_gram,
)
from tests.test_diagnostics import NUM_EDGES, digits_clients

RANDOM_SEEDS = range(100)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def label_div(edges: np.ndarray) -> float:
    d = digits_clients()
    return label_upward_divergence(d.info.label_histograms, edges, NUM_EDGES)


def grad_div(edges: np.ndarray, kind: str) -> float:
    d = digits_clients()
    result = divergences(d.embedded, d.weights(kind), torch.as_tensor(edges), NUM_EDGES)
    return float(result["upward_divergence"])


def random_mean(score) -> float:
    info = digits_clients().info
    return float(np.mean([score(assign_groups("random", info, NUM_EDGES, s))
                          for s in RANDOM_SEEDS]))


def check_balanced(edges: np.ndarray, n: int, groups: int) -> None:
    assert edges.dtype == np.int64 and edges.shape == (n,)
    np.testing.assert_array_equal(np.bincount(edges, minlength=groups),
                                  balanced_sizes(n, groups))


def toy_info(n: int, seed: int = 0) -> ClientInfo:
    rng = np.random.default_rng(seed)
    hist = np.stack([rng.multinomial(int(rng.integers(1, 60)), rng.dirichlet(np.full(5, 0.2)))
                     for _ in range(n)]).astype(np.int64)
    return ClientInfo(label_histograms=hist, num_examples=hist.sum(1))


@pytest.mark.parametrize("grouping", [min_divergence_grouping, max_divergence_grouping])
@pytest.mark.parametrize("n,groups", [(40, 4), (23, 4), (7, 7), (9, 1), (30, 7)])
def test_label_groupings_are_balanced_and_seeded(grouping, n, groups):
    info = toy_info(n)
    edges = grouping(info, groups, 3)
    check_balanced(edges, n, groups)
    np.testing.assert_array_equal(edges, grouping(info, groups, 3))


@pytest.mark.parametrize("kind", ["uniform", "samples"])
def test_gradient_grouping_is_balanced_and_seeded(kind):
    d = digits_clients()
    edges = gradient_grouping(d.info, 6, 2, d.grads, kind)
    check_balanced(edges, len(d.parts), 6)
    np.testing.assert_array_equal(edges, make_gradient_grouping(d.grads, kind)(d.info, 6, 2))


def test_min_random_max_order_on_digits():
    d = digits_clients()
    n = len(d.parts)
    lo, hi = min_divergence_grouping(d.info, NUM_EDGES, 0), max_divergence_grouping(
        d.info, NUM_EDGES, 0)
    check_balanced(lo, n, NUM_EDGES)
    check_balanced(hi, n, NUM_EDGES)
    assert label_div(lo) < random_mean(label_div) < label_div(hi)
    for kind in ("samples", "uniform"):
        assert grad_div(lo, kind) < random_mean(lambda e, k=kind: grad_div(e, k)) < grad_div(
            hi, kind)


def test_label_groupings_are_local_optima_of_the_swap_search():
    """No single swap of two clients between groups improves the returned grouping."""
    d = digits_clients()
    for grouping, sign in ((min_divergence_grouping, 1.0), (max_divergence_grouping, -1.0)):
        edges = grouping(d.info, NUM_EDGES, 1)
        value = sign * label_div(edges)
        for j in range(len(edges)):
            for k in range(j + 1, len(edges)):
                if edges[j] != edges[k]:
                    swapped = edges.copy()
                    swapped[[j, k]] = edges[[k, j]]
                    assert sign * label_div(swapped) >= value - 1e-9 * abs(value)


@pytest.mark.parametrize("kind", ["uniform", "samples"])
def test_gradient_grouping_beats_random(kind):
    d = digits_clients()
    edges = gradient_grouping(d.info, NUM_EDGES, 0, d.grads, kind)
    rand = random_mean(lambda e: grad_div(e, kind))
    assert grad_div(edges, kind) < 0.5 * rand
    adversarial = gradient_grouping(d.info, NUM_EDGES, 0, d.grads, kind, maximise=True)
    assert grad_div(adversarial, kind) > rand
    # through a 16-dimensional Gaussian projection (n = 40 > 16, P > 16): still far below random
    projected = gradient_grouping(d.info, NUM_EDGES, 0, d.grads, kind, max_dim=16)
    check_balanced(projected, len(d.parts), NUM_EDGES)
    assert grad_div(projected, kind) < 0.5 * rand


def test_search_on_a_tiny_instance_against_every_balanced_grouping():
    rng = np.random.default_rng(7)
    z = rng.normal(size=(8, 3))
    w = rng.uniform(0.5, 2.0, size=8)

    def value(edges: np.ndarray) -> float:
        return divergences(torch.from_numpy(z), torch.from_numpy(w), torch.as_tensor(edges),
                           2)["upward_divergence"]

    masks = [m for m in range(2 ** 8) if bin(m).count("1") == 4]
    values = np.array([value(np.array([(m >> j) & 1 for j in range(8)])) for m in masks])
    gram = weighted_gram(z, w, seed=0)
    lo = value(search_grouping(gram, w, 2, np.arange(8)))
    hi = value(search_grouping(gram, w, 2, np.arange(8), maximise=True))
    assert values.min() <= lo <= np.quantile(values, 0.1)
    assert np.quantile(values, 0.9) <= hi <= values.max()


def test_weighted_gram_exact_and_projected():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(300, 1000)) + rng.normal(size=(300, 1))
    w = rng.uniform(1, 5, size=300)
    u = w[:, None] * (z - w @ z / w.sum())
    exact = weighted_gram(z, w, seed=0, max_dim=1000)  # D <= max_dim: exact
    np.testing.assert_allclose(exact, u @ u.T, rtol=1e-9, atol=1e-9 * np.abs(u @ u.T).max())
    projected = weighted_gram(z, w, seed=0, max_dim=256)  # n, D > 256: projected
    np.testing.assert_array_equal(projected, weighted_gram(z, w, seed=0, max_dim=256))
    # squared norms preserved in expectation, relative error ~ sqrt(2 / 256)
    ratio = np.diag(projected) / np.diag(exact)
    assert abs(ratio.mean() - 1) < 0.03 and ratio.std() < 0.15
