"""An independent reference implementation of H-SGD's arithmetic (the test oracle).

Written from docs/hsgd.md and the reference maths (algorithms.md §1-2), in plain float64
numpy, for a multinomial logistic regression (``logreg``: logits = x Wᵀ + b, mean
cross-entropy) trained with full-batch gradient descent at a constant learning rate. It
imports nothing from fedhier: who trains, for how many steps and where is handed in as plain
functions (the tests derive them from the documented rules and draws), and everything that
turns those facts into numbers is computed here:

- client weights (``samples``: rows, ``uniform``: 1), presence weights under participation
  (renormalised within the edge, each edge keeping its full weight above the edges);
- the aggregation schedule: after global step t the highest level l with (t+1) % P_l == 0
  aggregates its subtree; per-edge periods replace P_1 by the edge's own I_i;
- stragglers' fewer steps and FedNova's rescale w_start + (τ_eff/τ_j)(w_j - w_start), with
  τ_eff/τ_j fixed when the client's edge plans its period and applied to the client's whole
  update over that period when its edge aggregates (w_start: the model it started the
  period's work from);
- mobility: a moved client starts from its new edge's model (``fresh``) or keeps its own
  (``carry``) and aggregates at the new edge;
- the coordinate-wise median, level by level;
- a cloud step computed by a Flower strategy (any callable over the cloud's children);
- asynchronous edges: jobs from the model version they started at, their reports combined
  by FedBuff's, FedAsync's or the shifted-mean equation (:func:`apply_rule`) with a
  polynomial or hinge staleness function; asynchronous regions: each region sends its first
  K_r children's reports up as one.

Models are dicts {"linear.weight": [C, D], "linear.bias": [C]}, float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

Model = dict[str, np.ndarray]
WEIGHT, BIAS = "linear.weight", "linear.bias"


# --------------------------------------------------------------------------- the local step
def gradient(model: Model, x: np.ndarray, y: np.ndarray) -> Model:
    """∇ of the mean cross-entropy of softmax(x Wᵀ + b) on the rows (x [m, D], y [m])."""
    logits = x @ model[WEIGHT].T + model[BIAS]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return {WEIGHT: p.T @ x, BIAS: p.sum(axis=0)}


def gd_steps(model: Model, x: np.ndarray, y: np.ndarray, lr: float, steps: int) -> Model:
    """``steps`` full-batch gradient-descent steps from ``model``."""
    w = {k: v.copy() for k, v in model.items()}
    for _ in range(steps):
        g = gradient(w, x, y)
        w = {k: w[k] - lr * g[k] for k in w}
    return w


def combine(models: Sequence[Model], coefficients: Sequence[float]) -> Model:
    """Σ c_i model_i."""
    return {k: sum(c * m[k] for c, m in zip(coefficients, models, strict=True))
            for k in models[0]}


def mean(models: Sequence[Model], weights: Sequence[float]) -> Model:
    total = float(sum(weights))
    return combine(models, [w / total for w in weights])


def median(models: Sequence[Model]) -> Model:
    return {k: np.median(np.stack([m[k] for m in models]), axis=0) for k in models[0]}


# --------------------------------------------------------------------------- the problem
@dataclass
class Problem:
    """Client data, the tree and the periods of one run."""

    xs: list[np.ndarray]  # client j's features [m_j, D]
    ys: list[np.ndarray]  # client j's labels [m_j]
    edge_of: np.ndarray  # client -> edge at the start of the run
    parents: list[np.ndarray] = field(default_factory=list)  # level l -> l+1 map, for l >= 1
    periods: tuple[int, ...] = (2, 4)  # P_1 .. P_L, in local steps
    lr: float = 0.1
    weighting: str = "samples"

    @property
    def num_clients(self) -> int:
        return len(self.xs)

    @property
    def num_edges(self) -> int:
        return int(self.edge_of.max()) + 1 if not self.parents else len(self.parents[0])

    @property
    def levels(self) -> int:
        return len(self.periods)

    def weights(self) -> np.ndarray:
        if self.weighting == "uniform":
            return np.ones(self.num_clients)
        return np.array([len(y) for y in self.ys], dtype=np.float64)

    def node_of_edge(self, level: int) -> np.ndarray:
        """edge -> its level-``level`` ancestor (level 1: itself; the top level: 0)."""
        node = np.arange(self.num_edges)
        for up in range(1, level):
            node = (self.parents[up - 1][node] if up - 1 < len(self.parents)
                    else np.zeros_like(node))
        return node

    def level_after(self, step_end: int, edge_period: int | None = None) -> int:
        """The level aggregating after ``step_end`` local steps (0 = none)."""
        periods = list(self.periods)
        if edge_period is not None:
            periods[0] = edge_period
        for level in range(self.levels, 0, -1):
            if step_end % periods[level - 1] == 0:
                return level
        return 0


# --------------------------------------------------------------------------- synchronous H-SGD
Participants = Callable[[int, int, np.ndarray], np.ndarray]  # (edge round, edge, members)
Steps = Callable[[int, int], int]  # (edge round, client) -> τ_j
EdgeMap = Callable[[int], np.ndarray]  # edge round -> client -> edge
CloudStep = Callable[[int, Model, list[Model], list[float]], Model]


def hsgd(problem: Problem, initial: Model, rounds: int, *,
         edge_periods: Sequence[int] | None = None,
         participants: Participants | None = None,
         steps: Steps | None = None,
         fednova: bool = False,
         edge_map: EdgeMap | None = None,
         handoff: str = "fresh",
         aggregator: str = "mean",
         cloud_step: CloudStep | None = None) -> Model:
    """The global model after ``rounds`` cloud rounds (of P_L steps each).

    The run advances in edge rounds of g steps (g = P_1, or gcd of the per-edge periods).
    Every client holds a model; a client that trains starts from its own model, which after
    an aggregation is its node's aggregate. A moved client under ``fresh`` first takes its new
    edge's model. ``steps(r, j)`` = local steps of client j in its edge's current period
    (per-edge periods: spread over the period, at most g per edge round).
    """
    p = problem
    n, num_edges = p.num_clients, p.num_edges
    omega = p.weights()
    g = math.gcd(*edge_periods) if edge_periods else p.periods[0]
    e_period = list(edge_periods) if edge_periods else [p.periods[0]] * num_edges
    clients = [{k: v.copy() for k, v in initial.items()} for _ in range(n)]
    edges = [{k: v.copy() for k, v in initial.items()} for _ in range(num_edges)]
    edge_of = p.edge_of.copy()
    top = p.levels
    rounds_per_cloud = p.periods[-1] // g
    remaining = np.zeros(n, dtype=np.int64)  # steps left in the client's edge period
    period_start: list[Model] = [clients[j] for j in range(n)]  # FedNova's w_start
    trained = np.zeros(n, dtype=bool)  # took part since its edge last aggregated
    scale = np.ones(n)  # FedNova's τ_eff / τ_j of the client's current plan
    global_model = initial
    for r in range(1, rounds * rounds_per_cloud + 1):
        start_step = (r - 1) * g
        new_map = edge_map(r) if edge_map else edge_of
        moved = np.flatnonzero(new_map != edge_of)
        edge_of = np.asarray(new_map).copy()
        for j in moved:
            if handoff == "fresh":  # it starts its work over from the new edge's model
                clients[j] = {k: v.copy() for k, v in edges[edge_of[j]].items()}
                period_start[j] = {k: v.copy() for k, v in clients[j].items()}
                trained[j] = False
        for i in range(num_edges):  # edges whose period starts plan it
            if start_step % e_period[i]:
                continue
            members = np.flatnonzero(edge_of == i)
            chosen = participants(r, i, members) if participants else members
            remaining[members] = 0
            for j in chosen:
                remaining[j] = steps(r, j) if steps else e_period[i]
                period_start[j] = {k: v.copy() for k, v in clients[j].items()}
            scale[members] = 1.0
            if fednova and len(chosen):  # τ_eff = Σ p_j τ_j over the edge's chosen clients
                pj = omega[chosen] / omega[chosen].sum()
                tau_eff = float(np.dot(pj, remaining[chosen]))
                scale[chosen] = tau_eff / remaining[chosen]
        for j in range(n):
            k = min(int(remaining[j]), g)
            if k:
                clients[j] = gd_steps(clients[j], p.xs[j], p.ys[j], p.lr, k)
                remaining[j] -= k
                trained[j] = True
        step_end = r * g
        level = [p.level_after(step_end, e_period[i]) for i in range(num_edges)]
        if not any(level):
            continue
        # members aggregating now, per edge, and their presence weights
        present = [np.flatnonzero((edge_of == i) & trained) for i in range(num_edges)]
        if fednova:  # each aggregating client's whole update over its period
            for i in range(num_edges):
                if level[i] == 0:
                    continue
                for j in present[i]:
                    s = scale[j]
                    clients[j] = {k: period_start[j][k] + s * (clients[j][k] - period_start[j][k])
                                  for k in clients[j]}
        full = np.array([omega[edge_of == i].sum() for i in range(num_edges)])
        presence = np.zeros(n)
        for i in range(num_edges):
            if len(present[i]):
                presence[present[i]] = full[i] * omega[present[i]] / omega[present[i]].sum()
        lvl = max(level)
        node = p.node_of_edge(lvl)
        # edge aggregates (level 1), then upwards level by level (for the median)
        edge_agg: dict[int, Model] = {}
        for i in range(num_edges):
            if level[i] and len(present[i]):
                members = [clients[j] for j in present[i]]
                edge_agg[i] = (median(members) if aggregator == "median"
                               else mean(members, presence[present[i]]))
        result: dict[int, Model] = {}
        if lvl == 1:
            result = {i: edge_agg[i] for i in edge_agg}
            targets = {i: [i] for i in edge_agg}
        else:
            targets = {}
            for a in sorted(set(node.tolist())):
                under = [i for i in range(num_edges) if node[i] == a and i in edge_agg]
                if not under:
                    continue
                targets[a] = [i for i in range(num_edges) if node[i] == a]
                if aggregator == "median":  # median of medians, level by level
                    level_models = {i: edge_agg[i] for i in under}
                    for lv in range(2, lvl + 1):
                        below, up = p.node_of_edge(lv - 1), p.node_of_edge(lv)
                        children: dict[int, list[Model]] = {}
                        for i in under:  # one model per level-(l-1) node
                            if int(below[i]) in level_models and i == min(
                                    e for e in under if below[e] == below[i]):
                                children.setdefault(int(up[i]), []).append(
                                    level_models[int(below[i])])
                        level_models = {u: median(ms) for u, ms in children.items()}
                    result[a] = level_models[a]
                elif lvl == top and cloud_step is not None:
                    below = p.node_of_edge(top - 1)
                    kids = sorted({int(below[i]) for i in under})
                    kid_models = [mean([edge_agg[i] for i in under if below[i] == c],
                                       [presence[present[i]].sum() for i in under
                                        if below[i] == c]) for c in kids]
                    kid_weights = [float(sum(presence[present[i]].sum() for i in under
                                             if below[i] == c)) for c in kids]
                    result[a] = cloud_step(r // rounds_per_cloud, global_model, kid_models,
                                           kid_weights)
                else:
                    js = np.concatenate([present[i] for i in under])
                    result[a] = mean([clients[j] for j in js], presence[js])
        for a, model in result.items():
            for i in targets[a]:
                edges[i] = {k: v.copy() for k, v in model.items()}
                for j in np.flatnonzero(edge_of == i):
                    clients[j] = {k: v.copy() for k, v in model.items()}
                    trained[j] = False
        if lvl == top:
            global_model = result[0]
    return global_model


def local_sgd(problem: Problem, initial: Model, period: int, aggregations: int) -> Model:
    """Closed form of the flat special case: every client does ``period`` steps from the
    global model, which becomes their weighted average; ``aggregations`` times."""
    w = initial
    omega = problem.weights()
    for _ in range(aggregations):
        w = mean([gd_steps(w, x, y, problem.lr, period)
                  for x, y in zip(problem.xs, problem.ys, strict=True)], omega)
    return w


# --------------------------------------------------------------------------- asynchronous rules
Staleness = Callable[[int], float]  # τ (aggregations behind) -> s(τ)


def polynomial(a: float) -> Staleness:
    """FedAsync's polynomial s_a(t - τ) = (t - τ + 1)^(-a); a = 1/2 is FedBuff's."""
    return lambda tau: (tau + 1.0) ** (-a)


def hinge(a: float, b: float) -> Staleness:
    """FedAsync's hinge: 1 if t - τ <= b, else 1 / (a (t - τ - b) + 1)."""
    return lambda tau: 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


@dataclass(frozen=True)
class AsyncRule:
    """How an aggregation's reports make the new model (docs/hsgd.md, "Asynchronous
    rules"): ``fedbuff`` (server lr η_g), ``fedasync`` (mixing α), ``shifted-mean``."""

    name: str = "fedbuff"
    server_lr: float = 1.0
    mixing: float = 0.5
    staleness: Staleness = field(default_factory=lambda: polynomial(0.5))


@dataclass
class Report:
    """One edge report as a rule reads it: x, the edge's aggregate of its clients' models
    (unmoved); moved, the aggregate of those models each moved by w - base; base, the model
    its job started from; weight W (its clients' data weights); tau, its staleness."""

    x: Model
    moved: Model
    base: Model
    weight: float
    tau: int


def apply_rule(rule: AsyncRule, w: Model, reports: Sequence[Report],
               cloud_step: Callable[[list[Model], list[float]], Model] | None = None) -> Model:
    """The new model from the papers' equations, π_e = W_e / Σ W:

    - fedbuff (Nguyen et al. 2022): w + η_g Σ_e π_e s(τ_e) Δ_e, Δ_e = moved_e - w (the
      edge's update from its own start model: x_e - base_e under the mean);
    - fedasync (Xie et al. 2019): w + Σ_e π_e α s(τ_e) (x_e - w) (K = 1: (1 - α_t) w + α_t x);
    - shifted-mean: Σ_e A_e moved_e / Σ_e A_e, A_e = W_e s(τ_e).

    ``cloud_step`` (children, weights) -> model: the strategy instead of the final mean; it
    gets each child at w + ρ (c_e - w) weighted A_e = W_e f_e, ρ the rule's share of its
    step, so that its weighted mean is the rule's model (c_e = moved_e, or x_e under fedasync).
    """
    total = sum(r.weight for r in reports)
    if rule.name == "fedbuff":
        factors = [rule.staleness(r.tau) for r in reports]
        step = sum_models([{k: (r.moved[k] - w[k]) * (r.weight * f / total) for k in w}
                           for r, f in zip(reports, factors, strict=True)])
        new = {k: w[k] + rule.server_lr * step[k] for k in w}
        children = [r.moved for r in reports]
        share = rule.server_lr * sum(r.weight * f for r, f in zip(reports, factors,
                                                                  strict=True)) / total
    elif rule.name == "fedasync":
        factors = [rule.mixing * rule.staleness(r.tau) for r in reports]
        new = dict(w)
        for r, alpha in zip(reports, factors, strict=True):
            new = {k: new[k] + (r.weight / total) * alpha * (r.x[k] - w[k]) for k in w}
        children = [r.x for r in reports]
        share = sum(r.weight * a for r, a in zip(reports, factors, strict=True)) / total
    else:
        factors = [rule.staleness(r.tau) for r in reports]
        new = mean([r.moved for r in reports], [r.weight * f for r, f in
                                                  zip(reports, factors, strict=True)])
        children, share = [r.moved for r in reports], 1.0
    if cloud_step is None:
        return new
    return cloud_step([{k: w[k] + share * (c[k] - w[k]) for k in w} for c in children],
                      [r.weight * f for r, f in zip(reports, factors, strict=True)])


def sum_models(models: Sequence[Model]) -> Model:
    return {k: sum(m[k] for m in models) for k in models[0]}


# --------------------------------------------------------------------------- asynchronous edges
def async_hsgd(problem: Problem, initial: Model, reports: Sequence[Sequence[int]],
               edge_rule: str = "mean", cloud_step: CloudStep | None = None,
               edge_periods: Sequence[int] | None = None, rule: AsyncRule | None = None,
               ) -> tuple[Model, list[list[int]]]:
    """Asynchronous two-level H-SGD: aggregation r takes the reports of edges ``reports[r]``.

    Every edge runs jobs: from the global model of version v, P_2 steps with edge
    aggregation every P_1, then it reports. A report from version v at aggregation r
    (versions count aggregations, so r - 1 >= v) is stale by s = r - 1 - v. The reports make
    the new model by ``rule`` (:func:`apply_rule`; default FedBuff, η_g = 1,
    s = 1/sqrt(1 + s)). Under ``shifted-mean`` with the mean that is
    Σ_j a_j x_j / Σ_j a_j + Σ_e A_e (w - w_base(e)) / Σ_e A_e with a_j = w̃_j s(s_e),
    A_e = Σ_{j in e} a_j. Returns the final model and, per aggregation, [edge, s] pairs.

    ``edge_rule`` "median" (aggregators median at the edges, mean at the cloud): each edge
    takes the coordinate-wise median of its report's models (moved to x_j + (w - w_base(e))
    where the rule moves them). ``cloud_step``: the cloud's update from w and the reporting
    edges' children (in edge order, :func:`apply_rule`) instead of their weighted mean.
    ``edge_periods``: I_e per edge (each divides P_2): edge e aggregates every I_e steps
    of its job instead of every P_1.
    """
    p = problem
    rule = rule or AsyncRule()
    omega = p.weights()
    versions = [initial]  # global model after v aggregations
    version_of_edge = np.zeros(p.num_edges, dtype=np.int64)
    stalenesses: list[list[int]] = []
    for r, edges in enumerate(reports, start=1):
        w = versions[-1]
        xs, a, bases, big_a = [], [], [], []
        pairs, taken = [], []
        for e in sorted(edges):
            s = r - 1 - int(version_of_edge[e])
            pairs.append([int(e), s])
            base = versions[version_of_edge[e]]
            members = np.flatnonzero(p.edge_of == e)
            models = [base] * len(members)
            period = p.periods[0] if edge_periods is None else int(edge_periods[e])
            for step_end in range(period, p.periods[-1] + 1, period):
                models = [gd_steps(m, p.xs[j], p.ys[j], p.lr, period)
                          for m, j in zip(models, members, strict=True)]
                if step_end < p.periods[-1]:  # edge aggregation inside the job
                    avg = (median(models) if edge_rule == "median"
                           else mean(models, omega[members]))
                    models = [avg] * len(members)
            shifted = [{k: m[k] + w[k] - base[k] for k in w} for m in models]
            agg = median if edge_rule == "median" else (
                lambda ms, om=omega[members]: mean(ms, om))
            taken.append(Report(agg(models), agg(shifted), base,
                                float(omega[members].sum()), s))
            decay = rule.staleness(s)
            xs += models
            a += list(omega[members] * decay)
            bases.append(base)
            big_a.append(float(omega[members].sum() * decay))
        step = (None if cloud_step is None else
                lambda children, weights, r=r, w=w: cloud_step(r, w, children, weights))
        if rule.name == "shifted-mean" and edge_rule == "mean" and cloud_step is None:
            # the flat form over the clients (the same model as apply_rule's)
            first = mean(xs, a)
            drift = mean([{k: w[k] - b[k] for k in w} for b in bases], big_a)
            versions.append({k: first[k] + drift[k] for k in w})
        else:
            versions.append(apply_rule(rule, w, taken, step))
        for e in edges:
            version_of_edge[e] = r
        stalenesses.append(pairs)
    return versions[-1], stalenesses


# --------------------------------------------------------------------------- asynchronous regions
def async_regions_hsgd(problem: Problem, initial: Model, reports: Sequence[Sequence[int]],
                       region_buffer: int, cloud_buffer: int,
                       rule: AsyncRule | None = None) -> Model:
    """Asynchronous three-level H-SGD whose regions buffer: aggregation r takes the reports of
    edges ``reports[r]`` (docs/hsgd.md, "Asynchronous regions").

    The buffer rule, checked on ``reports``: in every aggregation each region sends at most one
    report, made of exactly K_r of its edges' reports (``region_buffer``; 0 = all of its
    edges), and the cloud takes exactly K of the regions' reports (``cloud_buffer``; 0 = one
    from every region). An AssertionError says which aggregation breaks it.

    Jobs: the edges that got the model of version v together (those of aggregation v; every
    edge at v = 0) start from it as one batch; its clients do P_3 steps, each edge averaging
    its clients every P_1 and each region the batch's clients under it every P_2, except at
    step P_3 (the report is the clients' last models). The aggregation is the rule of
    :func:`async_hsgd` (the mean at every level is the data-weighted mean over the clients):
    Σ_j a_j x_j / Σ_j a_j + Σ_e A_e (w - w_base(e)) / Σ_e A_e, a_j = ω_j / sqrt(1 + s),
    s = aggregations between the job's start model and the one that takes it, under
    ``shifted-mean``; the other rules are applied where the reports are buffered, region by
    region and then at the cloud (:func:`apply_rule_nested`).
    """
    rule = rule or AsyncRule()
    p = problem
    assert p.levels == 3, "the oracle's regions are those of a three-level tree"
    omega = p.weights()
    region = p.node_of_edge(2)
    num_regions = int(region.max()) + 1
    versions = [initial]
    version_of_edge = np.zeros(p.num_edges, dtype=np.int64)
    batches: dict[int, dict[int, Model]] = {}  # version -> client -> last model of its job

    def train_batch(v: int) -> dict[int, Model]:
        batch = [e for e in range(p.num_edges) if version_of_edge[e] == v]
        clients = [int(j) for j in np.flatnonzero(np.isin(p.edge_of, batch))]
        models = {j: versions[v] for j in clients}
        for step_end in range(p.periods[0], p.periods[-1] + 1, p.periods[0]):
            models = {j: gd_steps(models[j], p.xs[j], p.ys[j], p.lr, p.periods[0])
                      for j in clients}
            level = p.level_after(step_end)
            if level == p.levels:
                continue  # the job ends: the clients' models are the report
            node = p.node_of_edge(level)
            for a in sorted({int(node[e]) for e in batch}):
                js = [j for j in clients if node[p.edge_of[j]] == a]
                avg = mean([models[j] for j in js], omega[js])
                models.update(dict.fromkeys(js, avg))
        return models

    for r, edges in enumerate(reports, start=1):
        per_region = np.bincount(region[list(edges)], minlength=num_regions)
        sizes = np.bincount(region, minlength=num_regions)
        for a in range(num_regions):
            want = region_buffer or sizes[a]
            assert per_region[a] in (0, want), (r, a, per_region[a], want)
        assert np.count_nonzero(per_region) == (cloud_buffer or num_regions), (r, per_region)
        for e in edges:
            v = int(version_of_edge[e])
            if v not in batches:
                batches[v] = train_batch(v)
        w = versions[-1]
        xs, a_j, bases, big_a = [], [], [], []
        by_region: dict[int, list[Report]] = {}
        for e in sorted(edges):
            v = int(version_of_edge[e])
            decay = rule.staleness(r - 1 - v)
            members = np.flatnonzero(p.edge_of == e)
            xs += [batches[v][int(j)] for j in members]
            a_j += list(omega[members] * decay)
            bases.append(versions[v])
            big_a.append(float(omega[members].sum() * decay))
            models = [batches[v][int(j)] for j in members]
            by_region.setdefault(int(region[e]), []).append(Report(
                mean(models, omega[members]),
                mean([{k: m[k] + w[k] - versions[v][k] for k in w} for m in models],
                     omega[members]),
                versions[v], float(omega[members].sum()), r - 1 - v))
        if rule.name != "shifted-mean":
            versions.append(apply_rule_nested(rule, w, list(by_region.values())))
        else:
            first = mean(xs, a_j)
            drift = mean([{k: w[k] - b[k] for k in w} for b in bases], big_a)
            versions.append({k: first[k] + drift[k] for k in w})
        for e in edges:
            version_of_edge[e] = r
    return versions[-1]


def apply_rule_nested(rule: AsyncRule, w: Model, regions: Sequence[Sequence[Report]]) -> Model:
    """FedBuff or FedAsync applied where the reports are buffered: each region combines its
    edges' reports by the rule's data-weighted sum into its update U_a and weight W_a (the
    discount applied once, at each edge report's staleness; fedbuff U_a = Σ_e (W_e / W_a)
    s(τ_e) (moved_e - w), fedasync Σ_e (W_e / W_a) α s(τ_e) (x_e - w)), and the cloud
    applies w + η Σ_a (W_a / Σ W) U_a (η = η_g under fedbuff, 1 under fedasync)."""
    updates, masses = [], []
    for reports in regions:
        mass = sum(r.weight for r in reports)
        parts = []
        for r in reports:
            if rule.name == "fedbuff":
                parts.append({k: (r.moved[k] - w[k]) * (r.weight / mass * rule.staleness(r.tau))
                              for k in w})
            else:
                parts.append({k: (r.x[k] - w[k]) * (r.weight / mass * rule.mixing
                                                    * rule.staleness(r.tau)) for k in w})
        updates.append(sum_models(parts))
        masses.append(mass)
    eta = rule.server_lr if rule.name == "fedbuff" else 1.0
    total = sum(masses)
    step = sum_models([{k: u[k] * (m / total) for k in w}
                       for u, m in zip(updates, masses, strict=True)])
    return {k: w[k] + eta * step[k] for k in w}
