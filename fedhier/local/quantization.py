"""Stochastic quantisation of a client's update (QSGD; Yin et al.'s diversity mechanism).

What is quantised: the update a client sends up at the end of its edge round,
u = w_end - w_start (w_start: the model it started the edge round from), one parameter
tensor at a time. The edge receives w_start + Q(u), so averaging the received models is
averaging the quantised updates. This is uplink compression in hierarchical FL
(client -> edge); what the edges send up, and every download, stay full precision.

QSGD with s levels (Alistarh et al. 2017): coordinate i of a tensor v is sent as
``||v|| * sign(v_i) * xi_i / s`` with xi_i = l or l + 1, where l = floor(s |v_i| / ||v||),
and xi_i = l + 1 with probability s |v_i| / ||v|| - l. So E[Q(v)] = v (unbiased) and
E||Q(v) - v||^2 = (||v|| / s)^2 sum_i p_i (1 - p_i) <= min(n / s^2, sqrt(n) / s) ||v||^2
(n = the tensor's size). ``b`` bits per value hold a sign and a level 0..s, so
s = 2**(b - 1) - 1 (b >= 2); each tensor also sends its norm as one float32.

Randomness is a pure function of (seed, client, start step): the uniform draws of client c's
edge round that starts at global step t are ``generator(seed, "quantize", c, t).random(P)``
(P = all parameters, the tensors in sorted name order), so every engine quantises alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedhier.common.errors import ConfigError
from fedhier.common.rng import generator
from fedhier.settings.declaration import RANGES

Params = dict[str, torch.Tensor]

#: The most bits per value fedhier quantises to (the declared range of ``quantize_bits``).
MAX_BITS = int(RANGES["quantize_bits"].high or 0)


def levels(bits: int) -> int:
    """s, the number of nonzero levels of ``bits`` bits per value (sign + level 0..s)."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def check_bits(bits: int) -> None:
    """A one-line ConfigError unless ``bits`` is 0 (off) or 2..MAX_BITS."""
    if bits != 0 and not 2 <= bits <= MAX_BITS:
        raise ConfigError(f"quantize_bits must be 0 (off) or 2..{MAX_BITS} bits per value "
                          f"(a sign and s = 2**(b-1) - 1 levels), got {bits}")


def quantize(v: torch.Tensor, s: int, uniforms: torch.Tensor) -> torch.Tensor:
    """QSGD of each row of v (float64 [c, n]) with s levels and uniform draws [c, n] in
    [0, 1): float64 [c, n], row j = ||v_j|| sign(v_j) xi_j / s (module docstring)."""
    norm = v.pow(2).sum(dim=1, keepdim=True).sqrt()
    ratio = (v.abs() / torch.where(norm > 0, norm, 1.0) * s).clamp_(0.0, float(s))
    level = ratio.floor()
    level += (uniforms < ratio - level).to(v.dtype)
    return v.sign() * level * (norm / s)


def client_uniforms(seed: int, clients: Sequence[int], start_step: int,
                    total: int) -> np.ndarray:
    """float64 [c, total]: each client's uniform draws of the edge round from ``start_step``."""
    out = np.empty((len(clients), total), dtype=np.float64)
    for row, client in enumerate(clients):
        out[row] = generator(seed, "quantize", int(client), int(start_step)).random(total)
    return out


def quantize_updates(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], *,
                     bits: int, seed: int, clients: Sequence[int],
                     start_step: int) -> Params:
    """The models the clients send up: start + Q(end - start), per tensor.

    Args:
        start, end: name -> [c, *shape], the clients' models at the start and the end of
            the edge round (row j is client ``clients[j]``).
        bits: bits per value (2..16); seed, start_step: key the draws with the client ids.

    Returns:
        name -> [c, *shape] in ``end``'s dtype and device.
    """
    s = levels(bits)
    names = sorted(end)
    sizes = [int(end[k][0].numel()) for k in names]
    draws = torch.as_tensor(client_uniforms(seed, clients, start_step, sum(sizes)))
    out: Params = {}
    at = 0
    for name, size in zip(names, sizes, strict=True):
        base, last = start[name], end[name]
        update = (last - base).reshape(len(clients), -1).to(torch.float64)
        u = draws[:, at:at + size].to(update.device)
        at += size
        q = quantize(update, s, u).to(last.dtype).reshape(last.shape)
        out[name] = base + q
    return {k: out[k] for k in end}


def quantize_update(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], *,
                    bits: int, seed: int, client: int, start_step: int) -> Params:
    """:func:`quantize_updates` for one client's models (name -> [*shape])."""
    out = quantize_updates({k: v[None] for k, v in start.items()},
                           {k: v[None] for k, v in end.items()}, bits=bits, seed=seed,
                           clients=[client], start_step=start_step)
    return {k: v[0] for k, v in out.items()}


def upload_bytes(params: Mapping[str, torch.Tensor], model_bytes: int, bits: int) -> int:
    """Bytes of one quantised upload: ``model_bytes`` (one full model as the engines count
    it) with each tensor's values replaced by ceil(n b / 8) bytes plus its float32 norm;
    ``model_bytes`` itself when ``bits`` is 0."""
    if bits == 0:
        return model_bytes
    full = sum(v.numel() * v.element_size() for v in params.values())
    packed = sum(math.ceil(v.numel() * bits / 8) + 4 for v in params.values())
    return int(model_bytes - full + packed)
