"""Per-edge periods (docs/hsgd.md#per-edge-periods): exact reductions and engine equality.

- the schedule: edge i aggregates when the step count is a multiple of I_i, every edge at the
  higher levels;
- all I_i equal is today's two-level run bit for bit (inprocess and vectorized), with
  participation, stragglers, FedNova, faults and moving clients;
- unequal I_i match a plain step-by-step H-SGD loop (a toy affine "training" executor), and
  the traffic counters count only what aggregating edges exchange;
- every engine gives the same numbers with unequal periods (also with mobility, and FedNova
  with moving clients and faults);
- bad periods stop with one line and exit code 2 before anything is written.
"""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedhier.cli.commands import main
from fedhier.clients.app import app as client_app
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.round.loop import (
    ClientEvaluation,
    EdgeRoundWork,
    HierarchicalSGD,
    HSGDSettings,
    Params,
    TrainResult,
)
from fedhier.round.participants import Workload
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import settings_for
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.hierfedavg import HierFedAvg
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import edge_levels_after
from tests.helpers import assert_same_run, initial_state, max_abs_diff, metrics

BASE = RunConfig(dataset="digits", clients=8, groups=(4,), local_period=2, global_period=4,
                 rounds=2, batch_size=8, seed=11)
TINY = ["--dataset", "digits", "--clients", "6", "--groups", "2", "--global-period", "4",
        "--rounds", "1", "--no-progress"]
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------ the schedule
def test_the_schedule_names_the_aggregating_edges():
    periods, edge_periods = (2, 8), (2, 4, 4, 8)
    levels = np.array([edge_levels_after(t, periods, edge_periods, 4) for t in range(8)])
    assert levels[:, 0].tolist() == [0, 1, 0, 1, 0, 1, 0, 2]
    assert levels[:, 1].tolist() == [0, 0, 0, 1, 0, 0, 0, 2]
    assert levels[:, 3].tolist() == [0] * 7 + [2]
    # without per-edge periods every edge follows aggregation_level
    assert edge_levels_after(3, (2, 4), (), 3).tolist() == [2, 2, 2]
    assert edge_levels_after(1, (2, 4), (), 3).tolist() == [1, 1, 1]
    # three levels: every edge joins the region aggregations (each I_i divides P_2)
    assert edge_levels_after(3, (2, 4, 8), (2, 4), 2).tolist() == [2, 2]
    assert edge_levels_after(7, (2, 4, 8), (2, 4), 2).tolist() == [3, 3]


def test_config_edge_round_is_the_gcd():
    cfg = RunConfig(groups=(4,), edge_periods="2,4,4,8", global_period=8)
    assert cfg.edge_period_list == (2, 4, 4, 8)
    assert cfg.local_period == 2 and cfg.periods == (2, 8)
    cfg.validate()
    assert RunConfig(groups=(2,), edge_periods="4,6", global_period=12).local_period == 2


# ------------------------------------------------------------------------------ reductions
EQUAL_CASES = {
    "plain": BASE,
    "participation-stragglers-fednova-carry": BASE.replace(
        groups=(3,), local_period=2, global_period=4, participation=0.7,
        straggler_fraction=0.5, normalize_updates=True, mobility_rate=0.5, handoff="carry",
        fail_rate=0.2, rounds=2),
    "three-level": BASE.replace(groups=(4, 2), periods=(2, 4, 8), rounds=1),
}


@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
@pytest.mark.parametrize("case", list(EQUAL_CASES))
def test_equal_periods_are_the_two_level_run_bit_for_bit(engine, case, tmp_path):
    off = EQUAL_CASES[case].replace(engine=engine)
    on = off.replace(edge_periods=",".join([str(off.local_period)] * off.num_edges))
    run = run_inprocess if engine == "inprocess" else run_vectorized
    run(off, RunFolder.create(tmp_path / "off"), progress=False)
    run(on, RunFolder.create(tmp_path / "on"), progress=False)
    assert_same_run(tmp_path / "off", tmp_path / "on", off.rounds, tol=0.0,
                    ignore=frozenset({"edge_aggregations"}))
    per_round = off.global_period // off.local_period
    assert all(r["edge_aggregations"] == [per_round] * off.num_edges
               for r in metrics(tmp_path / "on")[1:])


# ---------------------------------------------------------- a plain step-by-step reference
class AffineExecutor:
    """Toy clients whose local step is w <- a_j * w + c_j (elementwise), so the result
    depends on when each edge averages; enough of :class:`fedhier.round.loop.Executor`."""

    def __init__(self, sizes: np.ndarray, dim: int = 3) -> None:
        gen = np.random.default_rng(5)
        self.sizes = sizes
        self.a = torch.as_tensor(gen.uniform(0.5, 1.1, (len(sizes), dim)))
        self.c = torch.as_tensor(gen.normal(size=(len(sizes), dim)))
        self.sent: list[tuple[np.ndarray, np.ndarray]] = []  # (clients, steps) per call

    def step(self, client: int, w: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            w = self.a[client] * w + self.c[client]
        return w

    def profiles(self) -> ClientInfo:
        n = len(self.sizes)
        return ClientInfo(np.zeros((n, 1), dtype=np.int64), self.sizes.astype(np.int64),
                          edge_tags=np.full(n, -1))

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        rows = work.start_edges
        self.sent.append((work.clients.copy(), work.steps.copy()))
        out = torch.stack([self.step(int(j), edge_models["w"][rows[j]], int(s))
                           for j, s in zip(work.clients, work.steps, strict=True)])
        k = len(work.clients)
        return TrainResult(models={"w": out}, losses=np.zeros(k), ok=np.ones(k, dtype=bool))

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        return None

    def client_gradients(self, params: Params) -> torch.Tensor | None:
        return None

    def model_bytes(self, params: Params) -> int:
        return 1

    def client_state(self) -> None:
        return None

    def restore_client_state(self, state: object) -> None:
        pass


def reference(executor: AffineExecutor, edge_of: np.ndarray, edge_periods: tuple[int, ...],
              global_period: int, rounds: int, w0: torch.Tensor) -> torch.Tensor:
    """algorithms.md §1 as written, with I_i per edge: every client steps once per
    iteration; after step t the cloud averages when (t+1) % G == 0, else edge i averages
    when (t+1) % I_i == 0 (weights: rows)."""
    n = len(edge_of)
    weights = torch.as_tensor(executor.sizes, dtype=torch.float64)
    w = w0.repeat(n, 1)
    for t in range(rounds * global_period):
        w = torch.stack([executor.step(j, w[j], 1) for j in range(n)])
        if (t + 1) % global_period == 0:
            w[:] = (weights[:, None] * w).sum(0) / weights.sum()
            continue
        for edge, period in enumerate(edge_periods):
            if (t + 1) % period == 0:
                members = torch.as_tensor(np.flatnonzero(edge_of == edge))
                wm = weights[members]
                w[members] = (wm[:, None] * w[members]).sum(0) / wm.sum()
    return w[0]


@pytest.mark.parametrize("edge_periods, global_period", [
    ((1, 2, 4), 4), ((2, 4, 8), 8), ((4, 6, 12), 12), ((3, 3, 3), 6)])
def test_unequal_periods_follow_the_step_by_step_loop(edge_periods, global_period):
    sizes = np.array([5, 9, 2, 7, 4, 6, 8])
    executor = AffineExecutor(sizes)
    g = math.gcd(*edge_periods)
    settings = HSGDSettings(periods=(g, global_period), groups=(3,), grouping="contiguous",
                            edge_periods=edge_periods)
    algorithm = HierarchicalSGD(settings)
    w0 = torch.tensor([0.3, -0.2, 1.0], dtype=torch.float64)
    records: list[dict] = []
    final = algorithm.run(executor, {"w": w0}, 2, on_record=records.append)
    assert algorithm.hierarchy is not None
    edge_of = algorithm.hierarchy.edge_of_client()
    expected = reference(executor, edge_of, edge_periods, global_period, 2, w0)
    torch.testing.assert_close(final["w"], expected, rtol=1e-12, atol=1e-12)
    counts = [global_period // p for p in edge_periods]
    assert records[1]["edge_aggregations"] == counts
    # client <-> edge traffic: per period each member downloads once and uploads once
    members = np.bincount(edge_of, minlength=3)
    assert records[2]["client_edge_messages"] == 2 * 2 * int(np.dot(members, counts))
    assert records[2]["edge_cloud_messages"] == 2 * 2 * 3  # one cloud aggregation a round


def test_stragglers_do_their_planned_steps_over_their_edge_period():
    sizes = np.array([5, 9, 2, 7, 4, 6, 8, 3])
    executor = AffineExecutor(sizes)
    settings = HSGDSettings(periods=(2, 8), groups=(2,), grouping="contiguous",
                            edge_periods=(2, 8), seed=4,
                            workload=Workload(participation=0.75, straggler_fraction=0.5))
    algorithm = HierarchicalSGD(settings)
    algorithm.run(executor, {"w": torch.zeros(3, dtype=torch.float64)}, 1)
    assert algorithm.hierarchy is not None
    edge_of = algorithm.hierarchy.edge_of_client()
    assert len(executor.sent) == 4  # edge rounds of g = 2 steps
    totals = np.zeros(8, dtype=np.int64)
    for clients, steps in executor.sent:
        assert ((steps >= 1) & (steps <= 2)).all()
        totals[clients] += steps
    slow = edge_of == 1  # period 8: planned once, 3 of its 4 clients, up to 8 steps each
    assert (totals[slow] > 0).sum() == 3 and totals[slow].max() <= 8
    assert (totals[slow] < 8).any()  # a straggler did fewer
    # period 2: replanned every edge round, 3 of 4 clients each time, at most 2 steps
    assert totals[~slow].max() <= 8


# ------------------------------------------------------------------------------ engines
ENGINE_CASES = {
    "two-level": BASE.replace(edge_periods="1,2,2,4", global_period=4),
    "participation-stragglers-faults": BASE.replace(
        edge_periods="2,4,4,8", global_period=8, participation=0.6, straggler_fraction=0.5,
        fail_rate=0.2, rounds=2),
    "mobility-carry-momentum-kept": BASE.replace(
        groups=(3,), edge_periods="1,2,4", global_period=4, mobility_rate=0.5,
        handoff="carry", momentum=0.5, optimizer_state="keep", rounds=3),
    "mobility-fresh-participation": BASE.replace(
        groups=(3,), edge_periods="4,2,1", global_period=4, mobility_rate=0.5,
        participation=0.7, rounds=3),
    "three-level": BASE.replace(groups=(4, 2), periods=(2, 4, 8), edge_periods="2,4,2,4",
                                rounds=2),
    "fednova-mobility-carry-faults": BASE.replace(
        groups=(3,), edge_periods="2,4,8", global_period=8, normalize_updates=True,
        straggler_fraction=0.5, participation=0.7, fail_rate=0.2, mobility_rate=0.5,
        handoff="carry", rounds=2),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engines_agree_with_per_edge_periods(case, tmp_path):
    cfg = ENGINE_CASES[case]
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "vectorized", cfg.rounds, TOL)
    records = metrics(tmp_path / "vectorized")
    assert "edge_aggregations" in records[-1]
    if cfg.mobility_rate:
        assert sum(r.get("moved_clients", 0) for r in records) > 0


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("flags, message", [
    (["--edge-periods", "3,2"], "edge period 3 does not divide the next level's period 4"),
    (["--edge-periods", "2,2,4"], "3 period(s) for 2 edge(s)"),
    (["--edge-periods", "0,2"], "must be positive"),
    (["--edge-periods=-2,2"], "must be positive"),
    (["--edge-periods", "2,x"], "comma-separated integers"),
    (["--edge-periods", "2,4", "--local-period", "1"], "an edge round is their gcd, 2 steps"),
])
def test_bad_edge_periods_one_line_exit_2(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", *TINY, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_settings_check_the_periods():
    with pytest.raises(ConfigError, match="gcd"):
        HSGDSettings(periods=(1, 4), groups=(2,), edge_periods=(2, 4))
    with pytest.raises(ConfigError, match="one per edge"):
        HSGDSettings(periods=(2, 4), groups=(2,), edge_periods=(2,))


def test_flower_hooks_run_the_same_edge_rounds():
    """configure_train / aggregate_train (a ServerApp driving HierFedAvg edge round by edge
    round) send carried models too, and reach start()'s global model."""
    cfg = BASE.replace(edge_periods="1,2,2,4", global_period=4, rounds=1)
    config = ConfigRecord(cfg.to_run_config())
    arrays = ArrayRecord(initial_state(cfg))
    expected = HierFedAvg.from_settings(settings_for(cfg)).start(
        InProcessGrid(client_app, cfg.clients, seed=cfg.seed), arrays, num_rounds=1,
        train_config=config).arrays.to_torch_state_dict()
    strategy = HierFedAvg.from_settings(settings_for(cfg))
    grid = InProcessGrid(client_app, cfg.clients, seed=cfg.seed)
    strategy.setup(grid, config, 3600, arrays)
    final = None
    for edge_round in range(1, 5):
        messages = strategy.configure_train(edge_round, arrays, config, grid)
        final, _ = strategy.aggregate_train(edge_round, grid.send_and_receive(messages))
    assert final is not None
    assert max_abs_diff(final.to_torch_state_dict(), expected) == 0.0


@pytest.mark.parametrize("given", [{"local_period": 5}, {"periods": "3,12"}])
def test_an_edge_round_the_user_gave_that_is_not_the_gcd_is_refused(given):
    """edge_periods 2,4,4,2 make an edge round gcd = 2 steps: a given I of 5 (or periods
    starting at 3) is refused by name, not replaced by 2 without a word."""
    key = next(iter(given))
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({"edge_periods": "2,4,4,2", "global_period": 12, **given})
    message = str(err.value)
    assert message.startswith(f"{key} gives I={5 if key == 'local_period' else 3}, but with "
                              "edge_periods=2,4,4,2 an edge round is their gcd, 2 steps")
    assert "\n" not in message


def test_the_gcd_given_or_left_out_is_accepted_and_round_trips():
    left_out = RunConfig.from_mapping({"edge_periods": "2,4,4,2", "global_period": 12})
    given = RunConfig.from_mapping({"edge_periods": "2,4,4,2", "local_period": 2,
                                    "global_period": 12})
    assert left_out == given and left_out.local_period == 2 and left_out.periods == (2, 12)
    # config.json holds the resolved I: reading it back is the same run
    assert RunConfig.from_mapping(left_out.to_dict()) == left_out
