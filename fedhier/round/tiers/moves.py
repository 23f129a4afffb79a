"""Moving clients between edge servers (mobility, regrouping) when edges are processes.

The cloud of a server tier (:class:`fedhier.round.tiers.servers.ServerRounds`) decides every
move: its membership (:mod:`fedhier.round.membership`) draws the moves from the seed as in
every other engine. An edge server's job spans several edge rounds, so the cloud cuts the
cloud round into **segments** at the edge rounds where a client moves
(:func:`run_segments`); between two segments:

1. each edge reports its own model (its level-1 aggregate, not aggregated at the cloud), the
   cloud keeps it as that edge's model;
2. every moved client is **re-attached** to its new edge (:class:`Reattacher`: on real
   processes its SuperNode restarts with the new edge's SuperLink address), and the cloud
   waits until it is online there; with kept optimizer state (``--optimizer-state keep``)
   the cloud first takes the moved clients' state from their old edges
   (:func:`moved_states`): the restarted SuperNode starts the new edge's run without it;
3. the next segment's jobs start each edge from its own model and carry the **handoff**: a
   ``carry`` client starts from its old edge's model, which the job to its new edge carries
   (``ServerJob.start_edge_of_client``, ``carried``); ``fresh``: the new edge's model. Under
   both, the job to a moved client's new edge carries its kept state (``ServerJob.states``),
   which the edge restores to the client before it trains: as in every engine, a client's
   momentum is its own and travels with it.

An edge applies a job's handoff with :func:`apply_job_handoff` and runs with a static
membership (:func:`job_settings`): the job's client -> edge map is the one in force. Without
moves a cloud round is one segment, as before.

**Regions** (servers between the edges and the cloud; only clients move, an edge stays under
its region, so a move may cross regions). A segment is cut where a move is, whatever the
periods, so a node's job may start or end inside a period of its own level:

* a node splits its job into exchanges at its level's absolute period boundaries
  (:func:`exchanges`), aggregating at a boundary that is not its parent's (:func:`ends_period`),
  exactly where the one-process run aggregates at its level;
* a job that ends inside its parent's period answers with each of its edges' models
  (``EdgeReport.edge_models``: the simulation aggregates nothing there), which the parent
  writes into its edge models (:func:`absorb_reports`); a job that starts inside its node's
  period carries those models back (``carried``, :func:`with_own_edges`);
* a region passes its job's ``carry`` handoff and moved clients' kept state on to the jobs
  of its edges' first exchange (:class:`HandoffJobs` with ``first_round``); the moved
  client's old edge may sit in another region: its model travels in the job (``carried``).

A region's aggregate at a period's end is then the simulation's: the weighted mean of the
survivors its edges hold under the map in force in that edge round. A regrouping re-draws the
tree above the edges too, which fixed region servers cannot follow
(:func:`fedhier.settings.checks.check_edge_servers` refuses it with regions), and a rule that
measures from a region's own model (``needs_reference``) is refused there too: a job that
starts inside the cloud round does not carry the region's last aggregate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.round.loop import HierarchicalSGD, HSGDSettings, Params
from fedhier.round.membership import Handoff, Membership, RoundPace
from fedhier.tree.hierarchy import Hierarchy
from fedhier.tree.mobility import Mobility

#: Clients' kept optimizer state: client -> record name -> tensor name -> tensor.
ClientStates = dict[int, dict[str, dict[str, torch.Tensor]]]


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
    """Put a job's carried models (its moved clients' old edges' models; a region's job
    that starts inside its period: its own edges' models) in the edge models and start the
    moved clients from them in the job's first edge round."""
    edges = np.asarray(job.carried_edges, dtype=np.int64).tolist()
    for name, value in algorithm.edge_models.items():
        for row, edge in enumerate(edges):
            value[edge] = job.carried[name][row].to(value.device, value.dtype)
    if job.start_edge_of_client is None:
        return
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
    """The executor of one segment: each job to a server (an edge, a region, ...) carries
    the old edges' models of the clients that move under it with a ``carry`` handoff, and
    the kept state (``states``: client -> records, :func:`moved_states`) of the clients that
    moved under it. ``first_round``: only the jobs that start at that edge round (a
    region's first exchange of its job; None: every job, the cloud's one exchange per
    segment)."""

    def __init__(self, executor: Any, start_edges: np.ndarray | None, edge_models: Params,
                 edge_of_client: np.ndarray, first_round: int | None = None,
                 states: ClientStates | None = None) -> None:
        self.executor = executor
        self.start_edges = start_edges
        self.edge_models = edge_models
        self.edge_of_client = edge_of_client
        self.first_round = first_round
        self.states = states or {}

    def run_edge_jobs(self, jobs: list[Any]) -> list[Any]:
        jobs = [self._with_moves(job) if self.first_round in (None, job.first_round)
                else job for job in jobs]
        return self.executor.run_edge_jobs(jobs)  # type: ignore[no-any-return]

    def _with_moves(self, job: Any) -> Any:
        node_of_client = self.edge_of_client
        for parent in job.parents[:job.level - 1]:  # a region's job: its clients
            node_of_client = np.asarray(parent)[node_of_client]
        mine = node_of_client == job.edge
        states = {c: s for c, s in self.states.items() if mine[c]}
        if states:
            job = dataclasses.replace(job, states=states)
        if self.start_edges is None:
            return job
        olds = np.unique(self.start_edges[mine & (self.start_edges != self.edge_of_client)])
        if not len(olds):
            return job
        return with_carried(job, self.edge_models, olds,
                            start_edge_of_client=self.start_edges.copy())


def with_carried(job: Any, edge_models: Params, edges: np.ndarray, **changes: Any) -> Any:
    """``job`` (an :class:`fedhier.round.tiers.jobs.ServerJob`) also carrying the models of
    ``edges`` (int64) from ``edge_models`` (name -> [E, *shape]); the ones it carries
    already stay; ``changes``: other fields replaced."""
    have = np.asarray(job.carried_edges, dtype=np.int64)
    union = np.union1d(have, np.asarray(edges, dtype=np.int64))
    carried = {}
    for name, value in edge_models.items():
        rows = [job.carried[name][int(np.flatnonzero(have == e)[0])] if e in have
                else value[e].clone() for e in union.tolist()]
        carried[name] = torch.stack([r.to(value.device, value.dtype) for r in rows])
    return dataclasses.replace(job, carried=carried, carried_edges=union, **changes)


# ------------------------------------------------------------------------ any node's side
def ends_period(settings: HSGDSettings, level: int, edge_round: int) -> bool:
    """Whether edge round ``edge_round`` (1-based; 0: before the first) ends a period of
    ``level`` (1: edges, ..., L: the cloud; above the cloud: always)."""
    periods = settings.periods
    return level > len(periods) or edge_round * settings.local_period % periods[level - 1] == 0


def exchanges(settings: HSGDSettings, level: int, rounds: range) -> list[range]:
    """The edge rounds ``rounds`` of a level-``level`` node's job cut at its level's period
    boundaries (absolute: a segment may start or end inside a period)."""
    span = settings.periods[level - 1] // settings.local_period
    out, start = [], rounds.start
    while start < rounds.stop:
        stop = min((start - 1) // span * span + span + 1, rounds.stop)
        out.append(range(start, stop))
        start = stop
    return out


def with_own_edges(algorithm: HierarchicalSGD, job: Any, under: np.ndarray) -> Any:
    """A child server's job that starts inside the child's period (a segment): it carries
    the models of the child's edges (``under``: each edge's child-level ancestor), which
    differ there. An edge's job (its model is ``params``) or one at a period start: as is."""
    if job.level < 2 or ends_period(algorithm.settings, job.level, job.first_round - 1):
        return job
    return with_carried(job, algorithm.edge_models, np.flatnonzero(under == job.edge))


def absorb_reports(algorithm: HierarchicalSGD, reports: list[Any], under: np.ndarray) -> None:
    """A node's exchange that ended inside its period (a segment's end): each reached
    child's edges continue from their own models (``EdgeReport.edge_models``, or an edge's
    ``model``), written into the node's edge models (``under``: each edge's child)."""
    for report in reports:
        if not report.reached:
            continue
        if len(report.edges):
            # a copy: the edges of a reply come in a read-only buffer
            index = torch.as_tensor(np.array(report.edges, dtype=np.int64))
            for k, v in algorithm.edge_models.items():
                v.index_copy_(0, index.to(v.device), report.edge_models[k].to(v.device, v.dtype))
        elif report.model is not None:
            for k, v in algorithm.edge_models.items():
                v[torch.as_tensor(under == report.edge, device=v.device)] = \
                    report.model[k].to(v.device, v.dtype)


def moved_states(executor: Any, clients: list[int]) -> ClientStates:
    """The kept optimizer state of ``clients`` (client -> record -> tensor name -> tensor),
    asked of the servers they are connected to now (``query.state``, filtered), before
    they re-attach: a SuperNode restarted at another edge's SuperLink starts that edge's
    run without it. {} when the clients keep none (nothing asked)."""
    if not clients or not getattr(executor, "keeps_client_state", False):
        return {}
    return executor.client_state(clients)  # type: ignore[no-any-return]


def state_bytes(records: dict[str, dict[str, torch.Tensor]]) -> int:
    """Bytes of one client's kept state (its tensors' data)."""
    return sum(int(t.numel() * t.element_size()) for r in records.values() for t in r.values())


def reattach(executor: Any, hierarchy: Hierarchy, edge_round: int, handoff: Handoff | None,
             model_bytes: int) -> tuple[list[dict[str, Any]], ClientStates]:
    """Re-attach every client that is not connected to its edge in ``hierarchy``, with its
    kept state taken from its old edge first (:func:`moved_states`: the new edge's job
    brings it back, as in every engine a client's momentum travels with it); one record per
    client: edge round, client, from, to, seconds to re-attach, bytes its handoff moved (a
    ``carry`` model from its old edge, else 0), with kept state ``state_bytes`` (its
    state's tensors), and ``failed`` (why) for a client the deployment could not
    re-attach; and the moved clients' states."""
    where = np.array(executor.edge_of_client, dtype=np.int64)  # a copy: reattach moves it
    target = hierarchy.edge_of_client()
    moved = np.flatnonzero(where != target)
    if not len(moved):
        return [], {}
    if not hasattr(executor, "reattach"):
        raise ConfigError("clients move between edge servers but nothing re-attaches them "
                          "(fedhier deploy local --edges does)")
    states = moved_states(executor, moved.tolist())
    t0 = time.perf_counter()
    seconds = executor.reattach({int(c): int(target[c]) for c in moved})
    wall = time.perf_counter() - t0
    failed = getattr(executor, "unattached", {})  # client -> why (after the driver's retries)
    carried = (np.zeros(len(target), dtype=bool) if handoff is None or
               handoff.start_edges is None else handoff.start_edges != target)
    keeps = getattr(executor, "keeps_client_state", False)
    records = []
    for c in moved.tolist():
        record: dict[str, Any] = {
            "edge_round": edge_round, "client": c, "from": int(where[c]),
            "to": int(target[c]), "seconds": round(float(seconds.get(c, wall)), 4),
            "bytes": model_bytes if carried[c] else 0}
        if keeps:
            record["state_bytes"] = state_bytes(states.get(c, {}))
        if c in failed:  # not online at its new edge: it fails that edge's rounds
            record["failed"] = failed[c]
        records.append(record)
    return records, states


def run_segments(algorithm: HierarchicalSGD, executor: Any, run_children: Callable[..., Any],
                 level: int, cloud_round: int,
                 rounds: range) -> tuple[Any, list[dict[str, Any]]]:
    """``run_children`` (:func:`fedhier.round.tiers.jobs.run_children`, passed in: that module
    imports this one) of the cloud over ``rounds``, cut into :func:`segments`; returns the
    last segment's outcome (its losses, failures and unreached servers those of the whole
    range) and the handoff records."""
    if not algorithm.membership.rules:
        return run_children(algorithm, executor, level, 0, cloud_round, rounds), []
    handoffs: list[dict[str, Any]] = []
    parts = []
    pieces = segments(algorithm, rounds)
    for part in pieces:
        algorithm.hierarchy = part.hierarchy
        records, states = reattach(executor, part.hierarchy, part.rounds.start,
                                   part.handoff, algorithm.model_bytes)
        handoffs += records
        start_edges = None if part.handoff is None else part.handoff.start_edges
        jobs = HandoffJobs(executor, start_edges, algorithm.edge_models,
                           part.hierarchy.edge_of_client(), states=states)
        # a segment that ends inside the cloud round leaves each edge at its own model
        # (run_children writes it into the edge models: absorb_reports)
        parts.append(run_children(algorithm, jobs, level, 0, cloud_round, part.rounds))
    last = parts[-1]
    last.losses = np.concatenate([p.losses for p in parts])
    last.failed = sum(p.failed for p in parts)
    last.failed_edges = sum(p.failed_edges for p in parts)
    last.unreached = sorted({e for p in parts for e in p.unreached})
    return last, handoffs
