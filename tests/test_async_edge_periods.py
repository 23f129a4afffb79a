"""Asynchronous edges with per-edge periods on edge servers (fedhier.round.tiers.asynchronous): an
edge's job holds whole periods of its own edge, run on its server as a synchronous server
runs it, so the simulation fed the servers' recorded order (``--engine inprocess``) gives the
same records and model (1e-5). In-process grids (no sockets); the sharded engine's case is
in tests/test_vectorized_ray_async.py.

Every client is a straggler and 40% take part: some edge rounds send none of an edge's
clients while their carried models wait for the end of the edge's period, which the servers
must still settle (:func:`fedhier.round.tiers.jobs.waits_carried`, as the one-process round does).
"""

from __future__ import annotations

import pytest

from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from tests.helpers import metrics
from tests.test_deploy_async import (
    BASE,
    assert_replayed_simulation_equals,
    resume_servers_after_round_2,
    run_servers,
)
from tests.test_edge_tier import run_edge_tier
from tests.test_vectorized import assert_same_runs, final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 9 clients under 3 edges of periods 1, 3, 1 (6 steps a cloud round), K = 2 = N - 1, S = 1.
CFG = BASE.replace(edge_periods="1,3,1", local_period=1, global_period=6, async_buffer=2,
                   straggler_fraction=1.0, participation=0.4)
TOL = 1e-5


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The asynchronous edge servers' run of CFG (its arrivals recorded)."""
    path = tmp_path_factory.mktemp("async-periods") / "servers"
    run_servers(CFG, path)
    return path


def _distance(a, b) -> float:
    fa, fb = final_state(a), final_state(b)
    return max(float((fa[k] - fb[k]).abs().max()) for k in fa)


def test_the_simulation_fed_the_recorded_order_equals_the_servers(servers, tmp_path,
                                                                   monkeypatch):
    records = assert_replayed_simulation_equals(CFG, servers, tmp_path / "sim", monkeypatch)
    # each edge's aggregations in its last job: 6 / I_i, equal to the simulation's (above)
    assert [r["edge_aggregations"] for r in records[1:]] == [[6, 2, 6]] * CFG.rounds
    stale = [s for r in records[1:] for _, s in r["async_reports"]]
    assert max(stale) == 1  # K = N - 1: reports are stale


def test_the_periods_and_the_buffer_matter(servers, tmp_path):
    """The same servers with every I_i = 1, and with K = N (synchronous), end elsewhere."""
    run_servers(CFG.replace(edge_periods="1,1,1"), tmp_path / "equal")
    run_servers(CFG.replace(async_buffer=3), tmp_path / "k-equal-n")
    assert _distance(servers, tmp_path / "equal") > 1e-4
    assert _distance(servers, tmp_path / "k-equal-n") > 1e-4


def test_a_resume_keeps_each_edges_aggregations(servers, tmp_path):
    """Resumed after the checkpoint of round 2 on fresh servers: the jobs in flight are sent
    again, the recorded order taken, the model bit for bit and every record (the
    ``edge_aggregations`` restored from the checkpoint) the uninterrupted run's."""
    path = tmp_path / "resumed"
    resume_servers_after_round_2(CFG, servers, path)
    keys = ("edge_aggregations", "async_reports", "stale_dropped", "test_loss")
    assert [[r.get(k) for k in keys] for r in metrics(path)] == [
        [r.get(k) for k in keys] for r in metrics(servers)]


def test_synchronous_servers_settle_an_edge_round_with_only_carried_models(tmp_path):
    """The same periods on synchronous edge servers equal the one-process run: before
    :func:`~fedhier.round.tiers.jobs.waits_carried` a server skipped an edge round none of its
    clients was sent in, leaving its clients' carried models out of the edge's aggregation
    (the final model 0.04 away)."""
    cfg = CFG.replace(async_buffer=0, max_staleness=0)
    run_edge_tier(cfg, tmp_path / "servers")
    run_inprocess(cfg, RunFolder.create(tmp_path / "one", cfg), progress=False)
    assert_same_runs(tmp_path / "one", tmp_path / "servers", TOL)
