"""The one Ray Tune sweep of the suite (Ray's start-up is slow): 2 arms x 2 seeds of tiny
runs on a local Ray with 2 jobs, with --tracker tensorboard; one line per finished run, as it
finishes. Then the same command again: every run is skipped (nothing rerun, Ray not started)
and the report is the same."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.runs.trackers import read_tensorboard_scalars
from fedhier.studies.sweep.stats import t_interval

ARGV = ["sweep", "--grid", "grouping=random,contiguous", "--seeds", "2", "--clients", "6",
        "--groups", "2", "--rounds", "3", "--local-period", "2", "--global-period", "4",
        "--engine", "vectorized", "--min-partition-size", "2", "--jobs", "2",
        "--target-accuracy", "0.3", "--tracker", "tensorboard", "--runner", "tune"]


PRINTED: dict[str, str] = {}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([*ARGV, "--out", str(out)])
    PRINTED["first"] = printed.getvalue()
    assert code == 0
    return out


def test_one_line_per_finished_run_with_its_final_accuracy(sweep):
    lines = re.findall(r"^\[(\d)/4\] (grouping=\w+)/seed(\d): final test accuracy "
                       r"([\d.]+) \([\d.]+ s\)$", PRINTED["first"], re.M)
    assert sorted(int(done) for done, *_ in lines) == [1, 2, 3, 4], PRINTED["first"]
    for _, arm, seed, accuracy in lines:
        summary = json.loads((sweep / "runs" / arm / f"seed{seed}" / "summary.json").read_text())
        assert accuracy == f"{summary['final_test_accuracy']:.4f}"


def test_every_run_is_a_finished_run_folder_and_the_report_holds_their_intervals(sweep):
    results = json.loads((sweep / "results.json").read_text())
    assert set(results["arms"]) == {"grouping=random", "grouping=contiguous"}
    for name, arm in results["arms"].items():
        finals = []
        for seed in (0, 1):
            run = sweep / "runs" / name / f"seed{seed}"
            summary = json.loads((run / "summary.json").read_text())
            config = json.loads((run / "config.json").read_text())
            assert config["seed"] == seed and config["grouping"] == name.split("=")[1]
            assert list((run / "tensorboard").glob("events.out.tfevents.*"))
            finals.append(summary["final_test_accuracy"])
        assert arm["stats"]["final_test_accuracy"] == {**t_interval(finals)}
    pair = next(p for p in results["paired"] if p["metric"] == "final_test_accuracy")
    assert pair["arm"] == "grouping=contiguous" and pair["baseline"] == "grouping=random"
    assert (sweep / "results.md").is_file() and (sweep / "curves.png").is_file()
    assert (sweep / "tune").is_dir()  # Tune's own files stay inside the sweep folder


def test_tensorboard_events_hold_the_round_by_round_metrics(sweep):
    """Each trial ran ``fedhier run --tracker tensorboard``: its event files, read back, hold
    every cloud round's metrics.jsonl numbers (float32), step = iteration."""
    run = sweep / "runs" / "grouping=random" / "seed1"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scalars = read_tensorboard_scalars(run / "tensorboard")
    for key in ("test_accuracy", "test_loss", "train_loss", "client_edge_bytes",
                "sim_seconds"):
        expected = [(r["iteration"], r[key]) for r in records if key in r]
        assert [step for step, _ in scalars[key]] == [it for it, _ in expected], key
        np.testing.assert_array_equal(np.float32([v for _, v in scalars[key]]),
                                      np.float32([v for _, v in expected]))
    assert len(scalars["test_accuracy"]) == 4  # rounds 0..3
    assert list((run / "tensorboard").glob("hparams/events.out.tfevents.*"))  # the config


def test_the_same_command_again_skips_every_finished_run(sweep, capsys, monkeypatch):
    metrics = sorted(sweep.glob("runs/*/seed*/metrics.jsonl"))
    before = [p.stat().st_mtime_ns for p in metrics]

    def no_tune(*args, **kwargs):  # no Ray start, no run: Tune is never called
        raise AssertionError("Ray Tune started for a sweep with nothing to run")

    monkeypatch.setattr("fedhier.studies.sweep.tune_runner.run_on_tune", no_tune)
    assert main([*ARGV, "--out", str(sweep), "--no-progress"]) == 0
    assert "4 finished (skipped), 0 to resume, 0 to restart, 0 new" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in metrics] == before
