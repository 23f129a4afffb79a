"""How asynchronous reports make the new model: FedBuff, FedAsync and the shifted mean.

The K reports r = 1..K a buffering node takes each carry a model x_r trained from the start
model b_r (the global model τ_r cloud aggregations ago: its *staleness*), a data weight W_r
and the update Δ_r = x_r - b_r; w is the current global model and π_r = W_r / Σ_q W_q.

* ``fedbuff`` (Nguyen et al., AISTATS 2022, eq. of Algorithm 1 with data weights inside Δ):
  w + η_g Σ_r π_r s(τ_r) Δ_r. The discount is not renormalised over the buffer: stale
  updates move the model less than fresh ones (with K = 1 and τ > 0 too).
* ``fedasync`` (Xie, Koyejo, Gupta 2019, eq. of Algorithm 1): w + Σ_r π_r α_r (x_r - w),
  α_r = α s(τ_r); for K = 1 that is the paper's w <- (1 - α_t) w + α_t x. The stale model
  itself is mixed in (not its update moved to w).
* ``shifted-mean`` (fedhier before this rule had a name): w + Σ_r W_r s(τ_r) Δ_r /
  Σ_r W_r s(τ_r): each update moved to w and the discounts renormalised, so with K = 1, or
  when every report is equally stale, a stale update is applied in full.

s is the staleness function (:class:`StalenessFunction`): polynomial (1 + τ)^(-a) (a = 1/2
is FedBuff's 1/sqrt(1 + τ)), hinge (1 for τ <= b, else 1 / (a (τ - b) + 1)) or constant 1.

Every rule is one form, which is what :func:`fedhier.round.asynchrony.reports.merge_reports`
computes through the tree's aggregators::

    w_new = w + ρ (M - w),   M = Σ_r c_r (x_r + m_r) / Σ_r c_r,   c_r = W_r f_r

    rule          f_r (factors)   m_r (moves)      ρ (scale)
    shifted-mean  s(τ_r)          w - b_r          1
    fedbuff       s(τ_r)          w - b_r          η_g Σ_r c_r / Σ_r W_r
    fedasync      α s(τ_r)        0                Σ_r c_r / Σ_r W_r

M is the reports' c-weighted mean (any level's aggregator in its place: median, clip, ...),
and :func:`finish` returns M itself when ρ is exactly 1 (every report fresh with η_g = 1,
or α = 1: the synchronous mean bit for bit). :func:`combine` is the form over one model per
report, the rule as the papers write it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedhier.common.errors import ConfigError
from fedhier.settings.declaration import names_of

if TYPE_CHECKING:  # torch is imported where it is used: the CLI checks settings without it
    import torch

Params = dict[str, "torch.Tensor"]

#: the rules, the literature's first (the default: docs/hsgd.md, "Asynchronous edges")
ASYNC_RULES = names_of("async_rule")
#: the staleness functions and how many parameters each takes
STALENESS_FUNCTIONS = {"polynomial": 1, "hinge": 2, "constant": 0}


@dataclass(frozen=True)
class StalenessFunction:
    """s(τ): ``polynomial`` (1 + τ)^(-a), ``hinge`` 1 for τ <= b else 1 / (a (τ - b) + 1),
    ``constant`` 1 (a, b >= 0; τ in cloud aggregations)."""

    kind: str = "polynomial"
    a: float = 0.5
    b: float = 0.0

    def __call__(self, staleness: np.ndarray) -> np.ndarray:
        """float64 [K]: s of int [K] stalenesses (0 gives 1 under every function)."""
        tau = np.asarray(staleness, dtype=np.float64)
        if self.kind == "constant":
            return np.ones_like(tau)
        if self.kind == "hinge":
            return np.where(tau <= self.b, 1.0, 1.0 / (self.a * (tau - self.b) + 1.0))
        if self.a == 0.5:  # sqrt is correctly rounded (pow need not be): FedBuff's exactly
            return 1.0 / np.sqrt(1.0 + tau)
        return np.power(1.0 + tau, -self.a)

    @property
    def spec(self) -> str:
        """The setting's text: ``polynomial:A``, ``hinge:A:B`` or ``constant``."""
        args = {"polynomial": (self.a,), "hinge": (self.a, self.b), "constant": ()}[self.kind]
        return ":".join([self.kind, *(_number(x) for x in args)])


def staleness_function(spec: str) -> StalenessFunction:
    """Parse ``polynomial:A``, ``hinge:A:B`` or ``constant`` (one-line ConfigError)."""
    kind, *args = str(spec).strip().split(":")
    if kind not in STALENESS_FUNCTIONS:
        raise ConfigError(f"staleness_fn: unknown function '{kind}'; choose polynomial:A, "
                          "hinge:A:B or constant")
    want = STALENESS_FUNCTIONS[kind]
    if len(args) != want:
        shape = {"polynomial": "polynomial:A (e.g. polynomial:0.5)",
                 "hinge": "hinge:A:B (e.g. hinge:10:4)", "constant": "constant"}[kind]
        raise ConfigError(f"staleness_fn '{spec}': {kind} takes {want} parameter"
                          f"{'s' if want != 1 else ''}; write {shape}")
    values = []
    for name, text in zip("ab", args, strict=False):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"staleness_fn '{spec}': {name} must be a finite number >= 0, "
                              f"got '{text}'")
        values.append(value)
    return StalenessFunction(kind, *values)


@dataclass(frozen=True)
class AsyncRule:
    """A rule and its settings: ``server_lr`` η_g (fedbuff), ``mixing`` α (fedasync),
    ``staleness`` s (every rule)."""

    name: str = "fedbuff"
    server_lr: float = 1.0
    mixing: float = 0.5
    staleness: StalenessFunction = field(default_factory=StalenessFunction)

    def check(self) -> None:
        """One-line ConfigErrors for a rule no run could honour."""
        if self.name not in ASYNC_RULES:
            raise ConfigError(f"unknown async_rule '{self.name}'; choose one of "
                              f"{', '.join(ASYNC_RULES)}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ConfigError(f"async_server_lr must be > 0, got {self.server_lr}")
        if not (0 < self.mixing <= 1):
            raise ConfigError(f"async_mixing must be in (0, 1], got {self.mixing}")

    def factors(self, staleness: np.ndarray) -> np.ndarray:
        """float64 [K]: f_r, each report's multiplier of its data weight."""
        discount = self.staleness(staleness)
        return self.mixing * discount if self.name == "fedasync" else discount

    @property
    def moves(self) -> bool:
        """Whether a report is moved to the current model (x_r + w - b_r) before the mean."""
        return self.name != "fedasync"

    def scale(self, discounted: float, total: float) -> float:
        """ρ from Σ c_r (``discounted``) and Σ W_r (``total``): exactly η_g (fedbuff) or 1
        (fedasync) when they are equal (every factor 1; x / x is 1 in floating point)."""
        if self.name == "shifted-mean":
            return 1.0
        return (self.server_lr if self.name == "fedbuff" else 1.0) * (discounted / total)


#: today's rule before it had a name, as published runs used it
SHIFTED_MEAN = AsyncRule("shifted-mean")


def finish(current: Params, averaged: Params, scale: float) -> Params:
    """w + ρ (M - w), or M itself when ρ is exactly 1 (``averaged``: M, name -> [*shape])."""
    if scale == 1.0:
        return averaged
    return {k: current[k] + scale * (averaged[k] - current[k]) for k in averaged}


def combine(rule: AsyncRule, current: Params, models: Params, bases: Params,
            weights: np.ndarray, staleness: np.ndarray) -> Params:
    """The new model from K reports as the papers write the rules (module docstring).

    Args:
        current: w, name -> [*shape]; models: x_r, name -> [K, *shape]; bases: b_r, the
            models they started from, name -> [K, *shape]; weights: float64 [K], W_r;
            staleness: int [K], τ_r in cloud aggregations.
    """
    weights = np.asarray(weights, dtype=np.float64)
    c = weights * rule.factors(staleness)
    share = c / c.sum()
    import torch

    out: Params = {}
    for k, x in models.items():
        coef = torch.as_tensor(share, dtype=x.dtype, device=x.device).reshape(
            -1, *([1] * (x.dim() - 1)))
        moved = x + (current[k].unsqueeze(0) - bases[k]) if rule.moves else x
        out[k] = (coef * moved).sum(0)
    return finish(current, out, rule.scale(float(c.sum()), float(weights.sum())))


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)
