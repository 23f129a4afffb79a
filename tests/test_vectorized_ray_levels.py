"""Engine ``vectorized-ray`` on a tree of three levels (clients -> edges -> regions -> cloud):
whole regions on the workers (:mod:`fedhier.engines.vectorized_ray.subtree`), each region's
edge rounds and aggregations run inside its worker. On the session's two-node Ray cluster
(tests/ray_cluster.py) it equals engine ``vectorized`` to 1e-6 and engine ``inprocess`` to
1e-5, with participation and faults, with per-edge periods, and with clients moving between
regions (so between workers); regrouping is refused.
"""

import pytest

from fedhier.engines.vectorized_ray.engine import check_sharded
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_refused
from tests.test_deploy_mobility import without_handoffs
from tests.test_oracle import check_mobility_across_regions, tiny_data
from tests.test_vectorized import assert_same_runs
from tests.test_vectorized_ray import run_side_by_side
from tests.test_vectorized_ray_moves import moves_of

#: 8 clients, 4 edges, 2 regions (one per worker): edges aggregate every 2 steps, regions
#: every 4, the cloud every 8; participation and faults drop clients and edges.
CFG = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8),
                grouping="contiguous", rounds=2, batch_size=8, seed=5, participation=0.75,
                fail_rate=0.2, engine="vectorized-ray", ray_workers=2)


def test_whole_regions_on_workers_equal_the_one_process_engines(ray_cluster, tmp_path):
    cfg = CFG.replace(ray_address=ray_cluster)
    sharding = run_side_by_side(cfg, tmp_path, inprocess=True)
    assert_same_runs(tmp_path / "one", tmp_path / "ray", 1e-6)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "ray", 1e-5)
    workers = sharding["workers"]
    assert sorted(w["clients"] for w in workers) == [4, 4]  # a whole region each
    assert len({w["node"] for w in workers}) == 2
    # only regions' models cross: per cloud round one down and one up per region
    model_bytes = sharding["bytes_between_workers"] // (2 * 2 * cfg.rounds)
    assert sharding["bytes_between_workers"] == model_bytes * 2 * 2 * cfg.rounds


def test_per_edge_periods_in_regions_equal_the_one_process_engine(ray_cluster, tmp_path):
    """Each edge's own period (dividing the regions' 4) runs inside its region's worker;
    ``vectorized`` equals ``inprocess`` here (tests/test_edge_periods.py)."""
    cfg = CFG.replace(ray_address=ray_cluster, periods=(1, 4, 8), edge_periods="1,2,4,2")
    run_side_by_side(cfg, tmp_path)
    assert_same_runs(tmp_path / "one", tmp_path / "ray", 1e-6)


def test_clients_moving_between_regions_equal_the_one_process_engine(ray_cluster, tmp_path):
    """``carry`` mobility with participation and faults: every move of the one-process run
    is re-attached, some to an edge of the other region, so to the other worker."""
    cfg = CFG.replace(ray_address=ray_cluster, mobility_rate=0.5, handoff="carry")
    sharding = run_side_by_side(cfg, tmp_path)
    handoffs = [h for r in without_handoffs(tmp_path / "ray") for h in r]
    assert_same_runs(tmp_path / "one", tmp_path / "ray", 1e-6)
    moves = moves_of(tmp_path / "one")
    assert [[h["edge_round"], h["client"], h["from"], h["to"]] for h in handoffs] == moves
    region = {0: 0, 1: 0, 2: 1, 3: 1}  # worker = region (contiguous grouping)
    across = [[c, region[a], region[b]] for _, c, a, b in moves if region[a] != region[b]]
    assert across and sharding["worker_moves"] == across


def test_regrouping_is_refused_with_three_levels():
    assert_refused(lambda: check_sharded(CFG.replace(regroup_every=1)),
                   "engine vectorized-ray with three or more levels needs a fixed grouping "
                   "(no regroup_every): each worker holds whole regions")


def test_a_region_rule_measured_from_the_regions_model_is_refused_with_moving_clients():
    """A worker answers a region's job as a region server does: a job that starts inside
    the region's period does not carry its last aggregate, which clip measures from."""
    assert_refused(lambda: check_sharded(CFG.replace(mobility_rate=0.5, aggregators="clip")),
                   "engine vectorized-ray: moving clients under region servers need a region "
                   "rule that does not measure from the region's own model (not clip): a "
                   "region's job that starts inside its period does not carry its last "
                   "aggregate")


@pytest.fixture(scope="module")
def oracle_data(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tiny_data(tmp_path_factory.mktemp("oracle"))


@pytest.mark.parametrize("handoff", ["fresh", "carry"])
def test_moves_across_regions_match_the_oracle(ray_cluster, oracle_data, handoff):
    """The independent oracle (tests/oracle_hsgd.py), not another engine, on clients that
    move between regions, so between workers, inside and at a region's period."""
    check_mobility_across_regions(oracle_data, "vectorized-ray", handoff, "--ray-address",
                                  ray_cluster)
