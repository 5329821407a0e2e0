"""The home's residency records on the ART index, against a dict of sets."""
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.cluster.records import ArtRecordStore, Holder
from quillcache.model import KvBlockKey, encode_key


def k(i: int) -> KvBlockKey:
    return KvBlockKey("m", "t", None, "ten", f"p{i % 3}", f"b{i}")


ops = st.lists(st.tuples(st.sampled_from(["add", "drop", "drop_epoch"]), st.integers(0, 12),
                         st.sampled_from(["n1", "n2", "n3"]), st.integers(1, 3)), max_size=80)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_records_match_a_dict_oracle(ops):
    store, oracle = ArtRecordStore(), {}
    for op, i, node, epoch in ops:
        if op == "add":
            store.add(k(i), node, epoch, 100 + i, 1000 + i)
            oracle.setdefault(i, {})[(node, epoch)] = 100 + i
        elif op == "drop":
            store.drop(k(i), node, epoch)
            oracle.get(i, {}).pop((node, epoch), None)
        else:
            store.drop_epoch(node, epoch)
            for holders in oracle.values():
                holders.pop((node, epoch), None)
    for i in range(13):
        want = sorted(Holder(n, e, s, s + 900) for (n, e), s in oracle.get(i, {}).items())
        assert sorted(store.holders(k(i))) == want
        assert sorted(store.holders_encoded(encode_key(k(i)))) == want
    # a LOCATE's batched answer: the same holders, less those the view does not accept
    live = {("n1", 1), ("n2", 2), ("n3", 3), ("n1", 3)}
    got = store.live_holders([encode_key(k(i)) for i in range(13)], lambda n, e: (n, e) in live)
    for i in range(13):
        assert sorted(got[i]) == sorted((n, e, s, s + 900) for (n, e), s in oracle.get(i, {}).items()
                                        if (n, e) in live)
    assert len(store) == sum(len(h) for h in oracle.values())


def test_drop_epoch_leaves_the_new_epoch_of_the_same_node():
    store = ArtRecordStore()
    store.add(k(1), "a", 7, 10, 1)
    store.add(k(1), "a", 8, 10, 2)
    store.add(k(2), "b", 1, 10, 3)
    assert store.drop_epoch("a", 7) == 1
    assert store.holders(k(1)) == [Holder("a", 8, 10, 2)]
    assert store.epochs("a") == {8}


def test_records_share_the_store_index_and_name_this_node_for_its_own_blocks():
    from quillcache.index.art import ArtIndex
    from quillcache.model import CacheTier

    index = ArtIndex()
    crcs = {}
    store = ArtRecordStore(index, "me", lambda: ("node-me", 0x2A), crcs.get)
    # the store's own records of one block (DRAM and SSD) and another node's record
    index.set_holder(k(1), encode_key(k(1)), "me", (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD), 10)
    store.add(k(1), "other", 7, 10, 5)
    store.add(k(2), "other", 7, 20, 6)
    # its own block is named once its CRC is known (the flusher computed it), not before
    assert store.holders(k(1)) == [Holder("other", 7, 10, 5)]
    crcs[encode_key(k(1))] = 9
    assert sorted(store.holders(k(1))) == [Holder("node-me", 0x2A, 10, 9), Holder("other", 7, 10, 5)]
    assert len(store) == 2 and len(index) == 4          # other nodes' records are in the same index
    assert index.keys_of("me") == {encode_key(k(1))}     # the store's view of its own is untouched
    assert store.live_holders([encode_key(k(1)), encode_key(k(3))], lambda n, e: True) == [
        [("node-me", 0x2A, 10, 9), ("other", 7, 10, 5)], []]             # itself named once
    assert store.live_holders([encode_key(k(1))], lambda n, e: n != "other") == [[("node-me", 0x2A, 10, 9)]]
    assert store.drop_epoch("other", 7) == 2
    assert store.holders(k(1)) == [Holder("node-me", 0x2A, 10, 9)] and len(index) == 2
    assert store.drop(k(1), "me", 0) == 0 and index.keys_of("me") == {encode_key(k(1))}
