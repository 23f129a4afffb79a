"""Divergence-aware admission (``--handoff MODEL:min-divergence``, fedhier/tree/admission.py).

- closed form: 5 clients, 2 classes, 3 edges; the upward divergence of each candidate map is
  worked out by hand and the admitted edge is the one with the lowest;
- through Mobility.maps with a trace and a reachability matrix (the candidates);
- rate moves: the admission never raises the divergence a random choice would leave, and the
  maps are a pure function of (seed, round);
- vectorized == inprocess with clients moving under min-divergence admission;
- a bad admission is one line and exit code 2.
"""

import numpy as np
import pytest

from fedhier.cli.commands import main
from fedhier.diagnostics.measures import label_upward_divergence
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.admission import Move, edge_label_divergence, min_divergence_admission
from fedhier.tree.mobility import Mobility, parse_handoff
from tests.helpers import metrics
from tests.test_mobility import TINY, assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Clients 0, 1: 4 rows of class 0 at edge 0; client 2: 4 rows of class 1 at edge 1;
# client 3: 2 + 2 at edge 2; client 4 (the mover): 4 rows of class 1, now at edge 0.
HIST = np.array([[4, 0], [4, 0], [0, 4], [2, 2], [0, 4]])
MAP = np.array([0, 0, 1, 2, 0])


def test_closed_form_admission_picks_the_lowest_upward_divergence():
    # pi = (1/2, 1/2); U = sum_i P_i ||pi_i - pi||^2 over 20 rows.
    # to edge 1: E0 = (8,0), E1 = (0,8), E2 = (2,2): U = .4 * .5 + .4 * .5 + 0 = 0.4
    # to edge 2: E0 = (8,0), E1 = (0,4), E2 = (2,6): U = .4 * .5 + .2 * .5 + .4 * .125 = 0.35
    # stay at 0: E0 = (8,4), E1 = (0,4), E2 = (2,2): U = .6 * 2/36 + .2 * .5 + 0 = 2/15
    by_hand = {1: 0.4, 2: 0.35, 0: 2 / 15}
    for edge, u in by_hand.items():
        moved = MAP.copy()
        moved[4] = edge
        assert label_upward_divergence(HIST, moved, 3) == pytest.approx(u, abs=1e-12)
        edges = np.zeros((3, 2))
        np.add.at(edges, moved, HIST)
        assert edge_label_divergence(edges) == pytest.approx(u, abs=1e-12)
    for options, expected in (([1, 2], 2), ([0, 1, 2], 0), ([1], 1)):
        for draw in (0.0, 0.5, 0.99):
            move = Move(4, np.array(options), draw=draw)
            assert min_divergence_admission(move, MAP, HIST, 3) == expected


def test_traced_move_is_admitted_among_the_trace_edge_and_its_reach():
    # the trace sends client 4 to edge 1, which reaches only edge 2: candidates {1, 2} -> 2;
    # without a matrix every edge is a candidate and staying at edge 0 is lowest.
    ring = ((False, True, False), (False, False, True), (True, False, False))
    for reach, expected in ((ring, 2), (None, 0)):
        model = Mobility(trace=((1, 4, 1),), reachability=reach, admission="min-divergence")
        maps = model.maps(0, 1, 2, MAP, 3, HIST)
        assert maps[:, 4].tolist() == [expected, expected]
        assert Mobility(trace=((1, 4, 1),), reachability=reach).maps(
            0, 1, 2, MAP, 3, HIST)[:, 4].tolist() == [1, 1]


def test_rate_moves_are_deterministic_and_lower_the_divergence():
    rng = np.random.default_rng(5)
    hist = np.eye(4, dtype=np.int64)[rng.integers(0, 4, 24)] * 10  # one class per client
    # edge-non-IID start: clients sorted by label, 6 per edge
    start = np.argsort(np.argsort(hist.argmax(1), kind="stable")) * 4 // 24
    ups = {}
    for admission in ("random", "min-divergence"):
        model = Mobility(rate=0.5, admission=admission)
        current, trail = start.copy(), []
        for r in range(1, 6):
            maps = model.maps(3, r, 2, current, 4, hist)
            assert (maps == model.maps(3, r, 2, current, 4, hist)).all()
            current = maps[-1]
            trail.append(label_upward_divergence(hist, current, 4))
        ups[admission] = trail
        same = model.edge_of_client(10, start, 3, 2, 4, hist)
        assert (same == current).all()
    # the same clients move at the same edge rounds; only where they go differs
    assert all(a < b for a, b in zip(ups["min-divergence"], ups["random"], strict=True))


def test_parse_handoff():
    assert parse_handoff("fresh") == ("fresh", "random")
    assert parse_handoff("carry:min-divergence") == ("carry", "min-divergence")


def test_vectorized_equals_inprocess_with_min_divergence_admission(tmp_path):
    cfg = RunConfig(dataset="digits", clients=8, groups=(3,), local_period=2, global_period=4,
                    rounds=3, batch_size=8, seed=11, mobility_rate=0.5,
                    handoff="carry:min-divergence", partition="shards", classes_per_client=1)
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", 1e-5)
    random = cfg.replace(engine="vectorized", handoff="carry")
    run_vectorized(random, RunFolder.create(tmp_path / "random"), progress=False)
    admitted, drawn = metrics(tmp_path / "vectorized"), metrics(tmp_path / "random")
    # the same moves (edge round, client) happen; where they land differs
    assert [[m[:2] for m in r.get("moves", [])] for r in admitted] == \
        [[m[:2] for m in r.get("moves", [])] for r in drawn]
    assert [r.get("moves") for r in admitted] != [r.get("moves") for r in drawn]
    assert sum(r.get("moved_clients", 0) for r in admitted) > 0


@pytest.mark.parametrize("value, message", [
    ("fresh:nearest", "unknown admission 'nearest'"),
    ("teleport:min-divergence", "unknown handoff 'teleport'"),
])
def test_bad_admission_is_one_line(value, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", *TINY, "--handoff", value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
