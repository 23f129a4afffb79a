"""Asynchronous, buffered edges: exact reduction to synchronous H-SGD, equal engines, the
staleness rule, resume, and one-line errors."""

import json
import math

import numpy as np
import pytest
import torch

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.round.asynchrony.edges import EdgeTraining
from fedhier.round.asynchrony.rules import SHIFTED_MEAN
from fedhier.round.asynchrony.settings import AsyncEdges, staleness_weight
from fedhier.round.loop import HierarchicalSGD, HSGDSettings
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import metrics
from tests.test_faults import _same_final, run_interrupted_at
from tests.test_vectorized import TOL, assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = RunConfig(dataset="digits", clients=12, groups=(4,), local_period=2, global_period=4,
                 rounds=3, batch_size=8, seed=7)
ASYNC_KEYS = {"async_reports", "stale_dropped", "wall_seconds"}
RUNNERS = {"inprocess": run_inprocess, "vectorized": run_vectorized}


def run(cfg: RunConfig, path, engine: str = "inprocess"):
    RUNNERS[engine](cfg, RunFolder.create(path, cfg), progress=False)
    return metrics(path)


@pytest.mark.parametrize("engine", list(RUNNERS))
def test_buffer_of_every_edge_is_synchronous_h_sgd_bit_for_bit(engine, tmp_path):
    cfg = BASE.replace(participation=0.7, fail_rate=0.2, momentum=0.5, optimizer_state="keep",
                       compute_spread=0.5)
    sync = run(cfg, tmp_path / "sync", engine)
    for staleness in (0, 3):
        name = f"async-{staleness}"
        buffered = run(cfg.replace(async_buffer=4, max_staleness=staleness), tmp_path / name,
                       engine)
        for a, b in zip(sync, buffered, strict=True):
            assert {k: v for k, v in a.items() if k not in ASYNC_KEYS} == {
                k: v for k, v in b.items() if k not in ASYNC_KEYS}
        assert all(s == 0 for r in buffered[1:] for _, s in r["async_reports"])
        assert _same_final(tmp_path / "sync", tmp_path / name)


def test_engines_agree_with_stale_reports(tmp_path):
    cfg = BASE.replace(rounds=6, async_buffer=2, max_staleness=2, edge_slowdown="0:4",
                       participation=0.8, fail_rate=0.1, momentum=0.5,
                       optimizer_state="keep", normalize_updates=True,
                       straggler_fraction=0.3)
    records = run(cfg, tmp_path / "inprocess")
    run(cfg, tmp_path / "vectorized", "vectorized")
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", TOL)
    stale = [s for r in records[1:] for _, s in r["async_reports"]]
    assert max(stale) >= 1  # the slow edge's reports arrive late and still count
    assert all(len(r["async_reports"]) == 2 for r in records[1:])


def test_a_slow_edge_no_longer_sets_the_pace(tmp_path):
    cfg = BASE.replace(rounds=4, edge_slowdown="0:8", step_seconds=0.05)
    sync = run(cfg, tmp_path / "sync")
    buffered = run(cfg.replace(async_buffer=3), tmp_path / "async")
    assert buffered[-1]["sim_seconds"] < 0.5 * sync[-1]["sim_seconds"]
    # the slow edge reports once, 3 aggregations late, and still counts (S = 4)
    slow = [s for r in buffered[1:] for e, s in r["async_reports"] if e == 0]
    assert slow == [3]


def test_reports_staler_than_the_bound_are_dropped(tmp_path):
    cfg = BASE.replace(rounds=5, async_buffer=2, max_staleness=0, edge_slowdown="0:6")
    records = run(cfg, tmp_path / "r")
    assert sum(r["stale_dropped"] for r in records[1:]) > 0
    assert all(s == 0 for r in records[1:] for _, s in r["async_reports"])


def test_stale_reports_enter_as_weighted_updates_from_their_own_start():
    """w_new = sum_j a_j x_j / sum_j a_j + sum_e A_e (w - base_e) / sum_e A_e, with
    a_j = w_j / sqrt(1 + s_e) (the shifted mean): checked against the formula written out
    by hand."""
    hierarchy = Hierarchy(periods=(1, 2), parents=(np.array([0, 0, 1]),))
    settings = HSGDSettings(periods=(1, 2), groups=(2,),
                            asynchronous=AsyncEdges(2, 5, rule=SHIFTED_MEAN))
    algorithm = HierarchicalSGD(settings)
    algorithm.hierarchy = hierarchy
    algorithm.weights = np.array([1.0, 3.0, 2.0])
    w = torch.tensor([0.5, -1.0], dtype=torch.float64)
    base0, base1 = torch.tensor([0.0, 0.0], dtype=torch.float64), w.clone()
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.25, 4.0]], dtype=torch.float64)
    algorithm.global_params = {"p": w}
    jobs = [(EdgeTraining(0, 0, {"p": base0}, 1.0, {"p": x[:2]}, np.array([0, 1])), 2),
            (EdgeTraining(1, 2, {"p": base1}, 1.0, {"p": x[2:]}, np.array([2])), 0)]
    algorithm.rounds._aggregate(jobs)
    a = np.array([1.0, 3.0, 2.0]) * np.array([staleness_weight(2)] * 2 + [1.0])
    expected = (sum(a[j] * x[j] for j in range(3)) / a.sum()
                + (a[0] + a[1]) * (w - base0) / a.sum())
    torch.testing.assert_close(algorithm.global_params["p"], expected, rtol=1e-12, atol=1e-12)
    assert staleness_weight(3) == pytest.approx(0.5) and staleness_weight(0) == 1.0


@pytest.mark.parametrize("engine", list(RUNNERS))
def test_an_interrupted_async_run_resumes_bit_identically(engine, tmp_path, monkeypatch):
    args = ["run", "--clients", "12", "--groups", "4", "--local-period", "2",
            "--global-period", "4", "--rounds", "6", "--async-buffer", "2",
            "--max-staleness", "2", "--edge-slowdown", "0:4", "--momentum", "0.5",
            "--optimizer-state", "keep", "--engine", engine, "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(4, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    assert _same_final(tmp_path / "reference", stopped)
    ref, res = metrics(tmp_path / "reference"), metrics(stopped)
    for key in ("test_loss", "sim_seconds", "async_reports", "edge_cloud_bytes"):
        assert [r.get(key) for r in ref] == [r.get(key) for r in res], key


@pytest.mark.parametrize("flags,message", [
    (["--async-buffer", "5"], "more than the 4 edges"),
    (["--async-buffer", "-1"], ">= 0"),
])
def test_bad_async_settings_are_one_line_errors_before_any_work(flags, message, tmp_path,
                                                                capsys):
    out = tmp_path / "never"
    assert main(["run", "--groups", "4", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not out.exists()


def test_settings_reject_a_buffer_larger_than_the_edges():
    with pytest.raises(ConfigError, match="more than"):
        HSGDSettings(periods=(2, 4), groups=(3,), asynchronous=AsyncEdges(4))
    assert math.isclose(staleness_weight(1), 1 / math.sqrt(2))


def test_async_records_say_who_reported(tmp_path):
    records = run(BASE.replace(async_buffer=1, rounds=4), tmp_path / "r")
    assert [len(r["async_reports"]) for r in records[1:]] == [1] * 4
    assert json.loads((tmp_path / "r" / "config.json").read_text())["async_buffer"] == 1
