"""Moving clients keep their optimizer state on servers (fedhier.round.tiers.moves.moved_states): a
client that re-attaches to another edge (its SuperNode restarts there, in that edge's run,
with an empty ``context.state``) gets its momentum back from its old edge through the cloud
(``query.state`` before the re-attach, the new edge's job, ``query.restore`` before it
trains), so the split run equals the simulated mobile run with ``--optimizer-state keep``
to 1e-5: both handoffs, participation < 1, under regions too, on the nested in-process grids
of tests/test_deploy_mobility.py and tests/test_region_moves.py (no sockets). Without the
state moved the run differs: the state did travel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhier.engines.inprocess import run_inprocess
from fedhier.round.tiers import moves as edge_moves
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_deploy_mobility import BASE as TWO_LEVELS
from tests.test_deploy_mobility import without_handoffs
from tests.test_region_moves import BASE as REGIONS
from tests.test_region_moves import run_moving
from tests.test_vectorized import assert_same_runs, final_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-5
KEEP = dict(momentum=0.9, optimizer_state="keep", participation=0.7)
#: 6 clients at 2 edges (0-2, 3-5), 3 edge rounds per cloud round: moves inside cloud
#: round 1, at cloud round 2's start, and back inside it
TRACE = "edge_round,client,edge\n2,0,1\n3,4,0\n4,3,0\n5,0,0\n5,4,1\n"


def trace_config(tmp_path: Path, handoff: str) -> RunConfig:
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    return TWO_LEVELS.replace(mobility_rate=0.0, mobility_trace=str(trace), handoff=handoff,
                              **KEEP)


def run_and_compare(cfg: RunConfig, root: Path, monkeypatch) -> list[list[dict]]:
    """``cfg`` in one process (root/ref) and on servers (root/split), equal to ``TOL``;
    returns the servers' handoff records per cloud round."""
    run_inprocess(cfg, RunFolder.create(root / "ref", cfg), progress=False)
    run_moving(cfg, root / "split", monkeypatch)
    handoffs = without_handoffs(root / "split")
    assert_same_runs(root / "ref", root / "split", TOL)
    if cfg.regroup_every:  # re-attached at cloud-round starts, no "moves" records
        return handoffs
    moves = [m for r in metrics(root / "ref") for m in r.get("moves", [])]
    recorded = [[h["edge_round"], h["client"], h["from"], h["to"]] for r in handoffs
                for h in r]
    assert moves and recorded == moves
    return handoffs


def largest_difference(a: Path, b: Path) -> float:
    fa, fb = final_state(a), final_state(b)
    return max(float((fa[k] - fb[k]).abs().max()) for k in fa)


@pytest.mark.parametrize("handoff", ["carry", "fresh"])
def test_kept_state_moves_with_its_client_between_edge_servers(handoff, tmp_path,
                                                               monkeypatch):
    """Two levels, a trace (moves inside a cloud round and at its start), momentum 0.9
    kept, participation 0.7: equal to the simulation; each move records its state's bytes
    (momentum: one float32 per parameter once the client has trained, 0 before)."""
    cfg = trace_config(tmp_path, handoff)
    handoffs = run_and_compare(cfg, tmp_path, monkeypatch)
    state_bytes = [h["state_bytes"] for r in handoffs for h in r]
    momentum = 4 * sum(t.numel() for t in final_state(tmp_path / "ref").values())  # float32
    assert any(state_bytes) and set(state_bytes) <= {0, momentum}, (state_bytes, momentum)
    if handoff == "fresh":
        return
    # the state really moved: dropped at every move, the run is another one
    monkeypatch.setattr(edge_moves, "moved_states", lambda executor, clients: {})
    run_moving(cfg, tmp_path / "dropped", monkeypatch)
    assert largest_difference(tmp_path / "ref", tmp_path / "dropped") > 1e-4


def test_kept_state_moves_with_a_regrouping(tmp_path, monkeypatch):
    """A regrouping every cloud round re-attaches clients at its start: their state comes
    along (two levels; regions refuse a regrouping)."""
    cfg = TWO_LEVELS.replace(mobility_rate=0.0, regroup_every=1, grouping="random", **KEEP)
    handoffs = run_and_compare(cfg, tmp_path, monkeypatch)
    assert any(h["state_bytes"] for r in handoffs for h in r)


def test_kept_state_moves_through_region_servers(tmp_path, monkeypatch):
    """``--groups 4,2 --periods 1,2,4``: a mover's state passes through the region servers
    (the cloud's job to the new edge's region, the region's job to the edge), across
    regions and inside region periods too; dropped at the moves, the run differs."""
    cfg = REGIONS.replace(periods=(1, 2, 4), handoff="carry", **KEEP)
    handoffs = run_and_compare(cfg, tmp_path, monkeypatch)
    moves = [[h["edge_round"], h["from"], h["to"], h["state_bytes"]] for r in handoffs
             for h in r]
    region = np.array([0, 0, 1, 1])
    assert any(region[f] != region[t] and b for _, f, t, b in moves)  # state across regions
    assert any((r - 1) % 2 and b for r, _, _, b in moves)  # inside a region period
    monkeypatch.setattr(edge_moves, "moved_states", lambda executor, clients: {})
    run_moving(cfg, tmp_path / "dropped", monkeypatch)  # without it: another run
    assert largest_difference(tmp_path / "ref", tmp_path / "dropped") > 1e-4


def test_a_resumed_run_moves_the_restored_state(tmp_path, monkeypatch):
    """Stopped after cloud round 1 (a checkpoint every round, the clients' state gathered
    through the servers), resumed on fresh grids (every client back at its first edge, its
    state restored there): the displaced clients re-attach with that state and the run
    equals the uninterrupted simulation."""
    import fedhier.runs.driver as recorded_run
    from fedhier.engines.grid_run import run_federation
    from fedhier.runs.checkpoint import load_checkpoint
    from tests.helpers import interrupt_at_crash_point
    from tests.test_region_moves import moving_grid

    monkeypatch.setattr("fedhier.runs.plots.plot_runs", lambda *args, **kwargs: None)
    cfg = trace_config(tmp_path, "carry").replace(checkpoint_every=1)
    run_inprocess(cfg, RunFolder.create(tmp_path / "ref", cfg), progress=False)
    split = cfg.replace(edge_servers=True)
    with monkeypatch.context() as patch:
        patch.setattr(recorded_run, "crash_point", interrupt_at_crash_point(6))
        grid, _ = moving_grid(split, patch)
        with pytest.raises(KeyboardInterrupt):
            run_federation(grid, split, RunFolder.create(tmp_path / "split", split),
                           engine="servers (in-process)", progress=False)
    resume = load_checkpoint(tmp_path / "split")
    assert resume.round == 1 and resume.client_states
    grid, mover = moving_grid(split, monkeypatch)
    run_federation(grid, split, RunFolder.claim_existing(tmp_path / "split"),
                   engine="servers (in-process)", progress=False, resume=resume)
    handoffs = without_handoffs(tmp_path / "split")
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    # after round 1 clients 0 and 4 are at edges 1 and 0; client 3 moves at round 2's start
    assert mover.calls[0] == {0: 1, 3: 0, 4: 0}
    assert any(h["state_bytes"] for h in handoffs[2] if h["edge_round"] == 4)
