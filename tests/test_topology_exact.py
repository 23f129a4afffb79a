"""fedhier.tree.hierarchy's tree on a hand-built three-level example: every node count, ancestor
and edge map worked out by hand, and each refusal with its own message (mutation testing
found these paths run but unchecked)."""

from __future__ import annotations

import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.tree.hierarchy import Hierarchy, build_hierarchy, validate_periods

# 7 clients -> 4 edges -> 2 regions -> cloud
CLIENT_EDGE = np.array([0, 0, 1, 2, 2, 3, 3])
EDGE_REGION = np.array([0, 0, 1, 1])
TREE = Hierarchy(periods=(1, 2, 4), parents=(CLIENT_EDGE, EDGE_REGION))


def test_counts_ancestors_and_edges_by_hand():
    assert TREE.num_levels == 3 and TREE.num_clients == 7
    assert [TREE.num_nodes(level) for level in range(5)] == [7, 4, 2, 1, 1]
    assert TREE.ancestors(0).tolist() == list(range(7))
    assert TREE.ancestors(1).tolist() == CLIENT_EDGE.tolist() == TREE.edge_of_client().tolist()
    assert TREE.ancestors(2).tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert TREE.ancestors(3).tolist() == [0] * 7 and TREE.ancestors(4).tolist() == [0] * 7
    assert TREE.edges_under(1).tolist() == [0, 1, 2, 3]
    assert TREE.edges_under(2).tolist() == EDGE_REGION.tolist()
    assert TREE.edges_under(3).tolist() == [0, 0, 0, 0]
    assert [TREE.level_after(step) for step in range(8)] == [1, 2, 1, 3, 1, 2, 1, 3]


def test_moving_clients_may_empty_an_edge():
    moved = TREE.with_edge_map(np.array([0, 0, 0, 2, 2, 3, 3]))  # edge 1 now empty
    assert moved.num_nodes(1) == 4 and moved.num_edges == 4
    assert moved.edges_under(2).tolist() == EDGE_REGION.tolist()
    assert moved.ancestors(2).tolist() == [0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match=r"outside 0\.\.3"):
        TREE.with_edge_map(np.array([0, 0, 0, 2, 2, 3, 4]))
    with pytest.raises(ConfigError, match=r"outside 0\.\.3"):
        TREE.with_edge_map(np.array([0, 0, 0, 2, 2, 3, -1]))


@pytest.mark.parametrize("periods,parents,message", [
    ((1, 2), (CLIENT_EDGE, EDGE_REGION), "2 periods need 1 grouping level"),
    ((1, 2, 4), (np.array([0, 0, 2, 2]), np.array([0, 0, 1])), "leaves a group without"),
    ((1, 2, 4), (CLIENT_EDGE, np.array([0, 1, 1])), "level 2 does not match level 1"),
    ((2, 3), (CLIENT_EDGE,), "3 is not a multiple of 2"),
])
def test_malformed_trees_are_refused(periods, parents, message):
    with pytest.raises(ConfigError, match=message):
        Hierarchy(periods=periods, parents=parents)


@pytest.mark.parametrize("periods,message", [
    ((), "at least one aggregation period"), ((0, 2), r"positive integers, got \[0, 2\]"),
    ((2, -4), "positive integers"), ((2, 6, 9), "9 is not a multiple of 6")])
def test_bad_periods_are_refused_with_their_reason(periods, message):
    with pytest.raises(ConfigError, match=message):
        validate_periods(periods)
    validate_periods((1,))
    validate_periods((2, 6, 12))


def test_contiguous_build_by_hand():
    from fedhier.tree.grouping import ClientInfo

    info = ClientInfo(num_examples=np.full(8, 10), label_histograms=np.zeros((8, 2)))
    tree = build_hierarchy((1, 2, 4), (4, 2), "contiguous", info, seed=0)
    assert tree.edge_of_client().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert tree.edges_under(2).tolist() == [0, 0, 1, 1]
    assert tree.num_nodes(1) == 4 and tree.num_nodes(2) == 2 and tree.periods == (1, 2, 4)
