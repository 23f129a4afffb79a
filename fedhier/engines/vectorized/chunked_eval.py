"""The global model on every client's training rows, a run of clients at a time.

The batched engines evaluate the global model on each client's own rows once per cloud
round (:meth:`fedhier.engines.vectorized.engine.BatchedExecutor.evaluate`). Every distinct pool row
is evaluated once (batches of :data:`EVAL_CHUNK` rows of the sorted distinct rows), then each
client's mean is the float64 sum of its rows' losses (correct answers) in its partition
order, over its row count. Done for all n clients at once this held several arrays of all
the clients' rows together (int64 row ids, their inverse, float64 losses, the client of each:
about 0.5 GB per 14 million rows, the million-client federation's); here those exist for
:data:`EVAL_CLIENTS` clients at a time, and only the per-row results of the distinct rows
(at most the pool) and the [n] outputs stay. The numbers are bit for bit the all-at-once
ones: the same distinct rows in the same forward batches, and each client's sum has the same
terms in the same order (``np.bincount`` adds a bin's weights in input order;
tests/test_chunked_eval.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedhier.local.train import Forward

#: Rows per forward pass when evaluating the global model on the clients' training rows.
EVAL_CHUNK = 4096
#: Clients whose rows are gathered at a time (65,536 W1 clients: about 0.9 M rows).
EVAL_CLIENTS = 2**16


def distinct_rows(rows: Sequence[np.ndarray], clients_per_run: int = EVAL_CLIENTS,
                  ) -> np.ndarray:
    """int64: the sorted distinct pool rows of all clients (``rows[j]``: client j's), built
    a run of ``clients_per_run`` clients at a time."""
    used = np.zeros(0, dtype=np.int64)
    for lo in range(0, len(rows), clients_per_run):
        run = np.unique(np.concatenate(rows[lo:lo + clients_per_run]))
        used = np.union1d(used, run).astype(np.int64)
    return used


def row_metrics(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor, used: np.ndarray,
                forward: Forward | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 [u] cross-entropy and bool [u] correctness of the model on pool rows
    ``used`` (int64 [u]), in forward batches of :data:`EVAL_CHUNK` rows (``forward``: the
    logits' function instead of the model's own forward)."""
    used_t = torch.as_tensor(used, device=x.device)
    row_loss, row_correct = [], []
    with torch.no_grad():
        for lo in range(0, len(used), EVAL_CHUNK):
            index = used_t[lo:lo + EVAL_CHUNK]
            logits = (torch.func.functional_call(model, dict(params), (x[index],))
                      if forward is None else forward(params, x[index]))
            target = y[index]
            row_loss.append(nn.functional.cross_entropy(logits, target, reduction="none"))
            row_correct.append(logits.argmax(1) == target)
    if not row_loss:
        return np.zeros(0), np.zeros(0, dtype=bool)
    return (torch.cat(row_loss).to(torch.float64).cpu().numpy(),
            torch.cat(row_correct).cpu().numpy())


def client_metrics(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, rows: Sequence[np.ndarray],
                   clients_per_run: int = EVAL_CLIENTS,
                   forward: Forward | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 [n] each: the model's mean loss and accuracy on each client's rows
    (``rows[j]``: int64 indices of client j's rows into the pool ``x`` [R, ...], ``y`` [R]),
    every distinct row evaluated once, the clients' sums formed ``clients_per_run`` at a
    time."""
    used = distinct_rows(rows, clients_per_run)
    loss, correct = row_metrics(model, params, x, y, used, forward)
    n = len(rows)
    client_loss, client_acc = np.empty(n), np.empty(n)
    for lo in range(0, n, clients_per_run):
        run = rows[lo:lo + clients_per_run]
        member = np.searchsorted(used, np.concatenate(run))
        sizes = np.array([len(r) for r in run], dtype=np.int64)
        client = np.repeat(np.arange(len(run)), sizes)
        hi = lo + len(run)
        client_loss[lo:hi] = np.bincount(client, weights=loss[member],
                                         minlength=len(run)) / sizes
        client_acc[lo:hi] = np.bincount(client, weights=correct[member],
                                        minlength=len(run)) / sizes
    return client_loss, client_acc
