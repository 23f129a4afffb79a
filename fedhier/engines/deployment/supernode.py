"""Flower's SuperNode, asking its SuperLink promptly while a run is in flight.

``python -m fedhier.engines.deployment.supernode ARGS`` is ``flower-supernode ARGS`` (Flower's
own entry point, ``flwr.supernode.cli.flower_supernode``) with two of Flower 1.42's module
globals replaced in this process only (a monkeypatch, documented in docs/deployment.md):

* ``flwr.supernode.start_client_internal.time``: the module's only use of ``time`` is its
  three sleeps: ``time.sleep(3)`` after a pull that found no message, ``time.sleep(0.5)``
  while waiting for the ClientApp's reply and for its content. :class:`PacedTime` turns the
  3 s into :meth:`Poll.wait` and the 0.5 s into the busy interval;
* ``flwr.supernode.start_client_internal._pull_and_store_message``: wrapped to mark the node
  busy when a message arrived, to wake the task runtime (:class:`~.polling.Wake`) and to
  trace it (:mod:`.trace`); ``_push_messages``: wrapped to trace the reply's push.

The reply wait (0.5 s) also wakes when fedhier's task runtime pokes it.

``tests/test_deploy_polling.py`` fails if Flower's source stops matching these assumptions.
The pace comes from :data:`~.polling.POLL_ENV` (``fedhier deploy local --poll-interval``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from fedhier.engines.deployment.polling import (
    FLOWER_IDLE,
    REPLY,
    TASK,
    Poll,
    Wake,
    pace_flower_pulls,
    poke,
)
from fedhier.engines.deployment.trace import trace

#: Flower's idle sleep and reply-wait sleep in ``start_client_internal`` (seconds).
FLOWER_SLEEPS = (FLOWER_IDLE, 0.5)


class PacedTime:
    """Stands in for the ``time`` module inside ``flwr.supernode.start_client_internal``."""

    def __init__(self, poll: Poll, reply_wake: Wake | None = None) -> None:
        self.poll = poll
        self.reply_wake = reply_wake  # poked by the task runtime when its reply is in
        self.empty_pulls = 0  # pulls that found no message since the last message

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE:  # a pull found nothing
            self.empty_pulls += 1
            time.sleep(self.poll.wait())
        elif self.reply_wake is not None:  # waiting for a local reply: no request
            self.reply_wake.wait(min(seconds, self.poll.interval))
        else:
            time.sleep(min(seconds, self.poll.interval))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def install(poll: Poll) -> Callable[[], None]:
    """Pace Flower's SuperNode loop in this process with ``poll``; returns the undo."""
    import flwr.supernode.start_client_internal as sci

    clock = PacedTime(poll, Wake.from_env(REPLY))
    original_time: ModuleType = sci.time
    original_pull = sci._pull_and_store_message
    original_push = sci._push_messages
    pulled: list[str] = []

    def pull(*args: Any, **kwargs: Any) -> int | None:
        receive = kwargs["receive"]  # Flower passes every argument by keyword
        got: list[str] = []

        def receive_noting_id() -> Any:
            received = receive()
            if received is not None:
                got.append(received[0].metadata.message_id)
                trace("received", got)
            return received

        run_id = original_pull(*args, **{**kwargs, "receive": receive_noting_id})
        if got:
            poll.busy()
            pulled[:] = got
            poke(TASK)  # the task runtime claims it now
            trace("pulled", got, empty=clock.empty_pulls)
            clock.empty_pulls = 0
        return run_id

    def push(*args: Any, **kwargs: Any) -> None:
        original_push(*args, **kwargs)
        trace("sent", pulled)

    sci.time = clock  # type: ignore[assignment]
    sci._pull_and_store_message = pull
    sci._push_messages = push

    def undo() -> None:
        sci.time = original_time
        sci._pull_and_store_message = original_pull
        sci._push_messages = original_push

    return undo


def main() -> None:
    """``flower-supernode`` with :func:`install` (:meth:`Poll.from_env`)."""
    from flwr.supernode.cli import flower_supernode

    install(Poll.from_env())
    pace_flower_pulls()
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
