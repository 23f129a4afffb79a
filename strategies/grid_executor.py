"""The Flower executor: H-SGD's clients as nodes of a Flower Grid, reached with messages.

Implements :class:`fedhier.round.loop.Executor` on any Grid (in-process, Simulation Engine,
Deployment Engine) following the message contract (:mod:`fedhier.strategies.replies`,
docs/contract.md). Clients are numbered by the ``partition-id`` of their profile query or,
for clients without a query handler, by node id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedhier.clients.wire.array_records import to_record
from fedhier.clients.wire.packed_model import model_record, reads_packed
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import ClientEvaluation, EdgeRoundWork, Params, TrainResult
from fedhier.round.reply_policy import ReplyGuard, ReplyPolicy, outlying_updates
from fedhier.round.tiers.moves import ClientStates
from fedhier.strategies.cloud_failure import TrainOutcomes
from fedhier.strategies.exchange import SentMessages
from fedhier.strategies.flower_log import HeldFlowerLog
from fedhier.strategies.profiles import client_info, read_profiles
from fedhier.strategies.replies import (
    ACCURACY_KEYS,
    EDGE_ROUND,
    LOCAL_STEPS,
    LOSS_KEYS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    START_STEP,
    TRAIN_LOSS_KEYS,
    ContractError,
    NonFiniteLossError,
    evaluate_rows,
    read_evaluate_reply,
    read_gradient_reply,
    read_train_reply,
    who,
)
from fedhier.strategies.reply_metrics import ReplyMetrics
from fedhier.tree.grouping import ClientInfo

log = logging.getLogger("fedhier")

#: Flower's reason for a message type the ClientApp has no handler for.
NO_HANDLER = "function registered"


class GridExecutor:
    """Clients reached through ``grid``: one message per client and task.

    Args:
        grid: any Flower Grid (inside a ServerApp: the one ``main(grid, context)`` gets).
        train_config: the ConfigRecord sent with every train message (the ClientApp's run
            configuration), to which the per-message keys of the contract are added.
        evaluate_config: sent with evaluate messages (default: ``train_config``).
        timeout: seconds to wait for each batch of replies.
        min_available_nodes: wait for this many nodes before profiling them.
        keeps_client_state: clients keep state between rounds (momentum): checkpoints then
            collect it with ``query.state`` messages.
        clients: the partition ids this grid's nodes must report, when they are some of a
            larger federation's clients (an edge server's clients); default: 0..k-1.
        num_clients: the federation's number of clients (arrays by client have this length;
            default: the number of nodes).
        policy: what a reply that breaks the contract does (:mod:`fedhier.round.reply_policy`).
        packed_models: send models packed (one object instead of 1 + 2 per tensor:
            :mod:`fedhier.clients.wire.packed_model`) when every client's profile reply says it
            reads them (fedhier's own ClientApp does; a user's app gets ArrayRecords).
        weighted_by_key: the key of a client's size in its train and evaluate replies.
        loss_key, accuracy_key, train_loss_key: a key the replies hold their evaluate loss,
            accuracy or mean train loss under, read before the contract's names.
        metrics: the clients' own metrics, aggregated per level (None: not collected).
    """

    def __init__(self, grid: Grid, train_config: ConfigRecord | None = None,
                 evaluate_config: ConfigRecord | None = None, timeout: float = 3600,
                 *, min_available_nodes: int = 1, arrayrecord_key: str = "arrays",
                 configrecord_key: str = "config", keeps_client_state: bool = False,
                 clients: Iterable[int] | None = None, num_clients: int | None = None,
                 policy: ReplyPolicy | None = None, packed_models: bool = False,
                 weighted_by_key: str = NUM_EXAMPLES, loss_key: str | None = None,
                 accuracy_key: str | None = None, train_loss_key: str | None = None,
                 metrics: ReplyMetrics | None = None) -> None:
        self.grid = grid
        self.train_config = ConfigRecord() if train_config is None else train_config
        self.evaluate_config = (self.train_config if evaluate_config is None
                                else evaluate_config)
        self.timeout = timeout
        self.min_available_nodes = min_available_nodes
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.keeps_client_state = keeps_client_state
        self.expected_clients = None if clients is None else sorted(int(c) for c in clients)
        self.num_clients = num_clients
        self.node_ids: dict[int, int] = {}  # client -> node
        self.client_of_node: dict[int, int] = {}
        self.outcomes = TrainOutcomes()  # who trained, per cloud round (cloud_failure.py)
        self.guard = ReplyGuard(policy or ReplyPolicy())
        self.packed_models = packed_models
        #: models go packed to the clients: allowed, and every profiled client reads them
        self.packs = False
        self.weighted_by_key = weighted_by_key
        self.loss_keys = (loss_key, *LOSS_KEYS) if loss_key else LOSS_KEYS
        self.accuracy_keys = (accuracy_key, *ACCURACY_KEYS) if accuracy_key else ACCURACY_KEYS
        self.train_loss_keys = ((train_loss_key, *TRAIN_LOSS_KEYS) if train_loss_key
                                else TRAIN_LOSS_KEYS)
        self.metrics = metrics
        self.sent = SentMessages()  # every reply is bound to one of them (exchange.py)
        #: client -> the most rows its replies may claim (its profile; absent: no bound)
        self.declared: dict[int, int] = {}
        self._over_declared: set[int] = set()  # clients told once that they claim more
        self.left_out: set[int] = set()  # clients without a usable profile reply (drop)
        self._train_sent: list[Message] = []
        self._evaluate_sent: list[Message] = []
        self._evaluate_round = 0

    def reply_metrics(self, cloud_round: int, hierarchy: Any) -> dict[str, Any]:
        """The record keys of the clients' own metrics of ``cloud_round``, aggregated at
        every level of ``hierarchy`` (:mod:`fedhier.strategies.reply_metrics`); {} when
        none were collected."""
        return {} if self.metrics is None else self.metrics.record(cloud_round, hierarchy)

    def state_dict(self) -> dict[str, Any]:
        """The reply guard's counts for a checkpoint (a resumed run excludes exactly the
        clients the uninterrupted run excludes)."""
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        self.guard.load_state_dict(state)

    @property
    def excluded_clients(self) -> dict[int, str]:
        """Clients sent nothing more (K bad replies in a row, or left out at the profile
        query) -> why."""
        return self.guard.excluded

    def take_dropped_replies(self) -> int:
        """Replies dropped as bad since the last call (a record's ``dropped_replies``)."""
        return self.guard.take_dropped()

    def _bind(self, messages: list[Message], replies: Iterable[Message], what: str, *,
              training: bool = False) -> list[tuple[Message, Message]]:
        """(message, its reply) for each message of the batch ``what`` answered by a reply
        bound to it (:mod:`fedhier.strategies.exchange`); every other reply is a bad reply
        under the policy (a train reply's counts toward its client's streak)."""
        bound = self.sent.bind(messages, replies, what, self.client_of_node)
        for error, client in bound.bad:
            self.guard.bad(error, client, training=training)
        silent = [self.client_of_node.get(m.metadata.dst_node_id) for m in bound.unanswered]
        named = sorted(c for c in silent if c is not None)
        if silent:
            log.warning("%s: %d of %d clients did not reply within %.0f s: %s", what,
                        len(silent), len(messages), self.timeout,
                        named[:10] if named else "(nodes not numbered yet)")
        return bound.answers

    def _exchange(self, messages: list[Message], what: str, *,
                  training: bool = False) -> list[tuple[Message, Message]]:
        """Send ``messages``, wait for their replies (the timeout) and bind them
        (:meth:`_bind`)."""
        if not messages:
            return []
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        return self._bind(messages, replies, what, training=training)

    def _client(self, message: Message) -> int:
        """The client a message of this executor was sent to."""
        return self.client_of_node[message.metadata.dst_node_id]

    # ---------------------------------------------------------------- profiles
    def profiles(self) -> ClientInfo:
        """Wait for the nodes, then ask each for its partition id, rows, label histogram and
        edge tag (the optional profile query), one node first. When that node has no query
        handler, the others are not asked (Flower would log a traceback for each): the
        clients are numbered by node id and weighted by their train replies' rows. A node
        that fails the query stops the run, or under ``drop`` leaves its client out
        (:mod:`fedhier.strategies.profiles`)."""
        nodes = self.wait_for_nodes(self.min_available_nodes, self.timeout)
        # One node first: a ClientApp without the (optional) handler answers with an error,
        # and Flower would log its traceback once per node.
        with HeldFlowerLog() as held:
            answers = self._profile_replies(nodes[:1])
        if (answers and answers[0][1].has_error()
                and NO_HANDLER in (answers[0][1].error.reason or "")):
            held.drop_errors()
            log.warning("the clients have no profile query handler (docs/contract.md): "
                        "clients are numbered by node id and weighted by the num-examples "
                        "of their train replies; label-based groupings are unavailable")
            return self._anonymous(sorted(nodes))
        held.release()
        answers += self._profile_replies(nodes[1:])
        replies = {m.metadata.dst_node_id: r for m, r in answers}
        kept, left_out = read_profiles(nodes, replies, self.expected_clients, self.guard,
                                       self.timeout)
        self.packs = self.packed_models and all(reads_packed(replies[p.node]) for p in kept)
        wanted = (list(range(len(nodes))) if self.expected_clients is None
                  else self.expected_clients)
        if self.num_clients is None:
            self.num_clients = len(wanted)
        self._number([p.node for p in kept], [p.client for p in kept])
        self.declared = {p.client: p.declared for p in kept if p.declared > 0}
        self.left_out = set(left_out)
        for client, why in left_out.items():
            self.guard.excluded.setdefault(client, why)
        return client_info(kept, wanted)

    def _profile_replies(self, nodes: list[int]) -> list[tuple[Message, Message]]:
        """The profile query's messages to ``nodes`` and their bound replies."""
        messages = [Message(RecordDict({self.configrecord_key: self.train_config}),
                            message_type=MessageType.QUERY, dst_node_id=node) for node in nodes]
        return self._exchange(messages, "the profile query")

    def wait_for_nodes(self, count: int, timeout: float, what: str = "nodes") -> list[int]:
        """The grid's node ids once at least ``count`` are connected (RunFailureError after
        ``timeout`` seconds)."""
        deadline = time.time() + timeout
        while len(nodes := list(self.grid.get_node_ids())) < count:
            if time.time() > deadline:
                raise RunFailureError(f"fewer than {count} {what} connected after "
                                      f"{timeout:.0f} s")
            time.sleep(0.1)
        return nodes

    def _number(self, node_ids: list[int], clients: list[int] | None = None) -> None:
        clients = list(range(len(node_ids))) if clients is None else clients
        self.node_ids = dict(zip(clients, node_ids, strict=True))
        self.client_of_node = {node: client for client, node in self.node_ids.items()}
        if self.num_clients is None:
            self.num_clients = len(node_ids)

    def _anonymous(self, node_ids: list[int]) -> ClientInfo:
        if self.expected_clients is not None:
            raise RunFailureError("the clients have no profile query handler; an edge "
                                  "server needs their partition ids (docs/contract.md)")
        self._number(node_ids)
        n = len(node_ids)
        return ClientInfo(label_histograms=np.zeros((n, 1), dtype=np.int64),
                          num_examples=np.zeros(n, dtype=np.int64),
                          edge_tags=np.full(n, -1, dtype=np.int64))

    # ---------------------------------------------------------------- training
    def train_messages(self, work: EdgeRoundWork, edge_models: Params) -> list[Message]:
        """One train message per sent client: its start edge's model (its edge's, or its
        old edge's after a ``carry`` handoff) and the contract's keys. An excluded client
        (or one left out at the profile query) is sent nothing: it failed the edge round."""
        records: dict[int, ArrayRecord | ConfigRecord] = {}
        messages = []
        start_edges = work.start_edges
        for client, steps in zip(work.clients.tolist(), work.steps.tolist(), strict=True):
            if client in self.guard.excluded or client not in self.node_ids:
                continue
            edge = int(start_edges[client])
            if edge not in records:
                records[edge] = model_record({k: v[edge] for k, v in edge_models.items()},
                                             self.packs)
            cfg = self.train_config.copy()  # its values were checked when set
            cfg[LOCAL_STEPS] = int(steps)
            cfg[START_STEP] = work.start_step
            cfg[EDGE_ROUND] = work.edge_round
            cfg[SERVER_ROUND] = work.cloud_round
            content = RecordDict({self.arrayrecord_key: records[edge],
                                  self.configrecord_key: cfg})
            messages.append(Message(content, message_type=MessageType.TRAIN,
                                    dst_node_id=self.node_ids[client]))
        self._train_sent = messages
        return messages

    def read_train_replies(self, work: EdgeRoundWork, replies: Iterable[Message],
                           template: Params) -> TrainResult:
        """The replies to the last :meth:`train_messages` as a :class:`TrainResult` in
        ``work.clients`` order; an error reply (or none, or a bad one) marks its client
        failed. ``template``: the model that was sent."""
        row_of = {client: row for row, client in enumerate(work.clients.tolist())}
        k = len(row_of)
        params: list[dict[str, torch.Tensor] | None] = [None] * k
        losses = np.full(k, np.nan)
        reported = np.zeros(k, dtype=bool)
        sizes = np.zeros(k, dtype=np.int64)
        sender_of: list[Message | None] = [None] * k
        failures: list[tuple[str, str | None]] = []
        what = f"edge round {work.edge_round}"
        for message, reply in self._bind(self._train_sent, replies, what, training=True):
            client = self._client(message)
            if reply.has_error():
                failures.append((who(reply, client), reply.error.reason))
                continue
            if client not in row_of:
                continue  # not planned in this edge round (a hook's own messages)
            row = row_of[client]
            try:
                parsed = read_train_reply(reply, client, self.arrayrecord_key, template,
                                          size_key=self.weighted_by_key,
                                          loss_keys=self.train_loss_keys)
            except ContractError as exc:
                self.guard.bad(exc, client)
                continue
            params[row], sender_of[row] = parsed.params, reply
            sizes[row] = self._bounded(client, parsed.num_examples, "trained on")
            if parsed.train_loss is not None:
                losses[row], reported[row] = parsed.train_loss, True
        ratio = self.guard.policy.max_update_ratio
        for row, times in outlying_updates(params, template, ratio):
            client = int(work.clients[row])
            self.guard.bad(ContractError(
                f"{who(sender_of[row], client)} replied an update {times:.3g} x the round's "
                f"median length (max_update_ratio {ratio:g}): outlying"), client)
            params[row] = None
        ok = np.array([p is not None for p in params], dtype=bool)
        if self.metrics is not None:
            for row in np.flatnonzero(ok).tolist():
                client = int(work.clients[row])
                reply_row = sender_of[row]
                assert reply_row is not None
                self.metrics.train.note(work.cloud_round, client, reply_row.content,
                                        int(work.edge_of_client[client]))
        self.outcomes.note(work.cloud_round, work.edge_round, failures, bool(ok.any()),
                           defer=self.expected_clients is None)
        models = {key: torch.stack([p[key] if p is not None else torch.zeros_like(value)
                                    for p in params]) if k else value.unsqueeze(0)[:0]
                  for key, value in template.items()}
        return TrainResult(models=models, losses=losses, ok=ok, loss_reported=reported,
                           num_examples=sizes)

    def _bounded(self, client: int, rows: int, did: str) -> int:
        """``rows`` a reply of ``client`` claims, at most what its profile declared (one
        warning per client and run when it claims more)."""
        bound = self.declared.get(client, 0)
        if not bound or rows <= bound:
            return rows
        if client not in self._over_declared:
            self._over_declared.add(client)
            log.warning("client %d says it %s %d rows, its profile declared %d: weighted as "
                        "%d (docs/security.md)", client, did, rows, bound, bound)
        return bound

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        template = {k: v[0] for k, v in edge_models.items()}
        messages = self.train_messages(work, edge_models)
        replies = self.grid.send_and_receive(messages, timeout=self.timeout) if messages \
            else []
        result = self.read_train_replies(work, replies, template)
        self.guard.end_round()
        return result

    # ---------------------------------------------------------------- evaluation
    def evaluate_messages(self, params: Params, cloud_round: int) -> list[Message]:
        """The global model to every client, to evaluate on its own training rows."""
        cfg = ConfigRecord(dict(self.evaluate_config))
        cfg[SERVER_ROUND] = cloud_round
        content = RecordDict({self.arrayrecord_key: model_record(params, self.packs),
                              self.configrecord_key: cfg})
        self._evaluate_sent = [Message(content, message_type=MessageType.EVALUATE,
                                       dst_node_id=node) for node in self.node_ids.values()]
        self._evaluate_round = cloud_round
        return self._evaluate_sent

    def read_evaluate_replies(self, replies: Iterable[Message],
                              cloud_round: int | None = None) -> ClientEvaluation | None:
        """The replies' loss, accuracy and rows by client (None: no client answered with
        both); with ``cloud_round``, each usable reply's metrics are noted for the clients'
        own metrics of that round."""
        out = ClientEvaluation.unanswered(self.num_clients or 0)
        assert out.holdout_accuracy is not None and out.num_examples is not None
        silent: list[int] = []
        what = f"evaluate (round {self._evaluate_round})"
        for message, reply in self._bind(self._evaluate_sent, replies, what):
            if reply.has_error():
                continue
            client = self._client(message)
            try:
                numbers = read_evaluate_reply(reply, client, loss_keys=self.loss_keys,
                                              accuracy_keys=self.accuracy_keys)
                size = evaluate_rows(reply, client, self.weighted_by_key) \
                    if numbers is not None else 0
            except NonFiniteLossError as exc:
                log.warning("evaluate: %s", exc)
                continue
            except ContractError as exc:
                self.guard.bad(exc, client, training=False)
                continue
            if self.metrics is not None and cloud_round is not None:
                self.metrics.evaluate.note(cloud_round, client, reply.content)
            if numbers is None:
                silent.append(client)
                continue
            out.loss[client], out.accuracy[client] = numbers[0], numbers[1]
            if numbers[2] is not None:
                out.holdout_accuracy[client] = numbers[2]
            out.num_examples[client] = self._bounded(client, size, "evaluated")
        if silent:
            log.warning("evaluate: client(s) %s replied without a loss (%s) or an accuracy "
                        "(%s): left out of train_loss / train_accuracy (name their keys: "
                        "HierFedAvg(loss_key=..., accuracy_key=...)); their own metrics are "
                        "aggregated", sorted(silent)[:10], "/".join(self.loss_keys),
                        "/".join(self.accuracy_keys))
        return out.if_answered()

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        """The global model after ``cloud_round`` on every client; first, a cloud round in
        which no client trained (and one failed with its own error) stops the run
        (:mod:`fedhier.strategies.cloud_failure`; an edge server's executor leaves that to
        the cloud), and so does a run whose every client is excluded."""
        if cloud_round > 0 and self.expected_clients is None:
            self.outcomes.check(cloud_round)
            if self.node_ids and self.guard.excluded.keys() >= self.node_ids.keys():
                raise RunFailureError(
                    f"every client is excluded after cloud round {cloud_round} "
                    f"({self.guard.policy.exclude_after} bad replies in a row each): no "
                    "client can train")
        messages = self.evaluate_messages(params, cloud_round)
        replies = self.grid.send_and_receive(messages, timeout=self.timeout) if messages \
            else []
        return self.read_evaluate_replies(replies, cloud_round)

    # ---------------------------------------------------------------- queries
    def client_gradients(self, params: Params) -> torch.Tensor | None:
        """Every client's full local gradient (``query.gradient``), [n, P] by client; None
        (with a warning) when a client does not answer."""
        content = RecordDict({self.arrayrecord_key: model_record(params, self.packs),
                              self.configrecord_key: self.train_config})
        messages = [Message(content, message_type=f"{MessageType.QUERY}.gradient",
                            dst_node_id=node) for node in self.node_ids.values()]
        grads: dict[int, torch.Tensor] = {}
        # P: the model's floating-point entries (what flat_gradient differentiates), never
        # the length of whichever reply came first (a hostile first reply would fail the rest)
        size = sum(v.numel() for v in params.values() if v.is_floating_point())
        for message, reply in self._exchange(messages, "the gradient query"):
            if reply.has_error() or "gradient" not in reply.content.array_records:
                continue
            client = self._client(message)
            try:
                grads[client] = read_gradient_reply(reply, client, size)
            except ContractError as exc:
                self.guard.bad(exc, client, training=False)
                continue
        expected = (len(self.expected_clients) if self.expected_clients is not None
                    else len(self.node_ids) + len(self.left_out))
        if len(grads) != expected:
            log.warning("gradient query: %d of %d clients answered (a client needs a "
                        "query.gradient handler: docs/contract.md)", len(grads), expected)
            return None
        return torch.stack([grads[c] for c in sorted(self.node_ids)])

    def model_bytes(self, params: Params) -> int:
        """Bytes of one model as an ArrayRecord (what Flower sends)."""
        return int(to_record(params).count_bytes())

    def client_state(self, clients: Iterable[int] | None = None
                     ) -> ClientStates:
        """Every client's kept state (``query.state``), by client: name -> tensors; {} when
        the clients keep none. ``clients``: only those of them this grid reaches (default:
        all). A client that does not answer is left out (it would resume with fresh state)
        and named in a warning."""
        if not self.keeps_client_state:
            return {}
        wanted = None if clients is None else {int(c) for c in clients}
        content = RecordDict({self.configrecord_key: self.train_config})
        messages = [Message(content, message_type=f"{MessageType.QUERY}.state",
                            dst_node_id=node) for client, node in self.node_ids.items()
                    if wanted is None or client in wanted]
        states: ClientStates = {}
        for message, reply in self._exchange(messages, "the state query"):
            if reply.has_error():
                continue
            states[self._client(message)] = {
                key: dict(record.to_torch_state_dict())
                for key, record in reply.content.array_records.items()}
        if len(states) != len(messages):
            asked = {self._client(m) for m in messages}
            missing = sorted(asked - set(states))
            log.warning("client(s) %s did not send their kept state", missing[:10])
        return states

    def restore_client_state(self, state: ClientStates) -> None:
        """Send each client its kept state (``query.restore``): from a checkpoint, or a
        client that moved here (its state from its old edge)."""
        messages = []
        for client, records in state.items():
            if client not in self.node_ids:
                continue  # left out of the run: it never trains again
            content = RecordDict({key: ArrayRecord(tensors) for key, tensors in records.items()})
            content[self.configrecord_key] = self.train_config
            messages.append(Message(content, message_type=f"{MessageType.QUERY}.restore",
                                    dst_node_id=self.node_ids[client]))
        answers = self._exchange(messages, "the restore query")
        failed = len(messages) - sum(not reply.has_error() for _, reply in answers)
        if failed:
            raise RunFailureError(f"{failed} client(s) could not restore their kept "
                                  "state (from a checkpoint, or brought by a move)")

