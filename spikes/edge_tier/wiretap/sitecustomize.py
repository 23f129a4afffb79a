"""In-process wire-byte meter (spike). Loaded by every Python process started with
PYTHONPATH=/work/spike/wiretap and WIRETAP_DIR set. For every TCP socket whose local or peer
port is in WIRETAP_PORTS it reads the kernel's TCP_INFO (tcpi_bytes_acked = payload bytes sent
and acknowledged, tcpi_bytes_received) just before close and every 0.5 s while open, and writes
the per-connection totals to WIRETAP_DIR/<pid>.json. Counts everything above TCP: TLS records,
HTTP headers, protobuf bodies."""
import os
if os.environ.get("WIRETAP_DIR"):
    import atexit, json, socket, struct, sys, threading, weakref

    _PORTS = {int(p) for p in os.environ.get("WIRETAP_PORTS", "").split(",") if p}
    _DIR = os.environ["WIRETAP_DIR"]
    _lock = threading.Lock()
    _live = weakref.WeakSet()
    _stats: dict = {}   # "local>peer" -> [acked, received]

    def _read(s):
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
            l, p = s.getsockname()[1], s.getpeername()[1]
        except OSError:
            return
        if l in _PORTS or p in _PORTS:
            acked, received = struct.unpack_from("QQ", info, 120)
            with _lock:
                _stats[f"{l}>{p}"] = [acked, received]

    def _dump():
        for s in list(_live):
            _read(s)
        with _lock:
            data = {"argv": sys.argv[:2], "conns": dict(_stats)}
        tmp = os.path.join(_DIR, f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(_DIR, f"{os.getpid()}.json"))

    _orig_close, _orig_connect, _orig_accept = socket.socket.close, socket.socket.connect, socket.socket.accept

    def close(self):
        if self.fileno() >= 0 and self.type == socket.SOCK_STREAM:
            _read(self)
        _orig_close(self)

    def connect(self, addr):
        try:
            return _orig_connect(self, addr)
        finally:
            _live.add(self)

    import ssl
    _orig_wrap = ssl.SSLContext.wrap_socket

    def wrap_socket(self, *a, **k):
        s = _orig_wrap(self, *a, **k)
        _live.add(s)
        return s

    ssl.SSLContext.wrap_socket = wrap_socket

    def accept(self):
        conn, addr = _orig_accept(self)
        _live.add(conn)
        return conn, addr

    socket.socket.close, socket.socket.connect, socket.socket.accept = close, connect, accept

    def _loop():
        while True:
            threading.Event().wait(0.5)
            try:
                _dump()
            except Exception:
                pass

    threading.Thread(target=_loop, daemon=True).start()
    atexit.register(_dump)
