"""LocalKvStore: the KV byte pool of one node (DRAM arena + optional SSD tier).

What the daemon calls: two-phase puts into DRAM slots, leased gets, removes, pins,
prefix listing, stats and a periodic ``maintenance(now)``.  The identity guard
(store/guard.py) decides every get whose exact key is absent.  docs/tiering.md describes
the policy; the short version:

* write_back: ``put_end`` publishes in DRAM and returns; ``maintenance`` demotes LRU blocks
  to the SSD tier when DRAM use passes ``high_watermark`` (down to ``low_watermark``) and
  blocks older than ``demote_after_s``.
* write_through (or ``durable=True`` per put): ``put_end`` returns only after the SSD tier's
  durable publish; the block is then in both tiers and DRAM can drop it without I/O.
* A get of an SSD-only block promotes it into a new DRAM slot when the arena has room
  without evicting; otherwise it is read into a temporary buffer that the lease owns.
* A put that finds no room evicts DRAM copies that cost no I/O (a current SSD copy, or any
  block in a store without SSD) in policy order (unpinned first, then soft pins); when only
  dirty blocks hold the room it waits (``await reserve``, up to ``put_timeout_s``) while
  they are demoted: nothing is dropped while the SSD tier can take it (``dropped_dirty``
  counts the blocks it could not).  ``_may_evict`` is the one rule for every victim:
  leased, hard-pinned and in-flight blocks are never evicted; when nothing can go the put
  fails with CapacityError and nothing changes.
* SSD reads run off the event loop (``get_nowait`` / ``await get_async``).
* remove of a leased block unpublishes it at once (no new reader finds it); its slot is
  freed when the last lease ends.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import math
import time
from typing import Callable, Iterable, Optional

import numpy as np

from quillcache.errors import Busy, CapacityError, InvalidArgument, NotFound, QuillCacheError
from quillcache.index.art import ArtIndex
from quillcache.model import (
    MAX_PIN_TTL_S, CacheTier, IdentityScope, KvBlockKey, decode_key, encode_key, encode_scope,
    encode_scope_prefix,
)
from quillcache.store.batchlease import BatchLeases
from quillcache.store.dram import ARENA_UNIT, DEFAULT_PUT_TIMEOUT_S, DramTier, PendingPut, Slot
from quillcache.store.guard import LOCAL_HOLDER, IdentityGuard, miss_error
from quillcache.store.policy import make_policy

__all__ = ["LocalKvStore", "Lease", "PutHandle", "WRITE_POLICIES"]

log = logging.getLogger("quillcache.store")

WRITE_POLICIES = ("write_back", "write_through")
DEFAULT_LEASE_S = 10.0               # seconds a get's view stays valid
DEFAULT_MAX_BLOCK_BYTES = 16 << 20   # bytes: largest block (capped at the dram capacity)
DEFAULT_MAX_LEASES = 65_536          # leases alive at once
DEFAULT_MAX_INFLIGHT_PUTS = 4_096    # puts between start and end at once
MAX_LEASE_S = 3600.0                 # seconds: longest lease
MAX_PREFIX_KEYS = 65_536             # keys in one exists_prefix call
MAX_LIST_PAGE = 65_536               # keys in one list_page call
DEFAULT_MAX_HARD_PIN_FRACTION = 0.5  # of the dram capacity that hard pins may hold
MAX_DEMOTIONS_IN_FLIGHT = 8          # SSD writes started at once to make room for waiting puts

_IN_DRAM = (CacheTier.CPU_DRAM,)
_IN_SSD = (CacheTier.LOCAL_SSD,)
_IN_BOTH = (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD)

_TIER_COUNTERS = ("hits", "misses", "demotions", "promotions", "evictions", "lease_waits")


class _Entry:
    """The hot per-key state of a resident block (the version of its bytes, pins, last
    access), cached by exact key for GET/PUT.  What is resident where (tier, size,
    identity) is recorded in the residency index; ``_record`` keeps the two in step."""

    __slots__ = ("key", "ek", "size", "version", "ssd_version", "pin_until", "hard", "last_access")

    def __init__(self, key: KvBlockKey, size: int, version: int, now: float, ek: Optional[bytes] = None):
        self.key = key
        self.ek = encode_key(key) if ek is None else ek    # the index key, encoded once
        self.size = size
        self.version = version           # bumped by every publish of new bytes for the key
        self.ssd_version: Optional[int] = None   # the version the SSD copy holds, or None
        self.pin_until = 0.0             # clock time; 0 = not pinned
        self.hard = False
        self.last_access = now


class _Waiter:
    """A reserve waiting for room: how many bytes, and the future its next try waits on."""

    __slots__ = ("size", "fut")

    def __init__(self, size: int):
        self.size = size
        self.fut: Optional[asyncio.Future] = None


class PutHandle:
    """A put between start and end: write exactly ``size`` bytes into ``view``."""

    __slots__ = ("_pending", "key", "size", "durable", "view")

    def __init__(self, pending: PendingPut, durable: bool):
        self._pending = pending
        self.key = pending.key
        self.size = pending.size
        self.durable = durable
        self.view = pending.view

    @property
    def offset(self) -> int:
        """Where the reserved slot starts in the DRAM arena (for a client that mapped it)."""
        return self._pending.slot.offset


class Lease:
    """A get's hold on a block: ``view`` (read-only) is valid until release or expiry."""

    __slots__ = ("key", "view", "extent", "size", "tier", "expires_at", "_store", "_slot", "_id")

    def __init__(self, store: "LocalKvStore", key: KvBlockKey, view: Optional[memoryview], tier: str,
                 slot: Optional[Slot], expires_at: float, lease_id: int, extent: Optional[tuple] = None):
        self._store = store
        self.key = key                   # the key served (another identity's only in modes tenant/off)
        self.view = view                 # None for an extent lease
        # (fd, offset, length, crc32c) of a verified SSD extent, instead of a view: only for
        # get(extent_ok=True).  Read it (sendfile) before the next await; send the CRC along.
        self.extent = extent
        self.size = len(view) if view is not None else extent[2] if extent is not None else slot.size
        self.tier = tier                 # "dram", or "ssd" (a temporary buffer or an extent)
        self._slot = slot
        self.expires_at = expires_at
        self._id = lease_id

    @property
    def released(self) -> bool:
        return self._store is None

    @property
    def offset(self) -> Optional[int]:
        """Where the block starts in the DRAM arena; None unless it is held there."""
        return self._slot.offset if self._slot is not None else None

    def release(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store._end_lease(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LocalKvStore(BatchLeases):
    """DRAM arena + optional SSD tier + identity guard + leases, pins and eviction."""

    def __init__(self, dram_capacity: int, *, ssd=None, policy: str = "write_back",
                 high_watermark: float = 0.9, low_watermark: float = 0.75,
                 demote_after_s: Optional[float] = None, lease_s: float = DEFAULT_LEASE_S,
                 guard_mode: str = "strict", max_block_bytes: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic, eviction: str = "lru",
                 put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S, hugepages: bool = False,
                 prefault: bool = False, max_leases: int = DEFAULT_MAX_LEASES,
                 max_inflight_puts: int = DEFAULT_MAX_INFLIGHT_PUTS,
                 max_hard_pin_fraction: float = DEFAULT_MAX_HARD_PIN_FRACTION,
                 promote_on_get: bool = True, index: Optional[ArtIndex] = None,
                 holder: str = LOCAL_HOLDER):
        if policy not in WRITE_POLICIES:
            raise InvalidArgument(f"policy {policy!r}: must be one of {', '.join(WRITE_POLICIES)}")
        if policy == "write_through" and ssd is None:
            raise InvalidArgument("policy write_through needs an SSD tier")
        if not 0.0 < low_watermark < high_watermark <= 1.0:
            raise InvalidArgument(f"watermarks low={low_watermark!r} high={high_watermark!r}: "
                                  "need 0 < low < high <= 1")
        if demote_after_s is not None and not demote_after_s > 0:
            raise InvalidArgument(f"demote_after_s {demote_after_s!r}: must be > 0 seconds or None")
        if not 0 < lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s {lease_s!r}: must be in (0, {MAX_LEASE_S}] seconds")
        for name, value in (("max_leases", max_leases), ("max_inflight_puts", max_inflight_puts)):
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} {value!r}: must be a positive integer")
        if not 0.0 <= max_hard_pin_fraction <= 1.0:
            raise InvalidArgument(f"max_hard_pin_fraction {max_hard_pin_fraction!r}: must be in [0, 1]")
        if max_block_bytes is None and isinstance(dram_capacity, int):
            max_block_bytes = min(DEFAULT_MAX_BLOCK_BYTES, dram_capacity - dram_capacity % 256)
        # The residency index: the one record of what is resident where (index/art.py,
        # docs/residency-index.md).  ``holder`` names this node's records in it.
        self._index = index if index is not None else ArtIndex()
        self.holder = holder
        self.guard = IdentityGuard(guard_mode, self._index, holder)   # checks the mode before the arena
        self._clock = clock
        self._dram = DramTier(dram_capacity, max_block_bytes=max_block_bytes, put_timeout_s=put_timeout_s,
                              hugepages=hugepages, prefault=prefault, clock=clock)
        self._ssd = ssd
        self.policy = policy
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.demote_after_s = demote_after_s
        self.lease_s = float(lease_s)
        self.max_leases = max_leases
        # A get of an SSD-only block copies it into DRAM when there is room (True), or leaves
        # DRAM to puts and serves it from the SSD tier each time (False; reloadable).
        self.promote_on_get = bool(promote_on_get)
        # on_residency(resident, key): told when a key becomes resident on this node and
        # when it leaves (the node's KV-event publisher, control/residency.py); None: off.
        self.on_residency = None
        self.max_inflight_puts = max_inflight_puts
        self.max_hard_pin_bytes = int(self._dram.capacity * max_hard_pin_fraction)
        self._dram_lru = make_policy(eviction)
        self._ssd_lru = make_policy(eviction)
        self._entries: dict[KvBlockKey, _Entry] = {}      # exact-key cache of the index's local records
        # The SSD blocks recovered at start that have no entry yet: the index's records of
        # this node are their only record until their first touch (_warm).  Evicted first,
        # in index order from _untouched_cursor (they are older than anything touched since).
        self._untouched = 0
        self._untouched_cursor = b""
        self._handles: dict[int, PutHandle] = {}          # slot seq -> in-flight put
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._versions = itertools.count(1)
        self._pinned: set[KvBlockKey] = set()
        self._busy: set[KvBlockKey] = set()               # demotion / SSD write in flight
        self._ssd_garbage: set[KvBlockKey] = set()        # stale SSD copies to remove
        self._waiting: list[_Waiter] = []                 # reserves waiting for room, oldest first
        self._demoting: dict[KvBlockKey, int] = {}        # key -> bytes: demotions started for room
        self._demoting_bytes = 0
        self._demotion_tasks: set[asyncio.Task] = set()
        self._put_wait_s = 0.0                            # seconds reserves spent waiting, summed
        self._reads: dict[KvBlockKey, asyncio.Future] = {}  # SSD reads in flight (get_async)
        self._stats = {"dram": dict.fromkeys(_TIER_COUNTERS, 0), "ssd": dict.fromkeys(_TIER_COUNTERS, 0)}
        self._stats["ssd"]["extent_leases"] = 0           # SSD hits handed out as extents (sendfile)
        self._counters = {"puts": 0, "puts_aborted": 0, "puts_reaped": 0, "leases_expired": 0,
                          "dropped_dirty": 0, "removes": 0, "unsafe_served": 0,
                          "put_waits": 0, "put_wait_timeouts": 0}
        self.closed = False
        self._on_added: Optional[Callable[[bytes, int], None]] = None    # residency listener (by encoded key)
        self._on_dropped: Optional[Callable[[bytes], None]] = None
        if guard_mode == "off":
            log.warning("IDENTITY GUARD OFF: blocks are reused by content hash across models, "
                        "tokenizers, adapters and TENANTS. This serves wrong KV and leaks data "
                        "between tenants; use it only for studies.")
        self.reconciled = {"index_added": 0, "index_dropped": 0, "index_resized": 0, "index_agreed": 0}
        self._adopt_ssd(ssd)

    @property
    def index(self) -> ArtIndex:
        """The residency index; its records of worker ``holder`` are this store's (a pool's
        home keeps other nodes' records in it: cluster/records.py)."""
        return self._index

    # ------------------------------------------------------------------ index upkeep

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

    def _entry(self, key: KvBlockKey, ek: Optional[bytes] = None) -> Optional[_Entry]:
        """The entry of the exact key, made now if it is a recovered block's first touch."""
        entry = self._entries.get(key)
        if entry is None and self._untouched:
            entry = self._warm(key, ek)
        return entry

    def _warm(self, key: KvBlockKey, ek: Optional[bytes] = None) -> Optional[_Entry]:
        """First touch of an SSD block recovered at start: its entry, made from the index's
        record (after start, a record of this node without an entry is exactly such a block)."""
        ek = encode_key(key) if ek is None else ek
        size, tiers = self._index.holder(ek, self.holder)
        if not tiers:
            return None
        entry = _Entry(key, size, next(self._versions), self._clock(), ek)
        entry.ssd_version = entry.version
        self._entries[key] = entry
        self._ssd_lru.insert(key)
        self._untouched -= 1
        return entry

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

    def _record(self, entry: _Entry, gone: bool = False) -> None:
        """Write entry's residency (tiers, size) to the index: call after every change of
        where a block is (DRAM publish/unpublish, SSD copy made/dropped, entry gone)."""
        if gone:
            tiers = ()
        elif entry.ssd_version is None:
            tiers = _IN_DRAM if self._dram.lookup(entry.key) is not None else ()
        else:
            tiers = _IN_BOTH if self._dram.lookup(entry.key) is not None else _IN_SSD
        self._index.set_holder(entry.key, entry.ek, self.holder, tiers, entry.size)

    def _add_entry(self, entry: _Entry) -> None:
        self._entries[entry.key] = entry
        self._record(entry)
        self._tell_added(entry)

    def _tell_added(self, entry: _Entry) -> None:
        """A key became resident here: the residency publisher and the cluster hear of it."""
        if self.on_residency is not None:
            self.on_residency(True, entry.key)
        if self._on_added is not None:
            self._on_added(entry.ek, entry.size)

    def _drop_entry(self, key: KvBlockKey) -> Optional[_Entry]:
        entry = self._entry(key)
        if entry is None:
            return None
        del self._entries[key]
        self._record(entry, gone=True)
        if self.on_residency is not None:
            self.on_residency(False, key)
        self._pinned.discard(key)
        self._dram_lru.remove(key)
        self._ssd_lru.remove(key)
        if self._on_dropped is not None:
            self._on_dropped(entry.ek)
        return entry

    def _check_key(self, key: object) -> None:
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key {key!r}: must be a KvBlockKey")

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("the store is closed")

    # ------------------------------------------------------------------ puts

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
        self._check_open()
        items = list(items)
        if not items:
            return []
        for key, size in items:
            self._check_key(key)
            self._dram.check_size(size)
        if durable and self._ssd is None:
            raise InvalidArgument("durable put needs an SSD tier (this store is DRAM only)")
        if len(self._handles) + len(items) > self.max_inflight_puts:
            raise Busy(f"{len(self._handles)} puts in flight (max_inflight_puts={self.max_inflight_puts})")
        if self._waiting:
            return None                     # first come, first served: queue behind the waiters
        return self._reserve_all(items, durable)

    async def reserve(self, items, durable: bool = False) -> list[PutHandle]:
        """``reserve_nowait``, waiting (up to ``put_timeout_s``) while demotions make room."""
        handles = self.reserve_nowait(items, durable)
        if handles is not None:
            return handles
        items = list(items)
        waiter = _Waiter(sum(size for _, size in items))
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
                handles = self._reserve_all(items, durable)
                if handles is not None:
                    return handles
        finally:
            self._waiting.remove(waiter)
            self._put_wait_s += time.perf_counter() - t0
            if self._waiting:
                self._wake()                # the room this waiter did not take is for the next

    def _reserve_all(self, items: list, durable: bool) -> Optional[list[PutHandle]]:
        total = sum(size for _, size in items)
        if total > self._dram.capacity:
            raise CapacityError(total, *self._dram.report(),
                                f"{total} bytes in one request: more than the dram capacity "
                                f"({self._dram.capacity})")
        placed: list[PendingPut] = []
        try:
            for key, size in items:
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
        durable = durable or self.policy == "write_through"
        handles = [PutHandle(p, durable) for p in placed]
        for h in handles:
            self._handles[h._pending.slot.seq] = h
        return handles

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

    # ------------------------------------------------------------------ eviction: one predicate

    def _may_evict(self, key: KvBlockKey, now: float, soft_ok: bool, slot: Optional[Slot] = None) -> bool:
        """May this block's copy (its DRAM ``slot``, or with None its SSD copy) be evicted now?

        Never while a copy of it is in flight (busy, or queued for demotion), while a lease holds the DRAM slot, or
        while it is hard-pinned; a soft-pinned block only when ``soft_ok``."""
        if key in self._busy or key in self._demoting or (slot is not None and slot.refs > 0):
            return False
        entry = self._entries.get(key)
        return entry is not None and not (entry.pin_until > now and (entry.hard or not soft_ok))

    def _victims(self, tier: str, now: float, soft_ok: bool = True, leased: Optional[list] = None):
        """(key, slot) of the blocks whose copy in ``tier`` may be evicted (``_may_evict``),
        in policy order: unpinned ones first, then soft-pinned ones (``soft_ok``); slot is
        None for the SSD tier.  Lazy: collect what to evict, then evict.  ``leased`` collects
        the keys skipped because a lease holds them (first pass)."""
        dram = tier == "dram"
        lru = self._dram_lru if dram else self._ssd_lru
        if not dram and self._untouched:
            yield from self._untouched_victims(now)
        for soft in ((False, True) if soft_ok else (False,)):
            for key in lru.candidates():
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

    def _costs_no_io(self, key: KvBlockKey) -> bool:
        """Evicting the DRAM copy loses nothing: no SSD tier (a cache drops), or the SSD copy is current."""
        if self._ssd is None:
            return True
        entry = self._entries[key]
        return entry.ssd_version == entry.version

    def _evictable_bytes(self, now: float, enough: int, no_io: bool) -> int:
        """Bytes (in allocator units) that evicting DRAM copies could free, up to ``enough``;
        ``no_io``: only copies that can go without a demotion."""
        total = 0
        leased = [] if no_io else None      # the leases that kept eviction off a block, once per attempt
        for key, slot in self._victims("dram", now, leased=leased):
            if no_io and not self._costs_no_io(key):
                continue
            total += -(-slot.size // ARENA_UNIT) * ARENA_UNIT
            if total >= enough:
                break
        if leased:
            self._stats["dram"]["lease_waits"] += len(leased)
        return total

    def _make_room(self, size: int, now: float) -> None:
        """Evict DRAM copies that cost no I/O, in policy order, until ``size`` fits in one extent."""
        dram = self._dram
        victims = [key for key, _ in self._victims("dram", now) if self._costs_no_io(key)]
        for key in victims:
            if dram.report()[1] >= size:
                return
            self._evict_dram(key)

    def _evict_dram(self, key: KvBlockKey) -> None:
        """Free the DRAM copy; the block stays resident only if the SSD copy is current."""
        entry = self._entries[key]
        self._dram.unpublish(key)
        self._dram_lru.remove(key)
        self._stats["dram"]["evictions"] += 1
        if entry.ssd_version is not None and entry.ssd_version == entry.version:
            self._record(entry)
            return                                  # still readable from SSD
        if entry.ssd_version is not None:
            self._ssd_garbage.add(key)              # stale copy of older bytes
        self._drop_entry(key)

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

    async def put_end(self, handle: PutHandle) -> None:
        """Publish the put.  Durable puts return after the SSD tier's durable publish."""
        pending = handle._pending
        if self._handles.get(pending.slot.seq) is not handle or not self._dram.is_pending(pending):
            raise InvalidArgument("put handle is not in flight (already ended, aborted or reaped)")
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
                self._handles.pop(pending.slot.seq, None)
                self._dram.put_abort(pending)
                self._counters["puts_aborted"] += 1
                raise
            finally:
                self._busy.discard(key)
        del self._handles[pending.slot.seq]
        self._dram.put_end(pending)
        now = self._clock()
        entry = self._entries.get(key)
        ek = None
        if entry is None and self._untouched:
            ek = encode_key(key)
            entry = self._warm(key, ek)
        version = next(self._versions)
        stale_ssd = False
        if entry is None:
            entry = _Entry(key, handle.size, version, now, ek)
            self._entries[key] = entry                 # recorded in the index below
            self._tell_added(entry)
        else:
            stale_ssd = entry.ssd_version is not None and not ssd_written
            entry.size = handle.size
            entry.version = version
            entry.last_access = now
        self._dram_lru.insert(key)
        self._counters["puts"] += 1
        if ssd_written:
            entry.ssd_version = version
            self._ssd_lru.insert(key)
            self._ssd_garbage.discard(key)
        if self._waiting:
            self._wake()                            # a replaced slot was freed, or a clean block came
        if self._ssd is not None and self._dram.used > self.high_watermark * self._dram.capacity:
            self._pressure()                        # demote ahead of the next puts
        if stale_ssd:
            # The SSD holds older bytes of the key: drop them so they are never served.
            entry.ssd_version = None
            self._ssd_lru.remove(key)
            self._record(entry)
            await self._ssd_remove_if_unowned(key)
            return
        self._record(entry)

    def put_abort(self, handle: PutHandle) -> bool:
        pending = handle._pending
        if self._handles.pop(pending.slot.seq, None) is None:
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

    # ------------------------------------------------------------------ gets

    def _locate(self, key: KvBlockKey) -> _Entry:
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

    def _lookup(self, key: KvBlockKey) -> _Entry:
        self._check_open()
        self._check_key(key)
        if len(self._leases) >= self.max_leases:
            raise Busy(f"{len(self._leases)} leases alive (max_leases={self.max_leases})")
        return self._locate(key)

    def _lease_now(self, entry: _Entry, extent_ok: bool) -> Optional[Lease]:
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

    def _promotes(self, entry: _Entry) -> bool:
        """A get of this SSD-only block copies it into DRAM: allowed, no put waits for room,
        and room without evicting anything."""
        return (self.promote_on_get and not self._waiting
                and self._dram.report()[1] >= entry.size)

    def _ssd_read_start(self, entry: _Entry):
        """(DRAM slot to promote into or None, destination buffer, version) for one SSD read."""
        pending = None
        if self._promotes(entry):
            try:
                pending = self._dram.put_start(entry.key, entry.size)
                pending.slot.started = math.inf         # being filled: the reaper must not free it
            except CapacityError:
                pending = None
        return (pending, pending.view if pending is not None else bytearray(entry.size), entry.version)

    def _ssd_read_end(self, entry: _Entry, read, outcome) -> Optional[Lease]:
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
        self._dram.put_end(pending)
        self._record(entry)
        slot = self._dram.lookup(key)
        self._dram_lru.insert(key)
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

    @property
    def put_timeout_s(self) -> float:
        """A started put not finished within this many seconds is aborted (reloadable)."""
        return self._dram.put_timeout_s

    @put_timeout_s.setter
    def put_timeout_s(self, value: float) -> None:
        if not value > 0:
            raise InvalidArgument(f"put_timeout_s {value!r}: must be > 0 seconds")
        self._dram.put_timeout_s = float(value)

    # ------------------------------------------------------------------ remove, pins

    async def remove(self, key: KvBlockKey) -> bool:
        """Remove the exact key from every tier; a leased slot is freed when its lease ends."""
        self._check_open()
        self._check_key(key)
        entry = self._drop_entry(key)
        if entry is None:
            return False
        slot = self._dram.unpublish(key)           # invisible now
        if slot is not None and slot.refs > 0:
            self._stats["dram"]["lease_waits"] += 1
        self._counters["removes"] += 1
        if self._waiting:
            self._wake()
        if entry.ssd_version is not None or key in self._ssd_garbage:
            await self._ssd_remove_if_unowned(key)
        return True

    def pin(self, key: KvBlockKey, ttl_s: float, hard: bool = False) -> None:
        """Keep the block resident for ``ttl_s``: soft pins are evicted last, hard pins never."""
        self._check_key(key)
        if not 0 < ttl_s <= MAX_PIN_TTL_S:
            raise InvalidArgument(f"pin ttl {ttl_s!r}: must be in (0, {MAX_PIN_TTL_S}] seconds")
        entry = self._entry(key)
        if entry is None:
            raise miss_error(key)
        now = self._clock()
        if hard and not (entry.hard and entry.pin_until > now):
            held = self._hard_pinned_bytes(now)
            if held + entry.size > self.max_hard_pin_bytes:
                raise CapacityError(entry.size, max(0, self.max_hard_pin_bytes - held), 0,
                                    f"hard pins would hold {held + entry.size} bytes "
                                    f"(max {self.max_hard_pin_bytes})")
        entry.pin_until = max(entry.pin_until, now + ttl_s) if entry.pin_until > now else now + ttl_s
        entry.hard = hard or (entry.hard and entry.pin_until > now)
        self._pinned.add(key)

    def _hard_pinned_bytes(self, now: float) -> int:
        total = 0
        for key in self._pinned:
            e = self._entries.get(key)
            if e is not None and e.hard and e.pin_until > now:
                total += e.size
        return total

    def unpin(self, key: KvBlockKey) -> bool:
        entry = self._entries.get(key)
        if entry is None or key not in self._pinned:
            return False
        entry.pin_until = 0.0
        entry.hard = False
        self._pinned.discard(key)
        return True

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
        self._dram.unpublish(key)
        self._record(entry)
        self._dram_lru.remove(key)
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

    # ------------------------------------------------------------------ maintenance

    async def maintenance(self, now: Optional[float] = None) -> dict:
        """Reap stale puts, expire leases and pins, flush the audit log, demote (with SSD)."""
        if self.closed:
            return {}
        now = self._clock() if now is None else now
        done = {"reaped": 0, "leases_expired": 0, "pins_expired": 0, "demoted": 0, "audit_lines": 0}
        for _key in self._dram.reap_stale(now):
            done["reaped"] += 1
        if done["reaped"] and self._waiting:
            self._wake()
        if done["reaped"]:
            for seq in [s for s, h in self._handles.items() if not self._dram.is_pending(h._pending)]:
                del self._handles[seq]
            self._counters["puts_reaped"] += done["reaped"]
        for lease in [l for l in self._leases.values() if l.expires_at <= now]:
            lease.release()
            done["leases_expired"] += 1
        self._counters["leases_expired"] += done["leases_expired"]
        for key in [k for k in self._pinned if self._entries[k].pin_until <= now]:
            self.unpin(key)
            done["pins_expired"] += 1
        done["audit_lines"] = self.guard.flush_audit()
        if self._index.persistent:
            # group commit of the index's log (it may lag the SSD tier by one interval: at
            # start the SSD tier's records win, see _adopt_ssd)
            self._index.sync()
        if self._ssd is not None:
            for key in list(self._ssd_garbage):
                await self._ssd_remove_if_unowned(key)
            if self._dram.used > self.high_watermark * self._dram.capacity:
                for key in self._demotion_victims(now, int(self.low_watermark * self._dram.capacity)):
                    done["demoted"] += await self._demote(key)
            if self.demote_after_s is not None:
                for key in self._aged_victims(now):
                    done["demoted"] += await self._demote(key)
        return done

    # ------------------------------------------------------------------ stats, close

    def stats(self) -> dict:
        dram = self._dram
        free, largest = dram.report() if not dram.closed else (0, 0)
        out = {
            "dram": {"blocks": len(dram), "bytes": dram.published_bytes, "capacity": dram.capacity,
                     "used": dram.used if not dram.closed else 0, "largest_free": largest,
                     **self._stats["dram"]},
            "guard": self.guard.stats(),
            "store": {"policy": self.policy, "promote_on_get": self.promote_on_get,
                      "entries": len(self._entries), "entries_untouched": self._untouched,
                      "leases": len(self._leases),
                      "index_records": len(self._index), "index_persistent": self._index.persistent,
                      **{f"{k}_at_start": v for k, v in self.reconciled.items()},
                      "puts_in_flight": len(self._handles), "pinned": len(self._pinned),
                      "puts_waiting": len(self._waiting), "demotions_in_flight": len(self._demoting),
                      "put_wait_seconds": round(self._put_wait_s, 6), **self._counters},
        }
        if self._ssd is not None:
            out["ssd"] = {"blocks": self._untouched + sum(1 for e in self._entries.values()
                                                          if e.ssd_version is not None),
                          "bytes": self._ssd.used, "capacity": self._ssd.capacity,
                          "read_backend": self._ssd.read_backend, **self._stats["ssd"]}
        return out

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True                  # no new demotion starts; waiting reserves fail
        self._wake()
        if self._demotion_tasks:            # the SSD writes in flight end before the tiers close
            await asyncio.gather(*self._demotion_tasks, return_exceptions=True)
        for lease in list(self._leases.values()):
            lease.release()
        for handle in list(self._handles.values()):
            self.put_abort(handle)
        self._dram.close()
        if self._ssd is not None:
            result = self._ssd.close()
            if inspect.isawaitable(result):
                await result
        if self._index.persistent:
            self._index.checkpoint()        # the next start loads it instead of replaying the log
            self._index.close()
