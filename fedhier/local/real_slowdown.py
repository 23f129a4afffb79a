"""A real slowdown for deployments: a sleep per local step on a client, by its edge.

``edge_slowdown`` (e.g. ``1:4``) slows an edge's clients on the *simulated* clock
(:mod:`fedhier.round.clock`). With ``real_step_seconds`` S > 0 (``fedhier deploy local --edges
2 --edge-slowdown 1:4 --real-step-seconds 0.02 ...``), every client of a deployment with edge
servers also *really* sleeps, after its local steps, S x its edge's factor seconds per step
(factor 1 for an edge not named): the slow edge is slow in wall-clock seconds too
(docs/deployment.md, "Asynchronous edges"). 0 (the default): no sleep. It changes no number
of the run, only its time.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fedhier.settings.run_config import RunConfig


@functools.lru_cache(maxsize=4)
def _factors(edge_slowdown: str) -> dict[int, float]:
    """edge -> its slowdown factor (edges not named: 1)."""
    from fedhier.round.clock import parse_edge_slowdown

    return dict(parse_edge_slowdown(edge_slowdown))


def sleep_for_steps(cfg: RunConfig, edge: Any, steps: int) -> float:
    """Sleep ``steps`` x ``cfg.real_step_seconds`` x the factor of ``edge`` (the client's edge now,
    from its SuperNode's ``edge`` node config, which a re-attached SuperNode gets anew; None:
    factor 1) under edge servers; returns the seconds slept."""
    base = cfg.real_step_seconds
    if not base or not cfg.edge_servers or steps <= 0:
        return 0.0
    factor = 1.0 if edge is None else _factors(cfg.edge_slowdown).get(int(edge), 1.0)
    seconds = base * steps * factor
    time.sleep(seconds)
    return seconds
