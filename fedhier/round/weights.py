"""The clients' averaging weights, from the sizes they claim.

Every aggregation weighs a client by its rows (``samples``) or equally (``uniform``)
(:func:`fedhier.round.aggregators.averaging.client_weights`), a claim capped where it may not be
believed (:func:`fedhier.round.reply_policy.allowed_sizes`); replies can teach the round sizes it
did not know (docs/contract.md, "Which rows weigh"). Pure functions; no Flower import.
"""

from __future__ import annotations

import numpy as np

from fedhier.round.aggregators.averaging import client_weights
from fedhier.round.reply_policy import allowed_sizes


def weights_of(claimed: np.ndarray, histograms: np.ndarray, weighting: str,
               max_weight_ratio: float) -> np.ndarray:
    """float64 [n] averaging weights from the clients' claimed sizes (int64 [n]), as far as
    their label histograms (int64 [n, C]) and the cap let them claim them."""
    sums = np.asarray(histograms).sum(axis=1) if len(claimed) == len(histograms) else None
    return client_weights(weighting, allowed_sizes(claimed, sums, max_weight_ratio))


def learned_sizes(known: np.ndarray, clients: np.ndarray, sizes: np.ndarray | None, *,
                  trained: bool) -> np.ndarray | None:
    """The clients' rows (int64 [n]) after replies of ``clients`` (int64 [k]) reporting
    ``sizes`` (int64 [k]); None when nothing changes.

    A train reply's rows (``trained``) are its client's weight from then on, every round: a
    client whose data change size is re-weighted. An evaluate reply's rows only stand in for
    a client whose rows are not known yet (0: no profile, not trained yet); the client's
    first train reply replaces them.
    """
    if sizes is None:
        return None
    take = (sizes > 0) & (known[clients] != sizes)
    if not trained:
        take &= known[clients] <= 0
    if not take.any():
        return None
    known = known.copy()
    known[clients[take]] = sizes[take]
    return known


def evaluation_weights(rows: np.ndarray | None, weights: np.ndarray, weighting: str,
                       max_weight_ratio: float) -> np.ndarray:
    """float64 [n]: the weights of evaluation means: under ``samples`` the rows each client
    evaluated (``rows``, int64 [n], 0 = no answer), else (or when not reported) the clients'
    averaging ``weights``."""
    if rows is None or weighting != "samples" or not (rows > 0).any():
        return weights
    return client_weights(weighting,  # a claim is capped here too
                          allowed_sizes(rows, None, max_weight_ratio))
