"""Batched kernels for convolutional models: every client of a chunk in one computation.

A :class:`fedhier.local.models.ConvChain` (``cnn``, ``lenet5``) is trained for c clients at once
with the clients folded into the channel axis: client j's channels are channels
``j*C .. j*C + C - 1`` of one ``[b, c*C, H, W]`` activation stored channels-last (physically
``[b, H, W, c, C]``), and every convolution is one grouped convolution (``groups = c``,
weights ``[c*out, in, kh, kw]``, a view of the ``[c, out, in, kh, kw]`` parameters). In
that layout the CPU's convolution, pooling and ReLU kernels vectorise over all c*C channels
at once, where a single client's 6 or 16 channels leave most of each vector register empty
(docs/engines.md, "W2'").

The backward pass is written out (``convolution_backward``,
``max_pool2d_with_indices_backward``, ``threshold_backward``: the functions autograd calls
for the model's own forward) so that every tensor stays channels-last; the Linear head runs
feature-major (``[c, features, b]``) through autograd. Each client's loss is its weighted
cross-entropy (:func:`fedhier.engines.vectorized.kernels.weighted_targets`, 1 / b_j on real rows,
0 on padding), so its gradient is the gradient of ``fedhier.local.train.loss_fn`` on its own rows;
the update is :class:`fedhier.local.optimizer.LocalOptimizer`'s rule over the client axis.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fedhier.engines.vectorized.kernels import (
    EdgeRoundBatches,
    LocalTraining,
    chain_losses,
    weighted_targets,
)
from fedhier.local.models import ConvChain, conv_chain
from fedhier.local.optimizer import LocalOptimizer
from fedhier.local.train import Forward

Params = dict[str, torch.Tensor]
aten = torch.ops.aten
#: A conv block's (input, ReLU output, pool indices or None), kept for the backward pass.
Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

#: Rows per group when the global model is evaluated with the grouped kernels (rows of a
#: forward batch are split into groups of this many, each group one "client").
EVAL_GROUP_ROWS = 20
#: Rows per evaluation forward batch (a few MB of activations: they stay in the cache).
EVAL_BATCH_ROWS = 640


def grouped(x: torch.Tensor) -> torch.Tensor:
    """[c, b, C, H, W] -> [b, c*C, H, W] channels-last (physically [b, H, W, c, C])."""
    c, b, ch, h, w = x.shape
    return x.permute(1, 3, 4, 0, 2).reshape(b, h, w, c * ch).permute(0, 3, 1, 2)


def ungrouped(h: torch.Tensor, c: int) -> torch.Tensor:
    """[b, c*C, H, W] -> [c, C*H*W, b]: each client's flattened features (the model's
    ``flatten(1)`` order: channel, row, column), feature-major."""
    b, cc, hh, ww = h.shape
    return h.reshape(b, c, cc // c, hh, ww).permute(1, 2, 3, 4, 0).reshape(c, -1, b)


def regrouped(g: torch.Tensor, like: torch.Tensor, c: int) -> torch.Tensor:
    """The inverse of :func:`ungrouped`: [c, C*H*W, b] -> ``like``'s [b, c*C, H, W],
    channels-last."""
    b, cc, hh, ww = like.shape
    return (g.reshape(c, cc // c, hh, ww, b).permute(4, 2, 3, 0, 1)
            .reshape(b, hh, ww, cc).permute(0, 3, 1, 2))


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """The [b, H, W, C] view of a [b, C, H, W] tensor (contiguous when ``t`` is
    channels-last: element-wise kernels then run over one flat buffer)."""
    return t.permute(0, 2, 3, 1)


def _conv_weight(w: torch.Tensor) -> torch.Tensor:
    """[c, out, in, kh, kw] -> the grouped convolution's [c*out, in, kh, kw] (a view)."""
    return w.reshape(-1, *w.shape[2:])


def conv_stages_forward(chain: ConvChain, params: Mapping[str, torch.Tensor], h: torch.Tensor,
                        c: int, saved: list[Saved] | None = None,
                        ) -> torch.Tensor:
    """The conv blocks of ``chain`` for c clients: ``h`` [b, c*C, H, W] channels-last (from
    :func:`grouped`) -> the last block's output, same layout. With ``saved`` (a list), each
    block's (input, ReLU output, pool indices or None) is appended for the backward pass."""
    for stage in chain.stages:
        z = nn.functional.conv2d(h, _conv_weight(params[stage.weight]),
                                 params[stage.bias].reshape(-1), padding=stage.padding,
                                 groups=c)
        _nhwc(z).relu_()
        indices = None
        if stage.pool and saved is not None:
            out, indices = nn.functional.max_pool2d(z, 2, return_indices=True)
        else:
            out = nn.functional.max_pool2d(z, 2) if stage.pool else z
        if saved is not None:
            saved.append((h, z, indices))
        h = out
    return h


def head_forward(chain: ConvChain, params: Mapping[str, torch.Tensor],
                 a: torch.Tensor) -> torch.Tensor:
    """The Linear/ReLU head, feature-major: a [c, features, b] -> logits [c, classes, b]."""
    for i, (w_key, b_key) in enumerate(chain.head):
        a = torch.baddbmm(params[b_key].unsqueeze(2), params[w_key], a)
        if i + 1 < len(chain.head):
            a = torch.relu(a)
    return a


def conv_chain_grads(chain: ConvChain, params: Mapping[str, torch.Tensor], x: torch.Tensor,
                     target: torch.Tensor) -> tuple[Params, torch.Tensor]:
    """Gradients of every client's weighted cross-entropy, and the losses.

    Args:
        params: name -> [c, *shape], each client's parameters (not modified).
        x: [c, b, C, H, W], each client's mini-batch; target: [c, classes, b] from
            :func:`weighted_targets`.

    Returns:
        (name -> [c, *shape] gradients, float32 [c] losses at ``params``).
    """
    c = x.shape[0]
    saved: list[Saved] = []
    with torch.no_grad():
        top = conv_stages_forward(chain, params, grouped(x).contiguous(
            memory_format=torch.channels_last), c, saved)
    head_keys = [key for pair in chain.head for key in pair]
    with torch.enable_grad():
        leaves = {k: params[k].detach().requires_grad_(True) for k in head_keys}
        features = ungrouped(top, c).requires_grad_(True)
        log_probs = torch.log_softmax(head_forward(chain, leaves, features), dim=1)
        losses = chain_losses(log_probs, target)
        found = torch.autograd.grad(losses.sum(), [features, *leaves.values()])
    grads: Params = dict(zip(head_keys, found[1:], strict=True))
    with torch.no_grad():
        g = regrouped(found[0], top, c).contiguous(memory_format=torch.channels_last)
        for k in range(len(chain.stages) - 1, -1, -1):
            stage, (h, z, indices) = chain.stages[k], saved[k]
            if indices is not None:
                g = aten.max_pool2d_with_indices_backward(g, z, [2, 2], [2, 2], [0, 0],
                                                          [1, 1], False, indices)
            g = aten.threshold_backward(g, z, 0.0)  # ReLU: where its output is > 0
            w = params[stage.weight]
            g_in, g_w, g_b = aten.convolution_backward(
                g, h, _conv_weight(w), [w.shape[0] * w.shape[1]], [1, 1],
                [stage.padding, stage.padding], [1, 1], False, [0, 0], c, [k > 0, True, True])
            grads[stage.weight] = g_w.reshape(w.shape)
            grads[stage.bias] = g_b.reshape(params[stage.bias].shape)
            g = g_in
    return grads, losses.detach()


def conv_chain_training(chain: ConvChain) -> LocalTraining:
    """Local training of a conv chain for a chunk of clients at once
    (:func:`conv_chain_grads`, then ``LocalOptimizer.step`` over the client axis), in place
    on the chunk's parameters."""
    keep_freed_memory()

    def train(params: Params, batches: EdgeRoundBatches, lrs: Sequence[float],
              optimizer: LocalOptimizer,
              buffers: Params | None) -> tuple[torch.Tensor, Params | None]:
        num_classes = params[chain.head[-1][0]].shape[1]
        targets = weighted_targets(batches.y, batches.weight, num_classes)  # [I, c, C, b]
        total = torch.zeros(len(batches.batch), dtype=torch.float64, device=targets.device)
        plain = optimizer == LocalOptimizer()
        with torch.no_grad():
            for s, lr in enumerate(lrs):
                grads, losses = conv_chain_grads(chain, params, batches.x[s], targets[s])
                if plain:  # w.sub_(lr * g): the values of w - lr * g, bit for bit, in place
                    for key, value in params.items():
                        value.sub_(lr * grads[key])
                else:
                    new, buffers = optimizer.step(params, grads, lr, buffers, client_axis=True)
                    for key, value in new.items():
                        params[key].copy_(value)
                total += losses.to(torch.float64)
        return total, buffers

    return train


def conv_chain_logits(chain: ConvChain, params: Mapping[str, torch.Tensor],
                      x: torch.Tensor) -> torch.Tensor:
    """Logits [m, classes] of one model (``params``: name -> [*shape]) on rows x [m, C, H,
    W], with the grouped kernels: rows in groups of :data:`EVAL_GROUP_ROWS`, each group one
    "client" holding the same model, :data:`EVAL_BATCH_ROWS` rows per forward batch (the last
    group padded with zero rows, whose outputs are dropped)."""
    m = x.shape[0]
    out = []
    with torch.no_grad():
        for lo in range(0, m, EVAL_BATCH_ROWS):
            rows = x[lo:lo + EVAL_BATCH_ROWS]
            c = -(-rows.shape[0] // EVAL_GROUP_ROWS)
            pad = c * EVAL_GROUP_ROWS - rows.shape[0]
            if pad:
                rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
            stacked = {k: v.unsqueeze(0).expand(c, *v.shape) for k, v in params.items()}
            h = grouped(rows.reshape(c, EVAL_GROUP_ROWS, *rows.shape[1:])).contiguous(
                memory_format=torch.channels_last)
            logits = head_forward(chain, stacked, ungrouped(
                conv_stages_forward(chain, stacked, h, c), c))  # [c, classes, b]
            out.append(logits.permute(0, 2, 1).reshape(c * EVAL_GROUP_ROWS, -1)
                       [:rows.shape[0] - pad])
    return torch.cat(out) if out else x.new_zeros(0, params[chain.head[-1][1]].shape[0])


def forward_for(model: nn.Module, device: torch.device) -> Forward | None:
    """The batched engines' evaluation forward for ``model`` on ``device``: the grouped
    kernels (:func:`conv_chain_logits`) for a conv chain on the CPU, else None (the model's
    own forward)."""
    chain = conv_chain(model)
    if chain is None or device.type != "cpu":
        return None

    def forward(params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return conv_chain_logits(chain, params, x)

    return forward


_MALLOC_TUNED = False


def keep_freed_memory(threshold: int = 32 * 2**20) -> bool:
    """Ask glibc's allocator to keep freed blocks of up to ``threshold`` bytes (at most its
    32 MiB maximum) for reuse instead of returning them to the system (``mallopt``
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD), once per process; True when set.

    The grouped kernels allocate activations of a few MB per step; returned to the system
    each time, every step pays their page faults again (about a third of a LeNet-5 chunk's
    step, docs/engines.md, "W2'"). Changes no number; elsewhere than glibc it does nothing.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _MALLOC_TUNED = bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
        libc.mallopt(m_trim_threshold, 8 * threshold))
    return _MALLOC_TUNED
