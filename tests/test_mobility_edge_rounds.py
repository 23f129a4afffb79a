"""Chen et al.'s mobility model: clients move at every edge round (``mobility_every
edge-round``) along a one-way ring road (``reachability`` i -> i+1) carrying their models."""

from __future__ import annotations

import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.mobility import Mobility
from tests.test_vectorized import BASE, TOL, assert_same_runs

RING4 = ((False, True, False, False), (False, False, True, False),
         (False, False, False, True), (True, False, False, False))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rate_one_on_a_ring_moves_every_client_one_edge_per_edge_round():
    start = np.array([0, 1, 2, 3, 3, 0])
    mobility = Mobility(1.0, RING4, every="edge-round")
    maps = mobility.maps(seed=3, cloud_round=2, edge_rounds=5, start=start, num_edges=4)
    expected = np.stack([(start + k + 1) % 4 for k in range(5)])
    np.testing.assert_array_equal(maps, expected)
    # per cloud round (the default) the same rate moves each client once, one edge on
    once = Mobility(1.0, RING4).maps(seed=3, cloud_round=2, edge_rounds=5, start=start,
                                     num_edges=4)
    np.testing.assert_array_equal(once[-1], (start + 1) % 4)


def test_moves_per_cloud_round_follow_the_rate():
    """Rate p per edge round, E edge rounds: E p moves per client and cloud round on
    average (binomial; 20,000 client-rounds, a 6-sigma bound)."""
    n, edge_rounds, rate = 400, 5, 0.3
    mobility = Mobility(rate, every="edge-round")
    start = np.zeros(n, dtype=np.int64)
    moves = 0
    for cloud_round in range(1, 11):
        maps = mobility.maps(7, cloud_round, edge_rounds, start, 4)
        path = np.vstack([start, maps])
        moves += int((path[1:] != path[:-1]).sum())
    trials = n * 10 * edge_rounds
    assert abs(moves - trials * rate) <= 6 * np.sqrt(trials * rate * (1 - rate))


def test_edge_round_moves_with_a_trace_are_refused():
    with pytest.raises(ConfigError, match="mobility_every edge-round sets how often"):
        RunConfig.from_mapping({"mobility_every": "edge-round",
                                "mobility_trace": "examples/mobility/trace.csv"})
    with pytest.raises(ConfigError, match="unknown mobility_every 'step'"):
        RunConfig.from_mapping({"mobility_every": "step"})


def test_engines_agree_on_chens_model(tmp_path):
    cfg = BASE.replace(groups=(4,), mobility_rate=0.4, mobility_every="edge-round",
                       handoff="carry", reachability="examples/mobility/ring4.csv", rounds=3)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", TOL)
