"""Clients that move between edge servers (fedhier.round.tiers.moves): the split round with clients
re-attached to their new edges equals the simulated mobile run (inprocess), both handoffs,
regrouping too; first on in-process grids (a client's node moves from one edge's grid to
another's), then on real processes (`fedhier deploy local --edges 2 --mobility-rate`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment import reattach as reattach_module
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_edge_tier import edge_tier_grid
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 6 clients at 2 edges, 3 edge rounds per cloud round: moves land inside the cloud round.
BASE = RunConfig(dataset="digits", clients=6, groups=(2,), grouping="contiguous",
                 local_period=2, global_period=6, rounds=2, batch_size=8, seed=5,
                 mobility_rate=0.5)
TOL = 1e-5


class InProcessReattacher:
    """Moves a client's node from its edge's in-process grid to its new edge's, under a new
    node id (as a SuperNode restarted at another SuperLink gets one)."""

    def __init__(self, grids: list[InProcessGrid]) -> None:
        self.grids = grids
        self.calls: list[dict[int, int]] = []
        self._next_id = 10**6

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        self.calls.append(dict(moves))
        for client, edge in moves.items():
            (grid, node), = [(g, n) for g in self.grids for n, c in g.contexts.items()
                             if c.node_config["partition-id"] == client]
            old = grid.contexts.pop(node)
            self._next_id += 1
            self.grids[edge].contexts[self._next_id] = Context(
                run_id=old.run_id, node_id=self._next_id, node_config=old.node_config,
                state=RecordDict(), run_config=old.run_config)  # a new run: no kept state
        return {c: 0.0 for c in moves}


def run_moving(cfg: RunConfig, path: Path, monkeypatch) -> InProcessReattacher:
    cfg = cfg.replace(edge_servers=True)
    grid, app = edge_tier_grid(cfg)
    mover = InProcessReattacher([s.grid for s in app.servers])  # type: ignore[misc]
    monkeypatch.setattr(reattach_module, "reattacher_from_env", lambda: mover)
    run_federation(grid, cfg, RunFolder.create(path, cfg), engine="edge servers (in-process)",
                   progress=False)
    return mover


def without_handoffs(path: Path) -> list[list[dict]]:
    """Drop the measured handoff records (the simulation has none); returns them."""
    lines = (path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    handoffs = [r.pop("handoffs", []) for r in records]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return handoffs


@pytest.mark.parametrize("change", [
    {},
    dict(handoff="carry", participation=0.7, fail_rate=0.15, compute_spread=0.5),
    dict(mobility_rate=0.0, regroup_every=1, grouping="random"),
], ids=["fresh", "carry-faults-sim-time", "regroup"])
def test_moving_clients_equal_the_simulated_mobile_run(change, tmp_path, monkeypatch):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    mover = run_moving(cfg, tmp_path / "split", monkeypatch)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    ref = metrics(tmp_path / "ref")
    moves = [m for r in ref for m in r.get("moves", [])]
    if cfg.regroup_every:
        assert mover.calls and not moves  # regrouping re-attaches at cloud-round starts
        return
    assert moves and any((m[0] - 1) % 3 for m in moves)  # some inside a cloud round
    # every move of the simulation, re-attached once, in order
    recorded = [[h["edge_round"], h["client"], h["from"], h["to"]] for r in handoffs
                for h in r]
    assert recorded == moves
    assert [len(c) for c in mover.calls] == [
        len([m for m in moves if m[0] == k]) for k in sorted({m[0] for m in moves})]
    model_bytes = ref[-1]["client_edge_bytes"] // ref[-1]["client_edge_messages"]
    carried = [h["bytes"] for r in handoffs for h in r]
    if cfg.handoff == "carry":  # a model moves unless the move is at a cloud start
        assert carried == [model_bytes if (h[0] - 1) % 3 else 0 for h in moves]
    else:
        assert carried == [0] * len(moves)



def test_the_cloud_asks_the_driver_and_waits_for_its_answer(tmp_path):
    """The handshake of a real deployment (files under its work folder): the cloud's request
    is served by the driver's poll, and the cloud gets the driver's seconds per client; a
    re-attachment that keeps failing is tried 3 times, then comes back to the cloud as that
    client's failure (the others of its batch re-attached), not as an error of the run."""
    done: list[tuple[int, int]] = []
    tries: list[int] = []

    def move(client: int, edge: int) -> float:
        if client == 9:
            tries.append(client)
            raise RuntimeError("no such SuperNode")
        if client == 7 and tries.count(7) < 1:  # fails once, then comes online
            tries.append(client)
            raise RuntimeError("[code: 2004] Failed to activate SuperNode")
        done.append((client, edge))
        return 0.25 * edge

    driver = reattach_module.ReattachDriver(tmp_path / "reattach", move, pause=0.01)
    cloud = reattach_module.FileReattacher(tmp_path / "reattach", timeout=30)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            driver.poll()
            time.sleep(0.01)

    server = threading.Thread(target=serve)
    server.start()
    try:
        assert cloud.reattach({3: 1, 0: 2}) == {3: 0.25, 0: 0.5}
        assert cloud.reattach({1: 0}) == {1: 0.0} and cloud.failed == {}
        assert cloud.reattach({9: 1, 7: 2}) == {7: 0.5}
        assert cloud.failed == {9: "RuntimeError: no such SuperNode"}
    finally:
        stop.set()
        server.join()
    assert tries == [7, 9, 9, 9] or sorted(tries) == [7, 9, 9, 9]  # 3 tries of 9, 1 retry of 7
    assert sorted(done[:2]) == [(0, 2), (3, 1)] and done[2:] == [(1, 0), (7, 2)]
    assert sorted(p.name for p in (tmp_path / "reattach").iterdir()) == [
        f"{kind}-{n}.json" for kind in ("done", "request") for n in (1, 2, 3)]
    assert driver.poll() == 0  # every request answered once


def test_a_client_that_cannot_reattach_fails_its_new_edges_rounds(tmp_path, monkeypatch,
                                                                  caplog):
    """A moved client whose re-attachment fails (its SuperNode never comes online at its new
    edge): one warning, its handoff record says why, the new edge does not wait for it (the
    job names it absent) and every other client trains: the run finishes, the client counted
    failed in each edge round it was planned in after the move."""
    cfg = BASE.replace(edge_servers=True, rounds=1)
    grid, app = edge_tier_grid(cfg)
    mover = InProcessReattacher([s.grid for s in app.servers])  # type: ignore[misc]
    lost: list[int] = []

    class Failing:
        failed: dict[int, str] = {}

        def reattach(self, moves: dict[int, int]) -> dict[int, float]:
            if not lost:  # the first client to move never comes online again
                lost.append(min(moves))
                for g in mover.grids:  # its node is gone everywhere
                    for node, c in list(g.contexts.items()):
                        if c.node_config["partition-id"] == lost[0]:
                            del g.contexts[node]
            self.failed = {c: "RuntimeError: blocked" for c in moves if c in lost}
            seconds = mover.reattach({c: e for c, e in moves.items() if c not in lost})
            return seconds

    monkeypatch.setattr(reattach_module, "reattacher_from_env", Failing)
    start = time.perf_counter()
    run_federation(grid, cfg, RunFolder.create(tmp_path / "run", cfg),
                   engine="edge servers (in-process)", progress=False)
    assert time.perf_counter() - start < 50  # the edge did not wait FOLLOW_TIMEOUT for it
    records = metrics(tmp_path / "run")
    handoffs = [h for r in records for h in r.get("handoffs", [])]
    failed = [h for h in handoffs if "failed" in h]
    assert [h["client"] for h in failed] == lost and failed[0]["failed"] == \
        "RuntimeError: blocked"
    # every client takes part in every edge round: the lost one fails each from its move on
    assert records[-1]["failed_clients"] == 3 - failed[0]["edge_round"] + 1
    assert sum("could not be re-attached" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow
@pytest.mark.deployment
def test_a_mobile_deployment_equals_the_simulated_mobile_run(tmp_path, capsys):
    """4 clients under 2 edge servers on real processes (TLS, SuperNode authentication):
    clients move (carry handoff; two moves at the cloud round's start, one inside it); every
    move restarts the client's SuperNode at its new edge's SuperLink, and the run equals the
    simulated mobile run to 1e-5, every re-attachment timed in metrics.jsonl. (Regrouping
    re-attaches the same way, at cloud-round starts: tested in-process above, and by the
    command of docs/deployment.md "Moving clients", too slow for CI.)"""
    from fedhier.engines.deployment.ports import ports_needed
    from tests.helpers import assert_same_run
    from tests.test_deploy import leftovers
    from tests.test_deploy_edges import deploy_on_free_ports

    flags = ["--dataset", "digits", "--nodes", "4", "--grouping", "random", "--periods", "1,3",
             "--rounds", "1", "--batch-size", "8", "--seed", "4", "--mobility-rate", "0.5",
             "--handoff", "carry"]
    ports = ports_needed(4, 2)
    out, port = deploy_on_free_ports([*flags, "--edges", "2"], ports, tmp_path / "real",
                                     capsys)
    assert "re-attached to edge" in out
    assert leftovers(range(port, port + ports)) == ""
    cfg = RunConfig(dataset="digits", clients=4, groups=(2,), periods=(1, 3),
                    grouping="random", rounds=1, batch_size=8, seed=4, mobility_rate=0.5,
                    handoff="carry")
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess", cfg), progress=False)
    real = metrics(tmp_path / "real")
    handoffs = [h for r in real for h in r.get("handoffs", [])]
    wire = frozenset(k for r in real for k in r if k.startswith("wire_")) | {"handoffs"}
    assert_same_run(tmp_path / "inprocess", tmp_path / "real", 1, ignore=wire)
    moves = [m for r in metrics(tmp_path / "inprocess") for m in r.get("moves", [])]
    assert any((m[0] - 1) % 3 for m in moves)  # a carry move inside a cloud round
    assert [[h["edge_round"], h["client"], h["from"], h["to"]] for h in handoffs] == moves
    assert all(0 < h["seconds"] < 300 for h in handoffs)
    assert [h["bytes"] > 0 for h in handoffs] == [bool((m[0] - 1) % 3) for m in moves]


@pytest.mark.slow
@pytest.mark.deployment
def test_a_supernode_killed_at_its_new_edge_is_a_failed_client_not_the_end(
        tmp_path, capsys, monkeypatch):
    """On real processes (no TLS: the move, not the transport, is under test) the first
    moving client's SuperNode is killed each time it comes online at its new edge: the driver
    tries 3 times, then answers it as failed; the run finishes (exit 0), its handoff record
    says why, and that client is a failed client of its new edge's rounds."""
    from fedhier.engines.deployment.edge_servers import EdgeTierDeployment
    from fedhier.engines.deployment.ports import ports_needed
    from tests.test_deploy_edges import deploy_on_free_ports

    original = EdgeTierDeployment.reattach_client
    killed: list[int] = []

    def reattach(self, client: int, edge: int) -> float:
        seconds = original(self, client, edge)
        if not killed or killed[0] == client:
            killed.append(client)
            self.procs.stop([self.supernodes[client]], grace=2.0)
            raise RuntimeError(f"the test killed client {client}'s SuperNode at edge {edge}")
        return seconds

    monkeypatch.setattr(EdgeTierDeployment, "reattach_client", reattach)
    flags = ["--dataset", "digits", "--nodes", "4", "--grouping", "random", "--periods", "1,3",
             "--rounds", "1", "--batch-size", "8", "--seed", "4", "--mobility-rate", "0.5",
             "--insecure"]
    out, _ = deploy_on_free_ports([*flags, "--edges", "2"], ports_needed(4, 2),
                                  tmp_path / "real", capsys)
    assert len(killed) == 3 and out.count("trying again") == 2, out[-2000:]
    records = metrics(tmp_path / "real")
    failed = [h for r in records for h in r.get("handoffs", []) if "failed" in h]
    assert [h["client"] for h in failed] == killed[:1]
    assert "the test killed client" in failed[0]["failed"]
    assert records[-1]["failed_clients"] >= 3 - failed[0]["edge_round"] + 1


@pytest.mark.parametrize("change, message", [
    (dict(mobility_rate=0.5, edge_periods="1,2", local_period=1, global_period=4),
     "per-edge periods need static clients"),
])
def test_what_moving_clients_on_servers_cannot_keep_is_refused_in_one_line(change, message):
    """A job split at a move would restart an edge's own period. (Kept optimizer state
    moves with its client: tests/test_server_moves_state.py.)"""
    with pytest.raises(ConfigError, match=message):
        RunConfig(dataset="digits", clients=4, groups=(2,), edge_servers=True,
                  **change).validate()
