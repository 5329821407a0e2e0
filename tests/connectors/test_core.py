"""connectors/core.py against a real quillcached, over TCP and over the Unix socket with the
mapped arena: identity mapping, batched exists/load/save, and failures as counted misses."""
from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest

from quillcache.connectors.core import (
    ConnectorCore, chain_keys, hash_hex, model_scope, tenant_from_args, tenant_from_salt,
)
from quillcache import Client
from quillcache.connectors import core as core_mod
from quillcache.model import IdentityScope
from tests._support.daemon import Daemon
from tests._support.engine_node import ENGINE_TENANT, EngineNode

BLOCK = 64 * 1024            # bytes per block in these tests


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("conn")) as d:
        yield d


def addresses(node):
    return {"tcp": node.addr, "unix": f"unix:{node.data_dir / 'quillcached.sock'}"}


def ident(adapter=None, tenant="") -> IdentityScope:
    scope = model_scope("llama", dtype="bf16", block_size=16, num_layers=2, layout="vllm-nhd")
    return IdentityScope(scope, "llama-tok", adapter, tenant)


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


@pytest.fixture(scope="module")
def auth_node(tmp_path_factory):
    with EngineNode(tmp_path_factory.mktemp("conn-auth")) as d:
        yield d


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_a_wrong_token_is_logged_once_with_the_address_counted_and_every_call_misses(auth_node, via, caplog):
    where = auth_node.addresses[via]
    keys = chain_keys(ident(tenant=ENGINE_TENANT), [bytes([0xC0 + i]) * 32 for i in range(2)], block_size=16)
    with caplog.at_level(logging.ERROR, logger="quillcache.connectors"):
        core = ConnectorCore(where, token="not-the-token", timeout=5.0)
        try:
            assert core.save(keys, blocks(2, 11)) is False
            assert core.lookup(keys) == 0
            s = core.stats()
            assert s["connect_errors"] >= 2 and s["save_errors"] == 1 and s["lookup_errors"] == 1
            assert s["reconnects"] == 0 and core.connected_to is None
        finally:
            core.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors                          # one error per outage, not one per call
    assert where in errors[0] and "token matches no tenant" in errors[0]
    assert "not-the-token" not in errors[0] and "not-the-token" not in repr(core)


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_the_right_token_saves_then_hits_and_over_unix_maps_the_arena(auth_node, via):
    core = ConnectorCore(auth_node.addresses[via], token=auth_node.token, timeout=5.0)
    try:
        keys = chain_keys(ident(tenant=ENGINE_TENANT), [bytes([0xD0 + i, len(via)]) * 16 for i in range(3)],
                          block_size=16)
        data = blocks(3, 12)
        assert core.lookup(keys) == 0
        assert core.save(keys, data)
        assert core.lookup(keys) == 3
        back = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert core.load(keys, back) == 3 and all((a == b).all() for a, b in zip(back, data))
        assert core.shm is (via == "unix")
        s = core.stats()
        assert s["connect_errors"] == 0 and s["hit_blocks"] == 3 and core.connected_to == auth_node.addresses[via]
    finally:
        core.close()


def test_no_address_tries_the_default_unix_socket_then_tcp(node, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(core_mod, "DEFAULT_UNIX_SOCKET", str(tmp_path / "absent.sock"))
    monkeypatch.setattr(core_mod, "DEFAULT_ADDRESS", node.addr)
    assert core_mod.default_addresses() == [f"unix:{tmp_path / 'absent.sock'}", node.addr]
    core = ConnectorCore(None, timeout=5.0)
    try:
        keys = chain_keys(ident(tenant="defaults"), [b"\xee" * 32], block_size=16)
        assert core.save(keys, blocks(1, 13)) and core.lookup(keys) == 1
        assert core.connected_to == node.addr and core.stats()["connect_errors"] == 0
    finally:
        core.close()
    # with the default socket present, it is the one used (and the arena is mapped)
    monkeypatch.setattr(core_mod, "DEFAULT_UNIX_SOCKET", str(node.data_dir / "quillcached.sock"))
    core = ConnectorCore(None, timeout=5.0)
    try:
        assert core.lookup(keys) == 1 and core.shm
        assert core.connected_to == f"unix:{node.data_dir / 'quillcached.sock'}"
    finally:
        core.close()


def test_the_connectors_defaults_are_the_nodes_own():
    from quillcache.net import DEFAULT_ADDRESS, DEFAULT_UNIX_SOCKET
    from quillcache.node.settings import SETTINGS
    listen = next(s for s in SETTINGS if (s.section, s.name) == ("node", "listen"))
    assert listen.default == DEFAULT_ADDRESS
    assert core_mod.default_addresses() == [f"unix:{DEFAULT_UNIX_SOCKET}", DEFAULT_ADDRESS]


def test_nothing_listening_is_one_error_naming_every_address_tried(tmp_path, caplog):
    from tests._support.net import free_port
    where = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.ERROR, logger="quillcache.connectors"):
        core = ConnectorCore(where, timeout=1.0)
        try:
            assert core.lookup(chain_keys(ident(), [b"\x01" * 32], block_size=16)) == 0
            assert core.stats()["connect_errors"] >= 1
        finally:
            core.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and where in errors[0] and "cannot connect" in errors[0]


@pytest.mark.parametrize("via,opcode", [("unix", "GET_LOCATED"), ("tcp", "GET_MANY")])
def test_the_counters_docs_engines_md_names_move_on_the_first_hit(auth_node, via, opcode):
    """docs/engines.md, "Check it works": INFO's dram_hits and puts, mapped_connections over the
    Unix socket, failed_hellos at 0, and the request counter of the load's opcode on /metrics."""
    import urllib.request

    from tests._support.engines_doc import DOC
    doc = DOC.read_text()
    for name in ("`dram_hits`", "`puts`", "`mapped_connections`", "`failed_hellos`",
                 'quillcache_tier_hits_total{tier="dram"}', f'opcode="{opcode}"'):
        assert name in doc, name

    def node_stats():
        with Client(auth_node.addr, token=auth_node.token) as c:
            return c.stats()

    def opcode_count() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{auth_node.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(rf'^quillcache_requests_total{{opcode="{opcode}",status="OK"}} ([0-9.]+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before, ops_before = node_stats(), opcode_count()
    core = ConnectorCore(auth_node.addresses[via], token=auth_node.token)
    try:
        keys = chain_keys(ident(tenant=ENGINE_TENANT), [bytes([0xF0 + i, ord(via[0])]) * 16 for i in range(3)],
                          block_size=16)
        assert core.save(keys, blocks(3, 21)) and core.lookup(keys) == 3
        assert core.load(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]) == 3
        after = node_stats()
        assert after["server"]["mapped_connections"] == (1 if via == "unix" else 0)
    finally:
        core.close()
    assert after["store"]["puts"] - before["store"]["puts"] == 3
    assert after["tiers"]["dram_hits"] - before["tiers"]["dram_hits"] == 3
    assert after["auth"]["failed_hellos"] == before["auth"]["failed_hellos"]
    assert opcode_count() == ops_before + 1


def test_a_failing_adapter_call_is_counted_every_time_and_logged_once_an_interval(node, caplog):
    """call_async (the paged worker's path) used to count a node's refusal and drop the
    connection without a word; on the GPU machine that hid why every save of a 512-block
    request failed.  Now the first failure says what failed, the next ones within
    CALL_LOG_INTERVAL_S only count, and the connection comes back for the next call."""
    core = ConnectorCore(node.addr, timeout=5.0)
    try:
        keys = chain_keys(ident(), [bytes([i]) * 32 for i in range(3)], block_size=16)

        def refused(c):
            return c.remove_many([b""])                 # a key the client refuses: InvalidArgument

        with caplog.at_level(logging.WARNING, logger="quillcache.connectors"):
            for _ in range(3):
                assert core.call_async(refused, what="save", default=False).result() is False
        lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert len(lines) == 1 and "a save failed" in lines[0] and "InvalidArgument" in lines[0], lines
        assert core.stats()["save_errors"] == 3
        assert core.call_async(lambda c: c.exists_many(keys), what="load").result()[0] == 0     # reconnected
    finally:
        core.close()


def test_the_connection_polls_for_replies_as_configured_and_stats_say_so(node):
    keys = chain_keys(ident(), [f"spin-h{i}".encode() for i in range(4)], block_size=16)
    src = blocks(4, 7)
    polling, sleeping = ConnectorCore(node.addr), ConnectorCore(node.addr, spin_us=0)
    try:
        for core in (polling, sleeping):
            assert core.save(keys, src)
            for _ in range(20):
                assert core.lookup(keys) == 4
        if (os.cpu_count() or 1) > 1:      # a one-CPU machine never polls
            # A reply is caught only if it comes within the spin window, which a loaded machine
            # (the whole suite on two cores) can miss for a burst of lookups: ask more, up to a
            # bound, until five were caught.  A client that never polls catches none in 500.
            for _ in range(500):
                if polling.stats()["receive_polls_caught"] >= 5:
                    break
                assert polling.lookup(keys) == 4
            assert polling.stats()["receive_polls_caught"] >= 5
        assert sleeping.stats()["receive_polls_caught"] == sleeping.stats()["receive_polls_missed"] == 0
    finally:
        polling.close()
        sleeping.close()
