"""Eviction policy: which resident block of a tier goes first.

LRU, kept in a plain ``dict`` (key -> None; a dict keeps insertion order): ``touch``
deletes and re-inserts a key (the MRU end) in O(1), ``candidates`` walks from the LRU end.
An ``OrderedDict`` keeps a linked-list node per key besides its table: ~105 B of a
resident block's memory where the plain dict's entry costs ~45 B.  The holes that deletes
leave are dropped when the table next grows, so a walk stays proportional to the keys.

The policy knows nothing about leases, pins or in-flight writes; the tier manager filters
those out while it walks (see docs/tiering.md for why LRU and what the trace replay says
about it).

The same class drives the byte store (store/tiers.py) and the trace simulation
(bench/trace_hit_rate.py), so the hit rates in the docs are those of this code.
"""
from __future__ import annotations

from typing import Hashable, Iterator

__all__ = ["LruPolicy", "FifoPolicy", "make_policy", "POLICIES"]


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: dict[Hashable, None] = {}

    def insert(self, key: Hashable) -> None:
        """A block became resident (or was rewritten): it is the most recent."""
        order = self._order
        order.pop(key, None)
        order[key] = None

    def touch(self, key: Hashable) -> None:
        """A block was read."""
        order = self._order
        if order.pop(key, 0) is None:
            order[key] = None

    @property
    def order(self) -> "dict[Hashable, None] | None":
        """The order itself, for a batch loop that refreshes keys in native code
        (``_native.batch.hold_published``: what ``touch`` does, key by key); read it, change it
        only as ``touch`` would.  None where reads do not refresh."""
        return self._order

    @property
    def insert_order(self) -> "dict[Hashable, None]":
        """The order, for a batch loop that does what ``insert`` does key by key in native
        code (``_native.batch.commit_many``): delete the key, add it at the most recent end."""
        return self._order

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self) -> Hashable | None:
        """The first candidate, or None when empty."""
        for key in self._order:
            return key
        return None

    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order, lazily: collect victims first, evict after iterating."""
        return iter(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class FifoPolicy(LruPolicy):
    """First in, first out: reads do not refresh (the baseline in the trace table)."""

    name = "fifo"
    order = None

    def touch(self, key: Hashable) -> None:
        pass


POLICIES = {"lru": LruPolicy, "fifo": FifoPolicy}


def make_policy(name: str = "lru") -> LruPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
