"""Which edge report the cloud of asynchronous edges takes next: the arrival order.

:class:`fedhier.round.asynchrony.edges.BufferedRounds` takes edge reports one at a time until
K are accepted (docs/hsgd.md#asynchronous-edges). *Which* report comes next is a part behind
one interface, :class:`ArrivalOrder`:

* :class:`SimulatedOrder`: the job whose training ends first on the simulated clock
  (ties: the lower edge), the simulation's rule;
* :class:`ReceivedOrder`: on real processes (``fedhier deploy local --edges E
  --async-buffer K``), the report that really reaches the cloud first
  (:mod:`fedhier.round.tiers.asynchronous`);
* :class:`RecordedOrder`: the order written down by an earlier run (``arrivals.jsonl``),
  for the cloud aggregations it lists, then another order: what replays a deployment, in a
  simulation or on real processes, and what ``--resume`` of a deployment continues with.

The arrivals file (:data:`ARRIVALS_FILE` in the run folder) has one JSON line per cloud
aggregation: ``{"round": r, "order": [e, ...], "accepted": [e, ...]}``: every report taken in
cloud round r (accepted, or dropped as too stale), in the order taken, and the accepted ones.
Only ``round`` and ``order`` are read back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from fedhier.common.errors import ConfigError

#: The arrivals file of a run folder.
ARRIVALS_FILE = "arrivals.jsonl"


class ArrivalOrder(Protocol):
    """Chooses the edge whose report the cloud takes next."""

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        """One key of ``jobs`` (edge -> its job in flight, non-empty): the report taken next
        in the cloud aggregation that makes version ``version + 1`` (cloud round
        ``version + 1``)."""
        ...


class SimulatedOrder:
    """The job whose training ends first on the simulated clock (``job.finish``; ties:
    the lower edge)."""

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        return min(jobs, key=lambda e: (jobs[e].finish, e))


class ReceivedOrder:
    """Real arrivals: ``receive(edges)`` blocks until a report of one of ``edges`` is in
    and returns that edge (the first one in)."""

    def __init__(self, receive: Callable[[frozenset[int]], int]) -> None:
        self.receive = receive

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        return self.receive(frozenset(jobs))


class RecordedOrder:
    """The recorded order of the cloud rounds in ``rounds`` (round -> edges, in order), then
    ``then``'s. ``wait(edge)``, when given, is called with each recorded edge before it is
    returned (real processes: wait for that edge's report)."""

    def __init__(self, rounds: Mapping[int, list[int]], then: ArrivalOrder,
                 wait: Callable[[int], None] | None = None) -> None:
        self.rounds = {int(r): [int(e) for e in edges] for r, edges in rounds.items()}
        self.then = then
        self.wait = wait
        self._at: tuple[int, int] = (0, 0)  # (cloud round, reports taken in it so far)

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        cloud_round = version + 1
        taken = self._at[1] if self._at[0] == cloud_round else 0
        self._at = (cloud_round, taken + 1)
        recorded = self.rounds.get(cloud_round)
        if recorded is None or taken >= len(recorded):
            return self.then.next_edge(jobs, version)
        edge = recorded[taken]
        if edge not in jobs:
            raise ConfigError(f"the recorded arrivals do not fit this run: report {taken + 1} "
                              f"of cloud round {cloud_round} is edge {edge}'s, which has no "
                              f"job in flight (edges in flight: {sorted(jobs)})")
        if self.wait is not None:
            self.wait(edge)
        return edge

    def last_round(self) -> int:
        """The last cloud round the record lists (0: none)."""
        return max(self.rounds, default=0)


class RecordingOrder:
    """``inner``'s order, each choice also kept (:meth:`take` hands a round's over)."""

    def __init__(self, inner: ArrivalOrder) -> None:
        self.inner = inner
        self.taken: list[int] = []

    def next_edge(self, jobs: Mapping[int, Any], version: int) -> int:
        edge = self.inner.next_edge(jobs, version)
        self.taken.append(edge)
        return edge

    def take(self) -> list[int]:
        """The edges chosen since the last call, in order."""
        taken, self.taken = self.taken, []
        return taken


# ------------------------------------------------------------------------ the arrivals file
def arrivals_path(where: str | Path) -> Path:
    """The arrivals file named by ``where``: the file itself or a run folder holding one."""
    path = Path(where)
    return path / ARRIVALS_FILE if path.is_dir() else path


def read_arrivals(where: str | Path) -> dict[int, list[int]]:
    """cloud round -> the edges taken in it, in order, from an arrivals file (or a run
    folder's); a torn last line (a run killed while writing) is left out. A missing or
    unreadable file is one ConfigError."""
    path = arrivals_path(where)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"arrivals file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"arrivals file {path}: not text (not an arrivals.jsonl)") from None
    rounds: dict[int, list[int]] = {}
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
            cloud_round, order = int(entry["round"]), [int(e) for e in entry["order"]]
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(lines):  # torn by a kill: the round was not aggregated
                break
            raise ConfigError(f"arrivals file {path}, line {number}: not an arrivals "
                              f"record ({type(exc).__name__})") from None
        if cloud_round < 1 or any(e < 0 for e in order):
            raise ConfigError(f"arrivals file {path}, line {number}: round {cloud_round} "
                              f"with edges {order}")
        rounds[cloud_round] = order
    return rounds


class ArrivalsLog:
    """Appends one line per cloud aggregation to ``path`` (flushed at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, cloud_round: int, order: list[int], accepted: list[int]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"round": cloud_round, "order": order,
                                "accepted": accepted}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def cut(self, last_round: int) -> dict[int, list[int]]:
        """Keep the lines of cloud rounds <= ``last_round`` (a resumed run rewrites the
        later ones as it replays them); returns the later ones (round -> order)."""
        if not self.path.exists():
            return {}
        rounds = read_arrivals(self.path)
        later = {r: order for r, order in rounds.items() if r > last_round}
        kept = [line for line in self.path.read_text().splitlines()
                if _round_of(line) is not None and _round_of(line) <= last_round]  # type: ignore[operator]
        self.path.write_text("".join(f"{line}\n" for line in kept))
        return later


def _round_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["round"])
    except (ValueError, KeyError, TypeError):
        return None
