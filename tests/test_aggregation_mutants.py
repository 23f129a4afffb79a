"""Exact values of the round's aggregation part (fedhier/round/aggregation.py), case by case:
the tests written against its mutation survivors (docs/testing.md, "Mutation testing").

The tree: six clients under three edges under two regions under the cloud (periods 1, 2, 4);
the numbers below are worked out by hand from the clients' models and weights."""

import numpy as np
import pytest
import torch

from fedhier.round.aggregation import NodeModels, aggregate_levels, broadcast, needs_node_models
from fedhier.tree.hierarchy import Hierarchy
from tests.helpers import assert_refused

I64 = np.int64
F64 = torch.float64
#: clients 0, 1 -> edge 0; 2, 3 -> edge 1; 4, 5 -> edge 2; edges 0, 1 -> region 0, 2 -> 1
TREE = Hierarchy((1, 2, 4), (np.array([0, 0, 1, 1, 2, 2], dtype=I64),
                             np.array([0, 0, 1], dtype=I64)))
WEIGHTS = np.array([1.0, 3.0, 2.0, 5.0, 4.0, 6.0])
SURVIVORS = np.array([0, 1, 3, 5], dtype=I64)  # weights 1, 3, 5, 6


def survivor_models() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[2.0, 0.0], [6.0, 4.0], [1.0, 1.0], [10.0, -2.0]], dtype=F64)}


def levels(rules: tuple[str, ...], level: int, survivors: np.ndarray = SURVIVORS,
           models: dict | None = None, reference=None) -> tuple[list, list]:
    out, nodes = aggregate_levels(models or survivor_models(), survivors, WEIGHTS, TREE, level,
                                  rules, reference)
    assert nodes.dtype == I64
    return out["w"].tolist(), nodes.tolist()


def close(got: list, want: list) -> None:
    assert np.allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-14), (got, want)


def test_linear_rules_average_each_subtree_s_survivors_by_weight():
    # edge 0: (1 * [2, 0] + 3 * [6, 4]) / 4 = [5, 3]; edges 1, 2: their one survivor
    got, nodes = levels(("mean",), 1)
    assert nodes == [0, 1, 2]
    close(got, [[5.0, 3.0], [1.0, 1.0], [10.0, -2.0]])
    # region 0: (1 * [2, 0] + 3 * [6, 4] + 5 * [1, 1]) / 9 = [25/9, 17/9]
    got, nodes = levels(("mean", "mean", "mean"), 2)
    assert nodes == [0, 1]
    close(got, [[25 / 9, 17 / 9], [10.0, -2.0]])
    # cloud: ([25, 17] + 6 * [10, -2]) / 15
    got, nodes = levels(("mean",), 3)
    assert nodes == [0]
    close(got, [[85 / 15, 5 / 15]])


def test_nodes_without_a_survivor_are_left_out():
    got, nodes = levels(("mean",), 1, np.array([0, 1, 5], dtype=I64),
                        {"w": torch.tensor([[2.0, 0.0], [6.0, 4.0], [10.0, -2.0]], dtype=F64)})
    assert nodes == [0, 2]
    close(got, [[5.0, 3.0], [10.0, -2.0]])
    got, nodes = levels(("median",), 2, np.array([4, 5], dtype=I64),
                        {"w": torch.tensor([[1.0, 2.0], [3.0, 8.0]], dtype=F64)})
    assert nodes == [1]
    close(got, [[2.0, 5.0]])


def test_a_robust_rule_aggregates_level_by_level_with_each_node_s_total_weight():
    # median at the edges (weights ignored): [4, 2], [1, 1], [10, -2] with weights 4, 5, 6;
    # region 0: (4 * [4, 2] + 5 * [1, 1]) / 9 = [7/3, 13/9] (weight 9), region 1 (weight 6);
    # cloud: (9 * [7/3, 13/9] + 6 * [10, -2]) / 15 = [81/15, 1/15]
    got, nodes = levels(("median", "mean", "mean"), 3)
    assert nodes == [0]
    close(got, [[81 / 15, 1 / 15]])
    got, nodes = levels(("median", "mean", "mean"), 2)
    assert nodes == [0, 1]
    close(got, [[7 / 3, 13 / 9], [10.0, -2.0]])


def test_each_level_takes_its_own_rule():
    # mean at the edges, median of [5, 3] and [1, 1] in region 0, then the weighted mean
    close(levels(("mean", "median", "mean"), 3)[0], [[87 / 15, 6 / 15]])
    # means up to the regions, the median of two regions at the cloud: their midpoint
    close(levels(("mean", "mean", "median"), 3)[0], [[115 / 18, -1 / 18]])
    # up to a level whose rules are all linear: the direct mean, whatever rule is above
    close(levels(("mean", "mean", "median"), 2)[0], [[25 / 9, 17 / 9], [10.0, -2.0]])
    close(levels(("median", "mean", "mean"), 1)[0], [[4.0, 2.0], [1.0, 1.0], [10.0, -2.0]])
    close(levels(("mean", "median", "median"), 1)[0], [[5.0, 3.0], [1.0, 1.0], [10.0, -2.0]])
    # one name: that rule at every level
    close(levels(("median",), 2)[0], [[2.5, 1.5], [10.0, -2.0]])


def test_the_reference_is_asked_only_by_rules_that_measure_from_a_start_model():
    asked = []

    def reference(level, nodes):
        asked.append((level, nodes.tolist()))
        return {"w": torch.zeros(len(nodes), 2, dtype=F64)}

    # clip:100 from zero clips nothing here: the level-by-level means
    close(levels(("median", "clip:100", "mean"), 2, reference=reference)[0],
          [[7 / 3, 13 / 9], [10.0, -2.0]])
    assert asked == [(2, [0, 1])]


def test_one_name_or_one_per_level():
    assert_refused(lambda: levels(("mean", "mean"), 1),
                   "aggregators: give one name for every level or 3 (edge ... cloud), got 2: "
                   "mean,mean")


def test_broadcast_gives_each_edge_its_ancestor_s_aggregate():
    start = [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    edges = {"w": torch.tensor(start, dtype=F64)}
    broadcast(edges, {"w": torch.tensor([[7.0, 8.0]], dtype=F64)}, np.array([1], dtype=I64), 2,
              TREE)
    assert edges["w"].tolist() == [[0.0, 0.0], [1.0, 1.0], [7.0, 8.0]]
    broadcast(edges, {"w": torch.tensor([[5.0, 6.0]], dtype=F64)}, np.array([0], dtype=I64), 2,
              TREE)
    assert edges["w"].tolist() == [[5.0, 6.0], [5.0, 6.0], [7.0, 8.0]]
    broadcast(edges, {"w": torch.tensor([[3.0, 3.0], [4.0, 4.0]], dtype=F64)},
              np.array([0, 2], dtype=I64), 1, TREE)
    assert edges["w"].tolist() == [[3.0, 3.0], [5.0, 6.0], [4.0, 4.0]]
    broadcast(edges, {"w": torch.tensor([[9.0, 1.0]], dtype=F64)}, np.array([0], dtype=I64), 3,
              TREE)
    assert edges["w"].tolist() == [[9.0, 1.0]] * 3


def test_needs_node_models_when_some_level_measures_from_a_start_model():
    assert needs_node_models(("mean",)) is False
    assert needs_node_models(("mean", "median", "krum:1")) is False
    assert needs_node_models(("mean", "clip:1.5")) is True
    assert needs_node_models(("clip:2x",)) is True


#: four levels: clients -> 4 edges -> 3 regions -> 2 zones -> cloud
DEEP = Hierarchy((1, 2, 4, 8), (np.array([0, 0, 1, 1, 2, 3], dtype=I64),
                                np.array([0, 0, 1, 2], dtype=I64),
                                np.array([0, 1, 1], dtype=I64)))


def global_model() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([1.0, 2.0], dtype=F64), "b": torch.tensor(0.5, dtype=F64),
            "m": torch.tensor([[1.0], [-1.0]], dtype=F64)}


def aggregate(rows: list[float]) -> dict[str, torch.Tensor]:
    """A per-node aggregate whose every entry of node r is rows[r]."""
    r = torch.tensor(rows, dtype=F64)
    return {"w": r[:, None].repeat(1, 2), "b": r.clone(), "m": r[:, None, None].repeat(1, 2, 1)}


def node_values(models: dict[str, torch.Tensor]) -> list[list[float]]:
    """Each node's entries, flattened in the order w, b, m."""
    return [[*models["w"][i].tolist(), models["b"][i].item(), *models["m"][i].flatten().tolist()]
            for i in range(len(models["b"]))]


def test_node_models_hold_the_global_model_until_a_level_aggregates():
    nodes = NodeModels()
    g = global_model()
    edges = aggregate([10.0, 11.0, 12.0, 13.0])
    glob = [1.0, 2.0, 0.5, 1.0, -1.0]
    assert node_values(nodes.of(2, np.array([2, 0]), DEEP, edges, g)) == [glob, glob]
    assert node_values(nodes.of(1, np.array([3, 1]), DEEP, edges, g)) == \
        [[13.0] * 5, [11.0] * 5]
    assert node_values(nodes.of(4, np.array([0]), DEEP, edges, g)) == [glob]
    # regions 1 and 2 aggregate: region 0 keeps the global model
    nodes.remember(aggregate([6.0, 7.0]), np.array([1, 2], dtype=I64), 2, DEEP, g)
    assert node_values(nodes.of(2, np.array([0, 1, 2]), DEEP, edges, g)) == \
        [glob, [6.0] * 5, [7.0] * 5]
    assert node_values(nodes.of(3, np.array([0, 1]), DEEP, edges, g)) == [glob, glob]
    assert g["w"].tolist() == [1.0, 2.0]  # the global model is not written through
    # zone 1 (regions 1, 2) aggregates: it and the regions under it take its aggregate
    nodes.remember(aggregate([8.0]), np.array([1], dtype=I64), 3, DEEP, g)
    assert node_values(nodes.of(2, np.array([0, 1, 2]), DEEP, edges, g)) == \
        [glob, [8.0] * 5, [8.0] * 5]
    assert node_values(nodes.of(3, np.array([1, 0]), DEEP, edges, g)) == [[8.0] * 5, glob]
    assert node_values(nodes.of(4, np.array([0]), DEEP, edges, g)) == [glob]  # the top
    assert sorted(nodes.levels) == [2, 3]  # only the levels strictly between
    # a new cloud round starts from the global model
    nodes.reset()
    assert nodes.levels == {}
    assert node_values(nodes.of(2, np.array([1]), DEEP, edges, g)) == [glob]
    assert node_values(nodes.of(4, np.array([0]), DEEP, edges, g)) == [glob]


def test_the_part_makes_its_tensors_on_the_models_device():
    """Under another default device (meta) every tensor the part makes names the models'
    device (a GPU run's models stay on the GPU)."""
    edges = {"w": torch.zeros(3, 2, dtype=F64)}
    models, other = survivor_models(), survivor_models()
    one = {"w": torch.ones(1, 2, dtype=F64)}
    g = {"w": torch.tensor([1.0, 2.0], dtype=F64)}
    five = {"w": torch.full((1, 2), 5.0, dtype=F64)}
    with torch.device("meta"):
        lin, _ = aggregate_levels(models, SURVIVORS, WEIGHTS, TREE, 2, ("mean",))
        rob, _ = aggregate_levels(other, SURVIVORS, WEIGHTS, TREE, 2,
                                  ("median", "mean", "mean"))
        broadcast(edges, one, np.array([1], dtype=I64), 2, TREE)
        nodes = NodeModels()
        nodes.remember(five, np.array([1], dtype=I64), 3, DEEP, g)
        held = nodes.of(2, np.array([1, 0]), DEEP, edges, g)
        top = nodes.of(4, np.array([0]), DEEP, edges, g)
        edge = nodes.of(1, np.array([2]), DEEP, edges, g)
    for t in (lin["w"], rob["w"], edges["w"], held["w"], top["w"], edge["w"]):
        assert t.device.type == "cpu"
    close(lin["w"].tolist(), [[25 / 9, 17 / 9], [10.0, -2.0]])
    close(rob["w"].tolist(), [[7 / 3, 13 / 9], [10.0, -2.0]])
    assert edges["w"].tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert held["w"].tolist() == [[5.0, 5.0], [1.0, 2.0]]
    assert top["w"].tolist() == [[1.0, 2.0]] and edge["w"].tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_linear_rule_is_the_same_level_by_level(level):
    """mean at every level (direct) equals the mean after a median of singletons (a level-
    by-level pass that changes nothing at the edges when each edge has one survivor)."""
    survivors = np.array([1, 3, 5], dtype=I64)
    models = {"w": torch.tensor([[6.0, 4.0], [1.0, 1.0], [10.0, -2.0]], dtype=F64)}
    direct = levels(("mean",), level, survivors, models)
    stepped = levels(("median", "mean", "mean"), level, survivors, models)
    assert direct[1] == stepped[1]
    close(direct[0], stepped[0])
