"""The simulated clock: closed forms of the time model, equal on every engine, resumable."""

import json

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.round.clock import SimClock, TimeModel, parse_edge_slowdown
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = TimeModel(step_seconds=0.02, client_edge_mbps=8.0, client_edge_latency_ms=3.0,
                  edge_cloud_mbps=2.0, edge_cloud_latency_ms=40.0)
B = 10_000  # model bytes: 0.01 s per model at 8 Mbit/s, 0.04 s at 2 Mbit/s


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    seconds = MODEL.transfer_seconds("client-edge", np.array([0, 1, 3]), B)
    np.testing.assert_allclose(seconds, [0.0, 0.003 + 0.01, 0.003 + 0.03], rtol=1e-12)
    assert MODEL.transfer_seconds("edge-cloud", 2, B) == pytest.approx(0.04 + 0.08, rel=1e-12)


def test_edge_round_waits_for_its_slowest_client_and_its_shared_link():
    # clients 0, 1 at edge 0 (1 and 3 steps), client 2 at edge 1 slowed 4x, edge 2 idle
    model = TimeModel(step_seconds=0.02, client_edge_mbps=8.0, client_edge_latency_ms=3.0,
                      edge_slowdown=((1, 4.0),))
    clock = SimClock(model, seed=0, num_clients=3, num_edges=3)
    clock.edge_round(np.array([0, 1, 2]), np.array([1, 3, 2]), np.array([0, 0, 1]), B)
    expected = [2 * (0.003 + 2 * 0.01) + 3 * 0.02, 2 * (0.003 + 0.01) + 2 * 0.02 * 4, 0.0]
    np.testing.assert_allclose(clock.edge_time, expected, rtol=1e-12)


def test_three_level_aggregation_queues_uploads_then_syncs_each_subtree():
    # edges 0, 1 under region 0 and edge 2 under region 1; the cloud above both regions
    hierarchy = Hierarchy(periods=(1, 2, 4), parents=(np.array([0, 1, 2]), np.array([0, 0, 1])))
    clock = SimClock(MODEL, seed=0, num_clients=3, num_edges=3)
    clock.edge_time = np.array([1.0, 2.0, 0.5])
    per, lat = 0.04, 0.04  # one model over the 2 Mbit/s link, its latency
    clock.aggregate(hierarchy, 2, B)  # regions only
    # region 0: edge 0's model is through at 1.04, edge 1's (ready at 2.0) at 2.04
    region = [2.0 + per + lat, 0.5 + per + lat]
    np.testing.assert_allclose(clock.edge_time, [region[0] + lat + 2 * per] * 2
                               + [region[1] + lat + per], rtol=1e-12)
    before = clock.edge_time.copy()
    clock.aggregate(hierarchy, 3, B)  # region uplinks queued, the cloud, back down
    ready = [before[0] + 2 * per + lat, before[2] + per + lat]  # each region's queue
    first, second = sorted(ready)
    top = max(first + per + lat, max(second, first + per) + per + lat)
    np.testing.assert_allclose(clock.edge_time, [top + 2 * (lat + 2 * per)] * 2
                               + [top + (lat + 2 * per) + (lat + per)], rtol=1e-12)


def test_uploads_share_the_link_one_after_another():
    clock = SimClock(MODEL, seed=0, num_clients=3, num_edges=3)
    arrivals, free = clock.upload_queue(np.array([1.0, 0.0, 0.0]), -np.inf, B)
    np.testing.assert_allclose(arrivals, [1.04 + 0.04, 0.04 + 0.04, 0.08 + 0.04], rtol=1e-12)
    assert free == pytest.approx(1.04)
    later, _ = clock.upload_queue(np.array([0.5]), free, B)  # the link is busy until 1.04
    assert later[0] == pytest.approx(1.08 + 0.04)


def test_a_run_advances_by_the_closed_form(tmp_path):
    """Two levels, everyone trains I steps: edge e is done after (G/I) (2 transfer(k_e) +
    I step); the cloud's link takes the N models one after another, then sends N back."""
    cfg = RunConfig(dataset="digits", clients=8, groups=(3,), local_period=2, global_period=6,
                    rounds=2, step_seconds=0.02, client_edge_mbps=8.0,
                    client_edge_latency_ms=3.0, edge_cloud_mbps=2.0,
                    edge_cloud_latency_ms=40.0)
    run_inprocess(cfg, RunFolder.create(tmp_path / "r", cfg), progress=False)
    records = metrics(tmp_path / "r")
    edge_of = np.array(json.loads((tmp_path / "r" / "groups.json").read_text())["client_to_edge"])
    model_bytes = records[1]["edge_cloud_bytes"] // (2 * 3)  # one cloud round: 3 edges up+down
    per_edge = np.bincount(edge_of, minlength=3) * 8.0 * model_bytes / 8e6 + 0.003
    edge_rounds = 3
    ready = sorted(edge_rounds * (2 * per_edge + 2 * 0.02))  # each edge done training
    per_model, link = 8.0 * model_bytes / 2e6, -np.inf
    for edge_ready in ready:  # the cloud's link takes one model after another
        link = max(link, edge_ready) + per_model
    round_seconds = link + 0.04 + (0.04 + 3 * per_model)  # last arrival, then back down
    assert records[0]["sim_seconds"] == 0.0
    assert records[1]["sim_seconds"] == pytest.approx(round_seconds, rel=1e-12)
    assert records[2]["sim_seconds"] == pytest.approx(2 * round_seconds, rel=1e-12)


def test_every_engine_has_the_same_clock(tmp_path):
    cfg = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8), rounds=2,
                    batch_size=8, participation=0.6, straggler_fraction=0.5,
                    compute_spread=0.7, edge_slowdown="1:4", seed=5)
    run_inprocess(cfg, RunFolder.create(tmp_path / "a", cfg), progress=False)
    run_vectorized(cfg, RunFolder.create(tmp_path / "b", cfg), progress=False)
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["sim_seconds"] for r in a] == [r["sim_seconds"] for r in b]
    assert a[-1]["sim_seconds"] > 0


def test_a_slower_cloud_link_costs_a_flat_run_more_than_a_hierarchical_one(tmp_path):
    """The reason for H-SGD: 8 local steps in edge rounds of 2 either reach the cloud once
    (I=2, G=8) or after every edge round (flat, I=G=2); slowing the cloud link 10x costs the
    flat run exactly 4x the extra time."""
    def seconds(periods: str, rounds: int, mbps: float) -> float:
        out = tmp_path / f"{periods}-{mbps}"
        assert main(["run", "--clients", "8", "--groups", "2", "--periods", periods,
                     "--rounds", str(rounds), "--edge-cloud-mbps", str(mbps), "--no-progress",
                     "--out", str(out)]) == 0
        return metrics(out)[-1]["sim_seconds"]

    hier_fast, hier_slow = seconds("2,8", 1, 10.0), seconds("2,8", 1, 1.0)
    flat_fast, flat_slow = seconds("2,2", 4, 10.0), seconds("2,2", 4, 1.0)
    assert flat_slow - flat_fast == pytest.approx(4 * (hier_slow - hier_fast), rel=1e-9)
    assert hier_slow < flat_slow


@pytest.mark.parametrize("text,message", [
    ("0:x", "edge:factor"), ("0", "edge:factor"), ("0:0", "edge:factor"),
    ("0:4,0:2", "twice"), ("-1:2", "edge:factor"), ("0:inf", "edge:factor")])
def test_bad_edge_slowdown_is_one_line(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_edge_slowdown(text)


def test_time_model_inputs_are_checked_before_any_work(tmp_path, capsys):
    for flags in (["--edge-slowdown", "4:2"], ["--edge-cloud-mbps", "0"],
                  ["--step-seconds", "-1"]):
        out = tmp_path / "never"
        assert main(["run", "--groups", "4", *flags, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err
        assert not out.exists()
    assert parse_edge_slowdown(" 0:4, 3:2.5 ") == ((0, 4.0), (3, 2.5))


def test_per_edge_periods_pay_only_for_the_transfers_they_make():
    """A client that continues from its own model downloads nothing, and an edge that does
    not aggregate receives nothing: its edge round is its slowest client's compute."""
    clock = SimClock(MODEL, seed=0, num_clients=3, num_edges=2)
    clients, steps, edge_of = np.array([0, 1, 2]), np.array([2, 2, 2]), np.array([0, 0, 1])
    seconds = clock.edge_round_seconds(clients, steps, edge_of, B,
                                       downloads=np.array([True, True, False]),
                                       uploads=np.array([2, 0]))
    np.testing.assert_allclose(seconds, [2 * (0.003 + 2 * 0.01) + 2 * 0.02, 2 * 0.02],
                               rtol=1e-12)


def test_unequal_edge_periods_run_on_the_same_clock_on_every_engine(tmp_path):
    cfg = RunConfig(dataset="digits", clients=8, groups=(2,), local_period=2, global_period=8,
                    edge_periods="2,8", rounds=2, batch_size=8, compute_spread=0.3)
    run_inprocess(cfg, RunFolder.create(tmp_path / "a", cfg), progress=False)
    run_vectorized(cfg, RunFolder.create(tmp_path / "b", cfg), progress=False)
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["sim_seconds"] for r in a] == [r["sim_seconds"] for r in b]
    plain = cfg.replace(edge_periods="")
    run_inprocess(plain, RunFolder.create(tmp_path / "c", plain), progress=False)
    assert a[-1]["client_edge_bytes"] < metrics(tmp_path / "c")[-1]["client_edge_bytes"]
