"""Bytes between nodes on NIXL, in a pool of real quillcached processes on one real etcd: one-sided
reads from the holder's arena (GRANT, READ, GRANT_RELEASE), under the default UCX transports
(shared memory / CMA on one host) and under ``UCX_TLS=tcp`` (as between hosts); the fault tests
run on the TCP transport too.  Faults cost misses, never wrong bytes.

Skipped, with one line saying so, where NIXL or etcd is not installed (``make test`` installs NIXL).
"""
from __future__ import annotations

import signal
import time

import pytest

from quillcache import Client
from quillcache._native.crc import crc32c
from quillcache.errors import NotFound, PermissionDenied
from quillcache.model import encode_key
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.protocol import cluster as wire
from quillcache.protocol import grants as gw
from quillcache.protocol.opcodes import Opcode
from quillcache.settings.convert import hash_token
from quillcache.transfer.nixl import nixl_missing
from tests._support.cluster import Load, Pool, content, get_retry, key, member, member_ids, unix_addr
from tests._support.etcd import etcd_binary

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)"),
    pytest.mark.skipif(nixl_missing() is not None, reason=f"NIXL pool tests skipped: {nixl_missing()}"),
]

TTL_S = 2.0
ON_NIXL = [pytest.param("default", id="nixl-default"), pytest.param("tcp", id="nixl-ucx-tcp")]
EVERY = [pytest.param(("tcp", None), id="tcp"), pytest.param(("nixl", "default"), id="nixl-default"),
         pytest.param(("nixl", "tcp"), id="nixl-ucx-tcp")]


def _tls(monkeypatch, tls) -> None:
    """The daemons inherit this process's environment: UCX_TLS unset means UCX's default transports."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    if tls not in (None, "default"):
        monkeypatch.setenv("UCX_TLS", tls)


def _cluster(letter_info: dict) -> dict:
    return letter_info["Cluster"]


def _warm(pool, reader: str, k, holders: int = 1, timeout: float = 10.0) -> None:
    """Read ``k`` at ``reader`` (the first read of a holder goes over FETCH while its agent is
    learnt in the background), then wait until ``holders`` agents are known there."""
    with Client(pool[reader].addr) as c:
        get_retry(c, k)
    deadline = time.monotonic() + timeout
    while _cluster(pool.info(reader))["transport_nixl_peers"] < holders:
        assert time.monotonic() < deadline, f"{reader} never learnt its peers' NIXL agents"
        time.sleep(0.02)


def _released(pool, letter: str, timeout: float = 5.0) -> dict:
    """The holder's INFO once no grant is held there any more (readers release a grant when its
    reuse ends)."""
    deadline = time.monotonic() + timeout
    while (info := _cluster(pool.info(letter)))["grants_held"]:
        assert time.monotonic() < deadline, f"grants still held at {letter}: {info}"
        time.sleep(0.05)
    return info


@pytest.mark.parametrize("tls", ON_NIXL)
def test_blocks_cross_byte_for_byte_and_the_holder_sends_none_of_them(tmp_path, etcd, monkeypatch, tls):
    _tls(monkeypatch, tls)
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", transport="nixl") as pool:
        pool.wait_members(3)
        sizes = {0: 4 << 20, 1: 256 << 10, 2: 1, 3: 64 << 10, 4: 4097}
        with Client(pool["a"].addr) as a:
            for i, size in sizes.items():
                a.put(key(i), content(i, size))
            a.put(key(50), b"warm")
        for letter in "bc":
            _warm(pool, letter, key(50))
        served = _cluster(pool.info("a"))["fetches_served"]
        for letter in "bc":
            with Client(pool[letter].addr) as c:
                for i, size in sizes.items():
                    assert get_retry(c, key(i)) == content(i, size)
                got = c.get_many([key(i) for i in sizes] + [key(99)])
                assert got[:-1] == [content(i, size) for i, size in sizes.items()] and got[-1] is None
                with pytest.raises(NotFound):
                    c.get(key(98))
        held = _cluster(pool.info("a"))
        assert held["fetches_served"] == served, "the holder sent bytes itself"
        assert held["granted_blocks"] >= 2 * len(sizes) and held["meta_served"] == 2
        assert held["grant_crcs_computed"] == 0, "a grant summed a block whose CRC the holder keeps"
        held = _released(pool, "a")             # past grant_reuse (0.5 s): the readers released them
        assert held["grant_held_blocks"] == 0
        assert held["grant_releases"] == held["grants"] and held["grants_expired"] == 0
        for letter in "bc":
            info = _cluster(pool.info(letter))
            assert info["transport_transport"] == "nixl" and info["transport_ucx_tls"] == tls
            assert info["transport_nixl_reads"] >= 2 and info["transport_nixl_bytes"] >= 2 * sum(sizes.values())
            assert info["transport_nixl_fallbacks"] == 0 and info["crc_mismatches"] == 0
            assert info["transport_fetches"] == info["transport_nixl_tcp_fetches"] == 1   # the first read
            assert info["transport_nixl_grant_reuses"] >= len(sizes)    # get_many read them again
            assert info["transport_nixl_peers"] == 1


@pytest.mark.parametrize("tls", ON_NIXL)
def test_a_block_read_again_within_grant_reuse_costs_its_holder_no_grant(tmp_path, etcd, monkeypatch, tls):
    """grant_reuse: a reader reads a block it holds a grant on again without asking its holder,
    until the reuse ends, and then releases the grant; with grant_reuse = "0s" every read asks
    GRANT and releases it.  Every read returns the writer's bytes either way."""
    _tls(monkeypatch, tls)
    reads = 5 * 8
    for reuse in ("500ms", "0s"):
        with Pool(tmp_path / reuse, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="nixl",
                  grant_reuse=reuse, cluster_id=f"reuse{reuse[0]}") as pool:
            pool.wait_members(2)
            with Client(pool["a"].addr) as a:
                for i in range(8):
                    a.put(key(i), content(i, 64 << 10))
                a.put(key(50), b"warm")
            _warm(pool, "b", key(50))
            before = _cluster(pool.info("a"))
            with Client(pool["b"].addr) as b:
                for _ in range(5):
                    for i in range(8):
                        assert b.get(key(i)) == content(i, 64 << 10)
            reader = _cluster(pool.info("b"))
            held = _released(pool, "a")
            grants = held["grants"] - before["grants"]
            assert held["fetches_served"] == before["fetches_served"], "the holder sent bytes itself"
            assert held["grant_releases"] == held["grants"] and held["grants_expired"] == 0
            if reuse == "0s":
                assert grants == reads and reader["transport_nixl_grant_reuses"] == 0
            else:
                assert grants + reader["transport_nixl_grant_reuses"] == reads
                assert grants <= reads // 2, f"{grants} GRANTs for {reads} reads of 8 blocks"
            assert reader["transport_nixl_reads"] >= reads and reader["crc_mismatches"] == 0


def test_a_block_replaced_at_its_holder_is_read_as_granted_until_the_reuse_ends(tmp_path, etcd, monkeypatch):
    """What grant_reuse costs, pinned down: within the reuse a reader returns a block as it was
    granted (its writer's bytes, CRC-checked; the grant keeps that slot in place), not the block
    put under the key at the holder since; after the reuse ends it returns the new block."""
    _tls(monkeypatch, "default")
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="nixl", grant_reuse="1s",
              grant_ttl="3s") as pool:
        pool.wait_members(2)
        old, new = content(1, 128 << 10), content(2, 128 << 10)
        with Client(pool["a"].addr) as a, Client(pool["b"].addr) as b:
            a.put(key(50), b"warm")
            _warm(pool, "b", key(50))
            a.put(key(1), old)
            assert get_retry(b, key(1)) == old                  # granted now, read with NIXL
            a.put(key(1), new)
            assert b.get(key(1)) == old, "a read within the reuse returns the block as granted"
            time.sleep(1.1)
            assert get_retry(b, key(1)) == new, "after the reuse the reader asks again"
        reader = _cluster(pool.info("b"))
        assert reader["transport_nixl_grant_reuses"] >= 1 and reader["transport_nixl_reads"] >= 3


@pytest.mark.parametrize("transport", EVERY)
def test_holder_killed_mid_read_costs_misses_never_wrong_bytes(tmp_path, etcd, monkeypatch, transport):
    kind, tls = transport
    _tls(monkeypatch, tls)
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", transport=kind) as pool:
        pool.wait_members(3)
        keys = {i: (1 << 20) if i % 2 else (32 << 10) for i in range(40)}
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        with Client(pool["b"].addr) as b:
            for i in keys:
                get_retry(b, key(i))
        with Load([pool["b"].addr, pool["c"].addr], keys) as load:
            time.sleep(0.5)
            before = load.snapshot()
            pool["a"].send(signal.SIGKILL)
            t_kill = time.monotonic()
            while time.monotonic() - t_kill < TTL_S + 3 and any(
                    "node-a" in member_ids(pool[x].addr) for x in "bc"):
                time.sleep(0.05)
            time.sleep(0.5)
            after = load.snapshot()
        print(f"{kind}/{tls}: kill -9 of the holder under load: (hits, misses, errors, wrong) before {before}, "
              f"after {after}")
        assert after[3] == 0, "a wrong block was served"
        assert before[0] > 0 and after[1] > before[1], "reads hit before and missed after the kill"
        if kind == "nixl":
            assert _cluster(pool.info("b"))["transport_nixl_reads"] > 0


@pytest.mark.parametrize("transport", EVERY)
def test_a_restarted_holder_is_read_again_under_its_new_epoch(tmp_path, etcd, monkeypatch, transport):
    """kill -9 and restart: the reader forgets the old agent with the old epoch and adds the new one
    (NIXL_META again) at its next read; reads meanwhile are hits or misses, never wrong."""
    kind, tls = transport
    _tls(monkeypatch, tls)
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport=kind) as pool:
        pool.wait_members(2)
        keys = dict.fromkeys(range(16), 256 << 10)
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        with Load([pool["b"].addr], keys) as load:
            time.sleep(0.3)
            pool["a"].send(signal.SIGKILL)
            pool["a"].proc.wait()
            pool["a"].start()
            pool.wait_members(2)
            with Client(pool["a"].addr) as a:           # the restarted node's DRAM is empty: put again
                for i, size in keys.items():
                    a.put(key(i), content(i, size))
            with Client(pool["b"].addr) as b:
                for i in keys:
                    assert get_retry(b, key(i), 5.0) == content(i, keys[i])
            time.sleep(0.3)
        counts = load.snapshot()
        print(f"{kind}/{tls}: holder restarted under load: (hits, misses, errors, wrong) {counts}")
        assert counts[3] == 0 and counts[0] > 0
        info = _cluster(pool.info("b"))
        if kind == "nixl":
            assert info["transport_nixl_meta_fetched"] == 2 and info["transport_nixl_peers"] == 1
        else:
            assert info["transport_transport"] == "tcp"


@pytest.mark.parametrize("tls", ON_NIXL)
def test_a_grant_that_ends_before_the_read_is_done_is_a_miss(tmp_path, etcd, monkeypatch, tls):
    """grant_ttl of 1 ms: no READ is done within it, so every block is a miss at the reader (never
    bytes from a slot the holder may have let go), and the holder ends every grant at its ttl."""
    _tls(monkeypatch, tls)
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="nixl", grant_ttl="1ms") as pool:
        pool.wait_members(2)
        with Client(pool["a"].addr) as a:
            for i in range(9):
                a.put(key(i), content(i, 256 << 10))
        _warm(pool, "b", key(8))                    # over FETCH: the agent was not known yet
        with Client(pool["b"].addr) as b:
            for i in range(8):
                with pytest.raises(NotFound):
                    b.get(key(i))
            assert b.get_many([key(i) for i in range(8)]) == [None] * 8
        time.sleep(0.1)
        reader, holder = _cluster(pool.info("b")), _cluster(pool.info("a"))
        assert reader["transport_nixl_late"] >= 16 and reader["remote_hits"] == 1
        assert holder["grants"] >= 2 and holder["grants_held"] == 0
        assert holder["grants_expired"] + holder["grant_releases"] == holder["grants"]


def test_the_holder_keeps_a_granted_slot_until_the_grant_is_released_or_ends(tmp_path, etcd, monkeypatch):
    """A granted block removed and its arena pressed by new puts keeps its bytes in place (the CRC
    the grant named still matches there) until GRANT_RELEASE, or until the grant's ttl ends;
    then its slot is reused like any."""
    _tls(monkeypatch, "default")
    with Pool(tmp_path, etcd.endpoint, 1, dram="8MiB", max_block="1MiB", lease_ttl=f"{TTL_S}s",
              transport="nixl", grant_ttl="600ms") as pool:
        pool.wait_members(1)
        mb = 1 << 20
        with Client(unix_addr(pool["a"])) as c, member(pool["a"].addr, "node-z", peer_id="node-a") as peer:
            arena = c.arena.view

            def grant(i):
                c.put(key(i), content(i, mb))
                r = peer.call(Opcode.GRANT, gw.encode_grant("", [encode_key(key(i))], peer.limits))
                g = gw.decode_grant_reply(r.header, peer.limits)
                (item,) = g.items
                assert item.status == 0 and item.size == mb and item.crc == crc32c(content(i, mb))
                c.remove(key(i))
                return g.grant_id, item

            def press(base):                    # 3x the arena of new blocks: every free slot is reused
                for j in range(24):
                    c.put(key(base + j), content(base + j, mb))

            def still_there(item):
                return crc32c(arena[item.offset:item.offset + item.size]) == item.crc

            released, item_r = grant(1)
            expiring, item_e = grant(2)
            press(100)
            assert still_there(item_r) and still_there(item_e), "a granted slot was reused"
            r = peer.call(Opcode.GRANT_RELEASE, gw.encode_release([released, released], peer.limits))
            assert gw.decode_release_reply(r.header) == 1           # the second one ended already
            time.sleep(0.7)                                         # past the other's ttl
            press(200)
            assert not still_there(item_r) and not still_there(item_e)
        holder = _cluster(pool.info("a"))
        assert holder["grant_releases"] == 1 and holder["grants_expired"] == 1 and holder["grants_held"] == 0


@pytest.mark.parametrize("transport", EVERY)
def test_a_tenants_key_through_another_node_is_exactly_a_miss(tmp_path, etcd, monkeypatch, transport):
    kind, tls = transport
    _tls(monkeypatch, tls)
    tenants = (f'[[auth.tenants]]\nname = "t1"\ntoken = "{hash_token("tok-one")}"\n'
               f'[[auth.tenants]]\nname = "t2"\ntoken = "{hash_token("tok-two")}"\n')
    pool = Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport=kind)
    for d in pool.nodes.values():
        d.config.write_text(d.config.read_text() + tenants)
    pool.token = "tok-one"                      # the views and INFO, as a tenant of these nodes
    with pool:
        pool.wait_members(2)
        with Client(pool["a"].addr, token="tok-one") as a:
            a.put(key(1, "t1"), content(1, 256 << 10))
        with Client(pool["b"].addr, token="tok-one") as b1:
            for _ in range(3):              # the first over FETCH, then over NIXL (once the agent is known)
                assert get_retry(b1, key(1, "t1")) == content(1, 256 << 10)
                time.sleep(0.3)
        with Client(pool["b"].addr, token="tok-two") as b2:
            with pytest.raises(PermissionDenied) as remote_probe:
                b2.get(key(1, "t1"))
            with pytest.raises(PermissionDenied) as absent_probe:
                b2.get(key(2, "t1"))
            assert str(remote_probe.value) == str(absent_probe.value)
            for op, body in ((Opcode.NIXL_META, b""), (Opcode.GRANT_RELEASE, gw.encode_release([1], b2.limits)),
                             (Opcode.GRANT, gw.encode_grant("t1", [encode_key(key(1, "t1"))], b2.limits))):
                with pytest.raises(PermissionDenied):       # a tenant is not a node: no metadata, no grant
                    b2.call(op, body)
        with pytest.raises(PermissionDenied):               # nor is a client without a token
            with Client(pool["a"].addr) as anon:
                anon.call(Opcode.NIXL_META)
        with Client(pool["a"].addr, token=wire.NODE_HELLO_TOKEN) as marker:    # nor the node HELLO alone
            for op, body in ((Opcode.NIXL_META, b""), (Opcode.GRANT_RELEASE, gw.encode_release([1], marker.limits)),
                             (Opcode.GRANT, gw.encode_grant("t1", [encode_key(key(1, "t1"))], marker.limits))):
                with pytest.raises(PermissionDenied, match="log in with NODE_AUTH"):
                    marker.call(op, body)
        if kind == "tcp":
            with member(pool["a"].addr, "node-b", peer_id="node-a") as peer:   # a member, on a node without NIXL
                with pytest.raises(PermissionDenied, match="does not use NIXL"):
                    peer.call(Opcode.NIXL_META)
        if kind == "nixl":
            # a node asking on behalf of t2 is told exactly what an absent key gets, and nothing is held
            with member(pool["a"].addr, "node-b", peer_id="node-a") as peer:
                def grant(tenant, k):
                    r = peer.call(Opcode.GRANT, gw.encode_grant(tenant, [encode_key(k)], peer.limits))
                    return gw.decode_grant_reply(r.header, peer.limits)
                probe, absent = grant("t2", key(1, "t1")), grant("t2", key(2, "t1"))
                assert probe.items == absent.items == [gw.GrantItem(NotFound.status, 0, 0, 0)]
                assert probe.grant_id == absent.grant_id == 0
                assert grant("t1", key(1, "t1")).items[0].status == 0
            assert _cluster(pool.info("b"))["transport_nixl_reads"] >= 1


def test_a_holder_granting_other_bytes_than_its_writer_stored_is_a_miss(tmp_path, etcd, monkeypatch):
    """A holder whose arena holds other bytes than its writer stored (a member gone bad, or its
    memory) grants them; the reader checks what it READ against the CRC the writer recorded
    (LOCATE's) and drops it: a miss, never the substituted bytes."""
    _tls(monkeypatch, "default")
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="nixl") as pool:
        pool.wait_members(2)
        ring = Ring(["node-a", "node-b"])
        i = next(i for i in range(1000) if ring.home(key_hash(encode_key(key(i)))) == "node-b")
        k, ek, size = key(i), encode_key(key(i)), 256 << 10
        real, fake = content(i, size), content(i + 1, size)
        with Client(unix_addr(pool["a"])) as a:
            a.put(key(5000), b"warm")
            a.put(k, real)
            _warm(pool, "b", key(5000))
            with member(pool["b"].addr, "node-z", peer_id="node-b") as home:
                deadline = time.monotonic() + 5
                while True:                 # node-a announced it, with its writer's CRC, to its home
                    found = wire.decode_locate_reply(
                        home.call(Opcode.LOCATE, wire.encode_locate([ek], home.limits)).header, home.limits)[0]
                    if found:
                        break
                    assert time.monotonic() < deadline, "node-a never announced the block"
                    time.sleep(0.05)
                assert found[0].node_id == "node-a" and found[0].crc == crc32c(real)
            with member(pool["a"].addr, "node-z", peer_id="node-a") as peer:     # where it lies in the arena
                g = gw.decode_grant_reply(
                    peer.call(Opcode.GRANT, gw.encode_grant("", [ek], peer.limits)).header, peer.limits)
                (item,) = g.items
                peer.call(Opcode.GRANT_RELEASE, gw.encode_release([g.grant_id], peer.limits))
            assert item.status == 0 and item.size == size
            a.arena.view[item.offset:item.offset + size] = fake        # the holder's bytes are not the writer's
        before = _cluster(pool.info("b"))
        with Client(pool["b"].addr) as b:
            with pytest.raises(NotFound):
                b.get(k)
        after = _cluster(pool.info("b"))
        assert after["transport_nixl_reads"] > before["transport_nixl_reads"], "the block was not read with NIXL"
        assert after["crc_mismatches"] >= before["crc_mismatches"] + 1, "the writer's CRC caught it"


BROKEN_NIXL = "raise ImportError('libucp.so.0: cannot open shared object file (a broken NIXL install)')\n"


def _break_nixl(tmp_path, daemon) -> None:
    """Give ``daemon`` a NIXL that cannot load, as a broken install would be (its module raises
    ImportError), ahead of the real one on its PYTHONPATH."""
    shim = tmp_path / "broken-nixl"
    (shim / "nixl_cu12").mkdir(parents=True, exist_ok=True)
    (shim / "nixl_cu12" / "__init__.py").write_text(BROKEN_NIXL)
    daemon.env["PYTHONPATH"] = f"{shim}:{daemon.env.get('PYTHONPATH', '')}"


def test_transport_nixl_that_cannot_load_exits_78_saying_how_to_install(tmp_path, etcd):
    pool = Pool(tmp_path, etcd.endpoint, 1, transport="nixl")
    d = pool["a"]
    _break_nixl(tmp_path, d)
    d.start(wait=False)
    assert d.proc.wait(60) == 78
    log = d.log()
    assert "[cluster] transport = \"nixl\"" in log and "pip install --no-deps 'nixl-cu12" in log, log[-2000:]


def test_auto_reads_a_holder_without_nixl_over_tcp_and_says_so(tmp_path, etcd, monkeypatch):
    """auto: a node whose NIXL cannot load runs on TCP; a NIXL node reads it over FETCH (its
    NIXL_META is refused) and shows it in INFO; both directions hit."""
    _tls(monkeypatch, "default")
    pool = Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="auto")
    _break_nixl(tmp_path, pool["a"])
    with pool:
        pool.wait_members(2)
        deadline = time.monotonic() + 15
        while _cluster(pool.info("b"))["transport_transport"] != "nixl":    # auto: made in the background
            assert time.monotonic() < deadline, "auto never moved to NIXL on the node that has it"
            time.sleep(0.05)
        with Client(pool["a"].addr) as a, Client(pool["b"].addr) as b:
            a.put(key(1), content(1, 256 << 10))
            b.put(key(2), content(2, 256 << 10))
            for _ in range(3):          # META refused at the first: FETCH from then on
                assert get_retry(b, key(1)) == content(1, 256 << 10)
                time.sleep(0.2)
            assert get_retry(a, key(2)) == content(2, 256 << 10)
        ia, ib = _cluster(pool.info("a")), _cluster(pool.info("b"))
        assert ia["transport_transport"] == "tcp" and ib["transport_transport"] == "nixl"
        assert ib["transport_nixl_tcp_peers"] == 1 and ib["transport_nixl_reads"] == 0
        assert ib["transport_nixl_tcp_fetches"] >= 1 and ia["fetches_served"] >= 1
        assert "transport auto -> tcp" in pool["a"].log()


def test_a_node_on_nixl_stops_on_term_with_exit_0(tmp_path, etcd, monkeypatch):
    """NIXL 1.5.1 crashes in an ELF destructor at process exit once an agent was made: the node
    ends past it (``exit_past_nixl``) with its own exit code, its log flushed."""
    _tls(monkeypatch, "default")
    with Pool(tmp_path, etcd.endpoint, 1, transport="nixl") as pool:
        pool.wait_members(1)
        assert pool["a"].stop(signal.SIGTERM) == 0
        assert "transport nixl" in pool["a"].log() and pool["a"].log().rstrip().endswith("stopped")


def test_auto_under_ucx_tls_tcp_reads_over_fetch_and_says_so(tmp_path, etcd, monkeypatch):
    """auto with UCX_TLS=tcp: UCX could reach peers over TCP only, where FETCH is faster; both
    nodes run on TCP, INFO says so, a cross-node GET hits, the log gives the reason."""
    _tls(monkeypatch, "tcp")
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", transport="auto") as pool:
        pool.wait_members(2)
        with Client(pool["a"].addr) as a, Client(pool["b"].addr) as b:
            a.put(key(1), content(1, 256 << 10))
            assert get_retry(b, key(1)) == content(1, 256 << 10)
        for n in ("a", "b"):
            assert _cluster(pool.info(n))["transport_transport"] == "tcp"
            assert "transport auto -> tcp (UCX_TLS tcp" in pool[n].log()
