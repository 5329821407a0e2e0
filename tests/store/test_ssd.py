"""SsdTier: durable puts, overwrite, remove, recovery, corruption, faults and limits."""
import asyncio
import errno
import os

import pytest

from quillcache._native import wal as walmod
from quillcache.errors import CapacityError, InvalidArgument, NotFound, ReadOnlyError
from quillcache.model import KvBlockKey
from quillcache.store import ssd as ssdmod
from quillcache.store.ssd import SsdTier, crc32c

UNIT = 4096
CAP = 64 * UNIT


def key(i: int) -> KvBlockKey:
    return KvBlockKey("m", "tok", None, "t", "p", f"b{i}", i)


def data(i: int, n: int = 5000) -> bytes:
    return bytes((i * 7 + j) & 0xFF for j in range(n))


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def _no_wal_faults():
    walmod.clear_faults()
    yield
    walmod.clear_faults()


def state(tier):
    return sorted((str(k), off, n, crc) for k, off, n, crc in tier.entries())


def extents(tier):
    return [(off, size) for off, size, _ in tier.allocator.extents()]


def read(tier, k):
    buf = bytearray(tier.size_of(k))
    tier.read_into(k, buf)
    return bytes(buf)


def test_put_then_read_into_round_trips_bytes(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await asyncio.gather(*(t.put(key(i), data(i, 1000 + 300 * i)) for i in range(10)))
        for i in range(10):
            assert read(t, key(i)) == data(i, 1000 + 300 * i)
        assert t.contains(key(3)) and t.size_of(key(3)) == 1900 and t.size_of(key(99)) is None
        assert len(t.keys()) == 10 and t.used == 10 * UNIT
        s = t.stats()
        assert s["blocks"] == 10 and s["puts"] == 10 and s["commits"] <= 10
        assert s["wal_bytes_per_put"] > 0 and s["commit_p99_ms"] >= s["commit_p50_ms"] > 0
        await t.close()
    run(go())


def test_concurrent_puts_share_group_commits(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP, commit_window_s=0.005)
        await asyncio.gather(*(t.put(key(i), data(i, 100)) for i in range(32)))
        assert t.stats()["commits"] < 32 and t.stats()["data_syncs"] == t.stats()["commits"]
        await t.close()
    run(go())


def test_overwrite_publishes_new_bytes_and_frees_old_extent(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await t.put(key(1), data(1, 3 * UNIT))
        old = extents(t)
        await t.put(key(1), data(2, 100))
        assert read(t, key(1)) == data(2, 100)
        assert len(extents(t)) == 1 and extents(t) != old and t.used == UNIT
        await t.close()
    run(go())


def test_remove_frees_extent_only_after_record_is_durable(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await t.put(key(1), data(1))
        lsn_before = t._wal.durable_lsn
        fut = asyncio.ensure_future(t.remove(key(1)))
        await asyncio.sleep(0)                 # queued, not committed yet
        assert t.used == 2 * UNIT and t._wal.durable_lsn == lsn_before
        assert await fut is True
        assert t._wal.durable_lsn > lsn_before and t.used == 0 and not t.contains(key(1))
        assert await t.remove(key(1)) is False
        with pytest.raises(NotFound):
            t.read_into(key(1), bytearray(10000))
        await t.close()
    run(go())


def test_recovery_rebuilds_the_same_map_and_allocator(tmp_path):
    t = SsdTier(tmp_path, CAP, checkpoint_records=5)
    for i in range(12):
        t.put_sync(key(i), data(i, 700 * (i + 1)))
    t.remove_sync(key(4))
    t.put_sync(key(5), data(55, 123))
    before, ext = state(t), extents(t)
    t._committer.failed = ReadOnlyError("simulated crash: no clean close")   # skip the close checkpoint
    t.close_sync()
    r = SsdTier(tmp_path, CAP)
    assert state(r) == before and extents(r) == ext and r.stats()["recovered_blocks"] == 11
    assert read(r, key(5)) == data(55, 123)
    r.close_sync()


def test_recovery_is_idempotent(tmp_path):
    t = SsdTier(tmp_path, CAP)
    for i in range(6):
        t.put_sync(key(i), data(i))
    t.close_sync()
    states = []
    for _ in range(3):
        r = SsdTier(tmp_path, CAP, verify="eager")
        states.append((state(r), extents(r)))
        r.close_sync()
    assert states[0] == states[1] == states[2]


def _flip_data_byte(tmp_path, tier, k, at=10):
    off = {kk: o for kk, o, _, _ in tier.entries()}[k]
    with open(tmp_path / ssdmod.DATA_NAME, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)[0]
        f.seek(off + at)
        f.write(bytes([b ^ 0x40]))


def test_corrupted_block_is_dropped_counted_and_never_returned(tmp_path):
    t = SsdTier(tmp_path, CAP)
    t.put_sync(key(1), data(1))
    t.put_sync(key(2), data(2))
    _flip_data_byte(tmp_path, t, key(1))
    buf = bytearray(b"\xee" * 6000)
    with pytest.raises(NotFound):
        t.read_into(key(1), buf)
    assert bytes(buf[:5000]) == bytes(5000)       # the bad bytes were wiped
    assert not t.contains(key(1)) and t.stats()["crc_failures"] == 1 and t.stats()["dropped_blocks"] == 1
    assert read(t, key(2)) == data(2) and t.used == 2 * UNIT
    t.close_sync()
    r = SsdTier(tmp_path, CAP)                    # the drop was logged: it stays dropped
    assert r.keys() == [key(2)]
    r.close_sync()


def _need_direct_io(tier) -> None:
    if not tier.direct_io:
        tier.close_sync()
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs?): no sendfile extents")


def test_eager_verification_drops_corrupt_block_at_open(tmp_path):
    t = SsdTier(tmp_path, CAP)
    t.put_sync(key(1), data(1))
    t.put_sync(key(2), data(2))
    _flip_data_byte(tmp_path, t, key(2), at=4999)
    t.close_sync()
    r = SsdTier(tmp_path, CAP, verify="eager")
    assert r.keys() == [key(1)] and r.stats()["crc_failures"] == 1 and len(extents(r)) == 1
    _need_direct_io(r)
    assert r.extent_of(key(1))[1:3] == ({k: o for k, o, _, _ in r.entries()}[key(1)], 5000)
    r.close_sync()


def test_lazy_recovery_offers_sendfile_extent_only_after_a_verified_read(tmp_path):
    t = SsdTier(tmp_path, CAP)
    t.put_sync(key(1), data(1))
    t.close_sync()
    r = SsdTier(tmp_path, CAP, verify="lazy")
    _need_direct_io(r)
    assert r.extent_of(key(1)) is None
    read(r, key(1))
    fd, off, n, crc = r.extent_of(key(1))
    assert n == 5000 and os.pread(fd, n, off) == data(1) and crc == crc32c(data(1))
    r.close_sync()


def test_torn_wal_tail_drops_the_unacknowledged_put(tmp_path):
    t = SsdTier(tmp_path, CAP)
    t.put_sync(key(1), data(1))
    t.put_sync(key(2), data(2))
    t._committer.failed = ReadOnlyError("crash")
    t.close_sync()
    seg = sorted((tmp_path / "wal").glob("*.log"))[-1]
    size = seg.stat().st_size
    os.truncate(seg, size - 5)                    # the last record (key 2) torn mid-write
    r = SsdTier(tmp_path, CAP)
    assert r.keys() == [key(1)] and r.stats()["wal_tail_bytes"] > 0
    assert read(r, key(1)) == data(1) and len(extents(r)) == 1   # key 2's extent is free again
    r.close_sync()


def test_wal_fsync_eio_makes_later_puts_read_only(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await t.put(key(1), data(1))
        walmod.set_fault("fsync", errno.EIO)
        with pytest.raises(ReadOnlyError):
            await t.put(key(2), data(2))
        walmod.clear_faults()
        with pytest.raises(ReadOnlyError):
            await t.put(key(3), data(3))
        with pytest.raises(ReadOnlyError):
            await t.remove(key(1))
        assert read(t, key(1)) == data(1) and t.stats()["read_only"]
        await t.close()
    run(go())
    r = SsdTier(tmp_path, CAP)                    # key 2's record was synced before the error: either is valid
    assert key(1) in r.keys() and key(3) not in r.keys()
    r.close_sync()


def test_full_tier_raises_capacity_error_and_changes_nothing(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, 4 * UNIT)
        await t.put(key(1), data(1, 3 * UNIT))
        before = (state(t), t.used)
        with pytest.raises(CapacityError):
            await t.put(key(2), data(2, 2 * UNIT))
        assert (state(t), t.used) == before and not t.contains(key(2))
        await t.put(key(2), data(2, UNIT))      # what fits still fits
        await t.close()
    run(go())


def test_limits_are_checked_before_anything_changes(tmp_path):
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path / "a", 1000)            # not a multiple of unit
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path / "b", CAP, unit=3000)
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path / "c", CAP, verify="sometimes")
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path / "d", CAP, max_block_bytes=CAP + 1)
    assert not (tmp_path / "a").exists()
    t = SsdTier(tmp_path / "e", CAP, max_block_bytes=2 * UNIT)
    with pytest.raises(InvalidArgument):
        t.put_sync(key(1), b"")
    with pytest.raises(InvalidArgument):
        t.put_sync(key(1), bytes(2 * UNIT + 1))
    with pytest.raises(InvalidArgument):
        t.put_sync("not a key", b"x")
    t.put_sync(key(1), data(1))
    with pytest.raises(InvalidArgument):
        t.read_into(key(1), bytearray(10))       # buffer too small
    with pytest.raises(InvalidArgument):
        t.read_into(key(1), bytes(5000))         # read-only buffer
    assert t.used == 2 * UNIT and len(t) == 1
    t.close_sync()
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path / "e", UNIT)            # the existing data does not fit a smaller capacity


def test_second_tier_on_the_same_directory_is_refused(tmp_path):
    from quillcache.errors import Busy
    t = SsdTier(tmp_path, CAP)
    with pytest.raises(Busy):
        SsdTier(tmp_path, CAP)
    t.close_sync()


def test_buffered_io_when_direct_io_is_off_reads_back_the_same(tmp_path):
    t = SsdTier(tmp_path, CAP, direct_io=False, sync="always")
    t.put_sync(key(1), data(1, 10))
    assert not t.direct_io and read(t, key(1)) == data(1, 10)
    # verified, but written through the page cache: never offered for sendfile (a later
    # buffered write into the reused extent would change a reply still in a socket)
    assert t.extent_of(key(1)) is None
    t.close_sync()
    r = SsdTier(tmp_path, CAP)
    assert read(r, key(1)) == data(1, 10)
    r.close_sync()


def test_checkpoint_truncates_covered_wal_segments(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, 256 * UNIT, segment_bytes=32768, checkpoint_records=20)
        for i in range(60):
            await t.put(key(i % 30), data(i, 2000))
        assert t.stats()["checkpoints"] >= 2
        assert len(list((tmp_path / "wal").glob("*.log"))) <= 3
        snap = state(t)
        await t.close()
        return snap
    snap = run(go())
    r = SsdTier(tmp_path, 256 * UNIT, segment_bytes=32768)
    assert state(r) == snap
    r.close_sync()


def test_crc32c_matches_the_reference_on_any_buffer():
    import google_crc32c
    blob = bytes(range(256)) * 40
    ref = google_crc32c.value(blob)
    assert crc32c(blob) == crc32c(bytearray(blob)) == crc32c(memoryview(blob)[0:]) == ref
    assert crc32c(memoryview(blob)[5:300]) == google_crc32c.value(blob[5:300])


def test_read_into_async_reads_and_checks_off_the_loop(tmp_path):
    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await t.put(key(1), data(1))
        await t.put(key(2), data(2))
        _flip_data_byte(tmp_path, t, key(2))
        bufs = [bytearray(5000) for _ in range(4)]
        assert await asyncio.gather(*(t.read_into_async(key(1), b) for b in bufs)) == [5000] * 4
        assert all(bytes(b) == data(1) for b in bufs)
        bad = bytearray(b"\xee" * 5000)
        with pytest.raises(NotFound):
            await t.read_into_async(key(2), bad)
        assert bad == bytes(5000) and not t.contains(key(2)) and t.stats()["crc_failures"] == 1
        await t.close()
    run(go())


def test_an_extent_removed_during_an_async_read_is_reused_only_after_it(tmp_path, monkeypatch):
    from quillcache import faults
    monkeypatch.setattr(faults, "SSD_READ_DELAY_S", 0.3)   # QUILLCACHE_SSD_READ_DELAY_MS=300

    async def go():
        t = await SsdTier.open(tmp_path, CAP)
        await t.put(key(1), data(1))
        buf = bytearray(5000)
        reading = asyncio.ensure_future(t.read_into_async(key(1), buf))
        await asyncio.sleep(0)                     # the read holds the extent now
        await t.remove(key(1))
        assert t.used == 2 * UNIT                  # removed, but the extent is still being read
        assert await reading == 5000 and bytes(buf) == data(1)
        assert t.used == 0
        await t.close()
    run(go())


def test_read_delay_fault_parses_milliseconds_and_refuses_nonsense():
    from quillcache import faults
    assert faults._parse_delay("") == 0.0 and faults._parse_delay("200") == 0.2
    for bad in ("fast", "-1", "1e9"):
        with pytest.raises(ValueError, match="QUILLCACHE_SSD_READ_DELAY_MS"):
            faults._parse_delay(bad)
