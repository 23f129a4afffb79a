"""The in-process wire-byte meter (fedhier/engines/deployment/wiretap) and its reader (wire.py).

Each test starts a small ``python -c`` client with :func:`wire_env` against TCP servers run
here (threads on 127.0.0.1), so the byte counts are known exactly: the server reads all the
client sends, then replies, then waits for the client to close.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedhier.engines.deployment import wire
from fedhier.engines.deployment.certs import generate_certificates
from fedhier.engines.deployment.wire import WIRETAP_DIR, read_wire, wire_env
from fedhier.engines.deployment.wiretap import sitecustomize as meter

K, M = 1_000_000, 300_000  # bytes the client sends / receives per connection

#: The client's helpers; each test appends what its process does.
CLIENT = """
import os, signal, socket, ssl, sys, time

def exchange(port, k, m, ca=None, wrap_first=False):
    if ca and wrap_first:
        ctx = ssl.create_default_context(cafile=ca)
        s = ctx.wrap_socket(socket.socket(), server_hostname="localhost")
        s.connect(("127.0.0.1", port))
    else:
        s = socket.create_connection(("127.0.0.1", port))
        if ca:
            ctx = ssl.create_default_context(cafile=ca)
            s = ctx.wrap_socket(s, server_hostname="localhost")
    s.sendall(b"x" * k)
    got = 0
    while got < m:
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit("server closed early")
        got += len(chunk)
    return s
"""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        sock = self.request
        if server.tls is not None:
            sock = server.tls.wrap_socket(sock, server_side=True)
        got = 0
        while got < server.expect:
            chunk = sock.recv(65536)
            if not chunk:
                return
            got += len(chunk)
        sock.sendall(b"r" * server.reply)
        try:
            while sock.recv(65536):  # until the client closes
                pass
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self, expect: int, reply: int, tls: ssl.SSLContext | None = None) -> None:
        self.expect, self.reply, self.tls = expect, reply, tls
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def _serve(expect: int = K, reply: int = M, tls: ssl.SSLContext | None = None) -> _Server:
    import threading

    server = _Server(expect, reply, tls)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return server


@pytest.fixture
def servers() -> Iterator[list[_Server]]:
    started: list[_Server] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _client(code: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLIENT + code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(code: str, env: dict[str, str]) -> None:
    proc = _client(code, env)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_wire_env_prepends_the_meter_and_sets_the_link(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "PYTHONPATH": f"/a{os.pathsep}/b"}
    env = wire_env(base, tmp_path / "wire" / "x", "client-edge", 9510)
    assert base == {"PATH": "/bin", "PYTHONPATH": f"/a{os.pathsep}/b"}  # not modified
    assert env["PYTHONPATH"] == os.pathsep.join([str(WIRETAP_DIR), "/a", "/b"])
    assert env["FEDHIER_WIRE_DIR"] == str((tmp_path / "wire" / "x").absolute())
    assert env["FEDHIER_WIRE_LINK"] == "client-edge" and env["FEDHIER_WIRE_PORT"] == "9510"
    assert (tmp_path / "wire" / "x").is_dir()
    again = wire_env(env, tmp_path / "wire" / "x", "edge-cloud", 9500)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]  # the meter only once
    assert (WIRETAP_DIR / "sitecustomize.py").is_file()
    # the meter reads the names wire.py sets
    assert (meter.DIR_ENV, meter.LINK_ENV, meter.PORT_ENV) == (
        wire.WIRE_DIR_ENV, wire.WIRE_LINK_ENV, wire.WIRE_PORT_ENV)
    with pytest.raises(ValueError):
        wire_env(base, tmp_path, "", 9500)
    with pytest.raises(ValueError):
        wire_env(base, tmp_path, "x", 0)


def test_counts_exactly_the_bytes_to_the_watched_port(tmp_path: Path, servers: list) -> None:
    watched, other = _serve(), _serve(expect=5000, reply=700)
    servers += [watched, other]
    env = wire_env(os.environ, tmp_path, "client-edge", watched.port)
    _run(f"exchange({watched.port}, {K}, {M}).close()\n"
         f"exchange({other.port}, 5000, 700).close()\n", env)
    files = list(tmp_path.iterdir())
    record = json.loads(files[0].read_text())
    assert files == [tmp_path / f"client-edge-{record['pid']}.json"]  # no temporary left
    assert record["argv0"] == "-c" and record["link"] == "client-edge"
    assert read_wire(tmp_path) == {"client-edge": {"sent": K, "received": M, "connections": 1,
                                                   "processes": 1}}
    # a process that only talks to other ports (a SuperNode's ClientApp) writes nothing
    _run(f"exchange({other.port}, 5000, 700).close()\n", wire_env(os.environ, tmp_path / "o",
                                                                   "client-edge", watched.port))
    assert read_wire(tmp_path / "o") == {}
    # nor does a connection to the watched port that never comes through
    closed = _serve()
    closed.server_close()
    _run(f"try:\n    socket.create_connection(('127.0.0.1', {closed.port}))\n"
         "except ConnectionRefusedError:\n    pass\n",
         wire_env(os.environ, tmp_path / "r", "client-edge", closed.port))
    assert read_wire(tmp_path / "r") == {}


def test_connections_add_up_and_processes_are_counted(tmp_path: Path, servers: list) -> None:
    watched = _serve()
    servers.append(watched)
    env = wire_env(os.environ, tmp_path, "edge-cloud", watched.port)
    # two connections, one kept open until exit (written at exit, not at close)
    _run(f"exchange({watched.port}, {K}, {M}).close()\n"
         f"keep = exchange({watched.port}, {K}, {M})\n", env)
    _run(f"exchange({watched.port}, {K}, {M}).close()\n", env)
    assert read_wire(tmp_path) == {"edge-cloud": {"sent": 3 * K, "received": 3 * M,
                                                  "connections": 3, "processes": 2}}


def test_forked_child_does_not_count_the_parents_connection(tmp_path: Path,
                                                            servers: list) -> None:
    watched = _serve()
    servers.append(watched)
    env = wire_env(os.environ, tmp_path, "client-edge", watched.port)
    _run(f"s = exchange({watched.port}, {K}, {M})\n"
         "pid = os.fork()\n"
         "if pid == 0:\n"
         "    s.close()\n"
         "    sys.exit(0)\n"
         "os.waitpid(pid, 0)\n"
         "s.close()\n", env)
    assert read_wire(tmp_path) == {"client-edge": {"sent": K, "received": M, "connections": 1,
                                                   "processes": 1}}


@pytest.mark.parametrize("own_handler", [False, True], ids=["default", "flower-like"])
def test_sigterm_while_idle_leaves_the_bytes_on_file(tmp_path: Path, servers: list,
                                                     own_handler: bool) -> None:
    """Killed while idle with the connection open, before the writer thread's first tick
    (an hour): the SIGTERM handler (default disposition) or atexit (a handler that calls
    sys.exit, as Flower's do) writes the file; the process still ends as it would have."""
    watched = _serve()
    servers.append(watched)
    env = wire_env(os.environ, tmp_path, "client-edge", watched.port)
    env["FEDHIER_WIRE_INTERVAL"] = "3600"
    handler = "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n" if own_handler else ""
    proc = _client(f"{handler}s = exchange({watched.port}, {K}, {M})\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(60)\n", env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert read_wire(tmp_path) == {}  # nothing written yet
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == (3 if own_handler else -signal.SIGTERM)
    assert read_wire(tmp_path) == {"client-edge": {"sent": K, "received": M, "connections": 1,
                                                   "processes": 1}}


def test_writer_thread_reports_an_open_connection(tmp_path: Path, servers: list) -> None:
    watched = _serve()
    servers.append(watched)
    env = wire_env(os.environ, tmp_path, "client-edge", watched.port)
    proc = _client(f"s = exchange({watched.port}, {K}, {M})\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(60)\n", env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        import time

        deadline = time.monotonic() + 10
        while not read_wire(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_wire(tmp_path)["client-edge"]["sent"] == K
    finally:
        proc.kill()
        proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGKILL
    assert read_wire(tmp_path)["client-edge"]["received"] == M


@pytest.mark.parametrize("wrap_first", [False, True], ids=["wrap-after-connect",
                                                           "wrap-then-connect"])
def test_tls_counts_the_records(tmp_path: Path, servers: list, wrap_first: bool) -> None:
    certs = generate_certificates(tmp_path / "certs", 0)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(certs.server_cert, certs.server_key)
    watched = _serve(tls=tls)
    servers.append(watched)
    env = wire_env(os.environ, tmp_path / "wire", "client-edge", watched.port)
    _run(f"exchange({watched.port}, {K}, {M}, ca={str(certs.ca_cert)!r}, "
         f"wrap_first={wrap_first}).close()\n", env)
    totals = read_wire(tmp_path / "wire")["client-edge"]
    assert totals["connections"] == 1 and totals["processes"] == 1
    assert K < totals["sent"] <= 1.1 * K, totals
    assert M < totals["received"] <= 1.1 * M, totals


def test_without_the_wire_dir_the_meter_stays_off(tmp_path: Path) -> None:
    env = wire_env(os.environ, tmp_path, "client-edge", 9)
    del env["FEDHIER_WIRE_DIR"]
    out = subprocess.run([sys.executable, "-c", "import socket, sys; "
                          "print(hasattr(socket.socket, '_fedhier_wiretap'), "
                          "sys.modules['sitecustomize'].__file__)"],
                         env=env, capture_output=True, text=True, timeout=30, check=True)
    flag, path = out.stdout.split()
    assert flag == "False" and Path(path) == WIRETAP_DIR / "sitecustomize.py"


def test_a_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        f"import sys; open({str(tmp_path / 'ran')!r}, 'w').write(__name__ + ' ' + "
        "sys.modules['sitecustomize'].__file__)\n")
    env = wire_env({**os.environ, "PYTHONPATH": str(other)}, tmp_path / "wire", "x", 9)
    subprocess.run([sys.executable, "-c", "pass"], env=env, timeout=30, check=True)
    name, loaded = (tmp_path / "ran").read_text().split()
    assert name == "sitecustomize" and Path(loaded) == WIRETAP_DIR / "sitecustomize.py"


def test_read_wire_skips_partial_and_foreign_files(tmp_path: Path) -> None:
    assert read_wire(tmp_path / "missing") == {}
    good = {"link": "client-edge", "pid": 1, "argv0": "x", "sent": 10, "received": 4,
            "connections": 2}
    (tmp_path / "client-edge-1.json").write_text(json.dumps(good))
    (tmp_path / "client-edge-2.json").write_text(json.dumps({**good, "pid": 2})[:30])
    (tmp_path / "client-edge-3.json").write_text(json.dumps([1, 2]))
    (tmp_path / "client-edge-4.json").write_text(json.dumps({**good, "sent": "10"}))
    (tmp_path / "client-edge-5.json").write_text(json.dumps({**good, "connections": True}))
    (tmp_path / "edge-cloud-6.json").write_text(json.dumps({**good, "link": "edge-cloud"}))
    (tmp_path / ".client-edge-7.json.1.tmp").write_text(json.dumps(good))
    assert read_wire(tmp_path) == {
        "client-edge": {"sent": 10, "received": 4, "connections": 2, "processes": 1},
        "edge-cloud": {"sent": 10, "received": 4, "connections": 2, "processes": 1}}
