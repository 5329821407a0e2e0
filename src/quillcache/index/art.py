"""The ART residency index: ``model.IndexBackend`` on the adaptive radix tree.

The tree maps ``encode_key(key)`` to a slot id; ``self._slots[slot]`` is that key's list
of residency records, kept sorted by (worker_id, tier value).  Because the key encoding
puts scope then prefix hash first, ``prefix_scan`` is one ordered range walk of the tree
(``scan_prefix(encode_scope_prefix(...))``) and its output is already in
``model.sort_residencies`` order: key order, then worker, then tier.

Side maps keep the other operations proportional to what they touch:
``_by_worker[worker_id]`` = encoded keys where that worker has a record (clear_worker),
``_by_block[block_hash]`` = the encoded key with that block hash, or per tenant a tuple of them
(``add_block``; read through ``block_eks``)
(remove_block, and the identity guard: a lookup for one tenant never iterates another's).

The store (store/tiers.py) keeps its residency here: ``set_holder`` replaces one worker's
records of a key (one per tier), ``holder`` reads them back, ``page`` is LIST (an ordered
walk from a cursor, limited, never a sort) and ``block_keys`` is what the guard asks.
docs/residency-index.md describes the record layout.

For a persistent subclass (WAL + checkpoints): all state changes go through
``_apply_put``, ``_apply_remove`` and ``_apply_clear``; the public methods only pick what
to change and count.  ``iter_records()`` dumps every record in key order and
``load_records()`` / ``from_records()`` bulk-load such a dump.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import numpy as np

from quillcache._native.art import AdaptiveRadixTree
from quillcache._native.blocks import untrack
from quillcache.model import (
    CacheResidency, CacheTier, IdentityScope, IndexMetrics, KvBlockKey, decode_key, encode_key,
    encode_scope_prefix,
)

__all__ = ["ArtIndex", "add_block", "forget_block", "block_eks", "block_tenants", "tenant_of"]


def _order(r: CacheResidency) -> tuple[str, str]:
    return (r.worker_id, r.tier.value)


def tenant_of(ek: bytes) -> str:
    """The tenant_id field of an encoded key (the first field after the version byte)."""
    return ek[2:2 + ek[1]].decode("utf-8")


def add_block(by_block: dict, block_hash: str, tenant_id: str, ek: bytes) -> None:
    """ek has this block hash in this tenant.  The usual block hash has one key: its value
    is that key's bytes (the tenant is the key's first field), no container at all (a dict
    and a tuple per block were ~230 B of a resident block's memory).  A block hash with
    several keys holds ``{tenant_id: (ek, ...)}``.  Bytes, tuples of bytes and the dicts
    holding only them stay off the garbage collector's lists."""
    held = by_block.get(block_hash)
    if held is None:
        by_block[block_hash] = ek
        return
    if type(held) is bytes:
        if held == ek:
            return
        tenants = {tenant_of(held): (held,)}
        by_block[block_hash] = tenants
    else:
        tenants = held
    keys = tenants.get(tenant_id)
    if keys is None:
        tenants[tenant_id] = (ek,)
    elif ek not in keys:
        tenants[tenant_id] = keys + (ek,)


def forget_block(by_block: dict, block_hash: str, tenant_id: str, ek: bytes) -> None:
    """ek no longer has this block hash in this tenant (``add_block`` undone)."""
    held = by_block.get(block_hash)
    if held is None:
        return
    if type(held) is bytes:
        if held == ek:
            del by_block[block_hash]
        return
    keys = held.get(tenant_id)
    if keys is not None and ek in keys:
        keys = tuple(k for k in keys if k != ek)
        if keys:
            held[tenant_id] = keys
        else:
            del held[tenant_id]
    if not held:
        del by_block[block_hash]
    elif len(held) == 1:
        (only,) = held.values()
        if len(only) == 1:
            by_block[block_hash] = only[0]         # back to the one-key form


def block_eks(by_block: dict, block_hash: str, tenant_id: str) -> tuple:
    """The encoded keys of one tenant with this block hash (``add_block``'s record); the
    keys of another tenant are never iterated (a lone key's tenant field is compared)."""
    held = by_block.get(block_hash)
    if held is None:
        return ()
    if type(held) is bytes:
        return (held,) if tenant_of(held) == tenant_id else ()
    return held.get(tenant_id, ())


def block_tenants(by_block: dict, block_hash: str) -> list:
    """The tenants holding a key with this block hash."""
    held = by_block.get(block_hash)
    if held is None:
        return []
    return [tenant_of(held)] if type(held) is bytes else list(held)


class ArtIndex:
    """Residency index on an adaptive radix tree (in memory; ``persistent`` is False)."""

    name = "art"
    persistent = False

    def __init__(self) -> None:
        self._tree = AdaptiveRadixTree()
        self._slots: list[Optional[list[CacheResidency]]] = []
        self._free_slots: list[int] = []
        self._by_worker: dict[str, set[bytes]] = {}
        self._by_block: dict[str, bytes | dict[str, tuple[bytes, ...]]] = {}   # add_block
        self._records = 0
        self._resident_bytes = 0
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0

    # ------------------------------------------------------------------ state changes

    def _apply_put(self, residency: CacheResidency, ek: Optional[bytes] = None) -> None:
        """Add residency, replacing the record of the same worker and tier for its key.
        ``ek``: encode_key(residency.key) when the caller has it already."""
        if ek is None:
            ek = encode_key(residency.key)   # validates the key before anything changes
        untrack(residency)                   # records and their lists can hold no cycle: off the GC
        slot = self._tree.get(ek)
        if slot is None:
            slot = self._new_slot(untrack([residency]))
            try:
                self._tree.insert(ek, slot)
            except BaseException:
                self._release_slot(slot)
                raise
            key = residency.key
            add_block(self._by_block, key.block_hash, key.tenant_id, ek)
        else:
            records = self._slots[slot]
            order = _order(residency)
            for i, existing in enumerate(records):
                existing_order = _order(existing)
                if existing_order == order:
                    self._resident_bytes -= existing.bytes
                    self._records -= 1
                    records[i] = residency
                    break
                if existing_order > order:
                    records.insert(i, residency)
                    break
            else:
                records.append(residency)
        self._records += 1
        self._resident_bytes += residency.bytes
        mine = self._by_worker.get(residency.worker_id)
        if mine is None:
            self._by_worker[residency.worker_id] = {ek}
        else:
            mine.add(ek)

    def _apply_remove(self, ek: bytes, worker_id: str) -> int:
        """Drop every record of worker_id under encoded key ek; returns how many."""
        slot = self._tree.get(ek)
        if slot is None:
            return 0
        records = self._slots[slot]
        keep = [r for r in records if r.worker_id != worker_id]
        removed = len(records) - len(keep)
        if not removed:
            return 0
        self._records -= removed
        self._resident_bytes -= sum(r.bytes for r in records if r.worker_id == worker_id)
        keys = self._by_worker.get(worker_id)
        if keys is not None:
            keys.discard(ek)
            if not keys:
                del self._by_worker[worker_id]
        if keep:
            self._slots[slot] = untrack(keep)
        else:
            key = records[0].key
            self._tree.delete(ek)
            self._release_slot(slot)
            forget_block(self._by_block, key.block_hash, key.tenant_id, ek)
        return removed

    def _apply_clear(self) -> None:
        self._tree.clear()
        self._slots.clear()
        self._free_slots.clear()
        self._by_worker.clear()
        self._by_block.clear()
        self._records = 0
        self._resident_bytes = 0

    def _new_slot(self, records: list[CacheResidency]) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slots[slot] = records
            return slot
        self._slots.append(records)
        return len(self._slots) - 1

    def _release_slot(self, slot: int) -> None:
        self._slots[slot] = None
        self._free_slots.append(slot)

    # ------------------------------------------------------------------ IndexBackend

    def put(self, residency: CacheResidency) -> None:
        self._apply_put(residency)
        self._puts += 1

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        """The key's records, ordered by worker_id then tier."""
        slot = self._tree.get(encode_key(key))
        return [] if slot is None else list(self._slots[slot])

    def records_at(self, ek: bytes) -> list[CacheResidency]:
        """The records under encoded key ``ek`` (the index's own list: read it, do not
        change it); [] if none.  ``locate`` without encoding the key or copying."""
        slot = self._tree.get(ek)
        return [] if slot is None else self._slots[slot]

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        prefix = encode_scope_prefix(scope, prefix_hash)   # KeyError_ on a bad prefix_hash
        self._prefix_scans += 1
        slots = self._slots
        return [r for _, slot in self._tree.scan_prefix(prefix) for r in slots[slot]]

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        candidates = block_eks(self._by_block, block_hash, scope.tenant_id)
        mine = self._by_worker.get(worker_id)
        if not candidates or not mine:
            return 0
        removed = 0
        for ek in [ek for ek in candidates if ek in mine]:
            if scope.matches(self._slots[self._tree[ek]][0].key):
                removed += self._apply_remove(ek, worker_id)
        self._removes += removed
        return removed

    def clear_worker(self, worker_id: str) -> int:
        removed = 0
        for ek in list(self._by_worker.get(worker_id, ())):
            removed += self._apply_remove(ek, worker_id)
        self._removes += removed
        return removed

    def clear(self) -> None:
        self._apply_clear()

    def snapshot(self) -> list[CacheResidency]:
        return list(self.iter_records())

    def __len__(self) -> int:
        return self._records

    def metrics(self) -> IndexMetrics:
        return IndexMetrics(
            resident_blocks=self._records, resident_bytes=self._resident_bytes,
            puts=self._puts, removes=self._removes, prefix_scans=self._prefix_scans,
            bytes_written=0, memory_bytes=self._tree.memory_bytes(),
        )

    # ------------------------------------------------------------------ one holder's records (the store)

    def holder(self, ek: bytes, worker_id: str) -> tuple[int, tuple[CacheTier, ...]]:
        """(bytes, tiers) of worker_id's records under encoded key ek; (0, ()) if none."""
        slot = self._tree.get(ek)
        if slot is None:
            return 0, ()
        mine = [r for r in self._slots[slot] if r.worker_id == worker_id]
        return (mine[0].bytes if mine else 0), tuple(r.tier for r in mine)

    def set_holder(self, key: KvBlockKey, ek: bytes, worker_id: str, tiers: tuple[CacheTier, ...],
                   nbytes: int) -> bool:
        """Make worker_id's records of key exactly one per tier in ``tiers`` (in the order
        of CacheTier), each of ``nbytes``; no tiers removes them.  ``ek`` is encode_key(key).
        Returns False when the records were already so (nothing changed, nothing logged)."""
        slot = self._tree.get(ek)
        if slot is not None:
            records = self._slots[slot]
            if len(records) == 1 and len(tiers) == 1:          # the common case, checked cheaply
                r = records[0]
                if r.worker_id == worker_id and r.tier is tiers[0] and r.bytes == nbytes:
                    return False
            mine = [r for r in records if r.worker_id == worker_id]
            if (len(mine) == len(tiers) and all(r.bytes == nbytes for r in mine)
                    and {r.tier for r in mine} == set(tiers)):
                return False
            if mine:
                self._removes += self._apply_remove(ek, worker_id)
        elif not tiers:
            return False
        for tier in tiers:
            self._apply_put(CacheResidency(key, worker_id, tier, nbytes), ek)
            self._puts += 1
        return True

    def page(self, prefix: bytes, start_after: bytes, limit: int,
             worker_id: Optional[str] = None) -> tuple[list[bytes], bool]:
        """LIST: up to ``limit`` encoded keys that start with ``prefix`` and sort after
        ``start_after`` (b"" = from the first), in key order, each holding a record of
        ``worker_id`` (any worker when None).  ``more``: another such key follows.

        One ordered walk of the tree from the cursor (items() refills 256 entries at a
        time): the cost follows the page, not the size of the prefix or of the index."""
        if limit < 1:
            raise ValueError(f"limit {limit!r}: must be >= 1")
        start = start_after + b"\x00" if start_after and start_after >= prefix else prefix
        out: list[bytes] = []
        slots = self._slots
        self._prefix_scans += 1
        for ek, slot in self._tree.items(start):
            if not ek.startswith(prefix):
                break
            if worker_id is not None and not any(r.worker_id == worker_id for r in slots[slot]):
                continue
            if len(out) == limit:
                return out, True
            out.append(ek)
        return out, False

    def block_keys(self, block_hash: str, tenant_id: str, worker_id: str) -> list[KvBlockKey]:
        """Keys of one tenant with this block hash (any scope, any prefix) where worker_id
        holds a record.  Only that tenant's entries are looked at (the identity guard's
        request path: another tenant's keys are never iterated)."""
        eks = block_eks(self._by_block, block_hash, tenant_id)
        if not eks:
            return []
        tree, slots = self._tree, self._slots
        out = []
        for ek in eks:
            records = slots[tree[ek]]
            if any(r.worker_id == worker_id for r in records):
                out.append(records[0].key)
        return out

    def block_tenants(self, block_hash: str, worker_id: str) -> dict[str, list[KvBlockKey]]:
        """tenant -> block_keys(block_hash, tenant, worker_id), for every tenant that has
        one (audits and the guard's mode "off"; off the strict request path)."""
        out = {}
        for tenant in block_tenants(self._by_block, block_hash):
            keys = self.block_keys(block_hash, tenant, worker_id)
            if keys:
                out[tenant] = keys
        return out

    def records_of(self, worker_id: str) -> int:
        """How many encoded keys hold a record of worker_id."""
        return len(self._by_worker.get(worker_id, ()))

    def keys_of(self, worker_id: str) -> set[bytes]:
        """The encoded keys where worker_id holds a record (a copy)."""
        return set(self._by_worker.get(worker_id, ()))

    def agree_holder(self, worker_id: str, tier: CacheTier, blob, key_off, lengths) -> dict[str, int]:
        """Make worker_id's records say exactly this: one record in ``tier`` for each key of
        the key blob (key i is ``blob[key_off[i]:key_off[i + 1]]``, ``lengths[i]`` bytes),
        and none for any other key.  The store's start-up check against the SSD tier.

        Returns how many keys already ``agreed``, were ``added`` (no record of worker_id),
        ``resized`` (a record of another size or tier) and ``dropped`` (a record, no key in
        the blob).  Only the keys that disagree are decoded and written."""
        n = len(key_off) - 1
        slots = np.empty(n, np.int64)
        if n > 0:
            self._tree.get_blob(blob, key_off, slots)
        lengths = np.asarray(lengths, dtype=np.int64)
        ok, has = self._holder_match(worker_id, tier, slots, lengths)
        out = {"agreed": int(ok.sum()), "added": int((~has).sum()), "resized": int((has & ~ok).sum()),
               "dropped": 0}
        for i in np.flatnonzero(~ok).tolist():
            ek = bytes(blob[int(key_off[i]):int(key_off[i + 1])])
            self.set_holder(decode_key(ek), ek, worker_id, (tier,), int(lengths[i]))
        if self._holder_key_count(worker_id) > n:
            found = {bytes(blob[int(key_off[i]):int(key_off[i + 1])]) for i in range(n)}
            for ek in self.keys_of(worker_id) - found:
                self.set_holder(None, ek, worker_id, (), 0)
                out["dropped"] += 1
        return out

    def _holder_match(self, worker_id: str, tier: CacheTier, slots, lengths):
        """(ok, has) per looked-up key: worker_id holds a record of it (has), exactly one,
        in ``tier`` and of lengths[i] bytes (ok)."""
        ok = np.zeros(len(slots), dtype=bool)
        has = np.zeros(len(slots), dtype=bool)
        for i in np.flatnonzero(slots >= 0).tolist():
            mine = [r for r in self._slots[int(slots[i])] if r.worker_id == worker_id]
            if mine:
                has[i] = True
                ok[i] = len(mine) == 1 and mine[0].tier is tier and mine[0].bytes == lengths[i]
        return ok, has

    def _holder_key_count(self, worker_id: str) -> int:
        """How many keys hold a record of worker_id."""
        return len(self._by_worker.get(worker_id, ()))

    # ------------------------------------------------------------------ dump / load

    def iter_records(self) -> Iterator[CacheResidency]:
        """Every record in key order, then worker_id, then tier (sort_residencies order)."""
        slots = self._slots
        for _, slot in self._tree.items():
            yield from slots[slot]

    def load_records(self, records: Iterable[CacheResidency]) -> int:
        """Bulk-load a dump (e.g. iter_records() of a checkpoint); not counted as puts.
        Returns the number of records read."""
        n = 0
        for residency in records:
            self._apply_put(residency)
            n += 1
        return n

    @classmethod
    def from_records(cls, records: Iterable[CacheResidency]) -> "ArtIndex":
        index = cls()
        index.load_records(records)
        return index
