"""The put path of LocalKvStore: two-phase puts into DRAM slots (reserve, write the view,
``put_end`` publishes), all-or-nothing reserves of a batch, waiting (up to
``put_timeout_s``) while demotions make room, durable puts (SSD before visible).

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Optional

from quillcache._native.batch import check_columns, commit_many
from quillcache.errors import Busy, CapacityError, InvalidArgument
from quillcache.model import KvBlockKey
from quillcache.store.dram import PendingPut
from quillcache.store.values import Entry, PutHandle, Waiter

__all__ = ["Writes"]


class Writes:
    """Puts: reserve, write, publish."""

    def put_start(self, key: KvBlockKey, size: int, durable: bool = False) -> PutHandle:
        """Reserve a DRAM slot now; write ``size`` bytes into ``handle.view``.

        Never waits: where room needs a demotion first (an SSD write) it raises Busy; the
        daemon and ``put`` use ``reserve`` (awaitable) and ``reserve_nowait`` instead."""
        handles = self.reserve_nowait(((key, size),), durable)
        if handles is None:
            raise Busy(f"dram full: {size} bytes need a demotion to the SSD tier first "
                       "(await reserve() to wait for it)")
        return handles[0]

    def reserve_nowait(self, items, durable: bool = False) -> Optional[list[PutHandle]]:
        """Reserve DRAM slots for every ``(key, size)`` of ``items`` at once (all or nothing).

        Evicts blocks that can go without I/O (clean copies; any block in a store without an
        SSD tier).  Returns None when only demotions (SSD writes) can make the room, or when
        earlier puts already wait for them: then ``await reserve(...)``.  CapacityError when
        nothing could ever make the room; nothing changes then."""
        items = list(items)
        return self.reserve_columns_nowait([k for k, _ in items], [s for _, s in items], durable)

    def reserve_columns_nowait(self, keys: list, sizes: list, durable: bool = False) -> Optional[list[PutHandle]]:
        """``reserve_nowait`` of ``zip(keys, sizes)``: a batch request's columns as they were decoded."""
        self._check_open()
        if not keys:
            return []
        total = self._check_columns(keys, sizes)
        if durable and self._ssd is None:
            raise InvalidArgument("durable put needs an SSD tier (this store is DRAM only)")
        if len(self._handles) + len(keys) > self.max_inflight_puts:
            raise Busy(f"{len(self._handles)} puts in flight (max_inflight_puts={self.max_inflight_puts})")
        if self._waiting:
            return None                     # first come, first served: queue behind the waiters
        return self._reserve_all(keys, sizes, total, durable)

    def _check_columns(self, keys: list, sizes: list) -> int:
        """The batch's total bytes; InvalidArgument naming the first bad key or size."""
        if type(keys) is not list or type(sizes) is not list:
            keys, sizes = list(keys), list(sizes)
        try:
            return check_columns(keys, sizes, KvBlockKey, self._dram.max_block_bytes)
        except (TypeError, ValueError) as exc:
            i = exc.args[0] if exc.args and type(exc.args[0]) is int else None
            if i is None:
                raise
            if i < 0:
                raise InvalidArgument(f"{len(keys)} keys and {len(sizes)} sizes") from None
            self._check_key(keys[i])
            self._dram.check_size(sizes[i])
            raise                           # not reached: one of the two raised

    async def reserve(self, items, durable: bool = False) -> list[PutHandle]:
        """``reserve_nowait``, waiting (up to ``put_timeout_s``) while demotions make room."""
        items = list(items)
        keys, sizes = [k for k, _ in items], [s for _, s in items]
        handles = self.reserve_columns_nowait(keys, sizes, durable)
        if handles is not None:
            return handles
        waiter = Waiter(self._check_columns(keys, sizes))
        self._waiting.append(waiter)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        deadline = loop.time() + self.put_timeout_s
        self._counters["put_waits"] += 1
        try:
            while True:
                waiter.fut = loop.create_future()
                self._pressure()
                try:
                    async with asyncio.timeout_at(deadline):
                        await waiter.fut
                except TimeoutError:
                    self._counters["put_wait_timeouts"] += 1
                    raise Busy(f"dram full: waited {self.put_timeout_s:g} s for demotions to the SSD "
                               f"tier to make room for {waiter.size} bytes") from None
                self._check_open()
                handles = self._reserve_all(keys, sizes, waiter.size, durable)
                if handles is not None:
                    return handles
        finally:
            self._waiting.remove(waiter)
            self._put_wait_s += time.perf_counter() - t0
            if self._waiting:
                self._wake()                # the room this waiter did not take is for the next

    def _reserve_all(self, keys: list, sizes: list, total: int, durable: bool) -> Optional[list[PutHandle]]:
        if total > self._dram.capacity:
            raise CapacityError(total, *self._dram.report(),
                                f"{total} bytes in one request: more than the dram capacity "
                                f"({self._dram.capacity})")
        durable = durable or self.policy == "write_through"
        # the whole batch in one native pass where the arena has room now
        handles = self._dram.put_start_many(keys, sizes, durable, self._handles)
        if handles is not None:
            return handles
        placed: list[PendingPut] = []
        try:
            for key, size in zip(keys, sizes):
                pending = self._place(key, size)
                if pending is None:
                    for p in placed:
                        self._dram.put_abort(p)
                    return None
                placed.append(pending)
        except BaseException:
            for p in placed:
                self._dram.put_abort(p)
            raise
        for h in placed:
            h.durable = durable
            self._handles[h.slot] = h
        return placed

    def _place(self, key: KvBlockKey, size: int) -> Optional[PendingPut]:
        """One slot now, evicting what can go without I/O; None when a demotion must come first."""
        try:
            return self._dram.put_start(key, size)
        except CapacityError:
            pass
        now = self._clock()
        free = self._dram.report()[0]
        if self._evictable_bytes(now, size - free, no_io=True) + free >= size:
            self._make_room(size, now)      # only when eviction can succeed: a doomed put evicts nothing
            try:
                return self._dram.put_start(key, size)
            except CapacityError:
                pass                        # fragmented: what is left needs demotions
        if self._ssd is not None and (self._demoting or self._busy or self._evictable_bytes(now, 1, no_io=False)):
            return None                     # demotions (or SSD writes in flight) will free it: wait
        free, largest = self._dram.report()
        raise CapacityError(size, free, largest,
                            f"dram full: cannot place {size} bytes ({free} bytes free, largest "
                            f"extent {largest}) and nothing is evictable (leased, pinned or "
                            "in flight)")

    async def put_end(self, handle: PutHandle) -> None:
        """Publish the put.  Durable puts return after the SSD tier's durable publish."""
        pending = self._in_flight(handle)
        key = handle.key
        ssd_written = False
        if handle.durable:
            # Durable before visible: a reader that sees the block may rely on it surviving a restart.
            pending.slot.started = math.inf         # committing: the reaper must not free the slot
            self._busy.add(key)
            try:
                await self._ssd_write(key, pending.view)
                ssd_written = True
            except BaseException:
                self._handles.pop(pending.slot, None)
                self._dram.put_abort(pending)
                self._counters["puts_aborted"] += 1
                raise
            finally:
                self._busy.discard(key)
        entry, stale_ssd = self._publish(handle, pending, ssd_written)
        if stale_ssd:
            # The SSD holds older bytes of the key: drop them so they are never served.
            entry.ssd_version = None
            self._ssd_lru.remove(key)
            self._record(entry)
            await self._ssd_remove_if_unowned(key)
            return
        self._record(entry)

    def put_end_nowait(self, handle: PutHandle) -> bool:
        """``put_end`` of a put that needs no I/O: published now, True.  False, and nothing
        done, for one that does (durable: the SSD write first; older bytes of the key on
        the SSD tier: their removal): ``await put_end(handle)`` finishes it."""
        pending = self._in_flight(handle)
        if handle.durable:
            return False
        entry = self._entries.get(handle.key)
        if entry.ssd_version is not None if entry is not None else self._untouched:
            return False                            # an SSD copy (maybe a recovered one) to drop
        self._record(self._publish(handle, pending, False)[0])
        return True

    def put_end_many_nowait(self, handles: list, start: int = 0) -> int:
        """``put_end_nowait`` of ``handles[start:]`` in order, in one native pass, up to the
        first that needs I/O or is not in flight; returns how many were published (the
        caller finishes the one it stopped at with ``put_end_nowait`` or ``await put_end``,
        which give that handle's error, and goes on from the next)."""
        if self.closed or start >= len(handles):
            return 0
        done = commit_many(handles, start, self, self._dram, Entry, self._versions, self._clock())
        if done:
            self._counters["puts"] += done
            self._after_publish()
        return done

    def _added(self, entry: Entry) -> None:
        """A published put made a new entry (commit_many): the index and the listeners hear of it."""
        self._tell_added(entry)
        self._record(entry)

    def _in_flight(self, handle: PutHandle) -> PendingPut:
        pending = handle._pending
        if self._handles.get(pending.slot) is not handle or not self._dram.is_pending(pending):
            raise InvalidArgument("put handle is not in flight (already ended, aborted or reaped)")
        return pending

    def _publish(self, handle: PutHandle, pending: PendingPut, ssd_written: bool) -> tuple[Entry, bool]:
        """The slot becomes the key's bytes; returns (entry, whether an older SSD copy is now stale)."""
        key = handle.key
        del self._handles[pending.slot]
        self._dram.put_end(pending)                     # the key is now the most recent in the DRAM order
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None and self._untouched:
            entry = self._warm(key)
        version = next(self._versions)
        stale_ssd = False
        if entry is None:
            entry = Entry(key, handle.size, version, now)
            self._entries[key] = entry                 # recorded in the index by the caller
            self._tell_added(entry)
        else:
            stale_ssd = entry.ssd_version is not None and not ssd_written
            entry.size = handle.size
            entry.version = version
            entry.last_access = now
        self._counters["puts"] += 1
        if ssd_written:
            entry.ssd_version = version
            self._ssd_lru.insert(key)
            self._ssd_garbage.discard(key)
        self._after_publish()
        return entry, stale_ssd

    def _after_publish(self) -> None:
        """After one publish or a batch of them: wake the reserves waiting for room (a
        replaced slot was freed, or a clean block came), and demote ahead of the next puts
        when DRAM is past its high watermark."""
        if self._waiting:
            self._wake()
        if self._ssd is not None and self._dram.used > self.high_watermark * self._dram.capacity:
            self._pressure()

    @property
    def puts_reaped(self) -> int:
        """Puts the reaper has freed so far (``put_timeout``): a writer that saw this number
        change checks ``put_in_flight`` before writing on."""
        return self._counters["puts_reaped"]

    def put_in_flight(self, handle: PutHandle) -> bool:
        """``handle``'s slot is still its own to write (not ended, aborted or reaped)."""
        return self._handles.get(handle.slot) is handle

    def put_abort(self, handle: PutHandle) -> bool:
        pending = handle._pending
        if self._handles.pop(pending.slot, None) is None:
            return False
        self._counters["puts_aborted"] += 1
        freed = self._dram.put_abort(pending)
        if self._waiting:
            self._wake()
        return freed

    async def put(self, key: KvBlockKey, data, durable: bool = False) -> None:
        """Convenience: start, copy ``data`` (any bytes-like object) into the slot, end."""
        src = memoryview(data)
        if src.ndim != 1 or src.itemsize != 1:
            src = src.cast("B")
        (handle,) = await self.reserve(((key, src.nbytes),), durable)
        try:
            handle.view[:] = src
        except BaseException:
            self.put_abort(handle)
            raise
        await self.put_end(handle)
