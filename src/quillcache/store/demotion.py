"""Demotion of LocalKvStore: moving DRAM copies to the SSD tier, for room (a put waits:
``_pressure`` starts up to MAX_DEMOTIONS_IN_FLIGHT demotions and wakes the waiters as
each ends) or by maintenance (above the high watermark, or older than demote_after_s);
the SSD writes and removes they need.

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads
(``_waiting``, ``_demoting``, ``_demoting_bytes``, ``_demotion_tasks``, ``_busy``,
``_ssd_garbage``, the tiers and the LRUs).
"""
from __future__ import annotations

import asyncio
import functools
import logging

from quillcache.errors import CapacityError, QuillCacheError
from quillcache.model import KvBlockKey
from quillcache.store.options import MAX_DEMOTIONS_IN_FLIGHT

__all__ = ["Demotion"]

log = logging.getLogger("quillcache.store")


class Demotion:
    """DRAM -> SSD moves, for room and by maintenance."""

    # ------------------------------------------------------------------ back-pressure

    def _wake(self) -> None:
        """Room may have been freed: every waiting reserve tries again, oldest first."""
        for waiter in self._waiting:
            if waiter.fut is not None and not waiter.fut.done():
                waiter.fut.set_result(None)

    def _pressure(self) -> None:
        """Start demotions (up to MAX_DEMOTIONS_IN_FLIGHT) while puts wait for room or DRAM
        is above the high watermark; each one that ends wakes the waiters and comes back here."""
        if self._ssd is None or self.closed:
            return
        dram = self._dram
        # Free bytes are not counted for the waiters: they could not place their blocks in
        # them (fragmentation), so the room must come from blocks that go.
        need = max(sum(w.size for w in self._waiting), dram.used - int(self.high_watermark * dram.capacity))
        need -= self._demoting_bytes
        if need <= 0 or len(self._demoting) >= MAX_DEMOTIONS_IN_FLIGHT:
            return
        now = self._clock()
        victims = []
        for key, slot in self._victims("dram", now):
            if len(self._demoting) + len(victims) >= MAX_DEMOTIONS_IN_FLIGHT or need <= 0:
                break
            if self._costs_no_io(key):
                continue                    # clean copies go without I/O when a put needs them
            victims.append((key, slot.size))
            need -= slot.size
        loop = asyncio.get_running_loop()
        for key, size in victims:
            self._demoting[key] = size
            self._demoting_bytes += size
            task = loop.create_task(self._demote(key, for_room=True))
            self._demotion_tasks.add(task)
            task.add_done_callback(functools.partial(self._demotion_done, key))

    def _demotion_done(self, key: KvBlockKey, task: asyncio.Task) -> None:
        self._demotion_tasks.discard(task)
        self._demoting_bytes -= self._demoting.pop(key, 0)
        if not task.cancelled() and task.exception() is not None:
            log.error("demotion of %r failed: %r", key, task.exception())
        if self._waiting:
            self._wake()
        self._pressure()

    # ------------------------------------------------------------------ SSD moves

    async def _ssd_write(self, key: KvBlockKey, data) -> None:
        """ssd.put, evicting SSD blocks (policy order) while the SSD tier says it is full."""
        while True:
            try:
                await self._ssd.put(key, data)
                return
            except CapacityError:
                if not await self._evict_ssd_one(exclude=key):
                    raise

    async def _ssd_remove_if_unowned(self, key: KvBlockKey) -> None:
        entry = self._entry(key)
        if entry is not None and entry.ssd_version is not None:
            self._ssd_garbage.discard(key)     # a newer durable copy owns the SSD key now
            return
        self._ssd_garbage.discard(key)
        await self._ssd.remove(key)

    async def _demote(self, key: KvBlockKey, for_room: bool = False) -> bool:
        """Move one block's DRAM copy to SSD (write it if the SSD copy is not current).

        ``for_room``: a put waits for the slot.  If the SSD tier cannot take the block (full
        of pinned blocks, or failed) the block is then dropped, counted in ``dropped_dirty``
        and logged; otherwise (maintenance) it stays in DRAM."""
        entry = self._entries.get(key)
        slot = self._dram.lookup(key)
        if entry is None or slot is None:
            return False
        if entry.ssd_version != entry.version:
            version = entry.version
            self._dram.hold(slot)                  # the slot must outlive the write
            self._busy.add(key)
            try:
                await self._ssd_write(key, self._dram.raw_view(slot).toreadonly())
            except (QuillCacheError, OSError) as exc:
                if not for_room:
                    raise
                self._busy.discard(key)
                if self._entries.get(key) is entry and entry.version == version and self._dram.lookup(key) is slot:
                    log.error("dram full and the SSD tier cannot take block %r (%d bytes): %s; "
                              "the block is dropped", key, slot.size, exc)
                    self._counters["dropped_dirty"] += 1
                    self._evict_dram(key)
                return False
            finally:
                self._busy.discard(key)
                self._dram.release(slot)
            current = self._entries.get(key)
            if current is not entry or entry.version != version:
                # Replaced or removed while writing: what we wrote is stale.
                if current is None or current.ssd_version is None:
                    await self._ssd_remove_if_unowned(key)
                return False
            entry.ssd_version = version
            self._ssd_lru.insert(key)
            self._record(entry)
        if self._dram.lookup(key) is not slot or slot.refs > 0:
            return False                           # leased meanwhile: stays in DRAM, now clean
        self._dram.unpublish(key)               # out of the DRAM order with it
        self._record(entry)
        self._stats["dram"]["demotions"] += 1
        self._stats["ssd"]["demotions"] += 1
        if self._waiting:
            self._wake()
        return True

    def _demotion_victims(self, now: float, target_used: int) -> list[KvBlockKey]:
        """Victims bringing DRAM use down to ``target_used`` (maintenance, high -> low watermark)."""
        victims = []
        excess = self._dram.used - target_used - self._demoting_bytes
        for key, slot in self._victims("dram", now):
            if excess <= 0:
                break
            victims.append(key)
            excess -= slot.size
        return victims

    def _aged_victims(self, now: float) -> list[KvBlockKey]:
        """Unpinned blocks not read for ``demote_after_s`` (policy order: stop at the first younger)."""
        cutoff = now - self.demote_after_s
        victims = []
        for key, _ in self._victims("dram", now, soft_ok=False):
            if self._entries[key].last_access > cutoff:
                break
            victims.append(key)
        return victims
