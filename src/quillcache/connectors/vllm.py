"""QuillCache as a vLLM V1 KV connector (tested against vllm 0.33.0).

    --kv-transfer-config '{"kv_connector":"QuillCacheConnector",
        "kv_connector_module_path":"quillcache.connectors.vllm","kv_role":"kv_both",
        "kv_connector_extra_config":{"address":"unix:/run/quillcache/quillcached.sock",
        "token_file":"/etc/quillcache/engine.token"}}'

Extra config keys (``settings.VLLM``): address (unset: the node's default Unix socket, then
127.0.0.1:7470), token or token_file, timeout_s, model (default: the served model name), tokenizer_id
(default: the model's tokenizer), tenant (the engine's default tenant), layout (default
"vllm-2nbhd"), num_layers (default: the model's layer count), events (false: publish the pool's
stored blocks through take_events), events_medium ("STORAGE"), kv_dtype ("auto" or "fp8_e4m3"),
load_path ("layered" or "staged").  docs/engines.md has the rest.

The worker side is ``quillcache.connectors.paged.PagedKVWorker`` (no vLLM import; the GPU
benchmark drives it directly): one full block of tokens across every layer is one value,
``[layers, 2, block_size, kv_heads, head_size]``, the per-layer caches being vLLM's ``[2,
num_blocks, block_size, kv_heads, head_size]``.  Loads start in ``start_load_kv`` on the core's
I/O thread, copy layer by layer out of the mapped arena, and ``wait_for_layer_load(L)`` waits
for layer L only; saves are gathered (a copy)
in ``wait_for_save`` and sent asynchronously; the scheduler keeps a request's blocks until
``get_finished`` reports its saves done.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Iterable, Optional

import torch
from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from quillcache.connectors import settings
from quillcache.connectors.core import (
    ConnectorCore, chain_keys, model_scope, tenant_from_args, tenant_from_salt,
)
from quillcache.connectors.paged import PagedKVWorker, Transfer
from quillcache.model import IdentityScope, KvBlockKey

log = logging.getLogger("quillcache.connectors.vllm")

__all__ = ["QuillCacheConnector", "QuillCacheMeta", "QuillCacheKVEvents", "worker_ranks"]


def worker_ranks(pc, tp_size: int, pp_size: int) -> tuple[int, int]:
    """This worker's (TP rank, PP rank): from vLLM's process groups once they exist, else from
    the global rank (TP is the innermost dimension of vLLM's rank layout)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, AttributeError):          # the groups are not initialised (tests, tools)
        rank = int(getattr(pc, "rank", 0) or 0)
        return rank % tp_size, (rank // tp_size) % pp_size


class QuillCacheKVEvents(KVConnectorKVEvents):
    """Stored-block events from the workers.  A block is in the pool in full once every worker
    (each TP rank, each PP stage) stored its shard, possibly in different steps, so the counts
    persist across polls and an event is published when its count reaches the worker count."""

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be greater than zero")
        self._counts: Counter = Counter()
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._counts.update(events)

    def merge_from(self, other: "QuillCacheKVEvents") -> None:
        self._counts.update(other.get_all_events())
        self._workers = max(self._workers, other.get_number_of_workers())

    def pop_common_events(self) -> list[KVCacheEvent]:
        done = [e for e, n in self._counts.items() if n >= self._workers]
        for e in done:
            del self._counts[e]
        return done

    def aggregate(self) -> "QuillCacheKVEvents":
        common = self.pop_common_events()
        self._counts = Counter(common)
        self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._counts.elements())

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._counts.clear()


@dataclass
class QuillCacheMeta(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class _ReqState:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    load_from: int = 0           # first block to load (the locally computed ones are skipped)
    load_blocks: int = 0         # blocks to load from the pool
    saved_upto: int = 0          # blocks already scheduled for saving
    load_pending: bool = False


class QuillCacheConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        where = "kv_connector_extra_config"
        extra, unknown = settings.parse(settings.VLLM, dict(self._kv_transfer_config.kv_connector_extra_config or {}),
                                        where)
        if unknown:
            log.warning("%s: unknown QuillCache setting(s) %s ignored (known: %s)", where, ", ".join(unknown),
                        ", ".join(s.name for s in settings.VLLM))
        mc = getattr(vllm_config, "model_config", None)
        cc = getattr(vllm_config, "cache_config", None)
        pc = getattr(vllm_config, "parallel_config", None)
        self.block_size = int(extra["block_size"] or getattr(cc, "block_size", None) or 16)
        self.model = str(extra["model"] or (mc and (mc.served_model_name or mc.model)) or "model")
        self.tokenizer_id = str(extra["tokenizer_id"] or (mc and mc.tokenizer) or self.model)
        self.default_tenant = extra["tenant"]
        self.layout = extra["layout"]
        # the model's layer count (not this stage's: PP stages differ by pp rank in the scope), so
        # the scheduler's lookup scope and rank 0's save scope agree without the caches
        self.num_layers = int(extra["num_layers"] or (mc.get_total_num_hidden_layers() if mc else 0))
        dtype = extra["dtype"] or (cc and cc.cache_dtype != "auto" and cc.cache_dtype) or \
            (mc and str(mc.dtype).replace("torch.", "")) or "auto"
        self.dtype = str(dtype)
        # what the pool stores (kvquant.py): "auto" (the cache dtype) or "fp8_e4m3"; the stored
        # dtype is what the keys' scope names, so an FP8 value is never served to a bf16 reader
        self.kv_dtype = extra["kv_dtype"]
        if self.kv_dtype != "auto":
            self.dtype = self.kv_dtype
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        # the scheduler builds every key in rank 0's scope; each worker moves its own shard under
        # its own TP and PP rank (register_kv_caches), so two ranks never share a key
        self.tp_rank, self.pp_rank = 0, 0
        self._pc = pc
        self.publish_events = extra["events"]
        self.events_medium = extra["events_medium"]
        self.core = ConnectorCore(extra["address"], token=settings.resolve_token(extra, where),
                                  timeout=extra["timeout_s"], spin_us=extra["spin_us"],
                                  name=f"vLLM {role.name.lower()}")
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._saving: set[str] = set()
        self._events: Optional[QuillCacheKVEvents] = None
        # worker side
        self.worker = PagedKVWorker(self.core, kv_dtype=self.kv_dtype, load_path=extra["load_path"])

    # ------------------------------------------------------------------ identity

    def _scope(self) -> str:
        return model_scope(self.model, dtype=self.dtype, block_size=self.block_size,
                           num_layers=self.num_layers, layout=self.layout, tp_rank=self.tp_rank,
                           tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size)

    def identity(self, request) -> IdentityScope:
        lora = getattr(request, "lora_request", None)
        tenant = tenant_from_salt(getattr(request, "cache_salt", None), "")
        if not tenant:
            tenant = tenant_from_args(getattr(request, "kv_transfer_params", None), self.default_tenant)
        return IdentityScope(self._scope(), self.tokenizer_id, lora.lora_name if lora is not None else None, tenant)

    def _keys(self, request, start: int, stop: int) -> list[KvBlockKey]:
        hashes = list(request.block_hashes)
        return chain_keys(self.identity(request), hashes[start:stop], block_size=self.block_size,
                          start=start, parent=hashes[start - 1] if start > 0 else None)

    def _full_prompt_blocks(self, request) -> int:
        return min(len(request.block_hashes), request.num_prompt_tokens // self.block_size)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prefix match only, no side effects beyond remembering the answer for this request."""
        full = self._full_prompt_blocks(request)
        if full * self.block_size >= request.num_prompt_tokens:
            full -= 1                    # vLLM must compute at least the last prompt token
        first = num_computed_tokens // self.block_size
        if full <= first:
            return 0, False
        hit = self.core.lookup(self._keys(request, 0, full))
        if hit <= first:
            return 0, False
        return hit * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._reqs.setdefault(request.request_id, _ReqState(request))
        st.block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else st.block_ids
        if num_external_tokens > 0:
            computed = request.num_computed_tokens
            st.load_from = computed // self.block_size
            st.load_blocks = num_external_tokens // self.block_size
            st.load_pending = True

    def build_connector_meta(self, scheduler_output) -> QuillCacheMeta:
        meta = QuillCacheMeta()
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if nb is not None:
                st.block_ids += list(nb[0])
            progress[rid] = cached.num_computed_tokens[i]
        for rid, computed in progress.items():
            st = self._reqs[rid]
            req = st.request
            if st.load_pending:
                a, b = st.load_from, st.load_from + st.load_blocks
                meta.loads.append(Transfer(rid, self._keys(req, a, b), st.block_ids[a:b]))
                st.load_pending = False
                st.saved_upto = max(st.saved_upto, b)          # loaded blocks are in the pool already
            done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            ready = min(self._full_prompt_blocks(req), done // self.block_size, len(st.block_ids))
            if ready > st.saved_upto:
                a = st.saved_upto
                meta.saves.append(Transfer(rid, self._keys(req, a, ready), st.block_ids[a:ready],
                                           self._stored_event(req, a, ready) if self.publish_events else None))
                st.saved_upto = ready
                self._saving.add(rid)
        return meta

    def _stored_event(self, request, a: int, b: int) -> BlockStored:
        """vLLM's own BlockStored for blocks a..b of the request, in the pool's medium; the
        worker reports it once the save completed (take_events)."""
        lora = getattr(request, "lora_request", None)
        hashes = list(request.block_hashes)
        return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes[a:b]],
                           parent_block_hash=maybe_convert_block_hash(hashes[a - 1]) if a > 0 else None,
                           token_ids=list(request.all_token_ids[a * self.block_size:b * self.block_size]),
                           block_size=self.block_size, lora_id=lora.adapter_id if lora is not None else None,
                           medium=self.events_medium, lora_name=lora.name if lora is not None else None,
                           group_idx=0)

    def update_connector_output(self, connector_output) -> None:
        """Collect the workers' stored-block events (every TP/PP worker reports its own)."""
        got = getattr(connector_output, "kv_cache_events", None)
        if not self.publish_events or not isinstance(got, QuillCacheKVEvents):
            return
        if self._events is None:
            self._events = QuillCacheKVEvents(got.get_number_of_workers())
        self._events.merge_from(got)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Blocks the pool holds in full: an event once every worker reported its shard stored
        (events off: nothing).  Evictions are the node's own to publish ([events] on the node)."""
        if self._events is None:
            return ()
        return self._events.pop_common_events()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """Hold the blocks while saves for this request may be in flight (the worker reports it
        in get_finished once they are done): a freed block reused early would be stored under
        the old hash."""
        self._reqs.pop(request.request_id, None)
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None
        return False, None

    # ------------------------------------------------------------------ worker side (PagedKVWorker)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)
        self.tp_rank, self.pp_rank = worker_ranks(self._pc, self.tp_size, self.pp_size)

    def _own(self, transfers: list[Transfer]) -> list[Transfer]:
        """The scheduler's keys (rank 0's scope) in this worker's scope."""
        scope = self._scope()
        return [t if not t.keys or t.keys[0].model_id == scope else
                dc_replace(t, keys=[k.replace(model_id=scope) for k in t.keys]) for t in transfers]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._own(self._get_connector_metadata().loads))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._own(self._get_connector_metadata().saves))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self.worker.get_finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Optional[QuillCacheKVEvents]:
        """This worker's stored blocks since the last step (an empty container still counts
        the worker towards the quorum of take_events)."""
        if not self.publish_events:
            return None
        out = QuillCacheKVEvents(1)
        out.add_events([t.event for t in self.worker.take_stored() if t.event is not None])
        return out

    def get_kv_connector_stats(self):
        return None

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.core.close()
