"""Asynchronous edges on edge servers (fedhier.round.tiers.asynchronous): the cloud takes the
reports as they really come, records their order (arrivals.jsonl), and a replay or a resume takes
them in the recorded order: the simulation fed that order gives the same model (1e-5), two
replays the same bits. In-process grids (no sockets) here; one real deployment at the end.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from fedhier.common.errors import ConfigError
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.round.asynchrony.arrival_order import (
    ARRIVALS_FILE,
    ArrivalsLog,
    RecordedOrder,
    SimulatedOrder,
    read_arrivals,
)
from fedhier.runs.checkpoint import load_checkpoint
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_edge_tier import edge_tier_grid
from tests.test_vectorized import final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 9 clients under 3 edges, K = 1, S = 1: on in-process grids the reports come in the order
#: the jobs were sent (0 | 1 | 2 dropped at staleness 2, 0), edge 0 is the simulation's slow one.
BASE = RunConfig(dataset="digits", clients=9, groups=(3,), grouping="contiguous",
                 local_period=2, global_period=6, rounds=3, batch_size=8, seed=5,
                 async_buffer=1, max_staleness=1, edge_slowdown="0:4", checkpoint_every=2)
TOL = 1e-5
#: What the cloud of edge servers learns only when a report arrives (counted in the round
#: that takes it, the simulation counts it when the job starts), and the clients'
#: per-round evaluation, which edge servers busy with jobs do not run.
LATE_KEYS = ("local_train_loss", "failed_clients", "failed_edges", "client_edge_messages",
             "client_edge_bytes")


def run_servers(cfg: RunConfig, path, resume=None):
    cfg = cfg.replace(edge_servers=True)
    grid, _ = edge_tier_grid(cfg)
    folder = RunFolder.create(path, cfg) if resume is None else RunFolder.claim_existing(path)
    run_federation(grid, cfg, folder, engine="edge servers (in-process)", progress=False,
                   resume=resume)
    return metrics(path)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """One in-process async edge-server run (its arrivals recorded)."""
    path = tmp_path_factory.mktemp("async") / "servers"
    run_servers(BASE, path)
    return path


def resume_servers_after_round_2(cfg: RunConfig, whole, path) -> None:
    """A copy of the uninterrupted run ``whole`` (checkpointed after round 2) resumed at
    ``path`` on fresh servers: the same arrival orders and the same final model, bit for
    bit."""
    shutil.copytree(whole, path)
    checkpoint = load_checkpoint(path)
    assert checkpoint.round == 2
    run_servers(cfg, path, resume=checkpoint)
    assert orders(path) == orders(whole)
    fa, fb = final_state(path), final_state(whole)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def orders(path) -> list[list[int]]:
    return [json.loads(line)["order"] for line in (path / ARRIVALS_FILE).read_text().splitlines()]


def test_the_arrivals_are_recorded_per_cloud_aggregation(deployed):
    assert orders(deployed) == [[0], [1], [2, 0]]
    lines = [json.loads(x) for x in (deployed / ARRIVALS_FILE).read_text().splitlines()]
    assert [x["accepted"] for x in lines] == [[0], [1], [0]]
    records = metrics(deployed)
    assert [r.get("async_reports") for r in records[1:]] == [[[0, 0]], [[1, 1]], [[0, 1]]]
    assert [r["stale_dropped"] for r in records[1:]] == [0, 0, 1]


def test_the_simulation_fed_the_recorded_order_equals_the_servers(deployed, tmp_path,
                                                                   monkeypatch):
    run_inprocess(BASE, RunFolder.create(tmp_path / "own", BASE), progress=False)
    own = metrics(tmp_path / "own")
    # the simulated clock orders them otherwise (edge 0 is slow there): replaying matters
    assert [r["async_reports"] for r in own[1:]] != [r["async_reports"]
                                                      for r in metrics(deployed)[1:]]
    servers = assert_replayed_simulation_equals(BASE, deployed, tmp_path / "sim", monkeypatch)
    # the run's own train losses still all arrive, in the rounds that take them
    assert sum(r["failed_clients"] for r in servers[1:]) == 0


def assert_replayed_simulation_equals(cfg: RunConfig, servers_path, sim_path,
                                      monkeypatch) -> list[dict]:
    """The simulation (``--engine inprocess``) of ``cfg`` fed the servers' recorded order
    writes ``sim_path``: its records equal the servers' (floats to TOL, but the LATE_KEYS and
    the clients' own evaluation), its final model too (TOL); returns the servers' records."""
    cfg = cfg.replace(replay_arrivals=str(servers_path))
    run_inprocess(cfg, RunFolder.create(sim_path, cfg), progress=False)
    sim, servers = metrics(sim_path), metrics(servers_path)
    assert len(sim) == len(servers) == cfg.rounds + 1
    for a, b in zip(sim, servers, strict=True):
        for key in a.keys() - {"wall_seconds", *LATE_KEYS}:
            if key.startswith(("client_", "holdout_", "train_")) or key not in b:
                continue  # the clients' own evaluation: not run by busy edge servers
            va, vb = a[key], b[key]
            if isinstance(va, float):
                assert math.isclose(va, vb, rel_tol=TOL, abs_tol=TOL * 1e-3), (key, va, vb)
            else:
                assert va == vb, (key, a["round"], va, vb)
    fa, fb = final_state(sim_path), final_state(servers_path)
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= TOL
    return servers


def test_two_replays_are_bit_identical(deployed, tmp_path, monkeypatch):
    replay = BASE.replace(replay_arrivals=str(deployed / ARRIVALS_FILE))
    first = run_servers(replay, tmp_path / "a")
    second = run_servers(replay, tmp_path / "b")
    assert orders(tmp_path / "a") == orders(tmp_path / "b") == orders(deployed)
    strip = [{k: v for k, v in r.items() if k != "wall_seconds"} for r in first]
    assert strip == [{k: v for k, v in r.items() if k != "wall_seconds"} for r in second]
    fa, fb = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def test_a_resume_continues_with_the_recorded_order(deployed, tmp_path):
    """A checkpoint after round 2, round 3 recorded: resumed on fresh servers, the jobs in
    flight are sent again, round 3 takes the recorded [2, 0] (its own sending order would
    take edge 0 first) and ends on the same model, bit for bit."""
    resume_servers_after_round_2(BASE, deployed, tmp_path / "resumed")


# ------------------------------------------------------------------------ the parts
def test_a_recorded_order_is_taken_then_the_next_order():
    jobs = {0: type("J", (), {"finish": 3.0})(), 2: type("J", (), {"finish": 1.0})()}
    waited: list[int] = []
    order = RecordedOrder({1: [0, 2]}, SimulatedOrder(), wait=waited.append)
    assert [order.next_edge(jobs, 0), order.next_edge(jobs, 0)] == [0, 2]
    assert order.next_edge(jobs, 0) == 2  # round 1's record is spent: the simulated clock
    assert order.next_edge(jobs, 1) == 2  # round 2 is not recorded
    assert waited == [0, 2]
    with pytest.raises(ConfigError, match="report 1 of cloud round 1 is edge 1's"):
        RecordedOrder({1: [1]}, SimulatedOrder()).next_edge(jobs, 0)


def test_the_arrivals_file_is_cut_back_to_a_checkpoint_and_a_torn_line_is_left_out(tmp_path):
    log = ArrivalsLog(tmp_path / ARRIVALS_FILE)
    for r, order in ((1, [0]), (2, [2, 1]), (3, [1])):
        log.write(r, order, order[-1:])
    with log.path.open("a") as f:
        f.write('{"round": 4, "ord')  # killed while writing
    assert read_arrivals(tmp_path) == {1: [0], 2: [2, 1], 3: [1]}
    assert log.cut(1) == {2: [2, 1], 3: [1]}
    assert read_arrivals(log.path) == {1: [0]}
    (tmp_path / "bad.jsonl").write_text('{"round": 1}\n{"round": 2, "order": [0]}\n')
    with pytest.raises(ConfigError, match="line 1: not an arrivals record"):
        read_arrivals(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="arrivals file"):
        read_arrivals(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("change, message", [
    (dict(groups=(4, 2), periods=(2, 4, 8), clients=8), "two levels"),
    (dict(diagnostics_every=1), "diagnostics_every 0"),
    (dict(mobility_rate=0.5), "static clients"),
    (dict(regroup_every=1), "static clients"),
    (dict(momentum=0.9, optimizer_state="keep"), "optimizer-state reset"),
])
def test_what_async_edge_servers_do_not_run_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        BASE.replace(edge_servers=True, **change).validate()


def test_the_sharded_engine_refuses_async_edges_with_moving_clients():
    """The sharded engine runs asynchronous edges (tests/test_vectorized_ray_async.py) but,
    as edge servers, not with clients that move."""
    from fedhier.engines.vectorized_ray.engine import check_sharded

    with pytest.raises(ConfigError, match="vectorized-ray with async_buffer needs static"):
        check_sharded(RunConfig(dataset="digits", clients=8, groups=(4,), async_buffer=2,
                                mobility_rate=0.5))


# ------------------------------------------------------------------------ real processes
@pytest.mark.slow
@pytest.mark.deployment
def test_async_edge_servers_on_real_processes_record_and_replay_their_arrivals(tmp_path,
                                                                              capsys,
                                                                              monkeypatch):
    """4 clients under 2 edge servers and the cloud, each a process (K = 1): the order the
    reports really came in is recorded; a second deployment replaying it ends on the same
    model bit for bit, and the edge servers on in-process grids fed that order on it to
    1e-5."""
    from fedhier.engines.deployment.ports import ports_needed
    from tests.test_deploy_edges import deploy_on_free_ports

    flags = ["--dataset", "digits", "--nodes", "4", "--edges", "2", "--async-buffer", "1",
             "--grouping", "contiguous", "--periods", "2,4", "--rounds", "2",
             "--batch-size", "8", "--seed", "3", "--insecure"]
    ports = ports_needed(4, 2)
    deploy_on_free_ports(flags, ports, tmp_path / "live", capsys)
    live = orders(tmp_path / "live")
    assert len(live) == 2 and all(len(order) >= 1 for order in live)
    deploy_on_free_ports([*flags, "--replay-arrivals", str(tmp_path / "live")], ports,
                         tmp_path / "replay", capsys)
    assert orders(tmp_path / "replay") == live
    fa, fb = final_state(tmp_path / "live"), final_state(tmp_path / "replay")
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    cfg = RunConfig(dataset="digits", clients=4, groups=(2,), grouping="contiguous",
                    periods=(2, 4), rounds=2, batch_size=8, seed=3, async_buffer=1,
                    on_bad_reply="drop", replay_arrivals=str(tmp_path / "live"))
    run_servers(cfg, tmp_path / "inprocess")
    fc = final_state(tmp_path / "inprocess")
    assert max(float((fa[k] - fc[k]).abs().max()) for k in fa) <= TOL
    assert [r.get("async_reports") for r in metrics(tmp_path / "inprocess")] == \
        [r.get("async_reports") for r in metrics(tmp_path / "live")]


def test_the_real_slowdown_sleeps_by_the_edge_the_supernode_names(monkeypatch):
    """S x steps x the factor of the client's edge now (its SuperNode's ``edge`` config,
    renewed when it re-attaches); nothing without edge servers or without S."""
    from fedhier.local import real_slowdown

    slept: list[float] = []
    monkeypatch.setattr(real_slowdown.time, "sleep", slept.append)
    cfg = BASE.replace(edge_servers=True, edge_slowdown="1:4", real_step_seconds=0.5)
    assert real_slowdown.sleep_for_steps(cfg, 1, 3) == 6.0  # 0.5 s x 3 steps x 4
    assert real_slowdown.sleep_for_steps(cfg, "0", 3) == 1.5  # an edge not named: 1
    assert real_slowdown.sleep_for_steps(cfg, None, 2) == 1.0
    assert real_slowdown.sleep_for_steps(cfg.replace(edge_servers=False), 1, 3) == 0.0
    assert real_slowdown.sleep_for_steps(cfg.replace(real_step_seconds=0.0), 1, 3) == 0.0
    assert slept == [6.0, 1.5, 1.0]
