"""Local training and evaluation, shared by every engine.

The local step is a pure function of (parameters, mini-batch, learning rate), written with
``torch.func`` so that the batched engine can ``vmap`` the very same code over clients.
Mini-batch order is a pure function of (seed, client, step): see :func:`batch_indices`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedhier.common.permutations import permutations
from fedhier.common.rng import generator
from fedhier.local.optimizer import LocalOptimizer

Params = dict[str, torch.Tensor]
#: What a local step adds after the optimiser's update, in place: (the parameters, the
#: step's index within the call, its learning rate) -> None (Langevin noise:
#: :meth:`fedhier.local.langevin.Langevin.perturb_one_`).
StepNoise = Callable[[Params, int, float], None]
#: (one model's params, rows x [m, ...]) -> logits [m, classes]: a forward other than the
#: model's own (the batched engines' grouped kernels, ``fedhier.engines.vectorized.conv_kernels``).
Forward = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


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
    if num_steps == 0:
        return np.empty((0, b), dtype=np.int64)
    if b == num_rows:
        return np.tile(np.arange(num_rows, dtype=np.int64), (num_steps, 1))
    epochs = _stream_epochs(num_rows, b, start_step, num_steps)
    stream = np.concatenate([generator(seed, "batches", client, int(e)).permutation(num_rows)
                             for e in epochs])
    return _steps_of(stream, num_rows, b, int(epochs[0]), start_step, num_steps)


def clients_batch_indices(seed: int, num_rows: Sequence[int], batch_size: int, start_step: int,
                          num_steps: int, first_client: int = 0,
                          client_ids: np.ndarray | None = None) -> list[np.ndarray]:
    """``[batch_indices(seed, first_client + k, num_rows[k], batch_size, start_step,
    num_steps) for k]``, equal entry for entry, with every (client, epoch) permutation drawn
    in one :func:`fedhier.common.permutations.permutations` call instead of one generator each.
    ``client_ids`` (int64 [len(num_rows)]), when given, are the clients' ids instead of
    ``first_client + k`` (a shard of a federation: ``fedhier.engines.vectorized_ray.engine``)."""
    rows = [int(n) for n in num_rows]
    width = [effective_batch_size(batch_size, n) for n in rows]
    if num_steps == 0:
        return [np.empty((0, w), dtype=np.int64) for w in width]
    out = [np.tile(np.arange(n, dtype=np.int64), (num_steps, 1)) for n in rows]  # full batch
    shuffled = [k for k in range(len(rows)) if width[k] < rows[k]]
    if not shuffled:
        return out
    epochs = [_stream_epochs(rows[k], width[k], start_step, num_steps) for k in shuffled]
    owners = np.repeat(shuffled, [len(e) for e in epochs])
    drawn = permutations(seed, "batches",
                         np.column_stack([first_client + owners if client_ids is None
                                          else np.asarray(client_ids, dtype=np.int64)[owners],
                                          np.concatenate(epochs)]),
                         np.asarray(rows)[owners])
    at = 0
    for k, client_epochs in zip(shuffled, epochs, strict=True):
        stream = drawn[at:at + len(client_epochs), :rows[k]].reshape(-1)
        at += len(client_epochs)
        out[k] = _steps_of(stream, rows[k], width[k], int(client_epochs[0]), start_step,
                           num_steps)
    return out


def _stream_epochs(num_rows: int, b: int, start_step: int, num_steps: int) -> np.ndarray:
    """The epochs whose permutations hold stream positions [start_step*b, (start_step +
    num_steps)*b) of a client with ``num_rows`` rows (num_steps >= 1)."""
    first, end = start_step * b, (start_step + num_steps) * b
    return np.arange(first // num_rows, (end - 1) // num_rows + 1)


def _steps_of(stream: np.ndarray, num_rows: int, b: int, first_epoch: int, start_step: int,
              num_steps: int) -> np.ndarray:
    """[num_steps, b]: the steps' positions of ``stream``, the concatenated permutations of
    epochs ``first_epoch, first_epoch + 1, ...``."""
    lo = start_step * b - first_epoch * num_rows
    return stream[lo:lo + num_steps * b].reshape(num_steps, b)


def loss_fn(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
            y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model`` with ``params`` on a batch x [b, ...], y [b]."""
    logits = functional_call(model, dict(params), (x,))
    return nn.functional.cross_entropy(logits, y)


def local_sgd(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor, *,
              lr: float | np.ndarray, indices: np.ndarray,
              optimizer: LocalOptimizer | None = None,
              buffers: Params | None = None,
              noise: StepNoise | None = None) -> tuple[Params, float, Params | None]:
    """Run ``len(indices)`` local steps on a client's data x [m, ...], y [m].

    ``lr`` is one rate or one per step; ``optimizer`` adds momentum / weight decay / clipping
    (default: plain SGD), starting from momentum ``buffers`` (None = fresh); ``noise``, when
    given, is added after every step's update (Langevin dynamics).
    Returns the new parameters, the mean mini-batch loss over the steps, and the buffers.
    """
    optimizer = optimizer or LocalOptimizer()
    rates = np.broadcast_to(np.asarray(lr, dtype=np.float64), (len(indices),))
    rows = torch.as_tensor(indices, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    resident = _resident(model) if len(indices) else None
    # The resident copy's own parameters, updated in place (None: re-bind every step).
    leaves = resident.load(params) if resident is not None else None
    for k, (step_rows, rate) in enumerate(zip(rows, rates, strict=True)):
        if resident is not None and leaves is not None:
            values = leaves
            loss = nn.functional.cross_entropy(resident.module(x[step_rows]), y[step_rows])
        else:
            values = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            loss = loss_fn(model, values, x[step_rows], y[step_rows])
        grads = dict(zip(values, torch.autograd.grad(loss, tuple(values.values())),
                         strict=True))
        with torch.no_grad():
            if leaves is not None:
                buffers = optimizer.step_(leaves, grads, float(rate), buffers)
            else:
                params, buffers = optimizer.step(params, grads, float(rate), buffers)
            if noise is not None:
                noise(leaves if leaves is not None else params, k, float(rate))
        total += loss.detach().to(torch.float64)
    if leaves is not None:
        params = {key: leaf.detach().clone() for key, leaf in leaves.items()}
    return params, float(total) / max(len(indices), 1), buffers


class _Resident:
    """A private copy of a model whose own parameters hold each local step's values.

    ``loss_fn`` re-binds the parameters into the module on every call (``functional_call``),
    which costs more than a small model's forward pass; copying the values into this copy's
    parameters instead gives the same forward and gradients bit for bit, as long as shapes,
    dtypes, devices and strides agree (otherwise :meth:`load` declines).
    """

    def __init__(self, model: nn.Module) -> None:
        self.module = copy.deepcopy(model)
        self.params = dict(self.module.named_parameters())
        for param in self.params.values():
            param.requires_grad_(True)

    def load(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """This copy's parameters (in the order of ``params``) now holding ``params``, or None
        when ``params`` is not exactly a set of tensors laid out like them."""
        if params.keys() != self.params.keys():
            return None
        for key, value in params.items():
            own = self.params[key]
            if (value.shape != own.shape or value.dtype != own.dtype
                    or value.device != own.device or value.stride() != own.stride()):
                return None
        with torch.no_grad():
            for key, value in params.items():
                self.params[key].copy_(value)
        return {key: self.params[key] for key in params}


_RESIDENTS: weakref.WeakKeyDictionary[nn.Module, _Resident | None] = (
    weakref.WeakKeyDictionary())


def _resident(model: nn.Module) -> _Resident | None:
    """The model's :class:`_Resident` (None for a model that cannot be copied)."""
    if model not in _RESIDENTS:
        try:
            _RESIDENTS[model] = _Resident(model)
        except (TypeError, RuntimeError, copy.Error):
            _RESIDENTS[model] = None
    resident = _RESIDENTS[model]
    if resident is not None:
        resident.module.train(model.training)
    return resident


@torch.no_grad()
def evaluate(model: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor, chunk: int = 4096,
             forward: Forward | None = None) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the model on x [m, ...], y [m]; ``forward``
    (params, rows) -> logits replaces the model's own forward (the batched engines' grouped
    kernels for conv models, ``fedhier.engines.vectorized.conv_kernels.forward_for``)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    loss_sum = 0.0
    correct = 0
    for start in range(0, len(y), chunk):
        rows = x[start:start + chunk]
        logits = (functional_call(model, dict(params), (rows,)) if forward is None
                  else forward(params, rows))
        target = y[start:start + chunk]
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(1) == target).sum())
    return loss_sum / len(y), correct / len(y)


def params_of(model: nn.Module) -> Params:
    """The model's parameters and buffers as a detached name -> tensor dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def resolve_device(device: str) -> torch.device:
    """The device ``--device`` names on this machine ('auto': cuda, else mps, else cpu); a
    one-line ConfigError naming the available devices if this machine lacks it
    (:func:`fedhier.local.devices.resolve_device`)."""
    from fedhier.local.devices import resolve_device as resolve

    resolved: torch.device = resolve(device)
    return resolved
