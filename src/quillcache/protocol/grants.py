"""The node-to-node messages of the NIXL transport (opcodes 0x49-0x4B), encoded and decoded with
the checks of ``protocol.messages``.  docs/nixl.md is the spec.

Integers are little-endian; ``text8`` and ``keys`` as in protocol/cluster.py.

NIXL_META      empty         reply: u64 holder epoch, u64 arena address, u64 arena bytes,
                                    u32 length + the holder's NIXL agent metadata
GRANT          u32 r, r x u64 grant id (grants read since, released first), text8 tenant, keys
                             reply: u64 holder epoch, u64 grant id, u32 ttl (microseconds),
                                    u32 n, n x (u8 status, u64 arena offset, u64 size, u32 crc32c)
GRANT_RELEASE  u32 n, n x u64 grant id      reply: u32 how many were still held

A GRANT item's status is 0 (granted: ``size`` bytes at ``offset`` of the holder's arena, whose
CRC32C is ``crc32c``, are held in place until the grant is released or its ttl ends),
``STATUS_FETCH`` (the block is there but not in the arena: fetch it over FETCH), or an error
status (``errors.py``: NotFound, UnsafeReuse, Busy), a miss.
"""
from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

from quillcache.errors import InvalidArgument
from quillcache.protocol.cluster import decode_fetch, encode_fetch
from quillcache.protocol.messages import BodyReader
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = ["Meta", "Grant", "GrantItem", "STATUS_FETCH", "MAX_META_BYTES", "encode_meta_reply",
           "decode_meta_reply", "encode_grant", "decode_grant", "encode_grant_reply", "decode_grant_reply",
           "encode_release", "decode_release", "encode_release_reply", "decode_release_reply"]

STATUS_FETCH = 0xFF             # a GRANT item held outside the arena (SSD): ask FETCH for it
MAX_META_BYTES = 1 << 20        # bytes: a NIXL agent's metadata (a few KiB in 1.5.1)

_META = struct.Struct("<QQQI")
_GRANT_HEAD = struct.Struct("<QQII")
_ITEM = struct.Struct("<BQQI")
_I = struct.Struct("<I")
_Q = struct.Struct("<Q")


class Meta(NamedTuple):
    epoch: int
    arena_address: int
    arena_bytes: int
    metadata: bytes


class GrantItem(NamedTuple):
    status: int
    offset: int
    size: int
    crc: int


class Grant(NamedTuple):
    epoch: int
    grant_id: int
    ttl_us: int
    items: list[GrantItem]


def encode_meta_reply(meta: Meta) -> bytes:
    if not 0 < len(meta.metadata) <= MAX_META_BYTES:
        raise InvalidArgument(f"NIXL_META: metadata of {len(meta.metadata)} bytes, 1..{MAX_META_BYTES}")
    return _META.pack(meta.epoch, meta.arena_address, meta.arena_bytes, len(meta.metadata)) + bytes(meta.metadata)


def decode_meta_reply(body) -> Meta:
    r = BodyReader(body, "NIXL_META reply")
    epoch, address, nbytes, n = r.unpack(_META, "head")
    if not 0 < n <= MAX_META_BYTES:
        raise InvalidArgument(f"NIXL_META reply: metadata of {n} bytes, 1..{MAX_META_BYTES}")
    if address <= 0 or nbytes <= 0:
        raise InvalidArgument("NIXL_META reply: the arena's address and size must be positive")
    meta = bytes(r.take(n, "metadata"))
    r.end()
    return Meta(epoch, address, nbytes, meta)


def encode_grant(tenant: str, keys: Sequence[bytes], limits: ProtocolLimits, release: Sequence[int] = ()) -> bytes:
    """GRANT of ``keys`` for ``tenant``, releasing the grants ``release`` first (a reader's
    releases ride on its next GRANT to the same holder instead of a message of their own)."""
    if len(release) > limits.max_batch:
        raise InvalidArgument(f"GRANT: {len(release)} grants to release, at most {limits.max_batch}")
    head = _I.pack(len(release)) + b"".join(_Q.pack(g) for g in release)
    return head + encode_fetch(tenant, keys, limits)     # then the same body as FETCH: tenant, keys


def decode_grant(body, limits: ProtocolLimits) -> tuple[list[int], str, list[bytes]]:
    """(grant ids to release, tenant, keys)."""
    r = BodyReader(body, "GRANT")
    n = r.u32("release count")
    if n > limits.max_batch:
        raise InvalidArgument(f"GRANT: {n} grants to release, at most {limits.max_batch}")
    release = [r.u64("grant id") for _ in range(n)]
    tenant, keys = decode_fetch(memoryview(r.buf)[r.pos:], limits)
    return release, tenant, keys


def encode_grant_reply(grant: Grant, limits: ProtocolLimits) -> bytes:
    if len(grant.items) > limits.max_batch:
        raise InvalidArgument(f"GRANT reply: batch of {len(grant.items)} items, at most {limits.max_batch}")
    parts = [_GRANT_HEAD.pack(grant.epoch, grant.grant_id, grant.ttl_us, len(grant.items))]
    parts += [_ITEM.pack(*item) for item in grant.items]
    return b"".join(parts)


def decode_grant_reply(body, limits: ProtocolLimits) -> Grant:
    r = BodyReader(body, "GRANT reply")
    epoch, grant_id, ttl_us, n = r.unpack(_GRANT_HEAD, "head")
    if n > limits.max_batch:
        raise InvalidArgument(f"GRANT reply: batch of {n} items, at most {limits.max_batch}")
    items = [GrantItem(*r.unpack(_ITEM, "item")) for _ in range(n)]
    r.end()
    return Grant(epoch, grant_id, ttl_us, items)


def encode_release(grant_ids: Sequence[int], limits: ProtocolLimits) -> bytes:
    if not 0 < len(grant_ids) <= limits.max_batch:
        raise InvalidArgument(f"GRANT_RELEASE: {len(grant_ids)} grants, 1..{limits.max_batch}")
    return _I.pack(len(grant_ids)) + b"".join(_Q.pack(g) for g in grant_ids)


def decode_release(body, limits: ProtocolLimits) -> list[int]:
    r = BodyReader(body, "GRANT_RELEASE")
    n = r.u32("count")
    if not 0 < n <= limits.max_batch:
        raise InvalidArgument(f"GRANT_RELEASE: {n} grants, 1..{limits.max_batch}")
    ids = [r.u64("grant id") for _ in range(n)]
    r.end()
    return ids


def encode_release_reply(held: int) -> bytes:
    return _I.pack(held)


def decode_release_reply(body) -> int:
    r = BodyReader(body, "GRANT_RELEASE reply")
    n = r.u32("count")
    r.end()
    return n
