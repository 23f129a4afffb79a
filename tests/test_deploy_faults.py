"""Faults on every tier of real servers (`fedhier deploy local --edges 3 --regions 2`): a region
server killed mid-job and an edge server killed under a region each miss their jobs (their
whole subtree counted failed, by exact count), restart and rejoin, and the run completes; a
run whose cloud was killed resumes to the uninterrupted run's numbers; Ctrl-C mid-run stops
every process; a server that keeps dying ends the command with one line.

Each case is one tiny deployment (4 clients, digits, 2 edge rounds per cloud round); two
tiers are tested in tests/test_deploy_edges.py (docs/deployment.md#faults-on-every-tier).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedhier.engines import deployment as deploy
from fedhier.engines.deployment.edge_servers import MAX_RESTARTS, EdgeTierDeployment
from fedhier.engines.deployment.errors import DeployError
from fedhier.engines.deployment.ports import ports_needed
from fedhier.engines.deployment.processes import alive, process_tree
from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.messages import FIRST_ROUND
from fedhier.strategies.edge.server import EdgeServer, nested_timeout
from tests.helpers import assert_same_run, interruptible, metrics
from tests.test_deploy import ROOT, leftovers
from tests.test_deploy_regions import BASE, servers_grid

#: 4 clients under 3 edges under 2 regions (contiguous): edges [0, 0, 1, 2] by client, regions
#: [0, 0, 1] by edge; edges and regions aggregate every step, the cloud every 2 (each job of a
#: region is 2 exchanges of 1 edge round with its edges).
NODES, EDGES, REGIONS, PERIODS = 4, 3, 2, (1, 1, 2)
CLIENTS_OF_EDGE = {0: 2, 1: 1, 2: 1}
EDGES_OF_REGION = {0: (0, 1), 1: (2,)}
PORTS = ports_needed(NODES, EDGES + REGIONS)
#: The cloud waits this long for a region's job (a region 36 s per exchange, an edge 28.8 s
#: per edge round: nested_timeout). At 45 s (a region 18 s) a healthy exchange of 4 s work
#: expired on a 2-core machine at load average 28 (Flower's polling legs, not the work).
ROUND_TIMEOUT = 90.0


def _cmd(port: int, out: Path, rounds: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fedhier.engines.deployment", "local", "--nodes", str(NODES),
            "--edges", str(EDGES), "--regions", str(REGIONS), "--grouping", "contiguous",
            "--periods", ",".join(map(str, PERIODS)), "--rounds", str(rounds),
            "--batch-size", "8", "--seed", "11", "--insecure", "--base-port", str(port),
            "--out", str(out), *extra]


class Watched:
    """``fedhier deploy local`` as a child: its output read in a thread, the pids it prints,
    and every process of its tree seen while it ran (snapshotted by :meth:`wait_for`)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, preexec_fn=interruptible)
        self.lines: list[str] = []
        self.seen: dict[int, str] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def pid_of(self, name: str) -> int:
        """The pid the command printed last for ``name`` (``region server 1``, ``SuperLink``)."""
        found = re.findall(rf"^{re.escape(name)}\b.*\(pid (\d+)\)", self.text, re.M)
        assert found, self.text[-3000:]
        return int(found[-1])

    def wait_for(self, ready, timeout: float = 600) -> None:
        """Snapshot the process tree every 0.3 s until ``ready()`` (fails if the command
        ended first)."""
        deadline = time.time() + timeout
        while not ready():
            self.seen.update(process_tree([self.proc.pid]))
            assert self.proc.poll() is None and time.time() < deadline, self.text[-3000:]
            time.sleep(0.3)
        self.seen.update(process_tree([self.proc.pid]))

    def finish(self, timeout: float = 900) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.seen.update(process_tree([self.proc.pid]))
            time.sleep(0.5)
        code = self.proc.wait(timeout=max(1.0, deadline - time.time()))
        self.reader.join(timeout=30)
        return code

    def assert_all_stopped(self, port: int) -> None:
        """Every process seen under the command (SuperLinks, SuperNodes, servers, their
        ServerApps and ClientApps) is gone, and none names one of its ports."""
        assert len(self.seen) > 3 * (EDGES + REGIONS), sorted(self.seen)
        assert alive(self.seen) == [], alive(self.seen)
        assert leftovers(range(port, port + PORTS)) == ""


def _log(out: Path, name: str) -> str:
    """A deployment's log, while it runs (hidden work folder) or after (out/deploy)."""
    logs = [*out.parent.glob(f".{out.name}.deploy-*/logs/{name}.log"),
            out / "deploy" / "logs" / f"{name}.log"]
    return next((p.read_text() for p in logs if p.is_file()), "")


def _missed(log: str, child: str, cloud_round: int) -> list[int]:
    """The ``child`` servers (``edge``/``region``) a parent's log says missed a job of
    ``cloud_round``, once per missed job."""
    return [int(m) for m in re.findall(rf"^{child} (\d+) did not answer in cloud round "
                                       rf"{cloud_round}:", log, re.M)]


@pytest.mark.slow
def test_a_killed_region_and_a_killed_edge_under_a_region_miss_their_jobs_and_rejoin(
        tmp_path, monkeypatch):
    """SIGKILL region server 1 (edge 2, client 3) in its job of cloud round 2 and edge server 1
    (under region 0: client 2) in its first exchange of round 3: each restarts, its subtree
    is counted failed for exactly the jobs its parent saw it miss, region 0 is not (its edge's
    miss fits in the cloud's wait), both answer jobs again after their restart, the run
    completes and every process is stopped at its end.

    Edge 1's client really sleeps 2 s per local step (the others 0.05 s;
    fedhier.local.real_slowdown, which changes no number of the run), so the kill lands inside the
    exchange it names (an exchange of this tiny MLP answers in 0.3 s and the test looks
    every 0.3 s: a CI run once killed edge 1 just after its first exchange, and it missed
    none). A region's job (two exchanges through Flower) lasts seconds as it is."""
    rounds = 4
    port = deploy.free_port_block(PORTS)
    out = tmp_path / "run"
    run = Watched(_cmd(port, out, rounds, "--round-timeout", str(ROUND_TIMEOUT),
                       "--edge-slowdown", "1:40", "--real-step-seconds", "0.05"))
    for name, server, cloud_round in (("region-1", "region server 1", 2),
                                      ("edge-1", "edge server 1", 3)):
        got = f"got train (cloud round {cloud_round})"
        run.wait_for(lambda got=got, name=name: got in _log(out, name))
        os.kill(run.pid_of(server), signal.SIGKILL)
    assert run.finish() == 0, run.text[-3000:]
    assert "region server 1 stopped (exit code -9); restarting it" in run.text
    assert "edge server 1 stopped (exit code -9); restarting it" in run.text
    run.assert_all_stopped(port)

    rows = metrics(out)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    cloud, region = _log(out, "flwr-run"), {r: _log(out, f"region-{r}") for r in (0, 1)}
    span = PERIODS[2] // PERIODS[0]  # edge rounds of a region's job
    for row in rows[1:]:
        r = row["round"]
        unreached = sorted(set(_missed(cloud, "region", r)))
        assert row.get("unreached_regions") == (unreached or None), (r, row)
        # a missed region: its clients and edges failed every edge round of its job; a region
        # that answered counts its edges' missed exchanges (1 edge round each)
        edge_misses = [e for g in (0, 1) if g not in unreached
                       for e in _missed(region[g], "edge", r)]
        assert row["failed_clients"] == (
            sum(CLIENTS_OF_EDGE[e] for g in unreached for e in EDGES_OF_REGION[g]) * span
            + sum(CLIENTS_OF_EDGE[e] for e in edge_misses)), (r, row, edge_misses)
        assert row["failed_edges"] == (sum(len(EDGES_OF_REGION[g]) for g in unreached) * span
                                       + len(edge_misses)), (r, row)
        assert row.get("unreached_edges") == (sorted(set(edge_misses)) or None), (r, row)
    # by hand: region 1 (1 client, 1 edge) missed its job of round 2 (2 edge rounds); edge 1
    # missed its first exchange of round 3 (and its second, if it was not back in time),
    # region 0 answered round 3 all the same (its wait for edge 1 fits in the cloud's).
    # Region 1 may miss round 3 too: its edge 2 first tries to pull the job the killed region
    # was pushing (Flower retries a missing object for tens of seconds), and the restarted
    # region waits for edge 2 before it takes a job (it missed round 3 in each run measured here)
    assert rows[2]["unreached_regions"] == [1]
    assert (rows[2]["failed_clients"], rows[2]["failed_edges"]) == (2, 2)
    assert 0 not in rows[3].get("unreached_regions", [])
    assert _missed(region[0], "edge", 3) in ([1], [1, 1])
    region_1 = 2 if rows[3].get("unreached_regions") == [1] else 0
    assert rows[3]["failed_clients"] == rows[3]["failed_edges"] == region_1 + len(
        _missed(region[0], "edge", 3))
    assert rows[1]["failed_clients"] == 0
    # rejoined: each restarted process answered a job of a later round, and the last round
    # reached every region
    for name, killed_in in (("region-1", 2), ("edge-1", 3)):
        restarted = _log(out, name).split("\n$ ")[-1]
        later = re.findall(r"got train \(cloud round (\d+)\)\n[^\n]*answered train", restarted)
        assert any(int(r) > killed_in for r in later), restarted
    assert "unreached_regions" not in rows[4], rows[4]
    assert rows[4]["test_accuracy"] > rows[0]["test_accuracy"]


@pytest.mark.slow
def test_resume_after_killing_the_cloud_of_three_tiers_equals_the_one_process_run(tmp_path):
    """With clients' kept momentum: SIGKILL the cloud SuperLink once round 1 is checkpointed
    (the clients' state gathered through regions and edges): the command stops every process
    (exit 1) and keeps round 1's checkpoint; `--resume` on fresh processes (the state put
    back through them) finishes round 2.
    Equal to the one-process run to 1e-5 (not bit for bit: the split run averages its
    children's averages, tests/test_deploy_regions.py), as an uninterrupted deployment is."""
    port = deploy.free_port_block(PORTS)
    out = tmp_path / "run"
    run = Watched(_cmd(port, out, 2, "--checkpoint-every", "1", "--momentum", "0.9",
                       "--optimizer-state", "keep"))
    # the checkpoint follows round 1's record once the clients' kept momentum came back
    # through the regions and edges (query.state)
    run.wait_for(lambda: "round 1/2" in run.text and (out / "checkpoint.pt").is_file())
    os.kill(run.pid_of("SuperLink"), signal.SIGKILL)
    assert run.finish(300) == 1, run.text[-3000:]
    assert "the run failed" in run.text and "stopped all" in run.text
    assert (out / "checkpoint.pt").is_file() and len(metrics(out)) == 2
    run.assert_all_stopped(port)
    port = deploy.free_port_block(PORTS, start=port + PORTS + 100)
    resumed = Watched([sys.executable, "-m", "fedhier.engines.deployment", "local", "--resume",
                       str(out), "--base-port", str(port), "--insecure"])
    assert resumed.finish() == 0, resumed.text[-3000:]
    assert "round 2/2" in resumed.text
    resumed.assert_all_stopped(port)
    cfg = RunConfig(dataset="digits", clients=NODES, groups=(EDGES, REGIONS), periods=PERIODS,
                    grouping="contiguous", rounds=2, batch_size=8, seed=11, checkpoint_every=1,
                    momentum=0.9, optimizer_state="keep")
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    wire = frozenset(f"wire_{link}_bytes" for link in ("client_edge", "edge_region",
                                                       "region_cloud"))
    assert_same_run(tmp_path / "inprocess", out, 2, ignore=wire)


@pytest.mark.slow
def test_ctrl_c_mid_run_stops_every_process_of_three_tiers(tmp_path):
    """SIGINT to `fedhier deploy local` once the cloud's app is submitted (every SuperLink,
    SuperNode and server up): exit 130, every process of its tree gone."""
    port = deploy.free_port_block(PORTS)
    run = Watched(_cmd(port, tmp_path / "run", 2))
    run.wait_for(lambda: "flwr run" in run.text)  # every tier is up once the app is submitted
    assert "region server 1" in run.text
    assert leftovers(range(port, port + PORTS)) != ""
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(120) == 130, run.text[-3000:]
    assert "stopped all" in run.text
    run.assert_all_stopped(port)


# --------------------------------------------------------------------- no deployment needed
def test_a_lost_region_job_and_a_lost_edge_job_under_a_region_are_counted_and_named(
        tmp_path, monkeypatch):
    """The same accounting on nested in-process grids, every miss chosen (8 clients, 4 edges,
    2 regions, periods 2,4,8: a region's job is 4 edge rounds, an edge's 2): region 1 (edges
    2, 3; clients 4-7) fails its job of cloud round 1, edge 1 (under region 0; clients 2, 3)
    its first job of round 2. Each record counts exactly the lost subtree and names it."""
    from fedhier.engines.grid_run import run_federation

    down = {(2, 1, 1, 1), (1, 1, 2, 5)}  # (level, node, cloud round, first edge round)
    missed = []
    handle = EdgeServer.handle

    def flaky(self: EdgeServer, msg):
        config = msg.content["config"]
        key = (self.level, self.edge, int(config.get("server-round", 0)),
               int(config.get(FIRST_ROUND, 0)))
        if msg.metadata.message_type == "train" and key in down:
            missed.append(key)
            raise ConnectionError(f"{self.level}/{self.edge} is down")
        return handle(self, msg)

    monkeypatch.setattr(EdgeServer, "handle", flaky)
    cfg = BASE.replace(edge_servers=True)
    run_federation(servers_grid(cfg), cfg, RunFolder.create(tmp_path / "r", cfg),
                   engine="servers (in-process)", progress=False)
    rows = metrics(tmp_path / "r")
    assert sorted(missed) == sorted(down)
    assert rows[1]["unreached_regions"] == [1] and "unreached_edges" not in rows[1]
    assert (rows[1]["failed_clients"], rows[1]["failed_edges"]) == (4 * 4, 2 * 4)
    assert rows[2]["unreached_edges"] == [1] and "unreached_regions" not in rows[2]
    assert (rows[2]["failed_clients"], rows[2]["failed_edges"]) == (2 * 2, 1 * 2)


def test_a_server_dies_once_too_often_ends_the_command_in_one_line(tmp_path, monkeypatch):
    """A region server whose process exits 1 at every start (its last line: the error line
    fedhier's server process prints) is restarted MAX_RESTARTS times, then the deployment
    gives up in one line naming it, its exit code, its own error and its log (every start's
    output kept there). The other servers keep running and are not touched."""
    port = deploy.free_port_block(PORTS)
    deployment = EdgeTierDeployment(
        nodes=NODES, work=tmp_path / "work", base_port=port, secure=False,
        supernode_auth=False, echo=lambda line: None, edges=[0, 0, 1, 2], upper=[[0, 0, 1]],
        num_edges=EDGES, edge_timeout=5)
    region = deployment.server_index(2, 0)
    start = deployment.procs.start
    dies = ("import sys; print('region 0: error: RuntimeError: flwr run on the edge SuperLink "
            "failed: no connection', file=sys.stderr); sys.exit(1)")

    def start_dying(name, cmd, env, log, cwd):  # the real command line, then the dying one
        assert name == "region-0" and "--level" in cmd and cmd[cmd.index("--level") + 1] == "2"
        return start(name, [sys.executable, "-c", dies], env, log, cwd)

    try:
        deployment.edge_processes = [_running(deployment, j) for j in range(region)]
        monkeypatch.setattr(deployment.procs, "start", start_dying)
        deployment.start_edge_process(region)
        for _ in range(MAX_RESTARTS):
            deployment.edge_processes[region].popen.wait(timeout=60)
            assert deployment.restart_stopped_edges() == [region]
        deployment.edge_processes[region].popen.wait(timeout=60)
        with pytest.raises(DeployError) as raised:
            deployment.restart_stopped_edges()
        assert all(p.popen.poll() is None for p in deployment.edge_processes[:region])
    finally:
        monkeypatch.undo()
        assert deployment.stop() == []
    assert str(raised.value) == (
        f"region server 0 stopped {MAX_RESTARTS + 1} times (last exit code 1); not restarted "
        f"again (at most {MAX_RESTARTS} restarts); it said: region 0: error: RuntimeError: flwr "
        "run on the edge SuperLink failed: no connection; its log: logs/region-0.log; the "
        "rounds recorded so far stay in the run folder")
    log = (tmp_path / "work" / "logs" / "region-0.log").read_text().splitlines()
    assert sum(line.startswith("region 0: error") for line in log) == MAX_RESTARTS + 1


def _running(deployment: EdgeTierDeployment, index: int):
    """A stand-in for server ``index``'s process that keeps running (not restarted; stopped
    with the deployment)."""
    return deployment.procs.start(f"stand-in-{index}", ["sleep", "600"], dict(os.environ),
                                  deployment.log(f"stand-in-{index}"), deployment.work)


@pytest.mark.parametrize(("periods", "level", "seconds"), [
    ((1, 1, 2), 2, 45 * 0.8 / 2), ((1, 1, 2), 1, 45 * 0.8 / 2 * 0.8),
    ((2, 2), 1, 45 * 0.8), ((1, 4), 1, 45 * 0.8 / 4), ((2, 4, 8), 1, 45 * 0.8 / 2 * 0.8 / 2)])
def test_every_server_answers_before_its_parent_stops_waiting(periods, level, seconds):
    """A server's wait per exchange with its children times the exchanges of its job is
    CHILD_SHARE of its parent's wait (the cloud's: the round timeout), at every level."""
    assert nested_timeout(45, periods, level) == pytest.approx(seconds, rel=1e-12)
