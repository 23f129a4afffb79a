"""Weighted averaging: the one aggregation every engine calls.

Accumulates in float64 and returns the input dtype, so averages do not depend on the
number or order of summands beyond float64 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: the CLI checks names without it
    import torch

from fedhier.common.errors import ConfigError
from fedhier.round.aggregators.robust import Params, clipped_mean, krum, trimmed_mean


def segment_weighted_mean(
    values: torch.Tensor, weights: torch.Tensor, segments: torch.Tensor, num_segments: int
) -> torch.Tensor:
    """Weighted mean of ``values`` within each segment.

    Args:
        values: [n, *shape] one row per member (e.g. per client).
        weights: [n] non-negative weights; a segment's weights must not all be zero.
        segments: [n] int64 segment index of each member, in [0, num_segments).
        num_segments: number of output rows.

    Returns:
        [num_segments, *shape] in ``values.dtype``: sum_k w_k v_k / sum_k w_k per segment,
        accumulated in float64 in member order.

    Computed in tiles (:func:`_tiles`) so that the float64 temporaries stay small (not
    n x P x 8 bytes: GBs at 10,000 clients) and the memory traffic stays linear in n. Each
    column's sum depends on that column only, and the tiles of rows are added in row order,
    so on the CPU the result is bit for bit that of one ``index_add_`` over all rows
    (tests/test_aggregate.py).
    """
    import torch

    w = weights.to(device=values.device, dtype=torch.float64)
    seg = segments.to(device=values.device, dtype=torch.int64)
    totals = torch.zeros(num_segments, dtype=torch.float64, device=values.device)
    totals.index_add_(0, seg, w)
    if bool((totals <= 0).any()):
        raise ValueError("segment_weighted_mean: a segment has zero total weight")
    flat = values.reshape(values.shape[0], -1)
    out = torch.empty(num_segments, flat.shape[1], dtype=values.dtype, device=values.device)
    columns, rows = _tiles(flat.shape[0], flat.shape[1], num_segments)
    for lo in range(0, flat.shape[1], columns):
        block = flat[:, lo:lo + columns]
        acc = torch.zeros(num_segments, block.shape[1], dtype=torch.float64,
                          device=values.device)
        for first in range(0, flat.shape[0], rows):
            part = slice(first, first + rows)
            acc.index_add_(0, seg[part], block[part].to(torch.float64) * w[part, None])
        out[:, lo:lo + columns] = (acc / totals[:, None]).to(values.dtype)
    return out.reshape(num_segments, *values.shape[1:])


#: Entries of one tile of members x columns (its float64 copy: 2 MiB).
AGGREGATE_BLOCK = 2**18
#: Narrowest column block: each member then contributes a contiguous run of >= 1 KiB (float32).
MIN_TILE_COLUMNS = 256


def _tiles(num_members: int, num_columns: int, num_segments: int) -> tuple[int, int]:
    """(columns, rows) of the tiles :func:`segment_weighted_mean` sums: at most
    :data:`AGGREGATE_BLOCK` entries, at least :data:`MIN_TILE_COLUMNS` columns wide (a
    strided read of a few columns from every member costs a cache line per member and
    column block, i.e. quadratic traffic), and a float64 sum [segments, columns] of at most
    16 tiles."""
    columns = max(MIN_TILE_COLUMNS, AGGREGATE_BLOCK // max(num_members, 1))
    columns = min(columns, max(1, 16 * AGGREGATE_BLOCK // max(num_segments, 1)), num_columns)
    columns = max(columns, 1)
    return columns, max(1, AGGREGATE_BLOCK // columns)


def occupied_segments(segments: np.ndarray, num_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """The segments that have members, and each member's index among them.

    Averaging over only some clients (failures, sampling) can leave a node without members;
    its mean is undefined and the caller keeps that node's model instead.

    Args:
        segments: int64 [k], each member's segment in [0, num_segments).

    Returns:
        (occupied int64 [s]: sorted segment ids with at least one member, compact int64 [k]:
        each member's position in ``occupied``). With every segment occupied, compact ==
        segments.
    """
    has = np.zeros(num_segments, dtype=bool)
    has[segments] = True
    position = np.cumsum(has) - 1
    return np.flatnonzero(has), position[segments].astype(np.int64)


def client_weights(weighting: str, num_examples: np.ndarray) -> np.ndarray:
    """float64 [n] averaging weights: ``samples`` = rows per client, ``uniform`` = 1 each."""
    if weighting == "uniform":
        return np.ones(len(num_examples), dtype=np.float64)
    if weighting == "samples":
        return np.asarray(num_examples, dtype=np.float64)
    raise ValueError(f"unknown weighting '{weighting}'")


def presence_weights(weights: np.ndarray, present: np.ndarray,
                     edge_of_client: np.ndarray) -> np.ndarray:
    """Averaging weights when only some clients took part (sampling, failures).

    w~_j = w_j * W_e / S_e for present clients (W_e: the weights of all of edge e's clients,
    S_e: of its present ones), 0 for absent ones. Within an edge this renormalises over the
    present clients; above the edges each edge with a present client keeps its full weight
    W_e, and edges without one drop out. With every client present, w~ = w exactly.

    Args:
        weights: float64 [n]; present: bool [n]; edge_of_client: int64 [n].
    """
    num_edges = int(edge_of_client.max()) + 1 if len(edge_of_client) else 0
    full = np.bincount(edge_of_client, weights=weights, minlength=num_edges)
    kept = np.bincount(edge_of_client, weights=np.where(present, weights, 0.0),
                       minlength=num_edges)
    factor = np.divide(full, kept, out=np.zeros_like(full), where=kept > 0)
    factor[full == kept] = 1.0
    return np.where(present, weights * factor[edge_of_client], 0.0)


# ------------------------------------------------------------------------------ aggregators
def mean_aggregate(values: torch.Tensor, weights: torch.Tensor, segments: torch.Tensor,
                   num_segments: int) -> torch.Tensor:
    """The weighted mean of each segment's members (:func:`segment_weighted_mean`):
    values [k, *shape] -> [num_segments, *shape]."""
    return segment_weighted_mean(values, weights, segments, num_segments)


def median_aggregate(values: torch.Tensor, weights: torch.Tensor, segments: torch.Tensor,
                     num_segments: int) -> torch.Tensor:
    """Coordinate-wise median of each segment's members (weights are ignored): for an even
    count the mean of the two middle values, as ``numpy.median``. Robust to a minority of
    arbitrary (e.g. poisoned) updates in each segment."""
    import torch

    out = torch.empty(num_segments, *values.shape[1:], dtype=values.dtype,
                      device=values.device)
    seg = segments.to(values.device)
    for s in range(num_segments):
        members = values[seg == s]
        if len(members) == 0:
            raise ValueError("median_aggregate: a segment has no members")
        ordered = members.sort(dim=0).values
        k = len(members)
        out[s] = (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
    return out


class AggregateFn(Protocol):
    """values [k, *shape], weights float64 [k], segments int64 [k] -> [num_segments, *shape]."""

    def __call__(self, values: torch.Tensor, weights: torch.Tensor, segments: torch.Tensor,
                 num_segments: int) -> torch.Tensor: ...


class ModelAggregateFn(Protocol):
    """A rule over whole models: values name -> [k, *shape], weights [k], segments [k],
    reference name -> [num_segments, *shape] (each segment's start model, or None) ->
    name -> [num_segments, *shape]."""

    def __call__(self, values: Params, weights: torch.Tensor, segments: torch.Tensor,
                 num_segments: int, reference: Params | None) -> Params: ...



@dataclass(frozen=True)
class Aggregator:
    """An aggregation rule. ``linear``: aggregating aggregates (weighted by their members'
    total weight) equals aggregating all members at once (the mean); a level above the
    edges is then computed directly over the clients of its subtree. ``function`` works
    array by array; ``model_function``, when set, on the whole model (norms, distances);
    ``needs_reference``: it takes each segment's start model (the one place that refuses
    to run it without one); ``name``: as ``--aggregators`` spells it."""

    function: AggregateFn | None
    linear: bool
    model_function: ModelAggregateFn | None = None
    needs_reference: bool = False
    name: str = ""
    #: the fewest members of a node at which the rule can leave one hostile member out
    #: (docs/security.md); 1: any node; None: no size (a rule that is the mean, or not robust)
    min_members: int | None = 1

    def apply(self, values: Params, weights: torch.Tensor, segments: torch.Tensor,
              num_segments: int, reference: Params | None = None) -> Params:
        """The rule on every array of ``values``: name -> [num_segments, *shape]."""
        if self.needs_reference and reference is None:
            raise ConfigError(f"aggregator '{self.name}' needs each node's start model, "
                              "which this path does not provide")
        if self.model_function is not None:
            return self.model_function(values, weights, segments, num_segments, reference)
        assert self.function is not None
        return {k: self.function(v, weights, segments, num_segments) for k, v in values.items()}


def _trimmed(fraction: float) -> Aggregator:
    if not 0 <= fraction < 0.5:
        raise ConfigError(f"trimmed-mean:{fraction}: the fraction cut at each end must be "
                          "in [0, 0.5)")
    # it trims min(floor(b k), (k - 1) // 2) members at each end: >= 1 from this k on
    least = next((k for k in range(3, 10**6) if math.floor(fraction * k) >= 1), None)
    return Aggregator(lambda v, w, s, n: trimmed_mean(v, s, n, fraction), linear=False,
                      min_members=least)


def _clip(arg: str) -> Aggregator:

    relative = arg.endswith("x")
    bound = _number("clip", arg[:-1] if relative else arg)
    if not bound > 0:
        raise ConfigError(f"clip:{arg}: the bound must be positive (a norm, or Cx for C "
                          "times the median norm)")

    def rule(values: Params, weights: torch.Tensor, segments: torch.Tensor,
             num_segments: int, reference: Params | None) -> Params:
        assert reference is not None  # Aggregator.apply checks it (needs_reference)
        return clipped_mean(values, weights, segments, num_segments, reference, bound,
                            relative)

    # tau from the median norm: honest only with an honest majority, 2 of 3
    return Aggregator(None, linear=False, model_function=rule, needs_reference=True,
                      min_members=3 if relative else 1)


def _krum(arg: str, multi: bool) -> Aggregator:

    f = _number("krum", arg)
    if f != int(f) or f < 0:
        raise ConfigError(f"krum:{arg}: f (hostile members per node) must be a whole "
                          "number >= 0")
    def rule(values: Params, weights: torch.Tensor, segments: torch.Tensor,
             num_segments: int, reference: Params | None) -> Params:
        return krum(values, weights, segments, num_segments, int(f), multi)

    # each score sums k - f - 2 nearest others: k > 2 f + 2 (Blanchard et al., 2017);
    # multi-Krum with f = 0 keeps every member: the mean
    least = None if multi and f == 0 else 2 * int(f) + 3
    return Aggregator(None, linear=False, model_function=rule, min_members=least)


def _number(rule: str, text: str) -> float:
    """A rule's parameter: a finite number (nan, inf and 1e400 are refused here, once)."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"aggregator {rule}: '{text}' is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"aggregator {rule}: '{text}' is not a finite number")
    return value


#: Aggregation rules by name (``--aggregators``): one function plus one line here adds one.
AGGREGATORS: dict[str, Aggregator] = {
    "mean": Aggregator(mean_aggregate, linear=True, min_members=None),
    "median": Aggregator(median_aggregate, linear=False, min_members=3),
    "trimmed-mean": _trimmed(0.2),
    "clip": _clip("1x"),
    "krum": _krum("1", multi=False),
    "multi-krum": _krum("1", multi=True),
}

#: Rules that take a parameter as ``name:value`` (e.g. ``trimmed-mean:0.1``, ``clip:2x``).
PARAMETRISED: dict[str, Callable[[str], Aggregator]] = {
    "trimmed-mean": lambda a: _trimmed(_number("trimmed-mean", a)),
    "clip": _clip,
    "krum": lambda a: _krum(a, multi=False),
    "multi-krum": lambda a: _krum(a, multi=True),
}


def aggregator(name: str) -> Aggregator:
    """The rule named ``name`` or ``name:parameter`` (ConfigError when unknown)."""
    base, _, arg = name.partition(":")
    if base not in AGGREGATORS:
        raise ConfigError(f"unknown aggregator '{base}'; choose one of "
                          f"{', '.join(AGGREGATORS)}")
    if not arg:
        return replace(AGGREGATORS[base], name=name)
    if base not in PARAMETRISED:
        raise ConfigError(f"aggregator '{base}' takes no parameter, got '{name}'")
    return replace(PARAMETRISED[base](arg), name=name)


def check_aggregators(names: tuple[str, ...], num_levels: int) -> None:
    """One name for every level, or one per level (edge ... cloud)."""
    for name in names:
        aggregator(name)
    if len(names) not in (1, num_levels):
        raise ConfigError(f"aggregators: give one name for every level or {num_levels} "
                          f"(edge ... cloud), got {len(names)}: {','.join(names)}")


def check_metrics_aggregator(name: str, aggregators: tuple[str, ...] = ()) -> None:
    """``--metrics-aggregator``: ``mean``, ``model`` (the cloud level's rule of
    ``aggregators``) or a rule that needs no start model (ConfigError otherwise)."""
    if name == "model":
        name = aggregators[-1] if aggregators else "mean"
    if aggregator(name).needs_reference:
        raise ConfigError(f"metrics_aggregator '{name}': clip bounds updates from a start "
                          "model, which a metric has not; choose mean, median, "
                          "trimmed-mean[:b], krum[:f], multi-krum[:f] or model")


def robust_mean(values: np.ndarray, weights: np.ndarray, rule: str) -> float:
    """The rule ``rule`` (a name of :data:`AGGREGATORS`, not ``clip``) over k clients'
    values of one metric (float64 [k], weights float64 [k]), as it aggregates a model of one
    entry; ``mean``: sum w v / sum w."""
    if rule == "mean":
        return float(np.dot(weights, values) / weights.sum())
    import torch

    out = aggregator(rule).apply({"m": torch.as_tensor(values, dtype=torch.float64)[:, None]},
                                 torch.as_tensor(weights, dtype=torch.float64),
                                 torch.zeros(len(values), dtype=torch.int64), 1)
    return float(out["m"][0, 0])
