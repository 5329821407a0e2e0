"""LocalKvStore: two-phase puts, leases, pins, eviction, stats; SSD tiering once ssd.py exists."""
import asyncio
import inspect
import os
import time

import numpy as np
import pytest

from quillcache.errors import Busy, CapacityError, InvalidArgument, NotFound
from quillcache.model import IdentityScope, KvBlockKey
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.clock import Clock

BLOCK = 1024
SCOPE = IdentityScope("m", "tok", None, "t")


def key(i, prefix="root"):
    return KvBlockKey("m", "tok", None, "t", prefix, f"b{i}", i)


def data(i, size=BLOCK):
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def run(coro):
    return asyncio.run(coro)


def make(blocks=4, clock=None, **options):
    return LocalKvStore(StoreOptions(blocks * BLOCK, max_block_bytes=BLOCK, **options), clock=clock or Clock())


def fill(store, ids):
    for i in ids:
        run(store.put(key(i), data(i)))


def resident(store, ids):
    return [i for i in ids if store.exists(key(i))]


# ---------------------------------------------------------------- two-phase put

def test_block_is_invisible_until_put_end_then_bytes_round_trip():
    store = make()
    h = store.put_start(key(1), BLOCK)
    h.view[:] = data(1)
    with pytest.raises(NotFound):
        store.get(key(1))
    assert not store.exists(key(1))
    run(store.put_end(h))
    with store.get(key(1)) as lease:
        assert lease.view.readonly and bytes(lease.view) == data(1) and lease.tier == "dram"


def test_put_abort_frees_the_slot_and_publishes_nothing():
    store = make(blocks=1)
    h = store.put_start(key(1), BLOCK)
    assert store.put_abort(h)
    assert not store.exists(key(1)) and store.stats()["dram"]["used"] == 0
    with pytest.raises(InvalidArgument):
        run(store.put_end(h))
    fill(store, [2])                      # the whole arena is free again
    assert store.exists(key(2))


def test_stale_put_is_reaped_by_maintenance():
    clock = Clock()
    store = make(blocks=1, clock=clock, put_timeout_s=5.0)
    h = store.put_start(key(1), BLOCK)
    assert run(store.maintenance(clock.t + 1))["reaped"] == 0
    assert run(store.maintenance(clock.t + 6))["reaped"] == 1
    with pytest.raises(InvalidArgument):
        run(store.put_end(h))
    s = store.stats()
    assert s["store"]["puts_reaped"] == 1 and s["store"]["puts_in_flight"] == 0 and s["dram"]["used"] == 0


def test_put_accepts_numpy_arrays_and_replaces_existing_key():
    store = make()
    run(store.put(key(1), np.arange(256, dtype=np.uint32)))
    run(store.put(key(1), b"\x07" * 100))
    with store.get(key(1)) as lease:
        assert bytes(lease.view) == b"\x07" * 100
    assert store.stats()["dram"]["blocks"] == 1


def test_leased_old_version_stays_valid_after_replacement():
    store = make()
    fill(store, [1])
    old = store.get(key(1))
    run(store.put(key(1), data(99)))
    assert bytes(old.view) == data(1)
    with store.get(key(1)) as new:
        assert bytes(new.view) == data(99)
    old.release()


def test_bad_put_arguments_change_nothing():
    store = make(blocks=2)
    for size in (0, BLOCK + 1, -3):
        with pytest.raises(InvalidArgument):
            store.put_start(key(1), size)
    with pytest.raises(InvalidArgument):
        store.put_start("not a key", 10)
    with pytest.raises(InvalidArgument):
        store.put_start(key(1), 10, durable=True)      # DRAM only: nothing can be durable
    s = store.stats()
    assert s["dram"]["used"] == 0 and s["store"]["puts_in_flight"] == 0


def test_write_through_without_ssd_is_refused():
    with pytest.raises(InvalidArgument):
        LocalKvStore(StoreOptions(1 << 20, policy="write_through"))
    with pytest.raises(InvalidArgument):
        LocalKvStore(StoreOptions(1 << 20, high_watermark=0.5, low_watermark=0.6))


def test_inflight_put_limit_gives_busy():
    store = make(max_inflight_puts=2)
    store.put_start(key(1), 10)
    store.put_start(key(2), 10)
    with pytest.raises(Busy):
        store.put_start(key(3), 10)


# ---------------------------------------------------------------- eviction, leases, pins

def test_lru_block_is_evicted_first_and_reads_refresh_recency():
    store = make(blocks=3)
    fill(store, [1, 2, 3])
    store.get(key(1)).release()           # 2 is now the least recently used
    fill(store, [4])
    assert resident(store, [1, 2, 3, 4]) == [1, 3, 4]
    assert store.stats()["dram"]["evictions"] == 1


def test_leased_block_is_never_evicted():
    store = make(blocks=2)
    fill(store, [1, 2])
    lease = store.get(key(1))
    store.get(key(2)).release()           # 1 is LRU but leased
    fill(store, [3])
    assert resident(store, [1, 2, 3]) == [1, 3]
    assert bytes(lease.view) == data(1)
    assert store.stats()["dram"]["lease_waits"] >= 1
    lease.release()


def test_capacity_error_when_nothing_is_evictable_changes_nothing():
    store = make(blocks=2)
    fill(store, [1, 2])
    leases = [store.get(key(1)), store.get(key(2))]
    before = store.stats()
    with pytest.raises(CapacityError) as info:
        store.put_start(key(3), BLOCK)
    assert info.value.requested == BLOCK and info.value.free == 0
    after = store.stats()
    assert after["dram"].pop("lease_waits") == 2          # the two leased blocks were skipped
    before["dram"].pop("lease_waits")
    assert before["dram"] == after["dram"] and resident(store, [1, 2, 3]) == [1, 2]
    for lease in leases:
        lease.release()
    fill(store, [3])                      # evictable again once the leases end


def test_a_put_that_cannot_fit_even_after_eviction_evicts_nothing():
    store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=2 * BLOCK), clock=Clock())
    fill(store, [1, 2, 3, 4])
    leases = [store.get(key(i)) for i in (1, 2, 3)]
    with pytest.raises(CapacityError):
        store.put_start(key(5), 2 * BLOCK)
    assert resident(store, [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert store.stats()["dram"]["evictions"] == 0
    for lease in leases:
        lease.release()


def test_soft_pin_is_evicted_last_and_hard_pin_never():
    store = make(blocks=3, max_hard_pin_fraction=1.0)
    fill(store, [1, 2, 3])
    store.pin(key(1), 60)
    store.pin(key(2), 60, hard=True)
    fill(store, [4])                      # 3 (unpinned) goes before soft-pinned 1
    assert resident(store, [1, 2, 3, 4]) == [1, 2, 4]
    store.pin(key(4), 60, hard=True)
    fill(store, [5])                      # only soft-pinned 1 is left to evict
    assert resident(store, [1, 2, 4, 5]) == [2, 4, 5]
    store.pin(key(5), 60, hard=True)
    with pytest.raises(CapacityError):
        store.put_start(key(6), BLOCK)


def test_pins_expire_and_unpin_makes_blocks_evictable():
    clock = Clock()
    store = make(blocks=2, clock=clock, max_hard_pin_fraction=1.0)
    fill(store, [1, 2])
    store.pin(key(1), 10, hard=True)
    store.pin(key(2), 100, hard=True)
    with pytest.raises(CapacityError):
        store.put_start(key(3), BLOCK)
    clock.t += 11
    assert run(store.maintenance())["pins_expired"] == 1
    fill(store, [3])
    assert resident(store, [1, 2, 3]) == [2, 3]
    assert store.unpin(key(2)) and not store.unpin(key(2))
    fill(store, [4])
    assert resident(store, [2, 3, 4]) == [3, 4]


def test_pin_limits_and_missing_keys():
    store = make(blocks=4)                # hard pins may hold half the arena: 2 blocks
    fill(store, [1, 2, 3])
    with pytest.raises(NotFound):
        store.pin(key(9), 10)
    with pytest.raises(InvalidArgument):
        store.pin(key(1), 0)
    store.pin(key(1), 10, hard=True)
    store.pin(key(2), 10, hard=True)
    with pytest.raises(CapacityError):
        store.pin(key(3), 10, hard=True)
    store.pin(key(3), 10)                 # soft pins are not limited


def test_lease_expires_at_maintenance_and_its_view_stops_working():
    clock = Clock()
    store = make(blocks=1, clock=clock, lease_s=5.0)
    fill(store, [1])
    lease = store.get(key(1))
    clock.t += 5
    assert run(store.maintenance())["leases_expired"] == 1
    assert lease.released
    with pytest.raises(ValueError):
        bytes(lease.view)
    fill(store, [2])                      # the block became evictable
    assert resident(store, [1, 2]) == [2]


def test_lease_limit_gives_busy():
    store = make(max_leases=2)
    fill(store, [1])
    a, b = store.get(key(1)), store.get(key(1))
    with pytest.raises(Busy):
        store.get(key(1))
    a.release()
    store.get(key(1)).release()
    b.release()


def test_remove_of_a_leased_block_unpublishes_now_and_frees_at_release():
    store = make(blocks=2)
    fill(store, [1])
    lease = store.get(key(1))
    assert run(store.remove(key(1)))
    assert not run(store.remove(key(1)))
    with pytest.raises(NotFound):
        store.get(key(1))
    assert bytes(lease.view) == data(1)
    assert store.stats()["dram"]["used"] == BLOCK
    lease.release()
    lease.release()                       # idempotent
    assert store.stats()["dram"]["used"] == 0


# ---------------------------------------------------------------- reads, listing, stats

def test_get_into_copies_and_refuses_bad_buffers():
    store = make()
    fill(store, [1])
    buf = bytearray(BLOCK + 10)
    assert store.get_into(key(1), buf) == BLOCK and bytes(buf[:BLOCK]) == data(1)
    with pytest.raises(InvalidArgument):
        store.get_into(key(1), bytearray(BLOCK - 1))
    with pytest.raises(InvalidArgument):
        store.get_into(key(1), bytes(BLOCK))
    with pytest.raises(NotFound):
        store.get_into(key(2), buf)
    assert store.stats()["dram"]["hits"] == 1
    assert store.stats()["store"]["leases"] == 0


def test_exists_prefix_counts_the_leading_present_blocks():
    store = make(blocks=8)
    fill(store, [0, 1, 2, 4])
    assert store.exists_prefix([key(i) for i in range(6)]) == 3
    assert store.exists_prefix([key(5), key(0)]) == 0
    assert store.exists_prefix([]) == 0


def test_list_prefix_returns_the_scope_and_prefix_in_block_order():
    store = make(blocks=8)
    for i in (3, 1, 2):
        run(store.put(key(i, prefix="p"), data(i)))
    run(store.put(key(7, prefix="q"), data(7)))
    run(store.put(KvBlockKey("m", "tok", "lora", "t", "p", "b9", 0), data(9)))
    assert store.list_prefix(SCOPE, "p") == [key(1, "p"), key(2, "p"), key(3, "p")]
    assert store.list_prefix(SCOPE, "none") == []


def test_stats_has_the_per_tier_counters():
    store = make()
    fill(store, [1])
    store.get(key(1)).release()
    with pytest.raises(NotFound):
        store.get(key(2))
    s = store.stats()
    for field in ("blocks", "bytes", "capacity", "hits", "misses", "demotions", "promotions",
                  "evictions", "lease_waits"):
        assert field in s["dram"]
    assert (s["dram"]["blocks"], s["dram"]["bytes"], s["dram"]["hits"], s["dram"]["misses"]) == (1, BLOCK, 1, 1)
    assert s["dram"]["capacity"] == 4 * BLOCK and "reuse_refused_tenant" in s["guard"]


def test_close_releases_everything_and_refuses_new_work():
    store = make()
    fill(store, [1])
    lease = store.get(key(1))
    store.put_start(key(2), 10)
    run(store.close())
    assert lease.released
    with pytest.raises(InvalidArgument):
        store.get(key(1))


# ---------------------------------------------------------------- with the SSD tier

async def _open_ssd(tmp_path, capacity):
    # Assumed constructor of store/ssd.py: SsdTier(directory, capacity=bytes) or an async open().
    from quillcache.store.ssd import SsdTier
    opener = getattr(SsdTier, "open", None)
    path = str(tmp_path / "ssd")
    ssd = opener(path, capacity=capacity) if opener else SsdTier(path, capacity=capacity)
    return await ssd if inspect.isawaitable(ssd) else ssd


@pytest.fixture
def ssd_mod():
    from quillcache.store import ssd
    return ssd


def test_demotion_under_pressure_then_promotion_keeps_the_bytes(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, high_watermark=0.7, low_watermark=0.4),
                             ssd=ssd)
        for i in range(8):
            await store.put(key(i), data(i))
        await store.maintenance()
        s = store.stats()                                   # puts above the high watermark demote ahead too
        demoted = s["dram"]["demotions"]
        assert demoted >= 5 and s["ssd"]["blocks"] == demoted
        assert s["dram"]["used"] <= 0.4 * 8 * BLOCK
        for i in range(8):                                  # every block still reads back exactly
            with store.get(key(i)) as lease:
                assert bytes(lease.view) == data(i)
        assert store.stats()["dram"]["promotions"] == demoted
        await store.close()
    run(scenario())


def test_write_through_put_is_on_ssd_when_put_end_returns(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        await store.put(key(1), data(1))
        assert ssd.contains(key(1))
        buf = bytearray(BLOCK)
        assert ssd.read_into(key(1), buf) == BLOCK and bytes(buf) == data(1)
        await store.close()
    run(scenario())


def test_ssd_only_block_is_read_into_a_buffer_when_dram_has_no_room(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        await store.put(key(1), data(1))
        await store.put(key(2), data(2))
        await store.put(key(3), data(3))                    # evicts clean 1 from DRAM, still on SSD
        held = [store.get(key(2)), store.get(key(3))]       # DRAM full of leased blocks
        with store.get(key(1)) as lease:
            assert lease.tier == "ssd" and bytes(lease.view) == data(1)
        for lease in held:
            lease.release()
        await store.close()
    run(scenario())


def test_corrupt_ssd_block_is_a_miss_not_bad_bytes(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        await store.put(key(1), data(1))
        await store.put(key(2), data(2))
        await store.put(key(3), data(3))                    # 1 now lives only on SSD
        for root, _, files in os.walk(tmp_path / "ssd"):
            for name in files:
                path = os.path.join(root, name)
                blob = bytearray(open(path, "rb").read())
                at = blob.find(data(1)[:64])
                if at >= 0:
                    blob[at + 10] ^= 0xFF
                    open(path, "wb").write(bytes(blob))
        with pytest.raises(NotFound):
            store.get(key(1))
        assert not store.exists(key(1))
        await store.close()
    run(scenario())


def test_list_scope_lists_every_prefix_of_one_scope_only():
    store = make(blocks=8)
    mine = [key(0, prefix="a"), key(1, prefix="a"), key(2, prefix="b")]
    other = KvBlockKey("other-model", "tok", None, "acme", "a", "b9", 9)
    for k in mine + [other]:
        run(store.put(k, data(k.block_index)))
    assert store.list_scope(mine[0].scope) == mine
    assert store.list_scope(other.scope) == [other]
    assert store.list_scope(KvBlockKey("nobody", "tok", None, "acme", "a", "x").scope) == []


def test_put_timeout_setter_refuses_non_positive_and_updates_the_arena():
    store = make()
    with pytest.raises(InvalidArgument):
        store.put_timeout_s = 0
    store.put_timeout_s = 5.0
    assert store.put_timeout_s == 5.0 and store._dram.put_timeout_s == 5.0


def test_ssd_only_block_comes_as_a_verified_extent_only_when_asked_and_not_promoted(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        if not ssd.direct_io:
            await ssd.close()
            pytest.skip("this filesystem refuses O_DIRECT (tmpfs?): no sendfile extents")
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK,
                                          policy="write_through", promote_on_get=False),
                             ssd=ssd)
        for i in (1, 2, 3):
            await store.put(key(i), data(i))            # 3 evicts clean 1 from DRAM: SSD only
        with store.get(key(1), extent_ok=True) as lease:
            fd, offset, length, crc = lease.extent
            assert lease.view is None and lease.tier == "ssd" and lease.size == length == BLOCK
            assert os.pread(fd, length, offset) == data(1) and crc == ssd_mod.crc32c(data(1))
        with store.get(key(1)) as lease:                # not asked: bytes, still not promoted
            assert lease.extent is None and bytes(lease.view) == data(1)
        assert store.stats()["ssd"]["extent_leases"] == 1 and store.stats()["ssd"]["promotions"] == 0
        with store.get(key(2), extent_ok=True) as lease:   # in DRAM: a view, never an extent
            assert lease.extent is None and lease.tier == "dram"
        store.promote_on_get = True                        # room now (2 leases released): promoted
        await store.remove(key(3))
        with store.get(key(1), extent_ok=True) as lease:
            assert lease.extent is None and lease.tier == "dram" and bytes(lease.view) == data(1)
        assert store.stats()["store"]["leases"] == 0
        await store.close()
    run(scenario())


def test_unverified_ssd_block_is_read_and_checked_before_it_is_offered_as_an_extent(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * BLOCK)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        await store.put(key(1), data(1))
        await store.close()
        ssd = ssd_mod.SsdTier(str(tmp_path / "ssd"), 64 * BLOCK, verify="lazy")   # recovered: unverified
        if not ssd.direct_io:
            ssd.close_sync()
            pytest.skip("this filesystem refuses O_DIRECT (tmpfs?): no sendfile extents")
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, promote_on_get=False), ssd=ssd)
        with store.get(key(1), extent_ok=True) as lease:
            assert lease.extent is None and bytes(lease.view) == data(1)     # read + CRC checked
        with store.get(key(1), extent_ok=True) as lease:
            assert lease.extent is not None and lease.extent[3] == ssd_mod.crc32c(data(1))
        await store.close()
    run(scenario())


# ---------------------------------------------------------------- under pressure (SSD tier)

def test_puts_far_beyond_dram_wait_for_demotion_and_lose_nothing(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 256 * 4096)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK), ssd=ssd)
        await asyncio.gather(*(store.put(key(i), data(i)) for i in range(40)))   # 10x the DRAM
        for i in range(40):
            with store.get(key(i)) as lease:
                assert bytes(lease.view) == data(i)
        st = store.stats()["store"]
        assert st["dropped_dirty"] == 0 and st["put_waits"] > 0 and st["put_wait_seconds"] > 0
        assert st["puts_waiting"] == 0
        await store.close()                                 # waits for the demotions in flight
        assert not store._demotion_tasks
    run(scenario())


def test_a_put_that_could_only_wait_is_refused_by_the_sync_put_start(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * 4096)
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK, high_watermark=1.0), ssd=ssd)
        await store.put(key(1), data(1))
        await store.put(key(2), data(2))                    # DRAM full of dirty blocks
        assert store.reserve_nowait([(key(3), BLOCK)]) is None
        with pytest.raises(Busy):
            store.put_start(key(3), BLOCK)
        (h,) = await store.reserve([(key(3), BLOCK)])      # waits for a demotion
        h.view[:] = data(3)
        await store.put_end(h)
        assert [store.exists(key(i)) for i in (1, 2, 3)] == [True, True, True]
        await store.close()
    run(scenario())


def test_a_reserve_waits_at_most_put_timeout_then_busy(ssd_mod, tmp_path):
    async def scenario():
        from quillcache.store.ssd import SsdTier
        ssd = SsdTier(str(tmp_path / "ssd"), 64 * 4096, commit_window_s=0.5)   # each SSD write: 0.5 s
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK, put_timeout_s=0.1, high_watermark=1.0),
                             ssd=ssd)
        await store.put(key(1), data(1))
        await store.put(key(2), data(2))
        t0 = time.monotonic()
        with pytest.raises(Busy, match="waited"):
            await store.reserve([(key(3), BLOCK)])
        assert 0.1 <= time.monotonic() - t0 < 0.4
        assert store.stats()["store"]["put_wait_timeouts"] == 1
        await asyncio.sleep(0.6)                           # the demotions end: nothing lost
        assert store.exists(key(1)) and store.exists(key(2))
        await store.close()
    run(scenario())


def test_dirty_block_is_dropped_and_logged_only_when_the_ssd_cannot_take_it(ssd_mod, tmp_path, caplog):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 4 * 4096)           # room for 4 blocks
        store = LocalKvStore(StoreOptions(8 * BLOCK, max_block_bytes=BLOCK,
                                          max_hard_pin_fraction=1.0, high_watermark=1.0),
                             ssd=ssd)
        for i in range(4):                                  # the SSD full of hard-pinned blocks
            await store.put(key(i), data(i), durable=True)
            store.pin(key(i), 600, hard=True)
        for i in range(4, 8):                               # DRAM full: 4 pinned + 4 dirty
            await store.put(key(i), data(i))
        await store.put(key(8), data(8))                    # must demote: the SSD cannot take it
        st = store.stats()["store"]
        assert st["dropped_dirty"] == 1
        assert sum(store.exists(key(i)) for i in range(4, 9)) == 4 and store.exists(key(8))
        await store.close()
    with caplog.at_level("ERROR", logger="quillcache.store"):
        run(scenario())
    assert any("dropped" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("room", [True, False])
def test_concurrent_gets_of_an_ssd_only_block_share_one_read(ssd_mod, tmp_path, room):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * 4096)
        store = LocalKvStore(StoreOptions(4 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        for i in range(6):
            await store.put(key(i), data(i))                # 0 and 1 are on SSD only now
        if room:
            await store.remove(key(5))                      # room to promote without evicting
        assert store.get_nowait(key(0)) is None
        reads = ssd.stats()["reads"]
        leases = await asyncio.gather(*(store.get_async(key(0)) for _ in range(5)))
        assert all(bytes(lease.view) == data(0) for lease in leases)
        assert ssd.stats()["reads"] == reads + 1
        assert {lease.tier for lease in leases} == ({"dram"} if room else {"ssd"})
        for lease in leases:
            lease.release()
            assert all(bytes(other.view) == data(0) for other in leases if not other.released)
        await store.close()
    run(scenario())


def test_ssd_only_block_removed_while_it_is_read_is_a_miss(ssd_mod, tmp_path):
    async def scenario():
        ssd = await _open_ssd(tmp_path, 64 * 4096)
        store = LocalKvStore(StoreOptions(2 * BLOCK, max_block_bytes=BLOCK, policy="write_through"), ssd=ssd)
        for i in range(3):
            await store.put(key(i), data(i))                # 0 is on SSD only
        task = asyncio.ensure_future(store.get_async(key(0)))
        await asyncio.sleep(0)                              # the read is in the pool now
        assert await store.remove(key(0))
        with pytest.raises(NotFound):
            await task
        await asyncio.sleep(0.05)
        assert ssd.used == 2 * 4096                          # the old extent went back after the read
        await store.close()
    run(scenario())
