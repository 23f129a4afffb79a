"""Settings of asynchronous, buffered edges and their staleness rule (docs/hsgd.md).

With ``buffer`` K > 0 the cloud does not wait for every edge: it aggregates as soon as K edges
have reported the result of their G local steps (:mod:`fedhier.async_edges`). An edge's
report is *stale* by s when s cloud aggregations happened since the edge took the global model
it started from; reports staler than ``max_staleness`` S are dropped, the others weigh
``staleness_weight(s) = 1 / sqrt(1 + s)`` times their data weight (FedBuff's polynomial rule).
K = N edges is synchronous H-SGD: every report is then fresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedhier.errors import ConfigError


@dataclass(frozen=True)
class AsyncEdges:
    """K (``buffer``: reports per cloud aggregation, 0 = synchronous) and S
    (``max_staleness``: cloud aggregations a report may be behind)."""

    buffer: int = 0
    max_staleness: int = 4

    @property
    def active(self) -> bool:
        return self.buffer > 0

    def check(self, num_edges: int) -> None:
        """One-line ConfigErrors for settings no run could honour. Any depth, aggregators,
        mobility, regrouping and per-edge periods compose with asynchronous edges
        (:mod:`fedhier.async_edges`)."""
        if self.buffer < 0 or self.max_staleness < 0:
            raise ConfigError(f"async_buffer and max_staleness must be >= 0, got "
                              f"{self.buffer} and {self.max_staleness}")
        if not self.active:
            return
        if self.buffer > num_edges:
            raise ConfigError(f"async_buffer K={self.buffer} is more than the {num_edges} "
                              "edges; the cloud would wait for reports that never come")


def staleness_weight(staleness: int) -> float:
    """The factor of a report ``staleness`` cloud aggregations behind: 1 / sqrt(1 + s)."""
    return 1.0 / math.sqrt(1.0 + staleness)
