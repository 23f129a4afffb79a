"""A client's update on its way up: FedNova scaling, then screening.

Between the executor's :class:`~fedhier.round.executor.TrainResult` and the aggregation, the
round (:meth:`fedhier.round.loop.HierarchicalSGD.complete`) scales each client's update by its
plan's FedNova factor (:class:`fedhier.round.participants.Workload`, ``normalize_updates``; with
per-edge periods the schedule does it when the client's edge aggregates,
:class:`fedhier.round.schedule.EdgePeriods`) and keeps the clients
whose update is usable: returned and finite (``on_nan``: a non-finite one stops the run naming
the client, or is dropped). No state; no Flower import.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fedhier.round.executor import EdgeRoundWork, Params, TrainResult, device_of
from fedhier.round.faults import RunFailureError, non_finite_message

log = logging.getLogger("fedhier")


def scale_updates(models: Params, work: EdgeRoundWork, scale: np.ndarray,
                  edge_models: Params) -> None:
    """FedNova: client j's model becomes w_start + s_j (w_j - w_start), in place.

    Args:
        models: name -> [k, *shape], ``work.clients``' models; scale: float64 [k], s_j;
        edge_models: name -> [E, *shape], w_start = the model of the edge each client
            started from (``work.start_edges``).
    """
    rows = np.flatnonzero(scale != 1.0)
    if not len(rows):
        return
    edges = torch.as_tensor(work.start_edges[work.clients[rows]],
                            device=device_of(edge_models))
    scale_rows(models, rows, scale[rows],
               {k: v.index_select(0, edges) for k, v in edge_models.items()})


def scale_rows(models: Params, rows: np.ndarray, scale: np.ndarray, starts: Params) -> None:
    """Rows ``rows`` (int64 [r]) of ``models`` (name -> [k, *shape]) become
    w_start + s (w - w_start), in place: ``scale`` float64 [r], ``starts`` name ->
    [r, *shape] their start models (w_start)."""
    device = device_of(models)
    index = torch.as_tensor(rows, device=device)
    factor = torch.as_tensor(scale, device=device)
    for key, value in models.items():
        start = starts[key].to(device)
        local = value.index_select(0, index)
        f = factor.reshape(-1, *([1] * (local.dim() - 1))).to(local.dtype)
        value.index_copy_(0, index, start + f * (local - start))


def screen(work: EdgeRoundWork, result: TrainResult, on_nan: str,
           edge_rounds_per_cloud_round: int) -> np.ndarray:
    """bool [k]: the clients whose update is usable. A NaN/inf model or loss stops the run
    naming the client (``on_nan="stop"``) or drops it (``"skip-client"``)."""
    alive = result.ok.copy()
    if not alive.any():
        return alive
    device = device_of(result.models)
    rows = None if alive.all() else torch.as_tensor(np.flatnonzero(alive), device=device)
    loss_ok = np.isfinite(result.losses)
    if result.loss_reported is not None:  # an unreported loss is no evidence
        loss_ok |= ~result.loss_reported
    if all(all_finite(v if rows is None else v.index_select(0, rows))
           for v in result.models.values()) and loss_ok[alive].all():
        return alive
    finite = torch.ones(len(alive), dtype=torch.bool, device=device)
    for value in result.models.values():
        finite &= torch.isfinite(value.reshape(len(alive), -1)).all(dim=1)
    model_ok = finite.cpu().numpy()
    bad = np.flatnonzero(alive & ~(model_ok & loss_ok))
    if on_nan == "stop":
        row = int(bad[0])
        client = int(work.clients[row])
        raise RunFailureError(non_finite_message(
            client, int(work.edge_of_client[client]), work.edge_round,
            edge_rounds_per_cloud_round,
            loss=float(result.losses[row]) if model_ok[row] else None))
    log.warning("dropping the non-finite update of client(s) %s in edge round %d",
                work.named(work.clients[bad]), work.edge_round)
    alive[bad] = False
    return alive


def all_finite(value: torch.Tensor) -> bool:
    """Whether every entry of ``value`` is finite, without a bool copy of it ([n, *shape]:
    gigabytes at 100,000 clients): a NaN or inf entry makes the sum NaN or inf, so a finite
    sum proves them all finite; only a non-finite sum (or a float overflow) checks entries."""
    if value.is_floating_point() and bool(torch.isfinite(value.sum())):
        return True
    return bool(torch.isfinite(value).all())


def survivors_loss(work: EdgeRoundWork, result: TrainResult, alive: np.ndarray,
                   weights: np.ndarray) -> tuple[float | None, float]:
    """(the client-weighted mean of the survivors' reported mean mini-batch losses, or None;
    the sum of those clients' weights ``weights`` [n])."""
    reported = alive if result.loss_reported is None else alive & result.loss_reported
    if not reported.any():
        return None, 0.0
    w = weights[work.clients[reported]]
    return float(np.dot(w, result.losses[reported]) / w.sum()), float(w.sum())
