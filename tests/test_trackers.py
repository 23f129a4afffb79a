"""--tracker: TensorBoard's event files read back hold every round's metrics; a tracker whose
extra is missing is one line naming the extra, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli import main
from fedhier.errors import ConfigError
from fedhier.trackers import MODULES, check_tracker, read_tensorboard_scalars

TINY = ["--clients", "6", "--groups", "2", "--rounds", "3", "--local-period", "2",
        "--global-period", "4", "--engine", "vectorized", "--min-partition-size", "2",
        "--no-progress"]


def test_tensorboard_events_hold_the_round_by_round_accuracy(tmp_path: Path):
    pytest.importorskip("tensorboardX")
    run = tmp_path / "run"
    assert main(["run", "--out", str(run), "--tracker", "tensorboard", *TINY]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scalars = read_tensorboard_scalars(run / "tensorboard")
    for key in ("test_accuracy", "test_loss", "train_loss", "client_edge_bytes",
                "sim_seconds"):
        steps, values = zip(*scalars[key], strict=True)
        expected = [(r["iteration"], r[key]) for r in records if key in r]
        assert list(steps) == [it for it, _ in expected], key
        # float32 in the event file
        np.testing.assert_array_equal(np.float32(values), np.float32([v for _, v in expected]))
    assert len(scalars["test_accuracy"]) == 4  # rounds 0..3
    hparams = list((run / "tensorboard").glob("hparams/events.out.tfevents.*"))
    assert hparams, "the configuration as hyperparameters (hparams run)"


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(MODULES, "mlflow", "fedhier_no_such_module")
    with pytest.raises(ConfigError, match=r"pip install 'fedhier\[mlflow\]'"):
        check_tracker("mlflow")
    code = main(["run", "--out", str(tmp_path / "r"), "--tracker", "mlflow", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fedhier[mlflow]" in err[0]
    assert not (tmp_path / "r").exists()
