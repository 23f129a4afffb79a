"""A SuperLink and N SuperNodes on 127.0.0.1 (:class:`LocalDeployment`), and ``flwr run``
of the app on them with one line printed per cloud round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.connection import (
    CONNECTION,
    connection_toml,
    run_config_overrides,
    write_run_config,
)
from fedhier.engines.deployment.errors import DeployError, DeployTimeoutError
from fedhier.engines.deployment.polling import DEFAULT_INTERVAL, POLL_ENV, WAKE_ENV
from fedhier.engines.deployment.ports import HOST, check_ports, free_port_block, port_open
from fedhier.engines.deployment.processes import FLOWER_ENV, Managed, ProcessGroup, executable
from fedhier.engines.deployment.trace import NAME_ENV, TRACE_ENV
from fedhier.engines.deployment.wire import wire_env
from fedhier.settings.run_config import RunConfig

DEFAULT_BASE_PORT = 9300
#: How often one process (a server, a client's ClientApp runtime) is restarted before the
#: deployment gives up.
MAX_RESTARTS = 3
REPO_ROOT = Path(__file__).resolve().parents[3]  # the fedhier source tree (a Flower app)


def format_round(record: Mapping[str, Any], rounds: int) -> str:
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "-"

    return (f"round {record.get('round')}/{rounds}: test_acc {num('test_accuracy', '.4f')}  "
            f"test_loss {num('test_loss', '.4f')}  train_loss {num('train_loss', '.4f')}  "
            f"failed_clients {record.get('failed_clients', 0)}  "
            f"[{num('wall_seconds', '.1f')} s]")



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
    #: Measure each SuperNode's traffic to its SuperLink into this folder
    #: (:mod:`.wire`); the cloud's ServerApp records the totals in each round's record.
    wire_dir: Path | None = None
    #: Serve each client SuperNode's messages with one long-lived process running fedhier's
    #: ClientApp (:mod:`.client_runtime`) instead of a process per message (fedhier's app only).
    client_runtime: bool = False
    #: Continue this run folder from its checkpoint (``fedhier deploy local --resume``).
    resume_dir: Path | None = None
    #: Seconds between a busy SuperNode's (and task runtime's) requests for work
    #: (``--poll-interval``, :mod:`.polling`); 0: Flower's own 3 s.
    poll_interval: float = DEFAULT_INTERVAL
    #: Write every process's message timestamps into this folder (:mod:`.trace`).
    trace_dir: Path | None = None
    #: More environment of the cloud SuperLink (its ServerApp inherits it).
    cloud_env: dict[str, str] = field(default_factory=dict)
    _next_extra_port: int = 0
    _online: bool = False
    procs: ProcessGroup = field(default_factory=ProcessGroup)
    superlink: Managed | None = None
    supernodes: list[Managed] = field(default_factory=list)
    ca_cert: Path | None = None
    certs: Any = None  # certs.Certificates in secure mode
    node_ids: list[int] = field(default_factory=list)
    #: Client i's long-lived ClientApp process (with ``client_runtime``), and how often
    #: each was restarted after it exited mid-run.
    runtimes: dict[int, Managed] = field(default_factory=dict)
    runtime_restarts: dict[int, int] = field(default_factory=dict)

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
        if self.trace_dir is None and os.environ.get(TRACE_ENV):
            self.trace_dir = Path(os.environ[TRACE_ENV]).resolve()

    # -- paths and environment ---------------------------------------------------------------
    @property
    def superlink_port(self) -> int:
        return self.base_port

    def client_node_port(self, i: int) -> int:
        """Client SuperNode ``i``'s runtime API port (its ClientApp process connects to it)."""
        return self.superlink_port + 1 + i

    def home(self, name: str) -> Path:
        path = self.work / "flwr-home" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, name: str) -> dict[str, str]:
        env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(self.home(name)),
               POLL_ENV: str(self.poll_interval)}
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            env.update({TRACE_ENV: str(self.trace_dir), NAME_ENV: name})
        pair = re.fullmatch(r"(?:supernode|clientapp)-(\d+)|"
                            r"(?:supernode-)?((?:edge|region|level-\d+)-\d+)", name)
        if pair and self.poll_interval > 0:  # a SuperNode and its task runtime wake each other
            key = f"client-{pair[1]}" if pair[1] is not None else pair[2]
            (self.work / "wake").mkdir(parents=True, exist_ok=True)
            env[WAKE_ENV] = str(self.work / "wake" / key)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _wired(self, name: str, link: str, port: int) -> dict[str, str]:
        """The environment of process ``name``, measuring its traffic to ``port`` as
        ``link`` when this deployment has a wire folder."""
        env = self.env(name)
        return env if self.wire_dir is None else wire_env(env, self.wire_dir, link, port)

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
        shutil.rmtree(self.work / "wake", ignore_errors=True)  # the FIFOs of .polling.Wake
        if left:
            self.echo(f"fedhier deploy: warning: processes {left} did not stop")
        return left

    # -- steps -------------------------------------------------------------------------------
    def _prepare_security(self) -> list[Path]:
        from fedhier.engines.deployment.certs import (
            Certificates,
            generate_certificates,
            make_supernode_key,
        )

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

    def start_superlink(self, port: int | None = None, name: str = "superlink",
                        extra_args: Sequence[str] = ()) -> Managed:
        """A SuperLink on ``port`` (default: the cloud's); returns once it listens."""
        port = self.superlink_port if port is None else port
        cmd = [executable("flower-superlink"), "--host", HOST, "--port", str(port),
               "--disable-runtime-dependency-installation", *extra_args]
        if self.secure:
            certs = self.certs
            cmd += ["--ssl-certfile", str(certs.server_cert.resolve()),
                    "--ssl-keyfile", str(certs.server_key.resolve()),
                    "--ssl-ca-certfile", str(certs.ca_cert.resolve())]
            if self.supernode_auth:
                cmd.append("--enable-supernode-auth")
        else:
            cmd.append("--insecure")
        env = self.env(name)
        if port == self.superlink_port:  # read by the cloud's ServerApp
            from fedhier.engines.grid_run import RESUME_ENV, WIRE_RECORD_ENV

            if self.wire_dir is not None:
                env[WIRE_RECORD_ENV] = str(self.wire_dir)
            if self.resume_dir is not None:
                env[RESUME_ENV] = str(self.resume_dir)
            env.update(self.cloud_env)
        managed = self.procs.start(name, cmd, env, self.log(name), self.work)
        if port == self.superlink_port:
            self.superlink = managed
        deadline = time.time() + self.connect_timeout
        while not port_open(port):
            if managed.popen.poll() is not None:
                raise DeployError(f"the {name} exited at start:\n" + managed.log_tail())
            if time.time() > deadline:
                raise DeployError(f"the {name} did not listen on {HOST}:{port} within "
                                  f"{self.connect_timeout:.0f} s")
            time.sleep(0.2)
        mode = ("TLS + SuperNode authentication" if self.supernode_auth else
                "TLS" if self.secure else "INSECURE (no TLS)")
        label = "SuperLink" if name == "superlink" else name
        self.echo(f"{label} on {HOST}:{port} [{mode}] (pid {managed.pid})")
        return managed

    def write_cli_config(self, port: int | None = None, home: str = "cli") -> Path:
        """flwr-home/``home``/config.toml: the connection to the SuperLink on ``port``."""
        path = self.home(home) / "config.toml"
        path.write_text(connection_toml(CONNECTION, port or self.superlink_port, self.ca_cert))
        return path

    def flwr_cli(self, args: Sequence[str], timeout: float = 120,
                 home: str = "cli") -> subprocess.CompletedProcess:
        """Run one ``flwr`` CLI command against this SuperLink (FLWR_HOME = flwr-home/cli;
        ``home``: another SuperLink's connection)."""
        return subprocess.run([executable("flwr"), *args], env=self.env(home), cwd=self.work,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def register_supernodes(self, public_keys: Sequence[Path], home: str = "cli") -> list[int]:
        """``flwr supernode register KEY.pub`` for each SuperNode (two at a time), with the
        SuperLink of the connection in flwr-home/``home``."""
        results: dict[int, subprocess.CompletedProcess] = {}

        def register(i: int) -> None:
            results[i] = self.flwr_cli(["supernode", "register", str(public_keys[i]),
                                        CONNECTION, "--format", "json"], home=home)

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
        self.node_ids += ids
        self.echo(f"registered {len(ids)} SuperNode public keys")
        return ids

    def start_supernode(self, i: int, key: Path | None = None,
                        root_certificates: Path | None = None, name: str = "",
                        insecure: bool = False, track: bool = True,
                        extra_args: Sequence[str] = (), superlink_port: int | None = None,
                        port: int | None = None, node_config: str | None = None,
                        env: dict[str, str] | None = None) -> Managed:
        """SuperNode ``i`` (partition-id i). ``root_certificates`` overrides the CA and
        ``insecure`` drops TLS (to test refusals); ``track=False``: not one of the
        federation's nodes (not waited for), but still stopped with everything else.
        ``superlink_port`` (default: the cloud's), ``port`` (its runtime API),
        ``node_config`` and ``env`` override the defaults of client SuperNode ``i``."""
        name = name or f"supernode-{i}"
        if node_config is None:
            node_config = f"partition-id={i} num-partitions={self.nodes}"
            if self.edges is not None:
                node_config += f" edge={self.edges[i]}"
        if port is not None:
            pass
        elif track:
            port = self.client_node_port(i)
        else:  # above the federation's ports, never the same twice
            port = free_port_block(1, start=max(self._next_extra_port,
                                                self.superlink_port + self.nodes + 1))
            self._next_extra_port = port + 1
        executable("flower-supernode")  # Flower's SuperNode, paced (.supernode)
        cmd = [sys.executable, "-m", "fedhier.engines.deployment.supernode", "--superlink",
               f"{HOST}:{superlink_port or self.superlink_port}",
               "--host", HOST, "--port", str(port), "--node-config", node_config, *extra_args]
        ca = root_certificates or self.ca_cert
        cmd += ["--insecure"] if insecure or ca is None else ["--root-certificates", str(ca)]
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key)]
        if env is None:
            env = self._wired(name, "client-cloud", superlink_port or self.superlink_port)
        runtime = self.client_runtime and track and node_config.startswith("partition-id")
        if runtime:
            cmd += ["--isolation", "process", *self.secret_args()]
        managed = self.procs.start(name, cmd, env, self.log(name), self.work)
        if track:
            self.supernodes.append(managed)
        if runtime:
            self.start_client_runtime(i, port)
        return managed

    def secret_args(self) -> list[str]:
        """``--superexec-auth-secret-file`` for a SuperLink or SuperNode started with
        ``--isolation process`` (TLS deployments; the secret is made on first use)."""
        if not self.secure:
            return []
        secret = self.work / "certs" / "superexec.secret"
        if not secret.is_file():
            secret.parent.mkdir(parents=True, exist_ok=True)
            secret.write_bytes(os.urandom(32).hex().encode())
            secret.chmod(0o600)
        return ["--superexec-auth-secret-file", str(secret)]

    def start_client_runtime(self, i: int, port: int) -> Managed:
        """The long-lived ClientApp process of client SuperNode ``i`` (runtime API ``port``)."""
        name = f"clientapp-{i}"
        cmd = [sys.executable, "-m", "fedhier.engines.deployment.client_runtime", "--node",
               f"{HOST}:{port}", "--name", f"client {i}"]
        secret = self.secret_args()
        if secret:
            cmd += ["--superexec-secret", secret[1]]
        self.runtimes[i] = self.procs.start(name, cmd, self.env(name), self.log(name),
                                            self.work)
        return self.runtimes[i]

    def restart_stopped_runtimes(self) -> list[int]:
        """Start again each client's ClientApp runtime that exited while the run goes on (at
        most ``MAX_RESTARTS`` times each): its SuperNode keeps the client's tasks and kept
        state, so the new process answers the next task as the old one would have (a task
        the old one had claimed and not answered is lost: the SuperNode answers it with an
        error once its heartbeat lapses, and the client counts as failed). Returns those
        clients."""
        restarted = []
        for i, managed in sorted(self.runtimes.items()):
            code = managed.popen.poll()
            if code is None:
                continue
            if self.runtime_restarts.get(i, 0) >= MAX_RESTARTS:
                raise DeployError(f"the ClientApp process of client {i} stopped "
                                  f"{MAX_RESTARTS + 1} times (last exit code {code}); not "
                                  f"restarted again; its log: logs/{managed.log.name}")
            self.runtime_restarts[i] = self.runtime_restarts.get(i, 0) + 1
            self.echo(f"the ClientApp process of client {i} stopped (exit code {code}); "
                      "restarting it")
            self.start_client_runtime(i, self.client_node_port(i))
            restarted.append(i)
        return restarted

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
        shown, echoed = len(metrics.read_text().splitlines()) if metrics.is_file() else 0, 0
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
            self.restart_stopped_runtimes()
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
