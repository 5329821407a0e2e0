"""The get path of LocalKvStore: leases on DRAM slots, SSD reads (blocking, or off the
event loop with concurrent gets of one block sharing one read), promotion into DRAM where
there is room, verified SSD extents for sendfile, leases on the shared arena (docs/shm.md),
``exists``.

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads.
"""
from __future__ import annotations

import asyncio
import itertools
import math
from typing import Iterable, Optional

from quillcache.errors import Busy, CapacityError, InvalidArgument, NotFound, QuillCacheError
from quillcache.model import KvBlockKey
from quillcache.store.guard import miss_error
from quillcache.store.options import MAX_PREFIX_KEYS
from quillcache.store.values import Entry, Lease

__all__ = ["Reads"]


class Reads:
    """Gets: leases, SSD reads, promotion."""

    def _locate(self, key: KvBlockKey) -> Entry:
        """The entry to serve for ``key``; raises NotFound / UnsafeReuse (guard)."""
        entry = self._entries.get(key)
        if entry is not None or (self._untouched and (entry := self._warm(key)) is not None):
            return entry
        try:
            served = self.guard.resolve_missing(key)
        except QuillCacheError:
            self._stats["dram"]["misses"] += 1
            self._stats["ssd"]["misses"] += 1
            raise
        if served.tenant_id != key.tenant_id or not key.scope.matches(served):
            self._counters["unsafe_served"] += 1
        return self._entry(served)

    def get(self, key: KvBlockKey, *, extent_ok: bool = False) -> Lease:
        """A lease on the block's bytes (read-only view); release it (or use ``with``).

        Blocking where the block must be read from the SSD tier (tools, tests); the daemon
        calls ``get_nowait`` and, when that says the SSD must be read, ``await get_async``.

        ``extent_ok``: the caller can send from a file (sendfile).  Then a block served from
        the SSD tier without being promoted (``promote_on_get`` off, or no DRAM room now)
        whose bytes were verified in this process comes as a lease with ``view`` None and
        ``extent`` = (fd, offset, length, crc32c), valid until the caller's next await."""
        entry = self._lookup(key)
        lease = self._lease_now(entry, extent_ok)
        if lease is not None:
            return lease
        read = self._ssd_read_start(entry)
        try:
            n = self._ssd.read_into(entry.key, read[1])
        except BaseException as exc:
            return self._ssd_read_end(entry, read, exc) or self.get(key)
        return self._ssd_read_end(entry, read, n) or self.get(key)

    def get_nowait(self, key: KvBlockKey, *, extent_ok: bool = False) -> Optional[Lease]:
        """``get`` without I/O: a lease on the DRAM copy, or a verified SSD extent (with
        ``extent_ok``), or None when the block must be read from the SSD tier first."""
        return self._lease_now(self._lookup(key), extent_ok)

    def _lookup(self, key: KvBlockKey) -> Entry:
        """The entry to serve for ``key`` once the store is open, ``key`` is a key and a lease
        has room (raising otherwise, and as ``_locate`` does).  The common case, all three
        true and an entry of exactly this key, costs no further call."""
        if self.closed or type(key) is not KvBlockKey or len(self._leases) >= self.max_leases:
            self._check_open()
            self._check_key(key)
            if len(self._leases) >= self.max_leases:
                raise Busy(f"{len(self._leases)} leases alive (max_leases={self.max_leases})")
        entry = self._entries.get(key)
        return entry if entry is not None else self._locate(key)

    def _lease_now(self, entry: Entry, extent_ok: bool) -> Optional[Lease]:
        served = entry.key
        now = self._clock()
        slot = self._dram.lookup(served)
        if slot is not None:
            entry.last_access = now
            self._stats["dram"]["hits"] += 1
            self._dram_lru.touch(served)
            return self._new_lease(served, self._dram.acquire(slot), "dram", slot, now)
        if extent_ok and not self._promotes(entry):
            extent = self._ssd.extent_of(served)     # None until its bytes were verified
            if extent is not None and extent[2] == entry.size:
                entry.last_access = now
                self._stats["dram"]["misses"] += 1
                self._stats["ssd"]["hits"] += 1
                self._stats["ssd"]["extent_leases"] += 1
                self._ssd_lru.touch(served)
                return self._new_lease(served, None, "ssd", None, now, extent)
        return None

    async def get_async(self, key: KvBlockKey) -> Lease:
        """``get`` that reads SSD-only blocks off the event loop (the tier's read pool).

        Concurrent gets of one SSD-only block share one read: the later ones wait for it
        and then find the block promoted, or share the buffer it was read into."""
        while True:
            entry = self._lookup(key)
            lease = self._lease_now(entry, False)
            if lease is not None:
                return lease
            other = self._reads.get(entry.key)
            if other is not None:
                shared = await asyncio.shield(other)   # its errors are the first reader's to report
                if shared is not None and shared[0] is entry and shared[1] == entry.version \
                        and self._entries.get(entry.key) is entry and self._dram.lookup(entry.key) is None:
                    self._stats["dram"]["misses"] += 1
                    self._stats["ssd"]["hits"] += 1
                    return self._new_lease(entry.key, memoryview(shared[2]).toreadonly(), "ssd", None,
                                           self._clock())
                continue
            fut = asyncio.get_running_loop().create_future()
            self._reads[entry.key] = fut
            lease = None
            try:
                read = self._ssd_read_start(entry)
                try:
                    n = await self._ssd.read_into_async(entry.key, read[1])
                except BaseException as exc:
                    lease = self._ssd_read_end(entry, read, exc)
                else:
                    lease = self._ssd_read_end(entry, read, n)
            finally:
                del self._reads[entry.key]
                # a buffer read (not promoted) is shared, read-only, with the gets that waited
                fut.set_result((entry, read[2], read[1]) if lease is not None and lease.tier == "ssd"
                               else None)
            if lease is not None:
                return lease                           # else: rewritten meanwhile, look again

    def _promotes(self, entry: Entry) -> bool:
        """A get of this SSD-only block copies it into DRAM: allowed, no put waits for room,
        and room without evicting anything."""
        return (self.promote_on_get and not self._waiting
                and self._dram.report()[1] >= entry.size)

    def _ssd_read_start(self, entry: Entry):
        """(DRAM slot to promote into or None, destination buffer, version) for one SSD read."""
        pending = None
        if self._promotes(entry):
            try:
                pending = self._dram.put_start(entry.key, entry.size)
                pending.slot.started = math.inf         # being filled: the reaper must not free it
            except CapacityError:
                pending = None
        return (pending, pending.view if pending is not None else bytearray(entry.size), entry.version)

    def _ssd_read_end(self, entry: Entry, read, outcome) -> Optional[Lease]:
        """The lease for an SSD read that ended with ``outcome`` (its length, or the
        exception); None when the key was rewritten meanwhile (look it up again)."""
        pending, buf, version = read
        key = entry.key
        now = self._clock()
        if isinstance(outcome, BaseException):
            if pending is not None:
                self._dram.put_abort(pending)
            if isinstance(outcome, NotFound) and self._entries.get(key) not in (entry, None):
                return None                            # rewritten meanwhile: look again
            if isinstance(outcome, NotFound):
                # The SSD tier dropped the block (CRC mismatch) or lost it: gone for everyone.
                if self._entries.get(key) is entry and self._dram.lookup(key) is None:
                    self._drop_entry(key)
                self._stats["ssd"]["misses"] += 1
                raise miss_error(key) from None
            raise outcome
        if outcome != entry.size:
            if pending is not None:
                self._dram.put_abort(pending)
            raise NotFound(f"ssd returned {outcome} bytes for a {entry.size}-byte block")
        if self._entries.get(key) is not entry or entry.version != version or self._dram.lookup(key) is not None:
            # Replaced, rewritten or removed while reading (an await): what we read is not current.
            if pending is not None:
                self._dram.put_abort(pending)
            if self._entries.get(key) is None:
                raise miss_error(key)
            return None
        entry.last_access = now
        self._stats["dram"]["misses"] += 1
        self._stats["ssd"]["hits"] += 1
        self._ssd_lru.touch(key)
        if pending is None:
            return self._new_lease(key, memoryview(buf).toreadonly(), "ssd", None, now)
        self._dram.put_end(pending)              # the key is now the most recent in the DRAM order
        self._record(entry)
        slot = self._dram.lookup(key)
        self._stats["dram"]["promotions"] += 1
        self._stats["ssd"]["promotions"] += 1
        return self._new_lease(key, self._dram.acquire(slot), "dram", slot, now)

    def _new_lease(self, key, view, tier, slot, now, extent=None) -> Lease:
        lease = Lease(self, key, view, tier, slot, now + self.lease_s, next(self._lease_ids), extent)
        self._leases[lease._id] = lease
        return lease

    def _end_lease(self, lease: Lease) -> None:
        self._leases.pop(lease._id, None)
        if lease.view is not None:
            try:
                lease.view.release()      # a view used after its lease ends raises ValueError
            except BufferError:
                pass                      # the caller made a derived view; documented hazard
        if lease._slot is not None and not self._dram.closed:
            self._dram.release(lease._slot)
            if self._waiting:
                self._wake()              # the block may be evictable (or its slot freed) now

    # ------------------------------------------------------------------ the shared arena

    def located_nowait(self, key: KvBlockKey) -> Optional[Lease]:
        """``get_nowait`` for a client that mapped the arena (docs/shm.md): a lease that holds
        the DRAM slot in place, without a view (the client reads it by ``offset``); None
        when the block is only on SSD (``await get_async`` promotes it where there is room)."""
        entry = self._lookup(key)
        served = entry.key
        slot = self._dram.lookup(served)
        if slot is None:
            return None
        now = self._clock()
        entry.last_access = now
        self._stats["dram"]["hits"] += 1
        self._dram_lru.touch(served)
        self._dram.hold(slot)
        return self._new_lease(served, None, "dram", slot, now)

    @property
    def arena_fd(self) -> int:
        """The DRAM arena's memfd (a trusted client maps it: docs/shm.md)."""
        return self._dram.fd

    @property
    def arena_bytes(self) -> int:
        return self._dram.capacity

    def get_into(self, key: KvBlockKey, buffer) -> int:
        """Copy the block into ``buffer`` (writable, large enough); returns its size."""
        self._check_open()
        self._check_key(key)
        dst = memoryview(buffer)
        if dst.readonly:
            raise InvalidArgument("get_into: the buffer is read-only")
        if dst.ndim != 1 or dst.itemsize != 1:
            dst = dst.cast("B")
        size = self._peek_size(key)
        if dst.nbytes < size:
            raise InvalidArgument(f"get_into: buffer of {dst.nbytes} bytes, block is {size} bytes")
        with self.get(key) as lease:
            dst[:lease.size] = lease.view
            return lease.size

    def _peek_size(self, key: KvBlockKey) -> int:
        entry = self._entry(key)
        if entry is None:
            served = self.guard.would_serve(key)
            if served is None:
                return 0              # the get below raises the guard's error
            entry = self._entry(served)
        return entry.size

    def exists(self, key: KvBlockKey) -> bool:
        """Would a get serve this key?  Strict mode: only the exact identity counts."""
        self._check_key(key)
        return key in self._entries or self.guard.would_serve(key) is not None

    def exists_prefix(self, keys: Iterable[KvBlockKey]) -> int:
        """How many of ``keys``, from the first, a get would serve."""
        keys = list(itertools.islice(keys, MAX_PREFIX_KEYS + 1))
        if len(keys) > MAX_PREFIX_KEYS:
            raise InvalidArgument(f"exists_prefix: more than {MAX_PREFIX_KEYS} keys")
        n = 0
        for key in keys:
            if not self.exists(key):
                break
            n += 1
        return n
