"""Engine ``vectorized-ray``: the batched engine sharded by the hierarchy over a Ray cluster.

Whole edges are placed on Ray actors (:mod:`.vectorized_ray_executor`: contiguous runs of edges with
about equal numbers of clients, one shard per worker); each actor trains its clients with the
one-process engine's batched executor and aggregates each of its edges itself
(:mod:`fedhier.engines.vectorized_ray.shard`). The cloud's rounds are
:class:`fedhier.round.tiers.servers.ServerRounds`, the same cloud half that edge servers as
processes use: once per cloud round it sends each edge the global model and takes the cloud
step over the edges' aggregates, so only models cross between the driver and the workers,
at the cloud period, and the traffic between workers falls with G as the hierarchy's does.
Evaluation, profiles and gradient queries run in the driver on the whole federation
(:class:`~fedhier.engines.vectorized.engine.BatchedExecutor`, the one-process engine's).

Numbers: every edge round that ends at the edges is bit for bit the one-process engine's
(an edge's clients are all in one shard, summed in client order); the cloud averages the
edges' averages instead of all clients at once, as edge servers do, so the global model
differs from the one-process engine's by float rounding (docs/engines.md, "Sharded over a
Ray cluster"). Kept optimizer state (``optimizer_state=keep``) stays on the worker that
holds the client (:meth:`~.vectorized_ray_shard.ShardExecutor.keep_chunk_state`), moves with
it (:class:`~.vectorized_ray_moves.ClientMove`) and is gathered by client id for checkpoints
(:meth:`RayShardExecutor.client_state`); deeper trees
place whole regions on the workers (:mod:`.vectorized_ray_subtree`). Clients move
(mobility, regrouping) as between edge servers
(:mod:`fedhier.round.tiers.moves`): the edges stay on their workers and a client whose new edge is
on another worker moves there (:meth:`RayShardExecutor.reattach`,
:mod:`fedhier.engines.vectorized_ray.moves`); per-edge periods run in the workers' jobs;
asynchronous edges (``async_buffer``) are :mod:`fedhier.engines.vectorized_ray.asynchrony`.
"""

from __future__ import annotations

from typing import Any

from fedhier.common.errors import ConfigError, Refusal
from fedhier.data.federation import Federation
from fedhier.engines.vectorized.engine import BatchedExecutor, BatchedRun
from fedhier.engines.vectorized_ray.asynchrony import (
    RayShardAsyncExecutor,
    ShardedBufferedRounds,
    check_sharded_async,
)
from fedhier.engines.vectorized_ray.executor import RayShardExecutor
from fedhier.engines.vectorized_ray.subtree import check_levels
from fedhier.engines.vectorized_ray.worker import (
    check_reachable,
    ray_session,
    worker_pool,
)
from fedhier.round.loop import HierarchicalSGD
from fedhier.round.tiers.servers import ServerRounds
from fedhier.runs.checkpoint import Checkpoint
from fedhier.runs.folder import RunFolder
from fedhier.runs.prepare import settings_for
from fedhier.settings.checks import check_moves_under_regions
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.cloud_step import as_cloud_step, make_cloud_strategy

#: What engine ``vectorized-ray`` refuses (docs/hsgd.md's table; asynchronous edges:
#: :mod:`fedhier.engines.vectorized_ray.asynchrony`).
REFUSALS = (
    Refusal("`--engine vectorized-ray` with `--edge-periods` and mobility",
            "not yet: a job split at a move would restart an edge's period; "
            "`--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--local-period", "2", "--global-period", "8",
             "--edge-periods", "2,4,2,4", "--mobility-rate", "0.5"),
            "engine vectorized-ray with per-edge periods needs static clients"),
    Refusal("`--engine vectorized-ray` with a `clip` region rule and moving clients on three "
            "or more levels",
            "not yet: a region's job that starts inside its period does not carry its last "
            "aggregate, which clip measures from; `--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--groups", "4,2", "--periods", "5,10,20",
             "--mobility-rate", "0.5", "--aggregators", "mean,clip,mean"),
            "engine vectorized-ray: moving clients under region servers"),
)

def check_sharded(cfg: RunConfig) -> None:
    """Refuse, in one line, what the sharded engine does not run (yet)."""
    if cfg.edge_periods and (cfg.mobility_rate > 0 or cfg.mobility_trace):
        raise ConfigError("engine vectorized-ray with per-edge periods needs static clients "
                          "(no mobility): a job split at a move would restart an edge's "
                          "period")
    check_levels(cfg)  # three or more levels: whole subtrees on the workers
    if len(cfg.periods) > 2 and cfg.clients_move():  # a region's job runs as on servers
        try:
            check_moves_under_regions(cfg)
        except ConfigError as error:
            raise ConfigError(f"engine vectorized-ray: {error}") from None
    check_sharded_async(cfg)


def run_vectorized_ray(cfg: RunConfig, folder: RunFolder, progress: bool = True, *,
                       federation: Federation | None = None,
                       resume: Checkpoint | None = None) -> dict[str, Any]:
    """Run ``cfg`` sharded by edge over Ray (``ray_address``, ``ray_workers``); writes the
    same run folder as ``vectorized``. Returns summary.json's dict plus ``sharding``: the
    workers' clients and peak memory and the bytes moved (:meth:`RayShardExecutor.stats`).

    ``federation``: the data instead of ``prepare(cfg)`` (benchmarks: replicated clients).
    """
    check_sharded(cfg)
    check_reachable(cfg.ray_address)
    run = BatchedRun.start(cfg, folder, "vectorized-ray", progress, federation, resume)
    asynchronous = cfg.asynchronous().active
    algorithm = HierarchicalSGD(
        settings_for(cfg), as_cloud_step(make_cloud_strategy(
            cfg.cloud_strategy, cfg.server_lr, cfg.server_momentum)),
        rounds=ShardedBufferedRounds if asynchronous else ServerRounds)
    with ray_session(cfg.ray_address, cfg.ray_workers):
        worker_pool(min(cfg.ray_workers, cfg.groups[-1]))  # one per cloud child, booting now
        whole = BatchedExecutor.build(cfg, run.fed, run.model, run.device)
        executor = (RayShardAsyncExecutor if asynchronous else RayShardExecutor)(
            cfg, run.fed, whole, cfg.ray_workers)
        summary = run.finish(cfg, algorithm, executor, resume)
        summary["sharding"] = executor.stats()
        summary["sharding"]["worker_moves"] = executor.worker_moves
        folder.write_json("sharding.json", summary["sharding"])
    return summary

