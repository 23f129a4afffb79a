"""Asynchronous edges with the other features: robust aggregators per level, a Flower cloud
strategy, regrouping, mobility (rate, trace, both handoffs) and deeper trees.

Per-edge periods too. For each: K = N equals the synchronous run bit for bit, the engines
agree with stale reports, and the reductions that apply (one client per edge: median = mean;
move rate 0 = static; carry = fresh when every move is at a job's start)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhier.cli.commands import main
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.round.asynchrony.edges import BufferedRounds, EdgeTraining
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.round.loop import HierarchicalSGD, HSGDSettings
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy
from tests import oracle_hsgd as oracle
from tests.helpers import metrics
from tests.test_faults import _same_final, run_interrupted_at
from tests.test_oracle import (  # noqa: F401 - `data`: a fixture
    data,
    flower_fedadam,
    gap,
    initial,
    problem,
)
from tests.test_oracle import run as oracle_run
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 8 clients, 4 edges, one edge round per cloud round (G = I: synchronous moves and regroupings
# then happen at a cloud round's start, where async jobs start too)
BASE = RunConfig(dataset="digits", clients=8, groups=(4,), local_period=2, global_period=2,
                 rounds=2, batch_size=8, seed=7)
ASYNC_KEYS = {"async_reports", "stale_dropped", "wall_seconds"}
RUNNERS = {"inprocess": run_inprocess, "vectorized": run_vectorized}
ENGINE_TOL = 1e-5


def run(cfg: RunConfig, path, engine: str = "vectorized"):
    RUNNERS[engine](cfg, RunFolder.create(path, cfg), progress=False)
    return metrics(path)


def same_records(a: list[dict], b: list[dict]) -> bool:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in a] == [
        {k: v for k, v in r.items() if k != "wall_seconds"} for r in b]


def trace_file(path) -> str:
    """Moves at edge rounds 2 and 4: inside a cloud round of two edge rounds (G = 2I)."""
    path.write_text("edge_round,client,edge\n2,0,3\n2,5,0\n3,1,2\n4,0,1\n")
    return str(path)


COMBOS = {
    "median": {"aggregators": "median"},
    "fedadam": {"cloud_strategy": "fedadam"},
    "regroup": {"regroup_every": 1},
    "mobility-rate": {"mobility_rate": 0.5},
    "mobility-trace-carry": {"mobility_trace": "TRACE", "handoff": "carry",
                             "global_period": 4},
    "three-levels": {"groups": (4, 2), "periods": (2, 4, 8), "rounds": 2},
    "four-levels": {"groups": (4, 2, 2), "periods": (2, 4, 8, 16), "rounds": 1},
    "edge-periods": {"global_period": 4, "edge_periods": "2,4,4,2"},
}


def combo(tmp_path, *names: str) -> RunConfig:
    """BASE with the settings of the ``names`` in COMBOS."""
    changes = {k: v for name in names for k, v in COMBOS[name].items()}
    if changes.get("mobility_trace") == "TRACE":
        changes["mobility_trace"] = trace_file(tmp_path / "trace.csv")
    return BASE.replace(**changes)


@pytest.mark.parametrize("names", [("median", "fedadam"), ("regroup", "mobility-rate"),
                                   ("mobility-trace-carry",), ("three-levels", "median"),
                                   ("four-levels",), ("edge-periods",)])
def test_a_buffer_of_every_edge_is_the_synchronous_run_bit_for_bit(names, tmp_path):
    cfg = combo(tmp_path, *names)
    sync = run(cfg, tmp_path / "sync")
    buffered = run(cfg.replace(async_buffer=4), tmp_path / "async")
    for a, b in zip(sync, buffered, strict=True):
        assert {k: v for k, v in a.items() if k not in ASYNC_KEYS} == {
            k: v for k, v in b.items() if k not in ASYNC_KEYS}, a["round"]
    assert _same_final(tmp_path / "sync", tmp_path / "async")
    assert all(s == 0 for r in buffered[1:] for _, s in r["async_reports"])
    if names[0].startswith(("regroup", "mobility")):  # the membership did change
        assert any(r.get("regrouped") or r.get("moved_clients") for r in buffered[1:])


@pytest.mark.parametrize("names", [("median", "fedadam", "regroup", "mobility-trace-carry"),
                                   ("three-levels",), ("edge-periods",)])
def test_engines_agree_with_stale_reports(names, tmp_path):
    cfg = combo(tmp_path, *names).replace(async_buffer=2, edge_slowdown="0:4", max_staleness=2)
    records = run(cfg, tmp_path / "vectorized")
    run(cfg, tmp_path / "inprocess", "inprocess")
    assert_same_runs(tmp_path / "vectorized", tmp_path / "inprocess", ENGINE_TOL)
    assert max(s for r in records[1:] for _, s in r["async_reports"]) >= 1


def test_with_one_client_per_edge_the_median_is_the_mean(tmp_path):
    """A median over one client is that client: median at the edges equals the mean there,
    bit for bit, also with stale reports (the shifts are added after the edges' rule)."""
    cfg = BASE.replace(clients=4, async_buffer=2, edge_slowdown="0:4", rounds=3)
    mean = run(cfg, tmp_path / "mean")
    run(cfg.replace(aggregators="median,mean"), tmp_path / "median")
    assert same_records(metrics(tmp_path / "median"), mean)
    assert _same_final(tmp_path / "mean", tmp_path / "median")
    assert max(s for r in mean[1:] for _, s in r["async_reports"]) >= 1


def test_handoffs_and_rate_zero_reduce_as_documented(tmp_path):
    """With one edge round per cloud round every move is at a job's start, where the old
    and the new edge hold the same model: carry = fresh; a move rate of 0 is the static
    run."""
    cfg = BASE.replace(async_buffer=2, edge_slowdown="0:4", mobility_rate=0.5)
    moving = run(cfg, tmp_path / "fresh")
    run(cfg.replace(handoff="carry"), tmp_path / "carry")
    assert same_records(metrics(tmp_path / "carry"), moving)
    assert _same_final(tmp_path / "fresh", tmp_path / "carry")
    assert sum(r["moved_clients"] for r in moving[1:]) > 0
    tiny = cfg.replace(clients=4, rounds=1, mobility_rate=0.0)
    static = run(tiny, tmp_path / "static")
    run(tiny.replace(handoff="carry"), tmp_path / "rate0")
    assert same_records(metrics(tmp_path / "rate0"), static)


def test_jobs_in_flight_keep_their_clients():
    """A regrouping or a move changes the grouping at once, but a client stays with its
    job's edge until that job's report is in; new jobs do not take it."""
    settings = HSGDSettings(periods=(1, 2), groups=(2,), asynchronous=AsyncEdges(1, 5))
    algorithm = HierarchicalSGD(settings)
    algorithm.hierarchy = Hierarchy(periods=(1, 2), parents=(np.array([1, 1, 0, 0]),))
    p = {"p": torch.zeros(2)}
    algorithm.rounds.jobs = {0: EdgeTraining(0, 0, p, 1.0, None, np.zeros(0, np.int64),
                                 np.array([0, 1]))}  # started while 0 and 1 were at edge 0
    assert algorithm.rounds.training_map().tolist() == [0, 0, 0, 0]
    algorithm.rounds.jobs = {}
    assert algorithm.rounds.training_map().tolist() == [1, 1, 0, 0]


def test_no_client_is_in_two_jobs_at_once(tmp_path, monkeypatch):
    """Fast moves and regroupings with one slow edge: after every start, the jobs in flight
    have disjoint clients, and each job's survivors are among its clients."""
    start_jobs = BufferedRounds._start_jobs
    checked = []

    def checking(self, executor, stats):
        start_jobs(self, executor, stats)
        members = np.concatenate([job.members for job in self.jobs.values()])
        assert len(members) == len(np.unique(members))
        assert all(np.isin(job.survivors, job.members).all() for job in self.jobs.values())
        checked.append(len(self.jobs))

    monkeypatch.setattr(BufferedRounds, "_start_jobs", checking)
    records = run(BASE.replace(global_period=4, mobility_rate=0.9, regroup_every=2, rounds=4,
                               async_buffer=2, edge_slowdown="0:4"), tmp_path / "r")
    assert sum(r["moved_clients"] for r in records[1:]) > 0 and len(checked) >= 4


def test_a_median_async_run_matches_the_oracle(data):  # noqa: F811 - the fixture
    """Median at the edges, mean at the cloud, stale reports: against the oracle's rule
    (each report's models moved by w - w_base(e), the edge's median, the A_e-weighted mean)."""
    r = oracle_run(data, "vectorized", "--groups", "4", "--grouping", "contiguous",
                   "--local-period", "2", "--global-period", "4", "--async-buffer", "2",
                   "--edge-slowdown", "0:4", "--max-staleness", "8",
                   "--aggregators", "median,mean", rounds=5)
    records = r["records"][1:]
    reports = [[edge for edge, _ in rec["async_reports"]] for rec in records]
    want, staleness = oracle.async_hsgd(problem(data, r, (2, 4)), initial(r), reports,
                                        edge_rule="median")
    assert [sorted(rec["async_reports"]) for rec in records] == staleness
    assert max(s for pairs in staleness for _, s in pairs) >= 1
    assert gap(r, want) <= 1e-6
    mean, _ = oracle.async_hsgd(problem(data, r, (2, 4)), initial(r), reports)
    assert gap(r, mean) > 1e-3  # the rule matters


def test_everything_at_once_runs_and_resumes_bit_identically(tmp_path, monkeypatch):
    """Via the CLI: a Flower cloud strategy after async reports, clip (measured from each
    edge's start model) at the edges, regrouping, mobility and three levels; Ctrl-C in
    round 3 and --resume end where the uninterrupted run ends."""
    args = ["run", "--clients", "8", "--rounds", "4", "--async-buffer", "2",
            "--edge-slowdown", "0:4", "--cloud-strategy", "fedadam",
            "--aggregators", "clip:2x,median,mean", "--regroup-every", "2",
            "--mobility-rate", "0.3", "--groups", "4,2", "--periods", "2,4,8",
            "--momentum", "0.5", "--optimizer-state", "keep", "--engine", "vectorized",
            "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(3, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    assert _same_final(tmp_path / "reference", stopped)
    reference = metrics(tmp_path / "reference")
    assert same_records(metrics(stopped), reference)
    assert max(s for r in reference[1:] for _, s in r["async_reports"]) >= 1
    assert any(r.get("regrouped") for r in reference) and any(
        r["moved_clients"] for r in reference[1:])


def test_a_flower_cloud_step_after_async_reports_matches_the_oracle(data):  # noqa: F811
    """FedAdam over the reporting edges' aggregates of their moved models, weights A_e."""
    r = oracle_run(data, "vectorized", "--groups", "4", "--grouping", "contiguous",
                   "--local-period", "2", "--global-period", "4", "--async-buffer", "2",
                   "--edge-slowdown", "0:4", "--max-staleness", "8",
                   "--cloud-strategy", "fedadam", rounds=4)
    reports = [[edge for edge, _ in rec["async_reports"]] for rec in r["records"][1:]]
    p = problem(data, r, (2, 4))
    want, staleness = oracle.async_hsgd(p, initial(r), reports, cloud_step=flower_fedadam())
    assert max(s for pairs in staleness for _, s in pairs) >= 1
    assert gap(r, want) <= 1e-5  # FedAdam's float64 update of float32 models
    assert gap(r, oracle.async_hsgd(p, initial(r), reports)[0]) > 1e-3
