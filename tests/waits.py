"""Waits that follow events, not a clock tuned to a fast machine (issue 42).

:func:`wait_for` returns when the awaited event happened (a log line, a node up, a process
ended), fails at once when the process that should produce it died, and otherwise fails only
after ``idle`` seconds without any progress (the log grew, a process started or ended): a
machine three times slower makes more progress steps, never a failure; a hang still ends the
test. ``FEDHIER_TEST_IDLE_SECONDS`` changes the idle limit (default 600 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

IDLE = float(os.environ.get("FEDHIER_TEST_IDLE_SECONDS", "600"))


def wait_for(done: Callable[[], bool], *, what: str,
             progress: Callable[[], object] = lambda: None,
             alive: Callable[[], bool] = lambda: True, idle: float = IDLE,
             detail: Callable[[], str] = lambda: "", poll: float = 0.5) -> None:
    """Until ``done()``; ``progress()`` is any value that changes while the work goes on,
    ``alive()`` whether whatever should make ``done()`` true still runs."""
    seen, since = progress(), time.monotonic()
    while not done():
        assert alive(), f"{what}: the process ended first. {detail()}"
        now = progress()
        if now != seen:
            seen, since = now, time.monotonic()
        assert time.monotonic() - since < idle, \
            f"{what}: no progress for {idle:.0f} s. {detail()}"
        time.sleep(poll)
