"""Tests written against the survivors of `python scripts/mutation.py stale_reports`
(docs/testing.md, "Mutation"): the rule's start models (``clip``) for stale reports on both
ways of computing, a job's clients grouped by the job and not the grouping, and the device
the merged model is made on. Closed cases, no training."""

import math

import numpy as np
import pytest
import torch

from fedhier.round.asynchrony.edges import EdgeTraining
from fedhier.round.asynchrony.reports import merge_reports
from fedhier.round.asynchrony.rules import SHIFTED_MEAN
from fedhier.tree.hierarchy import Hierarchy

W = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
BASE = torch.tensor([0.1, 0.3, -0.7], dtype=torch.float64)  # a stale report's start model
X = torch.tensor([[1.0, 2.0, 0.5], [3.0, -1.0, 1.5], [0.25, 4.0, -2.0], [-1.0, 0.5, 0.0],
                  [2.0, 2.0, 2.0], [0.0, -3.0, 1.0]], dtype=torch.float64)
REF = torch.tensor([[0.2, 0.1, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)  # edges' starts
WEIGHTS = np.array([1.0, 3.0, 2.0, 2.0, 1.0, 4.0])
TREE = Hierarchy(periods=(1, 2), parents=(np.array([0, 0, 0, 1, 1, 1]),))


def _node_models(level, nodes):
    return {"p": W.unsqueeze(0).repeat(len(nodes), 1)}


def _jobs(stale: int, shifted: bool = False):
    """Edge 0's report, ``stale`` aggregations old (``shifted``: the same report written as
    a fresh one, its models and start moved by w - base), and edge 1's fresh report."""
    d = (W - BASE) if shifted else torch.zeros(3, dtype=torch.float64)
    old = EdgeTraining(0, 0, {"p": W.clone() if shifted else BASE}, 1.0, {"p": X[:3] + d},
                  np.array([0, 1, 2]), np.array([0, 1, 2]), {"p": REF[0] + d})
    new = EdgeTraining(1, 3, {"p": W.clone()}, 1.0, {"p": X[3:]}, np.array([3, 4, 5]),
                  np.array([3, 4, 5]), {"p": REF[1]})
    return [(old, 0 if shifted else stale), (new, 0)]


@pytest.mark.parametrize("above", ["mean", "median"])  # the linear way and the moved one
def test_clip_measures_a_stale_report_from_its_moved_start(above):
    """A stale report with clip at the edges = the same report moved by w - base and made
    fresh, its clients' weights times 1/sqrt(1 + s) (the shifted mean renormalises them):
    clip(x + d; r + d) = clip(x; r) + d."""
    rules = ("clip:0.5x", above)
    stale = merge_reports(_jobs(3), {"p": W}, WEIGHTS, TREE, rules, _node_models,
                          rule=SHIFTED_MEAN)
    factor = np.array([1 / math.sqrt(4)] * 3 + [1.0] * 3)
    fresh = merge_reports(_jobs(3, shifted=True), {"p": W}, WEIGHTS * factor, TREE, rules,
                          _node_models, rule=SHIFTED_MEAN)
    assert stale is not None and fresh is not None
    torch.testing.assert_close(stale["p"], fresh["p"], rtol=1e-12, atol=1e-12)
    unclipped = merge_reports(_jobs(3), {"p": W}, WEIGHTS, TREE, ("mean", above),
                              _node_models, rule=SHIFTED_MEAN)
    assert unclipped is not None
    assert float((unclipped["p"] - stale["p"]).abs().max()) > 1e-3  # clip acts here


def test_a_job_groups_its_clients_by_the_job_not_by_the_grouping():
    """Client 2 trained in edge 0's job though the grouping now has it at edge 1: the median
    at the edges takes it with edge 0's clients."""
    moved_tree = TREE.with_edge_map(np.array([0, 0, 1, 1, 1, 1]))
    rules = ("median", "mean")
    want = merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, rules, _node_models)
    got = merge_reports(_jobs(2), {"p": W}, WEIGHTS, moved_tree, rules, _node_models)
    assert want is not None and got is not None
    torch.testing.assert_close(got["p"], want["p"], rtol=0, atol=0)


def test_the_merged_model_is_made_where_the_models_are():
    """Under another default device (meta) the merge still indexes and returns CPU tensors."""
    want = merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, ("median", "mean"), _node_models)
    jobs = _jobs(2)
    with torch.device("meta"):
        got = merge_reports(jobs, {"p": W}, WEIGHTS, TREE, ("median", "mean"),
                            lambda level, nodes: {})
    assert want is not None and got is not None
    assert got["p"].device.type == "cpu"
    torch.testing.assert_close(got["p"], want["p"], rtol=0, atol=0)


def test_a_rule_above_the_edges_measures_from_the_nodes_models():
    """clip at the cloud measures the edges' aggregates from the model node_models gives for
    the cloud (level 2, node 0), not from an edge's start."""
    calls = []

    def node_models(level, nodes):
        calls.append((level, nodes.tolist()))
        return {"p": W.unsqueeze(0).repeat(len(nodes), 1)}

    rules = ("mean", "clip:0.5x")
    got = merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, rules, node_models)
    assert calls and all(call == (2, [0]) for call in calls)
    far = merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, rules,
                        lambda level, nodes: {"p": (W + 10).repeat(len(nodes), 1)})
    assert got is not None and far is not None
    assert float((got["p"] - far["p"]).abs().max()) > 1e-3


class _Exploding:
    """A cloud step whose update is not finite (its ``strategy`` names it in the error)."""

    class strategy:  # noqa: N801 - stands for a Flower strategy instance's class
        pass

    strategy = strategy()

    def step(self, cloud_round, children, weights):
        return {"p": torch.full((3,), float("nan"), dtype=torch.float64)}


def test_a_cloud_step_that_makes_the_model_non_finite_stops_the_run_in_one_line():
    from fedhier.round.faults import RunFailureError

    with pytest.raises(RunFailureError) as caught:
        merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, ("mean", "mean"), _node_models,
                      _Exploding(), cloud_round=7)
    assert str(caught.value) == (
        "the cloud step (strategy) made the global model non-finite in cloud round 7; lower "
        "--server-lr or use --cloud-strategy average")


def test_a_report_without_its_start_model_is_a_clear_error():
    jobs = _jobs(2)
    jobs[0][0].reference = None
    with pytest.raises(ValueError) as caught:
        merge_reports(jobs, {"p": W}, WEIGHTS, TREE, ("clip:0.5x", "mean"), _node_models)
    assert str(caught.value) == "a report without the model its rule needs (a job's reference)"


class _PlainStep:
    """A cloud step that is not a Flower strategy's (no ``strategy``): the error names it."""

    def step(self, cloud_round, children, weights):
        return {"p": torch.full((3,), float("inf"), dtype=torch.float64)}


def test_the_error_names_a_plain_cloud_step_by_its_own_class():
    from fedhier.round.faults import RunFailureError

    with pytest.raises(RunFailureError, match=r"^the cloud step \(_PlainStep\) made"):
        merge_reports(_jobs(2), {"p": W}, WEIGHTS, TREE, ("mean", "mean"), _node_models,
                      _PlainStep(), cloud_round=2)


# --------------------------------------------------------------------------- staleness.py
def test_async_settings_check_their_bounds_exactly():
    from fedhier.common.errors import ConfigError
    from fedhier.round.asynchrony.settings import AsyncEdges

    AsyncEdges(2, 0).check(4)  # S = 0 and K = N are allowed
    AsyncEdges(4, 0).check(4)
    AsyncEdges(0, 0, (0,)).check(4)  # 0 = all of a node's children
    for bad, message in [(AsyncEdges(-1, 4), "async_buffer and max_staleness must be >= 0, "
                                             "got -1 and 4"),
                         (AsyncEdges(1, -1), "async_buffer and max_staleness must be >= 0, "
                                             "got 1 and -1"),
                         (AsyncEdges(0, 4, (1, -2)), "region_buffer must be >= 0 at every "
                                                     "level, got 1,-2")]:
        with pytest.raises(ConfigError) as caught:
            bad.check(4)
        assert str(caught.value) == message
    AsyncEdges(9, 4, (1,)).check(4)  # with regions the cloud's K is checked against the tree


def test_region_buffers_check_the_tree_exactly():
    from fedhier.common.errors import ConfigError
    from fedhier.round.asynchrony.settings import AsyncEdges, check_region_buffers

    check_region_buffers(AsyncEdges(2, 4, (2,)), (4, 2))  # K = the children, K = regions
    check_region_buffers(AsyncEdges(1, 4, (3, 1)), (12, 4, 2))
    check_region_buffers(AsyncEdges(3), (4,))  # no regions: nothing to check here
    cases = [
        (AsyncEdges(0, 4, (1,)), (4,), "region_buffer needs a tree of 3+ levels (--groups "
         "N,R): with two levels no node lies between the edges and the cloud"),
        (AsyncEdges(0, 4, (1,)), (8, 4, 2), "region_buffer takes one K per level between the "
         "edges and the cloud: 2 for groups 8,4,2, got 1"),
        (AsyncEdges(0, 4, (3,)), (4, 2), "region_buffer K=3 at level 2 is more than the 2 "
         "children a node of that level may have (4 under 2); it would wait for reports that "
         "never come"),
        (AsyncEdges(0, 4, (1, 3)), (12, 4, 2), "region_buffer K=3 at level 3 is more than the "
         "2 children a node of that level may have (4 under 2); it would wait for reports "
         "that never come"),
        (AsyncEdges(3, 4, (1,)), (4, 2), "async_buffer K=3 is more than the cloud's 2 "
         "children; with region_buffer the cloud counts its children's reports"),
        (AsyncEdges(3, 4, (1, 1)), (12, 6, 2), "async_buffer K=3 is more than the cloud's 2 "
         "children; with region_buffer the cloud counts its children's reports"),
    ]
    for settings, groups, message in cases:
        with pytest.raises(ConfigError) as caught:
            check_region_buffers(settings, groups)
        assert str(caught.value) == message
