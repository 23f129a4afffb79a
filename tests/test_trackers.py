"""--tracker: a tracker whose extra is missing is one line naming the extra, before anything is
written. TensorBoard's event files are read back in tests/test_sweep_tune.py (its sweep runs
every trial as ``fedhier run --tracker tensorboard``; one run fewer in the suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedhier.cli import main
from fedhier.errors import ConfigError
from fedhier.trackers import MODULES, check_tracker

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
