"""_native/keys.pyx: ``decode_key_fast`` decodes exactly what ``model.decode_key`` decodes
(equal key, equal hash, the bytes kept as its encoding) and declines, with None, every byte
string that ``decode_key`` refuses, so the caller's error is always decode_key's."""
import copy
import gc
import pickle
import sys

import pytest
from hypothesis import given, settings, strategies as st

from quillcache._native.keys import decode_key_fast
from quillcache.model import IdentityScope, KeyError_, KvBlockKey, decode_key, encode_key

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


# ---------------------------------------------------------------- a key is its encoding (issue 28)

def _traced_bytes_per_key(make, n=20000):
    import tracemalloc
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keys = [make(i) for i in range(n)]
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return keys, used / n


def test_a_decoded_key_costs_little_beyond_the_bytes_it_was_decoded_from():
    """A resident block's key: its encoding (kept anyway) plus ~32 bytes of object.  The
    dataclass it replaced held ~330 bytes (two hash strings, ints, the hash, the object)."""
    raws = [encode_key(KvBlockKey("meta-llama/Llama-3.1-8B", "tok-v1", None, "acme", f"{i - 1:032x}",
                                  f"{i:032x}", i % 1000, 16)) for i in range(20000)]
    keys, per_key = _traced_bytes_per_key(lambda i: decode_key_fast(raws[i], KvBlockKey))
    assert all(k.encoded() is r for k, r in zip(keys, raws))
    assert per_key <= 48, per_key                       # the key object and the list's pointer
    assert sys.getsizeof(keys[0]) <= 32 and not hasattr(keys[0], "__dict__")
    assert keys[0].scope is keys[1].scope               # one IdentityScope for the scope's keys


def test_a_built_key_costs_its_encoding_and_little_more():
    keys, per_key = _traced_bytes_per_key(
        lambda i: KvBlockKey("meta-llama/Llama-3.1-8B", "tok-v1", "lora", "acme", f"{i - 1:032x}", f"{i:032x}", i))
    encoding = sum(sys.getsizeof(k.encoded()) for k in keys) / len(keys)
    assert per_key - encoding <= 48, (per_key, encoding)
    assert not gc.is_tracked(keys[0])


@settings(max_examples=200, deadline=None)
@given(ids, ids, st.none() | ids, ids, ids, ids, ints, ints)
def test_built_and_decoded_keys_read_back_the_same_fields_hash_and_pickle(model, tok, adapter, tenant,
                                                                           prefix, block, index, tokens):
    fields = (model, tok, adapter, tenant, prefix, block, index, tokens)
    built = KvBlockKey(*fields)
    decoded = decode_key_fast(encode_key(built), KvBlockKey)
    for k in (built, decoded, decode_key(encode_key(built)), pickle.loads(pickle.dumps(decoded))):
        assert (k.model_id, k.tokenizer_id, k.adapter_id, k.tenant_id, k.prefix_hash, k.block_hash,
                k.block_index, k.token_count) == fields
        assert k == built and hash(k) == hash(built) == hash(encode_key(built))
        assert k.scope == IdentityScope(model, tok, adapter, tenant)
        assert eval(repr(k), {"KvBlockKey": KvBlockKey}) == k
    assert KvBlockKey(model_id=model, tokenizer_id=tok, adapter_id=adapter, tenant_id=tenant,
                      prefix_hash=prefix, block_hash=block, block_index=index, token_count=tokens) == built


def test_a_key_is_immutable_and_compares_only_with_keys():
    k = KvBlockKey("m", "t", None, "x", "p", "b", 3, 16)
    for name in ("model_id", "tokenizer_id", "adapter_id", "tenant_id", "prefix_hash", "block_hash",
                 "block_index", "token_count", "scope", "_ek", "_scope", "other"):
        with pytest.raises(AttributeError):
            setattr(k, name, "z")
    assert k.__eq__(("m", "t")) is NotImplemented and k.__ne__(k.encoded()) is NotImplemented
    with pytest.raises(TypeError):
        k < k                                           # noqa: B015 (no order, as the dataclass)
    assert copy.copy(k) == k and copy.deepcopy(k) == k


def test_replace_and_defaults_and_str_subclasses():
    class Name(str):
        pass
    k = KvBlockKey(Name("m"), "t", None, Name("x"), Name("p"), "b")
    assert (k.block_index, k.token_count) == (0, 64)
    assert type(k.model_id) is str and k.model_id == "m" and type(k.prefix_hash) is str
    r = k.replace(model_id="m2", block_index=5)
    assert (r.model_id, r.block_index, r.block_hash, k.model_id) == ("m2", 5, "b", "m")
    with pytest.raises(TypeError):
        k.replace(bogus=1)
    with pytest.raises(KeyError_, match="block_index"):
        k.replace(block_index=-1)
    with pytest.raises(TypeError):
        decode_key_fast(encode_key(k), dict)


def test_a_key_made_without_its_fields_raises_instead_of_reading_nothing():
    bare = KvBlockKey.__new__(KvBlockKey)
    for name in ("model_id", "prefix_hash", "block_hash", "block_index", "token_count"):
        with pytest.raises(AttributeError):
            getattr(bare, name)
    assert bare.encoded() is None and bare != KvBlockKey("m", "t", None, "x", "p", "b")
