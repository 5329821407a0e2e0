"""LsmIndex (RocksDB via rocksdict, a bench extra): the shared backend behaviour + its own."""
import pytest

pytest.importorskip("rocksdict")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.lsm_index import LsmIndex
from quillcache.index.persistent import encode_put
from quillcache.model import CacheTier, MemoryIndex
from tests.index import test_backends as shared
from tests.index.test_backends import SCOPE, key, ops, res, run_ops


@pytest.fixture
def backend(tmp_path):
    index = LsmIndex(tmp_path / "db")
    yield index
    index.close()


for _name in dir(shared):
    if _name.startswith("test_") and "art_" not in _name and _name != "test_every_backend_answers_like_the_reference":
        globals()[_name] = getattr(shared, _name)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=50))
def test_lsm_answers_like_the_reference(tmp_path_factory, sequence):
    index = LsmIndex(tmp_path_factory.mktemp("lsm"))
    try:
        assert run_ops(index, sequence) == run_ops(MemoryIndex(), sequence)
    finally:
        index.close()


def test_state_survives_reopen(tmp_path):
    index = LsmIndex(tmp_path)
    for i in range(30):
        index.put(res(key(f"b{i}", f"p{i % 3}"), f"w{i % 2}", nbytes=i))
    index.clear_worker("w1")
    expected = index.snapshot()
    index.close()
    again = LsmIndex(tmp_path)
    assert again.snapshot() == expected and len(again) == 15
    assert again.metrics().resident_bytes == sum(r.bytes for r in expected)
    again.close()


def test_worker_ids_sort_like_strings_even_with_nul_and_extensions(tmp_path):
    index = LsmIndex(tmp_path)
    k = key()
    for w in ("w10", "w1\x00", "w1", "w2"):
        index.put(res(k, w))
    assert [r.worker_id for r in index.locate(k)] == ["w1", "w1\x00", "w10", "w2"]
    assert index.clear_worker("w1") == 1 and [r.worker_id for r in index.locate(k)] == ["w1\x00", "w10", "w2"]
    index.close()


def test_write_amplification_comes_from_rocksdb_statistics(tmp_path):
    index = LsmIndex(tmp_path)
    records = [res(key(f"b{i}", f"p{i % 7}"), f"w{i % 4}", CacheTier.CPU_DRAM, nbytes=i) for i in range(2000)]
    for r in records:
        index.put(r)
    assert index.logical_bytes == sum(len(encode_put(r)) for r in records)
    stats = index.rocksdb_stats()
    assert stats["rocksdb.wal.bytes"] > index.logical_bytes      # R + W + meta rows per put
    before = index.physical_bytes
    index.flush()
    after = index.rocksdb_stats()
    assert after["rocksdb.flush.write.bytes"] > 0
    flushed = after["rocksdb.flush.write.bytes"] - stats.get("rocksdb.flush.write.bytes", 0)
    assert index.physical_bytes == before + flushed
    assert index.write_amplification > 1.0 and index.metrics().bytes_written == index.physical_bytes
    index.close()


def test_bad_worker_id_is_refused_and_nothing_written(tmp_path):
    index = LsmIndex(tmp_path)
    with pytest.raises(ValueError):
        index.put(res(key(), "w" * 300))
    assert len(index) == 0 and index.snapshot() == [] and index.prefix_scan(SCOPE, "p0") == []
    index.close()
