"""Schedule: when each node aggregates, and who trains for how many steps until then.

One part of the round (docs/index.md, "The round as parts"). Per edge round the loop asks
the run's :class:`Schedule` who trains (:meth:`~Schedule.plan`: partial participation and
stragglers through :func:`fedhier.plan.plan_edge_round`), from which models
(:meth:`~Schedule.start_models`), at which level each edge aggregates after it
(:meth:`~Schedule.levels`: :func:`fedhier.topology.edge_levels_after`, the one schedule of
every engine), and which of the returned models aggregate now (:meth:`~Schedule.settle`,
which also charges the round to the simulated clock and says how many models went down).

* :class:`EqualPeriods`: every edge aggregates every I steps (H-SGD);
* :class:`EdgePeriods`: edge i every I_i steps (docs/hsgd.md#per-edge-periods); an edge round
  is then g = gcd(I_i) steps, each edge plans at the start of its own period, and the clients
  of edges that do not aggregate continue from their own (carried) models.

Buffered asynchronous reports are a schedule of the level above the edges
(:mod:`fedhier.async_edges`). A new schedule is one class here and one line of
:data:`SCHEDULES`. A schedule's state lives within a cloud round (nothing to checkpoint at its
boundary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from fedhier.plan import EdgeRoundPlan, plan_edge_round
from fedhier.round.executor import EdgeRoundWork, Params, device_of
from fedhier.sim_clock import SimClock
from fedhier.topology import Hierarchy, edge_levels_after


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
        self.remaining = np.zeros(0, dtype=np.int64)
        self.scale = np.ones(0, dtype=np.float64)
        self.carried: Params = {}
        self.has_carry = np.zeros(0, dtype=bool)
        self.aggregations = np.zeros(0, dtype=np.int64)

    def begin_cloud_round(self, num_clients: int, num_edges: int) -> None:
        self.remaining = np.zeros(num_clients, dtype=np.int64)
        self.scale = np.ones(num_clients, dtype=np.float64)
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
        if len(starting):
            period_plan = plan_edge_round(hierarchy, s.workload, weights, s.seed,
                                          edge_round, starting, s.edge_periods)
            planned = np.isin(hierarchy.edge_of_client(), starting)
            self.remaining[planned] = period_plan.steps[planned]
            self.scale[planned] = period_plan.scale[planned]
        steps = np.minimum(self.remaining, s.local_period)
        self.remaining -= steps
        carried = np.flatnonzero(self.has_carry & (steps > 0))
        if not len(carried):
            return EdgeRoundPlan(steps=steps, scale=self.scale.copy()), start_edges, None
        rows = hierarchy.edge_of_client() if start_edges is None else start_edges.copy()
        rows[carried] = hierarchy.num_nodes(1) + np.arange(len(carried))
        return EdgeRoundPlan(steps=steps, scale=self.scale.copy()), rows, carried

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
            self.scale = np.ones(num_clients, dtype=np.float64)
            self.has_carry = np.zeros(num_clients, dtype=bool)
        if len(self.aggregations) != num_edges:
            self.aggregations = np.zeros(num_edges, dtype=np.int64)
        self.remaining[members] = 0
        self.scale[members] = 1.0
        self.has_carry[members] = False
        self.aggregations[edges] = 0

    def start_models(self, work: EdgeRoundWork, edge_models: Params) -> Params:
        """The E edges' models, then the c carried client models (rows E..E+c-1)."""
        if work.carried is None:
            return edge_models
        index = torch.as_tensor(work.carried, device=device_of(self.carried))
        return {k: torch.cat([v, self.carried[k].index_select(0, index)])
                for k, v in edge_models.items()}

    def settle(self, work: EdgeRoundWork, models: Params, survivors: np.ndarray,
               failed: np.ndarray, levels: np.ndarray, clock: SimClock, model_bytes: int,
               ) -> tuple[Params, np.ndarray, int]:
        self.aggregations += levels > 0
        sent = len(work.clients) - (0 if work.carried is None else len(work.carried))
        models, survivors = self._carry(work, models, survivors, levels[work.edge_of_client])
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
    """The schedule a run's settings (:class:`fedhier.hsgd.HSGDSettings`) ask for."""
    for wanted, make in SCHEDULES:
        if wanted(settings):
            return make(settings)
    return EqualPeriods(settings)
