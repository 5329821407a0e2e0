"""connectors/core.py against a real quillcached, over TCP and over the Unix socket with the
mapped arena: identity mapping, batched exists/load/save, and failures as counted misses."""
from __future__ import annotations

import numpy as np
import pytest

from quillcache.connectors.core import (
    ConnectorCore, Identity, chain_keys, hash_hex, model_scope, tenant_from_args, tenant_from_salt,
)
from tests._support.daemon import Daemon

BLOCK = 64 * 1024            # bytes per block in these tests


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("conn")) as d:
        yield d


def addresses(node):
    return {"tcp": node.addr, "unix": f"unix:{node.data_dir / 'quillcached.sock'}"}


def ident(adapter=None, tenant="") -> Identity:
    scope = model_scope("llama", dtype="bf16", block_size=16, num_layers=2, layout="vllm-nhd")
    return Identity(scope, "llama-tok", adapter, tenant)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def test_identity_mapping_chains_parent_hashes_and_scopes_layout():
    hs = [bytes([i]) * 32 for i in range(3)]
    keys = chain_keys(ident("lora-a", "acme"), hs, block_size=16)
    assert [k.prefix_hash for k in keys] == ["", hs[0].hex(), hs[1].hex()]
    assert [k.block_hash for k in keys] == [h.hex() for h in hs]
    assert [k.block_index for k in keys] == [0, 1, 2]
    assert keys[0].adapter_id == "lora-a" and keys[0].tenant_id == "acme"
    assert "tp0of1" in keys[0].model_id and "bs16" in keys[0].model_id and "bf16" in keys[0].model_id
    other = model_scope("llama", dtype="bf16", block_size=16, num_layers=2, layout="vllm-nhd", tp_rank=1, tp_size=2)
    assert other != keys[0].model_id
    assert hash_hex(255) == "ff" and hash_hex("abc") == "abc"
    assert tenant_from_salt("tenant=acme;x") == "acme" and tenant_from_salt("random-salt", "eng") == "eng"
    assert tenant_from_args({"quillcache_tenant": "t9"}) == "t9" and tenant_from_args(None) == ""


@pytest.mark.parametrize("path", ["tcp", "unix"])
def test_save_then_lookup_and_load_round_trip_the_bytes(node, path):
    core = ConnectorCore(addresses(node)[path])
    try:
        assert core.shm == (path == "unix")
        hs = [f"{path}-h{i}".encode() for i in range(6)]
        keys = chain_keys(ident(), hs, block_size=16)
        src = blocks(6, 1)
        assert core.lookup(keys) == 0
        assert core.save(keys[:4], src[:4])                 # only 4 of 6 saved
        assert core.lookup(keys) == 4
        dst = [np.zeros(BLOCK, np.uint8) for _ in range(6)]
        assert core.wait(core.load_async(keys, dst)) == 4   # the present prefix, then the miss
        for a, b in zip(src[:4], dst[:4]):
            assert np.array_equal(a, b)
        assert not dst[4].any()
        # another adapter or tenant: same engine hashes, no hit
        assert core.lookup(chain_keys(ident("lora-b"), hs, block_size=16)) == 0
        assert core.lookup(chain_keys(ident(None, "other"), hs, block_size=16)) == 0
        s = core.stats()
        assert s["saved_blocks"] == 4 and s["loaded_blocks"] == 4 and s["load_errors"] == 0
    finally:
        core.close()


def test_a_dead_node_is_a_counted_miss_not_an_exception(tmp_path):
    d = Daemon(tmp_path).start()
    core = ConnectorCore(d.addr, timeout=2.0)
    try:
        keys = chain_keys(ident(), [b"x" * 32, b"y" * 32], block_size=16)
        assert core.save(keys, blocks(2, 3))
        assert core.lookup(keys) == 2
        d.stop()
        assert core.lookup(keys) == 0
        assert core.load(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]) == 0
        assert core.save(keys, blocks(2, 4)) is False
        s = core.stats()
        assert s["lookup_errors"] >= 1 and s["load_errors"] == 1 and s["save_errors"] == 1
    finally:
        core.close()
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_parts_are_stored_as_one_value_and_fetch_stops_at_the_first_miss(node, via):
    core = ConnectorCore(addresses(node)[via], timeout=5.0)
    try:
        keys = chain_keys(ident(tenant=f"parts-{via}"), [bytes([0xA0 + i]) * 32 for i in range(3)], block_size=16)
        head, (a, b) = b"HDR!", blocks(2, 7)
        assert core.save(keys[:2], [(head, a), (head, b[:100])])      # two sizes, header + payload
        seen = []

        def take(i, view):
            seen.append(bytes(view))
            return True

        assert core.fetch_async(keys, take).result(10) == 2
        assert seen == [head + a.tobytes(), head + b[:100].tobytes()]
        assert core.fetch_async(keys, lambda i, v: i == 0).result(10) == 1     # take refuses: stops
    finally:
        core.close()
