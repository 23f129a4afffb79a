"""fedhier's in-process wire-byte meter, loaded by Python at startup as ``sitecustomize``.

Python's ``site`` imports a top-level module ``sitecustomize`` at startup if one is on
``sys.path``; a process started with this folder first on ``PYTHONPATH`` therefore loads this
file before its own code (``fedhier.engines.deployment.wire.wire_env`` builds such an
environment). It does nothing unless ``FEDHIER_WIRE_DIR`` is set. Then:

* it counts the TCP connections this process opens as a client to port ``FEDHIER_WIRE_PORT``
  (the peer's port; ``socket.connect``/``connect_ex`` are patched), attributed to the link
  ``FEDHIER_WIRE_LINK``. Connections to other ports, and accepted (server-side) connections,
  count nothing, so a SuperNode's ClientApp subprocesses, which inherit the environment but
  talk to other local ports, write nothing;
* per counted connection it reads the kernel's ``TCP_INFO``: ``tcpi_bytes_acked`` (bytes
  sent and acknowledged by the peer) and ``tcpi_bytes_received``, less the SYN and FINs those
  sequence-number counters include, so: payload bytes (see ``_payload``). It reads them every
  ``FEDHIER_WIRE_INTERVAL`` seconds (default 0.25) from a daemon thread started at the first
  counted connection, just before ``close()``, at exit and on ``SIGTERM``. The payload is
  everything above TCP: TLS records, HTTP headers, bodies. A TLS socket made by
  ``ssl.SSLContext.wrap_socket`` from a counted socket is the same connection (``ssl`` is
  patched when the process imports it, not before);
* it writes ``<FEDHIER_WIRE_DIR>/<link>-<pid>.json`` = ``{"link", "pid", "argv0", "sent",
  "received", "connections"}``, totals over every counted connection of the process, closed
  ones included, atomically (a temporary file, then ``os.replace``): from the thread when the
  totals changed, at ``close()`` of a counted socket, at exit (``atexit``) and on ``SIGTERM``.
  A process that counted no connection writes no file. A child made by ``fork`` starts from
  zero (the connections it inherits are its parent's).

Flower 1.42 serves all of a SuperLink's APIs (Fleet, ServerAppIo, Control) on its one port, and
its SuperExec connects to that port too: give the environment only to the processes whose
connections to the port are the link's traffic (the SuperNodes), not to the SuperLink.

``SIGTERM``: a handler installed at startup writes the file, then does what the signal did
before: with the default disposition it restores it and re-raises the signal, so the process
still dies by ``SIGTERM``; a handler found (a ``.pth`` file's) is called; an ignored signal
stays ignored (no handler). A program that installs its own handler later replaces ours
(Flower's processes do: ``flwr.supercore.exit.register_signal_handlers``, whose handler calls
``flwr_exit`` -> ``sys.exit``); the file is then written by ``atexit`` on the way out. Not
guaranteed: a process ended by ``SIGKILL`` or ``os._exit`` (Flower's ``flwr_exit`` calls
``os._exit`` when its exit handlers take more than 5 s) keeps what the thread last wrote, at
most one interval old (the thread keeps writing while such a process winds down). A Python
handler runs when the main thread returns to the interpreter: a main thread stuck in a long C
call now ends on ``SIGTERM`` only when that call returns.

Never breaks the host: every error of the meter is swallowed, and it imports only small
standard modules (no ``ssl``, no ``json`` until it has something to write). Not counted:
connections made outside Python's ``socket`` module (C extensions, uvloop), bytes sent just
before ``close()`` that the peer had not acknowledged yet, a TLS handshake that fails inside
``wrap_socket``. Python started with ``-S``, ``-I`` or ``-E`` does not load this file.
Shadowing: this module is *the* ``sitecustomize``; if another one exists further down
``sys.path`` (a distribution's), it is run after this one (its ``__name__`` is
``sitecustomize``; ``sys.modules`` holds it as ``_fedhier_shadowed_sitecustomize``).
"""

from __future__ import annotations

import contextlib
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at run time: this module loads in every process
    from types import FrameType, ModuleType
    from typing import Any

DIR_ENV = "FEDHIER_WIRE_DIR"
LINK_ENV = "FEDHIER_WIRE_LINK"
PORT_ENV = "FEDHIER_WIRE_PORT"
INTERVAL_ENV = "FEDHIER_WIRE_INTERVAL"
DEFAULT_INTERVAL = 0.25
#: Set on ``socket.socket`` (and the patched ``wrap_socket``) once the meter is installed.
_MARK = "_fedhier_wiretap"

#: ``struct tcp_info`` (linux/tcp.h), of which the kernel returns what it knows: ``tcpi_state``
#: (u8, offset 0); ``tcpi_bytes_acked``, ``tcpi_bytes_received`` (u64, 120 and 128, Linux >=
#: 4.1); ``tcpi_bytes_sent``, ``tcpi_bytes_retrans`` (u64, 200 and 208, Linux >= 4.19).
_TCP_INFO_SIZE = 232
_ACKED_AT, _SENT_AT = 120, 200
#: TCP states (include/net/tcp_states.h) in which the peer's FIN has been received.
_FIN_WAIT2, _TIME_WAIT, _CLOSE, _CLOSE_WAIT, _LAST_ACK, _CLOSING = 5, 6, 7, 8, 9, 11
_PEER_FIN_STATES = (_TIME_WAIT, _CLOSE_WAIT, _LAST_ACK, _CLOSING)


def _payload(info: bytes) -> tuple[int, int] | None:
    """(payload bytes sent and acknowledged, payload bytes received) from a client socket's
    ``TCP_INFO``; None before the handshake completed (or if it never did).

    The kernel's counters follow sequence numbers, so they include the SYN (one acknowledged
    "byte" of every connection this end opened) and a FIN either way once it was acknowledged /
    received; those are taken out. Which FIN: ours is acknowledged when more was acknowledged
    than payload was ever sent (``tcpi_bytes_sent - tcpi_bytes_retrans``; before Linux 4.19,
    from the state); the peer's was received in the states after it, and in CLOSE when ours was
    acknowledged (a user's socket goes from FIN_WAIT2 or LAST_ACK to CLOSE). A connection reset
    may be off by one byte.
    """
    import struct

    if len(info) < _ACKED_AT + 16:
        return None
    acked, received = struct.unpack_from("=QQ", info, _ACKED_AT)
    if acked == 0:
        return None
    state, sent = info[0], acked - 1
    if len(info) >= _SENT_AT + 16:
        out, retrans = struct.unpack_from("=QQ", info, _SENT_AT)
        fin_acked = sent > out - retrans >= 0
    else:
        fin_acked = state in (_FIN_WAIT2, _TIME_WAIT, _CLOSE)
    if fin_acked:
        sent -= 1
    if received and (state in _PEER_FIN_STATES or (state == _CLOSE and fin_acked)):
        received -= 1
    return sent, received


def _safe(name: str) -> str:
    """``name`` with anything but letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "link"


class _Meter:
    """Counted connections of this process and the file that reports their totals."""

    def __init__(self, folder: str, link: str, port: int, interval: float) -> None:
        self.folder, self.link, self.port, self.interval = folder, link, port, interval
        self._reset()

    def _reset(self) -> None:
        """Forget every connection (also the child's side of a fork: they are the parent's)."""
        import threading
        import weakref

        self.lock = threading.RLock()
        #: open counted sockets -> connection number
        self.open: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: connection number -> (payload bytes sent, received), open and closed ones
        self.counts: dict[int, tuple[int, int]] = {}
        self.next_id = 0
        self.written: tuple[int, int, int] | None = None
        self.ticking = False
        self.writes = 0

    # -- hooks, called from the patched socket / ssl methods --------------------------------

    def on_connect(self, sock: Any, address: Any) -> None:
        """Count ``sock`` if it is a TCP socket connecting to the watched port."""
        import socket

        if (isinstance(address, tuple) and len(address) >= 2 and address[1] == self.port
                and sock.type == socket.SOCK_STREAM
                and sock.family in (socket.AF_INET, socket.AF_INET6)):
            with self.lock:
                if sock not in self.open:
                    self.open[sock] = self.next_id
                    self.next_id += 1
            self._start_ticking()

    def on_wrap(self, raw: Any, wrapped: Any) -> None:
        """``wrapped`` (an ``SSLSocket``) continues the connection of ``raw``, if counted."""
        with self.lock:
            number = self.open.pop(raw, None)
            if number is not None:
                self.open[wrapped] = number

    def on_close(self, sock: Any) -> None:
        """Read a counted socket's counters one last time, before its file descriptor goes."""
        if sock not in self.open:
            return
        with self.lock:
            number = self.open.pop(sock, None)
            if number is not None:
                self._read(sock, number)
        self.write()

    # -- reading and writing ----------------------------------------------------------------

    def _read(self, sock: Any, number: int) -> None:
        """Record the kernel's counters of one socket (nothing before it is connected: a
        connection that never comes through counts nothing)."""
        import socket

        try:
            if sock.fileno() < 0:
                return
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        except (OSError, ValueError):
            return
        payload = _payload(info)
        if payload is not None:
            self.counts[number] = payload

    def write(self, force: bool = False) -> None:
        """Refresh the open sockets' counters; write the file if the totals changed (or
        ``force``) and at least one connection counted."""
        with self.lock:
            for sock, number in list(self.open.items()):
                self._read(sock, number)
            sent = sum(acked for acked, _ in self.counts.values())
            received = sum(received for _, received in self.counts.values())
            totals = (sent, received, len(self.counts))
            if not self.counts or (totals == self.written and not force):
                return
            import json

            pid = os.getpid()
            argv = getattr(sys, "argv", None) or [""]
            record = {"link": self.link, "pid": pid, "argv0": str(argv[0]), "sent": sent,
                      "received": received, "connections": len(self.counts)}
            name = f"{_safe(self.link)}-{pid}.json"
            self.writes += 1
            tmp = os.path.join(self.folder, f".{name}.{self.writes}.tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(record, f)
                os.replace(tmp, os.path.join(self.folder, name))
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                return
            self.written = totals

    def _start_ticking(self) -> None:
        """Start the writer thread at the first counted connection (once per process)."""
        import threading

        with self.lock:
            if self.ticking:
                return
            self.ticking = True
        threading.Thread(target=self._tick, name="fedhier-wiretap", daemon=True).start()

    def _tick(self) -> None:
        with contextlib.suppress(Exception):  # e.g. an interval too long for time.sleep
            import time

            while True:
                time.sleep(self.interval)
                with contextlib.suppress(Exception):
                    self.write()

    def at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.write(force=True)

    def after_fork(self) -> None:
        with contextlib.suppress(Exception):
            self._reset()


def _patch_socket(meter: _Meter) -> None:
    """Count the connections ``socket.socket.connect``/``connect_ex`` open to the watched port
    and read them at ``close()``. The wrappers swallow every error of the meter."""
    import functools
    import socket

    cls: Any = socket.socket
    orig_connect, orig_connect_ex, orig_close = cls.connect, cls.connect_ex, cls.close

    @functools.wraps(orig_connect)
    def connect(self: socket.socket, address: Any) -> None:
        try:  # noqa: SIM105 (no module globals: also safe during interpreter shutdown)
            meter.on_connect(self, address)
        except Exception:
            pass
        return orig_connect(self, address)

    @functools.wraps(orig_connect_ex)
    def connect_ex(self: socket.socket, address: Any) -> int:
        try:  # noqa: SIM105 (no module globals: also safe during interpreter shutdown)
            meter.on_connect(self, address)
        except Exception:
            pass
        return orig_connect_ex(self, address)

    @functools.wraps(orig_close)
    def close(self: socket.socket) -> None:
        try:  # noqa: SIM105 (no module globals: also safe during interpreter shutdown)
            meter.on_close(self)
        except Exception:
            pass
        orig_close(self)

    cls.connect, cls.connect_ex, cls.close = connect, connect_ex, close
    setattr(cls, _MARK, True)


def _patch_ssl(meter: _Meter, ssl: ModuleType) -> None:
    """Carry a counted socket's connection over to the ``SSLSocket`` wrapping it."""
    import functools

    cls = ssl.SSLContext
    orig_wrap = cls.wrap_socket
    if getattr(orig_wrap, _MARK, False):
        return

    @functools.wraps(orig_wrap)
    def wrap_socket(self: Any, sock: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped = orig_wrap(self, sock, *args, **kwargs)
        try:  # noqa: SIM105 (no module globals: also safe during interpreter shutdown)
            meter.on_wrap(sock, wrapped)
        except Exception:
            pass
        return wrapped

    setattr(wrap_socket, _MARK, True)
    cls.wrap_socket = wrap_socket


class _SslImportHook:
    """A ``sys.meta_path`` finder that patches ``ssl`` right after it is first imported, so that
    a process that never uses TLS never loads it. Inert for every other module."""

    def __init__(self, meter: _Meter) -> None:
        self.meter = meter
        self.done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "ssl" or self.done:
            return None
        self.done = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader: Any = spec.loader
            exec_module = getattr(loader, "exec_module", None)
            if exec_module is None:
                return spec
            meter = self.meter

            def exec_and_patch(module: ModuleType) -> None:
                exec_module(module)
                with contextlib.suppress(Exception):
                    _patch_ssl(meter, module)

            loader.exec_module = exec_and_patch
            return spec
        except Exception:
            return None


def _handle_sigterm(meter: _Meter) -> None:
    """On ``SIGTERM``, write, then do what the signal did before: die by it (the default
    disposition) or call the handler found (one a ``.pth`` file installed). Ignored stays
    ignored. A handler the program installs later replaces this one; see the module docstring.
    """
    import signal
    import threading

    previous = signal.getsignal(signal.SIGTERM)
    if (threading.current_thread() is not threading.main_thread()
            or not (previous is signal.SIG_DFL or callable(previous))):
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        meter.at_exit()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # not reached: the default disposition ends the process

    signal.signal(signal.SIGTERM, on_sigterm)


def activate(environ: Any = None) -> bool:
    """Install the meter as configured by ``environ`` (default ``os.environ``); True if it
    runs. Called at startup when this file is loaded as ``sitecustomize``."""
    env = os.environ if environ is None else environ
    folder = env.get(DIR_ENV)
    if not folder:
        return False
    import socket

    if getattr(socket.socket, _MARK, False):  # already installed in this process
        return False
    try:
        port = int(env.get(PORT_ENV, ""))
        interval = float(env.get(INTERVAL_ENV) or DEFAULT_INTERVAL)
    except ValueError:
        return False
    if not 0 < port < 65536 or not interval > 0:
        return False
    meter = _Meter(os.path.abspath(folder), env.get(LINK_ENV) or "link", port, interval)
    _patch_socket(meter)
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        _patch_ssl(meter, ssl)
    else:
        sys.meta_path.insert(0, _SslImportHook(meter))
    import atexit

    atexit.register(meter.at_exit)
    os.register_at_fork(after_in_child=meter.after_fork)
    _handle_sigterm(meter)
    return True


def _run_shadowed_sitecustomize() -> None:
    """Run the ``sitecustomize`` this module hides (one further down ``sys.path``), if any."""
    import importlib.machinery

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if p and os.path.abspath(p) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    sys.modules["_fedhier_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    with contextlib.suppress(Exception):
        activate()
    with contextlib.suppress(Exception):
        _run_shadowed_sitecustomize()
