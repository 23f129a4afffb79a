"""Local training and evaluation, shared by every engine.

The local step is a pure function of (parameters, mini-batch, learning rate), written with
``torch.func`` so that the batched engine can ``vmap`` the very same code over clients.
Mini-batch order is a pure function of (seed, client, step): see :func:`batch_indices`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedhier.optim import LocalOptimizer
from fedhier.rng import generator

Params = dict[str, torch.Tensor]


def effective_batch_size(batch_size: int, num_rows: int) -> int:
    """Rows per step: ``batch_size``, or all rows when it is 0 or exceeds the client's data."""
    if batch_size <= 0 or batch_size >= num_rows:
        return num_rows
    return batch_size


def batch_indices(
    seed: int, client: int, num_rows: int, batch_size: int, start_step: int, num_steps: int
) -> np.ndarray:
    """Row indices of the mini-batches of steps ``start_step .. start_step + num_steps - 1``.

    Each client reads an endless stream of epochs; epoch e is a permutation of its rows drawn
    from ``generator(seed, "batches", client, e)``, and step t takes stream positions
    ``t*b .. t*b + b - 1`` (b = effective batch size). A full batch (``batch_size`` 0, or at
    least ``num_rows``) is every row in order: deterministic gradient descent.

    Returns:
        int64 array [num_steps, b] of indices into the client's rows.
    """
    b = effective_batch_size(batch_size, num_rows)
    if b == num_rows:
        return np.tile(np.arange(num_rows, dtype=np.int64), (num_steps, 1))
    positions = np.arange(start_step * b, (start_step + num_steps) * b, dtype=np.int64)
    epochs = positions // num_rows
    out = np.empty_like(positions)
    for epoch in np.unique(epochs):
        perm = generator(seed, "batches", client, int(epoch)).permutation(num_rows)
        mask = epochs == epoch
        out[mask] = perm[positions[mask] % num_rows]
    return out.reshape(num_steps, b)


def loss_fn(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
            y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model`` with ``params`` on a batch x [b, ...], y [b]."""
    logits = functional_call(model, dict(params), (x,))
    return nn.functional.cross_entropy(logits, y)


def sgd_update(params: Params, grads: Mapping[str, torch.Tensor], lr: float) -> Params:
    """The SGD update rule, params - lr * grads, shared by every engine."""
    return {k: params[k] - lr * grads[k] for k in params}


def local_sgd(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor, *,
              lr: float | np.ndarray, indices: np.ndarray,
              optimizer: LocalOptimizer | None = None,
              buffers: Params | None = None) -> tuple[Params, float, Params | None]:
    """Run ``len(indices)`` local steps on a client's data x [m, ...], y [m].

    ``lr`` is one rate or one per step; ``optimizer`` adds momentum / weight decay / clipping
    (default: plain SGD), starting from momentum ``buffers`` (None = fresh).
    Returns the new parameters, the mean mini-batch loss over the steps, and the buffers.
    """
    optimizer = optimizer or LocalOptimizer()
    rates = np.broadcast_to(np.asarray(lr, dtype=np.float64), (len(indices),))
    rows = torch.as_tensor(indices, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for step_rows, rate in zip(rows, rates, strict=True):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(model, leaves, x[step_rows], y[step_rows])
        grads = torch.autograd.grad(loss, tuple(leaves.values()))
        with torch.no_grad():
            params, buffers = optimizer.step({k: v.detach() for k, v in leaves.items()},
                                             dict(zip(leaves, grads, strict=True)),
                                             float(rate), buffers)
        total += loss.detach().to(torch.float64)
    return params, float(total) / max(len(indices), 1), buffers


@torch.no_grad()
def evaluate(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor, chunk: int = 4096) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the model on x [m, ...], y [m]."""
    if len(y) == 0:
        return float("nan"), float("nan")
    loss_sum = 0.0
    correct = 0
    for start in range(0, len(y), chunk):
        logits = functional_call(model, dict(params), (x[start:start + chunk],))
        target = y[start:start + chunk]
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(1) == target).sum())
    return loss_sum / len(y), correct / len(y)


def params_of(model: nn.Module) -> Params:
    """The model's parameters and buffers as a detached name -> tensor dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when available; otherwise the named device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
