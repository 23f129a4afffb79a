"""fedhier sweep, the pure parts in-process: spec parsing and validation, statistics against
scipy, honest tuning, the skip / resume / restart decisions, a trial run by fedhier run's own
code, and the sandwich suite written as a spec (same metrics.jsonl as the suite's own run).
The one Ray Tune sweep is in tests/test_sweep_tune.py."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.studies.sweep.report import summarize
from fedhier.studies.sweep.spec import build, parse_grid
from fedhier.studies.sweep.stats import paired, run_numbers, t_interval
from fedhier.studies.sweep.trials import (
    Trial,
    run_argv,
    run_trial,
    toml_text,
    trial_state,
    trials_of,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = {"clients": 6, "groups": 2, "rounds": 3, "local_period": 2, "global_period": 4,
        "engine": "vectorized", "min_partition_size": 2}


# ---------------------------------------------------------------- statistics
def test_t_interval_equals_scipy_on_a_known_case():
    values = [0.81, 0.79, 0.84, 0.80, 0.83]
    ci = t_interval(values)
    sem = scipy_stats.sem(values)
    low, high = scipy_stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 5, scale=sem)
    assert ci["low"] == pytest.approx(low, abs=1e-15)
    assert ci["high"] == pytest.approx(high, abs=1e-15)
    # by hand: mean 0.814, s = sqrt(0.00043), t_{0.975, 4} = 2.7764451051977987
    assert ci["mean"] == pytest.approx(0.814, abs=1e-15)
    assert ci["std"] == pytest.approx(math.sqrt(0.00043), abs=1e-15)
    assert ci["high"] - ci["mean"] == pytest.approx(
        2.7764451051977987 * math.sqrt(0.00043) / math.sqrt(5), abs=1e-15)
    assert t_interval([0.5])["low"] is None and t_interval([])["mean"] is None


def test_paired_difference_is_the_interval_of_per_seed_differences():
    a = {0: 0.90, 1: 0.80, 2: 0.85, 3: None}
    b = {0: 0.88, 1: 0.79, 2: 0.81, 3: 0.70, 4: 0.5}
    p = paired(a, b)
    assert p["seeds"] == [0, 1, 2]  # seed 3 never reached / missing in a, 4 only in b
    diffs = [0.02, 0.01, 0.04]
    low, high = scipy_stats.t.interval(0.95, 2, loc=sum(diffs) / 3,
                                       scale=scipy_stats.sem(diffs))
    assert (p["low"], p["high"]) == pytest.approx((low, high), abs=1e-12)


def _records(accs, bytes_per_round=100, g=4):
    return [{"round": r, "iteration": r * g, "test_accuracy": a, "client_edge_bytes":
             r * bytes_per_round, "edge_cloud_bytes": r * 10, "sim_seconds": 0.5 * r}
            for r, a in enumerate(accs)]


def test_run_numbers_to_target_and_at_iterations():
    numbers = run_numbers(_records([0.1, 0.4, 0.7, 0.6]), 0.65, [4, 9, 100])
    assert numbers["final_test_accuracy"] == 0.6
    assert numbers["to_target_iterations"] == 8 and numbers["to_target_rounds"] == 2
    assert numbers["to_target_bytes"] == 220 and numbers["to_target_sim_seconds"] == 1.0
    assert numbers["accuracy_at_4"] == 0.4 and numbers["accuracy_at_9"] == 0.7
    assert numbers["accuracy_at_100"] is None  # the run is shorter
    never = run_numbers(_records([0.1, 0.2]), 0.65, [])
    assert never["reached_target"] is False and never["to_target_iterations"] is None


# ---------------------------------------------------------------- spec
def test_spec_expands_grid_zip_random_and_validates_every_arm():
    spec = build({"base": TINY, "seeds": 2, "grid": {"alpha": [0.1, 0.5]},
                  "zip": {"local_period": [1, 2], "global_period": [2, 4]},
                  "random": {"samples": 3, "lr": {"low": 0.01, "high": 1.0, "log": True},
                             "batch_size": [8, 16]}}, "t")
    assert len(spec.arms) == 2 * 2 * 3 and spec.seeds == (0, 1)
    lrs = [a.values["lr"] for a in spec.arms]
    assert all(0.01 <= lr <= 1.0 for lr in lrs) and len(set(lrs)) == 3  # 3 draws, reused
    again = build({"base": TINY, "grid": {"alpha": [0.1, 0.5]},
                   "zip": {"local_period": [1, 2], "global_period": [2, 4]},
                   "random": {"samples": 3, "lr": {"low": 0.01, "high": 1.0, "log": True},
                              "batch_size": [8, 16]}}, "t")
    assert [a.values for a in again.arms] == [a.values for a in spec.arms]  # seeded draws
    cfg = spec.arms[-1].candidates[0][1]
    assert (cfg.alpha, cfg.local_period, cfg.global_period) == (0.5, 2, 4)


@pytest.mark.parametrize(("table", "message"), [
    ({"grid": {"lrr": [0.1]}}, "unknown setting 'lrr'; did you mean 'lr'"),
    ({"grid": {"seed": [1, 2]}}, "'seed' is set by the sweep"),
    ({"grid": {"lr": [-1.0]}}, "lr must be > 0"),
    ({"grid": {"lr": 0.1}}, "grid.lr must be a non-empty list"),
    ({"zip": {"lr": [0.1], "alpha": [0.1, 0.2]}}, "zip: the lists must have one length"),
    ({"grid": {"lr": [0.1]}, "zip": {"lr": [0.2]}}, "'lr' is an axis of both"),
    ({"tune": {"lr": [0.1, 0.2]}}, "set base.client_holdout > 0"),
    ({"grid": {"lr": [0.1]}, "seeds": [1, 1]}, "seeds repeat"),
    ({"grid": {"lr": [0.1]}, "colour": 1}, "unknown key 'colour'"),
    ({"grid": {"lr": [0.1]}, "compare": "alpha"}, "compare = 'alpha' is not an axis"),
    ({"random": {"samples": 2, "lr": {"low": 1, "high": 0.5}}}, "need numbers low < high"),
])
def test_bad_specs_are_one_line_errors(table, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build({"base": TINY, **table}, "spec")


def test_cli_bad_grid_exits_2_with_one_line(tmp_path, capsys):
    code = main(["sweep", "--grid", "lrr=0.1,0.2", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unknown setting 'lrr'" in err[0]
    assert not (tmp_path / "s").exists()  # nothing written


def test_parse_grid_reads_numbers_booleans_strings_and_tuples():
    assert parse_grid(["lr=0.1,1e-2", "grouping=random,min-divergence", "groups=4,8+2",
                       "self_balancing=true"]) == {
        "lr": [0.1, 0.01], "grouping": ["random", "min-divergence"], "groups": [4, "8,2"],
        "self_balancing": [True]}


# ---------------------------------------------------------------- honest tuning
def test_tuning_chooses_by_validation_and_reports_that_value_alone(tmp_path):
    spec = build({"base": {**TINY, "client_holdout": 0.2}, "seeds": 2,
                  "grid": {"alpha": [0.5]}, "tune": {"lr": [0.05, 0.2]}}, "t")
    trials = trials_of(spec, tmp_path)
    records = {}
    for t in trials:  # lr=0.05: best on test, worse on validation; lr=0.2 the other way
        test, val = (0.9, 0.3) if t.tuned["lr"] == 0.05 else (0.5, 0.6 + 0.01 * t.seed)
        records[t.name] = [{"round": 1, "iteration": 4, "test_accuracy": test,
                            "client_accuracy_mean": val}]
    results = summarize(spec, trials, records)
    arm = results["arms"]["alpha=0.5"]
    assert arm["chosen"] == {"lr": 0.2}
    assert arm["stats"]["final_test_accuracy"]["mean"] == 0.5  # the chosen value's test only
    assert arm["tuning_validation_accuracy"]["lr=0.2"]["mean"] == pytest.approx(0.605)


# ---------------------------------------------------------------- trials: skip / restart
def _trial(tmp_path) -> Trial:
    spec = build({"base": TINY, "seeds": [3], "grid": {"grouping": ["contiguous"]}}, "t")
    return trials_of(spec, tmp_path)[0]


def _rows(path: Path):
    return [{k: v for k, v in json.loads(line).items() if k != "wall_seconds"}
            for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_trial_new_done_restart_and_equal_to_fedhier_run(tmp_path, capsys):
    trial = _trial(tmp_path)
    assert trial_state(trial) == "new" and trial.name == "grouping=contiguous/seed3"
    summary = run_trial(trial)
    assert trial_state(trial) == "done"
    assert tomllib.loads(trial.config_file.read_text())["seed"] == 3
    # the trial's folder is what fedhier run writes for the same settings
    direct = tmp_path / "direct"
    argv = ["run", "--no-progress", "--out", str(direct), "--seed", "3", "--grouping",
            "contiguous", *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]]
    assert main(argv) == 0
    assert _rows(direct) == _rows(trial.run_dir)
    first = _rows(trial.run_dir)
    # cut off (no summary, no checkpoint): restarted from scratch, same numbers
    (trial.run_dir / "summary.json").unlink()
    lines = (trial.run_dir / "metrics.jsonl").read_text().splitlines()
    (trial.run_dir / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert trial_state(trial) == "restart"
    assert run_trial(trial)["final_test_accuracy"] == summary["final_test_accuracy"]
    assert _rows(trial.run_dir) == first
    # a checkpoint: resumed
    (trial.run_dir / "summary.json").rename(trial.run_dir / "s.json")
    (trial.run_dir / "checkpoint.pt").write_bytes(b"")
    assert trial_state(trial) == "resume"
    # ... unless the spec changed since: its checkpoint is of another run, restarted
    changed = dataclasses.replace(trial, config=trial.config.replace(lr=trial.config.lr / 2))
    assert trial_state(changed) == "restart"
    assert "--resume" not in run_argv(changed, trial_state(changed))


def test_a_finished_folder_of_another_configuration_is_refused(tmp_path):
    trial = _trial(tmp_path)
    trial.run_dir.mkdir(parents=True)
    (trial.run_dir / "summary.json").write_text("{}")
    trial.config_file.parent.mkdir(parents=True)
    trial.config_file.write_text(toml_text({"lr": 0.3}))
    with pytest.raises(ConfigError, match="another configuration"):
        trial_state(trial)


# ---------------------------------------------------------------- a suite as a spec
def test_sandwich_suite_as_a_spec_gives_the_suites_numbers(tmp_path, one_torch_thread):
    """examples/sweeps/sandwich-quick.toml at T = 32 iterations (rounds / 10) and one seed:
    every arm's metrics.jsonl equals the suite's own run (fedhier experiment sandwich
    --quick --iterations 32 --seeds 1)."""
    from fedhier.settings.run_config import RunConfig
    from fedhier.studies.experiments.cli import QUICK
    from fedhier.studies.experiments.suites import sandwich

    table = tomllib.loads((ROOT / "examples/sweeps/sandwich-quick.toml").read_text())
    table["zip"]["rounds"] = [r // 10 for r in table["zip"]["rounds"]]
    table["seeds"] = [0]
    spec = build(table, "sandwich-quick.toml")
    for trial in trials_of(spec, tmp_path / "sweep"):
        run_trial(trial)
    sandwich(RunConfig.from_mapping(QUICK), [0], tmp_path / "suite", "vectorized", 1, 32)
    for arm in spec.arms:
        name = arm.values["name"]
        assert _rows(tmp_path / "sweep/runs" / name / "seed0") == \
            _rows(tmp_path / "suite/runs" / name / "seed0"), name


def test_heatmap_grid_places_each_arms_mean_on_the_two_numeric_axes(tmp_path):
    from fedhier.studies.sweep.report import heatmap_grids, plot_heatmap

    spec = build({"base": TINY, "seeds": [0], "grid": {
        "alpha": [0.5, 0.1], "lr": [0.1, 0.2, 0.4], "grouping": ["random", "contiguous"]}},
        "t")
    results = {"arms": {a.name: {"stats": {"final_test_accuracy": {
        "mean": a.values["alpha"] * 10 + a.values["lr"] + (a.values["grouping"] == "random")}}}
        for a in spec.arms}}
    heat = heatmap_grids(spec, results)
    assert heat["x"] == ("alpha", [0.1, 0.5]) and heat["y"] == ("lr", [0.1, 0.2, 0.4])
    grid = heat["grids"]["grouping=contiguous"]
    assert grid[2, 1] == pytest.approx(5.4) and grid[0, 0] == pytest.approx(1.1)
    assert heat["grids"]["grouping=random"][0, 0] == pytest.approx(2.1)
    assert plot_heatmap(spec, results, tmp_path / "h.png") and (tmp_path / "h.png").stat().st_size
    one = build({"base": TINY, "grid": {"alpha": [0.5], "grouping": ["random"]}}, "t")
    assert heatmap_grids(one, {"arms": {}}) is None


def test_engine_flower_is_refused_in_a_sweep():
    with pytest.raises(ConfigError, match="engine 'flower' starts its own Ray"):
        build({"base": {**TINY, "engine": "flower"}, "grid": {"lr": [0.1]}}, "t")


def test_a_module_function_grouping_is_imported_without_a_package(tmp_path, monkeypatch):
    """A spec's own plugin, ``my_grouping:dealt_by_label`` (examples/sweeps), used by name."""
    import numpy as np

    from fedhier.settings.run_config import RunConfig
    from fedhier.tree.grouping import ClientInfo, assign_groups

    monkeypatch.syspath_prepend(str(ROOT / "examples/sweeps"))
    hist = np.eye(3, dtype=np.int64)[[0, 0, 1, 1, 2, 2]] * 5
    info = ClientInfo(hist, hist.sum(1), edge_tags=np.full(6, -1))
    groups = assign_groups("my_grouping:dealt_by_label", info, 2, seed=0)
    for label in range(3):  # each dominant label dealt to both edges
        assert sorted(groups[hist.argmax(1) == label]) == [0, 1]
    RunConfig.from_mapping({**TINY, "grouping": "my_grouping:dealt_by_label"})
    with pytest.raises(ConfigError, match="module reference no_such_mod:f failed to import"):
        RunConfig.from_mapping({**TINY, "grouping": "no_such_mod:f"})
