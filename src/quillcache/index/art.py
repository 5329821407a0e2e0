"""The ART residency index: ``model.IndexBackend`` on the adaptive radix tree.

The tree maps ``encode_key(key)`` to a slot id; ``self._slots[slot]`` is that key's list
of residency records, kept sorted by (worker_id, tier value).  Because the key encoding
puts scope then prefix hash first, ``prefix_scan`` is one ordered range walk of the tree
(``scan_prefix(encode_scope_prefix(...))``) and its output is already in
``model.sort_residencies`` order: key order, then worker, then tier.

Side maps keep the other operations proportional to what they touch:
``_by_worker[worker_id]`` = encoded keys where that worker has a record (clear_worker),
``_by_block[block_hash]`` = encoded keys with that block hash in any scope (remove_block).

For a persistent subclass (WAL + checkpoints): all state changes go through
``_apply_put``, ``_apply_remove`` and ``_apply_clear``; the public methods only pick what
to change and count.  ``iter_records()`` dumps every record in key order and
``load_records()`` / ``from_records()`` bulk-load such a dump.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

from quillcache._native.art import AdaptiveRadixTree
from quillcache.model import (
    CacheResidency, IdentityScope, IndexMetrics, KvBlockKey, encode_key, encode_scope_prefix,
)

__all__ = ["ArtIndex"]


def _order(r: CacheResidency) -> tuple[str, str]:
    return (r.worker_id, r.tier.value)


class ArtIndex:
    """Residency index on an adaptive radix tree (in memory; ``persistent`` is False)."""

    name = "art"
    persistent = False

    def __init__(self) -> None:
        self._tree = AdaptiveRadixTree()
        self._slots: list[Optional[list[CacheResidency]]] = []
        self._free_slots: list[int] = []
        self._by_worker: dict[str, set[bytes]] = {}
        self._by_block: dict[str, set[bytes]] = {}
        self._records = 0
        self._resident_bytes = 0
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0

    # ------------------------------------------------------------------ state changes

    def _apply_put(self, residency: CacheResidency) -> None:
        """Add residency, replacing the record of the same worker and tier for its key."""
        ek = encode_key(residency.key)       # validates the key before anything changes
        slot = self._tree.get(ek)
        if slot is None:
            slot = self._new_slot([residency])
            try:
                self._tree.insert(ek, slot)
            except BaseException:
                self._release_slot(slot)
                raise
            self._by_block.setdefault(residency.key.block_hash, set()).add(ek)
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
        self._by_worker.setdefault(residency.worker_id, set()).add(ek)

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
            self._slots[slot] = keep
        else:
            block_hash = records[0].key.block_hash
            self._tree.delete(ek)
            self._release_slot(slot)
            same_block = self._by_block.get(block_hash)
            if same_block is not None:
                same_block.discard(ek)
                if not same_block:
                    del self._by_block[block_hash]
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

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        prefix = encode_scope_prefix(scope, prefix_hash)   # KeyError_ on a bad prefix_hash
        self._prefix_scans += 1
        slots = self._slots
        return [r for _, slot in self._tree.scan_prefix(prefix) for r in slots[slot]]

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        candidates = self._by_block.get(block_hash)
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
