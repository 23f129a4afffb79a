"""The local optimiser: SGD with momentum, weight decay and gradient clipping.

Semantics follow ``torch.optim.SGD`` (and ``torch.nn.utils.clip_grad_norm_`` applied before
the step): g <- clip(grad) + weight_decay * w; buf <- g on the first step, else
momentum * buf + g; w <- w - lr * buf. With every knob at 0 this is exactly plain SGD,
w <- w - lr * grad. The update works on one client's parameters or on a stack of clients
(``client_axis=True``: a leading client dimension, norms taken per client), so the batched
engine applies the very same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedhier.settings.declaration import names_of

Params = dict[str, torch.Tensor]

#: what a client's optimizer state does between rounds, as the setting declares it
OPTIMIZER_STATES = names_of("optimizer_state")


@dataclass(frozen=True)
class LocalOptimizer:
    """SGD knobs; ``clip_norm`` 0 = no clipping."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    clip_norm: float = 0.0

    @property
    def has_state(self) -> bool:
        return self.momentum > 0

    def step(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
             lr: float | torch.Tensor, buffers: Params | None,
             client_axis: bool = False) -> tuple[Params, Params | None]:
        """One update. Returns (new params, new momentum buffers or None).

        ``lr`` is a float, or with ``client_axis`` a tensor [n] of per-client rates.
        """
        g, new_buffers = self.direction(params, grads, buffers, client_axis)
        if isinstance(lr, torch.Tensor) and client_axis:
            return {k: params[k] - _expand(lr, params[k]) * g[k] for k in params}, new_buffers
        return {k: params[k] - lr * g[k] for k in params}, new_buffers

    def step_(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
              lr: float, buffers: Params | None) -> Params | None:
        """:meth:`step` in place on ``params`` (``w.sub_(lr * d)`` runs the kernel of
        ``w - lr * d``: the same values bit for bit); returns the new momentum buffers."""
        g, new_buffers = self.direction(params, grads, buffers)
        for key, param in params.items():
            param.sub_(lr * g[key])
        return new_buffers

    def direction(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                  buffers: Params | None,
                  client_axis: bool = False) -> tuple[Params, Params | None]:
        """The step's direction d (the update is w <- w - lr * d) and the new momentum buffers
        (None without momentum)."""
        g = dict(grads)
        if self.clip_norm > 0:
            g = _clip(g, self.clip_norm, client_axis)
        if self.weight_decay > 0:
            g = {k: g[k] + self.weight_decay * params[k] for k in g}
        new_buffers: Params | None = None
        if self.momentum > 0:
            if buffers is None:
                new_buffers = {k: v.clone() for k, v in g.items()}
            else:
                new_buffers = {k: self.momentum * buffers[k] + g[k] for k in g}
            g = new_buffers
        return g, new_buffers


def _expand(per_client: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_client.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def _clip(grads: Params, max_norm: float, client_axis: bool) -> Params:
    """Scale gradients so their total L2 norm (per client with ``client_axis``) is <= max_norm."""
    if client_axis:
        squares = sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in grads.values())
    else:
        squares = sum(v.pow(2).sum() for v in grads.values())
    norm = torch.as_tensor(squares).sqrt()
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
    if client_axis:
        return {k: v * _expand(factor, v) for k, v in grads.items()}
    return {k: v * factor for k, v in grads.items()}
