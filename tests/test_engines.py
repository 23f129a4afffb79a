"""The same config and seed give the same numbers on every engine (1e-5)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from fedhier.engines.inprocess import run_inprocess
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import assert_same_run, metrics

ROOT = Path(__file__).resolve().parents[1]
SMALL = RunConfig(dataset="digits", clients=6, groups=2, local_period=2, global_period=4,
                  rounds=2, batch_size=8, seed=11)
@pytest.mark.slow
def test_inprocess_equals_simulation_engine(tmp_path):
    from fedhier.engines.flower import run_simulation_engine

    run_inprocess(SMALL, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_simulation_engine(SMALL.replace(engine="flower"), RunFolder.create(tmp_path / "flower"),
                          progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "flower", SMALL.rounds)
    assert json.loads((tmp_path / "flower" / "summary.json").read_text())["engine"] == "flower"


@pytest.mark.slow
def test_flwr_run_dot_completes_and_matches(tmp_path):
    run_inprocess(SMALL, RunFolder.create(tmp_path / "inprocess"), progress=False)
    out = tmp_path / "flwr"
    overrides = (f"groups=2 local-period=2 global-period=4 rounds=2 batch-size=8 seed=11 "
                 f"out='{out}'")
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    proc = subprocess.run([str(ROOT / "scripts" / "flwr_run_local.sh"), "6", overrides],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_run(tmp_path / "inprocess", out, SMALL.rounds)
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "flwr-home")], capture_output=True)
    assert leftover.returncode != 0, "flwr run left a SuperLink running"


@pytest.mark.slow
def test_knobs_and_faults_are_the_same_on_the_simulation_engine(tmp_path):
    """Participation, kept momentum, a schedule and injected faults: same numbers on Ray."""
    from fedhier.engines.flower import run_simulation_engine

    cfg = SMALL.replace(participation=0.5, momentum=0.9, optimizer_state="keep",
                        lr_schedule="cosine", fail_rate=0.3, client_holdout=0.2)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_simulation_engine(cfg.replace(engine="flower"), RunFolder.create(tmp_path / "flower"),
                          progress=False)
    assert_same_run(tmp_path / "inprocess", tmp_path / "flower", SMALL.rounds)
    records = metrics(tmp_path / "flower")
    assert sum(r["failed_clients"] for r in records) > 0
    assert "client_accuracy_mean" in records[-1]
