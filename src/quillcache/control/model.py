"""The control plane's data model: engines and workers, request shapes, SLOs and the
cost model the router, the simulated engine and the replay share.

(These lived in ``quillcache.model`` before the control package existed; the store's
own data model stays there.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional

from quillcache.model import DEFAULT_TOKENS_PER_BLOCK, CacheTier, GiB, KvBlockKey, MiB

__all__ = [
    "WorkerState", "EngineKind", "EngineEndpoint", "BlockHint", "RequestKvHints", "SloTarget",
    "RequestShape", "CostModel", "H200_LLAMA3_8B", "HOST_TO_HBM_BYTES_PER_S", "TCP_BYTES_PER_S", "us_per_mib",
]

# Links measured on the GPU machine (/work/shared/notes/gpu-machine.md, 2026-11-23, 1 GiB copies,
# best of 5): pinned or cudaHostRegister-ed host memory to HBM 55 GB/s; a QuillCache get over
# loopback TCP into pinned memory then to the device 4.2-4.9 GB/s (one to eight client threads).
HOST_TO_HBM_BYTES_PER_S = 55e9
TCP_BYTES_PER_S = 4.5e9


def us_per_mib(bytes_per_s: float) -> int:
    """A link's cost in microseconds per MiB moved (at least 1)."""
    return max(1, round((1 << 20) / bytes_per_s * 1e6))


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


# One H200 serving a Llama-3-8B-shaped model, from /work/shared/notes/gpu-machine.md:
# * prefill: 8192 tokens in 238 ms measured -> 29 us per uncached token;
# * decode: not measured there; one step streams the 16 GB of bf16 weights, 3.3 ms at the
#   4.8 TB/s HBM peak, ~6 ms at a realistic 55 % of it -> 6000 us per step;
# * each running decode also streams its KV: 4096 tokens x 128 KiB = 512 MiB, ~110 us at
#   4.8 TB/s -> 100 us per running decode;
# * pool load from pinned host memory: 8192 tokens reloaded + 128 computed in 43 ms measured,
#   i.e. (43 - 128 x 0.029) ms / 8192 tokens = 4.8 us per token = 38 us per MiB of KV.
H200_LLAMA3_8B = CostModel(
    prefill_us_per_token=29,
    decode_us_per_token=6000,
    running_decode_penalty_us=100,
    cpu_dram_us_per_mb=38,
)
