"""Execute a sweep's pending units on this machine, without Ray: ``jobs`` worker processes,
each started once (fedhier, torch and the data imported and loaded once, the federations
cached in-process), taking units from one queue, largest first.

A unit is a trial or a batch of trials (:func:`fedhier.studies.sweep.trials.batch_units`), run by
:func:`fedhier.studies.sweep.trials.run_unit`, the same function Ray Tune's trials run
(:mod:`fedhier.studies.sweep.tune_runner`, used with ``--ray-address`` or ``--runner tune``), so
the run folders are the same either way. Which units are pending is decided from the run
folders, so a sweep killed in any way resumes by running the same command.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from fedhier.studies.sweep.trials import (
    TrialFailedError,
    Unit,
    finished_lines,
    run_unit,
    unit_trials,
)


def _start_worker(paths: Sequence[str]) -> None:
    """A worker's start: the spec's folder (a plugin module beside it) on its path, one torch
    thread (one unit per core)."""
    import torch

    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(1)


def _run(unit: Unit, tracker: str | None) -> tuple[str | None, float]:
    """Run one unit in a worker: (its one-line error or None, seconds)."""
    started = time.perf_counter()
    try:
        run_unit(unit, tracker)
    except TrialFailedError as exc:
        return str(exc), time.perf_counter() - started
    return None, time.perf_counter() - started


def run_locally(units: Sequence[Unit], jobs: int, tracker: str | None,
                paths: Sequence[str] = (), progress: bool = True) -> list[str]:
    """Run ``units`` in ``jobs`` worker processes (in this process when ``jobs`` is 1 or
    there is one unit); returns the one-line errors of the units that failed.
    ``progress``: one line per finished run on stdout
    (:func:`fedhier.studies.sweep.trials.finished_lines`)."""
    errors: list[str] = []
    total = sum(len(unit_trials(unit)) for unit in units)
    done = 0

    def finished(unit: Unit, outcome: tuple[str | None, float]) -> None:
        nonlocal done
        error, seconds = outcome
        if error is not None:
            errors.append(error)
        if progress:
            print("\n".join(finished_lines(done, total, unit, error, seconds)), flush=True)
        done += len(unit_trials(unit))

    if jobs <= 1 or len(units) <= 1:
        _start_worker(paths)
        for unit in units:
            finished(unit, _run(unit, tracker))
        return errors
    context = multiprocessing.get_context("forkserver")  # no fork of a process with threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_start_worker,
                             initargs=(list(paths),)) as pool:
        futures = {pool.submit(_run, unit, tracker): unit for unit in units}
        for future in as_completed(futures):
            finished(futures[future], future.result())
    return errors
