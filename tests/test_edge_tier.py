"""Edge servers that run their own clients' edge rounds (fedhier.round.tiers.jobs): the split round
equals the one-process round, through Flower messages on in-process grids (no sockets).

The deployment with real processes is in tests/test_deploy_edges.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message

from fedhier.clients.app import app as client_app
from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.placement import client_placement
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.edge.server import EdgeServer
from tests.helpers import metrics
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = RunConfig(dataset="digits", clients=9, groups=(3,), grouping="contiguous",
                 local_period=2, global_period=6,
                 rounds=3, batch_size=8, seed=5)
#: Averaging the edges' averages instead of all clients at once: float rounding only.
TOL = 1e-5


class EdgeServersApp:
    """The cloud grid's "ClientApp": node e is edge server e (as the edge process is)."""

    def __init__(self, servers: list[EdgeServer]) -> None:
        self.servers = servers
        self.down: set[int] = set()  # edges that do not answer (killed)

    def __call__(self, msg: Message, context) -> Message:
        edge = int(context.node_config["partition-id"])
        if edge in self.down:
            raise ConnectionError(f"edge {edge} is down")
        return Message(self.servers[edge].handle(msg), reply_to=msg)


def edge_tier_grid(cfg: RunConfig) -> tuple[InProcessGrid, EdgeServersApp]:
    """The cloud's grid of cfg.num_edges edge servers, each with its own clients' grid."""
    placement = client_placement(cfg)
    servers = []
    for edge in range(cfg.num_edges):
        clients = np.flatnonzero(placement == edge).tolist()
        grid = InProcessGrid(client_app, len(clients), seed=cfg.seed + 1 + edge,
                             partition_ids=clients, num_partitions=cfg.clients)
        servers.append(EdgeServer(edge, grid, clients))
    app = EdgeServersApp(servers)
    return InProcessGrid(app, cfg.num_edges, seed=cfg.seed), app  # type: ignore[arg-type]


def run_edge_tier(cfg: RunConfig, path) -> list[dict]:
    cfg = cfg.replace(edge_servers=True)
    grid, _ = edge_tier_grid(cfg)
    run_federation(grid, cfg, RunFolder.create(path, cfg), engine="edge servers (in-process)",
                   progress=False)
    return metrics(path)


CASES = {
    "plain": BASE,
    "random-grouping": BASE.replace(grouping="random", seed=8),
    "participation-faults-fednova": BASE.replace(participation=0.7, fail_rate=0.15,
                                                 straggler_fraction=0.4,
                                                 normalize_updates=True, momentum=0.5),
    "label-grouping-sim-time": BASE.replace(grouping="min-divergence", compute_spread=0.5,
                                            edge_slowdown="1:3", client_holdout=0.2),
    "fedadam-cloud": BASE.replace(cloud_strategy="fedadam", server_lr=0.01),
    "diagnostics": BASE.replace(diagnostics_every=1, rounds=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_edge_servers_equal_the_one_process_run(name, tmp_path):
    cfg = CASES[name]
    reference = run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    split = run_edge_tier(cfg, tmp_path / "edges")
    assert_same_runs(tmp_path / "ref", tmp_path / "edges", TOL)
    assert split[-1]["round"] == cfg.rounds and reference["rounds"] == cfg.rounds


def test_an_edge_that_misses_its_job_leaves_its_clients_out_of_that_round(tmp_path):
    cfg = BASE.replace(edge_servers=True, rounds=3)
    grid, app = edge_tier_grid(cfg)
    handle = app.servers[1].handle
    missed = []

    def flaky(msg):  # edge 1 is down for cloud round 2's job only
        if msg.metadata.message_type == "train" and int(msg.content["config"]["server-round"]) == 2:
            missed.append(2)
            raise ConnectionError("edge 1 is down")
        return handle(msg)

    app.servers[1].handle = flaky  # type: ignore[method-assign]
    run_federation(grid, cfg, RunFolder.create(tmp_path / "r", cfg), engine="edges",
                   progress=False)
    records = metrics(tmp_path / "r")
    assert missed == [2]
    assert records[2]["unreached_edges"] == [1]
    assert all("unreached_edges" not in r for r in (records[1], records[3]))
    edge_rounds = cfg.global_period // cfg.local_period
    assert records[2]["failed_clients"] == 3 * edge_rounds  # edge 1's three clients
    assert records[2]["failed_edges"] == edge_rounds
    assert records[3]["failed_clients"] == 0
    # the round went on with the other edges, and the run recovered
    assert records[3]["test_accuracy"] > records[0]["test_accuracy"]
    # edge 1's clients exchanged nothing in round 2: a third fewer client-edge messages
    per_round = [b["client_edge_messages"] - a["client_edge_messages"]
                 for a, b in zip(records, records[1:], strict=False)]
    assert per_round == [per_round[0], per_round[0] * 2 // 3, per_round[0]]


@pytest.mark.parametrize("change, message", [
    (dict(mobility_rate=0.1, groups=(3, 1), periods=(2, 6, 6), aggregators="clip"),
     "region rule"),  # moving clients under regions run: tests/test_region_moves.py
    (dict(regroup_every=2, groups=(3, 1), periods=(2, 6, 6)), "fixed grouping"),
])
def test_what_edge_servers_do_not_run_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        BASE.replace(edge_servers=True, **change).validate()


def test_the_other_engines_refuse_edge_servers(tmp_path):
    from fedhier.engines.registry import run_engine

    with pytest.raises(ConfigError, match="fedhier deploy local --edges"):
        run_engine(BASE.replace(edge_servers=True), RunFolder.create(tmp_path / "r"))


def test_clients_connected_where_the_grouping_does_not_put_them_are_refused(tmp_path):
    cfg = BASE.replace(edge_servers=True)
    grid, _ = edge_tier_grid(cfg)  # placed by the contiguous grouping
    refusal = "client 0 is connected to edge 0 but the 'random' grouping puts it under edge 1"
    with pytest.raises(ConfigError, match=refusal):
        run_federation(grid, cfg.replace(grouping="random", seed=8),
                       RunFolder.create(tmp_path / "r"), engine="edges", progress=False)
