"""Tests written against the survivors of `python scripts/mutation.py async_regions`
(docs/testing.md, "Mutation testing"): the region buffers driven by a stand-in round whose
clock is closed-form (an edge report arrives at its region 1 s after its job finishes, a
region's report 2 s after it is ready), with every arrival order, firing, drop and call
worked out by hand in the docstrings. No training."""

from dataclasses import dataclass

import numpy as np
import pytest

from fedhier.round.asynchrony.regions import (
    RegionBuffers,
    RegionReport,
    check_tree,
    children,
    parent_of,
    region_buffers,
)
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import assert_refused

#: 4 edges (two clients each) under regions 0 = {0, 1} and 1 = {2, 3}, under the cloud
THREE = Hierarchy(periods=(1, 2, 4), parents=(np.array([0, 0, 1, 1, 2, 2, 3, 3]),
                                               np.array([0, 0, 1, 1])))
#: 4 edges under level-2 nodes {0, 1}, {2, 3}; level-3 node 0 above level-2 node 0, 1 above 1
FOUR = Hierarchy(periods=(1, 2, 4, 8), parents=(np.arange(4), np.array([0, 0, 1, 1]),
                                                np.array([0, 1])))
FINISH = {0: 5.0, 1: 3.0, 2: 4.0, 3: 9.0}  # when each edge's job ends (s)
DURATION = {0: 1.0, 1: 10.0, 2: 1.0, 3: 4.0}  # a restarted job's length (s)


@dataclass(eq=False)
class Job:
    edge: int
    version: int
    finish: float
    base: object = None
    models: object = None
    survivors: object = None
    members: object = None
    reference: object = None


class Round:
    """The part of BufferedRounds the buffers call, logging each call in order."""

    def __init__(self, tree: Hierarchy, version: int, jobs: list[Job]) -> None:
        self.tree, self.version = tree, version
        self.jobs = {job.edge: job for job in jobs}
        self.idle: dict[int, float] = {}
        self.communication = self
        self.model_bytes = 100
        self.log: list[tuple] = []

    def _hierarchy(self) -> Hierarchy:
        return self.tree

    def _start_jobs(self, executor, stats) -> None:
        self.log.append(("start", sorted(self.idle), executor, stats))
        for edge, when in sorted(self.idle.items()):
            self.jobs[edge] = Job(edge, self.version, when + DURATION[edge])
        self.idle.clear()

    def _send_up(self, job: Job, count: bool = True) -> float:
        self.log.append(("up", job.edge, count))
        return job.finish + 1.0

    def _queue_on(self, level: int, node: int, ready: float, count: bool = True) -> float:
        self.log.append(("queue", level, node, ready, count))
        return ready + 2.0

    def _restart(self, edge: int, when: float) -> None:
        self.log.append(("restart", edge, when))
        self.idle[edge] = when

    def add_edge_cloud(self, count: int, nbytes: int) -> None:
        self.log.append(("traffic", count, nbytes))


def _jobs(versions: dict[int, int]) -> list[Job]:
    return [Job(edge, version, FINISH[edge]) for edge, version in versions.items()]


def _buffers(regions: tuple[int, ...], buffer: int, staleness: int = 4) -> RegionBuffers:
    return RegionBuffers(AsyncEdges(buffer=buffer, max_staleness=staleness, regions=regions))


def _collect(buffers, rnd, now=0.0):
    return buffers.collect(rnd, "executor", {"stats": 1}, now)


def test_the_first_arrival_fires_its_region_and_reaches_the_cloud():
    """K_2 = 1, K = 1. Jobs end at 5, 3, 4, 9 s, so edge 1's report is sent up (arrives at 4)
    and edge 2's (its job ends at 4 <= 4, arrives at 5); edge 0's ends at 5 > 4, so edge 1's
    arrives first: region 0 fires at 4, its report reaches the cloud at 6. Edge 2's report is
    still on its way, edges 0 and 3 still train."""
    rnd = Round(THREE, 0, _jobs({0: 0, 1: 0, 2: 0, 3: 0}))
    jobs = dict(rnd.jobs)
    buffers = _buffers((1,), 1)
    accepted, done, dropped = _collect(buffers, rnd)
    assert accepted == [(jobs[1], 0)] and done == 6.0 and dropped == 0
    assert rnd.log == [("up", 1, False), ("up", 2, False), ("traffic", 1, 100),
                       ("queue", 3, 0, 4.0, True)]
    assert buffers.in_transit == [(5.0, jobs[2])]
    assert sorted(rnd.jobs) == [0, 3]
    assert buffers.held == {(2, 0): []}
    assert buffers.fired_at == {"2:0": 6.0}
    assert buffers.pending() == [jobs[2]]


@pytest.mark.parametrize("regions", [(2,), (0,)])  # K_2 = 2 children, or 0 = all of them
def test_a_region_fires_at_its_kth_arrival_and_the_cloud_waits_for_every_region(regions):
    """K_2 = 2, K = 0 (both regions). Arrivals: edge 1 at 4, edge 2 at 5, edge 0 at 6 (sent
    once edge 2's report is on its way: 5 <= 5), edge 3 at 10 (sent once nothing else is on
    its way). Region 0 fires at its 2nd arrival (6, at the cloud 8), region 1 at 10 (12).
    Version 2; jobs of versions 2, 1, 2, 0: staleness 0, 1, 0, 2 (S = 4 keeps them)."""
    rnd = Round(THREE, 2, _jobs({0: 2, 1: 1, 2: 2, 3: 0}))
    jobs = dict(rnd.jobs)
    buffers = _buffers(regions, 0)
    accepted, done, dropped = _collect(buffers, rnd)
    assert accepted == [(jobs[1], 1), (jobs[0], 0), (jobs[2], 0), (jobs[3], 2)]
    assert done == 12.0 and dropped == 0
    traffic = ("traffic", 1, 100)
    assert rnd.log == [("up", 1, False), ("up", 2, False), traffic, ("up", 0, False),
                       traffic, traffic, ("queue", 3, 0, 6.0, True), ("up", 3, False),
                       traffic, ("queue", 3, 0, 10.0, True)]
    assert buffers.fired_at == {"2:0": 12.0, "2:1": 12.0}
    assert buffers.in_transit == [] and rnd.jobs == {}
    assert buffers.held == {(2, 0): [], (2, 1): []}


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_report_more_than_s_behind_is_dropped_on_arrival_and_its_edge_starts_over(staleness):
    """Version 3, edge 1's job of version 1 (s = 2). S = 1: dropped when it arrives (4 s),
    edge 1 gets the model at 4 and starts a job ending at 14; edge 0's report goes up (5 <=
    5, arrives at 6), edge 2's arrives at 5 and fires region 1 (cloud at 7). S = 2: kept,
    region 0 fires at 4 (cloud at 6)."""
    rnd = Round(THREE, 3, _jobs({0: 3, 1: 1, 2: 3, 3: 3}))
    jobs = dict(rnd.jobs)
    buffers = _buffers((1,), 1, staleness)
    accepted, done, dropped = _collect(buffers, rnd)
    if staleness == 2:
        assert (accepted, done, dropped) == ([(jobs[1], 2)], 6.0, 0)
        return
    assert accepted == [(jobs[2], 0)] and done == 7.0 and dropped == 1
    assert rnd.log == [("up", 1, False), ("up", 2, False), ("traffic", 1, 100),
                       ("restart", 1, 4.0), ("start", [1], "executor", {"stats": 1}),
                       ("up", 0, False), ("traffic", 1, 100), ("queue", 3, 0, 5.0, True)]
    assert buffers.in_transit == [(6.0, jobs[0])]
    assert sorted(rnd.jobs) == [1, 3]
    assert (rnd.jobs[1].version, rnd.jobs[1].finish) == (3, 14.0)
    assert buffers.fired_at == {"2:1": 7.0}


def test_a_held_report_gone_stale_is_dropped_when_the_round_starts():
    """Edge 3's report (version 0) waits at region 1 since 1 s; version 2, S = 1: dropped at
    the round's start, edge 3 restarts at now = 5 (later than its arrival) with a job ending
    at 9; then as in the first test, edge 1's report reaches the cloud at 6."""
    rnd = Round(THREE, 2, _jobs({0: 2, 1: 2, 2: 2}))
    jobs = dict(rnd.jobs)
    buffers = _buffers((1,), 1, 1)
    buffers.held = {(2, 1): [RegionReport([Job(3, 0, 0.0)], 1.0)]}
    accepted, done, dropped = _collect(buffers, rnd, now=5.0)
    assert (accepted, done, dropped) == ([(jobs[1], 0)], 6.0, 1)
    assert rnd.log[:3] == [("restart", 3, 5.0), ("start", [3], "executor", {"stats": 1}),
                           ("up", 1, False)]
    assert rnd.jobs[3].finish == 9.0
    assert buffers.held[(2, 1)] == []


def test_drops_held_and_on_arrival_add_up_and_reports_arriving_together_go_by_edge():
    """Version 3, S = 1. Edge 3's held report (version 0, arrived at 1) is dropped at the
    start (restart at 1, new job ending at 5); edge 1's job (version 1) ends at 3, arrives at
    4 and is dropped too (restart at 4, new job ending at 14). Edges 0 and 3 then end at 5
    and both arrive at 6: edge 0's is taken first and fires region 0 (cloud at 8)."""
    rnd = Round(THREE, 3, _jobs({0: 3, 1: 1}))
    jobs = dict(rnd.jobs)
    buffers = _buffers((1,), 1, 1)
    buffers.held = {(2, 1): [RegionReport([Job(3, 0, 0.0)], 1.0)]}
    accepted, done, dropped = _collect(buffers, rnd)
    assert (accepted, done, dropped) == ([(jobs[0], 0)], 8.0, 2)
    start = ("start", [3], "executor", {"stats": 1})
    assert rnd.log == [("restart", 3, 1.0), start, ("up", 1, False), ("traffic", 1, 100),
                       ("restart", 1, 4.0), ("start", [1], "executor", {"stats": 1}),
                       ("up", 0, False), ("up", 3, False), ("traffic", 1, 100),
                       ("queue", 3, 0, 6.0, True)]
    assert [(t, job.edge) for t, job in buffers.in_transit] == [(6.0, 3)]


def test_dropping_held_reports_keeps_those_within_s_and_those_above_the_edges_parents():
    """Version 3, S = 2: at level 2, edge 0's (s = 3, arrived at 2) and edge 2's (s = 3,
    arrived at 8) are dropped, restarting at max(arrival, now = 5) = 5 and 8; edge 1's (s = 2)
    stays; a level-3 report (s = 3) is inside a region's report and is never dropped."""
    rnd = Round(FOUR, 3, [])
    buffers = _buffers((1, 1), 1, 2)
    j0, j1, j2, j3 = Job(0, 0, 0.0), Job(1, 1, 0.0), Job(2, 0, 0.0), Job(3, 0, 0.0)
    r1, r3 = RegionReport([j1], 3.0), RegionReport([j3], 1.0)
    buffers.held = {(3, 0): [r3], (2, 0): [RegionReport([j0], 2.0), r1],
                    (2, 1): [RegionReport([j2], 8.0)]}
    assert buffers._drop_held(rnd, 5.0) == 2
    assert rnd.log == [("restart", 0, 5.0), ("restart", 2, 8.0)]
    assert buffers.held == {(3, 0): [r3], (2, 0): [r1], (2, 1): []}


def test_a_region_sends_its_earliest_arrivals_no_earlier_than_its_last_aggregation():
    """Held at region 0: edge 0's report (arrived at 7) and edge 1's (at 3); the cloud took
    region 0's last report at 5. K_2 = 1: edge 1's goes up, ready at max(3, 5) = 5."""
    rnd = Round(THREE, 1, [])
    buffers = _buffers((1,), 1)
    j0, j1 = Job(0, 1, 0.0), Job(1, 0, 0.0)
    late = RegionReport([j0], 7.0)
    buffers.held = {(2, 0): [late, RegionReport([j1], 3.0)]}
    buffers.fired_at = {"2:0": 5.0, "2:1": 99.0}
    accepted, done, dropped = _collect(buffers, rnd)
    assert (accepted, done, dropped) == ([(j1, 1)], 7.0, 0)
    assert rnd.log == [("queue", 3, 0, 5.0, True)]
    assert buffers.held == {(2, 0): [late]}
    assert buffers.fired_at == {"2:0": 7.0, "2:1": 99.0}


@pytest.mark.parametrize("arrivals,fires", [((4.0, 4.0), 0), ((6.0, 4.0), 1), ((4.0, 6.0), 0)])
def test_regions_ready_together_fire_by_time_then_id(arrivals, fires):
    """Regions 0 and 1 each hold one report; the cloud needs one: the earlier, ties by id."""
    rnd = Round(THREE, 0, [])
    buffers = _buffers((1,), 1)
    reports = [RegionReport([Job(2 * r, 0, 0.0)], arrivals[r]) for r in (0, 1)]
    buffers.held = {(2, 1): [reports[1]], (2, 0): [reports[0]]}
    accepted, done, _ = _collect(buffers, rnd)
    assert accepted == [(reports[fires].jobs[0], 0)] and done == arrivals[fires] + 2.0
    assert rnd.log == [("queue", 3, 0, arrivals[fires], True)]  # into the cloud
    assert buffers.held[(2, 1 - fires)] == [reports[1 - fires]]


def test_in_four_levels_a_lower_node_ready_together_fires_first():
    """Level-3 node 0 and level-2 node 1 each hold a report from 4 s; K_2 = K_3 = K = 1.
    Level 2 first: node 1's report goes to level-3 node 1 (arrives at 6); then level-3 node
    0 (ready 4) beats level-3 node 1 (ready 6) and reaches the cloud at 6."""
    rnd = Round(FOUR, 0, [])
    buffers = _buffers((1, 1), 1)
    j0, j2 = Job(0, 0, 0.0), Job(2, 0, 0.0)
    buffers.held = {(3, 0): [RegionReport([j0], 4.0)], (2, 1): [RegionReport([j2], 4.0)]}
    accepted, done, _ = _collect(buffers, rnd)
    assert accepted == [(j0, 0)] and done == 6.0
    assert rnd.log == [("queue", 3, 1, 4.0, True), ("queue", 4, 0, 4.0, True)]
    assert buffers.held[(3, 1)][0].jobs == [j2] and buffers.held[(3, 1)][0].arrival == 6.0
    assert buffers.fired_at == {"2:1": 6.0, "3:0": 6.0}


def test_a_region_report_carries_its_edge_reports_up_two_levels():
    """K_2 = 2, K_3 = 1: level-2 node 0 fires at its 2nd arrival (2 s; at level-3 node 0 at
    4), which fires at once (at the cloud at 6) with both edge reports, s = 1 and 0."""
    rnd = Round(FOUR, 1, [])
    buffers = _buffers((2, 1), 1)
    j0, j1 = Job(0, 0, 0.0), Job(1, 1, 0.0)
    buffers.held = {(2, 0): [RegionReport([j0], 1.0), RegionReport([j1], 2.0)]}
    accepted, done, _ = _collect(buffers, rnd)
    assert accepted == [(j0, 1), (j1, 0)] and done == 6.0
    assert rnd.log == [("queue", 3, 0, 2.0, True), ("queue", 4, 0, 4.0, True)]
    assert buffers.fired_at == {"2:0": 6.0, "3:0": 6.0}


def test_a_cloud_with_nothing_coming_is_an_error_not_a_hang():
    assert_refused(lambda: _collect(_buffers((1,), 1), Round(THREE, 0, [])),
                   "asynchronous regions: the cloud waits for reports that never come",
                   RuntimeError)


def test_the_tree_helpers():
    tree = Hierarchy(periods=(1, 2, 4, 8), parents=(np.arange(5), np.array([0, 0, 0, 1, 1]),
                                                    np.array([0, 0])))
    assert children(tree, 2).tolist() == [3, 2] and children(tree, 3).tolist() == [2]
    assert [parent_of(tree, 2, n) for n in (0, 1)] == [0, 0]
    assert parent_of(tree, 1, 4) == 1 and parent_of(tree, 3, 0) == 0
    assert [parent_of(FOUR, 2, n) for n in (0, 1)] == [0, 1]


# edges {0, 1, 2} under region 0 and {3, 4} under region 1
TREE = Hierarchy(periods=(1, 2, 4), parents=(np.arange(5), np.array([0, 0, 0, 1, 1])))


@pytest.mark.parametrize("tree,regions,buffer,message", [
    (TREE, (1, 1), 0, "region_buffer takes one K per level between the edges and the cloud: "
     "1 for this tree, got 2"),
    (TREE, (), 0, "region_buffer takes one K per level between the edges and the cloud: "
     "1 for this tree, got 0"),
    (TREE, (3,), 0, "region_buffer K=3 at level 2 is more than the 2 children of node 1; "
     "it would wait for reports that never come"),
    (FOUR, (1, 2), 0, "region_buffer K=2 at level 3 is more than the 1 children of node 0; "
     "it would wait for reports that never come"),
    (TREE, (2,), 3, "async_buffer K=3 is more than the cloud's 2 children"),
])
def test_check_tree_refuses_what_no_run_could_honour(tree, regions, buffer, message):
    assert_refused(lambda: check_tree(AsyncEdges(buffer=buffer, regions=regions), tree),
                   message)


def test_check_tree_takes_the_bounds_themselves():
    check_tree(AsyncEdges(buffer=2, regions=(2,)), TREE)
    check_tree(AsyncEdges(buffer=2, regions=(2, 1)), FOUR)


def test_region_buffers_only_when_regions_are_asked_for():
    assert region_buffers(AsyncEdges(buffer=2)) is None
    settings = AsyncEdges(buffer=0, regions=(1,))
    buffers = region_buffers(settings)
    assert isinstance(buffers, RegionBuffers) and buffers.asynchronous is settings
    assert (buffers.held, buffers.in_transit, buffers.fired_at) == ({}, [], {})


def test_pending_lists_reports_on_their_way_then_those_held():
    buffers = _buffers((1,), 1)
    j0, j1, j2, j3 = (Job(e, 0, 0.0) for e in range(4))
    buffers.in_transit = [(1.0, j3), (2.0, j1)]
    buffers.held = {(2, 0): [RegionReport([j0, j2], 1.0)], (2, 1): []}
    assert buffers.pending() == [j3, j1, j0, j2]


def test_a_checkpoint_holds_the_reports_and_restores_them():
    """state_dict: non-empty holdings sorted by (level, node), [arrival, jobs] each; what is
    on its way; the last aggregations. load_state_dict turns the saved numbers back into
    ints and floats and the job lists into lists."""
    buffers = _buffers((1,), 1)
    j0, j1, j2, j3 = (Job(e, 0, 0.0) for e in range(4))
    buffers.held = {(2, 1): [RegionReport([j2], 5.0)], (3, 0): [],
                    (2, 0): [RegionReport([j0, j1], 3.0)]}
    buffers.in_transit = [(4.0, j3)]
    buffers.fired_at = {"2:0": 6.0}
    state = buffers.state_dict()
    assert state == {"held": [[2, 0, [[3.0, [j0, j1]]]], [2, 1, [[5.0, [j2]]]]],
                     "in_transit": [[4.0, j3]], "fired_at": {"2:0": 6.0}}
    buffers.fired_at["2:1"] = 1.0
    assert state["fired_at"] == {"2:0": 6.0}

    restored = _buffers((1,), 1)
    restored.load_state_dict({"held": [[np.int64(2), np.int64(0), [[np.int64(3), (j0, j1)]]],
                                       [2.0, 1.0, [[5, [j2]]]]],
                              "in_transit": [[np.int64(4), j3]],
                              "fired_at": {"2:0": np.int64(6)}})
    assert list(restored.held) == [(2, 0), (2, 1)]
    assert all(type(k) is int for key in restored.held for k in key)
    assert [(r.jobs, r.arrival) for r in restored.held[(2, 0)]] == [([j0, j1], 3.0)]
    assert [(r.jobs, r.arrival) for r in restored.held[(2, 1)]] == [([j2], 5.0)]
    assert type(restored.held[(2, 0)][0].jobs) is list
    assert type(restored.held[(2, 0)][0].arrival) is float
    assert restored.in_transit == [(4.0, j3)] and type(restored.in_transit[0][0]) is float
    assert restored.fired_at == {"2:0": 6.0} and type(restored.fired_at["2:0"]) is float
    assert restored.state_dict() == state


def test_a_checkpoint_without_region_buffers_is_refused():
    assert_refused(lambda: _buffers((1,), 1).load_state_dict(None),
                   "this checkpoint was written without region_buffer; resume it with the "
                   "settings it was written with")


def test_an_idle_edge_starts_before_the_next_arrival_is_taken():
    """Edge 0 waits idle since 2 s: it starts a job ending at 3 (arriving at 4); edge 2's
    job ends at 4 (<= 4: sent too, arriving at 5): edge 0's fires region 0 at 4, at the cloud
    at 6."""
    rnd = Round(THREE, 1, [Job(2, 1, 4.0)])
    rnd.idle = {0: 2.0}
    buffers = _buffers((1,), 1)
    accepted, done, _ = _collect(buffers, rnd)
    assert [(j.edge, s) for j, s in accepted] == [(0, 0)] and done == 6.0
    assert rnd.log == [("start", [0], "executor", {"stats": 1}), ("up", 0, False),
                       ("up", 2, False), ("traffic", 1, 100), ("queue", 3, 0, 4.0, True)]
