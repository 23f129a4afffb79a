"""Experiment trackers: TensorBoard, MLflow, Weights & Biases (``--tracker``).

A tracker is a :class:`RunCallback` the run recorder calls (pfl-research style): at the
start with the configuration (hyperparameters), after every cloud round with its
metrics.jsonl record (every numeric key, step = the record's iteration), and at the end with
the summary (the final model as an artifact where the tracker keeps artifacts). The command
line attaches trackers around a run with :func:`attached`; the recorder picks them up with
:func:`current`, so no engine knows about trackers.

Each tracker is an optional extra: ``pip install 'fedhier[tensorboard]'`` (tensorboardX),
``fedhier[mlflow]`` (to ``RUN_DIR/mlruns``), ``fedhier[wandb]`` (offline, to
``RUN_DIR/wandb``). TensorBoard's event files go to ``RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhier.common.errors import ConfigError

TRACKERS = ("tensorboard", "mlflow", "wandb")
#: tracker -> (module it needs, the fedhier extra that installs it)
MODULES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}
#: The folders the trackers write in the run folder (``--overwrite`` removes them).
OUTPUT_FOLDERS = ("tensorboard", "mlruns", "wandb")


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
    """The numeric entries of a record (lists such as client_accuracies and text left out)."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


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


class MLflowTracker(RunCallback):
    """An MLflow run in the local store ``RUN_DIR/mlruns``: params, metrics per round (step =
    iteration), model_final.safetensors and summary.json as artifacts."""

    def __init__(self) -> None:
        self.run: Any = None

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        import mlflow

        mlflow.set_tracking_uri((Path(run_dir).resolve() / "mlruns").as_uri())
        mlflow.set_experiment("fedhier")
        self.run = mlflow.start_run(run_name=Path(run_dir).name)
        if not resumed:
            mlflow.log_params({k: str(v) for k, v in hyperparameters(config).items()})

    def on_round(self, record: Mapping[str, Any]) -> None:
        import mlflow

        mlflow.log_metrics(scalars(record), step=int(record["iteration"]))

    def on_finish(self, run_dir: Path, summary: Mapping[str, Any]) -> None:
        import mlflow

        for name in ("model_final.safetensors", "summary.json"):
            mlflow.log_artifact(str(Path(run_dir) / name))

    def close(self) -> None:
        if self.run is not None:
            import mlflow

            mlflow.end_run()
            self.run = None


class WandbTracker(RunCallback):
    """An offline W&B run in ``RUN_DIR/wandb`` (``wandb sync`` uploads it later): config,
    metrics per round (step = iteration), the final model as a ``model`` artifact."""

    def __init__(self) -> None:
        self.run: Any = None

    def on_start(self, run_dir: Path, config: Mapping[str, Any], resumed: bool,
                 purge_from: int | None = None) -> None:
        import wandb

        self.run = wandb.init(mode="offline", dir=str(run_dir), project="fedhier",
                              name=Path(run_dir).name, config=hyperparameters(config))

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
    try:
        importlib.import_module(MODULES[name])
    except ImportError:
        raise ConfigError(f"--tracker {name} needs the optional extra: pip install "
                          f"'fedhier[{name}]' (the {MODULES[name]} package)") from None


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
