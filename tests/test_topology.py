import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.tree.hierarchy import Hierarchy, aggregation_level, validate_periods


def test_two_level_schedule_matches_algorithm():
    # algorithms.md §1: cloud if (t+1) % G == 0, else edge if (t+1) % I == 0.
    periods = (5, 20)
    for t in range(100):
        expected = 2 if (t + 1) % 20 == 0 else (1 if (t + 1) % 5 == 0 else 0)
        assert aggregation_level(t, periods) == expected


def test_three_level_schedule_picks_highest_level():
    levels = [aggregation_level(t, (2, 4, 12)) for t in range(12)]
    assert levels == [0, 1, 0, 2, 0, 1, 0, 2, 0, 1, 0, 3]


@pytest.mark.parametrize("periods", [(5, 7), (0, 5), (4, 2), ()])
def test_bad_periods_rejected(periods):
    with pytest.raises(ConfigError):
        validate_periods(periods)


def test_hierarchy_ancestors_and_sizes():
    edges = np.array([0, 0, 1, 2, 2, 3])
    regions = np.array([0, 0, 1, 1])
    h = Hierarchy((1, 2, 4), (edges, regions))
    assert h.num_levels == 3
    assert [h.num_nodes(k) for k in range(4)] == [6, 4, 2, 1]
    assert h.ancestors(1).tolist() == edges.tolist()
    assert h.ancestors(2).tolist() == [0, 0, 0, 1, 1, 1]
    assert h.ancestors(3).tolist() == [0] * 6
    assert h.edges_under(2).tolist() == [0, 0, 1, 1]


def test_hierarchy_rejects_empty_group():
    with pytest.raises(ConfigError):
        Hierarchy((1, 2), (np.array([0, 2, 2]),))
