"""Asynchronous regions: buffers at the levels between the edges and the cloud.

``--region-buffer K_2,...,K_{L-1}`` (one K per level between the edges and the cloud, like
``--periods`` takes one period per level) makes every node of level l (a *region*) buffer its
own children's reports, as the cloud of :mod:`fedhier.round.asynchrony.edges` buffers the edges':

* **Jobs** are those of asynchronous edges: from the global model of version v (cloud
  aggregations so far) an edge's clients do the G / I edge rounds of cloud round v + 1 (the
  regions aggregating inside the job on their schedule over the edges that started it
  together), then the edge uploads its clients' last models.
* **Arrival.** A report *arrives* at a node when its upload over the link into that node (the
  simulated clock, :mod:`fedhier.round.clock`: uploads into a node queue one after another) is
  done. Arrivals are taken in simulated-time order (ties by edge id; a node above the edges'
  parents, in trees of 4+ levels, takes its children's reports in the order they were sent);
  an upload counts in the traffic of the cloud round in which it arrives.
* **A region fires** when K_l reports have arrived at it that it has not sent up yet
  (K_l = 0: all of its children): it sends them up as *one* report over its parent's link,
  ready at the K_l-th arrival. A node sends at most one report per cloud aggregation:
  reports that arrive after it fired are held for its next one, which goes up no earlier
  than the cloud aggregation that took the previous one (the cloud's last report arrival).
  The nodes ready at the same moment fire by (time, level, id).
* **The cloud** aggregates its first K (``--async-buffer``; 0 = every child) of its
  children's reports to *arrive*: with regions buffering, the cloud's K counts region
  reports, not edge reports. The edge reports inside them are merged as asynchronous edges
  merge theirs (:func:`fedhier.round.asynchrony.reports.merge_reports`, the run's rule over the edge
  reports, each discounted by its own staleness: every rule is linear in its reports, so
  this is the rule applied at each buffering region with data weights and then at the
  cloud, :mod:`fedhier.round.asynchrony.rules`), and the new model goes back down to their edges,
  which start their next job; every other edge keeps going or waits at its region.
* **Staleness** s of an edge report = cloud aggregations between its job's start model and the
  aggregation that takes it (the version counter of asynchronous edges). A report more than S
  (``--max-staleness``) behind is dropped at its edge's parent: on arrival, and at the start
  of every cloud round while it is held there; its edge then gets the current model and
  starts over. A report inside a region's report is not dropped any more (in trees of 4+
  levels a region above the edges' parents may hold it across cloud aggregations; it is
  then weighted by its staleness as any other).

A region with K_l = its number of children (or 0) waits for all of them: with every region
so and the cloud's K = its number of children, this is synchronous H-SGD bit for bit (the
same model, traffic and ``sim_seconds``); with one edge per region, ``--region-buffer 1``
is the cloud-only buffer of :mod:`fedhier.round.asynchrony.edges` with the same K, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.round.asynchrony.reports import StaleReport
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.round.loop import Executor
from fedhier.tree.hierarchy import Hierarchy

J = TypeVar("J", bound=StaleReport)


@dataclass
class RegionReport(Generic[J]):
    """Edge reports travelling together: the jobs whose reports it holds, and the simulated
    second it arrives (arrived) at the node it is sent to."""

    jobs: list[J]
    arrival: float


class AsyncRound(Protocol[J]):
    """What the buffers use of :class:`fedhier.round.asynchrony.edges.BufferedRounds`."""

    version: int
    jobs: dict[int, J]
    idle: dict[int, float]

    @property
    def communication(self) -> Any: ...
    @property
    def model_bytes(self) -> int: ...

    def _hierarchy(self) -> Hierarchy: ...
    def _start_jobs(self, executor: Executor, stats: dict[str, Any]) -> None: ...
    def _send_up(self, job: J, count: bool = True) -> float: ...
    def _queue_on(self, level: int, node: int, ready: float, count: bool = True) -> float: ...
    def _restart(self, edge: int, when: float) -> None: ...


def children(tree: Hierarchy, level: int) -> np.ndarray:
    """int64 [num_nodes(level)]: each level-``level`` node's number of children."""
    return np.bincount(tree.parents[level - 1], minlength=tree.num_nodes(level))


def parent_of(tree: Hierarchy, level: int, node: int) -> int:
    """The level-(level + 1) node above level-``level`` node ``node`` (the cloud: 0)."""
    return int(tree.parents[level][node]) if level + 1 < tree.num_levels else 0


def check_tree(asynchronous: AsyncEdges, tree: Hierarchy) -> None:
    """One-line ConfigError when a node has fewer children than its level's K."""
    top = tree.num_levels
    if len(asynchronous.regions) != top - 2:
        raise ConfigError(f"region_buffer takes one K per level between the edges and the "
                          f"cloud: {top - 2} for this tree, got {len(asynchronous.regions)}")
    for level, k in enumerate(asynchronous.regions, start=2):
        count = children(tree, level)
        if k > count.min():
            node = int(count.argmin())
            raise ConfigError(f"region_buffer K={k} at level {level} is more than the "
                              f"{count.min()} children of node {node}; it would wait for "
                              "reports that never come")
    if asynchronous.buffer > tree.num_nodes(top - 1):
        raise ConfigError(f"async_buffer K={asynchronous.buffer} is more than the cloud's "
                          f"{tree.num_nodes(top - 1)} children")


def region_buffers(asynchronous: AsyncEdges) -> RegionBuffers[Any] | None:
    """The buffers the settings ask for (None: the regions relay the edges' reports)."""
    return RegionBuffers(asynchronous) if asynchronous.regions else None


class RegionBuffers(Generic[J]):
    """The reports held at, and on their way to, the nodes between the edges and the cloud
    (see the module docstring); :meth:`collect` is the cloud's buffer over them."""

    def __init__(self, asynchronous: AsyncEdges) -> None:
        self.asynchronous = asynchronous
        #: (level, node) -> the reports that arrived there and were not sent up yet
        self.held: dict[tuple[int, int], list[RegionReport[J]]] = {}
        #: (arrival at the edge's parent, job): edge reports on their way up
        self.in_transit: list[tuple[float, J]] = []
        #: "level:node" -> when the cloud aggregation that took its last report happened
        self.fired_at: dict[str, float] = {}

    def pending(self) -> list[J]:
        """The jobs whose reports wait at a node or are on their way to one."""
        return [*(job for _, job in self.in_transit),
                *(job for reports in self.held.values() for r in reports for job in r.jobs)]

    def collect(self, rnd: AsyncRound[J], executor: Executor, stats: dict[str, Any],
                now: float) -> tuple[list[tuple[J, int]], float, int]:
        """The cloud's first K children's reports (each region firing on its first K_l):
        the edge reports in them with their staleness, when the last reaches the cloud, and
        how many edge reports were dropped (``now``: the last aggregation reached its edges)."""
        s = self.asynchronous
        tree = rnd._hierarchy()
        check_tree(s, tree)
        top = tree.num_levels
        need = s.buffer or tree.num_nodes(top - 1)
        at_cloud: list[RegionReport[J]] = []
        fired: set[tuple[int, int]] = set()
        dropped = self._drop_held(rnd, now)
        parent = tree.edges_under(2)
        jobs = rnd.jobs
        while True:
            self._fire(rnd, tree, fired, at_cloud, need)
            if len(at_cloud) >= need:
                break
            if rnd.idle:
                rnd._start_jobs(executor, stats)
            first = min(jobs, key=lambda e: (jobs[e].finish, e), default=None)
            if first is not None and (not self.in_transit
                                      or jobs[first].finish <= self.in_transit[0][0]):
                job = jobs.pop(first)  # it finishes before any report arrives
                self.in_transit.append((rnd._send_up(job, count=False), job))
                self.in_transit.sort(key=lambda t: (t[0], t[1].edge))
                continue
            if not self.in_transit:
                raise RuntimeError("asynchronous regions: the cloud waits for reports that "
                                   "never come")
            arrival, job = self.in_transit.pop(0)  # the next arrival
            rnd.communication.add_edge_cloud(1, rnd.model_bytes)  # counted on arrival
            if rnd.version - job.version > s.max_staleness:  # the edge starts over
                dropped += 1
                rnd._restart(job.edge, arrival)
                continue
            self.held.setdefault((2, int(parent[job.edge])), []).append(
                RegionReport([job], arrival))
        accepted = [(job, rnd.version - job.version) for r in at_cloud for job in r.jobs]
        done = max(r.arrival for r in at_cloud)
        for level, node in fired:
            self.fired_at[f"{level}:{node}"] = done
        return accepted, done, dropped

    def _drop_held(self, rnd: AsyncRound[J], now: float) -> int:
        """Drop the edge reports held at the edges' parents that are now more than S cloud
        aggregations behind; returns how many."""
        dropped = 0
        for (level, node), reports in list(self.held.items()):
            if level != 2:
                continue
            keep = []
            for report in reports:
                job = report.jobs[0]
                if rnd.version - job.version > self.asynchronous.max_staleness:
                    dropped += 1
                    rnd._restart(job.edge, max(report.arrival, now))
                else:
                    keep.append(report)
            self.held[(level, node)] = keep
        return dropped

    def _fire(self, rnd: AsyncRound[J], tree: Hierarchy, fired: set[tuple[int, int]],
              at_cloud: list[RegionReport[J]], need: int) -> None:
        """Every node holding its K_l unsent reports sends them up as one, earliest first
        (by the K_l-th arrival, then level, then id), while the cloud needs reports."""
        regions = self.asynchronous.regions
        while len(at_cloud) < need:
            best: tuple[float, int, int, int] | None = None
            for (level, node), reports in self.held.items():
                if (level, node) in fired:
                    continue
                k = regions[level - 2] or int(children(tree, level)[node])
                if len(reports) < k:
                    continue
                reports.sort(key=lambda r: r.arrival)
                candidate = (max(reports[k - 1].arrival,
                                 self.fired_at.get(f"{level}:{node}", -math.inf)),
                             level, node, k)
                if best is None or candidate[:3] < best[:3]:
                    best = candidate
            if best is None:
                return
            ready, level, node, k = best
            reports = self.held[(level, node)]
            self.held[(level, node)] = reports[k:]
            fired.add((level, node))
            above = parent_of(tree, level, node)
            report = RegionReport([job for r in reports[:k] for job in r.jobs],
                                  rnd._queue_on(level + 1, above, ready))
            if level + 1 == tree.num_levels:
                at_cloud.append(report)
            else:
                self.held.setdefault((level + 1, above), []).append(report)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"held": [[level, node, [[r.arrival, r.jobs] for r in reports]]
                         for (level, node), reports in sorted(self.held.items()) if reports],
                "in_transit": [[arrival, job] for arrival, job in self.in_transit],
                "fired_at": dict(self.fired_at)}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is None:
            raise ConfigError("this checkpoint was written without region_buffer; resume "
                              "it with the settings it was written with")
        self.held = {(int(level), int(node)): [RegionReport(list(jobs), float(arrival))
                                               for arrival, jobs in reports]
                     for level, node, reports in saved["held"]}
        self.in_transit = [(float(arrival), job) for arrival, job in saved["in_transit"]]
        self.fired_at = {k: float(v) for k, v in saved["fired_at"].items()}
