"""Yin et al.'s diversity-inducing mechanisms applied to per-example gradients, for the
``diversity`` suite (fedhier/studies/experiments/diversity_suite.py).

Each mechanism maps the per-example gradients of a step (name -> [B, *shape]) to what the
step averages, a pure function of (seed, step); ``step`` 2**31 is the stream apart from the
training steps that the suite's Δ is measured with.

- ``dropout``: DropConnect-like masks, every coordinate kept with probability p and rescaled
  by 1/p (unbiased);
- ``quantize``: QSGD of each example's whole gradient with the quantiser of the
  ``--quantize-bits`` option (:func:`fedhier.local.quantization.quantize`), unbiased;
- ``langevin``: each example's gradient plus N(0, sigma^2 I). Averaged over a batch of B
  it adds N(0, sigma^2 / B) to the step's gradient: the Langevin step of ``--langevin-
  temperature`` T = eta sigma^2 / (2 B) at learning rate eta.

Every mechanism leaves the expected gradient unchanged and raises E Σ_k ||g_k||² while
E ||Σ_k g_k||² rises by less, so Δ grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedhier.common.rng import generator, torch_seed
from fedhier.local.quantization import levels, quantize

Grads = dict[str, torch.Tensor]
#: The step index of the draws Δ is measured with (apart from every training step).
MEASURE_STEP = 2**31


@dataclass(frozen=True)
class Mechanism:
    """A named mechanism: ``apply(grads, seed, step)`` -> grads of the same shapes."""

    name: str
    apply: Callable[[Grads, int, int], Grads]

    def __call__(self, grads: Grads, seed: int, step: int) -> Grads:
        return self.apply(grads, seed, step)


def _flat(grads: Grads) -> tuple[torch.Tensor, list[tuple[str, torch.Size, int]]]:
    names = sorted(grads)
    batch = next(iter(grads.values())).shape[0]
    parts = [(k, grads[k].shape, int(grads[k][0].numel())) for k in names]
    flat = torch.cat([grads[k].reshape(batch, -1) for k in names], dim=1)
    return flat, parts


def _unflat(flat: torch.Tensor, parts: list[tuple[str, torch.Size, int]],
            dtype: torch.dtype) -> Grads:
    out: Grads = {}
    at = 0
    for name, shape, size in parts:
        out[name] = flat[:, at:at + size].to(dtype).reshape(shape)
        at += size
    return out


def dropout(keep: float) -> Mechanism:
    """DropConnect-like masking with keep probability ``keep`` (rescaled by 1/keep)."""

    def apply(grads: Grads, seed: int, step: int) -> Grads:
        gen = torch.Generator().manual_seed(torch_seed(seed, "dropout-mask", step))
        return {k: g * (torch.rand(g.shape, generator=gen) < keep) / keep
                for k, g in grads.items()}

    return Mechanism(f"dropout (keep {keep})", apply)


def quantized(bits: int) -> Mechanism:
    """QSGD of each example's gradient to ``bits`` bits per value (s = 2**(bits-1) - 1)."""
    s = levels(bits)

    def apply(grads: Grads, seed: int, step: int) -> Grads:
        flat, parts = _flat(grads)
        u = torch.as_tensor(generator(seed, "quantize-examples", step).random(flat.shape))
        dtype = next(iter(grads.values())).dtype
        return _unflat(quantize(flat.to(torch.float64), s, u), parts, dtype)

    return Mechanism(f"quantised ({bits} bits, s={s})", apply)


def langevin(sigma: float, name: str | None = None) -> Mechanism:
    """Each example's gradient plus N(0, sigma^2 I) (``name``: the label, default with
    sigma)."""

    def apply(grads: Grads, seed: int, step: int) -> Grads:
        flat, parts = _flat(grads)
        noise = generator(seed, "langevin-examples", step).standard_normal(flat.shape)
        dtype = next(iter(grads.values())).dtype
        return _unflat(flat.to(torch.float64) + sigma * torch.as_tensor(noise), parts, dtype)

    return Mechanism(name or f"Langevin (sigma={sigma:.3g})", apply)


def matched_sigma(grads: Grads, ratio: float = 1.0) -> float:
    """sigma with d sigma^2 = ``ratio`` x the mean ||g_k||^2 (d parameters): noise of the
    gradients' own size."""
    flat, _ = _flat(grads)
    mean_square = float(flat.to(torch.float64).pow(2).sum(1).mean())
    return math.sqrt(ratio * mean_square / flat.shape[1])


def equivalent_temperature(sigma: float, lr: float, batch: int) -> float:
    """The ``--langevin-temperature`` whose step noise equals sigma's averaged over a batch."""
    return lr * sigma**2 / (2 * batch)


def mean_gradient(grads: Grads) -> Grads:
    """The step's gradient: the mean over the batch."""
    return {k: v.mean(0) for k, v in grads.items()}


