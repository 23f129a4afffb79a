"""Interrupted runs never duplicate or lose a record: a run SIGKILLed at twenty points of its
first and last rounds (before its first checkpoint, halfway through a metrics line, between a
record and its checkpoint, while the checkpoint is written, after the final model), then
resumed with ``fedhier run --resume``, leaves the run folder an uninterrupted run leaves: the
same records with the same values, the same summary and the same final model bit for bit.

The kill points are deterministic (``FEDHIER_CRASH_AT=N``, :mod:`fedhier.runs.crash_points`): each
killed run is forked from one forkserver process (one interpreter start, fedhier imported
once), so twenty kills and resumes cost about twenty tiny runs. Not forked from pytest
itself: its other threads (Ray's, earlier tests') may hold a lock of torch's BLAS at the
fork, and the child then spins forever in its first product (a CI run hung so).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from fedhier.cli.commands import main
from fedhier.runs import crash_points

pytestmark = pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="needs a forkserver")

#: 6 records (rounds 0..5), a checkpoint after rounds 2 and 4: the last round resumes from a
#: checkpoint two records old.
ROUNDS, EVERY = 5, 2
KILLS = 20


def run_argv(engine: str, out: Path) -> list[str]:
    return ["run", "--engine", engine, "--dataset", "digits", "--clients", "4",
            "--groups", "2", "--rounds", str(ROUNDS), "--local-period", "2",
            "--global-period", "4", "--checkpoint-every", str(EVERY), "--out", str(out),
            "--no-progress"]


def _run_killed(point: int, argv: list[str]) -> None:
    """A forkserver child: ``argv`` with a SIGKILL at crash point ``point`` (one torch
    thread and no plots, as in the test)."""
    import torch

    from fedhier.runs import plots

    torch.set_num_threads(1)
    for name in ("plot_runs", "plot_groups"):
        setattr(plots, name, lambda *args, **kwargs: None)
    os.environ[crash_points.ENV] = str(point)
    crash_points.reset()
    sys.exit(main(argv))


_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["fedhier.cli.commands", "fedhier.runs.plots", "torch"])


def killed_at(point: int, argv: list[str]) -> None:
    """Run ``argv`` in a child (from the forkserver) that SIGKILLs itself at crash point
    ``point``."""
    child = _FORKSERVER.Process(target=_run_killed, args=(point, argv))
    child.start()
    child.join(timeout=600)
    assert child.exitcode == -signal.SIGKILL, \
        f"crash point {point} was never reached (exit code {child.exitcode})"


def folder_contents(path: Path) -> dict[str, Any]:
    """What must equal between two runs of one configuration (wall-clock seconds left out)."""
    def records(name: str) -> Any:
        return [{k: v for k, v in json.loads(line).items() if k != "wall_seconds"}
                for line in (path / name).read_text().splitlines()]

    summary = json.loads((path / "summary.json").read_text())
    summary.pop("wall_seconds")
    config = json.loads((path / "config.json").read_text())
    config.pop("out")  # the folder's own name
    return {"metrics": records("metrics.jsonl"), "summary": summary, "config": config,
            **{name: (path / name).read_bytes() for name in (
                "model_final.safetensors", "model_initial.safetensors", "partition.json",
                "groups.json")},
            "failed": (path / "failed.json").exists()}


@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
def test_twenty_kills_then_resume_equal_the_uninterrupted_run(engine, tmp_path, monkeypatch,
                                                               one_torch_thread):
    monkeypatch.chdir(tmp_path)
    for name in ("plot_runs", "plot_groups"):  # PNGs are not what is compared; 60% of a run
        monkeypatch.setattr(f"fedhier.runs.plots.{name}", lambda *args, **kwargs: None)
    monkeypatch.setenv(crash_points.ENV, "0")  # count the points, kill at none
    crash_points.reset()
    assert main(run_argv(engine, tmp_path / "whole")) == 0
    points = crash_points.passed()
    monkeypatch.delenv(crash_points.ENV)
    # 3 per record (before it, halfway through its line, after it) + 2 per checkpoint
    # (its temporary file written, in place) + 1 after the final model
    assert points == 3 * (ROUNDS + 1) + 2 * (ROUNDS // EVERY) + 1
    reference = folder_contents(tmp_path / "whole")
    assert [r["round"] for r in reference["metrics"]] == list(range(ROUNDS + 1))
    # every point but round 3's three: rounds 0-2 (points 1-9 lie before the first
    # checkpoint, 10-11 write it) and rounds 4-5 (19-22 lie after a checkpoint of round 4,
    # 23 after the final model)
    chosen = [p for p in range(1, points + 1) if p not in (12, 13, 14)]
    assert len(chosen) == KILLS
    for point in chosen:
        out = tmp_path / f"killed-{point}"
        killed_at(point, run_argv(engine, out))
        assert not (out / "summary.json").exists()
        assert main(["run", "--resume", str(out), "--no-progress"]) == 0, point
        assert folder_contents(out) == reference, f"killed at crash point {point}"
        shutil.rmtree(out)


def test_a_failed_overwrite_leaves_no_file_of_the_earlier_run(tmp_path, monkeypatch, capsys):
    """``--overwrite`` of a finished run folder by a run that then fails (exit 3): the folder
    describes the new run only (its config.json and failed.json), never the earlier run's
    model_final.safetensors, curves.png or summary.json beside them."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = run_argv("inprocess", out)
    assert main(argv) == 0
    assert {"model_final.safetensors", "curves.png", "summary.json"} <= \
        {p.name for p in out.iterdir()}
    assert main([*argv, "--overwrite", "--lr", "1e30"]) == 3
    assert "failed.json" in capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert not names & {"model_final.safetensors", "curves.png", "summary.json",
                        "checkpoint.pt"}, names
    assert json.loads((out / "config.json").read_text())["lr"] == 1e30
    failed = json.loads((out / "failed.json").read_text())
    assert failed["exit_code"] == 3 and failed["last_completed_round"] == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rounds = [json.loads(line)["round"] for line in lines]
    assert rounds == [0]


def _interrupted_and_resumed(app_factory, cfg, root: Path, monkeypatch) -> tuple[list, list]:
    """An uninterrupted run of ``cfg`` (A) and one interrupted by Ctrl-C before its round-3
    record and resumed from its round-2 checkpoint (B), on the in-process grid of
    ``app_factory(run)`` (run "A" or "B"; B's app serves both halves, as one deployment
    would): (A's records, B's records), each with its final model's bytes."""
    import fedhier.runs.driver as recorded_run
    from fedhier.engines.grid_run import run_federation
    from fedhier.engines.inprocess_grid import InProcessGrid
    from fedhier.runs.checkpoint import load_checkpoint
    from fedhier.runs.folder import RunFolder
    monkeypatch.setattr("fedhier.runs.plots.plot_runs", lambda *args, **kwargs: None)
    run_federation(InProcessGrid(app_factory("A"), cfg.clients, seed=cfg.seed), cfg,
                   RunFolder.create(root / "A"), engine="inprocess", progress=False)
    calls = {"n": 0}

    def interrupt() -> None:  # 2 crash points for round 0, 3 per later round
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt

    app_b = app_factory("B")
    with monkeypatch.context() as patch:
        patch.setattr(recorded_run, "crash_point", interrupt)
        with pytest.raises(KeyboardInterrupt):
            run_federation(InProcessGrid(app_b, cfg.clients, seed=cfg.seed), cfg,
                           RunFolder.create(root / "B"), engine="inprocess", progress=False)
    resume = load_checkpoint(root / "B")
    assert resume.round == 2
    run_federation(InProcessGrid(app_b, cfg.clients, seed=cfg.seed), cfg,
                   RunFolder.claim_existing(root / "B"), engine="inprocess", progress=False,
                   resume=resume)

    def contents(path: Path) -> list:
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                for line in (path / "metrics.jsonl").read_text().splitlines()
                ] + [(path / "model_final.safetensors").read_bytes()]

    return contents(root / "A"), contents(root / "B")


def test_a_resumed_run_keeps_the_reply_guard(tmp_path, monkeypatch, one_torch_thread):
    """``drop`` with K = 3: client 2's first three train replies are bad (rounds 1-2: its
    edge rounds 1-3), so it is excluded in round 2; interrupted after round 2, the resumed
    run still excludes it (the guard's streak and exclusions are in the checkpoint)."""
    from tests.test_hostile_clients import CFG, HOSTILE, hostile_app, metric

    def app(_: str):
        calls = {"n": 0}
        bad = metric("num-examples", 0)

        def first_three_bad(reply):
            calls["n"] += 1
            return bad(reply) if calls["n"] <= 3 else reply
        return hostile_app("train", first_three_bad)

    cfg = CFG.replace(on_bad_reply="drop", exclude_after=3, rounds=3, checkpoint_every=1)
    a, b = _interrupted_and_resumed(app, cfg, tmp_path, monkeypatch)
    assert [r.get("excluded_clients") for r in a[:-1]] == [None, None, [HOSTILE], [HOSTILE]]
    assert a == b


def test_a_resumed_run_keeps_the_sizes_learned_from_train_replies(tmp_path, monkeypatch,
                                                                   one_torch_thread):
    """A ClientApp with a train handler only: its rows are learned from its train replies;
    with a third of the clients sent per round, the resumed run weighs them as the
    uninterrupted run does (the learned sizes are in the checkpoint)."""
    from tests.test_hsgd import CFG, bare_app

    cfg = CFG.replace(groups=(2,), rounds=3, checkpoint_every=1, participation=0.34,
                      local_period=4)
    a, b = _interrupted_and_resumed(lambda _: bare_app(), cfg, tmp_path, monkeypatch)
    assert a == b
