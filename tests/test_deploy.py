"""Flower's Deployment Engine (`fedhier deploy local`), TLS, SuperNode authentication, a
killed SuperNode, and the Simulation Engine joining an existing Ray cluster.

Every process binds and connects to 127.0.0.1 only. Each slow test starts and stops its own
federation and checks that nothing it started is left running.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from fedhier.common.errors import ConfigError
from fedhier.engines import deployment as deploy
from fedhier.engines.deployment.certs import (
    Certificates,
    generate_certificates,
    make_supernode_key,
)
from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_same_run, interruptible, metrics
from tests.waits import wait_for

ROOT = Path(__file__).resolve().parents[1]
# Small enough for a 2-core machine: every message starts a fresh ClientApp process.
TINY = RunConfig(dataset="digits", clients=3, groups=2, local_period=2, global_period=4,
                 rounds=1, batch_size=8, seed=11)
TINY_FLAGS = ["--groups", "2", "--local-period", "2", "--global-period", "4", "--rounds", "1",
              "--batch-size", "8", "--seed", "11"]


# ---------------------------------------------------------------------------- helpers
def leftovers(ports: range) -> str:
    """Processes whose command line names one of ``ports`` on 127.0.0.1 (ours)."""
    alternatives = "|".join(str(p) for p in ports)
    pattern = rf"(127\.0\.0\.1:|--port )({alternatives})( |$)"
    proc = subprocess.run(["pgrep", "-af", "--", pattern], capture_output=True, text=True)
    return proc.stdout.strip()


def wait_exit(managed: deploy.Managed, timeout: float = 90) -> int:
    try:
        return managed.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{managed.name} still running after {timeout} s:\n{managed.log_tail()}")


# ---------------------------------------------------------------------------- fast tests
def test_generated_certificates_form_a_chain_for_loopback(tmp_path):
    certs = generate_certificates(tmp_path / "certs", num_supernodes=2)
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for key_path in (*certs.supernode_keys, certs.server_key, certs.ca_key):
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600, key_path
    key = load_ssh_private_key(certs.supernode_keys[0].read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert Path(f"{certs.supernode_keys[0]}.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    again = Certificates.from_folder(tmp_path / "certs", num_supernodes=2)
    assert again.supernode_keys == certs.supernode_keys
    assert Certificates.from_folder(tmp_path / "certs", num_supernodes=3).supernode_keys == ()
    (tmp_path / "certs" / "server.key").unlink()
    with pytest.raises(ConfigError, match="server.key"):
        Certificates.from_folder(tmp_path / "certs")


def test_run_config_overrides_reach_the_app():
    overrides = deploy.run_config_overrides(TINY, ROOT)
    declared = deploy.app_config_keys(ROOT)
    assert overrides.keys() <= declared.keys()
    assert overrides["groups"] == 2 and overrides["local-period"] == 2
    assert "engine" not in overrides
    toml = deploy.write_run_config(Path(tempfile.mkdtemp()) / "rc.toml",
                                   {**overrides, "out": "/tmp/a b'\"c"})
    import tomllib

    assert tomllib.loads(toml.read_text())["out"] == "/tmp/a b'\"c"
    undeclared = [k for k in RunConfig().to_run_config() if k not in declared
                  and k not in deploy.NOT_PASSED and k != "periods"]
    if "cloud-strategy" in undeclared:  # a non-default value cannot reach the ServerApp
        with pytest.raises(ConfigError, match="cloud-strategy"):
            deploy.run_config_overrides(TINY.replace(cloud_strategy="fedavgm"), ROOT)


def test_contiguous_edges_match_the_contiguous_grouping():
    assert deploy.contiguous_edges(5, 2) == [0, 0, 0, 1, 1]
    assert deploy.contiguous_edges(4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "3", "--clients", "4"], "contradicts --nodes"),
    ([], "--nodes N is required"),
    (["--nodes", "4", "--edges", "2", "--groups", "2", "--app", "/"], "drop --app"),
    (["--nodes", "4", "--edges", "5"], "--edges must be between 1 and --nodes 4"),
    (["--nodes", "4", "--edges", "2", "--groups", "3"], "contradicts --edges 2"),
    (["--resume", "/nonexistent/run"], "its own configuration; drop --out"),
    (["--resume", "/nonexistent/run", "--rounds", "3"], "drop --rounds"),
    (["--nodes", "2", "--insecure", "--certs", "."], "contradict"),
    (["--nodes", "2", "--certs", "/nonexistent/certs"], "no such folder"),
    (["--nodes", "2", "--base-port", "65535"], "65535"),
    (["--nodes", "2", "--groups", "3"], "more groups"),
    (["--nodes", "2", "--timeout", "0"], "--timeout"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    groups = [] if "--groups" in argv or "--resume" in argv else ["--groups", "1"]
    code = deploy.main(["local", *argv, *groups, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("fedhier: error:") and len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []  # nothing staged, nothing started


def test_busy_port_and_non_empty_run_folder_are_refused(capsys, tmp_path):
    import socket

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    assert deploy.main(["local", "--nodes", "1", "--groups", "1",
                        "--out", str(tmp_path / "used")]) == 2
    assert "not empty" in capsys.readouterr().err
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code = deploy.main(["local", "--nodes", "1", "--groups", "1", "--base-port", str(port),
                            "--out", str(tmp_path / "run")])
    assert code == 2 and "in use" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used"]


def test_process_group_stops_detached_descendants(tmp_path):
    group = deploy.ProcessGroup()
    # A child in its own session that outlives its parent, like Flower's SuperExec.
    script = "setsid sleep 300 & sleep 300"
    managed = group.start("superlink", ["bash", "-c", script], os.environ, tmp_path / "l.log",
                          tmp_path)
    deadline = time.time() + 10
    while len(group.snapshot()) < 3 and time.time() < deadline:
        time.sleep(0.05)
    tree = dict(group.seen)
    assert len(tree) >= 3
    assert group.stop_all(grace=2) == []
    assert deploy.alive(tree) == []
    assert managed.popen.returncode is not None


# ---------------------------------------------------------------------------- slow tests
@pytest.mark.slow
def test_tls_deployment_matches_inprocess(tmp_path, capsys, monkeypatch):
    """`fedhier deploy local` with TLS and SuperNode authentication = inprocess (1e-5).

    The SuperNodes are tagged edge=0,0,1 and the deployed ServerApp groups them by those tags
    (--grouping edge-tag): the same groups as the contiguous grouping in process.

    Client 1's long-lived ClientApp process (fedhier's own app) is killed before the run:
    the command starts it again at its first look (one line says so), its SuperNode kept
    the client's messages, and the run still equals inprocess. Without the restart the run
    would wait for answers that never come (here: the 600 s timeout)."""
    run_app = deploy.LocalDeployment.run_app
    killed: list = []

    def kill_a_runtime_first(fed, *args, **kwargs):
        killed.append(fed.runtimes[1])
        os.killpg(killed[0].pid, signal.SIGKILL)
        killed[0].popen.wait(timeout=30)
        return run_app(fed, *args, **kwargs)

    monkeypatch.setattr(deploy.LocalDeployment, "run_app", kill_a_runtime_first)
    cfg = TINY.replace(grouping="contiguous")
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    port = deploy.free_port_block(TINY.clients + 1)
    out = tmp_path / "deployed"
    t0 = time.time()
    code = deploy.main(["local", "--nodes", str(TINY.clients), *TINY_FLAGS,
                        "--grouping", "edge-tag", "--base-port", str(port),
                        "--out", str(out), "--timeout", "600"])
    elapsed = time.time() - t0
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    assert "TLS + SuperNode authentication" in printed.out
    assert "round 1/1" in printed.out
    assert killed and ("the ClientApp process of client 1 stopped (exit code -9); restarting "
                       "it") in printed.out
    restarted = out / "deploy" / "logs" / "clientapp-1.log"  # every start's output in it
    assert restarted.read_text().split("\n$ ")[-1].count("client 1: answered train") >= 1
    # the deployment also measured its wire bytes (tests/test_deploy_edges.py checks them)
    assert_same_run(tmp_path / "inprocess", out, TINY.rounds,
                    ignore=frozenset({"wire_client_cloud_bytes"}))
    assert metrics(out)[-1]["wire_client_cloud_bytes"] > 0
    logs = out / "deploy" / "logs"
    superlink_log = (logs / "superlink.log").read_text()
    assert "Uvicorn running on https://127.0.0.1" in superlink_log
    assert "SuperNode authentication is disabled" not in superlink_log
    assert superlink_log.count("[Fleet.ActivateNode] Activated") == TINY.clients
    assert (out / "deploy" / "run_config.toml").is_file()
    for i, edge in enumerate([0, 0, 1]):  # the command line heads each process log
        assert f"partition-id={i} num-partitions=3 edge={edge}" in (
            logs / f"supernode-{i}.log").read_text().splitlines()[0]
    groups = json.loads((out / "groups.json").read_text())["client_to_edge"]
    assert groups == deploy.contiguous_edges(TINY.clients, 2) == [0, 0, 1]
    assert leftovers(range(port, port + TINY.clients + 1)) == ""
    print(f"TLS deployment of {TINY.clients} SuperNodes: {elapsed:.1f} s")


@pytest.mark.slow
def test_wrong_certificate_or_unregistered_key_is_refused(tmp_path):
    """Only a SuperNode that trusts the right CA and has a registered key gets in."""
    port = deploy.free_port_block(2)
    mine = generate_certificates(tmp_path / "my-certs", num_supernodes=1)  # as with --certs
    other = generate_certificates(tmp_path / "other-ca", num_supernodes=0)
    rogue_key, _ = make_supernode_key(tmp_path / "rogue")
    fed = deploy.LocalDeployment(nodes=1, work=tmp_path / "fed", base_port=port,
                                 certs_dir=mine.folder, echo=lambda _: None)
    try:
        keys = fed._prepare_security()
        assert keys == [mine.supernode_keys[0].resolve()]
        fed.start_superlink()
        fed.write_cli_config()
        fed.register_supernodes([Path(f"{keys[0]}.pub")])
        retries = ["--max-retries", "2"]
        wrong_ca = fed.start_supernode(0, keys[0], root_certificates=other.ca_cert,
                                       name="rogue-wrong-ca", track=False, extra_args=retries)
        plain = fed.start_supernode(0, name="rogue-no-tls", insecure=True, track=False,
                                    extra_args=retries)
        unregistered = fed.start_supernode(0, rogue_key, name="rogue-unregistered-key",
                                           track=False, extra_args=retries)
        fed.start_supernode(0, keys[0])  # the legitimate one
        fed.wait_supernodes_online()
        for rogue in (wrong_ca, plain, unregistered):
            assert wait_exit(rogue) != 0, rogue.log_tail()
            assert "SuperNode ID:" not in rogue.log_text(), rogue.name
        assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca.log_text()
        assert "Failed to activate SuperNode" in unregistered.log_text()
        superlink_log = fed.superlink.log_text() if fed.superlink else ""
        assert "No SuperNode found with the given public key" in superlink_log
        assert superlink_log.count("[Fleet.ActivateNode] Activated") == 1
    finally:
        assert fed.stop() == []
    assert leftovers(range(port, port + 2)) == ""


@pytest.mark.slow
def test_killed_supernode_is_left_out_and_the_run_completes(tmp_path):
    """SIGKILL a SuperNode while it trains: the SuperLink answers for it with an error
    reply once its heartbeat lapses, HierFedAvg leaves it out, the run completes."""
    # One edge of two clients; client 1 dies: the edge averages client 0 alone (weights
    # renormalised over the survivor).
    cfg = TINY.replace(clients=2, groups=(1,), grouping="contiguous")
    port = deploy.free_port_block(cfg.clients + 1)
    killed: dict[str, float] = {}

    def kill_when_training(fed: deploy.LocalDeployment) -> None:
        victim = fed.supernodes[1]
        if not killed and "Receiving: train message" in victim.log_text():
            os.killpg(victim.pid, signal.SIGKILL)  # the SuperNode, its SuperExec, ClientApp
            killed["at"] = time.time()

    out = tmp_path / "run"
    with deploy.LocalDeployment(nodes=cfg.clients, work=tmp_path / "fed", base_port=port,
                                secure=False, echo=lambda _: None,
                                edges=deploy.contiguous_edges(cfg.clients, 1)) as fed:
        summary = fed.run_app(cfg, out, timeout=600, on_tick=kill_when_training)
        run_log = (fed.work / "logs" / "flwr-run.log").read_text()
    assert killed, "the SuperNode was never seen training"
    rows = metrics(out)
    assert [r["round"] for r in rows] == [0, 1]
    assert rows[1]["failed_clients"] >= 1  # left out of the edge and cloud averages
    assert math.isfinite(rows[1]["test_accuracy"]) and math.isfinite(rows[1]["train_loss"])
    assert summary["rounds"] == 1
    assert "Node Unavailable" in run_log
    assert json.loads((out / "groups.json").read_text())["client_to_edge"] == [0, 0]
    print(f"killed SuperNode: run finished {time.time() - killed['at']:.1f} s after the kill")
    assert leftovers(range(port, port + cfg.clients + 1)) == ""


def test_no_task_heartbeat_outlives_the_task_token(monkeypatch):
    """The ClientApp runtime stops a task's heartbeat before it pushes the task's output
    (which ends the task's token): a heartbeat after it is refused with HTTP 401, and
    Flower's HTTP retry answers that with SIGINT to the runtime, which then served no later
    task (CI hung so: a client's evaluate waited for a runtime that had exited)."""
    from fedhier.engines.deployment import task_runtime

    events: list[str] = []

    class NoMoreTasksError(Exception):
        pass

    class Heartbeat:
        def __init__(self, fn):
            self.running = False

        def start(self):
            self.running = True
            events.append("heartbeat on")

        @property
        def is_running(self):
            return self.running

        def stop(self):
            assert self.running
            self.running = False
            events.append("heartbeat off")

    tasks = iter([("task", "token")])

    def acquire(*_args):
        try:
            return next(tasks)
        except StopIteration:
            raise NoMoreTasksError from None

    msg = SimpleNamespace(metadata=SimpleNamespace(message_id="m", message_type="train"),
                          content=SimpleNamespace(config_records={}))
    monkeypatch.setattr(task_runtime, "acquire", acquire)
    monkeypatch.setattr(task_runtime, "runtime_client", lambda *a, **k: object())
    monkeypatch.setattr(task_runtime, "HeartbeatSender", Heartbeat)
    monkeypatch.setattr(task_runtime, "pull_task_input", lambda c: (msg, "ctx", None, None))
    monkeypatch.setattr(task_runtime, "push_message", lambda *a: events.append("reply"))
    monkeypatch.setattr(task_runtime, "push_task_output",
                        lambda *a: events.append("task output (token ends)"))
    with pytest.raises(NoMoreTasksError):
        task_runtime.serve_tasks("127.0.0.1:1", None, lambda m, c: "reply", "client 0")
    assert events == ["heartbeat on", "reply", "heartbeat off", "task output (token ends)"]


@pytest.mark.slow
def test_simulation_engine_joins_an_existing_ray_cluster(tmp_path):
    """`ray start --head` on 127.0.0.1, then `flwr run .` attaches through RAY_ADDRESS."""
    ports = deploy.free_port_block(2, start=30000)
    temp_dir = Path(tempfile.mkdtemp(prefix="fhray", dir="/tmp"))  # short: socket paths
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray on loopback
           "RAY_DISABLE_USAGE_STATS": "1"}
    group = deploy.ProcessGroup()
    ray = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
           "--node-ip-address", "127.0.0.1", "--port", str(ports),
           "--ray-client-server-port", str(ports + 1), "--num-cpus", "2",
           "--include-dashboard", "false", "--temp-dir", str(temp_dir)]
    head = group.start("ray-head", ray, env, tmp_path / "ray.log", tmp_path)
    try:
        wait_for(lambda: "Ray runtime started" in head.log_text(), what="the Ray head",
                 progress=lambda: len(head.log_text()),
                 alive=lambda: head.popen.poll() is None, detail=head.log_tail)
        run_inprocess(TINY, RunFolder.create(tmp_path / "inprocess"), progress=False)
        out = tmp_path / "flwr"
        overrides = ("groups=2 local-period=2 global-period=4 rounds=1 batch-size=8 seed=11 "
                     f"out='{out}'")
        run_env = {**env, "RAY_ADDRESS": f"127.0.0.1:{ports}",
                   "FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_DISABLE_UPDATE_CHECK": "1"}
        run = group.start("flwr-run", [str(ROOT / "scripts" / "flwr_run_local.sh"),
                                       str(TINY.clients), overrides],
                          run_env, tmp_path / "flwr-run.log", ROOT)
        actors_in_cluster = False

        def progress() -> tuple[int, tuple[int, ...]]:
            """The run's log and the cluster's processes (ClientApp actors noted)."""
            nonlocal actors_in_cluster
            group.snapshot()  # the detached local SuperLink that `flwr run` starts
            tree = deploy.process_tree([head.pid])
            for pid in tree:
                try:
                    name = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                actors_in_cluster |= b"ClientAppActor" in name
            return len(run.log_text()), tuple(sorted(tree))

        wait_for(lambda: run.popen.poll() is not None, what="flwr run on the cluster",
                 progress=progress, detail=run.log_tail)
        assert run.popen.returncode == 0, run.log_tail(30)
        assert actors_in_cluster, "the ClientApp actors did not run in the existing cluster"
        assert_same_run(tmp_path / "inprocess", out, TINY.rounds)
    finally:
        assert group.stop_all() == []  # `ray stop` would also stop other users' Ray
    left = subprocess.run(["pgrep", "-af", str(temp_dir)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path):
    """SIGINT (Ctrl-C) while the run is submitted: exit 130, nothing left running."""
    port = deploy.free_port_block(2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fedhier.engines.deployment", "local", "--nodes", "1",
           "--groups", "1", "--insecure", "--base-port", str(port), "--out", str(out),
           *TINY_FLAGS[2:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, preexec_fn=interruptible)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until the app is submitted
        lines.append(line)
        if line.startswith("flwr run"):
            break
    assert leftovers(range(port, port + 2)) != ""  # the federation is up
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest + err
    assert "interrupted" in err and "stopped all" in rest
    assert leftovers(range(port, port + 2)) == ""
    assert (out / "deploy" / "logs" / "superlink.log").is_file()
