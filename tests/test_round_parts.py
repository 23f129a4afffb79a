"""The round as parts (fedhier/round/, docs/index.md "The round as parts"): each feature is
picked once per run by its registry line, the loop names none of them, and the parts answer
their questions exactly (closed cases, no training)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhier.round.executor import EdgeRoundWork
from fedhier.round.loop import HierarchicalSGD, HSGDSettings
from fedhier.round.membership import Moving, Regrouping, RoundPace, membership_for
from fedhier.round.participants import Workload
from fedhier.round.schedule import EdgePeriods, EqualPeriods, schedule_for
from fedhier.round.synchronous import SynchronousRounds
from fedhier.round.updates import scale_updates
from fedhier.tree.hierarchy import Hierarchy
from fedhier.tree.mobility import Mobility

ROOT = Path(__file__).resolve().parents[1]


def _settings(**kw) -> HSGDSettings:
    return HSGDSettings(periods=(2, 8), groups=(3,), **kw)


@pytest.mark.parametrize(("kw", "rules"), [
    ({}, []),
    ({"regroup_every": 2}, [Regrouping]),
    ({"mobility": Mobility(rate=0.5)}, [Moving]),
    ({"regroup_every": 2, "mobility": Mobility(trace=((2, 0, 1),))}, [Regrouping, Moving]),
])
def test_membership_rules_follow_the_registry_in_order(kw, rules):
    assert [type(r) for r in membership_for(_settings(**kw)).rules] == rules


def test_the_schedule_is_picked_by_its_registry_line():
    assert type(schedule_for(_settings())) is EqualPeriods
    assert type(schedule_for(_settings(edge_periods=(2, 4, 8)))) is EdgePeriods


def test_the_loop_names_no_feature():
    """The synchronous cloud round and the loop's begin_cloud_round / plan / complete /
    settle / aggregate ask parts; no branch of theirs tests a feature's setting (a feature is
    a part plus a registry line, not a branch)."""
    features = ("edge_periods", "mobility", "regroup_every", "normalize_updates", "handoff",
                "on_nan", "reachability", "asynchronous")
    steps = [(HierarchicalSGD, name) for name in
             ("begin_cloud_round", "plan", "complete", "settle", "aggregate")]
    for owner, name in [*steps, (SynchronousRounds, "run")]:
        source = inspect.getsource(getattr(owner, name))
        branches = [line for line in source.split('"""')[-1].splitlines()
                    if re.match(r"\s*(if|elif|while)\b", line) or " if " in line]
        assert branches, name  # the loop does branch (on levels, survivors, ...)
        assert not [(f, b) for f in features for b in branches if re.search(rf"\.{f}\b", b)]


def test_no_round_module_over_500_lines():
    for path in sorted((ROOT / "fedhier" / "round").rglob("*.py")):
        assert len(path.read_text().splitlines()) <= 500, path.name


@pytest.mark.parametrize("handoff", ["fresh", "carry"])
def test_a_mid_round_move_hands_off_as_configured(handoff):
    """Client 0 moves edge 0 -> 1 before edge round 2 of cloud round 1: carry starts it from
    edge 0's model, fresh from edge 1's and drops its own carried model."""
    tree = Hierarchy((2, 8), (np.array([0, 0, 1, 2], dtype=np.int64),), num_edges=3)
    moving = Moving(Mobility(trace=((2, 0, 1),), handoff=handoff))
    pace = RoundPace(seed=0, edge_rounds=4, histograms=np.ones((4, 2), dtype=np.int64))
    tree, keys = moving.begin_cloud_round(1, tree, lambda seed: tree, pace)
    assert keys == {}
    tree, handoff_1 = moving.enter(1, tree, pace)
    assert handoff_1 is None
    tree, moved = moving.enter(2, tree, pace)
    assert tree.edge_of_client().tolist() == [1, 0, 1, 2]
    assert moved is not None
    if handoff == "carry":
        assert moved.start_edges.tolist() == [0, 0, 1, 2] and moved.dropped.tolist() == []
    else:
        assert moved.start_edges is None and moved.dropped.tolist() == [0]
    assert moving.end_cloud_round(tree) == {"moved_clients": 1, "moves": [[2, 0, 0, 1]],
                                            "client_to_edge": [1, 0, 1, 2]}


def test_edge_periods_plan_each_edge_at_its_period_and_carry_the_rest():
    """Edges with periods 2, 4, 8 in edge rounds of g = 2: every client trains 2 steps each
    edge round; after round 1 only edge 0 aggregates, the others keep their models."""
    s = _settings(edge_periods=(2, 4, 8), workload=Workload())
    schedule = EdgePeriods(s)
    tree = Hierarchy((2, 8), (np.array([0, 1, 2], dtype=np.int64),), num_edges=3)
    schedule.begin_cloud_round(3, 3)
    plan, start, carried = schedule.plan(tree, np.ones(3) / 3, 1, None)
    assert plan.steps.tolist() == [2, 2, 2] and start is None and carried is None
    assert schedule.remaining.tolist() == [0, 2, 6]
    assert schedule.levels(1, 3).tolist() == [1, 0, 0]
    assert schedule.levels(4, 3).tolist() == [2, 2, 2]


def test_fednova_scales_each_update_from_its_start_model():
    """w_start + s (w - w_start), exactly, per client and only where s != 1."""
    work = EdgeRoundWork(edge_round=1, cloud_round=1, start_step=0,
                         clients=np.array([0, 1]), steps=np.array([2, 1]),
                         edge_of_client=np.array([0, 1]))
    edges = {"w": torch.tensor([[1.0, 1.0], [0.0, 2.0]])}
    models = {"w": torch.tensor([[3.0, 5.0], [4.0, 0.0]])}
    scale_updates(models, work, np.array([1.0, 0.5]), edges)
    assert models["w"].tolist() == [[3.0, 5.0], [2.0, 1.0]]
