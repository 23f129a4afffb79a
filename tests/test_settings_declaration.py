"""A run setting is declared once (a field of fedhier.config.RunConfig, its range in
fedhier.ranges); every other view is generated from it or checked against it here:
pyproject.toml's [tool.flwr.app.config], the CLI flags, the algorithm's settings
(HSGDSettings, settings_for) and HierFedAvg's keyword defaults."""

from __future__ import annotations

import argparse
import inspect
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from fedhier.cli_flags import add_config_flags
from fedhier.config import FIELD_DEFAULTS, RunConfig
from fedhier.errors import ConfigError
from fedhier.hsgd import HSGDSettings
from fedhier.plan import Workload
from fedhier.ranges import RANGES, choices
from fedhier.run_setup import settings_for
from fedhier.settings_table import (
    app_key,
    cli_flag,
    flower_app_config,
    flower_app_differences,
    flower_app_toml,
    settings,
)
from fedhier_strategies.hierfedavg import HierFedAvg

ROOT = Path(__file__).resolve().parents[1]


def pyproject_app_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def typed(table: dict) -> dict:
    """key -> (type, value): 0 and 0.0, or "4" and 4, are different TOML values."""
    return {k: (type(v).__name__, v) for k, v in table.items()}


def test_pyproject_app_config_is_the_declaration():
    """Every key at its declared value and type, no key more or less. On failure run
    `python -m fedhier.settings_table --write pyproject.toml` (or declare the change on the
    field)."""
    assert typed(pyproject_app_config()) == typed(flower_app_config())
    generated = tomllib.loads(flower_app_toml())["tool"]["flwr"]["app"]["config"]
    assert typed(generated) == typed(flower_app_config())


def test_the_flower_apps_own_values_are_declared_with_their_reason():
    """pyproject may differ from RunConfig's defaults only where a field declares it, with a
    reason; today only the bare `flwr run .` demo's rounds (5, the default run's 30)."""
    differences = flower_app_differences()
    assert {k: v[:2] for k, v in differences.items()} == {"rounds": (30, 5)}
    assert all(len(reason) > 40 for _, _, reason in differences.values())
    # what a bare `flwr run .` runs: the defaults with exactly those values changed
    assert RunConfig.from_app_config(pyproject_app_config()) == RunConfig.from_mapping(
        {k.replace("-", "_"): app for k, (_, app, _) in differences.items()})


def test_metadata_for_the_app_comes_with_a_reason():
    from fedhier.config import _help

    with pytest.raises(TypeError, match="together"):
        _help("x", flower_app=5)


def test_every_setting_is_one_row_with_its_range_or_names():
    rows = {s.name: s for s in settings()}
    assert list(rows) == [f.name for f in fields(RunConfig)]
    assert {n for n, s in rows.items() if s.valid is not None} == set(RANGES)
    assert set(choices()) <= {n for n, s in rows.items() if s.type == "str"}
    for s in rows.values():
        assert s.help and s.default == FIELD_DEFAULTS[s.name]
        assert s.flag == cli_flag(s.name) == "--" + app_key(s.name)
        assert "_" not in s.app_key


def test_cli_has_one_flag_per_setting_and_nothing_set_by_default():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == {s.name for s in settings()}
    for s in settings():
        action = actions[s.name]
        assert s.flag in action.option_strings and action.default is None
        if s.name != "engine":  # the engine's help lists the registry's engines
            assert action.help.startswith(s.help)


def test_the_algorithm_defaults_are_the_declared_defaults():
    """HSGDSettings' defaults (and those of its parts: Workload, Mobility, TimeModel,
    AsyncEdges, ReplyPolicy) and HierFedAvg's keyword defaults equal what the default
    RunConfig gives the algorithm."""
    cfg = RunConfig()
    declared = settings_for(cfg)
    assert HSGDSettings(periods=cfg.periods, groups=cfg.groups) == declared
    assert HierFedAvg(cfg.local_period, cfg.global_period, cfg.groups).settings == declared
    shared = ({f.name for f in fields(RunConfig)} & {f.name for f in fields(HSGDSettings)}
              - {"periods"})  # periods=None: (I, G)
    assert len(shared) >= 8
    for name, parameter in inspect.signature(HierFedAvg).parameters.items():
        if name in shared and parameter.default is not inspect.Parameter.empty:
            assert parameter.default == getattr(declared, name), name


#: a run far from the defaults, for every setting the algorithm reads
CHANGED = dict(clients=12, groups=(3,), grouping="contiguous", weighting="uniform", seed=7,
               local_period=2, global_period=8, edge_periods="2,4,4", participation=0.5,
               straggler_fraction=0.25, straggler_min_steps=2, min_clients_per_edge=1,
               on_nan="skip-client", diagnostics_every=2, regroup_every=3,
               aggregators="median,mean", mobility_rate=0.1, handoff="carry", step_seconds=0.5,
               compute_spread=0.2, edge_slowdown="1:3", client_edge_mbps=7.0,
               edge_cloud_latency_ms=9.0, exclude_after=5, max_weight_ratio=4.0,
               max_update_ratio=50.0, on_bad_reply="drop", metrics_aggregator="median")
#: HSGDSettings field -> the RunConfig view it is made from, where the names differ
VIEWS = {"aggregators": "aggregator_names", "edge_periods": "edge_period_list",
         "policy": "reply_policy"}


def test_settings_for_carries_every_setting_the_algorithm_reads():
    """Each HSGDSettings field is the same-named RunConfig setting or view (a method such as
    ``workload()``): none is dropped or left at its default on the way."""
    cfg = RunConfig(**CHANGED)
    algorithm = settings_for(cfg)
    for f in fields(HSGDSettings):
        source = getattr(cfg, VIEWS.get(f.name, f.name))
        expected = source() if callable(source) else source
        assert getattr(algorithm, f.name) == expected, f.name
        if f.name in FIELD_DEFAULTS and f.name not in ("periods", "groups"):
            assert expected != FIELD_DEFAULTS[f.name], f"{f.name}: CHANGED leaves it default"
    assert HierFedAvg.from_settings(algorithm).settings is algorithm


#: lead: once HSGDSettings.__post_init__ calls fedhier.topology.check_schedule (fedhier/hsgd.py
#: is helper t23a's file; see the t23c report) these pass: drop the mark


@pytest.mark.parametrize("values,algorithm", [
    pytest.param({"global_period": 7}, {"periods": (5, 7), "groups": (4,)}),
    pytest.param({"groups": (4, 2)}, {"periods": (5, 20), "groups": (4, 2)}),
    ({"periods": (2, 6, 9), "groups": (4, 2)}, {"periods": (2, 6, 9), "groups": (4, 2)}),
    pytest.param({"edge_periods": "3,6,6,6"}, {"periods": (3, 20), "groups": (4,),
                                               "edge_periods": (3, 6, 6, 6)}),
    ({"local_period": 2, "edge_periods": "2,4,4", "groups": (2,), "normalize_updates": True},
     {"periods": (2, 20), "groups": (2,), "edge_periods": (2, 4, 4),
      "workload": Workload(normalize_updates=True)})])
def test_periods_are_checked_by_one_function(values, algorithm):
    """RunConfig and the algorithm's settings refuse a bad schedule with the same line."""
    with pytest.raises(ConfigError) as config_error:
        RunConfig.from_mapping(values)
    with pytest.raises(ConfigError) as settings_error:
        HSGDSettings(**algorithm)
    assert str(settings_error.value) == str(config_error.value)
