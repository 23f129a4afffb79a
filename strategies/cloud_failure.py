"""A cloud round in which no client trained is a failed run, not a finished one.

:class:`TrainOutcomes` notes, per cloud round, whether any client's train reply was usable
and the first error reply; :meth:`TrainOutcomes.check` then stops the run
(:class:`~fedhier.round.faults.RunFailureError`, exit code 3 in the CLI) with one line naming that
error. Failures injected on purpose by fedhier's fault model (``--fail-rate``,
``--dropout-fraction``: "injected fault") and timeouts do not count: a round that only lost
clients that way keeps its models, as docs/faults.md describes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fedhier.round.faults import RunFailureError

log = logging.getLogger("fedhier")

#: The text of fedhier's own injected faults (``fedhier.round.faults.InjectedFaultError``).
INJECTED = "injected fault"


def error_summary(reason: str | None) -> str:
    """The useful line of an error reply's reason: in-process ``"KeyError: 'x'"``; from
    Flower's engines the part after ``Message:`` (the exception's own text)."""
    text = reason or ""
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1].rstrip("'>\n ")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "no reason given"


@dataclass
class TrainOutcomes:
    """Per cloud round: whether a client trained, the first error reply (not injected) and
    the edge rounds in which every client failed (told once the cloud round is known to
    go on, so that a run in which every client fails ends with one line)."""

    trained: set[int] = field(default_factory=set)
    errors: dict[int, tuple[str, int]] = field(default_factory=dict)  # round -> (first, count)
    untrained: dict[int, list[str]] = field(default_factory=dict)  # round -> deferred lines

    def note(self, cloud_round: int, edge_round: int, failures: list[tuple[str, str | None]],
             trained: bool, *, defer: bool = True) -> None:
        """One edge round's outcome: ``failures`` are (sender, e.g. "client 3 (node 123)",
        error reason) of its error replies; ``trained``: a client's model came back.
        Failures are logged now when a client trained (or ``defer`` is off), else once the
        cloud round is checked."""
        for sender, reason in failures:
            if INJECTED not in (reason or ""):
                first, count = self.errors.get(
                    cloud_round, (f"{sender}: {error_summary(reason)}", 0))
                self.errors[cloud_round] = (first, count + 1)
        if trained:
            self.trained.add(cloud_round)
        if trained or not defer:
            for sender, reason in failures:
                log.warning("%s failed: %s", sender, error_summary(reason))
        elif failures:
            sender, reason = failures[0]
            self.untrained.setdefault(cloud_round, []).append(
                f"edge round {edge_round}: no client trained ({len(failures)} failed; the "
                f"first: {sender}: {error_summary(reason)})")

    def check(self, cloud_round: int) -> None:
        """Raise RunFailureError when no client trained in ``cloud_round`` and a client
        failed with an error of its own; otherwise log the round's deferred lines."""
        if cloud_round not in self.trained and cloud_round in self.errors:
            first, count = self.errors[cloud_round]
            raise RunFailureError(f"no client trained in cloud round {cloud_round} ({count} "
                                  f"error replies); the first: {first}")
        for line in self.untrained.pop(cloud_round, []):
            log.warning("%s", line)
