"""Robust aggregation rules: trimmed mean, norm-bounded (clipped) mean, Krum and multi-Krum.

Each rule maps the members of each segment (a node's children: clients or lower nodes) to
one model per segment, like :func:`fedhier.round.aggregators.averaging.segment_weighted_mean`, and
is registered by name in :data:`fedhier.round.aggregators.averaging.AGGREGATORS`
(``--aggregators``). All arithmetic is float64; results come back in the members' dtype.

- ``trimmed-mean[:b]``: coordinate-wise, drop the ``floor(b k)`` smallest and largest of
  the k members' values, average the rest (unweighted). Default b = 0.2.
- ``clip[:t]``: the weighted mean of ``r + clip(v_i - r)``, r the segment's start model (the
  node's model before this aggregation), clip(d) = d min(1, tau / ||d||) with ||.|| the
  Euclidean norm over the whole model; ``t`` = ``Cx`` gives tau = C x the median of the
  members' norms (default ``1x``), a plain number a fixed tau.
- ``krum[:f]`` / ``multi-krum[:f]``: each member's score is the sum of squared distances
  (whole model) to its ``k - f - 2`` nearest other members (at least 1); Krum takes the
  lowest-scoring member, multi-Krum the weighted mean of the ``k - f`` lowest (ties: the
  lower member index). Default f = 1.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI checks names without it
    import torch

Params = dict[str, "torch.Tensor"]


def _flat(values: Params, rows: torch.Tensor) -> torch.Tensor:
    """float64 [len(rows), P]: the members' models concatenated in sorted key order."""
    import torch

    return torch.cat([values[k].index_select(0, rows).reshape(len(rows), -1).to(torch.float64)
                      for k in sorted(values)], dim=1)


def _unflat(flat: torch.Tensor, like: Params, s: int, out: Params) -> None:
    """Write the float64 [P] model ``flat`` into row ``s`` of ``out`` (``like``'s shapes)."""
    at = 0
    for key in sorted(like):
        size = like[key][0].numel()
        out[key][s] = flat[at:at + size].reshape(like[key].shape[1:]).to(out[key].dtype)
        at += size


def _empty(values: Params, num_segments: int) -> Params:
    import torch

    return {k: torch.empty(num_segments, *v.shape[1:], dtype=v.dtype, device=v.device)
            for k, v in values.items()}


def _members(segments: torch.Tensor, s: int, rule: str) -> torch.Tensor:
    import torch

    rows = torch.nonzero(segments == s).reshape(-1)
    if len(rows) == 0:
        raise ValueError(f"{rule}: a segment has no members")
    return rows


def _take(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return weights.index_select(0, rows.to(weights.device))


def _weighted_mean(flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 [P]: sum_i w_i x_i / sum_i w_i over the rows of ``flat``."""
    import torch

    w = weights.to(device=flat.device, dtype=torch.float64)
    return (flat * w[:, None]).sum(0) / w.sum()


def trimmed_mean(values: torch.Tensor, segments: torch.Tensor, num_segments: int,
                 fraction: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean of each segment: values [k, *shape] -> [num_segments,
    *shape]; b = floor(fraction k) members cut at each end per coordinate (fewer when
    2b >= k would leave none)."""
    import torch

    out = torch.empty(num_segments, *values.shape[1:], dtype=values.dtype,
                      device=values.device)
    seg = segments.to(values.device)
    for s in range(num_segments):
        rows = _members(seg, s, "trimmed-mean")
        k = len(rows)
        cut = min(math.floor(fraction * k), (k - 1) // 2)
        ordered = values.index_select(0, rows).to(torch.float64).sort(dim=0).values
        out[s] = ordered[cut:k - cut].mean(dim=0).to(values.dtype)
    return out


def clipped_mean(values: Params, weights: torch.Tensor, segments: torch.Tensor,
                 num_segments: int, reference: Params, bound: float,
                 relative: bool) -> Params:
    """The norm-bounded mean: each member's update v_i - r_s (whole model, r_s = segment
    s's start model ``reference[k][s]``) scaled down to norm at most tau, then the weighted
    mean added to r_s. tau = ``bound`` x median norm when ``relative``, else ``bound``."""
    import torch

    out = _empty(values, num_segments)
    seg = segments.to(next(iter(values.values())).device)
    for s in range(num_segments):
        rows = _members(seg, s, "clip")
        start = _flat(reference, torch.tensor([s], device=rows.device))[0]
        updates = _flat(values, rows) - start
        norms = updates.norm(dim=1)
        ordered = norms.sort().values  # the median as numpy defines it
        median = float(ordered[(len(rows) - 1) // 2] + ordered[len(rows) // 2]) / 2
        tau = bound * median if relative else bound
        scale = torch.where(norms > tau, tau / norms.clamp_min(1e-300),
                            torch.ones_like(norms))
        _unflat(start + _weighted_mean(updates * scale[:, None], _take(weights, rows)),
                values, s, out)
    return out


def krum_scores(flat: torch.Tensor, byzantine: int) -> torch.Tensor:
    """float64 [k]: each row's sum of squared distances to its ``max(1, k - f - 2)`` nearest
    other rows (k = 1: 0)."""
    import torch

    k = len(flat)
    if k == 1:
        return torch.zeros(1, dtype=torch.float64, device=flat.device)
    dist = torch.cdist(flat[None], flat[None])[0] ** 2
    dist.fill_diagonal_(float("inf"))
    nearest = max(1, k - byzantine - 2)
    return dist.sort(dim=1).values[:, :nearest].sum(dim=1)


def krum(values: Params, weights: torch.Tensor, segments: torch.Tensor, num_segments: int,
         byzantine: int, multi: bool) -> Params:
    """Krum (one member) or multi-Krum (weighted mean of the ``k - f`` best members, at
    least one) of each segment, scores by :func:`krum_scores`."""
    import torch

    out = _empty(values, num_segments)
    seg = segments.to(next(iter(values.values())).device)
    for s in range(num_segments):
        rows = _members(seg, s, "krum")
        flat = _flat(values, rows)
        scores = krum_scores(flat, byzantine)
        keep = max(1, len(rows) - byzantine) if multi else 1
        order = sorted(range(len(rows)), key=lambda i: (float(scores[i]), i))[:keep]
        chosen = torch.tensor(order, device=flat.device)
        _unflat(_weighted_mean(flat.index_select(0, chosen),
                               _take(weights, rows[chosen])), values, s, out)
    return out
