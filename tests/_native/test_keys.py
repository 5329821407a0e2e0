"""_native/keys.pyx: ``decode_key_fast`` decodes exactly what ``model.decode_key`` decodes
(equal key, equal hash, the bytes kept as its encoding) and declines, with None, every byte
string that ``decode_key`` refuses, so the caller's error is always decode_key's."""
import gc

import pytest
from hypothesis import given, settings, strategies as st

from quillcache._native.keys import decode_key_fast
from quillcache.model import KeyError_, KvBlockKey, decode_key, encode_key

ids = st.text(min_size=0, max_size=12)
ints = st.integers(0, (1 << 32) - 1)


@settings(max_examples=300, deadline=None)
@given(ids, ids, st.none() | ids, ids, ids, ids, ints, ints)
def test_it_decodes_what_decode_key_decodes(model, tok, adapter, tenant, prefix, block, index, tokens):
    raw = encode_key(KvBlockKey(model, tok, adapter, tenant, prefix, block, index, tokens))
    fast = decode_key_fast(raw, KvBlockKey)
    slow = decode_key(raw)
    assert fast == slow and hash(fast) == hash(slow)
    assert fast.encoded() is raw and slow.encoded() == raw
    assert not gc.is_tracked(fast)                      # it can hold no cycle: off the GC
    assert repr(fast) == repr(slow)
    assert {fast: 1}[slow] == 1


def _refused(raw) -> bool:
    try:
        decode_key(raw)
    except KeyError_:
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_random_bytes_decode_the_same_or_are_declined(raw):
    fast = decode_key_fast(raw, KvBlockKey)
    if _refused(raw):
        assert fast is None
    else:
        assert fast == decode_key(raw)


def test_every_malformed_form_is_declined():
    raw = encode_key(KvBlockKey("model", "tok", "lora", "tenant", "p", "b", 7, 16))
    for cut in range(len(raw)):
        assert decode_key_fast(raw[:cut], KvBlockKey) is None          # truncated anywhere
    assert decode_key_fast(raw + b"\x00", KvBlockKey) is None          # trailing bytes
    assert decode_key_fast(b"\x02" + raw[1:], KvBlockKey) is None      # another version
    flag = 1 + 1 + 6 + 1 + 5 + 1 + 3                                   # the adapter flag's offset
    assert raw[flag] == 1
    assert decode_key_fast(raw[:flag] + b"\x02" + raw[flag + 1:], KvBlockKey) is None
    bad_utf8 = raw[:2] + b"\xff" + raw[3:]                             # in the tenant
    assert decode_key_fast(bad_utf8, KvBlockKey) is None
    assert decode_key_fast(bytearray(raw), KvBlockKey) is None         # bytes only
    for bad in (raw[:5], raw + b"\x00", bad_utf8):
        with pytest.raises(KeyError_):
            decode_key(bad)


def test_the_scope_strings_are_shared_between_keys():
    a = decode_key_fast(encode_key(KvBlockKey("model-x", "tok-x", None, "ten-x", "p", "b1")), KvBlockKey)
    b = decode_key_fast(encode_key(KvBlockKey("model-x", "tok-x", None, "ten-x", "p", "b2")), KvBlockKey)
    assert a.model_id is b.model_id and a.tenant_id is b.tenant_id and a.tokenizer_id is b.tokenizer_id


@settings(max_examples=200, deadline=None)
@given(st.tuples(ids, ids, st.none() | ids, ids, ids, ids, ints, ints),
       st.tuples(ids, ids, st.none() | ids, ids, ids, ids, ints, ints))
def test_keys_are_equal_exactly_when_their_fields_are(a, b):
    """``__eq__`` compares the (canonical) encodings: the same verdict as the fields."""
    ka, kb = KvBlockKey(*a), KvBlockKey(*b)
    assert (ka == kb) == (a == b)
    assert (ka == KvBlockKey(*a)) and (decode_key_fast(encode_key(ka), KvBlockKey) == ka)
    assert (ka != kb) == (a != b)
    assert ka != a                                      # another type is never equal


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.sampled_from(["model_id", "tokenizer_id", "adapter_id", "tenant_id",
                                               "prefix_hash", "block_hash"]))
def test_a_key_field_is_refused_exactly_when_it_is_over_255_bytes_of_utf8(value, field):
    """The short-string fast path of KvBlockKey's checks refuses and accepts what the exact
    check does."""
    fields = dict(model_id="m", tokenizer_id="t", adapter_id=None, tenant_id="x", prefix_hash="p", block_hash="b")
    fields[field] = value
    too_long = len(value.encode("utf-8", "surrogatepass")) > 255
    try:
        KvBlockKey(**fields)
    except KeyError_:
        assert too_long
    else:
        assert not too_long


def test_non_strings_and_out_of_range_integers_are_still_refused():
    for bad in (dict(model_id=3), dict(block_index=-1), dict(token_count=1 << 32), dict(block_index="1")):
        fields = dict(model_id="m", tokenizer_id="t", adapter_id=None, tenant_id="x", prefix_hash="p", block_hash="b")
        fields.update(bad)
        with pytest.raises((KeyError_, TypeError)):
            KvBlockKey(**fields)
