"""The SGLang model gateway's approximate tree, for the ``sglang`` peer: per worker, the prompts
the gateway routed there, not what the engines' KV events say they cache.

sgl-router's ``cache_aware`` policy (HTTP workers, and gRPC workers that send no KV events)
inserts each request's prompt into the chosen worker's tree as it routes it.  A burst of
requests for one prefix therefore follows the first of them at once, and a burst of unmatched
prompts spreads by tree size, though no engine has computed anything yet.  It evicts each
worker's least recently used leaves down to ``max-tree-size`` (default 2^24 characters; at ~4
characters a token, 8,192 blocks of 512 tokens: ``default_max_blocks``).  It knows no identity:
hashes are the router's block-chain hashes, whoever sent them.

Bounded: at most ``max_blocks`` entries a worker, O(blocks) per insert and per match."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

__all__ = ["RoutedTree", "SGLANG_MAX_TREE_CHARS", "CHARS_PER_TOKEN", "default_max_blocks"]

SGLANG_MAX_TREE_CHARS = 1 << 24     # sgl-router ``--max-tree-size`` (characters of prompt text)
CHARS_PER_TOKEN = 4                 # English text under a BPE tokenizer (Llama 3: ~4.2)


def default_max_blocks(block_size: int) -> int:
    """``--max-tree-size`` in blocks of ``block_size`` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size {block_size!r}: at least 1")
    return max(1, SGLANG_MAX_TREE_CHARS // (CHARS_PER_TOKEN * block_size))


class RoutedTree:
    """Per worker, the block hashes of the prompts routed to it, least recently used first."""

    __slots__ = ("max_blocks", "_held", "_lru")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"RoutedTree max_blocks {max_blocks!r}: at least 1")
        self.max_blocks = max_blocks
        self._held: dict[int, set] = {}                 # hash -> workers it was routed to
        self._lru: dict[str, OrderedDict] = {}          # worker -> its hashes, least recent first

    def insert(self, hashes: Sequence[int], worker: str) -> None:
        """Route ``hashes`` (a prompt's chain) to ``worker``.  Its blocks become the most
        recently used there, the first the most recent of all, so eviction takes the leaves
        (the deepest blocks of the oldest prompts) before the prefixes they hang from."""
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._held.setdefault(h, set()).add(worker)
        while len(lru) > self.max_blocks:
            self._drop(lru.popitem(last=False)[0], worker)

    def depths(self, hashes: Sequence[int], names: Sequence[str]) -> np.ndarray:
        """Per worker of ``names``, the leading blocks of ``hashes`` routed to it."""
        out = np.zeros(len(names), np.int64)
        alive = list(range(len(names)))
        for i, h in enumerate(hashes):
            holders = self._held.get(h)
            if not holders:
                break
            alive = [j for j in alive if names[j] in holders]
            if not alive:
                break
            out[alive] = i + 1
        return out

    def sizes(self, names: Sequence[str]) -> np.ndarray:
        """Per worker, the blocks in its tree."""
        return np.array([len(self._lru.get(n, ())) for n in names], np.int64)

    def remove_worker(self, worker: str) -> None:
        for h in self._lru.pop(worker, ()):
            self._drop(h, worker)

    def _drop(self, h: int, worker: str) -> None:
        holders = self._held[h]
        holders.discard(worker)
        if not holders:
            del self._held[h]
