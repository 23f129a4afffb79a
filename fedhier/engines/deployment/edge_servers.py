"""Three tiers on 127.0.0.1: the cloud SuperLink, E edge servers, N client SuperNodes.

:class:`EdgeTierDeployment` extends :class:`~fedhier.engines.deployment.local.LocalDeployment`
(docs/deployment.md#edge-servers has the diagram). Per edge e:

* an **edge SuperLink** (``--isolation process``): its clients' SuperNodes connect to it;
* a **SuperNode of the cloud SuperLink** (``--isolation process``, tagged ``edge=e``): the
  cloud's messages to edge e arrive there;
* the **edge process** (:mod:`.edge_process`): the ServerApp of the edge SuperLink and the
  ClientApp runtime of that SuperNode, in one long-lived process.

Every SuperLink has TLS and SuperNode authentication (clients' keys registered with their
edge's SuperLink, edges' keys with the cloud's), and the runtime APIs that ``--isolation
process`` opens to an outside process need the SuperExec secret (``superexec.secret``, made
here). Ports from ``base_port``: cloud SuperLink, then one per client SuperNode, then per
edge its SuperLink and its SuperNode's runtime API.

With a wire folder every SuperNode measures its own traffic
(:mod:`fedhier.engines.deployment.wire`): client SuperNodes on the ``client-edge`` link,
edges' SuperNodes on the ``edge-cloud`` link; the cloud ServerApp records the totals per
cloud round.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhier.config import RunConfig
from fedhier.engines.deployment.connection import CONNECTION
from fedhier.engines.deployment.errors import DeployError
from fedhier.engines.deployment.local import LocalDeployment
from fedhier.engines.deployment.ports import HOST, check_ports, ports_needed
from fedhier.engines.deployment.processes import Managed
from fedhier.errors import ConfigError

#: How often one edge process is restarted before the deployment gives up.
MAX_RESTARTS = 3


@dataclass
class EdgeTierDeployment(LocalDeployment):
    """``edges`` must hold each client's edge (from the run's grouping:
    :func:`fedhier.engines.deployment.placement.client_placement`); ``num_edges`` edge servers
    are started; ``edge_timeout``: seconds an edge waits for its clients' replies."""

    num_edges: int = 1
    edge_timeout: float = 3600.0
    edge_processes: list[Managed] = field(default_factory=list)  # by edge
    restarts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ports(self.base_port, ports_needed(self.nodes, self.num_edges) - 1)
        if self.edges is None or len(self.edges) != self.nodes:
            raise ConfigError("an edge-tier deployment needs every client's edge")
        if self.num_edges < 1 or sorted(set(self.edges)) != list(range(self.num_edges)):
            raise ConfigError(f"--edges {self.num_edges}: every edge needs at least one client "
                              f"(clients at edges {sorted(set(self.edges))})")

    # -- ports -------------------------------------------------------------------------------
    def edge_superlink_port(self, edge: int) -> int:
        return self.base_port + 1 + self.nodes + 2 * edge

    def edge_node_port(self, edge: int) -> int:
        """The runtime API of edge ``edge``'s SuperNode on the cloud SuperLink."""
        return self.edge_superlink_port(edge) + 1

    def clients_of(self, edge: int) -> list[int]:
        assert self.edges is not None
        return [i for i, e in enumerate(self.edges) if e == edge]

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Certificates and secret, the cloud SuperLink, the edge SuperLinks, key
        registration on both tiers, the client and edge SuperNodes, the edge processes."""
        self.work.mkdir(parents=True, exist_ok=True)
        keys = self._prepare_edge_security()
        secret = self.secret_args()
        self.start_superlink()
        self.write_cli_config()
        for edge in range(self.num_edges):
            self.start_superlink(self.edge_superlink_port(edge), f"superlink-edge-{edge}",
                                 ["--isolation", "process", *secret])
            self.write_cli_config(self.edge_superlink_port(edge), f"edge-{edge}")
        if self.supernode_auth:
            for edge in range(self.num_edges):
                self.register_supernodes([self._pub(keys[i]) for i in self.clients_of(edge)],
                                         home=f"edge-{edge}")
            self.register_supernodes([self._pub(keys[self.nodes + e])
                                      for e in range(self.num_edges)])
        assert self.edges is not None
        for i in range(self.nodes):
            port = self.edge_superlink_port(self.edges[i])
            self.start_supernode(i, keys[i] if self.supernode_auth else None,
                                 superlink_port=port,
                                 env=self._wired(f"supernode-{i}", "client-edge", port))
        for edge in range(self.num_edges):
            self.start_supernode(
                edge, keys[self.nodes + edge] if self.supernode_auth else None,
                name=f"supernode-edge-{edge}", port=self.edge_node_port(edge),
                node_config=f"edge={edge}", extra_args=["--isolation", "process", *secret],
                env=self._wired(f"supernode-edge-{edge}", "edge-cloud", self.superlink_port))
        for edge in range(self.num_edges):
            self.start_edge_process(edge)
        if self.wait_online:
            self.wait_supernodes_online()

    def _prepare_edge_security(self) -> list[Path]:
        """TLS material and one SuperNode key per client and per edge."""
        from fedhier.engines.deployment.certs import make_supernode_key

        keys = self._prepare_security()
        if not self.secure:
            return []
        keys = keys[:self.nodes]
        if self.supernode_auth:
            keys += [make_supernode_key(self.work / "keys" / f"supernode-edge-{e}")[0].resolve()
                     for e in range(self.num_edges)]
        return keys

    @staticmethod
    def _pub(key: Path) -> Path:
        return key.with_name(key.name + ".pub")

    def run_app(self, cfg: RunConfig, out: Path, timeout: float = 3600,
                verbose: bool = False,
                on_tick: Callable[[LocalDeployment], None] | None = None) -> dict[str, Any]:
        """As :meth:`LocalDeployment.run_app`, restarting an edge process that stopped (it
        rejoins at the next job; the cloud counts its clients as failed for a job it lost)."""

        def tick(deployment: LocalDeployment) -> None:
            self.restart_stopped_edges()
            if on_tick is not None:
                on_tick(deployment)

        return super().run_app(cfg, out, timeout, verbose, tick)

    def restart_stopped_edges(self) -> list[int]:
        """Start again every edge whose process exited (at most ``MAX_RESTARTS`` times
        each); returns those edges."""
        restarted = []
        for edge, managed in enumerate(self.edge_processes):
            code = managed.popen.poll()
            if code is None:
                continue
            if self.restarts.get(edge, 0) >= MAX_RESTARTS:
                raise DeployError(f"edge server {edge} stopped {MAX_RESTARTS + 1} times; "
                                  f"last lines of {managed.log}:\n{managed.log_tail()}")
            self.restarts[edge] = self.restarts.get(edge, 0) + 1
            self.echo(f"edge server {edge} stopped (exit code {code}); restarting it")
            self.edge_processes[edge] = self.start_edge_process(edge, append=False)
            restarted.append(edge)
        return restarted

    def start_edge_process(self, edge: int, append: bool = True) -> Managed:
        """Edge ``edge``'s process (also to restart one that was stopped)."""
        name = f"edge-{edge}"
        cmd = [sys.executable, "-m", "fedhier.engines.deployment.edge_process",
               "--edge", str(edge), "--clients", ",".join(map(str, self.clients_of(edge))),
               "--edge-superlink", f"{HOST}:{self.edge_superlink_port(edge)}",
               "--cloud-node", f"{HOST}:{self.edge_node_port(edge)}", "--app", str(self.app),
               "--connection", CONNECTION,
               "--timeout", str(self.edge_timeout)]
        if self.secure:
            cmd += ["--root-certificates", str(self.ca_cert),
                    "--superexec-secret", str(self.work / "certs" / "superexec.secret")]
        managed = self.procs.start(name, cmd, self.env(f"edge-{edge}"), self.log(name),
                                   self.work)
        if append:
            self.edge_processes.append(managed)
        self.echo(f"edge server {edge} (pid {managed.pid}): SuperLink "
                  f"{HOST}:{self.edge_superlink_port(edge)}, clients {self.clients_of(edge)}")
        return managed
