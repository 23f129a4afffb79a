"""Who trains and for how many steps (fedhier/round/participants.py), worked out by hand from
docs/hsgd.md, written against mutmut's survivors (docs/testing.md, "Mutation testing").

The draws are the documented ones, ``generator(seed, purpose, ids)`` of fedhier/common/rng.py:
"participation" (edge round, edge) picks ⌈f·n_i⌉ of an edge's n_i members without
replacement, "stragglers" marks the clients whose uniform draw is below the fraction, and
"straggler-steps" (edge round, client) draws a straggler's steps in [min(k, I-1), I-1]
(I when I = 1). The lists below were read off those generators once (seed 7) and are
asserted as literals.

Clients 0..5 under two edges: edge 0 = {0, 2, 5}, edge 1 = {1, 3, 4}; weights 1..6.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedhier.round.participants import Workload, plan_edge_round, sample_clients, stragglers
from fedhier.tree.hierarchy import Hierarchy

SEED = 7
EDGE_OF = np.array([0, 1, 0, 1, 1, 0])
WEIGHTS = np.arange(1.0, 7.0)
# generator(7, "stragglers").random(6) = [0.899, 0.288, 0.470, 0.782, 0.763, 0.834]
# generator(7, "straggler-steps", 2, c).integers(1, 3) = [2, 2, 1, 1, 2, 2] for c = 0..5
# generator(7, "straggler-steps", 2, c).integers(1, 5) = [3, 4, 2, 1, 3, 3]
# generator(7, "straggler-steps", 2, c).integers(3, 5) = [4, 4, 3, 3, 4, 4]
# generator(7, "participation", 2, e).choice(3, 2, replace=False) = [0, 1] for e = 0, 1
# generator(7, "participation", 3, 0).choice(5, 3, replace=False) = [4, 0, 3]
# generator(7, "participation", 3, 1).choice(5, 3, replace=False) = [2, 0, 3]
# generator(7, "participation", 4, 0).choice(5, 3, replace=False) = [4, 2, 1]
# generator(8, "participation", 3, 0).choice(5, 3, replace=False) = [1, 2, 4]


def tree(periods: tuple[int, ...] = (3, 6)) -> Hierarchy:
    return Hierarchy(periods, (EDGE_OF,))


def plan(workload: Workload, periods: tuple[int, ...] = (3, 6), edge_round: int = 2,
         **kwargs):
    return plan_edge_round(tree(periods), workload, WEIGHTS, SEED, edge_round, **kwargs)


# -- sample_clients -------------------------------------------------------------------------
MEMBERS = np.array([40, 10, 30, 20, 50])  # not sorted: the result is


@pytest.mark.parametrize("participation", [1.0, 1, 5, 9, 0.999999999999])
def test_all_members_when_the_share_covers_the_edge(participation):
    # f = 1 is a fraction (every client), not "one client"; a count >= n is every client
    out = sample_clients(MEMBERS, participation, SEED, 3, 0)
    assert out.tolist() == [10, 20, 30, 40, 50]


def test_a_count_above_one_draws_that_many_members_seeded_by_edge_round_and_edge():
    # picks [4, 0, 3] of positions -> members 50, 40, 20, sorted
    assert sample_clients(MEMBERS, 3, SEED, 3, 0).tolist() == [20, 40, 50]
    assert sample_clients(MEMBERS, 3.0, SEED, 3, 0).tolist() == [20, 40, 50]
    assert sample_clients(MEMBERS, 3, SEED, 3, 1).tolist() == [20, 30, 40]  # [2, 0, 3]
    assert sample_clients(MEMBERS, 3, SEED, 4, 0).tolist() == [10, 30, 50]  # [4, 2, 1]
    assert sample_clients(MEMBERS, 3, 8, 3, 0).tolist() == [10, 30, 50]  # [1, 2, 4]


def test_a_fraction_takes_the_ceiling_of_f_n_at_least_one():
    # 0.6 * 5 = 3 exactly (3.0000000000000004 in floats: the 1e-9 keeps it 3, not 4)
    assert sample_clients(MEMBERS, 0.6, SEED, 3, 0).tolist() == [20, 40, 50]
    assert len(sample_clients(MEMBERS, 0.41, SEED, 3, 0)) == 3  # ⌈2.05⌉
    assert len(sample_clients(MEMBERS, 0.4, SEED, 3, 0)) == 2  # ⌈2⌉
    assert len(sample_clients(MEMBERS, 0.01, SEED, 3, 0)) == 1  # ⌈0.05⌉
    assert len(sample_clients(MEMBERS, 1e-12, SEED, 3, 0)) == 1  # ⌈5e-12 - 1e-9⌉ = 0 -> 1
    assert len(sample_clients(MEMBERS, 0.8, SEED, 3, 0)) == 4


def test_a_count_of_two_is_two_clients_not_a_share():
    # participation 2 > 1 is a count: 2 of 5 members (a share would be all of them)
    # generator(7, "participation", 3, 0).choice(5, 2) = [0, 4]
    assert sample_clients(MEMBERS, 2, SEED, 3, 0).tolist() == [40, 50]
    assert sample_clients(MEMBERS, 2.0, SEED, 3, 0).tolist() == [40, 50]
    # int(1.5) = 1 client: generator(7, "participation", 3, 0).choice(5, 1) = [0]
    assert sample_clients(MEMBERS, 1.5, SEED, 3, 0).tolist() == [40]


# -- stragglers ------------------------------------------------------------------------------
def test_no_stragglers_at_fraction_zero():
    out = stragglers(6, 0.0, SEED)
    assert out.dtype == np.bool_ and out.tolist() == [False] * 6


def test_stragglers_are_the_draws_below_the_fraction():
    assert stragglers(6, 0.5, SEED).tolist() == [False, True, True, False, False, False]
    assert stragglers(6, 0.8, SEED).tolist() == [False, True, True, True, True, False]
    assert stragglers(6, 1.0, SEED).tolist() == [True] * 6
    assert stragglers(6, 0.288, SEED).tolist() == [False] * 6  # 0.2880... is not below


# -- plan_edge_round -------------------------------------------------------------------------
def test_every_client_does_i_steps_with_scale_one_by_default():
    out = plan(Workload())
    assert out.steps.dtype == np.int64 and out.scale.dtype == np.float64
    assert out.steps.tolist() == [3] * 6 and out.scale.tolist() == [1.0] * 6
    assert out.participants.tolist() == [0, 1, 2, 3, 4, 5]


def test_only_the_planning_edges_clients_train():
    out = plan(Workload(), edges=np.array([1]))
    assert out.steps.tolist() == [0, 3, 0, 3, 3, 0]
    assert plan(Workload(), edges=np.array([0, 1])).steps.tolist() == [3] * 6


def test_per_edge_periods_give_each_client_its_edges_period():
    out = plan(Workload(), periods=(2, 4), edge_periods=(2, 4))
    assert out.steps.tolist() == [2, 4, 2, 4, 4, 2]


def test_participation_picks_per_edge_by_the_edge_round_draw():
    # 0.5 of 3 -> ⌈1.5⌉ = 2 per edge, positions [0, 1]: clients 0, 2 and 1, 3
    out = plan(Workload(participation=0.5))
    assert out.steps.tolist() == [3, 3, 3, 3, 0, 0]


def test_stragglers_draw_their_steps_in_one_to_i_minus_one():
    # clients 1 and 2 are stragglers; I = 3: steps in [1, 2], drawn [2, 1]
    out = plan(Workload(straggler_fraction=0.5))
    assert out.steps.tolist() == [3, 2, 1, 3, 3, 3]
    assert out.scale.tolist() == [1.0] * 6  # no FedNova: no rescale


def test_a_straggler_of_an_edge_that_does_not_plan_stays_at_zero():
    out = plan(Workload(straggler_fraction=0.5), edges=np.array([0]))
    assert out.steps.tolist() == [3, 0, 1, 0, 0, 3]


def test_straggler_steps_follow_the_clients_own_edge_period():
    # edge 0: I_0 = 2 -> [1, 1]: 1 step; edge 1: I_1 = 5 -> [1, 4]: draw 4 for client 1
    out = plan(Workload(straggler_fraction=0.5), periods=(1, 10), edge_periods=(2, 5))
    assert out.steps.tolist() == [2, 4, 1, 5, 5, 2]


def test_the_fewest_steps_bound_the_draw_from_below():
    # k = 3, I = 5: steps in [3, 4]; every client a straggler: draws [4, 4, 3, 3, 4, 4]
    out = plan(Workload(straggler_fraction=1.0, straggler_min_steps=3), periods=(5, 10))
    assert out.steps.tolist() == [4, 4, 3, 3, 4, 4]
    # k = 9 > I - 1 = 4: the draw is I - 1 = 4
    out = plan(Workload(straggler_fraction=1.0, straggler_min_steps=9), periods=(5, 10))
    assert out.steps.tolist() == [4] * 6
    # k = 1, I = 5: [1, 4], draws [3, 4, 2, 1, 3, 3]
    out = plan(Workload(straggler_fraction=1.0), periods=(5, 10))
    assert out.steps.tolist() == [3, 4, 2, 1, 3, 3]


def test_a_straggler_with_an_edge_period_of_one_does_one_step():
    # I = 1: low = min(k, max(0, 1)) = 1, high = 1, whatever k
    for k in (1, 2, 5):
        out = plan(Workload(straggler_fraction=1.0, straggler_min_steps=k), periods=(1, 2))
        assert out.steps.tolist() == [1] * 6


def test_fednova_scales_by_tau_eff_over_tau_within_each_edge():
    out = plan(Workload(straggler_fraction=0.5, normalize_updates=True))
    assert out.steps.tolist() == [3, 2, 1, 3, 3, 3]
    # edge 0: clients 0, 2, 5, weights 1, 3, 6 -> p = .1, .3, .6; tau 3, 1, 3: tau_eff 2.4
    # edge 1: clients 1, 3, 4, weights 2, 4, 5 -> tau_eff = (2*2 + 4*3 + 5*3) / 11 = 31/11
    expected = [2.4 / 3, 31 / 22, 2.4 / 1, 31 / 33, 31 / 33, 2.4 / 3]
    np.testing.assert_allclose(out.scale, expected, rtol=1e-15)


def test_fednova_counts_only_the_clients_that_train():
    out = plan(Workload(participation=0.5, straggler_fraction=0.5, normalize_updates=True))
    assert out.steps.tolist() == [3, 2, 1, 3, 0, 0]
    # edge 0: clients 0, 2 (weights 1, 3; tau 3, 1): tau_eff = 1.5
    # edge 1: clients 1, 3 (weights 2, 4; tau 2, 3): tau_eff = 8/3; clients 4, 5 keep 1
    np.testing.assert_allclose(out.scale, [0.5, 4 / 3, 1.5, 8 / 9, 1.0, 1.0], rtol=1e-15)


def test_fednova_leaves_the_edges_that_do_not_plan_at_scale_one():
    out = plan(Workload(straggler_fraction=0.5, normalize_updates=True), edges=np.array([1]))
    assert out.steps.tolist() == [0, 2, 0, 3, 3, 0]
    np.testing.assert_allclose(out.scale, [1.0, 31 / 22, 1.0, 31 / 33, 31 / 33, 1.0],
                               rtol=1e-15)


def test_members_by_edge_is_each_edges_flatnonzero():
    """One stable sort gives every edge's clients as ``np.flatnonzero(edge_of == e)`` does
    (increasing ids; an edge without clients empty), so sampling draws the same clients."""
    from fedhier.round.participants import members_by_edge

    edge_of = np.random.default_rng(3).integers(0, 7, size=200)
    edge_of[edge_of == 4] = 5  # edge 4 has no clients
    got = members_by_edge(edge_of, 8)
    assert len(got) == 8
    for e in range(8):
        want = np.flatnonzero(edge_of == e)
        assert got[e].dtype == np.int64 and np.array_equal(got[e], want), e
