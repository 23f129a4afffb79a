"""Batched kernels: local SGD for every client of an edge round as one tensor computation.

Every client's parameters live in one tensor per parameter name with a leading client axis,
``[n, *shape]``, and its mini-batches are gathered from one pool of rows on the device
(:class:`ClientRows`, with the indices of :func:`fedhier.local.train.batch_indices`, a pure function
of (seed, client, step)). The local step is the gradient of :func:`fedhier.local.train.loss_fn`
(mean cross-entropy) followed by :class:`fedhier.local.optimizer.LocalOptimizer`'s rule over the
client axis:

- models that are chains of linear layers with ReLU between them (``logreg``, ``mlp``) use a
  hand-batched forward/backward with ``torch.bmm`` (:func:`linear_chain_pass`, checked against
  autograd of ``loss_fn`` in tests/test_vectorized.py): a few large kernels per step instead
  of autograd's many small ones;
- any other model (``cnn``, ``lstm``) uses ``vmap(grad(loss_fn))`` over clients
  (:func:`vmap_training`); the vectorized engine trains convolutional models on the CPU one
  client after another instead (``fedhier.engines.vectorized.engine.client_loop_training``: vmap's
  grouped convolutions are slower there, docs/engines.md, W2).

Clients with fewer rows than ``batch_size`` use all their rows, so the per-step batch size b_j
differs between clients. Mini-batches are padded to the largest b_j of the run; padding rows
get weight 0 and real rows weight 1 / b_j, so each client's loss is exactly its mean
cross-entropy. The vmap path instead runs one vmap per distinct b_j (no padding at all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value, vmap

from fedhier.common.errors import ConfigError
from fedhier.data.federation import Federation
from fedhier.local.models import linear_chain
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import clients_batch_indices, effective_batch_size, loss_fn

Params = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ data
@dataclass
class ClientRows:
    """Every client's training rows as indices into one pool of rows on the device.

    Attributes:
        x: float32 [R, *input_shape], the dataset's training rows (the pool).
        y: int64 [R], their labels.
        rows: ``rows[j]`` int64 [m_j], client j's rows in the pool, in partition order (the
            order of ``Federation.client_tensors``, which ``batch_indices`` indexes).
        batch: int64 [n], b_j = ``effective_batch_size(batch_size, m_j)``.
        width: max_j b_j, the padded mini-batch width.
        weight: float32 [n, width] on the device: 1 / b_j for real rows, 0 for padding.
    """

    x: torch.Tensor
    y: torch.Tensor
    rows: list[np.ndarray]
    batch: np.ndarray
    width: int
    weight: torch.Tensor

    @classmethod
    def build(cls, fed: Federation, batch_size: int, device: torch.device) -> ClientRows:
        x, y = fed.bundle.train_arrays()
        rows = [np.asarray(p, dtype=np.int64) for p in fed.partitions]
        empty = [j for j, r in enumerate(rows) if len(r) == 0]
        if empty:
            raise ConfigError(f"clients {empty[:5]} have no training rows; the vectorized "
                              "engine needs at least one row per client")
        batch = np.array([effective_batch_size(batch_size, len(r)) for r in rows],
                         dtype=np.int64)
        width = int(batch.max())
        weight = np.zeros((len(rows), width), dtype=np.float32)
        for j, b in enumerate(batch):
            weight[j, :b] = np.float32(1.0) / np.float32(b)
        return cls(x=torch.as_tensor(x, device=device), y=torch.as_tensor(y, device=device),
                   rows=rows, batch=batch, width=width,
                   weight=torch.as_tensor(weight, device=device))

    @property
    def num_clients(self) -> int:
        return len(self.rows)

    @property
    def index_dtype(self) -> type[np.signedinteger]:
        """int32 when every pool row fits (torch indexes with int32 as with int64)."""
        return np.int32 if len(self.y) < 2**31 else np.int64

    def minibatch_rows(self, seed: int, batch_size: int, start: int, steps: int) -> np.ndarray:
        """Pool rows of every client's mini-batches for steps ``start .. start+steps-1``.

        Returns:
            [steps, n, width] of int32 (int64 for a pool of 2**31 rows or more: half the
            memory, 4 bytes per entry, 128 MB per cloud round of W1 at 100,000 clients);
            client j's step-s batch is ``[s, j, :b_j]`` (from :func:`batch_indices`),
            padding repeats its first row (weight 0).
        """
        out = np.empty((steps, self.num_clients, self.width), dtype=self.index_dtype)
        for lo in range(0, self.num_clients, INDEX_CLIENT_BLOCK):  # bounds the temporaries
            block = self.rows[lo:lo + INDEX_CLIENT_BLOCK]
            locals_ = clients_batch_indices(seed, [len(rows) for rows in block], batch_size,
                                            start, steps, first_client=lo)  # [steps, b_j] each
            for j, (rows, local) in enumerate(zip(block, locals_, strict=True), start=lo):
                b = local.shape[1]
                out[:, j, :b] = rows[local]
                out[:, j, b:] = rows[local[:, :1]]
        return out


#: Clients whose mini-batch indices :meth:`ClientRows.minibatch_rows` draws together.
INDEX_CLIENT_BLOCK = 2048


@dataclass
class EdgeRoundBatches:
    """The mini-batches of one edge round for a chunk of c clients.

    Attributes:
        x: float32 [steps, c, width, *input_shape]; y: int64 [steps, c, width].
        weight: float32 [c, width], 1 / b_j on client j's first b_j rows, 0 on padding.
        batch: int64 numpy [c], b_j per client.
    """

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    batch: np.ndarray


#: Local training of one edge round: (chunk params [c, ...], updated in place, the batches, one
#: learning rate per step, the optimizer, its momentum buffers or None) -> (float64 [c] each
#: client's summed mini-batch loss, the new buffers or None).
LocalTraining = Callable[[Params, EdgeRoundBatches, Sequence[float], LocalOptimizer,
                          Params | None], tuple[torch.Tensor, Params | None]]


# ------------------------------------------------------------------------------ local steps
def weighted_targets(y: torch.Tensor, weight: torch.Tensor, num_classes: int) -> torch.Tensor:
    """weight[j, r] * onehot(y[..., j, r]), class-major: y [..., c, b] -> [..., c, classes, b]."""
    onehot = nn.functional.one_hot(y, num_classes).to(weight.dtype)  # [..., c, b, classes]
    return (onehot * weight.unsqueeze(-1)).transpose(-1, -2).contiguous()


def linear_chain_pass(params: Params, layers: list[tuple[str, str]], x: torch.Tensor,
                      target: torch.Tensor, weight: torch.Tensor,
                      lr: float | None = None) -> tuple[Params, torch.Tensor]:
    """Hand-batched forward and backward of a Linear/ReLU chain for c clients at once.

    Client j's loss is sum_r weight[j, r] * CE(f(params_j, x[j, r]), y[j, r]): with weight
    1 / b_j on its b_j real rows (0 on padding) that is ``loss_fn``, its mean cross-entropy.
    Activations are feature-major ([c, features, b]): every product is one ``torch.bmm`` and
    the softmax runs over a non-innermost axis, several times faster than [c, b, features]
    on CPU for 10 classes.

    Args:
        params: weight [c, out, in] and bias [c, out] of every layer in ``layers``.
        x: [c, b, *input_shape]; target: [c, classes, b] from :func:`weighted_targets`;
        weight: [c, 1, b].
        lr: None: return the gradients and leave ``params`` alone. A float: apply the SGD
            rule params - lr * grads in place, fused into the gradient products
            (``baddbmm_``), and return no gradients.

    Returns:
        (gradients with the shapes of ``params`` or {} when ``lr`` is given, loss [c] at
        the parameters before the step).
    """
    c, b = x.shape[0], x.shape[1]
    log_probs = torch.empty((c, target.shape[1], b), dtype=x.dtype, device=x.device)
    grads = linear_chain_step(params, layers, x, target, weight, lr, log_probs)
    return grads, chain_losses(log_probs, target)


def chain_losses(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each client's weighted cross-entropy from the step's log-probabilities:
    [..., c, classes, b] -> [..., c] (one reduction for any number of leading steps; each
    client's sum runs over its own contiguous classes x b entries, so the result is the
    same bit for bit whether steps are reduced together or one by one)."""
    return (log_probs * target).sum(dim=(-2, -1)).neg_()


def linear_chain_step(params: Params, layers: list[tuple[str, str]], x: torch.Tensor,
                      target: torch.Tensor, weight: torch.Tensor, lr: float | None,
                      log_probs: torch.Tensor) -> Params:
    """The step of :func:`linear_chain_pass` without the loss: writes the log-probabilities
    [c, classes, b] into ``log_probs`` (for :func:`chain_losses`, once per edge round) and
    returns the gradients ({} when ``lr`` is given and the update is fused). The ReLU
    backward writes into the input-gradient product's own output (no extra tensor)."""
    c, b = x.shape[0], x.shape[1]
    acts = [x.reshape(c, b, -1).transpose(1, 2)]  # a_0 [c, in, b], then ReLU outputs
    for i, (w_key, b_key) in enumerate(layers):
        z = torch.baddbmm(params[b_key].unsqueeze(2), params[w_key], acts[-1])  # [c, out, b]
        acts.append(z.relu_() if i + 1 < len(layers) else z)
    torch.log_softmax(acts.pop(), dim=1, out=log_probs)  # [c, classes, b]
    delta = torch.exp(log_probs).mul_(weight).sub_(target)  # d loss / d logits
    grads: Params = {}
    for i in range(len(layers) - 1, -1, -1):
        w_key, b_key = layers[i]
        below = None
        if i > 0:  # d a_{i} (before this layer's update); ReLU passes it where a_i > 0
            below = torch.bmm(params[w_key].transpose(1, 2), delta)
            torch.ops.aten.threshold_backward.grad_input(below, acts[i], 0.0,
                                                        grad_input=below)
        if lr is None:
            grads[w_key] = torch.bmm(delta, acts[i].transpose(1, 2))
            grads[b_key] = delta.sum(dim=2)
        else:
            params[w_key].baddbmm_(delta, acts[i].transpose(1, 2), alpha=-lr)
            params[b_key].sub_(delta.sum(dim=2), alpha=lr)
        if below is not None:
            delta = below
    return grads


def linear_chain_training(layers: list[tuple[str, str]]) -> LocalTraining:
    """Local training of a Linear/ReLU chain with :func:`linear_chain_step`, in place.

    Plain SGD (every optimizer knob 0) uses the fused in-place update; momentum, weight decay
    or clipping take the gradients and apply ``LocalOptimizer.step`` over the client axis.
    The steps' log-probabilities are kept ([steps, c, classes, b], 35 KiB per step for 54
    clients of W1) and the losses reduced once per call, not once per step.
    """

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        num_classes = params[layers[-1][0]].shape[1]
        targets = weighted_targets(batches.y, batches.weight, num_classes)  # [I, c, C, b]
        weight = batches.weight.unsqueeze(1)
        log_probs = torch.empty_like(targets[:len(lrs)])
        fused = optimizer == LocalOptimizer()
        with torch.no_grad():
            for s, lr in enumerate(lrs):
                grads = linear_chain_step(params, layers, batches.x[s], targets[s], weight,
                                          lr if fused else None, log_probs[s])
                if not fused:
                    new, buffers = optimizer.step(params, grads, lr, buffers, client_axis=True)
                    for key, value in new.items():
                        params[key].copy_(value)
            losses = chain_losses(log_probs, targets[:len(lrs)]).to(torch.float64)
            total = torch.zeros(len(batches.batch), dtype=torch.float64, device=targets.device)
            for loss in losses:  # step by step, in float64, as the per-step sums were
                total += loss
        return total, buffers

    return train


def vmap_training(model: nn.Module) -> LocalTraining:
    """Local training of any model: ``vmap(grad(loss_fn))`` over clients, then the optimizer
    rule (``sgd_update`` for plain SGD) over the client axis.

    Clients are grouped by their batch size b_j, so each group is one vmap over exactly the
    ``loss_fn`` the other engines differentiate (mean over b_j real rows, no padding).
    """
    grad_loss = vmap(grad_and_value(partial(loss_fn, model)))

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        device = batches.x.device
        total = torch.zeros(len(batches.batch), dtype=torch.float64, device=device)
        new_buffers: Params | None = None
        for b in np.unique(batches.batch):
            index = torch.as_tensor(np.flatnonzero(batches.batch == b), device=device)
            group = {k: v.index_select(0, index) for k, v in params.items()}
            group_buffers = (None if buffers is None else
                             {k: v.index_select(0, index) for k, v in buffers.items()})
            x, y = batches.x.index_select(1, index), batches.y.index_select(1, index)
            for s, lr in enumerate(lrs):
                grads, loss = grad_loss(group, x[s, :, :b], y[s, :, :b])
                group, group_buffers = optimizer.step(group, grads, lr, group_buffers,
                                                      client_axis=True)
                total.index_add_(0, index, loss.detach().to(torch.float64))
            for key, value in group.items():
                params[key].index_copy_(0, index, value.detach())
            if group_buffers is not None:
                if new_buffers is None:
                    new_buffers = {k: torch.empty_like(v) for k, v in params.items()}
                for key, value in group_buffers.items():
                    new_buffers[key].index_copy_(0, index, value.detach())
        return total, new_buffers

    return train


def local_training_for(model: nn.Module) -> LocalTraining:
    """The batched local training for ``model``: hand-batched when it is a Linear/ReLU chain."""
    layers = linear_chain(model)
    return linear_chain_training(layers) if layers is not None else vmap_training(model)
