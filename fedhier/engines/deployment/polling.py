"""How often fedhier deploy's processes ask for work: promptly while a run is in flight,
Flower's own pace when idle.

Flower 1.42's SuperNode asks its SuperLink for a message, and when there is none sleeps 3 s
(``time.sleep(3)`` in ``flwr.supernode.start_client_internal.start_client_internal``), then
waits for its ClientApp's reply in 0.5 s sleeps (``_push_messages``). Every message leg paid
1.5 s on average for it. :class:`Poll` is the pace fedhier uses instead, in the processes it
starts (:mod:`.supernode`, :func:`.task_runtime.acquire`): ``interval`` seconds after a
message, each further empty ask 1.25 times later, up to Flower's 3 s. The interval is
``fedhier deploy local --poll-interval`` (environment :data:`POLL_ENV` in every process);
0 keeps Flower's pace everywhere. A SuperNode and the task runtime serving it wake each other
through FIFOs (:class:`Wake`) instead of polling, and Flower's 1 s retry of a content pull
that came too early starts at the interval (:func:`shorten_pull_backoff`). A Grid waiting
for replies pulls every interval at first, then at most 10% of the time waited late
(:func:`reply_wait`).

Cost on a SuperLink (docs/deployment.md#latency): an idle SuperNode asks every 3 s, as
Flower's; after a message it asks at 0.05, 0.0625, 0.078, ... s, 19 times in the first
13.7 s before it is back at 3 s: about log(1 + 0.25 gap / interval) / log(1.25) requests per
gap between two messages instead of gap / 3 (8 for 1 s, 17 for 10 s).
"""

from __future__ import annotations

import importlib
import os
import select
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

#: Environment variable holding the busy poll interval (seconds) of every process started.
POLL_ENV = "FEDHIER_POLL_INTERVAL"
#: Default busy poll interval (seconds): ``--poll-interval``.
DEFAULT_INTERVAL = 0.05
#: Flower 1.42's SuperNode's idle sleep (seconds); fedhier's pace when idle.
FLOWER_IDLE = 3.0
#: Each empty ask waits this much longer than the one before (up to the idle pace).
GROWTH = 1.25


@dataclass
class Poll:
    """The pace of one process: ``wait()`` seconds before it asks again.

    After a message (:meth:`busy`, and at start) the waits are ``interval``, then
    ``GROWTH`` times longer after each empty ask, up to ``idle``: a node asks promptly while
    a round is in flight and at Flower's pace when it has been idle for a while.
    """

    interval: float = DEFAULT_INTERVAL
    idle: float = FLOWER_IDLE
    growth: float = GROWTH
    misses: int = 0  # empty asks since the last message

    @classmethod
    def from_env(cls, idle: float = FLOWER_IDLE) -> Poll:
        """The pace :data:`POLL_ENV` sets (default :data:`DEFAULT_INTERVAL`; 0: always
        ``idle``)."""
        raw = os.environ.get(POLL_ENV, "")
        interval = float(raw) if raw else DEFAULT_INTERVAL
        return cls(interval=min(interval, idle) if interval > 0 else idle, idle=idle)

    def busy(self) -> None:
        """A message arrived: ask promptly again."""
        self.misses = 0

    def wait(self) -> float:
        """Seconds to sleep before asking again (one more empty ask counted)."""
        seconds = min(self.idle, self.interval * self.growth ** min(self.misses, 64))
        self.misses += 1
        return seconds


#: Environment variable: the path prefix of the FIFOs that a SuperNode and the task runtime
#: serving it (on the same machine) wake each other with (:class:`Wake`).
WAKE_ENV = "FEDHIER_WAKE"
#: The FIFOs' suffixes: a task for the runtime to claim; a reply for the SuperNode to send.
TASK, REPLY = "task", "reply"


class Wake:
    """A named pipe one process waits on and another pokes: the local legs between a
    SuperNode and its task runtime (a task to claim, a reply to send) without polling.

    ``Wake(path)`` makes the FIFO and listens; :func:`poke` writes one byte if someone
    listens (and does nothing otherwise: the listener's timeout is the fallback).
    """

    def __init__(self, path: Path) -> None:
        with suppress(FileExistsError):
            os.mkfifo(path, 0o600)
        # read-write: the pipe never reads as closed when a poker goes away (Linux)
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    @classmethod
    def from_env(cls, suffix: str) -> Wake | None:
        """The FIFO ``$FEDHIER_WAKE.suffix`` (None without :data:`WAKE_ENV`)."""
        prefix = os.environ.get(WAKE_ENV)
        return cls(Path(f"{prefix}.{suffix}")) if prefix else None

    def wait(self, timeout: float) -> bool:
        """Sleep until poked or ``timeout`` seconds; True if poked (pokes are drained)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            with suppress(BlockingIOError):
                while os.read(self.fd, 4096):
                    pass
        return bool(ready)


def poke(suffix: str) -> None:
    """Wake the listener of ``$FEDHIER_WAKE.suffix``, if there is one."""
    prefix = os.environ.get(WAKE_ENV)
    if not prefix:
        return
    try:
        fd = os.open(f"{prefix}.{suffix}", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no such FIFO, or nobody listening
        return
    try:
        os.write(fd, b"!")
    except OSError:  # full: it will wake anyway
        pass
    finally:
        os.close(fd)


#: A Grid waiting for replies waits at most this fraction of the time it has waited so far
#: between two pulls (:func:`reply_wait`): it is at most that much late.
REPLY_LATENESS = 0.1


def reply_wait(elapsed: float, interval: float, cap: float = FLOWER_IDLE) -> float:
    """Seconds a Grid sleeps before it pulls replies again, ``elapsed`` seconds after it
    pushed its messages: ``interval`` at first, then :data:`REPLY_LATENESS` of ``elapsed``, at
    most ``cap`` (Flower's ``HttpGrid``: always 3 s). A reply is noticed at most 10% of the
    exchange's time late, and an exchange of ``T`` seconds costs about
    ``L / interval + log(T / L) / log(1 + REPLY_LATENESS)`` pulls (``L = interval /
    REPLY_LATENESS``) instead of ``T / interval``: 26 instead of 40 for 2 s, 47 instead of 300
    for 15 s at 0.05 s."""
    return max(interval, min(cap, REPLY_LATENESS * elapsed))


#: Flower 1.42's functions that retry pulling a message's content, ``PULL_INITIAL_BACKOFF``
#: (1 s, doubling) after finding it not there yet: module globals, as (module, name).
FLOWER_PULLS = (("flwr.supernode.start_client_internal", "pull_objects"),  # SuperNode
                ("flwr.superlink.grid.http_grid", "pull_objects"),  # a Grid's replies
                ("flwr.supernode.runtime.run_clientapp",  # a task runtime's input
                 "pull_and_inflate_object_from_tree"))


#: The longest wait between two content pulls, in poll intervals (Flower's: 10 s).
BACKOFF_CAP_INTERVALS = 4


def shorten_pull_backoff(seconds: float) -> Callable[[], None]:
    """In this process, Flower's content pulls (:data:`FLOWER_PULLS`) retry ``seconds``
    after a miss instead of 1 s, then doubling up to :data:`BACKOFF_CAP_INTERVALS` times
    ``seconds`` (Flower's: 10 s). A message is visible before its content has arrived
    (pushed next), so a prompt asker often misses once. Returns the undo (a monkeypatch of
    Flower's module globals; docs/deployment.md#latency)."""
    originals = []
    for module_name, name in FLOWER_PULLS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        originals.append((module, name, original))
        if isinstance(original, partial) and "initial_backoff" in original.keywords:
            original = original.func  # shortened before: shorten again, not twice
        setattr(module, name, partial(original, initial_backoff=seconds,
                                      backoff_cap=BACKOFF_CAP_INTERVALS * seconds))

    def undo() -> None:
        for module, name, original in originals:
            setattr(module, name, original)

    return undo


def pace_flower_pulls() -> None:
    """:func:`shorten_pull_backoff` to the busy interval of :data:`POLL_ENV` (not with 0)."""
    poll = Poll.from_env()
    if poll.interval < FLOWER_IDLE:
        shorten_pull_backoff(poll.interval)
