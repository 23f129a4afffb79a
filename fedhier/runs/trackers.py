"""Experiment trackers: TensorBoard, MLflow, Weights & Biases (``--tracker``).

A tracker is a :class:`RunCallback` the run recorder calls (pfl-research style): at the
start with the configuration (hyperparameters), after every cloud round with its
metrics.jsonl record (every numeric key, step = the record's iteration), and at the end with
the summary (the final model as an artifact where the tracker keeps artifacts). The command
line attaches trackers around a run with :func:`attached`; the recorder picks them up with
:func:`current`, so no engine knows about trackers.

Each tracker is an optional extra (pyproject.toml pins the tested ranges):
``pip install 'fedhier[tensorboard]'`` (tensorboardX to write, tensorboard for the
``tensorboard`` command) writes ``RUN_DIR/tensorboard``; ``fedhier[mlflow]`` an SQLite store
``RUN_DIR/mlflow/mlflow.db`` with artifacts in ``RUN_DIR/mlflow/artifacts`` (mlflow 3 refuses
its old file store), or the server ``MLFLOW_TRACKING_URI`` names; ``fedhier[wandb]`` an
offline run in ``RUN_DIR/wandb``. :func:`read_tensorboard_scalars`, :func:`mlflow_uri` and
:func:`read_wandb_history` read them back (tests/test_trackers.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError

TRACKERS = ("tensorboard", "mlflow", "wandb")
#: tracker -> (module it needs, the fedhier extra that installs it)
MODULES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}
#: The folders the trackers write in the run folder (``--overwrite`` removes them; ``mlruns``
#: is where fedhier's MLflow tracker wrote before mlflow 3 refused the file store).
OUTPUT_FOLDERS = ("tensorboard", "mlflow", "mlruns", "wandb")
#: The MLflow experiment fedhier's runs are logged under.
MLFLOW_EXPERIMENT = "fedhier"


class RunCallback:
    """Hooks of one run's recorder; every method does nothing unless overridden."""

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        """The run starts (or continues, ``resumed``) in ``run_dir`` with ``config``.
        ``purge_from``: in a folder that already holds tracker output, the first iteration
        this run logs again (what was logged from it on belongs to the interrupted run and is
        replaced); None in a fresh folder."""

    def on_round(self, record: Mapping[str, Any]) -> None:
        """A cloud round's metrics.jsonl record was written."""

    def on_finish(self, run_dir: Path, summary: Mapping[str, Any]) -> None:
        """summary.json and model_final.safetensors were written."""

    def close(self) -> None:
        """The run ended (after on_finish, or on a failure); flush and release."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a record (lists such as client_accuracies and text left out);
    a dict of numbers (the clients' own ``train_metrics``) as ``train_metrics/KEY``."""
    out: dict[str, float] = {}
    for k, v in record.items():
        for key, value in (v.items() if isinstance(v, Mapping) else [(None, v)]):
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[k if key is None else f"{k}/{key}"] = float(value)
    return out


def hyperparameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration as flat hyperparameters: scalars kept, tuples written 8,2."""
    return {k: (",".join(map(str, v)) if isinstance(v, list | tuple) else v)
            for k, v in config.items() if v is None or isinstance(v, str | int | float | bool
                                                                  | list | tuple)}


class TensorBoardTracker(RunCallback):
    """Event files in ``RUN_DIR/tensorboard`` (tensorboardX): each numeric key as a scalar
    against iterations, the configuration as text and hparams. TensorBoard has no artifacts:
    the final model stays in the run folder."""

    def __init__(self) -> None:
        self.writer: Any = None
        self.config: dict[str, Any] = {}

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard drops the earlier events from that step on, so a resumed
        # run's rounds after its checkpoint are not shown twice
        # The event file is named by the second it opens in: a resume within the same second
        # would reopen (and empty) the first run's file. The nanosecond suffix keeps both,
        # in the order they were written.
        self.writer = SummaryWriter(logdir=str(Path(run_dir) / "tensorboard"),
                                    purge_step=purge_from,
                                    filename_suffix=f".{time.time_ns():020d}")
        self.config = hyperparameters(config)
        if not resumed:
            self.writer.add_text("config", "```\n" + json.dumps(self.config, indent=1) + "\n```")

    def on_round(self, record: Mapping[str, Any]) -> None:
        step = int(record["iteration"])
        for key, value in scalars(record).items():
            if key not in ("iteration",):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def on_finish(self, run_dir: Path, summary: Mapping[str, Any]) -> None:
        metrics = {f"final/{k}": v for k, v in scalars(summary).items()}
        self.writer.add_hparams({k: ("" if v is None else v) for k, v in self.config.items()},
                                metrics, name="hparams")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def mlflow_uri(run_dir: str | Path) -> str:
    """The MLflow tracking URI of a run: ``MLFLOW_TRACKING_URI`` when set (e.g. a started
    ``mlflow server``), else the SQLite store ``RUN_DIR/mlflow/mlflow.db``."""
    given = os.environ.get("MLFLOW_TRACKING_URI", "")
    return given or f"sqlite:///{Path(run_dir).resolve() / 'mlflow' / 'mlflow.db'}"


class MLflowTracker(RunCallback):
    """An MLflow run (:func:`mlflow_uri`): params, metrics per round (step = iteration),
    model_final.safetensors and summary.json as artifacts. The run is tagged
    ``fedhier.run_dir`` (the run folder's absolute path); a resumed run continues it."""

    def __init__(self) -> None:
        self.client: Any = None
        self.run_id: str | None = None

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        import mlflow

        uri = mlflow_uri(run_dir)
        local = uri.startswith("sqlite:///")
        if local:
            (Path(run_dir) / "mlflow").mkdir(exist_ok=True)
        # creating the SQLite store logs its schema migrations at INFO: not the run's news
        quiet = [logging.getLogger(n) for n in ("mlflow.store.db.utils", "alembic")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.WARNING)
        try:
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
            experiment_id = experiment.experiment_id if experiment else \
                self.client.create_experiment(
                    MLFLOW_EXPERIMENT, artifact_location=(
                        (Path(run_dir).resolve() / "mlflow" / "artifacts").as_uri()
                        if local else None))
        finally:
            for q, level in zip(quiet, levels, strict=True):
                q.setLevel(level)
        where = str(Path(run_dir).resolve())
        earlier = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`fedhier.run_dir` = '{where}'",
            max_results=1) if resumed else []
        if earlier:
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(experiment_id, run_name=Path(run_dir).name,
                                     tags={"fedhier.run_dir": where})
        self.run_id = run.info.run_id
        params = [mlflow.entities.Param(k, str(v))
                  for k, v in hyperparameters(config).items()]
        for start in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def on_round(self, record: Mapping[str, Any]) -> None:
        import mlflow

        step, now = int(record["iteration"]), int(time.time() * 1000)
        metrics = [mlflow.entities.Metric(k, v, now, step) for k, v in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_finish(self, run_dir: Path, summary: Mapping[str, Any]) -> None:
        for name in ("model_final.safetensors", "summary.json"):
            self.client.log_artifact(self.run_id, str(Path(run_dir) / name))
        self.client.set_terminated(self.run_id, "FINISHED")
        self.run_id = None

    def close(self) -> None:
        if self.run_id is not None:  # the run failed or was interrupted
            self.client.set_terminated(self.run_id, "FAILED")
            self.run_id = None


class WandbTracker(RunCallback):
    """An offline W&B run in ``RUN_DIR/wandb`` (``wandb sync`` uploads it later): config,
    metrics per round (step = iteration), the final model as a ``model`` artifact. Quiet:
    no console capture, no system metrics."""

    def __init__(self) -> None:
        self.run: Any = None

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        import wandb

        (Path(run_dir) / "wandb").mkdir(exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                  x_save_requirements=False, disable_git=True)
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="fedhier",
                              name=Path(run_dir).name, config=hyperparameters(config),
                              settings=settings)

    def on_round(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["iteration"]))

    def on_finish(self, run_dir: Path, summary: Mapping[str, Any]) -> None:
        import wandb

        artifact = wandb.Artifact("model_final", type="model")
        artifact.add_file(str(Path(run_dir) / "model_final.safetensors"))
        self.run.log_artifact(artifact)
        self.run.summary.update(scalars(summary))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


CLASSES: dict[str, type[RunCallback]] = {
    "tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}


def check_tracker(name: str | None) -> None:
    """Refuse, in one line naming the extra, a tracker whose package is not installed."""
    if name is None:
        return
    if name not in CLASSES:
        raise ConfigError(f"unknown tracker '{name}'; choose one of {', '.join(TRACKERS)}")
    try:  # found, not imported: mlflow's import alone takes seconds
        found = importlib.util.find_spec(MODULES[name]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"--tracker {name} needs the optional extra: pip install "
                          f"'fedhier[{name}]' (the {MODULES[name]} package)")


def make_trackers(name: str | None) -> list[RunCallback]:
    """The callbacks of ``--tracker name`` (none for None)."""
    check_tracker(name)
    return [] if name is None else [CLASSES[name]()]


_CURRENT: contextvars.ContextVar[tuple[RunCallback, ...]] = contextvars.ContextVar(
    "fedhier_run_callbacks", default=())


@contextlib.contextmanager
def attached(callbacks: Sequence[RunCallback]) -> Iterator[None]:
    """Runs recorded inside this block report to ``callbacks``; they are closed after it."""
    token = _CURRENT.set(tuple(callbacks))
    try:
        yield
    finally:
        _CURRENT.reset(token)
        for callback in callbacks:
            callback.close()


def current() -> tuple[RunCallback, ...]:
    """The callbacks attached around the run being recorded."""
    return _CURRENT.get()


def read_tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of the scalar events in ``logdir``'s event files (not its
    subfolders), as TensorBoard shows them: a session start at step s (a writer's
    ``purge_step``) drops the values logged before it at steps >= s. TFRecord framing (8-byte
    length, 4-byte CRC, the Event, 4-byte CRC) read with tensorboardX's protobuf classes.
    Values are float32, as TensorBoard stores them."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and \
                    event.session_log.status == event_pb2.SessionLog.START:
                out = {tag: [(step, v) for step, v in values if step < event.step]
                       for tag, values in out.items()}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((int(event.step), value.simple_value))
    return out


def read_wandb_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows an offline W&B run in ``run_dir/wandb`` logged (``run.log``), in order, each
    {key: value} with W&B's ``_step``, plus, as the last row under ``"summary"``, the run's
    final summary updates. Read from the run's transaction log (``run-<id>.wandb``: W&B's
    header, then LevelDB log records of 32 KiB blocks, each a ``wandb_internal_pb2.Record``),
    the file ``wandb sync`` uploads; the newest run when there are several."""
    import struct

    from wandb.proto import wandb_internal_pb2

    logs = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"no offline W&B run under {Path(run_dir, 'wandb')}")
    data = logs[-1].read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{logs[-1]} is not a W&B transaction log")
    block, pos, pending = 32768, 7, b""
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record.FromString(pending)  # type: ignore[attr-defined]
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif record.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json)
                            for item in record.summary.update if item.key})
    return [*rows, {"summary": summary}]
