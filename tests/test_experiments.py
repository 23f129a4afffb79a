"""Experiment suites: the papers' claims on digits (quick sizes), files, and resume."""

import json
import os

import pytest

from fedhier.cli.commands import main


def run_suite(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["experiment", name, "--quick", "--out", str(out), *extra]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_sandwich_claim_holds_on_digits(tmp_path):
    out, results = run_suite(tmp_path, "sandwich", "--seeds", "3")
    assert all(results["claims"].values()), results["claims"]
    assert {"local-I", "hsgd", "local-G", "minibatch", "central"} == set(results["arms"])
    assert (out / "sandwich_accuracy.png").exists() and "Claims" in (out / "results.md").read_text()
    # A repeated command reruns nothing: the finished run folders stay untouched.
    stamps = {p: p.stat().st_mtime for p in (out / "runs").rglob("summary.json")}
    assert main(["experiment", "sandwich", "--quick", "--seeds", "3", "--out", str(out)]) == 0
    assert stamps == {p: p.stat().st_mtime for p in (out / "runs").rglob("summary.json")}


@pytest.mark.slow
def test_grouping_claims_hold_on_digits(tmp_path):
    _, results = run_suite(tmp_path, "grouping", "--seeds", "3")
    assert all(results["claims"].values()), results["claims"]


@pytest.mark.slow
def test_diversity_claims_on_digits(tmp_path):
    out, results = run_suite(tmp_path, "diversity", "--seeds", "1")
    claims = results["claims"]
    bound_claims = {k: v for k, v in claims.items() if "training accuracy" not in k}
    assert bound_claims and all(bound_claims.values()), claims
    assert len(claims) == len(bound_claims) + 1  # the time-to-accuracy claim has a verdict
    variants = results["variants"]
    bounds = {name.split()[0]: v["bound"] for name, v in variants.items()}
    assert bounds["duplicates"] < bounds["original"] < bounds["dropout"]
    # each of Yin et al.'s mechanisms raises the diversity (and the bound)
    assert min(bounds["quantised"], bounds["Langevin"]) > 1.3 * bounds["original"]
    accuracy = results["accuracy"]
    assert set(accuracy["iterations"]) == {"none", *(n for n in variants if n.split()[0] in
                                                    ("dropout", "quantised", "Langevin"))}
    assert (out / "diversity.png").exists()


def test_periods_and_levels_write_their_outputs(tmp_path):
    out, results = run_suite(tmp_path, "periods", "--seeds", "1", "--iterations", "32",
                             "--local-period", "2", "--global-period", "16")
    assert (out / "periods_heatmap.png").exists()
    grid = results["grid"]
    cells = grid["final_test_accuracy"]
    assert len(cells) == len(grid["local_periods"]) and len(grid["global_periods"]) >= 2
    for i, row in zip(grid["local_periods"], cells, strict=True):
        assert len(row) == len(grid["global_periods"])
        for g, cell in zip(grid["global_periods"], row, strict=True):
            run = out / "runs" / f"I{i}-G{g}" / "seed0"
            if g % i:  # no such arm: an empty cell
                assert cell is None or cell != cell and not run.exists()
                continue
            # each cell is its own arm's run, which ran its (I, G) for the asked iterations
            config = json.loads((run / "config.json").read_text())
            summary = json.loads((run / "summary.json").read_text())
            assert (config["local_period"], config["global_period"]) == (i, g)
            assert config["rounds"] == max(1, 32 // g)
            assert cell == summary["final_test_accuracy"]
            assert cell == results["arms"][f"I{i}-G{g}"]["final"]["test_accuracy"]["mean"]
    values = [c for row in cells for c in row if c is not None]
    assert len(set(values)) > len(values) // 2  # the periods change the outcome
    out, results = run_suite(tmp_path, "levels", "--seeds", "1", "--iterations", "32")
    assert {"two-level", "three-level", "local-G"} == set(results["arms"])
    three = results["arms"]["three-level"]["config"]
    assert three["groups"] == [4, 2] and three["periods"] == [2, 8, 16]


def test_interrupted_arm_is_started_over(tmp_path):
    out, _ = run_suite(tmp_path, "levels", "--seeds", "1", "--iterations", "16")
    run_dir = out / "runs" / "two-level" / "seed0"
    os.remove(run_dir / "summary.json")  # as if the run had been killed before finishing
    assert main(["experiment", "levels", "--quick", "--seeds", "1", "--iterations", "16",
                 "--out", str(out)]) == 0
    assert (run_dir / "summary.json").exists()


def test_time_suite_times_every_arm_with_its_own_cloud_link(tmp_path):
    """Training is the same at every bandwidth, so each algorithm's accuracy curve is too;
    the seconds to the target grow with a slower cloud link, and most for the flat arm that
    aggregates most often."""
    out, results = run_suite(tmp_path, "time", "--seeds", "1", "--iterations", "64")
    arms = results["arms"]
    assert len(arms) == 12 and (out / "time_to_accuracy.png").exists()
    for algorithm in ("flat-I", "hsgd", "flat-G"):
        curves = [arms[f"{algorithm}-{m}mbps"]["curves"] for m in ("1000", "100", "10", "1")]
        assert all(c["test_accuracy"] == curves[0]["test_accuracy"] for c in curves)
        ends = [c["sim_seconds"]["mean"][-1] for c in curves]
        assert ends == sorted(ends) and ends[0] < ends[-1]
    reach = results["seconds_to_target"]
    assert reach["flat-I"]["1"]["mean"] > reach["flat-I"]["1000"]["mean"]
    assert "Simulated seconds to reach" in (out / "results.md").read_text()


def test_mobility_suite_sweeps_move_rates_and_times_async_edges(tmp_path):
    out, results = run_suite(tmp_path, "mobility", "--seeds", "1", "--iterations", "64")
    arms = results["arms"]
    assert {f"{g}-rate{r}" for g in ("random", "min-divergence")
            for r in ("0", "0.05", "0.2", "0.5")} | {"sync", "async"} == set(arms)
    assert arms["async"]["config"]["async_buffer"] == 3
    assert arms["async"]["config"]["rounds"] == 2 * arms["sync"]["config"]["rounds"]
    assert "upward_divergence" in arms["random-rate0.2"]["final"]
    assert (out / "mobility_rates.png").exists() and (out / "mobility_async.png").exists()
    static = json.loads((out / "runs" / "random-rate0" / "seed0" / "metrics.jsonl")
                        .read_text().splitlines()[-1])
    assert "moved_clients" not in static  # rate 0: the static run


def test_publishing_some_runs_keeps_the_sections_of_the_others(tmp_path):
    from fedhier.studies.experiments.publish import published_sections

    results = tmp_path / "results.md"
    results.write_text("# Results\n\n## Claims at a glance\n\n| run | claim | verdict |\n"
                       "|---|---|---|\n| a-run | x holds | holds |\n\n## a-run: sandwich\n\n"
                       "Command: `fedhier experiment sandwich`\n\n| arm | acc |\n")
    sections, claims = published_sections(results)
    assert list(sections) == ["a-run"] and "Command:" in sections["a-run"]
    assert claims == {"a-run": ["| a-run | x holds | holds |"]}


def test_a_run_from_before_a_setting_existed_is_reused(tmp_path):
    """config.json of an older run lacks newer settings: at their defaults it is the same
    run, at another value it is not."""
    from fedhier.runs.folder import write_json
    from fedhier.settings.run_config import RunConfig
    from fedhier.studies.experiments.runner import _same_config

    cfg = RunConfig(clients=6, groups=(2,))
    saved = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_dict().items()
             if k not in ("async_buffer", "max_staleness")}
    write_json(tmp_path / "config.json", saved)
    assert _same_config(tmp_path, cfg)
    assert not _same_config(tmp_path, cfg.replace(async_buffer=2))
    assert not _same_config(tmp_path, cfg.replace(clients=7))


def test_a_run_from_before_the_async_rules_ran_the_shifted_mean(tmp_path):
    """An async run folder without async_rule was made by the shifted mean: it is the same
    run as async_rule shifted-mean, not as the new default (fedbuff), and is run again."""
    from fedhier.runs.folder import write_json
    from fedhier.settings.run_config import RunConfig
    from fedhier.studies.experiments.runner import _same_config

    cfg = RunConfig(clients=6, groups=(2,), async_buffer=1)
    saved = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.to_dict().items()
             if k != "async_rule"}
    write_json(tmp_path / "config.json", saved)
    assert _same_config(tmp_path, cfg.replace(async_rule="shifted-mean"))
    assert not _same_config(tmp_path, cfg)
