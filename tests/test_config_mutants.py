"""Settings validation (fedhier/config_checks.py, fedhier/config.py): messages word for word
and the values a RunConfig takes, written against mutmut's survivors (docs/testing.md,
"Mutation testing"). Every case builds a RunConfig (no run starts); a setting just inside
each relation's bound is accepted, and one just across it refused with its one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedhier.config import RunConfig
from fedhier.config_checks import FLOAT32_MAX, one_of
from fedhier.errors import ConfigError
from tests.helpers import assert_refused

MEMBERS = "every group needs at least one member"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """A one-move mobility trace (4 clients, 2 edges) and a 2 x 2 reachability matrix."""
    trace = tmp_path / "trace.csv"
    trace.write_text("round,client,edge\n1,0,1\n")
    reach = tmp_path / "reach.csv"
    reach.write_text("0,1\n1,0\n")
    return {"trace": str(trace), "reach": str(reach)}


# -- limits -------------------------------------------------------------------------------
def test_an_integer_inside_a_tuple_is_held_to_the_int64_limit():
    assert_refused(lambda: RunConfig(groups=(2**62,)),
                   "groups 4611686018427387904 is too large (limit 2**62)")


def test_round_timeout_alone_may_be_infinite():
    assert RunConfig(round_timeout=float("inf")).round_timeout == float("inf")
    assert_refused(lambda: RunConfig(lr=float("inf")),
                   "lr inf is not a finite float32 number (|x| <= 3.4e+38)")


def test_the_largest_float32_is_accepted_and_no_more():
    assert RunConfig(weight_decay=FLOAT32_MAX).weight_decay == FLOAT32_MAX
    assert_refused(lambda: RunConfig(weight_decay=3.5e38),
                   "weight_decay 3.5e+38 is not a finite float32 number (|x| <= 3.4e+38)")


def test_the_total_step_count_is_held_below_2_to_the_62():
    # R x G = 2**61 x 2 = 2**62 exactly: refused; one round fewer: accepted
    assert_refused(lambda: RunConfig(rounds=2**61, local_period=1, global_period=2),
                   "rounds x global_period = 4611686018427387904 local steps is too many "
                   "(limit 2**62)")
    assert RunConfig(rounds=2**61 - 1, local_period=1, global_period=2).iterations == \
        2**62 - 2


# -- names --------------------------------------------------------------------------------
def test_an_unknown_name_lists_the_choices_with_a_hint_only_when_one_is_close():
    assert_refused(lambda: RunConfig(weighting="zzz"),
                   "unknown weighting 'zzz'; choose one of samples, uniform")
    assert_refused(lambda: RunConfig(weighting="unifrm"),
                   "unknown weighting 'unifrm' (did you mean 'uniform'?); choose one of "
                   "samples, uniform")
    assert_refused(lambda: one_of("colour", "gren", ("red", "green", "greenish")),
                   "unknown colour 'gren' (did you mean 'green'?); choose one of red, green, "
                   "greenish")


def test_a_module_function_grouping_is_imported_not_looked_up_by_name():
    cfg = RunConfig(grouping="fedhier.grouping.simple:contiguous_grouping")
    assert cfg.grouping == "fedhier.grouping.simple:contiguous_grouping"
    assert_refused(lambda: RunConfig(grouping="fedhier_no_such_mod:f"),
                   "grouping plugin 'fedhier_no_such_mod:f' from module reference "
                   "fedhier_no_such_mod:f failed to import: ModuleNotFoundError: No module "
                   "named 'fedhier_no_such_mod'; fix or uninstall that package")


def test_an_empty_dataset_is_refused():
    assert_refused(lambda: RunConfig(dataset=""), "dataset must not be empty")


# -- groups and levels ----------------------------------------------------------------------
def test_every_level_has_at_least_one_group_and_no_more_than_below():
    assert_refused(lambda: RunConfig(groups=(0,)), "groups must be at least 1, got [0]")
    assert_refused(lambda: RunConfig(groups=(4, 0), periods=(1, 2, 4)),
                   "groups must be at least 1, got [4, 0]")
    assert_refused(lambda: RunConfig(groups=(21,)),
                   f"more groups (21) than clients (20) at level 1: {MEMBERS}")
    assert_refused(lambda: RunConfig(groups=(4, 5), periods=(1, 2, 4)),
                   f"more groups (5) than level-1 groups (4) at level 2: {MEMBERS}")
    assert RunConfig(groups=(20,)).num_edges == 20
    assert RunConfig(groups=(4, 4), periods=(1, 2, 4)).groups == (4, 4)


def test_one_aggregator_per_level_counts_every_level():
    cfg = RunConfig(groups=(4, 2), periods=(1, 2, 4), aggregators="mean,median,mean")
    assert cfg.aggregator_names == ("mean", "median", "mean")
    assert_refused(lambda: RunConfig(aggregators="mean,median,mean"),
                   "aggregators: give one name for every level or 2 (edge ... cloud), got 3: "
                   "mean,median,mean")


# -- mobility, reachability, asynchronous edges -----------------------------------------------
def test_a_trace_and_a_positive_rate_are_refused_together(files):
    small = {"clients": 4, "groups": (2,)}
    assert RunConfig(mobility_trace=files["trace"], **small).mobility_trace == files["trace"]
    assert_refused(lambda: RunConfig(mobility_rate=1.0, mobility_trace=files["trace"], **small),
                   "give mobility_rate or mobility_trace, not both")


def test_a_reachability_matrix_needs_two_edges(files):
    assert RunConfig(reachability=files["reach"], clients=4, groups=(2,)).num_edges == 2
    assert_refused(lambda: RunConfig(reachability=files["reach"], clients=4, groups=(1,)),
                   "a reachability matrix needs at least 2 edges")


def test_the_async_buffer_is_held_to_the_number_of_edges():
    assert RunConfig(async_buffer=4).async_buffer == 4
    assert_refused(lambda: RunConfig(async_buffer=5),
                   "async_buffer K=5 is more than the 4 edges; the cloud would wait for "
                   "reports that never come")


# -- edge servers ---------------------------------------------------------------------------
NEED = "edge servers as processes need "


@pytest.mark.parametrize("kw,needs", [
    ({"groups": (4, 2), "periods": (1, 2, 4)},
     "a two-level hierarchy (one local and one global period)"),
    ({"mobility_rate": 0.5}, "static clients (no mobility)"),
    ({"regroup_every": 1}, "a fixed grouping (no regroup_every)"),
    ({"async_buffer": 1}, "synchronous edges (no async_buffer)"),
    ({"edge_periods": "5,5,5,5"}, "one local period for every edge (no edge_periods)"),
])
def test_edge_servers_refuse_what_they_do_not_run(kw, needs):
    assert_refused(lambda: RunConfig(edge_servers=True, **kw), NEED + needs)


def test_edge_servers_refuse_a_trace_too(files):
    assert_refused(lambda: RunConfig(edge_servers=True, mobility_trace=files["trace"],
                                     clients=4, groups=(2,)),
                   NEED + "static clients (no mobility)")


def test_edge_servers_refuse_gradient_grouping_and_kept_momentum_only():
    assert_refused(lambda: RunConfig(edge_servers=True, grouping="gradient"),
                   "edge servers as processes place clients before the run; the 'gradient' "
                   "grouping needs their gradients: choose contiguous, random or a "
                   "label-based grouping")
    assert_refused(lambda: RunConfig(edge_servers=True, momentum=0.5, optimizer_state="keep"),
                   "edge servers do not forward clients' kept optimizer state (checkpoints): "
                   "use optimizer_state reset")
    # momentum alone, or keep without state to keep: accepted
    assert RunConfig(edge_servers=True, momentum=0.5).edge_servers
    assert RunConfig(edge_servers=True, optimizer_state="keep").edge_servers
    assert RunConfig(edge_servers=True, grouping="contiguous").edge_servers
