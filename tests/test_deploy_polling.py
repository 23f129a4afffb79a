"""The pace of fedhier deploy's processes (fedhier/engines/deployment/polling.py) and the
monkeypatch of Flower's SuperNode loop it rests on (fedhier/engines/deployment/supernode.py).

The first test reads Flower's source: if a Flower upgrade changes what the patch replaces
(the module's ``time``, its 3 s and 0.5 s sleeps, the pull function and how it is called), it
fails, and the patch must be revisited (docs/deployment.md#latency).
"""

from __future__ import annotations

import inspect
import re
import time
from types import SimpleNamespace

import flwr.supernode.start_client_internal as sci
import pytest

from fedhier.engines.deployment import main as deploy_main
from fedhier.engines.deployment.polling import (
    FLOWER_IDLE,
    FLOWER_PULLS,
    GROWTH,
    POLL_ENV,
    Poll,
    shorten_pull_backoff,
)
from fedhier.engines.deployment.supernode import PacedTime, install
from fedhier.engines.deployment.trace import NAME_ENV, TRACE_ENV, read_trace


def test_flower_supernode_loop_is_what_the_patch_replaces():
    source = inspect.getsource(sci)
    assert sci.time is time
    assert set(re.findall(r"\btime\.(\w+)", source)) == {"sleep"}  # only sleeps use it
    loop = inspect.getsource(sci.start_client_internal)
    assert loop.count("time.sleep(3)") == 1 and FLOWER_IDLE == 3
    assert "run_id = _pull_and_store_message(" in loop and "receive=receive" in loop
    assert "_push_messages(" in loop
    assert "time.sleep(0.5)" in inspect.getsource(sci._push_messages)
    assert "receive" in inspect.signature(sci._pull_and_store_message).parameters
    assert "supernode.cli:flower_supernode" in _entry_point("flower-supernode")


def _entry_point(name: str) -> str:
    from importlib.metadata import entry_points

    (point,) = [p for p in entry_points(group="console_scripts") if p.name == name]
    return point.value


def test_flower_content_pulls_are_what_the_backoff_patch_replaces():
    import importlib

    from flwr.supercore import constant

    assert constant.PULL_INITIAL_BACKOFF == 1  # what shorten_pull_backoff shortens
    for module_name, name in FLOWER_PULLS:
        module = importlib.import_module(module_name)
        assert f"{name}(" in inspect.getsource(module).split(f"def {name}", 1)[-1]  # called
        parameters = inspect.signature(getattr(module, name)).parameters
        assert "initial_backoff" in parameters and "backoff_cap" in parameters
    undo = shorten_pull_backoff(0.02)
    shorten_pull_backoff(0.01)  # again: replaces, does not stack
    try:
        for module_name, name in FLOWER_PULLS:
            patched = getattr(importlib.import_module(module_name), name)
            assert patched.keywords == {"initial_backoff": 0.01, "backoff_cap": 0.04}
            assert not hasattr(patched.func, "keywords")
    finally:
        undo()
    for module_name, name in FLOWER_PULLS:
        assert not hasattr(getattr(importlib.import_module(module_name), name), "keywords")


def test_paced_sleeps_follow_the_poll():
    poll = Poll(interval=0.01, idle=FLOWER_IDLE)
    clock = PacedTime(poll)
    t0 = time.monotonic()
    clock.sleep(3)  # Flower's idle sleep: the busy interval
    clock.sleep(0.5)  # Flower's reply wait: never longer than the interval
    assert time.monotonic() - t0 < 0.5 and clock.empty_pulls == 1
    assert clock.monotonic is time.monotonic  # the rest of ``time`` passes through
    # each empty ask waits 1.25 times longer, up to Flower's 3 s; a message resets it
    waits = [poll.wait() for _ in range(40)]
    assert GROWTH == 1.25
    assert waits[:3] == [0.01 * 1.25, 0.01 * 1.25 ** 2, 0.01 * 1.25 ** 3]
    assert waits[-1] == FLOWER_IDLE and waits.index(FLOWER_IDLE) == 25  # 1.25^26 > 300
    poll.busy()
    assert poll.wait() == 0.01


def test_poll_from_environment(monkeypatch):
    monkeypatch.setenv(POLL_ENV, "0")
    assert Poll.from_env().wait() == Poll.from_env().wait() == FLOWER_IDLE  # Flower's pace
    assert Poll.from_env(idle=0.2).wait() == 0.2
    monkeypatch.setenv(POLL_ENV, "0.02")
    assert Poll.from_env().wait() == 0.02
    assert Poll.from_env(idle=0.01).wait() == 0.01  # never slower than the idle pace


def test_install_wraps_the_pull_and_undo_restores_flower(monkeypatch, tmp_path):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    monkeypatch.setenv(NAME_ENV, "supernode-0")
    calls = []

    def fake_pull(*, receive, state):  # Flower's signature, reduced
        calls.append(state)
        return 7 if receive() is not None else None

    monkeypatch.setattr(sci, "_pull_and_store_message", fake_pull)
    poll = Poll(interval=0.01)
    poll.misses = 100  # long idle
    undo = install(poll)
    try:
        assert isinstance(sci.time, PacedTime)
        assert sci._pull_and_store_message(receive=lambda: None, state="s") is None
        assert poll.misses == 100  # nothing arrived: still idle
        message = SimpleNamespace(metadata=SimpleNamespace(message_id="m1"))
        assert sci._pull_and_store_message(receive=lambda: (message, None), state="s") == 7
        assert poll.misses == 0 and poll.wait() == 0.01  # a message arrived: busy
    finally:
        undo()
    assert sci.time is time and sci._pull_and_store_message is fake_pull
    assert calls == ["s", "s"]
    received, pulled = read_trace(tmp_path)
    assert (received["ev"], received["ids"]) == ("received", ["m1"])
    assert (pulled["ev"], pulled["ids"], pulled["proc"]) == ("pulled", ["m1"], "supernode-0")
    assert pulled["empty"] == 0


@pytest.mark.parametrize("value", ["-1", "3.5", "nan"])
def test_bad_poll_interval_is_one_line_and_exit_2(value, capsys, tmp_path):
    code = deploy_main(["local", "--nodes", "4", "--poll-interval", value,
                        "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--poll-interval" in err[0]


def test_wake_returns_when_poked_and_poke_without_listener_is_harmless(monkeypatch, tmp_path):
    from fedhier.engines.deployment.polling import WAKE_ENV, Wake, poke

    monkeypatch.setenv(WAKE_ENV, str(tmp_path / "client-0"))
    poke("task")  # nobody listens yet: nothing happens
    wake = Wake.from_env("task")
    assert wake is not None and not wake.wait(0.01)
    poke("task")
    poke("task")
    t0 = time.monotonic()
    assert wake.wait(5) and time.monotonic() - t0 < 1  # poked: no sleep
    assert not wake.wait(0)  # both pokes drained
    clock = PacedTime(Poll(interval=5), reply_wake=wake)
    poke("task")
    t0 = time.monotonic()
    clock.sleep(0.5)  # Flower's reply wait, cut short by the runtime's poke
    assert time.monotonic() - t0 < 0.4
    monkeypatch.delenv(WAKE_ENV)
    assert Wake.from_env("task") is None


class FakeClock:
    """``time`` for a module under test: ``sleep`` advances ``time()`` at once."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_reply_wait_is_the_interval_then_a_tenth_of_the_elapsed_time():
    from fedhier.engines.deployment.polling import REPLY_LATENESS, reply_wait

    assert REPLY_LATENESS == 0.1
    assert reply_wait(0.0, 0.05) == reply_wait(0.49, 0.05) == 0.05
    assert reply_wait(2.0, 0.05) == pytest.approx(0.2)
    assert reply_wait(10.0, 0.05) == pytest.approx(1.0)
    assert reply_wait(100.0, 0.05) == FLOWER_IDLE  # never slower than Flower's HttpGrid
    assert reply_wait(1.0, 0.5) == 0.5  # never faster than the interval


@pytest.mark.parametrize(("arrives", "pulls"), [(0.32, 8), (2.0, 26), (15.0, 47)])
def test_prompt_grid_pulls_replies_about_log_times_and_at_most_10_percent_late(
        monkeypatch, arrives, pulls):
    """A reply that is there ``arrives`` seconds after the push is pulled at most 10% (or one
    interval) late, with ~ L/interval + log(T/L)/log(1.1) pulls (L = 0.5 s), not T/0.05."""
    import fedhier.engines.prompt_grid as prompt_grid

    clock = FakeClock()
    monkeypatch.setattr(prompt_grid, "time", clock)
    monkeypatch.setenv(POLL_ENV, "0.05")
    monkeypatch.setattr("fedhier.engines.deployment.polling.pace_flower_pulls", lambda: None)
    start = clock.now
    asked = []

    class Replies:  # the Grid methods send_and_receive uses
        def push_messages(self, messages):
            return ["m1"]

        def pull_messages(self, message_ids):
            asked.append(clock.now)
            if clock.now - start < arrives:
                return []
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))]

    grid = prompt_grid.PromptGrid(Replies())  # type: ignore[arg-type]
    assert grid.poll_seconds == 0.05
    replies = list(grid.send_and_receive([SimpleNamespace(
        metadata=SimpleNamespace(message_type="train"))], timeout=60))
    assert len(replies) == 1 and len(asked) == pulls
    late = asked[-1] - start - arrives
    assert 0 <= late <= max(0.05, 0.1 * arrives) + 1e-9


def test_a_woken_task_runtime_claims_at_once_and_otherwise_asks_every_3_s(
        monkeypatch, tmp_path):
    """With a wake FIFO (its SuperNode pokes it when a message is stored) the task runtime's
    fallback AcquireTask is Flower's idle pace, 3 s; a poke makes it ask at once."""
    from fedhier.engines.deployment import task_runtime
    from fedhier.engines.deployment.polling import WAKE_ENV, Wake, poke

    monkeypatch.setenv(WAKE_ENV, str(tmp_path / "client-0"))
    wake = Wake.from_env("task")
    answers = iter([None, "task"])

    class Node:
        calls = 0

        def AcquireTask(self, request):  # noqa: N802 - Flower's RPC name
            Node.calls += 1
            task = next(answers)
            return SimpleNamespace(HasField=lambda _: task is not None, task=task,
                                   token="tok" if task else "")

    poke("task")
    t0 = time.monotonic()
    poll = Poll(FLOWER_IDLE)
    assert task_runtime.acquire(Node(), "clientapp", poll, wake) == ("task", "tok")
    assert time.monotonic() - t0 < 1 and Node.calls == 2  # woken, not 3 s later
    assert poll.misses == 0 and poll.wait() == FLOWER_IDLE  # then idle at Flower's pace


def test_the_benchmark_table_takes_each_leg_from_the_trace():
    """benchmarks/deploy_latency.py: leg seconds are differences of the traced times; the CPU
    column is the difference of one process's CPU clock, empty for legs across processes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "deploy_latency.py"
    spec = importlib.util.spec_from_file_location("bench_deploy_latency", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def event(t, cpu, proc, ev, **fields):
        return {"t": t, "cpu": cpu, "proc": proc, "ev": ev, "ids": ["m"], **fields}

    trace = [event(10.0, 5.0, "edge-0", "push", kind="train"),
             event(10.1, 5.5, "edge-0", "pushed"),
             event(10.3, 1.0, "supernode-0", "received"),
             event(10.7, 1.2, "supernode-0", "pulled"),
             event(10.8, 3.0, "clientapp-0", "acquired"),
             event(11.8, 3.25, "clientapp-0", "answered"),
             event(12.0, 1.5, "supernode-0", "sent"),
             event(12.5, 6.0, "edge-0", "reply")]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:]
            for line in bench.leg_table(trace).splitlines()[2:-1]}
    assert rows["SuperNode pulls the content"] == ["0.400", "0.200 |"]
    assert rows["handling (ClientApp or edge job)"] == ["1.000", "0.250 |"]
    assert rows["SuperNode -> task runtime"] == ["0.100", " |"]  # two processes: no CPU
    assert rows["(the Grid pushes message and content)"] == ["0.100", " |"]
    assert rows["whole message, push to reply"] == ["2.500", " |"]
    assert bench.kind_of("supernode-3/fedhier.engines.deployment.supernode#812") == \
        "supernode-N/fedhier.engines.deployment.supernode"
