"""Claiming and answering tasks of a SuperLink's or SuperNode's runtime API from a process
of our own, as Flower's SuperExec and ``flwr-clientapp`` do.

A SuperNode (or SuperLink) started with ``--isolation process`` starts no app processes: an
outside process claims each task with ``AcquireTask`` (authenticated by the SuperExec secret)
and runs it. fedhier's edge servers (:mod:`.edge_process`) and the long-lived ClientApp
processes of ``fedhier deploy`` (:mod:`.client_runtime`) do so with :func:`serve_tasks`.
"""

from __future__ import annotations

import contextlib
import signal
import time
import traceback
from collections.abc import Callable
from types import FrameType

from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

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

#: Seconds between two AcquireTask calls of an idle task runtime (its SuperNode is local).
IDLE_ACQUIRE = 0.2


def runtime_client(address: str, root_certificates: bytes | None, component: str,
                   secret: bytes | None = None, token: str | None = None) -> RuntimeHttpClient:
    """A client of a SuperLink's or SuperNode's runtime API (what SuperExec uses)."""
    interceptors: list = [RuntimeVersionHttpInterceptor(component_name=component)]
    if secret is not None and token is None:
        interceptors.append(SuperExecAuthHttpInterceptor(
            master_secret=secret,
            protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=root_certificates is None,
        root_certificates=root_certificates, interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker())


def acquire(client: RuntimeHttpClient, task_type: str, poll: Poll | None = None,
            wake: Wake | None = None) -> tuple[object, str]:
    """Wait for a task of ``task_type`` and claim it; returns (task, token). Asks every
    ``poll.wait()`` seconds (default: :meth:`Poll.from_env`, 0.2 s when idle), and at once
    when the SuperNode pokes ``wake``; a claimed task marks ``poll`` busy."""
    poll = poll or Poll.from_env(idle=IDLE_ACQUIRE)
    while True:
        res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[task_type]))
        if res.HasField("task") and res.token:
            poll.busy()
            return res.task, res.token
        if wake is None:
            time.sleep(poll.wait())
        else:
            wake.wait(poll.wait())


def serve_tasks(node_address: str, secret: bytes | None,
                answer: Callable[[Message, Context], Message], name: str) -> None:
    """Claim the ClientApp tasks of the SuperNode whose runtime API is ``node_address``
    (started with ``--isolation process``) and answer each in this process, one at a time:
    what Flower's ``flwr-clientapp`` does for one message, without a process per message.
    An exception in ``answer`` becomes an error reply; a task whose input cannot be pulled
    (its sender, an edge server, was killed while pushing it) is skipped, so that the runtime
    serves the restarted sender's next run."""
    pace_flower_pulls()
    node = runtime_client(node_address, None, "SuperExec", secret)
    wake = Wake.from_env(TASK)  # poked by our SuperNode: no need to ask often
    poll = Poll(FLOWER_IDLE) if wake else Poll.from_env(idle=IDLE_ACQUIRE)
    while True:
        _, token = acquire(node, TaskType.CLIENT_APP, poll, wake)
        claimed = time.time()
        client = runtime_client(node_address, None, "flwr-clientapp", token=token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        try:
            try:
                msg, context, _, _ = pull_task_input(client)  # sets the task's identity
            except Exception as exc:  # noqa: BLE001 - e.g. its sender died mid-push: next task
                print(f"{name}: could not pull a task ({type(exc).__name__}: {exc}); waiting "
                      "for the next", flush=True)
                continue
            trace("claimed", [msg.metadata.message_id], t=claimed)
            trace("acquired", [msg.metadata.message_id])
            config = msg.content.config_records.get("config")
            cloud_round = config.get("server-round", "-") if config is not None else "-"
            kind = msg.metadata.message_type
            print(f"{name}: got {kind} (cloud round {cloud_round!s})", flush=True)
            started = time.time()
            try:
                reply = answer(msg, context)
            except Exception as exc:  # noqa: BLE001 - the sender gets it as an error reply
                reason = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=3)
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
                reply = Message(error, reply_to=msg)
                print(f"{name}: {kind} failed: {exc}", flush=True)
            push_message(client, reply, context)
            # The task's token ends with its output: a heartbeat sent after it is refused
            # (HTTP 401), and Flower's HTTP retry answers a 401 by sending SIGINT to this
            # process, which would end the runtime between two tasks (the next task then
            # waits for a runtime that is gone). So no heartbeat outlives the token.
            stop_heartbeat(heartbeat)
            push_task_output(client, context, SubStatus.COMPLETED, "")
            poke(REPLY)  # the SuperNode sends it now
            trace("answered", [msg.metadata.message_id])
            poll.busy()
            print(f"{name}: answered {kind} in {time.time() - started:.1f} s", flush=True)
        finally:
            stop_heartbeat(heartbeat)


def stop_heartbeat(heartbeat: HeartbeatSender) -> None:
    """Stop ``heartbeat`` and wait for a heartbeat in flight (once; a sender whose thread
    already ended is left as it is)."""
    if heartbeat.is_running:
        with contextlib.suppress(RuntimeError):  # its thread ended after the check
            heartbeat.stop()


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def exit_on_sigterm() -> None:
    """SIGTERM ends the process like ``sys.exit(0)`` (``fedhier deploy`` stops it so)."""
    signal.signal(signal.SIGTERM, _exit)
