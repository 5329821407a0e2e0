"""The ART indexer against the dict oracle, and the event translation both share."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.control.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from quillcache.control.indexer import (
    DEVICE, DISK, HOST, POOL, ArtIndexer, DictIndexer, IndexerLimits, chain_hashes, tier_of_medium,
)
from quillcache.model import IdentityScope

A = IdentityScope("m", "t", None, "acme")
B = IdentityScope("m", "t", None, "globex")
L = IdentityScope("m", "t", "lora1", "acme")
BS = 4


def stored(tokens, engine_hashes, parent=None, medium=None, lora=None):
    return BlockStored(tuple(engine_hashes), parent, tuple(tokens), BS, None, medium, lora)


def test_chain_hashes_cover_the_whole_prefix_and_ignore_a_partial_block():
    a = chain_hashes(range(10), BS)
    assert len(a) == 2
    assert chain_hashes(range(8), BS) == a
    assert chain_hashes([0, 1, 2, 3, 9, 9, 9, 9], BS)[0] == a[0]
    assert chain_hashes([0, 1, 2, 3, 9, 9, 9, 9], BS)[1] != a[1]
    assert chain_hashes([5, 5, 5, 5] + list(range(4, 8)), BS)[1] != a[1]   # depends on the parent


@pytest.mark.parametrize("cls", [ArtIndexer, DictIndexer])
def test_engines_with_different_hash_seeds_match_the_same_tokens(cls):
    idx = cls()
    tokens = list(range(16))
    # Two engines, unrelated hash spaces (int vs 32-byte bytes), one event each half.
    idx.apply("w0", EventBatch(0, (stored(tokens[:8], [11, 12]),
                                   stored(tokens[8:], [13, 14], parent=12))), A)
    idx.apply("w1", EventBatch(0, (stored(tokens[:8], [b"\x01" * 32, b"\x02" * 32]),)), A)
    m = idx.find_matches(A, chain_hashes(tokens, BS))
    assert m.as_dict() == {"w0": (4, 0, 0, 0, 0), "w1": (2, 0, 0, 0, 0)}
    idx.apply("w0", EventBatch(0, (BlockRemoved((12,)),)), A)
    assert idx.find_matches(A, chain_hashes(tokens, BS)).as_dict()["w0"] == (1, 0, 0, 0, 0)
    idx.apply("w0", EventBatch(0, (AllBlocksCleared(),)), A)
    assert idx.find_matches(A, chain_hashes(tokens, BS)).as_dict()["w0"] == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("cls", [ArtIndexer, DictIndexer])
def test_device_block_counts_follow_the_events(cls):
    """What fills each engine's KV memory, as the router reads it for the pages free there: a
    block stored twice counts once, another tier's blocks not at all, a removal and a clear
    take theirs away; ``device_counts`` is in the order of a Match's columns."""
    idx = cls()
    tokens = list(range(16))
    idx.apply("w0", EventBatch(0, (stored(tokens[:8], [11, 12]), stored(tokens[:8], [11, 12]),
                                   stored(tokens[8:], [13, 14], parent=12))), A)
    idx.apply("w1", EventBatch(0, (stored(tokens[:8], [21, 22], medium="cpu"),)), A)
    idx.add_blocks("w2", A, chain_hashes(tokens, BS)[:3], DEVICE)
    idx.add_blocks("w2", A, chain_hashes(tokens, BS)[:3], HOST)
    assert idx.device_blocks(["w0", "w1", "w2", "nobody"]) == [4, 0, 3, 0]
    m = idx.find_matches(A, chain_hashes(tokens, BS))
    assert dict(zip(m.workers, idx.device_counts().tolist())) == {"w0": 4, "w1": 0, "w2": 3}
    idx.apply("w0", EventBatch(0, (BlockRemoved((12, 99)),)), A)          # 99: never stored
    idx.remove_blocks("w2", A, chain_hashes(tokens, BS)[:1], DEVICE)
    assert idx.device_blocks(["w0", "w2"]) == [3, 2]
    idx.apply("w0", EventBatch(0, (AllBlocksCleared(),)), A)
    assert idx.device_blocks(["w0", "w1"]) == [0, 0]
    for w in range(3, 40):                                              # the count grows with the workers
        idx.add_blocks(f"w{w}", A, chain_hashes(tokens, BS)[:w % 4], DEVICE)
    assert idx.device_counts().tolist()[3:] == [w % 4 for w in range(3, 40)]


@pytest.mark.parametrize("cls", [ArtIndexer, DictIndexer])
def test_tiers_extend_the_prefix_and_other_identities_are_refused(cls):
    idx = cls()
    toks = list(range(24))
    h = chain_hashes(toks, BS)          # 6 blocks
    idx.add_blocks("w0", A, h[:2], DEVICE)
    idx.add_blocks("w0", A, h[1:3], HOST)
    idx.add_blocks("w0", A, h[3:4], DISK)
    idx.add_blocks("node1", A, h[:5], POOL)
    idx.add_blocks("w1", B, h[:6], DEVICE)      # another tenant's prefix
    idx.add_blocks("w2", L, h[:3], DEVICE)      # same tenant, with an adapter
    m = idx.find_matches(A, h)
    assert m.as_dict()["w0"] == (2, 1, 1, 1, 0)
    assert m.as_dict()["w1"] == (0, 0, 0, 5, 6)
    assert m.as_dict()["w2"] == (0, 0, 0, 5, 3)
    assert m.pool_depth == 5
    blind = idx.find_matches(None, h)
    assert blind.as_dict()["w1"][:3] == (6, 0, 0)


def test_medium_names_map_to_tiers():
    assert [tier_of_medium(m) for m in (None, "GPU", "cpu", "CPU", "disk", "tape")] == \
        [DEVICE, DEVICE, HOST, HOST, DISK, DISK]


def test_pool_residency_events_translate_engine_hashes_learnt_from_engines():
    idx = ArtIndexer()
    idx.worker("node1", pool=True)
    toks = list(range(12))
    idx.apply("w0", EventBatch(0, (stored(toks, [7, b"\x08" * 32, 9]),)), A)
    # the node publishes the engine's hashes as its keys name them (text), without tokens,
    # medium cpu, with the scope
    pool_ev = BlockStored((b"7", b"08" * 32), None, (), 0, None, "cpu", None, ("acme", "m", "t", None))
    idx.apply("node1", EventBatch(0, (pool_ev,)), B, pool=True)
    idx.apply("w1", EventBatch(0, ()), A)
    m = idx.find_matches(A, chain_hashes(toks, BS))
    assert m.as_dict()["w1"] == (0, 0, 0, 2, 0) and m.pool_depth == 2


def test_limits_are_enforced():
    idx = ArtIndexer(IndexerLimits(max_workers=2))
    idx.worker("a")
    idx.worker("b")
    with pytest.raises(ValueError, match="more than 2 workers"):
        idx.worker("c")


# --------------------------------------------------------------------------- oracle

SCOPES = [A, B, L]
op_st = st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 5), st.integers(0, 2),
                  st.integers(0, 3), st.integers(0, 7), st.integers(1, 8))


@settings(max_examples=120, deadline=None)
@given(st.lists(op_st, max_size=60), st.integers(0, 2), st.integers(1, 8))
def test_art_indexer_agrees_with_the_dict_oracle(ops, qscope, qlen):
    """Random adds and removes of chain prefixes on 6 workers (w5 a pool node), 3 scopes,
    4 tiers; every query answers the same on both backends."""
    chains = [chain_hashes([c] * 4 + list(range(4 * 8)), BS) for c in range(3)]
    art, ref = ArtIndexer(IndexerLimits(max_workers=70)), DictIndexer()
    for idx in (art, ref):
        for w in range(5):
            idx.worker(f"w{w}")
        idx.worker("w5", pool=True)
        for s in SCOPES:
            idx.scope_id(s)
    for kind, w, s, tier, start, n in ops:
        worker = f"w{w}"
        tier = POOL if w == 5 else min(tier, DISK)
        hs = chains[s % 3][start:start + n]
        for idx in (art, ref):
            if kind == "add":
                idx.add_blocks(worker, SCOPES[s], hs, tier)
            else:
                idx.remove_blocks(worker, SCOPES[s], hs, tier)
    for chain in chains:
        for scope in SCOPES + [None]:
            a = art.find_matches(scope, chain[:qlen])
            r = ref.find_matches(scope, chain[:qlen])
            assert a.as_dict() == r.as_dict()
            assert a.pool_depth == r.pool_depth


def test_art_indexer_frees_slots_of_removed_blocks():
    idx = ArtIndexer(capacity=4)
    h = chain_hashes(range(4 * 50), BS)
    idx.add_blocks("w0", A, h, DEVICE)          # grows past the initial capacity
    assert len(idx) == 50
    idx.remove_blocks("w0", A, h, DEVICE)
    assert len(idx) == 0
    idx.add_blocks("w0", A, h[:10], HOST)
    assert len(idx) == 10 and np.all(idx.find_matches(A, h).host[:1] == 10)
