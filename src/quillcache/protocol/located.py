"""Header bodies of the located (shared-memory) operations, opcodes 0x30-0x35.

A client that mapped the node's arena (MAP, over the Unix socket: docs/shm.md) asks where
blocks are instead of having them sent, and writes new blocks into reserved slots itself.
Every operation takes a batch.  docs/protocol.md has the table; keys and the RESERVE body
are the GET_MANY / PUT_MANY bodies of ``messages``.

Times are CLOCK_MONOTONIC nanoseconds: client and node share the host, hence the clock,
so a client can tell by itself whether a lease or a reserve has run out.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import numpy as np

from quillcache._native.codec import encode_located_items, first_bad_located_item
from quillcache._native.codec import located_views as _located_views
from quillcache._native.codec import first_slot_outside, release_views, slot_views
from quillcache.errors import InvalidArgument, NotFound, ProtocolError, UnsafeReuse, status_error
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = ["MapReply", "LocatedReply", "ReserveReply", "encode_map_reply", "decode_map_reply",
           "encode_located_reply", "decode_located_reply", "check_located_items", "located_views",
           "release_views", "check_slots", "slot_views", "encode_release_request", "decode_release_request",
           "encode_release_count", "decode_release_count", "encode_reserve_reply", "decode_reserve_reply",
           "encode_id", "decode_id", "LOCATED_ITEM", "MAP_REPLY_BYTES"]

_MAP = struct.Struct("<QQQQ")         # arena_bytes, arena_id, lease_ns, put_timeout_ns
_LEASE = struct.Struct("<QQI")        # lease id, expires (monotonic ns), count
_RESERVE = struct.Struct("<QQI")      # reserve id, expires (monotonic ns), count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# one GET_LOCATED item: u16 status, u64 offset, u64 length (packed, 18 bytes)
LOCATED_ITEM = np.dtype([("status", "<u2"), ("offset", "<u8"), ("length", "<u8")])
MAP_REPLY_BYTES = _MAP.size


class MapReply(NamedTuple):
    arena_bytes: int        # the size to map
    arena_id: int           # random per arena: a remap after a restart gets another one
    lease_ns: int           # how long a GET_LOCATED lease holds
    put_timeout_ns: int     # how long a RESERVE holds before it is reaped


class LocatedReply(NamedTuple):
    lease_id: int           # 0 when nothing was found (nothing to release)
    expires_ns: int         # CLOCK_MONOTONIC ns after which the extents may be reused
    items: np.ndarray       # LOCATED_ITEM records, in key order


class ReserveReply(NamedTuple):
    reserve_id: int
    expires_ns: int         # CLOCK_MONOTONIC ns after which the slots are reaped
    offsets: list[int]      # slot offsets in the arena, in key order


def _short(what: str, body, need: int) -> None:
    if len(body) < need:
        raise InvalidArgument(f"{what}: body of {len(body)} bytes, need {need}")


def encode_map_reply(r: MapReply) -> bytes:
    return _MAP.pack(*r)


def decode_map_reply(body) -> MapReply:
    if len(body) != _MAP.size:
        raise InvalidArgument(f"MAP reply: body of {len(body)} bytes, expected {_MAP.size}")
    return MapReply(*_MAP.unpack(body))


def encode_located_reply(lease_id: int, expires_ns: int, items: Sequence) -> bytes:
    """The GET_LOCATED reply: per key, in order, a ``(status, offset, length)`` tuple, or
    the object that holds a hit (status 0: a store ``Slot`` or ``Lease``, read for its
    ``offset`` and ``size``), so a batch of hits is encoded with no tuple per item.  The
    items are packed by the codec (``encode_located_items``), in one pass."""
    items = items if type(items) is list else list(items)
    return _LEASE.pack(lease_id, expires_ns, len(items)) + encode_located_items(items)


def decode_located_reply(body, limits: ProtocolLimits) -> LocatedReply:
    _short("GET_LOCATED reply", body, _LEASE.size)
    lease_id, expires, n = _LEASE.unpack_from(body)
    if n > limits.max_batch:
        raise InvalidArgument(f"GET_LOCATED reply: {n} items, max_batch is {limits.max_batch}")
    if len(body) != _LEASE.size + n * LOCATED_ITEM.itemsize:
        raise InvalidArgument(f"GET_LOCATED reply: {len(body)} bytes for {n} items")
    items = np.frombuffer(body, LOCATED_ITEM, n, _LEASE.size)
    return LocatedReply(lease_id, expires, items)


def check_located_items(items: np.ndarray, arena_bytes: int) -> None:
    """Every item is a hit whose extent lies inside an arena of ``arena_bytes``, or a miss
    (NotFound, UnsafeReuse); the first that is neither raises: its status's error, or
    ProtocolError for an extent outside the arena.  Checked for the batch in one pass."""
    i = first_bad_located_item(items, len(items), arena_bytes, NotFound.status, UnsafeReuse.status)
    if i < 0:
        return
    status, offset, length = (int(x) for x in items[i].tolist())
    if status:
        raise status_error(status, "get_located item")
    raise ProtocolError(f"GET_LOCATED: extent {offset}+{length} outside the {arena_bytes}-byte arena")


def located_views(arena: memoryview, items: np.ndarray) -> list:
    """Per item (checked by ``check_located_items``): the slice of ``arena`` (a read-only
    view of the whole mapping) at its extent, None for a miss; one slice per hit, in one
    pass (the codec's ``located_views``)."""
    return _located_views(arena, items, len(items))


def encode_release_request(ids: Sequence[int], limits: ProtocolLimits) -> bytes:
    if len(ids) > limits.max_batch:
        raise InvalidArgument(f"RELEASE: {len(ids)} ids, max_batch is {limits.max_batch}")
    return _U32.pack(len(ids)) + struct.pack(f"<{len(ids)}Q", *ids)


def decode_release_request(body, limits: ProtocolLimits) -> list[int]:
    _short("RELEASE", body, 4)
    (n,) = _U32.unpack_from(body)
    if n > limits.max_batch:
        raise InvalidArgument(f"RELEASE: {n} ids, max_batch is {limits.max_batch}")
    if len(body) != 4 + 8 * n:
        raise InvalidArgument(f"RELEASE: {len(body)} bytes for {n} ids")
    return list(struct.unpack_from(f"<{n}Q", body, 4))


def encode_release_count(n: int) -> bytes:
    """The RELEASE reply: u32 how many of the ids were held."""
    return _U32.pack(n)


def decode_release_count(body) -> int:
    if len(body) != 4:
        raise InvalidArgument(f"RELEASE reply: body of {len(body)} bytes, expected 4")
    return _U32.unpack(body)[0]


def encode_reserve_reply(reserve_id: int, expires_ns: int, offsets: Sequence[int] | bytes) -> bytes:
    """The RESERVE reply: ``offsets`` a sequence of ints, or bytes of them already packed
    (little-endian u64s, ``_native.batch.packed_offsets``)."""
    if isinstance(offsets, bytes):
        if len(offsets) % 8:
            raise InvalidArgument(f"RESERVE reply: {len(offsets)} bytes of packed offsets")
        return _RESERVE.pack(reserve_id, expires_ns, len(offsets) // 8) + offsets
    return _RESERVE.pack(reserve_id, expires_ns, len(offsets)) + struct.pack(f"<{len(offsets)}Q", *offsets)


def decode_reserve_reply(body, limits: ProtocolLimits) -> ReserveReply:
    _short("RESERVE reply", body, _RESERVE.size)
    rid, expires, n = _RESERVE.unpack_from(body)
    if n > limits.max_batch or len(body) != _RESERVE.size + 8 * n:
        raise InvalidArgument(f"RESERVE reply: {len(body)} bytes for {n} slots")
    return ReserveReply(rid, expires, list(struct.unpack_from(f"<{n}Q", body, _RESERVE.size)))


def check_slots(offsets: list[int], sizes: list[int], arena_bytes: int) -> None:
    """Every reserved slot (a RESERVE reply's offsets, the sizes asked for) lies inside an
    arena of ``arena_bytes``; else ProtocolError naming the first that does not."""
    i = first_slot_outside(offsets, sizes, arena_bytes)
    if i >= 0:
        raise ProtocolError(f"RESERVE: slot {offsets[i]}+{sizes[i]} outside the {arena_bytes}-byte arena")


def encode_id(value: int) -> bytes:
    """The COMMIT / ABORT body: one u64 reserve id."""
    if not isinstance(value, int) or not 0 < value < 1 << 64:
        raise InvalidArgument(f"reserve id {value!r}: must be in 1..2**64-1")
    return _U64.pack(value)


def decode_id(body, what: str) -> int:
    if len(body) != 8:
        raise InvalidArgument(f"{what}: body of {len(body)} bytes, expected a u64 reserve id")
    return _U64.unpack(body)[0]
