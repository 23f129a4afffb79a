"""The robust aggregators against values computed by hand on tiny matrices, and the rules
through the hierarchy and on both simulation engines."""

import numpy as np
import pytest
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.aggregators.averaging import aggregator
from fedhier.round.loop import aggregate_levels
from fedhier.tree.hierarchy import Hierarchy

ONE = torch.zeros(5, dtype=torch.int64)
W5 = torch.ones(5, dtype=torch.float64)


def _apply(name, values, weights=W5, segments=ONE, num_segments=1, reference=None):
    return aggregator(name).apply(values, weights, segments, num_segments, reference)


def test_trimmed_mean_closed_form():
    # per column, sorted: [-4, 0, 1, 2, 9] and [1, 2, 3, 50, 60]; b = floor(0.2 * 5) = 1
    x = torch.tensor([[1.0, 60.0], [-4.0, 2.0], [9.0, 3.0], [0.0, 50.0], [2.0, 1.0]],
                     dtype=torch.float64)
    out = _apply("trimmed-mean", {"w": x})["w"]
    assert out.tolist() == [[1.0, (2.0 + 3.0 + 50.0) / 3]]
    # b = floor(0.4 * 5) = 2: the median; b = 0: the plain mean
    assert _apply("trimmed-mean:0.4", {"w": x})["w"].tolist() == [[1.0, 3.0]]
    assert _apply("trimmed-mean:0", {"w": x})["w"].tolist() == [[1.6, 23.2]]
    two = torch.tensor([0, 0, 1, 1, 1])  # two segments: k = 2 cuts nothing, k = 3 none (0.2)
    out = _apply("trimmed-mean", {"w": x}, segments=two, num_segments=2)["w"]
    assert out.tolist() == [[-1.5, 31.0], [11.0 / 3, 18.0]]


def test_clip_closed_form():
    # start model r = (1, 1); updates (3, 4) norm 5, (0, 1) norm 1, (0, -2) norm 2,
    # (6, 8) norm 10, (0, 0) norm 0: median norm 2
    r = {"a": torch.tensor([[1.0]], dtype=torch.float64),
         "b": torch.tensor([[1.0]], dtype=torch.float64)}
    d = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, -2.0], [6.0, 8.0], [0.0, 0.0]],
                     dtype=torch.float64)
    models = {"a": (1 + d[:, :1]), "b": (1 + d[:, 1:])}
    w = torch.tensor([1.0, 2.0, 1.0, 1.0, 5.0], dtype=torch.float64)
    # clip:1x -> tau = 2: (1.2, 1.6), (0, 1), (0, -2), (1.2, 1.6), (0, 0); weights sum 10
    out = _apply("clip", models, weights=w, reference=r)
    expect_a = 1 + (1.2 + 0 + 0 + 1.2 + 0) / 10
    expect_b = 1 + (1.6 + 2 * 1 - 2 + 1.6 + 0) / 10
    assert out["a"].item() == pytest.approx(expect_a, abs=1e-15)
    assert out["b"].item() == pytest.approx(expect_b, abs=1e-15)
    # a fixed bound 1: (0.6, 0.8), (0, 1), (0, -1), (0.6, 0.8), (0, 0)
    out = _apply("clip:1", models, weights=w, reference=r)
    assert out["a"].item() == pytest.approx(1 + 1.2 / 10, abs=1e-15)
    assert out["b"].item() == pytest.approx(1 + (0.8 + 2 - 1 + 0.8) / 10, abs=1e-15)
    # a bound no update reaches: the weighted mean itself
    out = _apply("clip:100", models, weights=w, reference=r)
    mean = (d * w[:, None]).sum(0) / w.sum()
    assert out["a"].item() == pytest.approx(1 + mean[0].item(), abs=1e-15)


def test_krum_and_multi_krum_closed_form():
    # five 1-D members 0, 1, 2, 3, 100 (f = 1: k - f - 2 = 2 nearest neighbours)
    # scores: 0 -> 1 + 4 = 5; 1 -> 1 + 1 = 2; 2 -> 1 + 1 = 2; 3 -> 1 + 4 = 5;
    # 100 -> 97^2 + 98^2. Krum: the lowest score, ties to the lower index: member 1 -> 1.0
    x = {"w": torch.tensor([[0.0], [1.0], [2.0], [3.0], [100.0]])}
    assert _apply("krum", x)["w"].tolist() == [[1.0]]
    # multi-Krum keeps k - f = 4: members 1, 2, 0, 3 (scores 2, 2, 5, 5), weighted mean
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 1000.0], dtype=torch.float64)
    out = _apply("multi-krum", x, weights=w)["w"].item()
    assert out == pytest.approx((0 * 1 + 1 * 2 + 2 * 3 + 3 * 4) / 10, abs=1e-6)
    # f = 2: keeps 3 of scores with 1 neighbour: 0 -> 1, 1 -> 1, 2 -> 1, 3 -> 1, 100 -> 97^2
    out = _apply("multi-krum:2", x, weights=w)["w"].item()
    assert out == pytest.approx((0 * 1 + 1 * 2 + 2 * 3) / 6, abs=1e-6)
    # the whole model decides: member 4 is an outlier only in array "v"
    two = {"w": torch.tensor([[0.0], [1.0], [2.0], [3.0], [1.5]]),
           "v": torch.tensor([[0.0], [0.0], [0.0], [0.0], [50.0]])}
    assert _apply("multi-krum", two)["v"].item() == 0.0


def test_rule_names_and_parameters_are_checked():
    for bad, message in [("trimmed-mean:0.5", r"\[0, 0.5\)"), ("clip:-1", "positive"),
                         ("clip:ax", "not a number"), ("krum:1.5", "whole number"),
                         ("median:3", "takes no parameter"), ("mode", "unknown aggregator"),
                         ("krum:nan", "not a finite number"), ("krum:inf", "finite"),
                         ("multi-krum:1e400", "finite"), ("clip:infx", "finite")]:
        with pytest.raises(ConfigError, match=message):
            aggregator(bad)


def test_a_non_finite_krum_parameter_is_a_user_error(tmp_path, capsys):
    """``fedhier run --aggregators krum:nan`` (or inf, 1e400): one line, exit 2 (not 4)."""
    from fedhier.cli.commands import main

    for bad in ("krum:nan", "multi-krum:1e400"):
        assert main(["run", "--aggregators", bad, "--out", str(tmp_path / bad),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert "not a finite number" in err and "\n" not in err, err


def test_clip_at_every_level_uses_each_node_s_start_model():
    """Three levels, clip everywhere: level by level with each node's own start model
    (``reference``), equal to composing the closed form by hand."""
    hierarchy = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 1]), np.array([0, 0])))
    start = {1: torch.tensor([[0.0], [10.0]], dtype=torch.float64),
             2: torch.tensor([[5.0]], dtype=torch.float64)}
    models = {"w": torch.tensor([[1.0], [3.0], [10.0], [14.0]], dtype=torch.float64)}
    survivors = np.arange(4)

    def reference(level, nodes):
        return {"w": start[level].index_select(0, torch.as_tensor(nodes))}

    out, nodes = aggregate_levels(models, survivors, np.ones(4), hierarchy, 2,
                                  ("clip:1.5",), reference)
    # edge 0: updates 1, 3 -> 1, 1.5 -> 0 + 1.25; edge 1: 0, 4 -> 0, 1.5 -> 10.75
    # cloud from 5: updates -3.75, 5.75 -> -1.5, 1.5, weights 2 and 2 -> 5.0
    assert nodes.tolist() == [0] and out["w"].item() == pytest.approx(5.0, abs=1e-15)
    edges, _ = aggregate_levels(models, survivors, np.ones(4), hierarchy, 1,
                                ("clip:1.5",), reference)
    assert edges["w"].flatten().tolist() == pytest.approx([1.25, 10.75], abs=1e-15)
    with pytest.raises(ConfigError, match="aggregator 'clip' needs each node's start model"):
        aggregate_levels(models, survivors, np.ones(4), hierarchy, 1, ("clip",))
