"""--tracker: a tracker whose extra is missing is one line naming the extra, before anything is
written; each tracker's values, read back through the tracker's own reader (TensorBoard's
EventAccumulator, an MlflowClient on the run's store, W&B's Record protobufs of the offline
run's transaction log), are every round's metrics.jsonl values at its iteration; a resumed
run's TensorBoard events hold each round once, a resumed MLflow run continues the same run,
and --overwrite removes the earlier run's tracker folders. TensorBoard's event files are also
read back in tests/test_sweep_tune.py (its sweep runs every trial as ``fedhier run --tracker
tensorboard``). The packages are the extras CI installs (.ci/run); a test skips only where its
package is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.runs.trackers import (
    MODULES,
    check_tracker,
    mlflow_uri,
    read_tensorboard_scalars,
    read_wandb_history,
)

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


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


KEYS = ("test_accuracy", "test_loss", "train_loss", "client_edge_bytes")


def test_tensorboard_reads_back_every_round_and_the_extra_has_its_command(tmp_path: Path):
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "r"
    assert main(["run", "--out", str(out), "--tracker", "tensorboard", *TINY]) == 0
    records = _records(out)
    events = accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in KEYS:
        logged = events.Scalars(key)
        assert [e.step for e in logged] == [r["iteration"] for r in records]
        assert [e.value for e in logged] == [float(np.float32(r[key])) for r in records]
    # the extra installs the command that shows them (`tensorboard --logdir runs/`)
    command = Path(sys.executable).with_name("tensorboard")
    shown = subprocess.run([str(command), "--version_tb"], capture_output=True, text=True,
                           check=True)
    assert shown.stdout.strip().split(".")[0] == "2"


def test_mlflow_logs_to_a_store_mlflow_3_accepts_and_reads_back(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "r"
    assert main(["run", "--out", str(out), "--tracker", "mlflow", "--checkpoint-every", "2",
                 *TINY]) == 0
    records = _records(out)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri(out))
    assert mlflow_uri(out).startswith("sqlite:///") and (out / "mlflow" / "mlflow.db").is_file()
    experiment = client.get_experiment_by_name("fedhier")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params["clients"] == "6" and run.data.params["groups"] == "2"
    for key in KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == \
            [(r["iteration"], float(r[key])) for r in records]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"model_final.safetensors", "summary.json"}
    fetched = client.download_artifacts(run.info.run_id, "model_final.safetensors",
                                        str(tmp_path))
    assert Path(fetched).read_bytes() == (out / "model_final.safetensors").read_bytes()
    assert str((out / "mlflow" / "artifacts").resolve()) in run.info.artifact_uri
    # resumed after round 2's checkpoint: the same MLflow run continues, round 3 again
    (out / "summary.json").unlink()
    assert main(["run", "--resume", str(out), "--tracker", "mlflow", "--no-progress"]) == 0
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]
    assert runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "test_accuracy")]
    assert steps == [r["iteration"] for r in records] + [records[-1]["iteration"]]


def test_wandb_offline_run_reads_back_every_round(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "r"
    assert main(["run", "--out", str(out), "--tracker", "wandb", *TINY]) == 0
    records = _records(out)
    *rows, last = read_wandb_history(out)
    assert [row["_step"] for row in rows] == [r["iteration"] for r in records]
    for key in KEYS:
        assert [row[key] for row in rows] == [r[key] for r in records]
    summary = json.loads((out / "summary.json").read_text())
    assert last["summary"]["final_test_accuracy"] == summary["final_test_accuracy"]
    assert not os.environ.get("WANDB_MODE")  # the tracker asks for offline itself


@pytest.mark.slow
def test_mlflow_logs_to_a_started_mlflow_server_on_loopback(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """MLFLOW_TRACKING_URI names a running ``mlflow server`` (127.0.0.1, a free port): the run
    goes there, not into the run folder. The wait follows the server's /health answer."""
    mlflow = pytest.importorskip("mlflow")
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1", "--backend-store-uri",
         f"sqlite:///{tmp_path / 'server.db'}", "--default-artifact-root",
         str(tmp_path / "artifacts")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        while True:  # until the server answers, or exits (its error shown)
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited: {server.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        out = tmp_path / "r"
        assert main(["run", "--out", str(out), "--tracker", "mlflow", *TINY]) == 0
        assert not (out / "mlflow").exists()
        client = mlflow.MlflowClient(tracking_uri=uri)
        run, = client.search_runs([client.get_experiment_by_name("fedhier").experiment_id])
        records = _records(out)
        assert [(m.step, m.value) for m in client.get_metric_history(
            run.info.run_id, "test_accuracy")] == \
            [(r["iteration"], r["test_accuracy"]) for r in records]
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == \
            {"model_final.safetensors", "summary.json"}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
