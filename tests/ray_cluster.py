"""A two-node Ray cluster on 127.0.0.1 for the tests of engine ``vectorized-ray``
(tests/test_vectorized_ray.py, tests/test_vectorized_ray_moves.py): the ``ray_cluster``
fixture, registered in tests/conftest.py so that every module shares one cluster per session
(its start and stop take about 15 s on the 2-core CI machine) and connects to it for the
module's own tests only."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.waits import wait_for

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ray_node(*args: str, env: dict[str, str]) -> subprocess.Popen:
    """A ``ray start --block`` node in its own process group (stopped with the group)."""
    return subprocess.Popen([str(RAY), "start", "--block", "--num-cpus", "1",
                             "--disable-usage-stats", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop(nodes: list[subprocess.Popen], temp_dir: str) -> None:
    """Stop the nodes started here (their process groups), then any process still running
    from this cluster's private temp dir (by pid): never another cluster's."""
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
    for node in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(timeout=20)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if temp_dir.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def _wait_for_port(port: int, head: subprocess.Popen) -> None:
    """Until the head's GCS accepts connections on ``port`` (fails at once if the head
    exits; tests/waits.py)."""
    def accepts() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_for(accepts, what="the Ray head", alive=lambda: head.poll() is None, poll=0.2)


@pytest.fixture(scope="session")
def ray_cluster_nodes():
    """The address of a two-node Ray cluster on 127.0.0.1 (1 CPU each, a private temp dir),
    started once for the test session (each pytest-xdist worker: its own)."""
    pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="fhray-", dir="/tmp")  # short: Ray's socket paths
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    nodes = [_ray_node("--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                       "--include-dashboard=false", f"--temp-dir={temp_dir}", env=env)]
    try:
        _wait_for_port(port, nodes[0])
        nodes.append(_ray_node(f"--address={address}", "--node-ip-address=127.0.0.1",
                               env=env))
        yield address, nodes
    finally:
        _stop(nodes, temp_dir)


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster_nodes):
    """The session's cluster, this process connected to it for one test module: its runs
    share their workers (started once per module), and at the module's end the connection
    (and the workers it owns) goes, so a later module's Flower Simulation Engine
    (``ray.init``) starts a Ray of its own instead of waiting for ever for the CPUs those
    workers held."""
    ray = pytest.importorskip("ray")
    address, nodes = ray_cluster_nodes
    if ray.is_initialized():  # a module's own Ray (a local run) left open: not ours to share
        ray.shutdown()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) >= 2,
                 what="the second Ray node", alive=lambda: nodes[1].poll() is None)
        yield address
    finally:
        ray.shutdown()
        from fedhier.engines.vectorized_ray.worker import _POOL

        _POOL.clear()  # the workers went with the connection
