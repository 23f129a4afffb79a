"""The Simulation Engine's nodes as edge servers (``--engine flower --edge-servers``).

With ``edge_servers`` on, each virtual SuperNode of Flower's Simulation Engine is one of the
cloud's child servers (an edge; a region with ``--groups E,R``), as ``fedhier deploy local
--edges`` makes each one a process: the ClientApp :data:`edge_node_app`, run in the Ray
actors, is an :class:`~fedhier.strategies.edge.server.EdgeServer` whose own clients (and, for
a region, its edge servers) sit on in-process grids
(:class:`~fedhier.engines.inprocess_grid.InProcessGrid`) inside the actor. The cloud sends
one message per server and job (:mod:`fedhier.strategies.edge.messages`): a whole cloud
round of edge rounds of all its clients, instead of one message per client and edge round;
the server runs them with :func:`fedhier.round.tiers.jobs.run_edge_job`. The run equals the
one-process run up to the rounding of averaging the edges' averages (1e-5,
tests/test_edge_tier.py, tests/test_engines.py).

Servers hold no training state between jobs (:mod:`fedhier.round.tiers.jobs`), so whichever actor
a message lands on answers it alike; an actor builds a node's server (its clients' grid,
profiled once) at the node's first message and keeps it for the run (:data:`_SERVERS`).
"""

from __future__ import annotations

import functools
import gc
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedhier.clients.app import app as client_app
from fedhier.clients.app import run_config_of
from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.placement import tree_placement
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.messages import EDGE_KEYS
from fedhier.strategies.edge.server import EdgeServer

#: The ClientApp of a Simulation Engine whose nodes are the cloud's child servers.
edge_node_app = ClientApp()

#: (Flower run id, run configuration, node) -> that node's server, in this process (a Ray
#: actor).
_SERVERS: dict[tuple[int, RunConfig, int], EdgeServer] = {}


def cloud_children(cfg: RunConfig) -> int:
    """How many servers sit right under the cloud (the Simulation Engine's nodes)."""
    return int(cfg.groups[-1])


class _ServersApp:
    """A region's grid's "ClientApp": node ``partition-id`` c is child server c."""

    def __init__(self, servers: dict[int, EdgeServer]) -> None:
        self.servers = servers

    def __call__(self, msg: Message, context: Context) -> Message:
        child = int(cast(int, context.node_config["partition-id"]))
        return Message(self.servers[child].handle(msg), reply_to=msg)


@functools.lru_cache(maxsize=2)
def _placement(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """:func:`tree_placement` of ``cfg``, drawn once per actor for all its servers."""
    return tree_placement(cfg)


def build_server(cfg: RunConfig, level: int, node: int,
                 tree: tuple[np.ndarray, ...] | None = None) -> EdgeServer:
    """Server ``node`` of ``level`` (1: an edge) with its subtree in this process: an edge's
    clients on an in-process grid of the ClientApp, a region's edge servers on an
    in-process grid of servers. ``tree``: :func:`tree_placement` of ``cfg`` (default: drawn
    once per process), the same grouping the cloud draws and checks."""
    tree = _placement(cfg) if tree is None else tree
    under = tree[0]
    for parents in tree[1:level]:
        under = parents[under]
    clients = np.flatnonzero(under == node).tolist()
    if level == 1:
        grid = InProcessGrid(client_app, len(clients), seed=cfg.seed + 1 + node,
                             partition_ids=clients, num_partitions=cfg.clients)
        return EdgeServer(node, grid, clients)
    children = np.flatnonzero(tree[level - 1] == node).tolist()
    servers = {c: build_server(cfg, level - 1, c, tree) for c in children}
    grid = InProcessGrid(_ServersApp(servers), len(children),  # type: ignore[arg-type]
                         seed=cfg.seed + 1 + node, partition_ids=children,
                         num_partitions=int(cfg.groups[level - 2]))
    return EdgeServer(node, grid, clients, level=level, children=children)


def _server(msg: Message, context: Context) -> EdgeServer:
    """This node's server, built at its first message of the run in this actor."""
    config = cast(ConfigRecord, msg.content["config"])
    cfg = run_config_of(ConfigRecord({k: v for k, v in config.items() if k not in EDGE_KEYS}))
    node = int(cast(int, context.node_config["partition-id"]))
    key = (int(context.run_id), cfg, node)
    server = _SERVERS.get(key)
    if server is None:
        for stale in [k for k in _SERVERS if k[:2] != key[:2]]:  # an earlier run's
            del _SERVERS[stale]
        server = _SERVERS[key] = build_server(cfg, len(cfg.groups), node)
        # What exists now (imports, data, the grids) is never garbage: full collections set
        # off by the in-process messages need not rescan it (as run_inprocess does).
        gc.freeze()
    return server


def _answer(msg: Message, context: Context) -> Message:
    return Message(_server(msg, context).handle(msg), reply_to=msg)


@edge_node_app.train()
def train(msg: Message, context: Context) -> Message:
    """A job: the edge rounds of one period of the cloud, with this server's subtree."""
    return _answer(msg, context)


@edge_node_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The global model on this server's clients' rows."""
    return _answer(msg, context)


@edge_node_app.query()
def profile(msg: Message, context: Context) -> Message:
    """This server's clients: their rows and label histograms."""
    return _answer(msg, context)


@edge_node_app.query("gradient")
def gradient(msg: Message, context: Context) -> Message:
    """This server's clients' gradients (diagnostics, gradient groupings)."""
    return _answer(msg, context)


@edge_node_app.query("state")
def export_state(msg: Message, context: Context) -> Message:
    """This server's clients' kept state (checkpoints), where the server forwards it."""
    return _answer(msg, context)


@edge_node_app.query("restore")
def restore_state(msg: Message, context: Context) -> Message:
    """Put a checkpoint's kept state back on this server's clients."""
    return _answer(msg, context)


def check_edge_nodes(cfg: RunConfig) -> None:
    """What servers as Simulation Engine nodes do not run, in one line: a node's clients
    live in whichever actor takes its message, so they cannot keep state between messages
    (kept optimizer state) nor move to another node's actor (mobility)."""
    if cfg.keeps_client_state():
        raise ConfigError("--engine flower --edge-servers: clients cannot keep optimizer "
                          "state (a node's clients live in whichever actor takes its "
                          "message): use optimizer_state reset, or fedhier deploy local --edges")
    if cfg.clients_move():
        raise ConfigError("--engine flower --edge-servers: clients stay at their edges (no "
                          "mobility, no regroup_every); fedhier deploy local --edges or "
                          "--engine inprocess run moving clients")
    if cfg.asynchronous().active:
        raise ConfigError("--engine flower --edge-servers: synchronous edges only (no "
                          "async_buffer); fedhier deploy local --edges runs asynchronous "
                          "edge servers")


def simulation_nodes(cfg: RunConfig) -> tuple[Any, int]:
    """(the ClientApp, the number of virtual SuperNodes) of ``cfg``'s Simulation Engine run:
    one node per client, or with ``edge_servers`` one per server under the cloud (checked
    by :func:`check_edge_nodes`)."""
    if cfg.edge_servers:
        check_edge_nodes(cfg)
        return edge_node_app, cloud_children(cfg)
    return client_app, cfg.clients
