"""The store's value types: a resident block's hot state (``Entry``), a reserve waiting
for room (``Waiter``), a put in flight (``PutHandle``), a get's lease (``Lease``), and the
names of the store's counters (one definition: ``stats()`` fills them, node/metrics.py
exports every one of them)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

from quillcache._native import blocks as _blocks
from quillcache.model import KvBlockKey
from quillcache.store.dram import PendingPut, Slot

if TYPE_CHECKING:
    from quillcache.store.tiers import LocalKvStore

__all__ = ["Entry", "Waiter", "PutHandle", "Lease", "TIER_COUNTERS", "SSD_COUNTERS", "STORE_COUNTERS"]

# Counted per tier (stats()["dram"] and stats()["ssd"]); /metrics: quillcache_tier_<name>_total{tier}.
TIER_COUNTERS = {
    "hits": "Gets served from the tier",
    "misses": "Gets the tier could not serve",
    "demotions": "Blocks moved from DRAM to the SSD tier",
    "promotions": "SSD blocks copied into DRAM by a get",
    "evictions": "Copies dropped from the tier to make room",
    "lease_waits": "Evictions or frees held back by a lease on the block",
}
# Counted for the SSD tier only; /metrics: quillcache_tier_<name>_total{tier="ssd"}.
SSD_COUNTERS = {
    "extent_leases": "SSD hits handed out as file extents (sendfile)",
}
# Counted for the store (stats()["store"]); /metrics: quillcache_store_<name>_total.
STORE_COUNTERS = {
    "puts": "Puts published",
    "puts_aborted": "Puts aborted",
    "puts_reaped": "Puts freed by the reaper after put_timeout",
    "leases_expired": "Leases expired",
    "dropped_dirty": "Blocks lost: DRAM needed and the SSD tier could not take them",
    "removes": "Blocks removed",
    "unsafe_served": "Gets served another identity's block (guard modes tenant and off)",
    "put_waits": "Puts that waited for demotions to make DRAM room",
    "put_wait_timeouts": "Puts refused after waiting put_timeout for room",
}


# The hot per-key state of a resident block (its key, encoded key, size, version of its
# bytes, SSD version, pins, last access), cached by exact key for GET/PUT: a native record
# (_native/blocks.pyx).  What is resident where (tier, size, identity) is recorded in the
# residency index; ``_record`` keeps the two in step.
Entry = _blocks.Entry


class Waiter:
    """A reserve waiting for room: how many bytes, and the future its next try waits on."""

    __slots__ = ("size", "fut")

    def __init__(self, size: int):
        self.size = size
        self.fut: Optional[asyncio.Future] = None


# A put between start and end: write exactly ``size`` bytes into ``view``; ``offset`` is
# where its slot starts in the arena.  The DRAM tier's reservation itself (store/dram.py).
PutHandle = PendingPut


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
