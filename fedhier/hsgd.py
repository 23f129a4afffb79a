"""Hierarchical SGD, written once: the round every engine runs.

A cloud round is G / I edge rounds. Each edge round:

1. **plan** who trains and for how many steps (:func:`fedhier.plan.plan_edge_round`);
2. the **executor** trains the planned clients from their edges' models (:class:`Executor`:
   Flower Grid messages in ``fedhier.strategies.grid_executor``, one batched computation in
   ``fedhier.engines.vectorized``);
3. **screen** failed and non-finite updates (``on_nan``), count failed edges
   (:mod:`fedhier.faults`), and apply FedNova scaling (:class:`fedhier.plan.Workload`);
4. **aggregate** at the level the schedule names (:meth:`Hierarchy.level_after`) with the
   level's aggregator (:mod:`fedhier.aggregate`), weights renormalised over the survivors;
5. **broadcast** each node's aggregate to the edges under it (a node without survivors keeps
   its model); at the top level the global model is the aggregate, or the :class:`CloudStep`'s
   update (e.g. a Flower strategy: "hierarchical FedAdam").

With per-edge periods (``HSGDSettings.edge_periods``, docs/hsgd.md#per-edge-periods) an edge
round is g = gcd(I_i) steps, only the edges the schedule names aggregate
(:func:`fedhier.topology.edge_levels_after`), each edge plans at the start of its own period,
and the clients of the other edges continue from their carried models
(:meth:`HierarchicalSGD.start_models`).

The run's state (hierarchy, global and edge models, traffic counters, cloud step) lives in
:class:`HierarchicalSGD`, which checkpoints and resumes itself (:meth:`state_dict`); one record
builder (:meth:`record`) defines the metrics keys of every engine. No Flower import here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.aggregate import (
    aggregator,
    check_aggregators,
    client_weights,
    occupied_segments,
    presence_weights,
)
from fedhier.communication import Communication
from fedhier.errors import ConfigError
from fedhier.faults import RunFailureError, failed_edges, non_finite_message
from fedhier.grouping import ClientInfo, grouping_needs
from fedhier.mobility import Mobility
from fedhier.plan import EdgeRoundPlan, Workload, plan_edge_round
from fedhier.reply_policy import ReplyPolicy, allowed_sizes, outlying_gradients
from fedhier.round_diagnostics import client_diagnostics, diagnostics_due
from fedhier.sim_clock import SimClock, TimeModel
from fedhier.staleness import AsyncEdges
from fedhier.topology import (
    Hierarchy,
    build_hierarchy,
    edge_levels_after,
    validate_edge_periods,
    validate_periods,
)

Params = dict[str, torch.Tensor]
log = logging.getLogger("fedhier")


# ------------------------------------------------------------------------------ the seam
@dataclass(frozen=True)
class EdgeRoundWork:
    """What an executor runs in one edge round.

    Attributes:
        edge_round: 1-based index over the whole run.
        cloud_round: 1-based cloud round it belongs to.
        start_step: global 0-based index of its first local step, (edge_round - 1) * I.
        clients: int64 [k], sorted: the clients sent work.
        steps: int64 [k], local steps of each sent client (I, fewer for a straggler).
        edge_of_client: int64 [n], the client -> edge map in force (it aggregates there).
        start_edge_of_client: int64 [n], the edge whose model each client starts from, when
            it differs from ``edge_of_client`` (a client that just moved with ``carry``
            handoff starts from its old edge's model); None = its edge's. With per-edge
            periods a row >= the number of edges E names a carried client model (below).
        carried: int64 [c], the sent clients that continue from their own model (per-edge
            periods: their edge did not aggregate after their last edge round); client
            ``carried[r]`` starts from row E + r of the start models
            (:meth:`HierarchicalSGD.start_models`). None = every client starts from an edge.
    """

    edge_round: int
    cloud_round: int
    start_step: int
    clients: np.ndarray
    steps: np.ndarray
    edge_of_client: np.ndarray
    start_edge_of_client: np.ndarray | None = None
    carried: np.ndarray | None = None

    @property
    def start_edges(self) -> np.ndarray:
        """int64 [n]: the edge whose model each client starts this edge round from."""
        return (self.edge_of_client if self.start_edge_of_client is None
                else self.start_edge_of_client)


@dataclass
class TrainResult:
    """What came back from one edge round's clients, in ``work.clients`` order.

    Attributes:
        models: name -> [k, *shape], each client's model after its local steps (rows of
            clients that are not ``ok`` are ignored).
        losses: float64 [k], each client's mean mini-batch loss (NaN where not reported).
        ok: bool [k], the client returned a model.
        loss_reported: bool [k], the client reported a loss (None: every ok client did).
        num_examples: int64 [k], the rows each client reported (None: not reported; only
            needed for clients whose profile did not say).
    """

    models: Params
    losses: np.ndarray
    ok: np.ndarray
    loss_reported: np.ndarray | None = None
    num_examples: np.ndarray | None = None


@dataclass
class ClientEvaluation:
    """The global model on each client's own rows: float64 [n] each, NaN = no answer
    (``num_examples``: int64 [n] rows each client reported, 0 = no answer, or None)."""

    loss: np.ndarray
    accuracy: np.ndarray
    holdout_accuracy: np.ndarray | None = None
    num_examples: np.ndarray | None = None

    @classmethod
    def unanswered(cls, num_clients: int) -> ClientEvaluation:
        """No client has answered yet: NaN numbers, NaN held-out accuracies, 0 rows (fill
        them in place as replies come)."""
        return cls(loss=np.full(num_clients, np.nan), accuracy=np.full(num_clients, np.nan),
                   holdout_accuracy=np.full(num_clients, np.nan),
                   num_examples=np.zeros(num_clients, dtype=np.int64))

    def if_answered(self) -> ClientEvaluation | None:
        """None when no client answered; otherwise this, without held-out accuracies when
        no client holds rows out."""
        if np.isnan(self.loss).all():
            return None
        holdout = self.holdout_accuracy
        if holdout is not None and np.isnan(holdout).all():
            return dataclasses.replace(self, holdout_accuracy=None)
        return self


class Executor(Protocol):
    """How clients run: everything H-SGD needs from them, and nothing about the algorithm."""

    def profiles(self) -> ClientInfo:
        """The clients in client order: rows per client, label histograms, edge tags."""
        ...

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        """Run ``work``: each sent client trains from ``edge_models[name][its start
        edge]`` (``work.start_edges``). ``edge_models``: name -> [E (+ c), *shape], the
        start models (:meth:`HierarchicalSGD.start_models`: the edges' models, then any
        carried client models)."""
        ...

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        """The model on every client's training (and held-out) rows; None: no answers."""
        ...

    def client_gradients(self, params: Params) -> torch.Tensor | None:
        """Every client's full local gradient [n, P] at ``params``; None if some is missing."""
        ...

    def model_bytes(self, params: Params) -> int:
        """Bytes of one model on the wire (the traffic counters' unit)."""
        ...

    def client_state(self) -> Any:
        """The clients' kept state (momentum buffers) for a checkpoint."""
        ...

    def restore_client_state(self, state: Any) -> None:
        """Put back what :meth:`client_state` returned."""
        ...


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


@dataclass(frozen=True)
class HSGDSettings:
    """The algorithm's settings (see :class:`fedhier.strategies.HierFedAvg` for each)."""

    periods: tuple[int, ...]
    groups: tuple[int, ...]
    grouping: str = "random"
    weighting: str = "samples"
    seed: int = 0
    workload: Workload = field(default_factory=Workload)
    min_clients_per_edge: int = 0
    on_nan: str = "stop"
    diagnostics_every: int = 0
    regroup_every: int = 0
    aggregators: tuple[str, ...] = ("mean",)
    mobility: Mobility = field(default_factory=Mobility)
    time_model: TimeModel = field(default_factory=TimeModel)
    asynchronous: AsyncEdges = field(default_factory=AsyncEdges)
    edge_periods: tuple[int, ...] = ()
    policy: ReplyPolicy = field(default_factory=ReplyPolicy)

    def __post_init__(self) -> None:
        validate_periods(self.periods)
        if self.edge_periods:
            validate_edge_periods(self.edge_periods, self.periods,
                                  self.groups[0] if self.groups else 0)
            if self.workload.normalize_updates and len(set(self.edge_periods)) > 1:
                raise ConfigError("normalize_updates (FedNova) is not supported with unequal "
                                  "edge_periods")
        self.time_model.check_edges(self.groups[0] if self.groups else 1)
        self.asynchronous.check(self.groups[0] if self.groups else 1)
        check_aggregators(self.aggregators, len(self.periods))
        if len(self.groups) != len(self.periods) - 1:
            raise ConfigError(f"{len(self.groups)} group level(s) need "
                              f"{len(self.groups) + 1} periods, got {list(self.periods)}")
        if self.weighting not in ("samples", "uniform"):
            raise ConfigError(f"unknown weighting '{self.weighting}'; choose samples or uniform")
        if self.on_nan not in ("stop", "skip-client"):
            raise ConfigError(f"unknown on_nan '{self.on_nan}'; choose stop or skip-client")

    @property
    def local_period(self) -> int:
        """The length of one edge round in local steps: I, or g = gcd(I_i) per edge."""
        return self.periods[0]

    @property
    def global_period(self) -> int:
        return self.periods[-1]

    @property
    def edge_rounds_per_cloud_round(self) -> int:
        return self.global_period // self.local_period


#: The training keys of a round-0 (or resumed) record.
NO_TRAINING = {"local_train_loss": None, "failed_clients": 0, "failed_edges": 0}


# ------------------------------------------------------------------------------ the algorithm
class HierarchicalSGD:
    """The state and the round of one H-SGD run, whatever executes the clients."""

    def __init__(self, settings: HSGDSettings, cloud_step: CloudStep | None = None) -> None:
        self.settings = settings
        self.cloud_step = cloud_step
        self.hierarchy: Hierarchy | None = None
        self.info: ClientInfo | None = None
        self.weights = np.zeros(0, dtype=np.float64)  # float64 [n], client averaging weights
        self.global_params: Params = {}
        self.edge_models: Params = {}  # name -> [edges, *shape]
        self.communication = Communication()
        self.model_bytes = 0
        self._restored_hierarchy: Hierarchy | None = None
        self.clock: SimClock | None = None  # simulated time (fedhier.sim_clock)
        self._restored_clock: dict[str, Any] | None = None
        self._restored_sizes: list[int] | None = None  # rows learned before a checkpoint
        self._restored_executor: Any = None  # the executor's state_dict() at a checkpoint
        self._executor: Executor | None = None
        self._maps: np.ndarray | None = None  # int64 [E, n]: this cloud round's edge maps
        self._moves: list[list[int]] = []  # [edge round, client, from, to] this cloud round
        # Per-edge periods: each client's planned steps left in its edge's period (int64 [n]),
        # its FedNova scale (float64 [n]), its model not yet aggregated (name -> [n, *shape],
        # valid where _has_carry, bool [n]) and each edge's aggregations this cloud round.
        self._remaining = np.zeros(0, dtype=np.int64)
        self._scale = np.ones(0, dtype=np.float64)
        self._carried: Params = {}
        self._has_carry = np.zeros(0, dtype=bool)
        self._edge_aggregations = np.zeros(0, dtype=np.int64)
        self._node_models: dict[int, Params] = {}  # level -> [nodes, *shape], 1 < level < L

    # ---------------------------------------------------------------- set-up and grouping
    def setup(self, executor: Executor, initial: Params, *, info: ClientInfo | None = None,
              hierarchy: Hierarchy | None = None) -> None:
        """Profile the clients, take their weights and group them (unless resumed).

        ``info`` and ``hierarchy``, when given, are the clients' profiles and the tree in
        force as another process knows them (an edge server: :mod:`fedhier.edge_tier`).
        """
        s = self.settings
        self._executor = executor
        self.info = executor.profiles() if info is None else info
        if self._restored_sizes is not None:  # rows learned from replies before a checkpoint
            if len(self._restored_sizes) != len(self.info.num_examples):
                raise ConfigError(f"the checkpoint holds the rows of "
                                  f"{len(self._restored_sizes)} clients, this run has "
                                  f"{len(self.info.num_examples)}")
            self.info = dataclasses.replace(
                self.info, num_examples=np.array(self._restored_sizes, dtype=np.int64))
        if self._restored_executor is not None:
            try:
                executor.load_state_dict(self._restored_executor)  # type: ignore[attr-defined]
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise ConfigError(f"the checkpoint's executor state does not fit this run "
                                  f"({exc}); rerun the run from the start") from None
        self.weights = self._weights_of(self.info.num_examples)
        self.global_params = dict(initial)
        self.model_bytes = executor.model_bytes(initial)
        if hierarchy is not None:
            self.hierarchy = hierarchy
        elif self._restored_hierarchy is not None:  # a resumed run keeps its grouping
            self.hierarchy = self._restored_hierarchy
        else:
            self.hierarchy = self.group(executor, initial, s.seed)
        self.clock = SimClock(s.time_model, s.seed, self.hierarchy.num_clients,
                              self.hierarchy.num_nodes(1))
        if self._restored_clock is not None:
            self.clock.load_state_dict(self._restored_clock)

    def group(self, executor: Executor, params: Params, seed: int) -> Hierarchy:
        """A hierarchy drawn by the configured grouping with ``seed`` (gradient groupings take
        the clients' gradients at ``params``)."""
        s, info = self.settings, self._info()
        needs = grouping_needs(s.grouping)
        grads = None
        if "gradients" in needs:
            grads = executor.client_gradients(params)
            if grads is None:
                raise RunFailureError(f"the '{s.grouping}' grouping needs every client's "
                                      "gradient (query.gradient)")
        if "labels" in needs and not info.label_histograms.any():
            raise ConfigError(f"the '{s.grouping}' grouping needs the clients' label "
                              "histograms, which they did not report (docs/contract.md: "
                              "the profile query); use grouping 'random' or 'contiguous'")
        return build_hierarchy(s.periods, s.groups, s.grouping, info, seed,
                               client_grads=grads, weights=self.weights)

    def learn_sizes(self, clients: np.ndarray, sizes: np.ndarray | None, *,
                    trained: bool = True) -> None:
        """Take clients' rows (int64, aligned with ``clients``) from their replies.

        A train reply's rows (``trained``) are its client's weight from then on, every
        round: a client whose data change size is re-weighted. An evaluate reply's rows only
        stand in for a client whose rows are not known yet (0: no profile, not trained yet);
        the client's first train reply replaces them (docs/contract.md, "Which rows weigh").
        """
        info = self._info()
        if sizes is None:
            return
        known = info.num_examples
        take = (sizes > 0) & (known[clients] != sizes)
        if not trained:
            take &= known[clients] <= 0
        if not take.any():
            return
        known = known.copy()
        known[clients[take]] = sizes[take]
        self.info = dataclasses.replace(info, num_examples=known)
        self.weights = self._weights_of(known)

    def _weights_of(self, claimed: np.ndarray) -> np.ndarray:
        """float64 [n] averaging weights from the clients' claimed sizes, as far as they may
        claim them (:func:`fedhier.reply_policy.allowed_sizes`)."""
        info = self._info()
        sums = np.asarray(info.label_histograms).sum(axis=1) if len(claimed) == len(
            info.label_histograms) else None
        return client_weights(self.settings.weighting, allowed_sizes(
            claimed, sums, self.settings.policy.max_weight_ratio))

    def evaluation_weights(self, evaluation: ClientEvaluation) -> np.ndarray:
        """float64 [n]: the weights of evaluation means: under ``samples`` the rows each
        client evaluated (its evaluate reply's), else (or when not reported) the clients'
        averaging weights."""
        rows = evaluation.num_examples
        if rows is None or self.settings.weighting != "samples" or not (rows > 0).any():
            return self.weights
        return client_weights(self.settings.weighting,  # a claim is capped here too
                              allowed_sizes(rows, None, self.settings.policy.max_weight_ratio))

    def regroup_due(self, cloud_round: int) -> bool:
        every = self.settings.regroup_every
        return bool(every) and cloud_round > 1 and (cloud_round - 1) % every == 0

    # ---------------------------------------------------------------- one cloud round
    def begin_cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Regroup when due, start every edge from the global model, tell the cloud step;
        returns the record keys of a regrouping ({} without one)."""
        regrouped: dict[str, Any] = {}
        mobility = self.settings.mobility
        if self.regroup_due(cloud_round):
            before = self._hierarchy()
            self.hierarchy = self.group(executor, self.global_params,
                                        self.settings.seed + cloud_round - 1)
            if mobility.active and mobility.reachability is not None:
                self.hierarchy = self.hierarchy.with_edge_map(mobility.respect(
                    before.edge_of_client(), self.hierarchy.edge_of_client(),
                    self.hierarchy.num_nodes(1)))
            regrouped = {"regrouped": True,
                         "client_to_edge": self._hierarchy().edge_of_client().tolist()}
        hierarchy = self._hierarchy()
        num_edges = hierarchy.num_nodes(1)
        self._moves = []
        self._maps = None
        if mobility.active:
            self._maps = mobility.maps(self.settings.seed, cloud_round,
                                       self.settings.edge_rounds_per_cloud_round,
                                       hierarchy.edge_of_client(), num_edges,
                                       self._info().label_histograms)
        self.edge_models = {k: v.unsqueeze(0).repeat(num_edges, *([1] * v.dim()))
                            for k, v in self.global_params.items()}
        self._node_models = {}
        n = hierarchy.num_clients
        self._remaining = np.zeros(n, dtype=np.int64)
        self._scale = np.ones(n, dtype=np.float64)
        self._has_carry = np.zeros(n, dtype=bool)
        self._edge_aggregations = np.zeros(num_edges, dtype=np.int64)
        if self.cloud_step is not None:
            self.cloud_step.begin(cloud_round, self.global_params,
                                  hierarchy.num_nodes(hierarchy.num_levels - 1))
        return regrouped

    def cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """G / I edge rounds from the global model; returns the round's training keys."""
        s = self.settings
        regrouped = self.begin_cloud_round(executor, cloud_round)
        losses: list[float] = []
        failed = failed_edge_count = 0
        edge_rounds = s.edge_rounds_per_cloud_round
        for k in range(1, edge_rounds + 1):
            edge_round = (cloud_round - 1) * edge_rounds + k
            work, plan = self.plan(edge_round)
            outcome = self.complete(work, plan, executor.train(work, self.start_models(work)))
            failed += outcome["failed_clients"]
            failed_edge_count += outcome["failed_edges"]
            if outcome["train_loss"] is not None:
                losses.append(outcome["train_loss"])
        out: dict[str, Any] = {"local_train_loss": float(np.mean(losses)) if losses else None,
               "failed_clients": failed, "failed_edges": failed_edge_count, **regrouped}
        if s.edge_periods:
            out["edge_aggregations"] = self._edge_aggregations.tolist()
        if s.mobility.active:
            out["moved_clients"] = len(self._moves)
            if self._moves:
                out["moves"] = list(self._moves)
                out["client_to_edge"] = self._hierarchy().edge_of_client().tolist()
        return out

    def plan(self, edge_round: int) -> tuple[EdgeRoundWork, EdgeRoundPlan]:
        """Who trains in ``edge_round`` (1-based), for how many steps, and where: moves
        of the mobility model that take effect in ``edge_round`` are applied here."""
        s = self.settings
        start_edges = self._move(edge_round)
        hierarchy = self._hierarchy()
        start_step = (edge_round - 1) * s.local_period
        carried = None
        if s.edge_periods:
            plan, start_edges, carried = self._plan_periods(edge_round, start_step, start_edges)
        else:
            plan = plan_edge_round(hierarchy, s.workload, self.weights, s.seed, edge_round)
        clients = plan.participants
        work = EdgeRoundWork(
            edge_round=edge_round,
            cloud_round=(edge_round - 1) // s.edge_rounds_per_cloud_round + 1,
            start_step=start_step, clients=clients,
            steps=plan.steps[clients], edge_of_client=hierarchy.edge_of_client(),
            start_edge_of_client=start_edges, carried=carried)
        return work, plan

    def _plan_periods(self, edge_round: int, start_step: int, start_edges: np.ndarray | None,
                      ) -> tuple[EdgeRoundPlan, np.ndarray | None, np.ndarray | None]:
        """Per-edge periods: the edges whose period starts at ``start_step`` plan their whole
        period (:func:`plan_edge_round`); every client then does up to g of its remaining
        planned steps, from its carried model when it has one.

        Returns the edge round's plan (steps int64 [n] in 0..g), the start rows (int64 [n] or
        None, see :class:`EdgeRoundWork`) and the carried clients (int64 [c] or None).
        """
        s, hierarchy = self.settings, self._hierarchy()
        periods = np.asarray(s.edge_periods, dtype=np.int64)
        starting = np.flatnonzero(start_step % periods == 0)
        if len(starting):
            period_plan = plan_edge_round(hierarchy, s.workload, self.weights, s.seed,
                                          edge_round, starting, s.edge_periods)
            planned = np.isin(hierarchy.edge_of_client(), starting)
            self._remaining[planned] = period_plan.steps[planned]
            self._scale[planned] = period_plan.scale[planned]
        steps = np.minimum(self._remaining, s.local_period)
        self._remaining -= steps
        carried = np.flatnonzero(self._has_carry & (steps > 0))
        if not len(carried):
            return EdgeRoundPlan(steps=steps, scale=self._scale.copy()), start_edges, None
        rows = hierarchy.edge_of_client() if start_edges is None else start_edges.copy()
        rows[carried] = hierarchy.num_nodes(1) + np.arange(len(carried))
        return EdgeRoundPlan(steps=steps, scale=self._scale.copy()), rows, carried

    def start_models(self, work: EdgeRoundWork) -> Params:
        """name -> [E + c, *shape]: the models ``work``'s clients start from, rows indexed by
        ``work.start_edges``: the E edges' models, then the c carried client models."""
        if work.carried is None:
            return self.edge_models
        index = torch.as_tensor(work.carried, device=_device(self._carried))
        return {k: torch.cat([v, self._carried[k].index_select(0, index)])
                for k, v in self.edge_models.items()}

    def _move(self, edge_round: int) -> np.ndarray | None:
        """Put the map of ``edge_round`` in force; returns the start edges of a ``carry``
        handoff (None: every client starts from its own edge's model)."""
        if self._maps is None:
            return None
        s = self.settings
        k = edge_round - ((edge_round - 1) // s.edge_rounds_per_cloud_round) * (
            s.edge_rounds_per_cloud_round)
        old = self._hierarchy().edge_of_client()
        new = self._maps[k - 1]
        moved = np.flatnonzero(new != old)
        if not len(moved):
            return None
        self.hierarchy = self._hierarchy().with_edge_map(new)
        self._moves.extend([edge_round, int(c), int(old[c]), int(new[c])] for c in moved)
        if s.mobility.handoff != "carry" and len(self._has_carry):
            self._has_carry[moved] = False  # fresh: a moved client drops its own model
        if s.mobility.handoff != "carry" or k == 1:  # k = 1: every edge holds the global model
            return None
        start = new.copy()
        start[moved] = old[moved]
        return start

    def complete(self, work: EdgeRoundWork, plan: EdgeRoundPlan, result: TrainResult, *,
                 hold_cloud: bool = False) -> dict[str, Any]:
        """Screen, scale, aggregate and broadcast one edge round's results.

        Returns its ``level``, ``failed_clients``, ``failed_edges``, ``train_loss`` (the
        client-weighted mean of the survivors' reported mean mini-batch losses, or None) and
        ``loss_weight`` (the sum of those clients' weights).
        With ``hold_cloud`` an edge round that ends at the cloud is not aggregated: the
        outcome's ``held`` is (models [s, *shape], survivors int64 [s]), the screened and
        scaled survivors' models (asynchronous edges aggregate them later).
        """
        s, hierarchy = self.settings, self._hierarchy()
        models = result.models
        scale = plan.scale[work.clients]
        if (scale != 1.0).any():
            self._scale_updates(models, work, scale)
        alive = self._screen(work, result)
        if result.num_examples is not None:
            self.learn_sizes(work.clients[alive], result.num_examples[alive])
        survivors = work.clients[alive]
        num_edges = hierarchy.num_nodes(1)
        failed = len(work.clients) - len(survivors)
        failed_edge_count = failed_edges(work.edge_of_client, work.clients, survivors,
                                         num_edges, s.min_clients_per_edge, work.edge_round)
        levels = edge_levels_after(work.edge_round * s.local_period - 1, s.periods,
                                   s.edge_periods, num_edges)
        level = int(levels.max()) if num_edges else 0
        if s.edge_periods:
            self._edge_aggregations += levels > 0
        outcome: dict[str, Any] = {"level": level, "failed_clients": failed,
                                   "failed_edges": failed_edge_count, "train_loss": None,
                                   "loss_weight": 0.0}
        reported = alive if result.loss_reported is None else alive & result.loss_reported
        if reported.any():
            w = self.weights[work.clients[reported]]
            outcome["train_loss"] = float(np.dot(w, result.losses[reported]) / w.sum())
            outcome["loss_weight"] = float(w.sum())
        if not alive.all() and len(survivors):
            rows = torch.as_tensor(np.flatnonzero(alive), device=_device(models))
            models = {k: v.index_select(0, rows) for k, v in models.items()}
        clock = self._clock()
        if s.edge_periods:
            sent = len(work.clients) - (0 if work.carried is None else len(work.carried))
            failed_here = work.clients[~alive]
            models, survivors = self._carry(work, models, survivors, levels[work.edge_of_client])
            self._time_edge_round(work, levels, np.union1d(survivors, failed_here))
        else:
            sent = len(work.clients)
            clock.edge_round(work.clients, work.steps, work.edge_of_client, self.model_bytes)
        self.communication.add_edge_round(sent, len(survivors), self.model_bytes)
        if not len(survivors):
            return outcome  # nothing came back: every edge keeps its model
        if hold_cloud and level == hierarchy.num_levels:
            outcome["held"] = (models, survivors)
            return outcome
        present = np.zeros(hierarchy.num_clients, dtype=bool)
        present[survivors] = True
        weights = presence_weights(self.weights, present, work.edge_of_client)
        if level == hierarchy.num_levels and self.cloud_step is not None:
            averaged, nodes = self._cloud_update(work.cloud_round, models, survivors, weights)
        else:
            averaged, nodes = aggregate_levels(models, survivors, weights, hierarchy, level,
                                               s.aggregators, self.node_models)
        self.communication.add_aggregation(hierarchy, level, self.model_bytes)
        clock.aggregate(hierarchy, level, self.model_bytes)
        self._broadcast(averaged, nodes, level)
        if level == hierarchy.num_levels:
            self.global_params = {k: v[0] for k, v in averaged.items()}
        return outcome

    def _time_edge_round(self, work: EdgeRoundWork, levels: np.ndarray,
                         uploading: np.ndarray) -> None:
        """Per-edge periods on the simulated clock: a client receives its edge's model only
        when it does not continue from its own, and an edge receives models only when it
        aggregates (from ``uploading``, int64: its clients aggregated now or failed)."""
        downloads = np.ones(len(work.clients), dtype=bool)
        if work.carried is not None:
            downloads[np.isin(work.clients, work.carried)] = False
        edges = work.edge_of_client[uploading]
        uploads = np.bincount(edges[levels[edges] > 0], minlength=len(levels))
        self._clock().edge_round(work.clients, work.steps, work.edge_of_client,
                                 self.model_bytes, downloads=downloads, uploads=uploads)

    def _carry(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               client_levels: np.ndarray) -> tuple[Params, np.ndarray]:
        """Per-edge periods: keep the survivors whose edge does not aggregate now as carried
        models; return the models (name -> [m, *shape]) and ids (int64 [m]) that aggregate
        now: the survivors of aggregating edges, then their edges' earlier carried models.

        ``client_levels``: int64 [n], the level each client's edge aggregates at (0 = not).
        A sent client that failed loses its carried model.
        """
        self._has_carry[work.clients] = False
        keep = client_levels[survivors] == 0
        if keep.any():
            device = _device(models)
            rows = torch.as_tensor(np.flatnonzero(keep), device=device)
            into = torch.as_tensor(survivors[keep], device=device)
            if not self._carried:
                n = len(self._has_carry)
                self._carried = {k: torch.zeros(n, *v.shape[1:], dtype=v.dtype, device=device)
                                 for k, v in models.items()}
            for key, value in models.items():
                self._carried[key].index_copy_(0, into, value.index_select(0, rows))
            self._has_carry[survivors[keep]] = True
        earlier = np.flatnonzero(self._has_carry & (client_levels > 0))
        if not keep.any() and not len(earlier):
            return models, survivors
        device = _device(models)
        now = torch.as_tensor(np.flatnonzero(~keep), device=device)
        carried = torch.as_tensor(earlier, device=device)
        out = {k: torch.cat([v.index_select(0, now), self._carried[k].index_select(0, carried)])
               for k, v in models.items()}
        self._has_carry[earlier] = False
        return out, np.concatenate([survivors[~keep], earlier]).astype(np.int64)

    def _scale_updates(self, models: Params, work: EdgeRoundWork, scale: np.ndarray) -> None:
        """FedNova: client j's model becomes w_start + s_j (w_j - w_start), w_start its
        edge's model, in place."""
        device = _device(models)
        rows = np.flatnonzero(scale != 1.0)
        index = torch.as_tensor(rows, device=device)
        edges = torch.as_tensor(work.start_edges[work.clients[rows]], device=device)
        factor = torch.as_tensor(scale[rows], device=device)
        for key, value in models.items():
            start = self.edge_models[key].index_select(0, edges)
            local = value.index_select(0, index)
            f = factor.reshape(-1, *([1] * (local.dim() - 1))).to(local.dtype)
            value.index_copy_(0, index, start + f * (local - start))

    def _screen(self, work: EdgeRoundWork, result: TrainResult) -> np.ndarray:
        """bool [k]: the clients whose update is usable. A NaN/inf model or loss stops the
        run naming the client (``on_nan="stop"``) or drops it (``"skip-client"``)."""
        alive = result.ok.copy()
        if not alive.any():
            return alive
        device = _device(result.models)
        rows = None if alive.all() else torch.as_tensor(np.flatnonzero(alive), device=device)
        loss_ok = np.isfinite(result.losses)
        if result.loss_reported is not None:  # an unreported loss is no evidence
            loss_ok |= ~result.loss_reported
        if all(_all_finite(v if rows is None else v.index_select(0, rows))
               for v in result.models.values()) and loss_ok[alive].all():
            return alive
        finite = torch.ones(len(alive), dtype=torch.bool, device=device)
        for value in result.models.values():
            finite &= torch.isfinite(value.reshape(len(alive), -1)).all(dim=1)
        bad = np.flatnonzero(alive & ~(finite.cpu().numpy() & loss_ok))
        if self.settings.on_nan == "stop":
            client = int(work.clients[bad[0]])
            raise RunFailureError(non_finite_message(
                client, int(work.edge_of_client[client]), work.edge_round,
                self.settings.edge_rounds_per_cloud_round))
        log.warning("dropping the non-finite update of client(s) %s in edge round %d",
                    work.clients[bad].tolist(), work.edge_round)
        alive[bad] = False
        return alive

    def _cloud_update(self, cloud_round: int, models: Params, survivors: np.ndarray,
                      weights: np.ndarray) -> tuple[Params, np.ndarray]:
        """The cloud step over the aggregates of the cloud's children; -> ([1, *shape], [0])."""
        hierarchy = self._hierarchy()
        child_level = hierarchy.num_levels - 1
        children, nodes = aggregate_levels(models, survivors, weights, hierarchy, child_level,
                                           self.settings.aggregators, self.node_models)
        child_weight = np.bincount(hierarchy.ancestors(child_level)[survivors],
                                   weights=weights[survivors],
                                   minlength=hierarchy.num_nodes(child_level))
        return self._cloud_step_on(cloud_round, children, nodes, child_weight[nodes])

    def _cloud_step_on(self, cloud_round: int, children: Params, nodes: np.ndarray,
                       child_weight: np.ndarray) -> tuple[Params, np.ndarray]:
        """The cloud step over the cloud's children ``nodes`` (int64 [m]) holding
        ``children`` (name -> [m, *shape]) with weights ``child_weight`` (float64 [m]);
        -> ([1, *shape], [0])."""
        assert self.cloud_step is not None
        new = self.cloud_step.step(
            cloud_round, {int(node): {k: v[i] for k, v in children.items()}
                          for i, node in enumerate(nodes)},
            {int(node): float(child_weight[i]) for i, node in enumerate(nodes)})
        if not all(bool(torch.isfinite(v).all()) for v in new.values()):
            raise RunFailureError(f"the cloud step ({_step_name(self.cloud_step)}) made the "
                                  f"global model non-finite in cloud round {cloud_round}; "
                                  "lower --server-lr or use --cloud-strategy average")
        device = _device(children)
        return {k: v.to(device).unsqueeze(0) for k, v in new.items()}, np.zeros(1, np.int64)

    def aggregate_edges(self, cloud_round: int, models: Params, edges: np.ndarray,
                        weights: np.ndarray) -> None:
        """The cloud aggregation of a two-level run from the edges' own aggregates (edge
        servers that aggregated their clients themselves: :mod:`fedhier.edge_tier`).

        Args:
            models: name -> [m, *shape], the level-1 aggregates of the m edges ``edges``
                (int64 [m], increasing) that had a surviving client; weights: float64 [m],
                each one's total client weight. With the plain mean this is the cloud step
                of :meth:`complete` up to float rounding (it averaged the clients directly).
        """
        hierarchy = self._hierarchy()
        level = hierarchy.num_levels
        if self.cloud_step is not None:
            averaged, nodes = self._cloud_step_on(cloud_round, models, edges, weights)
        else:
            rule = aggregator(self.settings.aggregators[-1])
            device = _device(models)
            w = torch.as_tensor(weights, device=device)
            owner = torch.zeros(len(edges), dtype=torch.int64, device=device)
            averaged = rule.apply(models, w, owner, 1, self.node_models(level, np.zeros(1)))
            nodes = np.zeros(1, dtype=np.int64)
        self.communication.add_aggregation(hierarchy, level, self.model_bytes)
        self._clock().aggregate(hierarchy, level, self.model_bytes)
        self._broadcast(averaged, nodes, level)
        self.global_params = {k: v[0] for k, v in averaged.items()}

    def node_models(self, level: int, nodes: np.ndarray) -> Params:
        """The current models of level-``level`` nodes ``nodes`` (int64 [m]): name ->
        [m, *shape]; an edge's model, the global model at the top, and in between the node's
        last aggregate this cloud round (the global model before one)."""
        hierarchy = self._hierarchy()
        device = _device(self.global_params)
        index = torch.as_tensor(np.asarray(nodes, dtype=np.int64), device=device)
        if level == 1:
            return {k: v.index_select(0, index) for k, v in self.edge_models.items()}
        if level == hierarchy.num_levels or level not in self._node_models:
            return {k: v.unsqueeze(0).expand(len(index), *v.shape)
                    for k, v in self.global_params.items()}
        return {k: v.index_select(0, index) for k, v in self._node_models[level].items()}

    def _remember_nodes(self, averaged: Params, nodes: np.ndarray, level: int) -> None:
        """Levels strictly between the edges and the cloud: the nodes under (or at) a
        level-``level`` node in ``nodes`` take its aggregate (for :meth:`node_models`)."""
        hierarchy = self._hierarchy()
        position = np.full(hierarchy.num_nodes(level), -1, dtype=np.int64)
        position[nodes] = np.arange(len(nodes))
        device = _device(averaged)
        for lv in range(2, min(level, hierarchy.num_levels - 1) + 1):
            above = np.arange(hierarchy.num_nodes(lv))
            for k in range(lv, level):
                above = hierarchy.parents[k][above]
            source = position[above]
            updated = np.flatnonzero(source >= 0)
            if lv not in self._node_models:
                self._node_models[lv] = {k: v.unsqueeze(0).repeat(len(above), *([1] * v.dim()))
                                         for k, v in self.global_params.items()}
            src = torch.as_tensor(source[updated], device=device)
            dst = torch.as_tensor(updated, device=device)
            for key, value in averaged.items():
                self._node_models[lv][key].index_copy_(0, dst, value.index_select(0, src))

    def _broadcast(self, averaged: Params, nodes: np.ndarray, level: int) -> None:
        """Edges under a level-``level`` node in ``nodes`` take its aggregate."""
        hierarchy = self._hierarchy()
        if 1 < level < hierarchy.num_levels and any(
                aggregator(name).needs_reference for name in self.settings.aggregators):
            self._remember_nodes(averaged, nodes, level)
        position = np.full(hierarchy.num_nodes(level), -1, dtype=np.int64)
        position[nodes] = np.arange(len(nodes))
        source = position[hierarchy.edges_under(level)]
        updated = np.flatnonzero(source >= 0)
        device = _device(averaged)
        src = torch.as_tensor(source[updated], device=device)
        dst = torch.as_tensor(updated, device=device)
        for key, value in averaged.items():
            self.edge_models[key].index_copy_(0, dst, value.index_select(0, src))

    # ---------------------------------------------------------------- records and the loop
    def record(self, executor: Executor, cloud_round: int, trained: Mapping[str, Any],
               evaluate_fn: Callable[[int, Params], Mapping[str, Any]] | None = None,
               ) -> dict[str, Any]:
        """The metrics record of a cloud round (round 0: the initial model): the one place
        that defines metrics.jsonl's keys for every engine."""
        s = self.settings
        record: dict[str, Any] = {"round": cloud_round,
                                  "iteration": cloud_round * s.global_period,
                                  "edge_rounds": cloud_round * s.edge_rounds_per_cloud_round}
        evaluation = executor.evaluate(self.global_params, cloud_round)
        if evaluation is not None:
            self.learn_sizes(np.arange(len(self.weights)), evaluation.num_examples,
                             trained=False)
            record.update(evaluation_metrics(evaluation, self.evaluation_weights(evaluation)))
        record.update(trained)
        excluded = getattr(executor, "excluded_clients", None)
        if excluded:
            record["excluded_clients"] = sorted(excluded)
        if evaluate_fn is not None:
            record.update(evaluate_fn(cloud_round, self.global_params))
        if diagnostics_due(cloud_round, s.diagnostics_every):
            grads = executor.client_gradients(self.global_params)
            if grads is None:
                log.warning("divergences need every client's gradient (query.gradient, "
                            "docs/contract.md): not recorded for round %d", cloud_round)
            else:
                flagged = outlying_gradients(grads)
                weights = self.weights
                if flagged.any():
                    record["diagnostics_flagged_clients"] = np.flatnonzero(flagged).tolist()
                    grads = torch.where(torch.as_tensor(flagged, device=grads.device)[:, None],
                                        torch.zeros((), dtype=grads.dtype, device=grads.device),
                                        grads)
                    weights = np.where(flagged, 0.0, weights)
                record.update(client_diagnostics(grads, weights, self._hierarchy()))
        record.update(self.communication.as_dict())
        record["sim_seconds"] = self.elapsed_seconds()
        return record

    def elapsed_seconds(self) -> float:
        """The run's simulated time so far (:mod:`fedhier.sim_clock`)."""
        return self._clock().seconds

    def run(self, executor: Executor, initial: Params, num_rounds: int, *,
            first_round: int = 1,
            evaluate_fn: Callable[[int, Params], Mapping[str, Any]] | None = None,
            on_record: Callable[[dict[str, Any]], None] | None = None,
            client_state: Any = None) -> Params:
        """Set up, then cloud rounds ``first_round .. num_rounds`` (round 0, the initial
        model, is recorded when starting fresh); returns the final global model.

        ``first_round`` > 1 resumes: ``initial`` is then the model after round
        ``first_round - 1`` and ``client_state`` the clients' kept state at that point.
        """
        self.setup(executor, initial)
        if client_state:
            executor.restore_client_state(client_state)
        for cloud_round in range(0 if first_round == 1 else first_round, num_rounds + 1):
            trained = dict(NO_TRAINING)
            if cloud_round > 0:
                trained = self.cloud_round(executor, cloud_round)
            record = self.record(executor, cloud_round, trained, evaluate_fn)
            if on_record is not None:
                on_record(record)
        return self.global_params

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the global model and the clients' state: also
        the rows learned from replies (``num_examples``, ints by client) and the executor's
        own state when it keeps any (an optional ``state_dict()`` / ``load_state_dict()``
        pair of plain ints, lists and strings: a GridExecutor's reply guard)."""
        hook = getattr(self._executor, "state_dict", None)
        return {"communication": self.communication.as_dict(),
                "cloud_step": copy.deepcopy(self.cloud_step), "hierarchy": self.hierarchy,
                "clock": self._clock().state_dict(),
                "num_examples": [int(n) for n in self._info().num_examples],
                **({"executor": hook()} if hook is not None else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.communication = Communication(**state["communication"])
        if state.get("cloud_step") is not None:
            self.cloud_step = state["cloud_step"]
        # The grouping in force at the checkpoint (a regrouped or gradient-based one):
        # setup() must not draw a new one.
        self._restored_hierarchy = state.get("hierarchy")
        self._restored_clock = state.get("clock")  # None in checkpoints before sim_seconds
        # None in checkpoints written before these were kept: the profiles' sizes, a fresh guard
        sizes, executor_state = state.get("num_examples"), state.get("executor")
        if sizes is not None and (not isinstance(sizes, list) or not all(
                type(n) is int and n >= 0 for n in sizes)):
            raise TypeError("num_examples is not a list of row counts >= 0")
        if executor_state is not None and not isinstance(executor_state, dict):
            raise TypeError("the executor state is not a table")
        self._restored_sizes, self._restored_executor = sizes, executor_state

    def _hierarchy(self) -> Hierarchy:
        if self.hierarchy is None:
            raise RuntimeError("HierarchicalSGD.setup(executor, ...) must run before training")
        return self.hierarchy

    def _clock(self) -> SimClock:
        if self.clock is None:
            raise RuntimeError("HierarchicalSGD.setup(executor, ...) must run first")
        return self.clock

    def _info(self) -> ClientInfo:
        if self.info is None:
            raise RuntimeError("HierarchicalSGD.setup(executor, ...) must run first")
        return self.info


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
        # without a reference, a rule that needs one refuses in Aggregator.apply
        start = reference(lv, nodes) if rule.needs_reference and reference else None
        values = rule.apply(values, w, owner, len(nodes), start)
        member_weights = np.bincount(compact, weights=member_weights, minlength=len(nodes))
        members = nodes
    return values, members


def evaluation_metrics(evaluation: ClientEvaluation, weights: np.ndarray) -> dict[str, Any]:
    """train_loss / train_accuracy: client-weighted over the clients that answered (the
    global objective f(w)), and the held-out accuracy summary when clients hold rows out."""
    answered = ~np.isnan(evaluation.loss)
    if not answered.any():
        return {}
    w = weights[answered]
    out: dict[str, Any] = {
        "train_loss": float(np.dot(w, evaluation.loss[answered]) / w.sum()),
        "train_accuracy": float(np.dot(w, evaluation.accuracy[answered]) / w.sum())}
    holdout = evaluation.holdout_accuracy
    if holdout is not None and not np.isnan(holdout).all():
        out.update(client_accuracy_summary(holdout))
    return out


def client_accuracy_summary(accuracies: np.ndarray) -> dict[str, Any]:
    """Mean, 10th percentile and worst of per-client held-out accuracies (NaN = missing)."""
    valid = accuracies[~np.isnan(accuracies)]
    return {"client_accuracy_mean": float(valid.mean()),
            "client_accuracy_p10": float(np.percentile(valid, 10)),
            "client_accuracy_worst": float(valid.min()),
            "client_accuracies": [None if np.isnan(a) else float(a) for a in accuracies]}


def _all_finite(value: torch.Tensor) -> bool:
    """Whether every entry of ``value`` is finite, without a bool copy of it ([n, *shape]:
    gigabytes at 100,000 clients): a NaN or inf entry makes the sum NaN or inf, so a finite
    sum proves them all finite; only a non-finite sum (or a float overflow) checks entries."""
    if value.is_floating_point() and bool(torch.isfinite(value.sum())):
        return True
    return bool(torch.isfinite(value).all())


def _device(params: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(params.values())).device


def _step_name(step: Any) -> str:
    """The class name of a cloud step, or of the Flower strategy it wraps."""
    return type(getattr(step, "strategy", step)).__name__
