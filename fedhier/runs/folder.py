"""The run folder: everything needed to audit and repeat a run, written atomically.

Layout: config.json, partition.json, groups.json, metrics.jsonl, summary.json,
model_initial.safetensors, model_final.safetensors, curves.png; checkpoint.pt with
--checkpoint-every; failed.json when a run that had completed cloud rounds failed.

The command line claims a folder (:meth:`RunFolder.claim`, :meth:`RunFolder.claim_existing`)
only after the configuration, data and device are validated, holds its lock
(:mod:`fedhier.runs.lock`) for the run's life, and on failure either removes what it created
(no cloud round had completed) or leaves ``failed.json`` with the reason (:meth:`RunFolder.fail`).
Writes that the file system refuses (disk full, read-only, the folder removed) raise
:class:`WriteError`, one line naming the file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedhier.common.errors import ConfigError, DamagedFileError, FedhierError
from fedhier.runs import crash_points
from fedhier.runs.lock import LOCK_NAME, RunLock, busy_error, live_holder
from fedhier.runs.trackers import OUTPUT_FOLDERS

if TYPE_CHECKING:  # torch is imported where a model is saved: the CLI answers without it
    import torch

FAILED = "failed.json"
#: Every file a run writes in its folder: ``--overwrite`` removes them all when it claims the
#: folder, so that the folder describes one run (never an earlier run's model or curves beside
#: the new run's failed.json).
RUN_FILES = ("config.json", "partition.json", "groups.json", "groups.png", "metrics.jsonl",
             "summary.json", "model_initial.safetensors", "model_final.safetensors",
             "curves.png", "groups_history.json", "groups_history.png", FAILED, "checkpoint.pt",
             ".checkpoint.pt.tmp")


class WriteError(FedhierError):
    """An output file could not be written: disk full, read-only file system, folder gone
    (exit code 5)."""


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into a one-line :class:`WriteError`."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise WriteError(f"cannot write {path}: {reason}") from exc


class JsonStream(list):  # type: ignore[type-arg]
    """A JSON array of ``count`` items made one at a time, ``item(j)``, as :func:`write_json`
    writes it (a run folder's per-client lists: not all in memory at a million clients)."""

    def __init__(self, count: int, item: Callable[[int], Any]) -> None:
        super().__init__()
        self.size, self.make = count, item

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Any]:
        return (_jsonable(self.make(j)) for j in range(self.size))


def _jsonable(value: Any) -> Any:
    if isinstance(value, JsonStream):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def atomic_write_bytes(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (or its parts in turn) to a temporary file beside ``path`` and rename
    it: never a half-written file."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                for part in [data] if isinstance(data, bytes) else data:
                    handle.write(part)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def write_json(path: Path, value: Any) -> None:
    """``json.dumps(value, indent=1)`` and a newline, written as it is encoded (the same
    bytes; a :class:`JsonStream` is never whole in memory)."""
    chunks = json.JSONEncoder(indent=1).iterencode(_jsonable(value))
    atomic_write_bytes(path, (chunk.encode() for chunk in itertools.chain(chunks, ["\n"])))


def default_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}"


def _entries(path: Path) -> list[str]:
    """The names in a folder, the lock file left out."""
    return [p.name for p in path.iterdir() if p.name != LOCK_NAME]


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


class RunFolder:
    """A run folder. ``create`` refuses to reuse a non-empty folder unless ``overwrite``;
    ``claim`` does the same and locks it for this process (the command line's way)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock = RunLock(self.path)
        self.resumed = False
        self._created: Path | None = None  # the topmost folder this run created
        self._pristine = False  # empty before this run: everything in it is this run's

    @staticmethod
    def check_target(path: str | Path, overwrite: bool = False) -> None:
        """Refuse, in one line, an ``--out`` that is a file or a non-empty folder (without
        ``overwrite``), or whose parent is not a folder; cheap, so it runs before the data
        is loaded."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run folder {path} exists and is not a folder; choose another "
                              "--out")
        try:
            busy = path.is_dir() and bool(_entries(path))
        except OSError as exc:
            raise ConfigError(f"--out {path}: cannot read the folder: {_os_reason(exc)}") from exc
        if busy and not overwrite:
            pid = live_holder(path)
            if pid is not None and pid != os.getpid():
                raise busy_error(path, pid)
            raise ConfigError(
                f"run folder {path} already exists and is not empty; choose another --out "
                "or pass --overwrite")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"--out {path}: {parent} is a file, not a folder")
                break

    @classmethod
    def create(cls, path: str | Path, overwrite: bool = False) -> RunFolder:
        path = Path(path)
        cls.check_target(path, overwrite)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {path}: cannot create the run folder: "
                              f"{_os_reason(exc)}") from exc
        folder = cls(path)
        if overwrite:
            with writing(path / "metrics.jsonl"):
                (path / "metrics.jsonl").unlink(missing_ok=True)
        return folder

    @classmethod
    def claim(cls, path: str | Path, overwrite: bool = False,
              unique: bool = False) -> RunFolder:
        """Create (or reuse an empty, or with ``overwrite`` any) folder and lock it.

        ``unique``: ``path`` is a default name; if it exists, use ``path-2``, ``path-3``...
        (two runs started in the same second get two folders).

        Raises:
            ConfigError: the path is a file, a non-empty folder (without ``overwrite``), or
                cannot be created or written (read-only or full file system); a
                :class:`~fedhier.runs.lock.RunFolderBusyError` when another run holds it.
        """
        base = Path(path)
        path = base
        for attempt in range(2, 1000):
            if not unique or not path.exists():
                break
            path = base.with_name(f"{base.name}-{attempt}")
        cls.check_target(path, overwrite)
        top = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
        try:
            path.mkdir(parents=True)
            created = True
        except FileExistsError:
            created = False
            if not path.is_dir():
                raise ConfigError(f"run folder {path} exists and is not a folder; choose "
                                  "another --out") from None
        except OSError as exc:
            raise ConfigError(f"--out {path}: cannot create the run folder: "
                              f"{_os_reason(exc)}") from exc
        folder = cls(path)
        folder._created = top if created else None
        try:
            folder.lock.acquire()
        except OSError as exc:
            folder._remove_created()
            raise ConfigError(f"--out {path}: cannot write in the run folder: "
                              f"{_os_reason(exc)}") from exc
        try:
            cls.check_target(path, overwrite)  # another run may have filled it meanwhile
            folder._pristine = not _entries(path)
            if overwrite:
                for name in RUN_FILES:  # the earlier run's files, all of them
                    with writing(path / name):
                        (path / name).unlink(missing_ok=True)
                for name in OUTPUT_FOLDERS:  # and its trackers' (their rounds are not ours)
                    if (path / name).is_dir():
                        with writing(path / name):
                            shutil.rmtree(path / name)
        except BaseException:
            folder.lock.release()
            folder._remove_created()
            raise
        return folder

    @classmethod
    def claim_existing(cls, path: str | Path) -> RunFolder:
        """Lock an existing run folder to continue it (``--resume``)."""
        path = Path(path)
        if not path.is_dir():
            what = "is not a folder" if path.exists() else "does not exist"
            raise ConfigError(f"--resume {path}: {what}; give a run folder")
        folder = cls(path)
        folder.resumed = True
        try:
            folder.lock.acquire(purpose="resume")
        except OSError as exc:
            raise ConfigError(f"--resume {path}: cannot write in the run folder: "
                              f"{_os_reason(exc)}") from exc
        return folder

    # -- the end of a run -----------------------------------------------------------------
    def completed_rounds(self) -> int:
        """The last cloud round recorded in metrics.jsonl (0 if none)."""
        try:
            records = read_metrics(self.path)
        except (FedhierError, OSError, ValueError):
            return 0
        rounds = [r.get("round") for r in records if isinstance(r, dict)]
        return max([r for r in rounds if isinstance(r, int)], default=0)

    def succeed(self) -> None:
        """The run finished: drop a failed.json left by an earlier attempt, unlock."""
        try:
            with writing(self.path / FAILED):
                (self.path / FAILED).unlink(missing_ok=True)
        finally:
            self.lock.release()

    def fail(self, reason: str, exit_code: int, interrupted: bool = False) -> str:
        """The run failed (or was interrupted). Before any cloud round completed, in a folder
        this run created or found empty, remove what it wrote; otherwise keep the work and
        (unless ``interrupted`` with a checkpoint to resume from) write failed.json with the
        reason. Returns a few words for the error line saying which. Unlocks."""
        try:
            done = self.completed_rounds()
            resumable = (self.path / "checkpoint.pt").exists()
            if not self.resumed and done == 0 and self._pristine:
                self._remove_written()
                return f"run folder {self.path} removed (no cloud round had completed)"
            if interrupted and resumable:
                return ""
            record = {"status": "failed", "reason": reason, "exit_code": exit_code,
                      "last_completed_round": done, "checkpoint": resumable,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            try:
                write_json(self.path / FAILED, record)
            except WriteError as exc:
                return f"could not mark {self.path} failed: {exc}"
            return f"run folder {self.path} kept, marked failed in {FAILED}"
        finally:
            self.lock.release()

    def _remove_written(self) -> None:
        """Remove everything in the folder (it was empty or new), and the folder itself and
        the parents this run created."""
        if self._created is not None:
            self._remove_created()
            return
        for name in _entries(self.path):
            target = self.path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    target.unlink()

    def _remove_created(self) -> None:
        """Remove the folder and the parents this run created (never anything else)."""
        if self._created is None:
            return
        shutil.rmtree(self._created, ignore_errors=True)
        self._created = None

    # -- writing --------------------------------------------------------------------------
    def write_json(self, name: str, value: Any) -> None:
        write_json(self.path / name, value)

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl and flush it to disk."""
        path = self.path / "metrics.jsonl"
        line = json.dumps(_jsonable(record)) + "\n"
        with writing(path), open(path, "a", encoding="utf-8") as handle:
            if crash_points.active():  # a test kills the process halfway through the line
                handle.write(line[:len(line) // 2])
                handle.flush()
                os.fsync(handle.fileno())
                crash_points.crash_point()
                line = line[len(line) // 2:]
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def rewrite_metrics(self, records: list[dict[str, Any]]) -> None:
        """Replace metrics.jsonl atomically with ``records`` (used when resuming)."""
        text = "".join(json.dumps(_jsonable(r)) + "\n" for r in records)
        atomic_write_bytes(self.path / "metrics.jsonl", text.encode())

    def save_model(self, name: str, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tmp = self.path / f".{name}.tmp"
        with writing(self.path / name):
            try:
                save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                          str(tmp))
                os.replace(tmp, self.path / name)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-cloud-round records of a run folder's metrics.jsonl; a one-line ConfigError
    naming the file and line if it is damaged. A last line cut short (a write the kernel
    never finished: no newline at its end) is dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a fedhier run folder (no metrics.jsonl)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise DamagedFileError(path, f"cannot read it: {reason}", _REMEDY) from exc
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # the torn last line of an interrupted append
                break
            raise DamagedFileError(path, f"damaged: line {number} is not JSON",
                                   _REMEDY) from None
        if not isinstance(record, dict) or not isinstance(record.get("round"), int):
            raise DamagedFileError(path, f"damaged: line {number} is not a round's record",
                                   _REMEDY)
        records.append(record)
    return records


#: What to do about a damaged file of a run folder.
_REMEDY = "the run folder is damaged; rerun the run (or restore the file from a copy)"


def read_json(run_dir: str | Path, name: str) -> Any:
    """A JSON file of a run folder; a one-line :class:`DamagedFileError` if it cannot be
    read or is not JSON."""
    path = Path(run_dir) / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, not JSON
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            "not UTF-8 JSON text" if isinstance(exc, ValueError) else str(exc)
        raise DamagedFileError(path, f"cannot read it ({reason})", _REMEDY) from None
