"""The asynchronous rules (fedhier/round/asynchrony/rules.py, docs/hsgd.md "Asynchronous rules"):
FedBuff, FedAsync and the shifted mean by hand, in the merge, against the independent oracle through
``fedhier run`` (inprocess and vectorized) and their exact reductions, bit for bit.

The oracle case: the tiny data of tests/test_oracle.py, 4 edges, K = 2, edge 0 four times
slower, so reports are up to 3 aggregations stale; the arrival order does not depend on the
models, so every rule takes the same reports and the models differ by the rule alone."""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest
import torch

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.round.asynchrony.edges import EdgeTraining
from fedhier.round.asynchrony.reports import merge_reports
from fedhier.round.asynchrony.rules import (
    SHIFTED_MEAN,
    AsyncRule,
    StalenessFunction,
    combine,
    staleness_function,
)
from fedhier.round.asynchrony.settings import staleness_weight
from fedhier.tree.hierarchy import Hierarchy
from tests import oracle_hsgd as oracle
from tests.test_oracle import (  # noqa: F401 - `data`: a fixture
    ENGINES,
    TOL,
    data,
    gap,
    initial,
    moved,
    problem,
    run,
)

# ------------------------------------------------------------------ the rules by hand
W = {"p": torch.tensor([1.0, 2.0], dtype=torch.float64)}
MODELS = {"p": torch.tensor([[3.0, 2.0], [0.0, 0.0]], dtype=torch.float64)}
BASES = {"p": torch.tensor([[1.0, 2.0], [1.0, 0.0]], dtype=torch.float64)}  # report 0 fresh
WEIGHTS = np.array([1.0, 3.0])
TAU = np.array([0, 3])  # s(3) = 1/2 under polynomial:0.5
#: Δ = [2, 0] and [-1, 0]; π = 1/4, 3/4
BY_HAND = {
    # w + Σ π s Δ = [1, 2] + [1/4 * 2 - 3/4 * 1/2, 0]
    AsyncRule("fedbuff"): [1.125, 2.0],
    # w + 0.5 Σ π s Δ
    AsyncRule("fedbuff", server_lr=0.5): [1.0625, 2.0],
    # w + Σ π α s (x - w) = [1, 2] + 1/4 * 1/2 * [2, 0] + 3/4 * 1/4 * [-1, -2]
    AsyncRule("fedasync", mixing=0.5): [1.0625, 1.625],
    # w + Σ W s Δ / Σ W s = [1, 2] + ([2, 0] + 3/2 [-1, 0]) / (5/2)
    SHIFTED_MEAN: [1.2, 2.0],
    # hinge a = 2, b = 1: s(3) = 1 / (2 * 2 + 1) = 1/5; w + [1/2 - 3/4 * 1/5, 0]
    AsyncRule("fedbuff", staleness=StalenessFunction("hinge", 2.0, 1.0)): [1.35, 2.0],
    # constant: w + [1/2 - 3/4, 0]
    AsyncRule("fedbuff", staleness=StalenessFunction("constant")): [0.75, 2.0],
}


@pytest.mark.parametrize("rule", list(BY_HAND), ids=lambda r: f"{r.name}-{r.staleness.spec}")
def test_each_rule_is_its_papers_equation_by_hand(rule):
    got = combine(rule, W, MODELS, BASES, WEIGHTS, TAU)
    torch.testing.assert_close(got["p"], torch.tensor(BY_HAND[rule], dtype=torch.float64),
                               rtol=0, atol=1e-15)


def test_fedasync_with_one_report_is_the_papers_mixing():
    """K = 1: w <- (1 - α_t) w + α_t x, α_t = α s(t - τ), hinge a = 10, b = 4 at τ = 6."""
    rule = AsyncRule("fedasync", mixing=0.6, staleness=StalenessFunction("hinge", 10.0, 4.0))
    x = {"p": torch.tensor([[5.0, -1.0]], dtype=torch.float64)}
    alpha = 0.6 / (10 * (6 - 4) + 1)
    got = combine(rule, W, x, {"p": torch.zeros(1, 2, dtype=torch.float64)}, np.array([2.0]),
                  np.array([6]))
    torch.testing.assert_close(got["p"], (1 - alpha) * W["p"] + alpha * x["p"][0])


def test_the_staleness_functions():
    tau = np.arange(6)
    assert StalenessFunction()(tau).tolist() == [1 / math.sqrt(1 + t) for t in range(6)]
    assert staleness_weight(3) == 0.5  # FedBuff's 1/sqrt(1 + s), bit for bit
    np.testing.assert_allclose(StalenessFunction("polynomial", 2.0)(tau),
                               [(1 + t) ** -2.0 for t in range(6)], rtol=1e-15)
    assert StalenessFunction("hinge", 10.0, 2.0)(tau).tolist() == [1, 1, 1, 1 / 11, 1 / 21,
                                                                    1 / 31]
    assert StalenessFunction("constant")(tau).tolist() == [1.0] * 6
    for spec in ("polynomial:0.5", "hinge:10:4", "constant", "polynomial:1.25"):
        assert staleness_function(spec).spec == spec


@pytest.mark.parametrize("spec,message", [
    ("polynomial", "staleness_fn 'polynomial': polynomial takes 1 parameter; write "
                   "polynomial:A (e.g. polynomial:0.5)"),
    ("hinge:10", "staleness_fn 'hinge:10': hinge takes 2 parameters; write hinge:A:B"),
    ("constant:1", "staleness_fn 'constant:1': constant takes 0 parameters"),
    ("polynomial:-1", "staleness_fn 'polynomial:-1': a must be a finite number >= 0"),
    ("hinge:1:nan", "staleness_fn 'hinge:1:nan': b must be a finite number >= 0"),
    ("exp:1", "staleness_fn: unknown function 'exp'"),
])
def test_a_staleness_function_without_its_parameters_is_refused(spec, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        staleness_function(spec)


# ------------------------------------------------------------------ in the merge
TREE = Hierarchy(periods=(1, 2), parents=(np.array([0, 1]),))  # one client per edge


def _reports() -> list[tuple[EdgeTraining, int]]:
    return [(EdgeTraining(e, 0, {"p": BASES["p"][e]}, 1.0, {"p": MODELS["p"][e:e + 1]},
                     np.array([e]), np.array([e])), int(TAU[e])) for e in (0, 1)]


class WeightedMean:
    """A cloud step that is the plain weighted mean of the children it is given."""

    def step(self, cloud_round, children, weights):
        total = sum(weights.values())
        return {"p": sum(weights[c] * children[c]["p"] for c in children) / total}


@pytest.mark.parametrize("rule", list(BY_HAND), ids=lambda r: f"{r.name}-{r.staleness.spec}")
@pytest.mark.parametrize("way", ["linear", "moved", "cloud-step"])
def test_the_merge_applies_the_rule_on_each_of_its_ways(rule, way):
    """One client per edge: merge_reports gives the rule's model by hand on the linear way,
    with a robust rule above the edges (median of one child per node: the moved models'
    way) and through a cloud step that is the weighted mean of its children."""
    rules, tree = ("mean", "mean"), TREE
    if way == "moved":  # two regions of one edge each, the median at the regions
        rules = ("mean", "median", "mean")
        tree = Hierarchy(periods=(1, 2, 4), parents=(np.array([0, 1]), np.array([0, 1])))
    new = merge_reports(_reports(), W, WEIGHTS, tree, rules,
                        lambda level, nodes: {"p": W["p"].repeat(len(nodes), 1)},
                        WeightedMean() if way == "cloud-step" else None, rule=rule)
    assert new is not None
    torch.testing.assert_close(new["p"], torch.tensor(BY_HAND[rule], dtype=torch.float64),
                               rtol=0, atol=1e-14)


# ------------------------------------------------------------------ against the oracle
CASE = ("--groups", "4", "--grouping", "contiguous", "--local-period", "2",
        "--global-period", "4", "--async-buffer", "2", "--edge-slowdown", "0:4",
        "--max-staleness", "8")
RULES = {  # flags -> the oracle's rule
    "fedbuff": ((), oracle.AsyncRule("fedbuff")),
    "fedbuff-lr-poly1": (("--async-server-lr", "0.7", "--staleness-fn", "polynomial:1"),
                         oracle.AsyncRule("fedbuff", 0.7, staleness=oracle.polynomial(1.0))),
    "fedasync": (("--async-rule", "fedasync", "--async-mixing", "0.6"),
                 oracle.AsyncRule("fedasync", mixing=0.6)),
    "fedasync-hinge": (("--async-rule", "fedasync", "--async-mixing", "0.9",
                        "--staleness-fn", "hinge:2:0"),
                       oracle.AsyncRule("fedasync", mixing=0.9,
                                        staleness=oracle.hinge(2.0, 0.0))),
    "shifted-mean": (("--async-rule", "shifted-mean"), oracle.AsyncRule("shifted-mean")),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_rule_matches_the_oracle_and_the_rules_differ(data, engine):  # noqa: F811 - the fixture
    """Each rule's run equals the oracle's equation of that rule (1e-6) and is more than
    1e-4 from every other rule's oracle model."""
    wants, runs = {}, {}
    for name, (flags, rule) in RULES.items():
        r = run(data, engine, *CASE, *flags, rounds=6)
        records = r["records"][1:]
        reports = [[edge for edge, _ in rec["async_reports"]] for rec in records]
        wants[name], staleness = oracle.async_hsgd(problem(data, r, (2, 4)), initial(r),
                                                   reports, rule=rule)
        assert [sorted(rec["async_reports"]) for rec in records] == staleness
        assert max(s for pairs in staleness for _, s in pairs) >= 2
        runs[name] = r
        assert gap(r, wants[name]) <= TOL, name
        assert moved(r, wants[name]) > 1e-2
    for name, r in runs.items():
        for other, want in wants.items():
            if other != name:
                assert gap(r, want) > 1e-4, (name, other, gap(r, want))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["fedbuff-lr-poly1", "fedasync"])
def test_regions_apply_the_rule_where_they_buffer(data, engine, name):  # noqa: F811 - the fixture
    """Three levels, each region sends its first edge report, the cloud waits for both: the
    oracle applies the rule region by region and then at the cloud; fedhier once over the
    edge reports (the same model: each rule is linear in its reports)."""
    flags, rule = RULES[name]
    r = run(data, engine, "--groups", "4,2", "--grouping", "contiguous", "--periods", "1,2,4",
            "--edge-slowdown", "2:3,3:2", "--max-staleness", "8", "--region-buffer", "1",
            *flags, rounds=5)
    reports = [[edge for edge, _ in rec["async_reports"]] for rec in r["records"][1:]]
    assert max(s for rec in r["records"][1:] for _, s in rec["async_reports"]) >= 1
    p = problem(data, r, (1, 2, 4))
    want = oracle.async_regions_hsgd(p, initial(r), reports, 1, 0, rule=rule)
    assert gap(r, want) <= TOL
    shifted = oracle.async_regions_hsgd(p, initial(r), reports, 1, 0,
                                        rule=oracle.AsyncRule("shifted-mean"))
    assert gap(r, shifted) > 1e-4


# ------------------------------------------------------------------ exact reductions
def _bytes(data, engine, *flags, rounds=3) -> bytes:  # noqa: F811
    r = run(data, engine, *flags, rounds=rounds)
    return b"".join(v.tobytes() for _, v in sorted(r["final"].items()))


@pytest.mark.parametrize("engine", ENGINES)
def test_k_equal_n_is_synchronous_under_every_rule_that_reduces_to_it(data, engine):  # noqa: F811 - the fixture
    """K = N: every report fresh. FedBuff (η_g = 1, any staleness function), FedAsync with
    α = 1 and the shifted mean give the synchronous model bit for bit; FedBuff with
    η_g = 0.5 and FedAsync with α = 0.5 do not (w + 0.5 (w_sync - w))."""
    flags = ("--groups", "4", "--grouping", "contiguous", "--local-period", "2",
             "--global-period", "4", "--edge-slowdown", "0:4")
    sync = _bytes(data, engine, *flags)
    for rule in (("--async-rule", "fedbuff", "--staleness-fn", "hinge:3:0"),
                 ("--async-rule", "fedasync", "--async-mixing", "1"),
                 ("--async-rule", "shifted-mean")):
        assert _bytes(data, engine, *flags, "--async-buffer", "4", *rule) == sync, rule
    for rule in (("--async-server-lr", "0.5"), ("--async-rule", "fedasync")):
        assert _bytes(data, engine, *flags, "--async-buffer", "4", *rule) != sync, rule


@pytest.mark.parametrize("engine", ENGINES)
def test_fresh_fedbuff_with_unit_server_lr_is_the_shifted_mean(data, engine):  # noqa: F811 - the fixture
    """K = 1, S = 0 (every report taken is fresh; stale ones are dropped), η_g = 1: FedBuff
    is the shifted mean bit for bit. Reports allowed to be stale (S = 8), they differ."""
    flags = (*CASE[:-1], "0", "--async-buffer", "1")
    r = run(data, engine, *flags, rounds=5)
    assert sum(rec["stale_dropped"] for rec in r["records"][1:]) > 0
    shifted = run(data, engine, *flags, "--async-rule", "shifted-mean", rounds=5)
    for key in r["final"]:
        assert r["final"][key].tobytes() == shifted["final"][key].tobytes()
    stale = [run(data, engine, *CASE[:-1], "8", "--async-buffer", "1", *rule, rounds=5)
             for rule in ((), ("--async-rule", "shifted-mean"))]
    assert max(float(np.abs(stale[0]["final"][k] - stale[1]["final"][k]).max())
               for k in r["final"]) > 1e-4


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("flags,names", [
    (("--async-rule", "fedavg"), "async_rule"),
    (("--async-server-lr", "0"), "async_server_lr must be > 0"),
    (("--async-server-lr", "-1"), "async_server_lr must be > 0"),
    (("--async-mixing", "0"), "async_mixing must be in (0, 1]"),
    (("--async-mixing", "1.5"), "async_mixing must be in (0, 1]"),
    (("--staleness-fn", "polynomial"), "staleness_fn 'polynomial'"),
    (("--staleness-fn", "hinge:10"), "staleness_fn 'hinge:10'"),
    (("--staleness-fn", "sigmoid:1"), "staleness_fn: unknown function"),
])
def test_bad_rule_settings_are_one_line_and_exit_2(tmp_path, flags, names):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", "--async-buffer", "1", *flags, "--out", str(tmp_path / "r"),
                     "--no-progress"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and names in lines[0], err.getvalue()
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ why one-report buffers rise
def test_a_single_fresh_report_applied_in_full_is_why_one_report_buffers_rise(tmp_path):
    """The case of docs/hsgd.md ("Which rule"): digits, three levels, K = 1, mobility 0.5,
    lr 0.1, the first cloud aggregation. Its one report is fresh (s = 0), so no staleness
    function or bound acts: FedBuff with η_g = 1 and the shifted mean both set the global
    model to the reporting edge's (bit for bit), whose clients hold a few classes, and the
    train loss rises above the initial one. The same report with η_g = K / N = 1/4 is
    w0 + (x_e - w0) / 4, below the initial loss: the step, not the rule, makes it rise."""
    from safetensors.numpy import load_file

    from tests.helpers import metrics

    flags = ["run", "--dataset", "digits", "--clients", "20", "--alpha", "0.1",
             "--grouping", "min-divergence", "--batch-size", "0", "--groups", "4,2",
             "--periods", "5,10,20", "--lr", "0.1", "--mobility-rate", "0.5",
             "--async-buffer", "1", "--rounds", "1", "--engine", "vectorized",
             "--no-progress"]
    runs = {}
    for name, rule in (("full", []), ("shifted", ["--async-rule", "shifted-mean"]),
                       ("quarter", ["--async-server-lr", "0.25"])):
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*flags, *rule, "--out", str(tmp_path / name)]) == 0
        runs[name] = (metrics(tmp_path / name), load_file(tmp_path / name /
                                                           "model_final.safetensors"))
    (records, full), (_, shifted), (quarter_records, quarter) = runs.values()
    start = load_file(tmp_path / "full" / "model_initial.safetensors")
    assert records[1]["async_reports"] == [[3, 0]]  # one fresh report
    assert all(full[k].tobytes() == shifted[k].tobytes() for k in full)
    initial_loss = records[0]["train_loss"]
    assert records[1]["train_loss"] > initial_loss + 0.2
    assert quarter_records[1]["train_loss"] < initial_loss
    for k in full:
        np.testing.assert_allclose(quarter[k], start[k] + 0.25 * (full[k] - start[k]),
                                   atol=1e-6)
    # the reporting edge's clients (the map at the round's end) are further from the
    # global label mix (total variation) than the edge the grouping made
    import json

    partition = json.loads((tmp_path / "full" / "partition.json").read_text())
    counts = np.array([c["label_counts"] for c in partition["clients"]], dtype=np.float64)
    grouped = json.loads((tmp_path / "full" / "groups.json").read_text())["client_to_edge"]

    def distance(edge_of) -> float:
        mix = counts[np.asarray(edge_of) == 3].sum(0)
        return 0.5 * float(np.abs(mix / mix.sum() - counts.sum(0) / counts.sum()).sum())

    assert distance(records[1]["client_to_edge"]) > 0.5 > 0.3 > distance(grouped)
