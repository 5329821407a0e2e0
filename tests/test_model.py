"""The data model: keys, scopes, tiers and the key encoding."""
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.model import (
    MAX_ID_BYTES, CacheResidency, CacheTier, IdentityScope, KeyError_, KvBlockKey, MemoryIndex,
    decode_key, encode_key, encode_scope, encode_scope_prefix,
)

GiB = 1 << 30
MiB = 1 << 20


def key(**kw):
    base = {"model_id": "llama-3-8b", "tokenizer_id": "tok-v1", "adapter_id": None, "tenant_id": "acme",
                "prefix_hash": "root", "block_hash": "b0", "block_index": 0, "token_count": 64}
    base.update(kw)
    return KvBlockKey(**base)


def test_key_is_frozen_and_hashable():
    k = key()
    assert hash(k) == hash(key())
    with pytest.raises(AttributeError):
        k.tenant_id = "other"


def test_identity_scope_from_key_and_matches():
    k = key(adapter_id="lora-a")
    scope = IdentityScope.from_key(k)
    assert scope == IdentityScope("llama-3-8b", "tok-v1", "lora-a", "acme")
    assert scope.matches(k)
    assert not scope.matches(key(adapter_id=None))       # absence is not a wildcard
    assert not IdentityScope.from_key(key()).matches(k)
    assert not scope.matches(key(adapter_id="lora-a", tenant_id="other"))
    assert not scope.matches(key(adapter_id="lora-a", model_id="other"))
    assert not scope.matches(key(adapter_id="lora-a", tokenizer_id="other"))


@pytest.mark.parametrize("alias,tier", [
    ("gpu", CacheTier.HBM), ("GPU_MEMORY", CacheTier.HBM), ("vram", CacheTier.HBM), ("hbm", CacheTier.HBM),
    ("remote_gpu", CacheTier.REMOTE_HBM), ("remote_gpu_memory", CacheTier.REMOTE_HBM),
    ("cpu", CacheTier.CPU_DRAM), ("Dram", CacheTier.CPU_DRAM), ("host", CacheTier.CPU_DRAM),
    ("host_memory", CacheTier.CPU_DRAM), ("ssd", CacheTier.LOCAL_SSD), ("NVMe", CacheTier.LOCAL_SSD),
    ("disk", CacheTier.LOCAL_SSD), ("object", CacheTier.OBJECT_STORE), ("s3", CacheTier.OBJECT_STORE),
    ("blob", CacheTier.OBJECT_STORE),
])
def test_cache_tier_aliases_parse_case_insensitively(alias, tier):
    assert CacheTier.parse(alias) is tier


def test_cache_tier_names_and_unknown_name_is_quoted():
    assert [str(t) for t in CacheTier] == ["hbm", "remote_hbm", "cpu_dram", "local_ssd", "object_store"]
    with pytest.raises(ValueError, match="'tape'"):
        CacheTier.parse("tape")


def test_memory_index_put_replaces_same_worker_and_tier():
    idx = MemoryIndex()
    k = key()
    idx.put(CacheResidency(k, "w1", CacheTier.CPU_DRAM, 100))
    idx.put(CacheResidency(k, "w1", CacheTier.CPU_DRAM, 200))
    idx.put(CacheResidency(k, "w1", CacheTier.LOCAL_SSD, 300))
    assert sorted(r.bytes for r in idx.locate(k)) == [200, 300]
    assert len(idx) == 2 and idx.metrics().puts == 3 and idx.metrics().resident_bytes == 500


ids = st.text(min_size=0, max_size=40)
keys = st.builds(KvBlockKey, ids, ids, st.none() | ids, ids, ids, ids,
                 st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))


@given(keys)
@settings(max_examples=300)
def test_key_encoding_round_trips(k):
    assert decode_key(encode_key(k)) == k


@given(keys, keys)
@settings(max_examples=300)
def test_scope_and_prefix_are_a_contiguous_byte_prefix(a, b):
    # All keys of one scope + prefix hash share encode_scope_prefix as a byte prefix, and no key of
    # another scope or prefix hash does: a radix-tree prefix scan is then a range walk.
    pa = encode_scope_prefix(a, a.prefix_hash)
    same = IdentityScope.from_key(a).matches(b) and a.prefix_hash == b.prefix_hash
    assert encode_key(b).startswith(pa) == same
    assert encode_key(b).startswith(encode_scope(a)) == IdentityScope.from_key(a).matches(b)


def test_key_limits_are_enforced_with_a_clear_error():
    with pytest.raises(KeyError_, match="tenant_id is 256 bytes"):
        key(tenant_id="x" * (MAX_ID_BYTES + 1))
    with pytest.raises(KeyError_, match="block_index"):
        key(block_index=-1)
    with pytest.raises(KeyError_, match="must be a string"):
        key(model_id=3)


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\x00", "trailing"),
    (lambda b: b"\x09" + b[1:], "version 9"),
])
def test_decode_rejects_malformed_bytes(mutate, msg):
    with pytest.raises(KeyError_, match=msg):
        decode_key(mutate(encode_key(key())))


def test_a_key_pickled_in_one_process_is_found_by_its_equal_in_another():
    """KvBlockKey keeps its hash (computed once): a pickle must not carry it to a process
    whose str hashes differ."""
    import os
    import pickle
    import subprocess
    import sys
    k = KvBlockKey("m", "tok", None, "t", "p", "b", 3, 16)
    code = ("import pickle, sys; from quillcache.model import KvBlockKey; "
            "d = pickle.loads(sys.stdin.buffer.read()); "
            "print(d[KvBlockKey('m', 'tok', None, 't', 'p', 'b', 3, 16)])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps({k: 7}), capture_output=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed), check=True)
        assert out.stdout.strip() == b"7"
    assert hash(pickle.loads(pickle.dumps(k))) == hash(k) and {k: 1}[KvBlockKey("m", "tok", None, "t", "p", "b", 3, 16)]


def test_decode_shares_the_scope_strings():
    # a node holding a million keys of one scope keeps one copy of its strings
    k = KvBlockKey("model-" + "x" * 20, "tok-" + "y" * 20, "lora-" + "z" * 20, "tenant-" + "w" * 20,
                   "prefix-" + "v" * 20, "block-" + "u" * 20, 3)
    a, b = decode_key(encode_key(k)), decode_key(encode_key(k))
    assert a == b == k
    assert a.model_id is b.model_id and a.tokenizer_id is b.tokenizer_id
    assert a.adapter_id is b.adapter_id and a.tenant_id is b.tenant_id
