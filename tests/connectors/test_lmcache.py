"""The LMCache remote storage plugin, built LMCache's documented way (``remote_url:
"plugin://quillcache"``, ``remote_storage_plugins``, ``extra_config`` module_path/class_name,
through ``CreateConnector`` and its ``DynamicConnectorAdapter``) with a real ``LocalCPUBackend``
allocating real CPU ``TensorMemoryObj``s, its coroutines run on an event loop thread as
LMCache's ``RemoteBackend`` runs them, against a real quillcached.  Tested against lmcache 0.5.6."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from tests._support import engines, engines_doc
from tests._support.daemon import Daemon
from tests._support.engine_node import EngineNode

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("lmcache")

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

CHUNK, LAYERS, KVH, HD = 16, 2, 2, 8


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(5)
    lp.close()


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(15)


def engine_config(node, tenant):
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, remote_serde="naive",
        remote_url="plugin://quillcache", remote_storage_plugins=["quillcache"],
        extra_config={"remote_storage_plugin.quillcache.module_path": "quillcache.connectors.lmcache",
                      "remote_storage_plugin.quillcache.class_name": "QuillCacheRemoteConnector",
                      "remote_storage_plugin.quillcache.address": f"unix:{node.data_dir / 'quillcached.sock'}",
                      "remote_storage_plugin.quillcache.tenant": tenant,
                      "remote_storage_plugin.quillcache.timeout_s": 2})


def plugin(node, loop, *, tenant="acme", address=None):
    cfg = engine_config(node, tenant)
    if address is not None:
        cfg.extra_config["remote_storage_plugin.quillcache.address"] = address
    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (LAYERS, 2, CHUNK, KVH, HD), chunk_size=CHUNK)
    cpu = LocalCPUBackend(cfg, md)
    return CreateConnector("plugin://quillcache", loop, cpu, cfg, None, plugin_name="quillcache"), cpu, md


def chunk(cpu, md, seed, tokens=CHUNK):
    shapes = [torch.Size([2, LAYERS, tokens, KVH * HD])]
    obj = cpu.allocate(shapes, md.get_dtypes())
    obj.tensor.copy_(torch.randn(shapes[0], generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
    return obj


def put(loop, conn, key, obj):
    """As RemoteBackend does: its serializer takes a reference, LMCache's wrapper of the plugin
    drops it when put returns; the plugin's own reference is gone once the bytes are sent."""
    obj.ref_count_up()
    run(loop, conn.put(key, obj))
    assert obj.get_ref_count() == 1


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_lmcache_plugin_round_trips_chunks_byte_for_byte_and_scopes_tenants(node, loop, transport):
    from quillcache.connectors.lmcache import QuillCacheRemoteConnector
    conn, cpu, md = plugin(node, loop, address=node.addr if transport == "tcp" else None)
    try:
        assert isinstance(conn._connector, QuillCacheRemoteConnector)      # built by LMCache's adapter
        key = CacheEngineKey("m", 1, 0, 12345, torch.bfloat16)
        assert not conn.exists_sync(key) and run(loop, conn.get(key)) is None
        a = chunk(cpu, md, 1)
        put(loop, conn, key, a)
        assert conn.exists_sync(key) and run(loop, conn.exists(key))
        b = run(loop, conn.get(key))
        assert b is not None and b is not a
        assert bytes(b.byte_array) == bytes(a.byte_array)
        assert (b.get_shapes(), b.get_dtypes(), b.get_memory_format()) == \
            (a.get_shapes(), a.get_dtypes(), a.get_memory_format())
        b.ref_count_down()

        # batched: a full chunk, a partial last chunk (5 tokens), then an absent one
        keys = [CacheEngineKey("m", 1, 0, h, torch.bfloat16) for h in (1, 2, 3)]
        objs = [chunk(cpu, md, 2), chunk(cpu, md, 3, tokens=5)]
        for o in objs:
            o.ref_count_up()
        run(loop, conn.batched_put(keys[:2], objs))
        assert [o.get_ref_count() for o in objs] == [1, 1]
        assert run(loop, conn.batched_async_contains("L1", keys)) == 2 == conn.batched_contains(keys)
        got = run(loop, conn.batched_get(keys))
        assert got[2] is None
        for g, o in zip(got[:2], objs):
            assert g.get_shapes() == o.get_shapes() and bytes(g.byte_array) == bytes(o.byte_array)
            g.ref_count_down()
        leading = run(loop, conn.batched_get_non_blocking("L2", keys[1:]))     # the present prefix only
        assert [bytes(g.byte_array) for g in leading] == [bytes(objs[1].byte_array)]
        leading[0].ref_count_down()
        assert f"m@1@0@{key.chunk_hash_hex}@bfloat16" in run(loop, conn.list())

        # the same chunk hash under another tenant, adapter or worker is a miss, like an absent key
        for other in (CacheEngineKey("m", 1, 0, 12345, torch.bfloat16, {"lmcache.tag.quillcache_tenant": "other"}),
                      CacheEngineKey("m", 1, 0, 12345, torch.bfloat16, {"lmcache.tag.quillcache_adapter": "lora-b"}),
                      CacheEngineKey("m", 2, 1, 12345, torch.bfloat16),
                      CacheEngineKey("m", 1, 0, 12345, torch.float16)):
            assert (conn.exists_sync(other), run(loop, conn.exists(other)), run(loop, conn.get(other))) == \
                (False, False, None)
        # another engine configured for tenant "other" does not see acme's chunk either
        conn2, _, _ = plugin(node, loop, tenant="other")
        try:
            assert not conn2.exists_sync(key) and run(loop, conn2.get(key)) is None
        finally:
            run(loop, conn2.close())
        for o in [a, *objs]:
            o.ref_count_down()
    finally:
        run(loop, conn.close())


def test_lmcache_plugin_dead_node_is_a_miss_not_an_exception(node, loop):
    conn, cpu, md = plugin(node, loop)
    try:
        key = CacheEngineKey("m", 1, 0, 12345, torch.bfloat16)
        a = chunk(cpu, md, 1)
        put(loop, conn, key, a)
        assert conn.exists_sync(key)
        node.stop()
        assert run(loop, conn.get(key)) is None
        assert run(loop, conn.batched_get([key])) == [None]
        assert not conn.exists_sync(key) and not run(loop, conn.exists(key))
        put(loop, conn, CacheEngineKey("m", 1, 0, 777, torch.bfloat16), a)     # stores nothing, raises nothing
        stats = conn._connector.stats()
        assert stats["load_errors"] >= 2 and stats["lookup_errors"] >= 2 and stats["save_errors"] == 1
        a.ref_count_down()
    finally:
        run(loop, conn.close())


def test_lmcache_remote_backend_stores_and_retrieves_through_the_plugin(node, loop):
    """LMCache's own RemoteBackend (plugin_name set, as its storage manager builds it) saves and
    retrieves a chunk through the plugin, and a second tenant's backend misses it."""
    cfg = engine_config(node, "acme")
    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (LAYERS, 2, CHUNK, KVH, HD), chunk_size=CHUNK)
    cpu = LocalCPUBackend(cfg, md)
    rb = RemoteBackend(cfg, md, loop, cpu, "cpu", plugin_name="quillcache")
    other = RemoteBackend(engine_config(node, "other"), md, loop, cpu, "cpu", plugin_name="quillcache")
    try:
        key = CacheEngineKey("m", 1, 0, 4242, torch.bfloat16)
        a = chunk(cpu, md, 9)
        rb.submit_put_task(key, a).result(10)
        assert a.get_ref_count() == 1                      # every reference the put took is back
        assert rb.contains(key) and not other.contains(key)
        b = rb.get_blocking(key)
        assert b is not None and bytes(b.byte_array) == bytes(a.byte_array)
        assert other.get_blocking(key) is None
        got = rb.batched_get_blocking([key, CacheEngineKey("m", 1, 0, 4243, torch.bfloat16)])
        assert got[1] is None and bytes(got[0].byte_array) == bytes(a.byte_array)
        for o in (a, b, got[0]):
            o.ref_count_down()
    finally:
        rb.close()
        other.close()


def test_lmcache_plugin_value_that_does_not_decode_is_a_counted_miss(node, loop):
    from quillcache import Client
    conn, cpu, md = plugin(node, loop)
    try:
        qc = conn._connector
        key, cut = (CacheEngineKey("m", 1, 0, h, torch.bfloat16) for h in (99, 100))
        a = chunk(cpu, md, 4)
        put(loop, conn, cut, a)
        with Client(node.addr) as c:
            whole = c.get(qc.block_key(cut))
            c.put(qc.block_key(key), b"not an LMCache chunk")            # foreign bytes under the key
            c.put(qc.block_key(cut), whole[:-2])                         # a value cut short
        assert conn.exists_sync(key) and run(loop, conn.get(key)) is None
        assert run(loop, conn.batched_get([cut, key])) == [None, None]
        assert qc.stats()["bad_values"] == 2
        a.ref_count_down()
    finally:
        run(loop, conn.close())


# ---------------------------------------------------------------------- docs/engines.md, auth on

@pytest.fixture
def auth_node(tmp_path):
    with EngineNode(tmp_path) as d:
        yield d


def doc_plugin(node, loop, via, token_file, tmp_path):
    """The plugin exactly as docs/engines.md configures it: its YAML (this node's address and
    token file) written to a file and loaded by LMCache's own config loader, as
    LMCACHE_CONFIG_FILE makes vLLM's LMCache connector do; only the local CPU size is this
    machine's.  Built by LMCache's CreateConnector, as its RemoteBackend builds it."""
    text = engines_doc.lmcache_yaml().replace(engines_doc.DOC_ADDRESS, node.addresses[via])
    text = text.replace(engines_doc.DOC_TOKEN_FILE, str(token_file))
    path = tmp_path / f"lmcache-{via}.yaml"
    path.write_text(text)
    cfg = LMCacheEngineConfig.from_file(str(path))
    assert cfg.remote_url == "plugin://quillcache" and cfg.remote_storage_plugins == ["quillcache"]
    cfg.max_local_cpu_size = 0.05
    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (LAYERS, 2, CHUNK, KVH, HD), chunk_size=CHUNK)
    cpu = LocalCPUBackend(cfg, md)
    return CreateConnector(cfg.remote_url, loop, cpu, cfg, None, plugin_name="quillcache"), cpu, md


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_following_the_doc_with_auth_on_the_second_request_hits(auth_node, loop, via, tmp_path):
    conn, cpu, md = doc_plugin(auth_node, loop, via, auth_node.token_file, tmp_path)
    key = CacheEngineKey("m", 1, 0, 98765, torch.bfloat16, {"lmcache.tag.quillcache_tenant": "acme"})
    a = chunk(cpu, md, 4)
    try:
        assert not run(loop, conn.exists(key))                  # the first request: a miss, then saved
        put(loop, conn, key, a)
    finally:
        run(loop, conn.close())
    again, cpu2, _ = doc_plugin(auth_node, loop, via, auth_node.token_file, tmp_path)   # another vLLM process
    try:
        assert again.batched_contains([key]) == 1
        got = run(loop, again.get(key))
        assert got is not None and bytes(got.byte_array) == bytes(a.byte_array)
        got.ref_count_down()
        st = again._connector.stats()
        assert st["hit_blocks"] == 1 and st["loaded_blocks"] == 1 and st["connect_errors"] == 0
        assert again._connector.core.connected_to == auth_node.addresses[via]
    finally:
        a.ref_count_down()
        run(loop, again.close())


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_wrong_token_is_one_logged_error_and_every_chunk_misses(auth_node, loop, via, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="quillcache.connectors"):
        conn, cpu, md = doc_plugin(auth_node, loop, via, auth_node.wrong_token_file, tmp_path)
        key = CacheEngineKey("m", 1, 0, 5555, torch.bfloat16)
        a = chunk(cpu, md, 5)
        try:
            put(loop, conn, key, a)                                # stores nothing, raises nothing
            assert not run(loop, conn.exists(key)) and run(loop, conn.get(key)) is None
            st = conn._connector.stats()
            assert st["connect_errors"] >= 3 and st["save_errors"] == 1 and st["hit_blocks"] == 0
        finally:
            a.ref_count_down()
            run(loop, conn.close())
    errors = [r.getMessage() for r in caplog.records if r.name == "quillcache.connectors"]
    assert len(errors) == 1, errors
    assert errors[0].startswith("LMCache plugin quillcache connector: cannot use the node")
    assert auth_node.addresses[via] in errors[0] and "token matches no tenant" in errors[0]
