"""Deterministic crash points for testing interrupted runs (never active in normal use).

With ``FEDHIER_CRASH_AT=N`` in the environment, the N-th call of :func:`crash_point` in this
process kills the process with SIGKILL, as a power cut or the out-of-memory killer would, at
a chosen moment of writing the run folder (before a record, halfway through its line, between
a record and its checkpoint, while the checkpoint's temporary file is written, ...).
``FEDHIER_CRASH_AT=0`` only counts the points (:func:`passed`): a test learns how many a run
has and picks which to kill at.
"""

from __future__ import annotations

import os
import signal

ENV = "FEDHIER_CRASH_AT"
_passed = 0


def active() -> bool:
    """Whether crash points are counted in this process."""
    return os.environ.get(ENV, "").strip().isdigit()


def crash_point() -> None:
    """Count one crash point; SIGKILL this process if it is the N-th."""
    target = os.environ.get(ENV, "")
    if not target.strip().isdigit():  # unset (normal use), or not a count: no crash points
        return
    global _passed
    _passed += 1
    if _passed == int(target):
        os.kill(os.getpid(), signal.SIGKILL)


def passed() -> int:
    """The crash points counted so far in this process."""
    return _passed


def reset() -> None:
    """Count from zero again (a test's forked child starts its own count)."""
    global _passed
    _passed = 0
