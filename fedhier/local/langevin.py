"""Langevin noise on the local step (SGLD, Welling and Teh 2011; Yin et al.'s diversity
mechanism).

With temperature T > 0 every local step becomes w <- step(w) + sqrt(2 eta_t T) xi, where
step(w) is the optimiser's update (plain SGD: w - eta_t g), eta_t the step's learning rate
and xi ~ N(0, I) over every parameter. The noise is a pure function of (seed, client, global
step): ``generator(seed, "langevin", client, t).standard_normal(P)`` (float64, P = all
parameters, the tensors in sorted name order), scaled in float64 and rounded to the
parameters' dtype, so every engine adds the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedhier.common.rng import generator

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Langevin:
    """SGLD's Gaussian term at ``temperature`` for a run with ``seed`` (0 = off)."""

    temperature: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.temperature > 0

    def scale(self, lr: float) -> float:
        """The noise's standard deviation sqrt(2 eta T) at learning rate ``lr``."""
        return math.sqrt(2.0 * float(lr) * self.temperature)

    def noise(self, like: Mapping[str, torch.Tensor], clients: Sequence[int], step: int,
              lr: float) -> Params:
        """name -> [c, *shape]: the noise of global step ``step`` for ``clients`` (row j is
        client ``clients[j]``), shaped like ``like``'s [c, *shape] tensors."""
        names = sorted(like)
        sizes = [int(like[k][0].numel()) for k in names]
        draws = np.empty((len(clients), sum(sizes)), dtype=np.float64)
        for row, client in enumerate(clients):
            draws[row] = generator(self.seed, "langevin", int(client),
                                   int(step)).standard_normal(sum(sizes))
        draws *= self.scale(lr)
        out: Params = {}
        at = 0
        for name, size in zip(names, sizes, strict=True):
            target = like[name]
            block = torch.from_numpy(draws[:, at:at + size].astype(np.float32))
            out[name] = block.to(device=target.device, dtype=target.dtype).reshape(target.shape)
            at += size
        return out

    @torch.no_grad()
    def perturb_(self, params: Mapping[str, torch.Tensor], clients: Sequence[int], step: int,
                 lr: float) -> None:
        """Add step ``step``'s noise to the clients' parameters (name -> [c, *shape]) in
        place."""
        for name, value in self.noise(params, clients, step, lr).items():
            params[name].add_(value)

    @torch.no_grad()
    def perturb_one_(self, params: Mapping[str, torch.Tensor], client: int, step: int,
                     lr: float) -> None:
        """:meth:`perturb_` for one client's parameters (name -> [*shape])."""
        noise = self.noise({k: v[None] for k, v in params.items()}, [client], step, lr)
        for name, value in noise.items():
            params[name].add_(value[0])
