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
            assert (fast.hits, fast.misses, list(fast._map)) == (slow.hits, slow.misses, list(slow._map))


def test_a_bad_key_in_a_batch_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="bad key"):
        KeyCache().decode_many([RAWS[0], b"\x01bad"])
