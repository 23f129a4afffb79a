"""``--engine flower --edge-servers``: the Simulation Engine's nodes are edge servers
(fedhier.engines.flower_edges), equal to the one-process run to 1e-5 (the rounding of
averaging the edges' averages, as tests/test_edge_tier.py)."""

from __future__ import annotations

import json
import socket

import pytest

from fedhier.common.errors import ConfigError
from fedhier.engines.flower_edges import edge_node_app, simulation_nodes
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_same_run, metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = RunConfig(dataset="digits", clients=6, groups=2, local_period=2, global_period=4,
                  rounds=2, batch_size=8, seed=11, grouping="random")
TOL = 1e-5


@pytest.mark.slow
def test_edge_nodes_on_the_simulation_engine_equal_inprocess(tmp_path):
    from fedhier.engines.flower import run_simulation_engine

    cfg = SMALL.replace(participation=0.7, fail_rate=0.2)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_simulation_engine(cfg.replace(engine="flower", edge_servers=True),
                          RunFolder.create(tmp_path / "flower"), progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "flower", cfg.rounds, TOL)
    records = metrics(tmp_path / "flower")
    assert sum(r["failed_clients"] for r in records) > 0  # the faults were drawn alike
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["engine"] == "flower"


def test_regions_as_nodes_equal_inprocess(tmp_path):
    """A deeper tree: the nodes are regions, each with its edge servers and their clients on
    in-process grids (the same ClientApp, without Ray)."""
    cfg = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8), rounds=2,
                    batch_size=8, seed=3, grouping="contiguous")
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    app, nodes = simulation_nodes(cfg.replace(edge_servers=True))
    assert (app, nodes) == (edge_node_app, 2)
    grid = InProcessGrid(edge_node_app, nodes, seed=cfg.seed)
    run_federation(grid, cfg.replace(edge_servers=True, engine="flower"),
                   RunFolder.create(tmp_path / "regions"), engine="flower", progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "regions", cfg.rounds, TOL)


def test_an_unreachable_ray_address_is_refused_in_one_line(tmp_path):
    from fedhier.engines.flower import run_simulation_engine

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(ConfigError, match="no Ray cluster answers"):
        run_simulation_engine(SMALL.replace(engine="flower", edge_servers=True,
                                            ray_address=f"127.0.0.1:{port}"),
                              RunFolder.create(tmp_path / "r"), progress=False)


def test_the_engine_registry_lets_flower_run_edge_servers_only():
    from fedhier.engines.registry import run_engine

    with pytest.raises(ConfigError, match="--engine flower"):
        run_engine(SMALL.replace(edge_servers=True, engine="vectorized"), None)


@pytest.mark.parametrize("change, message", [
    (dict(momentum=0.9, optimizer_state="keep"), "optimizer state"),
    (dict(mobility_rate=0.1), "no mobility"),
    (dict(regroup_every=1), "no regroup_every"),
    (dict(async_buffer=1), "synchronous edges only"),
])
def test_what_edge_nodes_do_not_run_is_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        simulation_nodes(SMALL.replace(engine="flower", edge_servers=True, **change))
