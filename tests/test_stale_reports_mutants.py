"""Tests written against the survivors of the full pass of `python scripts/mutation.py
stale_reports` (docs/testing.md, "Mutation testing"): which way the merge computes is chosen
by the rules *above* the edges, and a cloud step is given the cloud's children. The reports
are those of tests/test_async_mutants.py (edge 0's three clients stale, edge 1's fresh)."""

import math

import numpy as np
import pytest
import torch

from fedhier.round.asynchrony.reports import merge_reports
from fedhier.round.asynchrony.rules import SHIFTED_MEAN
from tests.test_async_mutants import TREE, WEIGHTS, W, X, _jobs, _node_models


def test_a_median_above_the_edges_takes_the_moved_models():
    """mean at the edges, median above: the stale report enters as the same report moved
    by w - base and made fresh (its clients' weights times 1/sqrt(1 + s)), not as the
    median of the unmoved models plus the mean shift (the linear rules' way). The shifted
    mean's numbers (its weights are renormalised)."""
    rules = ("mean", "median")
    stale = merge_reports(_jobs(3), {"p": W}, WEIGHTS, TREE, rules, _node_models,
                          rule=SHIFTED_MEAN)
    factor = np.array([1 / math.sqrt(4)] * 3 + [1.0] * 3)
    fresh = merge_reports(_jobs(3, shifted=True), {"p": W}, WEIGHTS * factor, TREE, rules,
                          _node_models, rule=SHIFTED_MEAN)
    linear = merge_reports(_jobs(3), {"p": W}, WEIGHTS, TREE, ("mean", "mean"),
                           _node_models, rule=SHIFTED_MEAN)
    assert stale is not None and fresh is not None and linear is not None
    torch.testing.assert_close(stale["p"], fresh["p"], rtol=1e-12, atol=1e-12)
    assert float((stale["p"] - linear["p"]).abs().max()) > 1e-3


class Recorder:
    """A cloud step that records its children and their weights and returns child 0 + 100."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[int, list[float]], dict[int, float]]] = []

    def step(self, cloud_round, children, weights):
        self.seen.append((cloud_round, {n: c["p"].tolist() for n, c in children.items()},
                          dict(weights)))
        return {"p": children[0]["p"] + 100}


def test_a_cloud_step_is_given_the_cloud_children_and_their_weights():
    """Two levels: the cloud's children are the two edges. Edge 0 (stale by 2) gives its
    clients' weighted mean moved by w - base, weight (1 + 3 + 2) / sqrt(3); edge 1 its
    clients' mean, weight 2 + 1 + 4 = 7."""
    step = Recorder()
    new = merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, ("mean", "mean"), _node_models,
                        step, cloud_round=5, rule=SHIFTED_MEAN)
    assert new is not None and len(step.seen) == 1
    cloud_round, children, weights = step.seen[0]
    w = torch.as_tensor(WEIGHTS)[:, None]
    edge0 = (w[:3] * X[:3]).sum(0) / 6 + (W - _jobs(2)[0][0].base["p"])
    edge1 = (w[3:] * X[3:]).sum(0) / 7
    assert cloud_round == 5 and sorted(children) == [0, 1]
    torch.testing.assert_close(torch.tensor(children[0], dtype=torch.float64), edge0)
    torch.testing.assert_close(torch.tensor(children[1], dtype=torch.float64), edge1)
    assert weights[0] == pytest.approx(6 / math.sqrt(3), rel=1e-12) and weights[1] == 7.0
    torch.testing.assert_close(new["p"], edge0 + 100)
