"""The data model: keys, identity scopes, tiers, residency records, the cost model,
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
from dataclasses import dataclass, replace
from typing import Optional, Protocol, Sequence, runtime_checkable

__all__ = [
    "KvBlockKey", "IdentityScope", "CacheTier", "CacheResidency", "WorkerState", "EngineKind",
    "EngineEndpoint", "BlockHint", "RequestKvHints", "KvEvent", "BlockStored", "BlockRemoved",
    "AllBlocksCleared", "KvEventBatch", "SloTarget", "RequestShape", "CostModel", "IndexMetrics",
    "IndexBackend", "MemoryIndex", "sort_residencies", "encode_key", "decode_key", "encode_scope",
    "encode_scope_prefix",
    "KeyError_", "MAX_ID_BYTES", "KEY_FORMAT_VERSION", "MAX_PIN_TTL_S", "GiB", "MiB",
]

MiB = 1 << 20
GiB = 1 << 30

MAX_ID_BYTES = 255          # bytes of UTF-8 per identity/hash field of a key
MAX_BLOCK_INDEX = (1 << 32) - 1
MAX_TOKEN_COUNT = (1 << 32) - 1
KEY_FORMAT_VERSION = 1      # first byte of every encoded key
DEFAULT_TOKENS_PER_BLOCK = 64
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


@dataclass(frozen=True, slots=True)
class KvBlockKey:
    """One KV block: its identity scope, its place in a prefix chain and its size in tokens."""

    model_id: str
    tokenizer_id: str
    adapter_id: Optional[str]
    tenant_id: str
    prefix_hash: str
    block_hash: str
    block_index: int = 0
    token_count: int = DEFAULT_TOKENS_PER_BLOCK

    def __post_init__(self) -> None:
        for name in ("model_id", "tokenizer_id", "tenant_id", "prefix_hash", "block_hash"):
            _check_id(name, getattr(self, name))
        if self.adapter_id is not None:
            _check_id("adapter_id", self.adapter_id)
        if not isinstance(self.block_index, int) or not 0 <= self.block_index <= MAX_BLOCK_INDEX:
            raise KeyError_(f"block_index {self.block_index!r}: must be an integer in 0..{MAX_BLOCK_INDEX}")
        if not isinstance(self.token_count, int) or not 0 <= self.token_count <= MAX_TOKEN_COUNT:
            raise KeyError_(f"token_count {self.token_count!r}: must be an integer in 0..{MAX_TOKEN_COUNT}")

    @property
    def scope(self) -> IdentityScope:
        return IdentityScope(self.model_id, self.tokenizer_id, self.adapter_id, self.tenant_id)


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise KeyError_(f"{name} {value!r}: must be a string")
    n = len(value.encode("utf-8"))
    if n > MAX_ID_BYTES:
        raise KeyError_(f"{name} is {n} bytes: at most {MAX_ID_BYTES} bytes of UTF-8")


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
    out = bytearray(encode_scope_prefix(key, key.prefix_hash))
    out += _U32.pack(key.block_index)
    _enc_str(out, key.block_hash)
    out += _U32.pack(key.token_count)
    return bytes(out)


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
    return KvBlockKey(model, tokenizer, adapter, tenant, prefix, block, index, tokens)


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


# --------------------------------------------------------------------------- workers and requests


class EngineKind(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LMCACHE = "lmcache"
    MOCK = "mock"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: "str | EngineKind") -> "EngineKind":
        if isinstance(name, EngineKind):
            return name
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            raise ValueError(f"unknown engine kind {name!r} (known: vllm, sglang, lmcache, mock)") from None


@dataclass(frozen=True, slots=True)
class WorkerState:
    id: str
    locality_domain: str = "default"
    hbm_capacity_bytes: int = 80 * GiB
    hbm_used_bytes: int = 0
    cpu_capacity_bytes: int = 512 * GiB
    cpu_used_bytes: int = 0
    running_decodes: int = 0
    queued_prefill_tokens: int = 0

    def with_load(self, queued_prefill_tokens: int, running_decodes: int) -> "WorkerState":
        return replace(self, queued_prefill_tokens=queued_prefill_tokens, running_decodes=running_decodes)


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    id: str
    kind: EngineKind
    base_url: str
    model_id: str
    tokenizer_id: str
    tenant_id: str
    locality_domain: str = "default"

    def worker_state(self) -> WorkerState:
        return WorkerState(self.id, self.locality_domain)


@dataclass(frozen=True, slots=True)
class BlockHint:
    block_hash: str
    token_count: int = DEFAULT_TOKENS_PER_BLOCK
    bytes: Optional[int] = None


@dataclass(frozen=True, slots=True)
class RequestKvHints:
    """What a request says about its prompt's blocks, as the gateway receives it."""

    request_id: Optional[str] = None
    model_id: Optional[str] = None
    tokenizer_id: Optional[str] = None
    adapter_id: Optional[str] = None
    tenant_id: Optional[str] = None
    session_id: Optional[str] = None
    block_hashes: tuple[str, ...] = ()
    block_tokens: Optional[int] = None
    estimated_decode_tokens: Optional[int] = None
    block_bytes: Optional[int] = None

    def to_blocks(self, fallback_model: str, fallback_tokenizer: str,
                  fallback_tenant: str) -> list[KvBlockKey]:
        # Prefix hashes chain: the first block's parent is the session (or "root"),
        # each later block's parent is the previous block's hash.
        model = self.model_id or fallback_model
        tokenizer = self.tokenizer_id or fallback_tokenizer
        tenant = self.tenant_id or fallback_tenant
        tokens = DEFAULT_TOKENS_PER_BLOCK if self.block_tokens is None else self.block_tokens
        parent = self.session_id or "root"
        keys = []
        for index, block_hash in enumerate(self.block_hashes):
            keys.append(KvBlockKey(model, tokenizer, self.adapter_id, tenant, parent,
                                   block_hash, index, tokens))
            parent = block_hash
        return keys


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[str, ...]
    block_size: int
    parent_block_hash: Optional[str] = None
    token_ids: tuple[int, ...] = ()
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    group_idx: Optional[int] = None
    bytes_per_block: Optional[int] = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[str, ...]
    medium: Optional[str] = None
    group_idx: Optional[int] = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """A batch of engine KV events (vLLM/SGLang publish these), with the identity
    fields the engine knows; the control plane turns them into index calls."""

    engine_id: str
    events: tuple[KvEvent, ...] = ()
    ts_ms: Optional[int] = None
    model_id: Optional[str] = None
    tokenizer_id: Optional[str] = None
    adapter_id: Optional[str] = None
    tenant_id: Optional[str] = None
    bytes_per_block: Optional[int] = None


@dataclass(frozen=True, slots=True)
class SloTarget:
    ttft_ms: int = 800
    tpot_ms: int = 80


@dataclass(frozen=True, slots=True)
class RequestShape:
    id: str
    model_id: str
    tokenizer_id: str
    adapter_id: Optional[str]
    tenant_id: str
    blocks: tuple[KvBlockKey, ...] = ()
    estimated_decode_tokens: int = 0
    slo: SloTarget = SloTarget()

    def input_tokens(self) -> int:
        return sum(block.token_count for block in self.blocks)


# --------------------------------------------------------------------------- cost model


@dataclass(frozen=True, slots=True)
class CostModel:
    """Microsecond estimates used by the router to compare prefill, reuse and transfer."""

    prefill_us_per_token: int = 45
    decode_us_per_token: int = 80
    queue_us_per_prefill_token: int = 4
    running_decode_penalty_us: int = 1_500
    hbm_hit_us: int = 5
    remote_hbm_us_per_mb: int = 20
    cpu_dram_us_per_mb: int = 55
    local_ssd_us_per_mb: int = 280
    object_store_us_per_mb: int = 1_800
    cross_domain_penalty_us: int = 350

    def prefill_cost_us(self, tokens: int) -> int:
        return self.prefill_us_per_token * tokens

    def decode_cost_us(self, tokens: int, running_decodes: int) -> int:
        return self.decode_us_per_token * tokens + self.running_decode_penalty_us * running_decodes

    def queue_cost_us(self, worker: WorkerState) -> int:
        return self.queue_us_per_prefill_token * worker.queued_prefill_tokens

    def transfer_cost_us(self, tier: CacheTier, nbytes: int, same_worker: bool,
                         same_locality_domain: bool) -> int:
        # A same-worker HBM hit pays only the hit; everything else pays per MiB
        # (at least one), plus a penalty when it leaves the worker's locality domain.
        if same_worker and tier is CacheTier.HBM:
            return self.hbm_hit_us
        mib = max(1, -(-nbytes // MiB))
        if tier in (CacheTier.HBM, CacheTier.REMOTE_HBM):
            per_mb = self.remote_hbm_us_per_mb
        elif tier is CacheTier.CPU_DRAM:
            per_mb = self.cpu_dram_us_per_mb
        elif tier is CacheTier.LOCAL_SSD:
            per_mb = self.local_ssd_us_per_mb
        else:
            per_mb = self.object_store_us_per_mb
        base = per_mb * mib
        if same_worker or same_locality_domain:
            return base
        return base + self.cross_domain_penalty_us


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
