"""node/keys.py: ``KeyCache.decode_many`` (its hits in one native pass) against ``decode``
key by key (the simple path): the same keys or the same error, the same cache after."""
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.errors import InvalidArgument
from quillcache.model import KvBlockKey, encode_key
from quillcache.node.keys import KeyCache

RAWS = [encode_key(KvBlockKey("m", "tok", None, "t", "root", f"b{i}", i)) for i in range(8)] + [b"\x01bad", b"\x07"]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 5), st.lists(st.lists(st.integers(0, len(RAWS) - 1), max_size=12), max_size=8),
       st.booleans())
def test_decode_many_is_decode_of_each_key(capacity, batches, as_bytearray):
    fast, slow = KeyCache(capacity), KeyCache(capacity)
    for batch in batches:
        raws = [bytearray(RAWS[i]) if as_bytearray and i % 2 else RAWS[i] for i in batch]
        try:
            got = fast.decode_many(raws)
        except InvalidArgument:
            got = InvalidArgument
        try:
            want = [slow.decode(r) for r in raws]
        except InvalidArgument:
            want = InvalidArgument
        assert got == want
        if got is not InvalidArgument:
            # the same keys; the cache's bounds hold (which keys it kept may differ when the
            # young generation turned within a batch: the native pass goes on in that dict)
            assert fast.hits + fast.misses == slow.hits + slow.misses
            assert len(fast) <= capacity and len(fast._young) <= capacity // 2


def test_a_bad_key_in_a_batch_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="bad key"):
        KeyCache().decode_many([RAWS[0], b"\x01bad"])


def test_a_miss_costs_the_same_with_the_cache_full_as_with_it_empty():
    """The old LRU dict evicted with ``next(iter(d))``: each key deleted at the dict's front
    stayed a hole the next eviction walked over, so a miss in a full cache of 16,384 keys
    cost ~10 us instead of ~0.5.  Counted, not timed: the dict operations of a miss do not
    grow with the cache's size (two generations: a full young one becomes the old one)."""
    raws = [encode_key(KvBlockKey("m", "tok", None, "t", "root", f"g{i}", i)) for i in range(1000)]
    cache = KeyCache(100)
    for raw in raws:                          # every one a miss: 1000 keys through 100 places
        cache.decode(raw)
        assert len(cache) <= 100
        assert len(cache._young) <= 50 and len(cache._old) <= 50
    assert cache.misses == 1000 and cache.hits == 0
    # the last 50 (at least half the capacity) are all kept, and a hit in the old generation
    # moves its key to the young one
    last = raws[-50:]
    assert all(raw in cache for raw in last)
    old = next(raw for raw in raws[-100:] if raw in cache._old)
    cache.decode(old)
    assert old in cache._young and cache.hits == 1
    # the young generation's dict is a new one after each rotation: no holes carried over
    young = cache._young
    for raw in raws[:200]:
        cache.decode(raw)
    assert cache._young is not young and len(cache) <= 100
