"""fedhier/round/aggregators/averaging.py, value by value: the mutants `make mutation` left alive.

Hand-worked means, medians, presence weights, tile shapes and the exact messages of every
refused rule name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhier.round.aggregators.averaging import (
    AGGREGATE_BLOCK,
    AGGREGATORS,
    Aggregator,
    _tiles,
    aggregator,
    check_aggregators,
    client_weights,
    median_aggregate,
    occupied_segments,
    presence_weights,
    segment_weighted_mean,
)
from tests.helpers import assert_refused as refused


def test_segment_weighted_mean_by_hand():
    # segment 0: rows 0, 2 with weights 1, 3; segment 1: row 1 (weight 2); shape [3, 2, 1]
    values = torch.tensor([[[1.0], [2.0]], [[5.0], [7.0]], [[3.0], [-2.0]]])
    out = segment_weighted_mean(values, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 0]),
                                2)
    assert out.dtype == torch.float32 and out.shape == (2, 2, 1)
    assert out.flatten().tolist() == [2.5, -1.0, 5.0, 7.0]
    refused(lambda: segment_weighted_mean(values, torch.tensor([1.0, 0.0, 1.0]),
                                           torch.tensor([0, 1, 0]), 2),
             "segment_weighted_mean: a segment has zero total weight", ValueError)
    refused(lambda: segment_weighted_mean(values, torch.ones(3), torch.tensor([0, 0, 0]), 2),
             "segment_weighted_mean: a segment has zero total weight", ValueError)


def test_tile_shapes_by_hand():
    b = AGGREGATE_BLOCK  # 2**18
    assert b == 2**18
    assert _tiles(1, 10**6, 1) == (b, 1)              # one member: a whole block of columns
    assert _tiles(0, 10**6, 1) == (b, 1)              # no member counts as one
    assert _tiles(4, 10**6, 32) == (b // 4, 4)        # 16 * b / 32 = b / 2 > b / 4
    assert _tiles(1, 10**6, 32) == (b // 2, 2)        # the float64 sum cap: 16 tiles
    assert _tiles(1, 100, 2**23) == (1, b)            # 16 * b // 2**23 = 0 -> one column
    assert _tiles(1, 100, 0) == (100, b // 100)       # no segment counts as one
    assert _tiles(5, 0, 1) == (1, b)                  # no columns: one (empty) column


def test_occupied_segments():
    occupied, compact = occupied_segments(np.array([3, 0, 3, 4]), 6)
    assert occupied.tolist() == [0, 3, 4] and compact.tolist() == [1, 0, 1, 2]
    assert compact.dtype == np.int64
    occupied, compact = occupied_segments(np.array([1, 0]), 2)
    assert occupied.tolist() == [0, 1] and compact.tolist() == [1, 0]


def test_client_weights():
    uniform = client_weights("uniform", np.array([3, 5]))
    samples = client_weights("samples", np.array([3, 5]))
    assert uniform.tolist() == [1.0, 1.0] and uniform.dtype == np.float64
    assert samples.tolist() == [3.0, 5.0] and samples.dtype == np.float64
    refused(lambda: client_weights("rows", np.array([3])), "unknown weighting 'rows'",
             ValueError)


def test_presence_weights_by_hand():
    weights = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    edges = np.array([0, 0, 1, 1, 3])  # edge 2 has no client
    # edge 0: W = 3, present client 0 (S = 1) -> 1 * 3; edge 1: none present -> drops out;
    # edge 3: its only client present -> 5 (factor 1)
    out = presence_weights(weights, np.array([True, False, False, False, True]), edges)
    assert out.tolist() == [3.0, 0.0, 0.0, 0.0, 5.0]
    # edge 1: W = 7, S = 4 -> 4 * 7 / 4 = 7
    out = presence_weights(weights, np.array([False, True, False, True, False]), edges)
    assert out.tolist() == [0.0, 3.0, 0.0, 7.0, 0.0]
    # a present client of weight 0, alone present at its edge (S_e = 0): weight 0, not nan
    out = presence_weights(np.array([0.0, 2.0]), np.array([True, False]), np.array([0, 0]))
    assert out.tolist() == [0.0, 0.0]
    tenths = np.array([0.1, 0.2, 0.7])  # every client present: w exactly, not w * 1.000...
    assert presence_weights(tenths, np.ones(3, bool), np.array([0, 0, 0])).tolist() == \
        [0.1, 0.2, 0.7]


def test_median_by_hand():
    values = torch.tensor([[1.0, 9.0], [4.0, 2.0], [2.0, 5.0], [8.0, 0.0], [6.0, 3.0]])
    segments = torch.tensor([0, 0, 0, 1, 1])
    out = median_aggregate(values, torch.ones(5), segments, 2)
    # segment 0: [1, 4, 2] -> 2, [9, 2, 5] -> 5; segment 1 (even): [8, 6] -> 7, [0, 3] -> 1.5
    assert out.tolist() == [[2.0, 5.0], [7.0, 1.5]] and out.dtype == torch.float32
    tenth = torch.tensor([[0.1], [0.3], [0.2]], dtype=torch.float64)  # float64 kept as is
    out = median_aggregate(tenth, torch.ones(3), torch.zeros(3, dtype=torch.int64), 1)
    assert out.dtype == torch.float64 and out.item() == 0.2
    four = torch.tensor([[4.0], [1.0], [10.0], [2.0]])
    assert median_aggregate(four, torch.ones(4), torch.zeros(4, dtype=torch.int64),
                            1).tolist() == [[3.0]]
    refused(lambda: median_aggregate(values, torch.ones(5), segments, 3),
             "median_aggregate: a segment has no members", ValueError)


def test_rule_table():
    assert [(name, rule.linear, rule.needs_reference) for name, rule in AGGREGATORS.items()] \
        == [("mean", True, False), ("median", False, False), ("trimmed-mean", False, False),
            ("clip", False, True), ("krum", False, False), ("multi-krum", False, False)]
    assert aggregator("median").name == "median"
    assert aggregator("trimmed-mean:0.1").name == "trimmed-mean:0.1"
    assert aggregator("clip:2x").needs_reference
    # built at run time from a parameter: never linear (False itself, as the table's)
    for name in ("trimmed-mean:0.1", "clip:2", "krum:2", "multi-krum:0"):
        assert aggregator(name).linear is False, name


def test_defaults_are_their_documented_parameters():
    x = {"w": torch.tensor([[1.0], [-4.0], [9.0], [0.0], [2.0], [30.0], [7.0], [5.0], [3.0],
                            [6.0]], dtype=torch.float64)}
    ones, seg = torch.ones(10, dtype=torch.float64), torch.zeros(10, dtype=torch.int64)
    ref = {"w": torch.zeros(1, 1, dtype=torch.float64)}
    for base, explicit in [("trimmed-mean", "trimmed-mean:0.2"), ("clip", "clip:1x"),
                           ("krum", "krum:1"), ("multi-krum", "multi-krum:1")]:
        assert aggregator(base).apply(x, ones, seg, 1, ref)["w"].tolist() == \
            aggregator(explicit).apply(x, ones, seg, 1, ref)["w"].tolist()
    by_hand = {
        # cut 2 of 10 at each end: mean of 1, 2, 3, 5, 6, 7
        "trimmed-mean": 4.0,
        # median |update| = (4 + 5) / 2 = 4.5: 1 - 4 + 4.5 + 0 + 2 + 4.5 * 4 + 3 = 24.5, / 10
        "clip": 2.45,
        # f = 1: the sum of squares to the 7 nearest; 5 -> 1+4+4+9+16+16+25 = 75, 3 -> 79
        "krum": 5.0,
        # keeps k - f = 9: all but 30 -> 29 / 9
        "multi-krum": 29 / 9,
    }
    for base, value in by_hand.items():
        assert aggregator(base).apply(x, ones, seg, 1, ref)["w"].item() == \
            pytest.approx(value, abs=1e-12)


def test_apply_paths():
    x = {"a": torch.tensor([[1.0], [3.0]]), "b": torch.tensor([[2.0, 4.0], [6.0, 8.0]])}
    w, seg = torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([0, 0])
    out = aggregator("mean").apply(x, w, seg, 1)
    assert out["a"].tolist() == [[2.5]] and out["b"].tolist() == [[5.0, 7.0]]
    refused(lambda: aggregator("clip:2").apply(x, w, seg, 1),
             "aggregator 'clip:2' needs each node's start model, which this path does not "
             "provide")
    seen = []
    rule = Aggregator(None, linear=False,
                      model_function=lambda v, ww, s, n, r: seen.append(r) or {"a": v["a"]})
    assert rule.apply(x, w, seg, 1, {"r": 1}) == {"a": x["a"]} and seen == [{"r": 1}]


@pytest.mark.parametrize("name, message", [
    ("mode", "unknown aggregator 'mode'; choose one of mean, median, trimmed-mean, clip, krum, "
             "multi-krum"),
    ("mean:1", "aggregator 'mean' takes no parameter, got 'mean:1'"),
    ("trimmed-mean:0.5", "trimmed-mean:0.5: the fraction cut at each end must be in [0, 0.5)"),
    ("trimmed-mean:-0.1",
     "trimmed-mean:-0.1: the fraction cut at each end must be in [0, 0.5)"),
    ("trimmed-mean:x", "aggregator trimmed-mean: 'x' is not a number"),
    ("clip:0", "clip:0: the bound must be positive (a norm, or Cx for C times the median "
               "norm)"),
    ("clip:-2x", "clip:-2x: the bound must be positive (a norm, or Cx for C times the median "
                 "norm)"),
    ("clip:ax", "aggregator clip: 'a' is not a number"),
    ("clip:infx", "aggregator clip: 'inf' is not a finite number"),
    ("krum:1.5", "krum:1.5: f (hostile members per node) must be a whole number >= 0"),
    ("multi-krum:-1", "krum:-1: f (hostile members per node) must be a whole number >= 0"),
    ("krum:nan", "aggregator krum: 'nan' is not a finite number"),
])
def test_refused_rule_names(name, message):
    refused(lambda: aggregator(name), message)


def test_accepted_rule_edges():
    for name in ("trimmed-mean:0", "trimmed-mean:0.49", "clip:0.001", "clip:0.5x", "krum:0",
                 "multi-krum:2"):
        assert aggregator(name).name == name


def test_check_aggregators():
    assert check_aggregators(("mean",), 3) is None
    assert check_aggregators(("mean", "median", "krum"), 3) is None
    refused(lambda: check_aggregators(("mean", "median"), 3),
             "aggregators: give one name for every level or 3 (edge ... cloud), got 2: "
             "mean,median")
    refused(lambda: check_aggregators(("mean", "mode"), 2),
             "unknown aggregator 'mode'; choose one of mean, median, trimmed-mean, clip, krum, "
             "multi-krum")
