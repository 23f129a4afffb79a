"""What the server tier used to refuse, run on servers: per-edge periods, a grouping by the
clients' gradients, and clients' kept optimizer state (with a resume). Each equals the
one-process run to 1e-5 through Flower messages on the nested in-process grids of
tests/test_deploy_regions.py (servers as message handlers, no sockets); the kept state across a
resume on fresh grids (fresh client runtimes, as after restarting every process) too.

Regrouping, mobility and asynchronous edges on servers are tested elsewhere.
"""

from __future__ import annotations

import pytest

from fedhier.engines.deployment.placement import tree_placement
from fedhier.engines.grid_run import run_federation
from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import interrupt_at_crash_point, metrics
from tests.test_deploy_regions import BASE, TOL, servers_grid
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENGINE = "servers (in-process)"


def run_both(cfg: RunConfig, root) -> None:
    """``cfg`` in one process (root/ref) and on servers (root/split)."""
    run_inprocess(cfg, RunFolder.create(root / "ref", cfg), progress=False)
    split = cfg.replace(edge_servers=True)
    run_federation(servers_grid(split), split, RunFolder.create(root / "split", split),
                   engine=ENGINE, progress=False)


@pytest.mark.parametrize("change", [
    dict(groups=(2,), periods=(2, 8), edge_periods="2,4", rounds=1),
    dict(edge_periods="2,4,4,2", normalize_updates=True, straggler_fraction=0.5,
         participation=0.75, fail_rate=0.1, compute_spread=0.5, edge_slowdown="1:3"),
], ids=["two-levels", "regions-fednova-faults-sim-time"])
def test_per_edge_periods_on_servers_equal_the_one_process_run(change, tmp_path):
    """Each edge aggregates its clients at its own period inside its job (every I_i divides
    the period above the edges, so a job holds whole periods of each edge); the cloud
    records each edge's aggregations as the one-process run does."""
    cfg = BASE.replace(**change)
    run_both(cfg, tmp_path)
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    records = metrics(tmp_path / "split")
    periods = [int(p) for p in cfg.edge_periods.split(",")]
    per_round = cfg.global_period // cfg.local_period
    assert records[-1]["edge_aggregations"] == [per_round * cfg.local_period // p
                                                for p in periods]


def test_a_gradient_grouping_on_servers_equals_the_one_process_run(tmp_path):
    """The deployment places each client by the clients' gradients at the initial model;
    the cloud collects the same gradients through the servers, groups by them and finds
    every client where it is connected (its set-up refuses any other placement)."""
    cfg = BASE.replace(grouping="gradient", rounds=1)
    edges, regions = tree_placement(cfg)
    contiguous = tree_placement(cfg.replace(grouping="contiguous"))[0]
    assert edges.tolist() != contiguous.tolist()  # the gradients placed the clients
    assert sorted(edges.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3] and len(regions) == 4
    run_both(cfg, tmp_path)
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)


KEEP = BASE.replace(momentum=0.9, optimizer_state="keep", checkpoint_every=1)


def test_kept_optimizer_state_on_servers_equals_the_one_process_run_and_resumes(
        tmp_path, monkeypatch):
    """Momentum stays with each client (its runtime's state) between edge rounds and
    jobs; a checkpoint gathers it through the servers and a resume on fresh grids (fresh
    client runtimes) puts it back through them: both runs equal the one-process run."""
    import fedhier.runs.driver as recorded_run
    from fedhier.runs.checkpoint import load_checkpoint
    monkeypatch.setattr("fedhier.runs.plots.plot_runs", lambda *args, **kwargs: None)
    run_both(KEEP, tmp_path)
    assert_same_runs(tmp_path / "ref", tmp_path / "split", TOL)
    reset = KEEP.replace(optimizer_state="reset")
    run_inprocess(reset, RunFolder.create(tmp_path / "reset", reset), progress=False)
    last = metrics(tmp_path / "split")[-1]["train_loss"]
    assert abs(metrics(tmp_path / "reset")[-1]["train_loss"] - last) > 1e-3  # state matters

    split = KEEP.replace(edge_servers=True)
    interrupt = interrupt_at_crash_point(6)  # round 2's record
    with monkeypatch.context() as patch:
        patch.setattr(recorded_run, "crash_point", interrupt)
        with pytest.raises(KeyboardInterrupt):
            run_federation(servers_grid(split), split,
                           RunFolder.create(tmp_path / "resumed", split), engine=ENGINE,
                           progress=False)
    resume = load_checkpoint(tmp_path / "resumed")
    assert resume.round == 1 and sorted(resume.client_states) == list(range(KEEP.clients))
    run_federation(servers_grid(split), split, RunFolder.claim_existing(tmp_path / "resumed"),
                   engine=ENGINE, progress=False, resume=resume)
    assert_same_runs(tmp_path / "ref", tmp_path / "resumed", TOL)
