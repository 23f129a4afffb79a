"""Execute a sweep's pending trials on Ray Tune.

Each pending trial becomes one Tune trial (``param_space = grid_search`` over the trials)
whose function runs :func:`fedhier.studies.sweep.trials.run_trial` with one CPU. Locally Ray starts
with ``jobs`` CPUs; with ``address`` it joins an existing cluster (fedhier, and any plugin a
spec names, must be importable on its nodes). Tune's own files (experiment state, its
loggers) go to ``SWEEP/tune/``. Which trials are pending is decided from the run folders
(:func:`fedhier.studies.sweep.trials.trial_state`), not from Tune's state, so a sweep killed in any
way resumes by running the same command.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhier.common.errors import FedhierError
from fedhier.studies.sweep.trials import Unit, finished_lines, run_unit, unit_trials


def progress_callback(total: int) -> Any:
    """A Tune callback printing one line per finished (or failed) run on stdout, ``total``
    runs in all: ``[3/45] alpha=0.1,grouping=random/seed2: final test accuracy 0.8206 (12.3
    s)`` (a batch of runs, one Tune trial, prints a line for each of its runs)."""
    from ray.tune import Callback

    class TrialLines(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.done = 0
            self.started: dict[str, float] = {}

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.started[trial.trial_id] = time.time()

        def _line(self, trial: Any, error: str | None) -> None:
            unit = trial.config["trial"]
            seconds = time.time() - self.started.get(trial.trial_id, time.time())
            print("\n".join(finished_lines(self.done, total, unit, error, seconds)),
                  flush=True)
            self.done += len(unit_trials(unit))

        def on_trial_complete(self, iteration: int, trials: list, trial: Any,
                              **info: Any) -> None:
            self._line(trial, None)

        def on_trial_error(self, iteration: int, trials: list, trial: Any,
                           **info: Any) -> None:
            lines = str(getattr(trial, "error_msg", None) or "see its run folder").splitlines()
            self._line(trial, lines[-1][:200] if lines else "?")

    return TrialLines()


def _tune_trial(config: dict[str, Any]) -> None:
    """Tune's function: run one fedhier trial (or a batch of seeds), report its final
    numbers (a batch: its first seed's) to Tune."""
    from ray import tune

    unit: Unit = config["trial"]
    summary = run_unit(unit, config.get("tracker"))[0]
    tune.report({"final_test_accuracy": summary["final_test_accuracy"],
                 "final_test_loss": summary["final_test_loss"]})


def run_on_tune(trials: Sequence[Unit], folder: Path, jobs: int, address: str | None,
                tracker: str | None, paths: Sequence[str] = (),
                progress: bool = True) -> list[str]:
    """Run ``trials`` (trials, or batches of seeds) on Ray Tune; returns the one-line errors
    of those that failed. ``paths`` join the local workers' PYTHONPATH (where a spec's own
    plugin module lies). ``progress``: one line per finished trial on stdout."""
    import ray
    from ray import tune

    folder = folder.resolve()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.getcwd(),
                                                       os.environ.get("PYTHONPATH", "")])),
           "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "RAY_CHDIR_TO_TRIAL_DIR": "0"}  # relative data paths keep meaning the same files
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "configure_logging": False}
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=jobs, runtime_env={"env_vars": env}, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"--ray-address {address}" if address else "a local Ray"
        text = " ".join(str(exc).split())[:300]
        raise FedhierError(f"{where}: Ray did not start or connect ({type(exc).__name__}: "
                           f"{text})") from exc
    runs = sum(len(unit_trials(unit)) for unit in trials)
    try:
        tuner = tune.Tuner(
            tune.with_resources(_tune_trial, {"cpu": 1}),
            param_space={"trial": tune.grid_search(list(trials)), "tracker": tracker},
            tune_config=tune.TuneConfig(num_samples=1, max_concurrent_trials=jobs or None,
                                        reuse_actors=True),
            run_config=tune.RunConfig(name="tune", storage_path=str(folder), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0),
                                      callbacks=[progress_callback(runs)] if progress
                                      else None))
        grid = tuner.fit()
        errors = []
        for index in range(len(grid)):
            result = grid[index]
            if result.error is not None:
                lines = str(result.error).strip().splitlines()
                errors.append(next((line for line in reversed(lines) if "TrialFailedError" in line
                                    or line.startswith("fedhier")), lines[-1] if lines else "?"))
        return errors
    finally:
        ray.shutdown()
