"""A sweep's vectorized trials that share a model and dataset run as batched computations
(fedhier/studies/sweep/trials.py ``batch_units``, fedhier/engines/vectorized/seed_batch.py
``run_batched``), on local worker processes (fedhier/studies/sweep/local_runner.py): every trial's
folder equals the same trial run alone, bit for bit, though the trials differ in alpha, grouping and
seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedhier.cli.commands import main
from fedhier.engines.vectorized import seed_batch
from fedhier.studies.sweep.spec import build
from fedhier.studies.sweep.trials import (
    Trial,
    batch_units,
    run_trial,
    run_unit,
    trial_state,
    trials_of,
)
from tests.test_batched_seeds import same_run

BASE = {"dataset": "digits", "clients": 6, "groups": 2, "rounds": 2, "local_period": 2,
        "global_period": 4, "batch_size": 8, "engine": "vectorized", "min_partition_size": 8}
GRID = {"alpha": [0.3, 1.0], "grouping": ["random", "min-divergence"]}


def _trials(folder: Path, grid: dict[str, Any] = GRID, seeds: list[int] | None = None,
            **base: Any) -> list[Trial]:
    table = {"base": {**BASE, **base}, "seeds": seeds or [0, 1], "grid": grid}
    return trials_of(build(table, "t"), folder)


def test_batch_units_group_what_shares_model_and_data(tmp_path: Path) -> None:
    trials = _trials(tmp_path) + _trials(tmp_path / "mlp", {"model": ["logreg"]})
    states = {t.name: "new" for t in trials}
    states[trials[0].name] = "resume"
    units = batch_units(trials, states, parts=2)
    batches = [u for u in units if isinstance(u, tuple)]
    assert [len(b) for b in batches] == [4, 3]  # the 7 other mlp trials in 2 parts
    assert {t.config.model for b in batches for t in b} == {"mlp"}
    assert trials[0] in units  # a trial to resume stays alone
    assert trials[-2] in units and trials[-1] in units  # logreg's 2: one per worker
    assert len(units) == 5
    one = batch_units(trials[1:8], {t.name: "new" for t in trials}, parts=1, most=3)
    assert sorted(len(u) for u in one if isinstance(u, tuple)) == [2, 2, 3] and len(one) == 3


def test_heterogeneous_trials_batch_and_equal_lone_runs(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = seed_batch.train_jobs

    def spy(jobs: Any) -> Any:
        losses, batched = original(jobs)
        sizes.extend(batched)
        return losses, batched

    monkeypatch.setattr(seed_batch, "train_jobs", spy)
    batched = _trials(tmp_path / "b", seeds=[2, 3])[::2] + _trials(tmp_path / "b", seeds=[4])[:1]
    run_unit(tuple(batched))
    assert sizes == [5] * 4  # 2 cloud rounds x 2 edge rounds, all 5 trials in one batch
    finals = set()
    lone = _trials(tmp_path / "a", seeds=[2, 3])[::2] + _trials(tmp_path / "a", seeds=[4])[:1]
    for trial, alone in zip(batched, lone, strict=True):
        assert trial_state(trial) == "done"
        run_trial(alone)
        same_run(trial.run_dir, alone.run_dir)
        finals.add((alone.run_dir / "model_final.safetensors").read_bytes())
    assert len(finals) == len(batched)  # the trials differ: a mix-up could not match


def test_sweep_command_on_local_workers_equals_lone_runs(tmp_path: Path) -> None:
    """``fedhier sweep`` with 2 local worker processes (2 batches; arms of another lr share a
    unit but train apart, their rates differ), then a rerun skips everything."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in BASE.items() if k != "groups"]
    argv = ["sweep", "--grid", "alpha=0.3,1.0", "--grid", "lr=0.05,0.1", "--seeds", "1",
            *flags, "--groups", "2", "--jobs", "2", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    for trial in _trials(tmp_path / "alone", {"alpha": [0.3, 1.0], "lr": [0.05, 0.1]}, [0]):
        run_trial(trial)
        twin = tmp_path / "s" / trial.run_dir.relative_to(tmp_path / "alone")
        same_run(twin, trial.run_dir)
    assert main(argv) == 0  # nothing left to run
    assert (tmp_path / "s" / "results.md").is_file()
