"""Exact values of the round's schedule part (fedhier/round/schedule.py), case by case: the
tests written against its mutation survivors (docs/testing.md, "Mutation testing").

Four clients, two per edge. With per-edge periods (2, 4) under a cloud period of 8, an edge
round is g = 2 steps: edge 0 aggregates after every edge round, edge 1 after every second; the
states and models below are worked out by hand from that schedule (docs/hsgd.md)."""

import numpy as np
import pytest
import torch

from fedhier.round.executor import EdgeRoundWork
from fedhier.round.loop import HSGDSettings
from fedhier.round.participants import Workload
from fedhier.round.schedule import EdgePeriods, EqualPeriods, schedule_for
from fedhier.tree.hierarchy import Hierarchy

I64 = np.int64
F64 = torch.float64
EDGE_OF = np.array([0, 0, 1, 1], dtype=I64)
TREE = Hierarchy((2, 8), (EDGE_OF,))
WEIGHTS = np.array([1.0, 2.0, 3.0, 4.0])
ALL = np.arange(4, dtype=I64)


def settings(fednova: bool = False, edge_periods: tuple[int, ...] = (2, 4),
             periods: tuple[int, ...] = (2, 8), groups: tuple[int, ...] = (2,),
             ) -> HSGDSettings:
    return HSGDSettings(periods=periods, groups=groups, edge_periods=edge_periods,
                        workload=Workload(normalize_updates=fednova), seed=5)


class Clock:
    """Records what the schedule charges (the simulated clock's own tests check the times)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def edge_round(self, clients, steps, edge_of_client, model_bytes, downloads=None,
                   uploads=None) -> None:
        self.calls.append({"clients": clients.tolist(), "steps": steps.tolist(),
                           "edge_of": edge_of_client.tolist(), "bytes": model_bytes,
                           "downloads": None if downloads is None else downloads.tolist(),
                           "uploads": None if uploads is None else uploads.tolist()})


def col(values: list[float]) -> dict[str, torch.Tensor]:
    """A model of one parameter per row; explicitly on the CPU (tests run under meta too)."""
    return {"w": torch.tensor([[v] for v in values], dtype=F64, device="cpu")}


def rows(models: dict[str, torch.Tensor]) -> list[float]:
    assert models["w"].device.type == "cpu"
    return models["w"][:, 0].tolist()


def work(edge_round: int, clients, steps, start=None, carried=None) -> EdgeRoundWork:
    return EdgeRoundWork(edge_round=edge_round, cloud_round=1, start_step=(edge_round - 1) * 2,
                         clients=np.asarray(clients, dtype=I64),
                         steps=np.asarray(steps, dtype=I64), edge_of_client=EDGE_OF,
                         start_edge_of_client=None if start is None else np.asarray(start,
                                                                                    dtype=I64),
                         carried=None if carried is None else np.asarray(carried, dtype=I64))


def test_schedule_for_picks_edge_periods_only_when_set():
    assert type(schedule_for(settings())) is EdgePeriods
    assert type(schedule_for(settings(edge_periods=()))) is EqualPeriods


def test_equal_periods_levels_follow_the_periods():
    s = EqualPeriods(settings(edge_periods=(), periods=(2, 4, 8), groups=(2, 1)))
    assert [s.levels(r, 3).tolist() for r in (1, 2, 3, 4, 5)] == \
        [[1, 1, 1], [2, 2, 2], [1, 1, 1], [3, 3, 3], [1, 1, 1]]


def test_edge_periods_levels_follow_each_edge_s_period():
    s = EdgePeriods(settings())
    assert [s.levels(r, 2).tolist() for r in (1, 2, 3, 4)] == [[1, 0], [1, 1], [1, 0], [2, 2]]


def test_equal_periods_plan_everyone_for_i_steps_and_pass_the_start_rows_through():
    s = EqualPeriods(settings(edge_periods=()))
    assert s.begin_cloud_round(4, 2) is None and s.forget(ALL) is None
    start = np.array([1, 0, 1, 1], dtype=I64)
    plan, rows, carried = s.plan(TREE, WEIGHTS, 3, start)
    assert plan.steps.tolist() == [2, 2, 2, 2] and plan.scale.tolist() == [1.0] * 4
    assert rows is start and carried is None
    edges = col([1.0, 10.0])
    assert s.start_models(work(1, ALL, [2] * 4), edges) is edges
    assert s.end_cloud_round() == {}


def test_equal_periods_scale_from_the_edge_each_client_started_from():
    s = EqualPeriods(settings(edge_periods=(), fednova=True))
    models = col([3.0, 5.0, 12.0, 14.0])
    # client 0 started from edge 1 (a carry move): 10 + 0.5 (3 - 10); client 2: 10 + 2 (12 - 10)
    s.scale(models, work(1, ALL, [2] * 4, start=[1, 0, 1, 1]), np.array([0.5, 1.0, 2.0, 1.0]),
            col([1.0, 10.0]))
    assert rows(models) == [6.5, 5.0, 14.0, 14.0]


def test_equal_periods_settle_keeps_everyone_and_charges_the_default_transfers():
    s, clock = EqualPeriods(settings(edge_periods=())), Clock()
    models, survivors = col([1.0, 2.0, 3.0]), np.array([0, 2, 3], dtype=I64)
    out, ids, sent = s.settle(work(1, ALL, [2, 1, 2, 2]), models, survivors,
                              np.array([1], dtype=I64), np.array([1, 1], dtype=I64), clock, 40)
    assert out is models and ids is survivors and sent == 4
    assert clock.calls == [{"clients": [0, 1, 2, 3], "steps": [2, 1, 2, 2],
                            "edge_of": [0, 0, 1, 1], "bytes": 40, "downloads": None,
                            "uploads": None}]


def test_edge_periods_plan_each_edge_s_period_in_edge_rounds_of_g_steps():
    s = EdgePeriods(settings())
    s.begin_cloud_round(4, 2)
    assert s.remaining.tolist() == [0] * 4 and s.factor.tolist() == [1.0] * 4
    assert s.has_carry.tolist() == [False] * 4 and s.aggregations.tolist() == [0, 0]
    plan, start, carried = s.plan(TREE, WEIGHTS, 1, None)
    assert plan.steps.tolist() == [2, 2, 2, 2] and start is None and carried is None
    assert plan.scale.tolist() == [1.0] * 4 and not np.shares_memory(plan.scale, s.factor)
    assert s.remaining.tolist() == [0, 0, 2, 2]  # edge 1's period is 4 steps
    assert s.plan_starts.tolist() == [True] * 4
    # edge 1 does not aggregate after round 1: its clients carry their models
    s.settle(work(1, ALL, [2] * 4), col([1.0, 2.0, 3.0, 4.0]), ALL, ALL[:0],
             np.array([1, 0], dtype=I64), Clock(), 8)
    assert s.has_carry.tolist() == [False, False, True, True]
    # round 2: only edge 0 plans; clients 2, 3 continue from rows E + 0, E + 1
    given = np.array([1, 0, 0, 1], dtype=I64)
    plan, start, carried = s.plan(TREE, WEIGHTS, 2, given)
    assert plan.steps.tolist() == [2, 2, 2, 2] and s.remaining.tolist() == [0, 0, 0, 0]
    assert s.plan_starts.tolist() == [True, True, False, False]
    assert start is not None and start.tolist() == [1, 0, 2, 3] and carried.tolist() == [2, 3]
    assert given.tolist() == [1, 0, 0, 1]  # the caller's rows are not changed
    s.remaining[2:] = 2  # as before the round-2 plan
    _, start, _ = s.plan(TREE, WEIGHTS, 2, None)
    assert start.tolist() == [0, 0, 2, 3]  # without given rows: each client's edge


def test_a_client_without_steps_left_is_not_planned_from_its_carried_model():
    s = EdgePeriods(settings())
    s.begin_cloud_round(4, 2)
    s.has_carry[:] = [False, True, False, True]
    s.remaining[:] = [0, 0, 2, 0]
    plan, start, carried = s.plan(TREE, WEIGHTS, 2, None)  # edge 0 plans again: 0, 1 get 2
    assert plan.steps.tolist() == [2, 2, 2, 0]
    assert carried.tolist() == [1] and start.tolist() == [0, 2, 1, 1]


@pytest.mark.parametrize("default_device", ["cpu", "meta"])
def test_settle_aggregates_now_the_survivors_of_aggregating_edges_then_earlier_carries(
        default_device):
    """(Also under another default device, meta: the carried rows are indexed where the
    models are.)"""
    s, clock = EdgePeriods(settings()), Clock()
    s.begin_cloud_round(4, 2)
    first, second = col([1.0, 2.0, 3.0, 4.0]), col([5.0, 6.0, 7.0])
    with torch.device(default_device):
        out, ids, sent = s.settle(work(1, ALL, [2] * 4), first, ALL, ALL[:0],
                                  np.array([1, 0], dtype=I64), clock, 8)
    assert rows(out) == [1.0, 2.0] and ids.tolist() == [0, 1] and sent == 4
    # round 2: client 3 is not sent (no steps left), client 2 continues from its carry;
    # edge 1 receives two models: client 2's and client 3's carried one
    with torch.device(default_device):
        out, ids, sent = s.settle(work(2, [0, 1, 2], [2, 2, 2], carried=[2]), second,
                                  np.array([0, 1, 2], dtype=I64), ALL[:0],
                                  np.array([1, 1], dtype=I64), clock, 8)
    assert ids.dtype == I64 and ids.tolist() == [0, 1, 2, 3] and rows(out) == [5, 6, 7, 4]
    assert sent == 2 and s.has_carry.tolist() == [False] * 4
    assert s.end_cloud_round() == {"edge_aggregations": [2, 1]}
    assert clock.calls == [
        {"clients": [0, 1, 2, 3], "steps": [2] * 4, "edge_of": [0, 0, 1, 1], "bytes": 8,
         "downloads": [True] * 4, "uploads": [2, 0]},
        {"clients": [0, 1, 2], "steps": [2] * 3, "edge_of": [0, 0, 1, 1], "bytes": 8,
         "downloads": [True, True, False], "uploads": [2, 2]}]


def test_a_failed_client_loses_its_carried_model_and_uploads_nothing_useful():
    s, clock = EdgePeriods(settings()), Clock()
    s.begin_cloud_round(4, 2)
    s.settle(work(1, ALL, [2] * 4), col([1.0, 2.0, 3.0, 4.0]), ALL, ALL[:0],
             np.array([1, 0], dtype=I64), clock, 8)
    # round 2, edge 0 does not aggregate (levels 0, 0): client 2 fails, client 0 carries
    out, ids, sent = s.settle(work(2, [0, 2, 3], [2, 2, 2], carried=[2, 3]),
                              col([9.0, 8.0]), np.array([0, 3], dtype=I64),
                              np.array([2], dtype=I64), np.array([0, 0], dtype=I64), clock, 8)
    assert rows(out) == [] and ids.tolist() == [] and sent == 1
    assert s.has_carry.tolist() == [True, False, False, True]
    assert clock.calls[-1]["uploads"] == [0, 0]
    assert clock.calls[-1]["downloads"] == [True, False, False]
    # round 3: both aggregate; nobody is sent: the carries of clients 0 and 3 go up
    out, ids, _ = s.settle(work(3, [], []), {"w": torch.zeros(0, 1, dtype=F64)}, ALL[:0],
                           ALL[:0], np.array([1, 1], dtype=I64), clock, 8)
    assert ids.tolist() == [0, 3] and rows(out) == [9.0, 8.0]
    # a failure under an aggregating edge is still an upload the edge waits for
    s.settle(work(4, [1, 2], [2, 2]), col([5.0]), np.array([1], dtype=I64),
             np.array([2], dtype=I64), np.array([2, 2], dtype=I64), clock, 8)
    assert clock.calls[-1]["uploads"] == [1, 1]


def fednova_round_two() -> tuple[list[float], list[int], EdgePeriods]:
    """Two edge rounds with FedNova factors 0.5, 2, 0.25, 3 (set by hand after the first
    plan, as stragglers would give)."""
    s = EdgePeriods(settings(fednova=True))
    s.begin_cloud_round(4, 2)
    s.plan(TREE, WEIGHTS, 1, None)
    s.factor[:] = [0.5, 2.0, 0.25, 3.0]
    first = work(1, ALL, [2] * 4)
    starts = s.start_models(first, col([1.0, 10.0]))
    assert rows(starts) == [1.0, 10.0]
    assert rows(s.starts) == [1.0, 1.0, 10.0, 10.0]  # every client starts over from its edge
    # edge 0 aggregates: 1 + 0.5 (3 - 1) = 2, 1 + 2 (5 - 1) = 9; edge 1's clients carry
    out, ids, _ = s.settle(first, col([3.0, 5.0, 12.0, 14.0]), ALL, ALL[:0],
                           np.array([1, 0], dtype=I64), Clock(), 8)
    assert rows(out) == [2.0, 9.0] and ids.tolist() == [0, 1]
    _, start, carried = s.plan(TREE, WEIGHTS, 2, None)
    assert s.factor.tolist() == [1.0, 1.0, 0.25, 3.0]  # edge 0 planned afresh
    second = work(2, ALL, [2] * 4, start=start, carried=carried)
    starts = s.start_models(second, col([4.0, 10.0]))
    assert rows(starts) == [4.0, 10.0, 12.0, 14.0]
    # clients 2, 3 continue their plan: their w_start stays edge 1's model, 10
    assert rows(s.starts) == [4.0, 4.0, 10.0, 10.0]
    # both aggregate: 10 + 0.25 (16 - 10) = 11.5, 10 + 3 (20 - 10) = 40
    out, ids, _ = s.settle(second, col([5.0, 6.0, 16.0, 20.0]), ALL, ALL[:0],
                           np.array([1, 1], dtype=I64), Clock(), 8)
    return rows(out), ids.tolist(), s


def test_fednova_scales_a_whole_period_from_where_the_client_started_it():
    out, ids, s = fednova_round_two()
    assert out == [5.0, 6.0, 11.5, 40.0] and ids == [0, 1, 2, 3]
    # the scale applies only when the edge aggregates: a later period starts over
    assert s.scale(col([1.0]), work(1, [0], [2]), np.array([3.0]), col([0.0, 0.0])) is None


def test_the_part_makes_its_tensors_on_the_models_device():
    """Under another default device (meta) every tensor the part makes names the models'
    device (a GPU run's models stay on the GPU)."""
    with torch.device("meta"):
        out, ids, s = fednova_round_two()
    assert out == [5.0, 6.0, 11.5, 40.0] and ids == [0, 1, 2, 3]
    assert s.carried["w"].device.type == "cpu" and s.starts["w"].device.type == "cpu"


def test_a_failed_client_starts_over_from_its_edge_model_under_fednova():
    s = EdgePeriods(settings(fednova=True))
    s.begin_cloud_round(4, 2)
    s.plan(TREE, WEIGHTS, 1, None)
    s.start_models(work(1, ALL, [2] * 4), col([1.0, 10.0]))
    s.settle(work(1, ALL, [2] * 4), col([3.0, 5.0, 12.0, 14.0]), ALL, ALL[:0],
             np.array([1, 0], dtype=I64), Clock(), 8)
    s.plan(TREE, WEIGHTS, 2, None)
    # client 3 lost its carry (say it failed): it starts from edge 1's model row, 30
    second = work(2, ALL, [2] * 4, start=[0, 0, 2, 1], carried=[2])
    s.start_models(second, col([4.0, 30.0]))
    assert rows(s.starts) == [4.0, 4.0, 10.0, 30.0]


def test_no_start_is_kept_when_every_sent_client_continues_its_plan():
    s = EdgePeriods(settings(fednova=True))
    s.begin_cloud_round(4, 2)
    s.carried = col([0.0, 0.0, 12.0, 14.0])
    s.plan_starts = np.zeros(4, dtype=bool)
    starts = s.start_models(work(2, [2, 3], [2, 2], start=[0, 0, 2, 3], carried=[2, 3]),
                            col([4.0, 10.0]))
    assert rows(starts) == [4.0, 10.0, 12.0, 14.0] and s.starts == {}
    s = EdgePeriods(settings())  # no FedNova: no starts kept at all
    s.begin_cloud_round(4, 2)
    s.plan(TREE, WEIGHTS, 1, None)
    s.start_models(work(1, ALL, [2] * 4), col([1.0, 10.0]))
    assert s.starts == {}


def test_forget_drops_a_carry_and_restart_begins_a_cloud_period_for_some():
    s = EdgePeriods(settings())
    s.forget(np.array([1], dtype=I64))  # before any cloud round: nothing to drop
    s.restart(np.array([True, False, True, False]), np.array([1], dtype=I64), 4, 2)
    assert s.remaining.tolist() == [0] * 4 and s.factor.tolist() == [1.0] * 4
    assert s.has_carry.tolist() == [False] * 4 and s.aggregations.tolist() == [0, 0]
    assert s.remaining.dtype == I64 and s.factor.dtype == np.float64
    assert s.aggregations.dtype == I64 and s.has_carry.dtype == bool
    s.remaining[:] = [0, 0, 2, 2]
    s.factor[:] = [0.5, 2.0, 0.25, 3.0]
    s.has_carry[:] = [False, True, True, True]
    s.aggregations[:] = [1, 3]
    s.forget(np.array([1], dtype=I64))
    assert s.has_carry.tolist() == [False, False, True, True]
    s.restart(np.array([False, False, True, False]), np.array([1], dtype=I64), 4, 2)
    assert s.remaining.tolist() == [0, 0, 0, 2] and s.factor.tolist() == [0.5, 2.0, 1.0, 3.0]
    assert s.has_carry.tolist() == [False, False, False, True]
    assert s.aggregations.tolist() == [1, 0]
    # another federation's size: fresh arrays
    s.restart(np.zeros(5, dtype=bool), np.array([], dtype=I64), 5, 3)
    assert s.remaining.tolist() == [0] * 5 and s.aggregations.tolist() == [0, 0, 0]
    assert s.factor.tolist() == [1.0] * 5 and s.has_carry.tolist() == [False] * 5


def test_a_new_cloud_round_clears_the_edge_periods_state():
    s = EdgePeriods(settings())
    s.begin_cloud_round(4, 2)
    s.remaining[:] = 3
    s.factor[:] = 2.0
    s.has_carry[:] = True
    s.aggregations[:] = 4
    s.begin_cloud_round(3, 1)
    assert s.remaining.dtype == I64 and s.factor.dtype == np.float64
    assert s.aggregations.dtype == I64 and s.has_carry.dtype == bool
    assert (s.remaining.tolist(), s.factor.tolist(), s.has_carry.tolist(),
            s.aggregations.tolist()) == ([0] * 3, [1.0] * 3, [False] * 3, [0])


def test_the_empty_state_before_a_cloud_round():
    s = EdgePeriods(settings())
    assert (s.remaining.dtype, s.factor.dtype, s.has_carry.dtype, s.aggregations.dtype,
            s.plan_starts.dtype) == (I64, np.float64, bool, I64, bool)
    assert len(s.remaining) == len(s.factor) == len(s.has_carry) == 0
    assert len(s.aggregations) == len(s.plan_starts) == 0 and s.carried == {} == s.starts
