"""Whole subtrees on the workers of engine ``vectorized-ray``: trees of three or more levels.

With more than two levels the cloud's children are regions (level L - 1 nodes), and each
worker holds contiguous runs of whole cloud children (:func:`top_children`, placed by
:func:`fedhier.engines.vectorized_ray.executor.place_edges`). A worker answers a region's job as a
region server does (:func:`fedhier.round.tiers.jobs.run_edge_job`): the region's edge rounds from
the cloud's model, its edges' jobs run in process by the one-process batched machinery
(:func:`fedhier.engines.vectorized_ray.shard.run_shard_jobs` on the region's clients only,
:class:`RegionShard`), the region's aggregation at its period inside the worker, and the
region's aggregate of its survivors as the answer. Only the models of the cloud's children
cross between the driver and the workers, once per cloud round each way.

Numbers: the region averages its edges' averages and the cloud the regions', as region
servers do (``fedhier deploy local --regions``), so the global model equals the one-process
engine's up to float rounding (1e-6, tests/test_vectorized_ray_levels.py), per-edge periods
included (a region's edges run them in its worker as an edge server does). Clients move
between edges as with two levels (:mod:`fedhier.engines.vectorized_ray.moves`: a client whose
new edge is in a region on another worker moves there); the cloud cuts its round into
segments and a region's job carries its edges' own models (:mod:`fedhier.round.tiers.moves`), as
for region servers. Regrouping with three or more levels is refused (:func:`check_levels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhier.common.errors import ConfigError, Refusal
from fedhier.round.loop import EdgeRoundWork, HSGDSettings, Params, TrainResult
from fedhier.round.tiers.jobs import EdgeReport, ServerJob, job_hierarchy, run_edge_job
from fedhier.settings.run_config import RunConfig
from fedhier.tree.hierarchy import Hierarchy

#: What engine ``vectorized-ray`` refuses on deeper trees (docs/hsgd.md's table).
REFUSALS = (
    Refusal("`--engine vectorized-ray` with `--regroup-every` on three or more levels",
            "not yet: each worker holds whole regions, and a regrouping re-draws them; "
            "`--engine vectorized` runs it",
            ("--engine", "vectorized-ray", "--groups", "4,2", "--periods", "5,10,20",
             "--regroup-every", "1"), "engine vectorized-ray with three or more levels"),
)

def check_levels(cfg: RunConfig) -> None:
    """Refuse, in one line, what the sharded engine does not run with three or more
    levels: regrouping (it re-draws the edges' regions, and a worker holds whole regions;
    region servers refuse it too)."""
    if len(cfg.periods) > 2 and cfg.regroup_every > 0:
        raise ConfigError("engine vectorized-ray with three or more levels needs a fixed "
                          "grouping (no regroup_every): each worker holds whole regions")


def top_children(hierarchy: Hierarchy) -> tuple[np.ndarray, int, np.ndarray]:
    """What the workers are placed by (:meth:`RayShardExecutor.start`'s arguments): each
    client's edge (int64 [n]), the number E of edges, and each edge's child of the cloud
    (int64 [E]: itself with two levels, its region with three)."""
    num_edges = hierarchy.num_nodes(1)
    top = (np.arange(num_edges) if hierarchy.num_levels <= 2
           else hierarchy.edges_under(hierarchy.num_levels - 1))
    return hierarchy.edge_of_client().astype(np.int64), num_edges, top.astype(np.int64)


@dataclass
class RegionShard:
    """A worker's shard (:class:`~fedhier.engines.vectorized_ray.shard.ShardExecutor`)
    restricted to one subtree's clients, at ``positions`` (int64, increasing) of the shard:
    what :func:`run_shard_jobs` trains for the subtree's edges (its chunks are the shard's
    chunks, the same rows, draws and training)."""

    shard: Any
    positions: np.ndarray

    @property
    def clients(self) -> np.ndarray:
        return np.asarray(self.shard.clients[self.positions])

    @property
    def inner(self) -> Any:
        return self.shard.inner

    def chunk(self, positions: np.ndarray) -> Any:
        return self.shard.chunk(self.positions[positions])

    def keep_chunk_state(self, positions: np.ndarray, chunk: Any) -> None:
        self.shard.keep_chunk_state(self.positions[positions], chunk)

    def train(self, work: EdgeRoundWork, edge_models: Params) -> TrainResult:
        return self.shard.train(work, edge_models)  # type: ignore[no-any-return]

    def model_bytes(self, params: Params) -> int:
        return self.shard.model_bytes(params)  # type: ignore[no-any-return]


@dataclass
class SubtreeExecutor:
    """The executor of a node above the edges in a worker: its children's jobs
    (:meth:`run_edge_jobs`) run in process, the edges' through the shard's batched
    machinery; the rest as the shard (``shard``)."""

    settings: HSGDSettings
    shard: Any

    def run_edge_jobs(self, jobs: list[ServerJob]) -> list[EdgeReport]:
        return run_jobs(self.settings, self.shard, jobs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shard, name)


def run_jobs(settings: HSGDSettings, shard: Any, jobs: Sequence[ServerJob]) -> list[EdgeReport]:
    """A worker's jobs of one exchange with the cloud (or with a node above in the worker):
    edges' jobs (level 1) batched over the shard's clients
    (:func:`~fedhier.engines.vectorized_ray.shard.run_shard_jobs`); a job of a node above,
    one after the other, each run as its server would run it (:func:`run_edge_job`) on the
    shard's clients of its subtree."""
    from fedhier.engines.vectorized_ray.shard import run_shard_jobs

    if not jobs:
        return []
    if all(job.level == 1 for job in jobs):
        edges = {job.edge for job in jobs}
        edge_of = np.asarray(jobs[0].edge_of_client, dtype=np.int64)
        mine = np.flatnonzero(np.isin(edge_of[shard.clients], list(edges)))
        part: Any = shard if len(mine) == len(shard.clients) else RegionShard(shard, mine)
        return run_shard_jobs(settings, part, jobs)
    reports = []
    for job in jobs:
        node_of_client = job_hierarchy(settings, job).ancestors(job.level)
        mine = np.flatnonzero(node_of_client[shard.clients] == job.edge)
        reports.append(run_edge_job(settings, SubtreeExecutor(settings,
                                                              RegionShard(shard, mine)), job))
    return reports
