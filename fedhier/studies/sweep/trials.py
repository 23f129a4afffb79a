"""The trials of a sweep: one ordinary run folder per (arm, tuned value, seed).

A trial is run by ``fedhier run``'s own code (:func:`fedhier.cli.commands`), so its folder is the
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

from fedhier.common.errors import ConfigError
from fedhier.runs.folder import FAILED, atomic_write_bytes, read_metrics
from fedhier.settings.run_config import RunConfig
from fedhier.studies.sweep.spec import SweepSpec, arm_name


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
    """Run (or resume, or restart) one trial through :func:`fedhier.cli.commands`; returns its
    summary. A finished trial is not run again."""
    state = trial_state(trial)
    if state != "done":
        trial.run_dir.parent.mkdir(parents=True, exist_ok=True)
        _run_main(run_argv(trial, state, tracker), trial.name)
    return json.loads((trial.run_dir / "summary.json").read_text())


def _run_main(argv: list[str], name: str) -> None:
    """``fedhier run ARGV`` in this process, at one torch thread (one trial per core, as
    fedhier experiment does); TrialFailedError with its last error line if it fails."""
    import importlib

    import torch

    # the console script's entry point, fedhier.cli.commands:main, resolved as the registry resolves
    # engines: fedhier.cli.commands registers this subcommand, so a plain import would be a cycle
    main = importlib.import_module("fedhier.cli.commands").main
    torch.set_num_threads(1)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        lines = err.getvalue().strip().splitlines()
        raise TrialFailedError(f"{name}: exit code {code}: "
                               f"{lines[-1] if lines else 'no message'}")


#: What a sweep runs as one unit of work: a trial, or a batch of trials run as one batched
#: computation (:func:`batch_units`; ``--batch-seeds``: the seeds of one arm and tuned value).
Unit = Trial | tuple[Trial, ...]


def trial_units(pending: Sequence[Trial], states: Mapping[str, str],
                batch_seeds: bool) -> list[Unit]:
    """The pending trials as Tune's units of work. With ``batch_seeds``, the new or cut-off
    (restart) trials of one arm and tuned value on the vectorized engine form one batch
    (two or more seeds); trials to resume from a checkpoint, and other engines, stay alone."""
    if not batch_seeds:
        return list(pending)
    units: list[Unit] = []
    groups: dict[tuple[str, str], list[Trial]] = {}
    for trial in pending:
        if trial.config.engine == "vectorized" and states[trial.name] in ("new", "restart"):
            groups.setdefault((trial.arm, arm_key(trial.tuned)), []).append(trial)
        else:
            units.append(trial)
    for group in groups.values():
        units.append(tuple(group) if len(group) > 1 else group[0])
    return units


def arm_key(tuned: Mapping[str, Any]) -> str:
    return json.dumps(tuned, sort_keys=True, default=str)


def batch_units(pending: Sequence[Trial], states: Mapping[str, str], parts: int = 1,
                most: int = 64) -> list[Unit]:
    """The default units: the new or cut-off (restart) trials on the vectorized engine that
    share a model, a dataset and a device form batches (any arms, tuned values and seeds),
    each run as one batched computation (:func:`run_batch`), in ``parts`` batches or more
    (at most ``most`` trials each) so that ``parts`` workers share them; the rest (trials
    to resume, other engines) stay alone. The largest units come first."""
    units: list[Unit] = []
    groups: dict[tuple[Any, ...], list[Trial]] = {}
    for trial in pending:
        cfg = trial.config
        if cfg.engine == "vectorized" and states[trial.name] in ("new", "restart"):
            groups.setdefault((cfg.model, cfg.dataset, cfg.data_path, cfg.device),
                              []).append(trial)
        else:
            units.append(trial)
    for group in groups.values():
        count = max(1, min(parts, len(group)), -(-len(group) // most))
        for part in (group[i::count] for i in range(count)):
            units.append(tuple(part) if len(part) > 1 else part[0])
    return sorted(units, key=lambda u: -len(u) if isinstance(u, tuple) else -1)


def run_batch(trials: Sequence[Trial], states: Mapping[str, str],
              tracker: str | None = None) -> None:
    """The trials (new or to restart) as one batched computation in this process
    (:func:`fedhier.cli.commands.run_configs_batched`): each trial's config file written and read
    back as ``fedhier run --config FILE --out DIR`` reads it, so each folder is the one its
    own ``fedhier run`` writes; TrialFailedError with the first failure's line."""
    import importlib

    import torch

    from fedhier.cli.flags import error_text, read_config_file

    # imported by name, as _run_main does: fedhier.cli.commands imports this module
    cli = importlib.import_module("fedhier.cli.commands")
    torch.set_num_threads(1)
    names = ", ".join(t.name for t in trials)
    err = io.StringIO()
    try:
        cfgs = []
        for trial in trials:
            atomic_write_bytes(trial.config_file, toml_text(config_values(trial)).encode())
            cfgs.append(RunConfig.from_mapping(
                {**read_config_file(trial.config_file), "out": str(trial.run_dir)},
                where=f"--config {trial.config_file}"))
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.run_configs_batched(
                cfgs, [states[t.name] == "restart" for t in trials], tracker, False,
                [t.name for t in trials], "<run folder>")
    except Exception as exc:  # a run's failure: its folder is marked, as a lone run's
        raise TrialFailedError(f"{names}: {error_text(exc)}") from exc
    if code != 0:
        lines = err.getvalue().strip().splitlines()
        raise TrialFailedError(f"{names}: exit code {code}: "
                               f"{lines[-1] if lines else 'no message'}")


def unit_trials(unit: Unit) -> tuple[Trial, ...]:
    """The trials of a unit (a trial, or a batch of them)."""
    return unit if isinstance(unit, tuple) else (unit,)


def finished_lines(done: int, total: int, unit: Unit, error: str | None,
                   seconds: float) -> list[str]:
    """One progress line per run of a finished ``unit`` (its trials numbered from ``done``
    + 1 of ``total`` runs), each with that run's own final accuracy from its summary.json;
    ``seconds``: the unit's (a batch's runs share one computation)."""
    from fedhier.runs.progress import trial_line

    lines = []
    for k, trial in enumerate(unit_trials(unit), start=done + 1):
        path = trial.run_dir / "summary.json"
        summary = json.loads(path.read_text()) if path.is_file() else None
        lines.append(trial_line(k, total, trial.name, summary,
                                (error or "no summary.json") if summary is None else None,
                                seconds))
    return lines


def run_unit(unit: Unit, tracker: str | None = None) -> list[dict[str, Any]]:
    """Run a trial (:func:`run_trial`) or a batch (:func:`run_batch`); returns the
    summaries."""
    if isinstance(unit, Trial):
        return [run_trial(unit, tracker)]
    states = {t.name: trial_state(t) for t in unit}
    todo = [t for t in unit if states[t.name] in ("new", "restart")]
    for trial in unit:
        if trial not in todo and states[trial.name] != "done":
            run_trial(trial, tracker)  # checkpointed since the sweep looked: resumed alone
    if todo:
        run_batch(todo, states, tracker)
    return [json.loads((t.run_dir / "summary.json").read_text()) for t in unit]


def load_records(trials: Sequence[Trial]) -> dict[str, list[dict[str, Any]]]:
    """metrics.jsonl of every finished trial, by trial name."""
    return {t.name: read_metrics(t.run_dir) for t in trials
            if (t.run_dir / "summary.json").is_file()}
