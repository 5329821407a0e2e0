"""QuillCache as an SGLang HiCache storage backend (tested against sglang 0.5.23).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"quillcache",
        "module_path":"quillcache.connectors.sglang","class_name":"QuillCacheStorage",
        "interface_v1":1,"address":"unix:/run/quillcache/quillcached.sock",
        "token_file":"/etc/quillcache/engine.token"}'

SGLang builds it as ``QuillCacheStorage(storage_config, {})`` and registers the host pool later
(``register_mem_pool_host``).  Keys are SGLang's page hashes: hex strings chained over the whole
prefix, seeded with the request's extra key (LoRA) and cache_salt by SGLang itself.  Because a
page hash already covers its prefix, and because the HiCache controller backs pages up per
radix node and prefetches from wherever the host tier stops (``prefix_keys`` is None unless
``hicache_storage_pass_prefix_keys`` is on), a key never depends on the call it came in:
``prefix_hash`` is "" and ``block_index`` 0, so a page stored as the 3rd of one batch is found
as the 1st of another.  The model scope carries SGLang's own rank suffixes: TP, PP, DP and
attention-CP ranks, the MLA flag and the page layout.  Tenant: the configured ``tenant``
(SGLang 0.5.23's controller never fills ``extra_info.extra_info``; a caller that does may name
it under ``"quillcache_tenant"``).

``interface_v1`` (zero copy): ``batch_set_v1`` / ``batch_get_v1`` take the host pool's page
buffer metadata (``get_page_buffer_meta``: a pointer and a size per K and per V region of each
page, per layer in the layer-first layout) and move each page as one value straight between
those regions and the node (over ``unix:``, the mapped arena: one copy each way, no staging).
The value is the page's K regions then its V regions, which is the host pool's flat data page
(``get_data_page(flat=True)``), so pages stored by ``batch_set`` and ``batch_set_v1`` are the
same bytes.  Methods this backend does not implement (the v2 pool-transfer set, ``clear``, v1
on a pool without a KV buffer) raise NotImplementedError.
"""
from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from quillcache.connectors import settings
from quillcache.connectors.core import ConnectorCore, model_scope, tenant_from_args, value_nbytes
from quillcache.model import KvBlockKey

log = logging.getLogger("quillcache.connectors.sglang")

__all__ = ["QuillCacheStorage"]


class QuillCacheStorage(HiCacheStorage):

    def __init__(self, storage_config, kwargs: Optional[dict] = None) -> None:
        cfg = storage_config
        where = "--hicache-storage-backend-extra-config"
        extra, unknown = settings.parse(settings.SGLANG, dict(getattr(cfg, "extra_config", None) or {}), where,
                                        settings.SGLANG_OWN)
        if unknown:
            log.warning("%s: unknown QuillCache setting(s) %s ignored (known: %s)", where, ", ".join(unknown),
                        ", ".join(s.name for s in settings.SGLANG))
        self.config = cfg
        self.mla = bool(getattr(cfg, "is_mla_model", False))
        self.model = str(extra["model"] or getattr(cfg, "model_name", None) or "model")
        self.scope = self._scope(extra["dtype"], extra["page_size"], extra["num_layers"],
                                 "page-first" if getattr(cfg, "is_page_first_layout", False) else "layer-first")
        self.tokenizer_id = str(extra["tokenizer_id"] or self.model)
        self.default_tenant = extra["tenant"]
        self.core = ConnectorCore(extra["address"], token=settings.resolve_token(extra, where),
                                  timeout=extra["timeout_s"], spin_us=extra["spin_us"],
                                  name=f"SGLang tp{cfg.tp_rank}")
        self.mem_pool_host = None
        self._metrics: dict[str, list] = {"prefetch": [], "backup": []}

    def _scope(self, dtype: str, page_size: int, layers: int, layout: str) -> str:
        cfg = self.config
        layout = layout.replace("_", "-") + ("-mla" if self.mla else "")
        return model_scope(
            self.model, dtype=dtype, block_size=page_size, num_layers=layers,
            layout=f"sglang-{layout}-dp{cfg.dp_rank}-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}",
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The host pool fixes the bytes of a page: its dtype, page size, layer count and
        layout (page_first, layer_first, page_head, ...) go into the model scope."""
        super().register_mem_pool_host(mem_pool_host)
        p = mem_pool_host
        self.scope = self._scope(str(p.dtype).replace("torch.", ""), int(p.page_size),
                                 int(getattr(p, "layer_num", 0)), str(p.layout))

    # ------------------------------------------------------------------ keys

    def _keys(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[KvBlockKey]:
        tenant = tenant_from_args(getattr(extra_info, "extra_info", None), self.default_tenant)
        # LoRA: inside SGLang's page hash, so adapter_id is None
        return [KvBlockKey(self.scope, self.tokenizer_id, None, tenant, "", k, 0, 0) for k in keys]

    # ------------------------------------------------------------------ the HiCacheStorage set

    def exists(self, key: str) -> bool:
        return self.core.lookup(self._keys([key])) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The count of consecutive hits from the first key."""
        return self.core.lookup(self._keys(keys, extra_info))

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        if target_locations is None:
            raise NotImplementedError("QuillCacheStorage.batch_get needs target_locations (the host pages)")
        views = [t.view(torch.uint8).reshape(-1).numpy() for t in target_locations]
        n = self.core.load(self._keys(keys), views)
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None:
            raise NotImplementedError("QuillCacheStorage.batch_set needs values (tensors)")
        bufs = [v.contiguous().view(torch.uint8).reshape(-1).numpy() for v in values]
        return self.core.save(self._keys(keys), bufs)

    # ------------------------------------------------------------------ interface_v1: host pool pages

    def _page_values(self, keys: List[str], host_indices: torch.Tensor) -> list[tuple[memoryview, ...]]:
        """One value per page: views of its K regions then its V regions in the host pool
        (``get_page_buffer_meta``), each checked to lie inside the pool's KV buffer."""
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("QuillCacheStorage: batch_*_v1 before register_mem_pool_host")
        buf = getattr(pool, "kv_buffer", None)
        if buf is None:
            raise NotImplementedError("QuillCacheStorage: a host pool without a KV buffer (hybrid "
                                      "anchors) needs the v2 pool-transfer interface, not implemented")
        if len(host_indices) != len(keys) * pool.page_size:
            raise ValueError(f"QuillCacheStorage: {len(keys)} keys and {len(host_indices)} host indices "
                             f"(page size {pool.page_size})")
        if not keys:
            return []
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs) or len(sizes) != len(ptrs):
            raise ValueError(f"QuillCacheStorage: {len(ptrs)} page buffers for {len(keys)} pages")
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        out = []
        for i in range(len(keys)):
            regions = []
            for ptr, size in zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]):
                if not lo <= ptr <= hi - size:
                    raise ValueError(f"QuillCacheStorage: page buffer {ptr:#x}+{size} is outside the host pool")
                regions.append(memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B"))
            if not self.mla and per % 2 == 0:      # MHA: (K, V) per buffer pair -> all K, then all V
                regions = regions[0::2] + regions[1::2]
            out.append(tuple(regions))
        return out

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Receive each page straight into its host pool regions; True for the leading pages
        that arrived whole (a page after the first miss is not used, whatever its bytes)."""
        values = self._page_values(keys, host_indices)
        t0 = time.perf_counter()
        n = self.core.load(self._keys(keys, extra_info), values)
        self._metric("prefetch", n, values, t0)
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store each page from its host pool regions (one value per page)."""
        values = self._page_values(keys, host_indices)
        t0 = time.perf_counter()
        ok = self.core.save(self._keys(keys, extra_info), values)
        self._metric("backup", len(keys) if ok else 0, values, t0)
        return [ok] * len(keys)

    def _metric(self, kind: str, pages: int, values: list, t0: float) -> None:
        if pages:
            nbytes = sum(value_nbytes(v) for v in values[:pages])
            self._metrics[kind].append((pages, nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9))

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def clear(self) -> None:
        raise NotImplementedError("QuillCacheStorage.clear: the pool is shared; evict with quillctl")

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (pages per v1 batch and GB/s, as its
        storage metrics collector expects); the connector's counters are ``stats()``."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        got, self._metrics = self._metrics, {"prefetch": [], "backup": []}    # one swap: no lock needed
        return StorageMetrics(prefetch_pgs=[p for p, _ in got["prefetch"]], backup_pgs=[p for p, _ in got["backup"]],
                              prefetch_bandwidth=[b for _, b in got["prefetch"]],
                              backup_bandwidth=[b for _, b in got["backup"]])

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    def close(self) -> None:
        self.core.close()
