"""The trials of a sweep: one ordinary run folder per (arm, tuned value, seed).

A trial is run by ``fedhier run``'s own code (:func:`fedhier.cli.main`), so its folder is the
one ``fedhier run`` writes. Before running, :func:`trial_state` decides from the folder alone:
``done`` (summary.json: skipped), ``resume`` (a checkpoint.pt: ``fedhier run --resume``),
``restart`` (cut off without a checkpoint, or with one of a configuration the spec no longer
gives: run again with ``--overwrite``) or ``new``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhier.config import RunConfig
from fedhier.errors import ConfigError
from fedhier.run_folder import FAILED, atomic_write_bytes, read_metrics
from fedhier.sweep.spec import SweepSpec, arm_name


@dataclass(frozen=True)
class Trial:
    """One run of the sweep: ``arm`` (name), ``tuned`` values, ``seed`` and its config."""

    arm: str
    tuned: dict[str, Any]
    seed: int
    config: RunConfig
    run_dir: Path
    config_file: Path

    @property
    def name(self) -> str:
        tuned = f"/{arm_name(self.tuned)}" if self.tuned else ""
        return f"{self.arm}{tuned}/seed{self.seed}"


def trials_of(spec: SweepSpec, folder: Path) -> list[Trial]:
    """Every trial of ``spec`` in sweep folder ``folder`` (arms x tuned values x seeds)."""
    out = []
    for arm in spec.arms:
        for tuned, cfg in arm.candidates:
            for seed in spec.seeds:
                sub = folder / "runs" / arm.name
                if tuned:
                    sub = sub / arm_name(tuned)
                run_dir = sub / f"seed{seed}"
                key = str(run_dir.relative_to(folder / "runs")).replace("/", "__")
                out.append(Trial(arm.name, dict(tuned), seed, cfg.replace(seed=seed, out=""),
                                 run_dir, folder / "configs" / f"{key}.toml"))
    return out


def trial_state(trial: Trial) -> str:
    """``done``, ``resume``, ``restart`` or ``new``, from the run folder alone.

    Raises:
        ConfigError: a finished folder that ran another configuration (a changed spec with
            the same ``out``): nothing is overwritten.
    """
    path = trial.run_dir
    if (path / "summary.json").is_file() and not (path / FAILED).exists():
        if not same_config(trial):
            raise ConfigError(f"{path} holds a finished run of another configuration; give "
                              "the changed sweep another out, or remove that folder")
        return "done"
    if (path / "checkpoint.pt").is_file():  # a killed trial: resumed if the spec is unchanged
        return "resume" if same_config(trial) else "restart"
    if path.exists():
        return "restart"
    return "new"


def config_values(trial: Trial) -> dict[str, Any]:
    """The settings written to the trial's config file (all but ``out``)."""
    return {k: v for k, v in trial.config.to_dict().items() if k != "out"}


def same_config(trial: Trial) -> bool:
    """Whether the trial's finished folder ran its configuration: the config file the sweep
    wrote for it holds the same settings (config.json records resolved values, such as an
    automatic min_partition_size, so it is not compared)."""
    try:
        return trial.config_file.read_text() == toml_text(config_values(trial))
    except OSError:
        return False


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else
                                                          ("inf" if value > 0 else "-inf"))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def toml_text(values: Mapping[str, Any]) -> str:
    """Flat ``key = value`` TOML of a configuration's scalars and tuples."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())


def run_argv(trial: Trial, state: str, tracker: str | None = None) -> list[str]:
    """The ``fedhier run`` command line of ``trial`` in ``state`` (its config file written)."""
    extra = ["--tracker", tracker] if tracker else []
    if state == "resume":
        return ["run", "--resume", str(trial.run_dir), "--no-progress", *extra]
    atomic_write_bytes(trial.config_file, toml_text(config_values(trial)).encode())
    argv = ["run", "--config", str(trial.config_file), "--out", str(trial.run_dir),
            "--no-progress", *extra]
    return argv + (["--overwrite"] if state == "restart" else [])


class TrialFailedError(RuntimeError):
    """A trial's ``fedhier run`` ended with a non-zero exit code (its one-line error)."""


def run_trial(trial: Trial, tracker: str | None = None) -> dict[str, Any]:
    """Run (or resume, or restart) one trial through :func:`fedhier.cli.main`; returns its
    summary. A finished trial is not run again."""
    import importlib

    import torch

    # the console script's entry point, fedhier.cli:main, resolved as the registry resolves
    # engines: fedhier.cli registers this subcommand, so a plain import would be a cycle
    main = importlib.import_module("fedhier.cli").main
    state = trial_state(trial)
    if state != "done":
        torch.set_num_threads(1)  # one trial per core, as fedhier experiment does
        trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(run_argv(trial, state, tracker))
        if code != 0:
            lines = err.getvalue().strip().splitlines()
            raise TrialFailedError(f"{trial.name}: exit code {code}: "
                              f"{lines[-1] if lines else 'no message'}")
    return json.loads((trial.run_dir / "summary.json").read_text())


def load_records(trials: Sequence[Trial]) -> dict[str, list[dict[str, Any]]]:
    """metrics.jsonl of every finished trial, by trial name."""
    return {t.name: read_metrics(t.run_dir) for t in trials
            if (t.run_dir / "summary.json").is_file()}
