"""Seeds batched into one computation (``fedhier run --engine vectorized --seeds``,
fedhier/engines/vectorized/seed_batch.py): each seed's run folder equals its one-seed run, bit for
bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedhier.cli.commands import main
from fedhier.cli.flags import EXIT_RUN_FAILED
from fedhier.common.errors import ConfigError
from fedhier.engines.vectorized import seed_batch
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.engines.vectorized.seed_batch import SeedLockstep, parse_seeds, run_seeds
from fedhier.runs.folder import RunFolder, read_metrics
from fedhier.settings.run_config import RunConfig

TINY = ["--engine", "vectorized", "--dataset", "digits", "--clients", "8", "--groups", "2",
        "--local-period", "2", "--global-period", "4", "--rounds", "2", "--batch-size", "8",
        "--min-partition-size", "3", "--no-progress"]


def same_run(batched: Path, single: Path) -> None:
    """metrics.jsonl (but wall time), summary and both models equal, bit for bit."""
    def records(path: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in read_metrics(path)]

    assert records(batched) == records(single)
    for name in ("model_initial.safetensors", "model_final.safetensors"):
        assert (batched / name).read_bytes() == (single / name).read_bytes()
    a, b = (json.loads((p / "summary.json").read_text()) for p in (batched, single))
    assert {k: v for k, v in a.items() if k != "wall_seconds"} == \
        {k: v for k, v in b.items() if k != "wall_seconds"}
    assert (batched / "groups.json").read_bytes() == (single / "groups.json").read_bytes()


def test_cli_seeds_equal_one_seed_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    sizes: list[int] = []
    original = seed_batch.train_jobs

    def spy(jobs: Any) -> Any:
        losses, batched = original(jobs)
        sizes.extend(batched)
        return losses, batched

    monkeypatch.setattr(seed_batch, "train_jobs", spy)
    assert main(["run", *TINY, "--seeds", "0-1", "--out", str(tmp_path / "b")]) == 0
    assert sizes == [2] * 4  # 2 cloud rounds x 2 edge rounds, both seeds in one batch
    assert "2 seeds batched" in capsys.readouterr().out
    for seed in (0, 1):
        assert main(["run", *TINY, "--seed", str(seed), "--out",
                     str(tmp_path / "b" / f"seed{seed}")]) != 0  # taken: not overwritten
        assert main(["run", *TINY, "--seed", str(seed), "--out", str(tmp_path / f"s{seed}")]) == 0
        same_run(tmp_path / "b" / f"seed{seed}", tmp_path / f"s{seed}")
    # the seeds did differ: a batch that mixed them up could not match three one-seed runs
    finals = {(tmp_path / f"s{s}" / "model_final.safetensors").read_bytes() for s in (0, 1)}
    assert len(finals) == 2


@pytest.mark.parametrize("changes, batched", [
    # three levels, half the clients per edge round, kept momentum, held-out rows, decaying
    # lr, failures: every seed's jobs still share a key -> one batch per edge round
    (dict(periods=(2, 4, 8), groups=(4, 2), clients=12, participation=0.5, momentum=0.9,
          optimizer_state="keep", client_holdout=0.2, lr_schedule="exponential",
          lr_decay=0.9, fail_rate=0.1), True),
    # stragglers: each seed's steps cut the edge round differently -> trained apart
    (dict(local_period=5, global_period=10, rounds=1, straggler_fraction=0.5,
          regroup_every=1, grouping="min-divergence"), False),
])
def test_richer_settings_equal_one_seed_runs(tmp_path: Path, changes: dict[str, Any],
                                             batched: bool) -> None:
    base = dict(dataset="digits", clients=8, groups=(2,), local_period=2, global_period=4,
                rounds=2, batch_size=8, min_partition_size=3, engine="vectorized")
    cfgs = [RunConfig(**{**base, **changes}, seed=s) for s in (3, 4)]
    lockstep = SeedLockstep()
    results = run_seeds(cfgs, [RunFolder.create(tmp_path / f"b{c.seed}") for c in cfgs],
                        progress=False, lockstep=lockstep)
    assert [e for _, e in results] == [None, None]
    assert (max(lockstep.batch_sizes) == 2) is batched
    for cfg in cfgs:
        run_vectorized(cfg, RunFolder.create(tmp_path / f"s{cfg.seed}"), progress=False)
        same_run(tmp_path / f"b{cfg.seed}", tmp_path / f"s{cfg.seed}")


def test_failed_seeds_are_reported_one_line_each(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Seeds whose runs stop (a non-finite update at a huge learning rate) end as their
    one-seed runs would: one line each naming the seed, the run-failed exit code, and (no
    cloud round completed) their folders removed."""
    code = main(["run", *TINY, "--seeds", "0,1", "--lr", "1e30", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_RUN_FAILED and len(err) == 2
    assert all(line.startswith("fedhier:") and "non-finite" in line for line in err)
    assert {"seed 0", "seed 1"} == {s for s in ("seed 0", "seed 1") for line in err if s in line}
    assert not (tmp_path / "b" / "seed0").exists() and not (tmp_path / "b" / "seed1").exists()


@pytest.mark.parametrize("extra, message", [
    (["--engine", "inprocess"], "--seeds batches seeds on the vectorized engine"),
    (["--seed", "3"], "give --seed or --seeds, not both"),
    (["--resume", "somewhere"], "--seeds starts new runs"),
])
def test_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             extra: list[str], message: str) -> None:
    code = main(["run", *TINY, "--seeds", "0,1", "--out", str(tmp_path / "b"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "b").exists()


def test_parse_seeds() -> None:
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    for bad in ("", "a", "1,1", "-1", "2-0x"):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


def test_sweep_batch_seeds_writes_the_trials_own_folders(tmp_path: Path) -> None:
    """``fedhier sweep --batch-seeds``: the new seeds of a vectorized arm are one unit (one
    fedhier run --seeds), whose folders equal the trials run one by one; then all done."""
    from fedhier.studies.sweep.spec import build
    from fedhier.studies.sweep.trials import (
        run_trial,
        run_unit,
        trial_state,
        trial_units,
        trials_of,
    )
    table = {"base": {"clients": 6, "groups": 2, "rounds": 2, "local_period": 2,
                      "global_period": 4, "engine": "vectorized", "min_partition_size": 2},
             "seeds": [3, 4], "grid": {"grouping": ["contiguous"]}}
    batched, alone = (trials_of(build(table, "t"), tmp_path / name) for name in ("b", "a"))
    states = {t.name: trial_state(t) for t in batched}
    units = trial_units(batched, states, batch_seeds=True)
    assert units == [tuple(batched)] and trial_units(batched, states, False) == batched
    run_unit(units[0])
    for b, a in zip(batched, alone, strict=True):
        assert trial_state(b) == "done"
        run_trial(a)
        same_run(b.run_dir, a.run_dir)
