"""The write-ahead log: format, reader corruption handling, group commit, faults.

Corruption tests build or damage files on purpose and assert exactly what the
reader dropped and why.  The reference encoder below is an independent oracle of
docs/wal-format.md (plain Python + google_crc32c), not the code under test.
"""
import errno
import os
import random
import struct
import threading

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache._native import wal
from quillcache.errors import Busy, InvalidArgument, ReadOnlyError

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

BACKENDS = ["uring", "pwritev"] if wal.HAVE_LIBURING else ["pwritev"]


# ---- the oracle --------------------------------------------------------------------------------
def masked_crc(rtype: int, payload: bytes) -> int:
    crc = google_crc32c.value(bytes([rtype]) + payload)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def phys(rtype: int, payload: bytes, length: int | None = None, crc: int | None = None) -> bytes:
    """One physical record: header + payload (length/crc overridable to forge bad ones)."""
    return struct.pack("<IHB", masked_crc(rtype, payload) if crc is None else crc,
                       len(payload) if length is None else length, rtype) + payload


def reference_log(payloads, start: int = 0) -> bytes:
    """LevelDB framing of payloads, as the spec describes it."""
    out = bytearray()
    off = start
    for data in payloads:
        left, begin = data, True
        while True:
            leftover = BLOCK - off % BLOCK
            if leftover < HEADER:
                out += b"\0" * leftover
                off += leftover
            avail = BLOCK - off % BLOCK - HEADER
            frag, left = left[:avail], left[avail:]
            end = not left
            rtype = (FULL if end else FIRST) if begin else (LAST if end else MIDDLE)
            out += phys(rtype, frag)
            off += HEADER + len(frag)
            begin = False
            if end:
                break
    return bytes(out)


def lsn(seq: int, off: int) -> int:
    return (seq << 32) | off


@pytest.fixture(autouse=True)
def _no_faults():
    wal.clear_faults()
    yield
    wal.clear_faults()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def write_log(directory, payloads, backend="pwritev", **kw):
    with wal.WalWriter(directory, backend=backend, **kw) as w:
        lsns = [w.append(p) for p in payloads]
        assert w.commit() == lsns[-1]
    return lsns


def read_all(path):
    r = wal.WalReader(path)
    return list(r), r


def seg1(directory):
    return os.path.join(directory, "000000000001.log")


# ---- round trips and framing -------------------------------------------------------------------
def test_records_of_edge_sizes_round_trip_with_their_lsns(tmp_path, backend):
    sizes = [0, 1, BLOCK - HEADER, BLOCK - HEADER - 3, 100_000, 5, 1 << 20, 0]
    payloads = [os.urandom(n) for n in sizes]
    lsns = write_log(tmp_path, payloads, backend)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == payloads
    assert [l for l, _ in records] == lsns
    assert r.corruption == [] and r.tail_bytes == 0
    assert r.end_lsn == lsns[-1]


def test_file_bytes_match_the_reference_encoding(tmp_path, backend):
    rng = random.Random(7)
    payloads = [rng.randbytes(rng.choice([0, 1, 3, 1000, BLOCK - 14, BLOCK, 70_000])) for _ in range(40)]
    write_log(tmp_path, payloads, backend)
    with open(seg1(tmp_path), "rb") as f:
        assert f.read() == reference_log(payloads)


def test_table_crc_fallback_writes_identical_bytes(tmp_path):
    payloads = [os.urandom(n) for n in (0, 10, BLOCK, 100_000)]
    before = wal._crc_impl()
    try:
        wal._crc_impl("table")
        write_log(tmp_path / "table", payloads)
        records, r = read_all(tmp_path / "table")
    finally:
        wal._crc_impl(before)
    assert [p for _, p in records] == payloads and r.corruption == []
    with open(seg1(tmp_path / "table"), "rb") as f:
        assert f.read() == reference_log(payloads)


def test_record_exactly_filling_a_block_leaves_next_record_at_block_start(tmp_path):
    lsns = write_log(tmp_path, [b"a" * (BLOCK - HEADER), b"bc"])
    assert lsns == [lsn(1, BLOCK), lsn(1, BLOCK + HEADER + 2)]
    data = open(seg1(tmp_path), "rb").read()
    assert data[BLOCK:] == phys(FULL, b"bc")


def test_block_tail_shorter_than_header_is_zero_filled(tmp_path):
    first = b"\xff" * (BLOCK - HEADER - 3)          # leaves 3 bytes: no room for a header
    lsns = write_log(tmp_path, [first, b"next"])
    data = open(seg1(tmp_path), "rb").read()
    assert data[BLOCK - 3:BLOCK] == b"\0\0\0"
    assert data[BLOCK:] == phys(FULL, b"next")
    assert lsns[1] == lsn(1, BLOCK + HEADER + 4)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [first, b"next"] and r.corruption == []


def test_header_that_exactly_fits_starts_an_empty_first_fragment(tmp_path):
    first = b"x" * (BLOCK - 2 * HEADER)             # leaves exactly 7 bytes
    second = b"y" * 100
    write_log(tmp_path, [first, second])
    data = open(seg1(tmp_path), "rb").read()
    assert data[BLOCK - HEADER:BLOCK] == phys(FIRST, b"")
    assert data[BLOCK:] == phys(LAST, second)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [first, second] and r.corruption == []


def test_multi_block_record_is_split_first_middle_last(tmp_path):
    payload = os.urandom(3 * BLOCK)
    write_log(tmp_path, [payload])
    data = open(seg1(tmp_path), "rb").read()
    types = [data[i * BLOCK + 6] for i in range(4)]
    assert types == [FIRST, MIDDLE, MIDDLE, LAST]
    records, _ = read_all(tmp_path)
    assert records[0][1] == payload


def test_records_rotate_across_many_segments_and_never_span_one(tmp_path, backend):
    seg = 64 * 1024
    rng = random.Random(3)
    payloads = [rng.randbytes(rng.randrange(0, 9000)) for _ in range(300)]
    lsns = write_log(tmp_path, payloads, backend, segment_bytes=seg)
    segs = wal.list_segments(tmp_path)
    assert len(segs) >= 10
    assert [s for s, _ in segs] == list(range(1, len(segs) + 1))
    assert all(os.path.getsize(p) <= seg for _, p in segs)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == payloads and [l for l, _ in records] == lsns
    assert r.corruption == []
    # every segment alone parses cleanly: no record was split across two files
    for _, p in segs:
        alone = wal.WalReader(p)
        list(alone)
        assert alone.corruption == [] and alone.tail_bytes == 0


def test_lsns_increase_and_durable_lsn_follows_commits(tmp_path, backend):
    with wal.WalWriter(tmp_path, backend=backend, segment_bytes=BLOCK * 2) as w:
        start = w.durable_lsn
        assert start == w.appended_lsn == lsn(1, 0)
        seen = [start]
        for i in range(52):                              # ends with 2 uncommitted
            seen.append(w.append(os.urandom(3000)))
            assert w.appended_lsn == seen[-1]
            if i % 7 == 0:
                assert w.commit() == seen[-1] == w.durable_lsn
        assert seen == sorted(set(seen))
        assert w.durable_lsn < w.appended_lsn
        assert w.commit() == w.appended_lsn
        assert w.commit() == w.durable_lsn          # nothing pending: no I/O, same lsn


# ---- reader: corruption, LevelDB semantics -----------------------------------------------------
SMALL = 1000
REC = HEADER + SMALL
FILL = BLOCK - 2 * REC - HEADER                     # third record fills block 0 exactly


def three_then_two(tmp_path):
    """A, B, C fill block 0 exactly; D and E live in block 1.  Returns payloads."""
    payloads = [b"A" * SMALL, b"B" * SMALL, b"C" * FILL, b"D" * 500, b"E" * 500]
    write_log(tmp_path, payloads)
    assert os.path.getsize(seg1(tmp_path)) == BLOCK + 2 * (HEADER + 500)
    return payloads


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_bad_crc_drops_rest_of_block_and_resyncs_at_next_block(tmp_path):
    A, B, C, D, E = three_then_two(tmp_path)
    patch(seg1(tmp_path), REC + HEADER + 10, b"x")      # a payload byte of B
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [A, D, E]
    assert r.corruption == [(BLOCK - REC, "checksum mismatch")]
    assert r.corruption_lsns == [lsn(1, REC)]
    assert r.tail_bytes == 0


def test_bad_crc_inside_a_fragmented_record_drops_its_later_fragments_as_missing_start(tmp_path):
    big = os.urandom(BLOCK + 5000)                      # FIRST in block 0, LAST in block 1
    write_log(tmp_path, [b"a" * 100, big, b"after"])
    first_at = HEADER + 100
    patch(seg1(tmp_path), first_at + HEADER + 1, b"\x00" if big[1] else b"\x01")
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [b"a" * 100, b"after"]
    last_len = len(big) - (BLOCK - first_at - HEADER)
    assert r.corruption == [(BLOCK - first_at, "checksum mismatch"),
                            (HEADER + last_len, "missing start of fragmented record")]


def test_bad_length_drops_rest_of_block(tmp_path):
    A, B, C, D, E = three_then_two(tmp_path)
    patch(seg1(tmp_path), REC + 4, struct.pack("<H", 40000))
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [A, D, E]
    assert r.corruption == [(BLOCK - REC, "bad record length")]


def test_unknown_type_with_valid_crc_drops_only_that_record(tmp_path):
    A, B, C, D, E = three_then_two(tmp_path)
    patch(seg1(tmp_path), REC, phys(9, B))
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [A, C, D, E]
    assert r.corruption == [(REC, "unknown record type")]


def test_middle_without_first_is_dropped_and_reported(tmp_path):
    A, B, C, D, E = three_then_two(tmp_path)
    patch(seg1(tmp_path), REC, phys(MIDDLE, B))
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [A, C, D, E]
    assert r.corruption == [(REC, "missing start of fragmented record")]


def test_first_without_last_is_reported_when_a_full_record_follows(tmp_path):
    data = phys(FULL, b"one") + phys(FIRST, b"orphan") + phys(FULL, b"two")
    path = seg1(tmp_path)
    with open(path, "wb") as f:
        f.write(data)
    records, r = read_all(path)
    assert [p for _, p in records] == [b"one", b"two"]
    assert r.corruption == [(HEADER + 6, "partial record without end")]


def test_error_in_middle_of_record_reports_the_interrupted_fragments(tmp_path):
    data = (phys(FIRST, b"p1") + phys(MIDDLE, b"p2", crc=0) + b"\0" * 5)
    data += b"\1" * (BLOCK - len(data))                  # rest of block 0: garbage, dropped
    data += phys(FULL, b"ok")
    path = seg1(tmp_path)
    with open(path, "wb") as f:
        f.write(data)
    records, r = read_all(path)
    assert [p for _, p in records] == [b"ok"]
    assert r.corruption == [(BLOCK - (HEADER + 2), "checksum mismatch"),
                            (HEADER + 2, "error in middle of record")]


def test_torn_tail_record_is_dropped_not_reported(tmp_path):
    payloads = [os.urandom(2000) for _ in range(5)] + [os.urandom(3 * BLOCK)]
    write_log(tmp_path, payloads)
    path = seg1(tmp_path)
    size = os.path.getsize(path)
    keep = len(reference_log(payloads[:5]))
    for cut in (size - 1, keep + BLOCK, keep + HEADER + 10, keep + 3):   # shrinking only
        os.truncate(path, cut)
        records, r = read_all(tmp_path)
        assert [p for _, p in records] == payloads[:5]
        assert r.corruption == []
        assert r.tail_bytes == cut - keep
        assert r.valid_end == keep


def test_zero_filled_tail_of_last_segment_is_end_of_log(tmp_path):
    write_log(tmp_path, [b"a" * 10, b"b" * 20])
    path = seg1(tmp_path)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0" * (2 * BLOCK))
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [b"a" * 10, b"b" * 20]
    assert r.corruption == [] and r.tail_bytes == 2 * BLOCK and r.valid_end == size


def test_zeroed_header_before_valid_data_is_corruption(tmp_path):
    A, B, C, D, E = three_then_two(tmp_path)
    patch(seg1(tmp_path), REC, b"\0" * REC)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [A, D, E]
    assert r.corruption == [(BLOCK - REC, "zeroed header")]


def test_truncated_non_last_segment_is_reported(tmp_path):
    payloads = [bytes([i]) * 9000 for i in range(30)]
    write_log(tmp_path, payloads, segment_bytes=2 * BLOCK)
    segs = wal.list_segments(tmp_path)
    assert len(segs) >= 3
    first = segs[0][1]
    in_first = [p for l, p in read_all(first)[0]]
    os.truncate(first, os.path.getsize(first) - 100)
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == in_first[:-1] + payloads[len(in_first):]
    assert r.corruption == [(HEADER + 9000 - 100, "truncated segment")]


def test_missing_segment_is_reported(tmp_path):
    payloads = [bytes([i]) * 9000 for i in range(30)]
    write_log(tmp_path, payloads, segment_bytes=2 * BLOCK)
    segs = wal.list_segments(tmp_path)
    gone = [p for _, p in read_all(segs[1][1])[0]]
    os.unlink(segs[1][1])
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [p for p in payloads if p not in gone]
    assert r.corruption == [(0, "missing segment")]
    assert r.corruption_lsns == [lsn(2, 0)]


def test_record_larger_than_reader_limit_is_dropped_and_reported(tmp_path):
    write_log(tmp_path, [b"s", os.urandom(3 * BLOCK), b"t"])
    r = wal.WalReader(tmp_path, max_record_bytes=BLOCK)
    assert [p for _, p in r] == [b"s", b"t"]
    reasons = [reason for _, reason in r.corruption]
    assert reasons[0] == "record too large"
    assert set(reasons[1:]) <= {"missing start of fragmented record"}
    assert sum(n for n, _ in r.corruption) == len(reference_log([os.urandom(3 * BLOCK)], HEADER + 1))


# ---- writer: reopen, checkpoints, limits --------------------------------------------------------
def test_reopen_truncates_torn_tail_and_continues(tmp_path, backend):
    first = [os.urandom(1500) for _ in range(4)]
    lsns = write_log(tmp_path, first + [os.urandom(2 * BLOCK)], backend)
    path = seg1(tmp_path)
    keep = len(reference_log(first))
    os.truncate(path, keep + BLOCK)                  # the big record is torn
    with wal.WalWriter(tmp_path, backend=backend) as w:
        assert w.recovered_tail_bytes == BLOCK
        assert w.durable_lsn == lsns[3] == lsn(1, keep)
        more = w.append(b"again")
        assert more > lsns[3]
        w.commit()
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == first + [b"again"]
    assert r.corruption == [] and r.tail_bytes == 0
    assert os.path.getsize(path) == keep + HEADER + 5


def test_reopen_continues_in_the_last_segment_and_block(tmp_path):
    write_log(tmp_path, [b"a" * (BLOCK - HEADER - 3)])
    with wal.WalWriter(tmp_path) as w:
        assert w.append(b"b") == lsn(1, BLOCK + HEADER + 1)    # zero-fills the 3-byte tail
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == [b"a" * (BLOCK - HEADER - 3), b"b"] and r.corruption == []


def test_truncate_before_deletes_only_whole_segments_below_lsn(tmp_path):
    with wal.WalWriter(tmp_path, segment_bytes=2 * BLOCK) as w:
        lsns = [w.append(bytes([i]) * 9000) for i in range(30)]
        w.commit()
        segs = w.segments()
        assert len(segs) >= 4
        third = segs[2][0]
        cut = next(l for l in lsns if wal.lsn_segment(l) == third)   # first record of seg 3
        removed = w.truncate_before(cut)
        assert removed == segs[:2]
        assert w.segments() == segs[2:]
        assert w.truncate_before(cut) == []
        assert [s for s, _ in w.truncate_before(w.durable_lsn + 1)] == [s for s, _ in segs[2:-1]]
        assert w.segments() == segs[-1:]                 # never the open segment
    records, r = read_all(tmp_path)
    assert [l for l, _ in records] == [l for l in lsns if wal.lsn_segment(l) == segs[-1][0]]
    assert r.corruption == []


def test_oversized_record_is_refused_and_changes_nothing(tmp_path):
    with wal.WalWriter(tmp_path, max_record_bytes=1000) as w:
        w.append(b"ok")
        before = (w.appended_lsn, w.pending_bytes)
        with pytest.raises(InvalidArgument, match="max_record_bytes=1000"):
            w.append(b"x" * 1001)
        assert (w.appended_lsn, w.pending_bytes) == before
    assert [p for _, p in read_all(tmp_path)[0]] == [b"ok"]


def test_full_pending_buffer_raises_busy_until_commit(tmp_path):
    with wal.WalWriter(tmp_path, max_record_bytes=1000, max_pending_bytes=3 * (HEADER + 1000)) as w:
        for _ in range(3):
            w.append(b"x" * 1000)
        with pytest.raises(Busy, match="commit first"):
            w.append(b"x" * 1000)
        w.commit()
        w.append(b"x" * 1000)


@pytest.mark.parametrize("kwargs, match", [
    ({"backend": "aio"}, "backend"),
    ({"segment_bytes": 1000}, "segment_bytes"),
    ({"segment_bytes": BLOCK, "max_record_bytes": BLOCK}, "does not fit"),
    ({"max_record_bytes": 1 << 20, "max_pending_bytes": 1000}, "max_pending_bytes"),
])
def test_bad_settings_are_refused_before_touching_the_directory(tmp_path, kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        wal.WalWriter(tmp_path / "d", **kwargs)
    assert not (tmp_path / "d").exists()


def test_second_writer_on_same_directory_is_refused(tmp_path):
    with wal.WalWriter(tmp_path):
        with pytest.raises(Busy, match="locked"):
            wal.WalWriter(tmp_path)
    wal.WalWriter(tmp_path).close()


def test_non_buffer_payload_is_a_type_error(tmp_path):
    with wal.WalWriter(tmp_path) as w:
        with pytest.raises(TypeError):
            w.append("text")
        assert w.pending_bytes == 0


def test_closed_writer_refuses_appends(tmp_path):
    w = wal.WalWriter(tmp_path)
    w.append(b"pending")
    w.close()                                            # commits what is pending
    with pytest.raises(InvalidArgument, match="closed"):
        w.append(b"x")
    assert [p for _, p in read_all(tmp_path)[0]] == [b"pending"]


# ---- backends ----------------------------------------------------------------------------------
def test_auto_backend_picks_io_uring_here(tmp_path):
    if not wal.HAVE_LIBURING:
        pytest.skip("built without liburing")
    if wal._io_uring_disabled():
        pytest.skip("io_uring disabled by /proc/sys/kernel/io_uring_disabled")
    with wal.WalWriter(tmp_path) as w:
        assert w.backend == "io_uring"
        assert w.stats()["backend"] == "io_uring"


def test_pwritev_backend_when_asked(tmp_path):
    with wal.WalWriter(tmp_path, backend="pwritev") as w:
        assert w.backend == "pwritev"


# ---- faults: an fsync or write error is fatal ----------------------------------------------------
def test_fsync_error_makes_every_later_call_raise_read_only(tmp_path, backend):
    with wal.WalWriter(tmp_path, backend=backend) as w:
        ok = w.append(b"durable")
        assert w.commit() == ok
        w.append(b"doomed")
        wal.set_fault("fsync", errno.EIO)
        with pytest.raises(ReadOnlyError, match="EIO") as first:
            w.commit()
        assert isinstance(first.value.__cause__, OSError) and first.value.__cause__.errno == errno.EIO
        wal.clear_faults()                               # no retry, even once the disk is fine
        for call in (lambda: w.append(b"x"), w.commit, lambda: w.truncate_before(1 << 40)):
            with pytest.raises(ReadOnlyError, match="EIO"):
                call()
        assert w.durable_lsn == ok
        assert w.failed.errno == errno.EIO


def test_enospc_on_write_is_fatal(tmp_path, backend):
    with wal.WalWriter(tmp_path, backend=backend) as w:
        w.append(b"x" * 100)
        wal.set_fault("enospc", 1)
        with pytest.raises(ReadOnlyError, match="ENOSPC"):
            w.commit()
        wal.clear_faults()
        with pytest.raises(ReadOnlyError, match="ENOSPC"):
            w.append(b"y")
        assert w.durable_lsn == lsn(1, 0)


def test_short_writes_are_continued_until_complete(tmp_path, backend):
    payloads = [os.urandom(n) for n in (10, 5000, 100_000, 3)]
    wal.set_fault("write_short", 777)
    lsns = write_log(tmp_path, payloads, backend)
    wal.clear_faults()
    records, r = read_all(tmp_path)
    assert [p for _, p in records] == payloads and [l for l, _ in records] == lsns
    with open(seg1(tmp_path), "rb") as f:
        assert f.read() == reference_log(payloads)


def test_unknown_fault_is_refused():
    with pytest.raises(InvalidArgument, match="unknown WAL fault"):
        wal.set_fault("disk_on_fire", 1)


# ---- group commit across threads -----------------------------------------------------------------
def test_concurrent_appends_and_commits_return_every_record_once_in_lsn_order(tmp_path, backend):
    n_threads, per_thread = 4, 300
    appended = []                                         # (lsn, payload) per thread, list.append is atomic
    stop = threading.Event()
    commits = []
    w = wal.WalWriter(tmp_path, backend=backend, segment_bytes=256 * 1024)

    def producer(tid):
        rng = random.Random(tid)
        for i in range(per_thread):
            payload = f"{tid}:{i}:".encode() + rng.randbytes(rng.choice([0, 50, 3000, 40_000]))
            appended.append((w.append(payload), payload))

    def committer():
        while not stop.is_set():
            before = w.appended_lsn
            durable = w.commit()
            assert durable >= before                       # everything appended before is covered
            commits.append(durable)

    c = threading.Thread(target=committer)
    c.start()
    threads = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    c.join()
    final = w.commit()
    w.close()
    assert commits == sorted(commits) and len(commits) > 1
    assert final == max(l for l, _ in appended)
    records, r = read_all(tmp_path)
    assert r.corruption == [] and r.tail_bytes == 0
    assert records == sorted(appended)                    # each exactly once, in lsn order
    assert len({l for l, _ in records}) == n_threads * per_thread


# ---- property test against a list oracle ---------------------------------------------------------
ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3 * BLOCK)),
    st.tuples(st.just("commit"), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0))), max_size=40)


def _run_ops(directory, program, seed):
    rng = random.Random(seed)
    durable = []
    pending = []
    w = wal.WalWriter(directory, segment_bytes=4 * BLOCK, backend="pwritev")
    for op, n in program:
        if op == "append":
            p = rng.randbytes(n)
            pending.append((w.append(p), p))
        elif op == "commit":
            w.commit()
            durable += pending
            pending = []
        else:
            # the process dies: committed data stays, pending records are never written
            sizes = {seq: os.path.getsize(p) for seq, p in w.segments()}
            w = None                                       # dealloc: no commit, lock released
            assert {seq: os.path.getsize(p) for seq, p in wal.list_segments(directory)} == sizes
            w = wal.WalWriter(directory, segment_bytes=4 * BLOCK, backend="pwritev")
            pending = []
    w.close()                                              # close() commits what is pending
    durable += pending
    records, r = read_all(directory)
    assert records == durable
    assert r.corruption == [] and r.tail_bytes == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, seed=st.integers(0, 2**32))
def test_log_equals_committed_records_oracle(tmp_path_factory, program, seed):
    _run_ops(tmp_path_factory.mktemp("wal"), program, seed)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops, seed=st.integers(0, 2**32))
def test_log_equals_committed_records_oracle_long(tmp_path_factory, program, seed):
    _run_ops(tmp_path_factory.mktemp("wal"), program, seed)


@pytest.mark.slow
@given(data=st.binary(max_size=4 * BLOCK))
@settings(max_examples=3000, deadline=None)
def test_reader_never_raises_on_arbitrary_bytes(data):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "000000000001.log")
        with open(path, "wb") as f:
            f.write(data)
        r = wal.WalReader(path)
        records = list(r)
        accounted = sum(n for n, _ in r.corruption) + r.tail_bytes
        assert accounted <= len(data)
        assert all(isinstance(p, bytes) for _, p in records)
