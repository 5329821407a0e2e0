"""The sans-I/O connection state machines of the QuillCache protocol (asyncpg style).

Bytes come in through ``data_received(data)`` or the BufferedProtocol pair
``get_buffer(sizehint)`` / ``buffer_updated(n)`` (pass them straight through from an
asyncio protocol); events go out through ``_on_*`` hooks; bytes go out through
``_write(buffers)``, always a list of bytes-like objects to send in order
(``transport.writelines``).  Nothing here does I/O or imports asyncio.

``ProtocolConnection`` is the server side, ``ClientProtocolConnection`` the client
side.  A malformed frame is fatal for the connection: the server side sends an
ERROR reply with request id 0, sets ``failed`` and ``close_requested`` and ignores
further input; the owner closes the transport.  Errors of one request (a bad body,
too many in flight, a refused PUT) get an ERROR reply for that request id and the
connection goes on.
"""
from __future__ import annotations

import dataclasses

from typing import Any, Callable, Iterable, Optional, Sequence

from quillcache._native.codec import (
    EV_FRAME, EV_NEED_DATA, EV_PAYLOAD_CHUNK, EV_PAYLOAD_END, EV_PAYLOAD_START, Frame,
    FrameParser, MalformedFrame, crc32c, encode_frame_header, total_nbytes,
)
from quillcache.errors import (
    Busy, ConnectionLost, InvalidArgument, PermissionDenied, ProtocolError, QuillCacheError,
)
from quillcache.protocol import messages
from quillcache.protocol.opcodes import (
    FLAG_PAYLOAD_CRC, FLAG_REPLY, KNOWN_FLAGS, MAX_REQUEST_ID, PAYLOAD_REPLY_OPCODES,
    PAYLOAD_REQUEST_OPCODES, REQUEST_OPCODES, Opcode, ProtocolLimits, Status,
)

__all__ = ["ProtocolConnection", "ClientProtocolConnection", "Reply", "Destination", "DEFER", "AS_BYTES",
           "PREAUTH_OPCODES", "PREAUTH_HEADER_BYTES", "PREAUTH_READ_CHUNK", "PREAUTH_MAX_IN_FLIGHT"]

# What a hook may hand back for a payload: one writable buffer, a list of them
# (filled in order), AS_BYTES (a new ``bytes`` received into, client side), or None (the
# parser collects the payload into a bytearray).
Destination = Any


class _Deferred:
    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFER"


# ``_on_put_start`` may return DEFER: its destination is not known yet (the store waits for
# room).  The connection then takes no input until ``resume_put(dest)`` or
# ``refuse_put(exc)``; the owner stops feeding it meanwhile (``transport.pause_reading()``).
DEFER = _Deferred()


class _AsBytes:
    __slots__ = ()

    def __repr__(self) -> str:
        return "AS_BYTES"


# A reply's ``into`` (or what its callable returns) may be AS_BYTES: the payload is received
# straight into a new ``bytes`` of its size (``FrameParser.receive_bytes``) and
# ``Reply.payload`` is that ``bytes``: one allocation, no copy.
AS_BYTES = _AsBytes()

_SCRATCH = 65536    # bytes: get_buffer() target once the connection has failed (input is dropped)
_READ_CHUNK = 65536  # bytes: what the parser offers a read between payloads once logged in

# Before a client logged in (a server that requires HELLO), only these opcodes are taken;
# any other frame fails the connection (a connection-level PermissionDenied, then close).
PREAUTH_OPCODES = frozenset({Opcode.HELLO})
# Limits before login, enforced by the parser before anything is allocated: a HELLO's header
# (a token of max_token_bytes, a client name) fits; no payload at all; a small read buffer.
PREAUTH_HEADER_BYTES = 8192         # bytes of variable header
PREAUTH_READ_CHUNK = 4096           # bytes offered to a read (the codec's minimum)
PREAUTH_MAX_IN_FLIGHT = 1           # HELLOs at once (a refused one may be answered late)


class _Base:
    """Input plumbing and failure handling shared by both sides."""

    _replies = False
    put_deferred = False       # input is held: a PUT waits for its destination (server side, DEFER)

    def __init__(self, limits: ProtocolLimits | None = None, *, preauth: bool = False) -> None:
        self.limits = limits or ProtocolLimits()
        if preauth:         # the small limits of a client that has not logged in yet
            self._parser = FrameParser(
                REQUEST_OPCODES, max_header_bytes=min(self.limits.max_header_bytes, PREAUTH_HEADER_BYTES),
                max_payload_bytes=0, replies=self._replies, allowed_flags=KNOWN_FLAGS,
                read_chunk=PREAUTH_READ_CHUNK)
        else:
            self._parser = FrameParser(
                REQUEST_OPCODES, max_header_bytes=self.limits.max_header_bytes,
                max_payload_bytes=self.limits.max_payload_bytes, replies=self._replies,
                allowed_flags=KNOWN_FLAGS, read_chunk=_READ_CHUNK)
        self.failed: Optional[BaseException] = None   # the error that ended the connection
        self.close_requested = False                  # the owner should close the transport
        self.closed = False                           # connection_lost() was called
        self._scratch: Optional[bytearray] = None

    # ------------------------------------------------------------------ input

    def data_received(self, data: bytes) -> None:
        if self.failed is not None or self.closed:
            return
        if self.put_deferred:
            self._hold_input(bytes(data))
            return
        try:
            self._parser.feed(data)
        except MalformedFrame as exc:
            self._fail(exc)
            return
        self._process()

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self.failed is not None or self.closed or self.put_deferred:
            return self.scratch_buffer()
        return self._parser.get_buffer(sizehint)

    def scratch_buffer(self) -> memoryview:
        """A buffer for bytes nobody will parse (a failed connection's, a deferred put's)."""
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.failed is not None or self.closed:
            return
        if self.put_deferred:           # the owner should have paused reading: keep it for later
            self._hold_input(bytes(self._scratch[:nbytes]))
            return
        self._parser.buffer_updated(nbytes)
        self._process()

    def _hold_input(self, data: bytes) -> None:
        raise NotImplementedError

    def eof_received(self) -> None:
        """The peer closed its side; a frame cut short is lost (ConnectionLost)."""
        if self.failed is None and (self._parser.in_payload or self._parser.buffered):
            self._lost(ConnectionLost("peer closed the connection in the middle of a frame"))
        self.close_requested = True

    def connection_lost(self, exc: Optional[BaseException] = None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.failed is None:
            self._lost(ConnectionLost(f"connection lost: {exc}" if exc else "connection closed"))

    # ------------------------------------------------------------------ an owner that drives the parser

    @property
    def parser(self) -> FrameParser:
        """The connection's frame parser, for an owner that reads events from it itself (the
        sync client's GET): what it does not take goes back through ``hand_over``."""
        return self._parser

    def hand_over(self, ev: int, frame: Frame) -> None:
        """An event the owner read from ``parser`` and does not handle itself: the connection
        handles it as if it had read it, then every event already buffered behind it."""
        self._event(ev, frame)
        self._process()

    def fail(self, exc: BaseException) -> None:
        """The owner saw ``parser`` raise (a malformed frame): the connection fails with ``exc``."""
        self._fail(exc)

    def _process(self) -> None:
        parser = self._parser
        try:
            while self.failed is None and not self.put_deferred:
                ev = parser.next_event()
                if ev == EV_NEED_DATA:
                    return
                self._event(ev, parser.frame)
        except MalformedFrame as exc:
            self._fail(exc)

    # ------------------------------------------------------------------ output

    def _send(self, opcode: int, request_id: int, header_body: bytes = b"",
              payload_views: Sequence[Any] = (), *, flags: int = 0, status: int = 0,
              payload_crc: bool = False) -> None:
        views = list(payload_views)
        if payload_crc:
            flags |= FLAG_PAYLOAD_CRC
        hdr = encode_frame_header(opcode, request_id, flags=flags, header=header_body,
                                  payload_length=total_nbytes(views), status=status)
        out = [hdr, *views]
        if flags & FLAG_PAYLOAD_CRC:
            crc = 0
            for v in views:
                crc = crc32c(v, crc)
            out.append(crc.to_bytes(4, "little"))
        self._write(out)

    # ------------------------------------------------------------------ hooks

    def _write(self, data: list) -> None:
        """Send ``data`` (a list of bytes-like objects, in order).  Override."""
        raise NotImplementedError

    def _on_error(self, exc: BaseException) -> None:
        """The connection failed (``failed`` is set) or was lost.  Override."""

    # ------------------------------------------------------------------ subclass parts

    def _event(self, ev: int, frame: Frame) -> None:
        raise NotImplementedError

    def _fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    def _lost(self, exc: BaseException) -> None:
        raise NotImplementedError


# ============================================================================ server side


class ProtocolConnection(_Base):
    """Server side: parses requests, tracks them in flight, sends replies.

    Hooks to override:
      ``_on_request(frame)``        a complete request (PUT/PUT_MANY excepted); a payload,
                                    if any (PING), is collected in ``frame.payload``
      ``_on_put_start(frame)``      PUT/PUT_MANY header parsed: return the destination for
                                    the payload (arena slot view, or a list of them in order
                                    for PUT_MANY), or None to collect it; raise a
                                    QuillCacheError to refuse (it is replied, payload dropped)
      ``_on_put_end(frame)``        the payload landed in the destination (``frame.payload``)
      ``_on_put_abort(frame, exc)`` the payload will never complete: release the slot
      ``_on_error(exc)`` / ``_write(buffers)``
    Every request handed to a hook is in flight until ``reply_ok``/``reply_error``.
    """

    _replies = False

    def __init__(self, limits: ProtocolLimits | None = None, *, require_hello: bool = True) -> None:
        super().__init__(limits, preauth=require_hello)
        self.require_hello = require_hello
        self.hello_done = False
        self.negotiated_version: Optional[int] = None
        self._in_flight: dict[int, int] = {}     # request id -> opcode
        self._current: Optional[tuple[Frame, str]] = None   # frame in its payload phase, its kind
        self._backlog: Optional[bytearray] = None  # input that came while a PUT was deferred

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def is_in_flight(self, request_id: int) -> bool:
        return request_id in self._in_flight

    # ------------------------------------------------------------------ hooks (override)

    def _on_request(self, frame: Frame) -> None:
        raise NotImplementedError

    def _on_put_start(self, frame: Frame) -> Destination:
        return None

    def _on_put_end(self, frame: Frame) -> None:
        raise NotImplementedError

    def _on_put_abort(self, frame: Frame, exc: BaseException) -> None:
        pass

    # ------------------------------------------------------------------ replies

    def reply_ok(self, request_id: int, opcode: int, header_body: bytes = b"",
                 payload_views: Sequence[Any] = (), *, flags: int = 0, payload_crc: bool = False) -> None:
        """Send the OK reply of an in-flight request; ``payload_views`` follow the header
        without being copied (writelines)."""
        expected = self.take_request(request_id)
        if opcode != expected:
            raise InvalidArgument(f"reply opcode {opcode:#04x} for a request with opcode {expected:#04x}")
        if opcode == Opcode.HELLO and header_body:
            if not self.hello_done and self.require_hello:
                # logged in: the connection's own limits from the next frame on
                self._parser.set_limits(max_header_bytes=self.limits.max_header_bytes,
                                        max_payload_bytes=self.limits.max_payload_bytes, read_chunk=_READ_CHUNK)
            self.hello_done = True
            self.negotiated_version = header_body[0]
        if self.failed is None and not self.closed:
            self._send(opcode, request_id, header_body, payload_views,
                       flags=(flags | FLAG_REPLY), payload_crc=payload_crc)

    def reply_error(self, request_id: int, exc: BaseException) -> None:
        """Send the ERROR reply of an in-flight request (status and message from ``exc``)."""
        self.take_request(request_id)
        if self.failed is None and not self.closed:
            self._send_error(request_id, exc)

    def take_request(self, request_id: int) -> int:
        """Take an in-flight request out of flight without replying: its owner writes the
        reply itself (``encode_frame_header`` + payload views, the GET fast path).  Returns
        its opcode; InvalidArgument if it is not in flight."""
        try:
            return self._in_flight.pop(request_id)
        except KeyError:
            raise InvalidArgument(f"request {request_id} is not in flight") from None

    def _send_error(self, request_id: int, exc: BaseException) -> None:
        status, body = messages.encode_error(exc, self.limits)
        self._send(Opcode.ERROR, request_id, body, flags=FLAG_REPLY, status=status)

    # ------------------------------------------------------------------ events

    def _admit(self, frame: Frame) -> Optional[BaseException]:
        """None if the request may run, else the request-level error to reply."""
        if frame.payload_length and frame.opcode not in PAYLOAD_REQUEST_OPCODES:
            return InvalidArgument(f"{Opcode(frame.opcode).name} carries no payload, "
                                   f"got {frame.payload_length} bytes")
        if frame.opcode == Opcode.PING and frame.payload_length > self.limits.max_collect_bytes:
            return InvalidArgument(f"PING payload of {frame.payload_length} bytes, at most "
                                   f"{self.limits.max_collect_bytes}")
        if len(self._in_flight) >= self.limits.max_in_flight:
            return Busy(f"{len(self._in_flight)} requests in flight on this connection, "
                        f"at most {self.limits.max_in_flight}")
        if self.require_hello and not self.hello_done and len(self._in_flight) >= PREAUTH_MAX_IN_FLIGHT:
            return Busy("one HELLO at a time before login")
        return None

    def _event(self, ev: int, frame: Frame) -> None:
        if ev == EV_PAYLOAD_END:
            cur, self._current = self._current, None
            kind = cur[1] if cur is not None else "discard"
            if kind == "put":
                self._on_put_end(frame)
            elif kind == "request":
                self._on_request(frame)
            return
        if ev == EV_PAYLOAD_CHUNK:      # never asked for; keep the stream moving
            return
        rid = frame.request_id
        if self.require_hello and not self.hello_done and frame.opcode not in PREAUTH_OPCODES:
            self._fail(PermissionDenied(f"{Opcode(frame.opcode).name} before HELLO: this node has tenants, "
                                        "log in first; closing"))
            return
        if rid in self._in_flight:
            self._fail(ProtocolError(f"request id {rid} is already in flight"))
            return
        refused = self._admit(frame)
        if ev == EV_FRAME:
            if refused is not None:
                self._send_error(rid, refused)
                return
            self._in_flight[rid] = frame.opcode
            try:
                self._on_request(frame)
            except QuillCacheError as exc:
                if rid in self._in_flight:
                    self.reply_error(rid, exc)
            return
        # EV_PAYLOAD_START
        if refused is not None:
            self._parser.discard_payload()
            self._send_error(rid, refused)
            return
        self._in_flight[rid] = frame.opcode
        if frame.opcode not in (Opcode.PUT, Opcode.PUT_MANY):
            self._current = (frame, "request")
            return
        try:
            dest = self._on_put_start(frame)
            if dest is DEFER:
                self._current = (frame, "put")
                self.put_deferred = True
                return
            if dest is not None:
                self._parser.set_destination(dest)
            elif frame.payload_length > self.limits.max_collect_bytes:
                raise InvalidArgument(f"{frame.payload_length} bytes with no destination, at most "
                                      f"{self.limits.max_collect_bytes} are buffered")
        except QuillCacheError as exc:
            self._parser.discard_payload()
            if rid in self._in_flight:
                self.reply_error(rid, exc)
            return
        self._current = (frame, "put")

    def resume_put(self, dest: Destination) -> None:
        """The destination of the deferred PUT (see DEFER); then go on with the input."""
        self.put_deferred = False
        if self.failed is not None or self.closed:
            return
        cur = self._current
        try:
            self._parser.set_destination(dest)
        except QuillCacheError as exc:
            self._current = None
            self._parser.discard_payload()
            self._on_put_abort(cur[0], exc)
            if cur[0].request_id in self._in_flight:
                self.reply_error(cur[0].request_id, exc)
        self._go_on()

    def refuse_put(self, exc: QuillCacheError) -> None:
        """Reply ``exc`` to the deferred PUT, drop its payload, go on with the input."""
        self.put_deferred = False
        if self.failed is not None or self.closed:
            return
        cur, self._current = self._current, None
        self._parser.discard_payload()
        if cur is not None and cur[0].request_id in self._in_flight:
            self.reply_error(cur[0].request_id, exc)
        self._go_on()

    def _hold_input(self, data: bytes) -> None:
        if self._backlog is None:
            self._backlog = bytearray()
        self._backlog += data

    def _go_on(self) -> None:
        self._process()
        backlog, self._backlog = self._backlog, None
        if backlog and self.failed is None and not self.closed:
            self.data_received(bytes(backlog))     # held back while deferred: in order, after the buffer

    def _abort_current(self, exc: BaseException) -> None:
        cur, self._current = self._current, None
        if cur is not None and cur[1] == "put":
            self._on_put_abort(cur[0], exc)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is not None:
            return
        self._abort_current(exc)
        self._send_error(0, exc)        # request id 0: the connection, not one request
        self.failed = exc
        self.close_requested = True
        self._on_error(exc)

    def _lost(self, exc: BaseException) -> None:
        self._abort_current(exc)
        self.failed = exc
        self.close_requested = True
        self._on_error(exc)


# ============================================================================ client side


class Reply:
    """One reply.  ``status`` 0 is OK; otherwise ``error`` is the exception it stands for.
    ``payload``: None, the collected bytearray, or the caller's destination view(s)."""

    __slots__ = ("request_id", "opcode", "status", "header", "payload", "flags", "error")

    def __init__(self, request_id: int, opcode: int, status: int, header: bytes, payload: Any,
                 flags: int, error: Optional[QuillCacheError] = None) -> None:
        self.request_id = request_id
        self.opcode = opcode
        self.status = status
        self.header = header
        self.payload = payload
        self.flags = flags
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_status(self) -> "Reply":
        if self.error is not None:
            raise self.error
        return self

    def __repr__(self) -> str:
        return (f"Reply(request_id={self.request_id}, opcode={self.opcode:#04x}, status={self.status}, "
                f"header={len(self.header)}B, error={self.error!r})")


class ClientProtocolConnection(_Base):
    """Client side: sends requests with fresh ids, matches replies (in any order) by id.

    Hooks: ``_on_reply(reply)`` for every reply, ``_on_error(exc)`` when the connection
    fails (a connection-level ERROR from the server, a malformed reply, a loss): every
    pending request is then lost, see ``pending_ids()``.  After an OK HELLO reply the
    server's limits are in ``peer_limits`` and bound what ``send_request`` sends.
    """

    _replies = True

    def __init__(self, limits: ProtocolLimits | None = None) -> None:
        super().__init__(limits)
        self.peer_limits: ProtocolLimits = self.limits
        self.negotiated_version: Optional[int] = None
        self.tenant_id: Optional[str] = None
        self._pending: dict[int, tuple[int, Any]] = {}   # request id -> (opcode, into)
        self._next_id = 1
        self._current_error: Optional[QuillCacheError] = None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def pending_ids(self) -> list[int]:
        return list(self._pending)

    def accept_peer_payloads(self, ceiling: int) -> None:
        """After HELLO, between events: take reply payloads up to the server's announced
        ``max_payload`` (a GET_MANY reply may be that large), never above ``ceiling``, nor below
        this side's own limit."""
        want = max(self.limits.max_payload_bytes, min(self.peer_limits.max_payload_bytes, ceiling))
        if want != self.limits.max_payload_bytes:
            self.limits = dataclasses.replace(self.limits, max_payload_bytes=want)
            self._parser.set_limits(max_header_bytes=self.limits.max_header_bytes, max_payload_bytes=want)

    def _on_reply(self, reply: Reply) -> None:
        raise NotImplementedError

    def send_request(self, opcode: int, header_body: bytes = b"", payload_views: Iterable[Any] = (), *,
                     flags: int = 0, payload_crc: bool = False,
                     into: Destination | Callable[[Frame], Destination] = None) -> int:
        """Send one request; returns its request id.  ``into``: where a reply payload goes
        (a writable buffer, a list of them, AS_BYTES, or a callable(frame) returning one of
        those or None); without it the payload is collected into a bytearray."""
        if self.failed is not None or self.closed:
            raise ConnectionLost(f"connection is closed ({self.failed})")
        if opcode not in REQUEST_OPCODES:
            raise InvalidArgument(f"opcode {opcode!r} is not a request opcode")
        if flags & ~KNOWN_FLAGS or flags & FLAG_REPLY:
            raise InvalidArgument(f"request flags {flags:#06x}")
        peer = self.peer_limits
        if len(self._pending) >= peer.max_in_flight:
            raise Busy(f"{len(self._pending)} requests in flight, the server allows {peer.max_in_flight}")
        if len(header_body) > peer.max_header_bytes:
            raise InvalidArgument(f"header body of {len(header_body)} bytes, the server allows "
                                  f"{peer.max_header_bytes}")
        views = list(payload_views)
        if views and opcode not in PAYLOAD_REQUEST_OPCODES:
            raise InvalidArgument(f"{Opcode(opcode).name} carries no payload")
        total = total_nbytes(views)
        if total > peer.max_payload_bytes:
            raise InvalidArgument(f"payload of {total} bytes, the server allows {peer.max_payload_bytes}")
        rid = self._new_id()
        self._pending[rid] = (opcode, into)     # before the write: a reply may come back at once
        try:
            self._send(opcode, rid, header_body, views, flags=flags, payload_crc=payload_crc)
        except BaseException:
            del self._pending[rid]
            raise
        return rid

    def send_bare(self, opcode: int, header_body: bytes, into: Destination | Callable[[Frame], Destination],
                  payload: Optional[memoryview] = None) -> int:
        """``send_request`` for a request without flags whose body (and ``payload``, one
        byte-format view) the caller already checked against ``peer_limits`` (the hot paths
        of a GET and a PUT): one header encode and one write, none of the other checks.
        Returns the request id."""
        rid = self._new_id()
        self._pending[rid] = (opcode, into)     # before the write: a reply may come back at once
        try:
            if payload is None:
                self._write([encode_frame_header(opcode, rid, header=header_body)])
            else:
                self._write([encode_frame_header(opcode, rid, header=header_body, payload_length=payload.nbytes),
                             payload])
        except BaseException:
            self._pending.pop(rid, None)
            raise
        return rid

    def complete(self, request_id: int) -> None:
        """The owner consumed the whole reply of ``request_id`` from ``parser`` itself (up to
        its EV_PAYLOAD_END): the request is no longer pending."""
        del self._pending[request_id]

    def _new_id(self) -> int:
        rid = self._next_id
        while rid in self._pending:
            rid = rid + 1 if rid < MAX_REQUEST_ID else 1
        self._next_id = rid + 1 if rid < MAX_REQUEST_ID else 1
        return rid

    # ------------------------------------------------------------------ events

    def _event(self, ev: int, frame: Frame) -> None:
        if ev == EV_PAYLOAD_END:
            self._deliver(frame, self._current_error)
            return
        if ev == EV_PAYLOAD_CHUNK:
            return
        rid = frame.request_id
        if rid == 0:     # connection-level ERROR from the server: it closes
            if ev == EV_PAYLOAD_START:
                self._parser.discard_payload()
            self._fail(messages.decode_error(frame.status, frame.header, self.limits))
            return
        entry = self._pending.get(rid)
        if entry is None:
            self._fail(ProtocolError(f"reply to request id {rid}, which is not pending"))
            return
        opcode, into = entry
        if frame.opcode != opcode and frame.opcode != Opcode.ERROR:
            self._fail(ProtocolError(f"reply opcode {frame.opcode:#04x} to a request with opcode {opcode:#04x}"))
            return
        if ev == EV_FRAME:
            self._deliver(frame, None)
            return
        # EV_PAYLOAD_START
        self._current_error = None
        if frame.opcode == Opcode.ERROR or frame.opcode not in PAYLOAD_REPLY_OPCODES:
            self._parser.discard_payload()
            return
        if into is None:
            return
        try:
            dest = into(frame) if callable(into) else into
            if dest is AS_BYTES:
                self._parser.receive_bytes()
            elif dest is not None:
                self._parser.set_destination(dest)
        except QuillCacheError as exc:
            self._parser.discard_payload()
            self._current_error = exc

    def _deliver(self, frame: Frame, local_error: Optional[QuillCacheError]) -> None:
        self._current_error = None
        self._pending.pop(frame.request_id, None)
        error = local_error
        if frame.status:
            error = messages.decode_error(frame.status, frame.header, self.limits)
        elif frame.opcode == Opcode.HELLO and local_error is None:
            try:
                hello = messages.decode_hello_reply(frame.header)
            except InvalidArgument as exc:
                error = exc
            else:
                self.negotiated_version = hello.version
                self.tenant_id = hello.tenant_id
                self.peer_limits = hello.limits
        status = frame.status or (error.status if error is not None else Status.OK)
        self._on_reply(Reply(frame.request_id, frame.opcode, int(status), frame.header,
                             frame.payload, frame.flags, error))

    def _fail(self, exc: BaseException) -> None:
        if self.failed is not None:
            return
        self.failed = exc
        self.close_requested = True
        self._on_error(exc)

    def _lost(self, exc: BaseException) -> None:
        self._fail(exc)
