"""Hierarchical FedAvg (H-SGD): edge aggregation beneath Flower's cloud server.

Clients run local SGD; every ``local_period`` (I) steps each edge server averages its group of
clients, every ``global_period`` (G) steps the cloud averages everything (Wang et al., AAAI
2022, "Demystifying Why Local Aggregation Helps"). The algorithm is
:class:`fedhier.round.loop.HierarchicalSGD`, the one every engine runs; this class is its Flower
Strategy face: the clients are the Grid's nodes, reached through a
:class:`~fedhier.strategies.grid_executor.GridExecutor` under the message contract
(docs/contract.md). Edges are logical: the ServerApp keeps one model per edge, so edge rounds
inside a cloud round need no change to Flower.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

from fedhier.clients.wire.array_records import to_record, to_tensors
from fedhier.common.errors import ConfigError
from fedhier.round.asynchrony.edges import algorithm_for
from fedhier.round.asynchrony.settings import AsyncEdges
from fedhier.round.clock import TimeModel
from fedhier.round.loop import (
    EdgeRoundWork,
    HSGDSettings,
    Params,
    evaluation_metrics,
)
from fedhier.round.participants import EdgeRoundPlan, Workload
from fedhier.round.reply_policy import ReplyPolicy
from fedhier.round.traffic import Communication
from fedhier.settings.run_config import FIELD_DEFAULTS as DEFAULTS
from fedhier.strategies.cloud_step import as_cloud_step
from fedhier.strategies.fedavg_options import FedAvgOptions
from fedhier.strategies.flower_log import log_cloud_round
from fedhier.strategies.grid_executor import GridExecutor
from fedhier.tree.grouping import ClientInfo
from fedhier.tree.hierarchy import Hierarchy
from fedhier.tree.mobility import Mobility


class HierFedAvg(Strategy):
    """Two- (or more-) level hierarchical FedAvg on Flower's Message API.

    One call of :meth:`configure_train` / :meth:`aggregate_train` is one *edge round*: every
    sampled client starts from its edge's model, runs I local steps, and the replies are
    aggregated at the level the schedule names for that step (edge, or cloud every G steps).
    :meth:`start` runs ``num_rounds`` *cloud rounds* of G / I edge rounds each and evaluates
    after each.

    Parameters
    ----------
    local_period : int
        I, the edge aggregation period in local SGD steps.
    global_period : int
        G, the cloud aggregation period in local SGD steps; a multiple of I.
    num_groups : int or sequence of int
        N, the number of edge servers; for deeper trees one count per level, e.g. (8, 2) for
        8 edges under 2 regions (then ``periods`` must hold one period per level).
    grouping : str (default: "random")
        Name of the client -> edge grouping (see ``fedhier.tree.grouping``).
    weighting : str (default: "samples")
        "samples" weights each client by its ``num-examples``; "uniform" weights clients
        equally (the papers' f = (1/n) sum_j F_j).
    seed : int (default: 0)
        Seed of the grouping draw, participation sampling and stragglers.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before starting.
    arrayrecord_key, configrecord_key : str
        Keys of the ArrayRecord and ConfigRecord in messages ("arrays", "config").
    fraction_train, min_train_nodes, min_evaluate_nodes, weighted_by_key,
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        FedAvg's arguments, with their meaning under a hierarchy
        (:class:`fedhier.strategies.fedavg_options.FedAvgOptions`, docs/contract.md):
        fraction_train is the fraction of its clients each edge trains per edge round; the
        metric aggregations are applied at every level (edges, ..., cloud).
    loss_key, accuracy_key, train_loss_key : str, optional
        The reply keys of a client's evaluate loss and accuracy and of its mean train loss,
        when they are not the contract's ("loss" / "eval_loss", ...).
    periods : sequence of int, optional
        For hierarchies deeper than two levels: all periods (P_1, ..., P_L), each a multiple
        of the one below; ``local_period`` and ``global_period`` must equal P_1 and P_L.
    cloud_strategy : flwr.serverapp.strategy.Strategy, optional
        "Hierarchical X": at each cloud step, X's ``aggregate_train`` is applied to the
        cloud's children (the edges' aggregates, weighted by the sum of their clients'
        weights) instead of the plain weighted average; X's ``configure_train`` is called at
        the start of each cloud round with the global model so that server optimisers
        (FedAvgM, FedAdam, ...) know the current model. Any Strategy instance works (also
        one of your own). Default: the plain average (exact H-SGD).
    workload : fedhier.round.participants.Workload, optional
        Partial participation (each edge samples a fraction or number of its clients per edge
        round, seeded by (seed, edge round, edge)) and stragglers doing fewer than I steps,
        optionally FedNova-normalised (on the server: clients need not know). Default: every
        client, I steps.
    min_clients_per_edge : int (default: 0)
        Stop the run (``RunFailureError``) when an edge round leaves an edge with fewer surviving
        clients than this (or than it sampled, if fewer).
    on_nan : str (default: "stop")
        A client update holding NaN/inf stops the run naming the round, edge and client
        ("stop"), or is dropped like a failed client ("skip-client").
    diagnostics_every : int (default: 0)
        At the initial model and every K cloud rounds, query every client's full local
        gradient (``query.gradient``) and record the global / upward / downward divergences
        and the client-level gradient diversity (docs/diagnostics.md). 0 = off.
    regroup_every : int (default: 0)
        Regroup the clients every K cloud rounds (the grouping draws with seed + round - 1;
        ``gradient`` grouping uses the gradients at the current global model). 0 = never.
    aggregators : sequence of str (default: ("mean",))
        The aggregation rule at every level, or one per level (edge ... cloud), from
        ``fedhier.round.aggregators.averaging.AGGREGATORS`` ("mean": exact H-SGD; "median",
        "trimmed-mean", "clip", "krum", "multi-krum": robust rules, docs/security.md).
    mobility : fedhier.tree.mobility.Mobility, optional
        Clients moving between edges (a seeded rate or a trace) and the handoff policy
        (docs/hsgd.md#mobility). None = static.
    time_model : fedhier.round.clock.TimeModel, optional
        Compute and link speeds of the simulated clock behind each record's ``sim_seconds``
        (docs/hsgd.md#simulated-time). None = the defaults.
    asynchronous : fedhier.round.asynchrony.settings.AsyncEdges, optional
        Asynchronous, buffered edges: the cloud aggregates the first K edge reports on the
        simulated clock, combined by its ``rule`` (FedBuff by default, FedAsync or the
        shifted mean: fedhier.round.asynchrony.rules; docs/hsgd.md#asynchronous-edges).
        None = synchronous H-SGD.
    edge_periods : sequence of int (default: ())
        Per-edge periods I_i, one per edge, each dividing the next level's period; then
        ``local_period`` must be their gcd g, the length of an edge round
        (docs/hsgd.md#per-edge-periods). () = every edge aggregates every ``local_period``.
    fraction_evaluate : float (default: 1.0)
        Accepted as FedAvg's is, but HierFedAvg evaluates every client after each cloud
        round (the record's train_loss is the global objective over all clients); a value
        below 1 is named once in the log.
    reply_policy : fedhier.round.reply_policy.ReplyPolicy, optional
        A reply that breaks the contract stops the run or is dropped; K dropped rounds in a
        row exclude the client; the cap on a client's claimed size (docs/security.md).
        None = stop, K = 3, cap 10 x the median claim.
    metrics_aggregator : str (default: "mean")
        How the clients' evaluations become the round's loss and accuracy: "mean" (weighted
        by the rows each evaluated), a rule of ``aggregators`` without a start model
        ("median", "trimmed-mean", "krum", "multi-krum": per metric) or "model" (the cloud
        level's rule): a client cannot take over the recorded metrics (docs/security.md).
    """

    def __init__(
        self,
        local_period: int,
        global_period: int,
        num_groups: int | Sequence[int],
        grouping: str = DEFAULTS["grouping"],
        weighting: str = DEFAULTS["weighting"],
        seed: int = DEFAULTS["seed"],
        min_available_nodes: int = 1,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        periods: Sequence[int] | None = None,
        cloud_strategy: Strategy | None = None,
        workload: Workload | None = None,
        min_clients_per_edge: int = DEFAULTS["min_clients_per_edge"],
        on_nan: str = DEFAULTS["on_nan"],
        diagnostics_every: int = DEFAULTS["diagnostics_every"],
        regroup_every: int = DEFAULTS["regroup_every"],
        aggregators: Sequence[str] = (DEFAULTS["aggregators"],),
        mobility: Mobility | None = None,
        time_model: TimeModel | None = None,
        asynchronous: AsyncEdges | None = None,
        edge_periods: Sequence[int] = (),
        fraction_evaluate: float = 1.0,
        reply_policy: ReplyPolicy | None = None,
        fraction_train: float | None = None,
        min_train_nodes: int | None = None,
        min_evaluate_nodes: int | None = None,
        weighted_by_key: str = "num-examples",
        train_metrics_aggr_fn: Callable[..., MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[..., MetricRecord] | None = None,
        loss_key: str | None = None,
        accuracy_key: str | None = None,
        train_loss_key: str | None = None,
        metrics_aggregator: str = DEFAULTS["metrics_aggregator"],
    ) -> None:
        options = FedAvgOptions(
            fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn, loss_key=loss_key,
            accuracy_key=accuracy_key, train_loss_key=train_loss_key)
        all_periods = tuple(periods) if periods else (local_period, global_period)
        if all_periods[0] != local_period or all_periods[-1] != global_period:
            raise ConfigError("periods must start with local_period and end with global_period")
        groups = (num_groups,) if isinstance(num_groups, int) else tuple(num_groups)
        self._adopt(HSGDSettings(
            periods=all_periods, groups=groups, grouping=grouping, weighting=weighting,
            seed=seed, workload=options.workload(workload),
            min_clients_per_edge=min_clients_per_edge, on_nan=on_nan,
            diagnostics_every=diagnostics_every, regroup_every=regroup_every,
            aggregators=tuple(aggregators), mobility=mobility or Mobility(),
            time_model=time_model or TimeModel(), asynchronous=asynchronous or AsyncEdges(),
            edge_periods=tuple(edge_periods), policy=reply_policy or ReplyPolicy(),
            metrics_aggregator=metrics_aggregator),
            cloud_strategy, options)

    def _adopt(self, settings: HSGDSettings, cloud_strategy: Strategy | None,
               options: FedAvgOptions) -> None:
        """Hold ``settings`` (validated when they were made) and the Flower-side options."""
        self.settings = settings
        self.algorithm = algorithm_for(settings, as_cloud_step(cloud_strategy))
        self.options = options
        self.min_available_nodes = options.nodes_to_wait_for
        self.fraction_evaluate = options.fraction_evaluate
        self.arrayrecord_key = options.arrayrecord_key
        self.configrecord_key = options.configrecord_key
        self.keeps_client_state = False  # set by fedhier's ServerApp for exact checkpoints
        self.executor: GridExecutor | None = None
        self._pending: tuple[EdgeRoundWork, EdgeRoundPlan] | None = None
        self._restored_client_states: dict[int, Any] = {}

    @classmethod
    def from_settings(cls, settings: HSGDSettings, *, cloud_strategy: Strategy | None = None,
                      min_available_nodes: int = 1) -> HierFedAvg:
        """A HierFedAvg running ``settings`` (e.g. ``fedhier.runs.prepare.settings_for(cfg)``):
        held as they are, not listed field by field nor validated again."""
        strategy = cls.__new__(cls)
        strategy._adopt(settings, cloud_strategy,
                        FedAvgOptions(min_available_nodes=min_available_nodes))
        return strategy

    # ------------------------------------------------------------------ what it holds
    @property
    def periods(self) -> tuple[int, ...]:
        return self.settings.periods

    @property
    def local_period(self) -> int:
        return self.settings.local_period

    @property
    def global_period(self) -> int:
        return self.settings.global_period

    @property
    def hierarchy(self) -> Hierarchy | None:
        """The client -> edge (-> region ...) tree in force (None before set-up)."""
        return self.algorithm.hierarchy

    @property
    def client_info(self) -> ClientInfo | None:
        return self.algorithm.info

    @property
    def communication(self) -> Communication:
        """Messages and bytes sent so far on the client-edge and edge-cloud tiers."""
        return self.algorithm.communication

    @property
    def global_arrays(self) -> ArrayRecord | None:
        """The global model (None before set-up)."""
        params = self.algorithm.global_params
        return to_record(params) if params else None

    def summary(self) -> None:
        """Log the strategy's configuration (FedAvg's lines, then the hierarchy's)."""
        s = self.settings
        self.options.log_summary(s.workload.participation)
        log(INFO, "\t├──> Hierarchy: periods %s (edge every %d, cloud every %d steps)",
            list(s.periods), s.local_period, s.global_period)
        log(INFO, "\t├──> Groups per level: %s, grouping '%s'", list(s.groups), s.grouping)
        log(INFO, "\t└──> Weighting: %s, aggregators %s", s.weighting, list(s.aggregators))
        if self.fraction_evaluate < 1:
            log(INFO, "HierFedAvg evaluates every client after each cloud round: "
                "fraction_evaluate=%s is not used", self.fraction_evaluate)

    # ------------------------------------------------------------------ Flower's hooks
    def executor_for(self, grid: Grid, config: ConfigRecord, timeout: float = 3600,
                  evaluate_config: ConfigRecord | None = None) -> GridExecutor:
        o = self.options
        return GridExecutor(grid, config, evaluate_config, timeout,
                            min_available_nodes=self.min_available_nodes,
                            arrayrecord_key=self.arrayrecord_key,
                            configrecord_key=self.configrecord_key,
                            keeps_client_state=self.keeps_client_state,
                            policy=self.settings.policy, weighted_by_key=o.weighted_by_key,
                            loss_key=o.loss_key, accuracy_key=o.accuracy_key,
                            train_loss_key=o.train_loss_key, metrics=o.reply_metrics())

    def setup(self, grid: Grid, config: ConfigRecord, timeout: float,
              arrays: ArrayRecord) -> None:
        """Profile and group the grid's nodes starting from ``arrays`` (what :meth:`start`
        does first; call it before driving the hooks yourself)."""
        self.executor = self.executor_for(grid, config, timeout)
        self.algorithm.setup(self.executor, to_tensors(arrays))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each planned client its edge's model for edge round ``server_round``
        (1-based); at the first edge round of a cloud round every edge starts from
        ``arrays``."""
        if self.settings.asynchronous.active:
            raise ConfigError("asynchronous edges run through HierFedAvg.start(); the "
                              "per-edge-round hooks are synchronous H-SGD")
        if self.executor is None:
            self.setup(grid, config, 3600, arrays)
        executor = self._require_executor()
        executor.train_config = config
        edge_rounds = self.settings.edge_rounds_per_cloud_round
        if (server_round - 1) % edge_rounds == 0:  # a cloud round starts from ``arrays``
            self.algorithm.global_params = to_tensors(arrays)
            self.algorithm.begin_cloud_round(executor, (server_round - 1) // edge_rounds + 1)
        work, plan = self.algorithm.plan(server_round)
        self._pending = (work, plan)
        return executor.train_messages(work, self.algorithm.start_models(work))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the replies at the scheduled level; the global model at a cloud step.

        Clients that were not sampled, failed or did not reply are left out: weights
        renormalise over the present clients of each edge, and above the edges every edge with
        a present client keeps its full weight
        (``fedhier.round.aggregators.averaging.presence_weights``). An edge (or higher node) with no
        present client keeps its model.
        """
        if self._pending is None or self._pending[0].edge_round != server_round:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train")
        work, plan = self._pending
        template = {k: v[0] for k, v in self.algorithm.edge_models.items()}
        result = self._require_executor().read_train_replies(work, replies, template)
        outcome = self.algorithm.complete(work, plan, result)
        metrics = metric_record({"failed-clients": outcome["failed_clients"],
                                 "failed-edges": outcome["failed_edges"],
                                 "level": outcome["level"], "train-loss": outcome["train_loss"]})
        hierarchy = self.algorithm.hierarchy
        assert hierarchy is not None
        own = self._require_executor().reply_metrics(work.cloud_round, hierarchy)
        metrics.update(own.get("train_metrics", {}))  # this edge round's, all levels up
        if outcome["level"] == hierarchy.num_levels:
            return to_record(self.algorithm.global_params), metrics
        return None, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model to every client to evaluate on its own training rows."""
        executor = self._require_executor()
        executor.evaluate_config = config
        return executor.evaluate_messages(to_tensors(arrays), server_round)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The global model over all clients: weighted loss/accuracy on their training rows
        (the global objective f(w)) and, when clients hold out rows, each client's held-out
        accuracy (``client-accuracies``, ordered by client; NaN for a client that failed)."""
        executor = self._require_executor()
        evaluation = executor.read_evaluate_replies(replies, server_round)
        assert self.algorithm.hierarchy is not None
        own = executor.reply_metrics(server_round, self.algorithm.hierarchy)
        if evaluation is None:
            return MetricRecord(own["evaluate_metrics"]) if own else None
        numbers = evaluation_metrics(evaluation, self.algorithm.evaluation_weights(evaluation),
                                     self.algorithm.metrics_rule)
        record = MetricRecord({**own.get("evaluate_metrics", {}),
                               "loss": numbers["train_loss"],
                               "accuracy": numbers["train_accuracy"]})
        if evaluation.holdout_accuracy is not None:
            record["client-accuracies"] = evaluation.holdout_accuracy.tolist()
        return record

    # ------------------------------------------------------------------ driver
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        on_cloud_round: Callable[[dict[str, Any]], None] | None = None,
        first_round: int = 1,
    ) -> Result:
        """Run ``num_rounds`` cloud rounds (T = num_rounds * G local steps).

        ``evaluate_fn(round, arrays)`` evaluates the global model centrally before training
        (round 0) and after each cloud round. ``on_cloud_round(record)`` receives one dict for
        round 0 and per cloud round: round, iteration, train_loss and train_accuracy (of the
        global model on all clients' training rows, weighted: the global objective f(w)),
        local_train_loss (mean mini-batch loss), the evaluate_fn metrics, failed clients and
        the cumulative communication counters. ``self.global_arrays`` holds the global model
        when ``on_cloud_round`` runs. ``first_round`` > 1 resumes a run whose earlier rounds are
        done (``initial_arrays`` is then the model after round ``first_round - 1``; round 0 is
        not evaluated again).
        """
        train_config = ConfigRecord() if train_config is None else train_config
        # The ClientApp reads the run's configuration from every message: evaluation messages
        # carry the train config unless told otherwise.
        self.executor = self.executor_for(grid, train_config, timeout, evaluate_config)
        result = Result()
        result.arrays = initial_arrays

        def central(cloud_round: int, params: Params) -> dict[str, Any]:
            assert evaluate_fn is not None
            res = evaluate_fn(cloud_round, to_record(params))
            if res is None:
                return {}
            result.evaluate_metrics_serverapp[cloud_round] = res
            return {k.replace("-", "_"): v for k, v in res.items()}

        def on_record(record: dict[str, Any]) -> None:
            cloud_round = record["round"]
            log_cloud_round(record, num_rounds,
                            result.evaluate_metrics_serverapp.get(cloud_round))
            evaluated = dict(record.get("evaluate_metrics", {}))
            if "train_loss" in record:
                evaluated.update(loss=record["train_loss"], accuracy=record["train_accuracy"])
            if evaluated:
                result.evaluate_metrics_clientapp[cloud_round] = MetricRecord(evaluated)
            if cloud_round > 0:
                result.train_metrics_clientapp[cloud_round] = MetricRecord(
                    {**record.get("train_metrics", {}),
                     "failed-clients": record["failed_clients"],
                     "failed-edges": record["failed_edges"]})
            if on_cloud_round is not None:
                on_cloud_round(record)

        log(INFO, "Starting %s strategy:", type(self).__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        log(INFO, "")
        t_start = time.time()
        final = self.algorithm.run(
            self.executor, to_tensors(initial_arrays), num_rounds, first_round=first_round,
            evaluate_fn=central if evaluate_fn is not None else None, on_record=on_record,
            client_state=self._restored_client_states)
        result.arrays = to_record(final)
        log(INFO, "")  # Flower's closing lines, as FedAvg's start() ends
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        log(INFO, "")
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
        return result

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the global model (picklable)."""
        return self.algorithm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.algorithm.load_state_dict(state)

    def client_states(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Every client's kept state (``query.state``), by client (needs a started run)."""
        return self._require_executor().client_state()

    def restore_clients_on_start(self, states: dict[int, dict[str, dict[str, Any]]]) -> None:
        """Have :meth:`start` send the clients their kept state (from a checkpoint) once the
        nodes are known, before training."""
        self._restored_client_states = states

    def client_weights(self) -> np.ndarray:
        """float64 [n]: each client's averaging weight under the weighting."""
        return self.algorithm.weights

    def _require_executor(self) -> GridExecutor:
        if self.executor is None:
            raise RuntimeError("HierFedAvg.setup(grid, ...) or start(...) must run first")
        return self.executor


def metric_record(values: dict[str, Any]) -> MetricRecord:
    """A MetricRecord of the numbers in ``values`` (None dropped)."""
    return MetricRecord({k: v for k, v in values.items() if v is not None})
