"""A Flower Grid that calls a ClientApp in this process: no Ray, no sockets.

It implements Flower's ``Grid`` interface, so any ``flwr.serverapp.strategy`` strategy (ours
or Flower's own) runs on it unchanged. Messages are handled one after another in the order
sent; a ClientApp exception becomes an error reply, as on Flower's engines, and a reply that
does not answer the message it was returned for (another reply-to id or sender) an error reply
saying so (:mod:`fedhier.engines.reply_binding`). Under
``send_and_receive(..., timeout=T)`` each client gets T seconds of its own (as if the nodes
ran in parallel): a reply that takes longer is dropped, and a node still busy with it gets
no reply to later messages until it finishes, so a client that never answers does not hang
the run.

A late call keeps running in a daemon thread after the run. A daemon thread still inside
torch when Python shuts down can abort the interpreter ("terminate called without an active
exception", exit 134), so call :meth:`InProcessGrid.close` when done: it waits a bounded
time for late calls and names the nodes still busy. ``fedhier run`` does, and leaves with
``os._exit`` (after flushing) only when one is still stuck (:func:`stuck_client_threads`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedhier.common.rng import generator
from fedhier.engines.reply_binding import bound

#: The name prefix of the threads that run ClientApp calls under a timeout.
THREAD_PREFIX = "fedhier-node-"


def stuck_client_threads() -> list[threading.Thread]:
    """The ClientApp calls of any InProcessGrid of this process still running (late)."""
    return [t for t in threading.enumerate()
            if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


class _Caller:
    """One daemon thread that runs ClientApp calls one after another (jobs: message, reply
    holder, done event). One long-lived thread, not one per call: torch in many short-lived
    threads made Python abort at exit ("terminate called without an active exception")."""

    def __init__(self, call: Callable[[Message], Message]) -> None:
        self.jobs: queue.SimpleQueue[tuple[Message, list[Message], threading.Event] | None] = \
            queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(call,), daemon=True,
                                       name="fedhier-clientapp")
        self.thread.start()

    def _loop(self, call: Callable[[Message], Message]) -> None:
        while (job := self.jobs.get()) is not None:
            msg, holder, done = job
            holder.append(call(msg))
            done.set()

    def retire(self, name: str) -> threading.Thread:
        """No more jobs: the thread ends after the one it runs (named ``name`` till then)."""
        self.thread.name = name
        self.jobs.put(None)
        return self.thread


class InProcessGrid(Grid):
    """``num_nodes`` simulated SuperNodes, node i holding ``partition-id`` i."""

    def __init__(self, client_app: ClientApp, num_nodes: int, seed: int = 0,
                 run_config: dict | None = None,
                 edge_tags: Sequence[int] | None = None,
                 partition_ids: Sequence[int] | None = None,
                 num_partitions: int | None = None) -> None:
        """``edge_tags[i]``: node i's ``edge`` node-config tag, as a SuperNode started with
        ``--node-config "... edge=k"`` carries (the ``edge-tag`` grouping reads it).
        ``partition_ids``: node i holds ``partition_ids[i]`` of ``num_partitions`` (some
        clients of a larger federation, e.g. one edge server's) instead of i of num_nodes."""
        run_id = int(generator(seed, "run-id").integers(1, 2**62))
        self._run = Run.create_empty(run_id)
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 1  # the SuperLink's node id in Flower
        TaskIdentity.task_id = 1
        self.client_app = client_app
        node_ids = generator(seed, "node-ids").choice(2**62, size=num_nodes, replace=False) + 2
        ids = list(range(num_nodes)) if partition_ids is None else list(partition_ids)
        total = num_partitions or num_nodes
        configs: list[dict[str, Any]] = [{"partition-id": i, "num-partitions": total}
                                         for i in ids]
        for config, tag in zip(configs, edge_tags or [], strict=False):
            config["edge"] = int(tag)
        self.contexts: dict[int, Context] = {
            int(node_id): Context(run_id=run_id, node_id=int(node_id), node_config=config,
                                  state=RecordDict(), run_config=dict(run_config or {}))
            for node_id, config in zip(node_ids, configs, strict=True)
        }
        self._replies: dict[str, Message] = {}
        self._message_ids = itertools.count(1)
        self._busy: dict[int, threading.Thread] = {}  # node -> a call still running late
        self._caller: _Caller | None = None  # the thread that runs calls under a timeout

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._handle(messages, None)

    def _handle(self, messages: Iterable[Message], timeout: float | None) -> list[str]:
        """Call the ClientApp for each message in order; with ``timeout``, each call in a
        thread of its own given ``timeout`` seconds (a late call leaves no reply)."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(next(self._message_ids))
            ids.append(msg.metadata.message_id)
            if timeout is None:
                self._replies[msg.metadata.message_id] = self._call(msg)
                continue
            node = msg.metadata.dst_node_id
            late = self._busy.get(node)
            if late is not None and late.is_alive():
                continue  # still working on an earlier message: no reply
            if self._caller is None:
                self._caller = _Caller(self._call)
            holder: list[Message] = []
            done = threading.Event()
            self._caller.jobs.put((msg, holder, done))
            try:
                done.wait(timeout)
            except BaseException:
                # Ctrl-C while a client trains: let that call end before unwinding (a second
                # Ctrl-C stops waiting).
                done.wait()
                raise
            if done.is_set():
                self._replies[msg.metadata.message_id] = holder[0]
            else:  # late: whatever it replies is never read; its thread ends after it
                late = self._caller.retire(f"{THREAD_PREFIX}{node}")
                self._busy[node] = late
                self._caller = None
        return ids

    def close(self, wait: float = 5.0) -> list[int]:
        """Wait at most ``wait`` seconds in all for the ClientApp calls still running late;
        -> the nodes whose call still runs (empty: the grid holds no thread any more)."""
        if self._caller is not None:  # the idle thread: ends at once
            self._caller.retire("fedhier-clientapp-closed").join(wait)
            self._caller = None
        deadline = time.monotonic() + wait
        for worker in self._busy.values():
            worker.join(max(0.0, deadline - time.monotonic()))
        self._busy = {node: t for node, t in self._busy.items() if t.is_alive()}
        return sorted(self._busy)

    def _call(self, msg: Message) -> Message:
        """The ClientApp's reply to ``msg`` (an exception becomes an error reply, and so does
        a reply that does not answer ``msg``: :func:`fedhier.engines.reply_binding.bound`)."""
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            return bound(msg, self.client_app(msg, context))
        except Exception as exc:  # noqa: BLE001 - reported to the strategy as in Flower
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
            return Message(error, reply_to=msg)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in message_ids if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self._handle(messages, timeout))
