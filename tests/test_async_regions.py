"""Asynchronous regions (--region-buffer): exact reductions, equal engines, resume and
one-line errors. The oracle case is tests/test_oracle.py::test_async_regions_*."""

import pytest

from fedhier.cli.commands import main
from fedhier.settings.run_config import RunConfig
from tests.test_async_edges import ASYNC_KEYS, RUNNERS, run
from tests.test_faults import _same_final, run_interrupted_at
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = RunConfig(dataset="digits", clients=8, groups=(4, 2), grouping="contiguous",
                 periods=(2, 4, 8), local_period=2, global_period=8, rounds=3, batch_size=8,
                 seed=7, model="logreg")


def _without(records, keys):
    return [{k: v for k, v in r.items() if k not in keys} for r in records]


def test_regions_waiting_for_every_child_are_synchronous_h_sgd_bit_for_bit(tmp_path):
    """K_r = 0 (all of a region's children) and the cloud waiting for every region: the
    synchronous round, model, losses, traffic and sim_seconds included."""
    cfg = BASE.replace(participation=0.75, fail_rate=0.2, momentum=0.5,
                       optimizer_state="keep", compute_spread=0.5)
    sync = run(cfg, tmp_path / "sync")
    regions = run(cfg.replace(region_buffer=(0,)), tmp_path / "regions")
    assert _without(sync, ASYNC_KEYS) == _without(regions, ASYNC_KEYS)
    assert all(s == 0 for r in regions[1:] for _, s in r["async_reports"])
    assert _same_final(tmp_path / "sync", tmp_path / "regions")


def test_one_edge_per_region_is_the_cloud_only_buffer_bit_for_bit(tmp_path):
    """A region whose K_r is its one child relays: --region-buffer 1 with the cloud's K over
    the regions is today's --async-buffer K over the edges, reports and staleness included."""
    cfg = BASE.replace(groups=(4, 4), async_buffer=2, edge_slowdown="0:4", rounds=4)
    cloud_only = run(cfg, tmp_path / "cloud")
    regions = run(cfg.replace(region_buffer=(1,)), tmp_path / "regions")
    assert _without(cloud_only, {"wall_seconds"}) == _without(regions, {"wall_seconds"})
    assert max(s for r in regions[1:] for _, s in r["async_reports"]) >= 1
    assert _same_final(tmp_path / "cloud", tmp_path / "regions")


def test_engines_agree_with_buffering_regions(tmp_path):
    cfg = BASE.replace(region_buffer=(1,), edge_slowdown="2:3,3:2", participation=0.8,
                       fail_rate=0.1, momentum=0.5, optimizer_state="keep", rounds=4)
    records = run(cfg, tmp_path / "inprocess")
    run(cfg, tmp_path / "vectorized", "vectorized")
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", 1e-5)
    # every aggregation: one edge report from each region, some of them stale
    assert all(sorted(e // 2 for e, _ in r["async_reports"]) == [0, 1] for r in records[1:])
    assert max(s for r in records[1:] for _, s in r["async_reports"]) >= 1


def test_an_interrupted_run_with_held_reports_resumes_bit_identically(tmp_path, monkeypatch):
    args = ["run", "--clients", "8", "--groups", "4,2", "--grouping", "contiguous",
            "--periods", "2,4,8", "--model", "logreg", "--rounds", "5", "--region-buffer", "1",
            "--max-staleness", "2", "--edge-slowdown", "2:3,3:2", "--momentum", "0.5",
            "--optimizer-state", "keep", "--engine", "vectorized", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(3, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    assert _same_final(tmp_path / "reference", stopped)
    from tests.helpers import metrics

    ref, res = metrics(tmp_path / "reference"), metrics(stopped)
    for key in ("test_loss", "sim_seconds", "async_reports", "stale_dropped",
                "edge_cloud_bytes"):
        assert [r.get(key) for r in ref] == [r.get(key) for r in res], key


THREE = ["--groups", "4,2", "--periods", "2,4,8"]


@pytest.mark.parametrize("flags,message", [
    (["--groups", "4", "--region-buffer", "1"], "3+ levels"),
    ([*THREE, "--region-buffer", "1,1"], "one K per level"),
    ([*THREE, "--region-buffer", "3"], "more than the 2 children"),
    ([*THREE, "--region-buffer", "-1"], ">= 0"),
    ([*THREE, "--region-buffer", "1", "--async-buffer", "3"], "cloud's 2 children"),
])
def test_bad_region_buffers_are_one_line_errors_before_any_work(flags, message, tmp_path,
                                                                capsys):
    out = tmp_path / "never"
    assert main(["run", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not out.exists()


assert set(RUNNERS) == {"inprocess", "vectorized"}
