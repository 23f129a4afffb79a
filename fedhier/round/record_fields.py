"""The numbers a cloud round's record holds besides training: evaluation and diagnostics.

:meth:`fedhier.round.loop.HierarchicalSGD.record` is the one place that defines metrics.jsonl's keys
for every engine; these are its pieces. No Flower import.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from fedhier.diagnostics.in_rounds import client_diagnostics
from fedhier.round.aggregators.averaging import robust_mean
from fedhier.round.executor import ClientEvaluation, Executor, Params
from fedhier.round.reply_policy import outlying_gradients
from fedhier.tree.hierarchy import Hierarchy

log = logging.getLogger("fedhier")


def evaluation_metrics(evaluation: ClientEvaluation, weights: np.ndarray,
                       rule: str = "mean") -> dict[str, Any]:
    """train_loss / train_accuracy: client-weighted over the clients that answered (the
    global objective f(w)), or under a robust ``rule`` (``metrics_aggregator``:
    :func:`fedhier.round.aggregators.averaging.robust_mean`, each metric alone), and the held-out
    accuracy summary when clients hold rows out."""
    answered = ~np.isnan(evaluation.loss)
    if not answered.any():
        return {}
    w = weights[answered]
    if rule == "mean":  # as always (published numbers)
        loss = float(np.dot(w, evaluation.loss[answered]) / w.sum())
        accuracy = float(np.dot(w, evaluation.accuracy[answered]) / w.sum())
    else:
        loss = robust_mean(evaluation.loss[answered], w, rule)
        accuracy = robust_mean(evaluation.accuracy[answered], w, rule)
    out: dict[str, Any] = {"train_loss": loss, "train_accuracy": accuracy}
    holdout = evaluation.holdout_accuracy
    if holdout is not None and not np.isnan(holdout).all():
        out.update(client_accuracy_summary(holdout))
    return out


def client_accuracy_summary(accuracies: np.ndarray) -> dict[str, Any]:
    """Mean, 10th percentile and worst of per-client held-out accuracies (NaN = missing)."""
    valid = accuracies[~np.isnan(accuracies)]
    return {"client_accuracy_mean": float(valid.mean()),
            "client_accuracy_p10": float(np.percentile(valid, 10)),
            "client_accuracy_worst": float(valid.min()),
            "client_accuracies": [None if np.isnan(a) else float(a) for a in accuracies]}


def diagnostics_record(executor: Executor, params: Params, weights: np.ndarray,
                       hierarchy: Hierarchy, cloud_round: int) -> dict[str, Any]:
    """Divergences and gradient diversity at ``params`` from every client's full gradient
    (docs/diagnostics.md), outlying gradients flagged and left out; {} without gradients."""
    grads = executor.client_gradients(params)
    if grads is None:
        log.warning("divergences need every client's gradient (query.gradient, "
                    "docs/contract.md): not recorded for round %d", cloud_round)
        return {}
    record: dict[str, Any] = {}
    flagged = outlying_gradients(grads)
    if flagged.any():
        record["diagnostics_flagged_clients"] = np.flatnonzero(flagged).tolist()
        grads = torch.where(torch.as_tensor(flagged, device=grads.device)[:, None],
                            torch.zeros((), dtype=grads.dtype, device=grads.device), grads)
        weights = np.where(flagged, 0.0, weights)
    record.update(client_diagnostics(grads, weights, hierarchy))
    return record
