"""The DRAM arena: two-phase puts, slot lifetimes, bytes in the arena, limits."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.errors import CapacityError, ConfigError, InvalidArgument
from quillcache.model import KvBlockKey
from quillcache.store.dram import ARENA_UNIT, MAX_BLOCK_LIMIT, DramTier, _populate, hugepages_available
from tests._support.clock import Clock


def key(i, tenant="t"):
    return KvBlockKey("m", "tok", None, tenant, "root", f"b{i}", i)


def put(tier, k, data):
    p = tier.put_start(k, len(data))
    p.view[:] = data
    tier.put_end(p)


def test_put_start_gives_a_writable_view_of_exactly_the_block_size():
    tier = DramTier(1 << 16)
    p = tier.put_start(key(1), 1000)
    assert len(p.view) == 1000 and not p.view.readonly
    assert tier.used == 1024                 # rounded up to the 256-byte unit


def test_readers_never_see_a_block_between_start_and_end():
    tier = DramTier(1 << 16)
    p = tier.put_start(key(1), 300)
    p.view[:] = b"x" * 300
    assert tier.lookup(key(1)) is None and not tier.contains(key(1)) and len(tier) == 0
    tier.put_end(p)
    assert tier.contains(key(1)) and len(tier) == 1


def test_published_bytes_are_in_the_arena_at_the_slot_offset():
    tier = DramTier(1 << 16)
    data = bytes(range(256)) * 3
    put(tier, key(1), data)
    slot = tier.lookup(key(1))
    assert slot.offset % ARENA_UNIT == 0
    assert tier.array[slot.offset:slot.offset + len(data)].tobytes() == data
    view = tier.acquire(slot)
    assert view.readonly and bytes(view) == data
    tier.release(slot)


def test_writer_view_stops_working_after_put_end():
    tier = DramTier(1 << 16)
    p = tier.put_start(key(1), 10)
    p.view[:] = b"0123456789"
    tier.put_end(p)
    with pytest.raises(ValueError):
        p.view[0] = 1


def test_put_abort_frees_the_slot():
    tier = DramTier(1 << 16)
    p = tier.put_start(key(1), 5000)
    assert tier.used > 0
    assert tier.put_abort(p)
    assert tier.used == 0 and tier.lookup(key(1)) is None
    assert not tier.put_abort(p)
    with pytest.raises(InvalidArgument):
        tier.put_end(p)


def test_stale_put_is_reaped_after_the_timeout_and_not_before():
    clock = Clock()
    tier = DramTier(1 << 16, put_timeout_s=5.0, clock=clock)
    p = tier.put_start(key(1), 1000)
    assert tier.reap_stale(clock.t + 4.9) == []
    assert tier.used == 1024
    assert tier.reap_stale(clock.t + 5.0) == [key(1)]
    assert tier.used == 0 and tier.pending_count == 0
    with pytest.raises(InvalidArgument):
        tier.put_end(p)


def test_replaced_version_stays_valid_while_referenced_then_is_freed():
    tier = DramTier(1 << 16)
    put(tier, key(1), b"a" * 512)
    old = tier.lookup(key(1))
    old_view = tier.acquire(old)
    put(tier, key(1), b"b" * 512)
    assert bytes(old_view) == b"a" * 512          # the reader's version is intact
    new = tier.lookup(key(1))
    assert new is not old and bytes(tier.raw_view(new)) == b"b" * 512
    assert tier.used == 1024
    tier.release(old)
    assert tier.used == 512


def test_unpublished_slot_is_freed_when_the_last_reference_goes():
    tier = DramTier(1 << 16)
    put(tier, key(1), b"z" * 256)
    slot = tier.lookup(key(1))
    tier.acquire(slot)
    tier.acquire(slot)
    assert tier.unpublish(key(1)) is slot
    assert tier.lookup(key(1)) is None and tier.used == 256
    tier.release(slot)
    assert tier.used == 256
    tier.release(slot)
    assert tier.used == 0


@pytest.mark.parametrize("size", [0, -1, 4097, 1.5, True, "8"])
def test_bad_sizes_are_refused_before_allocating(size):
    tier = DramTier(1 << 16, max_block_bytes=4096)
    with pytest.raises(InvalidArgument):
        tier.put_start(key(1), size)
    assert tier.used == 0 and tier.pending_count == 0


def test_full_arena_raises_capacity_error_and_changes_nothing():
    tier = DramTier(4096)
    put(tier, key(1), b"q" * 3000)
    with pytest.raises(CapacityError) as info:
        tier.put_start(key(2), 2000)
    assert info.value.requested == 2000 and info.value.largest_free == 1024
    assert tier.used == 3072 and len(tier) == 1 and tier.pending_count == 0


@pytest.mark.parametrize("capacity", [0, 100, -5, 2 ** 41, 4096.0])
def test_bad_capacity_is_refused(capacity):
    with pytest.raises(InvalidArgument):
        DramTier(capacity)


def test_prefaulted_hugepage_arena_works():
    tier = DramTier(4 << 20, hugepages=True, prefault=True)
    put(tier, key(1), b"h" * 10000)
    assert bytes(tier.raw_view(tier.lookup(key(1)))) == b"h" * 10000
    assert tier.prefaulted
    tier.close()
    assert tier.closed


def _arena_mapping(tier: DramTier) -> dict:
    """The arena's entry of /proc/self/smaps: its fields (kB), by name."""
    start = tier.array.ctypes.data
    fields, inside = {}, False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= start < hi
            elif inside and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                fields[head[0][:-1]] = fields.get(head[0][:-1], 0) + int(head[1])
    return fields


@pytest.mark.parametrize("hugepages", [False, True])
def test_a_prefaulted_arena_is_resident_and_gets_the_pages_it_was_advised(hugepages):
    # Every page is faulted in before the first put, and after the huge-page advice: pages
    # faulted first (MAP_POPULATE at mmap) stayed small pages under shmem_enabled = advise.
    size = 8 << 20
    tier = DramTier(size, hugepages=hugepages, prefault=True)
    try:
        smaps = _arena_mapping(tier)
        if tier.backing == "memfd-hugetlb":             # reserved pages: not in Rss
            assert smaps.get("Shared_Hugetlb", 0) + smaps.get("Private_Hugetlb", 0) >= size >> 10, smaps
            return
        assert smaps["Rss"] >= size >> 10, smaps
        huge = smaps.get("ShmemPmdMapped", 0) + smaps.get("FilePmdMapped", 0)
        if tier.backing == "memfd-thp":
            assert huge >= (size >> 10) // 2, smaps     # most of it in 2 MiB pages
        else:
            assert tier.backing == "memfd" and (not hugepages or not hugepages_available())
            assert huge == 0, smaps
    finally:
        tier.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "unpublish", "abort"]), st.integers(0, 7),
                          st.integers(1, 3000), st.integers(0, 255)), max_size=40))
def test_arena_bytes_match_a_dict_oracle(ops):
    tier = DramTier(1 << 15)
    oracle = {}
    for op, i, size, fill in ops:
        k = key(i)
        if op == "put":
            try:
                p = tier.put_start(k, size)
            except CapacityError:
                continue
            p.view[:] = bytes([fill]) * size
            tier.put_end(p)
            oracle[k] = bytes([fill]) * size
        elif op == "abort":
            try:
                p = tier.put_start(k, size)
            except CapacityError:
                continue
            p.view[:] = b"\xee" * size
            tier.put_abort(p)
        else:
            tier.unpublish(k)
            oracle.pop(k, None)
        assert len(tier) == len(oracle)
        for kk, data in oracle.items():
            slot = tier.lookup(kk)
            assert bytes(tier.raw_view(slot)) == data
    assert tier.used == sum(-(-len(d) // ARENA_UNIT) * ARENA_UNIT for d in oracle.values())
    assert np.frombuffer(tier.array, dtype=np.uint8).size == tier.capacity


def _fds():
    import os
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("max_block_bytes", [MAX_BLOCK_LIMIT + 1, 3 << 30, 1 << 40])
def test_a_max_block_over_the_record_limit_is_refused_before_the_arena_is_made(max_block_bytes):
    """A slot's and an entry's size are u32 fields (_native/blocks.pyx): a max_block_bytes
    above 2 GiB is refused even where the arena is larger, before any memfd is made."""
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    fds = _fds()
    with pytest.raises(InvalidArgument, match=f"at most {MAX_BLOCK_LIMIT}"):
        DramTier(1 << 40, max_block_bytes=max_block_bytes)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_BLOCK_LIMIT}"):
        LocalKvStore(StoreOptions(1 << 40, max_block_bytes=max_block_bytes))
    assert _fds() == fds


def test_the_default_max_block_of_a_big_arena_is_the_record_limit():
    tier = DramTier(3 << 30)                # 3 GiB, sparse: nothing is touched
    try:
        assert MAX_BLOCK_LIMIT == 1 << 31 and tier.max_block_bytes == MAX_BLOCK_LIMIT
        with pytest.raises(InvalidArgument):
            tier.put_start(key(1), MAX_BLOCK_LIMIT + 1)
        assert tier.used == 0
    finally:
        tier.close()


def test_memory_that_cannot_be_faulted_in_is_a_clear_error_at_start():
    # A mapping past its memfd's end: every page there would SIGBUS on first touch.  Prefaulting
    # says so at once (the node exits 78 with the reason), instead of the first put dying on it.
    import mmap
    import os
    fd = os.memfd_create("test-populate", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4 << 20)
        m = mmap.mmap(fd, 4 << 20, flags=mmap.MAP_SHARED)
        os.ftruncate(fd, 1 << 20)          # the last 3 MiB of the mapping are past the end now
        try:
            with pytest.raises(ConfigError, match="could not be faulted in"):
                _populate(m)
        finally:
            m.close()
    finally:
        os.close(fd)
