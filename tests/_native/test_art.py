"""The adaptive radix tree against a dict + sorted list oracle."""
import bisect
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from quillcache._native.art import MAX_KEY_BYTES, MAX_PREFIX_INLINE, AdaptiveRadixTree

U64_MAX = (1 << 64) - 1

# Keys from a tiny alphabet with shared stems, so that keys are often prefixes of each
# other, paths share long compressed prefixes (longer than the inline part) and nodes of
# every width appear.
LONG_STEM = b"S" * (MAX_PREFIX_INLINE + 9)
stems = st.sampled_from([b"", b"a", b"ab", LONG_STEM, LONG_STEM + b"x" * 20, b"\x00", b"\xff" * 3])
tails = st.binary(max_size=4) | st.lists(st.sampled_from([b"\x00", b"a", b"b", b"\xff"]), max_size=6).map(b"".join)
keys = st.builds(lambda a, b: a + b, stems, tails)
values = st.integers(min_value=0, max_value=U64_MAX)


def oracle_items(d, start=None):
    ks = sorted(d)
    i = 0 if start is None else bisect.bisect_left(ks, start)
    return [(k, d[k]) for k in ks[i:]]


def oracle_prefix(d, prefix):
    return [(k, d[k]) for k in sorted(d) if k.startswith(prefix)]


class TreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = AdaptiveRadixTree()
        self.model = {}

    @rule(key=keys, value=values)
    def insert(self, key, value):
        assert self.tree.insert(key, value) == self.model.get(key)
        self.model[key] = value

    @rule(batch=st.dictionaries(keys, values, max_size=20))
    def insert_batch(self, batch):
        new = sum(1 for k in batch if k not in self.model)
        assert self.tree.insert_many(list(batch), list(batch.values())) == new
        self.model.update(batch)

    @rule(key=keys)
    def delete(self, key):
        if key in self.model:
            assert self.tree.delete(key) == self.model.pop(key)
        else:
            with pytest.raises(KeyError):
                self.tree.delete(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete_present(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        assert self.tree.pop(key) == self.model.pop(key)

    @rule(key=keys)
    def get(self, key):
        assert self.tree.get(key, -1) == self.model.get(key, -1)
        assert (key in self.tree) == (key in self.model)

    @rule(batch=st.lists(keys, max_size=40))
    def get_many(self, batch):
        assert self.tree.get_many(batch) == [self.model.get(k) for k in batch]

    @rule(start=keys)
    def items_from(self, start):
        assert list(self.tree.items(start)) == oracle_items(self.model, start)

    @rule(prefix=keys)
    def scan_prefix(self, prefix):
        assert self.tree.scan_prefix(prefix) == oracle_prefix(self.model, prefix)

    @invariant()
    def matches_oracle(self):
        self.tree.check()
        assert len(self.tree) == len(self.model)
        expect = oracle_items(self.model)
        assert list(self.tree.items()) == expect
        assert self.tree.minimum() == (expect[0] if expect else None)
        assert self.tree.maximum() == (expect[-1] if expect else None)
        if not self.model:
            assert self.tree.memory_bytes() == 0


TreeMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_tree_matches_dict_and_sorted_list = TreeMachine.TestCase


class TreeMachineCheckedAtEnd(TreeMachine):
    """The same rules; the full oracle comparison (check(), items(), min/max) runs once at
    the end of each example instead of after every step, so 10k examples stay affordable."""

    def matches_oracle(self):          # not an @invariant here
        TreeMachine.matches_oracle(self)

    def teardown(self):
        self.matches_oracle()
        self.tree.clear()
        assert self.tree.memory_bytes() == 0 and len(self.tree) == 0


@pytest.mark.slow
def test_tree_matches_oracle_over_10k_examples():
    run_state_machine_as_test(TreeMachineCheckedAtEnd, settings=settings(
        max_examples=10_000, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(keys, values, max_size=60), st.lists(keys, max_size=10))
def test_bulk_insert_items_and_scans_agree_with_sorted_list(d, probes):
    tree = AdaptiveRadixTree()
    assert tree.insert_many(list(d), list(d.values())) == len(d)
    tree.check()
    assert list(tree.items()) == oracle_items(d)
    for p in probes:
        assert list(tree.items(p)) == oracle_items(d, p)
        assert tree.scan_prefix(p) == oracle_prefix(d, p)


def test_keys_that_are_prefixes_of_each_other_and_the_empty_key():
    tree = AdaptiveRadixTree()
    chain = [b"", b"a", b"ab", b"abc", b"abcd" + LONG_STEM, b"abcd" + LONG_STEM + b"!"]
    for i, k in enumerate(reversed(chain)):
        tree.insert(k, i)
    tree.check()
    assert [k for k, _ in tree.items()] == chain
    assert tree.get(b"") == len(chain) - 1
    assert tree.scan_prefix(b"ab") == [(k, tree.get(k)) for k in chain[2:]]
    for k in chain[::2]:
        tree.delete(k)
        tree.check()
    assert [k for k, _ in tree.items()] == chain[1::2]
    assert b"" not in tree and b"a" in tree


def test_node_growth_4_16_48_256_and_shrink_back():
    tree = AdaptiveRadixTree()
    stem = b"prefix-longer-than-inline-" * 2
    expected = {5: "node16", 17: "node48", 49: "node256"}
    for n in range(1, 257):
        tree.insert(stem + bytes([n - 1]), n)
        counts = tree.node_counts()
        if n >= 2:
            kind = max((k for k in expected if k <= n), default=None)
            want = expected[kind] if kind else "node4"
            assert counts[want] == 1 and sum(v for k, v in counts.items() if k != "leaf") == 1, (n, counts)
        tree.check()
    # shrink with hysteresis: 256 -> 48 at 37 children, 48 -> 16 at 12, 16 -> 4 at 3
    shrink = {37: "node48", 12: "node16", 3: "node4"}
    seen = []
    for n in range(255, 0, -1):
        tree.delete(stem + bytes([n]))
        counts = tree.node_counts()
        if n in shrink:
            assert counts[shrink[n]] == 1, (n, counts)
            seen.append(shrink[n])
        tree.check()
    assert seen == ["node48", "node16", "node4"]
    # one key left: lazy expansion collapses the tree to a single leaf
    assert tree.node_counts() == {"node4": 0, "node16": 0, "node48": 0, "node256": 0, "leaf": 1}
    assert tree.items().__next__() == (stem + b"\x00", 1)


def test_long_shared_prefix_split_beyond_inline_bytes():
    tree = AdaptiveRadixTree()
    base = bytes(range(40))
    tree.insert(base + b"A", 1)
    tree.insert(base + b"B", 2)         # root prefix is 40 bytes, 16 inline
    tree.insert(base[:30] + b"\xff", 3)  # splits the compressed path after 30 bytes
    tree.insert(base[:20], 4)            # ends inside the path: stored in a term slot
    tree.check()
    assert tree.get(base[:30] + b"\xff") == 3 and tree.get(base[:20]) == 4
    assert tree.get(base[:25] + b"X" * 16) is None   # differs past the inline bytes
    assert [v for _, v in tree.items()] == [4, 1, 2, 3]
    tree.delete(base[:20])
    tree.delete(base[:30] + b"\xff")    # collapse merges prefixes back
    tree.check()
    assert tree.node_counts()["node4"] == 1 and [v for _, v in tree.items()] == [1, 2]


def test_memory_returns_to_zero_after_deleting_every_key():
    tree = AdaptiveRadixTree()
    ks = [i.to_bytes(4, "big") + b"/" + (i * 7919).to_bytes(8, "little") for i in range(20_000)]
    for i, k in enumerate(ks):
        tree.insert(k, i)
    assert tree.memory_bytes() > 20_000 * 17
    tree.check()
    for k in ks[::3] + ks[1::3] + ks[2::3]:
        tree.delete(k)
    assert len(tree) == 0 and tree.memory_bytes() == 0 and tree.minimum() is None
    tree.insert_many(ks, range(len(ks)))
    tree.clear()
    assert tree.memory_bytes() == 0 and list(tree.items()) == []


def test_bad_keys_and_values_are_refused_before_touching_the_tree():
    tree = AdaptiveRadixTree()
    tree.insert(b"k", 1)
    before = tree.memory_bytes()
    with pytest.raises(ValueError):
        tree.insert(b"x" * (MAX_KEY_BYTES + 1), 1)
    with pytest.raises(OverflowError):
        tree.insert(b"k2", 1 << 64)
    with pytest.raises(OverflowError):
        tree.insert(b"k2", -1)
    with pytest.raises(TypeError):
        tree.insert("k2", 1)
    with pytest.raises(TypeError):
        tree.insert(b"k2", 1.5)
    with pytest.raises(OverflowError):     # one bad value: no key of the batch goes in
        tree.insert_many([b"a", b"b"], [1, -5])
    with pytest.raises(ValueError):
        tree.insert_many([b"a", b"b"], [1])
    with pytest.raises(ValueError):
        tree.get(b"y" * (MAX_KEY_BYTES + 1))
    assert list(tree.items()) == [(b"k", 1)] and tree.memory_bytes() == before
    tree.insert(b"m" * MAX_KEY_BYTES, U64_MAX)
    assert tree.get(b"m" * MAX_KEY_BYTES) == U64_MAX


def test_items_iterator_resumes_across_chunks_and_sees_later_changes():
    tree = AdaptiveRadixTree()
    ks = [i.to_bytes(3, "big") for i in range(1000)]
    tree.insert_many(ks, range(1000))
    it = tree.items(ks[100])
    got = [next(it) for _ in range(300)]       # crosses a chunk boundary
    assert got == [(k, i) for i, k in enumerate(ks) if 100 <= i < 400]
    tree.delete(ks[700])
    tree.insert(ks[999] + b"\x01", 5)
    rest = list(it)
    assert [k for k, _ in rest] == [k for k in ks[400:] if k != ks[700]] + [ks[999] + b"\x01"]


def test_mutation_during_a_batch_read_in_another_thread_is_refused():
    tree = AdaptiveRadixTree()
    ks = [i.to_bytes(4, "big") for i in range(50_000)]
    tree.insert_many(ks, range(len(ks)))
    errors = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            assert tree.get_many(ks[:20_000])[-1] == 19_999

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(2000):
            try:
                tree.insert(b"new" + i.to_bytes(2, "big"), i)
            except RuntimeError as exc:
                errors.append(exc)
    finally:
        stop.set()
        t.join()
    tree.check()
    assert len(tree) == len(ks) + 2000 - len(errors)


def test_scan_prefix_beyond_the_inline_buffer_and_of_a_leaf_or_a_missing_prefix():
    tree = AdaptiveRadixTree()
    ks = [b"grp/" + i.to_bytes(2, "big") for i in range(1000)] + [b"grp0", b"gr", b"other"]
    tree.insert_many(ks, range(len(ks)))
    d = dict(zip(ks, range(len(ks))))
    for p in [b"grp/", b"grp", b"gr", b"g", b"", b"grp/\x01", b"grp/\x03\xe7", b"other", b"otherwise", b"grq", b"x"]:
        assert tree.scan_prefix(p) == oracle_prefix(d, p), p
    assert len(tree.scan_prefix(b"grp/")) == 1000      # grows past the 64-entry stack buffer


def test_get_many_interleaved_lookups_keep_batch_order_with_misses():
    tree = AdaptiveRadixTree()
    ks = [i.to_bytes(4, "big") * 3 for i in range(5000)]
    tree.insert_many(ks, range(5000))
    batch = []
    for i in range(0, 5000, 7):
        batch += [ks[i], ks[i][:-1], ks[i] + b"!", ks[i][:4]]
    expect = [i if j == 0 else -1 for i in range(0, 5000, 7) for j in range(4)]
    assert tree.get_many(batch, -1) == expect
    assert tree.get_many(batch[:5], -1) == expect[:5]        # below the no-GIL threshold
    with pytest.raises(ValueError):                           # like get(): refused, not a miss
        tree.get_many(batch[:20] + [b"z" * (MAX_KEY_BYTES + 1)])


def _blob(ks):
    import numpy as np
    off = np.zeros(len(ks) + 1, np.uint64)
    np.cumsum([len(k) for k in ks], out=off[1:])
    return b"".join(ks), off


@given(st.lists(keys, max_size=60, unique=True), st.lists(keys, max_size=20), st.integers(0, 1000))
def test_blob_insert_and_lookup_agree_with_a_dict(inserted, probes, first):
    import numpy as np
    tree = AdaptiveRadixTree()
    blob, off = _blob(inserted)
    assert tree.insert_blob(blob, off, first) == len(inserted)
    tree.check()
    oracle = {k: first + i for i, k in enumerate(inserted)}
    assert list(tree.items()) == oracle_items(oracle)
    blob, off = _blob(probes)
    out = np.empty(len(probes), np.int64)
    assert tree.get_blob(blob, off, out) == sum(p in oracle for p in probes)
    assert out.tolist() == [oracle.get(p, -1) for p in probes]


def test_blob_calls_refuse_bad_offsets_before_touching_the_tree():
    import numpy as np
    tree = AdaptiveRadixTree()
    for off in ([0, 5], [2, 1], [0, 1, 9]):
        with pytest.raises(ValueError, match="outside a blob"):
            tree.insert_blob(b"abc", np.array(off, np.uint64))
    with pytest.raises(ValueError, match="at most"):
        tree.insert_blob(b"x" * (MAX_KEY_BYTES + 1), np.array([0, MAX_KEY_BYTES + 1], np.uint64))
    assert len(tree) == 0
    with pytest.raises(ValueError, match="output"):
        tree.get_blob(b"ab", np.array([0, 1, 2], np.uint64), np.empty(1, np.int64))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, st.integers(min_value=0, max_value=15), max_size=300),
       st.integers(min_value=0, max_value=15), st.integers(min_value=0, max_value=15))
def test_keys_where_is_every_key_whose_value_has_those_bits_in_key_order(d, mask, want):
    t = AdaptiveRadixTree()
    for k, v in d.items():
        t.insert(k, v)
    assert t.keys_where(mask, want) == [k for k, v in oracle_items(d) if v & mask == want]
    assert t.keys_where(0, 0) == sorted(d)
    with pytest.raises(OverflowError):
        t.keys_where(-1, 0)
