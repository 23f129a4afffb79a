"""A shard's segment of a cloud round (engine ``vectorized-ray``), run as an edge server
runs its job.

With moving clients the cloud cuts a cloud round into segments
(:func:`fedhier.round.tiers.moves.run_segments`; the moves themselves:
:mod:`fedhier.engines.vectorized_ray.moves`). A shard runs a segment's jobs: each edge from
its job's model, a job's handoff applied with :func:`fedhier.round.tiers.moves.apply_job_handoff`
(:func:`start_shard_jobs`); a segment that ends inside the cloud round answers with each
edge's model (:func:`segment_models`), as :func:`fedhier.round.tiers.jobs.run_edge_job` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedhier.engines.vectorized.chunks import train_edge_chunks
from fedhier.round.loop import HierarchicalSGD, HSGDSettings, Params
from fedhier.round.tiers.jobs import (
    EdgeRunOutcome,
    ServerJob,
    edge_aggregates,
    job_rounds,
    start_job,
    train_edges,
)
from fedhier.round.tiers.moves import apply_job_handoff, ends_period


def start_shard_jobs(settings: HSGDSettings, executor: Any,
                     jobs: Sequence[ServerJob]) -> HierarchicalSGD:
    """A shard's round for its edges' ``jobs`` (one segment): :func:`start_job` on the first,
    then every edge from its own job's model (inside a cloud round the edges' models
    differ) and every job's handoff applied as an edge server applies it."""
    algorithm = start_job(settings, executor, jobs[0])
    for job in jobs[1:]:
        if job.params is not jobs[0].params:
            for name, value in algorithm.edge_models.items():
                value[job.edge] = job.params[name].to(value.device, value.dtype)
    for job in jobs[1:]:
        apply_job_handoff(algorithm, job)
    return algorithm


def shard_chunk_size(algorithm: HierarchicalSGD, executor: Any, jobs: Sequence[ServerJob],
                     size: int) -> int:
    """The clients per run of whole edges for a segment: ``size``, or all the shard's when
    a ``carry`` client of the shard starts from the model of an edge the shard trains too
    (a run trains its edges through the whole segment, so a later run would find that edge's
    model already moved on)."""
    starts = [job.start_edge_of_client for job in jobs if job.start_edge_of_client is not None]
    if not starts or not len(executor.clients):
        return size
    edge_of = algorithm._hierarchy().edge_of_client()
    start = starts[0][executor.clients]
    mine = edge_of[executor.clients]
    olds = np.unique(start[start != mine])
    return max(size, len(executor.clients)) if np.isin(olds, mine).any() else size


def train_shard(settings: HSGDSettings, algorithm: HierarchicalSGD, executor: Any,
                jobs: Sequence[ServerJob], size: int) -> tuple[EdgeRunOutcome, dict[int, Params]]:
    """A shard's edge rounds of one segment (:func:`train_edge_chunks`'s answer: the
    outcome and each edge's aggregate). In runs of whole edges of ``size`` clients, each run
    planned ahead; with per-edge periods, whose plan of an edge round depends on the one
    before (the clients' carried models), the edge rounds of all the shard's clients one
    after the other as an edge server runs them (:func:`fedhier.round.tiers.jobs.train_edges`)."""
    rounds = job_rounds(settings, jobs[0])
    if not settings.edge_periods:
        return train_edge_chunks(algorithm, executor, rounds,
                                 shard_chunk_size(algorithm, executor, jobs, size))
    edges = np.array(sorted(job.edge for job in jobs), dtype=np.int64)
    outcome = train_edges(algorithm, executor, edges, jobs[0].cloud_round, rounds,
                          held_from=2)
    averaged = edge_aggregates(algorithm, outcome.held)
    models = {} if averaged is None else {
        int(edge): {k: v[i].clone() for k, v in averaged[0].items()}
        for i, edge in enumerate(averaged[1].tolist())}
    return dataclasses.replace(outcome, held=None), models


def segment_models(settings: HSGDSettings, algorithm: HierarchicalSGD,
                   jobs: Sequence[ServerJob], models: dict[int, Params]) -> dict[int, Params]:
    """Each edge's answer: its aggregate of the last round's survivors (``models``) when the
    segment ends at the cloud, else its own model (it aggregated at the edge), as
    :func:`fedhier.round.tiers.jobs.run_edge_job` answers."""
    if ends_period(settings, 2, job_rounds(settings, jobs[0]).stop - 1):
        return models
    return {job.edge: {k: v[job.edge].clone() for k, v in algorithm.edge_models.items()}
            for job in jobs}
