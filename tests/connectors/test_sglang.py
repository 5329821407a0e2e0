"""The SGLang HiCache backend, built by SGLang's own StorageBackendFactory ("dynamic" backend)
from a real HiCacheStorageConfig, against a real quillcached.  Tested against sglang 0.5.23."""
from __future__ import annotations

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def backend(node, tp_rank=0, tenant=""):
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config={"backend_name": "quillcache", "module_path": "quillcache.connectors.sglang",
                      "class_name": "QuillCacheStorage", "interface_v1": 1, "tenant": tenant,
                      "address": f"unix:{node.data_dir / 'quillcached.sock'}", "page_size": 16})
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_sglang_backend_round_trips_pages_and_counts_consecutive_hits(node):
    from quillcache.connectors.sglang import QuillCacheStorage
    s = backend(node)
    try:
        assert isinstance(s, QuillCacheStorage)
        keys = [f"{i:064x}" for i in range(1, 6)]
        pages = [torch.randn(2, 16, 4, 8) for _ in keys]
        assert s.batch_set(keys[:3], pages[:3])
        assert s.batch_exists(keys) == 3                       # consecutive hits from the start
        assert s.exists(keys[0]) and not s.exists(keys[4])
        out = [torch.zeros(2, 16, 4, 8) for _ in keys]
        got = s.batch_get(keys, out)
        assert [g is not None for g in got] == [True, True, True, False, False]
        assert all(torch.equal(a, b) for a, b in zip(out[:3], pages[:3]))
        # the single-key call (no prefix info: stored as a chain start)
        assert s.set(keys[3], pages[3]) is True
        # the tenant from the request's extra info scopes the same page hashes apart
        info = HiCacheStorageExtraInfo(prefix_keys=None, extra_info={"quillcache_tenant": "other"})
        assert s.batch_exists(keys[:3], info) == 0
        # another TP rank never sees rank 0's pages (SGLang's rank suffix, in the model scope)
        r1 = backend(node, tp_rank=1)
        try:
            assert r1.batch_exists(keys) == 0
        finally:
            r1.close()
        with pytest.raises(NotImplementedError):
            s.batch_get_v2([])
        with pytest.raises(NotImplementedError):
            s.batch_get(keys)
    finally:
        s.close()
