"""fedhier/tree/hierarchy.py, checked value by value: the mutants `make mutation` left alive.

Each test pins exact numbers (hand-worked levels, messages, dtypes, what each level of
``build_hierarchy`` hands to its grouping), so a one-token change in topology.py fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedhier.tree.hierarchy as topology
from fedhier.tree import grouping as grouping_registry
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.grouping.divergence import gradient_grouping
from fedhier.tree.grouping.simple import contiguous_grouping
from fedhier.tree.hierarchy import (
    Hierarchy,
    build_hierarchy,
    edge_levels_after,
    parse_edge_periods,
    validate_edge_periods,
    validate_periods,
)
from tests.helpers import assert_refused as refused


def test_validate_periods_messages():
    refused(lambda: validate_periods(()), "at least one aggregation period is needed")
    refused(lambda: validate_periods((2, 0)),
             "aggregation periods must be positive integers, got [2, 0]")
    refused(lambda: validate_periods((2, 6, 8)),
             "each period must be a multiple of the one below: 8 is not a multiple of 6 "
             "(periods [2, 6, 8])")


def test_parse_edge_periods():
    assert parse_edge_periods("2,4,4,8") == (2, 4, 4, 8)
    assert parse_edge_periods(" 3 ") == (3,)
    assert parse_edge_periods("  ") == ()
    refused(lambda: parse_edge_periods("2;4"),
             "edge_periods must be comma-separated integers, one per edge, got '2;4'")


@pytest.mark.parametrize("edge_periods, periods, num_edges, message", [
    ((2, 4), (2, 8), 3, "edge_periods gives 2 period(s) for 3 edge(s) [2, 4]: give one per edge"),
    ((0, 4), (2, 8), 2, "edge_periods must be positive integers, got [0, 4]"),
    ((2, 4), (2,), 2, "per-edge periods need a level above the edges"),
    ((2, 3, 5), (1, 6), 3, "edge period 5 does not divide the next level's period 6 "
                           "(edge_periods [2, 3, 5])"),
    ((4, 8), (2, 8), 2, "the edge-level period 2 must be the gcd 4 of edge_periods [4, 8]"),
])
def test_validate_edge_periods_refuses(edge_periods, periods, num_edges, message):
    refused(lambda: validate_edge_periods(edge_periods, periods, num_edges), message)


@pytest.mark.parametrize("edge_periods, periods, num_edges", [
    ((), (2, 8), 5),            # off: nothing to check
    ((1, 2), (1, 4), 2),        # a period of 1 is positive
    ((2, 4), (2, 8), 2),        # two levels: P_2 = 8
    ((2, 4, 4), (2, 4, 8), 3),  # three levels: each I_i divides P_2 = 4 (not only P_3)
    ((3, 6), (3, 6), 2),        # the gcd is periods[0] (periods[1] is 6)
])
def test_validate_edge_periods_accepts(edge_periods, periods, num_edges):
    assert validate_edge_periods(edge_periods, periods, num_edges) is None


def test_edge_levels_after_by_hand():
    # periods (2, 8), edges every 2 and 4 steps: after step t (0-based) edge i aggregates at
    # level 1 when (t+1) % I_i == 0, and both at level 2 when (t+1) % 8 == 0.
    table = [edge_levels_after(t, (2, 8), (2, 4), 2).tolist() for t in range(8)]
    assert table == [[0, 0], [1, 0], [0, 0], [1, 1], [0, 0], [1, 0], [0, 0], [2, 2]]
    shared = edge_levels_after(3, (2, 4), (), 3)
    assert shared.tolist() == [2, 2, 2] and shared.dtype == np.int64


def test_empty_hierarchy_is_allowed():
    # no clients at all (e.g. a federation filtered to nothing): sizes 0, never max() of empty
    empty = np.array([], dtype=np.int64)
    h = Hierarchy((1, 2, 4), (empty, empty))
    assert h.num_clients == 0 and h.num_levels == 3


def test_hierarchy_messages():
    refused(lambda: Hierarchy((1, 2, 4), (np.array([0, 2]), np.array([0, 0, 0]))),
             "grouping level 1 leaves a group without members")
    refused(lambda: Hierarchy((1, 2, 4), (np.array([0, 1]), np.array([0, 2]))),
             "grouping level 2 leaves a group without members")
    refused(lambda: Hierarchy((1, 2, 4), (np.array([0, 1]), np.array([0, 0, 1]))),
             "grouping level 2 does not match level 1")
    refused(lambda: Hierarchy((1, 2), (np.array([0, 3]),), num_edges=3),
             "a client is mapped to an edge outside 0..2")


def test_fixed_edge_count_with_an_empty_edge():
    # mobility: 4 edges, the last one empty, under 2 regions
    h = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 2]), np.array([0, 0, 1, 1])), num_edges=4)
    assert [h.num_nodes(level) for level in range(4)] == [4, 4, 2, 1]
    assert h.edges_under(2).tolist() == [0, 0, 1, 1]


def test_index_arrays_are_int64():
    h = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 2]), np.array([0, 0, 1])))
    for level in range(5):
        assert h.ancestors(level).dtype == np.int64
        assert h.edges_under(level).dtype == np.int64
    assert h.ancestors(3).tolist() == [0, 0, 0, 0]
    assert h.edges_under(3).tolist() == [0, 0, 0]
    moved = h.with_edge_map(np.array([2, 1, 1, 0], dtype=np.int32))
    assert moved.parents[0].dtype == np.int64 and moved.num_edges == 3
    assert moved.edge_of_client().tolist() == [2, 1, 1, 0]


def _info() -> ClientInfo:
    histograms = np.array([[3, 0], [1, 2], [0, 4], [2, 2], [5, 0], [0, 1], [1, 1], [2, 3]])
    return ClientInfo(label_histograms=histograms, num_examples=histograms.sum(1))


def test_each_level_sees_the_summed_level_below(monkeypatch):
    """A grouping at level k gets seed + k - 1 and the level below's nodes: summed label
    histograms and row counts, both int64."""
    seen: list[tuple[ClientInfo, int, int]] = []

    def recorder(info, num_groups, seed):
        seen.append((info, num_groups, seed))
        return contiguous_grouping(info, num_groups, seed)

    monkeypatch.setitem(grouping_registry.BUILTIN_GROUPINGS, "recorder", recorder)
    info = _info()
    grads = torch.zeros(8, 3)  # given but unused by a label grouping without weights
    h = build_hierarchy((1, 2, 4), (4, 2), "recorder", info, seed=7, client_grads=grads)
    assert [s[1:] for s in seen] == [(4, 7), (2, 8)]
    assert seen[0][0] is info
    level1 = seen[1][0]
    assert level1.label_histograms.tolist() == [[4, 2], [2, 6], [5, 1], [3, 4]]
    assert level1.num_examples.tolist() == [6, 8, 6, 7]
    assert level1.label_histograms.dtype == np.int64 and level1.num_examples.dtype == np.int64
    assert [p.tolist() for p in h.parents] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 1, 1]]


def test_gradient_levels_get_weighted_mean_gradients(monkeypatch):
    """With the gradient grouping each level's grouping is built from the level below's
    weighted mean gradients and summed weights (worked by hand here)."""
    built: list[tuple[np.ndarray, np.ndarray]] = []

    def fake_make(grads, weights):
        built.append((torch.as_tensor(grads).double().numpy().copy(),
                      np.asarray(weights, dtype=np.float64).copy()))
        return contiguous_grouping

    monkeypatch.setattr(topology, "make_gradient_grouping", fake_make)
    grads = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0], [2.0, -2.0]], dtype=torch.float64)
    weights = np.array([1.0, 3.0, 2.0, 2.0])
    info = ClientInfo(label_histograms=np.ones((4, 2), dtype=np.int64),
                      num_examples=np.full(4, 2))
    h = build_hierarchy((1, 2, 4), (2, 1), "gradient", info, seed=0, client_grads=grads,
                        weights=weights)
    assert [p.tolist() for p in h.parents] == [[0, 0, 1, 1], [0, 0]]
    assert len(built) == 2
    np.testing.assert_array_equal(built[0][0], grads.numpy())
    np.testing.assert_array_equal(built[0][1], weights)
    # edge 0: (1*[1,0] + 3*[3,2]) / 4 = [2.5, 1.5]; edge 1: (2*[0,4] + 2*[2,-2]) / 4 = [1, 1]
    np.testing.assert_allclose(built[1][0], [[2.5, 1.5], [1.0, 1.0]], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(built[1][1], [4.0, 4.0])


def test_gradient_grouping_through_build_hierarchy_is_the_documented_composition():
    rng = np.random.default_rng(3)  # fixed data, same every run
    grads = torch.from_numpy(rng.normal(size=(8, 5)))
    weights = np.array([1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 2.0, 1.0])
    info = _info()
    h = build_hierarchy((1, 3, 6), (4, 2), "gradient", info, seed=11, client_grads=grads,
                        weights=weights)
    edges = gradient_grouping(info, 4, 11, grads, weights)
    np.testing.assert_array_equal(h.parents[0], edges)
    totals = np.bincount(edges, weights=weights, minlength=4)
    means = np.stack([(weights[edges == e, None] * grads.numpy()[edges == e]).sum(0) / totals[e]
                      for e in range(4)])
    hist = np.stack([info.label_histograms[edges == e].sum(0) for e in range(4)])
    edge_info = ClientInfo(label_histograms=hist, num_examples=hist.sum(1))
    np.testing.assert_array_equal(h.parents[1], gradient_grouping(edge_info, 2, 12,
                                                                  torch.from_numpy(means), totals))


def test_gradient_grouping_needs_gradients_and_weights():
    info = _info()
    message = "the gradient grouping needs the clients' gradients"
    refused(lambda: build_hierarchy((1, 2), (2,), "gradient", info, 0), message)
    refused(lambda: build_hierarchy((1, 2), (2,), "gradient", info, 0,
                                     client_grads=torch.zeros(8, 2)), message)
    refused(lambda: build_hierarchy((1, 2), (2,), "gradient", info, 0,
                                     weights=np.ones(8)), message)
