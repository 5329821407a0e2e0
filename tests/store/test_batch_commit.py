"""The put path of a batch in one native pass (``reserve_columns_nowait``,
``put_end_many_nowait``: _native/batch.pyx) leaves the store exactly as the per-put path
does, stops where that path needs I/O or refuses, and its per-block records stay off the
garbage collector."""
import asyncio
import gc

import pytest
from hypothesis import given, settings, strategies as st

from quillcache.errors import InvalidArgument, NotFound
from quillcache.model import encode_key
from quillcache.store.ssd import SsdTier
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.clock import Clock
from tests._support.store import BLOCK, data, key, make, state as reader_state


def state(store, ids):
    """The index's records of each key, then what a reader sees and the counters
    (test_writes.py's ``state``), then every stat."""
    records = {i: [(r.worker_id, r.tier, r.bytes) for r in store.index.locate(key(i))] for i in ids}
    return (records, *reader_state(store, ids), store.stats())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 5), st.integers(1, BLOCK)), min_size=1, max_size=4),
                          st.booleans()), max_size=10))
def test_a_batch_commit_leaves_what_put_end_leaves(batches):
    """Two stores, the same reserves (new keys, rewrites of another size or the same, a
    rewrite while a lease holds the old bytes): one publishes the batch in one native
    pass, the other awaits put_end per put."""
    fast, slow = make(blocks=8), make(blocks=8)
    ids = range(6)
    for n, (batch, hold) in enumerate(batches):
        if len({i for i, _ in batch}) < len(batch):
            continue                                    # one reserve per key in a batch
        held = []
        for store in (fast, slow):
            lease = None
            if hold:
                try:
                    lease = store.get(key(batch[0][0]))     # the old bytes stay while leased
                except NotFound:
                    pass
            held.append(lease)
            handles = store.reserve_columns_nowait([key(i) for i, _ in batch], [s for _, s in batch])
            assert handles is not None
            for h, (i, size) in zip(handles, batch):
                h.view[:] = data(i * 100 + n, size)
            if store is fast:
                assert store.put_end_many_nowait(handles) == len(handles)
            else:
                for h in handles:
                    asyncio.run(store.put_end(h))
        assert state(fast, ids)[:2] == state(slow, ids)[:2]
        assert list(fast._dram_lru.candidates()) == list(slow._dram_lru.candidates())
        for lease in held:
            if lease is not None:
                old = bytes(lease.view)
                lease.release()
                assert old                               # the old bytes were intact while held
        assert fast._dram.used == slow._dram.used         # a released old slot is freed in both
    assert state(fast, ids) == state(slow, ids)


def test_the_batch_stops_at_a_reaped_put_and_goes_on_after_it():
    clock = Clock()
    store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, put_timeout_s=5.0), clock=clock)
    (a,) = store.reserve_columns_nowait([key(1)], [10])
    clock.t += 4
    b, c = store.reserve_columns_nowait([key(2), key(3)], [10, 10])
    clock.t += 2
    asyncio.run(store.maintenance())                   # reaps a only (older than put_timeout)
    hs = [b, a, c]
    assert store.put_end_many_nowait(hs) == 1
    with pytest.raises(InvalidArgument, match="not in flight"):
        store.put_end_nowait(a)                        # its error is the per-put path's
    assert store.put_end_many_nowait(hs, 2) == 1
    assert store.put_end_many_nowait(hs, 3) == 0
    assert store.index.locate(key(1)) == []
    assert [r.bytes for r in store.index.locate(key(3))] == [10]


def test_puts_that_need_io_are_left_to_put_end(tmp_path):
    async def main():
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK), ssd=SsdTier(tmp_path, 64 * BLOCK))
        try:
            (h,) = await store.reserve([(key(1), BLOCK)], durable=True)
            h.view[:] = data(1)
            assert store.put_end_many_nowait([h]) == 0          # durable: fsync before visible
            await store.put_end(h)
            # key 1 has an SSD copy now: a rewrite must drop it first (I/O), a new key need not
            h1, h2 = await store.reserve([(key(2), BLOCK), (key(1), BLOCK)])
            h1.view[:] = data(3)
            h2.view[:] = data(2)
            assert store.put_end_many_nowait([h1, h2]) == 1     # key 2 published, key 1 left
            with store.get(key(2)) as new, store.get(key(1)) as old:
                assert (bytes(new.view), bytes(old.view)) == (data(3), data(1))
            assert store.put_end_nowait(h2) is False and store.put_in_flight(h2)
            await store.put_end(h2)
        finally:
            await store.close()
    asyncio.run(main())


def test_a_bad_key_or_size_is_named_and_nothing_is_reserved():
    store = make()
    with pytest.raises(InvalidArgument, match="must be a KvBlockKey"):
        store.reserve_columns_nowait([key(1), "k2"], [10, 10])
    with pytest.raises(InvalidArgument, match="block size 0"):
        store.reserve_columns_nowait([key(1), key(2)], [10, 0])
    with pytest.raises(InvalidArgument, match=f"must be 1..{BLOCK}"):
        store.reserve_columns_nowait([key(1)], [BLOCK + 1])
    with pytest.raises(InvalidArgument, match="must be an integer"):
        store.reserve_columns_nowait([key(1)], [1.5])
    with pytest.raises(InvalidArgument, match="2 keys and 1 sizes"):
        store.reserve_columns_nowait([key(1), key(2)], [10])
    assert store._dram.used == 0 and store.stats()["dram"]["hits"] == 0


def test_a_full_arena_falls_back_to_eviction_and_all_or_nothing_holds():
    store = make(blocks=4)
    hs = store.reserve_columns_nowait([key(i) for i in range(4)], [BLOCK] * 4)
    assert store.put_end_many_nowait(hs) == 4
    # no room for 2 more without evicting: the per-put path evicts the oldest two
    hs = store.reserve_columns_nowait([key(10), key(11)], [BLOCK, BLOCK])
    assert store.put_end_many_nowait(hs) == 2
    assert [i for i in (0, 1, 2, 3, 10, 11) if store.index.locate(key(i))] == [2, 3, 10, 11]


def test_the_per_block_records_stay_off_the_garbage_collector():
    store = make()
    k = key(1)
    (h,) = store.reserve_columns_nowait([k], [10])
    assert not gc.is_tracked(h) and not gc.is_tracked(h.slot)
    store.put_end_many_nowait([h])
    entry = store._entries[k]
    assert not gc.is_tracked(entry)
    assert entry.key is k and entry.ek is encode_key(k)     # the key's own encoding, not a copy
    records = store.index.records_at(entry.ek)              # the residency record and its list
    assert records and not gc.is_tracked(records) and not any(gc.is_tracked(r) for r in records)


def test_a_million_resident_blocks_add_nothing_to_what_the_collector_walks():
    """Keys decoded off the wire, entries, slots, index records: none on the GC's lists (at a
    million blocks a full collection of them paused a node for ~0.5 s)."""
    from quillcache.node.keys import KeyCache
    store, cache = make(blocks=2000), KeyCache()
    gc.collect()
    before = len(gc.get_objects())
    for b in range(0, 2000, 250):
        raws = [bytes(bytearray(encode_key(key(i)))) for i in range(b, b + 250)]
        hs = store.reserve_columns_nowait(cache.decode_many(raws), [16] * 250)
        assert store.put_end_many_nowait(hs) == 250
    gc.collect()
    assert len(gc.get_objects()) - before < 50             # a few dicts grew; nothing per block


def test_a_handles_view_stops_working_once_published():
    store = make()
    (h,) = store.reserve_columns_nowait([key(1)], [10])
    view = h.view
    view[:] = b"x" * 10
    assert h.view is view                               # made once, when first asked for
    assert store.put_end_many_nowait([h]) == 1
    with pytest.raises(ValueError):
        view[:1] = b"y"                                 # released: no write after publish
    with pytest.raises(ValueError):
        h.view[:1] = b"y"
    (h2,) = store.reserve_columns_nowait([key(2)], [10])
    store.put_abort(h2)
    with pytest.raises(ValueError):
        h2.view[:1] = b"y"                              # never asked for before the abort: none now
    with store.get(key(1)) as lease:
        assert bytes(lease.view) == b"x" * 10


def test_a_reaped_puts_view_stops_working_before_its_slot_is_another_puts():
    """A writer later than put_timeout must not write into a slot the store gave to
    another put since: its view is released when its put is reaped."""
    clock = Clock()
    store = LocalKvStore(StoreOptions(BLOCK, max_block_bytes=BLOCK, put_timeout_s=5.0), clock=clock)
    (late,) = store.reserve_columns_nowait([key(1)], [BLOCK])
    view = late.view                                   # a TCP put receives into this
    view[:4] = b"late"
    clock.t += 6
    asyncio.run(store.maintenance())                   # reaped: its slot is free again
    (h,) = store.reserve_columns_nowait([key(2)], [BLOCK])
    assert h.offset == late.offset                     # the same bytes of the arena
    h.view[:] = data(2)
    assert store.put_end_many_nowait([h]) == 1
    with pytest.raises(ValueError):
        view[:4] = b"oops"                             # the late writer is refused
    with store.get(key(2)) as lease:
        assert bytes(lease.view) == data(2)


def test_a_reserve_reply_of_packed_offsets_is_the_reply_of_the_offsets():
    from quillcache._native.batch import packed_offsets
    from quillcache.protocol import located
    store = make(blocks=8)
    hs = store.reserve_columns_nowait([key(i) for i in range(5)], [100, BLOCK, 7, 300, 1])
    offsets = [h.offset for h in hs]
    assert len(set(offsets)) == 5
    packed = located.encode_reserve_reply(9, 123, packed_offsets(hs))
    assert packed == located.encode_reserve_reply(9, 123, offsets)
    with pytest.raises(InvalidArgument):
        located.encode_reserve_reply(9, 123, b"\x00" * 9)
