"""The batched local-SGD kernels against their step-by-step formulation, bit for bit.

``linear_chain_training`` keeps each step's log-probabilities and reduces the losses once per
call, and writes the ReLU backward into its own product; the reference below is the
formulation before that (autograd equality: tests/test_vectorized.py).
"""

from __future__ import annotations

import numpy as np
import torch

from fedhier.engines.vectorized.kernels import (
    EdgeRoundBatches,
    linear_chain_pass,
    linear_chain_training,
    weighted_targets,
)
from fedhier.local.optimizer import LocalOptimizer

LAYERS = [("0.weight", "0.bias"), ("2.weight", "2.bias")]


def reference_training(params: dict[str, torch.Tensor], batches: EdgeRoundBatches,
                       lrs: list[float]) -> torch.Tensor:
    """Plain SGD, one loss reduction and one float64 sum per step (the earlier kernel)."""
    targets = weighted_targets(batches.y, batches.weight, 10)
    weight = batches.weight.unsqueeze(1)
    total = torch.zeros(len(batches.batch), dtype=torch.float64)
    for s, lr in enumerate(lrs):
        c, b = batches.x.shape[1], batches.x.shape[2]
        a0 = batches.x[s].reshape(c, b, -1).transpose(1, 2)
        a1 = torch.baddbmm(params["0.bias"].unsqueeze(2), params["0.weight"], a0).relu_()
        z = torch.baddbmm(params["2.bias"].unsqueeze(2), params["2.weight"], a1)
        log_probs = torch.log_softmax(z, dim=1)
        total += -(log_probs * targets[s]).sum(dim=(1, 2))
        delta = torch.exp(log_probs).mul_(weight).sub_(targets[s])
        below = torch.ops.aten.threshold_backward(
            torch.bmm(params["2.weight"].transpose(1, 2), delta), a1, 0.0)
        params["2.weight"].baddbmm_(delta, a1.transpose(1, 2), alpha=-lr)
        params["2.bias"].sub_(delta.sum(dim=2), alpha=lr)
        params["0.weight"].baddbmm_(below, a0.transpose(1, 2), alpha=-lr)
        params["0.bias"].sub_(below.sum(dim=2), alpha=lr)
    return total


def make_chunk(clients: int = 6, steps: int = 5, width: int = 16):
    """A W1-shaped chunk (mlp 64-128-10) with padded clients (b_j from 3 to 16)."""
    gen = torch.Generator().manual_seed(0)
    batch = np.array([3, 16, 7, 16, 12, 5][:clients], dtype=np.int64)
    weight = np.zeros((clients, width), dtype=np.float32)
    for j, b in enumerate(batch):
        weight[j, :b] = np.float32(1.0) / np.float32(b)
    batches = EdgeRoundBatches(
        x=torch.randn(steps, clients, width, 64, generator=gen),
        y=torch.randint(0, 10, (steps, clients, width), generator=gen),
        weight=torch.as_tensor(weight), batch=batch)
    params = {"0.weight": 0.1 * torch.randn(clients, 128, 64, generator=gen),
              "0.bias": 0.1 * torch.randn(clients, 128, generator=gen),
              "2.weight": 0.1 * torch.randn(clients, 10, 128, generator=gen),
              "2.bias": 0.1 * torch.randn(clients, 10, generator=gen)}
    return params, batches


def test_fused_training_equals_step_by_step_bit_for_bit() -> None:
    params, batches = make_chunk()
    lrs = [0.1, 0.1, 0.05, 0.05, 0.02]
    expected = {k: v.clone() for k, v in params.items()}
    expected_loss = reference_training(expected, batches, lrs)
    loss, buffers = linear_chain_training(LAYERS)(params, batches, lrs, LocalOptimizer(), None)
    assert buffers is None
    assert loss.dtype == torch.float64 and torch.equal(loss, expected_loss)
    for key, value in expected.items():
        assert torch.equal(params[key], value), key


def test_pass_loss_is_the_step_losses() -> None:
    """linear_chain_pass' loss = the reference's first-step loss, and its gradients applied
    by hand = the fused in-place update, bit for bit."""
    params, batches = make_chunk(steps=1)
    ref = {k: v.clone() for k, v in params.items()}
    expected_loss = reference_training(ref, batches, [0.1])
    targets = weighted_targets(batches.y, batches.weight, 10)
    grads, loss = linear_chain_pass(params, LAYERS, batches.x[0], targets[0],
                                    batches.weight.unsqueeze(1))
    assert torch.equal(loss.to(torch.float64), expected_loss)
    fused = {k: v.clone() for k, v in params.items()}
    _, loss_fused = linear_chain_pass(fused, LAYERS, batches.x[0], targets[0],
                                      batches.weight.unsqueeze(1), lr=0.1)
    assert torch.equal(loss_fused, loss)
    for key, value in ref.items():
        assert torch.equal(fused[key], value), key
        assert grads[key].shape == params[key].shape
