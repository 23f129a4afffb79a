"""Hierarchical FedAvg (H-SGD): edge aggregation beneath Flower's cloud server.

Clients run local SGD; every ``local_period`` (I) steps each edge server averages its group of
clients, every ``global_period`` (G) steps the cloud averages everything (Wang et al., AAAI
2022, "Demystifying Why Local Aggregation Helps"). Edges are logical: the ServerApp addresses
the clients through Flower's Grid and keeps one model per edge, so edge rounds inside a cloud
round need no change to Flower.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedhier.aggregate import (
    client_weights,
    occupied_segments,
    presence_weights,
    segment_weighted_mean,
)
from fedhier.cloud import cloud_update
from fedhier.communication import Communication
from fedhier.errors import ConfigError
from fedhier.faults import RunFailureError, failed_edges, non_finite_message
from fedhier.grouping import GRADIENT_GROUPING, ClientInfo
from fedhier.plan import Workload, plan_edge_round
from fedhier.records import to_tensors
from fedhier.round_diagnostics import client_diagnostics, diagnostics_due
from fedhier.topology import Hierarchy, build_hierarchy, validate_periods


class HierFedAvg(Strategy):
    """Two- (or more-) level hierarchical FedAvg on Flower's Message API.

    One call of :meth:`configure_train` / :meth:`aggregate_train` is one *edge round*: every
    client starts from its edge's model, runs I local steps, and the replies are averaged at
    the level the schedule names for that step (edge, or cloud every G steps). :meth:`start`
    runs ``num_rounds`` *cloud rounds* of G / I edge rounds each and evaluates after each.

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
        Name of the client -> edge grouping (see ``fedhier.grouping``).
    weighting : str (default: "samples")
        "samples" weights each client by its ``num-examples``; "uniform" weights clients
        equally (the papers' f = (1/n) sum_j F_j).
    seed : int (default: 0)
        Seed of the grouping draw.
    min_available_nodes : int (default: 1)
        Wait until this many nodes are connected before starting.
    arrayrecord_key, configrecord_key : str
        Keys of the ArrayRecord and ConfigRecord in messages ("arrays", "config").
    periods : sequence of int, optional
        For hierarchies deeper than two levels: all periods (P_1, ..., P_L), each a multiple
        of the one below; ``local_period`` and ``global_period`` must equal P_1 and P_L.
    cloud_strategy : flwr.serverapp.strategy.Strategy, optional
        "Hierarchical X": at each cloud step, X's ``aggregate_train`` is applied to the
        cloud's children (the edges' average models, weighted by the sum of their clients'
        weights) instead of the plain weighted average; X's ``configure_train`` is called at
        the start of each cloud round with the global model so that server optimisers
        (FedAvgM, FedAdam, ...) know the current model. X must accept ``min_available_nodes``
        of at most the number of nodes. Default: the plain average (exact H-SGD).
    workload : fedhier.plan.Workload, optional
        Partial participation (each edge samples a fraction or number of its clients per edge
        round, seeded by (seed, edge round, edge)) and stragglers doing fewer than I steps,
        optionally FedNova-normalised. Default: every client, I steps.
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
    """

    def __init__(
        self,
        local_period: int,
        global_period: int,
        num_groups: int | Sequence[int],
        grouping: str = "random",
        weighting: str = "samples",
        seed: int = 0,
        min_available_nodes: int = 1,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        periods: Sequence[int] | None = None,
        cloud_strategy: Strategy | None = None,
        workload: Workload | None = None,
        min_clients_per_edge: int = 0,
        on_nan: str = "stop",
        diagnostics_every: int = 0,
        regroup_every: int = 0,
    ) -> None:
        self.periods = tuple(periods) if periods else (local_period, global_period)
        validate_periods(self.periods)
        if self.periods[0] != local_period or self.periods[-1] != global_period:
            raise ConfigError("periods must start with local_period and end with global_period")
        if weighting not in ("samples", "uniform"):
            raise ConfigError(f"unknown weighting '{weighting}'; choose samples or uniform")
        self.local_period = local_period
        self.global_period = global_period
        self.groups = (num_groups,) if isinstance(num_groups, int) else tuple(num_groups)
        if len(self.groups) != len(self.periods) - 1:
            raise ConfigError(f"{len(self.groups)} group level(s) need "
                              f"{len(self.groups) + 1} periods, got {list(self.periods)}")
        self.grouping = grouping
        self.weighting = weighting
        self.seed = seed
        self.min_available_nodes = min_available_nodes
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        # Set by setup():
        self.node_ids: list[int] = []
        self.client_info: ClientInfo | None = None
        self.hierarchy: Hierarchy | None = None
        self.edge_arrays: list[ArrayRecord] = []
        self.communication = Communication()
        self._sent: list[int] = []
        self._query_config = ConfigRecord()
        self.cloud_strategy = cloud_strategy
        self.workload = workload or Workload()
        self.min_clients_per_edge = min_clients_per_edge
        self.on_nan = on_nan
        self.global_arrays: ArrayRecord | None = None
        self.diagnostics_every = diagnostics_every
        self.regroup_every = regroup_every
        self._cloud_round_index = 0
        self._restored_hierarchy: Hierarchy | None = None
        self._restored_client_states: dict[int, dict[str, dict[str, Any]]] = {}

    # ------------------------------------------------------------------ set-up
    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> Hierarchy: periods %s (edge every %d, cloud every %d steps)",
            list(self.periods), self.local_period, self.global_period)
        log(INFO, "\t├──> Groups per level: %s, grouping '%s'", list(self.groups), self.grouping)
        log(INFO, "\t└──> Weighting: %s", self.weighting)

    def configure_query(self, grid: Grid) -> Iterable[Message]:
        """Ask every connected node for its partition id, sample count and label histogram."""
        return [Message(RecordDict({self.configrecord_key: self._query_config}),
                        message_type=MessageType.QUERY, dst_node_id=node_id)
                for node_id in grid.get_node_ids()]

    def aggregate_query(self, replies: Iterable[Message]) -> None:
        """Order clients by partition id; group them (all but the ``gradient`` grouping)."""
        profiles = []
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(
                    f"node {reply.metadata.src_node_id} failed the profile query: "
                    f"{reply.error.reason}")
            metrics = reply.content["metrics"]
            profiles.append((int(metrics["partition-id"]), reply.metadata.src_node_id,
                             int(metrics["num-examples"]), list(metrics["label-histogram"]),
                             int(metrics.get("edge-tag", -1))))
        profiles.sort()
        ids = [p[0] for p in profiles]
        if ids != list(range(len(ids))):
            raise RuntimeError(f"partition ids must be 0..n-1 without gaps, got {ids}")
        self.node_ids = [p[1] for p in profiles]
        self.client_info = ClientInfo(
            label_histograms=np.array([p[3] for p in profiles], dtype=np.int64),
            num_examples=np.array([p[2] for p in profiles], dtype=np.int64),
            edge_tags=np.array([p[4] for p in profiles], dtype=np.int64))
        if self._restored_hierarchy is not None:  # a resumed run keeps its grouping
            self.hierarchy = self._restored_hierarchy
        elif self.grouping != GRADIENT_GROUPING:
            self.hierarchy = build_hierarchy(self.periods, self.groups, self.grouping,
                                             self.client_info, self.seed)

    def setup(self, grid: Grid, config: ConfigRecord, timeout: float,
              arrays: ArrayRecord | None = None) -> None:
        """Wait for nodes, query their profiles and group them into edges (the ``gradient``
        grouping also queries their gradients at ``arrays``)."""
        deadline = time.time() + timeout
        while len(list(grid.get_node_ids())) < self.min_available_nodes:
            if time.time() > deadline:
                raise RuntimeError(f"fewer than {self.min_available_nodes} nodes connected")
            time.sleep(0.1)
        self._query_config = config
        replies = grid.send_and_receive(self.configure_query(grid), timeout=timeout)
        self.aggregate_query(replies)
        if self.grouping == GRADIENT_GROUPING and self._restored_hierarchy is None:
            if arrays is None:
                raise ConfigError("the gradient grouping needs the model to take gradients at")
            self.regroup(grid, arrays, config, timeout, self.seed)

    def regroup(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, timeout: float,
                seed: int) -> None:
        """(Re)build the hierarchy with the configured grouping, drawing with ``seed``."""
        assert self.client_info is not None
        grads = None
        if self.grouping == GRADIENT_GROUPING:
            grads = self.query_gradients(grid, arrays, config, timeout)
            if grads is None:
                raise RunFailureError("the gradient grouping needs every client's gradient")
        self.hierarchy = build_hierarchy(self.periods, self.groups, self.grouping,
                                         self.client_info, seed, client_grads=grads,
                                         weights=self.client_weights())

    def query_gradients(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
                        timeout: float) -> torch.Tensor | None:
        """Every client's full local gradient at ``arrays``, [n, P] by client; None (with a
        warning) when a client does not answer."""
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        messages = [Message(content, message_type=f"{MessageType.QUERY}.gradient",
                            dst_node_id=node) for node in self.node_ids]
        replies = list(grid.send_and_receive(messages, timeout=timeout))
        client_of_node = {node: client for client, node in enumerate(self.node_ids)}
        grads: dict[int, torch.Tensor] = {}
        for reply in replies:
            if reply.has_error():
                continue
            grads[client_of_node[reply.metadata.src_node_id]] = (
                reply.content["gradient"].to_torch_state_dict()["g"])
        if len(grads) != len(self.node_ids):
            log(WARNING, "gradient query: %d of %d clients answered", len(grads),
                len(self.node_ids))
            return None
        return torch.stack([grads[c] for c in range(len(self.node_ids))])

    def client_weights(self) -> np.ndarray:
        """float64 [n]: each client's averaging weight under ``self.weighting``."""
        assert self.client_info is not None
        return client_weights(self.weighting, self.client_info.num_examples)

    # ------------------------------------------------------------------ training
    def edge_rounds_per_cloud_round(self) -> int:
        return self.global_period // self.local_period

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each client its edge's model for edge round ``server_round`` (1-based)."""
        hierarchy = self._require_setup()
        edge_of = hierarchy.edge_of_client()
        start = (server_round - 1) * self.local_period
        plan = plan_edge_round(hierarchy, self.workload, self.client_weights(), self.seed,
                               server_round)
        messages = []
        self._sent = []
        for client in plan.participants:
            node_id = self.node_ids[client]
            cfg = config.copy()  # its values were checked when set
            cfg["local-steps"] = int(plan.steps[client])
            if plan.scale[client] != 1.0:
                cfg["update-scale"] = float(plan.scale[client])
            cfg["start-step"] = start
            cfg["edge-round"] = server_round
            cfg["server-round"] = start // self.global_period + 1
            content = RecordDict({self.arrayrecord_key: self.edge_arrays[edge_of[client]],
                                  self.configrecord_key: cfg})
            messages.append(Message(content, message_type=MessageType.TRAIN,
                                    dst_node_id=node_id))
            self._sent.append(int(client))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the clients' models at the scheduled level; the global model at a cloud step.

        Clients that were not sampled, failed or did not reply are left out: weights
        renormalise over the present clients of each edge, and above the edges every edge with
        a present client keeps its full weight (``fedhier.aggregate.presence_weights``). An
        edge (or higher node) with no present client keeps its model.
        """
        hierarchy = self._require_setup()
        client_of_node = {node: client for client, node in enumerate(self.node_ids)}
        clients: list[int] = []
        states: list[dict[str, torch.Tensor]] = []
        losses: list[float] = []
        for reply in replies:
            if reply.has_error():
                log(WARNING, "client on node %s failed: %s", reply.metadata.src_node_id,
                    reply.error.reason.splitlines()[0] if reply.error.reason else "")
                continue
            client = client_of_node[reply.metadata.src_node_id]
            state = to_tensors(reply.content[self.arrayrecord_key], remember=False)
            loss = float(reply.content["metrics"]["train-loss"])
            if not (math.isfinite(loss) and all(bool(torch.isfinite(v).all())
                                                for v in state.values())):
                self._non_finite(client, server_round)
                continue
            clients.append(client)
            states.append(state)
            losses.append(loss)
        failed = len(self._sent) - len(clients)  # error, non-finite and missing replies
        failed_edges = self._check_edges(clients, server_round)
        last_step = server_round * self.local_period - 1
        level = hierarchy.level_after(last_step)
        model_bytes = self.edge_arrays[0].count_bytes() if self.edge_arrays else 0
        self.communication.add_edge_round(len(self._sent), len(clients), model_bytes)
        weights = self.client_weights()
        metrics = MetricRecord({"failed-clients": failed, "failed-edges": failed_edges,
                                "level": level})
        if clients:
            w = weights[clients]
            metrics["train-loss"] = float(np.dot(w, losses) / w.sum())
        if not clients or level == 0:
            return None, metrics
        index = np.array(clients)
        present = np.zeros(len(weights), dtype=bool)
        present[index] = True
        weights = presence_weights(weights, present, hierarchy.edge_of_client())
        if level == hierarchy.num_levels and self.cloud_strategy is not None:
            node_records = {0: self._cloud_step(server_round, states, index, weights)}
            has_survivor = np.ones(1, dtype=bool)
        else:
            node_records, has_survivor = self._average(states, index, weights, level)
        edge_owner = hierarchy.edges_under(level)
        for edge in range(hierarchy.num_nodes(1)):
            if has_survivor[edge_owner[edge]]:
                self.edge_arrays[edge] = node_records[edge_owner[edge]]
        self.communication.add_aggregation(hierarchy, level, model_bytes)
        if level == hierarchy.num_levels:
            return node_records.get(0), metrics
        return None, metrics

    def _non_finite(self, client: int, server_round: int) -> None:
        """A client sent NaN/inf: stop the run, or (``on_nan="skip-client"``) drop it."""
        hierarchy = self._require_setup()
        message = non_finite_message(client, int(hierarchy.edge_of_client()[client]),
                                     server_round, self.edge_rounds_per_cloud_round())
        if self.on_nan == "stop":
            raise RunFailureError(message)
        log(WARNING, "dropping the non-finite update of client %d in edge round %d", client,
            server_round)

    def _check_edges(self, clients: list[int], server_round: int) -> int:
        """Count edges left with no surviving client; enforce ``min_clients_per_edge``."""
        hierarchy = self._require_setup()
        return failed_edges(hierarchy.edge_of_client(), np.array(self._sent, dtype=np.int64),
                            np.array(clients, dtype=np.int64), hierarchy.num_nodes(1),
                            self.min_clients_per_edge, server_round)

    def _average(self, states: list[dict[str, torch.Tensor]], clients: np.ndarray,
                 weights: np.ndarray, level: int) -> tuple[dict[int, ArrayRecord], np.ndarray]:
        """Weighted average of the given clients' models per level-``level`` node.

        Returns the averages of the nodes that have at least one of the clients, and a
        bool mask [num_nodes(level)] of those nodes.
        """
        hierarchy = self._require_setup()
        num_nodes = hierarchy.num_nodes(level)
        nodes, compact = occupied_segments(hierarchy.ancestors(level)[clients], num_nodes)
        averaged = {
            key: segment_weighted_mean(torch.stack([s[key] for s in states]),
                                       torch.as_tensor(weights[clients]),
                                       torch.as_tensor(compact), len(nodes))
            for key in states[0]
        }
        has_survivor = np.zeros(num_nodes, dtype=bool)
        has_survivor[nodes] = True
        records = {int(node): ArrayRecord({k: v[i] for k, v in averaged.items()})
                   for i, node in enumerate(nodes)}
        return records, has_survivor

    def _cloud_step(self, server_round: int, states: list[dict[str, torch.Tensor]],
                    clients: np.ndarray, weights: np.ndarray) -> ArrayRecord:
        """The cloud's update with the wrapped Flower strategy, over the cloud's children.

        Each child of the cloud (an edge, or the top regions of a deeper tree) is presented
        to ``cloud_strategy.aggregate_train`` as one reply carrying its average model and, as
        ``num-examples``, the sum of its clients' weights.
        """
        hierarchy = self._require_setup()
        assert self.cloud_strategy is not None
        child_level = hierarchy.num_levels - 1
        records, has_child = self._average(states, clients, weights, child_level)
        child_weight = np.bincount(hierarchy.ancestors(child_level)[clients],
                                   weights=weights[clients], minlength=len(has_child))
        return cloud_update(self.cloud_strategy, self._cloud_round_index, records,
                            dict(enumerate(child_weight.tolist())))

    # ------------------------------------------------------------------ evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model to every client to evaluate on its own training rows."""
        cfg = ConfigRecord(dict(config))
        cfg["server-round"] = server_round
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
        return [Message(content, message_type=MessageType.EVALUATE, dst_node_id=node_id)
                for node_id in self.node_ids]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The global model over all clients: weighted loss/accuracy on their training rows
        (the global objective f(w)) and, when clients hold out rows, each client's held-out
        accuracy (``client-accuracies``, ordered by client; NaN for a client that failed)."""
        client_of_node = {node: client for client, node in enumerate(self.node_ids)}
        weights = self.client_weights()
        w, loss, acc = [], [], []
        holdout = np.full(len(self.node_ids), np.nan)
        for reply in replies:
            if reply.has_error():
                continue
            m = reply.content["metrics"]
            client = client_of_node[reply.metadata.src_node_id]
            w.append(weights[client])
            loss.append(float(m["loss"]))
            acc.append(float(m["accuracy"]))
            if "holdout-accuracy" in m:
                holdout[client] = float(m["holdout-accuracy"])
        if not w:
            return None
        wa = np.array(w)
        record = MetricRecord({"loss": float(np.dot(wa, loss) / wa.sum()),
                               "accuracy": float(np.dot(wa, acc) / wa.sum())})
        if not np.isnan(holdout).all():
            record["client-accuracies"] = holdout.tolist()
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
        evaluate_config = train_config if evaluate_config is None else evaluate_config
        self.setup(grid, train_config, timeout, initial_arrays)
        if self._restored_client_states:
            self.restore_client_states(grid, self._restored_client_states, train_config,
                                       timeout)
        self.summary()
        result = Result()
        result.arrays = initial_arrays
        arrays = initial_arrays
        train_record: dict[str, Any] = {"local_train_loss": None, "failed_clients": 0,
                                        "failed_edges": 0}
        edge_rounds = self.edge_rounds_per_cloud_round()
        self.global_arrays = arrays
        for cloud_round in range(0 if first_round == 1 else first_round,
                                 num_rounds + 1):
            if cloud_round > 0:
                train_record = self._cloud_round(cloud_round, arrays, train_config, grid,
                                                 timeout, result)
                arrays = result.arrays
                self.global_arrays = arrays
            record: dict[str, Any] = {"round": cloud_round,
                                      "iteration": cloud_round * self.global_period,
                                      "edge_rounds": cloud_round * edge_rounds}
            replies = grid.send_and_receive(
                self.configure_evaluate(cloud_round, arrays, evaluate_config, grid),
                timeout=timeout)
            client_eval = self.aggregate_evaluate(cloud_round, replies)
            if client_eval is not None:
                result.evaluate_metrics_clientapp[cloud_round] = client_eval
                record["train_loss"] = float(client_eval["loss"])
                record["train_accuracy"] = float(client_eval["accuracy"])
                if "client-accuracies" in client_eval:
                    record.update(client_accuracy_summary(
                        np.array(client_eval["client-accuracies"], dtype=np.float64)))
            record.update(train_record)
            if evaluate_fn is not None:
                res = evaluate_fn(cloud_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[cloud_round] = res
                    record.update({k.replace("-", "_"): v for k, v in res.items()})
            if diagnostics_due(cloud_round, self.diagnostics_every):
                record.update(self.diagnose(grid, arrays, train_config, timeout))
            record.update(self.communication.as_dict())
            if on_cloud_round is not None:
                on_cloud_round(record)
        return result

    def diagnose(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord,
                 timeout: float) -> dict[str, Any]:
        """Divergences and client-level diversity of the clients' gradients at ``arrays``."""
        grads = self.query_gradients(grid, arrays, config, timeout)
        if grads is None:
            return {}
        return client_diagnostics(grads, self.client_weights(), self._require_setup())

    def _cloud_round(self, cloud_round: int, arrays: ArrayRecord, config: ConfigRecord,
                     grid: Grid, timeout: float, result: Result) -> dict[str, Any]:
        """Run the G / I edge rounds of one cloud round; store the new global model."""
        regrouped: dict[str, Any] = {}
        if self.regroup_every and cloud_round > 1 and (cloud_round - 1) % self.regroup_every == 0:
            self.regroup(grid, arrays, config, timeout, self.seed + cloud_round - 1)
            regrouped = {"regrouped": True,
                         "client_to_edge": self._require_setup().edge_of_client().tolist()}
        hierarchy = self._require_setup()
        self.edge_arrays = [arrays] * hierarchy.num_nodes(1)
        self._cloud_round_index = cloud_round
        if self.cloud_strategy is not None:  # lets server optimisers see the current model
            self.cloud_strategy.configure_train(cloud_round, arrays, ConfigRecord(), grid)
        losses, failed, failed_edges = [], 0, 0
        edge_rounds = self.edge_rounds_per_cloud_round()
        for k in range(1, edge_rounds + 1):
            server_round = (cloud_round - 1) * edge_rounds + k
            replies = grid.send_and_receive(
                self.configure_train(server_round, arrays, config, grid), timeout=timeout)
            new_arrays, metrics = self.aggregate_train(server_round, replies)
            assert metrics is not None
            failed += int(metrics["failed-clients"])
            failed_edges += int(metrics["failed-edges"])
            if "train-loss" in metrics:
                losses.append(float(metrics["train-loss"]))
            if new_arrays is not None:
                result.arrays = new_arrays
        local_loss = float(np.mean(losses)) if losses else None
        result.train_metrics_clientapp[cloud_round] = MetricRecord(
            {"failed-clients": failed, "failed-edges": failed_edges})
        return {"local_train_loss": local_loss, "failed_clients": failed,
                "failed_edges": failed_edges, **regrouped}

    # ------------------------------------------------------------------ checkpoints
    def client_states(self, grid: Grid, config: ConfigRecord,
                      timeout: float) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
        """Every client's kept state (``query.state``), by client: name -> tensors.

        Through messages, so it works on every engine. A client that does not answer is
        left out (it would resume with fresh state) and named in a warning.
        """
        content = RecordDict({self.configrecord_key: config})
        messages = [Message(content, message_type=f"{MessageType.QUERY}.state",
                            dst_node_id=node) for node in self.node_ids]
        client_of_node = {node: client for client, node in enumerate(self.node_ids)}
        states: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                continue
            states[client_of_node[reply.metadata.src_node_id]] = {
                key: dict(record.to_torch_state_dict())
                for key, record in reply.content.array_records.items()}
        if len(states) != len(self.node_ids):
            missing = sorted(set(range(len(self.node_ids))) - set(states))
            log(WARNING, "checkpoint: clients %s did not send their kept state", missing[:10])
        return states

    def restore_client_states(self, grid: Grid, states: dict[int, dict[str, dict[str, Any]]],
                              config: ConfigRecord, timeout: float) -> None:
        """Send each client its kept state from a checkpoint (``query.restore``)."""
        messages = []
        for client, records in states.items():
            content = RecordDict({key: ArrayRecord(tensors) for key, tensors in records.items()})
            content[self.configrecord_key] = config
            messages.append(Message(content, message_type=f"{MessageType.QUERY}.restore",
                                    dst_node_id=self.node_ids[client]))
        failed = [reply.metadata.src_node_id
                  for reply in grid.send_and_receive(messages, timeout=timeout)
                  if reply.has_error()]
        if failed:
            raise RunFailureError(f"{len(failed)} client(s) could not restore their kept "
                                  "state from the checkpoint")

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the global model (picklable)."""
        return {"communication": self.communication.as_dict(),
                "cloud_strategy": copy.deepcopy(self.cloud_strategy),
                "hierarchy": self.hierarchy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.communication = Communication(**state["communication"])
        if state.get("cloud_strategy") is not None:
            self.cloud_strategy = state["cloud_strategy"]
        # The grouping in force when the checkpoint was taken (a regrouped one, or the
        # gradient grouping at the initial model): setup() must not draw a new one.
        self._restored_hierarchy = state.get("hierarchy")

    def restore_clients_on_start(self, states: dict[int, dict[str, dict[str, Any]]]) -> None:
        """Have :meth:`start` send the clients their kept state (from a checkpoint) once the
        nodes are known, before training."""
        self._restored_client_states = states

    def _require_setup(self) -> Hierarchy:
        if self.hierarchy is None:
            raise RuntimeError("HierFedAvg.setup(grid, ...) must run before training")
        return self.hierarchy


def client_accuracy_summary(accuracies: np.ndarray) -> dict[str, Any]:
    """Mean, 10th percentile and worst of per-client held-out accuracies (NaN = missing)."""
    valid = accuracies[~np.isnan(accuracies)]
    return {"client_accuracy_mean": float(valid.mean()),
            "client_accuracy_p10": float(np.percentile(valid, 10)),
            "client_accuracy_worst": float(valid.min()),
            "client_accuracies": [None if np.isnan(a) else float(a) for a in accuracies]}
