"""Engine ``vectorized-ray`` with asynchronous edges (fedhier.engines.vectorized_ray.asynchrony):
the cloud of asynchronous edge servers over the shard actors, the reports taken in the
simulated clock's order, gives ``--engine vectorized --async-buffer K`` to 1e-6 and
``--engine inprocess`` to 1e-5, on the session's two-node Ray cluster (tests/ray_cluster.py).
A slow edge and a small staleness bound make the order matter: reports are stale, one is
dropped, and a worker runs jobs of its edges that started at different cloud rounds.
"""

from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.engines.vectorized_ray.asynchrony import with_batch_losses
from fedhier.engines.vectorized_ray.engine import check_sharded, run_vectorized_ray
from fedhier.round.tiers.jobs import EdgeReport
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_refused, metrics
from tests.test_faults import run_interrupted_at
from tests.test_vectorized import final_state
from tests.test_vectorized_ray import EXACT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: 8 clients on 4 edges (two per worker), K = 2, S = 1; edges 0 and 1 slow (x8, x3).
CFG = RunConfig(dataset="digits", clients=8, groups=(4,), grouping="contiguous",
                local_period=2, global_period=4, rounds=5, batch_size=8, seed=11,
                participation=0.75, fail_rate=0.2, async_buffer=2, max_staleness=1,
                edge_slowdown="0:8,1:3", engine="vectorized-ray", ray_workers=2)


def assert_close_runs(reference: Path, other: Path, tol: float, exact=EXACT) -> None:
    """Same records: the ``exact`` keys and the lists (async_reports) equal, every other
    number within ``tol`` (relative above 1)."""
    ref, got = metrics(reference), metrics(other)
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key == "wall_seconds":
                continue
            if key in exact or a[key] is None or b[key] is None \
                    or not isinstance(a[key], (int, float)):
                assert a[key] == b[key], (a["round"], key)
            else:
                assert abs(a[key] - b[key]) <= tol * max(1.0, abs(a[key])), (
                    a["round"], key, a[key], b[key])


@pytest.fixture(scope="module")
def sharded(ray_cluster, tmp_path_factory):
    """One asynchronous sharded run on the two-node cluster: (its folder, its summary)."""
    path = tmp_path_factory.mktemp("async-ray") / "ray"
    summary = run_vectorized_ray(CFG.replace(ray_address=ray_cluster),
                                 RunFolder.create(path), progress=False)
    return path, summary


def test_equals_the_vectorized_engine(sharded, tmp_path):
    path, summary = sharded
    run_vectorized(CFG.replace(engine="vectorized"), RunFolder.create(tmp_path / "one"),
                   progress=False)
    assert_close_runs(tmp_path / "one", path, 1e-6)
    records = metrics(path)[1:]
    stale = [s for r in records for _, s in r["async_reports"]]
    assert max(stale) == 1 and sum(r["stale_dropped"] for r in records) == 2
    workers = summary["sharding"]["workers"]
    assert [w["clients"] for w in workers] == [4, 4]
    assert len({w["node"] for w in workers}) == 2


def test_equals_the_inprocess_engine(sharded, tmp_path):
    run_inprocess(CFG.replace(engine="inprocess"), RunFolder.create(tmp_path / "plain"),
                  progress=False)
    assert_close_runs(tmp_path / "plain", sharded[0], 1e-5)


def test_per_edge_periods_equal_the_vectorized_engine(ray_cluster, tmp_path):
    """Per-edge periods I = 1, 2, 1, 2 with the asynchronous edges, every client a
    straggler (edge rounds where only carried models wait for an edge's period to end): each
    job holds whole periods of its edge (run on its worker as an edge server runs it), the
    records' ``edge_aggregations`` and the model are the one-process engine's; the periods
    matter (every I = 2 ends elsewhere) and reports are stale."""
    cfg = CFG.replace(edge_periods="1,2,1,2", local_period=1, straggler_fraction=1.0)
    path = tmp_path / "ray"
    run_vectorized_ray(cfg.replace(ray_address=ray_cluster), RunFolder.create(path),
                       progress=False)
    one = cfg.replace(engine="vectorized")
    run_vectorized(one, RunFolder.create(tmp_path / "one"), progress=False)
    assert_close_runs(tmp_path / "one", path, 1e-6)
    records = metrics(path)[1:]
    assert max(s for r in records for _, s in r["async_reports"]) == 1
    assert [r["edge_aggregations"] for r in records] == [[4, 2, 4, 2]] * cfg.rounds
    run_vectorized(one.replace(edge_periods="2,2,2,2"), RunFolder.create(tmp_path / "equal"),
                   progress=False)
    periods, equal = final_state(path), final_state(tmp_path / "equal")
    assert max(float((periods[k] - equal[k]).abs().max()) for k in periods) > 1e-4


def test_a_submission_reports_its_batch_losses_once():
    """Two shards' per-edge-round (mean, weight) rows: one weighted mean per round."""
    reports = [EdgeReport(2, None, np.array([[1.0, 1.0], [0.0, 0.0]])),
               EdgeReport(0, None, np.array([[4.0, 2.0], [5.0, 3.0]]))]
    first, second = with_batch_losses(reports)
    np.testing.assert_allclose(first.losses, [[3.0, 3.0], [5.0, 3.0]])
    assert first.edge == 2 and not second.losses.any()


@pytest.mark.parametrize("change, message", [
    ({"mobility_rate": 0.2}, "engine vectorized-ray with async_buffer needs static clients "
     "(no mobility, no regroup_every): jobs in flight keep their clients"),
    ({"regroup_every": 2}, "engine vectorized-ray with async_buffer needs static clients "
     "(no mobility, no regroup_every): jobs in flight keep their clients"),
    ({"periods": (2, 4, 8), "groups": (4, 2)}, "engine vectorized-ray with async_buffer "
     "needs two levels (no --regions): the regions' buffers run in the simulation only "
     "(region_buffer)"),
    ({"momentum": 0.9, "optimizer_state": "keep"}, "engine vectorized-ray with async_buffer "
     "needs optimizer_state=reset: a checkpoint's jobs in flight run again on --resume, from "
     "kept state that already holds their training"),
])
def test_what_async_edges_do_not_shard_is_refused_in_one_line(change, message):
    assert_refused(lambda: check_sharded(CFG.replace(**change)), message)


def test_an_interrupted_run_resumes_bit_identically(sharded, ray_cluster, tmp_path,
                                                    monkeypatch):
    """Ctrl-C while round 3 is recorded: the checkpoint holds received jobs only (their
    reports and weights), and --resume ends where the uninterrupted run ends."""
    args = ["run", "--dataset", "digits", "--clients", "8", "--groups", "4", "--grouping",
            "contiguous", "--local-period", "2", "--global-period", "4", "--rounds", "5",
            "--batch-size", "8", "--seed", "11", "--participation", "0.75", "--fail-rate",
            "0.2", "--async-buffer", "2", "--max-staleness", "1", "--edge-slowdown",
            "0:8,1:3", "--engine", "vectorized-ray", "--ray-workers", "2", "--ray-address",
            ray_cluster, "--no-progress"]
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(3, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    whole, resumed = metrics(sharded[0]), metrics(stopped)
    assert [r["round"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    for a, b in zip(whole, resumed, strict=True):
        assert {k: v for k, v in a.items() if k != "wall_seconds"} == {
            k: v for k, v in b.items() if k != "wall_seconds"}
