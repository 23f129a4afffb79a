"""Engine ``flower``: Flower's Simulation Engine (Ray), one virtual SuperNode per client.

The ServerApp runs in this process (so it can write the run folder and show progress); the
ClientApp ``fedhier.clients.app:app`` runs in Ray actors. ``flwr run .`` from the repository
root runs the same ServerApp logic through ``fedhier.strategies.server_app:app``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from queue import Queue
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedhier.checkpoint import Checkpoint
from fedhier.config import RunConfig
from fedhier.engines.grid_run import run_federation
from fedhier.run_folder import RunFolder
from fedhier.server import quiet_flower


def run_simulation_engine(cfg: RunConfig, folder: RunFolder, progress: bool = True,
                          num_cpus: int | None = None,
                          resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` on Flower's Simulation Engine; each client actor gets one CPU."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from fedhier.clients.app import app as client_app

    quiet_flower()
    summary: dict[str, Any] = {}
    errors: list[BaseException] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # The ServerApp runs in a Flower thread; its exception (a run failure, a stop
        # requested inside it) is handed to the caller's thread, as on the other engines.
        if hasattr(grid, "pull_interval"):  # InMemoryGrid: look for replies every 10 ms
            grid.pull_interval = PULL_INTERVAL
        try:
            summary.update(run_federation(grid, cfg, folder, engine="flower",
                                          progress=progress, resume=resume))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller
            errors.append(exc)

    num_gpus = 1.0 if cfg.device in ("cuda", "auto") and _cuda() else 0.0
    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": "error"}
    if not os.environ.get("RAY_ADDRESS"):  # joining a cluster: Ray refuses num_cpus
        init_args["num_cpus"] = num_cpus or os.cpu_count() or 1
        # No idle workers started ahead: the actors get workers of their own, and idle
        # ones only took CPU from the actors' start (docs/engines.md).
        init_args["_system_config"] = {"enable_worker_prestart": False,
                                       "prestart_worker_first_driver": False}
    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": num_gpus / max(cfg.clients, 1)},
        "init_args": init_args,
    }
    with _fast_dispatch():
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=cfg.clients,
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


#: Seconds between two looks for replies (ServerApp side) and for new messages (SuperNode
#: side); Flower's are 0.1 s each.
PULL_INTERVAL = 0.01
DISPATCH_INTERVAL = 0.01


@contextlib.contextmanager
def _fast_dispatch() -> Iterator[None]:
    """Run the Simulation Engine with :func:`_add_messages_to_queue` as its dispatcher.

    Flower's dispatcher (``vce_api.add_messages_to_queue``) asks the LinkState, every 0.1 s,
    for one message per node with ``get_message_ins(node, limit=1)``, and each such call
    walks every stored message: with n nodes and n messages in flight that is n^2 validity
    checks per tick, which kept one of two cores busy for the whole run. Ours hands out the
    same messages (at most one per node per tick, each checked once as Flower checks it,
    marked delivered as Flower marks it) in one walk. Where the LinkState is not the
    in-memory one it knows, Flower's own dispatcher runs.
    """
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue

    def dispatch(state: Any, queue: Queue, nodes_mapping: dict[int, int],
                 f_stop: threading.Event) -> None:
        if not all(hasattr(state, a) for a in ("message_ins_store", "lock",
                                               "_check_stored_messages")):
            original(state, queue, nodes_mapping, f_stop)
            return
        _add_messages_to_queue(state, queue, nodes_mapping, f_stop)

    vce_api.add_messages_to_queue = dispatch
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original


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
