"""Clients that move between edge servers under region servers (fedhier.round.tiers.moves with
`--edges 4 --regions 2`): the split round, with moved clients re-attached to their new edges
(some under the other region), equals the simulated mobile run (inprocess) to 1e-5, both
handoffs, on nested in-process grids (no sockets; a client's node moves from one edge's grid
to another's). What regions cannot follow is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment import reattach as reattach_module
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import interrupt_at_crash_point, metrics
from tests.test_deploy_mobility import BASE as TWO_LEVELS
from tests.test_deploy_mobility import InProcessReattacher, without_handoffs
from tests.test_deploy_regions import servers_grid
from tests.test_edge_tier import edge_tier_grid
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 8 clients, 4 edges, 2 regions (edges 0, 1 under region 0; 2, 3 under region 1); edges
#: aggregate every 2 steps, regions every 4, the cloud every 8: 4 edge rounds per cloud
#: round, a region period of 2; moves land inside region periods and cross regions.
BASE = RunConfig(dataset="digits", clients=8, groups=(4, 2), periods=(2, 4, 8),
                 grouping="contiguous", rounds=2, batch_size=8, seed=5, mobility_rate=0.6)
TOL = 1e-5


def moving_grid(cfg: RunConfig, monkeypatch) -> tuple[InProcessGrid, InProcessReattacher]:
    """The cloud's grid of servers (regions, when ``cfg`` has three levels) and the
    re-attacher that moves clients between its edges' grids."""
    if len(cfg.periods) > 2:
        grid = servers_grid(cfg)
        edges = list(grid.client_app.servers)  # type: ignore[attr-defined]
        while edges[0].level > 1:  # down the tree to the edges
            edges = [e for node in edges for e in node.grid.client_app.servers]
    else:
        grid, app = edge_tier_grid(cfg)
        edges = list(app.servers)
    mover = InProcessReattacher([e.grid for e in sorted(edges, key=lambda e: e.edge)])
    monkeypatch.setattr(reattach_module, "reattacher_from_env", lambda: mover)
    return grid, mover


def run_moving(cfg: RunConfig, path: Path, monkeypatch) -> InProcessReattacher:
    cfg = cfg.replace(edge_servers=True)
    grid, mover = moving_grid(cfg, monkeypatch)
    run_federation(grid, cfg, RunFolder.create(path, cfg), engine="servers (in-process)",
                   progress=False)
    return mover


@pytest.mark.parametrize("change", [
    {},
    dict(handoff="carry", participation=0.7, fail_rate=0.15, compute_spread=0.5),
    # 4 clients at 4 edges: region 0's clients both leave (it aggregates nothing, its edges
    # still exchange with it) -- the real-process run of docs/deployment.md
    dict(clients=4, periods=(1, 2, 4), rounds=1, seed=4, handoff="carry",
         compute_spread=0.5),
    dict(groups=(4, 2, 1), periods=(2, 4, 8, 16), rounds=1, handoff="carry"),
], ids=["fresh", "carry-faults-sim-time", "a-region-emptied", "four-levels-carry"])
def test_moving_clients_under_regions_equal_the_simulated_mobile_run(change, tmp_path,
                                                                    monkeypatch):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    run_moving(cfg, tmp_path / "split", monkeypatch)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    moves = [m for r in metrics(tmp_path / "ref") for m in r.get("moves", [])]
    region = np.array([0, 0, 1, 1])
    span, per = cfg.periods[1] // cfg.periods[0], cfg.global_period // cfg.local_period
    assert any(region[m[2]] != region[m[3]] for m in moves)  # a move crosses regions
    assert any((m[0] - 1) % span for m in moves)  # one inside a region period
    recorded = [[h["edge_round"], h["client"], h["from"], h["to"]] for r in handoffs
                for h in r]
    assert recorded == moves
    carried = [h["bytes"] > 0 for r in handoffs for h in r]
    assert carried == [cfg.handoff == "carry" and bool((m[0] - 1) % per) for m in moves]


@pytest.mark.parametrize("change, message", [
    (dict(regroup_every=1, mobility_rate=0.0, grouping="random"), "fixed grouping"),
    (dict(aggregators="mean,clip,mean"), "region rule"),
])
def test_what_regions_cannot_follow_is_refused_in_one_line(change, message):
    """A regrouping re-draws the edges' regions (region servers are fixed); a region rule
    measured from the region's own model would need its last aggregate in every job."""
    with pytest.raises(ConfigError, match=message):
        BASE.replace(edge_servers=True, **change).validate()


@pytest.mark.parametrize("cfg", [TWO_LEVELS.replace(handoff="carry"), BASE],
                         ids=["two-levels-carry", "regions-fresh"])
def test_a_resumed_mobile_run_equals_the_uninterrupted_one(cfg, tmp_path, monkeypatch):
    """Stopped after cloud round 1 (a checkpoint every round), resumed on fresh grids (every
    client back at its first edge): the resumed run re-attaches the clients that moved to
    where the checkpoint's tree puts them and equals the simulated mobile run."""
    import fedhier.runs.driver as recorded_run
    from fedhier.runs.checkpoint import load_checkpoint
    monkeypatch.setattr("fedhier.runs.plots.plot_runs", lambda *args, **kwargs: None)
    cfg = cfg.replace(checkpoint_every=1)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    split = cfg.replace(edge_servers=True)
    interrupt = interrupt_at_crash_point(6)  # round 2's record
    with monkeypatch.context() as patch:
        patch.setattr(recorded_run, "crash_point", interrupt)
        grid, _ = moving_grid(split, patch)
        with pytest.raises(KeyboardInterrupt):
            run_federation(grid, split, RunFolder.create(tmp_path / "split", split),
                           engine="servers (in-process)", progress=False)
    resume = load_checkpoint(tmp_path / "split")
    assert resume.round == 1
    grid, mover = moving_grid(split, monkeypatch)  # fresh grids: clients at their first edges
    run_federation(grid, split, RunFolder.claim_existing(tmp_path / "split"),
                   engine="servers (in-process)", progress=False, resume=resume)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    ref = metrics(tmp_path / "ref")
    first = np.array(json.loads((tmp_path / "ref" / "groups.json").read_text())
                     ["client_to_edge"])  # where the fresh grids start every client
    start = cfg.global_period // cfg.local_period + 1  # round 2's first edge round
    target = np.array(ref[1]["client_to_edge"])  # the checkpoint's tree ...
    for _, client, _, edge in [m for m in ref[2].get("moves", []) if m[0] == start]:
        target[client] = edge  # ... and round 2's moves at its start
    displaced = {int(c): int(target[c]) for c in np.flatnonzero(target != first)}
    assert displaced and mover.calls[0] == displaced  # re-attached before round 2 trains
    assert [h["client"] for h in handoffs[2] if h["edge_round"] == start] == sorted(displaced)
