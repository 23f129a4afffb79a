"""Progress of a run's cloud rounds: a bar on a terminal, plain lines in a log.

On a terminal (stderr a TTY) :func:`round_progress` is tqdm's bar, redrawn in place. Anywhere
else (a log file, a pipe, CI) a redrawn bar is one ever longer line of carriage returns, so
it prints plain lines instead: ``cloud round 3/30 | test_acc 0.8123, test_loss 0.512 |
4.1 s``, at most one per ``every`` seconds, and always the last round's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

#: seconds between two plain progress lines (the last round is always shown)
EVERY = 5.0


class PlainProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` as plain lines on ``stream``."""

    def __init__(self, total: int, initial: int = 0, desc: str = "cloud round",
                 stream: TextIO | None = None, every: float = EVERY) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.start = time.time()
        self.shown_at = -float("inf")
        self.postfix: dict[str, Any] = {}

    def set_postfix(self, **values: Any) -> None:
        """Numbers shown after the count in the next line (as tqdm's postfix)."""
        self.postfix = values
        self._show()

    def update(self, n: int = 1) -> None:
        self.n += n

    def _show(self) -> None:
        now = time.time()
        if now - self.shown_at < self.every and self.n < self.total:
            return
        self.shown_at = now
        numbers = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc} {self.n}/{self.total}"
                          f"{' | ' + numbers if numbers else ''} | {now - self.start:.1f} s\n")
        self.stream.flush()

    def close(self) -> None:
        """Nothing to clear: every line is complete."""


def round_progress(total: int, initial: int = 0, enabled: bool = True,
                   stream: TextIO | None = None) -> Any:
    """The progress of ``total`` cloud rounds (``initial`` already done): tqdm's bar on a
    terminal, :class:`PlainProgress` elsewhere, a disabled bar when not ``enabled``."""
    out = stream if stream is not None else sys.stderr
    if enabled and not _is_terminal(out):
        return PlainProgress(total, initial, stream=out)
    from tqdm import tqdm

    return tqdm(total=total, desc="cloud rounds", unit="round", disable=not enabled,
                dynamic_ncols=True, initial=initial, file=out)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def trial_line(done: int, total: int, name: str, summary: Mapping[str, Any] | None,
               error: str | None, seconds: float) -> str:
    """One sweep trial's line: ``[3/45] alpha=0.1,grouping=random/seed2: final test accuracy
    0.8206 (12.3 s)``, or its error."""
    what = (f"failed: {error}" if error is not None else
            f"final test accuracy {summary['final_test_accuracy']:.4f}" if summary and
            "final_test_accuracy" in summary else "done")
    return f"[{done}/{total}] {name}: {what} ({seconds:.1f} s)"
