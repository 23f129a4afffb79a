"""Clients that move between edge servers under region servers (fedhier.edge_moves with
`--edges 4 --regions 2`): the split round, with moved clients re-attached to their new edges
(some under the other region), equals the simulated mobile run (inprocess) to 1e-5, both
handoffs, on nested in-process grids (no sockets; a client's node moves from one edge's grid
to another's). What regions cannot follow is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhier.config import RunConfig
from fedhier.engines.deployment import reattach as reattach_module
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.errors import ConfigError
from fedhier.run_folder import RunFolder
from tests.helpers import metrics
from tests.test_deploy_mobility import InProcessReattacher, without_handoffs
from tests.test_deploy_regions import servers_grid
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 8 clients, 4 edges, 2 regions (edges 0, 1 under region 0; 2, 3 under region 1); edges
#: aggregate every 2 steps, regions every 4, the cloud every 8: 4 edge rounds per cloud
#: round, a region period of 2; moves land inside region periods and cross regions.
BASE = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8),
                 grouping="contiguous", rounds=2, batch_size=8, seed=5, mobility_rate=0.6)
TOL = 1e-5


def run_moving(cfg: RunConfig, path: Path, monkeypatch) -> InProcessReattacher:
    cfg = cfg.replace(edge_servers=True)
    grid = servers_grid(cfg)
    edges = [e for region in grid.client_app.servers  # type: ignore[attr-defined]
             for e in region.grid.client_app.servers]
    mover = InProcessReattacher([e.grid for e in sorted(edges, key=lambda e: e.edge)])
    monkeypatch.setattr(reattach_module, "reattacher_from_env", lambda: mover)
    run_federation(grid, cfg, RunFolder.create(path, cfg), engine="servers (in-process)",
                   progress=False)
    return mover


@pytest.mark.parametrize("change", [
    {},
    dict(handoff="carry", participation=0.7, fail_rate=0.15, compute_spread=0.5),
], ids=["fresh", "carry-faults-sim-time"])
def test_moving_clients_under_regions_equal_the_simulated_mobile_run(change, tmp_path,
                                                                    monkeypatch):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    run_moving(cfg, tmp_path / "split", monkeypatch)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    moves = [m for r in metrics(tmp_path / "ref") for m in r.get("moves", [])]
    region = np.array([0, 0, 1, 1])
    assert any(region[m[2]] != region[m[3]] for m in moves)  # a move crosses regions
    assert any((m[0] - 1) % 2 for m in moves)  # one inside a region period
    assert any((m[0] - 1) % 4 for m in moves)  # one inside a cloud round
    recorded = [[h["edge_round"], h["client"], h["from"], h["to"]] for r in handoffs
                for h in r]
    assert recorded == moves
    carried = [h["bytes"] > 0 for r in handoffs for h in r]
    assert carried == [cfg.handoff == "carry" and bool((m[0] - 1) % 4) for m in moves]


@pytest.mark.parametrize("change, message", [
    (dict(regroup_every=1, mobility_rate=0.0, grouping="random"), "fixed grouping"),
    (dict(aggregators="mean,clip,mean"), "region rule"),
])
def test_what_regions_cannot_follow_is_refused_in_one_line(change, message):
    """A regrouping re-draws the edges' regions (region servers are fixed); a region rule
    measured from the region's own model would need its last aggregate in every job."""
    with pytest.raises(ConfigError, match=message):
        BASE.replace(edge_servers=True, **change).validate()
