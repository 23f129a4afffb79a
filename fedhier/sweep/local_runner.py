"""Execute a sweep's pending units on this machine, without Ray: ``jobs`` worker processes,
each started once (fedhier, torch and the data imported and loaded once, the federations
cached in-process), taking units from one queue, largest first.

A unit is a trial or a batch of trials (:func:`fedhier.sweep.trials.batch_units`), run by
:func:`fedhier.sweep.trials.run_unit`, the same function Ray Tune's trials run
(:mod:`fedhier.sweep.tune_runner`, used with ``--ray-address`` or ``--runner tune``), so
the run folders are the same either way. Which units are pending is decided from the run
folders, so a sweep killed in any way resumes by running the same command.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from fedhier.sweep.trials import TrialFailedError, Unit, run_unit


def _start_worker(paths: Sequence[str]) -> None:
    """A worker's start: the spec's folder (a plugin module beside it) on its path, one torch
    thread (one unit per core)."""
    import torch

    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(1)


def _run(unit: Unit, tracker: str | None) -> str | None:
    """Run one unit in a worker; its one-line error, or None."""
    try:
        run_unit(unit, tracker)
    except TrialFailedError as exc:
        return str(exc)
    return None


def run_locally(units: Sequence[Unit], jobs: int, tracker: str | None,
                paths: Sequence[str] = ()) -> list[str]:
    """Run ``units`` in ``jobs`` worker processes (in this process when ``jobs`` is 1 or
    there is one unit); returns the one-line errors of the units that failed."""
    if jobs <= 1 or len(units) <= 1:
        _start_worker(paths)
        return [e for e in (_run(unit, tracker) for unit in units) if e is not None]
    context = multiprocessing.get_context("forkserver")  # no fork of a process with threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_start_worker,
                             initargs=(list(paths),)) as pool:
        futures = [pool.submit(_run, unit, tracker) for unit in units]
        return [e for e in (f.result() for f in futures) if e is not None]
