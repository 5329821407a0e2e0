"""``Client``: the blocking client over one socket (TCP or the node's Unix socket)."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from quillcache._native.codec import (
    EV_FRAME, EV_NEED_DATA, EV_PAYLOAD_END, EV_PAYLOAD_START, FRAME_OVERHEAD, MalformedFrame, total_nbytes,
)
from quillcache._native.sockio import SpinReceiver
from quillcache.net import DEFAULT_ADDRESS, tune_same_host
from quillcache.errors import (
    ConnectionLost, InvalidArgument, PermissionDenied,
    ProtocolError, QuillCacheError, Timeout,
)
from quillcache.model import (
    KvBlockKey, decode_key,
)
from quillcache.protocol import located, messages
from quillcache.protocol.connection import AS_BYTES, ClientProtocolConnection, Reply
from quillcache.protocol.opcodes import Opcode


from quillcache.client import shm
from quillcache.client.calls import (
    DEFAULT_SPIN_US, DEFAULT_TIMEOUT_S, CLIENT_NAME, MAX_REPLY_PAYLOAD, MAX_SPIN_US, MIN_SOCKET_TIMEOUT_S,
    SHM_PUT_MIN_BYTES, Post, Req,
    resolve_address, token_bytes, dest_view, payload_view, timeval,
)
from quillcache.client.ops import _GET, _STALE, Ops

__all__ = ["Client"]

_PUT = int(Opcode.PUT)
_IOV_MAX = 1024             # buffers one sendmsg may take (Linux's UIO_MAXIOV)


class _SyncConnection(ClientProtocolConnection):
    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.replies: dict[int, Reply] = {}
        self.posted: set[int] = set()           # requests whose replies are dropped (calls.Post)

    def _write(self, data: list) -> None:
        try:
            if len(data) == 1:                  # a request without payload: one bytes object
                self.sock.sendall(data[0])
                return
            n = 0
            if len(data) <= _IOV_MAX:
                # the common case: the kernel takes the whole frame, the caller's buffers as they are
                n = self.sock.sendmsg(data)
                if n == total_nbytes(data):
                    return
            views = [memoryview(b).cast("B") for b in data]
            views = [v for v in views if v.nbytes]
            while True:
                while n:                            # drop what the kernel took
                    head = views[0]
                    if n >= head.nbytes:
                        n -= head.nbytes
                        views.pop(0)
                    else:
                        views[0] = head[n:]
                        n = 0
                if not views:
                    return
                n = self.sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, socket.timeout):   # SO_SNDTIMEO expired: part of a frame may be out
            self.connection_lost(None)
            raise Timeout("timed out sending a request (connection closed)") from None
        except OSError as exc:
            self.connection_lost(exc)
            raise ConnectionLost(f"connection lost while sending: {exc}") from None

    def _on_reply(self, reply: Reply) -> None:
        if self.posted and reply.request_id in self.posted:
            self.posted.discard(reply.request_id)
            return
        self.replies[reply.request_id] = reply


def _got(reply: Reply, dst: Optional[memoryview]):
    """A GET's result from its reply: the ``bytes`` (``dst`` None) or the size received into ``dst``."""
    reply.raise_for_status()
    p = reply.payload
    if dst is None:
        return b"" if p is None else p
    return 0 if p is None else memoryview(p).nbytes


class Client(Ops):
    """A blocking client over one TCP connection (TCP_NODELAY), or over the node's Unix
    socket (``"unix:/path/quillcached.sock"``), where a trusted client maps the node's arena
    at connect (``shm``; ``shm=False`` does not ask).  Not thread-safe: use one per thread.

    ``spin_us``: how long a receive that finds nothing polls the socket before it sleeps
    (default 100 us; 0 sleeps at once).  A reply that comes meanwhile skips the wake-up of
    this thread and the node's cost of waking it: a 1 KiB GET's round trip on loopback
    takes about a third of the time.  The GIL is released while polling; polling pauses by
    itself while replies keep coming later than ``spin_us`` (a remote or busy node, or one
    that shares this thread's CPU), and it is off on a machine of one CPU (docs/protocol.md, "Busy-polling
    receives").  ``receive_stats()`` counts what it did."""

    def __init__(self, address=DEFAULT_ADDRESS, token=None, timeout: float = DEFAULT_TIMEOUT_S, *,
                 client_name: str = CLIENT_NAME, shm: bool = True, spin_us: float = DEFAULT_SPIN_US) -> None:
        self.address = resolve_address(address)
        self.timeout = float(timeout)
        self._conn: Optional[_SyncConnection] = None
        self.tenant: Optional[str] = None
        self.server_name = ""
        self._token = token_bytes(token)
        self._name = client_name
        self._want_shm = bool(shm)
        self.shm_refused = ""            # why MAP was refused (the copy path is used), "" if not
        if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not 0 <= spin_us <= MAX_SPIN_US:
            raise InvalidArgument(f"spin_us {spin_us!r}: must be 0 to {MAX_SPIN_US:g} microseconds")
        self.spin_us = float(spin_us) if (os.cpu_count() or 1) > 1 else 0.0      # one CPU: nothing to wait for
        self._rx = SpinReceiver(int(self.spin_us * 1000))
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
            tune_same_host(sock)        # its PUTs are not paced on loopback (quillcache.net)
        # Blocking socket, timeouts in the kernel: a recv/send is one syscall (CPython's
        # timeout mode polls before each one and settimeout() costs an ioctl).
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(self.timeout))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(self.timeout))
        self._recv_timeout = max(self.timeout, MIN_SOCKET_TIMEOUT_S)
        self._sock = sock
        self._conn = _SyncConnection(sock)
        try:
            hello = self._exec(self._hello_req(self._token, self._name))
            self._conn.accept_peer_payloads(MAX_REPLY_PAYLOAD)
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
                    n, got = shm.recv_with_fds(self._sock, conn.get_buffer(-1))
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
            self._arena = shm.Arena(fds[0], info)
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
        """Run a client/shm.py flow: each request (``Req``) or pipelined ``Batch`` it yields
        is executed, its result sent back; a ``Post`` is sent and its result is None."""
        try:
            req = next(flow)
            while True:
                try:
                    kind = type(req)
                    result = (self._exec(req) if kind is Req else self._post(req.req) if kind is Post
                              else self._exec_many(*req))
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
        ``get_many`` copies, read-only.  The steps: ``shm.LocatedRead``."""
        op = shm.LocatedRead(self, keys)
        views = self._drive(op.enter())
        ok = False
        try:
            yield views
            ok = True
        finally:
            self._drive(op.exit(ok))

    @contextlib.contextmanager
    def put_many_reserved(self, items: Iterable[tuple[KvBlockKey, int]], durable: bool = False):
        """Zero-copy writes: ``items`` are (key, nbytes); yields a writable memoryview per
        key (a reserved arena slot, invisible to readers); leaving the block commits them
        all (``durable``: after the SSD fsync), an exception aborts them.  Write only inside
        the views.  Over TCP (or untrusted): buffers sent by ``put_many`` on leaving.  The
        steps: ``shm.ReservedWrite``."""
        op = shm.ReservedWrite(self, items, durable)
        views = self._drive(op.enter())
        try:
            yield views
        except BaseException:
            self._drive(op.abort())
            raise
        self._drive(op.commit())

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

    def _send(self, req: Req) -> int:
        conn = self._check()
        return conn.send_request(req.opcode, req.header, req.views, flags=req.flags, into=req.into)

    def _set_recv_timeout(self, seconds: float) -> None:
        seconds = max(seconds, MIN_SOCKET_TIMEOUT_S)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))
        self._recv_timeout = seconds

    def _wait(self, rid: int, deadline: float, first_read: int = 0) -> Reply:
        """Receive until the reply to ``rid`` is in; ``first_read`` > 0: when nothing is
        buffered, read at most that many bytes first (the fixed header of a payload reply,
        so that the payload then lands straight in its destination)."""
        replies = self._conn.replies
        while rid not in replies:
            self._recv_once(deadline, first_read, True)
        return replies.pop(rid)

    def receive_stats(self) -> dict:
        """What the receives' polling did (``spin_us``): ``caught`` replies that came while
        polling, ``missed`` polls that ran out (then the receive slept), ``skipped`` receives
        that slept at once because the polls before them had missed."""
        rx = self._rx
        return {"spin_us": self.spin_us, "caught": rx.caught, "missed": rx.missed, "skipped": rx.skipped}

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
            n = self._rx.recv_into(self._sock.fileno(), buf)
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

    def get(self, key: KvBlockKey) -> bytes:
        """The block's bytes.  Over TCP (or untrusted) the reply is received straight into a
        new ``bytes`` of its size (one allocation, no zero fill, no copy after the receive);
        with the arena mapped, one copy out of the mapping.  NotFound on a miss."""
        if self._arena is not None:
            return self._drive(shm.get_flow(self, key, None))
        return self._get(self.get_header(key), None)

    def get_into(self, key: KvBlockKey, buffer) -> int:
        """Receive the block straight into ``buffer`` (writable, C-contiguous); returns its size."""
        dst = dest_view(buffer)
        if self._arena is not None:
            return self._drive(shm.get_flow(self, key, dst))
        return self._get(self.get_header(key), dst)

    def _get(self, hdr: bytes, dst: Optional[memoryview]):
        """GET over the socket: into ``dst`` (returns the size), or into a new ``bytes`` (``dst`` None)."""
        if dst is None:
            into: Any = AS_BYTES
            cap = -1
        else:
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
            return _got(self._wait(rid, deadline, FRAME_OVERHEAD), dst)
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
                    return frame.payload if dst is None else frame.payload_length
                if (ev == EV_PAYLOAD_START and frame.request_id == rid and frame.opcode == _GET
                        and frame.status == 0 and (cap < 0 or frame.payload_length <= cap)):
                    if dst is None:
                        parser.receive_bytes()
                    else:
                        parser.set_destination(dst)
                    receiving = True
                    continue
                conn.hand_over(ev, frame)
                return _got(self._wait(rid, deadline, FRAME_OVERHEAD), dst)
        except MalformedFrame as exc:
            conn.fail(exc)
            self._check()
            raise

    def put(self, key: KvBlockKey, data, durable: bool = False) -> None:
        """Store ``data`` (any C-contiguous buffer) under ``key``; it is sent from where it is
        (``sendmsg``), not copied.  With nothing else in flight this method drives the parser
        for the bare OK reply itself, as ``get`` does; otherwise the general way."""
        mv = payload_view(data)
        n = mv.nbytes
        if durable or not n or self._arena is not None and n >= SHM_PUT_MIN_BYTES:
            return super().put(key, data, durable)
        limits = self.limits
        hdr = messages.encode_put_request(self.encoded_key(key), n, limits)   # checks key and size
        conn = self._check()
        parser = conn.parser
        if conn.in_flight or parser.buffered or parser.in_payload or len(hdr) > limits.max_header_bytes:
            return super().put(key, data, durable)
        deadline = time.monotonic() + self.timeout
        rid = conn.send_bare(_PUT, hdr, None, mv)
        try:
            while True:
                ev = parser.next_event()
                if ev == EV_NEED_DATA:
                    self._recv_once(deadline, 0, False)
                    continue
                frame = parser.frame
                if ev == EV_FRAME and frame.request_id == rid and frame.opcode == _PUT and frame.status == 0:
                    conn.complete(rid)
                    return None
                conn.hand_over(ev, frame)       # an error reply, or anything unexpected
                self._wait(rid, deadline).raise_for_status()
                return None
        except MalformedFrame as exc:
            conn.fail(exc)
            self._check()
            raise

    def _post(self, req: Req) -> None:
        """Send ``req`` and drop its reply when it comes (``calls.Post``); waited for like
        ``_exec`` where the in-flight window has no room for it and one more request."""
        conn = self._check()
        if conn.in_flight + 2 > self.limits.max_in_flight:
            self._exec(req)
            return
        conn.posted.add(self._send(req))

    def _exec(self, req: Req):
        rid = self._send(req)
        reply = self._wait(rid, time.monotonic() + self.timeout)
        reply.raise_for_status()
        return req.finish(reply)

    def _exec_many(self, reqs: list[Req], combine: Callable[[list], Any]):
        rids: list[int] = []
        got: dict[int, Reply] = {}
        oldest = 0                                 # rids[oldest:] are not in got yet
        try:
            for req in reqs:
                # a window of the server's max_in_flight: take replies in order until one frees a
                # place (an earlier reply may already be in without having been taken)
                while self._conn.in_flight >= self.limits.max_in_flight:
                    if oldest < len(rids):
                        got[rids[oldest]] = self._wait(rids[oldest], time.monotonic() + self.timeout)
                        oldest += 1
                    else:                          # posted requests (calls.Post) hold the window
                        self._recv_once(time.monotonic() + self.timeout, 0, True)
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
        rid = self._send(Req(opcode, header, views, flags, into, None))
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
