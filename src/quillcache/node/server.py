"""``NodeServer``: the node's listeners (TCP and the Unix socket), its connections and what they
share (the store, limits, auth, counters); the connection glue is ``node.connection``.

Zero copy on both paths:

* PUT/PUT_MANY payloads are received straight into DRAM arena slots: the PUT header
  starts the put (``store.put_start``) and its slot view becomes the parser's destination,
  so ``get_buffer`` hands the socket the remaining part of the slot; ``put_end`` runs when
  the payload is complete and ``put_abort`` on an error or a disconnect.
* GET/GET_MANY replies are ``transport.writelines([header, lease.view, ...])``: the
  payload goes from the arena to the transport without a Python copy.
* A GET served from the SSD tier without promotion (``[ssd] promote_on_get = false``, or
  no DRAM room) is sent from the data file with ``os.sendfile`` on the socket (only when
  the tier writes with O_DIRECT: ``SsdTier.extent_of`` says why), when the
  transport has nothing buffered (else bytes written directly would overtake the buffered
  ones).  Whatever the socket does not take at once is read (``preadv``) in the same step
  and handed to the transport behind it.  Such a reply always carries the block's stored
  CRC32C as its payload CRC trailer: the node does not look at sendfile'd bytes, the
  client checks them against the CRC taken at put time.

The connection itself is ``node.connection.ServerProtocol``; its requests are handled by
``reads``, ``writes``, ``ops``, ``login`` and ``located``; INFO by ``info``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

from quillcache.auth import Authenticator
from quillcache.node.admission import Admission, RateLimitedLog
from quillcache.node.connection import ServerProtocol
from quillcache.node.info import info_sections
from quillcache.node.keys import KeyCache
from quillcache.node.limits import (
    HELLO_TIMEOUT_S, IDLE_TIMEOUT_S, KEY_CACHE_ENTRIES, LEASE_MARGIN_S, MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_SOURCE, SEND_BUFFER_BYTES, WRITE_HIGH_BYTES,
)
from quillcache.node.metrics import RequestCounters
from quillcache.net import LOOPBACK_CONGESTION, same_host, set_congestion
from quillcache.protocol.info import render_info
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = ["NodeServer", "ServerProtocol", "KeyCache", "render_info", "WRITE_HIGH_BYTES", "LEASE_MARGIN_S",
           "KEY_CACHE_ENTRIES", "SEND_BUFFER_BYTES"]

log = logging.getLogger("quillcache.server")


def _wmem_max() -> int:
    """net.core.wmem_max (bytes), 0 where it cannot be read."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class NodeServer:
    """What every connection of one node shares: the store, auth, limits, metrics."""

    def __init__(self, store, *, limits: Optional[ProtocolLimits] = None, auth: Optional[Authenticator] = None,
                 metrics=None, max_connections: int = 4096, node_id: str = "", version: str = "",
                 ssd=None, lease_margin_s: float = LEASE_MARGIN_S, sendfile: bool = True,
                 shm: bool = True, router=None, hello_timeout: float = HELLO_TIMEOUT_S,
                 idle_timeout: float = IDLE_TIMEOUT_S, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_unauthenticated_per_source: int = MAX_UNAUTHENTICATED_PER_SOURCE,
                 loopback_congestion: str = LOOPBACK_CONGESTION) -> None:
        self.store = store
        self.router = router            # a control.host.RouterHost answering ROUTE, or None
        self.limits = limits or ProtocolLimits()
        self.auth = auth or Authenticator()
        self.metrics = metrics
        self.max_connections = max_connections
        self.hello_timeout = hello_timeout      # s a connection may wait before its HELLO ([node] hello_timeout)
        self.idle_timeout = idle_timeout        # s of silence that close a connection; 0: never
        self.loopback_congestion = loopback_congestion   # of same-host TCP connections ("": the system's)
        self.loopback_congestion_set = 0        # connections it was set on
        self._congestion_refused = ""           # the name the kernel last refused (logged once)
        # the connections that have not logged in yet: their slots, per source and in all
        self.admission = Admission(max_connections, max_unauthenticated, max_unauthenticated_per_source)
        self.bad_input_log = RateLimitedLog(log)   # lines a peer can cause at will
        self.node_id = node_id
        self.version = version
        self.ssd = ssd
        self.lease_margin_s = lease_margin_s
        self.started = time.time()
        self.listen = ""
        self.wal_backend = "none"
        self.connections: set[ServerProtocol] = set()
        self.draining = False
        self.protocol_errors = 0
        self.requests = 0
        self.keys = KeyCache()
        # A fixed SO_SNDBUF turns the kernel's autotuning off: set it only where the cap
        # (net.core.wmem_max) lets it be that large, else autotuning does better.
        self.send_buffer = SEND_BUFFER_BYTES if _wmem_max() >= SEND_BUFFER_BYTES else 0
        # per-request counters: the metrics' own (read at scrape time) or private ones
        self.request_counters = metrics.requests if metrics is not None else RequestCounters()
        self.sendfile = sendfile and hasattr(os, "sendfile")   # GETs of SSD extents by sendfile
        self.shm = bool(shm)             # MAP allowed on the Unix socket (for trusted principals)
        self.unix_path = ""              # the Unix socket's path, when the daemon listens on one
        self.arena_id = int.from_bytes(os.urandom(8), "little") or 1   # tells one arena from the next
        self.cluster = None     # cluster.hook.ClusterHook when [cluster] enabled: misses, puts, 0x40-0x48

    def protocol_factory(self) -> "ServerProtocol":
        return ServerProtocol(self)

    def unix_protocol_factory(self) -> "ServerProtocol":
        """A connection of the Unix socket: it may MAP the arena (docs/shm.md)."""
        conn = ServerProtocol(self)
        conn.unix = True
        return conn

    def tune_connection(self, sock) -> None:
        """A new TCP connection: the same-host congestion control where its peer is on this host
        (three syscalls, before login: bounded like the connection itself)."""
        name = self.loopback_congestion
        if not name or not same_host(sock):
            return
        if set_congestion(sock, name):
            self.loopback_congestion_set += 1
        elif self._congestion_refused != name:       # once per name, not once per connection
            self._congestion_refused = name
            log.warning("[node] loopback_congestion = %r: the kernel refuses it (see "
                        "net.ipv4.tcp_allowed_congestion_control); same-host connections keep the "
                        "system's", name)

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.connections)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests, wait (up to ``timeout`` s) until none is in flight; True if drained."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.in_flight == 0

    def close_all(self) -> None:
        for conn in list(self.connections):
            conn.close()

    def close_idle(self, now: Optional[float] = None) -> int:
        """Close connections idle past ``idle_timeout`` (see ``ServerProtocol.check_idle``) and
        log what the bad-input log suppressed; returns how many were closed.  About once a second."""
        now = time.monotonic() if now is None else now
        n = 0
        for conn in list(self.connections):
            n += conn.check_idle(now, self.idle_timeout)
        self.bad_input_log.flush()
        return n

    def expire_slow_writers(self, now: Optional[float] = None) -> int:
        """Disconnect clients that hold a GET lease too close to its expiry; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        for conn in list(self.connections):
            n += conn.check_held_leases(now + self.lease_margin_s)
        return n

    def reauthorize(self) -> int:
        """After a tenant reload: close connections bound to a tenant that is gone, and
        mapped connections whose tenant may no longer map (a mapping cannot be revoked
        otherwise: closing ends its leases; the client process keeps the pages mapped)."""
        n = 0
        for conn in list(self.connections):
            if (conn.tenant and not self.auth.has_tenant(conn.tenant)) or \
                    (conn.mapped and not self.auth.may_map(conn.tenant or "")):
                conn.close()
                n += 1
        return n

    def info_sections(self, conn: Optional[ServerProtocol] = None) -> dict[str, dict[str, Any]]:
        return info_sections(self, conn)
