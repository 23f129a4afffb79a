"""The one Ray Tune sweep of the suite (Ray's start-up is slow): 2 arms x 2 seeds of tiny
runs on a local Ray with 2 jobs, with --tracker tensorboard. Then the same command again:
every run is skipped (nothing rerun, Ray not started) and the report is the same."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fedhier.cli import main
from fedhier.sweep.stats import t_interval
from fedhier.trackers import read_tensorboard_scalars

ARGV = ["sweep", "--grid", "grouping=random,contiguous", "--seeds", "2", "--clients", "6",
        "--groups", "2", "--rounds", "3", "--local-period", "2", "--global-period", "4",
        "--engine", "vectorized", "--min-partition-size", "2", "--jobs", "2",
        "--target-accuracy", "0.3", "--tracker", "tensorboard", "--runner", "tune"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    code = main([*ARGV, "--out", str(out)])
    assert code == 0
    return out


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


def test_the_same_command_again_skips_every_finished_run(sweep, capsys):
    metrics = sorted(sweep.glob("runs/*/seed*/metrics.jsonl"))
    before = [p.stat().st_mtime_ns for p in metrics]
    started = time.perf_counter()
    assert main([*ARGV, "--out", str(sweep)]) == 0
    assert time.perf_counter() - started < 20  # no Ray start, no run
    assert "4 finished (skipped), 0 to resume, 0 to restart, 0 new" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in metrics] == before
