"""Schedule: when each node aggregates, and who trains for how many steps until then.

One part of the round (docs/index.md, "The round as parts"). Per edge round the loop asks
the run's :class:`Schedule` who trains (:meth:`~Schedule.plan`: partial participation and
stragglers through :func:`fedhier.round.participants.plan_edge_round`), from which models
(:meth:`~Schedule.start_models`), at which level each edge aggregates after it
(:meth:`~Schedule.levels`: :func:`fedhier.tree.hierarchy.edge_levels_after`, the one schedule of
every engine), which of the returned models aggregate now (:meth:`~Schedule.settle`,
which also charges the round to the simulated clock and says how many models went down),
and when a client's update is complete for FedNova's scaling (:meth:`~Schedule.scale`:
every edge round, or when the client's edge aggregates).

* :class:`EqualPeriods`: every edge aggregates every I steps (H-SGD);
* :class:`EdgePeriods`: edge i every I_i steps (docs/hsgd.md#per-edge-periods); an edge round
  is then g = gcd(I_i) steps, each edge plans at the start of its own period, and the clients
  of edges that do not aggregate continue from their own (carried) models; FedNova scales a
  client's whole update over its period, w_start + s_j (w_end - w_start), when its edge
  aggregates (w_start: the model it started the period from, kept per client).

Buffered asynchronous reports are a schedule of the level above the edges
(:mod:`fedhier.round.asynchrony.edges`). A new schedule is one class here and one line of
:data:`SCHEDULES`. A schedule's state lives within a cloud round (nothing to checkpoint at its
boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.round.clock import SimClock
from fedhier.round.executor import EdgeRoundWork, Params, device_of
from fedhier.round.participants import EdgeRoundPlan, plan_edge_round
from fedhier.round.updates import scale_rows, scale_updates
from fedhier.tree.hierarchy import Hierarchy, edge_levels_after


class Schedule(Protocol):
    """When nodes aggregate (see the module docstring)."""

    def begin_cloud_round(self, num_clients: int, num_edges: int) -> None:
        """A cloud round starts: every edge holds the global model."""
        ...

    def plan(self, hierarchy: Hierarchy, weights: np.ndarray, edge_round: int,
             start_edges: np.ndarray | None,
             ) -> tuple[EdgeRoundPlan, np.ndarray | None, np.ndarray | None]:
        """Edge round ``edge_round``'s plan (steps int64 [n], FedNova scale float64 [n]), the
        start rows (int64 [n] or None, :attr:`EdgeRoundWork.start_edge_of_client`) and the
        carried clients (int64 [c] or None, :attr:`EdgeRoundWork.carried`)."""
        ...

    def forget(self, clients: np.ndarray) -> None:
        """``clients`` (int64) drop any model of their own (a fresh handoff)."""
        ...

    def start_models(self, work: EdgeRoundWork, edge_models: Params) -> Params:
        """name -> [E + c, *shape]: the models ``work``'s clients start from."""
        ...

    def levels(self, edge_round: int, num_edges: int) -> np.ndarray:
        """int64 [E]: the level each edge aggregates at after ``edge_round`` (0 = not)."""
        ...

    def scale(self, models: Params, work: EdgeRoundWork, scale: np.ndarray,
              edge_models: Params) -> None:
        """FedNova on the returned models (name -> [k, *shape], ``work.clients``' order;
        ``scale`` float64 [k], the plan's s_j), in place, where the updates are complete now
        (a schedule that scales later, in :meth:`settle`, leaves them)."""
        ...

    def settle(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               failed: np.ndarray, levels: np.ndarray, clock: SimClock, model_bytes: int,
               ) -> tuple[Params, np.ndarray, int]:
        """The models (name -> [m, *shape]) and clients (int64 [m]) that aggregate now, from
        the survivors' ``models`` ([s, *shape], ``survivors`` int64 [s]; ``failed`` int64:
        the sent clients that failed), and how many models went down to clients; the edge
        round is charged to ``clock``."""
        ...

    def end_cloud_round(self) -> dict[str, Any]:
        """The record keys of the cloud round's schedule ({} when it records none)."""
        ...


class EqualPeriods:
    """Every edge aggregates every I = P_1 steps, the higher levels every P_l."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def begin_cloud_round(self, num_clients: int, num_edges: int) -> None:
        return None

    def plan(self, hierarchy: Hierarchy, weights: np.ndarray, edge_round: int,
             start_edges: np.ndarray | None,
             ) -> tuple[EdgeRoundPlan, np.ndarray | None, np.ndarray | None]:
        s = self.settings
        return plan_edge_round(hierarchy, s.workload, weights, s.seed, edge_round), \
            start_edges, None

    def forget(self, clients: np.ndarray) -> None:
        return None

    def start_models(self, work: EdgeRoundWork, edge_models: Params) -> Params:
        return edge_models

    def levels(self, edge_round: int, num_edges: int) -> np.ndarray:
        s = self.settings
        return edge_levels_after(edge_round * s.local_period - 1, s.periods, s.edge_periods,
                                 num_edges)

    def scale(self, models: Params, work: EdgeRoundWork, scale: np.ndarray,
              edge_models: Params) -> None:
        """Every edge round ends a period: w_start is the edge model each client started
        from (:func:`scale_updates`)."""
        scale_updates(models, work, scale, edge_models)

    def settle(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               failed: np.ndarray, levels: np.ndarray, clock: SimClock, model_bytes: int,
               ) -> tuple[Params, np.ndarray, int]:
        clock.edge_round(work.clients, work.steps, work.edge_of_client, model_bytes)
        return models, survivors, len(work.clients)

    def end_cloud_round(self) -> dict[str, Any]:
        return {}


class EdgePeriods(EqualPeriods):
    """Edge i aggregates every I_i steps (``settings.edge_periods``); see the module
    docstring."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        # Each client's planned steps left in its edge's period (int64 [n]), its FedNova
        # scale (float64 [n]), its model not yet aggregated (name -> [n, *shape], valid where
        # has_carry, bool [n]) and each edge's aggregations this cloud round (int64 [E]).
        # FedNova only: which clients' plans start this edge round (bool [n]) and the model
        # each client started its planned work from (w_start, name -> [n, *shape]).
        self.remaining = np.zeros(0, dtype=np.int64)
        self.factor = np.ones(0, dtype=np.float64)
        self.carried: Params = {}
        self.has_carry = np.zeros(0, dtype=bool)
        self.aggregations = np.zeros(0, dtype=np.int64)
        self.plan_starts = np.zeros(0, dtype=bool)
        self.starts: Params = {}

    def begin_cloud_round(self, num_clients: int, num_edges: int) -> None:
        self.remaining = np.zeros(num_clients, dtype=np.int64)
        self.factor = np.ones(num_clients, dtype=np.float64)
        self.has_carry = np.zeros(num_clients, dtype=bool)
        self.aggregations = np.zeros(num_edges, dtype=np.int64)

    def plan(self, hierarchy: Hierarchy, weights: np.ndarray, edge_round: int,
             start_edges: np.ndarray | None,
             ) -> tuple[EdgeRoundPlan, np.ndarray | None, np.ndarray | None]:
        """The edges whose period starts with ``edge_round`` plan their whole period
        (:func:`plan_edge_round`); every client then does up to g of its remaining planned
        steps, from its carried model when it has one."""
        s = self.settings
        start_step = (edge_round - 1) * s.local_period
        periods = np.asarray(s.edge_periods, dtype=np.int64)
        starting = np.flatnonzero(start_step % periods == 0)
        self.plan_starts = np.zeros(hierarchy.num_clients, dtype=bool)
        if len(starting):
            period_plan = plan_edge_round(hierarchy, s.workload, weights, s.seed,
                                          edge_round, starting, s.edge_periods)
            planned = np.isin(hierarchy.edge_of_client(), starting)
            self.remaining[planned] = period_plan.steps[planned]
            self.factor[planned] = period_plan.scale[planned]
            self.plan_starts[planned] = period_plan.steps[planned] > 0
        steps = np.minimum(self.remaining, s.local_period)
        self.remaining -= steps
        carried = np.flatnonzero(self.has_carry & (steps > 0))
        if not len(carried):
            return EdgeRoundPlan(steps=steps, scale=self.factor.copy()), start_edges, None
        rows = hierarchy.edge_of_client() if start_edges is None else start_edges.copy()
        rows[carried] = hierarchy.num_nodes(1) + np.arange(len(carried))
        return EdgeRoundPlan(steps=steps, scale=self.factor.copy()), rows, carried

    def forget(self, clients: np.ndarray) -> None:
        if len(self.has_carry):
            self.has_carry[clients] = False

    def restart(self, members: np.ndarray, edges: np.ndarray, num_clients: int,
                num_edges: int) -> None:
        """Asynchronous edges: the clients ``members`` (bool [n]) of the starting ``edges``
        begin a cloud period (no planned steps left, no carried model, no edge aggregation
        counted yet: what :meth:`begin_cloud_round` does for every client and edge)."""
        if len(self.remaining) != num_clients:
            self.remaining = np.zeros(num_clients, dtype=np.int64)
            self.factor = np.ones(num_clients, dtype=np.float64)
            self.has_carry = np.zeros(num_clients, dtype=bool)
        if len(self.aggregations) != num_edges:
            self.aggregations = np.zeros(num_edges, dtype=np.int64)
        self.remaining[members] = 0
        self.factor[members] = 1.0
        self.has_carry[members] = False
        self.aggregations[edges] = 0

    def start_models(self, work: EdgeRoundWork, edge_models: Params) -> Params:
        """The E edges' models, then the c carried client models (rows E..E+c-1).

        With FedNova each sent client's start row is kept as its w_start when its work
        starts over from it: its plan starts now, or it starts from an edge's model (after a
        failure, a ``fresh`` move or a ``carry`` move without a model of its own); a client
        that continues its plan from its carried model keeps the w_start it had.
        """
        starts = edge_models
        if work.carried is not None:
            index = torch.as_tensor(work.carried, device=device_of(self.carried))
            starts = {k: torch.cat([v, self.carried[k].index_select(0, index)])
                      for k, v in edge_models.items()}
        if self.settings.workload.normalize_updates:
            self._keep_starts(work, starts, len(next(iter(edge_models.values()))))
        return starts

    def _keep_starts(self, work: EdgeRoundWork, starts: Params, num_edges: int) -> None:
        """Copy the start rows (``starts``: name -> [E + c, *shape]) of the sent clients whose
        work starts over this edge round into :attr:`starts` (see :meth:`start_models`)."""
        rows = work.start_edges[work.clients]
        over = (rows < num_edges) | self.plan_starts[work.clients]
        if not over.any():
            return
        device = device_of(starts)
        if not self.starts:
            n = len(self.has_carry)
            self.starts = {k: torch.zeros(n, *v.shape[1:], dtype=v.dtype, device=device)
                           for k, v in starts.items()}
        into = torch.as_tensor(work.clients[over], device=device)
        source = torch.as_tensor(rows[over], device=device)
        for key, value in starts.items():
            self.starts[key].index_copy_(0, into, value.index_select(0, source))

    def scale(self, models: Params, work: EdgeRoundWork, scale: np.ndarray,
              edge_models: Params) -> None:
        """Nothing yet: a client's update is complete when its edge aggregates
        (:meth:`settle` scales it then, from the w_start of :meth:`start_models`)."""
        return None

    def settle(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               failed: np.ndarray, levels: np.ndarray, clock: SimClock, model_bytes: int,
               ) -> tuple[Params, np.ndarray, int]:
        self.aggregations += levels > 0
        sent = len(work.clients) - (0 if work.carried is None else len(work.carried))
        models, survivors = self._carry(work, models, survivors, levels[work.edge_of_client])
        rows = np.flatnonzero(self.factor[survivors] != 1.0) if len(survivors) else survivors
        if len(rows):  # FedNova: the whole period's update, w_start + s (w_end - w_start)
            index = torch.as_tensor(survivors[rows], device=device_of(self.starts))
            scale_rows(models, rows, self.factor[survivors[rows]],
                       {k: v.index_select(0, index) for k, v in self.starts.items()})
        self._time(work, levels, np.union1d(survivors, failed), clock, model_bytes)
        return models, survivors, sent

    def end_cloud_round(self) -> dict[str, Any]:
        return {"edge_aggregations": self.aggregations.tolist()}

    def _time(self, work: EdgeRoundWork, levels: np.ndarray, uploading: np.ndarray,
              clock: SimClock, model_bytes: int) -> None:
        """On the simulated clock a client receives its edge's model only when it does not
        continue from its own, and an edge receives models only when it aggregates (from
        ``uploading``, int64: its clients aggregated now or failed)."""
        downloads = np.ones(len(work.clients), dtype=bool)
        if work.carried is not None:
            downloads[np.isin(work.clients, work.carried)] = False
        edges = work.edge_of_client[uploading]
        uploads = np.bincount(edges[levels[edges] > 0], minlength=len(levels))
        clock.edge_round(work.clients, work.steps, work.edge_of_client, model_bytes,
                         downloads=downloads, uploads=uploads)

    def _carry(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               client_levels: np.ndarray) -> tuple[Params, np.ndarray]:
        """Keep the survivors whose edge does not aggregate now as carried models; return the
        models (name -> [m, *shape]) and ids (int64 [m]) that aggregate now: the survivors of
        aggregating edges, then their edges' earlier carried models.

        ``client_levels``: int64 [n], the level each client's edge aggregates at (0 = not).
        A sent client that failed loses its carried model.
        """
        self.has_carry[work.clients] = False
        keep = client_levels[survivors] == 0
        if keep.any():
            device = device_of(models)
            rows = torch.as_tensor(np.flatnonzero(keep), device=device)
            into = torch.as_tensor(survivors[keep], device=device)
            if not self.carried:
                n = len(self.has_carry)
                self.carried = {k: torch.zeros(n, *v.shape[1:], dtype=v.dtype, device=device)
                                for k, v in models.items()}
            for key, value in models.items():
                self.carried[key].index_copy_(0, into, value.index_select(0, rows))
            self.has_carry[survivors[keep]] = True
        earlier = np.flatnonzero(self.has_carry & (client_levels > 0))
        if not keep.any() and not len(earlier):
            return models, survivors
        device = device_of(models)
        now = torch.as_tensor(np.flatnonzero(~keep), device=device)
        carried = torch.as_tensor(earlier, device=device)
        out = {k: torch.cat([v.index_select(0, now), self.carried[k].index_select(0, carried)])
               for k, v in models.items()}
        self.has_carry[earlier] = False
        return out, np.concatenate([survivors[~keep], earlier]).astype(np.int64)


#: (when the settings ask for it, the schedule): one line per schedule, the first that
#: applies wins; :class:`EqualPeriods` otherwise.
SCHEDULES: tuple[tuple[Callable[[Any], bool], Callable[[Any], Schedule]], ...] = (
    (lambda s: bool(s.edge_periods), EdgePeriods),
)


def schedule_for(settings: Any) -> Schedule:
    """The schedule a run's settings (:class:`fedhier.round.loop.HSGDSettings`) ask for."""
    for wanted, make in SCHEDULES:
        if wanted(settings):
            return make(settings)
    return EqualPeriods(settings)
