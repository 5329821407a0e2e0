"""store/writes.py: ``put_end_nowait`` publishes exactly what ``put_end`` would, and leaves
to ``put_end`` every put that needs I/O first (durable; an older copy on the SSD tier)."""
import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from quillcache.errors import CapacityError, InvalidArgument, NotFound
from quillcache.store.ssd import SsdTier
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.store import BLOCK, data, key, make, state

@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(1, BLOCK)), min_size=1, max_size=3), max_size=12))
def test_put_end_nowait_publishes_what_put_end_publishes(batches):
    """Two stores, the same reserves: one publishes with put_end_nowait, the other awaits put_end."""
    fast, slow = make(), make()
    ids = range(6)
    for n, batch in enumerate(batches):
        items = [(key(i), size) for i, size in batch]
        got = []
        for store in (fast, slow):
            try:
                handles = store.reserve_nowait(items)
            except CapacityError:
                got.append("full")
                continue
            assert handles is not None                  # DRAM only: eviction needs no I/O
            for h, (i, size) in zip(handles, batch):
                h.view[:] = data(i * 100 + n, size)
            if store is fast:
                assert all(store.put_end_nowait(h) for h in handles)
            else:
                for h in handles:
                    asyncio.run(store.put_end(h))
            got.append("stored")
        assert got[0] == got[1]
        assert state(fast, ids) == state(slow, ids)


def test_an_ended_handle_is_refused_as_put_end_refuses_it():
    store = make()
    (h,) = store.reserve_nowait([(key(1), 10)])
    assert store.put_end_nowait(h)
    with pytest.raises(InvalidArgument, match="not in flight"):
        store.put_end_nowait(h)
    (h,) = store.reserve_nowait([(key(2), 10)])
    store.put_abort(h)
    with pytest.raises(InvalidArgument, match="not in flight"):
        store.put_end_nowait(h)


def test_puts_that_need_io_are_left_to_put_end_untouched(tmp_path):
    async def main():
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK), ssd=SsdTier(tmp_path, 64 * BLOCK))
        try:
            (h,) = await store.reserve([(key(1), BLOCK)], durable=True)
            h.view[:] = data(1)
            assert store.put_end_nowait(h) is False                  # durable: fsync before visible
            with pytest.raises(NotFound):
                store.get(key(1)).release()                          # nothing published
            await store.put_end(h)
            with store.get(key(1)) as lease:
                assert bytes(lease.view) == data(1)
            # key 1 now has a copy on the SSD tier: a plain rewrite must drop it (I/O)
            (h,) = await store.reserve([(key(1), BLOCK)])
            h.view[:] = data(2)
            assert store.put_end_nowait(h) is False
            with store.get(key(1)) as lease:
                assert bytes(lease.view) == data(1)                  # still the old bytes
            await store.put_end(h)
            with store.get(key(1)) as lease:
                assert bytes(lease.view) == data(2)
        finally:
            await store.close()
    asyncio.run(main())
