"""store/policy.py: the eviction order against a list kept the slow way."""
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.store.policy import FifoPolicy, LruPolicy, make_policy

ops_st = st.lists(st.tuples(st.sampled_from(["insert", "touch", "remove"]), st.integers(0, 12)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(ops_st, st.sampled_from(["lru", "fifo"]))
def test_candidates_follow_a_list_oracle(ops, name):
    policy, order = make_policy(name), []
    for op, k in ops:
        if op == "insert":
            policy.insert(k)
            if k in order:
                order.remove(k)
            order.append(k)
        elif op == "touch":
            policy.touch(k)
            if name == "lru" and k in order:
                order.remove(k)
                order.append(k)
        else:
            policy.remove(k)
            if k in order:
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
