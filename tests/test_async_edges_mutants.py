"""Asynchronous edges (fedhier/round/asynchrony/edges.py) driven by the closed-form fake executor of
tests/test_hsgd_mutants.py and a clock whose every time is a round number, so which reports
are taken, their staleness, the drops, the jobs' bookkeeping and the models are worked out by
hand (docs/hsgd.md), written against mutmut's survivors (docs/testing.md, "Mutation
testing"). No training.

The fake: client j trained s steps from w returns w + s * c_j (c = 1, 2, 3, 4), loss j + 1;
rows 1, 1, 2, 4. Two levels: edge 0 = {0, 1}, edge 1 = {2, 3}, periods (1, 2): a job is two
edge rounds of one step. The clock (:data:`CLOCK`): a step takes 1 s times the edge's
slowdown, a model 0.25 s over a client-edge link and 1 s over a link above the edges, no
latency. So an edge round of two clients takes 0.5 + 0.5 + slowdown s; an upload waits for
the link and takes 1 s; the model goes down to m children in m s. The models are those of
the ``shifted-mean`` rule (named in every AsyncEdges here; the other rules' arithmetic:
tests/test_async_rules.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhier.round.asynchrony.edges import BufferedRounds, algorithm_for
from fedhier.round.asynchrony.rules import SHIFTED_MEAN
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.round.clock import TimeModel
from fedhier.round.loop import HierarchicalSGD, HSGDSettings
from fedhier.tree.hierarchy import Hierarchy
from fedhier.tree.mobility import Mobility
from tests.helpers import assert_refused
from tests.test_hsgd_mutants import Fake, Recorder, settings


class Clocked(Fake):
    """The fake executor with 125 kB models: 1 s per model over 1 Mbit/s."""

    def model_bytes(self, params):
        return 125_000


def clock(*slowdown: tuple[int, float]) -> TimeModel:
    return TimeModel(step_seconds=1.0, client_edge_mbps=4.0, client_edge_latency_ms=0.0,
                     edge_cloud_mbps=1.0, edge_cloud_latency_ms=0.0, edge_slowdown=slowdown)


CLOCK = clock((1, 3.0))  # edge 1's steps take 3 s: its jobs take 2 * (1 + 3) = 8 s, edge 0's 4
KEYS = ("async_reports", "stale_dropped", "sim_seconds", "local_train_loss",
        "edge_cloud_messages", "client_edge_messages")


def run(rounds: int, buffer: int = 1, staleness: int = 4, time: TimeModel = CLOCK,
        fake: Fake | None = None, **kw):
    """(algorithm, records as tuples of :data:`KEYS` from round 1, final w)."""
    s = settings(time_model=time,
                 asynchronous=AsyncEdges(buffer, staleness, rule=SHIFTED_MEAN), **kw)
    algo = HierarchicalSGD(s)
    records: list[dict] = []
    final = algo.run(fake or Clocked(), {"w": torch.zeros(1)}, rounds,
                     on_record=records.append)
    return algo, records, float(final["w"][0])


def table(records: list[dict]) -> list[tuple]:
    return [tuple(r[k] for k in KEYS) for r in records[1:]]


def jobs(algo: HierarchicalSGD) -> dict[int, tuple]:
    """edge -> (version, finish, base w, survivors, members) of the jobs in flight."""
    return {e: (j.version, j.finish, float(j.base["w"][0]), j.survivors.tolist(),
                None if j.members is None else j.members.tolist())
            for e, j in algo.rounds.jobs.items()}


# -- the buffer, the staleness and the bookkeeping -------------------------------------------
def test_four_rounds_of_one_report_each_by_hand():
    """K = 1, S = 4. Both edges start at 0 from w = 0: edge 0's clients end at 2.5, 3.5
    (edge model 1.5 between), its job at 4 s; edge 1's at 20/3, 23/3, at 8 s.
    Round 1: edge 0's report arrives at 5 (s = 0): w = 3, down at 6. Edge 0 starts again
    from 3 (version 1), ends at 10 with 5.5, 6.5.
    Round 2: edge 1's report (8 s, arrives at 9), s = 1: its clients' mean 22/3 plus its
    update's shift w - base = 3: 31/3; down at 10. Edge 1 starts from 31/3 (version 2), ends
    at 18 with 31/3 + 20/3 = 17 and 18.
    Round 3: edge 0's (10 s, arrives at 11), s = 2 - 1 = 1: 6 + (31/3 - 3) = 40/3; at 12.
    Round 4: edge 0 again from 40/3 (version 3, ends at 16, arrives at 17), s = 0: 40/3 + 3.
    Losses: round 1 trains both edges (3.125 in both edge rounds), then one edge a round:
    edge 0 (1 + 2) / 2 = 1.5, edge 1 (2*3 + 4*4) / 6 = 11/3. Traffic above the edges: one
    report up, the model down to one edge; below, 8 messages per edge and job."""
    algo, records, final = run(4)
    assert table(records) == [
        ([[0, 0]], 0, 6.0, 3.125, 2, 16),
        ([[1, 1]], 0, 10.0, 1.5, 4, 24),
        ([[0, 1]], 0, 12.0, pytest.approx(11 / 3), 6, 32),
        ([[0, 0]], 0, 18.0, 1.5, 8, 40)]
    assert [r["round"] for r in records] == [0, 1, 2, 3, 4]
    assert final == pytest.approx(49 / 3, abs=1e-5)
    assert algo.rounds.version == 4 and algo.rounds.now == 18.0 and algo.rounds.link_free == 17.0
    assert algo.rounds.idle == {0: 18.0} and algo.rounds.relay_free == {}
    assert jobs(algo) == {1: (2, 18.0, pytest.approx(31 / 3), [2, 3], [2, 3])}
    models = algo.rounds.jobs[1].models
    assert models is not None and models["w"].flatten().tolist() == [17.0, 18.0]
    assert algo.rounds.jobs[1].reference is None
    assert algo.elapsed_seconds() == 18.0
    # the edges' models after their jobs' 1st edge round (the 2nd ends at the cloud): edge
    # 0 from 40/3, edge 1 from 31/3; an idle edge gets the global model when it starts
    assert algo.edge_models["w"].flatten().tolist() == pytest.approx([40 / 3 + 1.5, 14.0],
                                                                     abs=1e-5)


def test_a_report_staler_than_s_is_dropped_and_its_edge_starts_over():
    """S = 0, as above. Round 2: edge 1's report (version 0, arrives at 9) is 1 behind:
    dropped; the model (3) reaches edge 1 at 10 and it starts over (version 1, 8 s: ends at
    18). Edge 0's job (version 1, ends at 10, arrives at 11) is fresh: w = 6, down at 12.
    Round 3: edge 0 from 6 (ends at 16, arrives at 17): 9, at 18. Round 2's losses: both
    batches: (1.5 + 1.5 + 11/3 + 11/3) / 4 = 31/12; the drop costs a message up and down."""
    algo, records, final = run(3, staleness=0)
    assert table(records) == [
        ([[0, 0]], 0, 6.0, 3.125, 2, 16),
        ([[0, 0]], 1, 12.0, pytest.approx(31 / 12), 6, 32),
        ([[0, 0]], 0, 18.0, 1.5, 8, 40)]
    assert final == pytest.approx(9.0, abs=1e-6)
    assert jobs(algo) == {1: (1, 18.0, 3.0, [2, 3], [2, 3])}
    assert algo.rounds.idle == {0: 18.0} and algo.rounds.link_free == 17.0


def test_s_is_the_most_a_report_may_be_behind():
    """S = 1 keeps round 2's report of staleness 1 (as with S = 4)."""
    _, records, final = run(2, staleness=1)
    assert [r["async_reports"] for r in records[1:]] == [[[0, 0]], [[1, 1]]]
    assert records[2]["stale_dropped"] == 0 and final == pytest.approx(31 / 3, abs=1e-5)


def test_reports_ready_together_go_by_edge_and_queue_on_the_link():
    """No slowdown: both jobs end at 4. K = 1: edge 0's is taken (arrives at 5, down at 6),
    edge 1's stays in flight. K = 2: edge 0's arrives at 5, edge 1's queues behind it (6);
    the model goes down to both in 2 s: 8, and w is synchronous H-SGD's 6.25."""
    algo, records, final = run(1, time=clock())
    assert records[1]["async_reports"] == [[0, 0]] and records[1]["sim_seconds"] == 6.0
    assert final == pytest.approx(3.0, abs=1e-6) and sorted(algo.rounds.jobs) == [1]
    algo, records, final = run(1, buffer=2, time=clock())
    assert records[1]["async_reports"] == [[0, 0], [1, 0]]
    assert records[1]["sim_seconds"] == 8.0 and algo.rounds.link_free == 6.0
    assert final == pytest.approx(6.25, abs=1e-6) and algo.rounds.jobs == {}
    assert algo.rounds.idle == {0: 8.0, 1: 8.0}


def test_a_buffer_of_every_edge_is_synchronous_h_sgd():
    """K = N = 2, three rounds: the synchronous run's records (less the async keys) and
    model, simulated time included (edges at 4 and 8 s, uploads arrive at 5 and 9, the
    model is back at 11 s, and so on each round)."""
    algo, records, final = run(3, buffer=2, staleness=0)
    sync_records: list[dict] = []
    sync = HierarchicalSGD(settings(time_model=CLOCK))
    expected = sync.run(Clocked(), {"w": torch.zeros(1)}, 3, on_record=sync_records.append)
    assert final == pytest.approx(float(expected["w"][0]), abs=1e-6)
    assert final == pytest.approx(18.75, abs=1e-5)
    for mine, theirs in zip(records, sync_records, strict=True):
        assert {k: v for k, v in mine.items() if k not in ("async_reports", "stale_dropped")} \
            == theirs
    assert [r["sim_seconds"] for r in records] == [0.0, 11.0, 22.0, 33.0]
    assert all(r["async_reports"] == [[0, 0], [1, 0]] for r in records[1:])


def test_a_job_without_survivors_leaves_the_model_where_it_is():
    """Edge 0's clients always fail: round 1 takes its empty report (the model stays 0, the
    failures are counted: 2 clients per edge round, edge 0 in both); round 2 edge 1's, stale
    by 1: 22/3 + (0 - 0) = 22/3."""
    fake = Clocked(ok=lambda work: work.clients >= 2)
    algo, records, final = run(2, fake=fake)
    assert [r["async_reports"] for r in records[1:]] == [[[0, 0]], [[1, 1]]]
    assert [(r["failed_clients"], r["failed_edges"]) for r in records[1:]] == [(4, 2), (4, 2)]
    assert records[1]["local_train_loss"] == pytest.approx(11 / 3)
    assert final == pytest.approx(22 / 3, abs=1e-5)
    assert algo.rounds.jobs[0].models is None and algo.rounds.jobs[0].survivors.tolist() == []


def test_no_loss_at_all_is_none():
    fake = Clocked(ok=lambda work: np.zeros(len(work.clients), dtype=bool))
    _, records, final = run(1, fake=fake)
    assert records[1]["local_train_loss"] is None and final == 0.0


class Gradients(Clocked):
    """Gradients that pair clients 0, 3 and 1, 2 (not the contiguous 0, 1 and 2, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    def client_gradients(self, params):
        self.asked.append(float(params["w"][0]))
        return torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 1.0], [1.0, 0.1]])


# -- membership and per-edge periods ---------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {"grouping": "random", "regroup_every": 1, "seed": 3},
    {"grouping": "random", "mobility": Mobility(rate=0.5, handoff="carry"), "seed": 1},
    {"grouping": "random", "mobility": Mobility(rate=0.5, handoff="fresh"), "seed": 1},
    {"grouping": "random", "regroup_every": 2, "seed": 2,
     "mobility": Mobility(rate=0.5, reachability=((True, False), (True, True)))},
    {"grouping": "contiguous", "periods": (1, 4), "edge_periods": (1, 2)},
    {"grouping": "gradient", "regroup_every": 1},
    {"grouping": "random", "periods": (1, 4), "seed": 1,
     "mobility": Mobility(trace=((2, 1, 1), (3, 2, 0), (8, 0, 1)), handoff="carry")},
    {"grouping": "contiguous", "periods": (1, 4), "edge_periods": (1, 2),
     "mobility": Mobility(trace=((2, 1, 1), (3, 2, 0), (6, 0, 1)), handoff="fresh")},
    {"grouping": "contiguous", "periods": (1, 4), "edge_periods": (1, 2),
     "mobility": Mobility(trace=((2, 1, 1), (3, 2, 0), (6, 0, 1)), handoff="carry")},
], ids=["regroup", "carry", "fresh", "reachability", "edge-periods", "gradient",
        "four-edge-rounds", "edge-periods-fresh", "edge-periods-carry"])
def test_a_buffer_of_every_edge_regroups_moves_and_counts_as_the_synchronous_run(kw):
    """K = N: regroupings (seed + round - 1), moves with either handoff, reachability and
    per-edge periods as synchronous H-SGD has them: the same records (moves, maps, each
    edge's aggregations) and model, three rounds (the synchronous round is fedhier.round's,
    none of async_edges.py's code)."""
    kw = {"periods": (1, 2), "groups": (2,), "time_model": CLOCK, **kw}
    sync_records: list[dict] = []
    sync = HierarchicalSGD(HSGDSettings(**kw))
    expected = sync.run(Gradients(), {"w": torch.zeros(1)}, 3, on_record=sync_records.append)
    algo = HierarchicalSGD(HSGDSettings(asynchronous=AsyncEdges(2, 0, rule=SHIFTED_MEAN),
                                             **kw))
    records: list[dict] = []
    gradients = Gradients()
    final = algo.run(gradients, {"w": torch.zeros(1)}, 3, on_record=records.append)
    if kw["grouping"] == "gradient":  # asked at set-up, then at each round's global model
        assert gradients.asked == pytest.approx([0.0, 6.25, 12.5], abs=1e-5)
    assert float(final["w"][0]) == pytest.approx(float(expected["w"][0]), abs=1e-6)
    for mine, theirs in zip(records, sync_records, strict=True):
        assert {k: v for k, v in mine.items() if k not in ("async_reports", "stale_dropped")} \
            == theirs
    assert any(key in r for r in records[1:] for key in ("regrouped", "moves",
                                                         "edge_aggregations"))


@pytest.mark.parametrize("handoff,client1", [("carry", 3.5), ("fresh", 17 / 3)])
def test_a_job_in_flight_keeps_a_client_that_moves(handoff, client1):
    """K = 1; the trace moves client 1 to edge 1 in edge round 2 and client 2 to edge 0 in
    edge round 3. Round 1: edge 0 trains {0, 1}, then {0} (2.5, ends at 3.5 s: 0.5 + 1 per
    edge round of one client); edge 1 {2, 3}, then {1, 2, 3} (ends at 2 * (1 + 3) + 0.5 =
    8.5 s), client 1 from edge 0's model 1.5 (carry: 3.5) or edge 1's 11/3 (fresh: 17/3).
    w = 2.5 (at 5.5 s). Round 2: client 2 is still in edge 1's job: edge 0 trains client 0
    alone from 2.5 (4.5, ends at 8.5, before edge 1's by its id): w = 4.5 at 10.5 s.
    Round 3: edge 1's report (s = 2): (client1 + 2 * 20/3 + 4 * 23/3) / 7 + 4.5."""
    algo, records, final = run(3, mobility=Mobility(trace=((2, 1, 1), (3, 2, 0)),
                                                    handoff=handoff))
    assert [(r["moved_clients"], r.get("moves"), r.get("client_to_edge"))
            for r in records[1:]] == [(1, [[2, 1, 0, 1]], [0, 1, 1, 1]),
                                      (1, [[3, 2, 1, 0]], [0, 1, 0, 1]), (0, None, None)]
    assert table(records)[:2] == [([[0, 0]], 0, 5.5, 3.125, 2, 16),
                                  ([[0, 0]], 0, 10.5, 1.0, 4, 20)]
    assert records[3]["async_reports"] == [[1, 2]]
    assert final == pytest.approx((client1 + 44) / 7 + 4.5, abs=1e-5)
    assert algo.hierarchy.edge_of_client().tolist() == [0, 1, 0, 1]
    # edge 0's round-3 job started while edge 1's was in flight: client 2 waits for the next
    assert jobs(algo)[0][3:] == ([0], [0]) and sorted(algo.rounds.idle) == [1]


# -- deeper trees ------------------------------------------------------------------------------
def tree_run(rounds: int, buffer: int, *slowdown: tuple[int, float]):
    """Three levels: 4 edges of one client, regions {0, 1} and {2, 3}, periods (1, 2, 4): a
    job is 4 edge rounds of 1 step (0.5 s + the step), with its batch's region aggregation
    after the 2nd (each child's model up its region's link, 1 s each, down in 2 s)."""
    return run(rounds, buffer, time=clock(*slowdown), periods=(1, 2, 4), groups=(4, 2))


def test_in_three_levels_a_report_goes_through_its_region():
    """Edge 3's steps take 5 s. Round 1 (all from 0): edges 0-2 end their 2nd edge round
    at 3, edge 3 at 11; region 0's aggregate (of 2 and 4: 3) is back at 7, region 1's (of
    6, 8 by rows 2, 4: 22/3) at 14. Jobs end at 10 (edges 0, 1: 5 and 7), 17 (edge 2: 40/3)
    and 25 (edge 3). Edge 0's report reaches region 0 at 11, the cloud at 12: w = 5; down
    through 2 links: 14. Traffic: the region aggregation (4 up, 4 down), 1 up, 1 forwarded,
    2 down.
    Round 2: edge 0 (from 5 at 14) alone: its region aggregation at 17 -> 18, back at 20
    (2 s: region 0 has 2 children), ends at 23. Edge 1's report (10 s) queues behind edge
    0's on region 0's link (free at 11): 12; the cloud at 13: 7 + (5 - 0) = 12, at 15.
    Round 3: edge 1 from 12 at 15 ends at 24; edge 2's report (17 s) reaches region 1 at
    18, the cloud at 19 (its link free at 13); s = 2: 40/3 + 12 = 76/3; at 21."""
    algo, records, final = tree_run(3, 1, (3, 5.0))
    assert table(records) == [
        ([[0, 0]], 0, 14.0, 3.125, 12, 32),
        ([[1, 1]], 0, 15.0, 1.0, 18, 40),
        ([[2, 2]], 0, 21.0, 2.0, 24, 48)]
    assert final == pytest.approx(76 / 3, abs=1e-5)
    assert algo.rounds.relay_free == {"2:0": 12.0, "2:1": 18.0} and algo.rounds.link_free == 19.0
    assert {e: j[:3] for e, j in jobs(algo).items()} == {
        3: (0, 25.0, 0.0), 0: (1, 23.0, 5.0), 1: (2, 24.0, 12.0)}
    assert algo.rounds.idle == {2: 21.0}


def test_in_three_levels_the_earlier_region_goes_first():
    """K = 2; edges 0, 1, 3 are 2, 5, 5 times slower. Edges' 2nd edge rounds end at 5, 11,
    3, 11: both regions' aggregates are back at 14; jobs end at 19, 25, 17, 25. Edge 2's
    report reaches region 1 at 18, edge 0's region 0 at 20: region 1's goes up first (cloud
    at 19), then region 0's (21). Down: 1 s per region, 2 s from the cloud: 24. w: edge 0's
    client 3 + 2 = 5 (rows 1), edge 2's 22/3 + 6 = 40/3 (rows 2): 95/9."""
    algo, records, final = tree_run(1, 2, (0, 2.0), (1, 5.0), (3, 5.0))
    assert table(records) == [([[2, 0], [0, 0]], 0, 24.0, 3.125, 16, 32)]
    assert final == pytest.approx(95 / 9, abs=1e-5)
    assert algo.rounds.link_free == 21.0 and algo.rounds.relay_free == {"2:1": 18.0, "2:0": 20.0}
    assert algo.rounds.idle == {2: 24.0, 0: 24.0}


def test_in_three_levels_reports_of_one_region_go_up_as_one():
    """Edge 3's steps take 5 s, K = 2. Round 1: edges 0 and 1 (jobs end at 10) reach
    region 0 at 11 and 12; one aggregate goes up at 12 (the cloud at 13): w = (5 + 7) / 2
    = 6; down: region 0 sends to 2 children (2 s), the cloud to 1 (1 s): 16.
    Round 2: edges 0, 1 from 6 end at 26; edge 2's (17) and edge 3's (25) reach region 1 at
    18 and 26; the cloud has the aggregate at 27: s = 1 each, (2 * 40/3 + 4 * 46/3) / 6 +
    (6 - 0) = 62/3; down at 30."""
    algo, records, final = tree_run(2, 2, (3, 5.0))
    assert table(records) == [([[0, 0], [1, 0]], 0, 16.0, 3.125, 14, 32),
                              ([[2, 1], [3, 1]], 0, 30.0, 1.5, 24, 48)]
    assert final == pytest.approx(62 / 3, abs=1e-5)
    assert algo.rounds.link_free == 27.0 and algo.rounds.relay_free == {"2:0": 12.0, "2:1": 26.0}
    assert {e: j[:3] for e, j in jobs(algo).items()} == {0: (1, 26.0, 6.0),
                                                         1: (1, 26.0, 6.0)}


# -- checkpoints -------------------------------------------------------------------------------
def test_a_checkpoint_resumes_the_run_where_it_stopped():
    """Two rounds, a checkpoint, two more rounds in a fresh algorithm: the four-round run's
    records, model and jobs; the checkpoint holds the async state by value."""
    algo, _, _ = run(2)
    state = algo.state_dict()
    saved = state["async"]
    assert (saved["version"], saved["idle"], saved["link_free"], saved["now"]) == \
        (2, {1: 10.0}, 9.0, 10.0)
    assert saved["relay_free"] == {} and saved["edge_aggregations"] == []
    assert [job.edge for job in saved["jobs"]] == [0] and "regions" not in saved
    assert saved["edge_models"]["w"].flatten().tolist() == pytest.approx([4.5, 11 / 3])
    algo.rounds.idle[0] = 99.0
    algo.rounds.relay_free["x"] = 1.0
    assert saved["idle"] == {1: 10.0} and saved["relay_free"] == {}

    resumed = HierarchicalSGD(algo.settings)
    resumed.load_state_dict(state)
    fake = Clocked()
    resumed.setup(fake, {"w": torch.tensor([31 / 3])})
    assert resumed.rounds.idle == {1: 10.0} and sorted(resumed.rounds.jobs) == [0]
    assert resumed.rounds.jobs[0].members.tolist() == [0, 1]
    assert resumed.edge_models["w"].flatten().tolist() == pytest.approx([4.5, 11 / 3])
    assert (resumed.rounds.version, resumed.rounds.now, resumed.rounds.link_free) == (2, 10.0, 9.0)
    out3 = resumed.cloud_round(fake, 3)
    out4 = resumed.cloud_round(fake, 4)
    assert [out3["async_reports"], out4["async_reports"]] == [[[0, 1]], [[0, 0]]]
    assert float(resumed.global_params["w"][0]) == pytest.approx(49 / 3, abs=1e-5)
    assert resumed.elapsed_seconds() == 18.0


def test_a_synchronous_checkpoint_is_refused():
    algo = HierarchicalSGD(settings(time_model=CLOCK))
    algo.run(Clocked(), {"w": torch.zeros(1)}, 1)
    assert_refused(lambda: HierarchicalSGD(
        settings(asynchronous=AsyncEdges(1, rule=SHIFTED_MEAN))).load_state_dict(algo.state_dict()),
        "this checkpoint was written by a synchronous run; resume it without async_buffer")


def test_an_old_checkpoint_without_relay_or_members_still_loads():
    """Checkpoints of two levels hold no relay_free; jobs written before membership could
    change hold no members: the edge's clients in the grouping."""
    algo, _, _ = run(1)
    state = algo.state_dict()
    del state["async"]["relay_free"]
    state["async"]["jobs"][0].members = None
    resumed = HierarchicalSGD(algo.settings)
    resumed.load_state_dict(state)
    assert resumed.rounds.relay_free == {}
    resumed.setup(Clocked(), {"w": torch.tensor([3.0])})
    assert resumed.rounds.jobs[1].members.tolist() == [2, 3]


def test_a_checkpoint_without_edge_counts_gives_none():
    """A per-edge-period run's checkpoint written before the counts were kept: an empty
    int64 count (not float, not None)."""
    algo, _, _ = run(1, periods=(1, 4), edge_periods=(1, 2))
    state = algo.state_dict()
    assert state["async"]["edge_aggregations"] == [4, 2]
    del state["async"]["edge_aggregations"]
    resumed = HierarchicalSGD(algo.settings)
    resumed.load_state_dict(state)
    counts = resumed.rounds._edge_periods().aggregations
    assert counts.dtype == np.int64 and counts.tolist() == []


def test_algorithm_for_picks_the_round():
    assert type(algorithm_for(settings())) is HierarchicalSGD
    assert algorithm_for(settings(), cloud_step="step").cloud_step == "step"
    chosen = algorithm_for(settings(asynchronous=AsyncEdges(1, rule=SHIFTED_MEAN)),
                           cloud_step="step")
    assert type(chosen.rounds) is BufferedRounds and chosen.cloud_step == "step"


def test_a_fresh_run_starts_every_edge_idle_at_zero_with_the_initial_model():
    algo = HierarchicalSGD(settings(asynchronous=AsyncEdges(1, rule=SHIFTED_MEAN)))
    rounds = algo.rounds
    assert (rounds.version, rounds.jobs, rounds.idle, rounds.now) == (0, {}, {}, 0.0)
    assert rounds.link_free == -np.inf and rounds.regions is None and rounds.round_maps is None
    algo.setup(Clocked(), {"w": torch.tensor([2.0])})
    assert algo.rounds.idle == {0: 0.0, 1: 0.0}
    assert algo.edge_models["w"].tolist() == [[2.0], [2.0]]


def test_a_clipping_rule_keeps_each_jobs_reference():
    """aggregators clip:100 at the edges: each job keeps its edge's model before its last
    edge round (edge 0: 1.5, edge 1: 11/3); the mean's runs keep none."""
    algo, _, _ = run(1, aggregators=("clip:100", "mean"))
    assert algo.rounds.jobs[1].reference is not None
    assert algo.rounds.jobs[1].reference["w"].tolist() == pytest.approx([11 / 3])


class FirstChild(Recorder):
    """The recording cloud step of tests/test_hsgd_mutants.py, returning its lowest child's
    model + 100 (an async round may hand it edge 1 alone)."""

    def step(self, cloud_round, children, child_weights):
        self.steps.append((cloud_round, sorted(children),
                           [child_weights[c] for c in sorted(children)]))
        return {"w": children[min(children)]["w"] + 100}


def test_a_cloud_step_is_told_each_round_and_given_the_reports_edges():
    """K = 1 with a cloud step (returns its first child's model + 100). Round 1: it is told
    the round, w = 0 and the cloud's 2 children, then given edge 0's report (its clients'
    mean 3, weight 2): 103. Round 2: edge 1's (stale by 1: 22/3 + 103, weight 6 /
    sqrt(2)): + 100."""
    step = FirstChild()
    algo = HierarchicalSGD(
        settings(time_model=CLOCK, asynchronous=AsyncEdges(1, rule=SHIFTED_MEAN)),
        cloud_step=step)
    final = algo.run(Clocked(), {"w": torch.zeros(1)}, 2)
    assert step.begun == [(1, 0.0, 2), (2, pytest.approx(103.0), 2)]
    assert step.steps == [(1, [0], [2.0]), (2, [1], [pytest.approx(6 / 2 ** 0.5)])]
    assert float(final["w"][0]) == pytest.approx(22 / 3 + 203, abs=1e-4)


def test_region_buffers_drop_a_held_report_when_the_round_starts():
    """Regions buffer 2 children (K_2 = 2, K = 1), S = 1; edge 3's steps take 8 s. Round 1:
    edges 0, 1 (jobs end at 10) fire region 0 at 12 (the cloud at 13): w = 6, at 16.
    Round 2: edge 2's report (its job ends at 23) is held at region 1 from 24 (edge 3's
    job ends at 37); edges 0, 1 from 6 end at 26, reach region 0 at 27, 28: w = 12 at 32.
    Round 3 (version 2): edge 2's held report is 2 behind: dropped at the round's start,
    its edge restarts from max(24, 32) = 32 (the model there at 34); edge 3's report (37,
    at region 1 at 38) is dropped on arrival (restart at 38, the model there at 40). Edges
    0, 1 from 12 end at 42, reach region 0 at 43, 44: w = 18 at 48. Losses of round 3:
    the batch of edges 0-2 (weights 1, 1, 2: 9/4 per edge round), then edge 3's (4)."""
    s = settings(time_model=clock((3, 8.0)), periods=(1, 2, 4), groups=(4, 2),
                 asynchronous=AsyncEdges(1, 1, regions=(2,), rule=SHIFTED_MEAN))
    algo = HierarchicalSGD(s)
    records: list[dict] = []
    final = algo.run(Clocked(), {"w": torch.zeros(1)}, 3, on_record=records.append)
    assert table(records) == [([[0, 0], [1, 0]], 0, 16.0, 3.125, 14, 32),
                              ([[0, 0], [1, 0]], 0, 32.0, 1.5, 25, 48),
                              ([[0, 0], [1, 0]], 2, 48.0, 3.125, 44, 80)]
    assert float(final["w"][0]) == pytest.approx(18.0, abs=1e-5)
    # edge 3 restarted at 40 (8.5 s per edge round, its region's aggregation 1 + 2 s): 77;
    # edge 2's new job (from 34, ends at 43) is on its way to region 1 (its link free at 38)
    assert jobs(algo)[3][:2] == (2, 77.0) and sorted(algo.rounds.jobs) == [3]
    assert algo.rounds.regions is not None
    in_transit = algo.rounds.regions.in_transit
    assert [(t, job.edge, job.finish) for t, job in in_transit] == [(44.0, 2, 43.0)]


@pytest.mark.parametrize("stop", [1, 2])
@pytest.mark.parametrize("kw", [
    {"periods": (1, 2, 4), "groups": (4, 2), "time_model": clock((3, 5.0))},
    {"periods": (1, 2, 4), "groups": (4, 2), "time_model": clock((3, 8.0)),
     "asynchronous": AsyncEdges(1, 1, regions=(2,), rule=SHIFTED_MEAN)},
    {"periods": (1, 4), "edge_periods": (1, 2), "time_model": CLOCK},
], ids=["three-levels", "regions", "edge-periods"])
def test_a_run_resumed_from_its_checkpoint_is_the_run(kw, stop):
    """Four rounds straight, or ``stop`` rounds, a checkpoint, and the rest in a fresh
    algorithm from the checkpoint's model: the same records and model (the links' queues,
    the regions' held reports and each edge's aggregation counts carry over)."""
    kw = {"asynchronous": AsyncEdges(1, rule=SHIFTED_MEAN), **kw}
    straight: list[dict] = []
    expected = HierarchicalSGD(settings(**kw)).run(
        Clocked(), {"w": torch.zeros(1)}, 4, on_record=straight.append)
    first = HierarchicalSGD(settings(**kw))
    at_stop = first.run(Clocked(), {"w": torch.zeros(1)}, stop)
    resumed = HierarchicalSGD(settings(**kw))
    resumed.load_state_dict(first.state_dict())
    for name in ("version", "idle", "link_free", "relay_free", "now"):
        assert getattr(resumed.rounds, name) == getattr(first.rounds, name), name
    if (periods := resumed.rounds._edge_periods()) is not None:
        assert periods.aggregations.tolist() == first.rounds._edge_periods().aggregations.tolist()
    records: list[dict] = []
    final = resumed.run(Clocked(), at_stop, 4, first_round=stop + 1, on_record=records.append)
    assert records == straight[stop + 1:]
    assert float(final["w"][0]) == float(expected["w"][0])


def test_in_four_levels_each_node_queues_on_its_own_link():
    """Periods (1, 2, 4, 8) over 4 edges, 2 regions, 2 level-3 nodes (one region each);
    edges 1 and 3 are 5 times slower, K = 2. Edges 0 and 2's reports reach their regions
    at 48 together; each region's goes up its own level-3 node's link (49 both, not one
    after the other), then both up the cloud's shared link (50, 51). Down: 1 s per level
    below the cloud, 2 s from the cloud to its two children: 55."""
    algo, records, _ = run(1, 2, time=clock((1, 5.0), (3, 5.0)), periods=(1, 2, 4, 8),
                           groups=(4, 2, 2))
    assert records[1]["async_reports"] == [[0, 0], [2, 0]]
    assert records[1]["sim_seconds"] == 55.0 and algo.rounds.link_free == 51.0
    assert algo.rounds.relay_free == {"2:0": 48.0, "2:1": 48.0, "3:0": 49.0, "3:1": 49.0}


def test_drops_in_one_round_add_up():
    """Four edges of one client (c = 1..4), K = 1, S = 0; edges 2, 3 take 3 s a step (their
    jobs 7 s, the others' 3 s). Round 1: edge 0 (tie with edge 1, by id) arrives at 4: w = 2,
    at 5. Round 2: edge 0 restarts (ends at 8); edge 1's old report (arrives at 5), edge
    2's (8) and edge 3's (9) are dropped in turn, each edge restarting as the model reaches
    it; edge 0's arrives at 10: w = 4 at 11. Losses: the four one-client batches, 1..4."""
    algo, records, final = run(2, 1, 0, time=clock((2, 3.0), (3, 3.0)), groups=(4,))
    assert table(records) == [([[0, 0]], 0, 5.0, 3.125, 2, 16),
                              ([[0, 0]], 3, 11.0, 2.5, 10, 32)]
    assert final == pytest.approx(4.0, abs=1e-6)
    assert {e: j[:3] for e, j in jobs(algo).items()} == {1: (1, 9.0, 2.0), 2: (1, 16.0, 2.0),
                                                         3: (1, 17.0, 2.0)}


def test_failures_of_every_batch_in_a_round_add_up():
    """As above with client 1 failing: round 2 trains four one-client batches; edge 1's
    (the second) loses its client in both edge rounds, the later batches none."""
    fake = Clocked(ok=lambda work: work.clients != 1)
    _, records, _ = run(2, 1, 0, time=clock((2, 3.0), (3, 3.0)), groups=(4,), fake=fake)
    assert [(r["failed_clients"], r["failed_edges"], r["stale_dropped"])
            for r in records[1:]] == [(2, 2, 0), (2, 2, 3)]


def test_jobs_train_the_edge_rounds_of_the_next_cloud_round():
    """A job from version v trains cloud round v + 1's edge rounds (2v + 1, 2v + 2), in two
    levels and in three (where the batch's aggregations above the edges are its own)."""
    fake = Clocked()
    run(4, fake=fake)
    assert [(w.cloud_round, w.edge_round, w.clients.tolist()) for w, _ in fake.calls] == [
        (1, 1, [0, 1, 2, 3]), (1, 2, [0, 1, 2, 3]), (2, 3, [0, 1]), (2, 4, [0, 1]),
        (3, 5, [2, 3]), (3, 6, [2, 3]), (4, 7, [0, 1]), (4, 8, [0, 1])]
    fake = Clocked()
    run(2, time=clock((3, 5.0)), periods=(1, 2, 4), groups=(4, 2), fake=fake)
    assert [(w.cloud_round, w.edge_round) for w, _ in fake.calls][4:] == [
        (2, 5), (2, 6), (2, 7), (2, 8)]


def test_setup_takes_the_given_tree_and_profiles_and_copies_the_model_per_edge():
    tree = Hierarchy((1, 2), (np.array([1, 0, 0, 1], dtype=np.int64),))
    fake = Clocked()
    info = fake.profiles()
    algo = HierarchicalSGD(settings(asynchronous=AsyncEdges(1, rule=SHIFTED_MEAN)))
    algo.setup(fake, {"w": torch.tensor([2.0, 3.0])}, info=info, hierarchy=tree)
    assert algo.hierarchy is tree and algo.info is info
    assert algo.edge_models["w"].tolist() == [[2.0, 3.0], [2.0, 3.0]]


def test_a_rule_above_the_edges_reads_the_nodes_models():
    """clip at the cloud (radius 100: nothing clipped) measures from the cloud's model:
    the numbers of the mean, rounds 1-2 of the four-round run."""
    _, records, final = run(2, aggregators=("mean", "clip:100"))
    assert [r["async_reports"] for r in records[1:]] == [[[0, 0]], [[1, 1]]]
    assert final == pytest.approx(31 / 3, abs=1e-5)
