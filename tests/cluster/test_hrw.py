"""Rendezvous placement against the oracle (every weight computed, then sorted)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.cluster.hrw import Ring, key_hash, order_by_sorting
from quillcache.model import KvBlockKey, encode_key

node_ids = st.lists(st.text("abcdefgh-0123", min_size=1, max_size=8), min_size=1, max_size=9, unique=True)


@settings(max_examples=50, deadline=None)
@given(node_ids, st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=40))
def test_ring_order_home_and_batch_homes_agree_with_sorting_by_weight(nodes, khashes):
    ring = Ring(nodes)
    for kh in khashes:
        expected = order_by_sorting(nodes, kh)
        assert ring.order(kh) == expected
        assert ring.order(kh, 2) == expected[:2]
        assert ring.home(kh) == expected[0]
    assert ring.homes(khashes) == [order_by_sorting(nodes, kh)[0] for kh in khashes]


def test_a_joining_node_moves_only_the_keys_it_becomes_home_of():
    keys = [key_hash(encode_key(KvBlockKey("m", "t", None, "ten", "p", f"b{i}"))) for i in range(3000)]
    before = Ring(["a", "b", "c"]).homes(keys)
    after = Ring(["a", "b", "c", "d"]).homes(keys)
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    assert moved and all(y == "d" for _, y in moved)
    assert 0.15 < len(moved) / len(keys) < 0.35          # about a quarter go to the new node
    # and a leaving node's keys spread over the others; nobody else's keys move
    gone = Ring(["a", "c", "d"]).homes(keys)
    assert all(y == x for x, y in zip(after, gone) if x != "b")


def test_key_hash_depends_on_scope_prefix_and_block():
    base = KvBlockKey("m", "t", None, "ten", "p", "b")
    variants = [KvBlockKey("m2", "t", None, "ten", "p", "b"), KvBlockKey("m", "t", None, "ten2", "p", "b"),
                KvBlockKey("m", "t", None, "ten", "p2", "b"), KvBlockKey("m", "t", None, "ten", "p", "b2")]
    h = key_hash(encode_key(base))
    assert h == key_hash(encode_key(KvBlockKey("m", "t", None, "ten", "p", "b")))
    assert all(key_hash(encode_key(v)) != h for v in variants)
