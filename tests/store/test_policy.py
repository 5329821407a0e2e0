"""store/policy.py: the eviction order against a list kept the slow way."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.store.policy import FifoPolicy, LruPolicy, make_policy

def _to_end(order: list, k, add: bool = False) -> None:
    """The list oracle's move of k to the most recent end (added there if ``add``)."""
    if k in order:
        order.remove(k)
    elif not add:
        return
    order.append(k)


ops_st = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove"]), st.integers(0, 12)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(ops_st, st.sampled_from(["lru", "fifo"]))
def test_candidates_follow_a_list_oracle(ops, name):
    policy, order = make_policy(name), []
    for op, k in ops:
        getattr(policy, op)(k)
        if op == "insert":
            _to_end(order, k, add=True)
        elif op == "touch":
            if name == "lru":
                _to_end(order, k)
        elif k in order:
            order.remove(k)
        assert list(policy.candidates()) == order
        assert len(policy) == len(order) and policy.victim() == (order[0] if order else None)
        assert all(k in policy for k in order)


def test_touch_of_an_absent_key_adds_nothing():
    lru = LruPolicy()
    lru.touch("x")
    assert len(lru) == 0 and "x" not in lru


def test_fifo_ignores_reads():
    fifo = FifoPolicy()
    for k in "abc":
        fifo.insert(k)
    fifo.touch("a")
    assert list(fifo.candidates()) == ["a", "b", "c"]


owner_ops_st = st.lists(st.tuples(st.sampled_from(["add", "drop", "insert", "touch", "remove"]), st.integers(0, 12)),
                        max_size=200)


@settings(max_examples=200, deadline=None)
@given(owner_ops_st, st.sampled_from(["lru", "fifo"]))
def test_a_handed_dict_is_ordered_with_its_values_kept_and_its_keys_left_to_its_owner(ops, name):
    """The DRAM tier's way (its published dict is the order): the owner adds a key at the
    most recent end (a re-add moves it there) and drops keys; the policy only moves present
    keys, values and all, and adds or drops nothing."""
    owned: dict = {}
    policy, order = make_policy(name, order=owned), []
    for op, k in ops:
        if op == "add":                         # the owner publishes (a new key or a re-put)
            owned.pop(k, None)
            owned[k] = f"slot-{k}"
            _to_end(order, k, add=True)
        elif op == "drop":                      # the owner unpublishes
            owned.pop(k, None)
            if k in order:
                order.remove(k)
        else:
            getattr(policy, op)(k)
            if op == "insert" or op == "touch" and name == "lru":
                _to_end(order, k)               # only a present key moves; remove: the owner's to do
        assert list(policy.candidates()) == order == list(owned)
        assert all(v == f"slot-{k}" for k, v in owned.items())
        assert len(policy) == len(order) and policy.victim() == (order[0] if order else None)
    assert not policy.owns_keys


def test_a_handed_order_must_be_a_plain_dict():
    from collections import OrderedDict
    with pytest.raises(TypeError, match="plain dict"):
        LruPolicy(order=OrderedDict())


def test_batch_reads_refresh_a_handed_dict_with_its_values_kept():
    """``_native.batch.hold_published`` with the published dict as the order (the store's
    DRAM LRU): each hit key moves to the end with its slot; a miss moves nothing."""
    from quillcache._native.batch import hold_published
    from quillcache._native.blocks import Entry, Slot
    from tests._support.store import key

    keys = [key(i) for i in range(4)]
    published = {k: Slot(k, 256 * i, 10, i, 0.0) for i, k in enumerate(keys)}
    slots = dict(published)
    entries = {k: Entry(k, 10, 1, 0.0) for k in keys}
    lru = make_policy("lru", order=published)
    held, got = hold_published([keys[1], key(9), keys[0]], type(keys[0]), entries, published, 5.0, lru.order)
    assert got == [slots[keys[1]], None, slots[keys[0]]] and held == [slots[keys[1]], slots[keys[0]]]
    assert list(published) == [keys[2], keys[3], keys[1], keys[0]]
    assert all(published[k] is slots[k] for k in keys)
    fifo = make_policy("fifo", order=published)
    hold_published([keys[2]], type(keys[0]), entries, published, 6.0, fifo.order)
    assert list(published) == [keys[2], keys[3], keys[1], keys[0]]

