"""Process supervision: start Flower's processes in their own sessions, snapshot their whole
trees (SuperExec, ServerApp and ClientApp processes included), and stop every one of them.

Nothing here knows about Flower's command lines; :mod:`.local` builds them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from fedhier.engines.deployment.errors import DeployError

#: Environment of every process started here: no telemetry, no update check (no network),
#: no runtime dependency installation (uv would pull a CUDA torch).
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}


def _proc_stat(pid: int) -> tuple[int, int, str, str] | None:
    """(ppid, pgid, state, start time) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return int(rest[1]), int(rest[2]), rest[0], rest[19]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry.name))
    return children


def process_tree(roots: Sequence[int]) -> dict[int, str]:
    """Every live process under ``roots`` (included), as pid -> start time."""
    children = _children_map()
    found: dict[int, str] = {}
    stack = list(roots)
    while stack:
        pid = stack.pop()
        stat = _proc_stat(pid)
        if pid in found or stat is None:
            continue
        found[pid] = stat[3]
        stack.extend(children.get(pid, []))
    return found


def alive(processes: Mapping[int, str]) -> list[int]:
    """The pids of ``processes`` still running (same start time, not a zombie)."""
    out = []
    for pid, start in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[3] == start and stat[2] != "Z":
            out.append(pid)
    return out


@dataclass
class Managed:
    """One process started here, in its own session (process group = its pid)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class ProcessGroup:
    """Starts processes in new sessions and stops all of them, and their descendants.

    Flower's SuperLink starts a detached SuperExec (its own session) that starts the
    ServerApp; SuperNodes start a SuperExec and ClientApp processes. ``stop_all`` snapshots
    the whole tree first (children are re-parented once their parent dies), sends SIGTERM
    to every process group in it, waits, then SIGKILLs whatever is left.
    """

    def __init__(self) -> None:
        self.started: list[Managed] = []
        self.seen: dict[int, str] = {}  # every pid of the trees, as last snapshotted

    def start(self, name: str, cmd: Sequence[str], env: Mapping[str, str], log: Path,
              cwd: Path) -> Managed:
        log.parent.mkdir(parents=True, exist_ok=True)
        # the child writes to its own copy of the descriptor: ours is closed at once, so a
        # deployment that restarts processes (re-attached SuperNodes) holds no handle each
        with open(log, "ab") as handle:
            handle.write(f"$ {shlex.join(cmd)}\n".encode())  # the log says what ran
            handle.flush()
            popen = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=handle,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        managed = Managed(name, popen, log)
        self.started.append(managed)
        self.snapshot()
        return managed

    def snapshot(self) -> dict[int, str]:
        """Record every live descendant of the processes started here."""
        tree = process_tree([m.pid for m in self.started if m.popen.poll() is None])
        self.seen.update(tree)
        return tree

    def _signal(self, pids: Sequence[int], sig: int) -> None:
        groups = set()
        for pid in pids:
            stat = _proc_stat(pid)
            if stat is not None and stat[1] in self.seen:  # groups led by our processes only
                groups.add(stat[1])
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        for pgid in groups:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def stop(self, managed: Sequence[Managed], grace: float = 8.0) -> list[int]:
        """SIGTERM ``managed`` and their descendants; SIGKILL after ``grace`` s. Returns
        the pids still alive afterwards (normally none)."""
        tree = process_tree([m.pid for m in managed if m.popen.poll() is None])
        self.seen.update(tree)
        self._signal(list(tree), signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline:
            for m in managed:
                m.popen.poll()  # reap our direct children
            if not alive(tree):
                break
            time.sleep(0.1)
        left = alive(tree)
        if left:
            self._signal(left, signal.SIGKILL)
            time.sleep(0.5)
        for m in managed:
            with suppress(subprocess.TimeoutExpired):
                m.popen.wait(timeout=5)
        return alive(tree)

    def stop_all(self, grace: float = 8.0) -> list[int]:
        """Stop SuperNodes first, then the rest; returns pids left alive (should be [])."""
        self.snapshot()
        nodes = [m for m in self.started if m.name.startswith("supernode")]
        others = [m for m in self.started if not m.name.startswith("supernode")]
        self.stop(nodes, grace)
        self.stop(others, grace)
        left = alive(self.seen)
        if left:  # detached grandchildren seen in an earlier snapshot
            self._signal(left, signal.SIGKILL)
            time.sleep(0.5)
            left = alive(self.seen)
        return left



def executable(name: str) -> str:
    """A Flower command from this Python's environment (then PATH)."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"'{name}' not found; install flwr[simulation]==1.42.0")
    return found
