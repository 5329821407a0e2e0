"""Residency bookkeeping of LocalKvStore: the exact-key cache of entries and the residency
index's records of this node, kept in step (``_record`` after every change of where a
block is); the blocks the SSD tier recovered at start (``_adopt_ssd``, warmed at their
first touch); the residency listener; listing.

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads:
``_index``, ``holder``, ``_entries``, ``_untouched``, ``_dram``, ``_ssd``, the LRUs and the
listener callbacks.  docs/residency-index.md describes the index.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from quillcache.errors import InvalidArgument
from quillcache.index.art import ArtIndex
from quillcache.model import (
    CacheTier, IdentityScope, KvBlockKey, decode_key, encode_key, encode_scope, encode_scope_prefix,
)
from quillcache.store.options import MAX_LIST_PAGE
from quillcache.store.values import Entry

__all__ = ["Residency"]

log = logging.getLogger("quillcache.store")

_IN_DRAM = (CacheTier.CPU_DRAM,)
_IN_SSD = (CacheTier.LOCAL_SSD,)
_IN_BOTH = (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD)


class Residency:
    """What is resident where, for LocalKvStore."""

    @property
    def index(self) -> ArtIndex:
        """The residency index; its records of worker ``holder`` are this store's (a pool's
        home keeps other nodes' records in it: cluster/records.py)."""
        return self._index

    # ------------------------------------------------------------------ residency listener

    def set_residency_listener(self, added: Optional[Callable[[bytes, int], None]],
                               dropped: Optional[Callable[[bytes], None]]) -> dict[bytes, Optional[int]]:
        """Be told, by encoded key, of every key that becomes resident (``added(ek, size)``)
        and every key that stops being (``dropped(ek)``: removed or evicted from every
        tier).  The cluster announces them to their homes.  The callbacks run inside store
        calls: they must be quick and not raise.  None, None: stop.

        Returns what is resident now: encoded key -> size, or None for a block recovered at
        start and not touched since (``resident_size`` tells its size).  Built without
        decoding a key (about 0.1 µs a block: a node restarting with millions of recovered
        blocks joins its pool at once; decoding each, as this did before, took ~17 µs)."""
        self._on_added, self._on_dropped = added, dropped
        if added is None:
            return {}
        now: dict[bytes, Optional[int]] = {}
        if self._untouched:
            now = dict.fromkeys(self._index.keys_of(self.holder))
        now.update((e.ek, e.size) for e in self._entries.values())
        return now

    def resident_size(self, ek: bytes) -> Optional[int]:
        """The size of the block resident here under encoded key ``ek``; None if none is."""
        size, tiers = self._index.holder(ek, self.holder)
        return size if tiers else None

    def stored_crc(self, ek: bytes) -> Optional[int]:
        """The CRC32C the SSD tier recorded when it wrote the block under encoded key ``ek``
        (None: no SSD copy).  Read without touching the block: the cluster announces a block
        recovered at start with it (docs/security.md)."""
        return None if self._ssd is None else self._ssd.crc_of(ek)

    # ------------------------------------------------------------------ the index's records of this node

    def _adopt_ssd(self, ssd) -> None:
        """At start: the blocks the SSD tier recovered (CRC-checked per its ``verify``) are
        resident, and the index must say exactly that.  A persistent index comes back with
        its own records; where the two disagree the SSD tier wins: a local record without
        an SSD block is dropped, an SSD block without a record is added; each kind of
        mismatch is counted (``reconciled``) and logged.  No entry is made: a recovered
        block gets one at its first touch (``_warm``), its index record meanwhile being
        its only record here."""
        if ssd is None:
            blob, key_off, lengths = b"", np.zeros(1, np.uint64), np.zeros(0, np.uint32)
        else:
            blob, key_off, lengths = ssd.block_table()
        got = self._index.agree_holder(self.holder, CacheTier.LOCAL_SSD, blob, key_off, lengths)
        self._untouched = len(lengths)
        added, resized, dropped = got["added"], got["resized"], got["dropped"]
        self.reconciled.update(index_agreed=got["agreed"], index_resized=resized,
                               index_added=added if self._index.persistent else 0, index_dropped=dropped)
        if self._index.persistent and added:
            log.warning("residency index: %d SSD blocks had no record in the index: added "
                        "(the SSD tier's data wins)", added)
        if resized:
            log.warning("residency index: %d records had another size than their SSD block: "
                        "corrected (the SSD tier's data wins)", resized)
        if dropped:
            log.warning("residency index: %d records of this node name no block of the SSD tier: "
                        "dropped (the SSD tier's data wins)", dropped)

    def _entry(self, key: KvBlockKey, ek: Optional[bytes] = None) -> Optional[Entry]:
        """The entry of the exact key, made now if it is a recovered block's first touch."""
        entry = self._entries.get(key)
        if entry is None and self._untouched:
            entry = self._warm(key, ek)
        return entry

    def _warm(self, key: KvBlockKey, ek: Optional[bytes] = None) -> Optional[Entry]:
        """First touch of an SSD block recovered at start: its entry, made from the index's
        record (after start, a record of this node without an entry is exactly such a block)."""
        ek = encode_key(key) if ek is None else ek
        size, tiers = self._index.holder(ek, self.holder)
        if not tiers:
            return None
        entry = Entry(key, size, next(self._versions), self._clock())   # its ek: the key's own encoding
        entry.ssd_version = entry.version
        self._entries[key] = entry
        self._ssd_lru.insert(key)
        self._untouched -= 1
        return entry

    def _record(self, entry: Entry, gone: bool = False) -> None:
        """Write entry's residency (tiers, size) to the index: call after every change of
        where a block is (DRAM publish/unpublish, SSD copy made/dropped, entry gone)."""
        if gone:
            tiers = ()
        elif entry.ssd_version is None:
            tiers = _IN_DRAM if self._dram.lookup(entry.key) is not None else ()
        else:
            tiers = _IN_BOTH if self._dram.lookup(entry.key) is not None else _IN_SSD
        self._index.set_holder(entry.key, entry.ek, self.holder, tiers, entry.size)

    def _add_entry(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._record(entry)
        self._tell_added(entry)

    def _tell_added(self, entry: Entry) -> None:
        """A key became resident here: the residency publisher and the cluster hear of it."""
        if self.on_residency is not None:
            self.on_residency(True, entry.key)
        if self._on_added is not None:
            self._on_added(entry.ek, entry.size)

    def _drop_entry(self, key: KvBlockKey) -> Optional[Entry]:
        entry = self._entry(key)
        if entry is None:
            return None
        del self._entries[key]
        self._record(entry, gone=True)
        if self.on_residency is not None:
            self.on_residency(False, key)
        self._pinned.discard(key)
        self._ssd_lru.remove(key)                   # the DRAM order loses it when the tier unpublishes it
        if self._on_dropped is not None:
            self._on_dropped(entry.ek)
        return entry

    # ------------------------------------------------------------------ listing

    def list_page(self, prefix: bytes, start_after: bytes = b"", limit: int = MAX_LIST_PAGE
                  ) -> tuple[list[bytes], bool]:
        """LIST: up to ``limit`` encoded keys resident on this node that start with ``prefix``
        (``encode_scope`` or ``encode_scope_prefix`` bytes) and sort after ``start_after``,
        in key order, and whether more follow.  A walk of the residency index from the
        cursor: its cost follows the page, not the size of the scope."""
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_PAGE:
            raise InvalidArgument(f"list limit {limit!r}: must be in 1..{MAX_LIST_PAGE}")
        return self._index.page(prefix, start_after, limit, self.holder)

    def list_prefix(self, scope: IdentityScope, prefix_hash: str) -> list[KvBlockKey]:
        """The resident keys of exactly this scope and prefix hash, in encoded-key order
        (block_index, then block_hash, then token_count)."""
        return self._list_all(encode_scope_prefix(scope, prefix_hash))

    def list_scope(self, scope: IdentityScope) -> list[KvBlockKey]:
        """The resident keys of one identity scope, in encoded-key order (quillctl ls)."""
        return self._list_all(encode_scope(scope))

    def _list_all(self, prefix: bytes) -> list[KvBlockKey]:
        out, cursor, more = [], b"", True
        while more:
            page, more = self.list_page(prefix, cursor, MAX_LIST_PAGE)
            out.extend(decode_key(ek) for ek in page)
            if page:
                cursor = page[-1]
        return out

    def check_residency(self) -> None:
        """Assert that the index's records of this node are exactly what the tiers hold
        (tests and QC_DEBUG): the exact-key cache, the DRAM and SSD tiers and the index
        must name the same keys, tiers and sizes.  O(resident blocks)."""
        index, holder = self._index, self.holder
        held = index.keys_of(holder)
        cached = {e.ek: e for e in self._entries.values()}
        untouched = held - set(cached)
        assert len(untouched) == self._untouched and set(cached) <= held, (
            f"index holds {len(untouched)} keys the store has no entry for ({self._untouched} recovered "
            f"blocks untouched), misses {len(set(cached) - held)}")
        for ek in untouched:                       # recovered at start, not touched: SSD only
            size, tiers = index.holder(ek, holder)
            assert tiers == _IN_SSD and self._ssd is not None and self._ssd.size_of(decode_key(ek)) == size, \
                (ek, tiers, size)
        for ek, entry in cached.items():
            size, tiers = index.holder(ek, holder)
            want = set()
            if self._dram.lookup(entry.key) is not None:
                want.add(CacheTier.CPU_DRAM)
            if entry.ssd_version is not None:
                want.add(CacheTier.LOCAL_SSD)
                assert self._ssd is not None and entry.key in self._ssd, f"{entry.key}: no SSD block"
            assert set(tiers) == want and size == entry.size, (entry.key, tiers, size, want, entry.size)
