"""Clients that move between edge servers (fedhier.edge_moves): the split round with clients
re-attached to their new edges equals the simulated mobile run (inprocess), both handoffs,
regrouping too; first on in-process grids (a client's node moves from one edge's grid to
another's), then on real processes (`fedhier deploy local --edges 2 --mobility-rate`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context

from fedhier.config import RunConfig
from fedhier.engines.deployment import reattach as reattach_module
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.run_folder import RunFolder
from tests.helpers import metrics
from tests.test_edge_tier import edge_tier_grid
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 6 clients at 2 edges, 3 edge rounds per cloud round: moves land inside the cloud round.
BASE = RunConfig(dataset="digits", clients=6, groups=(2,), grouping="contiguous",
                 local_period=2, global_period=6, rounds=3, batch_size=8, seed=5,
                 mobility_rate=0.5)
TOL = 1e-5


class InProcessReattacher:
    """Moves a client's node from its edge's in-process grid to its new edge's, under a new
    node id (as a SuperNode restarted at another SuperLink gets one)."""

    def __init__(self, grids: list[InProcessGrid]) -> None:
        self.grids = grids
        self.calls: list[dict[int, int]] = []
        self._next_id = 10**6

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        self.calls.append(dict(moves))
        for client, edge in moves.items():
            (grid, node), = [(g, n) for g in self.grids for n, c in g.contexts.items()
                             if c.node_config["partition-id"] == client]
            old = grid.contexts.pop(node)
            self._next_id += 1
            self.grids[edge].contexts[self._next_id] = Context(
                run_id=old.run_id, node_id=self._next_id, node_config=old.node_config,
                state=old.state, run_config=old.run_config)
        return {c: 0.0 for c in moves}


def run_moving(cfg: RunConfig, path: Path, monkeypatch) -> InProcessReattacher:
    cfg = cfg.replace(edge_servers=True)
    grid, app = edge_tier_grid(cfg)
    mover = InProcessReattacher([s.grid for s in app.servers])  # type: ignore[misc]
    monkeypatch.setattr(reattach_module, "reattacher_from_env", lambda: mover)
    run_federation(grid, cfg, RunFolder.create(path, cfg), engine="edge servers (in-process)",
                   progress=False)
    return mover


def without_handoffs(path: Path) -> list[list[dict]]:
    """Drop the measured handoff records (the simulation has none); returns them."""
    lines = (path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    handoffs = [r.pop("handoffs", []) for r in records]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return handoffs


@pytest.mark.parametrize("change", [
    {},
    dict(handoff="carry"),
    dict(handoff="carry", participation=0.7, fail_rate=0.15, compute_spread=0.5),
    dict(mobility_rate=0.0, regroup_every=1, grouping="random"),
], ids=["fresh", "carry", "carry-faults-sim-time", "regroup"])
def test_moving_clients_equal_the_simulated_mobile_run(change, tmp_path, monkeypatch):
    cfg = BASE.replace(**change)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    mover = run_moving(cfg, tmp_path / "split", monkeypatch)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    ref = metrics(tmp_path / "ref")
    moves = [m for r in ref for m in r.get("moves", [])]
    if cfg.regroup_every:
        assert mover.calls and not moves  # regrouping re-attaches at cloud-round starts
        return
    assert moves and any((m[0] - 1) % 3 for m in moves)  # some inside a cloud round
    # every move of the simulation, re-attached once, in order
    recorded = [[h["edge_round"], h["client"], h["from"], h["to"]] for r in handoffs
                for h in r]
    assert recorded == moves
    assert [len(c) for c in mover.calls] == [
        len([m for m in moves if m[0] == k]) for k in sorted({m[0] for m in moves})]
    model_bytes = ref[-1]["client_edge_bytes"] // ref[-1]["client_edge_messages"]
    carried = [h["bytes"] for r in handoffs for h in r]
    if cfg.handoff == "carry":  # a model moves unless the move is at a cloud start
        assert carried == [model_bytes if (h[0] - 1) % 3 else 0 for h in moves]
    else:
        assert carried == [0] * len(moves)


def test_edge_models_follow_segments_not_the_cloud(tmp_path, monkeypatch):
    """Without moves a mobile run's edge jobs are whole cloud rounds (nothing re-attached)."""
    cfg = BASE.replace(mobility_rate=0.0, mobility_trace="", regroup_every=0)
    mover = run_moving(cfg, tmp_path / "split", monkeypatch)
    assert mover.calls == []
    assert np.isfinite(metrics(tmp_path / "split")[-1]["test_loss"])
