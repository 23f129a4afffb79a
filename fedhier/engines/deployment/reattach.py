"""Re-attaching a client's SuperNode to another edge's SuperLink (moving clients).

Flower 1.42 has no re-association: a SuperNode talks to the one SuperLink of its
``--superlink`` address for its whole life. A client that moves (``--mobility-rate``,
``--mobility-trace``, ``--regroup-every``) is therefore re-attached by restarting its SuperNode
(and its ClientApp process) with the new edge's SuperLink address, the same key and the same
runtime port; its data partition stays where it is (``partition-id`` in the node config).

Who does what (docs/deployment.md "Moving clients"):

* the **cloud** (its ServerApp, :class:`fedhier.round.tiers.servers.ServerRounds`) decides
  every move from the seed and, before the edge round a move takes effect in, asks with
  :class:`FileReattacher` (a file ``request-N.json`` in the deployment's ``reattach/``
  folder, :data:`REATTACH_ENV`) and waits for ``done-N.json``;
* the **deployment driver** (``fedhier deploy local``, :class:`ReattachDriver`, polled
  twice a second) stops each moved client's SuperNode (it deactivates itself at its old
  SuperLink), starts it at the new edge's SuperLink, waits until its log says it is online
  there and answers with the seconds each took; a move that fails is tried again, then
  answered as failed: that client is a failed client of its new edge's rounds (the cloud
  tells the edge not to wait for it), never the end of the run;
* the **edge servers** follow the job's client -> edge map: an edge looks up the node id of
  a client that arrived by its profile (``partition-id``) and forgets one that left
  (:func:`fedhier.strategies.edge.follow.follow_clients`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: The folder of the re-attach requests, in the cloud ServerApp's environment.
REATTACH_ENV = "FEDHIER_REATTACH_DIR"
#: Seconds the cloud waits for the driver to re-attach one batch of clients.
REATTACH_TIMEOUT = 300.0


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class FileReattacher:
    """The cloud's side: one request file per batch of moves, answered by the driver.
    ``failed`` (after :meth:`reattach`): client -> why, for the clients of the last batch
    the driver could not re-attach (after its retries)."""

    def __init__(self, folder: Path, timeout: float = REATTACH_TIMEOUT) -> None:
        self.folder = Path(folder)
        self.timeout = timeout
        self.failed: dict[int, str] = {}

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
        """client -> seconds for each client of ``moves`` now online at its new edge; the
        others are in :attr:`failed` (a driver that answers with one error for the batch
        fails all of them)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        seq = 1 + max((int(p.stem.split("-")[1]) for p in self.folder.glob("request-*.json")),
                      default=0)
        _write_json(self.folder / f"request-{seq}.json",
                    {"moves": {str(c): int(e) for c, e in moves.items()}})
        done = self.folder / f"done-{seq}.json"
        deadline = time.time() + self.timeout
        while not done.is_file():
            if time.time() > deadline:
                raise RuntimeError(f"the deployment did not re-attach clients "
                                   f"{sorted(moves)[:10]} within {self.timeout:.0f} s")
            time.sleep(0.02)
        answer = json.loads(done.read_text())
        if answer.get("error"):
            self.failed = {int(c): str(answer["error"]) for c in moves}
            return {}
        self.failed = {int(c): str(why) for c, why in answer.get("failed", {}).items()}
        return {int(c): float(s) for c, s in answer["seconds"].items()}


def reattacher_from_env() -> FileReattacher | None:
    """The cloud ServerApp's reattacher when the deployment set :data:`REATTACH_ENV`."""
    folder = os.environ.get(REATTACH_ENV)
    return FileReattacher(Path(folder)) if folder else None


#: Tries of one client's re-attachment (the first and its retries) before it counts failed.
REATTACH_TRIES = 3
#: Seconds between two tries (the old SuperLink may still hold the node as active: Flower's
#: "Failed to activate SuperNode").
RETRY_PAUSE = 2.0


class ReattachDriver:
    """The driver's side: answers every request in ``folder`` with ``move(client, edge)``
    (returns the seconds it took) for each of its clients, side by side; a move that raises
    is tried again (:data:`REATTACH_TRIES` in all), then answered as failed for that client
    (the cloud leaves it out of its new edge's rounds) without stopping the deployment."""

    def __init__(self, folder: Path, move: Callable[[int, int], float],
                 tries: int = REATTACH_TRIES, pause: float = RETRY_PAUSE,
                 echo: Callable[[str], None] | None = None) -> None:
        self.folder = Path(folder)
        self.move = move
        self.tries = tries
        self.pause = pause
        self.echo = echo

    def _move(self, client: int, edge: int) -> float:
        """One client's move, tried up to ``tries`` times; raises the last failure."""
        for attempt in range(1, self.tries + 1):
            try:
                return self.move(client, edge)
            except Exception as exc:  # noqa: BLE001 - tried again, then reported
                if attempt == self.tries:
                    raise
                if self.echo is not None:
                    self.echo(f"client {client}: re-attaching to edge {edge} failed (try "
                              f"{attempt} of {self.tries}: {str(exc).splitlines()[0][:200]});"
                              " trying again")
                time.sleep(self.pause)
        raise AssertionError("unreachable")

    def poll(self) -> int:
        """Serve the requests not answered yet; returns how many were served."""
        served = 0
        for request in sorted(self.folder.glob("request-*.json"),
                              key=lambda p: int(p.stem.split("-")[1])):
            done = self.folder / f"done-{request.stem.split('-')[1]}.json"
            if done.is_file():
                continue
            moves = json.loads(request.read_text())["moves"]
            seconds: dict[str, float] = {}
            failed: dict[str, str] = {}
            with ThreadPoolExecutor(max_workers=max(1, len(moves))) as pool:  # side by side
                futures = {c: pool.submit(self._move, int(c), int(e)) for c, e in moves.items()}
            for client, future in futures.items():
                try:
                    seconds[client] = future.result()
                except Exception as exc:  # noqa: BLE001 - the cloud leaves the client out
                    failed[client] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            _write_json(done, {"seconds": seconds, "failed": failed})
            served += 1
        return served
