"""The router's block table: token hash chains and the slot bitmasks beside the ART."""
from array import array

import numpy as np
import pytest

from quillcache._native.art import AdaptiveRadixTree
from quillcache._native.kvindex import ROOT_HASH, chain_hashes, mask_add, mask_remove


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
