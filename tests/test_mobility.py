"""Client mobility (docs/hsgd.md#mobility): exact reductions and engine equality.

- move rate 0 is today's static run, bit for bit (inprocess and vectorized);
- a trace moves exactly the named clients at the named rounds (the recorded map);
- every engine gives the same numbers with clients moving (both handoffs, faults,
  participation, kept momentum, an edge left empty, regrouping under reachability);
- a Markov chain never moves a client to an edge its edge does not reach, and moves at the
  configured rate (binomial bound);
- bad traces and matrices stop with one line and exit code 2 before anything is written.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.engines.inprocess import run_inprocess
from fedhier.engines.vectorized.engine import run_vectorized
from fedhier.round.aggregators.averaging import presence_weights
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy
from fedhier.tree.mobility import Mobility, read_reachability, read_trace
from tests.helpers import metrics

BASE = RunConfig(dataset="digits", clients=8, groups=(2,), local_period=2, global_period=4,
                 rounds=2, batch_size=8, seed=11)
TINY = ["--dataset", "digits", "--clients", "6", "--groups", "2", "--local-period", "1",
        "--global-period", "2", "--rounds", "1", "--no-progress"]


# Tiny models: one intra-op thread is fastest, and robust on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def close(a: object, b: object, tol: float) -> bool:
    """Equal values; floats (also inside lists, None allowed) within ``tol``."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(u, v, tol) for u, v in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol * 1e-3)
    return a == b


def assert_same_runs(a: Path, b: Path, tol: float) -> None:
    """Every metrics key but wall_seconds within ``tol``, final parameters within ``tol``."""
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra.keys() - {"wall_seconds"}:
            assert close(ra[key], rb[key], tol), (key, ra["round"], ra[key], rb[key])
    fa = load_file(str(a / "model_final.safetensors"))
    fb = load_file(str(b / "model_final.safetensors"))
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= tol


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------ reductions
@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])
def test_rate_zero_is_the_static_run_bit_for_bit(engine, tmp_path):
    run = run_inprocess if engine == "inprocess" else run_vectorized
    static = BASE.replace(engine=engine, momentum=0.5, optimizer_state="keep")
    reach = write(tmp_path / "reach.csv", "1,1\n1,1\n")
    mobile = static.replace(mobility_rate=0.0, handoff="carry", reachability=reach)
    run(static, RunFolder.create(tmp_path / "static"), progress=False)
    run(mobile, RunFolder.create(tmp_path / "mobile"), progress=False)
    for a, b in zip(metrics(tmp_path / "static"), metrics(tmp_path / "mobile"), strict=True):
        a.pop("wall_seconds"), b.pop("wall_seconds")
        assert a == b
    fa = load_file(str(tmp_path / "static" / "model_final.safetensors"))
    fb = load_file(str(tmp_path / "mobile" / "model_final.safetensors"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert not (tmp_path / "mobile" / "groups_history.json").exists()


def test_trace_moves_exactly_the_named_clients(tmp_path):
    # contiguous grouping: clients 0-3 at edge 0, 4-7 at edge 1
    trace = write(tmp_path / "trace.csv", "round,client,edge\n1,0,1\n2,5,0\n2,0,0\n")
    cfg = BASE.replace(grouping="contiguous", mobility_trace=trace, rounds=3,
                       engine="vectorized")
    run_vectorized(cfg, RunFolder.create(tmp_path / "run"), progress=False)
    records = metrics(tmp_path / "run")
    # cloud round r starts with edge round 2(r-1)+1 (G/I = 2)
    assert records[1]["moves"] == [[1, 0, 0, 1]]
    assert records[1]["client_to_edge"] == [1, 0, 0, 0, 1, 1, 1, 1]
    assert records[2]["moves"] == [[3, 0, 1, 0], [3, 5, 1, 0]]
    assert records[2]["client_to_edge"] == [0, 0, 0, 0, 1, 0, 1, 1]
    assert records[3]["moved_clients"] == 0 and "client_to_edge" not in records[3]
    history = json.loads((tmp_path / "run" / "groups_history.json").read_text())
    assert history["rounds"] == [0, 1, 2, 3]
    assert history["client_to_edge"][0] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert history["client_to_edge"][3] == [0, 0, 0, 0, 1, 0, 1, 1]
    assert (tmp_path / "run" / "groups_history.png").stat().st_size > 0


def test_trace_in_edge_rounds_moves_between_edge_rounds(tmp_path):
    trace = write(tmp_path / "trace.csv", "edge_round,client,edge\n2,7,0\n4,7,1\n")
    assert read_trace(trace, 8, 2, 2, 2) == ((2, 7, 0), (4, 7, 1))
    cfg = BASE.replace(grouping="contiguous", mobility_trace=trace, engine="vectorized")
    run_vectorized(cfg, RunFolder.create(tmp_path / "run"), progress=False)
    records = metrics(tmp_path / "run")
    assert records[1]["moves"] == [[2, 7, 1, 0]]
    assert records[2]["moves"] == [[4, 7, 0, 1]]
    assert records[2]["client_to_edge"] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_run_follows_the_pure_mobility_function(tmp_path):
    cfg = BASE.replace(groups=(3,), mobility_rate=0.4, rounds=4, engine="vectorized")
    run_vectorized(cfg, RunFolder.create(tmp_path / "run"), progress=False)
    history = json.loads((tmp_path / "run" / "groups_history.json").read_text())
    initial = np.array(history["client_to_edge"][0])
    model = cfg.mobility()
    for r in range(1, 5):  # the map after cloud round r = the map of its last edge round
        expected = model.edge_of_client(2 * r, initial, cfg.seed, 2, 3)
        assert history["client_to_edge"][r] == expected.tolist()
    # asked in any order, the function gives the same maps
    late = model.edge_of_client(7, initial, cfg.seed, 2, 3)
    early = model.edge_of_client(3, initial, cfg.seed, 2, 3)
    assert model.edge_of_client(7, initial, cfg.seed, 2, 3).tolist() == late.tolist()
    assert model.edge_of_client(3, initial, cfg.seed, 2, 3).tolist() == early.tolist()


# ------------------------------------------------------------------------------ engines agree
def _cases(tmp: Path) -> dict[str, RunConfig]:
    # contiguous: clients 0-3 at edge 0, 4-7 at edge 1; the trace empties edge 1 in edge
    # round 2 and sends client 6 back in edge round 5
    empty = write(tmp / "empty.csv", "edge_round,client,edge\n" + "".join(
        f"2,{c},0\n" for c in range(4, 8)) + "5,6,1\n")
    ring = write(tmp / "ring.csv", "0,1,0\n0,0,1\n1,0,0\n")
    return {
        "fresh": BASE.replace(groups=(3,), mobility_rate=0.5, rounds=3),
        "carry": BASE.replace(groups=(3,), mobility_rate=0.5, rounds=3, handoff="carry"),
        "carry-momentum-kept": BASE.replace(groups=(3,), mobility_rate=0.5, rounds=3,
                                            handoff="carry", momentum=0.5,
                                            optimizer_state="keep"),
        "fresh-momentum-kept": BASE.replace(groups=(3,), mobility_rate=0.5, rounds=3,
                                            momentum=0.5, optimizer_state="keep"),
        "carry-faults-participation-fednova": BASE.replace(
            clients=10, alpha=0.3, seed=3, batch_size=100, groups=(3,), mobility_rate=0.5,
            handoff="carry", fail_rate=0.3, participation=0.5, momentum=0.5,
            optimizer_state="keep", local_period=4, global_period=8,
            straggler_fraction=0.5, normalize_updates=True, rounds=3),
        "empty-edge-diagnostics": BASE.replace(grouping="contiguous", mobility_trace=empty,
                                               handoff="carry", diagnostics_every=1,
                                               rounds=3),
        "three-level-median": BASE.replace(groups=(4, 2), periods=(2, 4, 8),
                                           aggregators="median,mean,mean",
                                           mobility_rate=0.5, handoff="carry", rounds=2),
        "regroup-reachability": BASE.replace(groups=(3,), mobility_rate=0.3, reachability=ring,
                                             regroup_every=1, rounds=3),
    }


CASE_NAMES = ["fresh", "carry", "carry-momentum-kept", "fresh-momentum-kept",
              "carry-faults-participation-fednova", "empty-edge-diagnostics",
              "three-level-median", "regroup-reachability"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_vectorized_equals_inprocess_with_mobility(case, tmp_path):
    cfg = _cases(tmp_path)[case]
    run_inprocess(cfg, RunFolder.create(tmp_path / "inprocess"), progress=False)
    run_vectorized(cfg.replace(engine="vectorized"), RunFolder.create(tmp_path / "vectorized"),
                   progress=False)
    assert_same_runs(tmp_path / "inprocess", tmp_path / "vectorized", 1e-5)
    records = metrics(tmp_path / "vectorized")
    assert sum(r.get("moved_clients", 0) for r in records) > 0
    if case == "empty-edge-diagnostics":
        # edge 1 holds no client from edge round 2 to edge round 4
        assert records[1]["client_to_edge"] == [0] * 8
        assert records[1]["downward_divergence_by_edge"][1] is None
        assert records[3]["client_to_edge"] == [0] * 6 + [1, 0]
        assert all(math.isfinite(r["upward_divergence"]) for r in records)


def test_handoffs_differ_only_after_a_mid_round_move(tmp_path):
    mid = write(tmp_path / "mid.csv", "edge_round,client,edge\n2,0,1\n")
    start = write(tmp_path / "start.csv", "round,client,edge\n2,0,1\n")
    finals = {}
    for name, trace in (("mid", mid), ("start", start)):
        for handoff in ("fresh", "carry"):
            cfg = BASE.replace(grouping="contiguous", mobility_trace=trace, handoff=handoff,
                               engine="vectorized")
            out = tmp_path / f"{name}-{handoff}"
            run_vectorized(cfg, RunFolder.create(out), progress=False)
            finals[name, handoff] = load_file(str(out / "model_final.safetensors"))
    same = [torch.equal(finals["start", "fresh"][k], finals["start", "carry"][k])
            for k in finals["start", "fresh"]]
    assert all(same)  # at a cloud round's start every edge holds the global model
    assert not all(torch.equal(finals["mid", "fresh"][k], finals["mid", "carry"][k])
                   for k in finals["mid", "fresh"])


# ------------------------------------------------------------------------------ the model
def test_markov_moves_respect_reachability():
    n, edges, e = 60, 4, 5
    reach = ((0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 1, 0, 0))  # a ring plus 3 -> 1
    model = Mobility(rate=0.7, reachability=tuple(tuple(bool(v) for v in r) for r in reach))
    allowed = np.array(reach, dtype=bool) | np.eye(edges, dtype=bool)
    current = np.arange(n) % edges
    moved = 0
    for r in range(1, 201):
        maps = model.maps(0, r, e, current, edges)
        previous = current
        for k in range(e):
            assert allowed[previous, maps[k]].all()
            moved += int((maps[k] != previous).sum())
            previous = maps[k]
        current = maps[-1]
    assert moved > 0


def test_move_frequency_matches_the_rate():
    n, edges, rounds, rate = 100, 5, 60, 0.3
    model = Mobility(rate=rate)
    current = np.arange(n) % edges
    moves, when = 0, np.zeros(4, dtype=np.int64)
    for r in range(1, rounds + 1):
        maps = model.maps(7, r, 4, current, edges)
        changed = maps[-1] != current
        moves += int(changed.sum())  # one move per client per cloud round at most
        for k in range(4):
            before = current if k == 0 else maps[k - 1]
            when[k] += int((maps[k] != before).sum())
        current = maps[-1]
    trials = n * rounds
    assert abs(moves / trials - rate) <= 4 * math.sqrt(rate * (1 - rate) / trials)
    share = when / when.sum()  # the edge round of a move is uniform over the cloud round
    assert np.all(np.abs(share - 0.25) <= 4 * math.sqrt(0.25 * 0.75 / when.sum()))


def test_empty_edges_in_the_tree_and_the_weights():
    tree = Hierarchy((2, 4), (np.array([0, 0, 1]),))
    moved = tree.with_edge_map(np.array([0, 0, 0]))
    assert moved.num_nodes(1) == 2 and moved.edge_of_client().tolist() == [0, 0, 0]
    with pytest.raises(ConfigError):
        Hierarchy((2, 4), (np.array([0, 0, 0]), np.array([0, 0])))  # edge 1 has no client
    w = presence_weights(np.array([1.0, 2.0, 3.0]), np.array([True, False, True]),
                         np.array([0, 2, 2]))  # edge 1: no members at all
    assert w.tolist() == [1.0, 0.0, 5.0]


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("rows, message", [
    ("round,client,edge\n1,6,0\n", "client 6 does not exist"),
    ("round,client,edge\n1,0,2\n", "edge 2 does not exist"),
    ("round,client,edge\n2,0,1\n", "round 2 is not in 1..1"),
    ("1,0,1\n1,0,0\n", "two edges"),
    ("when,who,where\n1,0,1\n", "header"),
])
def test_bad_trace_is_one_line_before_any_output(rows, message, tmp_path, capsys):
    trace = write(tmp_path / "trace.csv", rows)
    out = tmp_path / "out"
    assert main(["run", *TINY, "--mobility-trace", trace, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("matrix, message", [
    ("1,1,1\n1,1,1\n1,1,1\n", "must be 2 x 2"),
    ("1,1\n0,1\n", "edge 1 reaches no other edge"),
    ("0,2\n1,0\n", "only 0 and 1"),
])
def test_bad_reachability_is_one_line_before_any_output(matrix, message, tmp_path, capsys):
    path = write(tmp_path / "reach.csv", matrix)
    out = tmp_path / "out"
    assert main(["run", *TINY, "--mobility-rate", "0.5", "--reachability", path,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--mobility-rate", "1.5"], "mobility_rate must be in [0, 1]"),
    (["--handoff", "keep"], "unknown handoff"),
    (["--mobility-rate", "0.2", "--mobility-trace", "x.csv"], "not both"),
    (["--mobility-trace", "missing.csv"], "cannot read mobility trace"),
])
def test_bad_mobility_flags(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", *TINY, *flags, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_reachability_reads_npy(tmp_path):
    path = tmp_path / "reach.npy"
    np.save(path, np.array([[0, 1], [1, 0]]))
    assert read_reachability(str(path), 2) == ((False, True), (True, False))


def test_interrupted_mobile_run_resumes_bit_identically(tmp_path, monkeypatch):
    """The map in force is checkpointed with the hierarchy: a resumed run moves the same
    clients and ends with the same model and groups history."""
    from tests.test_faults import run_interrupted_at

    args = ["run", *TINY, "--engine", "vectorized", "--rounds", "5", "--global-period", "4",
            "--groups", "3", "--mobility-rate", "0.5", "--handoff", "carry", "--momentum",
            "0.9", "--optimizer-state", "keep"]
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    stopped = tmp_path / "stopped"
    assert run_interrupted_at(3, [*args, "--out", str(stopped)], monkeypatch) == 130
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    fa = load_file(str(tmp_path / "reference" / "model_final.safetensors"))
    fb = load_file(str(stopped / "model_final.safetensors"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    ha, hb = (json.loads((d / "groups_history.json").read_text())
              for d in (tmp_path / "reference", stopped))
    assert ha == hb and ha["moves"]
