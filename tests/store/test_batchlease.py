"""LocalKvStore.located_batch: one lease per located batch, with a Lease's rules (held in
place, expiry, remove frees at release, the guard on every key)."""
import asyncio

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.errors import Busy, CapacityError, NotFound, UnsafeReuse
from quillcache.model import KvBlockKey
from quillcache.store.batchlease import BatchLease
from quillcache.store.dram import Slot
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.clock import Clock

BLOCK = 1024


def key(i, model="m"):
    return KvBlockKey(model, "tok", None, "t", "root", f"b{i}", i)


def data(i):
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def make(blocks=4, clock=None, **options):
    return LocalKvStore(StoreOptions(blocks * BLOCK, max_block_bytes=BLOCK, **options), clock=clock or Clock())


def fill(store, ids, model="m"):
    for i in ids:
        asyncio.run(store.put(key(i, model), data(i)))


def arena_bytes(store, slot):
    with open(f"/proc/self/fd/{store.arena_fd}", "rb") as f:
        f.seek(slot.offset)
        return f.read(slot.size)


def test_one_lease_holds_every_slot_of_the_batch_and_names_each_block():
    store = make(blocks=4)
    fill(store, [1, 2, 3])
    lease, got = store.located_batch([key(1), key(2), key(3)])
    assert isinstance(lease, BatchLease) and len(lease) == 3
    assert store.stats()["store"]["leases"] == 1           # one lease object for the batch
    assert all(type(g) is Slot for g in got)
    assert [arena_bytes(store, g) for g in got] == [data(1), data(2), data(3)]
    assert store.stats()["dram"]["hits"] == 3
    lease.release()
    lease.release()                                          # idempotent
    assert lease.released and store.stats()["store"]["leases"] == 0


def test_misses_are_per_key_statuses_and_the_guard_runs_on_every_key():
    store = make(blocks=4)
    fill(store, [1])
    fill(store, [2], model="other")                           # same tenant, another model
    lease, got = store.located_batch([key(1), key(2), key(3)])
    assert type(got[0]) is Slot
    assert got[1] == UnsafeReuse.status                      # the guard refused this key alone
    assert got[2] == NotFound.status
    assert len(lease) == 1
    assert store.stats()["guard"]["reuse_refused_model"] == 1
    lease.release()


def test_a_batch_of_only_misses_holds_nothing():
    store = make()
    lease, got = store.located_batch([key(7), key(8)])
    assert lease is None and got == [NotFound.status, NotFound.status]
    assert store.stats()["store"]["leases"] == 0


def test_held_slots_are_never_evicted_and_are_evictable_after_release():
    store = make(blocks=2)
    fill(store, [1, 2])
    lease, _ = store.located_batch([key(1), key(2)])
    with pytest.raises(CapacityError):                       # nothing evictable: both held
        store.put_start(key(3), BLOCK)
    lease.release()
    fill(store, [3])
    assert sum(store.exists(key(i)) for i in (1, 2, 3)) == 2 and store.exists(key(3))


def test_remove_of_a_held_block_unpublishes_now_and_frees_its_slot_at_release():
    store = make(blocks=2)
    fill(store, [1])
    lease, (slot,) = store.located_batch([key(1)])
    assert asyncio.run(store.remove(key(1)))
    assert store.located_batch([key(1)]) == (None, [NotFound.status])
    assert arena_bytes(store, slot) == data(1)                # still in place while held
    assert store.stats()["dram"]["used"] == BLOCK
    lease.release()
    assert store.stats()["dram"]["used"] == 0


def test_batch_lease_expires_at_maintenance_and_lets_the_slots_go():
    clock = Clock()
    store = make(blocks=1, clock=clock, lease_s=5.0)
    fill(store, [1])
    lease, _ = store.located_batch([key(1)])
    assert lease.expires_at == clock.t + 5.0
    clock.t += 5
    assert asyncio.run(store.maintenance())["leases_expired"] == 1
    assert lease.released
    fill(store, [2])                                          # the held block became evictable
    assert not store.exists(key(1)) and store.exists(key(2))


def test_lease_limit_counts_a_batch_once_and_refuses_the_next_batch_whole():
    store = make(max_leases=2)
    fill(store, [1, 2])
    a, _ = store.located_batch([key(1), key(2)])
    b, _ = store.located_batch([key(1), key(2)])
    with pytest.raises(Busy):
        store.located_batch([key(1)])
    assert store.stats()["dram"]["hits"] == 4                 # the refused batch took nothing
    a.release()
    b.release()


def test_close_releases_batch_leases():
    store = make()
    fill(store, [1])
    lease, _ = store.located_batch([key(1)])
    asyncio.run(store.close())
    assert lease.released


# ---------------------------------------------------------------- against per-key leases (the simple path)

OPS = st.lists(st.tuples(st.sampled_from(["put", "locate", "release", "remove", "expire"]),
                         st.lists(st.integers(0, 5), min_size=1, max_size=4)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_a_batch_lease_holds_exactly_what_per_key_leases_would(ops):
    """Two stores driven alike, one taking a BatchLease per located batch, the other a Lease per
    key (``located_nowait``): the same answers per key, the same bytes at every held offset, and
    the same residency, space used and evictions after every step."""
    clocks = Clock(), Clock()
    batch_store = make(blocks=4, clock=clocks[0], lease_s=5.0)
    key_store = make(blocks=4, clock=clocks[1], lease_s=5.0)
    held_b: list = []                    # (lease, slots)
    held_k: list = []                    # [Lease or None per key]
    version = 0
    for op, ids in ops:
        if op == "put":
            version += 1
            outcomes = []
            for store in (batch_store, key_store):
                try:
                    asyncio.run(store.put(key(ids[0]), data(ids[0] * 1000 + version)))
                    outcomes.append("stored")
                except CapacityError:
                    outcomes.append("full")        # every slot held: the same in both
            assert outcomes[0] == outcomes[1]
        elif op == "locate":
            ks = [key(i) for i in ids]
            lease, got = batch_store.located_batch(ks)
            singles = []
            for k in ks:
                try:
                    singles.append(key_store.located_nowait(k))
                except (NotFound, UnsafeReuse) as exc:
                    singles.append(exc.status)
            assert [type(g) is Slot for g in got] == [not isinstance(s, int) and s is not None for s in singles]
            for g, s in zip(got, singles):
                if type(g) is Slot:
                    assert arena_bytes(batch_store, g) == arena_bytes(key_store, s._slot)
                else:
                    assert g == s
            held_b.append(lease)
            held_k.append([s for s in singles if not isinstance(s, int) and s is not None])
        elif op == "release" and held_b:
            i = ids[0] % len(held_b)
            lease = held_b.pop(i)
            if lease is not None:
                lease.release()
            for s in held_k.pop(i):
                s.release()
        elif op == "remove":
            for store in (batch_store, key_store):
                asyncio.run(store.remove(key(ids[0])))
        elif op == "expire":
            for clock in clocks:
                clock.t += 5
            for store in (batch_store, key_store):
                asyncio.run(store.maintenance())
        b, k = batch_store.stats(), key_store.stats()
        assert b["dram"]["used"] == k["dram"]["used"] and b["dram"]["evictions"] == k["dram"]["evictions"]
        assert [batch_store.exists(key(i)) for i in range(6)] == [key_store.exists(key(i)) for i in range(6)]


def test_a_located_batch_refreshes_the_eviction_order_as_per_key_reads_do():
    """The batch loop's LRU refresh (native, by the hash taken once) leaves the DRAM eviction
    order exactly as a read of each key in turn does; a key the order does not hold is not
    added, and under FIFO reads refresh nothing."""
    for policy in ("lru", "fifo"):
        batch, single = make(blocks=8, eviction=policy), make(blocks=8, eviction=policy)
        for store in (batch, single):
            fill(store, [1, 2, 3, 4, 5])
        lease, _ = batch.located_batch([key(4), key(2), key(9), key(1)])
        lease.release()
        for i in (4, 2, 1):
            single.get(key(i)).release()
        order = list(batch._dram_lru.candidates())
        assert order == list(single._dram_lru.candidates())
        assert key(9) not in batch._dram_lru
        expected = [1, 2, 3, 4, 5] if policy == "fifo" else [3, 5, 4, 2, 1]
        assert order == [key(i) for i in expected]
