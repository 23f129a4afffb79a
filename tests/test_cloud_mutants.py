"""Exact values of the round's cloud part (fedhier/round/cloud.py), case by case: the tests
written against its mutation survivors (docs/testing.md, "Mutation testing").

Three clients under two edges under the cloud (clients 0, 1 at edge 0, client 2 at edge 1);
the averages below are worked out by hand, and a recording cloud step shows what the cloud
step is given."""

import numpy as np
import pytest
import torch

from fedhier.round.cloud import cloud_update, cloud_update_of_children, step_name, step_on
from fedhier.round.faults import RunFailureError
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import assert_refused

I64 = np.int64
F64 = torch.float64
TREE = Hierarchy((1, 2), (np.array([0, 0, 1], dtype=I64),))
#: clients 0..3 -> edges 0, 0, 1, 2 -> regions 0, 0, 1
DEEP = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 2], dtype=I64), np.array([0, 0, 1], dtype=I64)))


def col(values: list[float]) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[v] for v in values], dtype=F64, device="cpu")}


def no_reference(level, nodes):
    raise AssertionError("the mean needs no start model")


class Step:
    """A cloud step that records its calls and returns a fixed global model."""

    def __init__(self, result: dict[str, torch.Tensor]) -> None:
        self.result = result
        self.calls: list = []

    def begin(self, cloud_round, global_params, num_children) -> None:
        raise AssertionError("the round begins the step, not the cloud update")

    def step(self, cloud_round, children, child_weights):
        self.calls.append((cloud_round, {k: v["w"].tolist() for k, v in children.items()},
                           dict(child_weights)))
        assert all(type(k) is int for k in children) and all(type(k) is int and type(w) is
                                                             float for k, w in
                                                             child_weights.items())
        return self.result


def test_without_a_step_the_cloud_averages_every_survivor_by_weight():
    models = col([1.0, 3.0, 8.0])
    out, nodes = cloud_update(None, 2, models, np.arange(3), np.array([1.0, 1.0, 2.0]), TREE,
                              ("mean",), no_reference)
    assert out["w"].tolist() == [[5.0]] and nodes.tolist() == [0]  # (1 + 3 + 16) / 4
    # the top level's own rule: the median of the edges' means 2 and 8
    out, _ = cloud_update(None, 2, models, np.arange(3), np.array([1.0, 1.0, 2.0]), TREE,
                          ("mean", "median"), no_reference)
    assert out["w"].tolist() == [[5.0]]
    out, _ = cloud_update(None, 2, col([1.0, 8.0]), np.array([1, 2]), np.array([1.0, 3.0, 1.0]),
                          TREE, ("mean",), no_reference)
    assert out["w"].tolist() == [[2.75]]  # clients 1 (weight 3) and 2: (3 + 8) / 4


def test_a_step_gets_the_children_s_aggregates_and_their_survivors_total_weights():
    step = Step({"w": torch.tensor([7.0], dtype=F64)})
    out, nodes = cloud_update(step, 4, col([1.0, 3.0, 8.0]), np.arange(3),
                              np.array([1.0, 3.0, 2.0]), TREE, ("mean",), no_reference)
    # edge 0: (1 + 9) / 4 = 2.5 with weight 4; edge 1: 8 with weight 2
    assert step.calls == [(4, {0: [2.5], 1: [8.0]}, {0: 4.0, 1: 2.0})]
    assert out["w"].tolist() == [[7.0]] and nodes.dtype == I64 and nodes.tolist() == [0]
    # an edge without a survivor is left out
    step = Step({"w": torch.tensor([7.0], dtype=F64)})
    cloud_update(step, 5, col([8.0]), np.array([2]), np.array([1.0, 3.0, 2.0]), TREE,
                 ("mean",), no_reference)
    assert step.calls == [(5, {1: [8.0]}, {1: 2.0})]
    step = Step({"w": torch.tensor([7.0], dtype=F64)})
    cloud_update(step, 5, col([3.0]), np.array([1]), np.array([1.0, 3.0, 2.0]), TREE,
                 ("mean",), no_reference)
    assert step.calls == [(5, {0: [3.0]}, {0: 3.0})]


def test_on_three_levels_the_step_gets_the_regions():
    step = Step({"w": torch.tensor([0.0], dtype=F64)})
    # region 0: clients 0, 1, 2 (weights 1, 1, 2) -> (1 + 3 + 16) / 4; region 1: client 3
    cloud_update(step, 1, col([1.0, 3.0, 8.0, 4.0]), np.arange(4),
                 np.array([1.0, 1.0, 2.0, 5.0]), DEEP, ("mean",), no_reference)
    assert step.calls == [(1, {0: [5.0], 1: [4.0]}, {0: 4.0, 1: 5.0})]
    step = Step({"w": torch.tensor([0.0], dtype=F64)})
    cloud_update(step, 1, col([1.0, 3.0, 8.0, 4.0]), np.arange(4),
                 np.array([1.0, 1.0, 2.0, 5.0]), DEEP, ("median",), no_reference)
    # medians: edge 0 of 1, 3 = 2, edge 1 = 8; region 0 the median of 2 and 8 = 5
    assert step.calls == [(1, {0: [5.0], 1: [4.0]}, {0: 4.0, 1: 5.0})]


def test_a_non_finite_global_model_from_the_step_stops_the_run_naming_it():
    class FedSomething(Step):
        pass

    for bad in (float("nan"), float("inf")):
        step = FedSomething({"w": torch.tensor([1.0, bad], dtype=F64),
                             "b": torch.tensor([0.0], dtype=F64)})
        assert_refused(lambda step=step: step_on(step, 6, col([1.0]), np.array([0]),
                                                 np.array([1.0])),
                       "the cloud step (FedSomething) made the global model non-finite in "
                       "cloud round 6; lower --server-lr or use --cloud-strategy average",
                       RunFailureError, exact=True)
    # one finite array does not excuse another
    step = FedSomething({"b": torch.tensor([0.0], dtype=F64),
                         "w": torch.tensor([1.0, float("nan")], dtype=F64)})
    with pytest.raises(RunFailureError):
        step_on(step, 6, col([1.0]), np.array([0]), np.array([1.0]))


def test_step_name_is_the_wrapped_strategy_s_class():
    class Wrapper:
        def __init__(self) -> None:
            self.strategy = Step({})

    assert step_name(Wrapper()) == "Step" and step_name(Step({})) == "Step"


def test_the_children_s_update_without_a_step_uses_the_top_level_s_rule():
    top = col([5.0])
    children = col([2.0, 8.0])
    weights = np.array([1.0, 3.0])
    out, nodes = cloud_update_of_children(None, 3, children, np.array([0, 2]), weights,
                                          ("median", "mean"), top)
    assert out["w"].tolist() == [[6.5]]  # (2 + 24) / 4
    assert nodes.dtype == I64 and nodes.tolist() == [0]
    out, _ = cloud_update_of_children(None, 3, children, np.array([0, 2]), weights,
                                      ("mean", "median"), top)
    assert out["w"].tolist() == [[5.0]]
    # clip measures from the global model before: updates -3, +3 -> -1, +1, mean 0.5
    out, _ = cloud_update_of_children(None, 3, children, np.array([0, 2]), weights,
                                      ("clip:1",), top)
    assert out["w"].tolist() == [[5.5]]


def test_the_children_s_update_with_a_step():
    step = Step({"w": torch.tensor([9.0], dtype=F64)})
    out, nodes = cloud_update_of_children(step, 3, col([2.0, 8.0]), np.array([1, 4]),
                                          np.array([1.5, 3.0]), ("mean",), col([5.0]))
    assert step.calls == [(3, {1: [2.0], 4: [8.0]}, {1: 1.5, 4: 3.0})]
    assert out["w"].tolist() == [[9.0]] and nodes.tolist() == [0]


def test_the_part_makes_its_tensors_on_the_models_device():
    """Under another default device (meta) every tensor the part makes names the models'
    device (a GPU run's models stay on the GPU)."""
    children, top, step = col([2.0, 8.0]), col([5.0]), Step({"w": torch.tensor([9.0])})
    with torch.device("meta"):
        out, _ = cloud_update_of_children(None, 3, children, np.array([0, 2]),
                                          np.array([1.0, 3.0]), ("mean",), top)
        stepped, _ = step_on(step, 3, children, np.array([0, 2]), np.array([1.0, 3.0]))
    assert out["w"].device.type == "cpu" and out["w"].tolist() == [[6.5]]
    assert stepped["w"].device.type == "cpu" and stepped["w"].tolist() == [[9.0]]


def test_rules_that_measure_from_a_start_model_get_the_nodes_models():
    asked = []

    def reference(level, nodes):
        asked.append((level, nodes.tolist()))
        return {"w": torch.tensor([[0.0], [10.0]], dtype=F64)[:len(nodes)] if level == 1
                else torch.tensor([[4.0]], dtype=F64)}

    # edges' means 2 and 8 (weights 2, 2); the cloud clips from 4: updates -2, 4 -> -1, 1
    out, _ = cloud_update(None, 2, col([1.0, 3.0, 8.0]), np.arange(3),
                          np.array([1.0, 1.0, 2.0]), TREE, ("mean", "clip:1"), reference)
    assert out["w"].tolist() == [[4.0]] and asked == [(2, [0])]
    # with a step: the edges clip from their models 0 and 10: updates 1, 3 -> 1, 1 and -2 -> -1
    step = Step({"w": torch.tensor([0.0], dtype=F64)})
    asked.clear()
    cloud_update(step, 2, col([1.0, 3.0, 8.0]), np.arange(3), np.array([1.0, 1.0, 2.0]),
                 TREE, ("clip:1", "mean"), reference)
    assert step.calls == [(2, {0: [1.0], 1: [9.0]}, {0: 2.0, 1: 2.0})]
    assert asked == [(1, [0, 1])]


def test_the_children_s_update_with_a_rule_that_orders_them():
    children = col([1.0, 2.0, 3.0, 100.0])
    out, _ = cloud_update_of_children(None, 1, children, np.arange(4), np.ones(4),
                                      ("trimmed-mean:0.25",), col([0.0]))
    assert out["w"].tolist() == [[2.5]]  # one cut at each end: (2 + 3) / 2


def test_the_step_s_model_goes_to_the_children_s_device():
    """A step (a Flower strategy) answers on the CPU; the global model goes where the
    children's models are (meta here, a GPU in a GPU run)."""
    children = {"w": torch.zeros(2, 1, dtype=F64, device="meta")}

    class Fixed:
        def step(self, cloud_round, kids, weights):
            assert all(v["w"].device.type == "meta" for v in kids.values())
            return {"w": torch.tensor([9.0], dtype=F64)}

    out, nodes = step_on(Fixed(), 3, children, np.array([0, 2]), np.array([1.0, 3.0]))
    assert out["w"].device.type == "meta" and tuple(out["w"].shape) == (1, 1)
    assert nodes.tolist() == [0]
