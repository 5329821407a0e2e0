"""quillcache._native.crc: CRC32C over any contiguous buffer, against google_crc32c.

The oracle is google_crc32c's Python API (``value`` / ``extend``), not the code under test.
"""
import array
import mmap
import random
import threading
import time

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache._native import codec, crc, wal, walread
from quillcache._native.crc import CRC32C_IMPL, crc32c, crc32c_table
from quillcache.errors import InvalidArgument
from quillcache.store import ssd

SIZES = (0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 255, 4095, 4096, 65535, 65536, 65537, (1 << 20) + 3)
HAS_FAST_PATH = crc._select_impl() == "c"


def _kinds(data: bytes):
    """(name, buffer) pairs that all hold exactly the bytes of ``data``."""
    ba = bytearray(data)
    ro = np.frombuffer(data, dtype=np.uint8)               # read-only: backed by bytes
    rw = np.array(ro)                                       # writable copy
    out = [
        ("bytes", data),
        ("bytearray", ba),
        ("memoryview(bytes) read-only", memoryview(data)),
        ("memoryview(bytearray) writable", memoryview(ba)),
        ("memoryview read-only of a bytearray", memoryview(ba).toreadonly()),
        ("numpy uint8 read-only", ro),
        ("numpy uint8 writable", rw),
        ("unaligned memoryview slice", memoryview(b"\0" + data)[1:]),
        ("unaligned numpy slice", np.frombuffer(b"\0\0\0" + data, dtype=np.uint8)[3:]),
    ]
    if len(data) % 4 == 0:
        out.append(("numpy uint32", np.frombuffer(data, dtype=np.uint32)))
        out.append(("array('I')", array.array("I", data)))
    if len(data) % 8 == 0 and data:
        out.append(("numpy 2-D C-contiguous", np.frombuffer(data, dtype=np.uint8).reshape(8, -1)))
        out.append(("memoryview cast to 2-D", memoryview(data).cast("B", (8, len(data) // 8))))
    return out


@pytest.fixture(params=["c", "table"])
def impl(request):
    """Run the test with the crc32c_extend path and with the table fallback selected."""
    if request.param == "c" and not HAS_FAST_PATH:
        pytest.skip("crc32c_extend not found in google_crc32c: only the table path exists")
    before = crc._select_impl()
    crc._select_impl(request.param)
    yield request.param
    crc._select_impl(before)


def test_crc32c_matches_google_crc32c_for_every_buffer_kind_and_size(impl):
    rng = random.Random(11)
    for n in SIZES:
        data = rng.randbytes(n)
        want = google_crc32c.value(data)
        for name, buf in _kinds(data):
            assert crc32c(buf) == want, (impl, n, name)


def test_crc32c_reads_an_mmap_in_place(impl, tmp_path):
    data = random.Random(3).randbytes(70_000)
    with mmap.mmap(-1, len(data)) as m:
        m[:] = data
        assert crc32c(m) == google_crc32c.value(data)


def test_check_value_of_123456789_is_e3069283(impl):
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c_table(b"123456789") == 0xE3069283


def test_empty_buffer_returns_the_crc_it_was_given(impl):
    assert crc32c(b"") == 0
    assert crc32c(bytearray(), 0xDEADBEEF) == 0xDEADBEEF
    assert crc32c(np.empty(0, np.uint8), 7) == 7


def test_incremental_equals_one_shot(impl):
    rng = random.Random(5)
    for n in (1, 100, 65536 + 100, 3 << 20):
        data = rng.randbytes(n)
        whole = google_crc32c.value(data)
        mv = memoryview(data)
        for _ in range(5):
            cuts = sorted(rng.randrange(n + 1) for _ in range(rng.randrange(1, 6)))
            c, prev = 0, 0
            for cut in cuts + [n]:
                c = crc32c(mv[prev:cut], c)
                prev = cut
            assert c == whole, (impl, n, cuts)
        # the continuation value is google_crc32c.extend's
        assert crc32c(data[n // 2:], crc32c(data[:n // 2])) == google_crc32c.extend(
            google_crc32c.value(data[:n // 2]), data[n // 2:])


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000), seed=st.integers(0, 0xFFFFFFFF))
def test_crc32c_continues_like_google_crc32c_extend(a, b, seed):
    assert crc32c(a + b) == google_crc32c.value(a + b)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)
    assert crc32c(a, seed) == google_crc32c.extend(seed, a)
    assert crc32c_table(a, seed) == google_crc32c.extend(seed, a)


@pytest.mark.skipif(not HAS_FAST_PATH, reason="crc32c_extend not found in google_crc32c")
def test_table_fallback_agrees_with_the_fast_path_at_every_alignment_and_length():
    rng = random.Random(17)
    backing = rng.randbytes(5000 + 8)
    mv = memoryview(backing)
    assert crc._select_impl() == "c"
    for start in range(8):
        for n in list(range(0, 300)) + [1000, 4096, 4099, 5000]:
            buf = mv[start:start + n]
            seed = rng.getrandbits(32)
            assert crc32c_table(buf, seed) == crc32c(buf, seed), (start, n)
    big = rng.randbytes(3 << 20)
    assert crc32c_table(big) == crc32c(big) == google_crc32c.value(big)


def test_select_impl_switches_every_user_and_rejects_unknown_names():
    before = crc._select_impl()
    try:
        assert crc._select_impl("table") == "table"
        # the codec's frame header CRC goes through the same crc32c_update
        h = codec.encode_frame_header(0x10, 1, header=b"abc")
        assert int.from_bytes(h[-4:], "little") == google_crc32c.value(h[:-4])
        assert wal._crc_impl() == "table"
        assert wal._crc_impl("python") == "table"        # the old name of the fallback
        with pytest.raises(InvalidArgument):
            crc._select_impl("sse")
    finally:
        crc._select_impl(before)
    assert crc._select_impl() == before
    assert CRC32C_IMPL == ("libcrc32c crc32c_extend (from google_crc32c)" if HAS_FAST_PATH
                           else "slicing-by-8 table")


def test_non_contiguous_and_non_buffer_inputs_are_rejected():
    with pytest.raises(BufferError):
        crc32c(memoryview(b"abcdefgh")[::2])
    with pytest.raises((BufferError, ValueError)):
        crc32c(np.zeros((4, 4), np.uint8, order="F")[:, :3])
    with pytest.raises((BufferError, ValueError)):
        crc32c(np.arange(16, dtype=np.uint8).reshape(4, 4).T)
    with pytest.raises(TypeError):
        crc32c("text")
    with pytest.raises(TypeError):
        crc32c(None)


def test_crc_argument_outside_32_bits_is_rejected():
    with pytest.raises(OverflowError):
        crc32c(b"x", -1)
    with pytest.raises(OverflowError):
        crc32c(b"x", 1 << 32)
    assert crc32c(b"x", 0xFFFFFFFF) == google_crc32c.extend(0xFFFFFFFF, b"x")


def test_large_buffer_is_checksummed_without_holding_the_gil():
    # the table path at ~2 GB/s makes this one call last tens of milliseconds; a thread
    # holding the GIL for it would stop the main thread's loop for the whole call, one that
    # releases it leaves gaps no longer than the switch interval and the OS scheduler's
    big = np.frombuffer(random.Random(1).randbytes(64 << 20), np.uint8)
    span = {}
    ticks = []

    def work():
        span["t0"] = time.perf_counter()
        span["crc"] = crc32c(big)
        span["t1"] = time.perf_counter()

    before = crc._select_impl()
    crc._select_impl("table")
    try:
        t = threading.Thread(target=work)
        t.start()
        while t.is_alive():
            ticks.append(time.perf_counter())
        t.join()
    finally:
        crc._select_impl(before)
    assert span["crc"] == google_crc32c.value(big)
    took = span["t1"] - span["t0"]
    seen = [span["t0"]] + [x for x in ticks if span["t0"] < x < span["t1"]] + [span["t1"]]
    longest_stall = max(b - a for a, b in zip(seen, seen[1:]))
    assert longest_stall < took / 2, f"main thread stalled {longest_stall:.3f} s of a {took:.3f} s call"


def test_wal_codec_and_ssd_keep_their_names():
    assert codec.crc32c is crc32c and codec.CRC32C_IMPL == CRC32C_IMPL
    assert codec._crc32c_portable is crc32c_table
    assert wal.CRC32C_IMPL == CRC32C_IMPL
    assert ssd.crc32c is crc32c
    assert wal.WalReader is walread.WalReader
    assert wal.list_segments is walread.list_segments and wal.segment_name is walread.segment_name
    assert wal.WAL_MAX_SEGMENT == 1 << 31
    assert set(wal.__all__) <= set(dir(wal))
