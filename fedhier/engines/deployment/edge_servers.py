"""Servers at every level on 127.0.0.1: the cloud SuperLink, the servers of each level
between the clients and the cloud (edges, regions, ...), N client SuperNodes.

:class:`EdgeTierDeployment` extends :class:`~fedhier.engines.deployment.local.LocalDeployment`
(docs/deployment.md#edge-servers has the diagram). Per server (an edge e, a region r, ...):

* its **SuperLink** (``--isolation process``): its children connect to it (an edge's clients'
  SuperNodes, a region's edges' SuperNodes);
* a **SuperNode of its parent's SuperLink** (``--isolation process``, tagged ``edge=e`` /
  ``region=r``): its parent's messages arrive there (the parent: the cloud, or a region);
* the **server process** (:mod:`.edge_process`): the ServerApp of its SuperLink and the
  ClientApp runtime of that SuperNode, in one long-lived process.

Every SuperLink has TLS and SuperNode authentication (each SuperNode's key registered with
the SuperLink it connects to), and the runtime APIs that ``--isolation process`` opens to an
outside process need the SuperExec secret (``superexec.secret``, made here). Ports from
``base_port``: cloud SuperLink, then one per client SuperNode, then per server (edges first,
then regions, ...) its SuperLink and its SuperNode's runtime API.

With a wire folder every SuperNode measures its own traffic
(:mod:`fedhier.engines.deployment.wire`): client SuperNodes on the ``client-edge`` link,
a server's SuperNode on the link to its parent (``edge-cloud``; with regions ``edge-region``
and ``region-cloud``); the cloud ServerApp records the totals per cloud round.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.connection import CONNECTION
from fedhier.engines.deployment.errors import DeployError
from fedhier.engines.deployment.local import MAX_RESTARTS, LocalDeployment
from fedhier.engines.deployment.ports import HOST, check_ports, ports_needed
from fedhier.engines.deployment.processes import Managed
from fedhier.engines.deployment.reattach import REATTACH_ENV, ReattachDriver
from fedhier.round.tiers.jobs import server_names
from fedhier.settings.run_config import RunConfig

#: What a SuperNode's log says once it is online at its SuperLink.
ONLINE = "SuperNode ID:"


@dataclass
class EdgeTierDeployment(LocalDeployment):
    """``edges`` must hold each client's edge and ``upper`` each edge's region (each
    region's level-3 node, ...), from the run's grouping
    (:func:`fedhier.engines.deployment.placement.tree_placement`); ``num_edges`` edge servers
    (and one server per node of each level above) are started; ``edge_timeout``: seconds a
    server waits for its children's replies."""

    num_edges: int = 1
    edge_timeout: float = 3600.0
    upper: list[list[int]] = field(default_factory=list)
    edge_processes: list[Managed] = field(default_factory=list)  # by server
    restarts: dict[int, int] = field(default_factory=dict)
    #: Clients move between edges (mobility, regrouping): every client's key is registered
    #: with every edge's SuperLink at start, and the cloud's re-attach requests are served
    #: (:mod:`.reattach`, :meth:`reattach_client`).
    moves_clients: bool = False
    keys: list[Path] = field(default_factory=list)
    #: Per re-attached client: seconds to stop it, start it at the new edge, see it online.
    reattach_seconds: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.edges is None or len(self.edges) != self.nodes:
            raise ConfigError("an edge-tier deployment needs every client's edge")
        self.parents = [list(self.edges), *(list(p) for p in self.upper)]
        if sorted(set(self.edges)) != list(range(self.num_edges)):
            raise ConfigError(f"--edges {self.num_edges}: every edge needs at least one client "
                              f"(clients at edges {sorted(set(self.edges))})")
        for level, parent in enumerate(self.parents[1:], start=2):
            below = max(self.parents[level - 2]) + 1
            if len(parent) != below or sorted(set(parent)) != list(range(max(parent) + 1)):
                raise ConfigError(f"every level-{level} server needs at least one child "
                                  f"(level-{level - 1} servers under {sorted(set(parent))})")
        self.names = server_names(len(self.parents) + 1)
        # (level, node) of every server, edges first; the index is its place in the ports
        self.servers = [(level, node) for level in range(1, len(self.parents) + 1)
                        for node in range(max(self.parents[level - 1]) + 1)]
        check_ports(self.base_port, ports_needed(self.nodes, len(self.servers)) - 1)
        self.reattacher = ReattachDriver(self.work / "reattach", self.reattach_client,
                                         echo=self.echo)
        if self.moves_clients:
            self.cloud_env[REATTACH_ENV] = str(self.work / "reattach")

    # -- the tree ----------------------------------------------------------------------------
    def server_index(self, level: int, node: int) -> int:
        return self.servers.index((level, node))

    def server_name(self, index: int) -> str:
        level, node = self.servers[index]
        return f"{self.names[level]}-{node}"

    def parent_of(self, index: int) -> int | None:
        """The server above server ``index`` (None: the cloud)."""
        level, node = self.servers[index]
        if level == len(self.parents):
            return None
        return self.server_index(level + 1, self.parents[level][node])

    def clients_under(self, index: int) -> list[int]:
        level, node = self.servers[index]
        under = list(range(self.nodes))
        for parent in self.parents[:level]:
            under = [parent[u] for u in under]
        return [c for c in range(self.nodes) if under[c] == node]

    def children_of(self, index: int) -> list[int]:
        level, node = self.servers[index]
        return [c for c, p in enumerate(self.parents[level - 1]) if p == node]

    # -- ports -------------------------------------------------------------------------------
    def server_superlink_port(self, index: int) -> int:
        return self.base_port + 1 + self.nodes + 2 * index

    def edge_superlink_port(self, edge: int) -> int:
        return self.server_superlink_port(edge)  # edges come first

    def server_node_port(self, index: int) -> int:
        """The runtime API of server ``index``'s SuperNode on its parent's SuperLink."""
        return self.server_superlink_port(index) + 1

    def parent_port(self, index: int) -> int:
        parent = self.parent_of(index)
        return self.superlink_port if parent is None else self.server_superlink_port(parent)

    def parent_home(self, index: int) -> str:
        """The flwr-home whose connection is the parent's SuperLink."""
        parent = self.parent_of(index)
        return "cli" if parent is None else self.server_name(parent)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Certificates and secret, the cloud SuperLink, the servers' SuperLinks, key
        registration on every tier, the client and server SuperNodes, the server processes."""
        self.work.mkdir(parents=True, exist_ok=True)
        keys = self.keys = self._prepare_edge_security()
        secret = self.secret_args()
        self.start_superlink()
        self.write_cli_config()
        for j in range(len(self.servers)):
            port = self.server_superlink_port(j)
            self.start_superlink(port, f"superlink-{self.server_name(j)}",
                                 ["--isolation", "process", *secret])
            self.write_cli_config(port, self.server_name(j))
        if self.supernode_auth:
            for j in range(len(self.servers)):  # who connects to server j's SuperLink
                level, _ = self.servers[j]
                clients = range(self.nodes) if self.moves_clients else self.children_of(j)
                below = ([keys[i] for i in clients] if level == 1 else
                         [keys[self.nodes + self.server_index(level - 1, c)]
                          for c in self.children_of(j)])
                self.register_supernodes([self._pub(k) for k in below],
                                         home=self.server_name(j))
            self.register_supernodes([self._pub(keys[self.nodes + j])
                                      for j in range(len(self.servers))
                                      if self.parent_of(j) is None])
        assert self.edges is not None
        for i in range(self.nodes):
            port = self.edge_superlink_port(self.edges[i])
            self.start_supernode(i, keys[i] if self.supernode_auth else None,
                                 superlink_port=port,
                                 env=self._wired(f"supernode-{i}", "client-edge", port))
        for j, (level, node) in enumerate(self.servers):
            name = self.server_name(j)
            link = f"{self.names[level]}-{self.names[level + 1]}"
            self.start_supernode(
                node, keys[self.nodes + j] if self.supernode_auth else None,
                name=f"supernode-{name}", port=self.server_node_port(j),
                superlink_port=self.parent_port(j),
                node_config=f"{self.names[level]}={node}",
                extra_args=["--isolation", "process", *secret],
                env=self._wired(f"supernode-{name}", link, self.parent_port(j)))
        for j in range(len(self.servers)):
            self.start_edge_process(j)
        if self.wait_online:
            self.wait_supernodes_online()

    def _prepare_edge_security(self) -> list[Path]:
        """TLS material and one SuperNode key per client and per server."""
        from fedhier.engines.deployment.certs import make_supernode_key

        keys = self._prepare_security()
        if not self.secure:
            return []
        keys = keys[:self.nodes]
        if self.supernode_auth:
            keys += [make_supernode_key(self.work / "keys" /
                                        f"supernode-{self.server_name(j)}")[0].resolve()
                     for j in range(len(self.servers))]
        return keys

    @staticmethod
    def _pub(key: Path) -> Path:
        return key.with_name(key.name + ".pub")

    def run_app(self, cfg: RunConfig, out: Path, timeout: float = 3600,
                verbose: bool = False,
                on_tick: Callable[[LocalDeployment], None] | None = None) -> dict[str, Any]:
        """As :meth:`LocalDeployment.run_app`, restarting a server process that stopped (it
        rejoins at the next job; its parent counts its clients as failed for a job it lost)."""

        def tick(deployment: LocalDeployment) -> None:
            self.restart_stopped_edges()
            self.reattacher.poll()
            if on_tick is not None:
                on_tick(deployment)

        return super().run_app(cfg, out, timeout, verbose, tick)

    def restart_stopped_edges(self) -> list[int]:
        """Start again every server whose process exited (at most ``MAX_RESTARTS`` times
        each); returns those servers' indices."""
        restarted = []
        for j, managed in enumerate(self.edge_processes):
            code = managed.popen.poll()
            if code is None:
                continue
            level, node = self.servers[j]
            what = f"{self.names[level]} server {node}"
            if self.restarts.get(j, 0) >= MAX_RESTARTS:
                raise DeployError(self.gave_up(j, code, managed))
            self.restarts[j] = self.restarts.get(j, 0) + 1
            self.echo(f"{what} stopped (exit code {code}); restarting it")
            self.edge_processes[j] = self.start_edge_process(j, append=False)
            restarted.append(j)
        return restarted

    def reattach_client(self, client: int, edge: int) -> float:
        """Restart client ``client``'s SuperNode at edge ``edge``'s SuperLink, same key and
        runtime port; returns once it is online there (seconds). Its ClientApp process
        (``client_runtime``) keeps running: it reconnects to the runtime port (Flower's
        retrying HTTP client), with its data still loaded."""
        t0 = time.perf_counter()
        old = self.supernodes[client]
        self.procs.stop([old])
        stopped = time.perf_counter() - t0
        online = old.log_text().count(ONLINE)
        assert self.edges is not None
        self.edges[client] = self.parents[0][client] = edge  # a restarted edge serves it
        port = self.edge_superlink_port(edge)
        isolation = (["--isolation", "process", *self.secret_args()] if self.client_runtime
                     else [])
        managed = self.start_supernode(client, self.keys[client] if self.supernode_auth
                                       else None, superlink_port=port, track=False,
                                       port=self.client_node_port(client),
                                       extra_args=isolation,
                                       env=self._wired(f"supernode-{client}", "client-edge",
                                                       port))
        self.supernodes[client] = managed
        deadline = time.time() + self.connect_timeout
        while managed.log_text().count(ONLINE) <= online:
            if managed.popen.poll() is not None or time.time() > deadline:
                raise DeployError(f"client {client} did not come online at edge {edge}:\n"
                                  + managed.log_tail())
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        self.reattach_seconds.append(seconds)
        self.echo(f"client {client} re-attached to edge {edge} (SuperLink {HOST}:{port}) in "
                  f"{seconds:.2f} s (stopped in {stopped:.2f} s)")
        return seconds

    def gave_up(self, index: int, code: int, managed: Managed) -> str:
        """The one line of server ``index`` stopped once more than ``MAX_RESTARTS`` allows:
        its last exit code, its own last error line (:mod:`.edge_process` prints one before
        it exits 1) and its log's name."""
        level, node = self.servers[index]
        own = f"{self.names[level]} {node}: error: "
        errors = [line.strip() for line in managed.log_text().splitlines()
                  if line.startswith(own)]
        said = f"; it said: {errors[-1][:300]}" if errors else ""
        return (f"{self.names[level]} server {node} stopped {MAX_RESTARTS + 1} times (last "
                f"exit code {code}); not restarted again (at most {MAX_RESTARTS} restarts)"
                f"{said}; its log: logs/{managed.log.name}; the rounds recorded so far stay "
                "in the run folder")

    def start_edge_process(self, index: int, append: bool = True) -> Managed:
        """Server ``index``'s process (also to restart one that was stopped)."""
        name = self.server_name(index)
        level, node = self.servers[index]
        port = self.server_superlink_port(index)
        cmd = [sys.executable, "-m", "fedhier.engines.deployment.edge_process",
               "--edge", str(node), "--level", str(level),
               "--clients", ",".join(map(str, self.clients_under(index))),
               "--edge-superlink", f"{HOST}:{port}",
               "--cloud-node", f"{HOST}:{self.server_node_port(index)}", "--app", str(self.app),
               "--connection", CONNECTION,
               "--timeout", str(self.edge_timeout)]
        if level > 1:
            cmd += ["--children", ",".join(map(str, self.children_of(index)))]
        if self.secure:
            cmd += ["--root-certificates", str(self.ca_cert),
                    "--superexec-secret", str(self.work / "certs" / "superexec.secret")]
        managed = self.procs.start(name, cmd, self.env(name), self.log(name), self.work)
        if append:
            self.edge_processes.append(managed)
        below = (f"clients {self.children_of(index)}" if level == 1 else
                 f"{self.names[level - 1]}s {self.children_of(index)}")
        self.echo(f"{self.names[level]} server {node} (pid {managed.pid}): SuperLink "
                  f"{HOST}:{port}, {below}")
        return managed
