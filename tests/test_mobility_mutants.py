"""fedhier/tree/mobility.py, value by value: the mutants `make mutation` left alive.

The Markov maps against a second implementation written from the module docstring (the
documented draws of ``generator(seed, "mobility", cloud round, client)``), traced maps and
file checks against hand-worked values and exact messages.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedhier.common.errors import ConfigError
from fedhier.common.rng import generator
from fedhier.tree.mobility import (
    HANDOFFS,
    Mobility,
    parse_handoff,
    read_reachability,
    read_trace,
)
from tests.helpers import assert_refused as refused


def test_handoffs():
    assert HANDOFFS == ("fresh", "carry", "fresh:random", "fresh:min-divergence",
                        "carry:random", "carry:min-divergence")
    assert parse_handoff("fresh") == ("fresh", "random")
    assert parse_handoff("carry:min-divergence") == ("carry", "min-divergence")
    assert parse_handoff("carry:random") == ("carry", "random")
    refused(lambda: parse_handoff("keep:random"),
             "unknown handoff 'keep' in 'keep:random'; choose one of fresh, carry, optionally "
             "followed by :ADMISSION (random, min-divergence)")
    refused(lambda: parse_handoff("fresh:best"),
             "unknown admission 'best' in handoff 'fresh:best'; choose one of random, "
             "min-divergence")


def test_active_and_reaches():
    assert not Mobility().active
    assert Mobility(rate=0.1).active and Mobility(trace=((1, 0, 0),)).active
    everywhere = Mobility().reaches(3)
    assert everywhere.dtype == bool
    assert everywhere.tolist() == [[False, True, True], [True, False, True], [True, True, False]]
    given = ((True, True, False), (False, True, True), (True, False, False))
    assert Mobility(reachability=given).reaches(3).tolist() == \
        [[False, True, False], [False, False, True], [True, False, False]]
    as_ints = Mobility(reachability=((0, 1), (1, 1))).reaches(2)  # 0/1 ints, not bools
    assert as_ints.dtype == bool and as_ints.tolist() == [[False, True], [True, False]]


def _documented_maps(seed, cloud_round, edge_rounds, start, num_edges, rate, reach):
    """The module docstring's Markov model with the ``random`` admission, written afresh."""
    maps = np.tile(np.asarray(start), (edge_rounds, 1))
    for client, edge in enumerate(start):
        draw = generator(seed, "mobility", cloud_round, client)
        moved, when, which = draw.random(), int(draw.integers(1, edge_rounds + 1)), draw.random()
        options = [e for e in range(num_edges) if e != edge and (reach is None or reach[edge][e])]
        if moved < rate and options:
            maps[when - 1:, client] = options[int(which * len(options))]
    return maps


@pytest.mark.parametrize("rate, reach", [
    (0.5, None),
    (1.0, None),
    (0.6, ((False, True, False, False), (False, False, True, False),
           (False, False, False, False), (True, True, True, False))),  # edge 2 reaches none
])
def test_markov_maps_are_the_documented_draws(rate, reach):
    model = Mobility(rate=rate, reachability=reach)
    start = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1])
    moves = 0
    for cloud_round in (1, 2):
        maps = model.maps(9, cloud_round, 3, start, 4)
        assert maps.dtype == np.int64 and maps.shape == (3, 12)
        expected = _documented_maps(9, cloud_round, 3, start, 4, rate, reach)
        assert maps.tolist() == expected.tolist()
        moves += int((maps[-1] != start).sum())
        start = maps[-1]
    assert 0 < moves < 24 or rate == 1.0
    if rate == 1.0:
        assert moves == 24  # every client moves in each cloud round


def _u(edge_hist: np.ndarray) -> float:
    """Σ_i P_i ||π_i − π||² of edge label histograms [N, C] (an empty edge adds nothing)."""
    rows = edge_hist.sum(1)
    pi = edge_hist.sum(0) / rows.sum()
    return float(sum(r / rows.sum() * np.sum((h / r - pi) ** 2)
                     for h, r in zip(edge_hist, rows, strict=True) if r > 0))


def _documented_min_divergence_maps(seed, cloud_round, edge_rounds, start, num_edges, rate,
                                    histograms):
    """Markov moves admitted in (edge round, client) order, each to the option whose
    admission leaves the label upward divergence lowest (ties: the move's draw)."""
    maps = np.tile(np.asarray(start), (edge_rounds, 1))
    moves = []
    for client, edge in enumerate(start):
        draw = generator(seed, "mobility", cloud_round, client)
        moved, when, which = draw.random(), int(draw.integers(1, edge_rounds + 1)), draw.random()
        if moved < rate:
            moves.append((when, client, which, [e for e in range(num_edges) if e != edge]))
    for when, client, which, options in sorted(moves):
        current = maps[when - 1]
        scores = []
        for option in options:
            placed = current.copy()
            placed[client] = option
            edge_hist = np.zeros((num_edges, histograms.shape[1]))
            np.add.at(edge_hist, placed, histograms)
            scores.append(_u(edge_hist))
        best = min(scores)
        tied = [o for o, u in zip(options, scores, strict=True)
                if u <= best + 1e-12 * max(max(scores), 1e-300)]
        maps[when - 1:, client] = tied[int(which * len(tied))]
    return maps


def test_markov_min_divergence_maps_are_the_documented_admissions():
    rng = np.random.default_rng(5)  # fixed data
    histograms = rng.integers(0, 6, size=(10, 3))
    histograms[:, 0] += 1  # every client holds rows
    model = Mobility(rate=0.7, admission="min-divergence")
    start = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1], dtype=np.int32)
    current = start
    for cloud_round in (1, 2, 3):
        maps = model.maps(2, cloud_round, 3, current, 4, histograms)
        assert maps.dtype == np.int64
        expected = _documented_min_divergence_maps(2, cloud_round, 3, current, 4, 0.7,
                                                   histograms)
        assert maps.tolist() == expected.tolist()
        current = maps[-1]
    # the map in force in edge round 8 (cloud round 3, its 2nd edge round), from scratch
    assert model.edge_of_client(8, start, 2, 3, 4, histograms).tolist() == \
        model.maps(2, 3, 3, model.edge_of_client(6, start, 2, 3, 4, histograms), 4,
                   histograms)[1].tolist()


def test_markov_edge_of_client_composes_the_cloud_rounds():
    model = Mobility(rate=0.5)
    start = np.array([0, 1, 2, 0, 1, 2], dtype=np.int32)
    current, by_round = start, {}
    for cloud_round in (1, 2, 3):
        maps = model.maps(4, cloud_round, 2, current, 3)
        by_round[2 * cloud_round - 1], by_round[2 * cloud_round] = maps[0], maps[1]
        current = maps[-1]
    for edge_round, expected in by_round.items():
        got = model.edge_of_client(edge_round, start, 4, 2, 3)
        assert got.tolist() == expected.tolist() and got.dtype == np.int64
    assert not all(by_round[k].tolist() == start.tolist() for k in by_round)  # clients moved
    before = model.edge_of_client(0, start, 4, 2, 3)  # before the first edge round: the start
    assert before.tolist() == start.tolist() and before.dtype == np.int64


# clients 0..3 at edges 0, 1, 2, 0; 4 edge rounds per cloud round (rounds 1: 1..4, 2: 5..8)
START = np.array([0, 1, 2, 0])
TRACE = ((2, 0, 2), (5, 1, 0), (8, 3, 1))


def test_traced_maps_by_hand():
    model = Mobility(trace=TRACE)
    first = model.maps(0, 1, 4, START, 3)
    assert first.tolist() == [[0, 1, 2, 0], [2, 1, 2, 0], [2, 1, 2, 0], [2, 1, 2, 0]]
    second = model.maps(0, 2, 4, first[-1], 3)
    assert second.tolist() == [[2, 0, 2, 0], [2, 0, 2, 0], [2, 0, 2, 0], [2, 0, 2, 1]]
    assert model.maps(0, 3, 4, second[-1], 3).tolist() == [[2, 0, 2, 1]] * 4
    by_round = {k: model.edge_of_client(k, START, 0, 4, 3).tolist() for k in (1, 2, 4, 5, 7, 8, 9)}
    assert by_round == {1: [0, 1, 2, 0], 2: [2, 1, 2, 0], 4: [2, 1, 2, 0], 5: [2, 0, 2, 0],
                        7: [2, 0, 2, 0], 8: [2, 0, 2, 1], 9: [2, 0, 2, 1]}
    assert model.edge_of_client(6, START, 0, 4, 3).dtype == np.int64


def test_traced_move_candidates_under_min_divergence():
    # client 3 (labels [0, 2]) is traced to edge 1, which reaches edge 0. Others: edge 0
    # [2, 0], edge 1 [0, 2], edge 2 [2, 0]. At edge 0: U = 2/8 * 0.5 + 2/8 * 0.5 = 0.25; at
    # edge 1: U = (2 + 4 + 2) / 8 * 0.5 = 0.5. min-divergence takes edge 0, random the trace's.
    histograms = np.array([[2, 0], [0, 2], [2, 0], [0, 2]])
    reach = ((False, False, False), (True, False, False), (True, False, False))
    start = np.array([0, 1, 2, 2])
    for admission, edge in [("min-divergence", 0), ("random", 1)]:
        model = Mobility(trace=((1, 3, 1),), reachability=reach, admission=admission)
        assert model.maps(0, 1, 2, start, 3, histograms)[0].tolist() == [0, 1, 2, edge]
    # traced to edge 0, which reaches only edge 1: candidates 0 (U = 0.25) and 1 (U = 0.5);
    # edge 2 (also U = 0.25) is not one
    reach = ((False, True, False), (True, False, False), (True, False, False))
    model = Mobility(trace=((1, 3, 0),), reachability=reach, admission="min-divergence")
    assert model.maps(0, 1, 2, start, 3, histograms)[0].tolist() == [0, 1, 2, 0]


def test_respect():
    old, new = np.array([0, 1, 2, 0]), np.array([1, 2, 0, 0])
    assert Mobility().respect(old, new, 3) is new
    reach = ((False, True, False), (True, False, False), (True, False, False))
    kept = Mobility(reachability=reach).respect(old, new, 3)
    assert kept.tolist() == [1, 1, 0, 0] and kept.dtype == np.int64


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_read_reachability(tmp_path):
    path = _write(tmp_path / "r.csv", "1,1,0\n0,0,1\n1,0,1\n")
    assert read_reachability(path, 3) == ((True, True, False), (False, False, True),
                                          (True, False, True))
    npy = tmp_path / "r.npy"
    np.save(npy, np.array([[0, 1], [1, 0]]))
    assert read_reachability(str(npy), 2) == ((False, True), (True, False))
    refused(lambda: read_reachability(path, 2),
             f"reachability matrix {path} has shape [3, 3]; the run has 2 edges, so it must be "
             "2 x 2")
    bad = _write(tmp_path / "b.csv", "0,2\n1,0\n")
    refused(lambda: read_reachability(bad, 2), f"reachability matrix {bad} must hold only 0 and 1")
    stuck = _write(tmp_path / "s.csv", "0,1,1\n0,1,0\n1,0,0\n")
    refused(lambda: read_reachability(stuck, 3),
             f"reachability matrix {stuck}: edge 1 reaches no other edge")
    pickled = tmp_path / "p.npy"
    np.save(pickled, np.array([[0, 1], [1, 0]], dtype=object), allow_pickle=True)
    refused(lambda: read_reachability(str(pickled), 2),
             f"cannot read reachability matrix {pickled}: Object arrays cannot be loaded when "
             "allow_pickle=False")
    row = _write(tmp_path / "row.csv", "0,1\n")
    refused(lambda: read_reachability(row, 2),
             f"reachability matrix {row} has shape [1, 2]; the run has 2 edges, so it must be "
             "2 x 2")
    one = _write(tmp_path / "one.csv", "0\n")
    refused(lambda: read_reachability(one, 1), f"reachability matrix {one}: edge 0 reaches no "
             "other edge")
    text = _write(tmp_path / "t.csv", "a,b\n")
    with pytest.raises(ConfigError) as caught:
        read_reachability(text, 2)
    assert str(caught.value).startswith(f"cannot read reachability matrix {text}: ")
    assert str(caught.value).endswith("could not convert string 'a' to float64 at row 0, column 1.")
    missing = str(tmp_path / "missing.npy")
    refused(lambda: read_reachability(missing, 2),
             f"cannot read reachability matrix {missing}: [Errno 2] No such file or directory: "
             f"'{missing}'")


def test_read_trace(tmp_path):
    rounds = _write(tmp_path / "r.csv", " Round , Client , Edge \n2,1,0\n\n1,0,2\n1,0,2\n , \n")
    assert read_trace(rounds, 3, 3, 2, 3) == ((1, 0, 2), (4, 1, 0))  # round 2 -> edge round 4
    bare = _write(tmp_path / "b.csv", "2,1,0\n1,0,2\n")
    assert read_trace(bare, 3, 3, 2, 3) == ((1, 0, 2), (4, 1, 0))
    edge_rounds = _write(tmp_path / "e.csv", "edge_round,client,edge\n6,2,1\n2,0,0\n")
    assert read_trace(edge_rounds, 3, 2, 2, 3) == ((2, 0, 0), (6, 2, 1))


@pytest.mark.parametrize("rows, message", [
    ("round,client,edge\n3,0,0\n", "mobility trace t.csv row 2: round 3 is not in 1..2"),
    ("round,client,edge\n0,0,0\n", "mobility trace t.csv row 2: round 0 is not in 1..2"),
    ("-1,0,0\n", "mobility trace t.csv row 1: round -1 is not in 1..2"),
    ("edge_round,client,edge\n7,0,0\n",
     "mobility trace t.csv row 2: edge round 7 is not in 1..6"),
    ("1,3,0\n", "mobility trace t.csv row 1: client 3 does not exist (clients 0..2)"),
    ("1,-1,0\n", "mobility trace t.csv row 1: client -1 does not exist (clients 0..2)"),
    ("1,0,0\n1,2,2\n", "mobility trace t.csv row 2: edge 2 does not exist (edges 0..1)"),
    ("1,0,-1\n", "mobility trace t.csv row 1: edge -1 does not exist (edges 0..1)"),
    ("1,0,1\n2,0,0\n1,0,0\n",
     "mobility trace t.csv row 3: client 0 is sent to two edges in round 1"),
    ("1,x,0\n", "mobility trace t.csv row 1: need three integers round,client,edge, got '1,x,0'"),
    ("1,0\n", "mobility trace t.csv row 1: need three integers round,client,edge, got '1,0'"),
])
def test_bad_traces(rows, message, tmp_path):
    path = _write(tmp_path / "t.csv", rows)
    refused(lambda: read_trace(path, 3, 2, 2, 3), message)


def test_bad_trace_header_and_missing_file(tmp_path):
    path = _write(tmp_path / "t.csv", "when,who,where\n1,0,1\n")
    refused(lambda: read_trace(path, 3, 2, 2, 3),
             f"mobility trace {path}: the header must be 'round,client,edge' or "
             "'edge_round,client,edge', got 'when,who,where'")
    xpath = _write(tmp_path / "x.csv", "X1,0,0\n")  # not a number: a (bad) header
    refused(lambda: read_trace(xpath, 3, 2, 2, 3),
             f"mobility trace {xpath}: the header must be 'round,client,edge' or "
             "'edge_round,client,edge', got 'X1,0,0'")
    missing = str(tmp_path / "missing.csv")
    refused(lambda: read_trace(missing, 3, 2, 2, 3),
             f"cannot read mobility trace {missing}: No such file or directory")
