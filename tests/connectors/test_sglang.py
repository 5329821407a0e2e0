"""The SGLang HiCache backend, built by SGLang's own StorageBackendFactory ("dynamic" backend)
from a real HiCacheStorageConfig, against a real quillcached.  The zero-copy v1 path runs on
SGLang's real MHA host pool (MHATokenToKVPoolHost, built from a real CPU MHATokenToKVPool as
SGLang's pool assembler builds it) with SGLang's real page hashes, in the HiCache controller's
call order.  Tested against sglang 0.5.23."""
from __future__ import annotations

import json
import logging

import pytest

from tests._support import engines, engines_doc
from tests._support.daemon import Daemon
from tests._support.engine_node import EngineNode

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def backend(node, tp_rank=0, tenant="", via="unix", pool=None):
    address = f"unix:{node.data_dir / 'quillcached.sock'}" if via == "unix" else node.addr
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config={"backend_name": "quillcache", "module_path": "quillcache.connectors.sglang",
                      "class_name": "QuillCacheStorage", "interface_v1": 1, "tenant": tenant,
                      "address": address, "page_size": 16})
    s = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    if pool is not None:                 # the controller's attach order
        s.register_mem_pool_host(pool)
        s.on_host_pools_registered()
    return s


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


# ---------------------------------------------------------------------- interface_v1 (zero copy)

PS, LAYERS, KVH, HD, DEV_TOKENS = 16, 3, 2, 32, 256


def host_pool(layout: str):
    """SGLang's MHA host pool on CPU, built as its pool assembler builds it (buffer info of the
    device pool, the class SGLang picks for it); pin_memory off: there is no CUDA here."""
    memory_pool, mha = engines.import_sglang("sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mha")
    dev = memory_pool.MHATokenToKVPool(DEV_TOKENS, PS, torch.bfloat16, KVH, HD, LAYERS, "cpu", False,
                                       enable_alt_stream=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    cls = mha.get_mha_host_pool_cls(info)
    assert cls is mha.MHATokenToKVPoolHost
    return cls(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
               start_layer=dev.start_layer, end_layer=dev.end_layer)


def page_hashes(tokens, lora):
    """SGLang's own storage page hashes (seeded with the request's extra key, the LoRA id)."""
    utils, radix = engines.import_sglang("sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.radix_cache")
    return utils.get_storage_hash_str(radix.RadixKey(list(tokens), extra_key=lora), None, page_size=PS)


def page_bytes(pool, index) -> torch.Tensor:
    return pool.get_data_page(int(index), flat=True).contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout,via", [("page_first", "unix"), ("layer_first", "unix"), ("page_first", "tcp")])
def test_sglang_v1_moves_host_pages_byte_for_byte_in_the_controllers_order(node, layout, via):
    pool = host_pool(layout)
    s = backend(node, via=via, pool=pool)
    try:
        assert s.core.shm == (via == "unix")
        g = torch.Generator().manual_seed(5)
        tokens = range(2000, 2000 + 6 * PS)
        keys = page_hashes(tokens, "lora-a")
        src = pool.alloc(6 * PS)
        for i in range(6):                   # the KV of 6 pages, written as SGLang's D2H backup leaves it
            kv = torch.randn(2, LAYERS, PS, KVH, HD, generator=g).to(torch.bfloat16)
            pool.set_from_flat_data_page(int(src[i * PS]), kv.flatten())
        none = HiCacheStorageExtraInfo(prefix_keys=None)     # SGLang's default (pass_prefix_keys off)

        # backup (_page_backup -> _page_set_zero_copy): two radix nodes, 4 pages then 2
        assert all(s.batch_set_v1(keys[:4], src[:4 * PS], none))
        assert all(s.batch_set_v1(keys[4:], src[4 * PS:], none))
        # a page stored by v1 is SGLang's flat data page: the copying path reads the same bytes
        flat = s.batch_get(keys[:1], [pool.get_dummy_flat_data_page()])[0]
        assert torch.equal(flat.view(torch.uint8), page_bytes(pool, src[0]))

        # prefetch (_storage_hit_query, then _page_transfer -> _page_get_zero_copy), starting
        # where the host tier stopped (page 2): keys never depend on the batch they came in
        assert s.batch_exists(keys[2:], none) == 4
        dst = pool.alloc(4 * PS)
        assert s.batch_get_v1(keys[2:], dst, none) == [True] * 4
        for i in range(4):
            assert torch.equal(page_bytes(pool, dst[i * PS]), page_bytes(pool, src[(i + 2) * PS])), f"page {i}"

        # a page missing in the middle: the pages after it are not reported, whatever their bytes
        gap = keys[:2] + [f"{0xdead:064x}"] + keys[3:4]
        assert s.batch_get_v1(gap, pool.alloc(4 * PS), none) == [True, True, False, False]

        # another adapter (SGLang's page hash) or another tenant (our key): a miss, nothing written
        sentinel = torch.full((2 * LAYERS * PS * KVH * HD,), 7.0, dtype=torch.bfloat16)
        other = pool.alloc(2 * PS)
        for i in range(2):
            pool.set_from_flat_data_page(int(other[i * PS]), sentinel)
        assert s.batch_exists(page_hashes(tokens, "lora-b")[:2], none) == 0
        assert s.batch_get_v1(page_hashes(tokens, "lora-b")[:2], other, none) == [False, False]
        acme = HiCacheStorageExtraInfo(prefix_keys=None, extra_info={"quillcache_tenant": "acme"})
        assert s.batch_exists(keys[:2], acme) == 0
        assert s.batch_get_v1(keys[:2], other, acme) == [False, False]
        t = backend(node, tenant="other", via=via, pool=pool)
        try:
            assert t.batch_get_v1(keys[:2], other, none) == [False, False]
        finally:
            t.close()
        for i in range(2):
            assert torch.equal(pool.get_data_page(int(other[i * PS])), sentinel), "a miss wrote into the host pool"

        # SGLang's storage metrics collector gets its own type
        m = s.get_stats()
        assert m.prefetch_pgs == [4, 2] and m.backup_pgs == [4, 2] and all(b > 0 for b in m.prefetch_bandwidth)
        assert s.get_stats().prefetch_pgs == []

        # the node gone: misses and False, never an exception into SGLang's storage threads
        node.stop()
        assert s.batch_exists(keys, none) == 0
        assert s.batch_get_v1(keys[:2], dst[:2 * PS], none) == [False, False]
        assert s.batch_set_v1(keys[:2], src[:2 * PS], none) == [False, False]
        st = s.stats()
        assert st["load_errors"] >= 1 and st["save_errors"] >= 1 and st["lookup_errors"] >= 1
        # bad input is a clear error
        with pytest.raises(ValueError, match="host indices"):
            s.batch_get_v1(keys[:2], dst[:PS], none)
    finally:
        s.close()


# ---------------------------------------------------------------------- docs/engines.md, auth on

@pytest.fixture
def auth_node(tmp_path):
    with EngineNode(tmp_path) as d:
        yield d


def doc_backend(node, via, token_file, pool):
    """The backend exactly as docs/engines.md's command line configures it (its JSON, with this
    node's address and token file), built by SGLang's factory, then attached to the host pool."""
    (j, *_) = engines_doc.doc_json("quillcache.connectors.sglang")
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config=engines_doc.for_node(j, node.addresses[via], str(token_file)))
    s = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    s.register_mem_pool_host(pool)
    s.on_host_pools_registered()
    return s


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_following_the_doc_with_auth_on_the_second_request_hits(auth_node, via):
    pool = host_pool("page_first")
    first = doc_backend(auth_node, via, auth_node.token_file, pool)
    g = torch.Generator().manual_seed(9)
    keys = page_hashes(range(3000, 3000 + 3 * PS), None)
    src = pool.alloc(3 * PS)
    for i in range(3):
        pool.set_from_flat_data_page(int(src[i * PS]), torch.randn(2 * LAYERS * PS * KVH * HD, generator=g)
                                     .to(torch.bfloat16))
    none = HiCacheStorageExtraInfo(prefix_keys=None)
    try:
        assert first.batch_exists(keys, none) == 0                      # the first request: nothing yet
        assert all(first.batch_set_v1(keys, src, none))                 # its pages backed up
        assert first.stats()["connect_errors"] == 0 and first.core.shm == (via == "unix")
    finally:
        first.close()
    second = doc_backend(auth_node, via, auth_node.token_file, pool)  # the engine restarted: host tier empty
    try:
        assert second.batch_exists(keys, none) == 3
        dst = pool.alloc(3 * PS)
        assert second.batch_get_v1(keys, dst, none) == [True] * 3
        for i in range(3):
            assert torch.equal(page_bytes(pool, dst[i * PS]), page_bytes(pool, src[i * PS])), f"page {i}"
        st = second.stats()
        assert st["hit_blocks"] == 3 and st["loaded_blocks"] == 3 and st["connect_errors"] == 0
    finally:
        second.close()


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_wrong_token_is_one_logged_error_and_every_page_misses(auth_node, via, caplog):
    pool = host_pool("page_first")
    keys = page_hashes(range(4000, 4000 + 2 * PS), None)
    none = HiCacheStorageExtraInfo(prefix_keys=None)
    with caplog.at_level(logging.ERROR, logger="quillcache.connectors"):
        s = doc_backend(auth_node, via, auth_node.wrong_token_file, pool)
        try:
            src = pool.alloc(2 * PS)
            assert s.batch_set_v1(keys, src, none) == [False, False]
            assert s.batch_exists(keys, none) == 0
            assert s.batch_get_v1(keys, pool.alloc(2 * PS), none) == [False, False]
            st = s.stats()
            assert st["connect_errors"] >= 3 and st["save_errors"] == 1 and st["lookup_errors"] == 1
        finally:
            s.close()
    errors = [r.getMessage() for r in caplog.records if r.name == "quillcache.connectors"]
    assert len(errors) == 1, errors
    assert errors[0].startswith("SGLang tp0 connector: cannot use the node")
    assert auth_node.addresses[via] in errors[0] and "token matches no tenant" in errors[0]


def test_the_docs_launch_line_parses_with_sglangs_own_server_args():
    import argparse
    (server_args,) = engines.import_sglang("sglang.srt.server_args")
    argv = engines_doc.engine_command("sglang")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert ns.enable_hierarchical_cache is True and ns.hicache_storage_backend == "dynamic"
    (doc, *_) = engines_doc.doc_json("quillcache.connectors.sglang")
    assert json.loads(ns.hicache_storage_backend_extra_config) == doc
