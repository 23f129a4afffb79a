"""The Simulation Engine's message dispatcher (fedhier.engines.flower._add_messages_to_queue)."""

import threading
from queue import Queue
from types import SimpleNamespace

from fedhier.engines.flower import _add_messages_to_queue


class _State:
    """The parts of Flower's InMemoryLinkState the dispatcher uses."""

    def __init__(self, messages, expired=()):
        self.lock = threading.RLock()
        self.message_ins_store = dict(messages)
        self.expired = set(expired)
        self.checked = []

    def _check_stored_messages(self, ids):
        self.checked.extend(ids)
        for i in ids & self.expired:
            self.message_ins_store.pop(i, None)


def _msg(node, delivered=""):
    return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node, delivered_at=delivered))


class _OneTick(threading.Event):
    """A stop event that is set by the dispatcher's first wait: one walk, then return."""

    def wait(self, timeout=None):
        self.set()
        return True


def _one_tick(state, nodes):
    queue = Queue()
    _add_messages_to_queue(state, queue, {n: i for i, n in enumerate(nodes)}, _OneTick())
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_one_undelivered_message_per_node_per_tick_in_store_order():
    a1, b1, a2, c1, done = _msg(1), _msg(2), _msg(1), _msg(3), _msg(2, delivered="then")
    state = _State({"a1": a1, "b1": b1, "a2": a2, "c1": c1, "d": done, "x": _msg(9)})
    out = _one_tick(state, [1, 2, 3])
    assert out == [a1, b1, c1]  # a2 waits for the next tick; node 9 is not ours
    assert all(m.metadata.delivered_at for m in out) and a2.metadata.delivered_at == ""
    assert _one_tick(state, [1, 2, 3]) == [a2]
    assert _one_tick(state, [1, 2, 3]) == []


def test_expired_messages_are_dropped_as_flower_drops_them():
    old, new = _msg(1), _msg(1)
    state = _State({"old": old, "new": new}, expired={"old"})
    assert _one_tick(state, [1]) == [new]
    assert "old" not in state.message_ins_store and "old" in state.checked
