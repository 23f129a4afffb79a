"""Moving clients between edge servers (mobility, regrouping) when edges are processes.

The cloud of a server tier (:class:`fedhier.edge_tier.EdgeTierHierarchicalSGD`) decides every
move: its membership (:mod:`fedhier.round.membership`) draws the moves from the seed as in
every other engine. An edge server's job spans several edge rounds, so the cloud cuts the
cloud round into **segments** at the edge rounds where a client moves
(:func:`run_segments`); between two segments:

1. each edge reports its own model (its level-1 aggregate, not aggregated at the cloud), the
   cloud keeps it as that edge's model;
2. every moved client is **re-attached** to its new edge (:class:`Reattacher`: on real
   processes its SuperNode restarts with the new edge's SuperLink address), and the cloud
   waits until it is online there;
3. the next segment's jobs start each edge from its own model and carry the **handoff**: a
   ``carry`` client starts from its old edge's model, which the job to its new edge carries
   (``EdgeJob.start_edge_of_client``, ``carried``); ``fresh``: the new edge's model.

An edge applies a job's handoff with :func:`apply_job_handoff` and runs with a static
membership (:func:`job_settings`): the job's client -> edge map is the one in force. Without
moves a cloud round is one segment, as before. Two levels only (edges under the cloud).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.errors import ConfigError
from fedhier.hsgd import HierarchicalSGD, HSGDSettings, Params
from fedhier.mobility import Mobility
from fedhier.round.membership import Handoff, Membership, RoundPace
from fedhier.topology import Hierarchy


class Reattacher(Protocol):
    """Connects clients to other edges: returns once each is online at its new edge."""

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        """``moves``: client -> its new edge; returns client -> seconds its re-attachment
        took (stop, start, online at the new edge)."""
        ...


# ------------------------------------------------------------------------ the edge's side
def job_settings(settings: HSGDSettings) -> HSGDSettings:
    """An edge's settings for a job: the membership is the cloud's (the job's map, its
    handoff), so the edge neither moves nor regroups clients itself."""
    if not settings.mobility.active and not settings.regroup_every:
        return settings
    return dataclasses.replace(settings, mobility=Mobility(handoff=settings.mobility.handoff),
                               regroup_every=0)


class JobHandoff:
    """A membership rule of an edge's job: the job's first edge round starts moved clients
    from the models ``start_edges`` (int64 [n]) names (a ``carry`` handoff)."""

    def __init__(self, first_round: int, start_edges: np.ndarray) -> None:
        self.first_round = first_round
        self.start_edges = np.asarray(start_edges, dtype=np.int64)

    def begin_cloud_round(self, cloud_round: int, hierarchy: Hierarchy, regroup: Any,
                          pace: RoundPace) -> tuple[Hierarchy, dict[str, Any]]:
        return hierarchy, {}

    def enter(self, edge_round: int, hierarchy: Hierarchy,
              pace: RoundPace) -> tuple[Hierarchy, Handoff | None]:
        if edge_round != self.first_round:
            return hierarchy, None
        return hierarchy, Handoff(self.start_edges.copy())

    def end_cloud_round(self, hierarchy: Hierarchy) -> dict[str, Any]:
        return {}


def apply_job_handoff(algorithm: HierarchicalSGD, job: Any) -> None:
    """Put a job's carried models (its moved clients' old edges' models) in the edge
    models and start those clients from them in the job's first edge round."""
    if job.start_edge_of_client is None:
        return
    edges = np.asarray(job.carried_edges, dtype=np.int64).tolist()
    for name, value in algorithm.edge_models.items():
        for row, edge in enumerate(edges):
            value[edge] = job.carried[name][row].to(value.device, value.dtype)
    first = job.first_round or algorithm.settings.edge_rounds_of(job.cloud_round).start
    algorithm.membership = Membership([JobHandoff(first, job.start_edge_of_client)])


# ------------------------------------------------------------------------ the cloud's side
@dataclasses.dataclass
class Segment:
    """Edge rounds ``rounds`` with one client -> edge map (``hierarchy``); ``handoff``:
    the moves at its first round (None: none)."""

    rounds: range
    hierarchy: Hierarchy
    handoff: Handoff | None


def segments(algorithm: HierarchicalSGD, rounds: range) -> list[Segment]:
    """The cloud round's edge rounds cut where the membership moves a client (the
    membership is entered at every edge round, so its record keys are the one-process
    run's); leaves the algorithm at the last map."""
    cuts: list[tuple[int, Hierarchy, Handoff | None]] = []
    for edge_round in rounds:
        algorithm.hierarchy, handoff = algorithm.membership.enter(
            edge_round, algorithm._hierarchy(), algorithm._pace())
        if edge_round == rounds.start or handoff is not None:
            cuts.append((edge_round, algorithm._hierarchy(), handoff))
    stops = [c[0] for c in cuts[1:]] + [rounds.stop]
    return [Segment(range(start, stop), tree, handoff)
            for (start, tree, handoff), stop in zip(cuts, stops, strict=True)]


class HandoffJobs:
    """The executor of one segment: each job to an edge carries the old edges' models of
    the clients that move there with a ``carry`` handoff."""

    def __init__(self, executor: Any, start_edges: np.ndarray | None, edge_models: Params,
                 edge_of_client: np.ndarray) -> None:
        self.executor = executor
        self.start_edges = start_edges
        self.edge_models = edge_models
        self.edge_of_client = edge_of_client

    def run_edge_jobs(self, jobs: list[Any]) -> list[Any]:
        if self.start_edges is not None:
            jobs = [self._with_handoff(job) for job in jobs]
        return self.executor.run_edge_jobs(jobs)  # type: ignore[no-any-return]

    def _with_handoff(self, job: Any) -> Any:
        assert self.start_edges is not None
        mine = self.edge_of_client == job.edge
        olds = np.unique(self.start_edges[mine & (self.start_edges != self.edge_of_client)])
        if not len(olds):
            return job
        index = torch.as_tensor(olds)
        carried = {k: v.index_select(0, index.to(v.device)).clone()
                   for k, v in self.edge_models.items()}
        return dataclasses.replace(job, start_edge_of_client=self.start_edges.copy(),
                                   carried=carried, carried_edges=olds)


def reattach(executor: Any, hierarchy: Hierarchy, edge_round: int, handoff: Handoff | None,
             model_bytes: int) -> list[dict[str, Any]]:
    """Re-attach every client that is not connected to its edge in ``hierarchy``; one
    record per client: edge round, client, from, to, seconds to re-attach, bytes its
    handoff moved (a ``carry`` model from its old edge, else 0)."""
    where = np.array(executor.edge_of_client, dtype=np.int64)  # a copy: reattach moves it
    target = hierarchy.edge_of_client()
    moved = np.flatnonzero(where != target)
    if not len(moved):
        return []
    if not hasattr(executor, "reattach"):
        raise ConfigError("clients move between edge servers but nothing re-attaches them "
                          "(fedhier deploy local --edges does)")
    t0 = time.perf_counter()
    seconds = executor.reattach({int(c): int(target[c]) for c in moved})
    wall = time.perf_counter() - t0
    carried = (np.zeros(len(target), dtype=bool) if handoff is None or
               handoff.start_edges is None else handoff.start_edges != target)
    return [{"edge_round": edge_round, "client": int(c), "from": int(where[c]),
             "to": int(target[c]), "seconds": round(float(seconds.get(int(c), wall)), 4),
             "bytes": model_bytes if carried[c] else 0} for c in moved]


def run_segments(algorithm: HierarchicalSGD, executor: Any, run_children: Callable[..., Any],
                 level: int, cloud_round: int,
                 rounds: range) -> tuple[Any, list[dict[str, Any]]]:
    """``run_children`` (:func:`fedhier.edge_tier.run_children`, passed in: that module
    imports this one) of the cloud over ``rounds``, cut into :func:`segments`; returns the
    last segment's outcome (its losses, failures and unreached servers those of the whole
    range) and the handoff records."""
    if not algorithm.membership.rules:
        return run_children(algorithm, executor, level, 0, cloud_round, rounds), []
    if level != 2:
        raise ConfigError("clients move between edge servers directly under the cloud only "
                          "(no --regions with mobility or regroup_every)")
    handoffs: list[dict[str, Any]] = []
    parts = []
    pieces = segments(algorithm, rounds)
    for part in pieces:
        algorithm.hierarchy = part.hierarchy
        handoffs += reattach(executor, part.hierarchy, part.rounds.start, part.handoff,
                             algorithm.model_bytes)
        start_edges = None if part.handoff is None else part.handoff.start_edges
        jobs = HandoffJobs(executor, start_edges, algorithm.edge_models,
                           part.hierarchy.edge_of_client())
        out = run_children(algorithm, jobs, level, 0, cloud_round, part.rounds)  # type: ignore[arg-type]
        if part.rounds.stop < rounds.stop and out.models is not None:
            index = torch.as_tensor(out.children)
            for k, v in algorithm.edge_models.items():  # each edge continues from its own
                v.index_copy_(0, index.to(v.device), out.models[k].to(v.device, v.dtype))
        parts.append(out)
    last = parts[-1]
    last.losses = np.concatenate([p.losses for p in parts])
    last.failed = sum(p.failed for p in parts)
    last.failed_edges = sum(p.failed_edges for p in parts)
    last.unreached = sorted({e for p in parts for e in p.unreached})
    return last, handoffs
