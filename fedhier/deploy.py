"""``fedhier deploy local``: the hierarchical app on Flower's Deployment Engine, on one machine.

Starts a SuperLink and N SuperNodes on 127.0.0.1 (SuperNode i gets
``--node-config "partition-id=i num-partitions=N"`` and its own Runtime API port), submits the
app with ``flwr run <app> <connection>``, prints one line per cloud round while the ServerApp
writes the usual run folder, and stops every process it started (by process group, also on
error, timeout or Ctrl-C). fedhier writes no networking of its own: all traffic is Flower's.

Secure by default: TLS between SuperNodes and SuperLink with a generated test CA (or your
certificates, ``--certs DIR``) and Flower's SuperNode authentication (each SuperNode's public
key is registered with ``flwr supernode register`` before it connects). ``--insecure`` turns
both off and must be asked for. See docs/deployment.md.

Layout of the run folder ``out``: the ServerApp's files (config.json, metrics.jsonl, ...) and
``deploy/`` with this command's material: ``flwr-home/<process>`` (each process's FLWR_HOME),
``certs/``, ``logs/`` (one log per process) and ``run_config.toml``. The ServerApp refuses a
non-empty run folder, so ``deploy/`` is staged beside ``out`` during the run and moved in at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedhier.config import RunConfig
from fedhier.errors import ConfigError, FedhierError

HOST = "127.0.0.1"  # loopback only: this command never listens on another address
DEFAULT_BASE_PORT = 9300
CONNECTION = "fedhier-local"
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Environment of every process started here: no telemetry, no update check (no network),
#: no runtime dependency installation (uv would pull a CUDA torch).
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}
#: RunConfig fields that never go to the ServerApp (it sets ``engine`` itself).
NOT_PASSED = ("engine",)


class DeployError(RuntimeError):
    """The federation could not be started or the run failed (not a bad-input error)."""


class DeployTimeoutError(DeployError):
    """The run did not finish within ``--timeout`` seconds."""


# ---------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[int, int, str, str] | None:
    """(ppid, pgid, state, start time) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return int(rest[1]), int(rest[2]), rest[0], rest[19]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
    return children


def process_tree(roots: Sequence[int]) -> dict[int, str]:
    """Every live process under ``roots`` (included), as pid -> start time."""
    children = _children_map()
    found: dict[int, str] = {}
    stack = list(roots)
    while stack:
        pid = stack.pop()
        stat = _proc_stat(pid)
        if pid in found or stat is None:
            continue
        found[pid] = stat[3]
        stack.extend(children.get(pid, []))
    return found


def alive(processes: Mapping[int, str]) -> list[int]:
    """The pids of ``processes`` still running (same start time, not a zombie)."""
    out = []
    for pid, start in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[3] == start and stat[2] != "Z":
            out.append(pid)
    return out


@dataclass
class Managed:
    """One process started here, in its own session (process group = its pid)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class ProcessGroup:
    """Starts processes in new sessions and stops all of them, and their descendants.

    Flower's SuperLink starts a detached SuperExec (its own session) that starts the
    ServerApp; SuperNodes start a SuperExec and ClientApp processes. ``stop_all`` snapshots
    the whole tree first (children are re-parented once their parent dies), sends SIGTERM
    to every process group in it, waits, then SIGKILLs whatever is left.
    """

    def __init__(self) -> None:
        self.started: list[Managed] = []
        self.seen: dict[int, str] = {}  # every pid of the trees, as last snapshotted
        self._handles: list[IO[bytes]] = []

    def start(self, name: str, cmd: Sequence[str], env: Mapping[str, str], log: Path,
              cwd: Path) -> Managed:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(log, "ab")  # noqa: SIM115 - closed in stop_all
        handle.write(f"$ {shlex.join(cmd)}\n".encode())  # the log says what ran
        handle.flush()
        self._handles.append(handle)
        popen = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=handle,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        managed = Managed(name, popen, log)
        self.started.append(managed)
        self.snapshot()
        return managed

    def snapshot(self) -> dict[int, str]:
        """Record every live descendant of the processes started here."""
        tree = process_tree([m.pid for m in self.started if m.popen.poll() is None])
        self.seen.update(tree)
        return tree

    def _signal(self, pids: Sequence[int], sig: int) -> None:
        groups = set()
        for pid in pids:
            stat = _proc_stat(pid)
            if stat is not None and stat[1] in self.seen:  # groups led by our processes only
                groups.add(stat[1])
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        for pgid in groups:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def stop(self, managed: Sequence[Managed], grace: float = 8.0) -> list[int]:
        """SIGTERM ``managed`` and their descendants; SIGKILL after ``grace`` s. Returns
        the pids still alive afterwards (normally none)."""
        tree = process_tree([m.pid for m in managed if m.popen.poll() is None])
        self.seen.update(tree)
        self._signal(list(tree), signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline:
            for m in managed:
                m.popen.poll()  # reap our direct children
            if not alive(tree):
                break
            time.sleep(0.1)
        left = alive(tree)
        if left:
            self._signal(left, signal.SIGKILL)
            time.sleep(0.5)
        for m in managed:
            with suppress(subprocess.TimeoutExpired):
                m.popen.wait(timeout=5)
        return alive(tree)

    def stop_all(self, grace: float = 8.0) -> list[int]:
        """Stop SuperNodes first, then the rest; returns pids left alive (should be [])."""
        self.snapshot()
        nodes = [m for m in self.started if m.name.startswith("supernode")]
        others = [m for m in self.started if not m.name.startswith("supernode")]
        self.stop(nodes, grace)
        self.stop(others, grace)
        left = alive(self.seen)
        if left:  # detached grandchildren seen in an earlier snapshot
            self._signal(left, signal.SIGKILL)
            time.sleep(0.5)
            left = alive(self.seen)
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        return left


# ---------------------------------------------------------------------------- helpers
def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(count: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port p >= start such that p .. p+count-1 are all free on 127.0.0.1."""
    port = start
    while port + count < stop:
        if all(port_is_free(p) for p in range(port, port + count)):
            return port
        port += count
    raise DeployError(f"no block of {count} free ports on {HOST}")


def check_ports(base_port: int, nodes: int) -> None:
    """ConfigError unless ``base_port .. base_port + nodes`` are valid and free."""
    last = base_port + nodes
    if base_port < 1024 or last > 65535:
        raise ConfigError(f"ports {base_port}..{last} must lie in 1024..65535; choose another "
                          "--base-port")
    busy = [p for p in range(base_port, last + 1) if not port_is_free(p)]
    if busy:
        raise ConfigError(f"port(s) {', '.join(map(str, busy[:5]))} on {HOST} in use; choose "
                          f"another --base-port (needs {nodes + 1} free ports from it)")


def contiguous_edges(nodes: int, groups: int) -> list[int]:
    """Edge of SuperNode i when nodes are cut into ``groups`` contiguous blocks (sizes
    differ by at most one, larger first): the same as ``--grouping contiguous``."""
    from fedhier.grouping.base import balanced_sizes

    sizes = balanced_sizes(nodes, groups)
    return [edge for edge, size in enumerate(sizes.tolist()) for _ in range(size)]


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def executable(name: str) -> str:
    """A Flower command from this Python's environment (then PATH)."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"'{name}' not found; install flwr[simulation]==1.42.0")
    return found


def app_config_keys(app: Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the Flower app at ``app`` (the keys flwr run accepts)."""
    pyproject = app / "pyproject.toml"
    try:
        data = tomllib.loads(pyproject.read_text())
        return dict(data["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        raise ConfigError(f"{app} is not a Flower app (no [tool.flwr.app.config] in "
                          f"{pyproject}); pass --app with the fedhier source tree") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def run_config_overrides(cfg: RunConfig, app: Path) -> dict[str, Any]:
    """The ``--run-config`` overrides for ``cfg``: every key the app declares.

    A non-default value for a RunConfig key the app does not declare cannot reach the
    ServerApp (Flower rejects unknown keys): that is a ConfigError.
    """
    declared = app_config_keys(app)
    defaults = RunConfig().to_run_config()
    overrides: dict[str, Any] = {}
    for key, value in cfg.to_run_config().items():
        if key in NOT_PASSED:
            continue
        if key == "periods" and len(cfg.periods) == 2:
            value = ""  # two-level: local-period / global-period say it all
        if key == "groups" and "," not in str(value):
            value = int(value)
        if key in declared:
            overrides[key] = value
        elif value != defaults[key] and not (key == "periods" and value == ""):
            raise ConfigError(
                f"--{key} cannot be passed to the Flower app: '{key}' is not declared in "
                f"[tool.flwr.app.config] of {app / 'pyproject.toml'}")
    return overrides


def write_run_config(path: Path, overrides: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in overrides.items()))
    return path


def connection_toml(name: str, port: int, root_certificates: Path | None) -> str:
    """A ``$FLWR_HOME/config.toml`` with one SuperLink connection (made the default)."""
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]",
             f'address = "{HOST}:{port}"']
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(str(root_certificates))}")
    return "\n".join(lines) + "\n"


def format_round(record: Mapping[str, Any], rounds: int) -> str:
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    return (f"round {record.get('round')}/{rounds}: test_acc {num('test_accuracy', '.4f')}  "
            f"test_loss {num('test_loss', '.4f')}  train_loss {num('train_loss', '.4f')}  "
            f"failed_clients {record.get('failed_clients', 0)}  "
            f"[{num('wall_seconds', '.1f')} s]")


# ---------------------------------------------------------------------------- deployment
@dataclass
class LocalDeployment:
    """A SuperLink and ``nodes`` SuperNodes on 127.0.0.1; use as a context manager.

    ``secure``: TLS with ``certs_dir`` (ca.crt, server.crt, server.key) or generated test
    certificates; ``supernode_auth``: Flower's SuperNode authentication (needs TLS).
    ``edges``: tag SuperNode i with ``--node-config edge=edges[i]`` (where it would sit).
    Ports: SuperLink ``base_port`` (Fleet, Control and Runtime HTTP API on one port since
    Flower 1.42), SuperNode i ``base_port + 1 + i`` (its Runtime API for ClientApps).
    """

    nodes: int
    work: Path
    base_port: int = DEFAULT_BASE_PORT
    secure: bool = True
    supernode_auth: bool = True
    certs_dir: Path | None = None
    app: Path = REPO_ROOT
    echo: Callable[[str], None] = print
    connect_timeout: float = 180.0
    edges: list[int] | None = None
    #: False: ``start`` does not wait for the SuperNodes; ``run_app`` submits the app first
    #: and waits for them while the ServerApp starts (the ServerApp waits for all N anyway).
    wait_online: bool = True
    _next_extra_port: int = 0
    _online: bool = False
    procs: ProcessGroup = field(default_factory=ProcessGroup)
    superlink: Managed | None = None
    supernodes: list[Managed] = field(default_factory=list)
    ca_cert: Path | None = None
    certs: Any = None  # fedhier.certs.Certificates in secure mode
    node_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be at least 1, got {self.nodes}")
        if not self.secure and (self.certs_dir is not None):
            raise ConfigError("--insecure and --certs contradict each other; give one")
        if self.supernode_auth and not self.secure:
            self.supernode_auth = False  # Flower requires TLS for SuperNode authentication
        check_ports(self.base_port, self.nodes)
        if self.edges is not None and len(self.edges) != self.nodes:
            raise ConfigError(f"{len(self.edges)} edge tags for {self.nodes} SuperNodes")
        self.work = Path(self.work).resolve()

    # -- paths and environment ---------------------------------------------------------------
    @property
    def superlink_port(self) -> int:
        return self.base_port

    def home(self, name: str) -> Path:
        path = self.work / "flwr-home" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, name: str) -> dict[str, str]:
        env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(self.home(name))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        return env

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Certificates, SuperLink, SuperNode registration, SuperNodes: all up or raise."""
        self.work.mkdir(parents=True, exist_ok=True)
        keys = self._prepare_security()
        self.start_superlink()
        self.write_cli_config()
        if self.supernode_auth:
            self.register_supernodes([k.with_name(k.name + ".pub") for k in keys])
        for i in range(self.nodes):
            self.start_supernode(i, keys[i] if self.supernode_auth else None)
        if self.wait_online:
            self.wait_supernodes_online()

    def stop(self) -> list[int]:
        """Stop every process started here; returns pids that survived (should be [])."""
        left = self.procs.stop_all()
        if left:
            self.echo(f"fedhier deploy: warning: processes {left} did not stop")
        return left

    # -- steps -------------------------------------------------------------------------------
    def _prepare_security(self) -> list[Path]:
        from fedhier.certs import Certificates, generate_certificates, make_supernode_key

        if not self.secure:
            return []
        if self.certs_dir is not None:
            certs = Certificates.from_folder(self.certs_dir, self.nodes)
        else:
            certs = generate_certificates(self.work / "certs",
                                          self.nodes if self.supernode_auth else 0)
        self.certs = certs
        self.ca_cert = certs.ca_cert.resolve()
        keys = list(certs.supernode_keys)
        if self.supernode_auth and len(keys) != self.nodes:  # your certs, our keys
            keys = [make_supernode_key(self.work / "keys" / f"supernode-{i}")[0]
                    for i in range(self.nodes)]
        return [k.resolve() for k in keys]

    def start_superlink(self) -> Managed:
        cmd = [executable("flower-superlink"), "--host", HOST, "--port",
               str(self.superlink_port), "--disable-runtime-dependency-installation"]
        if self.secure:
            certs = self.certs
            cmd += ["--ssl-certfile", str(certs.server_cert.resolve()),
                    "--ssl-keyfile", str(certs.server_key.resolve()),
                    "--ssl-ca-certfile", str(certs.ca_cert.resolve())]
            if self.supernode_auth:
                cmd.append("--enable-supernode-auth")
        else:
            cmd.append("--insecure")
        self.superlink = self.procs.start("superlink", cmd, self.env("superlink"),
                                          self.log("superlink"), self.work)
        deadline = time.time() + self.connect_timeout
        while not port_open(self.superlink_port):
            if self.superlink.popen.poll() is not None:
                raise DeployError("the SuperLink exited at start:\n"
                                  + self.superlink.log_tail())
            if time.time() > deadline:
                raise DeployError(f"the SuperLink did not listen on {HOST}:"
                                  f"{self.superlink_port} within {self.connect_timeout:.0f} s")
            time.sleep(0.2)
        mode = ("TLS + SuperNode authentication" if self.supernode_auth else
                "TLS" if self.secure else "INSECURE (no TLS)")
        self.echo(f"SuperLink on {HOST}:{self.superlink_port} [{mode}] "
                  f"(pid {self.superlink.pid})")
        return self.superlink

    def write_cli_config(self) -> Path:
        path = self.home("cli") / "config.toml"
        path.write_text(connection_toml(CONNECTION, self.superlink_port, self.ca_cert))
        return path

    def flwr_cli(self, args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run one ``flwr`` CLI command against this SuperLink (FLWR_HOME = flwr-home/cli)."""
        return subprocess.run([executable("flwr"), *args], env=self.env("cli"), cwd=self.work,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def register_supernodes(self, public_keys: Sequence[Path]) -> list[int]:
        """``flwr supernode register KEY.pub`` for each SuperNode (two at a time)."""
        results: dict[int, subprocess.CompletedProcess] = {}

        def register(i: int) -> None:
            results[i] = self.flwr_cli(["supernode", "register", str(public_keys[i]),
                                        CONNECTION, "--format", "json"])

        for start in range(0, len(public_keys), 2):
            threads = [threading.Thread(target=register, args=(i,))
                       for i in range(start, min(start + 2, len(public_keys)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        ids = []
        for i in range(len(public_keys)):
            out = results[i].stdout + results[i].stderr
            match = re.search(r'"node-id":\s*"?(\d+)', out)
            if results[i].returncode != 0 or match is None:
                raise DeployError(f"registering SuperNode {i}'s key failed: "
                                  f"{out.strip().splitlines()[-1:] or results[i].returncode}")
            ids.append(int(match.group(1)))
        self.node_ids = ids
        self.echo(f"registered {len(ids)} SuperNode public keys")
        return ids

    def start_supernode(self, i: int, key: Path | None = None,
                        root_certificates: Path | None = None, name: str = "",
                        insecure: bool = False, track: bool = True,
                        extra_args: Sequence[str] = ()) -> Managed:
        """SuperNode ``i`` (partition-id i). ``root_certificates`` overrides the CA and
        ``insecure`` drops TLS (to test refusals); ``track=False``: not one of the
        federation's nodes (not waited for), but still stopped with everything else."""
        name = name or f"supernode-{i}"
        node_config = f"partition-id={i} num-partitions={self.nodes}"
        if self.edges is not None:
            node_config += f" edge={self.edges[i]}"
        if track:
            port = self.superlink_port + 1 + i
        else:  # above the federation's ports, never the same twice
            port = free_port_block(1, start=max(self._next_extra_port,
                                                self.superlink_port + self.nodes + 1))
            self._next_extra_port = port + 1
        cmd = [executable("flower-supernode"), "--superlink", f"{HOST}:{self.superlink_port}",
               "--host", HOST, "--port", str(port), "--node-config", node_config, *extra_args]
        ca = root_certificates or self.ca_cert
        cmd += ["--insecure"] if insecure or ca is None else ["--root-certificates", str(ca)]
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key)]
        managed = self.procs.start(name, cmd, self.env(name), self.log(name), self.work)
        if track:
            self.supernodes.append(managed)
        return managed

    def wait_supernodes_online(self) -> None:
        """Wait until every SuperNode has activated with the SuperLink (its log says so)."""
        deadline = time.time() + self.connect_timeout
        pending = list(self.supernodes)
        while pending:
            for node in list(pending):
                if "SuperNode ID:" in node.log_text():
                    pending.remove(node)
                elif node.popen.poll() is not None:
                    raise DeployError(f"{node.name} exited before connecting:\n"
                                      + node.log_tail())
            if pending and time.time() > deadline:
                raise DeployError(f"{', '.join(n.name for n in pending)} did not connect "
                                  f"within {self.connect_timeout:.0f} s:\n"
                                  + pending[0].log_tail())
            time.sleep(0.2)
        self.procs.snapshot()
        self._online = True
        self.echo(f"{len(self.supernodes)} SuperNodes online (ports "
                  f"{self.superlink_port + 1}..{self.superlink_port + self.nodes})")

    def run_app(self, cfg: RunConfig, out: Path, timeout: float = 3600,
                verbose: bool = False,
                on_tick: Callable[[LocalDeployment], None] | None = None) -> dict[str, Any]:
        """``flwr run <app> <connection> --run-config <toml> --stream``; returns summary.json.

        Prints one line per cloud round from ``out/metrics.jsonl``, echoes the ServerApp's
        warnings and errors (all of its log with ``verbose``), calls ``on_tick`` about twice
        a second. Raises DeployTimeoutError after ``timeout`` s, DeployError if the run fails.
        """
        out = Path(out).resolve()
        overrides = {**run_config_overrides(cfg, self.app), "clients": self.nodes,
                     "out": str(out)}
        toml_path = write_run_config(self.work / "run_config.toml", overrides)
        cmd = [executable("flwr"), "run", str(self.app), CONNECTION, "--run-config",
               str(toml_path), "--stream"]
        run = self.procs.start("flwr-run", cmd, self.env("cli"), self.log("flwr-run"),
                               self.app)
        self.echo(f"flwr run {self.app} {CONNECTION} (pid {run.pid}); run folder {out}")
        if not self._online:
            self.wait_supernodes_online()
        metrics = out / "metrics.jsonl"
        shown, echoed = 0, 0
        deadline = time.time() + timeout
        while True:
            finished = run.popen.poll() is not None
            if metrics.is_file():
                text = metrics.read_text()
                complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
                for line in complete[shown:]:
                    self.echo(format_round(json.loads(line), cfg.rounds))
                shown = len(complete)
            log_lines = run.log_text().splitlines()
            for line in log_lines[echoed:]:
                if verbose or re.search(r"WARN|ERROR|Traceback|fedhier:", line):
                    self.echo(f"  | {line}")
            echoed = len(log_lines)
            if finished:
                break
            if time.time() > deadline:
                raise DeployTimeoutError(f"the run did not finish within {timeout:.0f} s "
                                    f"(--timeout); log: {run.log}")
            if on_tick is not None:
                on_tick(self)
            self.procs.snapshot()
            time.sleep(0.5)
        summary_path = out / "summary.json"
        if run.popen.returncode != 0 or not summary_path.is_file():
            raise DeployError(f"the run failed (flwr run exit code {run.popen.returncode}, "
                              f"no {summary_path.name}); last lines of {run.log}:\n"
                              + run.log_tail(20))
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        return summary


# ---------------------------------------------------------------------------- command
@contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM/SIGHUP like Ctrl-C so that every started process is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The run configuration of ``fedhier deploy``: clients = --nodes."""
    from fedhier.cli_flags import config_from_args

    cfg = config_from_args(args)
    if args.nodes is None or args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
    if args.clients is not None and args.clients != args.nodes:
        raise ConfigError(f"--clients {args.clients} contradicts --nodes {args.nodes}: each "
                          "SuperNode is one client; give --nodes only")
    return cfg.replace(clients=args.nodes)


def cmd_deploy(args: argparse.Namespace) -> int:
    """``fedhier deploy local``: 0 on success, 1 if the run failed, 124 on --timeout."""
    from fedhier.results import default_run_dir
    from fedhier.server import prepare

    cfg = resolve_config(args)
    if args.insecure and args.certs is not None:
        raise ConfigError("--insecure and --certs contradict each other; give one")
    if args.certs is not None and not Path(args.certs).is_dir():
        raise ConfigError(f"--certs {args.certs}: no such folder")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout}")
    app = Path(args.app).resolve()
    run_config_overrides(cfg, app)  # every flag must reach the ServerApp
    out = Path(cfg.out or default_run_dir(f"{cfg.dataset}-deploy")).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"run folder {out} already exists and is not empty; choose another "
                          "--out")
    check_ports(args.base_port, args.nodes)
    prepare(cfg)  # data and partition are valid before anything starts
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.deploy-", dir=out.parent))
    echo: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    edges = (contiguous_edges(args.nodes, cfg.num_edges)
             if cfg.grouping in ("contiguous", "edge-tag") else None)
    try:
        deployment = LocalDeployment(
            nodes=args.nodes, work=work, base_port=args.base_port, secure=not args.insecure,
            supernode_auth=not args.no_supernode_auth,
            certs_dir=Path(args.certs) if args.certs else None, app=app, echo=echo,
            edges=edges, wait_online=False)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    t0 = time.time()
    code = 1
    try:
        with _interrupt_on_sigterm(), deployment:
            summary = deployment.run_app(cfg, out, timeout=args.timeout, verbose=args.verbose)
            echo(f"final test accuracy {summary['final_test_accuracy']:.4f}, test loss "
                 f"{summary['final_test_loss']:.4f} after {summary['iterations']} iterations "
                 f"({summary['rounds']} cloud rounds) on {args.nodes} SuperNodes in "
                 f"{time.time() - t0:.1f} s")
            code = 0
    except DeployTimeoutError as exc:
        print(f"fedhier: error: {exc}", file=sys.stderr)
        code = 124
    except DeployError as exc:
        print(f"fedhier: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        _keep(work, out)
        echo(f"stopped all {len(deployment.procs.started)} processes started; run folder: "
             f"{out} (logs in {out / 'deploy' / 'logs'})")
    return code


def _keep(work: Path, out: Path) -> None:
    """Move the staged deploy material into ``out/deploy``."""
    if not work.exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    target = out / "deploy"
    if target.exists():
        target = out / work.name.lstrip(".")
    shutil.move(str(work), str(target))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``deploy`` (action ``local``) to the ``fedhier`` subcommands."""
    from fedhier.cli_flags import add_config_flags

    parser = subparsers.add_parser(
        "deploy", help="run on Flower's Deployment Engine (SuperLink + SuperNodes)",
        description="Start a SuperLink and --nodes SuperNodes on 127.0.0.1, run the "
        "hierarchical app on them with `flwr run`, write the run folder, stop everything. "
        "TLS and SuperNode authentication are on unless --insecure.")
    parser.add_argument("action", choices=["local"],
                        help="local: every process on this machine, loopback only")
    parser.add_argument("--nodes", type=int, required=True, metavar="N",
                        help="number of SuperNodes = clients (SuperNode i has partition-id i)")
    parser.add_argument("--config", type=Path, metavar="FILE.toml",
                        help="TOML file with run configuration keys")
    security = parser.add_argument_group("security")
    security.add_argument("--insecure", action="store_true",
                          help="no TLS, no SuperNode authentication (only when asked for)")
    security.add_argument("--certs", type=Path, metavar="DIR",
                          help="use DIR/ca.crt, server.crt, server.key (and supernode-<i> "
                          "keys if present) instead of generated test certificates")
    security.add_argument("--no-supernode-auth", action="store_true",
                          help="TLS only: do not register and authenticate SuperNode keys")
    proc = parser.add_argument_group("processes")
    proc.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, metavar="PORT",
                      help=f"SuperLink port; SuperNode i uses PORT+1+i (default "
                      f"{DEFAULT_BASE_PORT})")
    proc.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                      help="stop everything if the run takes longer (default 3600)")
    proc.add_argument("--app", type=Path, default=REPO_ROOT, metavar="DIR",
                      help="the Flower app to run (default: the fedhier source tree)")
    proc.add_argument("--verbose", action="store_true", help="echo the whole ServerApp log")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_config_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedhier.deploy local --nodes N ...`` (same as ``fedhier deploy``)."""
    parser = argparse.ArgumentParser(prog="fedhier")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["deploy", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_deploy(args)
    except FedhierError as exc:
        print(f"fedhier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedhier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
