"""Exact values of the round's membership part (fedhier/round/membership.py), case by case:
the tests written against its mutation survivors (docs/testing.md, "Mutation testing").

The mobility model's own draws are tested in tests/test_mobility*.py; here a recording stand-in
gives fixed maps, so each edge round's tree, handoff and record keys are worked out by hand."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import HSGDSettings
from fedhier.round.membership import (
    Handoff,
    Membership,
    Moving,
    Regrouping,
    RoundPace,
    draw_hierarchy,
    membership_for,
    regroup_due,
)
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy, build_hierarchy
from fedhier.tree.mobility import Mobility
from tests.helpers import assert_refused

I64 = np.int64
START = np.array([0, 0, 1, 1, 2, 2], dtype=I64)
TREE = Hierarchy((1, 3), (START,))
HIST = np.array([[3, 0], [0, 2], [1, 1], [2, 2], [0, 5], [4, 0]], dtype=I64)
PACE = RoundPace(seed=11, edge_rounds=3, histograms=HIST)


def info(histograms: np.ndarray = HIST) -> ClientInfo:
    return ClientInfo(label_histograms=histograms, num_examples=histograms.sum(axis=1))


def edge_map(h: Hierarchy) -> list[int]:
    return h.edge_of_client().tolist()


class Maps:
    """A mobility model's stand-in: fixed maps, and what it was asked."""

    def __init__(self, maps: list[list[int]], handoff: str = "fresh",
                 reachability=None) -> None:
        self.given = np.array(maps, dtype=I64)
        self.handoff = handoff
        self.reachability = reachability
        self.active = True
        self.asked: list[tuple] = []

    def maps(self, seed, cloud_round, edge_rounds, start, num_edges, histograms):
        self.asked.append((seed, cloud_round, edge_rounds, start.tolist(), num_edges,
                           histograms.tolist()))
        return self.given

    def respect(self, old, new, num_edges):
        self.asked.append(("respect", old.tolist(), new.tolist(), num_edges))
        return np.where(new == 2, old, new)  # nobody may join edge 2


def settings(grouping: str, groups=(3,), periods=(1, 3)) -> SimpleNamespace:
    return SimpleNamespace(grouping=grouping, groups=groups, periods=periods)


def no_gradients() -> torch.Tensor:
    raise AssertionError("a grouping that needs no gradient asked for them")


def test_draw_hierarchy_draws_the_run_s_grouping_with_the_seed_given():
    weights = np.ones(6)
    tree = draw_hierarchy(settings("contiguous"), info(), weights, 4, no_gradients)
    assert edge_map(tree) == [0, 0, 1, 1, 2, 2] and tree.periods == (1, 3)
    for seed in (4, 5):
        drawn = draw_hierarchy(settings("random", (3, 2), (1, 2, 4)), info(), weights, seed,
                               no_gradients)
        want = build_hierarchy((1, 2, 4), (3, 2), "random", info(), seed)
        assert [p.tolist() for p in drawn.parents] == [p.tolist() for p in want.parents]
    # label groupings read the histograms (min-divergence: the same labels apart)
    assert len(set(edge_map(draw_hierarchy(settings("min-divergence"), info(), weights, 4,
                                           no_gradients)))) == 3


def test_the_gradient_grouping_asks_for_the_gradients_and_names_them_when_missing():
    assert_refused(lambda: draw_hierarchy(settings("gradient"), info(), np.ones(6), 4,
                                          lambda: None),
                   "the 'gradient' grouping needs every client's gradient (query.gradient)",
                   RunFailureError, exact=True)
    grads = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0],
                          [-0.9, -0.1]], dtype=torch.float64)
    weights = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tree = draw_hierarchy(settings("gradient"), info(), weights, 4, lambda: grads)
    want = build_hierarchy((1, 3), (3,), "gradient", info(), 4, client_grads=grads,
                           weights=weights)
    assert edge_map(tree) == edge_map(want)


def test_a_label_grouping_without_histograms_is_refused_in_one_line():
    for name in ("min-divergence", "max-divergence"):
        assert_refused(lambda name=name: draw_hierarchy(
            settings(name), info(np.zeros((6, 2), dtype=I64)), np.ones(6), 4, no_gradients),
            f"the '{name}' grouping needs the clients' label histograms, which they did not "
            "report (docs/contract.md: the profile query); use grouping 'random' or "
            "'contiguous'", ConfigError, exact=True)
    # one reported label anywhere is enough to group by labels
    one = np.zeros((6, 2), dtype=I64)
    one[5, 1] = 1
    draw_hierarchy(settings("min-divergence"), info(one), np.ones(6), 4, no_gradients)


def test_a_handoff_by_default_starts_everyone_at_their_edge_and_drops_nothing():
    h = Handoff()
    assert h.start_edges is None and h.dropped.dtype == I64 and h.dropped.tolist() == []


@pytest.mark.parametrize("every,due", [(0, []), (1, [2, 3, 4, 5, 6, 7]), (2, [3, 5, 7]),
                                       (3, [4, 7])])
def test_regroup_due_every_k_cloud_rounds_never_the_first(every, due):
    assert [r for r in range(1, 8) if regroup_due(every, r)] == due
    assert all(type(regroup_due(every, r)) is bool for r in range(1, 8))


def regroup_to(target: list[int], asked: list[int]):
    def regroup(seed: int) -> Hierarchy:
        asked.append(seed)
        return Hierarchy((1, 3), (np.array(target, dtype=I64),))
    return regroup


def test_regrouping_draws_a_new_tree_with_the_cloud_round_s_seed():
    asked: list[int] = []
    rule = Regrouping(2, Mobility())
    tree, keys = rule.begin_cloud_round(2, TREE, regroup_to([2, 1, 0, 0, 1, 2], asked), PACE)
    assert tree is TREE and keys == {} and asked == []
    tree, keys = rule.begin_cloud_round(3, TREE, regroup_to([2, 1, 0, 0, 1, 2], asked), PACE)
    assert asked == [11 + 3 - 1]
    assert edge_map(tree) == [2, 1, 0, 0, 1, 2]
    assert keys == {"regrouped": True, "client_to_edge": [2, 1, 0, 0, 1, 2]}
    assert rule.enter(4, tree, PACE) == (tree, None) and rule.end_cloud_round(tree) == {}


def test_a_regrouping_under_a_reachability_matrix_keeps_unreachable_moves_home():
    asked: list[int] = []
    mobility = Maps([], reachability=((True,) * 3,) * 3)
    rule = Regrouping(1, mobility)
    tree, keys = rule.begin_cloud_round(2, TREE, regroup_to([2, 1, 0, 0, 1, 2], asked), PACE)
    assert mobility.asked == [("respect", [0, 0, 1, 1, 2, 2], [2, 1, 0, 0, 1, 2], 3)]
    assert edge_map(tree) == [0, 1, 0, 0, 1, 2] == keys["client_to_edge"]
    assert tree.num_edges == 3 and tree.num_nodes(1) == 3
    # without a matrix, or without mobility, the drawn tree as it is
    for mobility in (Maps([]), SimpleNamespace(active=False, reachability=((True,),))):
        tree, _ = Regrouping(1, mobility).begin_cloud_round(
            2, TREE, regroup_to([2, 1, 0, 0, 1, 2], asked), PACE)
        assert edge_map(tree) == [2, 1, 0, 0, 1, 2]
        assert getattr(mobility, "asked", []) == []


#: one cloud round of three edge rounds: client 1 moves to edge 2 in the first, client 4 to
#: edge 0 in the second, nobody in the third
MAPS = [[0, 2, 1, 1, 2, 2], [0, 2, 1, 1, 0, 2], [0, 2, 1, 1, 0, 2]]


def test_moving_draws_the_cloud_round_s_maps_at_its_start():
    mobility = Maps(MAPS)
    rule = Moving(mobility)  # type: ignore[arg-type]
    assert rule.maps is None and rule.moves == []
    assert rule.enter(1, TREE, PACE) == (TREE, None)  # no maps drawn yet
    rule.moves = [[9, 9, 9, 9]]
    tree, keys = rule.begin_cloud_round(2, TREE, regroup_to([], []), PACE)
    assert tree is TREE and keys == {} and rule.moves == []
    assert mobility.asked == [(11, 2, 3, [0, 0, 1, 1, 2, 2], 3, HIST.tolist())]
    assert rule.maps is mobility.given


def run_cloud_round(handoff: str, first_edge_round: int) -> tuple[list, dict]:
    rule = Moving(Maps(MAPS, handoff))  # type: ignore[arg-type]
    tree = TREE
    rule.begin_cloud_round(2, tree, regroup_to([], []), PACE)
    seen = []
    for r in range(first_edge_round, first_edge_round + 3):
        tree, handoff_of = rule.enter(r, tree, PACE)
        seen.append((edge_map(tree), None if handoff_of is None else
                     (None if handoff_of.start_edges is None else
                      handoff_of.start_edges.tolist(), handoff_of.dropped.tolist(),
                      handoff_of.dropped.dtype)))
    return seen, rule.end_cloud_round(tree)


@pytest.mark.parametrize("first", [4, 7])  # the second and third cloud rounds' edge rounds
def test_a_fresh_move_drops_the_mover_s_own_model(first):
    seen, keys = run_cloud_round("fresh", first)
    assert seen == [([0, 2, 1, 1, 2, 2], (None, [1], I64)),
                    ([0, 2, 1, 1, 0, 2], (None, [4], I64)),
                    ([0, 2, 1, 1, 0, 2], None)]
    assert keys == {"moved_clients": 2, "moves": [[first, 1, 0, 2], [first + 1, 4, 2, 0]],
                    "client_to_edge": [0, 2, 1, 1, 0, 2]}


def test_a_carry_move_starts_from_the_old_edge_after_the_first_edge_round():
    seen, keys = run_cloud_round("carry", 4)
    # first edge round: every edge holds the global model, nothing to carry
    assert seen == [([0, 2, 1, 1, 2, 2], (None, [], I64)),
                    ([0, 2, 1, 1, 0, 2], ([0, 2, 1, 1, 2, 2], [], I64)),
                    ([0, 2, 1, 1, 0, 2], None)]
    assert keys["moves"] == [[4, 1, 0, 2], [5, 4, 2, 0]]
    assert all(type(v) is int for move in keys["moves"] for v in move)


def test_a_cloud_round_without_moves_records_only_their_count():
    rule = Moving(Maps([[0, 0, 1, 1, 2, 2]] * 3))  # type: ignore[arg-type]
    rule.begin_cloud_round(1, TREE, regroup_to([], []), PACE)
    assert rule.enter(2, TREE, PACE) == (TREE, None)
    assert rule.end_cloud_round(TREE) == {"moved_clients": 0}


class Rule:
    """A membership rule's stand-in: a fixed next tree, keys and handoff."""

    def __init__(self, name: str, tree: Hierarchy, keys: dict, handoff) -> None:
        self.name, self.tree, self.keys, self.handoff = name, tree, keys, handoff
        self.seen: list = []

    def begin_cloud_round(self, cloud_round, hierarchy, regroup, pace):
        self.seen.append(("begin", cloud_round, edge_map(hierarchy)))
        return self.tree, self.keys

    def enter(self, edge_round, hierarchy, pace):
        self.seen.append(("enter", edge_round, edge_map(hierarchy)))
        return self.tree, self.handoff

    def end_cloud_round(self, hierarchy):
        self.seen.append(("end", edge_map(hierarchy)))
        return {self.name: True, "shared": self.name}


def test_membership_applies_its_rules_in_order():
    a_tree = Hierarchy((1, 3), (np.array([1, 0, 2, 2, 1, 0], dtype=I64),))
    b_tree = Hierarchy((1, 3), (np.array([2, 2, 1, 0, 0, 1], dtype=I64),))
    handoff = Handoff(np.arange(6, dtype=I64))
    a = Rule("a", a_tree, {"x": 1, "y": 1}, handoff)
    b = Rule("b", b_tree, {"y": 2}, None)
    m = Membership([a, b])  # type: ignore[list-item]
    tree, keys = m.begin_cloud_round(3, TREE, regroup_to([], []), PACE)
    assert tree is b_tree and keys == {"x": 1, "y": 2}
    tree, got = m.enter(5, TREE, PACE)
    assert tree is b_tree and got is handoff  # a later rule without a handoff keeps it
    assert m.end_cloud_round(b_tree) == {"a": True, "b": True, "shared": "b"}
    assert a.seen == [("begin", 3, [0, 0, 1, 1, 2, 2]), ("enter", 5, [0, 0, 1, 1, 2, 2]),
                      ("end", [2, 2, 1, 0, 0, 1])]
    assert b.seen == [("begin", 3, [1, 0, 2, 2, 1, 0]), ("enter", 5, [1, 0, 2, 2, 1, 0]),
                      ("end", [2, 2, 1, 0, 0, 1])]
    later = Handoff(None, np.array([3], dtype=I64))
    b.handoff = later
    assert m.enter(6, TREE, PACE)[1] is later  # the last rule's handoff wins
    static = Membership([])
    assert static.begin_cloud_round(2, TREE, regroup_to([], []), PACE) == (TREE, {})
    assert static.enter(2, TREE, PACE) == (TREE, None) and static.end_cloud_round(TREE) == {}


def test_membership_for_picks_the_rules_the_settings_ask_for_in_order():
    moving = Mobility(rate=0.5, handoff="carry")
    both = membership_for(HSGDSettings(periods=(1, 3), groups=(3,), regroup_every=2,
                                       mobility=moving))
    assert [type(r) for r in both.rules] == [Regrouping, Moving]
    regroup, move = both.rules
    assert regroup.every == 2 and regroup.mobility is moving and move.mobility is moving
    assert move.maps is None
    only = membership_for(HSGDSettings(periods=(1, 3), groups=(3,), regroup_every=3))
    assert [type(r) for r in only.rules] == [Regrouping] and only.rules[0].every == 3
    assert [type(r) for r in membership_for(HSGDSettings(
        periods=(1, 3), groups=(3,), mobility=Mobility(trace=((2, 0, 1),)))).rules] == [Moving]
    assert membership_for(HSGDSettings(periods=(1, 3), groups=(3,))).rules == []


@pytest.mark.parametrize("edge_rounds", [1, 2])
def test_each_edge_round_of_a_cloud_round_takes_its_own_map(edge_rounds):
    """Short cloud rounds: the map index and the first edge round (nothing to carry) count
    from each cloud round's start."""
    maps = [[0, 2, 1, 1, 2, 2], [0, 2, 1, 1, 0, 2]][:edge_rounds]
    pace = RoundPace(seed=11, edge_rounds=edge_rounds, histograms=HIST)
    rule = Moving(Maps(maps, "carry"))  # type: ignore[arg-type]
    rule.begin_cloud_round(2, TREE, regroup_to([], []), pace)
    first = edge_rounds + 1  # the second cloud round's first edge round
    tree, handoff = rule.enter(first, TREE, pace)
    assert edge_map(tree) == [0, 2, 1, 1, 2, 2]
    assert handoff is not None and handoff.start_edges is None
    if edge_rounds == 2:
        tree, handoff = rule.enter(first + 1, tree, pace)
        assert edge_map(tree) == [0, 2, 1, 1, 0, 2]
        assert handoff is not None and handoff.start_edges.tolist() == [0, 2, 1, 1, 2, 2]
