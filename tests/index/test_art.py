"""ArtIndex as the store's residency record: one holder's records, LIST pages, the guard's
block lookup -- each against a simple oracle, in memory and after a persistent reopen."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.index.art import ArtIndex
from quillcache.index.persistent import PersistentArtIndex
from quillcache.model import CacheResidency, CacheTier, KvBlockKey, encode_key, encode_scope, encode_scope_prefix

DRAM, SSD = CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD


def key(i, prefix="p", tenant="t", model="m", block=None):
    return KvBlockKey(model, "tok", None, tenant, prefix, block or f"b{i}", i)


def test_set_holder_replaces_only_that_holders_records():
    index = ArtIndex()
    k = key(1)
    ek = encode_key(k)
    index.put(CacheResidency(k, "other", SSD, 10))
    assert index.set_holder(k, ek, "me", (DRAM,), 100)
    assert index.holder(ek, "me") == (100, (DRAM,))
    assert not index.set_holder(k, ek, "me", (DRAM,), 100)        # unchanged: nothing done
    assert index.set_holder(k, ek, "me", (DRAM, SSD), 100)
    assert index.holder(ek, "me") == (100, (DRAM, SSD))
    assert index.set_holder(k, ek, "me", (SSD,), 120)
    assert index.holder(ek, "me") == (120, (SSD,))
    assert len(index) == 2 and index.metrics().resident_bytes == 130
    assert index.set_holder(k, ek, "me", (), 0)
    assert index.holder(ek, "me") == (0, ())
    assert [r.worker_id for r in index.locate(k)] == ["other"]
    assert not index.set_holder(key(2), encode_key(key(2)), "me", (), 0)   # absent: no-op
    assert index.keys_of("me") == set() and index.keys_of("other") == {ek}


def test_block_keys_looks_only_at_the_tenant_asked():
    index = ArtIndex()
    same = [key(1, tenant="a"), key(2, tenant="a", model="m2", block="b1"), key(3, tenant="b", block="b1")]
    for k in same:
        index.put(CacheResidency(k, "me", DRAM, 1))
    index.put(CacheResidency(key(4, tenant="a", block="b1"), "node-b", DRAM, 1))
    assert sorted(k.block_index for k in index.block_keys("b1", "a", "me")) == [1, 2]
    assert [k.block_index for k in index.block_keys("b1", "b", "me")] == [3]
    assert index.block_keys("b1", "c", "me") == []
    assert sorted(index.block_tenants("b1", "me")) == ["a", "b"]
    index.remove_block(same[2].scope, "me", "b1")
    assert index.block_keys("b1", "b", "me") == [] and sorted(index.block_tenants("b1", "me")) == ["a"]


ops_st = st.lists(st.tuples(st.booleans(), st.sampled_from(["a", "b", "c"]), st.sampled_from(["h0", "h1"]),
                            st.integers(0, 3)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops_st)
def test_block_hash_lookups_match_a_dict_through_the_one_key_form(ops):
    # adds and removes of keys sharing block hashes across tenants, against a set of keys:
    # the map moves between its one-key form (the key's bytes) and its per-tenant form
    index, held = ArtIndex(), set()
    for add, tenant, block, i in ops:
        k = key(i, tenant=tenant, block=block)
        index.set_holder(k, encode_key(k), "me", (DRAM,) if add else (), 1)
        (held.add if add else held.discard)(k)
    for block in ("h0", "h1"):
        want = {t: sorted(k.block_index for k in held if k.block_hash == block and k.tenant_id == t)
                for t in ("a", "b", "c")}
        for t in ("a", "b", "c"):
            assert sorted(k.block_index for k in index.block_keys(block, t, "me")) == want[t]
        assert sorted(index.block_tenants(block, "me")) == sorted(t for t in want if want[t])
        form = index._by_block.get(block)
        n = sum(len(v) for v in want.values())
        assert (form is None) == (n == 0) and (type(form) is bytes) == (n == 1), (form, want)


keys_st = st.lists(st.tuples(st.sampled_from(["p0", "p1", "p2"]), st.integers(0, 50),
                             st.sampled_from(["me", "node-b"])), max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys_st, st.integers(1, 9), st.sampled_from([None, "p1"]))
def test_pages_concatenate_to_the_sorted_keys_of_the_holder(items, limit, prefix_hash):
    index = ArtIndex()
    for p, i, holder in items:
        index.put(CacheResidency(key(i, prefix=p), holder, DRAM, 1))
    k0 = key(0)
    prefix = encode_scope(k0) if prefix_hash is None else encode_scope_prefix(k0, prefix_hash)
    want = sorted({encode_key(key(i, prefix=p)) for p, i, h in items if h == "me"})
    want = [ek for ek in want if ek.startswith(prefix)]
    got, cursor = [], b""
    while True:
        page, more = index.page(prefix, cursor, limit, "me")
        assert len(page) <= limit
        got += page
        if not more:
            break
        assert len(page) == limit
        cursor = page[-1]
    assert got == want


def test_persistent_reopen_keeps_holders_pages_and_block_lookups_but_not_volatile_tiers(tmp_path):
    with PersistentArtIndex(tmp_path, volatile_tiers=(DRAM,)) as index:
        for i in range(10):
            k = key(i, block="shared" if i < 3 else None)
            index.set_holder(k, encode_key(k), "me", (DRAM, SSD) if i % 2 else (DRAM,), 100 + i)
        index.checkpoint()
        k = key(20, tenant="t2", block="shared")                 # after the checkpoint: replayed
        index.set_holder(k, encode_key(k), "me", (SSD,), 7)
        index.sync()
    with PersistentArtIndex(tmp_path, volatile_tiers=(DRAM,)) as again:
        # only the SSD records came back (odd i, and key 20)
        assert again.holder(encode_key(key(3)), "me") == (103, (SSD,))
        assert again.holder(encode_key(key(2)), "me") == (0, ())
        assert len(again) == 6
        assert sorted(k.block_index for k in again.block_keys("shared", "t", "me")) == [1]
        assert [k.block_index for k in again.block_keys("shared", "t2", "me")] == [20]
        page, more = again.page(encode_scope(key(0)), b"", 3, "me")
        mine = [key(i, block="shared" if i < 3 else None) for i in (1, 3, 5, 7, 9)]
        assert page == sorted(encode_key(k) for k in mine)[:3] and more


def test_persistent_index_with_an_owner_keeps_only_the_owners_records_across_a_reopen(tmp_path):
    """A pool's home keeps other nodes' records in the store's index (cluster/records.py):
    neither the log nor a checkpoint carries them, whichever tier they name."""
    def fill(index, lo, hi):
        for i in range(lo, hi):
            k = key(i)
            index.set_holder(k, encode_key(k), "me", (SSD,), 100 + i)
            index.set_holder(k, encode_key(k), "other@2a", (SSD,), 100 + i)
    with PersistentArtIndex(tmp_path, owner="me") as index:
        fill(index, 0, 5)
        index.checkpoint()
        fill(index, 5, 8)                                         # in the log only
        index.clear_worker("other@2a")                            # dropped: nothing to log either
        fill(index, 8, 10)
        index.sync()
        assert index.records_of("other@2a") == 2 and len(index) == 12
    with PersistentArtIndex(tmp_path, owner="me") as again:
        assert again.records_of("me") == 10 and again.records_of("other@2a") == 0
        assert {r.worker_id for r in again.iter_records()} == {"me"} and len(again) == 10


def test_page_refuses_a_limit_below_one():
    with pytest.raises(ValueError):
        ArtIndex().page(b"", b"", 0)


def _blob(pairs):
    """(key blob, key_off, lengths) of [(key, length)]: the SSD tier's block_table shape."""
    eks = [encode_key(k) for k, _ in pairs]
    off = np.zeros(len(eks) + 1, np.uint64)
    np.cumsum([len(e) for e in eks], out=off[1:])
    return b"".join(eks), off, np.array([n for _, n in pairs], np.uint32)


@pytest.mark.parametrize("decoded", [False, True])
def test_agree_holder_makes_the_holders_records_exactly_the_blob(tmp_path, decoded):
    """The store's start-up check, lazily (numpy over the checkpoint's records, no key
    decoded unless it disagrees) and decoded (the plain ArtIndex path: the oracle)."""
    with PersistentArtIndex(tmp_path) as index:
        for i in range(30):
            k = key(i)
            index.set_holder(k, encode_key(k), "me" if i % 3 else "node-b", (SSD,), 100 + i)
        index.put(CacheResidency(key(1), "node-b", SSD, 5))     # two holders of one key
        index.checkpoint()
        for i in (2, 30):                                        # replayed after the checkpoint
            k = key(i)
            index.set_holder(k, encode_key(k), "me", (SSD,), 7)
        index.sync()
    # what the SSD tier holds: most agree, key 4 has another size, key 5 has no block,
    # key 40 has no record, key 3 (node-b's) is ours too now
    blocks = [(key(i), 100 + i) for i in range(1, 30) if i % 3 and i not in (2, 4, 5)]
    blocks += [(key(2), 7), (key(30), 7), (key(4), 999), (key(40), 1), (key(3), 103)]
    with PersistentArtIndex(tmp_path) as again:
        again.locate(key(7))                                     # one record decoded, the rest lazy
        if decoded:
            again.materialize()
        got = again.agree_holder("me", SSD, *_blob(blocks))
        assert got == {"agreed": len(blocks) - 3, "added": 2, "resized": 1, "dropped": 1}
        assert again.holder(encode_key(key(4)), "me") == (999, (SSD,))
        assert again.holder(encode_key(key(5)), "me") == (0, ())
        assert again.holder(encode_key(key(40)), "me") == (1, (SSD,))
        assert again.keys_of("me") == {encode_key(k) for k, _ in blocks}
        assert [r.worker_id for r in again.locate(key(3))] == ["me", "node-b"]   # node-b's kept
        assert again.agree_holder("me", SSD, *_blob(blocks)) == {
            "agreed": len(blocks), "added": 0, "resized": 0, "dropped": 0}
        again.sync()
    with PersistentArtIndex(tmp_path) as after:                   # the corrections were logged
        assert after.agree_holder("me", SSD, *_blob(blocks))["agreed"] == len(blocks)
        assert after.agree_holder("me", SSD, *_blob([])) == {     # no SSD tier: every record goes
            "agreed": 0, "added": 0, "resized": 0, "dropped": len(blocks)}
        assert after.keys_of("me") == set() and len(after.keys_of("node-b")) == 11
