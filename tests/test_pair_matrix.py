"""Every pair of features either runs, on both engines alike, or is refused on purpose.

Issue 23 item 2: for each pair of the features below, a run either

- works: it finishes (``run_engine``), ``inprocess`` (Flower messages) equals ``vectorized``
  to :data:`TOL`, each feature changes the result (none is silently dropped), and each
  reduction that applies holds: asynchronous edges with K = N equal synchronous H-SGD bit
  for bit; all per-edge periods equal is no per-edge periods bit for bit; move rate 0 is the
  static run bit for bit; the median at the edges with one client per edge is the mean; or
- is refused: ``fedhier run`` exits 2 with one line, and the pair is in :data:`REFUSED` with
  its reason, the table docs/hsgd.md ("Combinations that are refused") shows.

A pair that runs but is listed as refused fails, and so does a refused pair not listed: a
change that lifts a refusal deletes its line here and in the docs. Runs are tiny (8 clients,
digits, an MLP, 3 cloud rounds of 4 steps) and each distinct configuration runs once per
module (:func:`runs`); figures are skipped.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedhier.cli.commands import main
from fedhier.common.errors import ConfigError
from fedhier.engines.registry import run_engine
from fedhier.runs.folder import RunFolder
from fedhier.settings.run_config import RunConfig
from tests.helpers import metrics
from tests.test_vectorized import assert_same_runs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: inprocess vs vectorized: every metric (relative) and every final parameter.
TOL = 1e-5
DOCS = Path(__file__).resolve().parents[1] / "docs" / "hsgd.md"
SECTION = "## Combinations that are refused"

#: What every run shares: 8 clients, I = 2, G = 4, 3 cloud rounds (two-level).
BASE: dict[str, Any] = {"dataset": "digits", "clients": 8, "groups": (2,), "periods": (2, 4),
                        "rounds": 3, "batch_size": 8, "model": "mlp", "seed": 11}
#: A trace with moves in the middle of cloud rounds (edge rounds 2, 4 and 6; G / I >= 2 edge
#: rounds per cloud round in every shape below), where the carry handoff matters, and at
#: two-level cloud rounds' starts (3, 5), after a regrouping; clients are sent both ways, so
#: that some move whatever the (re)grouping. (A carry move in the last edge round of a
#: two-level cloud round changes no model: the cloud averages every client anyway.)
TRACE = ("edge_round,client,edge\n2,0,1\n2,1,0\n2,2,1\n3,3,1\n3,6,0\n4,0,0\n4,1,1\n"
         "5,7,1\n5,2,0\n6,4,1\n6,5,0\n")


@dataclass(frozen=True)
class Shape:
    """What a feature's settings depend on: the number of edges and the reductions' twists.

    async_all: K = N (synchronous); equal_periods: every I_i = I; rate_zero: move rate 0
    (with a carry handoff and an all-ones reachability matrix, so the settings still
    differ from the static run); one_per_edge: as many edges as clients; edge_mean: the
    mean, not the median, at the edges.
    """

    edges: int
    levels: int
    files: Path
    async_all: bool = False
    equal_periods: bool = False
    rate_zero: bool = False
    one_per_edge: bool = False
    edge_mean: bool = False


def _three_level(shape: Shape) -> dict[str, Any]:
    return {}  # the shape itself (see settings)


def _async(shape: Shape) -> dict[str, Any]:
    return {"async_buffer": shape.edges if shape.async_all else shape.edges - 1}


def _edge_periods(shape: Shape) -> dict[str, Any]:
    periods = [2] * shape.edges if shape.equal_periods else [2, 4] * (shape.edges // 2)
    return {"edge_periods": ",".join(map(str, periods))}


def _fednova(shape: Shape) -> dict[str, Any]:
    return {"normalize_updates": True, "straggler_fraction": 0.5}


def _mobility_rate(shape: Shape) -> dict[str, Any]:
    if shape.rate_zero:
        reach = shape.files / f"reach{shape.edges}.csv"
        return {"mobility_rate": 0.0, "handoff": "carry", "reachability": str(reach)}
    return {"mobility_rate": 0.5, "handoff": "fresh"}


def _mobility_trace(shape: Shape) -> dict[str, Any]:
    return {"mobility_trace": str(shape.files / "trace.csv"), "handoff": "carry"}


def _regroup(shape: Shape) -> dict[str, Any]:
    return {"regroup_every": 1}


def _median(shape: Shape) -> dict[str, Any]:
    edge = "mean" if shape.edge_mean else "median"
    return {"aggregators": f"{edge},mean" if shape.levels == 2 else f"{edge},mean,median"}


def _cloud_strategy(shape: Shape) -> dict[str, Any]:
    return {"cloud_strategy": "fedavgm", "server_lr": 1.0, "server_momentum": 0.9}


def _kept_state(shape: Shape) -> dict[str, Any]:
    return {"momentum": 0.5, "optimizer_state": "keep"}


def _faults(shape: Shape) -> dict[str, Any]:
    return {"participation": 0.5, "fail_rate": 0.2, "straggler_fraction": 0.5}


#: feature -> its settings for a shape. The order is the order of a pair's names.
FEATURES: dict[str, Callable[[Shape], dict[str, Any]]] = {
    "three-level": _three_level,  # --groups 4,2 --periods 2,4,8
    "async": _async,  # --async-buffer N-1
    "edge-periods": _edge_periods,  # --edge-periods 2,4,...
    "fednova": _fednova,  # --normalize-updates with stragglers
    "mobility-rate": _mobility_rate,  # --mobility-rate 0.5 (fresh handoff)
    "mobility-trace": _mobility_trace,  # --mobility-trace (carry handoff)
    "regroup": _regroup,  # --regroup-every 1
    "median": _median,  # --aggregators median,mean[,median]
    "cloud-strategy": _cloud_strategy,  # --cloud-strategy fedavgm
    "kept-state": _kept_state,  # --momentum 0.5 --optimizer-state keep
    "faults": _faults,  # --participation 0.5 --fail-rate 0.2 --straggler-fraction 0.5
}

Pair = tuple[str, str]
PAIRS: list[Pair] = list(itertools.combinations(FEATURES, 2))

#: The pairs refused today, each with the reason docs/hsgd.md gives (same words, same order).
REFUSED: dict[Pair, str] = {
    ("mobility-rate", "mobility-trace"): "no meaning: clients move by a rate or by a trace, "
                                         "not both",
}


# ---------------------------------------------------------------------------- configurations
def settings(features: tuple[str, ...], files: Path, **twists: bool) -> dict[str, Any]:
    """RunConfig keys of a run with ``features`` on (``twists``: see :class:`Shape`)."""
    out = dict(BASE)
    if "three-level" in features:
        out.update(groups=(4, 2), periods=(2, 4, 8))
    if twists.get("one_per_edge"):
        out["groups"] = (out["clients"], *out["groups"][1:])
    shape = Shape(out["groups"][0], len(out["periods"]), files, **twists)
    for name in features:
        out.update(FEATURES[name](shape))
    return out


def flags(values: dict[str, Any]) -> list[str]:
    """The ``fedhier run`` flags of RunConfig keys."""
    argv = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return argv


def is_refused(pair: Pair) -> bool:
    return pair in REFUSED


def running(*needed: str) -> list[Pair]:
    """The pairs not refused that hold every feature in ``needed``."""
    return [p for p in PAIRS if not is_refused(p) and set(needed) <= set(p)]


def pair_id(pair: Pair) -> str:
    return "+".join(pair)


class Runs:
    """Each distinct configuration runs once per module; figures are skipped."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.files.mkdir()
        (self.files / "trace.csv").write_text(TRACE)
        for n in (2, 4, 8):
            (self.files / f"reach{n}.csv").write_text("\n".join([",".join("1" * n)] * n) + "\n")
        self.done: dict[RunConfig, Path] = {}

    def config(self, features: tuple[str, ...], engine: str = "vectorized",
               **twists: bool) -> RunConfig:
        return RunConfig(**settings(features, self.files, **twists), engine=engine)

    def run(self, features: tuple[str, ...], engine: str = "vectorized",
            **twists: bool) -> Path:
        """The run folder of ``features`` on ``engine`` (a refusal raises ConfigError)."""
        cfg = self.config(features, engine, **twists)
        if cfg not in self.done:
            out = self.root / f"run{len(self.done)}"
            run_engine(cfg, RunFolder.create(out, cfg), progress=False)
            self.done[cfg] = out
        return self.done[cfg]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    import fedhier.runs.plots as plots

    with pytest.MonkeyPatch.context() as patch:
        for name in ("plot_runs", "plot_groups", "plot_groups_history"):
            patch.setattr(plots, name, lambda *a, **k: None)
        yield Runs(tmp_path_factory.mktemp("pairs"))


# ---------------------------------------------------------------------------- comparisons
def final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model_final.safetensors"))


class SimSecondsError(AssertionError):
    """Only the simulated clock differs (a strict xfail names it, see EDGE_PERIOD_REDUCTION)."""


def assert_bit_identical(a: Path, b: Path, ignore: frozenset[str] = frozenset()) -> None:
    """Same records (but ``ignore`` and wall_seconds) and the same final model, bit for bit;
    ``sim_seconds`` is compared last, so that :class:`SimSecondsError` means only it."""
    skip = ignore | {"wall_seconds", "sim_seconds"}
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb, strict=True):
        assert {k: v for k, v in ra.items() if k not in skip} == {
            k: v for k, v in rb.items() if k not in skip}, ra["round"]
    fa, fb = final(a), final(b)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    clocks = [(ra["round"], ra.get("sim_seconds"), rb.get("sim_seconds"))
              for ra, rb in zip(ma, mb, strict=True)
              if ra.get("sim_seconds") != rb.get("sim_seconds")]
    if clocks:
        raise SimSecondsError(f"sim_seconds differ (round, a, b): {clocks}")


def max_diff(a: Path, b: Path) -> float:
    fa, fb = final(a), final(b)
    return max(float((fa[k] - fb[k]).abs().max()) for k in fa)


# ---------------------------------------------------------------------------- the matrix
def test_every_pair_of_features_is_in_the_matrix():
    assert len(PAIRS) == len(FEATURES) * (len(FEATURES) - 1) // 2
    assert set(REFUSED) <= set(PAIRS), "REFUSED names a pair in the order of FEATURES"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_alone_runs_on_both_engines_alike(feature, runs):
    vectorized = runs.run((feature,))
    assert_same_runs(runs.run((feature,), "inprocess"), vectorized, TOL)
    assert max_diff(vectorized, runs.run(())) > 1e-4, f"{feature} changes nothing"


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_pair_runs_on_both_engines_alike_or_is_refused(pair, runs, tmp_path, capsys):
    if is_refused(pair):
        try:  # the API refuses ...
            runs.run(pair)
        except ConfigError as exc:
            refusal = str(exc)
        else:
            pytest.fail(f"{pair} runs now: delete it from REFUSED and docs/hsgd.md")
        out = tmp_path / "run"  # ... and the CLI says the same in one line, exit code 2
        code = main(["run", *flags(settings(pair, runs.files)), "--no-progress",
                     "--out", str(out)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and lines == [f"fedhier: error: {refusal}"], (code, lines)
        assert not out.exists()
        return
    try:
        vectorized = runs.run(pair)
    except ConfigError as exc:
        pytest.fail(f"{pair} is refused but not listed in REFUSED: {exc}")
    assert_same_runs(runs.run(pair, "inprocess"), vectorized, TOL)
    for alone in pair:  # without one of the two, the run differs: neither is dropped
        without = tuple(f for f in pair if f != alone)
        assert max_diff(vectorized, runs.run(without)) > 1e-4, f"{alone} changes nothing"


# ---------------------------------------------------------------------------- reductions
@pytest.mark.parametrize("pair", running("async"), ids=pair_id)
def test_async_with_k_equal_n_is_synchronous_bit_for_bit(pair, runs):
    other = tuple(f for f in pair if f != "async")
    k_equal_n = runs.run(pair, async_all=True)
    assert_bit_identical(runs.run(other), k_equal_n,
                         frozenset({"async_reports", "stale_dropped"}))
    stale = [s for r in metrics(runs.run(pair))[1:] for _, s in r["async_reports"]]
    assert max(stale) > 0  # K = N - 1 is asynchronous indeed


#: The pairs whose per-edge periods reduce to none (with moving clients too: the clock sums
#: (down + up) + compute, which is 2 * transfer + compute when every edge's periods agree).
EDGE_PERIOD_REDUCTION = running("edge-periods")


@pytest.mark.parametrize("pair", EDGE_PERIOD_REDUCTION, ids=pair_id)
def test_equal_edge_periods_are_no_edge_periods_bit_for_bit(pair, runs):
    other = tuple(f for f in pair if f != "edge-periods")
    assert_bit_identical(runs.run(other), runs.run(pair, equal_periods=True),
                         frozenset({"edge_aggregations"}))


@pytest.mark.parametrize("pair", running("mobility-rate"), ids=pair_id)
def test_move_rate_zero_is_the_static_run_bit_for_bit(pair, runs):
    other = tuple(f for f in pair if f != "mobility-rate")
    assert_bit_identical(runs.run(other), runs.run(pair, rate_zero=True))


#: Moving clients gather two at an edge: the reduction needs one client per edge throughout.
MEDIAN_REDUCTION = [p for p in running("median")
                    if not {"mobility-rate", "mobility-trace"} & set(p)]


@pytest.mark.parametrize("pair", MEDIAN_REDUCTION, ids=pair_id)
def test_median_with_one_client_per_edge_is_the_mean(pair, runs):
    median = runs.run(pair, one_per_edge=True)
    assert_bit_identical(runs.run(pair, one_per_edge=True, edge_mean=True), median)


# ---------------------------------------------------------------------------- the docs
def section() -> str:
    text = DOCS.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/hsgd.md has no section '{SECTION}'"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def test_the_docs_list_exactly_the_refused_pairs():
    """The section's table | `a` | `b` | reason | is REFUSED, reasons word for word."""
    rows = re.findall(r"^\|\s*`([\w-]+)`\s*\|\s*`([\w-]+)`\s*\|\s*(.+?)\s*\|\s*$",
                      section(), re.MULTILINE)
    assert {(a, b): reason for a, b, reason in rows} == REFUSED
    assert len(rows) == len(REFUSED)


def test_the_docs_name_every_feature_of_the_matrix():
    """The section's table | `feature` | settings | names FEATURES, in their order."""
    names = re.findall(r"^\|\s*`([\w-]+)`\s*\|\s*`--", section(), re.MULTILINE)
    assert names == list(FEATURES)
