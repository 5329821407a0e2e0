"""Encode/decode the variable header body of every request and reply (pure functions).

All integers little-endian.  Common pieces (docs/protocol.md has the tables):

    key      = u16 length + encoded key bytes (quillcache.model.encode_key), 1..max_key_bytes
    keys     = u32 count (0..max_batch) + count * key
    bitmap   = ceil(count / 8) bytes, bit i = byte i // 8, bit i % 8 (LSB first); spare bits 0
    text16   = u16 length + UTF-8

Decoders check every count and length against ``ProtocolLimits`` and against the
bytes actually present before building anything, and raise ``InvalidArgument``
(a request-level error: the connection stays open) naming what is wrong.
Encoders check the same limits, so a peer never sees a body we would refuse.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

from quillcache._native.codec import (
    decode_key_body, decode_key_list, decode_put_body, decode_sized_key_list, decode_status_sizes, encode_key_body,
    encode_key_list, encode_put_body, encode_sized_key_list, encode_status_sizes,
)
from quillcache.protocol.body import DEFAULT_LIMITS, U16, U32, BodyReader, BytesLike, write_text16
# ROUTE's bodies live in protocol.route; they are named here too, beside every other body.
from quillcache.protocol.route import (
    MAX_ROUTE_TEXT, ROUTE_FIRST_TOKEN, ROUTE_FREE, ROUTE_HASHES, ROUTE_POLICIES, ROUTE_TOKENS, ROUTE_TRACK,
    RouteReply, RouteRequest, decode_route_reply, decode_route_request, decode_route_update,
    encode_route_reply, encode_route_request, encode_route_update,
)
from quillcache.errors import (
    STATUS_CLASSES, CapacityError, InvalidArgument, ProtocolError, QuillCacheError, UnsafeReuse,
    error_for_status,
)
from quillcache.protocol.opcodes import (
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, InfoFormat, PinMode, ProtocolLimits, Status, Violation,
)

__all__ = [
    "DEFAULT_LIMITS", "HelloRequest", "HelloReply", "PutItem", "PinRequest", "ListRequest",
    "ListReply", "ExistsReply", "StatsRequest",
    "encode_hello_request", "decode_hello_request", "negotiate_version",
    "encode_hello_reply", "decode_hello_reply",
    "encode_put_request", "decode_put_request", "encode_get_request", "decode_get_request",
    "encode_put_many_request", "decode_put_many_request", "decode_put_many_columns", "encode_status_list",
    "decode_status_list",
    "encode_keys_request", "decode_keys_request", "BodyReader",
    "encode_get_many_reply", "decode_get_many_reply", "get_many_reply_fit",
    "encode_exists_reply", "decode_exists_reply", "encode_bitmap_reply", "decode_bitmap_reply",
    "encode_pin_request", "decode_pin_request", "encode_unpin_request", "decode_unpin_request",
    "encode_list_request", "decode_list_request", "encode_list_reply", "decode_list_reply",
    "encode_stats_request", "decode_stats_request", "encode_stats_reply", "decode_stats_reply",
    "encode_error", "decode_error",
    "RouteRequest", "RouteReply", "encode_route_request", "decode_route_request",
    "encode_route_reply", "decode_route_reply", "encode_route_update", "decode_route_update",
    "ROUTE_TOKENS", "ROUTE_HASHES", "ROUTE_FIRST_TOKEN", "ROUTE_FREE", "ROUTE_POLICIES", "ROUTE_TRACK",
    "MAX_ROUTE_TEXT",
]

_GET_MANY_ITEM = struct.Struct("<HQ")       # status, nbytes
_HELLO_LIMITS = struct.Struct("<IQIIHHH")   # header, payload, batch, in_flight, key, message, token
_CAPACITY = struct.Struct("<QQQ")           # requested, free, largest_free
_U64_MAX = (1 << 64) - 1



def _key(out: bytearray, key: BytesLike, limits: ProtocolLimits, what: str) -> None:
    out += encode_key_body(key, limits.max_key_bytes, what)      # the codec writes every key field


def _count(out: bytearray, n: int, limits: ProtocolLimits, what: str) -> None:
    if n > limits.max_batch:
        raise InvalidArgument(f"{what}: batch of {n} items, at most {limits.max_batch}")
    out += U32.pack(n)


def _nbytes(n: object, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _U64_MAX:
        raise InvalidArgument(f"{what}: size {n!r} must be an integer in 0..2**64-1")
    return n


def _bitmap(out: bytearray, bits: Sequence[bool]) -> None:
    raw = bytearray((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        if b:
            raw[i >> 3] |= 1 << (i & 7)
    out += raw


def _check_payload(total: int, payload_length: int | None, what: str) -> None:
    if payload_length is not None and total != payload_length:
        raise InvalidArgument(f"{what}: the body declares {total} payload bytes, the frame carries {payload_length}")


# --------------------------------------------------------------------------- HELLO


class HelloRequest(NamedTuple):
    min_version: int
    max_version: int
    token: bytes
    client_name: str


class HelloReply(NamedTuple):
    version: int
    tenant_id: str
    server_name: str
    limits: ProtocolLimits


def encode_hello_request(token: bytes = b"", *, min_version: int = MIN_PROTOCOL_VERSION,
                         max_version: int = PROTOCOL_VERSION, client_name: str = "",
                         limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u8 min_version, u8 max_version, u16 token_len, token, text16 client_name``."""
    if not (isinstance(min_version, int) and isinstance(max_version, int)
            and 1 <= min_version <= max_version <= 0xFF):
        raise InvalidArgument(f"HELLO: versions {min_version!r}..{max_version!r}: need 1 <= min <= max <= 255")
    if not isinstance(token, (bytes, bytearray, memoryview)):
        raise InvalidArgument("HELLO: token must be bytes")
    token = bytes(token)
    if len(token) > limits.max_token_bytes:
        raise InvalidArgument(f"HELLO: token of {len(token)} bytes, at most {limits.max_token_bytes}")
    out = bytearray((min_version, max_version))
    out += U16.pack(len(token))
    out += token
    write_text16(out, client_name, 255, "HELLO", "client_name")
    return bytes(out)


def decode_hello_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> HelloRequest:
    r = BodyReader(body, "HELLO")
    lo, hi = r.u8("min_version"), r.u8("max_version")
    if not 1 <= lo <= hi:
        raise InvalidArgument(f"HELLO: version range {lo}..{hi} is empty or starts at 0")
    n = r.u16("token length")
    if n > limits.max_token_bytes:
        raise InvalidArgument(f"HELLO: token of {n} bytes, at most {limits.max_token_bytes}")
    token = r.take(n, "token")
    name = r.text16("client_name", 255)
    r.end()
    return HelloRequest(lo, hi, token, name)


def negotiate_version(request: HelloRequest, *, min_version: int = MIN_PROTOCOL_VERSION,
                      max_version: int = PROTOCOL_VERSION) -> int:
    """The highest version both sides speak; ``ProtocolError`` when the ranges do not meet."""
    best = min(request.max_version, max_version)
    if best < max(request.min_version, min_version):
        raise ProtocolError(f"no common protocol version: client speaks {request.min_version}.."
                            f"{request.max_version}, server {min_version}..{max_version}")
    return best


def encode_hello_reply(version: int, tenant_id: str, limits: ProtocolLimits, server_name: str = "") -> bytes:
    """``u8 version, text16 tenant_id, text16 server_name, u32 max_header, u64 max_payload,
    u32 max_batch, u32 max_in_flight, u16 max_key, u16 max_message, u16 max_token``."""
    if not isinstance(version, int) or not 1 <= version <= 0xFF:
        raise InvalidArgument(f"HELLO reply: version {version!r} must be in 1..255")
    out = bytearray((version,))
    write_text16(out, tenant_id, 255, "HELLO reply", "tenant_id")
    write_text16(out, server_name, 255, "HELLO reply", "server_name")
    out += _HELLO_LIMITS.pack(limits.max_header_bytes, limits.max_payload_bytes, limits.max_batch,
                              limits.max_in_flight, limits.max_key_bytes, limits.max_message_bytes,
                              limits.max_token_bytes)
    return bytes(out)


def decode_hello_reply(body: BytesLike) -> HelloReply:
    r = BodyReader(body, "HELLO reply")
    version = r.u8("version")
    tenant = r.text16("tenant_id", 255)
    name = r.text16("server_name", 255)
    fields = r.unpack(_HELLO_LIMITS, "limits")
    r.end()
    try:
        limits = ProtocolLimits(*fields)
    except InvalidArgument as exc:
        raise InvalidArgument(f"HELLO reply: {exc}") from None
    return HelloReply(version, tenant, name, limits)


# --------------------------------------------------------------------------- PUT / GET


class PutItem(NamedTuple):
    key: bytes
    nbytes: int


# The codec (quillcache._native.codec, codec_bodies.pxi) owns these two formats: the
# server's and the client's fast paths call it directly, these names are for everyone else.


def encode_put_request(key: BytesLike, nbytes: int, limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``key, u64 nbytes`` (nbytes must equal the frame's payload_length)."""
    return encode_put_body(key, nbytes, limits.max_key_bytes, limits.max_payload_bytes, "PUT")


def decode_put_request(body: BytesLike, payload_length: int | None = None,
                       limits: ProtocolLimits = DEFAULT_LIMITS) -> PutItem:
    return PutItem(*decode_put_body(body, payload_length, limits.max_key_bytes, "PUT"))


def encode_get_request(key: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``key``.  The OK reply has an empty body and the block as payload."""
    return encode_key_body(key, limits.max_key_bytes, "GET")


def decode_get_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    return decode_key_body(body, limits.max_key_bytes, "GET")


# --------------------------------------------------------------------------- PUT_MANY


def encode_put_many_request(items: Sequence[tuple[BytesLike, int]],
                            limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u32 count, count * (u64 nbytes, key)``; the payload is the blocks concatenated in order.
    The RESERVE body too (the codec's sized key list)."""
    return encode_sized_key_list(items, limits.max_batch, limits.max_key_bytes, limits.max_payload_bytes,
                                 "PUT_MANY")


def decode_put_many_columns(body: BytesLike, payload_length: int | None = None,
                            limits: ProtocolLimits = DEFAULT_LIMITS,
                            what: str = "PUT_MANY") -> tuple[list[bytes], list[int]]:
    """``decode_put_many_request`` as two lists, keys and sizes (no record per item)."""
    keys, sizes, total = decode_sized_key_list(body, limits.max_batch, limits.max_key_bytes, what)
    _check_payload(total, payload_length, what)
    return keys, sizes


def decode_put_many_request(body: BytesLike, payload_length: int | None = None,
                            limits: ProtocolLimits = DEFAULT_LIMITS) -> list[PutItem]:
    keys, sizes = decode_put_many_columns(body, payload_length, limits)
    return list(map(PutItem, keys, sizes))


def encode_status_list(statuses: Sequence[int], limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """PUT_MANY reply: ``u32 count, count * u16 status`` (0 = stored)."""
    out = bytearray()
    _count(out, len(statuses), limits, "status list")
    try:
        out += struct.pack(f"<{len(statuses)}H", *statuses)   # checks each is an int in range
    except struct.error:
        for s in statuses:
            if not isinstance(s, int) or not 0 <= s <= 0xFFFF:
                raise InvalidArgument(f"status list: status {s!r} is not a u16") from None
        raise
    return bytes(out)


def decode_status_list(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> list[int]:
    r = BodyReader(body, "status list")
    n = r.count(limits, 2)
    raw = r.take(2 * n, "status")
    r.end()
    return list(struct.unpack(f"<{n}H", raw))


# --------------------------------------------------------------------------- key-list requests


def encode_keys_request(keys: Sequence[BytesLike], limits: ProtocolLimits = DEFAULT_LIMITS,
                        what: str = "request") -> bytes:
    """GET_MANY, EXISTS, REMOVE, GET_LOCATED: ``keys`` (u32 count + count * key)."""
    return encode_key_list(keys, limits.max_batch, limits.max_key_bytes, what)


def decode_keys_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS,
                        what: str = "request") -> list[bytes]:
    return decode_key_list(body, 0, limits.max_batch, limits.max_key_bytes, what)


def get_many_reply_fit(items: Sequence[tuple[int, int]], max_payload: int) -> tuple[int, int]:
    """(items, hits among them) that one GET_MANY or FETCH reply carries: all of them, or the
    longest prefix whose values fit ``max_payload`` bytes (at least one item).  A reply
    covering fewer items than the request had keys tells the client to ask for the rest
    again (the clients and the pool's reader do); without it a batch of large values made a
    frame over the limit, which the client refused and the connection died of."""
    total = hits = 0
    for i, (status, nbytes) in enumerate(items):
        if status == 0:
            total += nbytes
            if total > max_payload and i:
                return i, hits
            hits += 1
    return len(items), hits


def encode_get_many_reply(items: Sequence[tuple[int, int]], limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u32 count, count * (u16 status, u64 nbytes)``; the payload is the blocks with
    status 0 concatenated in request order (nbytes is 0 for the others)."""
    items = list(items)
    body = encode_status_sizes(items, limits.max_batch)     # one native pass; None: named below
    if body is not None:
        return body
    out = bytearray()
    _count(out, len(items), limits, "GET_MANY reply")
    for status, nbytes in items:
        if not isinstance(status, int) or not 0 <= status <= 0xFFFF:
            raise InvalidArgument(f"GET_MANY reply: status {status!r} is not a u16")
        if status and nbytes:
            raise InvalidArgument("GET_MANY reply: an item with a non-zero status carries no bytes")
        out += _GET_MANY_ITEM.pack(status, _nbytes(nbytes, "GET_MANY reply"))
    return bytes(out)


def decode_get_many_reply(body: BytesLike, payload_length: int | None = None,
                          limits: ProtocolLimits = DEFAULT_LIMITS) -> list[tuple[int, int]]:
    fast = decode_status_sizes(body, limits.max_batch)      # one native pass; None: named below
    if fast is not None:
        items, total = fast
        _check_payload(total, payload_length, "GET_MANY reply")
        return items
    r = BodyReader(body, "GET_MANY reply")
    n = r.count(limits, _GET_MANY_ITEM.size)
    items = [r.unpack(_GET_MANY_ITEM, "item") for _ in range(n)]
    r.end()
    for status, nbytes in items:
        if status and nbytes:
            raise InvalidArgument("GET_MANY reply: an item with a non-zero status carries bytes")
    _check_payload(sum(nb for _, nb in items), payload_length, "GET_MANY reply")
    return items


class ExistsReply(NamedTuple):
    prefix_len: int         # how many keys from the first are all present (SGLang batch_exists)
    present: list[bool]


def encode_exists_reply(present: Sequence[bool], limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u32 count, u32 prefix_len, bitmap``."""
    present = [bool(p) for p in present]
    out = bytearray()
    _count(out, len(present), limits, "EXISTS reply")
    prefix = next((i for i, p in enumerate(present) if not p), len(present))
    out += U32.pack(prefix)
    _bitmap(out, present)
    return bytes(out)


def decode_exists_reply(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> ExistsReply:
    r = BodyReader(body, "EXISTS reply")
    n = r.u32("count")
    if n > limits.max_batch:
        raise InvalidArgument(f"EXISTS reply: batch of {n} items, at most {limits.max_batch}")
    prefix = r.u32("prefix_len")
    bits = r.bitmap(n)
    r.end()
    expect = next((i for i, p in enumerate(bits) if not p), n)
    if prefix != expect:
        raise InvalidArgument(f"EXISTS reply: prefix_len {prefix} but the bitmap's present prefix is {expect}")
    return ExistsReply(prefix, bits)


def encode_bitmap_reply(flags: Sequence[bool], limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """REMOVE / PIN / UNPIN reply: ``u32 count, bitmap`` (bit set = done for that key)."""
    flags = [bool(f) for f in flags]
    out = bytearray()
    _count(out, len(flags), limits, "bitmap reply")
    _bitmap(out, flags)
    return bytes(out)


def decode_bitmap_reply(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> list[bool]:
    r = BodyReader(body, "bitmap reply")
    n = r.u32("count")
    if n > limits.max_batch:
        raise InvalidArgument(f"bitmap reply: batch of {n} items, at most {limits.max_batch}")
    bits = r.bitmap(n)
    r.end()
    return bits


# --------------------------------------------------------------------------- PIN / UNPIN


class PinRequest(NamedTuple):
    mode: PinMode
    ttl_ms: int         # 0: until UNPIN
    keys: list[bytes]


def _mode(value: object, what: str) -> PinMode:
    try:
        return PinMode(value)
    except ValueError:
        raise InvalidArgument(f"{what}: pin mode {value!r} (0 soft, 1 hard)") from None


def encode_pin_request(keys: Sequence[BytesLike], mode: PinMode = PinMode.SOFT, ttl_ms: int = 0,
                       limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u8 mode, u32 ttl_ms, keys``."""
    m = _mode(mode, "PIN")
    if not isinstance(ttl_ms, int) or not 0 <= ttl_ms <= 0xFFFFFFFF:
        raise InvalidArgument(f"PIN: ttl_ms {ttl_ms!r} must be in 0..2**32-1")
    return bytes((m,)) + U32.pack(ttl_ms) + encode_keys_request(keys, limits, "PIN")


def decode_pin_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> PinRequest:
    r = BodyReader(body, "PIN")
    m = _mode(r.u8("mode"), "PIN")
    ttl = r.u32("ttl_ms")
    keys = r.keys(limits)
    r.end()
    return PinRequest(m, ttl, keys)


def encode_unpin_request(keys: Sequence[BytesLike], mode: PinMode = PinMode.SOFT,
                         limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u8 mode, keys``."""
    return bytes((_mode(mode, "UNPIN"),)) + encode_keys_request(keys, limits, "UNPIN")


def decode_unpin_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> tuple[PinMode, list[bytes]]:
    r = BodyReader(body, "UNPIN")
    m = _mode(r.u8("mode"), "UNPIN")
    keys = r.keys(limits)
    r.end()
    return m, keys


# --------------------------------------------------------------------------- LIST


class ListRequest(NamedTuple):
    prefix: bytes           # encode_scope / encode_scope_prefix bytes (may be empty)
    limit: int              # 1..max_batch keys per reply
    start_after: bytes      # resume after this key (b"" = from the start)


class ListReply(NamedTuple):
    keys: list[bytes]
    more: bool              # more keys follow: ask again with start_after = keys[-1]


def _raw16(out: bytearray, raw: BytesLike, limit: int, what: str, field: str) -> None:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what}: {field} must be bytes")
    raw = bytes(raw)
    if len(raw) > limit:
        raise InvalidArgument(f"{what}: {field} is {len(raw)} bytes, at most {limit}")
    out += U16.pack(len(raw))
    out += raw


def encode_list_request(prefix: BytesLike, limit: int, start_after: BytesLike = b"",
                        limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u16 prefix_len, prefix, u32 limit, u16 start_after_len, start_after``."""
    if not isinstance(limit, int) or not 1 <= limit <= limits.max_batch:
        raise InvalidArgument(f"LIST: limit {limit!r} must be in 1..{limits.max_batch}")
    out = bytearray()
    _raw16(out, prefix, limits.max_key_bytes, "LIST", "prefix")
    out += U32.pack(limit)
    _raw16(out, start_after, limits.max_key_bytes, "LIST", "start_after")
    return bytes(out)


def decode_list_request(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> ListRequest:
    r = BodyReader(body, "LIST")
    n = r.u16("prefix length")
    if n > limits.max_key_bytes:
        raise InvalidArgument(f"LIST: prefix of {n} bytes, at most {limits.max_key_bytes}")
    prefix = r.take(n, "prefix")
    limit = r.u32("limit")
    if not 1 <= limit <= limits.max_batch:
        raise InvalidArgument(f"LIST: limit {limit} must be in 1..{limits.max_batch}")
    n = r.u16("start_after length")
    if n > limits.max_key_bytes:
        raise InvalidArgument(f"LIST: start_after of {n} bytes, at most {limits.max_key_bytes}")
    start_after = r.take(n, "start_after")
    r.end()
    return ListRequest(prefix, limit, start_after)


def encode_list_reply(keys: Sequence[BytesLike], more: bool, limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    """``u8 more, keys``."""
    return bytes((1 if more else 0,)) + encode_keys_request(keys, limits, "LIST reply")


def decode_list_reply(body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> ListReply:
    r = BodyReader(body, "LIST reply")
    more = r.u8("more")
    if more > 1:
        raise InvalidArgument(f"LIST reply: more flag {more} (0 or 1)")
    keys = r.keys(limits)
    r.end()
    return ListReply(keys, bool(more))


# --------------------------------------------------------------------------- STATS / INFO


class StatsRequest(NamedTuple):
    format: InfoFormat
    section: str            # "" = all sections


def _format(value: object, what: str) -> InfoFormat:
    try:
        return InfoFormat(value)
    except ValueError:
        raise InvalidArgument(f"{what}: format {value!r} (0 text, 1 json)") from None


def encode_stats_request(format: InfoFormat = InfoFormat.TEXT, section: str = "") -> bytes:
    """``u8 format, text16 section``.  The OK reply body is ``u8 format``, its payload the UTF-8 text."""
    out = bytearray((_format(format, "STATS"),))
    write_text16(out, section, 255, "STATS", "section")
    return bytes(out)


def decode_stats_request(body: BytesLike) -> StatsRequest:
    r = BodyReader(body, "STATS")
    fmt = _format(r.u8("format"), "STATS")
    section = r.text16("section", 255)
    r.end()
    return StatsRequest(fmt, section)


def encode_stats_reply(format: InfoFormat) -> bytes:
    return bytes((_format(format, "STATS reply"),))


def decode_stats_reply(body: BytesLike) -> InfoFormat:
    r = BodyReader(body, "STATS reply")
    fmt = _format(r.u8("format"), "STATS reply")
    r.end()
    return fmt


# --------------------------------------------------------------------------- ERROR

_VIOLATIONS = {"model": Violation.MODEL, "tokenizer": Violation.TOKENIZER, "adapter": Violation.ADAPTER}
_VIOLATION_NAMES = {v: k for k, v in _VIOLATIONS.items()}


def _cut_utf8(text: str, limit: int) -> bytes:
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode("utf-8")   # never split a character


def encode_error(exc: BaseException, limits: ProtocolLimits = DEFAULT_LIMITS) -> tuple[int, bytes]:
    """``(status, body)`` for an ERROR reply: ``u8 violation, text16 message`` then, for
    CAPACITY, ``u64 requested, u64 free, u64 largest_free``.  Exceptions that are not
    QuillCacheErrors become INTERNAL (status 1)."""
    status = exc.status if isinstance(exc, QuillCacheError) and exc.status in STATUS_CLASSES else Status.INTERNAL
    message = str(exc) if isinstance(exc, QuillCacheError) else f"internal error: {type(exc).__name__}: {exc}"
    violation = _VIOLATIONS.get(getattr(exc, "violation", None), Violation.NONE) \
        if isinstance(exc, UnsafeReuse) else Violation.NONE
    raw = _cut_utf8(message, limits.max_message_bytes)
    out = bytearray((violation,))
    out += U16.pack(len(raw))
    out += raw
    if isinstance(exc, CapacityError):
        vals = [v if isinstance(v, int) and 0 <= v <= _U64_MAX else 0
                for v in (exc.requested, exc.free, exc.largest_free)]
        out += _CAPACITY.pack(*vals)
    return int(status), bytes(out)


def decode_error(status: int, body: BytesLike, limits: ProtocolLimits = DEFAULT_LIMITS) -> QuillCacheError:
    """The exception an ERROR reply stands for (the class from errors.STATUS_CLASSES).
    A body that does not decode still gives an exception of the right class."""
    cls = STATUS_CLASSES.get(status, QuillCacheError)
    try:
        r = BodyReader(body, "ERROR")
        violation = r.u8("violation")
        message = r.text16("message", limits.max_message_bytes)
        extra = r.unpack(_CAPACITY, "capacity") if cls is CapacityError else None
        r.end()
    except InvalidArgument as exc:
        violation, message, extra = Violation.NONE, f"status {status} with a malformed ERROR body ({exc})", None
    name = _VIOLATION_NAMES.get(violation)
    if cls is UnsafeReuse and name is None:
        return ProtocolError(f"UnsafeReuse error with violation code {violation}: {message}")
    return error_for_status(status, message, violation=name or "model", capacity=extra or (0, 0, 0))


