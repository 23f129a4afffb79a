"""Servers at every level (`fedhier deploy local --edges E --regions R`): clients under edge
servers under region servers under the cloud. The split round equals the one-process run
through Flower messages on nested in-process grids (no sockets), and on real processes on
127.0.0.1 with TLS and SuperNode authentication on every tier, with the bytes measured on
each link in the ratio the algorithm counts.

Two levels (edges under the cloud) are tested in tests/test_edge_tier.py and
tests/test_deploy_edges.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message

from fedhier.config import RunConfig
from fedhier.engines.deployment.placement import tree_placement
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.run_folder import RunFolder
from fedhier_clients.app import app as client_app
from fedhier_strategies.edge.server import EdgeServer
from tests.helpers import metrics
from tests.test_vectorized import assert_same_runs

#: 8 clients, 4 edges, 2 regions: edges aggregate every 2 steps, regions every 4, the cloud
#: every 8 (2 region rounds of 2 edge rounds per cloud round).
BASE = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8),
                 grouping="contiguous", rounds=2, batch_size=8, seed=5)
TOL = 1e-5


class ServersApp:
    """A grid's "ClientApp" whose node k is server ``servers[k]`` (as a server process is)."""

    def __init__(self, servers: list[EdgeServer]) -> None:
        self.servers = servers

    def __call__(self, msg: Message, context) -> Message:
        return Message(self.servers[int(context.node_config["partition-id"])].handle(msg),
                       reply_to=msg)


def servers_grid(cfg: RunConfig) -> InProcessGrid:
    """The cloud's grid: its child servers, each with its own grid of children, down to the
    clients' grids at the edges."""
    parents = tree_placement(cfg)  # client -> edge, edge -> region, ...
    below: list[EdgeServer] = []
    ancestors = np.arange(cfg.clients)
    for level, parent in enumerate(parents, start=1):
        ancestors = parent[ancestors]
        servers = []
        for node in range(int(parent.max()) + 1):
            children = np.flatnonzero(parent == node).tolist()
            clients = np.flatnonzero(ancestors == node).tolist()
            if level == 1:
                grid = InProcessGrid(client_app, len(children), seed=cfg.seed + 1 + node,
                                     partition_ids=children, num_partitions=cfg.clients)
            else:
                grid = InProcessGrid(ServersApp([below[c] for c in children]),  # type: ignore[arg-type]
                                     len(children), seed=cfg.seed + 100 * level + node)
            servers.append(EdgeServer(node, grid, clients, level=level, children=children))
        below = servers
    return InProcessGrid(ServersApp(below), len(below), seed=cfg.seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [
    {},
    dict(participation=0.7, fail_rate=0.15, compute_spread=0.5, edge_slowdown="1:3"),
    dict(aggregators="mean,median,mean"),
    dict(groups=(4, 2, 1), periods=(2, 4, 8, 16), rounds=1),
], ids=["plain", "faults-sim-time", "median-regions", "four-levels"])
def test_servers_at_every_level_equal_the_one_process_run(change, tmp_path):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    split = cfg.replace(edge_servers=True)
    run_federation(servers_grid(split), split, RunFolder.create(tmp_path / "split", split),
                   engine="servers (in-process)", progress=False)
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    assert metrics(tmp_path / "split")[-1]["round"] == cfg.rounds
