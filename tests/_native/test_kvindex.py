"""The router's block table: token hash chains, the slot bitmasks beside the ART, and
match_levels (one routing decision's lookup) against the simple path: keys packed with
struct, looked up one by one, the masks walked block by block in Python."""
import struct
from array import array

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache._native.art import AdaptiveRadixTree
from quillcache._native.kvindex import (
    MATCH_MAX_KEYS, ROOT_HASH, chain_hashes, mask_add, mask_remove, match_levels,
)


def test_chain_hashes_are_stable_and_chain_through_the_parent():
    toks = list(range(64))
    a = chain_hashes(toks, 16)
    assert a == chain_hashes(array("I", toks), 16) == chain_hashes(tuple(toks), 16)
    assert a[1:] == chain_hashes(toks[16:], 16, a[0])
    assert chain_hashes(toks, 16, ROOT_HASH) == a
    assert len(set(a)) == 4 and all(-(1 << 63) <= h < (1 << 63) for h in a)
    assert chain_hashes(toks[:15], 16) == []


@pytest.mark.parametrize("bad, exc", [([1, -1], OverflowError), ([1, 1 << 32], OverflowError),
                                      (["x"], TypeError)])
def test_bad_token_ids_are_refused(bad, exc):
    with pytest.raises(exc):
        chain_hashes(bad * 8, 2)
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 0)


def test_mask_add_and_remove_keep_slots_and_tree_in_step():
    tree = AdaptiveRadixTree()
    masks = np.zeros((8, 4, 2), np.uint64)
    free = []
    keys = [b"k%d" % i for i in range(3)] + [b"k0"]        # a key twice in one batch
    nxt = mask_add(tree, keys, masks, 1, 70, free, 0)
    assert nxt == 3 and len(tree) == 3
    assert all(masks[tree[k], 1, 1] == 1 << 6 for k in keys)
    nxt = mask_add(tree, [b"k0"], masks, 0, 0, free, nxt)
    assert nxt == 3 and masks[tree[b"k0"], 0, 0] == 1
    assert mask_remove(tree, [b"k0", b"k1", b"nope"], masks, 1, 70, free) == 1   # k0 still on tier 0
    assert b"k1" not in tree and b"k0" in tree and len(free) == 1
    assert mask_add(tree, [b"k9"], masks, 2, 3, free, nxt) == nxt                 # reuses the slot
    with pytest.raises(ValueError):
        mask_add(tree, [b"a"] * 9, masks, 0, 0, [], 0)
    with pytest.raises(TypeError):
        mask_add(tree, ["str"], masks, 0, 0, [], 0)


KEY = struct.Struct(">Iq")
WORDS = 3                                   # 192 workers: bits in every word
ALL = (1 << 64) - 1


def simple_levels(tree, masks, pool_mask, sids, hashes, nw, local_only=False):
    """Block by block: the OR of the block's masks over the scopes, one level at a time; a
    worker's depth is the first block whose bit it lacks."""
    rows = []
    for h in hashes:
        row = np.zeros((4, WORDS), np.uint64)
        for sid in sids:
            slot = tree.get(KEY.pack(sid, h))
            if slot is not None:
                row |= masks[slot]
        rows.append(row)
    pool_any = [bool((r[3] & pool_mask).any()) for r in rows]
    pool_depth = next((i for i, p in enumerate(pool_any) if not p), len(rows))

    def bit(words, w):
        return bool(int(words[w >> 6]) >> (w & 63) & 1)

    def level(r, p, lv):
        local = r[0] | r[1] | r[2]
        if local_only:
            return local & ~pool_mask
        return [r[0], r[0] | r[1], local, local | (np.uint64(ALL) if p else np.uint64(0))][lv]

    out = np.zeros((1 if local_only else 4, nw), np.int64)
    for lv in range(out.shape[0]):
        for w in range(nw):
            d = 0
            for r, p in zip(rows, pool_any):
                if not bit(level(r, p, lv), w):
                    break
                d += 1
            out[lv, w] = d
    return out, pool_depth


placement = st.tuples(st.integers(0, 2), st.integers(0, 191), st.integers(0, 3), st.integers(0, 11),
                      st.integers(1, 12))


@settings(max_examples=150, deadline=None)
@given(st.lists(placement, max_size=40), st.sets(st.integers(0, 191), max_size=6),
       st.lists(st.integers(0, 3), min_size=0, max_size=3, unique=True), st.integers(0, 14),
       st.integers(1, 192), st.booleans())
def test_match_levels_agrees_with_the_block_by_block_walk(places, pool_workers, sids, qlen, nw, local_only):
    tree = AdaptiveRadixTree()
    masks = np.zeros((4096, 4, WORDS), np.uint64)
    pool_mask = np.zeros(WORDS, np.uint64)
    for w in pool_workers:
        pool_mask[w >> 6] |= np.uint64(1 << (w & 63))
    chain = [(-1) ** i * (i * 0x9E3779B97F4A7C15 % (1 << 62)) for i in range(16)]   # both signs
    nxt = 0
    for sid, w, tier, start, n in places:
        keys = [KEY.pack(sid, h) for h in chain[start:start + n]]
        nxt = mask_add(tree, keys, masks, tier, w, [], nxt)
    hashes = chain[:qlen]
    depth = np.full((1 if local_only else 4, nw), -7, np.int64)
    got = match_levels(tree, sids, hashes, masks, pool_mask, depth, local_only)
    want, want_pool = simple_levels(tree, masks, pool_mask, sids, hashes, nw, local_only)
    assert depth.tolist() == want.tolist()
    assert got == (want_pool if sids and hashes else 0)


def test_match_levels_refuses_bad_input_before_the_tree():
    tree = AdaptiveRadixTree()
    masks = np.zeros((4, 4, 1), np.uint64)
    pool = np.zeros(1, np.uint64)
    with pytest.raises(OverflowError):
        match_levels(tree, [0], [1 << 63], masks, pool, np.zeros((4, 8), np.int64))
    with pytest.raises(OverflowError):
        match_levels(tree, [-1], [5], masks, pool, np.zeros((4, 8), np.int64))
    with pytest.raises(ValueError, match="depth needs 4 rows"):
        match_levels(tree, [0], [5], masks, pool, np.zeros((3, 8), np.int64))
    with pytest.raises(ValueError, match="disagree on the workers"):
        match_levels(tree, [0], [5], masks, pool, np.zeros((4, 65), np.int64))    # 1 word: 64 workers
    with pytest.raises(ValueError, match=f"over {MATCH_MAX_KEYS} keys"):
        match_levels(tree, range(2), range(MATCH_MAX_KEYS // 2 + 1), masks, pool, np.zeros((4, 8), np.int64))
