"""The data model of the store: keys, identity scopes, tiers, residency records,
and the residency-index protocol with its reference in-memory backend.

Keys are frozen and hashable.  ``encode_key``/``decode_key`` give the canonical
binary form used on the wire and as the radix-tree key: every field is
self-delimiting, and the fields are ordered scope first, then ``prefix_hash``, so
all blocks of one identity scope and one prefix hash share one byte prefix
(``encode_scope_prefix``) and are one contiguous range in key order.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable

from quillcache._native import keys as _native_keys
from quillcache._native.keys import (  # the key's limits and layout version: defined with the key
    DEFAULT_TOKENS_PER_BLOCK, KEY_FORMAT_VERSION, MAX_BLOCK_INDEX, MAX_ID_BYTES, MAX_TOKEN_COUNT,
)

__all__ = [
    "KvBlockKey", "IdentityScope", "CacheTier", "CacheResidency", "IndexMetrics", "IndexBackend",
    "MemoryIndex", "sort_residencies", "encode_key", "decode_key", "encode_scope", "encode_scope_prefix",
    "KeyError_", "MAX_ID_BYTES", "KEY_FORMAT_VERSION", "MAX_BLOCK_INDEX", "MAX_TOKEN_COUNT",
    "DEFAULT_TOKENS_PER_BLOCK", "MAX_PIN_TTL_S", "GiB", "MiB",
]

MiB = 1 << 20
GiB = 1 << 30

MAX_PIN_TTL_S = 7 * 24 * 3600.0   # seconds: the longest pin a store keeps (PIN ttl 0 gets this)


class KeyError_(ValueError):
    """A key field is out of its limits, or encoded key bytes are malformed."""


# --------------------------------------------------------------------------- identity


@dataclass(frozen=True, slots=True)
class IdentityScope:
    """Who may reuse a block: the same model, tokenizer, LoRA adapter (or none) and tenant."""

    model_id: str
    tokenizer_id: str
    adapter_id: Optional[str]
    tenant_id: str

    @classmethod
    def from_key(cls, key: "KvBlockKey") -> "IdentityScope":
        return cls(key.model_id, key.tokenizer_id, key.adapter_id, key.tenant_id)

    def matches(self, other: "IdentityScope | KvBlockKey") -> bool:
        # The adapter must match exactly, absence included: KV computed with a LoRA
        # adapter is numerically different from the base model's.
        return (
            self.model_id == other.model_id
            and self.tokenizer_id == other.tokenizer_id
            and self.adapter_id == other.adapter_id
            and self.tenant_id == other.tenant_id
        )


# KvBlockKey is native (_native/keys.pyx): a key is its encoding (``_ek``) and a reference
# to its interned IdentityScope, ~32 bytes beside the encoding; the hashes and integers are
# read from the encoding when asked for.  The API is a frozen dataclass's: the 8 fields
# positional or by keyword, checked at construction (KeyError_), read-only attributes,
# equality by encoding, pickling from the fields; ``key.replace(**changes)`` stands for
# ``dataclasses.replace``.
_native_keys.bind(IdentityScope, KeyError_)
KvBlockKey = _native_keys.KvBlockKey
_check_id = _native_keys.check_id


# --------------------------------------------------------------------------- key encoding
#
#   u8 version (=1)
#   str tenant_id | str model_id | str tokenizer_id | adapter | str prefix_hash   <- scope+prefix
#   u32be block_index | str block_hash | u32be token_count
#
# str     = u8 length + UTF-8 bytes (self-delimiting: no encoding is a prefix of another)
# adapter = 0x00 (none) | 0x01 + str
# The tenant comes first so one tenant's blocks are one range (per-tenant listing).

_U32 = struct.Struct(">I")


def _enc_str(out: bytearray, s: str) -> None:
    b = s.encode("utf-8")
    out.append(len(b))
    out += b


def encode_scope(scope: IdentityScope | KvBlockKey) -> bytes:
    """The byte prefix shared by every key of one identity scope."""
    out = bytearray((KEY_FORMAT_VERSION,))
    _enc_str(out, scope.tenant_id)
    _enc_str(out, scope.model_id)
    _enc_str(out, scope.tokenizer_id)
    if scope.adapter_id is None:
        out.append(0)
    else:
        out.append(1)
        _enc_str(out, scope.adapter_id)
    return bytes(out)


def encode_scope_prefix(scope: IdentityScope | KvBlockKey, prefix_hash: str) -> bytes:
    """The byte prefix shared by every key of one identity scope and one prefix hash."""
    _check_id("prefix_hash", prefix_hash)
    out = bytearray(encode_scope(scope))
    _enc_str(out, prefix_hash)
    return bytes(out)


def encode_key(key: KvBlockKey) -> bytes:
    """The index key of ``key`` (layout above), made once per key and kept on it."""
    try:
        return key.encoded()
    except AttributeError:
        raise KeyError_(f"{key!r} is not a KvBlockKey") from None


def decode_key(data: bytes | bytearray | memoryview) -> KvBlockKey:
    """Inverse of ``encode_key``; raises ``KeyError_`` naming what is wrong."""
    buf = bytes(data)
    pos = 0
    n = len(buf)

    def take(count: int, what: str) -> bytes:
        nonlocal pos
        if pos + count > n:
            raise KeyError_(f"encoded key truncated in {what} (at byte {pos} of {n})")
        chunk = buf[pos:pos + count]
        pos += count
        return chunk

    def take_str(what: str) -> str:
        length = take(1, what)[0]
        raw = take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KeyError_(f"encoded key: {what} is not UTF-8") from exc

    version = take(1, "version")[0]
    if version != KEY_FORMAT_VERSION:
        raise KeyError_(f"encoded key version {version}: this build reads version {KEY_FORMAT_VERSION}")
    # This walk names what is wrong; the key itself is decode_key_fast's (its scope from the
    # table of interned scopes, its hashes read from buf when asked for), checked against it.
    tenant = take_str("tenant_id")
    model = take_str("model_id")
    tokenizer = take_str("tokenizer_id")
    flag = take(1, "adapter flag")[0]
    if flag == 0:
        adapter = None
    elif flag == 1:
        adapter = take_str("adapter_id")
    else:
        raise KeyError_(f"encoded key: adapter flag {flag} (must be 0 or 1)")
    prefix = take_str("prefix_hash")
    (index,) = _U32.unpack(take(4, "block_index"))
    block = take_str("block_hash")
    (tokens,) = _U32.unpack(take(4, "token_count"))
    if pos != n:
        raise KeyError_(f"encoded key has {n - pos} trailing bytes")
    key = _native_keys.decode_key_fast(buf, KvBlockKey)     # the layout is canonical: buf is its encoding
    if key is None or key.scope != IdentityScope(model, tokenizer, adapter, tenant) \
            or (key.prefix_hash, key.block_index, key.block_hash, key.token_count) != (prefix, index, block, tokens):
        raise AssertionError(f"decode_key_fast and decode_key disagree on {buf!r}")
    return key


# --------------------------------------------------------------------------- tiers


class CacheTier(enum.Enum):
    HBM = "hbm"
    REMOTE_HBM = "remote_hbm"
    CPU_DRAM = "cpu_dram"
    LOCAL_SSD = "local_ssd"
    OBJECT_STORE = "object_store"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: "str | CacheTier") -> "CacheTier":
        if isinstance(name, CacheTier):
            return name
        tier = _TIER_ALIASES.get(str(name).strip().lower())
        if tier is None:
            known = ", ".join(sorted(_TIER_ALIASES))
            raise ValueError(f"unknown cache tier {name!r} (known: {known})")
        return tier


_TIER_ALIASES = {
    "hbm": CacheTier.HBM, "gpu": CacheTier.HBM, "gpu_memory": CacheTier.HBM, "vram": CacheTier.HBM,
    "remote_hbm": CacheTier.REMOTE_HBM, "remote_gpu": CacheTier.REMOTE_HBM,
    "remote_gpu_memory": CacheTier.REMOTE_HBM,
    "cpu_dram": CacheTier.CPU_DRAM, "cpu": CacheTier.CPU_DRAM, "dram": CacheTier.CPU_DRAM,
    "host": CacheTier.CPU_DRAM, "host_memory": CacheTier.CPU_DRAM,
    "local_ssd": CacheTier.LOCAL_SSD, "ssd": CacheTier.LOCAL_SSD, "nvme": CacheTier.LOCAL_SSD,
    "disk": CacheTier.LOCAL_SSD,
    "object_store": CacheTier.OBJECT_STORE, "object": CacheTier.OBJECT_STORE,
    "s3": CacheTier.OBJECT_STORE, "blob": CacheTier.OBJECT_STORE,
}


@dataclass(frozen=True, slots=True)
class CacheResidency:
    """One copy of one block: where it lives and how it is held."""

    key: KvBlockKey
    worker_id: str
    tier: CacheTier
    bytes: int
    last_access_ms: int = 0
    ref_count: int = 0
    pinned: bool = False


# --------------------------------------------------------------------------- index protocol


@dataclass(frozen=True, slots=True)
class IndexMetrics:
    """Comparable metrics of every backend; what does not apply is 0."""

    resident_blocks: int = 0        # residency records held
    resident_bytes: int = 0
    puts: int = 0
    removes: int = 0
    prefix_scans: int = 0
    bytes_written: int = 0          # bytes physically written to a backing store
    memory_bytes: int = 0           # the structure's own memory, where it knows it


@runtime_checkable
class IndexBackend(Protocol):
    """Where every block lives: key -> residency records (one per worker and tier)."""

    name: str
    persistent: bool

    def put(self, residency: CacheResidency) -> None: ...
    def locate(self, key: KvBlockKey) -> list[CacheResidency]: ...
    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]: ...
    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int: ...
    def clear_worker(self, worker_id: str) -> int: ...   # records removed
    def clear(self) -> None: ...
    def snapshot(self) -> list[CacheResidency]: ...
    def __len__(self) -> int: ...
    def metrics(self) -> IndexMetrics: ...


class MemoryIndex:
    """The reference backend: a dict of key -> residencies.  ``prefix_scan`` filters
    everything (what the seed's flat map did); the ART backend walks a key range."""

    name = "memory"
    persistent = False

    def __init__(self) -> None:
        self._entries: dict[KvBlockKey, list[CacheResidency]] = {}
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0

    def put(self, residency: CacheResidency) -> None:
        # Replaces an existing record for the same worker + tier.
        entries = self._entries.setdefault(residency.key, [])
        entries[:] = [e for e in entries
                      if not (e.worker_id == residency.worker_id and e.tier is residency.tier)]
        entries.append(residency)
        self._puts += 1

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        # Ordered by (worker, tier) like every backend, so answers compare equal.
        return sorted(self._entries.get(key, ()), key=lambda r: (r.worker_id, r.tier.value))

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        self._prefix_scans += 1
        out = [r for key, entries in self._entries.items()
               if key.prefix_hash == prefix_hash and scope.matches(key) for r in entries]
        return sort_residencies(out)

    def _drop(self, keep_record, match_key=lambda key: True) -> int:
        removed = 0
        for key in [k for k in self._entries if match_key(k)]:
            entries = self._entries[key]
            keep = [r for r in entries if keep_record(r)]
            removed += len(entries) - len(keep)
            if keep:
                self._entries[key] = keep
            else:
                del self._entries[key]
        self._removes += removed
        return removed

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        return self._drop(lambda r: r.worker_id != worker_id,
                          lambda k: k.block_hash == block_hash and scope.matches(k))

    def clear_worker(self, worker_id: str) -> int:
        return self._drop(lambda r: r.worker_id != worker_id)

    def clear(self) -> None:
        self._entries.clear()

    def snapshot(self) -> list[CacheResidency]:
        return sort_residencies([r for entries in self._entries.values() for r in entries])

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())

    def metrics(self) -> IndexMetrics:
        return IndexMetrics(
            resident_blocks=len(self),
            resident_bytes=sum(r.bytes for e in self._entries.values() for r in e),
            puts=self._puts, removes=self._removes, prefix_scans=self._prefix_scans,
        )


def sort_residencies(records: Sequence[CacheResidency]) -> list[CacheResidency]:
    return sorted(records, key=lambda r: (encode_key(r.key), r.worker_id, r.tier.value))
