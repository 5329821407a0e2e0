"""Loopback ports for the servers that tests and benches start (no quillcache import: the
benches load it against any build)."""
from __future__ import annotations

import os
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


def _slice() -> tuple[int, int]:
    """``QUILLCACHE_PORT_SLICE`` "i/n": this process picks only ports ``p % n == i``.  `make test`
    runs the engine tests in a second pytest beside the main suite; each process keeps its own
    record of the ports it handed out, so two of them could pick the same port, and one's
    server then fails to bind it.  Given disjoint slices ("0/2" and "1/2") they cannot.  Unset:
    every port ("0/1")."""
    text = os.environ.get("QUILLCACHE_PORT_SLICE", "").strip() or "0/1"
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"QUILLCACHE_PORT_SLICE={text!r}: give i/n with 0 <= i < n (say 0/2 and 1/2)")
    return _worker_slice(i, n)


def _worker_slice(i: int, n: int) -> tuple[int, int]:
    """Slice ``i/n`` cut again among pytest-xdist's workers: `make test` runs the main suite on two
    (``-n 2``) beside the engine tests, and worker ``gwK`` of ``W`` picks ports ``p % (n*W) ==
    i + n*K``, inside ``i/n`` and apart from its sibling's.  Not under xdist: ``i/n`` itself."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        k, w = int(worker.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", ""))
    except ValueError:
        return i, n
    if not 0 <= k < w:
        return i, n
    return i + n * k, n * w


_SLICE = _slice()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, and likely still free when a server binds it.

    Picked below the kernel's ephemeral range: a port from ``bind(0)`` lies inside it, where
    any outgoing connection in the run (a client, etcd's own peers) may take it between the
    pick and the server's bind; CI lost a run to that ("Address already in use").  Outside
    the range only another listener can take it, and no test binds a port it did not pick
    here.  Only ports of this process's ``QUILLCACHE_PORT_SLICE`` (``_slice``): another process
    of the same run picking from another slice cannot hand out the same port.  Falls back to
    the kernel's pick where the range leaves too little room below it.
    """
    i, n = _SLICE
    if _EPHEMERAL_LOW - _LOWEST > 2000 * n:
        for _ in range(200):
            port = _RNG.randrange(_LOWEST + n - 1, _EPHEMERAL_LOW)
            port -= (port - i) % n                  # down to this process's slice, still >= _LOWEST
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
