"""Hierarchical SGD, written once: the round every engine runs.

A cloud round is G / I edge rounds; one loop runs them and asks the round's parts
(:mod:`fedhier.round`, docs/index.md "The round as parts") their questions, naming none of the
features behind them. Each part is chosen once per run from the settings:

1. **membership** (:mod:`fedhier.round.membership`): the tree a cloud round starts with
   (regrouping) and the client -> edge map of each edge round (mobility, with its handoff);
2. **schedule** (:mod:`fedhier.round.schedule`): who trains for how many steps
   (:func:`fedhier.round.participants.plan_edge_round`), from which models, and at which level each
   edge aggregates after the edge round (equal or per-edge periods);
3. the **executor** trains the planned clients (:class:`Executor`: Flower Grid messages in
   ``fedhier.strategies.grid_executor``, one batched computation in
   ``fedhier.engines.vectorized.engine``);
4. **updates** (:mod:`fedhier.round.updates`): FedNova scaling, then failed and non-finite
   updates screened out (``on_nan``); failed edges counted (:mod:`fedhier.round.faults`);
5. **aggregation** (:mod:`fedhier.round.aggregation`) at the level the schedule names with the
   level's rule from the registry (:mod:`fedhier.round.aggregators.averaging`), weights renormalised
   over the survivors, each node's aggregate broadcast to the edges under it (a node without
   survivors keeps its model); at the top the **cloud step** (:mod:`fedhier.round.cloud`: the plain
   mean, or a :class:`CloudStep` such as a Flower strategy) makes the global model;
6. the **clock** (:mod:`fedhier.round.clock`) is charged by the schedule and the aggregation.

The run's state (hierarchy, global and edge models, traffic counters, cloud step) lives in
:class:`HierarchicalSGD`, which checkpoints and resumes itself (:meth:`state_dict`); one record
builder (:meth:`record`) defines the metrics keys of every engine. No Flower import here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.diagnostics.in_rounds import diagnostics_due
from fedhier.local.quantization import upload_bytes
from fedhier.round.aggregation import (
    NodeModels,
    aggregate_levels,
    broadcast,
    needs_node_models,
    new_run,
)
from fedhier.round.aggregators.averaging import (
    check_aggregators,
    check_metrics_aggregator,
    presence_weights,
)
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.round.clock import SimClock, TimeModel
from fedhier.round.cloud import CloudStep, cloud_update, cloud_update_of_children
from fedhier.round.executor import (
    ClientEvaluation,
    EdgeRoundWork,
    Executor,
    Params,
    TrainResult,
    device_of,
)
from fedhier.round.faults import failed_edges
from fedhier.round.membership import (
    RoundPace,
    draw_hierarchy,
    membership_for,
    regroup_due,
)
from fedhier.round.participants import EdgeRoundPlan, Workload
from fedhier.round.record_fields import (
    client_accuracy_summary,
    diagnostics_record,
    evaluation_metrics,
)
from fedhier.round.reply_policy import ReplyPolicy
from fedhier.round.restore import Restored
from fedhier.round.rounds import CloudRounds, RoundsFactory, Settled, rounds_for
from fedhier.round.schedule import schedule_for
from fedhier.round.traffic import Communication
from fedhier.round.updates import all_finite as _all_finite
from fedhier.round.updates import screen, survivors_loss
from fedhier.round.weights import evaluation_weights, learned_sizes, weights_of
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy, check_schedule
from fedhier.tree.mobility import Mobility

#: Importable from here as before the round was split into parts (engines, strategies, tests).
__all__ = ["NO_TRAINING", "ClientEvaluation", "CloudRounds", "CloudStep", "EdgeRoundWork",
           "Executor", "HSGDSettings", "HierarchicalSGD", "Params", "RoundsFactory", "Settled",
           "TrainResult", "_all_finite", "aggregate_levels", "client_accuracy_summary",
           "evaluation_metrics"]


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
    quantize_bits: int = 0  # clients' uploads counted at b bits per value (0: float32)
    metrics_aggregator: str = "mean"

    def __post_init__(self) -> None:
        check_schedule(self.periods, self.groups, self.edge_periods)
        check_metrics_aggregator(self.metrics_aggregator, self.aggregators)
        self.time_model.check_edges(self.groups[0] if self.groups else 1)
        self.asynchronous.check(self.groups[0] if self.groups else 1)
        check_aggregators(self.aggregators, len(self.periods))
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

    def edge_rounds_of(self, cloud_round: int) -> range:
        """The 1-based edge rounds of cloud round ``cloud_round`` (1-based)."""
        per_round = self.edge_rounds_per_cloud_round
        return range((cloud_round - 1) * per_round + 1, cloud_round * per_round + 1)


#: The training keys of a round-0 (or resumed) record.
NO_TRAINING = {"local_train_loss": None, "failed_clients": 0, "failed_edges": 0}


# ------------------------------------------------------------------------------ the algorithm
class HierarchicalSGD:
    """The state and the round of one H-SGD run, whatever executes the clients."""

    def __init__(self, settings: HSGDSettings, cloud_step: CloudStep | None = None,
                 rounds: RoundsFactory | None = None) -> None:
        """``rounds``: the :class:`CloudRounds` part (default: the one the settings ask for,
        :func:`fedhier.round.rounds.rounds_for`)."""
        self.settings = settings
        self.cloud_step = cloud_step
        self.membership = membership_for(settings)  # the parts, chosen once (fedhier.round)
        self.schedule = schedule_for(settings)
        self.hierarchy: Hierarchy | None = None
        self.info: ClientInfo | None = None
        self.weights = np.zeros(0, dtype=np.float64)  # float64 [n], client averaging weights
        self.global_params: Params = {}
        self.edge_models: Params = {}  # name -> [edges, *shape]
        self.inner_nodes = NodeModels()  # the levels between the edges and the cloud
        self.communication = Communication()
        self.model_bytes = 0
        self.upload_bytes: int | None = None  # one client's upload (None: model_bytes)
        self.clock: SimClock | None = None  # simulated time (fedhier.round.clock)
        self._restored = Restored()  # what a checkpoint gives back (load_state_dict)
        self._executor: Executor | None = None
        self.rounds: CloudRounds = (rounds or rounds_for(settings))(self)

    # ---------------------------------------------------------------- set-up and grouping
    def setup(self, executor: Executor, initial: Params, *, info: ClientInfo | None = None,
              hierarchy: Hierarchy | None = None) -> None:
        """Profile the clients, take their weights and group them (unless resumed).

        ``info`` and ``hierarchy``, when given, are the clients' profiles and the tree in
        force as another process knows them (an edge server: :mod:`fedhier.round.tiers.jobs`).
        """
        s = self.settings
        self._executor = executor
        if info is None:  # a run, not an edge server's job: rules' size warnings told anew
            new_run()
        self.info = self._restored.info(executor.profiles() if info is None else info)
        self._restored.restore_executor(executor)
        self.weights = self._weights_of(self.info.num_examples)
        self.global_params = dict(initial)
        self.model_bytes = executor.model_bytes(initial)
        self.upload_bytes = upload_bytes(initial, self.model_bytes, s.quantize_bits)
        if hierarchy is not None:
            self.hierarchy = hierarchy
        elif self._restored.hierarchy is not None:  # a resumed run keeps its grouping
            self.hierarchy = self._restored.hierarchy
        else:
            self.hierarchy = self.group(executor, initial, s.seed)
        self.clock = SimClock(s.time_model, s.seed, self.hierarchy.num_clients,
                              self.hierarchy.num_nodes(1), upload_bytes=self.upload_bytes)
        if self._restored.clock is not None:
            self.clock.load_state_dict(self._restored.clock)
        self.rounds.setup(executor)
        attach = getattr(executor, "attach", None)  # an executor placing clients by the tree
        if attach is not None:
            attach(self.hierarchy)

    def group(self, executor: Executor, params: Params, seed: int) -> Hierarchy:
        """A hierarchy drawn by the configured grouping with ``seed`` (gradient groupings take
        the clients' gradients at ``params``)."""
        return draw_hierarchy(self.settings, self._info(), self.weights, seed,
                              lambda: executor.client_gradients(params))

    def learn_sizes(self, clients: np.ndarray, sizes: np.ndarray | None, *,
                    trained: bool = True) -> None:
        """Take clients' rows (int64, aligned with ``clients``) from their replies
        (:func:`fedhier.round.weights.learned_sizes`: a train reply's rows weigh from then
        on, an evaluate reply's only for a client whose rows are not known yet)."""
        info = self._info()
        known = learned_sizes(info.num_examples, clients, sizes, trained=trained)
        if known is not None:
            self.info = dataclasses.replace(info, num_examples=known)
            self.weights = self._weights_of(known)

    def _weights_of(self, claimed: np.ndarray) -> np.ndarray:
        """float64 [n] averaging weights from the clients' claimed sizes."""
        return weights_of(claimed, self._info().label_histograms, self.settings.weighting,
                          self.settings.policy.max_weight_ratio)

    def evaluation_weights(self, evaluation: ClientEvaluation) -> np.ndarray:
        """float64 [n]: the weights of evaluation means (the rows each client evaluated
        under ``samples``, else the clients' averaging weights)."""
        return evaluation_weights(evaluation.num_examples, self.weights,
                                  self.settings.weighting, self.settings.policy.max_weight_ratio)

    @property
    def metrics_rule(self) -> str:
        """The rule that averages the clients' evaluations (``metrics_aggregator``;
        ``model``: the cloud level's rule)."""
        s = self.settings
        return s.aggregators[-1] if s.metrics_aggregator == "model" else s.metrics_aggregator

    def regroup_due(self, cloud_round: int) -> bool:
        return regroup_due(self.settings.regroup_every, cloud_round)

    # ---------------------------------------------------------------- one cloud round
    def begin_cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """The membership's tree for the cloud round (a regrouping when due), every edge
        from the global model, the schedule and the cloud step told; returns the record keys
        of a membership change ({} without one)."""
        self.hierarchy, changed = self.membership.begin_cloud_round(
            cloud_round, self._hierarchy(),
            lambda seed: self.group(executor, self.global_params, seed), self._pace())
        hierarchy = self._hierarchy()
        num_edges = hierarchy.num_nodes(1)
        self.edge_models = {k: v.unsqueeze(0).repeat(num_edges, *([1] * v.dim()))
                            for k, v in self.global_params.items()}
        self.inner_nodes.reset()
        self.schedule.begin_cloud_round(hierarchy.num_clients, num_edges)
        if self.cloud_step is not None:
            self.cloud_step.begin(cloud_round, self.global_params,
                                  hierarchy.num_nodes(hierarchy.num_levels - 1))
        return changed

    def cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """One cloud round as the run's :class:`CloudRounds` part runs it; returns the
        round's training keys."""
        return self.rounds.run(executor, cloud_round)

    def plan(self, edge_round: int) -> tuple[EdgeRoundWork, EdgeRoundPlan]:
        """Who trains in ``edge_round`` (1-based), for how many steps, and where: the
        membership's changes that take effect in ``edge_round`` (moves) are applied here."""
        s = self.settings
        self.hierarchy, handoff = self.membership.enter(edge_round, self._hierarchy(),
                                                        self._pace())
        start_edges = None
        if handoff is not None:
            self.schedule.forget(handoff.dropped)
            start_edges = handoff.start_edges
        hierarchy = self._hierarchy()
        plan, start_edges, carried = self.schedule.plan(hierarchy, self.weights, edge_round,
                                                        start_edges)
        clients = plan.participants
        work = EdgeRoundWork(
            edge_round=edge_round,
            cloud_round=(edge_round - 1) // s.edge_rounds_per_cloud_round + 1,
            start_step=(edge_round - 1) * s.local_period, clients=clients,
            steps=plan.steps[clients], edge_of_client=hierarchy.edge_of_client(),
            start_edge_of_client=start_edges, carried=carried)
        return work, plan

    def start_models(self, work: EdgeRoundWork) -> Params:
        """name -> [E + c, *shape]: the models ``work``'s clients start from, rows indexed by
        ``work.start_edges``: the E edges' models, then any c carried client models."""
        return self.schedule.start_models(work, self.edge_models)

    def complete(self, work: EdgeRoundWork, plan: EdgeRoundPlan,
                 result: TrainResult) -> dict[str, Any]:
        """Scale, screen, aggregate and broadcast one edge round's results
        (:meth:`settle`, then :meth:`aggregate`); returns the outcome :meth:`settle` gives."""
        settled = self.settle(work, plan, result)
        if len(settled.survivors):
            self.aggregate(settled)
        return settled.outcome

    def settle(self, work: EdgeRoundWork, plan: EdgeRoundPlan,
               result: TrainResult) -> Settled:
        """One edge round's results scaled (FedNova), screened (failed, non-finite), counted
        and charged to the clock, not aggregated yet: a caller that aggregates elsewhere (an
        edge server's job, asynchronous edges) takes :attr:`Settled.models` instead of
        calling :meth:`aggregate`."""
        s, hierarchy = self.settings, self._hierarchy()
        models = result.models
        self.schedule.scale(models, work, plan.scale[work.clients], self.edge_models)
        alive = screen(work, result, s.on_nan, s.edge_rounds_per_cloud_round)
        if result.num_examples is not None:
            self.learn_sizes(work.clients[alive], result.num_examples[alive])
        survivors = work.clients[alive]
        num_edges = hierarchy.num_nodes(1)
        failed_edge_count = failed_edges(work.edge_of_client, work.clients, survivors,
                                         num_edges, s.min_clients_per_edge, work.edge_round)
        levels = self.schedule.levels(work.edge_round, num_edges)
        level = int(levels.max()) if num_edges else 0
        train_loss, loss_weight = survivors_loss(work, result, alive, self.weights)
        outcome: dict[str, Any] = {"level": level,
                                   "failed_clients": len(work.clients) - len(survivors),
                                   "failed_edges": failed_edge_count, "train_loss": train_loss,
                                   "loss_weight": loss_weight}
        if not alive.all() and len(survivors):
            rows = torch.as_tensor(np.flatnonzero(alive), device=device_of(models))
            models = {k: v.index_select(0, rows) for k, v in models.items()}
        models, survivors, sent = self.schedule.settle(
            work, models, survivors, work.clients[~alive], levels, self._clock(),
            self.model_bytes)
        self.communication.add_edge_round(sent, len(survivors), self.model_bytes,
                                          self.upload_bytes)
        return Settled(work, models, survivors, level, outcome)

    def aggregate(self, settled: Settled) -> None:
        """Aggregate a settled edge round's survivors at its level (the cloud step at the
        top) and broadcast the aggregates to the edges under each node."""
        hierarchy, work = self._hierarchy(), settled.work
        present = np.zeros(hierarchy.num_clients, dtype=bool)
        present[settled.survivors] = True
        weights = presence_weights(self.weights, present, work.edge_of_client)
        aggregators = self.settings.aggregators
        if settled.level == hierarchy.num_levels:
            averaged, nodes = cloud_update(self.cloud_step, work.cloud_round, settled.models,
                                           settled.survivors, weights, hierarchy, aggregators,
                                           self.node_models)
        else:
            averaged, nodes = aggregate_levels(settled.models, settled.survivors, weights,
                                               hierarchy, settled.level, aggregators,
                                               self.node_models)
        self._aggregated(averaged, nodes, settled.level)

    def aggregate_edges(self, cloud_round: int, models: Params, edges: np.ndarray,
                        weights: np.ndarray) -> None:
        """The cloud aggregation of a two-level run from the edges' own aggregates (edge
        servers that aggregated their clients themselves: :mod:`fedhier.round.tiers.jobs`).

        Args:
            models: name -> [m, *shape], the level-1 aggregates of the m edges ``edges``
                (int64 [m], increasing) that had a surviving client; weights: float64 [m],
                each one's total client weight. With the plain mean this is the cloud step
                of :meth:`complete` up to float rounding (it averaged the clients directly).
        """
        level = self._hierarchy().num_levels
        averaged, nodes = cloud_update_of_children(
            self.cloud_step, cloud_round, models, edges, weights, self.settings.aggregators,
            self.node_models(level, np.zeros(1)))
        self._aggregated(averaged, nodes, level)

    def _aggregated(self, averaged: Params, nodes: np.ndarray, level: int) -> None:
        """Count and time an aggregation at ``level``; the edges under each node in
        ``nodes`` (int64 [m]) take its aggregate (``averaged``: name -> [m, *shape]), and at
        the top it is the global model."""
        hierarchy = self._hierarchy()
        self.communication.add_aggregation(hierarchy, level, self.model_bytes)
        self._clock().aggregate(hierarchy, level, self.model_bytes)
        if 1 < level < hierarchy.num_levels and needs_node_models(self.settings.aggregators):
            self.inner_nodes.remember(averaged, nodes, level, hierarchy, self.global_params)
        broadcast(self.edge_models, averaged, nodes, level, hierarchy)
        if level == hierarchy.num_levels:
            self.global_params = {k: v[0] for k, v in averaged.items()}

    def node_models(self, level: int, nodes: np.ndarray) -> Params:
        """The current models of level-``level`` nodes ``nodes`` (int64 [m]): name ->
        [m, *shape]; an edge's model, the global model at the top, and in between the node's
        last aggregate this cloud round (the global model before one)."""
        return self.inner_nodes.of(level, nodes, self._hierarchy(), self.edge_models,
                                   self.global_params)

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
            record.update(evaluation_metrics(evaluation, self.evaluation_weights(evaluation),
                                             self.metrics_rule))
        record.update(trained)
        own = getattr(executor, "reply_metrics", None)  # the clients' own metrics, per level
        if own is not None:
            record.update(own(cloud_round, self._hierarchy()))
        excluded = getattr(executor, "excluded_clients", None)
        if excluded:
            record["excluded_clients"] = sorted(excluded)
        if evaluate_fn is not None:
            record.update(evaluate_fn(cloud_round, self.global_params))
        if diagnostics_due(cloud_round, s.diagnostics_every):
            record.update(diagnostics_record(executor, self.global_params, self.weights,
                                             self._hierarchy(), cloud_round))
        dropped = getattr(executor, "take_dropped_replies", None)
        if dropped is not None and (count := dropped()):
            record["dropped_replies"] = count  # since the last record (docs/security.md)
        record.update(self.communication.as_dict())
        record["sim_seconds"] = self.elapsed_seconds()
        return record

    def elapsed_seconds(self) -> float:
        """The run's simulated time so far (:mod:`fedhier.round.clock`; the part's)."""
        return self.rounds.elapsed_seconds()

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
                **({"executor": hook()} if hook is not None else {}),
                **self.rounds.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.communication = Communication(**state["communication"])
        if state.get("cloud_step") is not None:
            self.cloud_step = state["cloud_step"]
        self._restored = Restored.from_state(state)
        self.rounds.load_state_dict(state)

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

    def _pace(self) -> RoundPace:
        return RoundPace(self.settings.seed, self.settings.edge_rounds_per_cloud_round,
                         self._info().label_histograms)
