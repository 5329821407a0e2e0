"""A pool of real quillcached processes on one real etcd (loopback): cross-node reads,
node death (kill -9, SIGSTOP past the lease), etcd restarting under load, replicas,
a node joining, and tenancy across nodes.  Faults must cost misses, never wrong bytes.
"""
from __future__ import annotations

import signal
import time

import pytest

from quillcache import Client
from quillcache.protocol import cluster as wire
from quillcache.cluster.hrw import Ring, key_hash
from quillcache.settings.convert import hash_token
from quillcache.errors import NotFound, PermissionDenied
from quillcache.index.persistent import PersistentArtIndex
from quillcache.model import encode_key
from quillcache.protocol.opcodes import Opcode
from tests._support.cluster import Load, Pool, cluster_view, content, get_retry, key, member, member_ids
from tests._support.etcd import etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (Debian etcd-server)")

TTL_S = 2.0


def test_block_put_on_a_is_read_byte_for_byte_from_b_and_c(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(3)
        sizes = {0: 4 << 20, 1: 256 << 10, 2: 1, 3: 64 << 10}
        with Client(pool["a"].addr) as a:
            for i, size in sizes.items():
                a.put(key(i), content(i, size))
        for letter in "bc":
            with Client(pool[letter].addr) as c:
                for i, size in sizes.items():
                    assert get_retry(c, key(i)) == content(i, size)
                got = c.get_many([key(i) for i in sizes] + [key(99)])
                assert got[:4] == [content(i, size) for i, size in sizes.items()] and got[4] is None
                with pytest.raises(NotFound):
                    c.get(key(98))
        info = pool.info("b")["Cluster"]
        assert info["remote_hits"] >= 4 and info["cluster_state"] == "ok" and info["cluster_members"] == 3


def test_a_get_many_of_remote_blocks_over_max_payload_comes_back_whole(tmp_path, etcd):
    """B's reply to a GET_MANY of A's blocks is cut at B's max_payload like a local one (the
    pool fetch fills the misses first), and the client asks for the rest; A's FETCH replies are
    cut at A's the same way, and B fetches the rest: every byte arrives."""
    size, n = 512 << 10, 12                            # 6 MiB through 2 MiB frames
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", max_block="1MiB",
              sections={"limits": 'max_payload = "2MiB"'}) as pool:
        pool.wait_members(2)
        with Client(pool["a"].addr) as a:
            a.put_many([(key(i), content(i, size)) for i in range(n)])
        with Client(pool["b"].addr) as b:
            for i in (0, n - 1):
                assert get_retry(b, key(i)) == content(i, size)
            got = b.get_many([key(i) for i in range(n)] + [key(99)])
            assert [bytes(v) for v in got[:n]] == [content(i, size) for i in range(n)] and got[n] is None
            assert pool.info("b")["Cluster"]["remote_hits"] >= n


def test_kill9_under_load_serves_misses_or_correct_bytes_and_is_seen_within_ttl(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(3)
        keys = {i: (256 << 10) if i % 2 else (32 << 10) for i in range(40)}
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        with Client(pool["b"].addr) as b:
            for i in keys:
                get_retry(b, key(i))
        with Load([pool["b"].addr, pool["c"].addr], keys, writer_addr=pool["a"].addr) as load:
            time.sleep(0.5)
            before = load.snapshot()
            pool["a"].send(signal.SIGKILL)
            t_kill = time.monotonic()
            seen = {}
            while len(seen) < 2 and time.monotonic() - t_kill < TTL_S + 3:
                for letter in "bc":
                    if letter not in seen and "node-a" not in member_ids(pool[letter].addr):
                        seen[letter] = time.monotonic() - t_kill
                time.sleep(0.02)
            time.sleep(0.5)
            after = load.snapshot()
        print(f"kill -9: death seen by b in {seen.get('b')} s, by c in {seen.get('c')} s; "
              f"reads before {before}, after (hits, misses, errors, wrong) {after}")
        assert after[3] == 0, "a wrong block was served"
        assert before[0] > 0 and after[1] > before[1], "reads hit before and missed after the kill"
        assert set(seen) == {"b", "c"} and max(seen.values()) <= TTL_S + 1.0, seen


def test_sigstop_past_the_ttl_comes_back_with_a_new_epoch_and_serves_nothing_wrong(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(3)
        keys = dict.fromkeys(range(24), 128 << 10)
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        old_epoch = next(m["epoch"] for m in cluster_view(pool["b"].addr)["members"] if m["node_id"] == "node-a")
        with Load([pool["b"].addr, pool["c"].addr], keys) as load:
            pool["a"].send(signal.SIGSTOP)
            time.sleep(TTL_S + 1.5)
            assert "node-a" not in member_ids(pool["b"].addr)
            pool["a"].send(signal.SIGCONT)
            deadline = time.monotonic() + 10
            new_epoch = None
            while time.monotonic() < deadline:
                view = {m["node_id"]: m for m in cluster_view(pool["b"].addr)["members"]}
                if view.get("node-a", {}).get("state") == "up":
                    new_epoch = view["node-a"]["epoch"]
                    break
                time.sleep(0.05)
            assert new_epoch is not None and new_epoch != old_epoch
            assert cluster_view(pool["a"].addr)["epoch"] == new_epoch
            with Client(pool["c"].addr) as c:          # re-announced under the new epoch
                for i in keys:
                    assert get_retry(c, key(i), 5.0) == content(i, keys[i])
        hits, misses, errors, wrong = load.snapshot()
        print(f"SIGSTOP {TTL_S + 1.5}s: epoch {old_epoch} -> {new_epoch}; reads (hits, misses, errors, wrong) "
              f"{(hits, misses, errors, wrong)}")
        assert wrong == 0 and hits > 0
        assert pool.info("a")["Cluster"]["membership_epochs_started"] == 2


def test_etcd_restart_under_load_keeps_the_data_path_working(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(3)
        keys = dict.fromkeys(range(30), 64 << 10)
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        with Client(pool["c"].addr) as c:
            for i in keys:
                get_retry(c, key(i))
        with Load([pool["b"].addr, pool["c"].addr], keys, writer_addr=pool["a"].addr) as load:
            time.sleep(0.3)
            before = load.snapshot()
            etcd.stop(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while pool.info("b")["Cluster"]["cluster_state"] != "degraded" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.info("b")["Cluster"]["cluster_state"] == "degraded"
            during0 = load.snapshot()
            time.sleep(1.0)
            during1 = load.snapshot()
            etcd.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                    pool.info(x)["Cluster"]["cluster_state"] != "ok" for x in "abc"):
                time.sleep(0.05)
            assert all(pool.info(x)["Cluster"]["cluster_state"] == "ok" for x in "abc")
            time.sleep(0.3)
            after = load.snapshot()
        print(f"etcd down: reads (hits, misses, errors, wrong) before {before}, while down "
              f"{during0} -> {during1}, after {after}")
        assert after[3] == 0 and after[2] == before[2]          # no wrong bytes, no errors
        assert during1[0] - during0[0] > 50                     # reads kept hitting while etcd was down
        assert during1[1] == during0[1]                         # and nothing was lost to a miss
        pool.wait_members(3)


def test_replicas_2_survive_a_kill_of_the_first_holder(tmp_path, etcd):
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", replicas=2) as pool:
        pool.wait_members(3)
        keys = dict.fromkeys(range(24), 64 << 10)
        with Client(pool["a"].addr) as a:
            for i, size in keys.items():
                a.put(key(i), content(i, size))
        deadline = time.monotonic() + 5
        while pool.info("a")["Cluster"]["replicas_pushed"] < len(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.info("a")["Cluster"]["replicas_pushed"] == len(keys)
        pool["a"].send(signal.SIGKILL)
        deadline = time.monotonic() + TTL_S + 3
        while time.monotonic() < deadline and any("node-a" in member_ids(pool[x].addr) for x in "bc"):
            time.sleep(0.05)
        for letter in "bc":
            with Client(pool[letter].addr) as c:
                for i in keys:
                    assert get_retry(c, key(i), 3.0) == content(i, keys[i])


def test_a_fourth_node_finds_blocks_after_reannouncement_with_progress_in_info(tmp_path, etcd):
    rate = 1500                     # keys/s: a node's round of 1000 keys takes about 0.7 s
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", reannounce_rate=rate) as pool:
        pool.wait_members(3)
        keys = dict.fromkeys(range(3000), 1 << 10)
        for n, letter in enumerate("abc"):
            with Client(pool[letter].addr) as c:
                c.put_many([(key(i), content(i, keys[i])) for i in keys if i % 3 == n])
        before = {x: pool.info(x)["Cluster"] for x in "abc"}
        pool.add("d")
        pool.wait_members(4)
        deadline = time.monotonic() + 10
        midway = set()              # nodes seen re-announcing, part of their keys scanned
        while time.monotonic() < deadline:
            infos = {x: pool.info(x)["Cluster"] for x in "abc"}
            for x, i in infos.items():
                scanned = i["reannounce_scanned"] - before[x]["reannounce_scanned"]
                if i["reannounce_active"] and 0 < scanned < i["reannounce_total"]:
                    midway.add(x)
            if all(i["reannounce_rounds"] > before[x]["reannounce_rounds"] and not i["reannounce_active"]
                   for x, i in infos.items()):
                break
            time.sleep(0.02)
        assert midway, "INFO never showed a re-announcement in progress"
        queued = sum(i["reannounce_queued"] - before[x]["reannounce_queued"] for x, i in infos.items())
        assert 0 < queued < len(keys)               # only the keys whose home moved (to node-d)
        assert all(i["reannounce_total"] == len(keys) // 3 for i in infos.values())
        with Client(pool["d"].addr) as d:
            got = d.get_many([key(i) for i in keys])
        missed = [i for i, g in zip(keys, got) if g is None]
        assert not missed, (len(missed), missed[:20], {x: pool.info(x)["Cluster"] for x in "abcd"})
        assert got == [content(i, keys[i]) for i in keys]
        assert pool.info("d")["Cluster"]["cluster_records"] > 0      # it is home for some keys now


def test_hashed_placement_puts_the_first_copy_at_the_home(tmp_path, etcd):
    """placement = "hashed": a put on A also lands at the key's first node in HRW order (its
    home), so the block survives A; with replicas = 2, at the first two."""
    for replicas in (1, 2):
        with Pool(tmp_path / f"r{replicas}", etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", placement="hashed",
                  replicas=replicas, cluster_id=f"hashed{replicas}") as pool:
            pool.wait_members(3)
            keys = dict.fromkeys(range(30), 16 << 10)
            ring = Ring(["node-a", "node-b", "node-c"])
            first = {i: ring.order(key_hash(encode_key(key(i))), replicas) for i in keys}
            with Client(pool["a"].addr) as a:
                for i, size in keys.items():
                    a.put(key(i), content(i, size))
            pushes = sum(len([n for n in first[i] if n != "node-a"]) for i in keys)
            deadline = time.monotonic() + 5
            while pool.info("a")["Cluster"]["replicas_pushed"] < pushes and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.info("a")["Cluster"]["replicas_pushed"] == pushes
            for letter in "bc":
                # each replica fetched the block from A (REPLICATE); EXISTS asks its store only
                want = [i for i in keys if f"node-{letter}" in first[i]]
                deadline = time.monotonic() + 5
                while pool.info(letter)["Cluster"]["replicas_fetched"] < len(want):
                    assert time.monotonic() < deadline, pool.info(letter)["Cluster"]
                    time.sleep(0.05)
                with Client(pool[letter].addr) as c:
                    for i in keys:
                        assert c.exists(key(i)) == (f"node-{letter}" in first[i]), i
                    for i in want:
                        assert c.get(key(i)) == content(i, keys[i])
            pool["a"].send(signal.SIGKILL)
            with Client(pool["b"].addr) as b:
                for i in keys:
                    if set(first[i]) - {"node-a"}:
                        assert get_retry(b, key(i)) == content(i, keys[i])


def test_home_records_live_in_the_store_index_and_never_come_back_from_its_disk(tmp_path, etcd):
    """[index] persistent: other nodes' records sit in the store's own ART index (INFO's
    index_records counts them, a locate answers from them), but neither its log nor its
    checkpoint keeps them: after kill -9 or TERM only the node's own records come back."""
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", ssd=True,
              sections={"index": "persistent = true"}) as pool:
        pool.wait_members(3)
        with Client(pool["a"].addr) as a:
            for i in range(20):
                a.put(key(i), content(i, 4096), durable=True)      # A's own records reach its disk
        for n, letter in enumerate("bc"):
            with Client(pool[letter].addr) as c:
                c.put_many([(key(i), content(i, 4096)) for i in range(100 + 60 * n, 160 + 60 * n)])
        ring = Ring(["node-a", "node-b", "node-c"])
        homed = [i for i in range(100, 220) if ring.home(key_hash(encode_key(key(i)))) == "node-a"]
        deadline = time.monotonic() + 5
        while pool.info("a")["Cluster"]["cluster_records"] < len(homed) and time.monotonic() < deadline:
            time.sleep(0.05)
        with Client(pool["a"].addr) as peer:
            info = peer.info()
            assert info["Cluster"]["cluster_records"] == len(homed) > 0
            # 20 blocks of A in DRAM and on SSD: 40 records of its own, the rest are B's and C's
            assert info["Store"]["index_records"] == 40 + len(homed)
            body = wire.encode_locate([encode_key(key(i)) for i in homed], peer.limits)
            found = wire.decode_json(peer.call(Opcode.CLUSTER_LOCATE, body).header)
            assert [f["holders"] for f in found] == [["node-b" if i < 160 else "node-c"] for i in homed]
        for sig in (signal.SIGKILL, signal.SIGTERM):
            time.sleep(1.5)         # the index's log is group-committed once a second (maintenance)
            pool["a"].stop(sig)
            with PersistentArtIndex(pool["a"].data_dir / "index") as disk:   # what a restart reads
                assert {r.worker_id for r in disk.iter_records()} == {"node-a"}
                assert disk.records_of("node-a") == 20
            pool["a"].start()
            pool.wait_members(3)
            deadline = time.monotonic() + 5             # soft state: B and C announce again
            while pool.info("a")["Cluster"]["cluster_records"] < len(homed) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.info("a")["Cluster"]["cluster_records"] == len(homed)


def test_records_announced_before_the_watch_shows_their_node_survive_a_view_change(tmp_path, etcd):
    """An ANNOUNCE can overtake the etcd watch that shows its node joining: a view change
    in between must not drop those records (the holder would not announce them again);
    records of a node never seen go after a grace of two lease TTLs."""
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        with member(pool["a"].addr, "node-z", 7, peer_id="node-a") as peer:
            items = [(encode_key(key(i)), 4096, 0) for i in range(10)]
            peer.call(Opcode.ANNOUNCE, wire.encode_announce("node-z", 7, items, peer.limits))
        assert pool.info("a")["Cluster"]["cluster_records"] == 10
        pool.add("c")
        pool.wait_members(3)                        # a view change at A: node-z is not in it
        assert pool.info("a")["Cluster"]["cluster_records"] == 10
        time.sleep(2 * TTL_S)
        pool["c"].stop()
        pool.wait_members(2, nodes=[pool["a"], pool["b"]], timeout=2 * TTL_S + 5)
        assert pool.info("a")["Cluster"]["cluster_records"] == 0


def test_tenancy_across_nodes_a_probe_of_another_tenant_looks_like_a_miss(tmp_path, etcd):
    tenants = (f'[[auth.tenants]]\nname = "t1"\ntoken = "{hash_token("tok-one")}"\n'
               f'[[auth.tenants]]\nname = "t2"\ntoken = "{hash_token("tok-two")}"\n')
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        for d in pool.nodes.values():
            d.config.write_text(d.config.read_text() + tenants)
            d.stop()
            d.start()
        pool.token = "tok-one"
        pool.wait_members(2)
        with Client(pool["a"].addr, token="tok-one") as a:
            a.put(key(1, "t1"), content(1, 4096))
        with Client(pool["b"].addr, token="tok-one") as b1:
            assert get_retry(b1, key(1, "t1")) == content(1, 4096)
        with Client(pool["b"].addr, token="tok-two") as b2:
            with pytest.raises(PermissionDenied) as remote_probe:
                b2.get(key(1, "t1"))
            with pytest.raises(PermissionDenied) as absent_probe:
                b2.get(key(2, "t1"))
            assert str(remote_probe.value) == str(absent_probe.value)
            with pytest.raises(PermissionDenied):           # a client is not a node
                b2.call(Opcode.FETCH, wire.encode_fetch("t1", [encode_key(key(1, "t1"))], b2.limits))
        # a node asking for the block on behalf of t2 is told exactly what an absent key gets
        with member(pool["a"].addr, "node-b", 7, peer_id="node-a") as peer:
            def fetch(tenant, k):
                r = peer.call(Opcode.FETCH, wire.encode_fetch(tenant, [encode_key(k)], peer.limits))
                return wire.decode_fetch_reply(r.header, peer.limits, len(r.payload or b""))[1]
            assert fetch("t2", key(1, "t1")) == fetch("t2", key(2, "t1")) == [(NotFound.status, 0)]
            assert fetch("t1", key(1, "t1")) == [(0, 4096)]
        with pytest.raises(PermissionDenied):
            Client(pool["a"].addr, token="not-the-credential").close()


def test_a_node_given_a_taken_node_id_stays_out_of_the_pool_and_says_why(tmp_path, etcd):
    from tests._support.cluster import cluster_section
    from tests._support.daemon import Daemon

    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s") as pool:
        pool.wait_members(2)
        a_view = {m["node_id"]: m for m in cluster_view(pool["b"].addr)["members"]}["node-a"]
        (tmp_path / "dup").mkdir()
        dup = Daemon(tmp_path / "dup", dram="64MiB", sections={
            "cluster": cluster_section(etcd.endpoint, "node-a", lease_ttl=f"{TTL_S}s"), "node": 'id = "node-a"'})
        pool.nodes["dup"] = dup                      # the pool stops it too
        dup.start()

        def dup_info():
            with Client(dup.addr) as c:
                return c.info("cluster")["Cluster"]

        deadline = time.monotonic() + 10
        while dup_info()["cluster_state"] != "conflict":
            assert time.monotonic() < deadline, dup_info()
            time.sleep(0.1)
        assert pool["a"].addr.rsplit(":", 1)[1] in dup_info()["membership_conflict"]
        with Client(pool["a"].addr) as a:
            a.put(key(1), content(1, 4096))
        time.sleep(2 * TTL_S)                        # the conflicted node retries: nothing changes
        now = {m["node_id"]: m for m in cluster_view(pool["b"].addr)["members"]}["node-a"]
        assert (now["address"], now["epoch"]) == (a_view["address"], a_view["epoch"])
        with Client(pool["b"].addr) as b:
            assert get_retry(b, key(1)) == content(1, 4096)
        # The holder of the name dies: the other takes it, as a new epoch at its own address.
        pool["a"].send(signal.SIGKILL)
        pool["a"].wait()
        deadline = time.monotonic() + TTL_S + 5
        while dup_info()["cluster_state"] != "ok":
            assert time.monotonic() < deadline, dup_info()
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while True:
            now = {m["node_id"]: m for m in cluster_view(pool["b"].addr)["members"]}.get("node-a")
            if now is not None and now["address"] != a_view["address"]:
                break
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        assert now["address"].rsplit(":", 1)[1] == dup.addr.rsplit(":", 1)[1] and now["epoch"] != a_view["epoch"]


def test_a_clustered_node_without_the_etcd_client_refuses_to_start_and_says_how_to_fix_it(tmp_path):
    # Stands in for an install without the [cluster] extra: etcd3gw fails to import.
    from quillcache import exitcodes
    from tests._support.cluster import cluster_section
    from tests._support.daemon import Daemon

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "etcd3gw.py").write_text('raise ImportError("No module named \'etcd3gw\'")\n')
    (tmp_path / "n").mkdir()
    d = Daemon(tmp_path / "n", env={"PYTHONPATH": str(shim)},
               sections={"cluster": cluster_section("127.0.0.1:1", "node-x")})
    d.start(wait=False)
    assert d.wait(60) == exitcodes.CONFIG
    log = d.log()
    assert "quillcache[cluster]" in log and "Traceback" not in log


def test_a_block_the_holder_keeps_only_on_ssd_crosses_intact_and_a_corrupted_one_is_a_miss(tmp_path, etcd):
    """A FETCH of a block A evicted from DRAM is read from A's SSD tier (off the loop) and
    arrives byte for byte; a block whose bytes rotted on A's disk fails A's CRC check and
    is a miss at B, never its bytes."""
    size, n = 512 << 10, 40                          # 20 MiB through an 8 MiB DRAM tier
    with Pool(tmp_path, etcd.endpoint, 2, lease_ttl=f"{TTL_S}s", ssd=True, dram="8MiB", max_block="1MiB",
              sections={"ssd": "promote_on_get = false"}) as pool:
        pool.wait_members(2)
        with Client(pool["a"].addr) as a:
            for i in range(n):
                a.put(key(i), content(i, size), durable=True)
        # Rot one early block on A's disk (its head is unique: see ``content``).
        blocks = pool["a"].data_dir / "ssd" / "blocks.dat"
        raw = bytearray(blocks.read_bytes())
        at = raw.find(b"block-2-")
        assert at >= 0, "block 2 is not on A's disk"
        with open(blocks, "r+b") as f:
            f.seek(at + 1000)
            f.write(bytes([raw[at + 1000] ^ 0xFF]))
        with Client(pool["b"].addr) as b:
            for i in (0, 1, 3, 4, n - 1):            # the early ones only on A's SSD by now
                assert get_retry(b, key(i)) == content(i, size), i
            with pytest.raises(NotFound):
                b.get(key(2))
            got = b.get_many([key(i) for i in range(6)])
            assert got[2] is None and all(got[i] == content(i, size) for i in (0, 1, 3, 4, 5))
        with Client(pool["a"].addr) as peer:
            info = peer.info()
        assert info["Cluster"]["fetches_served"] >= 5
        assert info["Store"]["entries"] == n - 1                       # the rotten block was dropped
        assert any(k.endswith("crc_failures") and int(v) >= 1 for sec in info.values() for k, v in sec.items()), info


def test_cache_remote_keeps_a_clean_copy_that_outlives_the_holder(tmp_path, etcd):
    """cache_remote = true: a cross-node GET leaves B a copy of its own, announced to the
    home like any block, so the block survives the holder's death (B, and C through B)."""
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", cache_remote=True) as pool:
        pool.wait_members(3)
        blocks = {i: content(i, 64 << 10) for i in range(8)}
        with Client(pool["a"].addr) as a:
            for i, data in blocks.items():
                a.put(key(i), data)
        with Client(pool["b"].addr) as b:
            for i, data in blocks.items():
                assert get_retry(b, key(i)) == data
        deadline = time.monotonic() + 5
        while pool.info("b")["Cluster"]["cached_remote"] < len(blocks):
            assert time.monotonic() < deadline, pool.info("b")["Cluster"]
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while True:                                 # B's copies reach their homes
            with Client(pool["c"].addr) as peer:
                body = wire.encode_locate([encode_key(key(i)) for i in blocks], peer.limits)
                found = wire.decode_json(peer.call(Opcode.CLUSTER_LOCATE, body).header)
            if all(set(f["holders"]) == {"node-a", "node-b"} for f in found):
                break
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        pool["a"].send(signal.SIGKILL)
        pool["a"].wait()
        pool.wait_members(2, nodes=[pool["b"], pool["c"]])
        with Client(pool["b"].addr) as b, Client(pool["c"].addr) as c:
            for i, data in blocks.items():
                assert b.get(key(i)) == data                # B's own copy: a local hit
                assert get_retry(c, key(i)) == data         # C: from B now


def test_blocks_a_node_recovers_from_its_disk_are_announced_again_and_read_across(tmp_path, etcd):
    """kill -9 of A, then A again: its durable blocks come back untouched (no entry, their
    sizes only in its records) and, announced to the homes of its new epoch, are read from
    B byte for byte; nothing of them was decoded to join the pool."""
    with Pool(tmp_path, etcd.endpoint, 3, lease_ttl=f"{TTL_S}s", ssd=True) as pool:
        pool.wait_members(3)
        blocks = {i: content(i, (16 << 10) * (1 + i % 3)) for i in range(60)}
        with Client(pool["a"].addr) as a:
            for i, data in blocks.items():
                a.put(key(i), data, durable=True)
        pool["a"].stop(signal.SIGKILL)
        pool["a"].start()
        pool.wait_members(3)
        with Client(pool["a"].addr) as peer:
            info = peer.info()
        assert info["Store"]["entries_untouched"] == len(blocks), info["Store"]
        assert info["Cluster"]["cluster_held"] == len(blocks)
        with Client(pool["b"].addr) as b:
            for i, data in blocks.items():
                assert get_retry(b, key(i), timeout=10) == data, i
