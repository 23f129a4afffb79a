"""How the K accepted reports of asynchronous edges make the new global model.

The rule (FedBuff, FedAsync or the shifted mean, :mod:`fedhier.round.asynchrony.rules`) is
w_new = w + ρ (M - w), M the reports' combination below with each client's weight times the
rule's factor f (s(τ), or α s(τ) under FedAsync) and the reports moved to w (not under
FedAsync), ρ the rule's scale (:func:`fedhier.round.asynchrony.rules.finish`: M itself when ρ is 1,
as under the shifted mean, whose M this docstring describes).

A report is an edge job's result (:class:`fedhier.round.asynchrony.edges.EdgeTraining`): its
surviving clients' last models x_j, trained from the job's start model w_base(e), s cloud
aggregations old (s = staleness). It enters the aggregation as its *update applied to the current
model* w: each of its clients' models is shifted to

    x'_j = x_j + (w - w_base(e))            (x'_j = x_j exactly when s = 0),

each client weighs a_j = w~_j f(s) (w~ its presence weight over the job's clients,
:func:`fedhier.round.aggregators.averaging.presence_weights`; f = 1 / sqrt(1 + s) by default), and
the level's aggregators of the run (``--aggregators``, one per level or one for all) combine
the x'_j up the tree exactly as in a synchronous cloud aggregation
(:func:`fedhier.round.loop.aggregate_levels`). A rule that measures from each node's start model
(``clip``) measures an edge's clients from that edge's model before its last edge round,
shifted the same way; the cloud measures from the current model, and a node in between
from its last aggregate inside a job (:meth:`~fedhier.round.loop.HierarchicalSGD.node_models`;
the current model before it had one).

How it is computed. Every built-in rule commutes with a shift within a node (median(x + d)
= median(x) + d; ``clip`` with its start model shifted too), so when the levels above the
edges are linear (the mean), the new model is the rule's aggregate of the *unmoved* models
plus the weighted mean of the shifts:

    w_new = Agg(x) + Σ_e A_e (w - w_base(e)) / Σ_e A_e,   A_e = Σ_{j in e} a_j,

which with the mean everywhere is Σ_j a_j x_j / Σ_j a_j + Σ_e A_e (w - w_base(e)) / Σ_e A_e
(computed over all clients at once, as :func:`~fedhier.round.loop.aggregate_levels` computes
linear rules), the rule of runs recorded before other rules were allowed, bit for bit; and
a robust rule at the edges with one client per edge gives the mean's numbers. Otherwise (a
non-linear rule above the edges, or a cloud step) the rules run on the moved models x'_j.

A **cloud step** (a Flower strategy, ``--cloud-strategy``): the levels below the cloud
aggregate the x'_j as above; the strategy's ``aggregate_train`` receives those children
(the cloud's children with an accepted survivor) weighted by Σ a_j of their clients, after
``configure_train`` with w at the round's start: what a synchronous round does with them;
each child is first moved to w + ρ (c - w), so that a strategy's plain weighted mean is the
rule's model.

With K = N every report is fresh (s = 0, factor 1, no shift, ρ = 1 under FedBuff with
η_g = 1, FedAsync with α = 1 and the shifted mean): each way is the synchronous cloud
aggregation, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from fedhier.round.aggregators.averaging import aggregator, presence_weights
from fedhier.round.asynchrony.rules import AsyncRule, finish
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import CloudStep, Params, aggregate_levels
from fedhier.tree.hierarchy import Hierarchy


class StaleReport(Protocol):
    """What a report is read for here and in :mod:`fedhier.round.asynchrony.regions`
    (:class:`fedhier.round.asynchrony.edges.EdgeTraining` has it): the edge, its start model's
    version, when its training ends, the start model ``base``, the survivors' models and ids, the
    clients it trained, and the edge's model before its last edge round (``reference``, for
    ``clip``)."""

    edge: int
    version: int
    finish: float
    base: Params
    models: Params | None
    survivors: np.ndarray
    members: np.ndarray | None
    reference: Params | None

#: (level, node ids int64 [m]) -> name -> [m, *shape]: nodes' models before an aggregation.
NodeModels = Callable[[int, np.ndarray], Params]


def merge_reports(reports: Sequence[tuple[StaleReport, int]], global_params: Params,
                  weights: np.ndarray, hierarchy: Hierarchy, aggregators: tuple[str, ...],
                  node_models: NodeModels, cloud_step: CloudStep | None = None,
                  cloud_round: int = 0, rule: AsyncRule | None = None) -> Params | None:
    """The new global model from accepted reports by ``rule`` (the module docstring).

    Args:
        reports: (job, staleness) of the accepted reports; jobs without a surviving client
            (``models`` None) are ignored. Each job's ``members`` are its clients (int64).
        global_params: w, the current global model; weights: float64 [n], every client's
            averaging weight; hierarchy: the tree (its edge map is replaced by the jobs').
        node_models: the models of level-``level`` nodes before this aggregation (levels
            above the edges; :meth:`fedhier.round.loop.HierarchicalSGD.node_models`).
        cloud_step: the cloud's update over its children, None = the levels' rules.
        rule: FedBuff, FedAsync or the shifted mean with their settings
            (:mod:`fedhier.round.asynchrony.rules`; None = the default, FedBuff).

    Returns:
        name -> [*shape], or None when no report has a survivor (the model stays).
    """
    rule = AsyncRule() if rule is None else rule
    reports = [(job, s) for job, s in reports if job.models is not None]
    if not reports:
        return None
    n, num_edges = hierarchy.num_clients, hierarchy.num_nodes(1)
    survivors = np.concatenate([job.survivors for job, _ in reports])
    order = np.argsort(survivors, kind="stable")
    survivors = survivors[order]
    keys = list(global_params)
    device = next(iter(global_params.values())).device
    index = torch.as_tensor(order, device=device)
    present = np.zeros(n, dtype=bool)
    present[survivors] = True
    # each client weighs within the job it trained in; clients of no report: a spare edge id
    report_edge = np.full(n, num_edges, dtype=np.int64)
    factor = np.ones(n)
    for job, staleness in reports:
        report_edge[job.members] = job.edge
        factor[job.survivors] = rule.factors(np.array([staleness]))[0]
    data = presence_weights(weights, present, report_edge)
    weights = data * factor
    scale = rule.scale(float(weights[survivors].sum()), float(data[survivors].sum()))
    tree = hierarchy.with_edge_map(np.where(report_edge < num_edges, report_edge,
                                            hierarchy.edge_of_client()))
    shift = {job.edge: {k: global_params[k] - job.base[k] for k in keys}
             for job, s in reports if s > 0 and rule.moves}
    jobs = {job.edge: job for job, _ in reports}
    top = hierarchy.num_levels

    def reference(level: int, nodes: np.ndarray, moved: bool = True) -> Params:
        """Level 1: each edge's model before its last edge round (shifted when ``moved``);
        above: as ever."""
        if level > 1:
            return node_models(level, nodes)
        return {k: torch.stack([_shifted(jobs[int(e)].reference,
                                         shift.get(int(e)) if moved else None, k)
                                for e in nodes.tolist()]) for k in keys}

    above = [aggregator(aggregators[0] if len(aggregators) == 1 else aggregators[lv - 1])
             for lv in range(2, top + 1)]
    if cloud_step is None and all(rule.linear for rule in above):
        # the edges' rules commute with the shift and the levels above are linear: the
        # aggregate of the unmoved models plus Σ_e A_e (w - w_base(e)) / Σ_e A_e
        averaged, _ = aggregate_levels(_rows(reports, keys, index), survivors, weights, tree,
                                       top, aggregators,
                                       lambda level, nodes: reference(level, nodes, False))
        new = {k: v[0] for k, v in averaged.items()}
        stale = [(job, float(weights[job.survivors].sum())) for job, _ in reports
                 if job.edge in shift]
        if stale:
            total = float(weights[survivors].sum())
            for key in keys:
                correction = sum(mass * (global_params[key] - job.base[key])
                                 for job, mass in stale)
                new[key] = new[key] + correction / total
        return finish(global_params, new, scale)
    models = _rows(reports, keys, index, shift)
    level = top if cloud_step is None else top - 1
    averaged, nodes = aggregate_levels(models, survivors, weights, tree, level, aggregators,
                                       reference)
    if cloud_step is None:
        return finish(global_params, {k: v[0] for k, v in averaged.items()}, scale)
    averaged = finish({k: v.unsqueeze(0) for k, v in global_params.items()}, averaged, scale)
    child_weight = np.bincount(tree.ancestors(level)[survivors], weights=weights[survivors],
                               minlength=tree.num_nodes(level))
    new = cloud_step.step(cloud_round,
                          {int(node): {k: v[i] for k, v in averaged.items()}
                           for i, node in enumerate(nodes)},
                          {int(node): float(child_weight[node]) for node in nodes})
    if not all(bool(torch.isfinite(v).all()) for v in new.values()):
        name = type(getattr(cloud_step, "strategy", cloud_step)).__name__
        raise RunFailureError(f"the cloud step ({name}) made the global model non-finite in "
                              f"cloud round {cloud_round}; lower --server-lr or use "
                              "--cloud-strategy average")
    return {k: v.to(device) for k, v in new.items()}


def _rows(reports: Sequence[tuple[StaleReport, int]], keys: list[str], index: torch.Tensor,
          shift: dict[int, Params] | None = None) -> Params:
    """name -> [s, *shape]: the reports' client models (shifted by their edge's entry of
    ``shift``, when it has one), in client order (``index``: the sorting permutation)."""
    shift = shift or {}
    return {k: torch.cat([_shifted(job.models, shift.get(job.edge), k)  # type: ignore[arg-type]
                          for job, _ in reports]).index_select(0, index) for k in keys}


def _shifted(params: Params | None, shift: Params | None, key: str) -> torch.Tensor:
    if params is None:
        raise ValueError("a report without the model its rule needs (a job's reference)")
    return params[key] if shift is None else params[key] + shift[key]
