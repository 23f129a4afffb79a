"""fedhier/round/clock.py, value by value: the mutants `make mutation` left alive.

Hand-worked times on a model with round numbers: client-edge latency 1 s and 1 s per model
(8 Mbit/s, 1 MB models), 0.5 s per local step.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedhier.common.rng import generator
from fedhier.round.clock import SimClock, TimeModel, parse_edge_slowdown
from tests.helpers import assert_refused as refused

MB = 1_000_000




@pytest.mark.parametrize("name", ["step_seconds", "compute_spread", "client_edge_latency_ms",
                                  "edge_cloud_latency_ms"])
@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan")])
def test_non_negative_fields_refuse(name, value):
    refused(lambda: TimeModel(**{name: value}),
             f"{name} must be a finite number >= 0, got {value}")


@pytest.mark.parametrize("name", ["client_edge_mbps", "edge_cloud_mbps"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf")])
def test_bandwidths_refuse(name, value):
    refused(lambda: TimeModel(**{name: value}),
             f"{name} must be a finite number > 0 (Mbit/s), got {value}")


def test_edge_values_accepted():
    model = TimeModel(step_seconds=0.0, compute_spread=0.0, client_edge_mbps=0.5,
                      edge_cloud_mbps=0.25, client_edge_latency_ms=0.0)
    assert model.link("client-edge", MB) == (0.0, 16.0)
    assert model.link("edge-cloud", MB) == (0.05, 32.0)


def test_check_edges():
    TimeModel(edge_slowdown=((0, 2.0),)).check_edges(1)  # edge 0 of 1 exists
    TimeModel(edge_slowdown=((1, 2.0),)).check_edges(2)
    refused(lambda: TimeModel(edge_slowdown=((2, 2.0),)).check_edges(2),
             "edge_slowdown names edge 2, but the edges are 0..1")
    refused(lambda: SimClock(TimeModel(edge_slowdown=((-1, 2.0),)), 0, 4, 3),
             "edge_slowdown names edge -1, but the edges are 0..2")


def test_parse_edge_slowdown():
    assert parse_edge_slowdown("0:4,3:2.5") == ((0, 4.0), (3, 2.5))
    assert parse_edge_slowdown(" 1:0.5 ,") == ((1, 0.5),)
    assert parse_edge_slowdown("") == ()
    refused(lambda: parse_edge_slowdown("0:4,0:2"), "edge_slowdown '0:4,0:2' names edge 0 twice")
    refused(lambda: parse_edge_slowdown("0:0"),
             "edge_slowdown '0:0': give edge:factor pairs such as '0:4,3:2' (edge >= 0, "
             "factor > 0)")


@pytest.mark.parametrize("spread", [0.5, 1.0])
def test_compute_speeds_are_the_documented_draw(spread):
    # speed_j = exp(N(0, spread)), drawn from generator(seed, "compute-speed")
    normal = generator(5, "compute-speed").normal(0.0, spread, 6)
    expected = 0.25 * np.exp(normal)
    model = TimeModel(step_seconds=0.25, compute_spread=spread)
    np.testing.assert_allclose(model.client_step_seconds(5, 6), expected, rtol=1e-12)
    np.testing.assert_allclose(SimClock(model, 5, 6, 2).step_seconds, expected, rtol=1e-12)
    assert not np.allclose(model.client_step_seconds(6, 6), expected)


def test_no_spread_is_the_same_for_all():
    assert TimeModel(step_seconds=0.25).client_step_seconds(5, 3).tolist() == [0.25] * 3


def _clock() -> SimClock:
    model = TimeModel(step_seconds=0.5, client_edge_mbps=8.0, client_edge_latency_ms=1000.0,
                      edge_slowdown=((1, 3.0),))
    return SimClock(model, seed=0, num_clients=4, num_edges=2)


# clients 0, 1 at edge 0 and client 2 at edge 1 (slowed 3x) do 2, 4, 1 steps: compute 1, 2,
# 1.5 s; the slowest per edge: 2 and 1.5 s. transfer(m) = 1 + m s for m > 0, 0 for m = 0.
CLIENTS, STEPS, EDGE_OF = np.array([0, 1, 2]), np.array([2, 4, 1]), np.array([0, 0, 1, 1])


@pytest.mark.parametrize("downloads, uploads, expected", [
    (None, None, [2 * 3 + 2, 2 * 2 + 1.5]),                      # 2 down, 2 up / 1 and 1
    (np.array([True, False, True]), None, [2 + 2 + 3, 2 + 1.5 + 2]),   # down 1, 1; up 2, 1
    (None, np.array([0, 1]), [3 + 2 + 0, 2 + 1.5 + 2]),          # down 2, 1; up 0, 1
    (np.array([False, True, False]), np.array([1, 1]), [2 + 2 + 2, 0 + 1.5 + 2]),
])
def test_edge_round_seconds_by_hand(downloads, uploads, expected):
    clock = _clock()
    seconds = clock.edge_round_seconds(CLIENTS, STEPS, EDGE_OF, MB, downloads, uploads)
    assert seconds.tolist() == expected
    clock.edge_round(CLIENTS, STEPS, EDGE_OF, MB, downloads, uploads)
    clock.edge_round(CLIENTS, STEPS, EDGE_OF, MB)  # clocks add up: + [8, 5.5]
    assert clock.edge_time.tolist() == [expected[0] + 8, expected[1] + 5.5]
    assert clock.seconds == max(expected[0] + 8, expected[1] + 5.5)


def test_state_round_trip():
    clock = _clock()
    clock.edge_round(CLIENTS, STEPS, EDGE_OF, MB)
    state = clock.state_dict()
    assert state == {"edge_time": [8.0, 5.5]}
    fresh = _clock()
    fresh.load_state_dict({"edge_time": [3, 4]})
    assert fresh.edge_time.dtype == np.float64 and fresh.edge_time.tolist() == [3.0, 4.0]
    fresh.load_state_dict(state)
    assert fresh.seconds == 8.0
