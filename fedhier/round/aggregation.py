"""Aggregation up the tree: the registry's rule per level, and the models the nodes hold.

One part of the round (docs/index.md, "The round as parts"). :func:`aggregate_levels` combines
the surviving clients' models up to a level with each level's rule from the registry
(:mod:`fedhier.round.aggregators.averaging`: mean, median, clip, krum, ...); :func:`broadcast` gives
each node's aggregate to the edges under it, and :class:`NodeModels` keeps what the levels strictly
between the edges and the cloud hold within a cloud round (the start model of rules that measure
from one, such as ``clip``). No Flower import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from fedhier.round.aggregators.averaging import (
    Aggregator,
    aggregator,
    check_aggregators,
    occupied_segments,
)
from fedhier.round.executor import Params, device_of
from fedhier.tree.hierarchy import Hierarchy

log = logging.getLogger("fedhier")

#: (rule, level, node, members) already warned about in this run (see :func:`warn_size`).
_WARNED: set[tuple[str, int, int, int]] = set()


def level_name(level: int, num_levels: int) -> str:
    """'the edges', 'the cloud', 'level 2': where a rule runs."""
    return "the cloud" if level == num_levels else "the edges" if level == 1 \
        else f"level {level}"


def new_run() -> None:
    """A run starts: its rules' size warnings are told again (:func:`warn_size`)."""
    _WARNED.clear()


def warn_size(rule: Aggregator, level: int, num_levels: int, nodes: np.ndarray,
              sizes: np.ndarray) -> None:
    """One warning per run, node and size where ``rule`` aggregates fewer members than it
    needs to leave one hostile member out (``Aggregator.min_members``, docs/security.md):
    there it is not robust (the median of 2 is their mean; a trimmed mean that trims
    nothing is the mean)."""
    if rule.linear:
        return
    least = rule.min_members
    for node, k in zip(nodes.tolist(), sizes.tolist(), strict=True):
        if (least is not None and k >= least) or (rule.name, level, node, k) in _WARNED:
            continue
        _WARNED.add((rule.name, level, node, k))
        need = f"needs >= {least}" if least is not None else "never leaves one out"
        log.warning("aggregator %s at %s: node %d aggregates %d member(s), the rule %s "
                    "to resist one hostile member: not robust there (docs/security.md)",
                    rule.name, level_name(level, num_levels), node, k, need)


def aggregate_levels(models: dict[str, torch.Tensor], survivors: np.ndarray,
                     weights: np.ndarray, hierarchy: Hierarchy, level: int,
                     aggregators: tuple[str, ...],
                     reference: Callable[[int, np.ndarray], Params] | None = None,
                     ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Aggregate the surviving clients' models up to ``level``.

    Args:
        models: name -> [s, *shape], the survivors' models in ``survivors`` order.
        survivors: int64 [s], their client ids; weights: float64 [n], every client's
            (presence) weight; aggregators: one name for all levels or one per level.
        reference: (level, node ids int64 [m]) -> name -> [m, *shape], those nodes' models
            before this aggregation (the start model rules such as ``clip`` measure from).

    Returns:
        (name -> [m, *shape], the aggregates of the m level-``level`` nodes that have a
        survivor; int64 [m], those nodes' ids). Linear rules up to ``level`` aggregate the
        subtree's clients directly; otherwise level by level, each node weighted by its
        survivors' total weight.
    """
    check_aggregators(aggregators, hierarchy.num_levels)
    rules = [aggregator(aggregators[0] if len(aggregators) == 1 else aggregators[lv - 1])
             for lv in range(1, level + 1)]
    device = next(iter(models.values())).device
    if all(rule.linear for rule in rules):
        nodes, compact = occupied_segments(hierarchy.ancestors(level)[survivors],
                                           hierarchy.num_nodes(level))
        w = torch.as_tensor(weights[survivors], device=device)
        owner = torch.as_tensor(compact, device=device)
        return rules[-1].apply(models, w, owner, len(nodes)), nodes
    members, member_weights, values = survivors, weights[survivors], models
    for lv, rule in enumerate(rules, start=1):
        parent = (hierarchy.parents[lv - 1][members] if lv < hierarchy.num_levels
                  else np.zeros(len(members), dtype=np.int64))
        nodes, compact = occupied_segments(parent, hierarchy.num_nodes(lv))
        w = torch.as_tensor(member_weights, device=device)
        owner = torch.as_tensor(compact, device=device)
        warn_size(rule, lv, hierarchy.num_levels, nodes,
                  np.bincount(compact, minlength=len(nodes)))
        # without a reference, a rule that needs one refuses in Aggregator.apply
        start = reference(lv, nodes) if rule.needs_reference and reference else None
        values = rule.apply(values, w, owner, len(nodes), start)
        member_weights = np.bincount(compact, weights=member_weights, minlength=len(nodes))
        members = nodes
    return values, members


def broadcast(edge_models: Params, averaged: Params, nodes: np.ndarray, level: int,
              hierarchy: Hierarchy) -> None:
    """The edges under a level-``level`` node in ``nodes`` (int64 [m]) take its aggregate
    (``averaged``: name -> [m, *shape]); ``edge_models`` (name -> [E, *shape]) in place."""
    position = np.full(hierarchy.num_nodes(level), -1, dtype=np.int64)
    position[nodes] = np.arange(len(nodes))
    source = position[hierarchy.edges_under(level)]
    updated = np.flatnonzero(source >= 0)
    device = device_of(averaged)
    src = torch.as_tensor(source[updated], device=device)
    dst = torch.as_tensor(updated, device=device)
    for key, value in averaged.items():
        edge_models[key].index_copy_(0, dst, value.index_select(0, src))


def needs_node_models(aggregators: tuple[str, ...]) -> bool:
    """Whether some level's rule measures from the node's model before it aggregates."""
    return any(aggregator(name).needs_reference for name in aggregators)


class NodeModels:
    """The models of the nodes strictly between the edges and the cloud in one cloud round:
    level -> name -> [nodes, *shape]; a level not aggregated yet holds the global model."""

    def __init__(self) -> None:
        self.levels: dict[int, Params] = {}

    def reset(self) -> None:
        """A cloud round starts: every node holds the global model."""
        self.levels = {}

    def remember(self, averaged: Params, nodes: np.ndarray, level: int, hierarchy: Hierarchy,
                 global_params: Params) -> None:
        """The nodes of levels 2 .. min(level, L - 1) under (or at) a level-``level`` node in
        ``nodes`` take its aggregate (``averaged``: name -> [m, *shape])."""
        position = np.full(hierarchy.num_nodes(level), -1, dtype=np.int64)
        position[nodes] = np.arange(len(nodes))
        device = device_of(averaged)
        for lv in range(2, min(level, hierarchy.num_levels - 1) + 1):
            above = np.arange(hierarchy.num_nodes(lv))
            for k in range(lv, level):
                above = hierarchy.parents[k][above]
            source = position[above]
            updated = np.flatnonzero(source >= 0)
            if lv not in self.levels:
                self.levels[lv] = {k: v.unsqueeze(0).repeat(len(above), *([1] * v.dim()))
                                   for k, v in global_params.items()}
            src = torch.as_tensor(source[updated], device=device)
            dst = torch.as_tensor(updated, device=device)
            for key, value in averaged.items():
                self.levels[lv][key].index_copy_(0, dst, value.index_select(0, src))

    def of(self, level: int, nodes: np.ndarray, hierarchy: Hierarchy, edge_models: Params,
           global_params: Params) -> Params:
        """The current models of level-``level`` nodes ``nodes`` (int64 [m]): name ->
        [m, *shape]; an edge's model, the global model at the top, and in between the node's
        last aggregate this cloud round (the global model before one)."""
        device = device_of(global_params)
        index = torch.as_tensor(np.asarray(nodes, dtype=np.int64), device=device)
        if level == 1:
            return {k: v.index_select(0, index) for k, v in edge_models.items()}
        if level == hierarchy.num_levels or level not in self.levels:
            return {k: v.unsqueeze(0).expand(len(index), *v.shape)
                    for k, v in global_params.items()}
        return {k: v.index_select(0, index) for k, v in self.levels[level].items()}
