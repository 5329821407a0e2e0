"""store/pins.py: the hard-pin budget and each tenant's quota within it (docs/tiering.md
"Hard-pin quotas per tenant"); tests/security/test_pin_quota.py runs the same against a daemon."""
import asyncio

import pytest

from quillcache.errors import CapacityError, InvalidArgument
from quillcache.model import KvBlockKey
from quillcache.store.tiers import LocalKvStore, StoreOptions

BLOCK = 1024


def key(i, tenant):
    return KvBlockKey("m", "tok", None, tenant, "root", f"b{i}", i)


def make(per_tenant=12, **options):
    """A store full of ``per_tenant`` blocks of each of 4 tenants; the hard-pin budget is half
    of it (2 * per_tenant blocks) unless ``max_hard_pin_fraction`` says otherwise."""
    tenants = ("a", "b", "c", "x")
    store = LocalKvStore(StoreOptions(len(tenants) * per_tenant * BLOCK, max_block_bytes=BLOCK, **options))
    for tenant in tenants:
        for i in range(per_tenant):
            asyncio.run(store.put(key(i, tenant), b"\0" * BLOCK))
    return store


def pinned_until_refused(store, tenant, n=12):
    for i in range(n):
        try:
            store.pin(key(i, tenant), 60, hard=True)
        except CapacityError as exc:
            return i, exc
    return n, None


def test_without_quotas_one_tenant_may_take_the_whole_budget_as_before():
    store = make(max_hard_pin_fraction=0.25)                 # budget: 12 blocks, open mode
    assert store.pin_quota("a") is None
    assert pinned_until_refused(store, "a") == (12, None)
    with pytest.raises(CapacityError, match=r"hard pins would hold 13312 bytes \(max 12288\)"):
        store.pin(key(0, "b"), 60, hard=True)


def test_tenants_without_pin_bytes_share_the_budget_evenly():
    store = make(pin_quotas=(("a", None), ("b", None), ("c", None)))   # budget 24 blocks: 8 each
    n, exc = pinned_until_refused(store, "a")
    assert n == 8 and exc.requested == BLOCK and exc.free == 0
    assert str(exc) == ("hard-pin quota of tenant 'a' is 8192 bytes ([[auth.tenants]] pin_bytes, or its share "
                        "of the node's budget): 8192 bytes pinned, 1024 more asked")
    assert pinned_until_refused(store, "b")[0] == 8          # a took only its own share
    assert store.pin_quota("x") == 8 * BLOCK                # a name not configured: the share too
    assert store.stats()["tenants"]["a"] == {"pin_quota_bytes": 8 * BLOCK, "hard_pinned_bytes": 8 * BLOCK,
                                             "pins_refused": 1}


def test_explicit_quotas_are_kept_and_the_rest_is_shared():
    store = make(pin_quotas=(("a", 2 * BLOCK), ("b", None), ("c", None), ("x", 0)))
    assert [store.pin_quota(t) for t in "abcx"] == [2 * BLOCK, 11 * BLOCK, 11 * BLOCK, 0]
    assert pinned_until_refused(store, "x")[0] == 0
    store.pin(key(0, "x"), 60)                               # soft pins have no quota


def test_a_soft_pin_and_a_repeated_hard_pin_spend_no_quota():
    store = make(pin_quotas=(("a", BLOCK),))
    store.pin(key(0, "a"), 60, hard=True)
    store.pin(key(0, "a"), 120, hard=True)                   # already hard-pinned: no new bytes
    store.pin(key(1, "a"), 60)
    with pytest.raises(CapacityError):
        store.pin(key(1, "a"), 60, hard=True)


def test_oversubscribed_quotas_meet_the_budget_with_no_figure_of_the_others():
    store = make(pin_quotas=(("a", 12 * BLOCK), ("b", 12 * BLOCK)), max_hard_pin_fraction=0.25)   # 24 of 12
    assert pinned_until_refused(store, "a")[0] == 12
    n, exc = pinned_until_refused(store, "b")
    assert n == 0 and exc.free == 0 and str(exc) == (
        "hard pin refused: the node's hard-pin budget is full (its tenants' quotas add up to more than it)")


def test_new_quotas_apply_to_new_pins_and_keep_the_pins_held():
    store = make(pin_quotas=(("a", 4 * BLOCK),))
    assert pinned_until_refused(store, "a")[0] == 4
    store.set_pin_quotas((("a", 2 * BLOCK),))
    assert all(store.unpin(key(i, "a")) is True for i in range(2))   # the 4 were kept
    with pytest.raises(CapacityError):
        store.pin(key(0, "a"), 60, hard=True)                # 2 held: at the new quota
    with pytest.raises(InvalidArgument):
        store.set_pin_quotas((("a", -1),))
