"""Engine ``flower``: Flower's Simulation Engine (Ray), one virtual SuperNode per client.

The ServerApp runs in this process (so it can write the run folder and show progress); the
ClientApp ``fedhier.clients.app:app`` runs in Ray actors. ``flwr run .`` from the repository
root runs the same ServerApp logic through ``fedhier.strategies.server_app:app``.

With ``edge_servers`` (``--engine flower --edge-servers``) the virtual SuperNodes are the
cloud's child servers instead, each running its clients' edge rounds in its actor
(:mod:`fedhier.engines.flower_edges`): one message per server and cloud round. With
``ray_address`` the run joins that Ray cluster (its CPUs: one actor each) instead of
starting and stopping a local Ray (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from queue import Empty, Queue
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedhier.engines.grid_run import run_federation
from fedhier.engines.reply_binding import bound
from fedhier.runs.checkpoint import Checkpoint
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import quiet_flower
from fedhier.settings.run_config import RunConfig


def run_simulation_engine(cfg: RunConfig, folder: RunFolder, progress: bool = True,
                          num_cpus: int | None = None,
                          resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` on Flower's Simulation Engine; each actor gets one CPU. Its nodes are
    the clients, or with ``cfg.edge_servers`` the servers under the cloud."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from fedhier.engines.flower_edges import simulation_nodes

    client_app, num_nodes = simulation_nodes(cfg)
    quiet_flower()
    summary: dict[str, Any] = {}
    errors: list[BaseException] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # The ServerApp runs in a Flower thread; its exception (a run failure, a stop
        # requested inside it) is handed to the caller's thread, as on the other engines.
        replies.wait_on(grid)
        try:
            summary.update(run_federation(grid, cfg, folder, engine="flower",
                                          progress=progress, resume=resume))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    num_gpus = 1.0 if cfg.device in ("cuda", "auto") and _cuda() else 0.0
    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": "error"}
    if cfg.ray_address:  # an existing cluster: its CPUs, one actor each
        from fedhier.engines.vectorized_ray.worker import check_reachable

        check_reachable(cfg.ray_address)
        init_args["address"] = cfg.ray_address
    elif not os.environ.get("RAY_ADDRESS"):  # joining a cluster: Ray refuses num_cpus
        # a Ray of the run's own, as ray_address = "" says: not a cluster some `ray start`
        # left on this machine (ray.init() would join it, and refuse num_cpus there)
        init_args["address"] = "local"
        init_args["num_cpus"] = num_cpus or os.cpu_count() or 1
        # No idle workers started ahead: the actors get workers of their own, and idle
        # ones only took CPU from the actors' start (docs/engines.md).
        init_args["_system_config"] = {"enable_worker_prestart": False,
                                       "prestart_worker_first_driver": False}
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": num_gpus / max(num_nodes, 1)},
        "init_args": init_args,
    }
    replies = _Replies()
    with _fast_dispatch(replies):
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=num_nodes,
                       backend_config=backend_config)  # type: ignore[arg-type]
    quiet_flower()
    if errors:
        raise errors[0]
    if not summary:
        raise RuntimeError("the Simulation Engine finished without a result (see log above)")
    return summary


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


#: Seconds between two walks over the stored messages for new ones to hand to the clients
#: (Flower's: 0.1 s); and the longest wait for replies between two looks (Flower's pull
#: interval: 0.1 s), which only matters for replies the LinkState makes itself (expired
#: messages): the Simulation Engine's replies wake the ServerApp as they are stored.
DISPATCH_INTERVAL = 0.01
#: The Flower release whose private dispatcher (``vce_api``) :func:`_fast_dispatch` replaces;
#: under any other the Simulation Engine runs unpatched.
PATCHED_FLOWER = "1.42.0"
PULL_INTERVAL = 0.1
#: Seconds the first batch of messages waits for the engine's first reply (its actors
#: starting: ~30 s on 2 CPUs) before its own deadline starts.
STARTUP_SECONDS = 600.0


class _Replies:
    """Counts the replies the Simulation Engine stores, so that the ServerApp's
    ``send_and_receive`` wakes when its last reply is in instead of looking every 0.1 s;
    notes when the first one came (the nodes are up: deadlines start from then)."""

    def __init__(self) -> None:
        self.stored = 0
        self.changed = threading.Condition()
        self.first_at: float | None = None  # time.time() of the first reply stored

    def add(self) -> None:
        with self.changed:
            self.stored += 1
            if self.first_at is None:
                self.first_at = time.time()
            self.changed.notify_all()

    def deadline(self, pushed: float, timeout: float | None) -> float:
        """When a batch pushed at ``pushed`` stops waiting: ``timeout`` seconds from its
        push, or from the engine's first reply when that came later (the nodes were still
        starting); before any reply, at most :data:`STARTUP_SECONDS` more."""
        if timeout is None:
            return math.inf
        if self.first_at is None:
            return pushed + max(timeout, STARTUP_SECONDS)
        return max(pushed, self.first_at) + timeout

    def _all_in(self, seen: int, target: int) -> bool:
        return self.stored > seen and self.stored >= target

    def wait_on(self, grid: Grid) -> None:
        """Give ``grid`` (Flower's InMemoryGrid) a ``send_and_receive`` that waits for
        these notifications; the same pushes and pulls as Flower's, fewer pulls."""
        if not all(hasattr(grid, a) for a in ("push_messages", "pull_messages")):
            return

        def send_and_receive(messages: Iterable[Message], *,
                             timeout: float | None = None) -> list[Message]:
            with self.changed:
                base = self.stored
            pushed = time.time()
            ids = set(grid.push_messages(messages))
            total = len(ids)
            out: list[Message] = []
            while True:
                with self.changed:
                    seen = self.stored
                replies = list(grid.pull_messages(ids))
                out.extend(replies)
                ids.difference_update(r.metadata.reply_to_message_id for r in replies)
                left = self.deadline(pushed, timeout) - time.time()
                if not ids or left <= 0:
                    return out
                with self.changed:  # all replies in since the push, or a new one since the pull
                    self.changed.wait_for(functools.partial(self._all_in, seen, base + total),
                                          timeout=min(PULL_INTERVAL, left))

        grid.send_and_receive = send_and_receive  # type: ignore[method-assign]


@contextlib.contextmanager
def _fast_dispatch(replies: _Replies) -> Iterator[None]:
    """Run the Simulation Engine with :func:`_add_messages_to_queue` as its dispatcher and
    a reply injector that tells ``replies``.

    Flower's dispatcher (``vce_api.add_messages_to_queue``) asks the LinkState, every 0.1 s,
    for one message per node with ``get_message_ins(node, limit=1)``, and each such call
    walks every stored message: with n nodes and n messages in flight that is n^2 validity
    checks per tick, which kept one of two cores busy for the whole run. Ours hands out the
    same messages (at most one per node per tick, each checked once as Flower checks it,
    marked delivered as Flower marks it) in one walk. Where the LinkState is not the
    in-memory one it knows, Flower's own dispatcher runs. The injector stores each reply as
    Flower's ``put_message_into_state`` does, then counts it in ``replies``. The backend's
    reply to a message is bound to it (:func:`fedhier.engines.reply_binding.bound`): a
    ClientApp reply that does not answer its message becomes an error reply to it that says
    so, where Flower's LinkState would drop it unseen.
    """
    import flwr
    from flwr.server.superlink.fleet.vce import vce_api

    if flwr.__version__ != PATCHED_FLOWER:  # another Flower: its own dispatcher, unpatched
        yield
        return
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    original = vce_api.add_messages_to_queue
    original_injector = vce_api.put_message_into_state
    original_process = RayBackend.process_message

    def process(backend: Any, message: Message, context: Context) -> tuple[Message, Context]:
        # the reply to exactly this message, or an error reply to it saying what did not
        # match (Flower's LinkState would drop it unseen: a silent client)
        reply, updated = original_process(backend, message, context)
        return bound(message, reply), updated

    def dispatch(state: Any, queue: Queue, nodes_mapping: dict[int, int],
                 f_stop: threading.Event) -> None:
        if not all(hasattr(state, a) for a in ("message_ins_store", "lock",
                                               "_check_stored_messages")):
            original(state, queue, nodes_mapping, f_stop)
            return
        _add_messages_to_queue(state, queue, nodes_mapping, f_stop)

    def inject(state: Any, queue: Queue, f_stop: threading.Event) -> None:
        while not f_stop.is_set():
            try:
                reply = queue.get(timeout=1.0)
            except Empty:
                continue
            state.store_message_res(reply)
            replies.add()

    vce_api.add_messages_to_queue = dispatch
    vce_api.put_message_into_state = inject
    RayBackend.process_message = process  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
        vce_api.put_message_into_state = original_injector
        RayBackend.process_message = original_process  # type: ignore[method-assign]


def _add_messages_to_queue(state: Any, queue: Queue, nodes_mapping: dict[int, int],
                           f_stop: threading.Event) -> None:
    """Put each node's oldest undelivered message in ``queue``, one walk per tick."""
    from flwr.supercore.date import now

    nodes = set(nodes_mapping)
    while not f_stop.is_set():
        taken: dict[int, Any] = {}
        with state.lock:
            for msg_id, msg in list(state.message_ins_store.items()):
                node = msg.metadata.dst_node_id
                if node in taken or node not in nodes or msg.metadata.delivered_at != "":
                    continue
                state._check_stored_messages({msg_id})  # expired: deleted, as in Flower
                if state.message_ins_store.get(msg_id) is msg:
                    taken[node] = msg
            delivered_at = now().isoformat()
            for msg in taken.values():
                msg.metadata.delivered_at = delivered_at
        for msg in taken.values():
            queue.put(msg)
        f_stop.wait(DISPATCH_INTERVAL)
