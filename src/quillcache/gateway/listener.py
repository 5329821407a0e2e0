"""A listening socket for an aiohttp runner with a limit on the connections open at once.

aiohttp has timeouts (its ``keepalive_timeout`` closes a connection that has sent no complete
request head in that time) but no connection limit, so a client that opens connections and
says nothing holds a descriptor each until then.  Here every accepted connection passes a
``ConnectionGate``: past ``limit`` open connections, a new one is answered ``503`` (an
OpenAI error) and closed at once, before aiohttp allocates anything for it; past ``per_peer``
connections of one address, the same.  The counts are exact: taken when the connection is
accepted (its address when it is made) and given back when it is lost.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Callable, Optional

from aiohttp import web

__all__ = ["ConnectionGate", "Listener", "raise_fd_limit", "FDS_PER_CONNECTION", "RESERVED_FDS"]

log = logging.getLogger("quillcache.gateway")

FDS_PER_CONNECTION = 2      # a client's socket and its upstream socket to the engine
RESERVED_FDS = 256          # descriptors for everything else: listeners, ZMQ, etcd, logs
REFUSED_LINGER_S = 0.5      # seconds a refused connection may take to read its 503 before the close
MAX_LINGERING = 64          # refused connections lingering at once; past it they close at once

_BUSY = json.dumps({"error": {"message": "too many connections open to the gateway; retry later",
                              "type": "unavailable", "code": 503}}).encode()
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: " + str(len(_BUSY)).encode()
                  + b"\r\n\r\n" + _BUSY)


class ConnectionGate:
    """Counts the open connections of one or more listeners against one limit, and those of
    each peer address against ``per_peer`` (0: no per-peer limit)."""

    def __init__(self, limit: int, per_peer: int = 0,
                 on_refused: Callable[[str], None] = lambda reason: None) -> None:
        self.limit = limit
        self.per_peer = per_peer
        self.open = 0
        self.refused = 0
        self.peers: dict[str, int] = {}
        self._on_refused = on_refused

    def _refuse(self, reason: str) -> bool:
        self.refused += 1
        self._on_refused(reason)
        return False

    def take(self) -> bool:
        """At accept, before anything is allocated for the connection."""
        if self.open >= self.limit:
            return self._refuse("max_connections")
        self.open += 1
        return True

    def admit(self, peer: str) -> bool:
        """Once the peer's address is known (the connection already holds a slot)."""
        if self.per_peer and self.peers.get(peer, 0) >= self.per_peer:
            return self._refuse("max_connections_per_peer")
        self.peers[peer] = self.peers.get(peer, 0) + 1
        return True

    def give_back(self, peer: Optional[str]) -> None:
        self.open -= 1
        if peer is not None:
            n = self.peers[peer] - 1
            if n:
                self.peers[peer] = n
            else:
                del self.peers[peer]


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, made once the peer is admitted, with the gate's
    slots given back when the connection ends."""

    __slots__ = ("_make", "_inner", "_gate", "_peer")

    def __init__(self, make: Callable[[], asyncio.Protocol], gate: ConnectionGate) -> None:
        self._make = make
        self._inner: Optional[asyncio.Protocol] = None
        self._gate = gate
        self._peer: Optional[str] = None

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        peer = peer[0] if isinstance(peer, tuple) else str(peer)
        if self._gate.admit(peer):
            self._peer = peer
            self._inner = self._make()
        else:
            self._inner = _Refused()
        self._inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        self._gate.give_back(self._peer)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _Refused(asyncio.Protocol):
    """Past the limit: one 503, then the connection is closed.  What the client sends meanwhile
    is discarded for ``REFUSED_LINGER_S`` at most, so that the close does not reset the
    connection before the client has read the answer.  At most ``MAX_LINGERING`` refused
    connections linger at once (a flood keeps no descriptors): past it the one that has
    lingered longest is closed, so the newest refused client (likely a real one arriving
    behind a flood of silent connections) still reads its 503 rather than a reset."""

    lingering: "dict[_Refused, None]" = {}      # in the order they started lingering

    def __init__(self) -> None:
        self._transport = None
        self._timer = None

    def connection_made(self, transport) -> None:
        transport.write(_BUSY_RESPONSE)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        while len(_Refused.lingering) >= MAX_LINGERING:
            next(iter(_Refused.lingering)).close()
        _Refused.lingering[self] = None
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.close)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        _Refused.lingering.pop(self, None)
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        pass                                       # discarded

    def eof_received(self) -> bool:
        return False                               # the client is done: close now

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        _Refused.lingering.pop(self, None)


class Listener:
    """``runner``'s application served on ``host:port`` through ``gate``."""

    def __init__(self, runner: web.BaseRunner, gate: ConnectionGate) -> None:
        self.runner = runner
        self.gate = gate
        self._server: Optional[asyncio.AbstractServer] = None

    def _protocol(self) -> asyncio.Protocol:
        if not self.gate.take():
            return _Refused()
        return _Counted(self.runner.server, self.gate)

    async def start(self, host: str, port: int, backlog: int = 1024) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port, backlog=backlog, reuse_address=True)
        return self._server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        """Stop accepting; connections already open are the runner's to drain."""
        if self._server is not None:
            self._server.close()
            self._server = None


def raise_fd_limit(connections: int) -> int:
    """Raise the soft descriptor limit so that ``connections`` clients fit (each with its
    upstream socket, plus ``RESERVED_FDS``); returns how many connections fit under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections * FDS_PER_CONNECTION + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit to %d: %s", new, exc)
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(1, min(connections, (soft - RESERVED_FDS) // FDS_PER_CONNECTION))
