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
* A put that finds no room evicts DRAM blocks in LRU order (unpinned first, then soft
  pins); a block with a current SSD copy stays readable from SSD, any other is dropped.
  Leased, hard-pinned and in-flight blocks are never evicted; when nothing can go the put
  fails with CapacityError and nothing changes.
* remove of a leased block unpublishes it at once (no new reader finds it); its slot is
  freed when the last lease ends.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from typing import Callable, Iterable, Optional

from quillcache.errors import Busy, CapacityError, InvalidArgument, NotFound, QuillCacheError
from quillcache.model import IdentityScope, KvBlockKey
from quillcache.store.dram import ARENA_UNIT, DEFAULT_PUT_TIMEOUT_S, DramTier, PendingPut, Slot
from quillcache.store.guard import IdentityGuard, miss_error
from quillcache.store.policy import make_policy

__all__ = ["LocalKvStore", "Lease", "PutHandle", "WRITE_POLICIES"]

log = logging.getLogger("quillcache.store")

WRITE_POLICIES = ("write_back", "write_through")
DEFAULT_LEASE_S = 10.0               # seconds a get's view stays valid
DEFAULT_MAX_BLOCK_BYTES = 16 << 20   # bytes: largest block (capped at the dram capacity)
DEFAULT_MAX_LEASES = 65_536          # leases alive at once
DEFAULT_MAX_INFLIGHT_PUTS = 4_096    # puts between start and end at once
MAX_PIN_TTL_S = 7 * 24 * 3600.0      # seconds: longest pin
MAX_LEASE_S = 3600.0                 # seconds: longest lease
MAX_PREFIX_KEYS = 65_536             # keys in one exists_prefix call
DEFAULT_MAX_HARD_PIN_FRACTION = 0.5  # of the dram capacity that hard pins may hold

_TIER_COUNTERS = ("hits", "misses", "demotions", "promotions", "evictions", "lease_waits")


class _Entry:
    """One resident block: its size, the version of its bytes and where copies are."""

    __slots__ = ("key", "size", "version", "ssd_version", "pin_until", "hard", "last_access")

    def __init__(self, key: KvBlockKey, size: int, version: int, now: float):
        self.key = key
        self.size = size
        self.version = version           # bumped by every publish of new bytes for the key
        self.ssd_version: Optional[int] = None   # the version the SSD copy holds, or None
        self.pin_until = 0.0             # clock time; 0 = not pinned
        self.hard = False
        self.last_access = now


class PutHandle:
    """A put between start and end: write exactly ``size`` bytes into ``view``."""

    __slots__ = ("_pending", "key", "size", "durable", "view")

    def __init__(self, pending: PendingPut, durable: bool):
        self._pending = pending
        self.key = pending.key
        self.size = pending.size
        self.durable = durable
        self.view = pending.view


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
        self.size = len(view) if view is not None else extent[2]
        self.tier = tier                 # "dram", or "ssd" (a temporary buffer or an extent)
        self._slot = slot
        self.expires_at = expires_at
        self._id = lease_id

    @property
    def released(self) -> bool:
        return self._store is None

    def release(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store._end_lease(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LocalKvStore:
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
                 promote_on_get: bool = True):
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
        self.guard = IdentityGuard(guard_mode)      # validates the mode before allocating the arena
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
        self.max_inflight_puts = max_inflight_puts
        self.max_hard_pin_bytes = int(self._dram.capacity * max_hard_pin_fraction)
        self._dram_lru = make_policy(eviction)
        self._ssd_lru = make_policy(eviction)
        self._entries: dict[KvBlockKey, _Entry] = {}
        self._by_prefix: dict[tuple[IdentityScope, str], set[KvBlockKey]] = {}
        self._handles: dict[int, PutHandle] = {}          # slot seq -> in-flight put
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._versions = itertools.count(1)
        self._pinned: set[KvBlockKey] = set()
        self._busy: set[KvBlockKey] = set()               # demotion / SSD write in flight
        self._ssd_garbage: set[KvBlockKey] = set()        # stale SSD copies to remove
        self._stats = {"dram": dict.fromkeys(_TIER_COUNTERS, 0), "ssd": dict.fromkeys(_TIER_COUNTERS, 0)}
        self._stats["ssd"]["extent_leases"] = 0           # SSD hits handed out as extents (sendfile)
        self._counters = {"puts": 0, "puts_aborted": 0, "puts_reaped": 0, "leases_expired": 0,
                          "dropped_dirty": 0, "removes": 0, "unsafe_served": 0}
        self.closed = False
        self._on_added: Optional[Callable[[KvBlockKey, int], None]] = None    # residency listener
        self._on_dropped: Optional[Callable[[KvBlockKey], None]] = None
        if guard_mode == "off":
            log.warning("IDENTITY GUARD OFF: blocks are reused by content hash across models, "
                        "tokenizers, adapters and TENANTS. This serves wrong KV and leaks data "
                        "between tenants; use it only for studies.")
        if ssd is not None:
            now = clock()
            for key in list(ssd.keys()):      # blocks recovered by the SSD tier are resident
                size = ssd.size_of(key)
                if size is None:
                    continue
                entry = _Entry(key, size, next(self._versions), now)
                entry.ssd_version = entry.version
                self._add_entry(entry)
                self._ssd_lru.insert(key)

    # ------------------------------------------------------------------ index upkeep

    def set_residency_listener(self, added: Optional[Callable[[KvBlockKey, int], None]],
                               dropped: Optional[Callable[[KvBlockKey], None]]) -> None:
        """Be told of every key that becomes resident (``added(key, size)``, at once for the
        keys resident now) and every key that stops being (``dropped(key)``: removed or
        evicted from every tier).  The cluster announces them to their homes.  None, None:
        stop.  The callbacks run inside store calls: they must be quick and not raise."""
        self._on_added, self._on_dropped = added, dropped
        if added is not None:
            for entry in list(self._entries.values()):
                added(entry.key, entry.size)

    def _add_entry(self, entry: _Entry) -> None:
        key = entry.key
        self._entries[key] = entry
        self.guard.add(key)
        self._by_prefix.setdefault((key.scope, key.prefix_hash), set()).add(key)
        if self._on_added is not None:
            self._on_added(key, entry.size)

    def _drop_entry(self, key: KvBlockKey) -> Optional[_Entry]:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.guard.discard(key)
        pk = (key.scope, key.prefix_hash)
        keys = self._by_prefix.get(pk)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_prefix[pk]
        self._pinned.discard(key)
        self._dram_lru.remove(key)
        self._ssd_lru.remove(key)
        if self._on_dropped is not None:
            self._on_dropped(key)
        return entry

    def _check_key(self, key: object) -> None:
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key {key!r}: must be a KvBlockKey")

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("the store is closed")

    # ------------------------------------------------------------------ puts

    def put_start(self, key: KvBlockKey, size: int, durable: bool = False) -> PutHandle:
        """Reserve a DRAM slot (evicting if needed); write ``size`` bytes into ``handle.view``."""
        self._check_open()
        self._check_key(key)
        self._dram.check_size(size)
        if durable and self._ssd is None:
            raise InvalidArgument("durable put needs an SSD tier (this store is DRAM only)")
        if len(self._handles) >= self.max_inflight_puts:
            raise Busy(f"{len(self._handles)} puts in flight (max_inflight_puts={self.max_inflight_puts})")
        pending = self._reserve(key, size)
        handle = PutHandle(pending, durable or self.policy == "write_through")
        self._handles[pending.slot.seq] = handle
        return handle

    def _reserve(self, key: KvBlockKey, size: int) -> PendingPut:
        try:
            return self._dram.put_start(key, size)
        except CapacityError:
            pass
        if self._evictable_bytes(size) + self._dram.report()[0] >= size:
            self._make_room(size)           # only when eviction can succeed: a doomed put evicts nothing
        try:
            return self._dram.put_start(key, size)
        except CapacityError as exc:
            free, largest = self._dram.report()
            raise CapacityError(size, free, largest,
                                f"dram full: cannot place {size} bytes ({free} bytes free, largest "
                                f"extent {largest}) and nothing is evictable (leased, pinned or "
                                "in flight)") from exc

    def _evictable_bytes(self, enough: int) -> int:
        """Bytes (in allocator units) that eviction could free, counted up to ``enough``."""
        now = self._clock()
        dram = self._dram
        total = 0
        for key in self._dram_lru.candidates():
            slot = dram.lookup(key)
            if slot is None or key in self._busy:
                continue
            if slot.refs > 0:
                self._stats["dram"]["lease_waits"] += 1    # a lease kept eviction off this block
                continue
            entry = self._entries[key]
            if entry.pin_until > now and entry.hard:
                continue
            total += -(-slot.size // ARENA_UNIT) * ARENA_UNIT
            if total >= enough:
                break
        return total

    def _make_room(self, size: int) -> None:
        """Evict DRAM blocks in policy order until ``size`` fits in one extent, or none is left."""
        now = self._clock()
        dram = self._dram
        for allow_soft in (False, True):
            while dram.report()[1] < size:
                victim = self._dram_victim(now, allow_soft)
                if victim is None:
                    break
                self._evict_dram(victim)
            else:
                return

    def _dram_victim(self, now: float, allow_soft: bool) -> Optional[KvBlockKey]:
        dram = self._dram
        for key in self._dram_lru.candidates():
            slot = dram.lookup(key)
            if slot is None or key in self._busy:
                continue
            if slot.refs > 0:
                continue
            entry = self._entries[key]
            if entry.pin_until > now and (entry.hard or not allow_soft):
                continue
            return key
        return None

    def _evict_dram(self, key: KvBlockKey) -> None:
        """Free the DRAM copy; the block stays resident only if the SSD copy is current."""
        entry = self._entries[key]
        self._dram.unpublish(key)
        self._dram_lru.remove(key)
        self._stats["dram"]["evictions"] += 1
        if entry.ssd_version is not None and entry.ssd_version == entry.version:
            return                                  # still readable from SSD
        if entry.ssd_version is not None:
            self._ssd_garbage.add(key)              # stale copy of older bytes
        if self._ssd is not None:
            self._counters["dropped_dirty"] += 1
        self._drop_entry(key)

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
        version = next(self._versions)
        entry = self._entries.get(key)
        stale_ssd = False
        if entry is None:
            entry = _Entry(key, handle.size, version, now)
            self._add_entry(entry)
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
        elif stale_ssd:
            # The SSD holds older bytes of the key: drop them so they are never served.
            entry.ssd_version = None
            self._ssd_lru.remove(key)
            await self._ssd_remove_if_unowned(key)

    def put_abort(self, handle: PutHandle) -> bool:
        pending = handle._pending
        if self._handles.pop(pending.slot.seq, None) is None:
            return False
        self._counters["puts_aborted"] += 1
        return self._dram.put_abort(pending)

    async def put(self, key: KvBlockKey, data, durable: bool = False) -> None:
        """Convenience: start, copy ``data`` (any bytes-like object) into the slot, end."""
        src = memoryview(data)
        if src.ndim != 1 or src.itemsize != 1:
            src = src.cast("B")
        handle = self.put_start(key, src.nbytes, durable)
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
        if entry is not None:
            return entry
        try:
            served = self.guard.resolve_missing(key)
        except QuillCacheError:
            self._stats["dram"]["misses"] += 1
            self._stats["ssd"]["misses"] += 1
            raise
        if served.tenant_id != key.tenant_id or not key.scope.matches(served):
            self._counters["unsafe_served"] += 1
        return self._entries[served]

    def get(self, key: KvBlockKey, *, extent_ok: bool = False) -> Lease:
        """A lease on the block's bytes (read-only view); release it (or use ``with``).

        ``extent_ok``: the caller can send from a file (sendfile).  Then a block served from
        the SSD tier without being promoted (``promote_on_get`` off, or no DRAM room now)
        whose bytes were verified in this process comes as a lease with ``view`` None and
        ``extent`` = (fd, offset, length, crc32c), valid until the caller's next await."""
        self._check_open()
        self._check_key(key)
        if len(self._leases) >= self.max_leases:
            raise Busy(f"{len(self._leases)} leases alive (max_leases={self.max_leases})")
        entry = self._locate(key)
        served = entry.key
        now = self._clock()
        entry.last_access = now
        slot = self._dram.lookup(served)
        if slot is not None:
            self._stats["dram"]["hits"] += 1
            self._dram_lru.touch(served)
            return self._new_lease(served, self._dram.acquire(slot), "dram", slot, now)
        self._stats["dram"]["misses"] += 1
        return self._get_from_ssd(entry, now, extent_ok)

    def _get_from_ssd(self, entry: _Entry, now: float, extent_ok: bool = False) -> Lease:
        key = entry.key
        ssd = self._ssd
        pending = None
        if self.promote_on_get:
            try:
                pending = self._dram.put_start(key, entry.size)   # promote only if there is room now
            except CapacityError:
                pass
        if pending is None and extent_ok:
            extent = ssd.extent_of(key)        # None until its bytes were verified: read below
            if extent is not None and extent[2] == entry.size:
                self._stats["ssd"]["hits"] += 1
                self._stats["ssd"]["extent_leases"] += 1
                self._ssd_lru.touch(key)
                return self._new_lease(key, None, "ssd", None, now, extent)
        try:
            if pending is not None:
                n = ssd.read_into(key, pending.view)
            else:
                buf = bytearray(entry.size)
                n = ssd.read_into(key, buf)
            if n != entry.size:
                raise NotFound(f"ssd returned {n} bytes for a {entry.size}-byte block")
        except NotFound:
            # The SSD tier dropped the block (CRC mismatch) or lost it: it is gone for everyone.
            if pending is not None:
                self._dram.put_abort(pending)
            self._drop_entry(key)
            self._stats["ssd"]["misses"] += 1
            raise miss_error(key) from None
        except BaseException:
            if pending is not None:
                self._dram.put_abort(pending)
            raise
        self._stats["ssd"]["hits"] += 1
        self._ssd_lru.touch(key)
        if pending is None:
            return self._new_lease(key, memoryview(buf).toreadonly(), "ssd", None, now)
        self._dram.put_end(pending)
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
        if lease.view is None:
            return                        # an extent lease: nothing held
        try:
            lease.view.release()          # a view used after its lease ends raises ValueError
        except BufferError:
            pass                          # the caller made a derived view; documented hazard
        if lease._slot is not None and not self._dram.closed:
            self._dram.release(lease._slot)

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
        entry = self._entries.get(key)
        if entry is None:
            served = self.guard.would_serve(key)
            if served is None:
                return 0              # the get below raises the guard's error
            entry = self._entries[served]
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

    def list_prefix(self, scope: IdentityScope, prefix_hash: str) -> list[KvBlockKey]:
        """The resident keys of exactly this scope and prefix hash, by block_index."""
        if isinstance(scope, KvBlockKey):
            scope = scope.scope
        keys = self._by_prefix.get((scope, prefix_hash), ())
        return sorted(keys, key=lambda k: (k.block_index, k.block_hash, k.token_count))

    def list_scope(self, scope: IdentityScope) -> list[KvBlockKey]:
        """The resident keys of one identity scope, in encoded-key order (quillctl ls)."""
        if isinstance(scope, KvBlockKey):
            scope = scope.scope
        keys = [k for (sc, _prefix), ks in self._by_prefix.items() if sc == scope for k in ks]
        return sorted(keys, key=lambda k: (k.prefix_hash, k.block_index, k.block_hash, k.token_count))

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
        if entry.ssd_version is not None or key in self._ssd_garbage:
            await self._ssd_remove_if_unowned(key)
        return True

    def pin(self, key: KvBlockKey, ttl_s: float, hard: bool = False) -> None:
        """Keep the block resident for ``ttl_s``: soft pins are evicted last, hard pins never."""
        self._check_key(key)
        if not 0 < ttl_s <= MAX_PIN_TTL_S:
            raise InvalidArgument(f"pin ttl {ttl_s!r}: must be in (0, {MAX_PIN_TTL_S}] seconds")
        entry = self._entries.get(key)
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
        """ssd.put, evicting SSD blocks (LRU) while the SSD tier says it is full."""
        while True:
            try:
                await self._ssd.put(key, data)
                return
            except CapacityError:
                if not await self._evict_ssd_one(exclude=key):
                    raise

    async def _evict_ssd_one(self, exclude: Optional[KvBlockKey] = None) -> bool:
        now = self._clock()
        for allow_soft in (False, True):
            for key in self._ssd_lru.candidates():
                entry = self._entries.get(key)
                if key == exclude or key in self._busy or entry is None:
                    continue
                if entry.pin_until > now and (entry.hard or not allow_soft):
                    continue
                if self._dram.lookup(key) is None:
                    self._drop_entry(key)               # its only copy goes
                else:
                    entry.ssd_version = None            # the DRAM copy stays, now dirty
                    self._ssd_lru.remove(key)
                self._stats["ssd"]["evictions"] += 1
                self._busy.add(key)
                try:
                    await self._ssd.remove(key)
                finally:
                    self._busy.discard(key)
                return True
        return False

    async def _ssd_remove_if_unowned(self, key: KvBlockKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.ssd_version is not None:
            self._ssd_garbage.discard(key)     # a newer durable copy owns the SSD key now
            return
        self._ssd_garbage.discard(key)
        await self._ssd.remove(key)

    async def _demote(self, key: KvBlockKey) -> bool:
        """Move one block's DRAM copy to SSD (write it if the SSD copy is not current)."""
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
        if self._dram.lookup(key) is not slot or slot.refs > 0:
            return False                           # leased meanwhile: stays in DRAM, now clean
        self._dram.unpublish(key)
        self._dram_lru.remove(key)
        self._stats["dram"]["demotions"] += 1
        self._stats["ssd"]["demotions"] += 1
        return True

    def _demotion_victims(self, now: float, target_used: int) -> list[KvBlockKey]:
        victims = []
        excess = self._dram.used - target_used
        for allow_soft in (False, True):
            for key in self._dram_lru.candidates():
                if excess <= 0:
                    return victims
                slot = self._dram.lookup(key)
                if slot is None or slot.refs > 0 or key in self._busy or key in victims:
                    continue
                entry = self._entries[key]
                if entry.pin_until > now and (entry.hard or not allow_soft):
                    continue
                victims.append(key)
                excess -= slot.size
        return victims

    def _aged_victims(self, now: float) -> list[KvBlockKey]:
        cutoff = now - self.demote_after_s
        victims = []
        for key in self._dram_lru.candidates():
            entry = self._entries[key]
            if entry.last_access > cutoff:
                break                              # LRU order: the rest are younger
            slot = self._dram.lookup(key)
            if slot is None or slot.refs > 0 or key in self._busy or entry.pin_until > now:
                continue
            victims.append(key)
        return victims

    # ------------------------------------------------------------------ maintenance

    async def maintenance(self, now: Optional[float] = None) -> dict:
        """Reap stale puts, expire leases and pins, flush the audit log, demote (with SSD)."""
        if self.closed:
            return {}
        now = self._clock() if now is None else now
        done = {"reaped": 0, "leases_expired": 0, "pins_expired": 0, "demoted": 0, "audit_lines": 0}
        for key in self._dram.reap_stale(now):
            done["reaped"] += 1
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
                      "entries": len(self._entries), "leases": len(self._leases),
                      "puts_in_flight": len(self._handles), "pinned": len(self._pinned),
                      **self._counters},
        }
        if self._ssd is not None:
            out["ssd"] = {"blocks": sum(1 for e in self._entries.values() if e.ssd_version is not None),
                          "bytes": self._ssd.used, "capacity": self._ssd.capacity, **self._stats["ssd"]}
        return out

    async def close(self) -> None:
        if self.closed:
            return
        for lease in list(self._leases.values()):
            lease.release()
        for handle in list(self._handles.values()):
            self.put_abort(handle)
        self.closed = True
        self._dram.close()
        if self._ssd is not None:
            result = self._ssd.close()
            if inspect.isawaitable(result):
                await result
