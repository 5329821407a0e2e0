"""Loopback ports for the servers that tests and benches start (no quillcache import: the
benches load it against any build)."""
from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                                # Linux's default


_EPHEMERAL_LOW = _ephemeral_low()                   # the first port the kernel gives outgoing connections
_LOWEST = 10000                                     # picked from [_LOWEST, _EPHEMERAL_LOW)
_PICKED: set[int] = set()                           # never hand the same port out twice
_RNG = random.SystemRandom()                        # untouched by a test that seeds `random`


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, and likely still free when a server binds it.

    Picked below the kernel's ephemeral range: a port from ``bind(0)`` lies inside it, where
    any outgoing connection in the run (a client, etcd's own peers) may take it between the
    pick and the server's bind; CI lost a run to that ("Address already in use").  Outside
    the range only another listener can take it, and no test binds a port it did not pick
    here.  Falls back to the kernel's pick where the range leaves too little room below it.
    """
    if _EPHEMERAL_LOW - _LOWEST > 2000:
        for _ in range(200):
            port = _RNG.randrange(_LOWEST, _EPHEMERAL_LOW)
            if port in _PICKED:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _PICKED.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
