"""Seeded fault injection for simulations, and the errors a run can stop with.

Faults are raised inside the ClientApp, so on every Flower engine they become real error
replies that the strategy handles by its fault rules (the client is left out of that round's
average). Whether a client fails is a pure function of (seed, client, round).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedhier.common.errors import ConfigError, FedhierError
from fedhier.common.rng import generator


class RunFailureError(FedhierError):
    """A run stopped on purpose: too many failed clients, or non-finite numbers."""


def failed_edges(edge_of_client: np.ndarray, sent: np.ndarray, alive: np.ndarray,
                 num_edges: int, min_clients_per_edge: int, edge_round: int) -> int:
    """Edges of an edge round left with no surviving client (they keep their model).

    Args:
        edge_of_client: int64 [n]; sent, alive: int64 client ids that were sent the round's
            work and that came back usable.

    Raises:
        RunFailureError: an edge kept fewer clients than ``min_clients_per_edge`` (or than
            it sent, if fewer).
    """
    sent_per_edge = np.bincount(edge_of_client[sent], minlength=num_edges)
    alive_per_edge = np.bincount(edge_of_client[alive], minlength=num_edges)
    short = np.flatnonzero(alive_per_edge < np.minimum(sent_per_edge, min_clients_per_edge))
    if len(short):
        edge = int(short[0])
        raise RunFailureError(
            f"edge {edge} kept {int(alive_per_edge[edge])} of {int(sent_per_edge[edge])} "
            f"clients in edge round {edge_round}, fewer than --min-clients-per-edge "
            f"{min_clients_per_edge}")
    return int(((sent_per_edge > 0) & (alive_per_edge == 0)).sum())


def non_finite_message(client: int, edge: int, edge_round: int,
                       edge_rounds_per_cloud_round: int, loss: float | None = None) -> str:
    """The one-line stop message for a client update holding NaN or inf (every engine);
    ``loss``: the update is finite but the train loss the client reported is not."""
    cloud_round = (edge_round - 1) // edge_rounds_per_cloud_round + 1
    if loss is not None:
        return (f"client {client} (edge {edge}) reported a train loss of {loss} in edge round "
                f"{edge_round} (cloud round {cloud_round}) with a finite model; the last "
                "checkpoint is kept (its loss is not a number: --on-nan skip-client drops "
                "its update)")
    return (f"non-finite values in the update of client {client} (edge {edge}) in edge round "
            f"{edge_round} (cloud round {cloud_round}); the last checkpoint is kept (lower "
            "--lr, clip with --clip-norm, or --on-nan skip-client)")


class InjectedFaultError(RuntimeError):
    """Raised by a ClientApp that the fault model makes fail this round."""


def parse_span(text: str) -> tuple[int, int] | None:
    """'3-5' -> (3, 5) (inclusive cloud rounds), '4' -> (4, 4), '' -> None."""
    if not text.strip():
        return None
    parts = text.split("-")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if len(parts) > 2 or first < 1 or last < first:
        raise ConfigError(f"dropout_rounds must look like '3-5' (cloud rounds), got '{text}'")
    return first, last


@dataclass(frozen=True)
class FaultModel:
    """``fail_rate``: a client fails an edge round with this probability. ``dropout_fraction``
    of the clients (a seeded set) are away during the cloud rounds in ``dropout_span``."""

    fail_rate: float = 0.0
    dropout_fraction: float = 0.0
    dropout_span: tuple[int, int] | None = None

    def fails(self, seed: int, client: int, edge_round: int, cloud_round: int) -> bool:
        if self.fail_rate > 0 and generator(seed, "fail", edge_round, client).random() < (
                self.fail_rate):
            return True
        if self.dropout_span and self.dropout_fraction > 0:
            first, last = self.dropout_span
            if first <= cloud_round <= last:
                return bool(generator(seed, "dropout", client).random() < self.dropout_fraction)
        return False
