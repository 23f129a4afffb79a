"""Asynchronous, buffered edges: the cloud aggregates the first K edge reports.

Each edge runs *jobs*: from the global model of some version v (the number of cloud
aggregations so far), its clients do the G / I edge rounds of a cloud round (edge
aggregation every I steps, with the edge round and step numbers of cloud round v + 1, so
mini-batches, participation, stragglers and faults are those of that round), and the edge
then uploads its clients' last models to the cloud. On the simulated clock
(:mod:`fedhier.sim_clock`) edges finish at different times; uploads queue on the cloud's
link; the cloud aggregates as soon as K reports have arrived, and sends the new model back
to those K edges, which start their next job from it. The others keep going.

A report that arrives s aggregations after its job's version is *stale* by s: over S
(``max_staleness``) it is dropped and its edge restarts from the current model; otherwise its
clients' weights are multiplied by ``staleness_weight(s)`` (1/sqrt(1+s)) and it enters the
aggregate as an update relative to the model its job started from:

    w_new = sum_j a_j x_j / sum_j a_j  +  sum_e A_e (w - w_base(e)) / sum_e A_e,

a_j the client weights (presence weights x staleness factor), A_e their sum over edge e,
w the current global model and w_base(e) the model edge e's job started from; the second
term is zero for fresh reports, so with K = N (every report fresh) this is exactly the
synchronous round of :class:`fedhier.hsgd.HierarchicalSGD`, bit for bit.

Jobs train when they start (their result depends only on their start model and their round
numbers), so executors run them as ordinary edge rounds restricted to the starting edges'
clients. Two-level hierarchies, static groupings and the plain average only (checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedhier.aggregate import presence_weights
from fedhier.edge_tier import train_edges
from fedhier.errors import ConfigError
from fedhier.grouping import ClientInfo
from fedhier.hsgd import (
    CloudStep,
    Executor,
    HierarchicalSGD,
    HSGDSettings,
    Params,
    aggregate_levels,
)
from fedhier.staleness import staleness_weight
from fedhier.topology import Hierarchy


@dataclass
class EdgeJob:
    """An edge's G local steps from the global model of ``version``.

    Attributes:
        edge: the edge; version: cloud aggregations before its start model;
        base: that start model (name -> [*shape]); finish: simulated second its training ends;
        models: its clients' last models that survived (name -> [s, *shape]; None: none did);
        survivors: int64 [s], those clients, sorted.
    """

    edge: int
    version: int
    base: Params
    finish: float
    models: Params | None
    survivors: np.ndarray


class AsyncHierarchicalSGD(HierarchicalSGD):
    """H-SGD whose cloud aggregates the first K edge reports (see the module docstring)."""

    def __init__(self, settings: HSGDSettings, cloud_step: CloudStep | None = None) -> None:
        if cloud_step is not None:
            raise ConfigError("asynchronous edges use the staleness-weighted average at the "
                              "cloud; choose cloud_strategy 'average'")
        super().__init__(settings, cloud_step)
        self.version = 0  # cloud aggregations so far
        self.jobs: dict[int, EdgeJob] = {}  # edge -> its job in flight
        self.idle: dict[int, float] = {}  # edge -> simulated second it got the global model
        self.link_free = -math.inf  # the cloud link is busy uploading until then
        self.now = 0.0  # simulated second of the last cloud aggregation's broadcast
        self._restored_edge_models: Params | None = None  # from a checkpoint

    # ---------------------------------------------------------------- one cloud round
    def cloud_round(self, executor: Executor, cloud_round: int) -> dict[str, Any]:
        """Wait for K fresh-enough reports, aggregate them; returns the training keys."""
        s = self.settings
        clock = self._clock()
        stats: dict[str, Any] = {"losses": [], "failed_clients": 0, "failed_edges": 0}
        accepted: list[tuple[EdgeJob, int]] = []
        dropped = 0
        arrival = self.now
        while len(accepted) < s.asynchronous.buffer:
            if self.idle:
                self._start_jobs(executor, stats)
            job = self.jobs.pop(min(self.jobs, key=lambda e: (self.jobs[e].finish, e)))
            arrivals, self.link_free = clock.upload_queue(np.array([job.finish]),
                                                          self.link_free, self.model_bytes)
            arrival = float(arrivals[0])
            self.communication.add_edge_cloud(1, self.model_bytes)
            staleness = self.version - job.version
            if staleness > s.asynchronous.max_staleness:  # too old: the edge starts over
                dropped += 1
                self.idle[job.edge] = arrival + float(clock.model.transfer_seconds(
                    "edge-cloud", 1, self.model_bytes))
                self.communication.add_edge_cloud(1, self.model_bytes)
                continue
            accepted.append((job, staleness))
        self._aggregate(accepted)
        self.now = arrival + float(clock.model.transfer_seconds("edge-cloud", len(accepted),
                                                                self.model_bytes))
        self.communication.add_edge_cloud(len(accepted), self.model_bytes)
        for job, _ in accepted:
            self.idle[job.edge] = self.now
        self.version += 1
        losses = stats["losses"]
        return {"local_train_loss": float(np.mean(losses)) if losses else None,
                "failed_clients": stats["failed_clients"],
                "failed_edges": stats["failed_edges"],
                "async_reports": [[job.edge, staleness] for job, staleness in accepted],
                "stale_dropped": dropped}

    def _start_jobs(self, executor: Executor, stats: dict[str, Any]) -> None:
        """Train the jobs of every idle edge from the current global model: the G / I edge
        rounds of cloud round ``version + 1``, restricted to those edges' clients."""
        hierarchy, clock = self._hierarchy(), self._clock()
        edges = np.array(sorted(self.idle), dtype=np.int64)
        for edge in edges.tolist():
            clock.edge_time[edge] = self.idle[edge]
            for key, value in self.edge_models.items():
                value[edge] = self.global_params[key]
        self.idle = {}
        edge_of = hierarchy.edge_of_client()
        outcome = train_edges(self, executor, edges, self.version + 1)
        stats["failed_clients"] += outcome.failed_clients
        stats["failed_edges"] += outcome.failed_edges
        stats["losses"].extend(outcome.losses[outcome.losses[:, 1] > 0, 0].tolist())
        held = outcome.held
        for edge in edges.tolist():
            models, survivors = None, np.zeros(0, dtype=np.int64)
            if held is not None:
                rows = np.flatnonzero(edge_of[held[1]] == edge)
                if len(rows):
                    index = torch.as_tensor(rows, device=next(iter(held[0].values())).device)
                    models = {k: v.index_select(0, index) for k, v in held[0].items()}
                    survivors = held[1][rows]
            self.jobs[edge] = EdgeJob(edge, self.version, dict(self.global_params),
                                      float(clock.edge_time[edge]), models, survivors)

    def _aggregate(self, accepted: list[tuple[EdgeJob, int]]) -> None:
        """The new global model from the accepted reports (the module docstring's rule)."""
        reports = [(job, staleness) for job, staleness in accepted if job.models is not None]
        if not reports:
            return  # nothing survived: the global model stays
        hierarchy = self._hierarchy()
        survivors = np.concatenate([job.survivors for job, _ in reports])
        order = np.argsort(survivors, kind="stable")
        survivors = survivors[order]
        keys = list(self.global_params)
        device = next(iter(self.global_params.values())).device
        index = torch.as_tensor(order, device=device)
        models = {k: torch.cat([job.models[k] for job, _ in reports  # type: ignore[index]
                                ]).index_select(0, index) for k in keys}
        present = np.zeros(hierarchy.num_clients, dtype=bool)
        present[survivors] = True
        edge_of = hierarchy.edge_of_client()
        factor = np.ones(hierarchy.num_clients)
        for job, staleness in reports:
            factor[job.survivors] = staleness_weight(staleness)
        weights = presence_weights(self.weights, present, edge_of) * factor
        averaged, _ = aggregate_levels(models, survivors, weights, hierarchy,
                                       hierarchy.num_levels, self.settings.aggregators,
                                       self.node_models)
        new = {k: v[0] for k, v in averaged.items()}
        stale = [(job, float(weights[job.survivors].sum())) for job, s in reports if s > 0]
        if stale:  # stale reports enter as updates relative to their own start model
            total = float(weights[survivors].sum())
            for key in keys:
                correction = sum(mass * (self.global_params[key] - job.base[key])
                                 for job, mass in stale)
                new[key] = new[key] + correction / total
        self.global_params = new

    # ---------------------------------------------------------------- time and checkpoints
    def elapsed_seconds(self) -> float:
        """The simulated second the last cloud aggregation reached its edges."""
        return self.now

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["async"] = {"version": self.version, "jobs": list(self.jobs.values()),
                          "idle": dict(self.idle), "link_free": self.link_free,
                          "now": self.now, "edge_models": dict(self.edge_models)}
        return state

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        saved = state.get("async")
        if saved is None:
            raise ConfigError("this checkpoint was written by a synchronous run; resume it "
                              "without async_buffer")
        self.version = saved["version"]
        self.jobs = {job.edge: job for job in saved["jobs"]}
        self.idle = dict(saved["idle"])
        self.link_free = saved["link_free"]
        self.now = saved["now"]
        self._restored_edge_models = saved["edge_models"]

    def setup(self, executor: Executor, initial: Params, *, info: ClientInfo | None = None,
              hierarchy: Hierarchy | None = None) -> None:
        """As synchronous H-SGD; a fresh run then has every edge idle at second 0 with the
        initial model, a resumed one its checkpointed edges."""
        super().setup(executor, initial, info=info, hierarchy=hierarchy)
        restored = self._restored_edge_models
        if restored is not None:
            device = next(iter(initial.values())).device
            self.edge_models = {k: v.to(device) for k, v in restored.items()}
            return
        edges = self._hierarchy().num_nodes(1)
        self.idle = dict.fromkeys(range(edges), 0.0)
        self.edge_models = {k: v.unsqueeze(0).repeat(edges, *([1] * v.dim()))
                            for k, v in self.global_params.items()}


def algorithm_for(settings: HSGDSettings,
                  cloud_step: CloudStep | None = None) -> HierarchicalSGD:
    """The round the settings ask for: synchronous H-SGD, or with asynchronous edges."""
    if settings.asynchronous.active:
        return AsyncHierarchicalSGD(settings, cloud_step)
    return HierarchicalSGD(settings, cloud_step)
