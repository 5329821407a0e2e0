"""Rendezvous (highest random weight) placement.

Each key has a 64-bit hash (``key_hash``: BLAKE2b of its encoded form, which carries the
identity scope, the prefix hash and the block hash); each node a 64-bit hash of its id.
A node's weight for a key is ``mix64(key_hash ^ node_hash)`` (splitmix64's finaliser);
the key's nodes in HRW order are the nodes by falling weight, ties by node id.  When a
node joins or leaves, only the keys whose first node it is (or becomes) move.

``Ring`` holds one membership's node hashes and answers for one key (pure Python) or
for a batch (numpy, one pass over a keys x nodes weight matrix).  ``order_by_sorting``
is the oracle the tests hold both against.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import numpy as np

__all__ = ["key_hash", "node_hash", "mix64", "Ring", "order_by_sorting"]

_M64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def key_hash(encoded_key: bytes) -> int:
    """The key's 64-bit placement hash (of ``model.encode_key`` bytes)."""
    return int.from_bytes(hashlib.blake2b(encoded_key, digest_size=8).digest(), "little")


def node_hash(node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(node_id.encode("utf-8"), digest_size=8, person=b"qc-node").digest(),
                          "little")


def mix64(x: int) -> int:
    x &= _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def order_by_sorting(node_ids: Iterable[str], khash: int) -> list[str]:
    """The oracle: every node's weight computed, then sorted (falling weight, then id)."""
    return sorted(node_ids, key=lambda n: (-mix64(khash ^ node_hash(n)), n))


class Ring:
    """One membership's placement.  Immutable: a view change makes a new Ring."""

    __slots__ = ("nodes", "_hashes", "_np_hashes")

    def __init__(self, node_ids: Iterable[str]) -> None:
        self.nodes: tuple[str, ...] = tuple(sorted(set(node_ids)))
        self._hashes = [node_hash(n) for n in self.nodes]
        self._np_hashes = np.array(self._hashes, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.nodes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ring) and other.nodes == self.nodes

    def __hash__(self) -> int:
        return hash(self.nodes)

    def order(self, khash: int, n: int = 0) -> list[str]:
        """The first ``n`` nodes (all when 0) for the key, in HRW order."""
        weights = [(mix64(khash ^ h), node) for h, node in zip(self._hashes, self.nodes)]
        # falling weight, then the smaller id first: sort by (-weight, id)
        weights.sort(key=lambda wn: (-wn[0], wn[1]))
        out = [node for _, node in weights]
        return out[:n] if n else out

    def home(self, khash: int) -> str:
        """The key's first node (raises IndexError on an empty ring)."""
        best_w, best = -1, ""
        for h, node in zip(self._hashes, self.nodes):
            w = mix64(khash ^ h)
            if w > best_w or (w == best_w and node < best):
                best_w, best = w, node
        if best_w < 0:
            raise IndexError("no nodes in the ring")
        return best

    def homes(self, khashes: Sequence[int]) -> list[str]:
        """The first node of each key, for a batch (numpy: one keys x nodes weight matrix)."""
        if not self.nodes:
            raise IndexError("no nodes in the ring")
        if len(khashes) < 8:
            return [self.home(k) for k in khashes]
        x = np.array(khashes, dtype=np.uint64)[:, None] ^ self._np_hashes[None, :]
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(_C1)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(_C2)
            x = x ^ (x >> np.uint64(31))
        # argmax takes the first maximum: nodes are sorted, so ties go to the smaller id
        idx = np.argmax(x, axis=1)
        nodes = self.nodes
        return [nodes[i] for i in idx.tolist()]
