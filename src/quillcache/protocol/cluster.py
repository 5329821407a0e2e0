"""The node-to-node messages (opcodes 0x40-0x45), encoded and decoded with the checks of
``protocol.messages``: every count and length is checked against the limits before a
list is built.  docs/cluster.md is the spec.

Integers are little-endian.  ``text8`` = u8 length + UTF-8; ``keys`` = u32 count + count
x (u16 length + encoded key), as in GET_MANY.

ANNOUNCE  text8 node, u64 epoch, u32 n, n x (u16 klen, key, u64 size)   reply: empty
WITHDRAW  text8 node, u64 epoch, keys                                    reply: empty
LOCATE    keys                 reply: u32 n, n x (u8 m, m x (text8 node, u64 epoch, u64 size))
FETCH     text8 tenant, keys   reply: u64 holder epoch, u32 n, n x (u8 status, u64 size);
                               payload = the found blocks in order (CRC32C trailer)
CLUSTER_LOCATE  keys           reply: u32 length + JSON
CLUSTER_VIEW    empty          reply: u32 length + JSON
"""
from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple, Sequence

from quillcache._native.codec import decode_key_list
from quillcache.errors import InvalidArgument
from quillcache.protocol.messages import BodyReader, encode_keys_request
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = [
    "encode_announce", "decode_announce", "encode_withdraw", "decode_withdraw",
    "encode_locate", "decode_locate", "encode_locate_reply", "decode_locate_reply",
    "encode_fetch", "decode_fetch", "encode_fetch_reply", "decode_fetch_reply",
    "encode_json", "decode_json", "MAX_HOLDERS",
]

MAX_HOLDERS = 255           # holders named per key in a LOCATE reply (u8)
MAX_JSON_BYTES = 16 << 20   # a CLUSTER_* reply body

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_H = struct.Struct("<H")
_BQ = struct.Struct("<BQ")
_QQ = struct.Struct("<QQ")
_names: dict[str, bytes] = {}           # node id -> its text8 bytes (a LOCATE reply names few nodes)
_names_read: dict[bytes, str] = {}      # the other way, for the decoder
_holder_items: dict[tuple[str, int, int], bytes] = {}   # (node id, epoch, size) -> its reply bytes
_COUNTS = [bytes((i,)) for i in range(MAX_HOLDERS + 1)]


class Holder(NamedTuple):
    """One holder of a block as LOCATE answers it: the node, the epoch of its run, the block's size."""
    node_id: str
    epoch: int
    size: int


def _name(node_id: str) -> bytes:
    raw = _names.get(node_id)
    if raw is None:
        b = bytearray()
        _text8(b, node_id, "node id")
        raw = bytes(b)
        if len(_names) < 4096:
            _names[node_id] = raw
    return raw


def _keys_at(buf, pos: int, limits: ProtocolLimits, what: str) -> list[bytes]:
    """The ``keys`` list starting at ``buf[pos]`` and ending the body, with the checks of
    ``messages.decode_keys_request`` (in the codec: one pass, no reader)."""
    return decode_key_list(buf, pos, limits.max_batch, limits.max_key_bytes, what)


def _text8(out: bytearray, text: str, field: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 255:
        raise InvalidArgument(f"{field} {text!r}: at most 255 bytes of UTF-8")
    out.append(len(raw))
    out += raw


def _read_text8(r: BodyReader, field: str) -> str:
    n = r.u8(field + " length")
    try:
        return r.take(n, field).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{r.what}: {field} is not UTF-8") from None


def _check_count(n: int, limits: ProtocolLimits, what: str) -> None:
    if n > limits.max_batch:
        raise InvalidArgument(f"{what}: batch of {n} items, at most {limits.max_batch}")


# ---------------------------------------------------------------- ANNOUNCE / WITHDRAW

def encode_announce(node_id: str, epoch: int, items: Sequence[tuple[bytes, int]], limits: ProtocolLimits) -> bytes:
    _check_count(len(items), limits, "ANNOUNCE")
    out = bytearray()
    _text8(out, node_id, "node id")
    out += _Q.pack(epoch)
    out += _I.pack(len(items))
    for key, size in items:
        if not 0 < len(key) <= limits.max_key_bytes:
            raise InvalidArgument(f"ANNOUNCE: key of {len(key)} bytes")
        out += _H.pack(len(key))
        out += key
        out += _Q.pack(size)
    return bytes(out)


def decode_announce(body, limits: ProtocolLimits) -> tuple[str, int, list[tuple[bytes, int]]]:
    r = BodyReader(body, "ANNOUNCE")
    node = _read_text8(r, "node id")
    epoch = r.u64("epoch")
    n = r.count(limits, 11)
    items = []
    for _ in range(n):
        key = r.key(limits)
        items.append((key, r.u64("size")))
    r.end()
    return node, epoch, items


def encode_withdraw(node_id: str, epoch: int, keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    out = bytearray()
    _text8(out, node_id, "node id")
    out += _Q.pack(epoch)
    return bytes(out) + encode_keys_request(keys, limits, "WITHDRAW")


def decode_withdraw(body, limits: ProtocolLimits) -> tuple[str, int, list[bytes]]:
    r = BodyReader(body, "WITHDRAW")
    node = _read_text8(r, "node id")
    epoch = r.u64("epoch")
    return node, epoch, _keys_at(r.buf, r.pos, limits, "WITHDRAW")


# ---------------------------------------------------------------- LOCATE

def encode_locate(keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    return encode_keys_request(keys, limits, "LOCATE")


def decode_locate(body, limits: ProtocolLimits, what: str = "LOCATE") -> list[bytes]:
    return _keys_at(body, 0, limits, what)


def encode_locate_reply(per_key: Sequence[Sequence[Holder]], limits: ProtocolLimits) -> bytes:
    """``per_key``: (node id, epoch, size) triples (``Holder`` or plain tuples) per key."""
    _check_count(len(per_key), limits, "LOCATE reply")
    parts = [_I.pack(len(per_key))]
    append = parts.append
    encoded = _holder_items
    for holders in per_key:
        if len(holders) > MAX_HOLDERS:
            holders = holders[:MAX_HOLDERS]
        append(_COUNTS[len(holders)])
        for h in holders:
            raw = encoded.get(h)
            if raw is None:
                raw = _holder_item(h)
            append(raw)
    return b"".join(parts)


def _holder_item(h) -> bytes:
    """One holder as a LOCATE reply names it: text8 node, u64 epoch, u64 size (cached:
    a pool has few nodes and blocks of few sizes)."""
    node_id, epoch, size = h
    raw = _name(node_id) + _QQ.pack(epoch, size)
    if len(_holder_items) < 4096:
        _holder_items[tuple(h)] = raw
    return raw


def decode_locate_reply(body, limits: ProtocolLimits) -> list[list[Holder]]:
    """The holders of each key; every count and length is checked before it is used, as
    ``BodyReader`` would (one loop over the bytes: this runs on every located miss)."""
    buf = bytes(body)
    end = len(buf)
    if end < 4:
        raise InvalidArgument("LOCATE reply: body truncated in count")
    n = int.from_bytes(buf[:4], "little")
    if n > limits.max_batch:
        raise InvalidArgument(f"LOCATE reply: batch of {n} items, at most {limits.max_batch}")
    if n > end - 4:
        raise InvalidArgument(f"LOCATE reply: count {n} needs at least {n} bytes, the body has {end - 4} left")
    pos = 4
    names = _names_read
    unpack = _QQ.unpack_from
    out = []
    append = out.append
    for _ in range(n):
        if pos >= end:
            raise InvalidArgument("LOCATE reply: body truncated in holder count")
        m = buf[pos]
        pos += 1
        holders = []
        for _ in range(m):
            if pos >= end:
                raise InvalidArgument("LOCATE reply: body truncated in node id length")
            ln = buf[pos]
            stop = pos + 1 + ln
            if stop + 16 > end:
                raise InvalidArgument("LOCATE reply: body truncated in holder")
            raw = buf[pos + 1:stop]
            node = names.get(raw)
            if node is None:
                try:
                    node = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidArgument("LOCATE reply: node id is not UTF-8") from None
                if len(names) < 4096:
                    names[raw] = node
            epoch, nbytes = unpack(buf, stop)
            holders.append(Holder(node, epoch, nbytes))
            pos = stop + 16
        append(holders)
    if pos != end:
        raise InvalidArgument(f"LOCATE reply: {end - pos} trailing bytes in the body")
    return out


# ---------------------------------------------------------------- FETCH

def encode_fetch(tenant: str, keys: Sequence[bytes], limits: ProtocolLimits) -> bytes:
    out = bytearray()
    _text8(out, tenant, "tenant")
    return bytes(out) + encode_keys_request(keys, limits, "FETCH")


def decode_fetch(body, limits: ProtocolLimits) -> tuple[str, list[bytes]]:
    r = BodyReader(body, "FETCH")
    tenant = _read_text8(r, "tenant")
    return tenant, _keys_at(r.buf, r.pos, limits, "FETCH")


def encode_fetch_reply(epoch: int, items: Sequence[tuple[int, int]], limits: ProtocolLimits) -> bytes:
    _check_count(len(items), limits, "FETCH reply")
    out = bytearray(_Q.pack(epoch))
    out += _I.pack(len(items))
    for status, size in items:
        out += _BQ.pack(status, size)
    return bytes(out)


def decode_fetch_reply(body, limits: ProtocolLimits, payload_length: int) -> tuple[int, list[tuple[int, int]]]:
    """(holder epoch, [(status, size)]); the sizes of the found items must add up to
    ``payload_length``."""
    r = BodyReader(body, "FETCH reply")
    epoch = r.u64("epoch")
    n = r.count(limits, _BQ.size)
    items = [r.unpack(_BQ, "item") for _ in range(n)]
    r.end()
    total = sum(size for status, size in items if status == 0)
    if total != payload_length:
        raise InvalidArgument(f"FETCH reply: items add up to {total} bytes, the payload has {payload_length}")
    return epoch, items


# ---------------------------------------------------------------- operator replies

def encode_json(obj: Any) -> bytes:
    raw = json.dumps(obj, sort_keys=True).encode("utf-8")
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidArgument(f"reply of {len(raw)} bytes of JSON, at most {MAX_JSON_BYTES}")
    return _I.pack(len(raw)) + raw


def decode_json(body) -> Any:
    r = BodyReader(body, "cluster reply")
    n = r.u32("length")
    if n > MAX_JSON_BYTES:
        raise InvalidArgument(f"cluster reply: {n} bytes of JSON, at most {MAX_JSON_BYTES}")
    raw = r.take(n, "JSON")
    r.end()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"cluster reply: bad JSON ({exc})") from None
