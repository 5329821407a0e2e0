"""QuillCache as an SGLang HiCache storage backend (tested against sglang 0.5.23).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"quillcache",
        "module_path":"quillcache.connectors.sglang","class_name":"QuillCacheStorage",
        "interface_v1":1,"address":"unix:/run/quillcache/quillcached.sock"}'

SGLang builds it as ``QuillCacheStorage(storage_config, {})`` and registers the host pool later
(``register_mem_pool_host``).  Keys are SGLang's page hashes (hex strings chained over the
prefix, with the request's extra key -- LoRA id, cache_salt -- mixed in by SGLang); the parent
hash is the previous page's key (``extra_info.prefix_keys`` for the first of a batch).  The
model scope carries SGLang's own rank suffixes: TP, PP, DP and attention-CP ranks, the MLA flag
and the page layout.  Tenant: ``extra_info.extra_info["quillcache_tenant"]`` or the configured
``tenant``.  Methods this backend does not implement (the v2 pool-transfer set) raise
NotImplementedError.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from quillcache.connectors.core import ConnectorCore, Identity, model_scope, tenant_from_args
from quillcache.model import KvBlockKey

__all__ = ["QuillCacheStorage"]


class QuillCacheStorage(HiCacheStorage):

    def __init__(self, storage_config, kwargs: Optional[dict] = None) -> None:
        cfg = storage_config
        extra = dict(getattr(cfg, "extra_config", None) or {})
        self.config = cfg
        layout = ("page-first" if getattr(cfg, "is_page_first_layout", False) else "layer-first") + \
            ("-mla" if getattr(cfg, "is_mla_model", False) else "")
        model = str(extra.get("model") or getattr(cfg, "model_name", None) or "model")
        self.scope = model_scope(
            model, dtype=str(extra.get("dtype", "auto")), block_size=int(extra.get("page_size", 0)),
            num_layers=int(extra.get("num_layers", 0)),
            layout=f"sglang-{layout}-dp{cfg.dp_rank}-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}",
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size)
        self.tokenizer_id = str(extra.get("tokenizer_id", model))
        self.default_tenant = str(extra.get("tenant", ""))
        self.core = ConnectorCore(str(extra.get("address", "127.0.0.1:7600")),
                                  timeout=float(extra.get("timeout_s", 5.0)))
        self.mem_pool_host = None

    # ------------------------------------------------------------------ keys

    def _keys(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[KvBlockKey]:
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        tenant = tenant_from_args(getattr(extra_info, "extra_info", None), self.default_tenant)
        ident = Identity(self.scope, self.tokenizer_id, None, tenant)   # LoRA: inside SGLang's hash
        parent = prefix[-1] if prefix else ""
        out = []
        for i, k in enumerate(keys):
            out.append(KvBlockKey(ident.model_id, ident.tokenizer_id, None, ident.tenant_id, parent, k,
                                  len(prefix) + i, 0))
            parent = k
        return out

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

    def _pages(self, host_indices: torch.Tensor, count: int) -> list[int]:
        ps = self.mem_pool_host.page_size
        return [int(host_indices[i * ps]) for i in range(count)]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        pages = self._pages(host_indices, len(keys))
        bufs = [pool.get_dummy_flat_data_page().clone() for _ in pages]
        n = self.core.load(self._keys(keys, extra_info), [b.view(torch.uint8).reshape(-1).numpy() for b in bufs])
        for i in range(n):
            pool.set_from_flat_data_page(pages[i], bufs[i])
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        bufs = [pool.get_data_page(p, flat=True).contiguous() for p in self._pages(host_indices, len(keys))]
        ok = self.core.save(self._keys(keys, extra_info), [b.view(torch.uint8).reshape(-1).numpy() for b in bufs])
        return [ok] * len(keys)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError("QuillCacheStorage: the v2 pool-transfer interface is not implemented")

    def clear(self) -> None:
        raise NotImplementedError("QuillCacheStorage.clear: the pool is shared; evict with quillctl")

    def get_stats(self):
        return self.core.stats()

    def close(self) -> None:
        self.core.close()
