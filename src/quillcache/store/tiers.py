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

The class is this facade (construction, remove, maintenance, stats, close) over the
mixins that hold its parts, one concern each:

  store/options.py    StoreOptions and the store's limits
  store/values.py     Entry, Waiter, PutHandle, Lease; the counter names
  store/residency.py  the entries and the residency index's records of this node
  store/eviction.py   victim selection (one predicate) and evictions without I/O
  store/demotion.py   DRAM -> SSD moves, for room and by maintenance
  store/writes.py     the put path
  store/reads.py      the get path and the shared arena
  store/pins.py       soft and hard pins, the hard-pin budget and the tenants' quotas
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from typing import Callable, Optional

from quillcache.errors import InvalidArgument
from quillcache.index.art import ArtIndex
from quillcache.model import KvBlockKey
from quillcache.store.batchlease import BatchLeases
from quillcache.store.demotion import Demotion
from quillcache.store.dram import DramTier
from quillcache.store.eviction import Eviction
from quillcache.store.guard import IdentityGuard
from quillcache.store.options import DEFAULT_MAX_BLOCK_BYTES, StoreOptions
from quillcache.store.pins import Pins
from quillcache.store.policy import make_policy
from quillcache.store.reads import Reads
from quillcache.store.residency import Residency
from quillcache.store.values import SSD_COUNTERS, STORE_COUNTERS, TIER_COUNTERS, Entry, Lease, PutHandle, Waiter
from quillcache.store.writes import Writes

__all__ = ["LocalKvStore", "StoreOptions", "Lease", "PutHandle"]

log = logging.getLogger("quillcache.store")


class LocalKvStore(Residency, Eviction, Demotion, Writes, Reads, Pins, BatchLeases):
    """DRAM arena + optional SSD tier + identity guard + leases, pins and eviction."""

    def __init__(self, options: StoreOptions, *, ssd=None, index: Optional[ArtIndex] = None,
                 clock: Callable[[], float] = time.monotonic):
        """``ssd``: the SSD tier (store/ssd.py) or None (DRAM only); ``index``: the residency
        index (a persistent one at a node with [index] persistent), a new ArtIndex if None;
        ``clock``: seconds, monotonic (tests pass a fake one)."""
        if not isinstance(options, StoreOptions):
            raise InvalidArgument(f"options {options!r}: must be a StoreOptions")
        o = self.options = options
        if o.policy == "write_through" and ssd is None:
            raise InvalidArgument("policy write_through needs an SSD tier")
        max_block_bytes = o.max_block_bytes
        if max_block_bytes is None and isinstance(o.dram_bytes, int):
            max_block_bytes = min(DEFAULT_MAX_BLOCK_BYTES, o.dram_bytes - o.dram_bytes % 256)
        # The residency index: the one record of what is resident where (index/art.py,
        # docs/residency-index.md).  ``holder`` names this node's records in it.
        self._index = index if index is not None else ArtIndex()
        self.holder = o.holder
        self._index.set_home(o.holder)     # its keys are walked when asked, not kept in a set
        self.guard = IdentityGuard(o.guard_mode, self._index, o.holder)   # checks the mode before the arena
        self._clock = clock
        self._dram = DramTier(o.dram_bytes, max_block_bytes=max_block_bytes, put_timeout_s=o.put_timeout_s,
                              hugepages=o.hugepages, prefault=o.prefault, clock=clock)
        self._ssd = ssd
        # Reloadable (node/daemon.py RELOAD_HOOKS sets them on the running store).
        self.policy = o.policy
        self.high_watermark = o.high_watermark
        self.low_watermark = o.low_watermark
        self.demote_after_s = o.demote_after_s
        self.lease_s = float(o.lease_s)
        self.max_leases = o.max_leases
        # A get of an SSD-only block copies it into DRAM when there is room (True), or leaves
        # DRAM to puts and serves it from the SSD tier each time (False; reloadable).
        self.promote_on_get = bool(o.promote_on_get)
        # on_residency(resident, key): told when a key becomes resident on this node and
        # when it leaves (the node's KV-event publisher, control/residency.py); None: off.
        self.on_residency = None
        self.max_inflight_puts = o.max_inflight_puts
        self.max_hard_pin_bytes = int(self._dram.capacity * o.max_hard_pin_fraction)
        # The DRAM order is the DRAM tier's published dict itself (store/policy.py): the tier
        # adds a published key at the most recent end and drops an unpublished one; the
        # policy moves a read key to the end (LRU) or leaves it (FIFO).
        self._dram_lru = make_policy(o.eviction, order=self._dram.published)
        self._ssd_lru = make_policy(o.eviction)
        self._entries: dict[KvBlockKey, Entry] = {}       # exact-key cache of the index's local records
        # The SSD blocks recovered at start that have no entry yet: the index's records of
        # this node are their only record until their first touch (_warm).  Evicted first,
        # in index order from _untouched_cursor (they are older than anything touched since).
        self._untouched = 0
        self._untouched_cursor = b""
        self._handles: dict = {}                          # slot -> in-flight put
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._versions = itertools.count(1)
        self._pinned: set[KvBlockKey] = set()
        self._busy: set[KvBlockKey] = set()               # demotion / SSD write in flight
        self._ssd_garbage: set[KvBlockKey] = set()        # stale SSD copies to remove
        self._waiting: list[Waiter] = []                  # reserves waiting for room, oldest first
        self._demoting: dict[KvBlockKey, int] = {}        # key -> bytes: demotions started for room
        self._demoting_bytes = 0
        self._demotion_tasks: set[asyncio.Task] = set()
        self._put_wait_s = 0.0                            # seconds reserves spent waiting, summed
        self._reads: dict[KvBlockKey, asyncio.Future] = {}  # SSD reads in flight (get_async)
        self._stats = {"dram": dict.fromkeys(TIER_COUNTERS, 0),
                       "ssd": dict.fromkeys((*TIER_COUNTERS, *SSD_COUNTERS), 0)}
        self._counters = dict.fromkeys(STORE_COUNTERS, 0)
        self.closed = False
        self._on_added: Optional[Callable[[bytes, int], None]] = None    # residency listener (by encoded key)
        self._on_dropped: Optional[Callable[[bytes], None]] = None
        self._pins_refused: dict[str, int] = {}           # tenant -> hard pins refused
        self.set_pin_quotas(o.pin_quotas)
        if o.guard_mode == "off":
            log.warning("IDENTITY GUARD OFF: blocks are reused by content hash across models, "
                        "tokenizers, adapters and TENANTS. This serves wrong KV and leaks data "
                        "between tenants; use it only for studies.")
        self.reconciled = {"index_added": 0, "index_dropped": 0, "index_resized": 0, "index_agreed": 0}
        self._adopt_ssd(ssd)

    def _check_key(self, key: object) -> None:
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key {key!r}: must be a KvBlockKey")

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("the store is closed")

    @property
    def put_timeout_s(self) -> float:
        """A started put not finished within this many seconds is aborted (reloadable)."""
        return self._dram.put_timeout_s

    @put_timeout_s.setter
    def put_timeout_s(self, value: float) -> None:
        if not value > 0:
            raise InvalidArgument(f"put_timeout_s {value!r}: must be > 0 seconds")
        self._dram.put_timeout_s = float(value)

    # ------------------------------------------------------------------ remove

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
            for slot in [s for s, h in self._handles.items() if not self._dram.is_pending(h._pending)]:
                # the late writer's view stops working: the slot may be another put's already
                self._handles.pop(slot).close_view()
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
                     "backing": dram.backing, "prefaulted": dram.prefaulted, **self._stats["dram"]},
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
        out["tenants"] = self.pin_stats()   # per tenant: the operator's (/metrics), not INFO's
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
