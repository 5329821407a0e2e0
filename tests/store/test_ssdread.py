"""SsdReader: SSD reads through io_uring reaped on the loop, or through the thread pool.

The same tests run on both backends (the pool is the simple path, io_uring the fast one);
io_uring cases are skipped where the kernel refuses a ring."""
import asyncio
import os
import time

import numpy as np
import pytest

from quillcache import faults
from quillcache._native.crc import crc32c
from quillcache.store import ssdread
from quillcache.store.ssdread import CRC_ON_LOOP_BYTES, RING_DEPTH, SsdReader

SIZE = 3 * CRC_ON_LOOP_BYTES


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def _reader(fd, backend):
    try:
        return SsdReader(fd, backend)
    except OSError as exc:                 # asked for io_uring where it is refused or switched off
        pytest.skip(str(exc))


@pytest.mark.parametrize("backend", ["io_uring", "pool"])
def test_reads_check_the_crc_and_never_hand_out_bad_bytes(data_file, backend):
    fd, data = data_file
    r = _reader(fd, backend)

    async def go():
        for off, n in ((0, 1), (4096, 65536), (100, CRC_ON_LOOP_BYTES), (0, CRC_ON_LOOP_BYTES + 4096)):
            dst = memoryview(bytearray(n))
            assert await r.read_extent(dst, off, crc32c(data[off:off + n])) == ""
            assert bytes(dst) == data[off:off + n]
            bad = memoryview(bytearray(n))                  # a wrong CRC: zeroed, and why
            assert await r.read_extent(bad, off, crc32c(data[off:off + n]) ^ 1) == "CRC32C mismatch"
            assert bytes(bad) == bytes(n)
        past = memoryview(bytearray(8192))                  # runs past the end of the file
        assert await r.read_extent(past, SIZE - 4096, 0) == "short read" and bytes(past) == bytes(8192)
    asyncio.run(go())
    st = r.stats()
    assert st["read_backend"] == backend and st["ring_reads" if backend == "io_uring" else "pool_reads"] == 9
    r.close()


@pytest.mark.parametrize("backend", ["io_uring", "pool"])
def test_more_reads_than_the_ring_holds_all_complete_in_order(data_file, backend):
    fd, data = data_file
    r = _reader(fd, backend)
    n = 3 * RING_DEPTH

    async def go():
        dsts = [memoryview(bytearray(4096)) for _ in range(n)]
        whys = await asyncio.gather(*(r.read_extent(d, i * 4096, crc32c(data[i * 4096:(i + 1) * 4096]))
                                      for i, d in enumerate(dsts)))
        assert whys == [""] * n
        assert all(bytes(d) == data[i * 4096:(i + 1) * 4096] for i, d in enumerate(dsts))
        assert r.in_flight == 0
    asyncio.run(go())
    asyncio.run(go())                                       # a second loop: the ring follows it
    r.close()


@pytest.mark.parametrize("backend", ["io_uring", "pool"])
def test_a_cancelled_read_ends_before_its_buffer_is_given_back(data_file, backend, monkeypatch):
    fd, data = data_file
    monkeypatch.setattr(faults, "SSD_READ_DELAY_S", 0.3)
    r = _reader(fd, backend)

    async def go():
        dst = memoryview(bytearray(4096))
        t0 = time.monotonic()
        task = asyncio.ensure_future(r.read_extent(dst, 0, crc32c(data[:4096])))
        await asyncio.sleep(0.05)
        ticks = 0
        task.cancel()
        while not task.done():                              # the loop keeps running meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert task.cancelled()
        assert time.monotonic() - t0 >= 0.29 and ticks >= 10  # it waited for the read, not blocking
        assert bytes(dst) == data[:4096] and r.in_flight == 0   # the read finished into the buffer
    asyncio.run(go())
    r.close()


def test_no_uring_in_the_environment_selects_the_pool(data_file, monkeypatch):
    fd, _ = data_file
    monkeypatch.setenv("QUILLCACHE_NO_URING", "1")
    r = SsdReader(fd)
    assert r.backend == "pool" and "QUILLCACHE_NO_URING" in r.refused
    r.close()
    with pytest.raises(OSError, match="QUILLCACHE_NO_URING"):
        SsdReader(fd, "io_uring")
    with pytest.raises(ValueError):
        SsdReader(fd, "threads")
    assert ssdread.READ_BACKENDS == ("auto", "io_uring", "pool")
