"""PersistentArtIndex: the shared backend behaviour, plus WAL + checkpoint recovery."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.errors import Busy, InvalidArgument
from quillcache.index.persistent import (
    CHECKPOINT_NAME, CorruptCheckpoint, CorruptLog, PersistentArtIndex, encode_put,
)
from quillcache.model import CacheTier, MemoryIndex
from tests.index import test_backends as shared
from tests.index.test_backends import SCOPE, key, ops, res, run_ops

# ---------------------------------------------------------------- the shared behaviour tests


@pytest.fixture(params=[False, True], ids=["group-commit", "sync-every"])
def backend(request, tmp_path):
    index = PersistentArtIndex(tmp_path / "idx", sync_every=request.param)
    yield index
    index.close()


for _name in dir(shared):
    if _name.startswith("test_") and "art_" not in _name and _name != "test_every_backend_answers_like_the_reference":
        globals()[_name] = getattr(shared, _name)


def reopen(index, **kw):
    index.close()
    return PersistentArtIndex(index.directory, **kw)


def fill(index, n=60):
    for i in range(n):
        index.put(res(key(f"b{i}", f"p{i % 4}", index=i % 3), f"w{i % 3}",
                      (CacheTier.HBM, CacheTier.CPU_DRAM)[i % 2], nbytes=i, last_access_ms=i * 10,
                      ref_count=i % 5, pinned=bool(i % 7 == 0)))


# ---------------------------------------------------------------- recovery


def test_put_remove_and_clear_worker_survive_reopen(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index)
    assert index.remove_block(SCOPE, "w0", "b3") == 1
    assert index.clear_worker("w1") == 20
    index.sync()
    expected = index.snapshot()
    again = reopen(index)
    assert again.snapshot() == expected and len(again) == 39
    assert again.recovery.replayed == 60 + 1 + 20 and again.recovery.checkpoint_records == 0
    assert again.metrics().resident_bytes == sum(r.bytes for r in expected)
    again.close()


def test_checkpoint_plus_tail_replay_equals_the_in_memory_state(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index)
    size = index.checkpoint()
    assert size > 0 and os.path.exists(tmp_path / CHECKPOINT_NAME)
    index.put(res(key("tail"), "w9"))
    index.clear_worker("w2")
    index.remove_block(SCOPE, "w0", "b0")
    expected = index.snapshot()
    scans = [index.prefix_scan(SCOPE, f"p{i}") for i in range(4)]
    again = reopen(index)
    assert again.recovery.checkpoint_records == 60
    assert again.recovery.replayed == 1 + 20 + 1 and again.recovery.skipped == 60
    # lazy: the side maps answer before any record was decoded
    assert again.clear_worker("nobody") == 0
    assert again.remove_block(SCOPE, "w0", "b6") == 1
    expected = [r for r in expected if not (r.worker_id == "w0" and r.key.block_hash == "b6")]
    assert [again.prefix_scan(SCOPE, f"p{i}") for i in range(4)] != [] and again.snapshot() == expected
    assert again.clear_worker("w1") == 20
    again.close()
    third = PersistentArtIndex(tmp_path)
    assert third.snapshot() == [r for r in expected if r.worker_id != "w1"]
    assert scans[0] and third.metrics().resident_blocks == len(third)
    third.close()


def test_clear_after_a_checkpoint_survives_reopen(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 10)
    index.checkpoint()
    index.clear()
    index.put(res(key("z")))
    again = reopen(index)
    assert again.snapshot() == [res(key("z"))]
    again.close()


def test_checkpoint_truncates_the_wal_segments_it_covers(tmp_path):
    index = PersistentArtIndex(tmp_path, segment_bytes=32768)
    fill(index, 600)          # ~50 KiB of records: at least two segments
    index.sync()
    wal = tmp_path / "wal"
    before = sorted(os.listdir(wal))
    assert len(before) >= 2
    index.checkpoint()
    after = sorted(os.listdir(wal))
    assert len(after) == 1 and after[0] == before[-1]
    expected = index.snapshot()
    again = reopen(index, segment_bytes=32768)
    assert again.snapshot() == expected
    again.close()


def test_automatic_checkpoint_after_checkpoint_wal_bytes(tmp_path):
    index = PersistentArtIndex(tmp_path, checkpoint_wal_bytes=2000)
    fill(index, 60)        # ~3.4 KiB of WAL
    assert index.stats()["checkpoints"] == 0
    index.sync()
    assert index.stats()["checkpoints"] == 1 and os.path.exists(tmp_path / CHECKPOINT_NAME)
    index.close()


def test_torn_wal_tail_is_dropped_and_the_rest_recovered(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 10)
    index.sync()
    expected = index.snapshot()
    index.put(res(key("last"), "w7"))
    index.close()
    seg = sorted((tmp_path / "wal").iterdir())[-1]
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 5)              # the writer died inside the last record
    again = PersistentArtIndex(tmp_path)
    assert again.snapshot() == expected
    assert again.recovery.corruption == []
    assert again.recovery.tail_bytes == len(encode_put(res(key("last"), "w7"))) + 7 - 5
    again.put(res(key("after"), "w7"))     # appending continues after the cut
    again.close()
    third = PersistentArtIndex(tmp_path)
    assert third.locate(key("after")) == [res(key("after"), "w7")]
    third.close()


def test_corrupt_record_inside_the_log_is_refused_or_dropped_when_not_strict(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 10)
    index.close()
    seg = sorted((tmp_path / "wal").iterdir())[-1]
    data = bytearray(seg.read_bytes())
    data[20] ^= 0xFF                       # inside the first record's payload
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptLog, match="checksum mismatch"):
        PersistentArtIndex(tmp_path)
    # strict=False drops the rest of the 32 KiB block (all ten records) and says so
    lax = PersistentArtIndex(tmp_path, strict=False)
    assert len(lax) == 0 and lax.recovery.corruption == [(len(data), "checksum mismatch")]
    lax.close()


@pytest.mark.parametrize("where", ["header", "body", "truncated"])
def test_corrupted_checkpoint_is_refused_with_a_clear_error(tmp_path, where):
    index = PersistentArtIndex(tmp_path)
    fill(index, 30)
    index.checkpoint()
    index.close()
    path = tmp_path / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    if where == "header":
        data[20] ^= 1
    elif where == "body":
        data[len(data) // 2] ^= 1
    else:
        del data[-8:]
    path.write_bytes(bytes(data))
    message = {"header": "header checksum mismatch", "body": "body checksum mismatch",
               "truncated": "header says"}[where]
    with pytest.raises(CorruptCheckpoint, match=message):
        PersistentArtIndex(tmp_path)
    # refused, not half-loaded: the directory lock was released and nothing was changed
    assert path.read_bytes() == bytes(data)
    with pytest.raises(CorruptCheckpoint):
        PersistentArtIndex(tmp_path)


def test_leftover_temp_checkpoint_is_ignored_and_removed(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 5)
    index.close()
    (tmp_path / (CHECKPOINT_NAME + ".tmp")).write_bytes(b"half written")
    again = PersistentArtIndex(tmp_path)
    assert len(again) == 5 and not (tmp_path / (CHECKPOINT_NAME + ".tmp")).exists()
    again.close()


def test_reopen_is_idempotent(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 40)
    index.checkpoint()
    fill(index, 50)
    index.clear_worker("w0")
    expected = index.snapshot()
    index.close()
    wal_bytes = sorted((p.name, p.stat().st_size) for p in (tmp_path / "wal").iterdir())
    for _ in range(3):
        again = PersistentArtIndex(tmp_path)
        assert again.snapshot() == expected
        assert again.metrics().bytes_written == 0        # recovery writes nothing
        again.close()
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "wal").iterdir()) == wal_bytes


def test_write_amplification_is_reported(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 100)
    index.sync()
    logical = index.logical_bytes
    assert logical == sum(len(encode_put(r)) for r in index.snapshot())
    wal_only = index.metrics().bytes_written
    assert logical < wal_only < logical * 1.25     # 7-byte framing per record
    ck = index.checkpoint()
    assert index.metrics().bytes_written == wal_only + ck
    assert index.write_amplification == pytest.approx((wal_only + ck) / logical)
    index.close()


def test_a_second_opener_of_the_directory_is_refused(tmp_path):
    index = PersistentArtIndex(tmp_path)
    with pytest.raises(Busy):
        PersistentArtIndex(tmp_path)
    index.close()


def test_bad_input_is_refused_and_nothing_is_logged(tmp_path):
    index = PersistentArtIndex(tmp_path)
    index.put(res(key("ok")))
    before = index.stats()["wal"]["appended_lsn"]
    for bad in (res(key("b"), "w" * 256), res(key("b"), nbytes=-1),
                res(key("b"), ref_count=1 << 32), res(key("b"), last_access_ms=1 << 63)):
        with pytest.raises(InvalidArgument):
            index.put(bad)
    assert index.stats()["wal"]["appended_lsn"] == before and len(index) == 1
    again = reopen(index)
    assert again.snapshot() == [res(key("ok"))]
    again.close()


def test_materialize_decodes_everything_and_answers_the_same(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 50)
    index.checkpoint()
    expected = index.snapshot()
    again = reopen(index)
    assert again.stats()["lazy_slots"] == 50
    again.materialize()
    assert again.stats()["lazy_slots"] == 0 and type(again._slots) is list
    assert again.snapshot() == expected and again.remove_block(SCOPE, "w1", "b1") == 1
    again.close()


# ---------------------------------------------------------------- equivalence across reopen

histories = (st.lists(ops, max_size=40), st.booleans(), st.lists(ops, max_size=30),
             st.lists(ops, max_size=20))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(*histories)
def test_reopened_index_answers_like_the_reference(tmp_path_factory, first, checkpoint, tail, after):
    check_reopen(tmp_path_factory, first, checkpoint, tail, after)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(*histories)
def test_reopened_index_answers_like_the_reference_long(tmp_path_factory, first, checkpoint, tail, after):
    check_reopen(tmp_path_factory, first, checkpoint, tail, after)


def check_reopen(tmp_path_factory, first, checkpoint, tail, after):
    """ops, maybe a checkpoint, more ops (the WAL tail), reopen (checkpoint + replay, lazy),
    then ops on the reopened index and another reopen: always the reference's answers."""
    ref = MemoryIndex()
    path = tmp_path_factory.mktemp("p")
    index = PersistentArtIndex(path)
    assert run_ops(index, first)[:-2] == run_ops(ref, first)[:-2]
    if checkpoint:
        index.checkpoint()
    run_ops(index, tail)
    run_ops(ref, tail)
    index.close()
    index = PersistentArtIndex(path)
    assert len(index) == len(ref)
    got = run_ops(index, after)[:-2]         # metrics counters are per process
    assert got == run_ops(ref, after)[:-2] and index.snapshot() == ref.snapshot()
    assert index.metrics().resident_bytes == ref.metrics().resident_bytes
    index.close()
    final = PersistentArtIndex(path)
    assert final.snapshot() == ref.snapshot()
    final.close()


def test_replayed_tail_on_checkpointed_keys_is_decoded_on_first_touch(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 30)
    index.checkpoint()
    k = key("b4", "p0", index=1)
    index.put(res(k, "w0", CacheTier.HBM, nbytes=7))       # a new worker on a checkpointed key
    index.put(res(k, "w1", CacheTier.HBM, nbytes=8))       # replaces the checkpointed record
    index.remove_block(SCOPE, "w0", "b0")                  # drops a checkpointed key entirely
    index.put(res(key("b0", "p0"), "w2"))                  # and the same key comes back
    expected = index.snapshot()
    again = reopen(index)
    assert again.stats()["lazy_slots"] == len(again._tree)  # nothing decoded by the replay
    assert again.locate(k) == [res(k, "w0", CacheTier.HBM, nbytes=7), res(k, "w1", CacheTier.HBM, nbytes=8)]
    assert again.remove_block(SCOPE, "w2", "b0") == 1 and again.locate(key("b0", "p0")) == []
    assert again.snapshot() == [r for r in expected if r.key != key("b0", "p0")]
    again.checkpoint()                                       # copies undecoded groups as they are
    expected = again.snapshot()
    third = reopen(again)
    assert third.snapshot() == expected
    third.close()


def test_a_wal_behind_the_checkpoint_is_refused(tmp_path):
    index = PersistentArtIndex(tmp_path)
    fill(index, 10)
    index.checkpoint()
    index.close()
    for seg in (tmp_path / "wal").iterdir():
        seg.unlink()                       # someone removed the log: new lsns would restart
    with pytest.raises(CorruptLog, match="before the checkpoint"):
        PersistentArtIndex(tmp_path)
