"""Re-attaching a client's SuperNode to another edge's SuperLink (moving clients).

Flower 1.42 has no re-association: a SuperNode talks to the one SuperLink of its
``--superlink`` address for its whole life. A client that moves (``--mobility-rate``,
``--mobility-trace``, ``--regroup-every``) is therefore re-attached by restarting its SuperNode
(and its ClientApp process) with the new edge's SuperLink address, the same key and the same
runtime port; its data partition stays where it is (``partition-id`` in the node config).

Who does what (docs/deployment.md "Moving clients"):

* the **cloud** (its ServerApp, :class:`fedhier.round.tiers.jobs.EdgeTierHierarchicalSGD`) decides
  every move from the seed and, before the edge round a move takes effect in, asks with
  :class:`FileReattacher` (a file ``request-N.json`` in the deployment's ``reattach/``
  folder, :data:`REATTACH_ENV`) and waits for ``done-N.json``;
* the **deployment driver** (``fedhier deploy local``, :class:`ReattachDriver`, polled
  twice a second) stops each moved client's SuperNode (it deactivates itself at its old
  SuperLink), starts it at the new edge's SuperLink, waits until its log says it is online
  there and answers with the seconds each took;
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
    """The cloud's side: one request file per batch of moves, answered by the driver."""

    def __init__(self, folder: Path, timeout: float = REATTACH_TIMEOUT) -> None:
        self.folder = Path(folder)
        self.timeout = timeout

    def reattach(self, moves: dict[int, int]) -> dict[int, float]:
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
            raise RuntimeError(f"re-attaching clients failed: {answer['error']}")
        return {int(c): float(s) for c, s in answer["seconds"].items()}


def reattacher_from_env() -> FileReattacher | None:
    """The cloud ServerApp's reattacher when the deployment set :data:`REATTACH_ENV`."""
    folder = os.environ.get(REATTACH_ENV)
    return FileReattacher(Path(folder)) if folder else None


class ReattachDriver:
    """The driver's side: answers every request in ``folder`` with ``move(client, edge)``
    (returns the seconds it took) for each of its clients, side by side."""

    def __init__(self, folder: Path, move: Callable[[int, int], float]) -> None:
        self.folder = Path(folder)
        self.move = move

    def poll(self) -> int:
        """Serve the requests not answered yet; returns how many were served."""
        served = 0
        for request in sorted(self.folder.glob("request-*.json"),
                              key=lambda p: int(p.stem.split("-")[1])):
            done = self.folder / f"done-{request.stem.split('-')[1]}.json"
            if done.is_file():
                continue
            moves = json.loads(request.read_text())["moves"]
            try:  # the clients of one request restart side by side
                with ThreadPoolExecutor(max_workers=max(1, len(moves))) as pool:
                    futures = {c: pool.submit(self.move, int(c), int(e))
                               for c, e in moves.items()}
                seconds = {c: f.result() for c, f in futures.items()}
                _write_json(done, {"seconds": seconds})
            except Exception as exc:  # noqa: BLE001 - the cloud reports it in one line
                _write_json(done, {"error": f"{type(exc).__name__}: {exc}"})
                raise
            served += 1
        return served
