"""Behaviour every IndexBackend must have; each test runs on every backend in BACKENDS.

To add a backend, append a (name, factory) pair to BACKENDS; a persistent backend's
factory may use the ``tmp_path`` it is given.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.index.art import ArtIndex
from quillcache.model import (
    CacheResidency, CacheTier, IdentityScope, IndexBackend, IndexMetrics, KvBlockKey, MemoryIndex,
    sort_residencies,
)

BACKENDS = [
    ("memory", lambda tmp_path: MemoryIndex()),
    ("art", lambda tmp_path: ArtIndex()),
]


@pytest.fixture(params=[factory for _, factory in BACKENDS], ids=[name for name, _ in BACKENDS])
def backend(request, tmp_path):
    return request.param(tmp_path)


SCOPE = IdentityScope("llama-3-8b", "tok-a", None, "acme")


def key(block_hash="b0", prefix="p0", index=0, scope=SCOPE, tokens=64):
    return KvBlockKey(scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id,
                      prefix, block_hash, index, tokens)


def res(k, worker="w1", tier=CacheTier.HBM, nbytes=1000, **kw):
    return CacheResidency(k, worker, tier, nbytes, **kw)


def test_backend_satisfies_the_protocol(backend):
    assert isinstance(backend, IndexBackend)
    assert backend.name and isinstance(backend.persistent, bool)


def test_put_replaces_the_record_of_the_same_worker_and_tier(backend):
    k = key()
    backend.put(res(k, nbytes=1, last_access_ms=1))
    backend.put(res(k, nbytes=2, last_access_ms=2))
    assert backend.locate(k) == [res(k, nbytes=2, last_access_ms=2)]
    assert len(backend) == 1
    assert backend.metrics().resident_bytes == 2


def test_a_key_holds_one_record_per_worker_and_tier(backend):
    k = key()
    records = [res(k, "w2", CacheTier.CPU_DRAM), res(k, "w1", CacheTier.LOCAL_SSD),
               res(k, "w1", CacheTier.HBM), res(k, "w2", CacheTier.HBM)]
    for r in records:
        backend.put(r)
    assert sort_residencies(backend.locate(k)) == sort_residencies(records)
    assert len(backend) == 4


def test_locate_of_an_unknown_key_is_empty_and_other_keys_do_not_answer(backend):
    backend.put(res(key("b0")))
    assert backend.locate(key("b1")) == []
    assert backend.locate(key("b0", tokens=32)) == []      # token_count is part of the key
    assert backend.locate(key("b0", index=1)) == []


def test_prefix_scan_returns_that_scope_and_prefix_in_key_worker_tier_order(backend):
    mine = [res(key(f"b{i}", "p0", index=i), w, t)
            for i in (3, 1, 2) for w, t in (("w2", CacheTier.HBM), ("w1", CacheTier.CPU_DRAM))]
    for r in mine:
        backend.put(r)
    got = backend.prefix_scan(SCOPE, "p0")
    assert got == sort_residencies(mine)
    assert [r.key.block_index for r in got] == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("other", [
    IdentityScope("llama-3-8b", "tok-a", "lora-x", "acme"),     # an adapter vs none
    IdentityScope("llama-3-8b", "tok-a", None, "globex"),       # another tenant
    IdentityScope("llama-3-8b", "tok-b", None, "acme"),         # another tokenizer
    IdentityScope("llama-3-70b", "tok-a", None, "acme"),        # another model
    IdentityScope("llama-3-8b", "tok-a", None, "acme2"),        # tenant id extends ours
], ids=["adapter", "tenant", "tokenizer", "model", "tenant-extension"])
def test_prefix_scan_does_not_leak_other_scopes(backend, other):
    ours = res(key("b0", "p0"))
    theirs = res(key("b0", "p0", scope=other))
    backend.put(ours)
    backend.put(theirs)
    assert backend.prefix_scan(SCOPE, "p0") == [ours]
    assert backend.prefix_scan(other, "p0") == [theirs]


def test_prefix_scan_does_not_leak_a_prefix_hash_that_extends_the_asked_one(backend):
    short, long_ = res(key("b0", "ab")), res(key("b0", "abc"))
    other = res(key("b0", "b"))
    for r in (long_, short, other):
        backend.put(r)
    assert backend.prefix_scan(SCOPE, "ab") == [short]
    assert backend.prefix_scan(SCOPE, "abc") == [long_]
    assert backend.prefix_scan(SCOPE, "a") == []


def test_remove_block_drops_only_that_workers_records_in_that_scope(backend):
    other_scope = IdentityScope("llama-3-8b", "tok-a", "lora-x", "acme")
    k = key("b0", "p0")
    backend.put(res(k, "w1", CacheTier.HBM))
    backend.put(res(k, "w1", CacheTier.CPU_DRAM))
    backend.put(res(k, "w2", CacheTier.HBM))
    backend.put(res(key("b0", "p1", index=3), "w1"))      # same block hash, other prefix
    backend.put(res(key("b0", "p0", scope=other_scope), "w1"))
    backend.put(res(key("b9", "p0"), "w1"))
    assert backend.remove_block(SCOPE, "w1", "b0") == 3     # both tiers under p0, and p1
    assert backend.locate(k) == [res(k, "w2", CacheTier.HBM)]
    assert backend.locate(key("b0", "p0", scope=other_scope)) != []
    assert backend.locate(key("b9", "p0")) != []
    assert backend.remove_block(SCOPE, "w1", "b0") == 0
    assert backend.remove_block(SCOPE, "w3", "b9") == 0
    assert len(backend) == 3


def test_clear_worker_removes_all_its_records_and_nothing_else(backend):
    for i in range(5):
        backend.put(res(key(f"b{i}"), "w1", CacheTier.HBM))
        backend.put(res(key(f"b{i}"), "w1", CacheTier.LOCAL_SSD))
    backend.put(res(key("b0"), "w2"))
    assert backend.clear_worker("w1") == 10
    assert backend.clear_worker("w1") == 0
    assert backend.clear_worker("nobody") == 0
    assert backend.snapshot() == [res(key("b0"), "w2")]
    assert backend.prefix_scan(SCOPE, "p0") == [res(key("b0"), "w2")]


def test_clear_empties_the_index(backend):
    for i in range(10):
        backend.put(res(key(f"b{i}")))
    backend.clear()
    assert len(backend) == 0 and backend.snapshot() == []
    assert backend.prefix_scan(SCOPE, "p0") == [] and backend.locate(key("b1")) == []
    assert backend.metrics().resident_blocks == 0 and backend.metrics().resident_bytes == 0
    backend.put(res(key("b1")))
    assert len(backend) == 1


def test_snapshot_is_every_record_in_sort_residencies_order(backend):
    records = [res(key(f"b{i % 4}", f"p{i % 3}", scope=s), w, t, nbytes=i)
               for i, (s, w, t) in enumerate(
                   (s, w, t) for s in (SCOPE, IdentityScope("m", "t", "a", "x"))
                   for w in ("w2", "w1") for t in (CacheTier.HBM, CacheTier.OBJECT_STORE))]
    for r in reversed(records):
        backend.put(r)
    assert backend.snapshot() == sort_residencies(records)
    assert len(backend) == len(records)


def test_metrics_count_puts_removes_scans_and_bytes(backend):
    backend.put(res(key("b0"), nbytes=100))
    backend.put(res(key("b0"), nbytes=300))                # replaces: still one record
    backend.put(res(key("b1"), "w2", nbytes=50))
    backend.prefix_scan(SCOPE, "p0")
    backend.remove_block(SCOPE, "w2", "b1")
    m = backend.metrics()
    assert isinstance(m, IndexMetrics)
    assert (m.resident_blocks, m.resident_bytes, m.puts, m.removes, m.prefix_scans) == (1, 300, 3, 1, 1)
    assert m.memory_bytes >= 0 and m.bytes_written >= 0


def test_art_metrics_report_the_trees_memory():
    index = ArtIndex()
    assert index.metrics().memory_bytes == 0
    for i in range(100):
        index.put(res(key(f"b{i}")))
    assert index.metrics().memory_bytes > 100 * 40
    index.clear_worker("w1")
    assert index.metrics().memory_bytes == 0


def test_art_dump_and_bulk_load_round_trip():
    index = ArtIndex()
    for i in range(50):
        index.put(res(key(f"b{i}", f"p{i % 5}"), f"w{i % 3}", nbytes=i))
    copy = ArtIndex.from_records(index.iter_records())
    assert copy.snapshot() == index.snapshot()
    assert copy.metrics().resident_bytes == index.metrics().resident_bytes
    assert copy.metrics().puts == 0


# --------------------------------------------------------------------------- equivalence

scopes = st.sampled_from([SCOPE, IdentityScope("llama-3-8b", "tok-a", "lora", "acme"),
                          IdentityScope("m", "t", None, "acme2")])
hashes = st.sampled_from(["a", "ab", "abc", "b", "x" * 40])
workers = st.sampled_from(["w1", "w2", "w10"])
tiers = st.sampled_from(list(CacheTier))
keys = st.builds(lambda s, p, b, i: key(b, p, i, s), scopes, hashes, hashes, st.integers(0, 2))
ops = st.one_of(
    st.tuples(st.just("put"), keys, workers, tiers, st.integers(0, 1 << 40)),
    st.tuples(st.just("locate"), keys),
    st.tuples(st.just("scan"), scopes, hashes),
    st.tuples(st.just("remove_block"), scopes, workers, hashes),
    st.tuples(st.just("clear_worker"), workers),
    st.tuples(st.just("clear")),
)


def run_ops(index, sequence):
    answers = []
    for op, *args in sequence:
        if op == "put":
            k, w, t, n = args
            answers.append(index.put(CacheResidency(k, w, t, n)))
        elif op == "locate":
            answers.append(sort_residencies(index.locate(args[0])))
        elif op == "scan":
            answers.append(index.prefix_scan(*args))
        elif op == "remove_block":
            answers.append(index.remove_block(*args))
        elif op == "clear_worker":
            answers.append(index.clear_worker(*args))
        else:
            answers.append(index.clear())
        answers.append(len(index))
    m = index.metrics()
    answers.append((m.resident_blocks, m.resident_bytes, m.puts, m.removes, m.prefix_scans))
    answers.append(index.snapshot())
    return answers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=50))
def test_every_backend_answers_like_the_reference(tmp_path_factory, sequence):
    expected = run_ops(MemoryIndex(), sequence)
    for name, factory in BACKENDS:
        got = run_ops(factory(tmp_path_factory.mktemp(name)), sequence)
        assert got == expected, name
