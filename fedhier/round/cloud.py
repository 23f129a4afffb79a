"""The cloud step: what the root does with what its children send.

One part of the round (docs/index.md, "The round as parts"). Without a :class:`CloudStep` the
cloud aggregates with the registry's rule of the top level like every other node (the plain
mean: exact H-SGD, the subtree's clients averaged directly); with one (a Flower Strategy
through ``fedhier.strategies.cloud_step``: "hierarchical FedAdam") the cloud's children
aggregate first and the step makes the global model from their aggregates and weights.
:func:`cloud_update` is the one entry for both; :func:`cloud_update_of_children` starts from
children's aggregates already made (edge servers, :mod:`fedhier.round.tiers.jobs`). No Flower
import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.round.aggregation import aggregate_levels, warn_size
from fedhier.round.aggregators.averaging import aggregator
from fedhier.round.executor import Params, device_of
from fedhier.round.faults import RunFailureError
from fedhier.tree.hierarchy import Hierarchy

#: (level, node ids int64 [m]) -> name -> [m, *shape]: those nodes' current models.
Reference = Callable[[int, np.ndarray], Params]


class CloudStep(Protocol):
    """The cloud's update over its children's aggregates (default: the plain average)."""

    def begin(self, cloud_round: int, global_params: Params, num_children: int) -> None:
        """A cloud round starts from ``global_params`` (server optimisers record it)."""
        ...

    def step(self, cloud_round: int, children: Mapping[int, Params],
             child_weights: Mapping[int, float]) -> Params:
        """The new global model from the children's aggregates (absent children left out)
        and their weights (the sums of their surviving clients' weights)."""
        ...


def cloud_update(step: CloudStep | None, cloud_round: int, models: Params,
                 survivors: np.ndarray, weights: np.ndarray, hierarchy: Hierarchy,
                 aggregators: tuple[str, ...], reference: Reference,
                 ) -> tuple[Params, np.ndarray]:
    """The global model from the survivors' models (name -> [s, *shape], ``survivors``
    int64 [s], presence ``weights`` float64 [n]); -> ([1, *shape], [0])."""
    if step is None:
        return aggregate_levels(models, survivors, weights, hierarchy, hierarchy.num_levels,
                                aggregators, reference)
    child_level = hierarchy.num_levels - 1
    children, nodes = aggregate_levels(models, survivors, weights, hierarchy, child_level,
                                       aggregators, reference)
    child_weight = np.bincount(hierarchy.ancestors(child_level)[survivors],
                               weights=weights[survivors],
                               minlength=hierarchy.num_nodes(child_level))
    return step_on(step, cloud_round, children, nodes, child_weight[nodes])


def cloud_update_of_children(step: CloudStep | None, cloud_round: int, children: Params,
                             nodes: np.ndarray, child_weight: np.ndarray,
                             aggregators: tuple[str, ...], top: Params,
                             ) -> tuple[Params, np.ndarray]:
    """The global model from the cloud's children ``nodes`` (int64 [m], increasing) holding
    ``children`` (name -> [m, *shape]) with weights ``child_weight`` (float64 [m]); ``top``:
    name -> [1, *shape], the global model before (rules that measure from it). With the
    plain mean this is :func:`cloud_update` up to float rounding."""
    if step is not None:
        return step_on(step, cloud_round, children, nodes, child_weight)
    rule = aggregator(aggregators[-1])
    warn_size(rule, 2, 2, np.zeros(1, dtype=np.int64), np.array([len(nodes)]))  # the cloud
    device = device_of(children)
    w = torch.as_tensor(child_weight, device=device)
    owner = torch.zeros(len(nodes), dtype=torch.int64, device=device)
    return rule.apply(children, w, owner, 1, top), np.zeros(1, dtype=np.int64)


def step_on(step: CloudStep, cloud_round: int, children: Params, nodes: np.ndarray,
            child_weight: np.ndarray) -> tuple[Params, np.ndarray]:
    """The cloud step over the cloud's children ``nodes`` (int64 [m]) holding ``children``
    (name -> [m, *shape]) with weights ``child_weight`` (float64 [m]);
    -> ([1, *shape], [0])."""
    new = step.step(
        cloud_round, {int(node): {k: v[i] for k, v in children.items()}
                      for i, node in enumerate(nodes)},
        {int(node): float(child_weight[i]) for i, node in enumerate(nodes)})
    if not all(bool(torch.isfinite(v).all()) for v in new.values()):
        raise RunFailureError(f"the cloud step ({step_name(step)}) made the "
                              f"global model non-finite in cloud round {cloud_round}; "
                              "lower --server-lr or use --cloud-strategy average")
    device = device_of(children)
    return {k: v.to(device).unsqueeze(0) for k, v in new.items()}, np.zeros(1, np.int64)


def step_name(step: Any) -> str:
    """The class name of a cloud step, or of the Flower strategy it wraps."""
    return type(getattr(step, "strategy", step)).__name__
