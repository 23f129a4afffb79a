"""Ports on the loopback interface: free, busy, open."""

from __future__ import annotations

import socket

from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.errors import DeployError

HOST = "127.0.0.1"  # loopback only: this command never listens on another address


def port_is_free(port: int, host: str = HOST) -> bool:
    """Nothing listens on ``port``. Bound as servers bind (SO_REUSEADDR), so the TIME_WAIT
    connections a finished run leaves behind do not count as busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(count: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port p >= start such that p .. p+count-1 are all free on 127.0.0.1."""
    port = start
    while port + count < stop:
        if all(port_is_free(p) for p in range(port, port + count)):
            return port
        port += count
    raise DeployError(f"no block of {count} free ports on {HOST}")


def ports_needed(nodes: int, edges: int) -> int:
    """Ports from the base port: cloud SuperLink, N client SuperNodes, 2 per edge."""
    return 1 + nodes + 2 * edges


def check_ports(base_port: int, nodes: int) -> None:
    """ConfigError unless ``base_port .. base_port + nodes`` are valid and free."""
    last = base_port + nodes
    if base_port < 1024 or last > 65535:
        raise ConfigError(f"ports {base_port}..{last} must lie in 1024..65535; choose another "
                          "--base-port")
    busy = [p for p in range(base_port, last + 1) if not port_is_free(p)]
    if busy:
        raise ConfigError(f"port(s) {', '.join(map(str, busy[:5]))} on {HOST} in use; choose "
                          f"another --base-port (needs {nodes + 1} free ports from it)")



def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
