"""Timestamps of each message's legs across ``fedhier deploy``'s processes (opt-in).

With :data:`TRACE_ENV` set to a folder, every process started by a deployment with
``trace_dir`` appends one JSON line per event to ``DIR/<name>-<pid>.jsonl``:
``{"t": unix seconds, "cpu": the process's CPU seconds so far, "proc": name, "ev": event,
"ids": [message ids], ...}``. Events, in the order a message meets them:

=============  ==================================================  ==========================
``push``       a Grid pushed messages (``kind``: message type)     cloud ServerApp, edge
``pushed``     ... and their content is on the SuperLink
``received``   a SuperNode's pull returned it (no content yet)     :mod:`.supernode`
``pulled``     ... and it pulled its content and stored it
               (``empty``: empty pulls before it)
``claimed``    a task runtime's AcquireTask returned its task      :mod:`.task_runtime`
``acquired``   ... and it read the task's input and the message
``answered``   ... and handed the reply to its SuperNode
``sent``       the SuperNode pushed the reply to its SuperLink     :mod:`.supernode`
``reply``      the Grid pulled the replies (ids: the messages)     cloud ServerApp, edge
``exchange``   one ``send_and_receive`` ended (``s``: seconds)
=============  ==================================================  ==========================

``benchmarks/deploy_latency.py`` turns them into the per-leg table of docs/deployment.md.
All processes run on one machine (one clock). Without the variable nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Folder of the trace files (unset: no tracing).
TRACE_ENV = "FEDHIER_TRACE_DIR"
#: The process's name in its events (``LocalDeployment.env`` sets it).
NAME_ENV = "FEDHIER_TRACE_NAME"


def trace(event: str, ids: Iterable[str], **fields: Any) -> None:
    """Append one event about messages ``ids`` (no-op unless :data:`TRACE_ENV` is set)."""
    folder = os.environ.get(TRACE_ENV)
    if not folder:
        return
    name = os.environ.get(NAME_ENV, "process")
    line = json.dumps({"t": time.time(), "cpu": time.process_time(), "proc": name,
                       "ev": event, "ids": list(ids), **fields})  # ``t`` in fields: when
    with open(Path(folder) / f"{name}-{os.getpid()}.jsonl", "a") as handle:
        handle.write(line + "\n")


def read_trace(folder: Path) -> list[dict[str, Any]]:
    """Every event in ``folder``, by time."""
    events = [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl"))
              for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])
