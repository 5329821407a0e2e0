"""The native block-hash map (_native/blockmap.pyx) against a plain dict of the same forms
(the dict the residency index kept before it: block hash str -> ek, or {tenant: (ek, ...)})."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache._native.blockmap import HASH_ALGORITHM, MAX_CAPACITY, MIN_CAPACITY, SLOT_BYTES, BlockMap
from quillcache.model import KvBlockKey, decode_key, encode_key


def ek(block: str, tenant: str = "a", i: int = 0, adapter=None) -> bytes:
    return encode_key(KvBlockKey("llama", "tok", adapter, tenant, f"p{i:04x}", block,
                                 block_index=i, token_count=16))


def _fields(k: bytes) -> tuple[str, str]:
    """(block hash, tenant) of an encoded key, read by the model's own decoder."""
    key = decode_key(k)
    return key.block_hash, key.tenant_id


class DictModel:
    """The oracle: the dict form of the map, as index/art.py kept it (add_block & co.)."""

    def __init__(self) -> None:
        self.d: dict = {}

    def add(self, k: bytes) -> None:
        bh, t = _fields(k)
        held = self.d.get(bh)
        if held is None:
            self.d[bh] = k
            return
        if type(held) is bytes:
            if held == k:
                return
            held = self.d[bh] = {_fields(held)[1]: (held,)}
        keys = held.get(t)
        if keys is None:
            held[t] = (k,)
        elif k not in keys:
            held[t] = keys + (k,)

    def forget(self, k: bytes) -> None:
        bh, t = _fields(k)
        held = self.d.get(bh)
        if held is None:
            return
        if type(held) is bytes:
            if held == k:
                del self.d[bh]
            return
        keys = held.get(t)
        if keys is not None and k in keys:
            keys = tuple(x for x in keys if x != k)
            if keys:
                held[t] = keys
            else:
                del held[t]
        if not held:
            del self.d[bh]
        elif len(held) == 1:
            (only,) = held.values()
            if len(only) == 1:
                self.d[bh] = only[0]

    def eks(self, bh: str, t: str) -> tuple:
        held = self.d.get(bh)
        if held is None:
            return ()
        if type(held) is bytes:
            return (held,) if _fields(held)[1] == t else ()
        return held.get(t, ())

    def tenants(self, bh: str) -> list:
        held = self.d.get(bh)
        if held is None:
            return []
        return [_fields(held)[1]] if type(held) is bytes else list(held)


def assert_same(m: BlockMap, model: DictModel, blocks, tenants) -> None:
    assert len(m) == len(model.d)
    assert sorted(m.block_hashes()) == sorted(model.d)
    for bh in blocks:
        assert m.get(bh) == model.d.get(bh), bh
        assert (bh in m) == (bh in model.d)
        assert sorted(m.tenants(bh)) == sorted(model.tenants(bh))
        for t in tenants:
            assert m.eks(bh, t) == model.eks(bh, t), (bh, t)
    assert m.capacity >= MIN_CAPACITY and m.capacity & (m.capacity - 1) == 0
    assert len(m) * 4 <= m.capacity * 3                      # the load stays under 3/4


BLOCKS = [f"b{i}" for i in range(12)] + ["", "é-block", "x" * 255]
TENANTS = ["a", "b", "ténant"]
ops_st = st.lists(st.tuples(st.booleans(), st.sampled_from(BLOCKS), st.sampled_from(TENANTS),
                            st.integers(0, 3), st.booleans()), max_size=200)


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, hash_bits=st.sampled_from([64, 3, 1]))
def test_random_adds_and_forgets_agree_with_the_dict(ops, hash_bits):
    # hash_bits 3 and 1: most block hashes share a hash; the answers must not change
    m, model = BlockMap(hash_bits=hash_bits), DictModel()
    for add, block, tenant, i, adapter in ops:
        k = ek(block, tenant, i, "lora" if adapter else None)
        (m.add if add else m.forget)(k)
        (model.add if add else model.forget)(k)
    assert_same(m, model, BLOCKS + ["absent"], TENANTS + ["other"])


def test_the_tenant_given_by_the_caller_keys_the_per_tenant_form():
    m = BlockMap()
    m.add(ek("h", "a", 1), "a")
    m.add(ek("h", "b", 2), "b")
    assert m.get("h") == {"a": (ek("h", "a", 1),), "b": (ek("h", "b", 2),)}
    m.forget(ek("h", "a", 1), "a")
    assert m.get("h") == ek("h", "b", 2)                    # back to the one-key form


def test_a_cross_tenant_query_is_exactly_a_miss():
    m = BlockMap()
    m.add(ek("shared", "a", 1))
    assert m.eks("shared", "a") == (ek("shared", "a", 1),)
    assert m.eks("shared", "b") == ()                       # the lone key's tenant differs
    assert m.eks("shared", "") == () and m.eks("shared", "aa") == ()
    m.add(ek("shared", "c", 2))
    assert m.eks("shared", "b") == ()                       # per-tenant form: no entry for b
    assert m.eks("shared", "c") == (ek("shared", "c", 2),)
    assert sorted(m.tenants("shared")) == ["a", "c"]


def test_colliding_block_hashes_each_find_only_their_own_keys():
    # one hash bit: every block hash lands in one of two probe runs
    m, model = BlockMap(hash_bits=1), DictModel()
    keys = [ek(f"c{i}", "ab"[i % 2], i) for i in range(200)]
    for k in keys:
        m.add(k)
        model.add(k)
    assert m.max_probe() > 50                                 # the collisions really happened
    for i in range(200):
        assert m.eks(f"c{i}", "ab"[i % 2]) == (keys[i],)
        assert m.eks(f"c{i}", "ab"[1 - i % 2]) == ()
    assert m.eks("c200", "a") == () and "c200" not in m
    for k in keys[::3]:                                     # deletes inside the long runs
        m.forget(k)
        model.forget(k)
    assert_same(m, model, [f"c{i}" for i in range(201)], ["a", "b"])


def test_a_block_hash_that_is_a_prefix_of_another_is_another_block_hash():
    m = BlockMap(hash_bits=1)
    m.add(ek("abc", "a", 1))
    assert m.eks("ab", "a") == () and m.eks("abcd", "a") == () and m.eks("abc", "a") == (ek("abc", "a", 1),)


def test_the_table_grows_and_shrinks_with_the_entries():
    m = BlockMap()
    assert m.capacity == MIN_CAPACITY
    keys = [ek(f"g{i}", "a", i) for i in range(10_000)]
    for k in keys:
        m.add(k)
    assert len(m) == 10_000 and m.capacity == 16_384          # 10,000 / 3/4 rounded up to 2^k
    assert m.memory_bytes() == 16_384 * SLOT_BYTES and SLOT_BYTES == 16
    for k in keys[:9_000]:
        m.forget(k)
    assert len(m) == 1_000 and m.capacity <= 8_192            # shrunk below 1/8 load
    assert all(m.eks(f"g{i}", "a") == (keys[i],) for i in range(9_000, 10_000))
    assert all(f"g{i}" not in m for i in range(9_000))
    for k in keys[9_000:]:
        m.forget(k)
    assert len(m) == 0 and m.capacity == MIN_CAPACITY


def test_clear_drops_every_entry_and_the_table():
    m = BlockMap()
    for i in range(1000):
        m.add(ek(f"k{i % 300}", "ab"[i % 2], i))
    m.clear()
    assert len(m) == 0 and m.capacity == MIN_CAPACITY and m.block_hashes() == []
    assert m.eks("k1", "b") == () and m.tenants("k1") == []
    m.add(ek("k1", "b", 1))
    assert m.eks("k1", "b") == (ek("k1", "b", 1),)


def test_the_map_holds_its_own_references():
    m = BlockMap()
    m.add(b"".join([ek("r", "a", 7)]))                       # a bytes object only the map holds
    m.add(bytes(ek("r2", "b", 1)))
    m.add(bytes(ek("r2", "c", 2)))
    assert m.eks("r", "a") == (ek("r", "a", 7),) and m.tenants("r2") == ["b", "c"]


def test_adds_and_forgets_in_random_order_match_the_dict_at_scale():
    rnd = random.Random(5)
    m, model = BlockMap(hash_bits=12), DictModel()       # 4,096 hashes for ~3,000 block hashes
    keys = [ek(f"s{rnd.randrange(3000)}", rnd.choice(TENANTS), i) for i in range(6000)]
    for _ in range(20_000):
        k = rnd.choice(keys)
        if rnd.random() < 0.6:
            m.add(k)
            model.add(k)
        else:
            m.forget(k)
            model.forget(k)
    assert_same(m, model, [f"s{i}" for i in range(3000)], TENANTS)


def test_bad_input_gets_a_clear_error_and_changes_nothing():
    m = BlockMap()
    m.add(ek("x", "a", 1))
    with pytest.raises(ValueError, match="not an encoded key"):
        m.add(b"\x01\x05ab")
    with pytest.raises(ValueError, match="not an encoded key"):
        m.forget(ek("x", "a", 1)[:-12])                       # cut inside the block hash
    with pytest.raises(TypeError):
        m.add("not bytes")
    with pytest.raises(TypeError, match="block hash must be str"):
        m.eks(b"x", "a")
    with pytest.raises(ValueError, match="hash_bits"):
        BlockMap(hash_bits=0)
    assert m.eks("\udc80", "a") == () and "\udc80" not in m   # not UTF-8: no key can hold it
    assert len(m) == 1 and m.eks("x", "a") == (ek("x", "a", 1),)
    assert MAX_CAPACITY == 1 << 40


def test_the_slot_hash_is_the_interpreters_keyed_siphash():
    # the map's defence against chosen block hashes is a keyed PRF; an interpreter built with
    # an unkeyed hash (Py_HASH_ALGORITHM=FNV) would lose it
    assert HASH_ALGORITHM.startswith("siphash")
