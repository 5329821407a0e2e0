"""The asyncio glue of the node: one BufferedProtocol per client connection over the
sans-I/O ``ProtocolConnection``, and the request dispatch to ``LocalKvStore``.

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

Lease lifetime on the GET path (the decision): a lease is held until the transport has
handed every byte of it to the kernel.  The write-buffer limits are set to 0, so the
transport calls ``pause_writing`` as soon as anything stays buffered after a write and
``resume_writing`` when the buffer is empty again; a lease whose reply was written
synchronously (``get_write_buffer_size() == 0`` right after ``writelines``) is released at
once, the others when ``resume_writing`` comes.  A client so slow that a held lease comes
within ``LEASE_MARGIN_S`` of its expiry is disconnected (``abort``) before the store could
reuse the slot under the transport: it can never be sent bytes of another block.
Flow control: reading is paused while more than ``WRITE_HIGH_BYTES`` wait in the
transport and resumed when it drains.

Ordering: replies come back as requests complete, not in request order; a PUT is
acknowledged (and visible) when ``put_end`` returns.  Nothing orders two requests that
are in flight at the same time on one connection.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from quillcache.auth import Authenticator
from quillcache.fsutil import pread_full
from quillcache._native.codec import decode_key_body, decode_put_body, encode_frame_header
from quillcache.errors import (
    Busy, InvalidArgument, NotFound, PermissionDenied, QuillCacheError, UnsafeReuse,
)
from quillcache.model import (
    KEY_FORMAT_VERSION, MAX_PIN_TTL_S, IdentityScope, KeyError_, KvBlockKey, decode_key,
)
from quillcache.node.metrics import RequestCounters
from quillcache.protocol import messages
from quillcache.protocol.connection import DEFER, ProtocolConnection
from quillcache.protocol.info import render_info
from quillcache.node.located import LOCATED_HANDLERS, LocatedMixin
from quillcache.protocol.opcodes import (
    CLUSTER_OPCODES, FLAG_DURABLE, FLAG_PAYLOAD_CRC, FLAG_REPLY, PROTOCOL_VERSION, InfoFormat, Opcode,
    PinMode, ProtocolLimits,
)

__all__ = ["NodeServer", "ServerProtocol", "KeyCache", "render_info", "WRITE_HIGH_BYTES", "LEASE_MARGIN_S",
           "KEY_CACHE_ENTRIES", "SEND_BUFFER_BYTES"]

log = logging.getLogger("quillcache.server")

WRITE_HIGH_BYTES = 64 << 20      # bytes waiting in a transport before reading pauses
LEASE_MARGIN_S = 2.0             # seconds: abort a writer whose held lease expires this soon
SEND_BUFFER_BYTES = 4 << 20      # SO_SNDBUF of a client connection (the kernel doubles it, caps at wmem_max)
KEY_CACHE_ENTRIES = 16384        # decoded keys kept per node (encoded bytes -> KvBlockKey), LRU
_PAYLOAD_OPS = (Opcode.PUT, Opcode.PUT_MANY)
_GET = int(Opcode.GET)
_GET_REPLY_FLAGS = FLAG_REPLY
_EXTENT_REPLY_FLAGS = FLAG_REPLY | FLAG_PAYLOAD_CRC
_U32 = struct.Struct("<I")


# --------------------------------------------------------------------------- helpers


def _decode_scope_prefix(raw: bytes) -> tuple[IdentityScope, Optional[str]]:
    """Parse ``encode_scope`` or ``encode_scope_prefix`` bytes."""
    pos = 0

    def take_str(what: str) -> str:
        nonlocal pos
        if pos >= len(raw):
            raise InvalidArgument(f"LIST prefix truncated in {what}")
        n = raw[pos]
        if pos + 1 + n > len(raw):
            raise InvalidArgument(f"LIST prefix truncated in {what}")
        s = raw[pos + 1:pos + 1 + n]
        pos += 1 + n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"LIST prefix: {what} is not UTF-8") from None

    if not raw or raw[0] != KEY_FORMAT_VERSION:
        raise InvalidArgument("LIST prefix must be encode_scope(...) or encode_scope_prefix(...) bytes")
    pos = 1
    tenant, model, tokenizer = take_str("tenant_id"), take_str("model_id"), take_str("tokenizer_id")
    if pos >= len(raw) or raw[pos] not in (0, 1):
        raise InvalidArgument("LIST prefix: bad adapter flag")
    flag = raw[pos]
    pos += 1
    adapter = take_str("adapter_id") if flag else None
    prefix_hash = take_str("prefix_hash") if pos < len(raw) else None
    if pos != len(raw):
        raise InvalidArgument(f"LIST prefix has {len(raw) - pos} trailing bytes")
    return IdentityScope(model, tokenizer, adapter, tenant), prefix_hash


def _flatten(prefix: str, d: dict, out: dict) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}_", v, out)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[f"{prefix}{k}"] = "" if v is None else v


def _wmem_max() -> int:
    """net.core.wmem_max (bytes), 0 where it cannot be read."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class KeyCache:
    """The last ``capacity`` keys decoded, by their encoded bytes (LRU).

    ``decode_key`` is a pure function of the bytes and ``KvBlockKey`` is immutable, so a
    hit is exactly what decoding again would give; only keys that decoded are kept.  The
    tenant check stays per request (it depends on the connection, not the bytes).
    """

    __slots__ = ("capacity", "_map", "hits", "misses")

    def __init__(self, capacity: int = KEY_CACHE_ENTRIES) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(f"key cache capacity {capacity!r}: an integer >= 0")
        self.capacity = capacity
        self._map: OrderedDict[bytes, KvBlockKey] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._map)

    def decode(self, raw: bytes) -> KvBlockKey:
        """``decode_key(raw)``, from the cache when it was seen lately; raises InvalidArgument."""
        if type(raw) is not bytes:
            raw = bytes(raw)
        m = self._map
        key = m.get(raw)
        if key is not None:
            m.move_to_end(raw)
            self.hits += 1
            return key
        self.misses += 1
        try:
            key = decode_key(raw)
        except KeyError_ as exc:
            raise InvalidArgument(f"bad key: {exc}") from None
        if self.capacity:
            m[raw] = key
            if len(m) > self.capacity:
                m.popitem(last=False)
        return key


# --------------------------------------------------------------------------- the node server


class NodeServer:
    """What every connection of one node shares: the store, auth, limits, metrics."""

    def __init__(self, store, *, limits: Optional[ProtocolLimits] = None, auth: Optional[Authenticator] = None,
                 metrics=None, max_connections: int = 4096, node_id: str = "", version: str = "",
                 ssd=None, lease_margin_s: float = LEASE_MARGIN_S, sendfile: bool = True,
                 shm: bool = True, router=None) -> None:
        self.store = store
        self.router = router            # a control.host.RouterHost answering ROUTE, or None
        self.limits = limits or ProtocolLimits()
        self.auth = auth or Authenticator()
        self.metrics = metrics
        self.max_connections = max_connections
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
        self.cluster = None     # cluster.hook.ClusterHook when [cluster] enabled: misses, puts, 0x40-0x47

    def protocol_factory(self) -> "ServerProtocol":
        return ServerProtocol(self)

    def unix_protocol_factory(self) -> "ServerProtocol":
        """A connection of the Unix socket: it may MAP the arena (docs/shm.md)."""
        conn = ServerProtocol(self)
        conn.unix = True
        return conn

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

    # ------------------------------------------------------------------ INFO / STATS

    def info_sections(self, conn: Optional["ServerProtocol"] = None) -> dict[str, dict[str, Any]]:
        st = self.store.stats()
        server = {
            "node_id": self.node_id, "version": self.version, "protocol_version": PROTOCOL_VERSION,
            "process_id": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
            "listen": self.listen, "unix_socket": self.unix_path, "shm": self.shm,
            "mapped_connections": sum(1 for c in self.connections if c.mapped),
            "located_leases": sum(c.located_leases for c in self.connections),
            "located_reserves": sum(c.located_reserves for c in self.connections),
            "mode": "open" if self.auth.open_mode else "auth",
            "connections": len(self.connections), "requests": self.requests,
            "requests_in_flight": self.in_flight, "protocol_errors": self.protocol_errors,
            "draining": self.draining, "received_bytes": self.request_counters.received_bytes,
            "sent_bytes": self.request_counters.sent_bytes,
            "sendfile_bytes": self.request_counters.sendfile_bytes,
        }
        if self.auth.open_mode:
            server["mode_note"] = "open mode (no tenants configured)"
        store = dict(st.get("store", {}))
        tiers: dict[str, Any] = {}
        for tier in ("dram", "ssd"):
            if tier in st:
                _flatten(f"{tier}_", st[tier], tiers)
            else:
                tiers[f"{tier}_enabled"] = 0
        guard = dict(st.get("guard", {}))
        wal: dict[str, Any] = {"backend": self.wal_backend}
        if self.ssd is not None:
            try:
                _flatten("", self.ssd.stats(), wal)
            except Exception as exc:       # stats of a tier in trouble must not break INFO
                wal["stats_error"] = str(exc)
        auth = self.auth.stats()
        auth["connection_tenant"] = (conn.tenant or "") if conn is not None else ""
        sections = {"Server": server, "Store": store, "Tiers": tiers, "Guard": guard, "WAL": wal, "Auth": auth}
        if self.router is not None:
            sections["Router"] = self.router.info()
        if self.cluster is not None:
            sections["Cluster"] = self.cluster.info()
        return sections


# --------------------------------------------------------------------------- one connection


class ServerProtocol(LocatedMixin, ProtocolConnection, asyncio.BufferedProtocol):
    """One client connection: the sans-I/O ProtocolConnection bound to a transport."""

    def __init__(self, node: NodeServer) -> None:
        super().__init__(node.limits, require_hello=not node.auth.open_mode)
        self.node = node
        self.store = node.store
        self.transport: Optional[asyncio.Transport] = None
        self.peer = "?"
        self.tenant: Optional[str] = None
        self._puts: dict[int, list] = {}          # request id -> put handles in their payload phase
        self._started: dict[int, float] = {}      # request id -> perf_counter at arrival
        self._held: list = []                     # leases whose bytes may still sit in the transport
        self._writing_paused = False
        self._reading_paused = False
        self._tasks: set[asyncio.Task] = set()
        self._metrics = node.metrics
        self._counters = node.request_counters
        self._keys = node.keys
        self._fd = -1                             # the socket's fd, for sendfile (-1: not available)
        self._deferred_task: Optional[asyncio.Task] = None   # a PUT waiting for DRAM room (DEFER)
        self._located_init()                      # located leases and reserves (server_shm)
        self.peer_node = False                    # HELLO with the cluster credential: another node

    # ------------------------------------------------------------------ asyncio side

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        transport.set_write_buffer_limits(high=0, low=0)     # pause/resume = "buffer non-empty/empty"
        node = self.node
        sock = transport.get_extra_info("socket")
        if sock is not None and node.sendfile and sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            try:
                self._fd = sock.fileno()
            except (OSError, ValueError):
                self._fd = -1
        if sock is not None and node.send_buffer:
            try:     # a 4 MiB reply leaves in one writev instead of a write + EPOLLOUT + write
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, node.send_buffer)
            except OSError:
                pass
        if len(node.connections) >= node.max_connections:
            if self._metrics is not None:
                self._metrics.connections_refused.labels("max_connections").inc()
            self._send_error(0, Busy(f"{len(node.connections)} connections open, at most "
                                     f"{node.max_connections}"))
            self.failed = Busy("max_connections")
            transport.close()
            return
        node.connections.add(self)
        if self._metrics is not None:
            self._metrics.connections.inc()
            self._metrics.connections_total.inc()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)        # aborts a PUT in its payload phase
        if self in self.node.connections:
            self.node.connections.discard(self)
            if self._metrics is not None:
                self._metrics.connections.dec()
        for handles in self._puts.values():
            for h in handles:
                self.store.put_abort(h)
        self._puts.clear()
        if self._deferred_task is not None:
            self._deferred_task.cancel()        # a PUT waiting for room: its client is gone
            self._deferred_task = None
        self._release_held()
        self._located_close()

    def buffer_updated(self, nbytes: int) -> None:
        self._counters.received_bytes += nbytes
        super().buffer_updated(nbytes)
        if self.close_requested and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        super().eof_received()
        return False                         # close our side too

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._release_held()
        if self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self._reading_paused = False
            if not self.put_deferred:
                self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _write(self, data: list) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.writelines(data)
        self._counters.sent_bytes += sum([memoryview(b).nbytes for b in data])
        if not self._reading_paused and t.get_write_buffer_size() > WRITE_HIGH_BYTES:
            self._reading_paused = True
            t.pause_reading()

    def _on_error(self, exc: BaseException) -> None:
        if self.failed is exc and not isinstance(exc, (ConnectionError,)) and not self.closed:
            self.node.protocol_errors += 1
            if self._metrics is not None:
                self._metrics.protocol_errors.inc()
            log.info("closing connection from %s: %s", self.peer, exc)
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ leases held by the transport

    def _hold(self, leases) -> None:
        t = self.transport
        if t is None or t.is_closing() or t.get_write_buffer_size() == 0:
            for lease in leases:            # written synchronously (or dropped): nothing refers to them
                lease.release()
        else:
            self._held.extend(leases)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for lease in held:
            lease.release()

    def check_held_leases(self, horizon: float) -> int:
        """Abort the connection if a held lease expires before ``horizon``; 1 if aborted."""
        if not self._held:
            return 0
        t = self.transport
        if t is not None and t.get_write_buffer_size() == 0:
            self._release_held()
            return 0
        if min(lease.expires_at for lease in self._held) <= horizon:
            log.warning("disconnecting %s: it did not read a GET reply within the lease", self.peer)
            if t is not None:
                t.abort()
            self._release_held()
            return 1
        return 0

    # ------------------------------------------------------------------ replies with metrics

    def _done(self, rid: int, opcode: int, status: int) -> None:
        self.node.requests += 1
        t0 = self._started.pop(rid, None)
        if t0 is not None:
            self._counters.observe(opcode, status, time.perf_counter() - t0)

    def _ok(self, rid: int, opcode: int, body: bytes = b"", views=(), *, crc: bool = False) -> None:
        self.reply_ok(rid, opcode, body, views, payload_crc=crc)
        self._done(rid, opcode, 0)

    def _err(self, rid: int, opcode: int, exc: BaseException) -> None:
        if not isinstance(exc, QuillCacheError):
            log.exception("internal error in %s from %s", Opcode(opcode).name, self.peer, exc_info=exc)
        self.reply_error(rid, exc)
        self._done(rid, opcode, exc.status if isinstance(exc, QuillCacheError) else 1)

    # the calls the cluster hook makes (it never reaches the private ones)
    def finish(self, rid: int, opcode: int, body: bytes = b"", views=(), *, crc: bool = False, leases=()) -> None:
        """Reply OK to an in-flight request; ``leases`` are held until the transport sent them."""
        try:
            self._ok(rid, opcode, body, views, crc=crc)
        finally:
            self._hold(leases)

    def finish_error(self, rid: int, opcode: int, exc: BaseException) -> None:
        if self.is_in_flight(rid):
            self._err(rid, opcode, exc)

    def spawn(self, coro) -> None:
        self._spawn(coro)

    def key_of(self, raw: bytes) -> KvBlockKey:
        """The decoded key, checked against this connection's tenant (peers may name any)."""
        return self._key(raw)

    def _spawn(self, coro) -> None:
        """Run ``coro`` now, up to its first real suspension; only then give it a task.

        A non-durable PUT's ``put_end`` and most REMOVEs never suspend: they finish (and
        reply) in this loop turn, without a Task and the loop turn it costs.  The handlers
        catch their own errors; anything else escaping is logged, as a task's would be.
        """
        try:
            fut = coro.send(None)
        except StopIteration:
            return
        except Exception:
            log.exception("internal error in a request handler from %s", self.peer)
            return
        task = asyncio.get_running_loop().create_task(_finish(coro, fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ keys and tenants

    def _check_access(self) -> None:
        if self.node.draining:
            raise Busy("the node is shutting down")
        if not self.node.auth.open_mode and not self.tenant and not self.peer_node:
            raise PermissionDenied("authenticate with HELLO first (this node has tenants)")

    def _key(self, raw: bytes) -> KvBlockKey:
        key = self._keys.decode(raw)
        self._own(key.tenant_id)
        return key

    def _own(self, tenant_id: str) -> None:
        # Decided on the key alone, before the store is consulted: the refusal cannot tell
        # whether the other tenant has the block.
        if not self.node.auth.open_mode and tenant_id != self.tenant and not self.peer_node \
                and not self.node.auth.may_act_for(self.tenant, tenant_id):
            raise PermissionDenied("the key names another tenant than this connection's")

    # ------------------------------------------------------------------ PUT / PUT_MANY

    def _on_put_start(self, frame):
        rid = frame.request_id
        self._started[rid] = time.perf_counter()
        try:
            self._check_access()
            durable = bool(frame.flags & FLAG_DURABLE)
            if frame.opcode == Opcode.PUT:
                raw, nbytes = decode_put_body(frame.header, frame.payload_length, self.limits.max_key_bytes)
                items = [(self._key(raw), nbytes)]
            else:
                decoded = messages.decode_put_many_request(frame.header, frame.payload_length, self.limits)
                items = [(self._key(i.key), i.nbytes) for i in decoded]
            handles = self.store.reserve_nowait(items, durable)     # all or nothing
        except QuillCacheError as exc:
            self._done(rid, frame.opcode, exc.status)
            raise                           # the connection replies it and skips the payload
        if handles is None:                 # DRAM is full of blocks that must be demoted first
            self._defer_put(frame, items, durable)
            return DEFER
        return self._put_destination(frame, handles)

    def _put_destination(self, frame, handles: list):
        self._puts[frame.request_id] = handles
        views = [h.view for h in handles if h.size]
        if frame.opcode == Opcode.PUT:
            return views[0] if views else None
        return views

    def _defer_put(self, frame, items: list, durable: bool) -> None:
        """Back-pressure: read nothing more from this client until the store has the slots."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        # a task, not _spawn: the connection must see DEFER before the slots can arrive
        task = asyncio.get_running_loop().create_task(self._reserve_deferred(frame, items, durable))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._deferred_task = task

    async def _reserve_deferred(self, frame, items: list, durable: bool) -> None:
        rid = frame.request_id
        try:
            handles = await self.store.reserve(items, durable)
        except Exception as exc:
            if not isinstance(exc, QuillCacheError):
                log.exception("internal error reserving a PUT from %s", self.peer)
                exc = InvalidArgument(f"internal error: {exc!r}")
            self._done(rid, frame.opcode, exc.status)
            self.refuse_put(exc)
        else:
            if self.closed or self.failed is not None:
                for h in handles:
                    self.store.put_abort(h)
                return
            self.resume_put(self._put_destination(frame, handles))
        if self._deferred_task is asyncio.current_task():
            self._deferred_task = None
        if self.close_requested and self.transport is not None:
            self.transport.close()
        elif not self.put_deferred and not self._reading_paused and self.transport is not None \
                and not self.transport.is_closing():
            self.transport.resume_reading()

    def _on_put_end(self, frame) -> None:
        handles = self._puts.pop(frame.request_id, None)
        if handles is None:
            return
        self._spawn(self._finish_put(frame.request_id, frame.opcode, handles))

    def _on_put_abort(self, frame, exc) -> None:
        for h in self._puts.pop(frame.request_id, ()):
            self.store.put_abort(h)

    async def _finish_put(self, rid: int, opcode: int, handles: list) -> None:
        if opcode == Opcode.PUT:
            try:
                await self.store.put_end(handles[0])
            except Exception as exc:
                self._err(rid, opcode, exc)
            else:
                self._ok(rid, opcode)
                if self.node.cluster is not None and not self.peer_node:
                    self.node.cluster.after_put([handles[0].key])
            return
        statuses = []
        for h in handles:
            try:
                await self.store.put_end(h)
                statuses.append(0)
            except QuillCacheError as exc:
                statuses.append(exc.status)
            except Exception:
                log.exception("internal error in PUT_MANY item from %s", self.peer)
                statuses.append(1)
        self._ok(rid, opcode, messages.encode_status_list(statuses, self.limits))
        if self.node.cluster is not None and not self.peer_node:
            self.node.cluster.after_put([h.key for h, st in zip(handles, statuses) if st == 0])

    def _put_empty(self, frame) -> None:
        """A PUT/PUT_MANY whose payload is empty arrives as a complete frame."""
        self._on_put_start(frame)           # raises QuillCacheError: replied by the caller
        self._on_put_end(frame)

    # ------------------------------------------------------------------ everything else

    def _on_request(self, frame) -> None:
        rid = frame.request_id
        op = frame.opcode
        if op == _GET:
            self._get(frame)
            return
        if op in _PAYLOAD_OPS:
            try:
                self._put_empty(frame)
            except QuillCacheError as exc:
                self.reply_error(rid, exc)
            return
        self._started[rid] = time.perf_counter()
        try:
            handler = _HANDLERS.get(op, ServerProtocol._cluster_request)
            if op not in (Opcode.HELLO, Opcode.PING):
                self._check_access()
            handler(self, frame)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._err(rid, op, exc)

    def _hello(self, frame) -> None:
        rid = frame.request_id
        auth = self.node.auth
        if auth.blocked(self.peer):
            auth.refused_peers += 1
            if self._metrics is not None:
                self._metrics.connections_refused.labels("failed_hellos").inc()
            self._err(rid, Opcode.HELLO, PermissionDenied("too many failed HELLOs from this address; "
                                                          "try again later"))
            self.close()
            return
        req = messages.decode_hello_request(frame.header, self.limits)
        version = messages.negotiate_version(req)
        cluster = self.node.cluster
        if cluster is not None and req.token and cluster.is_credential(req.token):
            self.peer_node = True           # another node of the pool: tenants travel per request
            self.tenant = None
            self._ok(rid, Opcode.HELLO, messages.encode_hello_reply(version, "", self.limits, self.node.node_id))
            return
        try:
            tenant = auth.authenticate(req.token)
        except PermissionDenied as exc:
            over = auth.record_failure(self.peer)
            if self._metrics is not None:
                self._metrics.failed_hellos.inc()
            log.warning("HELLO from %s refused: bad token%s", self.peer,
                        " (rate limit reached: closing)" if over else "")
            self._err(rid, Opcode.HELLO, exc)
            if over:
                self.close()
            return
        self.tenant = tenant or None
        body = messages.encode_hello_reply(version, tenant, self.limits, self.node.node_id)
        self._ok(rid, Opcode.HELLO, body)

    def _ping(self, frame) -> None:
        payload = frame.payload
        self._ok(frame.request_id, Opcode.PING, b"", [payload] if payload else [],
                 crc=bool(frame.flags & FLAG_PAYLOAD_CRC))

    def _get(self, frame) -> None:
        """GET, the hot path: no per-request closure, task or dict entry; one writelines."""
        t0 = time.perf_counter()
        rid = frame.request_id
        key = None
        try:
            node = self.node
            if node.draining or (not self.tenant and not node.auth.open_mode):
                self._check_access()
            raw = decode_key_body(frame.header, self.limits.max_key_bytes)
            key = self._keys.decode(raw)
            if not node.auth.open_mode and key.tenant_id != self.tenant:
                self._own(key.tenant_id)
            lease = self.store.get_nowait(key, extent_ok=self._fd >= 0)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._started[rid] = t0
                if type(exc) is NotFound and key is not None and node.cluster is not None and not self.peer_node:
                    # another node may hold it (raw: the key encoded, as the pool names it)
                    self._spawn(node.cluster.serve_get(self, rid, key, frame.flags, exc, raw))
                    return
                self._err(rid, _GET, exc)
            return
        if lease is None:                   # SSD-only: read off the loop, reply when it is in
            self._spawn(self._get_from_ssd(rid, key, frame.flags, t0))
            return
        self._reply_get(rid, lease, frame.flags, t0)

    async def _get_from_ssd(self, rid: int, key: KvBlockKey, flags: int, t0: float) -> None:
        try:
            lease = await self.store.get_async(key)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._started[rid] = t0
                self._err(rid, _GET, exc)
            return
        if not self.is_in_flight(rid):      # the connection went meanwhile
            lease.release()
            return
        self._reply_get(rid, lease, flags, t0)

    def _reply_get(self, rid: int, lease, flags: int, t0: float) -> None:
        node = self.node
        if lease.extent is not None:
            try:
                self.take_request(rid)
                if self.failed is None and not self.closed:
                    self._send_extent(rid, *lease.extent)
            finally:
                lease.release()             # everything was read from the file in this step
            node.requests += 1
            self._counters.observe(_GET, 0, time.perf_counter() - t0)
            return
        try:
            if flags & FLAG_PAYLOAD_CRC or self.failed is not None or self.closed:
                self._started[rid] = t0
                self._ok(rid, _GET, b"", [lease.view], crc=bool(flags & FLAG_PAYLOAD_CRC))
                return
            self.take_request(rid)
            size = lease.size
            head = encode_frame_header(_GET, rid, flags=_GET_REPLY_FLAGS, payload_length=size)
            t = self.transport
            if t is not None and not t.is_closing():
                t.writelines([head, lease.view])
                self._counters.sent_bytes += len(head) + size
                if not self._reading_paused and t.get_write_buffer_size() > WRITE_HIGH_BYTES:
                    self._reading_paused = True
                    t.pause_reading()
            node.requests += 1
            self._counters.observe(_GET, 0, time.perf_counter() - t0)
        finally:
            self._hold((lease,))

    def _send_extent(self, rid: int, fd: int, offset: int, length: int, crc: int) -> None:
        """The GET reply for a verified SSD extent: header, sendfile, then whatever the socket
        did not take (preadv, to the transport), then the stored CRC32C as the trailer."""
        t = self.transport
        if t is None or t.is_closing():
            return
        head = encode_frame_header(_GET, rid, flags=_EXTENT_REPLY_FLAGS, payload_length=length)
        sent = direct = 0                       # payload bytes by sendfile, header bytes by write
        sock = self._fd
        if sock >= 0 and t.get_write_buffer_size() == 0:
            # Nothing is queued in the transport, so bytes written to the socket here are in
            # order; from the first byte it does not take, the rest goes through the transport.
            try:
                w = os.write(sock, head)
                direct = w
                head = head[w:]
                while not head and sent < length:
                    n = os.sendfile(sock, fd, offset + sent, length - sent)
                    if n == 0:
                        break                          # past the end of the file: preadv says so below
                    sent += n
            except BlockingIOError:
                pass
            except OSError:
                pass          # a broken connection: the transport's own write reports it below
        parts = [head] if head else []
        rest = length - sent
        if rest:
            buf = bytearray(rest)
            got = pread_full(fd, memoryview(buf), offset + sent)
            if got != rest:
                # The reply's length is promised (and maybe partly sent): the stream cannot
                # be continued.  A preallocated data file makes this an I/O fault.
                log.error("SSD data file short read (%d of %d bytes at %d): closing the connection from %s",
                          got, rest, offset + sent, self.peer)
                t.abort()
                return
            parts.append(buf)
        parts.append(_U32.pack(crc))
        self._write(parts)                      # counts its parts and applies flow control
        counters = self._counters
        counters.sent_bytes += direct + sent    # what went to the socket directly
        counters.sendfile_bytes += sent

    def _get_many(self, frame) -> None:
        keys = [self._key(k) for k in messages.decode_keys_request(frame.header, self.limits, "GET_MANY")]
        got = []
        try:
            for key in keys:
                try:
                    lease = self.store.get_nowait(key)
                except (NotFound, UnsafeReuse, Busy) as exc:
                    lease = exc
                if lease is None:           # an SSD-only block: all of it off the loop
                    break
                got.append(lease)
        except BaseException:
            _release(got)
            raise
        if len(got) < len(keys):
            _release(got)
            self._spawn(self._get_many_async(frame.request_id, keys, frame.flags))
            return
        self._reply_get_many(frame.request_id, got, frame.flags, keys)

    async def _get_many_async(self, rid: int, keys: list, flags: int) -> None:
        got = []
        try:
            for key in keys:
                try:
                    got.append(await self.store.get_async(key))
                except (NotFound, UnsafeReuse, Busy) as exc:
                    got.append(exc)
        except Exception as exc:
            _release(got)
            if self.is_in_flight(rid):
                self._err(rid, Opcode.GET_MANY, exc)
            return
        self._reply_get_many(rid, got, flags, keys)

    def _reply_get_many(self, rid: int, got: list, flags: int, keys: list) -> None:
        """``got``: per key, its lease or the miss (NotFound, UnsafeReuse, Busy) to report."""
        cluster = self.node.cluster
        if cluster is not None and not self.peer_node and any(type(g) is NotFound for g in got):
            # other nodes may hold the local misses: the hook owns the leases and replies
            self._spawn(cluster.serve_get_many(
                self, rid, keys, [None if isinstance(g, Exception) else g for g in got],
                [(g.status, 0) if isinstance(g, Exception) else (0, g.size) for g in got], flags,
                lambda it: messages.encode_get_many_reply(it, self.limits)))
            return
        leases = [g for g in got if not isinstance(g, Exception)]
        try:
            if not self.is_in_flight(rid):
                return
            items = [(g.status, 0) if isinstance(g, Exception) else (0, g.size) for g in got]
            body = messages.encode_get_many_reply(items, self.limits)
            self._ok(rid, Opcode.GET_MANY, body, [l.view for l in leases], crc=bool(flags & FLAG_PAYLOAD_CRC))
        finally:
            self._hold(leases)

    def _exists(self, frame) -> None:
        keys = [self._key(k) for k in messages.decode_keys_request(frame.header, self.limits, "EXISTS")]
        present = [self.store.exists(k) for k in keys]
        self._ok(frame.request_id, Opcode.EXISTS, messages.encode_exists_reply(present, self.limits))

    def _remove(self, frame) -> None:
        keys = [self._key(k) for k in messages.decode_keys_request(frame.header, self.limits, "REMOVE")]
        self._spawn(self._finish_remove(frame.request_id, keys))

    async def _finish_remove(self, rid: int, keys: list) -> None:
        try:
            done = [await self.store.remove(k) for k in keys]
        except Exception as exc:
            self._err(rid, Opcode.REMOVE, exc)
            return
        self._ok(rid, Opcode.REMOVE, messages.encode_bitmap_reply(done, self.limits))

    def _pin(self, frame) -> None:
        req = messages.decode_pin_request(frame.header, self.limits)
        keys = [self._key(k) for k in req.keys]
        # ttl 0 ("until UNPIN") and anything longer become the store's longest pin
        ttl_s = min(req.ttl_ms / 1000.0, MAX_PIN_TTL_S) if req.ttl_ms else MAX_PIN_TTL_S
        done = []
        for key in keys:
            try:
                self.store.pin(key, ttl_s, hard=req.mode == PinMode.HARD)
                done.append(True)
            except (NotFound, UnsafeReuse):
                done.append(False)
        self._ok(frame.request_id, Opcode.PIN, messages.encode_bitmap_reply(done, self.limits))

    def _unpin(self, frame) -> None:
        _mode, raw = messages.decode_unpin_request(frame.header, self.limits)
        keys = [self._key(k) for k in raw]
        done = [self.store.unpin(k) for k in keys]
        self._ok(frame.request_id, Opcode.UNPIN, messages.encode_bitmap_reply(done, self.limits))

    def _list(self, frame) -> None:
        req = messages.decode_list_request(frame.header, self.limits)
        scope, _prefix_hash = _decode_scope_prefix(req.prefix)     # validates it
        self._own(scope.tenant_id)
        # a walk of the store's residency index from the cursor: no sort of the scope
        page, more = self.store.list_page(req.prefix, req.start_after, req.limit)
        self._ok(frame.request_id, Opcode.LIST, messages.encode_list_reply(page, more, self.limits))

    def _cluster_request(self, frame) -> None:
        if frame.opcode not in CLUSTER_OPCODES:
            raise InvalidArgument(f"opcode {frame.opcode:#04x} has no handler")
        if self.node.cluster is None:
            raise InvalidArgument(f"{Opcode(frame.opcode).name}: this node is not in a cluster "
                                  "([cluster] enabled = false)")
        self.node.cluster.on_request(self, frame)

    def _stats(self, frame) -> None:
        req = messages.decode_stats_request(frame.header)
        sections = self.node.info_sections(self)
        if req.section:
            wanted = req.section.lower()
            sections = {k: v for k, v in sections.items() if k.lower() == wanted}
            if not sections:
                raise InvalidArgument(f"INFO: no section {req.section!r}")
        if req.format == InfoFormat.JSON:
            text = json.dumps({k.lower(): v for k, v in sections.items()}, sort_keys=True)
        else:
            text = render_info(sections)
        raw = text.encode("utf-8")
        self._ok(frame.request_id, Opcode.STATS, messages.encode_stats_reply(req.format), [raw])

    # ------------------------------------------------------------------ ROUTE (the hosted router)

    def _hosted_router(self):
        if self.node.router is None:
            raise InvalidArgument('ROUTE: this node hosts no router ([router] module = "none")')
        return self.node.router

    def _route(self, frame) -> None:
        router = self._hosted_router()
        req = messages.decode_route_request(frame.header, self.limits)
        self._own(req.tenant)
        # The caller is the connection's tenant: its request ids are its own (control/host.py).
        reply = router.route(req, caller=self.tenant or "")
        self._ok(frame.request_id, Opcode.ROUTE, messages.encode_route_reply(reply))

    def _route_update(self, frame) -> None:
        router = self._hosted_router()
        event, rid = messages.decode_route_update(frame.header)
        self._ok(frame.request_id, Opcode.ROUTE_UPDATE, bytes((router.update(event, rid, caller=self.tenant or ""),)))


class _Resume:
    """Awaitable that finishes a coroutine which already yielded ``fut`` to its runner: the
    task waits on ``fut`` and then drives the rest, as if it had run the coroutine itself."""

    __slots__ = ("coro", "fut")

    def __init__(self, coro, fut) -> None:
        self.coro = coro
        self.fut = fut

    def __await__(self):
        coro, fut = self.coro, self.fut
        self.coro = self.fut = None
        while True:
            try:
                value = yield fut
            except BaseException as exc:        # the task was cancelled (or the wait raised)
                try:
                    fut = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    fut = coro.send(value)
                except StopIteration as stop:
                    return stop.value


def _release(got: list) -> None:
    """Release the leases among ``got`` (leases and misses, as GET_MANY collects them)."""
    for g in got:
        if not isinstance(g, Exception):
            g.release()


async def _finish(coro, fut):
    return await _Resume(coro, fut)


_HANDLERS: dict[int, Callable[[ServerProtocol, Any], None]] = {
    Opcode.HELLO: ServerProtocol._hello,
    Opcode.PING: ServerProtocol._ping,
    Opcode.GET: ServerProtocol._get,
    Opcode.GET_MANY: ServerProtocol._get_many,
    Opcode.EXISTS: ServerProtocol._exists,
    Opcode.REMOVE: ServerProtocol._remove,
    Opcode.PIN: ServerProtocol._pin,
    Opcode.UNPIN: ServerProtocol._unpin,
    Opcode.LIST: ServerProtocol._list,
    Opcode.STATS: ServerProtocol._stats,
    **LOCATED_HANDLERS,
    Opcode.ROUTE: ServerProtocol._route,
    Opcode.ROUTE_UPDATE: ServerProtocol._route_update,
}
