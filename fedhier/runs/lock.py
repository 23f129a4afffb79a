"""An exclusive lock on a run folder, held for the whole life of the run that writes it.

``RUN_DIR/.lock`` is locked with ``fcntl.flock`` and holds the holder's pid. A second
``fedhier run --out RUN_DIR`` or a ``fedhier run --resume RUN_DIR`` while the first one still
runs gets a one-line error naming the folder and that pid; neither writes a byte into the
other's folder. The kernel drops the lock when the holder exits, however it exits (SIGKILL
included), so a crashed run never leaves a stale lock: its folder can be resumed at once.

The file is removed when the run ends. A process that opened the file just before it was
removed could lock the removed file, so :meth:`RunLock.acquire` checks that the path still
names the file it locked and starts over if not.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from fedhier.common.errors import ConfigError

LOCK_NAME = ".lock"


class RunFolderBusyError(ConfigError):
    """Another live process holds the run folder's lock (exit code 2)."""


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file (it may not have written it yet)."""
    for _ in range(20):
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            return None
        if text.isdigit():
            return int(text)
        time.sleep(0.01)
    return None


def live_holder(folder: str | Path) -> int | None:
    """The pid written in ``folder``'s lock file if that process is alive, else None. Reads
    the file without locking it (so it never disturbs a run taking the lock); for messages
    only: :meth:`RunLock.acquire` is what decides."""
    try:
        text = (Path(folder) / LOCK_NAME).read_text(encoding="ascii").strip()
        pid = int(text)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def busy_error(folder: Path, pid: int | None, purpose: str = "write") -> RunFolderBusyError:
    holder = f"pid {pid}" if pid is not None else "a process that is starting"
    action = ("resume it when that run has stopped" if purpose == "resume"
              else "wait for it to finish or choose another --out")
    return RunFolderBusyError(f"run folder {folder} is in use by another fedhier run "
                              f"({holder}); {action}")


class RunLock:
    """``with RunLock(folder):`` holds ``folder/.lock`` exclusively, or raises
    :class:`RunFolderBusyError` at once (it never waits for the holder)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self, purpose: str = "write") -> RunLock:
        """Lock the folder. ``purpose`` words the error: "write" (a new run) or "resume".

        Raises:
            RunFolderBusyError: another process holds the lock.
            OSError: the lock file cannot be created (read-only or full file system, the
                folder is gone); the caller turns it into a one-line error.
        """
        if self.fd is not None:
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                pid = _read_pid(fd)
                os.close(fd)
                raise busy_error(self.folder, pid, purpose) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # we locked a file its holder had just removed: start over
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                os.close(fd)
                raise
            self.fd = fd
            return self

    def release(self) -> None:
        """Remove the lock file, then unlock (in that order: see the module docstring)."""
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the folder is gone or read-only now: the kernel still drops the lock
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

