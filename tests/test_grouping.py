import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.tree.grouping import ClientInfo, assign_groups, available_groupings


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


def test_edge_tag_grouping_places_clients_where_their_supernodes_are_tagged():
    """The edge-tag grouping reads each SuperNode's `edge` node-config tag through the
    profile query: HierFedAvg's edges are then exactly the tags."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedhier.clients.app import app as client_app
    from fedhier.engines.inprocess_grid import InProcessGrid
    from fedhier.settings.run_config import RunConfig
    from fedhier.strategies.hierfedavg import HierFedAvg
    from tests.helpers import initial_state

    cfg = RunConfig(clients=6, groups=(3,), local_period=2, global_period=4, rounds=1,
                    grouping="edge-tag")
    tags = [2, 0, 1, 2, 0, 1]

    def run(edge_tags: list[int] | None, groups: tuple[int, ...] = (3,),
            periods: tuple[int, ...] = (2, 4)) -> HierFedAvg:
        strategy = HierFedAvg(periods[0], periods[-1], groups, grouping="edge-tag",
                              periods=periods)
        grid = InProcessGrid(client_app, 6, edge_tags=edge_tags)
        strategy.start(grid, ArrayRecord(initial_state(cfg)), num_rounds=1,
                       train_config=ConfigRecord(cfg.to_run_config()))
        return strategy

    strategy = run(tags)
    assert strategy.hierarchy is not None
    assert strategy.hierarchy.edge_of_client().tolist() == tags
    deeper = run(tags, groups=(3, 2), periods=(2, 4, 8)).hierarchy  # edges -> regions: blocks
    assert deeper is not None and deeper.parents[1].tolist() == [0, 0, 1]
    with pytest.raises(ConfigError, match="needs every SuperNode tagged"):
        run(None)
    with pytest.raises(ConfigError, match="must be exactly 0..2"):
        run([0, 0, 1, 1, 0, 1])


def test_edge_tag_grouping_checks_tags_without_flower():
    tagged = ClientInfo(label_histograms=np.ones((4, 3), dtype=np.int64),
                        num_examples=np.full(4, 3), edge_tags=np.array([1, 0, 0, 1]))
    assert assign_groups("edge-tag", tagged, 2, seed=0).tolist() == [1, 0, 0, 1]
    assert "edge-tag" in available_groupings()
