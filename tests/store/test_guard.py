"""The identity guard: serve / refuse / miss, every mode, and no cross-tenant oracle."""
import asyncio
import logging
import time

import pytest

from quillcache.errors import InvalidArgument, NotFound, UnsafeReuse
from quillcache.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey
from quillcache.store.guard import IdentityGuard, Refusal, audit_reuse, violation_of
from quillcache.store.tiers import LocalKvStore, StoreOptions

BASE = {"model_id": "llama", "tokenizer_id": "tok", "adapter_id": None, "tenant_id": "acme",
            "prefix_hash": "p0", "block_hash": "b0"}


def k(**changes):
    fields = dict(BASE, **changes)
    return KvBlockKey(fields["model_id"], fields["tokenizer_id"], fields["adapter_id"], fields["tenant_id"],
                      fields["prefix_hash"], fields["block_hash"])


def store_with(*keys, mode="strict"):
    store = LocalKvStore(StoreOptions(1 << 20, guard_mode=mode))
    for i, key in enumerate(keys):
        asyncio.run(store.put(key, bytes([i + 1]) * 512))
    return store


def error_fields(exc):
    return type(exc), str(exc), exc.args, exc.status, getattr(exc, "__dict__", {})


# ---------------------------------------------------------------- audit_reuse (pure)

def test_violation_precedence_is_tenant_model_tokenizer_adapter():
    req = k()
    assert violation_of(req, k()) is None
    assert violation_of(req, k(tenant_id="x", model_id="y")) == "tenant"
    assert violation_of(req, k(model_id="y", tokenizer_id="z", adapter_id="a")) == "model"
    assert violation_of(req, k(tokenizer_id="z", adapter_id="a")) == "tokenizer"
    assert violation_of(req, k(adapter_id="a")) == "adapter"


def test_audit_reuse_strict_refuses_every_identity_difference():
    cands = [k(), k(tenant_id="other"), k(model_id="m2"), k(tokenizer_id="t2"), k(adapter_id="lora")]
    allowed, refused = audit_reuse(k().scope, cands, "strict")
    assert allowed == [k()]
    assert [(r.item, r.violation) for r in refused] == [
        (cands[1], "tenant"), (cands[2], "model"), (cands[3], "tokenizer"), (cands[4], "adapter")]
    assert all(isinstance(r, Refusal) for r in refused)


def test_audit_reuse_tenant_mode_refuses_only_other_tenants():
    cands = [k(), k(tenant_id="other"), k(model_id="m2"), k(adapter_id="lora")]
    allowed, refused = audit_reuse(k(), cands, "tenant")
    assert allowed == [cands[0], cands[2], cands[3]]
    assert refused == [Refusal(cands[1], "tenant")]


def test_audit_reuse_off_mode_allows_everything():
    cands = [k(tenant_id="other"), k(model_id="m2")]
    assert audit_reuse(k(), cands, "off") == (cands, [])


def test_audit_reuse_accepts_residencies_and_returns_them():
    res = [CacheResidency(k(), "w1", CacheTier.CPU_DRAM, 512),
           CacheResidency(k(adapter_id="lora"), "w2", CacheTier.LOCAL_SSD, 512)]
    allowed, refused = audit_reuse(IdentityScope("llama", "tok", None, "acme"), res)
    assert allowed == [res[0]] and refused == [Refusal(res[1], "adapter")]


def test_unknown_mode_is_refused():
    with pytest.raises(InvalidArgument):
        audit_reuse(k(), [], "lenient")
    with pytest.raises(InvalidArgument):
        IdentityGuard("lenient")


# ---------------------------------------------------------------- the store, strict

def test_exact_identity_and_content_is_served():
    store = store_with(k())
    with store.get(k()) as lease:
        assert lease.key == k() and bytes(lease.view) == b"\x01" * 512


@pytest.mark.parametrize("field,value,violation", [
    ("model_id", "mistral", "model"), ("tokenizer_id", "tok2", "tokenizer"),
    ("adapter_id", "lora-a", "adapter")])
def test_same_tenant_identity_mismatch_raises_unsafe_reuse(field, value, violation):
    store = store_with(k(**{field: value}))
    with pytest.raises(UnsafeReuse) as info:
        store.get(k())
    assert info.value.violation == violation
    assert store.stats()["guard"][f"reuse_refused_{violation}"] == 1


def test_adapter_present_versus_base_model_is_a_mismatch():
    store = store_with(k())
    with pytest.raises(UnsafeReuse) as info:
        store.get(k(adapter_id="lora-a"))
    assert info.value.violation == "adapter"


def test_several_differences_report_the_highest_precedence():
    store = store_with(k(adapter_id="lora-a"), k(tokenizer_id="tok2", adapter_id="lora-b"))
    with pytest.raises(UnsafeReuse) as info:
        store.get(k())
    assert info.value.violation == "tokenizer"
    store2 = store_with(k(adapter_id="lora-a"), k(model_id="m2", tokenizer_id="tok2"))
    with pytest.raises(UnsafeReuse) as info:
        store2.get(k())
    assert info.value.violation == "model"


def test_true_miss_raises_not_found():
    store = store_with(k(block_hash="other-content"))
    with pytest.raises(NotFound):
        store.get(k())
    assert store.stats()["guard"]["reuse_refused_tenant"] == 0


def test_cross_tenant_probe_is_indistinguishable_from_a_true_miss():
    refusing = store_with(k(tenant_id="victim"))
    empty = store_with()
    with pytest.raises(NotFound) as refused:
        refusing.get(k())
    with pytest.raises(NotFound) as missed:
        empty.get(k())
    assert error_fields(refused.value) == error_fields(missed.value)
    assert refused.value.__cause__ is None and missed.value.__cause__ is None
    assert not refusing.exists(k()) and not empty.exists(k())
    assert refusing.exists_prefix([k()]) == empty.exists_prefix([k()]) == 0
    # Only the operator sees the difference.
    assert refusing.stats()["guard"]["reuse_refused_tenant"] == 1
    assert empty.stats()["guard"]["reuse_refused_tenant"] == 0


def test_cross_tenant_refusal_is_audited_without_the_other_tenant(caplog):
    store = store_with(k(tenant_id="victim-corp"))
    with pytest.raises(NotFound):
        store.get(k())
    assert not [r for r in caplog.records if r.name == "quillcache.audit"]   # not on the request path
    with caplog.at_level(logging.INFO, logger="quillcache.audit"):
        done = asyncio.run(store.maintenance())
    lines = [r.getMessage() for r in caplog.records if r.name == "quillcache.audit"]
    assert done["audit_lines"] == 1 and len(lines) == 1
    assert "tenant=acme" in lines[0] and "b0" in lines[0] and "victim-corp" not in lines[0]


def test_unclassified_miss_overflow_is_counted_not_lost_silently(monkeypatch):
    import quillcache.store.guard as guard_mod
    monkeypatch.setattr(guard_mod, "AUDIT_QUEUE_MAX", 3)
    store = store_with(k(tenant_id="victim"))
    for _ in range(5):
        with pytest.raises(NotFound):
            store.get(k())
    g = store.stats()["guard"]
    assert g["reuse_refused_tenant"] == 3 and g["audit_dropped"] == 2


def test_own_tenant_mismatch_wins_over_another_tenants_copy():
    store = store_with(k(tenant_id="victim"), k(model_id="m2"))
    with pytest.raises(UnsafeReuse):
        store.get(k())


def test_same_identity_and_content_at_another_block_index_is_served():
    other_index = KvBlockKey("llama", "tok", None, "acme", "p0", "b0", 5)
    store = store_with(other_index)
    with store.get(k()) as lease:
        assert lease.key == other_index
    assert store.exists(k())
    assert store.stats()["store"]["unsafe_served"] == 0


def test_exists_counts_only_exact_identity_and_never_refuses():
    store = store_with(k(model_id="m2"), k(tenant_id="victim"))
    assert store.exists(k(model_id="m2")) and not store.exists(k())
    assert store.stats()["guard"]["reuse_refused_model"] == 0


def test_removed_block_no_longer_causes_refusals():
    store = store_with(k(model_id="m2"))
    assert asyncio.run(store.remove(k(model_id="m2")))
    with pytest.raises(NotFound):
        store.get(k())


# ---------------------------------------------------------------- modes tenant / off

def test_tenant_mode_serves_same_tenant_mismatches_but_not_other_tenants():
    store = store_with(k(adapter_id="lora-a"), k(tenant_id="victim", block_hash="b1"), mode="tenant")
    with store.get(k()) as lease:
        assert lease.key == k(adapter_id="lora-a")
    with pytest.raises(NotFound):
        store.get(k(block_hash="b1"))
    g = store.stats()["guard"]
    assert g["reuse_served_cross_identity"] == 1 and g["reuse_refused_tenant"] == 1
    assert store.exists(k()) and not store.exists(k(block_hash="b1"))


def test_off_mode_serves_any_identity_and_warns_at_construction(caplog):
    with caplog.at_level(logging.WARNING, logger="quillcache.store"):
        store = store_with(k(tenant_id="victim", model_id="m9"), mode="off")
    assert any("GUARD OFF" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with store.get(k()) as lease:
        assert lease.key.tenant_id == "victim" and bytes(lease.view) == b"\x01" * 512
    s = store.stats()
    assert s["guard"]["reuse_served_cross_tenant"] == 1 and s["store"]["unsafe_served"] == 1


@pytest.mark.slow
def test_cross_tenant_refusal_takes_the_same_time_as_a_miss():
    # Same number of other tenants' blocks in both; only the probed content differs.
    refusing = store_with(*[k(tenant_id=f"victim{i}") for i in range(50)])
    empty = store_with(*[k(tenant_id=f"victim{i}", block_hash="unrelated") for i in range(50)])

    def one(store):
        t0 = time.perf_counter_ns()
        try:
            store.get(k())
        except NotFound:
            pass
        return time.perf_counter_ns() - t0

    ratios = []
    for _ in range(5):
        a, b = [], []
        for i in range(20000):        # interleaved call by call, alternating which goes first
            if i & 1:
                a.append(one(refusing))
                b.append(one(empty))
            else:
                b.append(one(empty))
                a.append(one(refusing))
        a.sort(), b.sort()
        ratios.append(a[len(a) // 2] / b[len(b) // 2])
        refusing.stats(), empty.stats()   # drain the classification queues
    ratios.sort()
    assert 0.95 < ratios[len(ratios) // 2] < 1.05, ratios
