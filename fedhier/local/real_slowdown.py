"""A real slowdown for deployments: a sleep per local step on a client, by its edge.

``edge_slowdown`` (e.g. ``1:4``) slows an edge's clients on the *simulated* clock
(:mod:`fedhier.round.clock`). With :data:`STEP_SECONDS_ENV` set (seconds, e.g.
``FEDHIER_STEP_SECONDS=0.02 fedhier deploy local --edges 2 --edge-slowdown 1:4 ...``), every
client of a deployment with edge servers also *really* sleeps, after its local steps,
``FEDHIER_STEP_SECONDS x its edge's factor`` seconds per step (factor 1 for an edge not
named): the slow edge is slow in wall-clock seconds too (docs/deployment.md, "Asynchronous
edges"). Unset or 0: no sleep (the default). It changes no number of the run, only its time.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from fedhier.common.errors import ConfigError
from fedhier.settings.run_config import RunConfig

#: Seconds of real sleep per local step of a client of an edge with factor 1.
STEP_SECONDS_ENV = "FEDHIER_STEP_SECONDS"


def step_seconds() -> float:
    """:data:`STEP_SECONDS_ENV` (0: unset); a bad value is one ConfigError."""
    text = os.environ.get(STEP_SECONDS_ENV, "").strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = -1.0
    if not 0 <= value < 3600:
        raise ConfigError(f"{STEP_SECONDS_ENV}={text!r}: give seconds per step, 0 <= s < 3600")
    return value


@functools.lru_cache(maxsize=4)
def _factors(edge_slowdown: str) -> dict[int, float]:
    """edge -> its slowdown factor (edges not named: 1)."""
    from fedhier.round.clock import parse_edge_slowdown

    return dict(parse_edge_slowdown(edge_slowdown))


def sleep_for_steps(cfg: RunConfig, edge: Any, steps: int) -> float:
    """Sleep ``steps`` x :func:`step_seconds` x the factor of ``edge`` (the client's edge now,
    from its SuperNode's ``edge`` node config, which a re-attached SuperNode gets anew; None:
    factor 1) under edge servers; returns the seconds slept."""
    base = step_seconds()
    if not base or not cfg.edge_servers or steps <= 0:
        return 0.0
    factor = 1.0 if edge is None else _factors(cfg.edge_slowdown).get(int(edge), 1.0)
    seconds = base * steps * factor
    time.sleep(seconds)
    return seconds
