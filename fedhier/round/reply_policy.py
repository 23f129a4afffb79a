"""What the server does with a client reply it cannot use, and how much weight a client may
claim (docs/security.md).

:class:`ReplyPolicy` is the run's setting: a reply that breaks the contract either stops
the run (``stop``: one line naming client, node, key and problem) or is dropped (``drop``:
the client counts as failed for that round, one warning names it); a client dropped
``exclude_after`` rounds in a row is sent nothing more for the rest of the run.
:class:`ReplyGuard` applies it to one run's replies. :func:`allowed_sizes` turns the sizes
clients claim into the sizes their weights may use.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedhier.common.errors import ConfigError, FedhierError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("fedhier")

#: ``--on-bad-reply``: auto = drop on real processes (fedhier deploy, edge servers), stop in
#: simulations.
ON_BAD_REPLY = ("auto", "stop", "drop")


@dataclass(frozen=True)
class ReplyPolicy:
    """on_bad_reply: ``stop`` or ``drop``; exclude_after: K >= 1 dropped rounds in a row
    exclude a client (0 = never); max_weight_ratio: a client's size is capped at this
    multiple of the median claimed size (0 = no cap); max_update_ratio: a train reply whose
    update (its model minus the model sent) is longer than this multiple of the round's
    median update is a bad reply (0 = no check)."""

    on_bad_reply: str = "stop"
    exclude_after: int = 3
    max_weight_ratio: float = 10.0
    max_update_ratio: float = 1000.0

    def __post_init__(self) -> None:
        if self.on_bad_reply not in ("stop", "drop"):
            raise ConfigError(f"unknown on_bad_reply '{self.on_bad_reply}'; choose stop or "
                              "drop")
        if self.exclude_after < 0 or not (self.max_weight_ratio >= 0
                                          and self.max_update_ratio >= 0):
            raise ConfigError("need exclude_after >= 0, max_weight_ratio >= 0 and "
                              "max_update_ratio >= 0")


def resolve_on_bad_reply(value: str, real_processes: bool) -> str:
    """``auto`` -> ``drop`` on real processes, ``stop`` in simulations; else ``value``."""
    if value not in ON_BAD_REPLY:
        raise ConfigError(f"unknown on_bad_reply '{value}'; choose one of "
                          f"{', '.join(ON_BAD_REPLY)}")
    if value == "auto":
        return "drop" if real_processes else "stop"
    return value


@dataclass
class ReplyGuard:
    """One run's bad replies under ``policy``: :meth:`bad` stops or drops; :meth:`end_round`
    counts each client's dropped rounds in a row and excludes it after K."""

    policy: ReplyPolicy = field(default_factory=ReplyPolicy)
    streak: dict[int, int] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)  # client -> why
    dropped_now: set[int] = field(default_factory=set)
    dropped: int = 0  # replies dropped since the last take_dropped()

    def bad(self, error: FedhierError, client: int | None, *, training: bool = True) -> None:
        """A reply that breaks the contract: raise ``error`` (stop) or log it (drop). Only a
        dropped train reply (``training``) counts toward the client's streak: a bad
        evaluate, profile or gradient reply is dropped, never a bad training round."""
        if self.policy.on_bad_reply == "stop":
            raise error
        log.warning("dropped a bad reply: %s", error)
        self.dropped += 1
        if client is not None and training:
            self.dropped_now.add(client)

    def take_dropped(self) -> int:
        """The replies dropped since the last call (a cloud round's record)."""
        count, self.dropped = self.dropped, 0
        return count

    def state_dict(self) -> dict[str, list]:
        """The streaks and exclusions for a checkpoint: [client, rounds] and [client, why]
        pairs (plain ints and strings)."""
        return {"streak": [[int(c), int(n)] for c, n in sorted(self.streak.items())],
                "excluded": [[int(c), str(why)] for c, why in sorted(self.excluded.items())]}

    def load_state_dict(self, state: dict[str, list]) -> None:
        """Put back what :meth:`state_dict` returned (TypeError / ValueError if damaged)."""
        pairs = {key: state[key] for key in ("streak", "excluded")}
        for key, kind in (("streak", int), ("excluded", str)):
            if not isinstance(pairs[key], list) or not all(
                    isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] >= 0
                    and isinstance(p[1], kind) and not isinstance(p[1], bool)
                    for p in pairs[key]):
                raise TypeError(f"the reply guard's '{key}' is not [client, value] pairs")
        self.streak = {c: n for c, n in pairs["streak"]}
        self.excluded = {c: why for c, why in pairs["excluded"]}
        self.dropped_now = set()

    def end_round(self) -> list[int]:
        """Close a round of train replies: clients dropped now extend their streak, the
        others reset it; -> the clients excluded now (K in a row)."""
        for client in list(self.streak):
            if client not in self.dropped_now:
                del self.streak[client]
        newly = []
        for client in sorted(self.dropped_now):
            self.streak[client] = self.streak.get(client, 0) + 1
            k = self.policy.exclude_after
            if k and self.streak[client] >= k and client not in self.excluded:
                self.excluded[client] = f"{k} bad replies in a row"
                newly.append(client)
                log.warning("client %d excluded for the rest of the run: %d bad replies in a "
                            "row", client, k)
        self.dropped_now = set()
        return newly


def allowed_sizes(claimed: np.ndarray, histogram_sums: np.ndarray | None = None,
                  max_ratio: float = 10.0) -> np.ndarray:
    """The sizes clients' weights may use, from what they claim.

    Args:
        claimed: int64 [n] rows each client claims (profile or train reply; 0 = none yet).
        histogram_sums: int64 [n] the sums of their label histograms (0 = none reported).
        max_ratio: cap at this multiple of the median positive claim (0 = no cap).

    Returns:
        int64 [n]: min(claim, histogram sum) where both are reported (the two must agree;
        a client gains nothing by inflating one), then at most ``max_ratio`` x the median of
        those sizes; 0 stays 0 (unknown). Honest claims below the cap pass unchanged.
    """
    sizes = np.asarray(claimed, dtype=np.int64).copy()
    if histogram_sums is not None:
        sums = np.asarray(histogram_sums, dtype=np.int64)
        both = (sums > 0) & (sizes > 0)
        mismatch = np.flatnonzero(both & (sums != sizes))
        if len(mismatch):
            log.warning("client(s) %s claim sizes their label histograms do not sum to: "
                        "weighted by the smaller", mismatch[:10].tolist())
        sizes[both] = np.minimum(sizes[both], sums[both])
    known = sizes[sizes > 0]
    if max_ratio > 0 and len(known):
        cap = max(1, int(max_ratio * float(np.median(known))))
        over = np.flatnonzero(sizes > cap)
        if len(over):
            log.warning("client(s) %s claim more than %g x the median size: weighted as %d "
                        "rows", over[:10].tolist(), max_ratio, cap)
            sizes[over] = cap
    return sizes


def outlying_updates(params: list[dict[str, torch.Tensor] | None],
                     sent: dict[str, torch.Tensor], ratio: float) -> list[tuple[int, float]]:
    """(row, norm / median) of the replies whose update ||w_j - w_sent|| (whole model,
    float64) exceeds ``ratio`` x the median update of the usable replies ``params`` (a
    model per row, None = none); needs 3 or more replies and a positive median."""
    rows = [i for i, p in enumerate(params) if p is not None]
    if ratio <= 0 or len(rows) < 3:
        return []
    norms = np.array([_distance(params[i], sent) for i in rows])
    finite = np.isfinite(norms)  # non-finite updates are on_nan's to judge
    median = float(np.median(norms[finite])) if finite.any() else 0.0
    if not median > 0:
        return []
    over = np.flatnonzero(finite & (norms > ratio * median))
    return [(rows[i], float(norms[i] / median)) for i in over]


def _distance(model: dict[str, torch.Tensor] | None, sent: dict[str, torch.Tensor]) -> float:
    """||model - sent|| over every array, in float64."""
    assert model is not None
    total = 0.0
    for key, value in sent.items():
        total += float(((model[key].double() - value.double()) ** 2).sum())
    return math.sqrt(total)


#: A gradient this many times the median client norm is flagged as outlying.
OUTLYING_GRADIENT = 1e3


def outlying_gradients(grads: torch.Tensor, factor: float = OUTLYING_GRADIENT) -> np.ndarray:
    """bool [n]: clients whose gradient ([n, P]) is non-finite or has a norm above
    ``factor`` x the median norm of the finite ones; their diagnostics are flagged in
    metrics.jsonl and left out of the averages."""
    import torch

    norms = torch.linalg.vector_norm(grads.to(torch.float64), dim=1).cpu().numpy()
    finite = np.isfinite(norms)
    flagged = ~finite
    if finite.any():
        median = float(np.median(norms[finite]))
        flagged |= finite & (norms > factor * max(median, 1e-300))
    if flagged.any():
        log.warning("diagnostics: the gradients of client(s) %s are non-finite or above "
                    "%g x the median norm: flagged, left out", np.flatnonzero(flagged)[:10]
                    .tolist(), factor)
    return flagged
