"""Settings of asynchronous, buffered edges and their staleness rule (docs/hsgd.md).

With ``buffer`` K > 0 the cloud does not wait for every edge: it aggregates as soon as K edges
have reported the result of their G local steps (:mod:`fedhier.round.asynchrony.edges`). An edge's
report is *stale* by s when s cloud aggregations happened since the edge took the global model
it started from; reports staler than ``max_staleness`` S are dropped, the others make the new
model by the run's ``rule`` (:mod:`fedhier.round.asynchrony.rules`: FedBuff, FedAsync or the shifted
mean, with a staleness function s such as FedBuff's 1 / sqrt(1 + s)). K = N edges is
synchronous H-SGD under every rule that reduces to it: every report is then fresh.

With ``regions`` (one K per level between the edges and the cloud, trees of 3+ levels) the
nodes of those levels buffer too: a region aggregates its first K children's reports and sends
one report up, and the cloud's ``buffer`` then counts its own children's reports (0 = all of
them): :mod:`fedhier.round.asynchrony.regions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedhier.common.errors import ConfigError, Refusal
from fedhier.round.asynchrony.rules import AsyncRule, StalenessFunction

#: What asynchronous edges refuse (docs/hsgd.md's table, :mod:`fedhier.settings.refusals`).
REFUSALS = (
    Refusal("`--async-buffer K` with K above the number of edges",
            "no meaning: the cloud would wait for reports that never come",
            ("--async-buffer", "5"), "edges; the cloud would wait for reports that never come"),
    Refusal("`--async-buffer` or `--max-staleness` below 0",
            "no meaning: a buffer holds some reports, a report is some aggregations old",
            ("--async-buffer", "-1"), "async_buffer must be"),
    Refusal("`--region-buffer` on two levels",
            "no meaning: no node lies between the edges and the cloud",
            ("--async-buffer", "1", "--region-buffer", "1"),
            "region_buffer needs a tree of 3+ levels"),
    Refusal("`--region-buffer` with one entry too many or too few",
            "no meaning: it takes one K per level between the edges and the cloud",
            ("--groups", "4,2", "--periods", "5,10,20", "--async-buffer", "1",
             "--region-buffer", "1,1"), "region_buffer takes one K per level"),
    Refusal("`--region-buffer` with an entry above a node's children",
            "no meaning: the node would wait for reports that never come",
            ("--groups", "4,2", "--periods", "5,10,20", "--async-buffer", "1",
             "--region-buffer", "3"), "it would wait for reports that never come"),
    Refusal("`--async-buffer` above the cloud's children, with `--region-buffer`",
            "no meaning: the cloud would wait for reports that never come",
            ("--groups", "4,2", "--periods", "5,10,20", "--async-buffer", "3",
             "--region-buffer", "1"), "is more than the cloud's"),
)

@dataclass(frozen=True)
class AsyncEdges:
    """K (``buffer``: reports per cloud aggregation, 0 = synchronous) and S
    (``max_staleness``: cloud aggregations a report may be behind); ``regions``: K_l of each
    level l = 2..L-1 between the edges and the cloud (0 = all of a node's children), () = the
    regions relay the edges' reports and the cloud's K counts those; ``rule``: how the
    accepted reports make the new model (:mod:`fedhier.round.asynchrony.rules`; FedBuff by
    default); ``replay``: a recorded arrival order to take the reports in
    (:mod:`fedhier.round.asynchrony.arrival_order`; '' = the run's own)."""

    buffer: int = 0
    max_staleness: int = 4
    regions: tuple[int, ...] = ()
    rule: AsyncRule = field(default_factory=AsyncRule)
    replay: str = ""  # an arrivals file or run folder whose order the cloud takes ('': none)

    @property
    def active(self) -> bool:
        return self.buffer > 0 or bool(self.regions)

    def check(self, num_edges: int) -> None:
        """One-line ConfigErrors for settings no run could honour. Any depth, aggregators,
        mobility, regrouping and per-edge periods compose with asynchronous edges
        (:mod:`fedhier.round.asynchrony.edges`)."""
        if self.buffer < 0 or self.max_staleness < 0:
            raise ConfigError(f"async_buffer and max_staleness must be >= 0, got "
                              f"{self.buffer} and {self.max_staleness}")
        if any(k < 0 for k in self.regions):
            raise ConfigError(f"region_buffer must be >= 0 at every level, got "
                              f"{','.join(map(str, self.regions))}")
        self.rule.check()
        if not self.active or self.regions:
            return
        if self.buffer > num_edges:
            raise ConfigError(f"async_buffer K={self.buffer} is more than the {num_edges} "
                              "edges; the cloud would wait for reports that never come")


def check_region_buffers(asynchronous: AsyncEdges, groups: tuple[int, ...]) -> None:
    """One-line ConfigErrors for ``regions`` that a tree of ``groups`` (node counts per level,
    edges first) cannot honour; the exact check against each node's children is
    :func:`fedhier.round.asynchrony.regions.check_tree`."""
    regions = asynchronous.regions
    if not regions:
        return
    if len(groups) < 2:
        raise ConfigError("region_buffer needs a tree of 3+ levels (--groups N,R): with two "
                          "levels no node lies between the edges and the cloud")
    if len(regions) != len(groups) - 1:
        raise ConfigError(f"region_buffer takes one K per level between the edges and the "
                          f"cloud: {len(groups) - 1} for groups {','.join(map(str, groups))}, "
                          f"got {len(regions)}")
    for level, k in enumerate(regions, start=2):
        fewest = groups[level - 2] // groups[level - 1]  # some node has at most this many
        if k > fewest:
            raise ConfigError(f"region_buffer K={k} at level {level} is more than the "
                              f"{fewest} children a node of that level may have "
                              f"({groups[level - 2]} under {groups[level - 1]}); it would "
                              "wait for reports that never come")
    if asynchronous.buffer > groups[-1]:
        raise ConfigError(f"async_buffer K={asynchronous.buffer} is more than the cloud's "
                          f"{groups[-1]} children; with region_buffer the cloud counts its "
                          "children's reports")


def staleness_weight(staleness: int) -> float:
    """FedBuff's factor of a report ``staleness`` cloud aggregations behind: 1 / sqrt(1 + s)
    (:class:`fedhier.round.asynchrony.rules.StalenessFunction`'s default)."""
    return float(StalenessFunction()(np.array([staleness]))[0])
