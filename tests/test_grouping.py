import numpy as np
import pytest

from fedhier.errors import ConfigError
from fedhier.grouping import ClientInfo, assign_groups, available_groupings


def info(n: int) -> ClientInfo:
    return ClientInfo(label_histograms=np.ones((n, 3), dtype=np.int64),
                      num_examples=np.full(n, 3, dtype=np.int64))


@pytest.mark.parametrize("n,groups", [(20, 4), (23, 4), (5, 5), (7, 1)])
def test_random_grouping_is_balanced_and_seeded(n, groups):
    a = assign_groups("random", info(n), groups, seed=1)
    sizes = np.bincount(a, minlength=groups)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == n
    np.testing.assert_array_equal(a, assign_groups("random", info(n), groups, seed=1))


def test_random_grouping_changes_with_seed():
    draws = {tuple(assign_groups("random", info(20), 4, seed=s)) for s in range(10)}
    assert len(draws) == 10


def test_contiguous_grouping_is_index_blocks():
    assert assign_groups("contiguous", info(10), 3, seed=0).tolist() == [0] * 4 + [1] * 3 + [2] * 3


def test_unknown_grouping_and_too_many_groups():
    with pytest.raises(ConfigError, match="unknown grouping"):
        assign_groups("nope", info(4), 2, seed=0)
    with pytest.raises(ConfigError, match="more groups"):
        assign_groups("random", info(3), 4, seed=0)
    assert available_groupings()[:2] == ["random", "contiguous"]
