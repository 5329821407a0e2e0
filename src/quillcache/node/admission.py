"""Who a connection comes from, and how many may wait to log in.

* A *source* is what the per-source limits and the failed-HELLO slow-down count by: the
  peer's IP address on TCP (the port is not part of it: a client picks a new one per
  connection), ``uid=U,pid=P`` from ``SO_PEERCRED`` on the Unix socket (every Unix peer has
  the empty address, so that would put the engine and any other local process together).
  Log lines name the peer by its ``name``: ``ip:port`` or ``unix:uid=U,pid=P``.
* ``Admission`` keeps the connections that have not logged in yet (HELLO), oldest first.
  Together they may hold at most ``max_unauthenticated`` slots (at most half of
  ``max_connections``: logged-in clients keep the rest); one source at most
  ``max_per_source`` of them.  The newest always gets its chance: a source at its limit
  pushes out its own oldest waiting connection (never another source's), and when the
  shared pool is full, or every slot of the node is taken, the oldest waiting connection of
  all is closed.  A newcomer with a valid token logs in unless the peer opens more
  connections in the time of its HELLO's round trip than those limits; bare connections
  cannot keep logged-in clients out, and a source that is refused nothing cannot be locked
  out by a neighbour holding idle connections.
* ``RateLimitedLog``: log lines about bad input (malformed frames, refused HELLOs, refused
  connections) at most ``LOG_BURST`` at once and ``LOG_PER_S`` a second; the lines it drops
  are counted and the count is logged with the next line that passes (or by ``flush``).
"""
from __future__ import annotations

import logging
import socket
import struct
import time
from collections import OrderedDict
from typing import Callable, Optional

__all__ = ["Admission", "RateLimitedLog", "peer_identity", "LOG_BURST", "LOG_PER_S"]

LOG_BURST = 20                   # lines of bad-input logging let through at once
LOG_PER_S = 1.0                  # lines per second after the burst
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (native ints)


def peer_identity(transport) -> tuple[str, str]:
    """``(source, name)`` of a connection's peer; see the module docstring."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            pid, uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return "unix:?", "unix:?"
        source = f"unix:uid={uid},pid={pid}"
        return source, source
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return host, (f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}")
    return str(peer), str(peer)


class RateLimitedLog:
    """A token bucket in front of a logger, for lines a peer can cause at will."""

    def __init__(self, logger: logging.Logger, *, burst: int = LOG_BURST, per_s: float = LOG_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._burst = float(burst)
        self._per_s = per_s
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.suppressed = 0          # lines dropped since the last one written
        self.suppressed_total = 0    # lines dropped since start

    def _take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def log(self, level: int, msg: str, *args) -> None:
        if not self._log.isEnabledFor(level):
            return
        if not self._take():
            self.suppressed += 1
            self.suppressed_total += 1
            return
        if self.suppressed:
            msg += " (and %d similar lines suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._log.log(level, msg, *args)

    def flush(self) -> None:
        """Log how many lines were dropped, when some were and the bucket allows a line."""
        if self.suppressed and self._take():
            n, self.suppressed = self.suppressed, 0
            self._log.warning("%d log lines about bad input suppressed (at most %d at once, %g a second)",
                              n, int(self._burst), self._per_s)


class Admission:
    """The connections waiting to log in, by source and oldest first (see the module docstring)."""

    def __init__(self, max_connections: int, max_unauthenticated: int, max_per_source: int) -> None:
        if max_connections < 1 or max_unauthenticated < 1 or max_per_source < 1:
            raise ValueError("connection limits must be positive")
        self.max_connections = max_connections
        # logged-in clients keep at least half of the slots
        self.max_unauthenticated = max(1, min(max_unauthenticated, max_connections // 2))
        self.max_per_source = max_per_source
        self._waiting: OrderedDict = OrderedDict()              # connection -> source, oldest first
        self._by_source: dict[str, OrderedDict] = {}            # source -> its waiting, oldest first
        self.evicted = 0             # closed to make room for a newer one, from anywhere
        self.evicted_same_source = 0  # ... for a newer one of the same source (max_per_source)

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting_from(self, source: str) -> int:
        mine = self._by_source.get(source)
        return len(mine) if mine is not None else 0

    def admit(self, conn, source: str, open_connections: int) -> Optional[tuple[str, str]]:
        """Take ``conn`` (not logged in) among the waiting, closing the oldest waiting ones to
        make room: of its own source when that one has ``max_per_source`` waiting (a source
        pushes out only its own), else of all.  Returns None, or ``(reason, message)`` when
        every slot is held by logged-in clients.  ``open_connections``: the node's before it."""
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= self.max_per_source:
            self.evicted_same_source += 1
            open_connections -= self._evict(next(iter(mine)))
        while self._waiting and (len(self._waiting) >= self.max_unauthenticated
                                 or open_connections >= self.max_connections):
            self.evicted += 1
            open_connections -= self._evict(next(iter(self._waiting)))
        if open_connections >= self.max_connections:
            return "max_connections", f"{open_connections} connections open, at most {self.max_connections}"
        self._waiting[conn] = source
        mine = self._by_source.get(source)        # again: an eviction may have emptied and dropped it
        if mine is None:
            mine = self._by_source[source] = OrderedDict()
        mine[conn] = None
        return None

    def _evict(self, conn) -> int:
        """Close a waiting connection (``conn.evict()``); 1 if it held one of the node's slots."""
        self.remove(conn)
        return conn.evict()

    def remove(self, conn) -> None:
        """``conn`` logged in or went: it no longer waits."""
        source = self._waiting.pop(conn, None)
        if source is None:
            return
        mine = self._by_source[source]
        del mine[conn]
        if not mine:
            del self._by_source[source]

    def stats(self) -> dict:
        return {"unauthenticated": len(self._waiting), "unauthenticated_sources": len(self._by_source),
                "max_unauthenticated": self.max_unauthenticated,
                "max_unauthenticated_per_source": self.max_per_source,
                "unauthenticated_evicted": self.evicted,
                "unauthenticated_evicted_same_source": self.evicted_same_source}
