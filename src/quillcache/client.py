"""The QuillCache client library: ``Client`` (blocking socket) and ``AsyncClient`` (asyncio).

    from quillcache import Client, KvBlockKey
    with Client("127.0.0.1:7470", token=None, timeout=10.0) as c:
        c.put(key, data)
        n = c.get_into(key, numpy_array)      # received straight into the array

Both sit on the sans-I/O ``ClientProtocolConnection``: the sync client reads with
``recv_into`` straight into the buffer the parser hands out (the caller's buffer for
``get_into``), the async one is an ``asyncio.BufferedProtocol``.  Requests are
pipelined (``get_many``/``put_many``/``exists_many`` send every request before waiting),
replies matched by id.  Errors are the ``quillcache.errors`` classes of the server's
status; a dropped connection is ``ConnectionLost``; every wait has a deadline
(``Timeout``).  After a ``Timeout`` the sync client closes its connection (the stream may
hold half a reply); the async one keeps it (a late reply is matched and dropped).

Data handed to ``put``/``put_many`` is sent without a copy and must not change until the
call returns.  ``get`` returns ``bytes`` (one copy out of the receive buffer);
``get_many`` returns a ``memoryview`` per value over buffers of up to
``GET_MANY_BUFFER_BYTES`` that consecutive values are received into (no second copy; few
allocations: each fresh buffer costs an mmap or heap growth and its page faults, and
buffers larger than glibc's 32 MiB mmap ceiling are never reused from the heap);
``get_into``/``get_many_into`` receive into the caller's buffers (zero copy).

Hot-path choices: encoded keys are cached per client (``KEY_CACHE_ENTRIES``, by key); the
sync client's socket is blocking with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` (one syscall per
send/recv, no poll, no timeout change per wait: the kernel timeout is lowered only when a
deadline is nearer than it); a single GET first reads just the reply's fixed header so the
payload goes from the socket straight into the destination.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

from quillcache._native.codec import (
    EV_NEED_DATA, EV_PAYLOAD_END, EV_PAYLOAD_START, FRAME_OVERHEAD, MalformedFrame, encode_key_body,
)
from quillcache.config import DEFAULT_ADDRESS, parse_hostport
from quillcache.errors import (
    STATUS_CLASSES, ConnectionLost, InvalidArgument, NotFound, PermissionDenied,
    ProtocolError, QuillCacheError, Timeout, UnsafeReuse, error_for_status,
)
from quillcache.model import (
    IdentityScope, KvBlockKey, decode_key, encode_key, encode_scope, encode_scope_prefix,
)
from quillcache import client_shm
from quillcache.protocol import located, messages
from quillcache.protocol.connection import ClientProtocolConnection, Reply
from quillcache.protocol.info import parse_info
from quillcache.protocol.opcodes import FLAG_DURABLE, InfoFormat, Opcode, PinMode, ProtocolLimits

__all__ = ["Client", "AsyncClient", "parse_info", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT_S",
           "KEY_CACHE_ENTRIES", "GET_MANY_BUFFER_BYTES"]

DEFAULT_TIMEOUT_S = 10.0         # seconds: connect and every wait for a reply
LIST_PAGE = 1024                 # keys asked per LIST request (capped at the server's max_batch)
CLIENT_NAME = "quillcache-py"
KEY_CACHE_ENTRIES = 16384        # encoded keys kept per client (KvBlockKey -> bytes), oldest dropped
GET_MANY_BUFFER_BYTES = 8 << 20  # bytes: get_many packs consecutive values into buffers of at most this
MIN_SOCKET_TIMEOUT_S = 0.001     # seconds: the smallest SO_RCVTIMEO set (0 would mean "forever")
_GET = int(Opcode.GET)
_STALE = " (the arena mapping is no longer the node's: reconnect() maps its new arena)"


# --------------------------------------------------------------------------- shared pieces


UNIX_PREFIX = "unix:"            # Client("unix:/path/quillcached.sock"): the node's Unix socket


def _address(address) -> "tuple[str, int] | str":
    """(host, port) for TCP, or the socket path (a str) for ``unix:/path``."""
    if isinstance(address, str) and address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX):]
        if not path:
            raise InvalidArgument(f"address {address!r}: unix: needs a socket path")
        return path
    if isinstance(address, tuple):
        return address[0], int(address[1])
    try:
        return parse_hostport(address)
    except ValueError as exc:
        raise InvalidArgument(f"address {address!r}: {exc}") from None


def _token(token) -> bytes:
    if token is None:
        return b""
    if isinstance(token, str):
        return token.encode("utf-8")
    return bytes(token)


def _payload(data) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise InvalidArgument("data must be C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _dest(buffer) -> memoryview:
    mv = memoryview(buffer)
    if mv.readonly:
        raise InvalidArgument("get_into: the buffer is read-only")
    if not mv.c_contiguous:
        raise InvalidArgument("get_into: the buffer is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, MIN_SOCKET_TIMEOUT_S)
    sec = int(seconds)
    return struct.pack("@ll", sec, int((seconds - sec) * 1e6))


def _pack_buffers(sizes: list[int]) -> list[tuple[bytearray, list[memoryview]]]:
    """Consecutive values packed into buffers of at most GET_MANY_BUFFER_BYTES (a larger
    value gets its own): ``[(buffer, [view of each value in it])]``, in order."""
    out: list = []
    group: list[int] = []
    total = 0

    def close() -> None:
        buf = bytearray(total)
        mv = memoryview(buf)
        views, pos = [], 0
        for n in group:
            views.append(mv[pos:pos + n])
            pos += n
        out.append((buf, views))

    for n in sizes:
        if group and total + n > GET_MANY_BUFFER_BYTES:
            close()
            group, total = [], 0
        group.append(n)
        total += n
    if group:
        close()
    return out


def _status_error(status: int, what: str) -> QuillCacheError:
    """The exception of one item's status in a PUT_MANY/GET_MANY reply (no ERROR body to read)."""
    name = STATUS_CLASSES.get(status, QuillCacheError).__name__
    return error_for_status(status, f"{what}: status {status} ({name})")


class _Req(NamedTuple):
    opcode: int
    header: bytes
    views: Sequence[Any]
    flags: int
    into: Any                               # destination or callable(frame), or None
    finish: Callable[[Reply], Any]          # OK reply -> result (errors raised before)


def _chunks(seq: Sequence, n: int) -> list:
    return [seq[i:i + n] for i in range(0, len(seq), n)] or [seq[:0]]


class _Ops:
    """Request builders shared by Client and AsyncClient; ``_exec``/``_exec_many`` run them."""

    _conn: Optional[ClientProtocolConnection]
    _keys: dict

    @property
    def limits(self) -> ProtocolLimits:
        """The server's limits (from HELLO)."""
        return self._conn.peer_limits if self._conn is not None else ProtocolLimits()

    def _ekey(self, key) -> bytes:
        """``encode_key(key)``, cached (a key is immutable and its encoding a pure function of it)."""
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key {key!r}: must be a KvBlockKey")
        cache = self._keys
        raw = cache.get(key)
        if raw is None:
            raw = encode_key(key)
            if len(cache) >= KEY_CACHE_ENTRIES:
                del cache[next(iter(cache))]       # the oldest insertion
            cache[key] = raw
        return raw

    def _get_header(self, key) -> bytes:
        """The GET request body of ``key`` within the server's limits (the codec's format)."""
        return encode_key_body(self._ekey(key), self.limits.max_key_bytes)

    # each returns the result (Client) or an awaitable of it (AsyncClient)

    _arena: Optional["client_shm.Arena"] = None

    @property
    def shm(self) -> bool:
        """Whether the node's arena is mapped (Unix socket, trusted): puts and gets then copy
        through the mapping and the located calls are zero-copy."""
        return self._arena is not None

    def put(self, key: KvBlockKey, data, durable: bool = False):
        mv = _payload(data)
        if self._arena is not None:
            return self._drive(client_shm.put_many_flow(self, [(key, mv)], durable))
        hdr = messages.encode_put_request(self._ekey(key), mv.nbytes, self.limits)
        return self._exec(_Req(Opcode.PUT, hdr, [mv] if mv.nbytes else [],
                               FLAG_DURABLE if durable else 0, None, lambda r: None))

    def get(self, key: KvBlockKey):
        if self._arena is not None:
            return self._drive(client_shm.get_flow(self, key, None))
        hdr = self._get_header(key)
        holder: list = []

        def into(frame):                     # one buffer of the exact size, received into by recv_into
            holder.append(bytearray(frame.payload_length))
            return holder[0]

        return self._exec(_Req(Opcode.GET, hdr, (), 0, into,
                               lambda r: bytes(holder[0]) if holder else b""))

    def get_into(self, key: KvBlockKey, buffer):
        dst = _dest(buffer)
        if self._arena is not None:
            return self._drive(client_shm.get_flow(self, key, dst))
        hdr = self._get_header(key)

        def into(frame):
            if frame.payload_length > dst.nbytes:
                raise InvalidArgument(f"get_into: buffer of {dst.nbytes} bytes, block is "
                                      f"{frame.payload_length} bytes")
            return dst

        def finish(r: Reply) -> int:
            return 0 if r.payload is None else memoryview(r.payload).nbytes

        return self._exec(_Req(Opcode.GET, hdr, (), 0, into, finish))

    def exists(self, key: KvBlockKey):
        hdr = messages.encode_keys_request([self._ekey(key)], self.limits, "EXISTS")
        return self._exec(_Req(Opcode.EXISTS, hdr, (), 0, None,
                               lambda r: messages.decode_exists_reply(r.header, self.limits).present[0]))

    def exists_many(self, keys: Iterable[KvBlockKey]):
        keys = [self._ekey(k) for k in keys]
        reqs = [_Req(Opcode.EXISTS, messages.encode_keys_request(c, self.limits, "EXISTS"), (), 0, None,
                     lambda r: messages.decode_exists_reply(r.header, self.limits))
                for c in _chunks(keys, self.limits.max_batch)]

        def combine(results) -> tuple[int, list[bool]]:
            present: list[bool] = []
            for res in results:
                present += res.present
            prefix = next((i for i, p in enumerate(present) if not p), len(present))
            return prefix, present

        return self._exec_many(reqs, combine)

    def remove(self, key: KvBlockKey):
        hdr = messages.encode_keys_request([self._ekey(key)], self.limits, "REMOVE")
        return self._exec(_Req(Opcode.REMOVE, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def pin(self, key: KvBlockKey, ttl: float, hard: bool = False):
        if not isinstance(ttl, (int, float)) or ttl < 0:
            raise InvalidArgument(f"pin ttl {ttl!r}: seconds >= 0 (0 = until unpin)")
        ttl_ms = 0 if ttl == 0 else max(1, int(round(ttl * 1000)))
        mode = PinMode.HARD if hard else PinMode.SOFT
        hdr = messages.encode_pin_request([self._ekey(key)], mode, ttl_ms, self.limits)
        return self._exec(_Req(Opcode.PIN, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def unpin(self, key: KvBlockKey, hard: bool = False):
        """Drop the key's pin; ``hard`` names the pin mode to drop (sent as the UNPIN mode)."""
        hdr = messages.encode_unpin_request([self._ekey(key)], PinMode.HARD if hard else PinMode.SOFT,
                                            self.limits)
        return self._exec(_Req(Opcode.UNPIN, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def put_many(self, items: Iterable[tuple[KvBlockKey, Any]], durable: bool = False):
        """Store every (key, data); raises the first item's error (after all were tried)."""
        if self._arena is not None:
            return self._drive(client_shm.put_many_flow(self, [(k, _payload(d)) for k, d in items], durable))
        prepared = [(self._ekey(k), _payload(d)) for k, d in items]
        lim = self.limits
        reqs, starts = [], []
        i = 0
        while i < len(prepared) or not reqs:
            batch, total = [], 0
            while i < len(prepared) and len(batch) < lim.max_batch:
                nb = prepared[i][1].nbytes
                if batch and total + nb > lim.max_payload_bytes:
                    break
                batch.append(prepared[i])
                total += nb
                i += 1
            hdr = messages.encode_put_many_request([(k, mv.nbytes) for k, mv in batch], lim)
            starts.append(i - len(batch))
            reqs.append(_Req(Opcode.PUT_MANY, hdr, [mv for _, mv in batch if mv.nbytes],
                             FLAG_DURABLE if durable else 0, None,
                             lambda r: messages.decode_status_list(r.header, lim)))
            if i >= len(prepared):
                break

        def combine(results) -> None:
            for start, statuses in zip(starts, results):
                for j, st in enumerate(statuses):
                    if st:
                        raise _status_error(st, f"put_many item {start + j}")

        return self._exec_many(reqs, combine)

    def get_many(self, keys: Iterable[KvBlockKey]):
        """``list[memoryview | None]`` in key order; None where the key is not served (not
        found, or refused by the identity guard).  Each value is a writable memoryview of
        exactly its bytes, over one buffer per GET_MANY request that the reply was received
        into (no copy); it compares equal to the same ``bytes``; ``bytes(v)`` makes an
        independent copy.  The shared buffer lives as long as any of its views."""
        return self._get_many(keys, None)

    def get_many_into(self, keys: Iterable[KvBlockKey], buffers: Sequence[Any]):
        """Receive each key's value straight into the buffer at the same position (writable,
        C-contiguous; numpy arrays welcome).  Returns ``list[int | None]``: the bytes written
        into each buffer, None where the key is not served.  Every buffer is checked before
        anything is sent; a value larger than its buffer raises InvalidArgument (the values of
        that GET_MANY request are then dropped, other requests' buffers may be filled)."""
        return self._get_many(keys, buffers)

    def _get_many(self, keys, buffers):
        keys = list(keys)
        dsts = None
        if buffers is not None:
            dsts = [_dest(b) for b in buffers]
            if len(dsts) != len(keys):
                raise InvalidArgument(f"get_many_into: {len(keys)} keys and {len(dsts)} buffers")
            if self._arena is not None:
                return self._drive(client_shm.get_many_into_flow(self, keys, dsts))
        keys = [self._ekey(k) for k in keys]
        lim = self.limits
        mb = lim.max_batch
        reqs = []
        for start in range(0, len(keys), mb) if keys else (0,):
            chunk = keys[start:start + mb]
            holder: dict = {}

            def into(frame, holder=holder, start=start, count=len(chunk)):  # noqa: B008 (binds this chunk)
                items = messages.decode_get_many_reply(frame.header, frame.payload_length, lim)
                if len(items) != count:
                    raise ProtocolError(f"GET_MANY reply has {len(items)} items for {count} keys")
                holder["items"] = items
                if dsts is None:
                    bufs = holder["bufs"] = _pack_buffers([nb for st, nb in items if st == 0 and nb])
                    return [b for b, _ in bufs]
                views = []
                for j, (st, nb) in enumerate(items):
                    if st == 0 and nb:
                        d = dsts[start + j]
                        if nb > d.nbytes:
                            raise InvalidArgument(f"get_many_into: buffer {start + j} has {d.nbytes} bytes, "
                                                  f"its block is {nb} bytes")
                        views.append(d[:nb])
                return views

            def finish(r: Reply, holder=holder, count=len(chunk)):  # noqa: B008 (binds this chunk)
                items = holder.get("items")
                if items is None:                   # no payload phase: every value empty or missing
                    items = messages.decode_get_many_reply(r.header, None, lim)
                if len(items) != count:
                    raise ProtocolError(f"GET_MANY reply has {len(items)} items for {count} keys")
                views = iter([v for _, vs in holder.get("bufs", ()) for v in vs])
                out: list = []
                for st, nb in items:
                    if st == 0:
                        if dsts is not None:
                            out.append(nb)
                        else:
                            out.append(next(views) if nb else memoryview(b""))
                    elif st in (NotFound.status, UnsafeReuse.status):
                        out.append(None)
                    else:
                        raise _status_error(st, "get_many item")
                return out

            reqs.append(_Req(Opcode.GET_MANY, messages.encode_keys_request(chunk, lim, "GET_MANY"),
                             (), 0, into, finish))
        return self._exec_many(reqs, lambda results: [x for res in results for x in res])

    def _list_req(self, prefix: bytes, start_after: bytes) -> _Req:
        lim = self.limits
        hdr = messages.encode_list_request(prefix, min(LIST_PAGE, lim.max_batch), start_after, lim)
        return _Req(Opcode.LIST, hdr, (), 0, None, lambda r: messages.decode_list_reply(r.header, lim))

    def _stats_req(self, fmt: InfoFormat, section: str, raw: bool = False) -> _Req:
        def finish(r: Reply):
            text = bytes(r.payload).decode("utf-8") if r.payload is not None else ""
            if raw:
                return text
            return json.loads(text) if fmt == InfoFormat.JSON else parse_info(text)
        return _Req(Opcode.STATS, messages.encode_stats_request(fmt, section), (), 0, None, finish)

    def info(self, section: str = ""):
        """INFO sections as ``{"Server": {...}, "Store": {...}, ...}``."""
        return self._exec(self._stats_req(InfoFormat.TEXT, section))

    def info_text(self, section: str = ""):
        """INFO exactly as the server rendered it (redis-style ``# Section`` / ``key:value`` text)."""
        return self._exec(self._stats_req(InfoFormat.TEXT, section, raw=True))

    def stats(self, section: str = ""):
        return self._exec(self._stats_req(InfoFormat.JSON, section))

    def _map_req(self) -> _Req:
        return _Req(Opcode.MAP, b"", (), 0, None, lambda r: located.decode_map_reply(r.header))

    def route(self, scope: IdentityScope, token_ids=None, *, hashes=None, policy: "str | None" = None,
              request_id: "str | None" = None, request_tokens: int = 0, track: bool = True):
        """Ask the node's hosted router where to send a request (its token ids, or the
        router's block hashes): a ``messages.RouteReply`` with the worker and the per-block
        plan (0 device, 1 host, 2 disk, 3 pool, 4 recompute).  With ``track`` report the
        request's first token and end with ``route_update``."""
        if (token_ids is None) == (hashes is None):
            raise InvalidArgument("route: give token_ids or hashes")
        kind, items = (messages.ROUTE_TOKENS, token_ids) if hashes is None else (messages.ROUTE_HASHES, hashes)
        hdr = messages.encode_route_request(
            kind, scope.tenant_id, scope.model_id, scope.tokenizer_id, scope.adapter_id, items,
            policy=policy, track=track, request_id=request_id, request_tokens=request_tokens,
            limits=self.limits)
        return self._exec(_Req(Opcode.ROUTE, hdr, (), 0, None,
                               lambda r: messages.decode_route_reply(r.header)))

    def route_update(self, request_id: str, *, first_token: bool = False):
        """The routed request produced its first token (``first_token=True``) or ended, was
        aborted or lost its client; returns whether the router knew the request."""
        event = messages.ROUTE_FIRST_TOKEN if first_token else messages.ROUTE_FREE
        return self._exec(_Req(Opcode.ROUTE_UPDATE, messages.encode_route_update(event, request_id),
                               (), 0, None, lambda r: bool(r.header[:1] == b"\x01")))

    def _hello_req(self, token: bytes, name: str) -> _Req:
        return _Req(Opcode.HELLO, messages.encode_hello_request(token, client_name=name), (), 0, None,
                    lambda r: messages.decode_hello_reply(r.header))

    @staticmethod
    def _ping_req() -> _Req:
        return _Req(Opcode.PING, b"", (), 0, None, lambda r: None)

    @staticmethod
    def _scope_prefix(scope, prefix_hash: "str | None") -> bytes:
        if isinstance(scope, KvBlockKey):
            scope = scope.scope
        if not isinstance(scope, IdentityScope):
            raise InvalidArgument("ls: scope must be an IdentityScope or a KvBlockKey")
        if prefix_hash is None:                 # every block of the scope
            return encode_scope(scope)
        return encode_scope_prefix(scope, prefix_hash)


# --------------------------------------------------------------------------- sync client


class _SyncConnection(ClientProtocolConnection):
    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.replies: dict[int, Reply] = {}

    def _write(self, data: list) -> None:
        try:
            if len(data) == 1:                  # a request without payload: one bytes object
                self.sock.sendall(data[0])
                return
            views = [memoryview(b).cast("B") for b in data]
            views = [v for v in views if v.nbytes]
            while views:
                n = self.sock.sendmsg(views[:1024])     # IOV_MAX
                while n:
                    head = views[0]
                    if n >= head.nbytes:
                        n -= head.nbytes
                        views.pop(0)
                    else:
                        views[0] = head[n:]
                        n = 0
        except (BlockingIOError, socket.timeout):   # SO_SNDTIMEO expired: part of a frame may be out
            self.connection_lost(None)
            raise Timeout("timed out sending a request (connection closed)") from None
        except OSError as exc:
            self.connection_lost(exc)
            raise ConnectionLost(f"connection lost while sending: {exc}") from None

    def _on_reply(self, reply: Reply) -> None:
        self.replies[reply.request_id] = reply


class Client(_Ops):
    """A blocking client over one TCP connection (TCP_NODELAY), or over the node's Unix
    socket (``"unix:/path/quillcached.sock"``), where a trusted client maps the node's arena
    at connect (``shm``; ``shm=False`` does not ask).  Not thread-safe: use one per thread."""

    def __init__(self, address=DEFAULT_ADDRESS, token=None, timeout: float = DEFAULT_TIMEOUT_S, *,
                 client_name: str = CLIENT_NAME, shm: bool = True) -> None:
        self.address = _address(address)
        self.timeout = float(timeout)
        self._conn: Optional[_SyncConnection] = None
        self._keys: dict = {}
        self.tenant: Optional[str] = None
        self.server_name = ""
        self._token = _token(token)
        self._name = client_name
        self._want_shm = bool(shm)
        self.shm_refused = ""            # why MAP was refused (the copy path is used), "" if not
        self._connect()

    def _connect(self) -> None:
        where = self.address if isinstance(self.address, str) else f"{self.address[0]}:{self.address[1]}"
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout)
                    sock.connect(self.address)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(self.address, timeout=self.timeout)
        except socket.timeout:
            raise Timeout(f"connecting to {where} timed out") from None
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {where}: {exc.strerror or exc}") from None
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking socket, timeouts in the kernel: a recv/send is one syscall (CPython's
        # timeout mode polls before each one and settimeout() costs an ioctl).
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout))
        self._recv_timeout = max(self.timeout, MIN_SOCKET_TIMEOUT_S)
        self._sock = sock
        self._conn = _SyncConnection(sock)
        try:
            hello = self._exec(self._hello_req(self._token, self._name))
            self.tenant = hello.tenant_id or None
            self.server_name = hello.server_name
            if sock.family == socket.AF_UNIX and self._want_shm:
                self._map()
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        """MAP: the reply brings the arena's fd (SCM_RIGHTS), mapped here MAP_SHARED."""
        conn = self._conn
        rid = self._send(self._map_req())
        deadline = time.monotonic() + self.timeout
        fds: list[int] = []
        try:
            while rid not in conn.replies:
                if time.monotonic() > deadline:
                    raise Timeout(f"no MAP reply within {self.timeout} s")
                try:
                    n, got = client_shm.recv_with_fds(self._sock, conn.get_buffer(-1))
                except (BlockingIOError, socket.timeout):
                    conn.buffer_updated(0)
                    continue
                fds += got
                if n == 0:
                    conn.connection_lost(None)
                    self._check()
                conn.buffer_updated(n)
            reply = conn.replies.pop(rid)
            if reply.error is not None:
                if isinstance(reply.error, PermissionDenied):
                    self.shm_refused = str(reply.error)     # not trusted: the copy path it is
                    return
                raise reply.error
            info = located.decode_map_reply(reply.header)
            if len(fds) != 1:
                raise ProtocolError(f"MAP reply came with {len(fds)} fds, expected 1")
            self._arena = client_shm.Arena(fds[0], info)
        finally:
            for fd in fds:
                os.close(fd)              # the mapping keeps the memory; the fd is not needed

    def detach(self) -> tuple:
        """Hand over (socket, the node's limits, the mapped arena or None) and leave this
        client closed; the socket must be idle (no request in flight, nothing buffered).
        AsyncClient connects over the Unix socket this way."""
        conn = self._check()
        if conn.in_flight or conn.replies:
            raise InvalidArgument("detach: requests are in flight")
        out = (self._sock, conn.peer_limits, self._arena)
        self._arena = None
        self._sock = None
        conn.connection_lost(None)
        return out

    def reconnect(self) -> None:
        """Close and connect again (HELLO, and MAP on the Unix socket): after the node
        restarted, this maps its new arena."""
        self.close()
        self._conn = None
        self.shm_refused = ""
        self._connect()

    def _drive(self, flow):
        """Run a client_shm flow: each request it yields is executed, its result sent back."""
        try:
            req = next(flow)
            while True:
                try:
                    result = self._exec(req)
                except BaseException as exc:
                    req = flow.throw(exc)
                else:
                    req = flow.send(result)
        except StopIteration as stop:
            return stop.value
        except ConnectionLost as exc:
            raise ConnectionLost(f"{exc}{_STALE}") from None

    @contextlib.contextmanager
    def get_many_located(self, keys: Iterable[KvBlockKey]):
        """Zero-copy reads: yields a ``LocatedViews`` (a list of read-only memoryviews into
        the mapped arena, None for a miss) valid inside the block; leaving it releases the
        lease (and the views).  Raises Timeout on leaving if the lease ran out while held
        (the bytes read may then be another block's).  Over TCP (or untrusted): the
        ``get_many`` copies, read-only."""
        keys = list(keys)
        if self._arena is None:
            yield client_shm.LocatedViews.copies(self.get_many(keys))
            return
        loc = self._drive(client_shm.located_flow(self, keys))
        out = client_shm.LocatedViews.of_arena(self._arena.view, loc.extents)
        ok = False
        try:
            yield out
            ok = True
        finally:
            out.release_views()
            if loc.lease_ids and not self._conn.closed and self._conn.failed is None:
                self._drive(client_shm.release_flow(self, loc.lease_ids))
        if ok:
            client_shm.check_lease(loc.expires_ns, "get_many_located")

    @contextlib.contextmanager
    def put_many_reserved(self, items: Iterable[tuple[KvBlockKey, int]], durable: bool = False):
        """Zero-copy writes: ``items`` are (key, nbytes); yields a writable memoryview per
        key (a reserved arena slot, invisible to readers); leaving the block commits them
        all (``durable``: after the SSD fsync), an exception aborts them.  Write only inside
        the views.  Over TCP (or untrusted): buffers sent by ``put_many`` on leaving."""
        items = [(k, int(n)) for k, n in items]
        if self._arena is None:
            bufs = [memoryview(bytearray(n)) for _, n in items]
            yield bufs
            self.put_many([(k, b) for (k, _), b in zip(items, bufs)], durable)
            return
        reserves = self._drive(client_shm.reserve_flow(self, items, durable))
        views = client_shm.slot_views(self, reserves, [n for _, n in items])
        try:
            yield views
        except BaseException:
            self._drive(client_shm.abort_flow(self, [r.reserve_id for r in reserves]))
            raise
        finally:
            for v in views:
                try:
                    v.release()
                except BufferError:
                    pass
        self._drive(client_shm.commit_flow(self, reserves))

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.connection_lost(None)
        try:
            self._sock.close()
        except (OSError, AttributeError):
            pass
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> _SyncConnection:
        conn = self._conn
        if conn is None:
            raise ConnectionLost("not connected (reconnect() failed)")
        if conn.failed is not None or conn.closed:
            err = conn.failed
            if isinstance(err, QuillCacheError):
                raise err
            raise ConnectionLost(f"connection is closed ({err}){_STALE if self._arena is not None else ''}")
        return conn

    def _send(self, req: _Req) -> int:
        conn = self._check()
        return conn.send_request(req.opcode, req.header, req.views, flags=req.flags, into=req.into)

    def _set_recv_timeout(self, seconds: float) -> None:
        seconds = max(seconds, MIN_SOCKET_TIMEOUT_S)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self._recv_timeout = seconds

    def _wait(self, rid: int, deadline: float, first_read: int = 0) -> Reply:
        """Receive until the reply to ``rid`` is in; ``first_read`` > 0: when nothing is
        buffered, read at most that many bytes first (the fixed header of a payload reply,
        so that the payload then lands straight in its destination)."""
        replies = self._conn.replies
        while rid not in replies:
            self._recv_once(deadline, first_read, True)
        return replies.pop(rid)

    def _recv_once(self, deadline: float, first_read: int, process: bool) -> None:
        """One recv into the parser's buffer (raises Timeout past ``deadline``, ConnectionLost
        at EOF); ``process``: let the connection handle the events it completes, else the
        caller drives ``next_event`` itself."""
        conn = self._conn
        if conn.failed is not None or conn.closed:
            self._check()
        left = deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise Timeout(f"no reply within {self.timeout} s (connection closed)")
        r = self._recv_timeout
        slack = max(MIN_SOCKET_TIMEOUT_S, 0.05 * self.timeout)     # how late a recv may return
        if r > left + slack or r < left - slack:   # the kernel timeout must not outlast the deadline
            self._set_recv_timeout(left)
        parser = conn.parser
        buf = conn.get_buffer(-1)
        if first_read and parser.buffered == 0 and not parser.in_payload:
            buf = buf[:first_read]
        update = conn.buffer_updated if process else parser.buffer_updated
        try:
            n = self._sock.recv_into(buf)
        except (BlockingIOError, socket.timeout):  # SO_RCVTIMEO expired
            update(0)
            return                                 # the deadline check decides
        except OSError as exc:
            conn.connection_lost(exc)
            raise ConnectionLost(f"connection lost: {exc}") from None
        if n == 0:
            update(0)
            conn.connection_lost(None)
            self._check()
        update(n)

    def get_into(self, key: KvBlockKey, buffer) -> int:
        """Receive the block straight into ``buffer`` (writable, C-contiguous); returns its size."""
        dst = _dest(buffer)
        if self._arena is not None:
            return self._drive(client_shm.get_flow(self, key, dst))
        hdr = self._get_header(key)
        cap = dst.nbytes

        def into(frame):
            if frame.payload_length > cap:
                raise InvalidArgument(f"get_into: buffer of {cap} bytes, block is "
                                      f"{frame.payload_length} bytes")
            return dst

        conn = self._check()
        parser = conn.parser
        deadline = time.monotonic() + self.timeout
        if conn.in_flight or parser.buffered or parser.in_payload or len(hdr) > conn.peer_limits.max_header_bytes:
            rid = conn.send_request(Opcode.GET, hdr, (), into=into)   # the general way
            return self._got_into(self._wait(rid, deadline, FRAME_OVERHEAD))
        # The hot path of a connector: nothing else in flight, so this method drives the
        # parser itself (about a third of the Python calls of the general way).  It takes
        # only its own OK reply with a payload that fits; any other event (an error reply,
        # a frame it does not expect) goes to the connection's own handler, which then
        # finishes the request exactly as the general way would.
        rid = conn.send_bare(_GET, hdr, into)
        receiving = False
        try:
            while True:
                ev = parser.next_event()
                if ev == EV_NEED_DATA:
                    self._recv_once(deadline, FRAME_OVERHEAD, False)
                    continue
                frame = parser.frame
                if receiving and ev == EV_PAYLOAD_END:
                    conn.complete(rid)
                    return frame.payload_length
                if (ev == EV_PAYLOAD_START and frame.request_id == rid and frame.opcode == _GET
                        and frame.status == 0 and frame.payload_length <= cap):
                    parser.set_destination(dst)
                    receiving = True
                    continue
                conn.hand_over(ev, frame)
                return self._got_into(self._wait(rid, deadline, FRAME_OVERHEAD))
        except MalformedFrame as exc:
            conn.fail(exc)
            self._check()
            raise

    @staticmethod
    def _got_into(reply: Reply) -> int:
        if reply.error is not None:
            raise reply.error
        p = reply.payload
        return 0 if p is None else memoryview(p).nbytes

    def _exec(self, req: _Req):
        rid = self._send(req)
        reply = self._wait(rid, time.monotonic() + self.timeout)
        reply.raise_for_status()
        return req.finish(reply)

    def _exec_many(self, reqs: list[_Req], combine: Callable[[list], Any]):
        rids: list[int] = []
        got: dict[int, Reply] = {}
        try:
            for req in reqs:
                if self._conn.in_flight >= self.limits.max_in_flight:
                    oldest = next(r for r in rids if r not in got)
                    got[oldest] = self._wait(oldest, time.monotonic() + self.timeout)
                rids.append(self._send(req))
            deadline = time.monotonic() + self.timeout
            replies = [got.pop(rid) if rid in got else self._wait(rid, deadline) for rid in rids]
        except BaseException:
            for rid in rids:
                self._conn.replies.pop(rid, None)
            raise
        results = []
        for req, reply in zip(reqs, replies):
            reply.raise_for_status()
            results.append(req.finish(reply))
        return combine(results)

    # ------------------------------------------------------------------ calls with their own loop

    def call(self, opcode: int, header: bytes = b"", views: Sequence[Any] = (), *, flags: int = 0,
             into: Any = None) -> Reply:
        """One raw request (``quillctl cluster``/``locate`` use it): the OK reply, or its error raised."""
        rid = self._send(_Req(opcode, header, views, flags, into, None))
        return self._wait(rid, time.monotonic() + self.timeout).raise_for_status()

    def ls(self, scope, prefix_hash: "str | None" = None) -> list[KvBlockKey]:
        prefix = self._scope_prefix(scope, prefix_hash)
        out: list[KvBlockKey] = []
        after = b""
        while True:
            page = self._exec(self._list_req(prefix, after))
            out += [decode_key(k) for k in page.keys]
            if not page.more or not page.keys:
                return out
            after = page.keys[-1]

    def ping(self) -> float:
        t0 = time.perf_counter()
        self._exec(self._ping_req())
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- async client


def _expire(fut: asyncio.Future, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(Timeout(f"no reply within {timeout} s"))


class _AsyncConnection(ClientProtocolConnection, asyncio.BufferedProtocol):
    def __init__(self) -> None:
        super().__init__()
        self.transport: Optional[asyncio.Transport] = None
        self.futures: dict[int, asyncio.Future] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._fail_all(self.failed or ConnectionLost("connection closed"))

    def eof_received(self):
        super().eof_received()
        return False

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        if self.close_requested and self.transport is not None:
            self.transport.close()

    def _write(self, data: list) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionLost("connection is closed")
        if len(data) == 1:
            t.write(data[0])            # a request without payload: no list join
        else:
            t.writelines(data)

    def _on_reply(self, reply: Reply) -> None:
        fut = self.futures.pop(reply.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _on_error(self, exc: BaseException) -> None:
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.close()

    def _fail_all(self, exc: BaseException) -> None:
        if not isinstance(exc, QuillCacheError):
            exc = ConnectionLost(str(exc))
        futures, self.futures = self.futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(exc)


class AsyncClient(_Ops):
    """The asyncio client: ``async with AsyncClient(addr, token=...) as c: await c.get(key)``
    (or ``await AsyncClient(...).connect()``).  Same methods as Client, as coroutines."""

    def __init__(self, address=DEFAULT_ADDRESS, token=None, timeout: float = DEFAULT_TIMEOUT_S, *,
                 client_name: str = CLIENT_NAME, shm: bool = True) -> None:
        self.address = _address(address)
        self.timeout = float(timeout)
        self._token = _token(token)
        self._name = client_name
        self._keys: dict = {}
        self._conn: Optional[_AsyncConnection] = None
        self.tenant: Optional[str] = None
        self.server_name = ""
        self._want_shm = bool(shm)
        self.shm_refused = ""

    async def _connect_unix(self, loop) -> "AsyncClient":
        # HELLO and MAP need recvmsg (the fd rides SCM_RIGHTS), which asyncio transports do
        # not offer: they run on a blocking socket in a worker thread (the sync Client),
        # then the socket, idle and with nothing buffered, is handed to the loop.
        sync = await asyncio.to_thread(Client, UNIX_PREFIX + self.address, self._token, self.timeout,
                                       client_name=self._name, shm=self._want_shm)
        self.tenant, self.server_name, self.shm_refused = sync.tenant, sync.server_name, sync.shm_refused
        sock, limits, self._arena = sync.detach()
        try:
            _, conn = await loop.create_unix_connection(_AsyncConnection, sock=sock)
        except BaseException:
            sock.close()
            await self.close()
            raise
        conn.peer_limits = limits
        self._conn = conn
        return self

    async def connect(self) -> "AsyncClient":
        loop = asyncio.get_running_loop()
        if isinstance(self.address, str):
            return await self._connect_unix(loop)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_AsyncConnection, *self.address), self.timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"connecting to {self.address[0]}:{self.address[1]} timed out") from None
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.address[0]}:{self.address[1]}: "
                                 f"{exc.strerror or exc}") from None
        self._conn = conn
        try:
            hello = await self._exec(self._hello_req(self._token, self._name))
        except BaseException:
            await self.close()
            raise
        self.tenant = hello.tenant_id or None
        self.server_name = hello.server_name
        return self

    async def close(self) -> None:
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.close()

    async def reconnect(self) -> "AsyncClient":
        """Close and connect again (HELLO, and MAP on the Unix socket)."""
        await self.close()
        self._conn = None
        self.shm_refused = ""
        return await self.connect()

    async def _drive(self, flow):
        """Run a client_shm flow, awaiting each request it yields."""
        try:
            req = next(flow)
            while True:
                try:
                    result = await self._exec(req)
                except BaseException as exc:
                    req = flow.throw(exc)
                else:
                    req = flow.send(result)
        except StopIteration as stop:
            return stop.value
        except ConnectionLost as exc:
            raise ConnectionLost(f"{exc}{_STALE}") from None

    @contextlib.asynccontextmanager
    async def get_many_located(self, keys: Iterable[KvBlockKey]):
        """``Client.get_many_located``, as an async context manager."""
        keys = list(keys)
        if self._arena is None:
            yield client_shm.LocatedViews.copies(await self.get_many(keys))
            return
        loc = await self._drive(client_shm.located_flow(self, keys))
        out = client_shm.LocatedViews.of_arena(self._arena.view, loc.extents)
        ok = False
        try:
            yield out
            ok = True
        finally:
            out.release_views()
            conn = self._conn
            if loc.lease_ids and conn is not None and not conn.closed and conn.failed is None:
                await self._drive(client_shm.release_flow(self, loc.lease_ids))
        if ok:
            client_shm.check_lease(loc.expires_ns, "get_many_located")

    @contextlib.asynccontextmanager
    async def put_many_reserved(self, items: Iterable[tuple[KvBlockKey, int]], durable: bool = False):
        """``Client.put_many_reserved``, as an async context manager."""
        items = [(k, int(n)) for k, n in items]
        if self._arena is None:
            bufs = [memoryview(bytearray(n)) for _, n in items]
            yield bufs
            await self.put_many([(k, b) for (k, _), b in zip(items, bufs)], durable)
            return
        reserves = await self._drive(client_shm.reserve_flow(self, items, durable))
        views = client_shm.slot_views(self, reserves, [n for _, n in items])
        try:
            yield views
        except BaseException:
            await self._drive(client_shm.abort_flow(self, [r.reserve_id for r in reserves]))
            raise
        finally:
            for v in views:
                try:
                    v.release()
                except BufferError:
                    pass
        await self._drive(client_shm.commit_flow(self, reserves))

    @property
    def is_open(self) -> bool:
        """Connected, and the connection has neither failed nor closed."""
        conn = self._conn
        return conn is not None and conn.failed is None and not conn.closed

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _send(self, req: _Req) -> asyncio.Future:
        conn = self._conn
        if conn is None:
            raise ConnectionLost("not connected (use `async with` or await connect())")
        if conn.failed is not None or conn.closed:
            err = conn.failed
            raise err if isinstance(err, QuillCacheError) else ConnectionLost(f"connection is closed ({err})")
        fut = asyncio.get_running_loop().create_future()
        rid = conn.send_request(req.opcode, req.header, req.views, flags=req.flags, into=req.into)
        conn.futures[rid] = fut
        return fut

    async def _wait(self, fut: asyncio.Future, deadline: float) -> Reply:
        """The reply in ``fut`` by ``deadline``: one timer on the future itself (no
        wait_for/shield task per request).  On Timeout the request stays pending on the
        connection: its late reply is matched and dropped."""
        if not fut.done():
            left = deadline - time.monotonic()
            timer = asyncio.get_running_loop().call_later(max(left, 0.0), _expire, fut, self.timeout)
            try:
                await fut
            finally:
                timer.cancel()
        return fut.result()

    async def _exec(self, req: _Req):
        fut = self._send(req)
        reply = await self._wait(fut, time.monotonic() + self.timeout)
        reply.raise_for_status()
        return req.finish(reply)

    async def _exec_many(self, reqs: list[_Req], combine: Callable[[list], Any]):
        futs: list[asyncio.Future] = []
        deadline = time.monotonic() + self.timeout
        for req in reqs:
            while self._conn is not None and self._conn.in_flight >= self.limits.max_in_flight:
                mine = [f for f in futs if not f.done()]
                if mine:
                    await self._wait(mine[0], deadline)
                elif time.monotonic() > deadline:
                    raise Timeout(f"no room to send within {self.timeout} s")
                else:
                    await asyncio.sleep(0.001)      # the window is held by other callers
            futs.append(self._send(req))
        results = []
        for req, fut in zip(reqs, futs):
            reply = await self._wait(fut, deadline)
            reply.raise_for_status()
            results.append(req.finish(reply))
        return combine(results)

    async def call(self, opcode: int, header: bytes = b"", views: Sequence[Any] = (), *, flags: int = 0,
                   into: Any = None, timeout: Optional[float] = None) -> Reply:
        """One raw request (the node-to-node ops of cluster/ use it): the OK reply, or its
        error raised; ``into`` as in ``ClientProtocolConnection.send_request``."""
        fut = self._send(_Req(opcode, header, views, flags, into, None))
        reply = await self._wait(fut, time.monotonic() + (self.timeout if timeout is None else timeout))
        return reply.raise_for_status()

    async def ls(self, scope, prefix_hash: "str | None" = None) -> list[KvBlockKey]:
        prefix = self._scope_prefix(scope, prefix_hash)
        out: list[KvBlockKey] = []
        after = b""
        while True:
            page = await self._exec(self._list_req(prefix, after))
            out += [decode_key(k) for k in page.keys]
            if not page.more or not page.keys:
                return out
            after = page.keys[-1]

    async def ping(self) -> float:
        t0 = time.perf_counter()
        await self._exec(self._ping_req())
        return time.perf_counter() - t0
