"""One lease per located batch (docs/shm.md): GET_LOCATED holds every DRAM slot of its
batch under a single ``BatchLease`` instead of a ``Lease`` per block.

The rules are those of a ``Lease``: each held slot stays in place (eviction skips it, a
replacement goes elsewhere, a remove frees it when the lease ends); the lease ends on
``release()``, on expiry (``maintenance`` walks ``_leases`` and finds it there like any
other lease) and when the store closes.  The identity guard still runs on every key.
What changes is the cost: one object, one id and one entry in ``_leases`` per batch,
and per key only the lookups and a reference count.

``BatchLeases`` is mixed into ``LocalKvStore``; it uses the store's own state
(``_entries``, ``_dram``, ``_leases``) as the store's other get paths do.
"""
from __future__ import annotations

from typing import Optional, Sequence

from quillcache._native.batch import hold_published
from quillcache.errors import Busy, InvalidArgument, NotFound, UnsafeReuse
from quillcache.model import KvBlockKey

__all__ = ["BatchLease", "BatchLeases"]

_MISS = (NotFound, UnsafeReuse)


class BatchLease:
    """The hold of one located batch on its DRAM slots; ``len()`` is how many."""

    __slots__ = ("slots", "expires_at", "_store", "_id")

    def __init__(self, store, slots: list, expires_at: float, lease_id: int) -> None:
        self._store = store
        self.slots = slots               # dram.Slot, each with one reference taken
        self.expires_at = expires_at
        self._id = lease_id

    @property
    def released(self) -> bool:
        return self._store is None

    def __len__(self) -> int:
        return len(self.slots)

    def release(self) -> None:
        """Let go of every slot, once; releasing again does nothing."""
        store, self._store = self._store, None
        if store is not None:
            store.release_batch(self)

    def __enter__(self) -> "BatchLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class BatchLeases:
    """``located_batch``: the located lookups of a whole batch under one lease."""

    def located_batch(self, keys: Sequence[KvBlockKey]) -> tuple[Optional[BatchLease], list]:
        """Per key, in order: the held ``Slot`` (read ``offset`` and ``size``), a miss
        status (NotFound, UnsafeReuse: the guard's verdict for that key), or None when the
        block is only on SSD (``await get_async`` promotes it).  The slots are held by the
        returned lease (None when no key hit); release it once the client is done."""
        self._check_open()
        if len(self._leases) >= self.max_leases:
            raise Busy(f"{len(self._leases)} leases alive (max_leases={self.max_leases})")
        if type(keys) is not list:
            keys = list(keys)
        now = self._clock()
        try:
            # the keys whose exact entry has a published DRAM slot, in one native pass
            slots, got = hold_published(keys, KvBlockKey,
                                        self._entries, self._dram.published, now, self._dram_lru.order)
        except TypeError as exc:
            if not exc.args or type(exc.args[0]) is not int:
                raise
            raise InvalidArgument(f"key {keys[exc.args[0]]!r}: must be a KvBlockKey") from None
        if len(slots) < len(got):
            self._located_rest(keys, slots, got, now)
        if not slots:
            return None, got
        self._stats["dram"]["hits"] += len(slots)
        lease = BatchLease(self, slots, now + self.lease_s, next(self._lease_ids))
        self._leases[lease._id] = lease
        return lease, got

    def _located_rest(self, keys, slots: list, got: list, now: float) -> None:
        """The keys ``hold_published`` left (None in ``got``), per key: the guard decides
        where no entry of the exact key exists, the SSD tier where no DRAM copy is."""
        locate = self._locate
        published = self._dram.lookup
        touch = self._dram_lru.touch
        try:
            for i, g in enumerate(got):
                if g is not None:
                    continue
                try:
                    entry = locate(keys[i])
                except _MISS as exc:
                    got[i] = exc.status
                    continue
                served = entry.key
                slot = published(served)
                if slot is None:
                    continue                 # only on SSD: None, ``await get_async`` promotes it
                entry.last_access = now
                touch(served)
                slot.refs += 1               # dram.hold: the slot stays in place while held
                slots.append(slot)
                got[i] = slot
        except BaseException:
            for slot in slots:
                self._dram.release(slot)
            raise

    def held_views(self, lease: BatchLease) -> list:
        """A read-only view of each slot ``lease`` holds, in order (valid while it is held)."""
        return self._dram.views(lease.slots)

    def release_batch(self, lease: BatchLease) -> None:
        """End ``lease`` (what ``BatchLease.release`` calls): its slots are let go, once."""
        if self._leases.pop(lease._id, None) is not lease:
            return                       # ended already (released, expired or closed)
        dram = self._dram
        if dram.closed:
            return
        dram.release_many(lease.slots)
        if self._waiting:
            self._wake()                 # a block may be evictable (or its slot freed) now
