"""The DRAM eviction order is the DRAM tier's published dict (store/policy.py, store/dram.py):
which key a full store evicts first after reads, re-puts and batch reads and commits, by
every path that reorders it (per key and the native batch loops), under LRU and FIFO."""
import asyncio

import pytest

from quillcache.store.dram import DramTier, Slot
from tests._support.store import BLOCK, data, key, make


def resident(store, ids):
    return [i for i in ids if store.exists(key(i))]


def fill(store, ids):
    for i in ids:
        asyncio.run(store.put(key(i), data(i)))


def reput_batch(store, ids):
    handles = store.reserve_columns_nowait([key(i) for i in ids], [BLOCK] * len(ids))
    for h, i in zip(handles, ids):
        h.view[:] = data(i + 100)
    assert store.put_end_many_nowait(handles) == len(ids)


@pytest.mark.parametrize("policy, first_out", [("lru", [5, 1, 2, 3]), ("fifo", [1, 3, 5, 2])])
def test_reads_reputs_and_batches_move_keys_to_the_recent_end_of_the_published_dict(policy, first_out):
    """Five keys in room for six, then: a read of 1, a re-put of 2, a batch read of 4 and 3,
    a re-put of 4 in a batch commit.  LRU evicts the one left alone (5) first, then 1, 2, 3;
    FIFO ignores the reads (1, 3 and 5 keep their places) and moves only the re-puts (2, 4)."""
    store = make(blocks=6, eviction=policy)
    fill(store, [1, 2, 3, 4, 5])
    assert store._dram_lru.order is (store._dram.published if policy == "lru" else None)
    assert list(store._dram_lru.candidates()) == list(store._dram.published)    # one dict, not two
    store.get(key(1)).release()                             # a read
    asyncio.run(store.put(key(2), data(20)))                # a re-put, per key
    lease, _ = store.located_batch([key(4), key(3)])        # a batch read (hold_published)
    lease.release()
    reput_batch(store, [4])                                 # a re-put in a batch commit (commit_many)
    published = store._dram.published
    assert all(type(slot) is Slot and slot.key == k for k, slot in published.items())
    asyncio.run(store.put(key(10), data(10)))               # the free block: nothing evicted
    assert resident(store, range(1, 6)) == [1, 2, 3, 4, 5]
    gone = []
    for n in range(1, 5):                                   # each new key evicts one
        before = set(resident(store, range(1, 6)))
        asyncio.run(store.put(key(10 + n), data(10 + n)))
        (out,) = before - set(resident(store, range(1, 6)))
        gone.append(out)
    assert gone == first_out
    assert list(published) == [key(4)] + [key(10 + n) for n in range(5)]
    assert store.stats()["dram"]["evictions"] == 4


def test_a_rewrite_of_a_published_key_goes_to_the_recent_end_of_the_tier_order():
    """DramTier.put_end alone: a re-put is popped and added again, not overwritten in place."""
    tier = DramTier(4 * BLOCK, max_block_bytes=BLOCK)
    try:
        for i in (1, 2, 3):
            p = tier.put_start(key(i), 10)
            tier.put_end(p)
        old = tier.lookup(key(1))
        p = tier.put_start(key(1), 20)
        assert tier.put_end(p) is old
        assert list(tier.published) == [key(2), key(3), key(1)]
        assert tier.lookup(key(1)).size == 20
        tier.unpublish(key(2))
        assert list(tier.published) == [key(3), key(1)]
    finally:
        tier.close()


def test_demotion_and_removal_leave_the_order_with_the_published_key():
    store = make(blocks=4)
    fill(store, [1, 2, 3])
    asyncio.run(store.remove(key(2)))
    assert list(store._dram_lru.candidates()) == [key(1), key(3)]
    assert key(2) not in store._dram_lru and len(store._dram_lru) == 2
