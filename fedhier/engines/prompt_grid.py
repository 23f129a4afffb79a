"""A Grid that waits for replies by polling every 0.1 s at first, then a tenth of the time
waited so far.

Flower 1.42's :class:`flwr.superlink.grid.HttpGrid` (the Deployment Engine's Grid) sleeps 3 s
between polls in ``send_and_receive``: with edge servers every edge round and every evaluation
pays it (an edge round of two clients took 19 s, most of it waiting). :class:`PromptGrid`
delegates everything to the wrapped Grid and only polls sooner
(:func:`fedhier.engines.deployment.polling.reply_wait`); the messages are the same.
Under ``fedhier deploy`` it also retries a reply's content sooner than Flower's 1 s
(:func:`fedhier.engines.deployment.polling.pace_flower_pulls`, docs/deployment.md#latency).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # the type Flower's Grid.get_nodes returns
from flwr.serverapp import Grid
from flwr.supercore.run import Run

#: Seconds between two polls for replies.
POLL_SECONDS = 0.1


class PromptGrid(Grid):
    """``grid`` with a ``send_and_receive`` that polls every :data:`POLL_SECONDS` (or
    ``fedhier deploy --poll-interval``, if shorter), then at most 10% of the time waited
    late."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.poll_seconds = POLL_SECONDS
        from fedhier.engines.deployment.polling import POLL_ENV, Poll, pace_flower_pulls

        if os.environ.get(POLL_ENV):  # started by fedhier deploy: its pace
            pace_flower_pulls()
            self.poll_seconds = min(POLL_SECONDS, Poll.from_env().interval)

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``; return the replies that arrive within ``timeout`` seconds."""
        from fedhier.engines.deployment.polling import reply_wait
        from fedhier.engines.deployment.trace import trace  # deploy's opt-in timestamps

        messages = list(messages)
        start = time.time()
        pending = set(self.grid.push_messages(messages))
        kind = messages[0].metadata.message_type if messages else ""
        trace("push", pending, kind=kind, t=start)
        trace("pushed", pending)  # push_messages returned: the content is on the SuperLink
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while pending:
            arrived = list(self.grid.pull_messages(pending))
            replies.extend(arrived)
            pending.difference_update(m.metadata.reply_to_message_id for m in arrived)
            if arrived:
                trace("reply", [m.metadata.reply_to_message_id for m in arrived])
            if not pending or (timeout is not None and time.time() >= end):
                break
            time.sleep(reply_wait(time.time() - start, self.poll_seconds))
        trace("exchange", [], kind=kind, n=len(messages), s=time.time() - start)
        return replies
