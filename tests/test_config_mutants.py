"""Settings validation (fedhier/settings/checks.py, fedhier/settings/run_config.py): messages word
for word and the values a RunConfig takes, written against mutmut's survivors (docs/testing.md,
"Mutation testing"). Every case builds a RunConfig (no run starts); a setting just inside
each relation's bound is accepted, and one just across it refused with its one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhier.settings.checks import FLOAT32_MAX, one_of
from fedhier.settings.run_config import RunConfig
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
    cfg = RunConfig(grouping="fedhier.tree.grouping.simple:contiguous_grouping")
    assert cfg.grouping == "fedhier.tree.grouping.simple:contiguous_grouping"
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
@pytest.mark.parametrize("kw,message", [  # mobility under regions runs (test_region_moves)
    ({"mobility_rate": 0.5, "groups": (4, 2), "periods": (1, 2, 4), "aggregators": "clip"},
     "moving clients under region servers need a region rule that does not measure from "
     "the region's own model (not clip): a region's job that starts inside its period does "
     "not carry its last aggregate"),
    ({"regroup_every": 1, "groups": (4, 2), "periods": (1, 2, 4)},
     "edge servers under region servers need a fixed grouping (no regroup_every): a "
     "regrouping re-draws the edges' regions too, and an edge server stays under the region "
     "server it started under"),
])
def test_edge_servers_refuse_what_they_do_not_run(kw, message):
    assert_refused(lambda: RunConfig(edge_servers=True, **kw), message)


def test_edge_servers_run_deeper_trees():
    """Servers at every level (docs/deployment.md, regions): three levels are accepted."""
    cfg = RunConfig(edge_servers=True, groups=(4, 2), periods=(1, 2, 4))
    assert (cfg.edge_servers, cfg.groups, cfg.periods) == (True, (4, 2), (1, 2, 4))


def test_edge_servers_take_a_trace_at_any_depth(files):
    """Clients move between edge servers (fedhier.round.tiers.moves), under regions too."""
    assert RunConfig(edge_servers=True, mobility_trace=files["trace"], clients=4,
                     groups=(2, 1), periods=(1, 2, 4)).edge_servers
    for kw in ({"mobility_trace": files["trace"]}, {"mobility_rate": 0.5},
               {"regroup_every": 1}):
        assert RunConfig(edge_servers=True, clients=4, groups=(2,), **kw).edge_servers


def test_edge_servers_run_per_edge_periods_gradient_grouping_and_kept_momentum():
    """Once refused; run on servers since (tests/test_deploy_edge_features.py)."""
    assert RunConfig(edge_servers=True, edge_periods="5,5,5,5").edge_servers
    assert RunConfig(edge_servers=True, grouping="gradient").edge_servers
    assert RunConfig(edge_servers=True, momentum=0.5, optimizer_state="keep").edge_servers


# -- fedhier/settings/run_config.py: building a RunConfig
# ------------------------------------------------
def card(tmp_path: Path, name: str, defaults: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'name = "{name}"\nsource = "synthetic"\n[defaults]\n{defaults}\n')
    return str(path)


def test_a_cards_periods_give_way_to_the_users(tmp_path):
    io = card(tmp_path, "io", "local_period = 2\nglobal_period = 8\nclients = 8")
    assert RunConfig.from_mapping({"dataset": io}).periods == (2, 8)
    # the user's periods replace the card's I and G (no contradiction with them)
    assert RunConfig.from_mapping({"dataset": io, "periods": [3, 6]}).periods == (3, 6)
    # a given G keeps the card's I
    assert RunConfig.from_mapping({"dataset": io, "global_period": 4}).periods == (2, 4)
    p = card(tmp_path, "p", "periods = [2, 8]\nclients = 8")
    assert RunConfig.from_mapping({"dataset": p}).periods == (2, 8)
    # a given I drops the card's periods, and G takes the field default 20
    assert RunConfig.from_mapping({"dataset": p, "local_period": 4}).periods == (4, 20)
    assert RunConfig.from_mapping({"dataset": p}).clients == 8


def test_a_card_may_not_set_the_runs_own_settings(tmp_path):
    bad = card(tmp_path, "bad", "seed = 3")
    assert_refused(lambda: RunConfig.from_mapping({"dataset": bad}),
                   f"[defaults] of {bad} cannot set 'seed'; a card sets only what fits its "
                   "data, not dataset, data_path, out, seed, engine, device")
    typo = card(tmp_path, "typo", 'rounds = "x"')
    assert_refused(lambda: RunConfig.from_mapping({"dataset": typo}),
                   f"rounds in [defaults] of {typo} must be an integer, got 'x'")


def test_a_shipped_cards_defaults():
    from fedhier.settings.run_config import dataset_defaults

    assert dataset_defaults("digits") == {}
    assert dataset_defaults("shakespeare") == {
        "model": "lstm", "partition": "natural", "clients": 40, "groups": (2,),
        "local_period": 5, "global_period": 40, "participation": 0.25, "batch_size": 10,
        "lr": 2.0}


def test_an_npz_path_names_its_dataset_unless_one_is_given():
    assert RunConfig.from_mapping({"data_path": "/x/d.NPZ"}).dataset == "npz"
    assert RunConfig.from_mapping({"data_path": "/x/d.npz", "dataset": "digits"}).dataset == \
        "digits"
    assert RunConfig.from_mapping({"data_path": "/x/d.csv"}).dataset == "digits"


def test_periods_and_i_or_g_must_agree():
    assert_refused(lambda: RunConfig.from_mapping({"periods": [2, 4], "local_period": 3}),
                   "local_period=3 contradicts periods=[2, 4] in config; give one or the other")
    assert_refused(lambda: RunConfig.from_mapping({"periods": [2, 4], "global_period": 8},
                                                  "a.toml"),
                   "global_period=8 contradicts periods=[2, 4] in a.toml; give one or the "
                   "other")
    assert RunConfig.from_mapping({"periods": [2, 4], "local_period": 2,
                                   "global_period": 4}).periods == (2, 4)


def test_a_given_i_must_be_the_gcd_of_the_edge_periods():
    edges = "2,4,4,4"
    assert_refused(lambda: RunConfig.from_mapping({"edge_periods": edges, "local_period": 4}),
                   "local_period gives I=4, but with edge_periods=2,4,4,4 an edge round is "
                   "their gcd, 2 steps, in config; leave local_period unset or give 2")
    assert_refused(lambda: RunConfig.from_mapping({"edge_periods": edges,
                                                   "periods": [4, 20]}, "b.toml"),
                   "periods gives I=4, but with edge_periods=2,4,4,4 an edge round is "
                   "their gcd, 2 steps, in b.toml; leave periods unset or give 2")
    for given in ({}, {"local_period": 2}, {"global_period": 20}, {"periods": [2, 20]}):
        cfg = RunConfig.from_mapping({"edge_periods": edges, **given})
        assert (cfg.periods, cfg.local_period, cfg.global_period) == ((2, 20), 2, 20)


def test_the_flower_apps_defaults_count_as_not_set():
    # model = "mlp" is the field default: the shakespeare card's lstm applies
    cfg = RunConfig.from_app_config({"dataset": "shakespeare", "model": "mlp", "rounds": 30})
    assert (cfg.model, cfg.rounds, cfg.clients) == ("lstm", 30, 40)
    assert RunConfig.from_app_config({"dataset": "shakespeare", "model": "cnn"}).model == "cnn"
    assert_refused(lambda: RunConfig.from_app_config({"rounds": "x"}),
                   "rounds in run_config must be an integer, got 'x'")
    assert_refused(lambda: RunConfig.from_mapping({"rounds": "x"}),
                   "rounds in config must be an integer, got 'x'")
    # a later error names the run_config too
    assert_refused(lambda: RunConfig.from_app_config({"periods": [2, 4], "local_period": 3}),
                   "local_period=3 contradicts periods=[2, 4] in run_config; give one or the "
                   "other")


def test_a_toml_files_errors_name_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('rounds = "x"\n')
    assert_refused(lambda: RunConfig.from_toml(path),
                   f"rounds in {path} must be an integer, got 'x'")
    path.write_text("rounds = 3\nperiods = [2, 4]\n")
    assert RunConfig.from_toml(path).periods == (2, 4)


def test_field_metadata_takes_the_flower_app_value_with_its_reason_only():
    from fedhier.settings.declaration import setting

    assert dict(setting(0, "h").metadata) == {"help": "h", "valid": None, "readers": ()}
    assert dict(setting(0, "h", flower_app=1, flower_app_reason="r").metadata) == {
        "help": "h", "valid": None, "readers": (), "flower_app": 1, "flower_app_reason": "r"}
    assert setting(0, "h", part=["a", ("b", "x"), ("c", "y", "m:f")]).metadata["readers"] == (
        ("a", "", None), ("b", "x", None), ("c", "y", "m:f"))
    for half in ({"flower_app": 1}, {"flower_app_reason": "r"}):
        assert_refused(lambda half=half: setting(0, "h", **half),
                       "give flower_app and flower_app_reason together", TypeError)


# -- fedhier/settings/run_config.py: the views the run reads
# ----------------------------------------------
def test_mobility_reads_the_trace_in_edge_rounds_and_the_matrix(files, tmp_path):
    from fedhier.tree.mobility import Mobility

    trace = tmp_path / "t3.csv"
    trace.write_text("round,client,edge\n3,1,1\n")
    cfg = RunConfig(local_period=2, global_period=8, rounds=3, clients=4, groups=(2,),
                    mobility_trace=str(trace), handoff="carry:min-divergence",
                    reachability=files["reach"])
    # cloud round 3 of G/I = 4 edge rounds starts at edge round (3 - 1) * 4 + 1 = 9
    assert cfg.mobility() == Mobility(rate=0.0, reachability=((False, True), (True, False)),
                                      trace=((9, 1, 1),), handoff="carry",
                                      admission="min-divergence")
    assert [type(x) for x in cfg.mobility().trace[0]] == [int, int, int]  # not 9.0
    assert_refused(lambda: RunConfig(local_period=2, global_period=8, rounds=2, clients=4,
                                     groups=(2,), mobility_trace=str(trace)),
                   "mobility trace t3.csv row 2: round 3 is not in 1..2")
    assert_refused(lambda: RunConfig(local_period=2, global_period=8, rounds=3, clients=1,
                                     groups=(1,), mobility_trace=str(trace)),
                   "mobility trace t3.csv row 2: client 1 does not exist (clients 0..0)")
    assert RunConfig(mobility_rate=0.25).mobility() == Mobility(rate=0.25)


def test_the_parts_take_each_setting_in_its_place():
    from fedhier.local.optimizer import LocalOptimizer
    from fedhier.round.asynchrony.settings import AsyncEdges
    from fedhier.round.clock import TimeModel
    from fedhier.round.faults import FaultModel
    from fedhier.round.participants import Workload
    from fedhier.round.reply_policy import ReplyPolicy

    cfg = RunConfig(step_seconds=1.5, compute_spread=0.5, client_edge_mbps=7.0,
                    client_edge_latency_ms=3.0, edge_cloud_mbps=2.0, edge_cloud_latency_ms=9.0,
                    edge_slowdown="1:4", exclude_after=5, max_weight_ratio=2.0,
                    max_update_ratio=3.0, participation=0.5, straggler_fraction=0.25,
                    straggler_min_steps=2, normalize_updates=True, async_buffer=2,
                    max_staleness=7, fail_rate=0.25, dropout_fraction=0.5,
                    dropout_rounds="2-3", momentum=0.5, weight_decay=0.25, clip_norm=3.0)
    assert cfg.time_model() == TimeModel(1.5, 0.5, 7.0, 3.0, 2.0, 9.0, ((1, 4.0),))
    assert cfg.reply_policy() == ReplyPolicy("stop", 5, 2.0, 3.0)
    assert RunConfig(edge_servers=True).reply_policy().on_bad_reply == "drop"
    assert cfg.workload() == Workload(0.5, 0.25, 2, True)
    assert cfg.asynchronous() == AsyncEdges(2, 7)
    assert cfg.faults() == FaultModel(0.25, 0.5, (2, 3))
    assert cfg.local_optimizer() == LocalOptimizer(0.5, 0.25, 3.0)


def test_learning_rates_follow_the_schedule_over_the_runs_steps():
    # step: 0.5 * 0.5 ** (t // 2) for t = 1..4
    cfg = RunConfig(lr=0.5, lr_schedule="step", lr_decay=0.5, lr_step_every=2)
    assert cfg.learning_rates(1, 4).tolist() == [0.5, 0.25, 0.25, 0.125]
    # exponential: a decay per cloud round of G = 4 steps, t = 3, 4, 5
    cfg = RunConfig(lr=0.5, lr_schedule="exponential", lr_decay=0.5, local_period=2,
                    global_period=4)
    assert cfg.learning_rates(3, 3).tolist() == [0.5, 0.25, 0.25]
    # cosine over T = R x G = 8 steps: (1 + cos(pi t / 8)) / 2
    cfg = RunConfig(lr=1.0, lr_schedule="cosine", rounds=2, local_period=2, global_period=4)
    rates = cfg.learning_rates(0, 9)
    assert rates[[0, 4, 8]].tolist() == [1.0, 0.5, 0.0]
    assert rates[2] == pytest.approx((1 + 2**-0.5) / 2, abs=1e-15)
    assert cfg.learning_rates(0, 9).dtype == np.float64


def test_replace_with_a_new_i_or_g_resets_a_two_level_schedule():
    assert RunConfig().replace(local_period=4).periods == (4, 20)
    assert RunConfig().replace(global_period=40).periods == (5, 40)
    assert RunConfig().replace(lr=0.5).periods == (5, 20)
    deep = RunConfig(groups=(4, 2), periods=(1, 2, 4))
    assert deep.replace(periods=(2, 4, 8)).periods == (2, 4, 8)
    assert deep.replace(lr=0.5).periods == (1, 2, 4)
    assert deep.replace(periods=(2, 4, 8), local_period=2).periods == (2, 4, 8)
    assert_refused(lambda: deep.replace(local_period=2),
                   "replace periods, not local/global_period, on a deeper tree")
    assert_refused(lambda: deep.replace(global_period=8),
                   "replace periods, not local/global_period, on a deeper tree")


def test_the_views_of_groups_and_periods():
    cfg = RunConfig(groups=(4, 2), periods=(1, 2, 4), rounds=3)
    assert (cfg.num_edges, cfg.iterations, cfg.local_period, cfg.global_period) == (4, 12, 1, 4)
    assert RunConfig(groups=4).groups == (4,)
    assert RunConfig(edge_periods="2,4,4,4").edge_period_list == (2, 4, 4, 4)
    assert RunConfig(aggregators=" mean , median").aggregator_names == ("mean", "median")
    assert RunConfig().to_run_config()["local-period"] == 5


def test_groups_and_periods_given_directly_are_checked_by_name():
    assert_refused(lambda: RunConfig(groups=2.5), "groups in config must be integers, got 2.5")
    assert_refused(lambda: RunConfig(periods=[2, "x"]),
                   "periods in config must be an integer or a comma-separated list of "
                   "integers, got [2, 'x']")


def test_edge_periods_set_i_to_their_gcd_only_when_all_are_positive():
    assert RunConfig(edge_periods="1,2,2,4").periods == (1, 20)
    assert_refused(lambda: RunConfig(edge_periods="0,5,5,5"),
                   "edge_periods must be positive integers, got [0, 5, 5, 5]")
    # all zero: gcd 0 would make I = 0 and a message about local_period instead
    assert_refused(lambda: RunConfig(edge_periods="0,0,0,0"),
                   "edge_periods must be positive integers, got [0, 0, 0, 0]")
