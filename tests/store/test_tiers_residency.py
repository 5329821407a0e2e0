"""LocalKvStore's residency: the ART index is the store's record of what is resident where.

Every step of a block's life (put, demote, promote, evict, remove) must leave the index's
records of this node equal to what the tiers hold (``check_residency``); LIST pages walk the
index; a persistent index is reconciled with the SSD tier at start, the SSD tier winning.
"""
import asyncio
import logging

import numpy as np
import pytest

from quillcache.errors import InvalidArgument, NotFound
from quillcache.index.art import ArtIndex
from quillcache.index.persistent import PersistentArtIndex
from quillcache.model import CacheResidency, CacheTier, KvBlockKey, encode_key, encode_scope, encode_scope_prefix
from quillcache.store.ssd import SsdTier
from quillcache.store.tiers import LocalKvStore, StoreOptions

BLOCK = 1024
NODE = "node-a"


def key(i, prefix="root", model="m", tenant="t"):
    return KvBlockKey(model, "tok", None, tenant, prefix, f"b{i}", i)


def data(i, size=BLOCK):
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def run(coro):
    return asyncio.run(coro)


def tiers_of(store, k):
    return store._index.holder(encode_key(k), store.holder)


def test_records_follow_a_block_through_demotion_promotion_eviction_and_remove(tmp_path):
    async def scenario():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK,
                                          high_watermark=0.7, low_watermark=0.4, holder=NODE),
                             ssd=ssd)
        for i in range(8):
            await store.put(key(i), data(i))
        assert tiers_of(store, key(0)) == (BLOCK, (CacheTier.CPU_DRAM,))
        store.check_residency()
        await store.maintenance()                           # LRU blocks go to SSD
        for _ in range(100):                                # demotions started by puts end too
            if not store.stats()["store"].get("demotions_in_flight"):
                break
            await asyncio.sleep(0.01)
        assert store.stats()["ssd"]["demotions"] >= 3
        store.check_residency()
        assert tiers_of(store, key(0)) == (BLOCK, (CacheTier.LOCAL_SSD,))
        with store.get(key(0)) as lease:                   # promoted: now in both tiers
            assert bytes(lease.view) == data(0)
        assert set(tiers_of(store, key(0))[1]) == {CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD}
        store.check_residency()
        await store.put(key(0), data(100, 512))            # new bytes: the SSD copy is stale, dropped
        assert tiers_of(store, key(0)) == (512, (CacheTier.CPU_DRAM,))
        store.check_residency()
        assert await store.remove(key(0))
        assert tiers_of(store, key(0)) == (0, ())
        store.check_residency()
        assert len(store._index) == sum(len(tiers_of(store, key(i))[1]) for i in range(1, 8))
        await store.close()
    run(scenario())


def test_eviction_without_ssd_removes_the_record():
    store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE))
    for i in range(6):                                     # two evictions
        run(store.put(key(i), data(i)))
    store.check_residency()
    assert tiers_of(store, key(0)) == (0, ()) and tiers_of(store, key(1)) == (0, ())
    assert len(store._index) == 4


def test_list_page_walks_the_scope_in_key_order_from_the_cursor():
    store = LocalKvStore(StoreOptions(1 << 20, max_block_bytes=BLOCK))
    keys = [key(i, prefix=f"p{i % 3}") for i in range(40)]
    for k in keys:
        run(store.put(k, data(k.block_index, 256)))
    other = key(99, model="other")                          # another scope: never listed
    run(store.put(other, data(99, 256)))
    want = sorted(encode_key(k) for k in keys)
    prefix = encode_scope(keys[0])
    got, cursor, pages = [], b"", 0
    while True:
        page, more = store.list_page(prefix, cursor, 7)
        pages += 1
        assert len(page) == 7 or not more
        got += page
        if not more:
            break
        cursor = page[-1]
    assert got == want and pages == 6
    p1 = encode_scope_prefix(keys[0], "p1")
    assert store.list_page(p1, b"", 100) == ([k for k in want if k.startswith(p1)], False)
    assert store.list_prefix(keys[0].scope, "p1") == [k for k in keys if k.prefix_hash == "p1"]
    # a cursor past the prefix, and one before it
    assert store.list_page(p1, p1 + b"\xff", 10) == ([], False)
    assert store.list_page(p1, b"\x00", 2) == (want_p1 := [k for k in want if k.startswith(p1)][:2], True)
    assert len(want_p1) == 2
    with pytest.raises(InvalidArgument):
        store.list_page(prefix, b"", 0)


def test_records_of_other_holders_are_neither_listed_nor_served_by_the_guard():
    # the cluster (issue 14) keeps other nodes' records in the same index
    index = ArtIndex()
    store = LocalKvStore(StoreOptions(1 << 20, max_block_bytes=BLOCK, holder=NODE), index=index)
    mine, theirs = key(1), key(2)
    run(store.put(mine, data(1, 256)))
    index.put(CacheResidency(theirs, "node-b", CacheTier.CPU_DRAM, 256))
    index.put(CacheResidency(mine, "node-b", CacheTier.LOCAL_SSD, 256))
    assert store.list_page(encode_scope(mine), b"", 10) == ([encode_key(mine)], False)
    # same content under another block_index: served only from this node's records
    assert store.exists(KvBlockKey("m", "tok", None, "t", "root", "b1", 7))
    assert not store.exists(KvBlockKey("m", "tok", None, "t", "root", "b2", 7))
    assert not store.exists(theirs)
    store.check_residency()                                  # node-b's records are not this node's
    assert len(index.locate(mine)) == 2


def _persistent(tmp_path):
    return PersistentArtIndex(tmp_path / "index", volatile_tiers=(CacheTier.CPU_DRAM,))


def test_persistent_index_recovers_the_ssd_blocks_and_agrees_with_the_ssd_tier(tmp_path):
    async def first():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        for i in range(6):
            await store.put(key(i), data(i), durable=True)  # on SSD and in DRAM
        await store.put(key(50), data(50))                  # DRAM only: gone at restart
        store.check_residency()
        await store.close()

    async def second():
        index = _persistent(tmp_path)
        assert index.recovery.checkpoint_records == 6      # DRAM records were never persisted
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, holder=NODE), ssd=ssd, index=index)
        assert store.reconciled == {"index_added": 0, "index_dropped": 0, "index_resized": 0,
                                   "index_agreed": 6}
        store.check_residency()
        assert [k.block_index for k in store.list_scope(key(0).scope)] == list(range(6))
        with store.get(key(3)) as lease:
            assert bytes(lease.view) == data(3)
        assert store.stats()["store"]["index_agreed_at_start"] == 6
        await store.close()
    run(first())
    run(second())


def test_on_disagreement_the_ssd_tier_wins_and_each_mismatch_is_counted_and_logged(tmp_path, caplog):
    async def first():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        for i in range(4):
            await store.put(key(i), data(i), durable=True)
        await store.close()

    async def behind_its_back():
        # the SSD tier changes without the index: one block removed, one added
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        assert await ssd.remove(key(1))
        await ssd.put(key(7), data(7))
        await ssd.put(key(2), data(2, 512))                 # rewritten at another size
        await ssd.close()
        # and the index gains a record the SSD tier never had
        index = _persistent(tmp_path)
        index.put(CacheResidency(key(8), NODE, CacheTier.LOCAL_SSD, BLOCK))
        index.put(CacheResidency(key(9), "node-b", CacheTier.LOCAL_SSD, BLOCK))   # not ours: kept
        index.sync()
        index.close()

    async def second():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        index = _persistent(tmp_path)
        with caplog.at_level(logging.WARNING, logger="quillcache.store"):
            store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, holder=NODE), ssd=ssd, index=index)
        assert store.reconciled == {"index_added": 1, "index_dropped": 2, "index_resized": 1,
                                    "index_agreed": 2}
        text = caplog.text
        assert "1 SSD blocks had no record in the index: added" in text
        assert "1 records had another size than their SSD block: corrected" in text
        assert tiers_of(store, key(2)) == (512, (CacheTier.LOCAL_SSD,))
        assert "2 records of this node name no block of the SSD tier: dropped" in text
        store.check_residency()
        listed = [k.block_index for k in store.list_scope(key(0).scope)]
        assert listed == [0, 2, 3, 7]
        assert [r.worker_id for r in index.locate(key(9))] == ["node-b"]
        await store.close()
        # the corrected records were persisted: the next start agrees everywhere
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        assert store.reconciled == {"index_added": 0, "index_dropped": 0, "index_resized": 0,
                                    "index_agreed": 4}
        await store.close()
    run(first())
    run(behind_its_back())
    run(second())


def test_a_restart_makes_no_entry_until_a_block_is_touched(tmp_path):
    """Recovered blocks stay records (the index's, the SSD tier's rows) until first touched:
    a restart materialises nothing, and each kind of touch makes exactly that block's entry
    (without timing: the counters say how many exist)."""
    n = 12

    async def first():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        for i in range(n):
            await store.put(key(i), data(i), durable=True)
        await store.close()

    async def second():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        st = store.stats()
        assert st["store"]["entries"] == 0 and st["store"]["entries_untouched"] == n
        assert ssd.untouched == n and st["ssd"]["blocks"] == n
        store.check_residency()
        # a residency listener (the cluster) learns every block without an entry being made
        now = store.set_residency_listener(lambda ek, size: None, lambda ek: None)
        assert now == {encode_key(key(i)): None for i in range(n)}
        assert store.resident_size(encode_key(key(7))) == len(data(7)) and store.resident_size(b"nope") is None
        assert store.stats()["store"]["entries"] == 0
        store.set_residency_listener(None, None)
        # what needs no entry: LIST, exists, the guard
        assert [k.block_index for k in store.list_scope(key(0).scope)] == list(range(n))
        assert store.exists(key(3)) and not store.exists(key(99))
        assert store.stats()["store"]["entries"] == 0
        with store.get(key(3)) as lease:                    # a read: one entry, one SSD row
            assert bytes(lease.view) == data(3)
        assert store.stats()["store"]["entries"] == 1 and ssd.untouched == n - 1
        store.pin(key(4), 60)                               # a pin
        await store.put(key(5), data(105, 512))             # an overwrite: the old SSD copy goes
        with store.get(key(5)) as lease:
            assert bytes(lease.view) == data(105, 512)
        assert tiers_of(store, key(5)) == (512, (CacheTier.CPU_DRAM,)) and key(5) not in ssd
        assert await store.remove(key(6))                   # a remove
        assert not store.exists(key(6)) and key(6) not in ssd
        with pytest.raises(NotFound):
            store.get(key(6))
        st = store.stats()["store"]
        assert st["entries"] == 3 and st["entries_untouched"] == n - 4
        store.check_residency()
        await store.close()

    async def third():                                      # what the touches did survives
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 64 * BLOCK)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        assert store.reconciled["index_agreed"] == n - 2    # key 5 was DRAM only, key 6 removed
        assert [k.block_index for k in store.list_scope(key(0).scope)] == [i for i in range(n) if i not in (5, 6)]
        store.check_residency()
        await store.close()
    run(first())
    run(second())
    run(third())


def test_blocks_untouched_since_the_restart_are_the_first_ssd_victims(tmp_path):
    async def first():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 8 * 4096)   # room for 8 blocks
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        for i in range(8):
            await store.put(key(i), data(i), durable=True)
        await store.close()

    async def second():
        ssd = await SsdTier.open(str(tmp_path / "ssd"), 8 * 4096)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, holder=NODE),
                             ssd=ssd, index=_persistent(tmp_path))
        with store.get(key(0)) as lease:                    # touched: the LRU's now
            assert bytes(lease.view) == data(0)
        await store.put(key(20), data(20), durable=True)     # the SSD is full: one must go
        # the victim is the first untouched block in index order, not the touched key 0
        assert store.exists(key(0)) and not store.exists(key(1))
        assert store.stats()["ssd"]["evictions"] == 1
        store.check_residency()
        await store.close()
    run(first())
    run(second())
