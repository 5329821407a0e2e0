"""Eviction policy: which resident block of a tier goes first.

LRU, kept in a plain ``dict`` (a dict keeps insertion order): ``touch`` deletes and
re-inserts a key (the MRU end) in O(1), ``candidates`` walks from the LRU end.  An
``OrderedDict`` keeps a linked-list node per key besides its table: ~105 B of a resident
block's memory where the plain dict's entry costs ~41 B.  The holes that deletes leave are
dropped only when the table is next rebuilt (after up to ~N more inserts), and a walk from
the front skips every hole left there by the keys evicted since: the store walks once per
round of evictions, not once per put (store/eviction.py ``_make_room``, docs/tiering.md).

Two ways to hold the order:

* its own dict (``LruPolicy()``: key -> None), where the policy decides which keys are in
  it (``insert``, ``remove``): the SSD tier's order and the trace replay;
* a dict it is handed (``LruPolicy(order=d)``), whose owner adds and removes the keys and
  whose values the policy keeps: the policy only moves a present key, value and all, to
  the most recent end.  The DRAM tier's ``published`` dict (key -> Slot) is its own
  eviction order this way: it holds exactly the keys published in DRAM, a publish (a new
  key or a re-put) puts the key at the most recent end (store/dram.py ``put_end``,
  ``_native.batch.commit_many``), and an LRU ``touch`` moves it there again
  (``_native.batch.hold_published`` does the same in native code).  One dict per DRAM
  block instead of two: ~41 B per resident block at 1 M blocks.

FIFO is LRU without ``touch``: reads do not reorder.

The policy knows nothing about leases, pins or in-flight writes; the tier manager filters
those out while it walks (see docs/tiering.md for why LRU and what the trace replay says
about it).

The same class drives the byte store (store/tiers.py) and the trace simulation
(bench/trace_hit_rate.py), so the hit rates in the docs are those of this code.
"""
from __future__ import annotations

from typing import Hashable, Iterator, Optional

__all__ = ["LruPolicy", "FifoPolicy", "make_policy", "POLICIES"]

_ABSENT = object()


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self, order: Optional[dict] = None) -> None:
        """``order``: a dict whose owner adds and removes its keys (the policy keeps its
        values and only moves keys within it); None: the policy keeps its own (key -> None)."""
        if order is not None and type(order) is not dict:
            raise TypeError(f"order must be a plain dict (kept in insertion order), not {type(order).__name__}")
        self._owns = order is None
        self._order: dict = {} if order is None else order

    @property
    def owns_keys(self) -> bool:
        """True where ``insert`` adds keys and ``remove`` drops them (the policy's own dict);
        False where the dict's owner does both (``insert`` only moves a present key)."""
        return self._owns

    def insert(self, key: Hashable) -> None:
        """A block became resident (or was rewritten): it is the most recent.  In a handed
        dict the owner added the key; a present key is moved to the most recent end."""
        order = self._order
        if self._owns:
            order.pop(key, None)
            order[key] = None
        else:
            LruPolicy.touch(self, key)      # a present key moves (FIFO's touch would not)

    def touch(self, key: Hashable) -> None:
        """A block was read: a key the order holds goes to the most recent end (its value kept)."""
        order = self._order
        value = order.pop(key, _ABSENT)
        if value is not _ABSENT:
            order[key] = value

    @property
    def order(self) -> "dict | None":
        """The order itself, for a batch loop that refreshes keys in native code
        (``_native.batch.hold_published``: what ``touch`` does, key by key, values kept);
        read it, change it only as ``touch`` would.  None where reads do not refresh."""
        return self._order

    def remove(self, key: Hashable) -> None:
        """The block left the tier.  In a handed dict the owner removed it: nothing to do."""
        if self._owns:
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


def make_policy(name: str = "lru", order: Optional[dict] = None) -> LruPolicy:
    """The policy called ``name``; ``order``: a dict to order whose owner adds and removes
    its keys (``LruPolicy``), None: the policy's own."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    return cls(order)
