"""The executor of a node whose children are servers of their own: one message per child.

Implements :class:`fedhier.round.tiers.jobs.EdgeTierExecutor` on the Grid of the cloud (or of a
region, in a deeper tree), whose nodes are servers
(:class:`~fedhier.strategies.edge.server.EdgeServer`), with the messages of
:mod:`fedhier.strategies.edge.messages`. Clients are never addressed directly: profiles,
evaluation and gradients come back per child and are put in client order here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedhier.clients.app import run_config_of
from fedhier.clients.wire.packed_model import model_record
from fedhier.round.faults import RunFailureError
from fedhier.round.loop import ClientEvaluation, EdgeRoundWork, Params, TrainResult
from fedhier.round.tiers.jobs import EdgeReport, ServerJob, server_name
from fedhier.strategies.edge.messages import (
    ABSENT,
    DROPPED,
    EDGE_ID,
    PARTITION_IDS,
    PATH,
    ClientStates,
    MalformedReplyError,
    job_content,
    report_from_reply,
    state_content,
    state_query,
    states_of,
)
from fedhier.strategies.grid_executor import GridExecutor
from fedhier.tree.grouping import ClientInfo

log = logging.getLogger("fedhier")
#: The least time the edge servers get to start and profile their clients (seconds).
STARTUP_SECONDS = 600.0



def error_reason(reply: Message) -> str:
    """The first line of an error reply's reason ("" if it gave none)."""
    lines = (reply.error.reason or "").strip().splitlines()
    return lines[0] if lines else ""

def dropped_count(reply: Message) -> int:
    """The bad client replies a server's report says it dropped (0 when it does not say)."""
    metrics = reply.content.metric_records.get("metrics")
    value = None if metrics is None else metrics.get(DROPPED)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else 0


class EdgeServersExecutor(GridExecutor):
    """``num_edges`` servers reached through ``grid`` (the children ``children``, default
    0 .. num_edges-1, of a node of level ``level``: 2 for edges), serving ``clients`` (default:
    all ``num_clients`` clients of the federation).

    ``ancestors`` (after :meth:`profiles`: per level 1 .. level-1, int64 [n], -1 for a client
    not served here) is where each client is connected; the run's grouping must put it there
    (checked by the algorithm's set-up).
    """

    def __init__(self, grid: Any, run_config: ConfigRecord, num_edges: int, num_clients: int,
                 timeout: float = 3600, *, level: int = 2, children: list[int] | None = None,
                 clients: list[int] | None = None) -> None:
        super().__init__(grid, run_config, timeout=timeout, min_available_nodes=num_edges,
                         num_clients=num_clients)
        self.num_edges = num_edges
        self.level = level
        self.children = list(range(num_edges)) if children is None else sorted(children)
        self.served = list(range(num_clients)) if clients is None else sorted(clients)
        self.node_of_edge: dict[int, int] = {}
        #: each edge's server among this node's children (the edge itself on two levels;
        #: its region under regions), from the profiles: edges do not change regions
        self.child_of_edge: dict[int, int] = {}
        self.ancestors = [np.full(num_clients, -1, dtype=np.int64)
                          for _ in range(level - 1)]
        cfg = run_config_of(run_config)  # do the clients keep optimizer state?
        self.keeps_client_state = cfg.keeps_client_state()

        from fedhier.engines.deployment.reattach import reattacher_from_env
        #: moves clients between edges (fedhier.round.tiers.moves.Reattacher); from the deployment
        self.reattacher = reattacher_from_env()
        #: client -> why its last re-attachment failed (it fails its new edge's rounds)
        self.unattached: dict[int, str] = {}

    @property
    def edge_of_client(self) -> np.ndarray:
        """int64 [n]: the edge each client is connected to (-1: not served here)."""
        return self.ancestors[0]

    # ---------------------------------------------------------------- profiles
    def profiles(self) -> ClientInfo:
        """Each child's clients, their rows and label histograms (int64 [n], zero for a
        client not served here). Servers first start their own run and profile their
        children: this waits up to ``STARTUP_SECONDS`` (or the timeout, if longer)."""
        timeout = max(self.timeout, STARTUP_SECONDS)
        nodes = self.wait_for_nodes(self.num_edges, timeout, "servers")
        messages = [Message(RecordDict({"config": self.train_config}),
                            message_type=MessageType.QUERY, dst_node_id=node) for node in nodes]
        replies = self._servers_answer(
            messages, self.grid.send_and_receive(messages, timeout=timeout),
            "the servers' profile query")
        for reply in replies:
            if reply.has_error():
                raise RunFailureError(f"edge server on node {reply.metadata.src_node_id} "
                                      f"failed: {error_reason(reply) or 'no reason given'}")
        if len(replies) != len(nodes):
            raise RunFailureError(f"{len(nodes) - len(replies)} of {len(nodes)} edge servers "
                                  f"did not answer within {timeout:.0f} s")
        n = self.num_clients or 0
        sizes = np.zeros(n, dtype=np.int64)
        histograms: np.ndarray | None = None
        self.node_of_edge = {}
        for where in self.ancestors:
            where[:] = -1
        for reply in replies:
            m = reply.content["metrics"]
            if EDGE_ID not in m:
                raise RunFailureError(f"node {reply.metadata.src_node_id} answered like a "
                                      "client, not an edge server: edge_servers runs on "
                                      "fedhier deploy local --edges")
            edge = int(m[EDGE_ID])  # type: ignore[arg-type]
            if edge not in self.children or edge in self.node_of_edge:
                raise RunFailureError(f"server on node {reply.metadata.src_node_id} "
                                      f"says it is node {edge}: expected each of "
                                      f"{self.children} once")
            self.node_of_edge[edge] = reply.metadata.src_node_id
            clients = np.asarray(m[PARTITION_IDS], dtype=np.int64)
            classes = int(m["num-classes"])  # type: ignore[arg-type]
            if histograms is None:
                histograms = np.zeros((n, classes), dtype=np.int64)
            if ((clients < 0) | (clients >= n)).any() or (self.ancestors[-1][clients] >= 0).any():
                raise RunFailureError(f"edge {edge} serves clients {clients.tolist()[:10]}: "
                                      f"outside 0..{n - 1} or served by another edge too")
            self.ancestors[-1][clients] = edge
            if self.level > 2:  # a region's reply: each client's edge (and levels above)
                path = np.asarray(m[PATH], dtype=np.int64).reshape(len(clients), -1)
                for level, where in enumerate(self.ancestors[:-1]):
                    where[clients] = path[:, level]
            sizes[clients] = np.asarray(m["num-examples"], dtype=np.int64)
            histograms[clients] = np.asarray(m["label-histogram"],
                                             dtype=np.int64).reshape(len(clients), classes)
        served = np.flatnonzero(self.ancestors[-1] >= 0)
        self.child_of_edge = dict(zip(self.ancestors[0][served].tolist(),
                                      self.ancestors[-1][served].tolist(), strict=True))
        missing = np.setdiff1d(self.served, served)
        if len(missing) or (self.ancestors[-1] >= 0).sum() != len(self.served):
            raise RunFailureError(f"no server serves clients {missing.tolist()[:10]} (or it "
                                  f"serves others than {self.served[:10]})")
        assert histograms is not None
        return ClientInfo(label_histograms=histograms, num_examples=sizes,
                          edge_tags=self.edge_of_client.copy())

    def _servers_answer(self, messages: list[Message], replies: Iterable[Message],
                        what: str) -> list[Message]:
        """The replies bound to ``messages`` (:mod:`fedhier.strategies.exchange`), in
        message order; a reply that answers none of them is named in a warning and left
        out (its server counts as not answering)."""
        bound = self.sent.bind(messages, replies, what, {})
        for error, _ in bound.bad:
            log.warning("left out a server's reply: %s", error)
        return [reply for _, reply in bound.answers]

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        """Connect each client of ``moves`` (client -> edge) to its new edge and wait until it
        is online there (:class:`fedhier.round.tiers.moves.Reattacher`); client -> seconds."""
        if self.reattacher is None:
            raise RunFailureError("clients move between edge servers but this deployment "
                                  "cannot re-attach them (fedhier deploy local --edges can)")
        seconds = self.reattacher.reattach(moves)
        failed = dict(getattr(self.reattacher, "failed", {}))
        for client in moves:
            self.unattached.pop(client, None)
        self.unattached.update({c: why for c, why in failed.items() if c in moves})
        if failed:
            log.warning("client(s) %s could not be re-attached to their new edge (%s): they "
                        "fail its edge rounds until they come online there",
                        sorted(failed)[:10], next(iter(failed.values())))
        for client, edge in moves.items():
            self.edge_of_client[client] = edge
            if self.level > 2:  # its server among the children (its region) too
                self.ancestors[-1][client] = self.child_of_edge.get(edge, -1)
        return seconds

    # ---------------------------------------------------------------- training
    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        raise RuntimeError("with edge servers the edges train their clients "
                           "(EdgeServersExecutor.run_edge_jobs)")

    def job_messages(self, jobs: list[ServerJob]) -> list[Message]:
        """One train message per job, to its server's node. A job outlives its round by
        nothing (``ttl``): a server that restarts must not take it late."""
        messages = []
        for job in jobs:
            content = job_content(job, self.train_config)
            if self.unattached:  # clients it must not wait for (failed re-attachments)
                content.config_records["config"][ABSENT] = sorted(self.unattached)
            messages.append(Message(content, message_type=MessageType.TRAIN,
                                    dst_node_id=self.node_of_edge[job.edge], ttl=self.timeout))
        return messages

    def run_edge_jobs(self, jobs: list[ServerJob]) -> list[EdgeReport]:
        """Send each edge its job; an edge that fails or does not answer within the timeout
        is reported ``reached=False``."""
        messages = self.job_messages(jobs)
        replies = self._servers_answer(
            messages, self.grid.send_and_receive(messages, timeout=self.timeout),
            f"cloud round {jobs[0].cloud_round if jobs else 0}'s jobs")
        # By the message answered: an error reply may come from the SuperLink itself (an
        # expired message), not from the edge's node.
        edge_of_message = {m.metadata.message_id: job.edge
                           for m, job in zip(messages, jobs, strict=True)}
        job_of_edge = {job.edge: job for job in jobs}
        reports: dict[int, EdgeReport] = {}
        child = server_name(self.level - 1)  # edge, region, ...
        for reply in replies:
            edge = edge_of_message[reply.metadata.reply_to_message_id]
            if reply.has_error():
                log.warning("%s %d failed its job: %s", child, edge, error_reason(reply))
                continue
            self.guard.dropped += dropped_count(reply)
            try:
                reports[edge] = report_from_reply(reply, job_of_edge[edge])
            except MalformedReplyError as exc:
                log.warning("%s %d sent a malformed reply to its job (%s): its clients miss "
                            "the round", child, edge, exc)
                reports[edge] = EdgeReport(edge, None, np.zeros((0, 2)), reached=False)
        for job in jobs:
            if job.edge not in reports:
                log.warning("%s %d did not answer in cloud round %d: its clients miss "
                            "the round", child, job.edge, job.cloud_round)
                reports[job.edge] = EdgeReport(job.edge, None, np.zeros((0, 2)), reached=False)
        return [reports[job.edge] for job in jobs]

    # ---------------------------------------------------------------- evaluation, queries
    def _per_edge(self, message_type: str, params: Params,
                  cloud_round: int | None = None, extra: RecordDict | None = None,
                  children: Iterable[int] | None = None) -> Iterable[Message]:
        """``message_type`` with ``params`` to every child server (or to ``children``); the
        replies that are not errors."""
        config = self.evaluate_config.copy()
        if cloud_round is not None:
            config["server-round"] = cloud_round
        content = RecordDict({"arrays": model_record(params, packed=True), "config": config})
        for key, record in (extra or RecordDict()).items():
            content[key] = record
        nodes = (self.node_of_edge.values() if children is None
                 else [self.node_of_edge[c] for c in children if c in self.node_of_edge])
        messages = [Message(content, message_type=message_type, dst_node_id=node)
                    for node in nodes]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        return [r for r in self._servers_answer(messages, replies, f"the '{message_type}' "
                                                "messages") if not r.has_error()]

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        out = ClientEvaluation.unanswered(self.num_clients or 0)
        assert out.holdout_accuracy is not None and out.num_examples is not None
        for reply in self._per_edge(MessageType.EVALUATE, params, cloud_round):
            m = reply.content["metrics"]
            if "loss" not in m:
                continue
            clients = np.asarray(m[PARTITION_IDS], dtype=np.int64)
            out.loss[clients] = np.asarray(m["loss"], dtype=np.float64)
            out.accuracy[clients] = np.asarray(m["accuracy"], dtype=np.float64)
            out.holdout_accuracy[clients] = np.asarray(m["holdout-accuracy"], dtype=np.float64)
            out.num_examples[clients] = np.asarray(m["num-examples"], dtype=np.int64)
        return out.if_answered()

    def client_gradients(self, params: Params) -> torch.Tensor | None:
        """[k, P]: the gradients of the clients served here, in client order."""
        grads: dict[int, torch.Tensor] = {}
        for reply in self._per_edge(f"{MessageType.QUERY}.gradient", params):
            clients = reply.content["metrics"][PARTITION_IDS]
            g = cast(ArrayRecord, reply.content["gradient"]).to_torch_state_dict()["g"]
            grads.update({int(c): g[i] for i, c in enumerate(clients)})  # type: ignore[union-attr, arg-type, call-overload]
        if sorted(grads) != self.served:
            log.warning("gradient query: %d of %d clients answered through their servers",
                        len(grads), len(self.served))
            return None
        return torch.stack([grads[c] for c in self.served])

    def client_state(self, clients: Iterable[int] | None = None) -> ClientStates:
        """The served clients' kept state (``query.state`` through their servers), by
        client; {} when they keep none (nothing asked). ``clients``: only those (moving
        clients, :func:`fedhier.round.tiers.moves.moved_states`; each server answers for the ones
        it serves; default: all). A server that does not answer leaves its clients out
        (they would go on with fresh state), named in a warning."""
        states: ClientStates = {}
        if not self.keeps_client_state:
            return states
        answered = set()
        asked = None if clients is None else sorted(int(c) for c in clients)
        children = None  # every child server; only the movers' ones when all are known
        if asked is not None and (self.ancestors[-1][asked] >= 0).all():
            children = sorted(set(self.ancestors[-1][asked].tolist()))
        for reply in self._per_edge(f"{MessageType.QUERY}.state", {}, extra=state_query(asked),
                                    children=children):
            answered.add(reply.metadata.src_node_id)
            states.update(states_of(reply.content))
        missing = sorted(e for e, node in self.node_of_edge.items() if node not in answered
                         and (children is None or e in children))
        if missing:
            log.warning("servers %s did not send their clients' kept state", missing[:10])
        return states

    def restore_client_state(self, state: ClientStates) -> None:
        """Send each server its clients' kept state from a checkpoint (``query.restore``)."""
        by_edge: dict[int, ClientStates] = {}
        for client, records in state.items():
            by_edge.setdefault(int(self.ancestors[-1][client]), {})[client] = records
        messages = []
        for edge, states in by_edge.items():
            content = state_content(states)
            content["config"] = self.evaluate_config
            messages.append(Message(content, message_type=f"{MessageType.QUERY}.restore",
                                    dst_node_id=self.node_of_edge[edge]))
        replies = self._servers_answer(
            messages, self.grid.send_and_receive(messages, timeout=self.timeout),
            "the restore query")
        failed = len(messages) - sum(not r.has_error() for r in replies)
        if failed:
            raise RunFailureError(f"{failed} server(s) could not restore their clients' "
                                  "kept state from the checkpoint")
