"""ArtIndex's packed records (issue 28): a key with one holder keeps no Python object per
record, and every other shape of a key's records still reads back exactly, in order."""
import gc
import tracemalloc

import pytest

from quillcache.index import art
from quillcache.index.art import ArtIndex
from quillcache.index.persistent import PersistentArtIndex
from quillcache.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey, encode_key

DRAM, SSD, HBM = CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD, CacheTier.HBM
BLOCK = 16384


def key(i, tenant="t"):
    return KvBlockKey("m", "tok", None, tenant, f"p{i // 100}", f"b{i:08d}", i % 100, 16)


def _traced_per_key(index, keys, eks, tiers):
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k, ek in zip(keys, eks):
            index.set_holder(k, ek, "me", tiers, BLOCK)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("tiers", [(DRAM,), (DRAM, SSD)])
@pytest.mark.parametrize("home", [True, False])
def test_a_one_holder_key_costs_only_its_side_map_entries(tiers, home):
    """Keys and their encodings exist before (the store's entry holds them).  What the index
    adds per key of its home is one slot of the block map (16 B, the table 3/8 to 3/4 used:
    26 B measured at this size); another holder's key also takes an entry of that holder's
    key set (16 B a slot, the table between 1/8 and 3/5 used: 105 B measured at this size).
    Before packing, each record (88 B), its list (64 B) and its size's int (28 B) came on
    top, and the home had a key set too: 286 B per key (DRAM) and 430 B (DRAM and SSD)
    measured.  Before the block map, a dict keyed by a block-hash str of its own (the key
    reads its block hash from its encoding, a new str each time) added ~120 B to each."""
    n = 20000
    keys = [key(i) for i in range(n)]
    eks = [encode_key(k) for k in keys]
    index = ArtIndex()
    if home:
        index.set_home("me")
    per_key = _traced_per_key(index, keys, eks, tiers)
    assert per_key < (40 if home else 150), per_key
    assert index.records_of("me") == n and len(index.keys_of("me")) == n


def test_records_of_several_holders_and_tiers_come_back_all_in_order_and_pack_again():
    index = ArtIndex()
    k = key(1)
    ek = encode_key(k)
    index.set_holder(k, ek, "me", (DRAM, SSD), 100)
    assert index._tree[ek] & art.PACKED
    index.put(CacheResidency(k, "b-node", SSD, 100))
    index.put(CacheResidency(k, "a-node", HBM, 7, last_access_ms=5, ref_count=2, pinned=True))
    want = [CacheResidency(k, "a-node", HBM, 7, 5, 2, True), CacheResidency(k, "b-node", SSD, 100),
            CacheResidency(k, "me", DRAM, 100), CacheResidency(k, "me", SSD, 100)]
    assert index.locate(k) == want == index.records_at(ek) == index.snapshot()
    assert index.holders_at(ek) == [(r.worker_id, r.bytes) for r in want]
    assert index.prefix_scan(IdentityScope.from_key(k), k.prefix_hash) == want
    assert not index._tree[ek] & art.PACKED
    assert index.clear_worker("a-node") == 1 and index.clear_worker("b-node") == 1
    assert index._tree[ek] & art.PACKED                     # one holder again: packed, slot freed
    assert index.locate(k) == want[2:] and len(index) == 2
    assert index.metrics().resident_bytes == 200
    assert index._slots == [None]


def test_a_size_or_state_that_does_not_pack_keeps_its_records_exactly():
    index = ArtIndex()
    big, pinned = key(1), key(2)
    index.put(CacheResidency(big, "me", SSD, art.BYTES_MASK + 1))
    index.put(CacheResidency(pinned, "me", DRAM, 10, pinned=True))
    assert index.locate(big) == [CacheResidency(big, "me", SSD, art.BYTES_MASK + 1)]
    assert index.locate(pinned) == [CacheResidency(pinned, "me", DRAM, 10, pinned=True)]
    assert index.holder(encode_key(big), "me") == (art.BYTES_MASK + 1, (SSD,))
    index.put(CacheResidency(pinned, "me", DRAM, 10))       # the same record, not pinned now
    assert index.locate(pinned) == [CacheResidency(pinned, "me", DRAM, 10)]
    index.put(CacheResidency(key(3), "me", DRAM, 5))
    index.put(CacheResidency(key(3), "me", SSD, 6))          # another size per tier: a slot
    assert index.holder(encode_key(key(3)), "me") == (5, (DRAM, SSD))
    assert [r.bytes for r in index.locate(key(3))] == [5, 6]


def test_holder_numbers_are_reused_and_a_full_table_falls_back_to_slots(monkeypatch):
    monkeypatch.setattr(art, "WORKER_MASK", 1)             # two holder numbers
    index = ArtIndex()
    for i, worker in enumerate(["w0", "w1", "w2"]):
        index.set_holder(key(i), encode_key(key(i)), worker, (DRAM,), 10 + i)
    assert [bool(index._tree[encode_key(key(i))] & art.PACKED) for i in range(3)] == [True, True, False]
    assert [index.holder(encode_key(key(i)), w) for i, w in enumerate(["w0", "w1", "w2"])] == [
        (10, (DRAM,)), (11, (DRAM,)), (12, (DRAM,))]
    assert index.clear_worker("w0") == 1 and "w0" not in index._numbers
    index.set_holder(key(5), encode_key(key(5)), "w5", (SSD,), 3)
    assert index._numbers["w5"] == 0 and index.page(b"", b"", 10, "w5") == ([encode_key(key(5))], False)
    assert index.page(b"", b"", 10, "w1") == ([encode_key(key(1))], False)
    assert index.block_keys(key(2).block_hash, "t", "w2") == [key(2)]
    assert index.block_keys(key(5).block_hash, "t", "w5") == [key(5)]
    assert index.block_keys(key(5).block_hash, "t", "w1") == []


def test_the_identity_scope_still_decides_which_packed_key_is_removed():
    index = ArtIndex()
    mine, theirs = key(1), KvBlockKey("m", "tok", "lora", "t", "p0", key(1).block_hash, 1, 16)
    for k in (mine, theirs):
        index.set_holder(k, encode_key(k), "me", (DRAM,), 10)
    assert index.remove_block(IdentityScope.from_key(theirs), "me", mine.block_hash) == 1
    assert index.locate(mine) and not index.locate(theirs)
    assert index.remove_block(IdentityScope.from_key(mine), "other", mine.block_hash) == 0
    assert sorted(index.block_keys(mine.block_hash, "t", "me"), key=encode_key) == [mine]


def test_packed_records_survive_a_checkpoint_and_the_log(tmp_path):
    with PersistentArtIndex(tmp_path, sync_every=True, volatile_tiers=(DRAM,)) as index:
        for i in range(10):
            index.set_holder(key(i), encode_key(key(i)), "me", (DRAM, SSD), 100 + i)
        index.checkpoint()
        for i in range(10, 20):
            index.set_holder(key(i), encode_key(key(i)), "me", (SSD,), 100 + i)
        index.set_holder(key(3), encode_key(key(3)), "me", (), 0)
        index.set_holder(key(5), encode_key(key(5)), "me", (SSD,), 555)     # replaced in place:
        index.set_holder(key(6), encode_key(key(6)), "me", (DRAM,), 106)    # logged as remove + puts
        assert index.holder(encode_key(key(6)), "me") == (106, (DRAM,)) and len(index) == 26
    with PersistentArtIndex(tmp_path) as again:
        assert again.holder(encode_key(key(5)), "me") == (555, (SSD,))
        assert again.holder(encode_key(key(6)), "me") == (0, ())              # only in DRAM: not kept
        again.set_holder(key(6), encode_key(key(6)), "me", (SSD,), 106)
        assert len(again) == 19
        assert again.holder(encode_key(key(4)), "me") == (104, (SSD,))     # DRAM records not kept
        assert again.holder(encode_key(key(15)), "me") == (115, (SSD,))
        assert again.holder(encode_key(key(3)), "me") == (0, ())
        # a recovered key becomes packed when the store next writes it unchanged
        assert not again.set_holder(key(4), encode_key(key(4)), "me", (SSD,), 104)
        assert again._tree[encode_key(key(4))] & art.PACKED
        again.checkpoint()
    with PersistentArtIndex(tmp_path) as third:
        assert [r.bytes for r in third.iter_records()] == [555 if i == 5 else 100 + i for i in range(20) if i != 3]


def test_the_homes_keys_are_walked_and_counted_without_a_key_set():
    index = ArtIndex()
    for i in range(3):                                       # before set_home: a key set
        index.set_holder(key(i), encode_key(key(i)), "me", (DRAM,), 10)
    index.set_home("me")
    assert "me" not in index._by_worker and index.records_of("me") == 3
    for i in range(3, 8):
        index.set_holder(key(i), encode_key(key(i)), "me", (DRAM, SSD), 10)
    index.put(CacheResidency(key(4), "peer", SSD, 10))      # a slot: two holders
    index.put(CacheResidency(key(5), "me", HBM, 99))         # a slot: another size
    index.put(CacheResidency(key(9), "peer", SSD, 10))       # not the home's
    index.put(CacheResidency(key(5), "me", HBM, 99))         # the same record again: no new key
    assert index.records_of("me") == 8 and index.records_of("peer") == 2
    assert index.keys_of("me") == {encode_key(key(i)) for i in range(8)}
    assert index.keys_of("peer") == {encode_key(key(4)), encode_key(key(9))}
    index.set_holder(key(6), encode_key(key(6)), "me", (), 0)
    assert index.records_of("me") == 7
    assert index.clear_worker("me") == 1 + 2 * 4 + 3         # 0-2: DRAM; 3, 4, 7: both; 5: three
    assert index.records_of("me") == 0 and index.keys_of("me") == set()
    assert {r.worker_id for r in index.iter_records()} == {"peer"} and len(index) == 2
    with pytest.raises(ValueError, match="home"):
        index.set_home("peer")


def test_a_recovered_index_counts_and_walks_the_home_without_decoding(tmp_path):
    with PersistentArtIndex(tmp_path, sync_every=True) as index:
        for i in range(30):
            index.set_holder(key(i), encode_key(key(i)), "me", (SSD,), 100 + i)
        index.put(CacheResidency(key(40), "peer", SSD, 5))
        index.checkpoint()
        index.set_holder(key(31), encode_key(key(31)), "me", (SSD,), 1)     # replayed from the log
        index.set_holder(key(2), encode_key(key(2)), "me", (), 0)
    with PersistentArtIndex(tmp_path) as again:
        again.set_home("me")
        assert again.stats()["lazy_slots"] == len(again._tree)              # nothing decoded
        assert again.records_of("me") == 30
        want = {encode_key(key(i)) for i in list(range(30)) + [31] if i != 2}
        assert again.keys_of("me") == want and again.keys_of("peer") == {encode_key(key(40))}
        assert not again.set_holder(key(7), encode_key(key(7)), "me", (SSD,), 107)    # packed now
        assert again.set_holder(key(8), encode_key(key(8)), "me", (), 0)
        assert again.keys_of("me") == want - {encode_key(key(8))} and again.records_of("me") == 29
        again.materialize()
        assert again.keys_of("me") == want - {encode_key(key(8))}
