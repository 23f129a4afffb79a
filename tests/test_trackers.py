"""--tracker: a tracker whose extra is missing is one line naming the extra, before anything is
written; a resumed run's TensorBoard events hold each round once and --overwrite removes the
earlier run's tracker folders. TensorBoard's event files are also read back in
tests/test_sweep_tune.py (its sweep runs every trial as ``fedhier run --tracker tensorboard``)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.runs.trackers import MODULES, check_tracker, read_tensorboard_scalars

TINY = ["--clients", "6", "--groups", "2", "--rounds", "3", "--local-period", "2",
        "--global-period", "4", "--engine", "vectorized", "--min-partition-size", "2",
        "--no-progress"]


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(MODULES, "mlflow", "fedhier_no_such_module")
    with pytest.raises(ConfigError, match=r"pip install 'fedhier\[mlflow\]'"):
        check_tracker("mlflow")
    code = main(["run", "--out", str(tmp_path / "r"), "--tracker", "mlflow", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fedhier[mlflow]" in err[0]
    assert not (tmp_path / "r").exists()


def test_resume_logs_each_round_once_and_overwrite_removes_tracker_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    writer_module = pytest.importorskip("tensorboardX.event_file_writer")
    # Both sessions open their event file in the same second (as on a fast machine): the
    # resumed one must not reopen and empty the first one's file.
    monkeypatch.setattr(writer_module, "time", types.SimpleNamespace(time=lambda: 1.7e9))
    out = tmp_path / "r"
    assert main(["run", "--out", str(out), "--tracker", "tensorboard", "--checkpoint-every",
                 "2", *TINY]) == 0
    # as if killed after logging round 3 but before finishing: resumed from round 2's
    # checkpoint, round 3 is logged again
    (out / "summary.json").unlink()
    assert main(["run", "--resume", str(out), "--tracker", "tensorboard", "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = read_tensorboard_scalars(out / "tensorboard")
    for key in ("test_accuracy", "test_loss"):
        assert [step for step, _ in logged[key]] == [r["iteration"] for r in records]
        assert [v for _, v in logged[key]] == \
            [float(np.float32(r[key])) for r in records]
    (out / "mlruns").mkdir()  # as the MLflow tracker leaves it
    assert main(["run", "--out", str(out), "--overwrite", *TINY]) == 0
    assert not (out / "tensorboard").exists() and not (out / "mlruns").exists()
