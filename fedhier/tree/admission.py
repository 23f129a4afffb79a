"""Admission: which edge a moving client joins (where it goes; :mod:`fedhier.tree.mobility` says
when it moves and ``handoff`` which model it brings).

A policy gets one move at a time, with the client -> edge map in force when the move takes
effect, and returns the edge the client joins. Two policies:

- ``random`` (the default): the edge the move's seeded draw picks among its candidates
  (``options[int(draw * len(options))]``), as every run before admission policies.
- ``min-divergence``: the candidate edge that leaves the label upward divergence lowest,

      U(map) = Σ_i P_i ||π_i − π||²,

  with π_i edge i's label distribution (its clients' summed label histograms, normalised), π
  the global one and P_i edge i's share of the rows: :func:`fedhier.diagnostics.measures.
  label_upward_divergence` with row weights, the objective the ``min-divergence`` grouping
  minimises. Ties (within 1e-12 of U's scale) go to the draw among the tied edges, or for a
  traced move to the trace's own edge, then the lowest id.

Both are pure functions of their arguments, so the maps stay a function of (seed, round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedhier.common.errors import ConfigError


@dataclass(frozen=True)
class Move:
    """One client's move.

    Attributes:
        client: the client's id.
        options: int64 [k] candidate edges, ascending (k >= 1).
        draw: the move's uniform draw in [0, 1) (rate moves), or None (a traced move).
        preferred: the trace's edge, preferred on ties (traced moves), or None.
    """

    client: int
    options: np.ndarray
    draw: float | None = None
    preferred: int | None = None


#: (move, client -> edge map int64 [n] before the move, label histograms [n, C] or None,
#: number of edges) -> the edge the client joins.
Admission = Callable[[Move, np.ndarray, "np.ndarray | None", int], int]


def _pick(move: Move, tied: np.ndarray) -> int:
    """The edge among ``tied`` (ascending) a move takes: its draw, else its trace's edge,
    else the lowest id."""
    if move.draw is not None:
        return int(tied[int(move.draw * len(tied))])
    if move.preferred is not None and move.preferred in tied:
        return int(move.preferred)
    return int(tied[0])


def random_admission(move: Move, edge_of_client: np.ndarray, histograms: np.ndarray | None,
                     num_edges: int) -> int:
    """The draw's edge among the options (a traced move: the trace's edge)."""
    if move.draw is None and move.preferred is not None:
        return int(move.preferred)
    return _pick(move, move.options)


def edge_label_divergence(edge_histograms: np.ndarray) -> np.ndarray:
    """float64 [...]: U = Σ_i P_i ||π_i − π||² of edge label histograms [..., N, C] (rows
    summed over each edge's clients; an empty edge adds nothing)."""
    h = np.asarray(edge_histograms, dtype=np.float64)
    rows = h.sum(-1)  # [..., N]
    total = rows.sum(-1)  # [...]
    pi = h.sum(-2) / np.maximum(total, 1e-300)[..., None]  # [..., C]
    dist = h / np.maximum(rows, 1e-300)[..., None]
    gap = ((dist - pi[..., None, :]) ** 2).sum(-1)
    return (rows / np.maximum(total, 1e-300)[..., None] * gap * (rows > 0)).sum(-1)


def min_divergence_admission(move: Move, edge_of_client: np.ndarray,
                             histograms: np.ndarray | None, num_edges: int) -> int:
    """The option whose admission leaves the label upward divergence lowest."""
    if histograms is None or not np.asarray(histograms).any():
        raise ConfigError("the 'min-divergence' admission needs the clients' label histograms, "
                          "which they did not report; use admission 'random'")
    h = np.asarray(histograms, dtype=np.float64)
    others = np.asarray(edge_of_client, dtype=np.int64).copy()
    others[move.client] = -1  # the client itself is placed by the candidate
    edges = np.zeros((num_edges, h.shape[1]))
    keep = others >= 0
    np.add.at(edges, others[keep], h[keep])
    candidates = np.repeat(edges[None], len(move.options), axis=0)  # [k, N, C]
    candidates[np.arange(len(move.options)), move.options] += h[move.client]
    u = edge_label_divergence(candidates)
    tol = 1e-12 * max(float(u.max()), 1e-300)
    return _pick(move, move.options[u <= u.min() + tol])


ADMISSIONS: dict[str, Admission] = {
    "random": random_admission,
    "min-divergence": min_divergence_admission,
}
#: Admissions that read the clients' label histograms.
NEEDS_LABELS = frozenset({"min-divergence"})


def get_admission(name: str) -> Admission:
    """The admission policy registered under ``name``; one-line error otherwise."""
    try:
        return ADMISSIONS[name]
    except KeyError:
        raise ConfigError(f"unknown admission '{name}'; choose one of "
                          f"{', '.join(ADMISSIONS)}") from None
