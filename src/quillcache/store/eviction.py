"""Victim selection of LocalKvStore: one predicate for every victim (``_may_evict``: never
a leased, hard-pinned or in-flight block), the victims of a tier in policy order
(unpinned first, then soft pins; on SSD the recovered blocks not touched yet come first),
and the evictions that cost no I/O.

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads
(``_entries``, ``_busy``, ``_demoting``, the LRUs, the tiers, ``_stats``).
"""
from __future__ import annotations

from typing import Optional

from quillcache.model import KvBlockKey, decode_key
from quillcache.store.dram import ARENA_UNIT, Slot
from quillcache.store.options import CLEAN_SCAN_BLOCKS, EVICT_AHEAD_FRACTION, EVICT_AHEAD_MAX_BYTES
from quillcache.store.ssdfile import round_up

__all__ = ["Eviction"]


class Eviction:
    """Which copies may go, in which order, and evicting them."""

    # ------------------------------------------------------------------ one predicate

    def _may_evict(self, key: KvBlockKey, now: float, soft_ok: bool, slot: Optional[Slot] = None) -> bool:
        """May this block's copy (its DRAM ``slot``, or with None its SSD copy) be evicted now?

        Never while a copy of it is in flight (busy, or queued for demotion), while a lease holds the DRAM slot, or
        while it is hard-pinned; a soft-pinned block only when ``soft_ok``."""
        if key in self._busy or key in self._demoting or (slot is not None and slot.refs > 0):
            return False
        entry = self._entries.get(key)
        return entry is not None and not (entry.pin_until > now and (entry.hard or not soft_ok))

    def _victims(self, tier: str, now: float, soft_ok: bool = True, leased: Optional[list] = None,
                 limit: Optional[int] = None):
        """(key, slot) of the blocks whose copy in ``tier`` may be evicted (``_may_evict``),
        in policy order: unpinned ones first, then soft-pinned ones (``soft_ok``); slot is
        None for the SSD tier.  Lazy: collect what to evict, then evict.  ``leased`` collects
        the keys skipped because a lease holds them (first pass).  ``limit``: look at that
        many keys of the order at most (both passes together), None: all of them."""
        dram = tier == "dram"
        lru = self._dram_lru if dram else self._ssd_lru
        if not dram and self._untouched:
            yield from self._untouched_victims(now)
        left = -1 if limit is None else limit
        for soft in ((False, True) if soft_ok else (False,)):
            for key in lru.candidates():
                if left == 0:
                    return
                left -= 1
                slot = self._dram.lookup(key) if dram else None
                if dram and slot is None:
                    continue
                if not self._may_evict(key, now, soft, slot):
                    if leased is not None and not soft and slot is not None and slot.refs > 0:
                        leased.append(key)
                    continue
                if soft and not self._entries[key].pin_until > now:
                    continue                # unpinned: the first pass had it
                yield key, slot

    def _untouched_victims(self, now: float):
        """Recovered blocks not touched yet, in index order: the first SSD victims.  Each is
        warmed as it is offered; the cursor never goes back (a block, once warm, is in the LRU)."""
        while self._untouched:
            page, more = self._index.page(b"", self._untouched_cursor, 64, self.holder)
            for ek in page:
                self._untouched_cursor = ek
                key = decode_key(ek)
                if key in self._entries or self._warm(key, ek) is None:
                    continue
                if self._may_evict(key, now, False):
                    yield key, None
            if not more:
                return

    def _costs_no_io(self, key: KvBlockKey) -> bool:
        """Evicting the DRAM copy loses nothing: no SSD tier (a cache drops), or the SSD copy is current."""
        if self._ssd is None:
            return True
        entry = self._entries[key]
        return entry.ssd_version == entry.version

    def _clean_scan(self) -> Optional[int]:
        """How many keys of the DRAM order a search for copies that go without I/O looks at:
        all of them without an SSD tier (every copy does, so the search stops at the first
        that may go), ``CLEAN_SCAN_BLOCKS`` with one (most copies may be dirty: a search of
        the whole order would cost each put in proportion to the blocks resident)."""
        return None if self._ssd is None else CLEAN_SCAN_BLOCKS

    def _evictable_bytes(self, now: float, enough: int, no_io: bool) -> int:
        """Bytes (in allocator units) that evicting DRAM copies could free, up to ``enough``;
        ``no_io``: only copies that can go without a demotion (among the first
        ``_clean_scan()`` keys of the order)."""
        total = 0
        leased = [] if no_io else None      # the leases that kept eviction off a block, once per attempt
        limit = self._clean_scan() if no_io else None
        for key, slot in self._victims("dram", now, leased=leased, limit=limit):
            if no_io and not self._costs_no_io(key):
                continue
            total += round_up(slot.size, ARENA_UNIT)
            if total >= enough:
                break
        if leased:
            self._stats["dram"]["lease_waits"] += len(leased)
        return total

    def _make_room(self, size: int, now: float) -> None:
        """Evict DRAM copies that cost no I/O, in policy order, until ``size`` fits in one
        extent, and at least ``EVICT_AHEAD_FRACTION`` of the tier (the next puts then find
        room without a walk of the order).

        The victims are collected a round at a time, never the whole order (that made every
        put into a full DRAM tier cost ~1.4 us per resident block): a round takes copies
        worth ``want`` bytes from the oldest end and evicts them; while free space is too
        fragmented for the extent, the next round wants twice as much."""
        dram = self._dram
        limit = self._clean_scan()
        ahead = min(int(dram.capacity * EVICT_AHEAD_FRACTION), EVICT_AHEAD_MAX_BYTES)
        want = max(size, ahead)
        while True:
            batch, got = [], 0
            for key, slot in self._victims("dram", now, limit=limit):
                if self._costs_no_io(key):
                    batch.append(key)
                    got += round_up(slot.size, ARENA_UNIT)
                    if got >= want:
                        break
            for key in batch:
                self._evict_dram(key)
            if not batch or dram.report()[1] >= size:
                return
            want *= 2

    def _evict_dram(self, key: KvBlockKey) -> None:
        """Free the DRAM copy; the block stays resident only if the SSD copy is current."""
        entry = self._entries[key]
        self._dram.unpublish(key)                   # out of the DRAM order with it
        self._stats["dram"]["evictions"] += 1
        if entry.ssd_version is not None and entry.ssd_version == entry.version:
            self._record(entry)
            return                                  # still readable from SSD
        if entry.ssd_version is not None:
            self._ssd_garbage.add(key)              # stale copy of older bytes
        self._drop_entry(key)

    async def _evict_ssd_one(self, exclude: Optional[KvBlockKey] = None) -> bool:
        now = self._clock()
        for key, _ in self._victims("ssd", now):
            if key == exclude:
                continue
            entry = self._entries[key]
            if self._dram.lookup(key) is None:
                self._drop_entry(key)               # its only copy goes
            else:
                entry.ssd_version = None            # the DRAM copy stays, now dirty
                self._ssd_lru.remove(key)
                self._record(entry)
            self._stats["ssd"]["evictions"] += 1
            self._busy.add(key)
            try:
                await self._ssd.remove(key)
            finally:
                self._busy.discard(key)
            return True
        return False
