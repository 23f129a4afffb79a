"""Wire bytes of a local deployment's network links, as the processes themselves measured them.

A process started with :func:`wire_env` loads the meter in :data:`WIRETAP_DIR` (a
``sitecustomize``, see its docstring) and reports its client connections to one port, the
SuperLink it talks to, under one link name: e.g. every client SuperNode of an edge with
``link="client-edge"`` and the edge SuperLink's Fleet port, an edge's cloud-side SuperNode with
``link="edge-cloud"`` and the cloud SuperLink's Fleet port. :func:`read_wire` sums the
processes' reports per link. Flower 1.42 serves every API of a SuperLink on its one port (and
its SuperExec connects to it): give this environment to the SuperNodes of a link, not to the
SuperLink, whose own connections to that port are not link traffic.

What is counted, per TCP connection the process opened to that port (closed ones included):

* ``sent``: the kernel's ``tcpi_bytes_acked``, payload bytes sent *and acknowledged* by the
  peer; ``received``: ``tcpi_bytes_received``. Payload means everything above TCP: TLS
  records (handshakes, record headers, MACs), HTTP headers and bodies (Flower 1.42's Fleet API
  is protobuf over HTTP(S)), polling and heartbeats included;
* on the client side of each link only, so nothing is counted twice; on 127.0.0.1 (loopback),
  where the peer acknowledges everything it reads.

Not counted: IP/TCP headers, SYN/FIN/ACK segments, retransmissions; the server side of a
link; bytes sent just before a socket's ``close()`` that were not yet acknowledged; traffic of
processes started without :func:`wire_env` or that open sockets outside Python's ``socket``
module (C extensions, uvloop); what happened in a process's last interval (0.25 s) before it
was killed with ``SIGKILL`` or left by ``os._exit``. A process stopped with ``SIGTERM``
writes its totals on the way out (its own handler, if any, still runs; see the meter).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

#: The folder that goes on ``PYTHONPATH``: it holds the meter, ``sitecustomize.py``.
WIRETAP_DIR: Path = Path(__file__).resolve().parent / "wiretap"

#: Environment read by the meter (the same names as in ``wiretap/sitecustomize.py``).
WIRE_DIR_ENV = "FEDHIER_WIRE_DIR"
WIRE_LINK_ENV = "FEDHIER_WIRE_LINK"
WIRE_PORT_ENV = "FEDHIER_WIRE_PORT"

#: The totals of one link in :func:`read_wire`'s answer.
WIRE_FIELDS = ("sent", "received", "connections", "processes")


def wire_env(env: Mapping[str, str], wire_dir: Path, link: str, port: int) -> dict[str, str]:
    """A copy of ``env`` for a process whose client connections to ``port`` count as ``link``.

    Prepends :data:`WIRETAP_DIR` to ``PYTHONPATH`` and sets ``FEDHIER_WIRE_DIR`` (absolute),
    ``FEDHIER_WIRE_LINK`` and ``FEDHIER_WIRE_PORT``; creates ``wire_dir``. The process's
    Python subprocesses inherit the meter; they count only their own connections to ``port``.
    """
    if not link:
        raise ValueError("wire_env: empty link name")
    if not 0 < port < 65536:
        raise ValueError(f"wire_env: port {port} out of range")
    folder = Path(wire_dir).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    out = dict(env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep)
             if p and p != str(WIRETAP_DIR)]
    out["PYTHONPATH"] = os.pathsep.join([str(WIRETAP_DIR), *paths])
    out[WIRE_DIR_ENV] = str(folder)
    out[WIRE_LINK_ENV] = link
    out[WIRE_PORT_ENV] = str(port)
    return out


def _report(path: Path) -> tuple[str, int, int, int] | None:
    """(link, sent, received, connections) of one process's file, None if unreadable."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("link"), str):
        return None
    numbers: list[int] = []
    for key in ("sent", "received", "connections"):
        value = record.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
        numbers.append(value)
    return record["link"], numbers[0], numbers[1], numbers[2]


def read_wire(wire_dir: Path) -> dict[str, dict[str, int]]:
    """``{link: {"sent", "received", "connections", "processes"}}`` summed over the files in
    ``wire_dir`` (one per process that counted a connection). Files that are not valid reports
    (partial, foreign) are skipped; a missing folder gives ``{}``."""
    totals: dict[str, dict[str, int]] = {}
    try:
        paths = sorted(Path(wire_dir).glob("*.json"))
    except OSError:
        return totals
    for path in paths:
        report = _report(path)
        if report is None:
            continue
        link, sent, received, connections = report
        link_totals = totals.setdefault(link, dict.fromkeys(WIRE_FIELDS, 0))
        link_totals["sent"] += sent
        link_totals["received"] += received
        link_totals["connections"] += connections
        link_totals["processes"] += 1
    return totals
