"""The data model: keys, scopes, tiers, hints, the cost model and the key encoding."""
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.model import (
    MAX_ID_BYTES, BlockHint, CacheResidency, CacheTier, CostModel, EngineEndpoint, EngineKind,
    IdentityScope, KeyError_, KvBlockKey, MemoryIndex, RequestKvHints, RequestShape, SloTarget,
    WorkerState, decode_key, encode_key, encode_scope, encode_scope_prefix,
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


def test_worker_state_defaults_and_with_load():
    w = WorkerState("w1")
    assert (w.hbm_capacity_bytes, w.cpu_capacity_bytes) == (80 * GiB, 512 * GiB)
    loaded = w.with_load(1000, 3)
    assert (loaded.queued_prefill_tokens, loaded.running_decodes) == (1000, 3)
    assert w.queued_prefill_tokens == 0
    ep = EngineEndpoint("w2", EngineKind.parse("vLLM"), "http://127.0.0.1:8000", "m", "t", "acme", "rack1")
    assert ep.worker_state() == WorkerState("w2", "rack1")


def test_request_hints_chain_prefix_hashes():
    hints = RequestKvHints(block_hashes=("h1", "h2", "h3"), session_id="sess", adapter_id="lora")
    blocks = hints.to_blocks("m", "t", "acme")
    assert [b.prefix_hash for b in blocks] == ["sess", "h1", "h2"]
    assert [b.block_index for b in blocks] == [0, 1, 2]
    assert all(b.token_count == 64 and b.adapter_id == "lora" and b.tenant_id == "acme" for b in blocks)
    root = RequestKvHints(block_hashes=("x",), block_tokens=16, model_id="m2").to_blocks("m", "t", "acme")
    assert root[0].prefix_hash == "root" and root[0].token_count == 16 and root[0].model_id == "m2"
    shape = RequestShape("r", "m", "t", None, "acme", tuple(blocks))
    assert shape.input_tokens() == 192
    assert SloTarget() == SloTarget(800, 80)
    assert BlockHint("h").token_count == 64


def test_cost_model_seed_defaults_and_functions():
    c = CostModel()
    assert c.prefill_cost_us(100) == 4500
    assert c.decode_cost_us(10, 2) == 800 + 3000
    assert c.queue_cost_us(WorkerState("w").with_load(250, 9)) == 1000
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, True, True) == 5
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, False, True) == 80
    assert c.transfer_cost_us(CacheTier.CPU_DRAM, 1, True, True) == 55          # at least 1 MiB
    assert c.transfer_cost_us(CacheTier.CPU_DRAM, MiB + 1, False, True) == 110  # ceil
    assert c.transfer_cost_us(CacheTier.LOCAL_SSD, 3 * MiB, False, False) == 840 + 350
    assert c.transfer_cost_us(CacheTier.OBJECT_STORE, MiB, True, False) == 1800  # same worker: no penalty
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, True, True) < c.prefill_cost_us(64)


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
