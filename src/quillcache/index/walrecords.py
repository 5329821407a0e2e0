"""The residency index's WAL records: their layout, encoders and one decoder
(index/persistent.py logs and replays them).

Payloads (little-endian; the WAL adds its own CRC framing, docs/wal-format.md)::

    PUT    u8 op=1 | u16 key_len | encoded key | u8 worker_len | worker (UTF-8)
                   | u8 tier code | u8 pinned | u32 ref_count | u64 bytes | i64 last_access_ms
    REMOVE u8 op=2 | u16 key_len | encoded key | u8 worker_len | worker     (all tiers)
    CLEAR  u8 op=3

Encoders validate every field before anything is logged (InvalidArgument); the decoder
raises one of ``RECORD_ERRORS`` on a record it cannot read (the replay reports it as
corruption, never a half-applied record).
"""
from __future__ import annotations

import struct

from quillcache.errors import InvalidArgument, QuillCacheError
from quillcache.index.checkpoint import TIER_CODE, TIERS
from quillcache.model import CacheResidency, CacheTier, encode_key

__all__ = ["OP_PUT", "OP_REMOVE", "OP_CLEAR", "MAX_WORKER_ID_BYTES", "MAX_ENCODED_KEY", "CorruptLog",
           "RECORD_ERRORS", "encode_put", "encode_put_ek", "encode_remove", "encode_clear", "decode_record"]

OP_PUT = 1
OP_REMOVE = 2
OP_CLEAR = 3
MAX_WORKER_ID_BYTES = 255                 # bytes of UTF-8 (a u8 length in the record)
MAX_ENCODED_KEY = 0xFFFF                  # bytes (a u16 length in the record)
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

PUT_TAIL = struct.Struct("<BBIQq")         # tier, pinned, ref_count, bytes, last_access_ms
HEAD = struct.Struct("<BH")                # op, key_len

_unpack_head, _unpack_tail = HEAD.unpack_from, PUT_TAIL.unpack_from

# what decode_record (and the replay of what it decoded) raises on a record it cannot read
RECORD_ERRORS = (ValueError, IndexError, UnicodeDecodeError, struct.error)


class CorruptLog(QuillCacheError):
    """The WAL has corrupt records before its tail (strict recovery refuses them)."""


def _worker_bytes(worker_id: str) -> bytes:
    if not isinstance(worker_id, str):
        raise InvalidArgument(f"worker_id {worker_id!r}: must be a string")
    wb = worker_id.encode("utf-8")
    if len(wb) > MAX_WORKER_ID_BYTES:
        raise InvalidArgument(f"worker_id is {len(wb)} bytes: at most {MAX_WORKER_ID_BYTES}")
    return wb


def encode_put_ek(ek: bytes, r: CacheResidency) -> bytes:
    """The PUT record of ``r`` under its encoded key ``ek``; InvalidArgument for a field out of range."""
    wb = _worker_bytes(r.worker_id)
    if not isinstance(r.tier, CacheTier):
        raise InvalidArgument(f"tier {r.tier!r}: must be a CacheTier")
    for name, value, lo, hi in (("bytes", r.bytes, 0, U64_MAX),
                                ("last_access_ms", r.last_access_ms, I64_MIN, I64_MAX),
                                ("ref_count", r.ref_count, 0, U32_MAX)):
        if not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f"{name} {value!r}: must be an integer in {lo}..{hi}")
    if len(ek) > MAX_ENCODED_KEY:
        raise InvalidArgument(f"encoded key is {len(ek)} bytes: at most {MAX_ENCODED_KEY}")
    return b"".join((HEAD.pack(OP_PUT, len(ek)), ek, bytes((len(wb),)), wb,
                     PUT_TAIL.pack(TIER_CODE[r.tier], bool(r.pinned), r.ref_count, r.bytes,
                                    r.last_access_ms)))


def encode_put(residency: CacheResidency) -> bytes:
    """The PUT record of residency; its length is the logical size of a put (the unit of
    write amplification in every backend's study)."""
    return encode_put_ek(encode_key(residency.key), residency)


def encode_remove(ek: bytes, worker_id: str) -> bytes:
    """The REMOVE record of worker_id's records (every tier) under the encoded key ``ek``."""
    wb = _worker_bytes(worker_id)
    return b"".join((HEAD.pack(OP_REMOVE, len(ek)), ek, bytes((len(wb),)), wb))


def encode_clear() -> bytes:
    """The CLEAR record (every record of every worker)."""
    return bytes((OP_CLEAR,))


def decode_record(payload) -> tuple:
    """``(OP_PUT, ek, (worker, tier code, bytes, last_access_ms, ref_count, pinned))``,
    ``(OP_REMOVE, ek, worker)`` or ``(OP_CLEAR, b"", None)``; one of RECORD_ERRORS when
    the payload is not a well-formed record (the key itself is checked by its reader)."""
    op = payload[0]
    if op == OP_CLEAR and len(payload) == 1:
        return OP_CLEAR, b"", None
    if op != OP_PUT and op != OP_REMOVE:
        raise ValueError(f"unknown op {op}")
    _, klen = _unpack_head(payload, 0)
    pos = 3 + klen
    ek = payload[3:pos]
    wlen = payload[pos]
    worker = payload[pos + 1:pos + 1 + wlen].decode("utf-8")
    pos += 1 + wlen
    if op == OP_REMOVE:
        if pos != len(payload):
            raise ValueError("REMOVE record length mismatch")
        return OP_REMOVE, ek, worker
    if pos + PUT_TAIL.size != len(payload) or len(ek) != klen:
        raise ValueError("PUT record length mismatch")
    tier, pinned, ref, nbytes, last = _unpack_tail(payload, pos)
    if tier >= len(TIERS):
        raise ValueError(f"tier code {tier}")
    return OP_PUT, ek, (worker, tier, nbytes, last, ref, pinned)
