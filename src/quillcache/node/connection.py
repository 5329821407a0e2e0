"""The asyncio glue of the node: one BufferedProtocol per client connection over the
sans-I/O ``ProtocolConnection``, and the dispatch of its requests to the handlers of
``reads`` (GET, GET_MANY, EXISTS), ``writes`` (PUT, PUT_MANY), ``ops`` (the others),
``login`` (HELLO) and ``located`` (the shared-memory requests).

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
import logging
import socket
import time
from typing import Any, Callable, Optional

from quillcache._native.codec import total_nbytes
from quillcache.errors import Busy, PermissionDenied, QuillCacheError, Timeout
from quillcache.model import KvBlockKey
from quillcache.node.admission import peer_identity
from quillcache.node.limits import WRITE_HIGH_BYTES
from quillcache.node.located import LOCATED_HANDLERS, LocatedMixin
from quillcache.node.login import LoginMixin
from quillcache.node.ops import OpsMixin
from quillcache.node.reads import ReadsMixin
from quillcache.node.tasks import finish_in_task
from quillcache.node.writes import WritesMixin
from quillcache.protocol.cluster import NODE_OPCODES
from quillcache.protocol.connection import ProtocolConnection
from quillcache.protocol.opcodes import Opcode

__all__ = ["ServerProtocol"]

log = logging.getLogger("quillcache.server")

_PAYLOAD_OPS = (Opcode.PUT, Opcode.PUT_MANY)
_GET = int(Opcode.GET)


class ServerProtocol(LoginMixin, ReadsMixin, WritesMixin, OpsMixin, LocatedMixin, ProtocolConnection,
                     asyncio.BufferedProtocol):
    """One client connection: the sans-I/O ProtocolConnection bound to a transport."""

    def __init__(self, node) -> None:
        super().__init__(node.limits, require_hello=not node.auth.open_mode)
        self.node = node
        self.store = node.store
        self.transport: Optional[asyncio.Transport] = None
        self.peer = "?"                           # the peer's name in logs: ip:port, unix:uid=U,pid=P
        self.source = "?"                         # what per-source limits count by (node.admission)
        self.tenant: Optional[str] = None
        self._puts: dict[int, list] = {}          # request id -> put handles in their payload phase
        self._reaps_seen = 0                      # the store's puts_reaped when they were checked
        self._put_reaped = False                  # a put of this connection was reaped: fail it
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
        self.peer_node = ""                       # the node id this connection logged in as (cluster/hook.py)
        self.peer_epoch = 0                       # ... and that node's epoch: its records only
        self._hello_timer: Optional[asyncio.TimerHandle] = None   # [node] hello_timeout, before login
        self._hello_refusal: Optional[asyncio.TimerHandle] = None  # a failed HELLO's delayed answer
        self._close_after_refusal = False         # the login deadline passed while it waited
        self._active = True                       # bytes came since the last idle check
        self._idle_since = 0.0                    # monotonic s: the idle check that saw it quiet

    # ------------------------------------------------------------------ asyncio side

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.source, self.peer = peer_identity(transport)
        transport.set_write_buffer_limits(high=0, low=0)     # pause/resume = "buffer non-empty/empty"
        node = self.node
        sock = transport.get_extra_info("socket")
        if sock is not None and node.sendfile and sock.family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            try:
                self._fd = sock.fileno()
            except (OSError, ValueError):
                self._fd = -1
        if sock is not None and sock.family != socket.AF_UNIX:
            node.tune_connection(sock)
        if sock is not None and node.send_buffer:
            try:     # a 4 MiB reply leaves in one writev instead of a write + EPOLLOUT + write
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, node.send_buffer)
            except OSError:
                pass
        if self.require_hello:
            # not logged in yet: one of the slots those may hold (it may push out the oldest)
            refused = node.admission.admit(self, self.source, len(node.connections))
            if refused is not None:
                self._refuse(refused[1], refused[0])
                return
            self._hello_timer = asyncio.get_running_loop().call_later(node.hello_timeout, self._hello_expired)
        elif len(node.connections) >= node.max_connections:
            self._refuse(f"{len(node.connections)} connections open, at most {node.max_connections}",
                         "max_connections")
            return
        node.connections.add(self)
        if self._metrics is not None:
            self._metrics.connections.inc()
            self._metrics.connections_total.inc()

    def _refuse(self, why: str, reason: str, error: type = Busy) -> None:
        """Answer a connection-level error (Busy unless said) and close: a connection not
        admitted, pushed out, or too slow to log in.  ``reason``: the metrics label."""
        if self._metrics is not None:
            self._metrics.connections_refused.labels(reason).inc()
        self.node.bad_input_log.log(logging.INFO, "closing connection from %s: %s", self.peer, why)
        self._send_error(0, error(why))
        self.failed = error(reason)
        if self.transport is not None:
            self.transport.close()

    def evict(self) -> int:
        """Pushed out by a newer connection while waiting to log in (``Admission``); returns 1
        if it held one of the node's slots (it is given back now, not when the close lands)."""
        node = self.node
        held = 0
        if self in node.connections:
            node.connections.discard(self)
            held = 1
            if self._metrics is not None:
                self._metrics.connections.dec()
        self._cancel_timers()
        self._refuse("too many connections waiting to log in: the oldest is closed", "unauthenticated_evicted")
        return held

    def _hello_expired(self) -> None:
        self._hello_timer = None
        if self.hello_done or self.closed or self.transport is None or self.transport.is_closing():
            return
        if self._hello_refusal is not None:
            self._close_after_refusal = True    # a failed HELLO waits for its answer: then close
            return
        self.node.admission.remove(self)
        self._refuse(f"not logged in within {self.node.hello_timeout:g} s ([node] hello_timeout)", "hello_timeout",
                     Timeout)

    def _logged_in(self) -> None:
        """HELLO succeeded: the connection leaves the unauthenticated pool."""
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.node.admission.remove(self)

    def _cancel_timers(self) -> None:
        for timer in (self._hello_timer, self._hello_refusal):
            if timer is not None:
                timer.cancel()
        self._hello_timer = self._hello_refusal = None

    def check_idle(self, now: float, timeout: float) -> int:
        """Close the connection if nothing came for ``timeout`` s and it holds nothing (no
        request in flight, no lease, no reserve, no PUT) and did not map the arena (its
        mapping would be lost); 1 if closed.  Called about once a second (the node's sweep)."""
        if self._active:
            self._active = False
            self._idle_since = now
            return 0
        if timeout <= 0 or now - self._idle_since < timeout or self.mapped or self.in_flight or self._held \
                or self._puts or self._deferred_task is not None or self.located_leases or self.located_reserves:
            return 0
        if self.transport is None or self.transport.is_closing():
            return 0
        if self._metrics is not None:
            self._metrics.connections_refused.labels("idle_timeout").inc()
        log.info("closing connection from %s: idle for %.0f s ([node] idle_timeout)", self.peer, now - self._idle_since)
        self._send_error(0, Timeout(f"idle for {timeout:g} s ([node] idle_timeout): closing"))
        self.failed = Timeout("idle")
        self.transport.close()
        return 1

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)        # aborts a PUT in its payload phase
        self._cancel_timers()
        self.node.admission.remove(self)
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

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        # The common case in this one call: no put of this connection in its payload phase
        # was reaped, and the connection neither failed, closed nor holds a deferred put.
        # The others go the whole way (WritesMixin.get_buffer, then ProtocolConnection's).
        if (not self._puts or self.store.puts_reaped == self._reaps_seen) and not self._put_reaped \
                and self.failed is None and not self.closed and not self.put_deferred:
            return self._parser.get_buffer(sizehint)
        return super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._counters.received_bytes += nbytes
        self._active = True
        if self._put_reaped or self.failed is not None or self.closed or self.put_deferred:
            super().buffer_updated(nbytes)  # WritesMixin's and ProtocolConnection's checks
        else:
            self._parser.buffer_updated(nbytes)
            self._process()
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
        self._counters.sent_bytes += total_nbytes(data)
        if not self._reading_paused and t.get_write_buffer_size() > WRITE_HIGH_BYTES:
            self._reading_paused = True
            t.pause_reading()

    def _on_error(self, exc: BaseException) -> None:
        if self.failed is exc and not isinstance(exc, (ConnectionError,)) and not self.closed:
            self.node.protocol_errors += 1
            if self._metrics is not None:
                self._metrics.protocol_errors.inc()
            self.node.bad_input_log.log(logging.INFO, "closing connection from %s: %s", self.peer, exc)
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
        task = asyncio.get_running_loop().create_task(finish_in_task(coro, fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ keys and tenants

    def _check_access(self) -> None:
        if self.node.draining:
            raise Busy("the node is shutting down")
        if self.peer_node:
            raise PermissionDenied("a connection logged in as a node may use the node opcodes only")
        if not self.node.auth.open_mode and not self.tenant:
            raise PermissionDenied("authenticate with HELLO first (this node has tenants)")

    def logged_in_as_node(self, node_id: str, epoch: int) -> None:
        """The cluster hook's node login succeeded (NODE_PROOF): a member connection from now
        on, bound to that node and epoch, out of the unauthenticated pool."""
        self.peer_node, self.peer_epoch = node_id, epoch
        if self.require_hello:              # the limits the node HELLO kept small (node/login.py)
            self._parser.set_limits(max_header_bytes=self.limits.max_header_bytes,
                                    max_payload_bytes=self.limits.max_payload_bytes)
        self._logged_in()

    def _key(self, raw: bytes) -> KvBlockKey:
        """The decoded key, refused (``_own``) where it names another tenant than this
        connection's; a key of the connection's own tenant, or any on an open node, costs no
        further call."""
        key = self._keys.decode(raw)
        if key.tenant_id != self.tenant and not self.node.auth.open_mode:
            self._own(key.tenant_id)
        return key

    def _keys_of(self, raws: list) -> list[KvBlockKey]:
        """``_key`` of each of a batch's keys: the tenant check once per tenant named."""
        keys = self._keys.decode_many(raws)
        if not self.node.auth.open_mode and not self.peer_node:      # else _own allows every tenant
            for tenant_id in {k.tenant_id for k in keys}:
                self._own(tenant_id)
        return keys

    def _own(self, tenant_id: str) -> None:
        # Decided on the key alone, before the store is consulted: the refusal cannot tell
        # whether the other tenant has the block.
        if not self.node.auth.open_mode and tenant_id != self.tenant and not self.peer_node \
                and not self.node.auth.may_act_for(self.tenant, tenant_id):
            raise PermissionDenied("the key names another tenant than this connection's")

    # ------------------------------------------------------------------ dispatch

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
            if op not in (Opcode.HELLO, Opcode.PING) and op not in NODE_OPCODES:
                self._check_access()        # the node opcodes are the node login's (cluster/hook.py)
            handler(self, frame)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._err(rid, op, exc)


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
