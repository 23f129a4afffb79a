"""The Ray side of engine ``vectorized-ray``: the cluster it runs on and the shard actors.

:func:`ray_session` connects to an existing cluster (``--ray-address``) or starts a local one
for the run and stops it after; :class:`ShardWorker` is the actor class of one shard
(:mod:`fedhier.engines.vectorized_ray.shard`): built once per run with the federation from
Ray's object store (one ``ray.put`` for all workers) and its clients' ids, then asked once per
cloud round to run its edges' jobs. Only models (the global model down, one aggregate per edge
up) and the client -> edge map cross between the driver and the workers.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.data.federation import Federation
from fedhier.local.train import resolve_device
from fedhier.round.tiers.jobs import EdgeReport, ServerJob
from fedhier.runs.prepare import initial_model, settings_for
from fedhier.settings.run_config import RunConfig


def peak_rss_bytes() -> int:
    """This process's peak resident memory (bytes; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class ShardWorker:
    """One shard of whole edges (a Ray actor: ``ray.remote(ShardWorker)``), given its run's
    shard by :meth:`load` (an actor serves the runs of one Ray session in turn)."""

    def load(self, cfg: RunConfig, fed: Federation, clients: np.ndarray) -> None:
        """Take the shard of ``fed``'s clients ``clients`` (int64, sorted) of run ``cfg``."""
        from fedhier.engines.vectorized_ray.shard import ShardExecutor

        device = resolve_device(cfg.device)
        self.settings = settings_for(cfg)
        self.num_clients = len(clients)
        self.executor = ShardExecutor.build(cfg, fed, clients,
                                            initial_model(cfg, fed).to(device), device)
        self.run_seconds = self.run_cpu_seconds = 0.0

    def run(self, jobs: Sequence[ServerJob]) -> list[EdgeReport]:
        """Some or all of its edges' (or whole subtrees') jobs of one cloud round
        (:func:`run_jobs`: only the clients of those edges train; asynchronous edges send
        the edges that start together)."""
        from fedhier.engines.vectorized_ray.subtree import run_jobs

        return self._timed(run_jobs, jobs)

    def _timed(self, run: Callable[..., list[EdgeReport]],
               jobs: Sequence[ServerJob]) -> list[EdgeReport]:
        """``run(settings, shard, jobs)``, its wall and CPU seconds added to the worker's."""
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return run(self.settings, self.executor, jobs)
        finally:
            self.run_seconds += time.perf_counter() - wall
            self.run_cpu_seconds += time.process_time() - cpu

    def release(self, clients: Sequence[int]) -> list[Any]:
        """Let ``clients`` go to another shard; their moves (:mod:`.vectorized_ray_moves`)."""
        from fedhier.engines.vectorized_ray.moves import release

        self.executor, moves = release(self.executor, clients)
        self.num_clients = len(self.executor.clients)
        return moves

    def adopt(self, moves: Sequence[Any]) -> None:
        """Take the clients of ``moves`` (released by another shard) into this one."""
        from fedhier.engines.vectorized_ray.moves import adopt

        self.executor = adopt(self.executor, moves)
        self.num_clients = len(self.executor.clients)

    def client_state(self) -> tuple[np.ndarray, dict[str, Any]]:
        """Its clients' ids (int64 [m], increasing) and their kept momentum buffers
        (name -> [m, *shape]; {} when they keep none)."""
        return self.executor.clients, self.executor.client_state()

    def restore_client_state(self, state: dict[str, Any]) -> None:
        """Take its clients' kept state (name -> [m, *shape], in the order of their ids)."""
        if len(self.executor.clients) and state:
            self.executor.restore_client_state(state)

    def stats(self) -> dict[str, Any]:
        """Its clients, peak resident memory (bytes), node and process id, and the wall and
        CPU seconds of its runs of jobs since its shard was loaded (CPU time does not grow
        with other processes' load on the machine)."""
        import ray

        return {"clients": self.num_clients, "peak_rss_bytes": peak_rss_bytes(),
                "run_seconds": self.run_seconds, "run_cpu_seconds": self.run_cpu_seconds,
                "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def worker_env() -> dict[str, Any]:
    """The Ray runtime environment of the workers: this fedhier importable (its parent
    folder first on PYTHONPATH), for clusters started from this machine's checkout."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def check_reachable(address: str, seconds: float = 5.0) -> None:
    """A one-line ConfigError unless something accepts connections at ``address``
    (``host:port``; "" and ``auto`` are not checked): ``ray.init`` would retry for minutes."""
    if not address or address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address '{address}': expected host:port (or auto)")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as error:
        raise ConfigError(f"no Ray cluster answers at {address} ({error.strerror or error}); "
                          "start one with `ray start --head` or leave --ray-address empty"
                          ) from None


@contextmanager
def ray_session(address: str, num_cpus: int) -> Iterator[None]:
    """Ray for one run: the cluster at ``address`` ("" = a local one with ``num_cpus`` CPUs,
    started here and stopped at the end); a session already open in this process is used
    as it is."""
    import ray

    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address or "local", num_cpus=None if address else num_cpus,
                 include_dashboard=False, log_to_driver=False, runtime_env=worker_env(),
                 logging_level=logging.ERROR, configure_logging=True)
    except (ConnectionError, ValueError, RuntimeError) as error:
        raise ConfigError(f"cannot reach the Ray cluster at '{address}': "
                          f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                          ) from None
    try:
        yield
    finally:
        ray.shutdown()
        _POOL.clear()  # a later session of this process may reuse the same job id


#: Ray job id -> the :class:`ShardWorker` actors started in that Ray session: a process that
#: runs several runs on one connection (a sweep trial, tests) starts its workers once.
_POOL: dict[str, list[Any]] = {}


def worker_pool(count: int) -> list[Any]:
    """``count`` :class:`ShardWorker` actors of this Ray session, one CPU each, spread over
    the cluster's nodes: those of its earlier runs, and new ones (started asynchronously:
    they boot while the driver sets up)."""
    import ray

    session = ray.get_runtime_context().get_job_id()
    for stale in [key for key in _POOL if key != session]:  # their session has ended
        del _POOL[stale]
    pool = _POOL.setdefault(session, [])
    actor = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(ShardWorker)
    pool.extend(actor.remote() for _ in range(count - len(pool)))
    return pool[:count]


def start_workers(cfg: RunConfig, fed: Federation,
                  shards: Sequence[np.ndarray]) -> list[Any]:
    """One worker per shard (int64 client ids each, :func:`worker_pool`), each loaded with
    its shard; the federation goes to the object store once."""
    import ray

    workers = worker_pool(len(shards))
    fed_ref = ray.put(fed)
    ray.get([worker.load.remote(cfg, fed_ref, clients)
             for worker, clients in zip(workers, shards, strict=True)])
    return workers
