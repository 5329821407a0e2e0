"""A located GET (the shared-memory path, docs/shm.md) that misses locally asks the pool:
real etcd, real nodes, a client mapping B's arena through B's Unix socket."""
from __future__ import annotations

import signal
import time

import pytest

from quillcache import Client
from quillcache.settings.convert import hash_token
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.errors import NotFound, PermissionDenied
from quillcache.model import encode_key
from tests._support.cluster import Pool, content, get_retry, key, member_ids, unix_addr
from tests._support.etcd import etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

TTL_S = 2.0


def located(c: Client, keys) -> list:
    """The bytes of each key read through its located view (None: a miss)."""
    with c.get_many_located(keys) as views:
        assert all(v is None or v.readonly for v in views)
        return [None if v is None else bytes(v) for v in views]


def located_retry(c: Client, keys, timeout: float = 10.0, absent: int = 0) -> list:
    """Announcements reach the homes a few ms after a put (longer on a loaded machine): retry
    while something misses, but for the last ``absent`` keys (put nowhere)."""
    deadline = time.monotonic() + timeout
    while True:
        got = located(c, keys)
        if all(g is not None for g in got[:len(got) - absent]) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_a_block_put_on_a_is_read_byte_for_byte_through_a_located_get_on_b(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", cache_remote=False) as pool:
        pool.wait_members(3)
        sizes = {0: 4 << 20, 1: 256 << 10, 2: 1, 3: 64 << 10}
        with Client(pool["a"].addr) as a:
            for i, size in sizes.items():
                a.put(key(i), content(i, size))
        with Client(unix_addr(pool["b"])) as b:
            assert b.shm
            got = located_retry(b, [key(i) for i in sizes] + [key(99)], absent=1)
            assert got[:4] == [content(i, size) for i, size in sizes.items()] and got[4] is None
            info = pool.info("b")["Cluster"]
            assert info["located_remote"] == 4 and info["remote_hits"] >= 4
            # the copy was kept as a block of B (cache_remote = false governs the copy path
            # only): read again, it is a local hit, nothing crosses
            fetches = info["fetches_sent"]
            assert located(b, [key(i) for i in sizes]) == [content(i, size) for i, size in sizes.items()]
            assert pool.info("b")["Cluster"]["fetches_sent"] == fetches
        with Client(pool["b"].addr) as tcp:
            assert tcp.info("server")["Server"]["located_leases"] == 0      # every lease released
        # C, not mapped: the same read over TCP is still fetched from the pool
        with Client(pool["c"].addr) as c:
            assert c.get_many([key(i) for i in sizes]) == [content(i, size) for i, size in sizes.items()]


def test_a_dead_or_hung_holder_costs_a_located_miss_never_wrong_bytes_or_a_hang(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", cache_remote=False,
              hop_timeout="300ms") as pool:
        pool.wait_members(3)
        keys = dict.fromkeys(range(12), 256 << 10)
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        ring = Ring(["node-a", "node-b", "node-c"])
        remembered = next(i for i in range(4, 12) if ring.home(key_hash(encode_key(key(i)))) != "node-a")
        with Client(unix_addr(pool["b"])) as b, Client(pool["b"].addr) as tcp:
            assert located_retry(b, [key(0)]) == [content(0, keys[0])]     # the records are in
            assert get_retry(tcp, key(remembered)) == content(remembered, keys[remembered])   # B remembers A
            # hung: A stopped (no EOF, its lease still alive): the hop's deadline, then a miss
            pool["a"].send(signal.SIGSTOP)
            t0 = time.monotonic()
            got = located(b, [key(1), key(2)])
            hung_s = time.monotonic() - t0
            assert got == [None, None] and hung_s < 2.0, (got, hung_s)
            # the remembered holder costs one FETCH: the home names it again, it is not retried
            fetches = pool.info("b")["Cluster"]["fetches_sent"]
            with pytest.raises(NotFound):
                tcp.get(key(remembered))
            assert pool.info("b")["Cluster"]["fetches_sent"] == fetches + 1
            pool["a"].send(signal.SIGCONT)
            assert located_retry(b, [key(3)]) == [content(3, keys[3])]
            # dead: kill -9, then reads through B at once and until the death is seen
            pool["a"].send(signal.SIGKILL)
            t0 = time.monotonic()
            outcomes = []
            while time.monotonic() - t0 < TTL_S + 1.0:
                i = 4 + len(outcomes) % 8
                t1 = time.monotonic()
                got = located(b, [key(i)])[0]
                outcomes.append((got is None, time.monotonic() - t1))
                assert got is None or got == content(i, keys[i]), "wrong bytes served"
                if "node-a" not in member_ids(pool["b"].addr):
                    break
            assert "node-a" not in member_ids(pool["b"].addr)
            assert located(b, [key(j) for j in range(5, 12)]) == [None] * 7    # only A had them
        print(f"hung holder: miss in {hung_s:.3f} s; after kill -9: {len(outcomes)} located reads, "
              f"slowest {max(t for _, t in outcomes):.3f} s")
        assert max(t for _, t in outcomes) < 2.0


def test_cross_tenant_located_probe_through_b_is_a_miss(tmp_path, etcd):
    def tenants(eng_acts_for: str) -> str:
        return (f'[[auth.tenants]]\nname = "t1"\ntoken = "{hash_token("tok-one")}"\nshm = true\n'
                f'[[auth.tenants]]\nname = "t2"\ntoken = "{hash_token("tok-two")}"\nshm = true\n'
                f'[[auth.tenants]]\nname = "eng"\ntoken = "{hash_token("tok-eng")}"\nshm = true\n'
                f'may_act_for = [{eng_acts_for}]\n')
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", cache_remote=False) as pool:
        # B lets the engine principal read t1's keys; A, which holds them, does not
        for letter, acts_for in (("a", '"t2"'), ("b", '"t1", "t2"')):
            d = pool[letter]
            d.config.write_text(d.config.read_text() + tenants(acts_for))
            d.stop()
            d.start()
        pool.token = "tok-one"
        pool.wait_members(2)
        with Client(pool["a"].addr, token="tok-one") as a:
            a.put(key(1, "t1"), content(1, 4096))
            a.put(key(2, "t1"), content(2, 4096))
        with Client(unix_addr(pool["b"]), token="tok-one") as b1:
            assert b1.shm and located_retry(b1, [key(1, "t1")]) == [content(1, 4096)]
        # key 2 announced and readable through B before the probes (the engine's probe below must
        # reach the holder, not miss at the home while the announce is on its way): over TCP, so
        # B keeps no copy (cache_remote = false), as a located read would
        with Client(pool["b"].addr, token="tok-one") as b1:
            assert get_retry(b1, key(2, "t1"), timeout=10.0) == content(2, 4096)
        # t2 through B: refused on the key alone, exactly as an absent key of t1, and nothing
        # leaves B
        fetches = pool.info("b")["Cluster"]["fetches_sent"]
        with Client(unix_addr(pool["b"]), token="tok-two") as b2:
            with pytest.raises(PermissionDenied) as held:
                located(b2, [key(2, "t1")])
            with pytest.raises(PermissionDenied) as absent:
                located(b2, [key(9, "t1")])
            assert str(held.value) == str(absent.value)
        assert pool.info("b")["Cluster"]["fetches_sent"] == fetches
        # the engine passes B's check, but the holder checks the tenant again: a miss
        with Client(unix_addr(pool["b"]), token="tok-eng") as eng:
            assert eng.shm and located(eng, [key(2, "t1"), key(9, "t1")]) == [None, None]
        info = pool.info("b")["Cluster"]
        assert info["fetches_sent"] > fetches and info["located_remote"] == 1
        with Client(pool["b"].addr, token="tok-one") as tcp:
            assert tcp.info("server")["Server"]["located_leases"] == 0
