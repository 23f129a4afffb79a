"""The cloud's executor of asynchronous edge servers: jobs pushed, reports taken as they come.

:class:`AsyncEdgeServersExecutor` is :class:`~fedhier.strategies.edge.cloud_executor.
EdgeServersExecutor` (same messages, :mod:`fedhier.strategies.edge.messages`) with
:meth:`submit` (push a job, do not wait) and :meth:`receive` (the first report in among some
edges), for :class:`fedhier.round.tiers.asynchronous.BufferedServerRounds`. Replies are
pulled from the Grid as they reach the cloud's SuperLink; those pulled together are taken by
edge. Clients are not evaluated between aggregations (their edges are busy with jobs).
"""

from __future__ import annotations

import logging
import time

import numpy as np
from flwr.app import Message

from fedhier.engines.reply_binding import mismatch
from fedhier.round.loop import ClientEvaluation, Params
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.strategies.edge.cloud_executor import (
    EdgeServersExecutor,
    dropped_count,
    error_reason,
)
from fedhier.strategies.edge.messages import MalformedReplyError, report_from_reply

log = logging.getLogger("fedhier")
#: Seconds between two pulls for replies while waiting (at most; PromptGrid's pace if less).
PULL_SECONDS = 0.05


class AsyncEdgeServersExecutor(EdgeServersExecutor):
    """Edge servers whose jobs run while the cloud aggregates (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.in_flight: dict[str, tuple[int, float]] = {}  # message id -> (edge, pushed at)
        self.job_of: dict[str, ServerJob] = {}  # message id -> its job (to check the reply)
        self.arrived: dict[int, EdgeReport] = {}  # edge -> its report, in arrival order
        self.pushed: dict[str, Message] = {}  # message id -> the job's message (binding)

    def submit(self, jobs: list[ServerJob]) -> None:
        messages = self.job_messages(jobs)
        now = time.monotonic()
        ids = list(self.grid.push_messages(messages))
        for message_id, job, message in zip(ids, jobs, messages, strict=True):
            self.in_flight[message_id] = (job.edge, now)
            self.job_of[message_id] = job
            self.pushed[message_id] = message

    def _pull(self) -> None:
        """The replies in now, by edge, after the earlier ones."""
        if not self.in_flight:
            return
        replies = list(self.grid.pull_messages(list(self.in_flight)))
        reports: dict[int, EdgeReport] = {}
        pulled = []
        for reply in replies:  # bound to a job in flight (fedhier.strategies.exchange)
            message = self.pushed.get(reply.metadata.reply_to_message_id)
            why = ("it answers no job in flight" if message is None
                   or reply.metadata.reply_to_message_id not in self.in_flight
                   else mismatch(message, reply))
            if why is None:
                pulled.append(reply)
                self.pushed.pop(reply.metadata.reply_to_message_id)
            else:
                log.warning("left out a server's reply to its job: %s", why)
        for reply in pulled:
            self.guard.dropped += dropped_count(reply)
            edge, _ = self.in_flight.pop(reply.metadata.reply_to_message_id)
            job = self.job_of.pop(reply.metadata.reply_to_message_id)
            if reply.has_error():
                log.warning("edge %d failed its job: %s", edge, error_reason(reply))
                reports[edge] = EdgeReport(edge, None, np.zeros((0, 2)), reached=False)
            else:
                try:
                    reports[edge] = report_from_reply(reply, job)
                except MalformedReplyError as exc:
                    log.warning("edge %d sent a malformed reply to its job (%s): its clients "
                                "miss the job", edge, exc)
                    reports[edge] = EdgeReport(edge, None, np.zeros((0, 2)), reached=False)
        for edge in sorted(reports):
            self.arrived[edge] = reports[edge]

    def receive(self, edges: frozenset[int]) -> int:
        pause = min(PULL_SECONDS, getattr(self.grid, "poll_seconds", PULL_SECONDS))
        while True:
            self._pull()
            for edge in self.arrived:
                if edge in edges:
                    return edge
            now = time.monotonic()
            late = [(pushed, edge) for edge, pushed in self.in_flight.values()
                    if edge in edges and now - pushed > self.timeout]
            if late:
                edge = min(late)[1]
                log.warning("edge %d did not report within %.0f s: its clients miss the job",
                            edge, self.timeout)
                self.in_flight = {m: v for m, v in self.in_flight.items() if v[0] != edge}
                self.job_of = {m: j for m, j in self.job_of.items() if m in self.in_flight}
                self.pushed = {m: p for m, p in self.pushed.items() if m in self.in_flight}
                self.arrived[edge] = EdgeReport(edge, None, np.zeros((0, 2)), reached=False)
                return edge
            if not any(edge in edges for edge, _ in self.in_flight.values()):
                raise RuntimeError(f"no job in flight for edges {sorted(edges)}")
            time.sleep(pause)

    def report(self, edge: int) -> EdgeReport:
        return self.arrived.pop(edge)

    def evaluate(self, params: Params, cloud_round: int) -> ClientEvaluation | None:
        return None  # the edges are busy with jobs; the cloud evaluates centrally
