"""The ART residency index: ``model.IndexBackend`` on the adaptive radix tree.

The tree maps ``encode_key(key)`` to a value in one of two forms:

* packed (``value & PACKED``): the usual key, one holder whose records differ only in
  tier (same size, no access time, refs or pin): the holder's number, the set of its tiers
  and the size, in the tree's own 64-bit value.  No Python object is kept for such a key;
  ``CacheResidency`` records are built when a caller asks for them (``locate``,
  ``prefix_scan``, ``records_at``, ``iter_records``);
* a slot id: ``self._slots[slot]`` is that key's list of residency records, kept sorted by
  (worker_id, tier value): several holders, or a record that does not pack.

Because the key encoding puts scope then prefix hash first, ``prefix_scan`` is one ordered
range walk of the tree (``scan_prefix(encode_scope_prefix(...))``) and its output is
already in ``model.sort_residencies`` order: key order, then worker, then tier.

Side maps keep the other operations proportional to what they touch:
``_by_worker[worker_id]`` = encoded keys where that worker has a record (clear_worker), for
every worker but the home (``set_home``: the store's own, counted and walked when asked),
``_by_block``, a native ``BlockMap`` (_native/blockmap.pyx): block hash -> the encoded key
with that block hash, or per tenant a tuple of them, keyed by a keyed hash of the block hash
read inside the encoded key (no block-hash str per resident block); ``eks`` reads it
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
from quillcache._native.blockmap import BlockMap, block_hash_of   # block_hash_of: re-exported
from quillcache._native.blocks import untrack
from quillcache._native.keys import decode_key_fast
from quillcache.model import (
    CacheResidency, CacheTier, IdentityScope, IndexMetrics, KvBlockKey, decode_key, encode_key,
    encode_scope, encode_scope_prefix,
)

__all__ = ["ArtIndex", "tenant_of", "block_hash_of", "packed_tiers", "PACKED"]

# A packed value (module docstring): PACKED | holder number << WORKER_SHIFT | tier set <<
# TIER_SHIFT | size.  Below PACKED a value is a slot id; the tree's batch reads give -1 for
# a missing key, so values stay below 1 << 63.
BYTES_BITS = 41                       # bits: sizes below 2 TiB pack
TIER_BITS = 5                         # one bit per CacheTier, in TIER_ORDER
WORKER_BITS = 16                      # holder numbers: at most this many holders pack at once
TIER_SHIFT = BYTES_BITS
WORKER_SHIFT = BYTES_BITS + TIER_BITS
PACKED = 1 << 62
BYTES_MASK = (1 << BYTES_BITS) - 1
TIER_MASK = (1 << TIER_BITS) - 1
WORKER_MASK = (1 << WORKER_BITS) - 1
assert WORKER_SHIFT + WORKER_BITS <= 62 and len(CacheTier) <= TIER_BITS

TIER_ORDER = tuple(sorted(CacheTier, key=lambda t: t.value))    # the records' order within a holder
TIER_BIT = {t: 1 << i for i, t in enumerate(TIER_ORDER)}
MASK_TIERS = tuple(tuple(t for i, t in enumerate(TIER_ORDER) if m >> i & 1) for m in range(1 << TIER_BITS))


def packed_tiers(value: int) -> tuple[CacheTier, ...]:
    """The tiers of a packed value's records, in record order."""
    return MASK_TIERS[value >> TIER_SHIFT & TIER_MASK]


def _order(r: CacheResidency) -> tuple[str, str]:
    return (r.worker_id, r.tier.value)


def tenant_of(ek: bytes) -> str:
    """The tenant_id field of an encoded key (the first field after the version byte)."""
    return ek[2:2 + ek[1]].decode("utf-8")


def key_of(ek: bytes) -> KvBlockKey:
    """The key an encoded key of the index encodes (its encoding kept)."""
    key = decode_key_fast(ek, KvBlockKey)
    return key if key is not None else decode_key(ek)


class ArtIndex:
    """Residency index on an adaptive radix tree (in memory; ``persistent`` is False)."""

    name = "art"
    persistent = False

    def __init__(self) -> None:
        self._tree = AdaptiveRadixTree()
        self._slots: list[Optional[list[CacheResidency]]] = []
        self._free_slots: list[int] = []
        self._by_worker: dict[str, set[bytes]] = {}
        self._by_block = BlockMap()                 # block hash -> ek, or {tenant: (ek, ...)}
        self._workers: list[Optional[str]] = []     # holder number of packed values -> worker_id
        self._numbers: dict[str, int] = {}          # worker_id -> its holder number
        self._packed: list[int] = []                # holder number -> packed keys naming it
        self._free_numbers: list[int] = []
        self._home: Optional[str] = None            # set_home: the holder with no key set
        self._home_keys = 0                         # keys holding a record of _home
        self._records = 0
        self._resident_bytes = 0
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0

    # ------------------------------------------------------------------ packed values

    def _pack(self, worker_id: str, tiers: int, nbytes: int) -> int:
        """The packed value of worker_id's records in the tier set ``tiers`` (TIER_BIT bits),
        each of nbytes; 0 when it does not pack (a size over BYTES_BITS, or every holder
        number taken).  Numbers a new holder; ``_hold`` the value once the tree has it."""
        if not 0 <= nbytes <= BYTES_MASK:
            return 0
        no = self._numbers.get(worker_id)
        if no is None:
            if self._free_numbers:
                no = self._free_numbers.pop()
                self._workers[no] = worker_id
            elif len(self._workers) <= WORKER_MASK:
                no = len(self._workers)
                self._workers.append(worker_id)
                self._packed.append(0)
            else:
                return 0
            self._numbers[worker_id] = no
        return PACKED | no << WORKER_SHIFT | tiers << TIER_SHIFT | int(nbytes)

    def _pack_records(self, records: list[CacheResidency]) -> int:
        """The packed value of records (one key's, sorted) if they pack, else 0."""
        first = records[0]
        tiers = 0
        for r in records:
            if (r.worker_id != first.worker_id or r.bytes != first.bytes or r.last_access_ms
                    or r.ref_count or r.pinned):
                return 0
            tiers |= TIER_BIT[r.tier]
        return self._pack(first.worker_id, tiers, first.bytes)

    def _hold(self, value: int) -> None:
        self._packed[value >> WORKER_SHIFT & WORKER_MASK] += 1

    def _unhold(self, value: int) -> None:
        """A packed value left the tree (or never got in): its holder's number is free
        again once no packed key names it."""
        no = value >> WORKER_SHIFT & WORKER_MASK
        if self._packed[no] > 0:
            self._packed[no] -= 1
        if not self._packed[no] and self._workers[no] is not None:
            del self._numbers[self._workers[no]]
            self._workers[no] = None
            self._free_numbers.append(no)

    def _worker_of(self, value: int) -> Optional[str]:
        return self._workers[value >> WORKER_SHIFT & WORKER_MASK]

    def _unpacked(self, value: int, ek: bytes, key: Optional[KvBlockKey] = None) -> list[CacheResidency]:
        """The records of a packed value (built now; ``key``: the key of ek if the caller has it)."""
        if key is None:
            key = key_of(ek)
        worker, nbytes = self._worker_of(value), value & BYTES_MASK
        return untrack([untrack(CacheResidency(key, worker, t, nbytes))
                        for t in packed_tiers(value)])

    def _records_in(self, value: int, ek: bytes, key: Optional[KvBlockKey] = None) -> list[CacheResidency]:
        """The records under tree value ``value`` of ek (a slot's own list: read it only)."""
        return self._unpacked(value, ek, key) if value & PACKED else self._slots[value]

    def _insert_value(self, ek: bytes, value: int) -> None:
        """Put ``value`` (either form, a slot already made) under ek in the tree; if the
        tree refuses it, the value is given back (its holder count, or its slot)."""
        if value & PACKED:
            self._hold(value)
        try:
            self._tree.insert(ek, value)
        except BaseException:
            self._release_value(value)
            raise

    def _release_value(self, value: int) -> None:
        if value & PACKED:
            self._unhold(value)
        else:
            self._release_slot(value)

    def _set_value(self, ek: bytes, old: int, value: int) -> None:
        """Give ek's records the tree value ``value`` in place of ``old`` (either form)."""
        self._insert_value(ek, value)
        self._release_value(old)

    # ------------------------------------------------------------------ state changes

    def _apply_put(self, residency: CacheResidency, ek: Optional[bytes] = None) -> None:
        """Add residency, replacing the record of the same worker and tier for its key.
        ``ek``: encode_key(residency.key) when the caller has it already."""
        if ek is None:
            ek = encode_key(residency.key)   # validates the key before anything changes
        value = self._tree.get(ek)
        worker = residency.worker_id
        home = worker == self._home
        if home and (value is None or worker not in self._holders(value)):
            self._home_keys += 1
        if value is None:
            self._put_new(residency, ek)
        elif value & PACKED:
            self._put_packed(residency, ek, value)
        else:
            self._merge(self._slots[value], untrack(residency))
        self._records += 1
        self._resident_bytes += residency.bytes
        if not home:
            mine = self._by_worker.get(worker)
            if mine is None:
                self._by_worker[worker] = {ek}
            else:
                mine.add(ek)

    def _put_new(self, residency: CacheResidency, ek: bytes) -> None:
        r = residency
        value = 0
        if not (r.last_access_ms or r.ref_count or r.pinned):
            value = self._pack(r.worker_id, TIER_BIT[r.tier], r.bytes)
        if not value:
            # records and their lists can hold no cycle: off the GC
            value = self._new_slot(untrack([untrack(residency)]))
        self._insert_value(ek, value)
        self._by_block.add(ek, r.key.tenant_id)    # the block hash is read inside ek: no str

    def _put_packed(self, residency: CacheResidency, ek: bytes, value: int) -> None:
        r = residency
        if (self._worker_of(value) == r.worker_id and r.bytes == value & BYTES_MASK
                and not (r.last_access_ms or r.ref_count or r.pinned)):
            bit = TIER_BIT[r.tier] << TIER_SHIFT
            if value & bit:                  # the same record again
                self._records -= 1
                self._resident_bytes -= r.bytes
            else:
                self._tree.insert(ek, value | bit)
            return
        records = self._unpacked(value, ek, r.key)     # another holder, size or state: a slot
        self._set_value(ek, value, self._new_slot(records))
        self._merge(records, untrack(residency))

    def _merge(self, records: list[CacheResidency], residency: CacheResidency) -> None:
        """Put residency into a key's sorted records, replacing the same (worker, tier)."""
        order = _order(residency)
        for i, existing in enumerate(records):
            existing_order = _order(existing)
            if existing_order == order:
                self._resident_bytes -= existing.bytes
                self._records -= 1
                records[i] = residency
                return
            if existing_order > order:
                records.insert(i, residency)
                return
        records.append(residency)

    def _apply_remove(self, ek: bytes, worker_id: str) -> int:
        """Drop every record of worker_id under encoded key ek; returns how many."""
        value = self._tree.get(ek)
        if value is None:
            return 0
        if value & PACKED:
            if self._worker_of(value) != worker_id:
                return 0
            removed = len(packed_tiers(value))
            self._resident_bytes -= removed * (value & BYTES_MASK)
            keep = None
        else:
            records = self._slots[value]
            keep = [r for r in records if r.worker_id != worker_id]
            removed = len(records) - len(keep)
            if not removed:
                return 0
            self._resident_bytes -= sum(r.bytes for r in records if r.worker_id == worker_id)
        self._records -= removed
        if worker_id == self._home:
            self._home_keys -= 1
        else:
            keys = self._by_worker.get(worker_id)
            if keys is not None:
                keys.discard(ek)
                if not keys:
                    del self._by_worker[worker_id]
        if keep:
            packed = self._pack_records(keep)
            if packed:
                self._set_value(ek, value, packed)
            else:
                self._slots[value] = untrack(keep)
            return removed
        self._tree.delete(ek)
        self._release_value(value)
        self._by_block.forget(ek)
        return removed

    def _apply_clear(self) -> None:
        self._tree.clear()
        self._slots.clear()
        self._free_slots.clear()
        self._by_worker.clear()
        self._by_block.clear()
        self._workers.clear()
        self._numbers.clear()
        self._packed.clear()
        self._free_numbers.clear()
        self._home_keys = 0
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
        ek = encode_key(key)
        value = self._tree.get(ek)
        return [] if value is None else list(self._records_in(value, ek, key))

    def records_at(self, ek: bytes) -> list[CacheResidency]:
        """The records under encoded key ``ek`` (read them, do not change the list: it may
        be the index's own); [] if none.  ``locate`` without encoding the key."""
        value = self._tree.get(ek)
        return [] if value is None else self._records_in(value, ek)

    def holders_at(self, ek: bytes) -> list[tuple[str, int]]:
        """(worker_id, bytes) of each record under encoded key ``ek``, in record order,
        without building records or decoding the key (LOCATE's answer, cluster/records.py)."""
        value = self._tree.get(ek)
        if value is None:
            return []
        if value & PACKED:
            return [(self._worker_of(value), value & BYTES_MASK)] * len(packed_tiers(value))
        return [(r.worker_id, r.bytes) for r in self._slots[value]]

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        prefix = encode_scope_prefix(scope, prefix_hash)   # KeyError_ on a bad prefix_hash
        self._prefix_scans += 1
        out: list[CacheResidency] = []
        for ek, value in self._tree.scan_prefix(prefix):
            out += self._records_in(value, ek)
        return out

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        candidates = self._by_block.eks(block_hash, scope.tenant_id)
        if not candidates:
            return 0
        in_scope = encode_scope(scope)      # a key of the scope starts with exactly these bytes
        removed = 0
        for ek in candidates:
            if ek.startswith(in_scope) and worker_id in self._holders(self._tree[ek]):
                removed += self._apply_remove(ek, worker_id)
        self._removes += removed
        return removed

    def _holders(self, value: int) -> tuple | list:
        """The worker ids holding a record under tree value ``value`` (with repeats)."""
        if value & PACKED:
            return (self._worker_of(value),)
        return [r.worker_id for r in self._slots[value]]

    def clear_worker(self, worker_id: str) -> int:
        removed = 0
        for ek in list(self._keys(worker_id)):
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
        value = self._tree.get(ek)
        if value is None:
            return 0, ()
        if value & PACKED:
            if self._worker_of(value) != worker_id:
                return 0, ()
            return value & BYTES_MASK, packed_tiers(value)
        mine = [r for r in self._slots[value] if r.worker_id == worker_id]
        return (mine[0].bytes if mine else 0), tuple(r.tier for r in mine)

    def set_holder(self, key: KvBlockKey, ek: bytes, worker_id: str, tiers: tuple[CacheTier, ...],
                   nbytes: int) -> bool:
        """Make worker_id's records of key exactly one per tier in ``tiers`` (in the order
        of CacheTier), each of ``nbytes``; no tiers removes them.  ``ek`` is encode_key(key).
        Returns False when the records were already so (nothing changed, nothing logged)."""
        value = self._tree.get(ek)
        if value is not None:
            if value >= PACKED:                                 # the common case, checked cheaply
                hi = value >> TIER_SHIFT                        # holder number, tier set
                have = MASK_TIERS[hi & TIER_MASK]
                if self._workers[hi >> TIER_BITS & WORKER_MASK] == worker_id:
                    if value & BYTES_MASK == nbytes and (have == tiers or (
                            len(have) == len(tiers) and set(have) == set(tiers))):
                        return False
                    if tiers:
                        mask = 0
                        for tier in tiers:
                            mask |= TIER_BIT[tier]
                        if 0 <= nbytes <= BYTES_MASK and len(MASK_TIERS[mask]) == len(tiers):
                            self._replace_packed(ek, value, key, worker_id, have, tiers,
                                                 value & ~(TIER_MASK << TIER_SHIFT | BYTES_MASK)
                                                 | mask << TIER_SHIFT | nbytes)
                            return True
                    self._removes += self._apply_remove(ek, worker_id)
            else:
                records = self._slots[value]
                mine = [r for r in records if r.worker_id == worker_id]
                if (len(mine) == len(tiers) and all(r.bytes == nbytes for r in mine)
                        and {r.tier for r in mine} == set(tiers)):
                    packed = self._pack_records(records)
                    if packed:          # e.g. recovered from a checkpoint: packed from now on
                        self._set_value(ek, value, packed)
                    return False
                if mine:
                    self._removes += self._apply_remove(ek, worker_id)
        elif not tiers:
            return False
        for tier in tiers:
            self._apply_put(CacheResidency(key, worker_id, tier, nbytes), ek)
            self._puts += 1
        return True

    def _replace_packed(self, ek: bytes, value: int, key: KvBlockKey, worker_id: str,
                        have: tuple[CacheTier, ...], tiers: tuple[CacheTier, ...], new: int) -> None:
        """set_holder of a packed key whose one holder is worker_id, to another packed
        value of the same holder: what removing ``have`` and putting ``tiers`` would do,
        without taking the key out of the tree and its side maps and back in (the
        persistent index logs it as those removes and puts)."""
        self._tree.insert(ek, new)
        self._records += len(tiers) - len(have)
        self._resident_bytes += len(tiers) * (new & BYTES_MASK) - len(have) * (value & BYTES_MASK)
        self._removes += len(have)
        self._puts += len(tiers)

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
        number = self._numbers.get(worker_id, -1) if worker_id is not None else -1
        self._prefix_scans += 1
        for ek, value in self._tree.items(start):
            if not ek.startswith(prefix):
                break
            if worker_id is not None:
                if value & PACKED:
                    if value >> WORKER_SHIFT & WORKER_MASK != number:
                        continue
                elif not any(r.worker_id == worker_id for r in slots[value]):
                    continue
            if len(out) == limit:
                return out, True
            out.append(ek)
        return out, False

    def block_keys(self, block_hash: str, tenant_id: str, worker_id: str) -> list[KvBlockKey]:
        """Keys of one tenant with this block hash (any scope, any prefix) where worker_id
        holds a record.  Only that tenant's entries are looked at (the identity guard's
        request path: another tenant's keys are never iterated)."""
        eks = self._by_block.eks(block_hash, tenant_id)
        if not eks:
            return []
        tree, slots = self._tree, self._slots
        out = []
        for ek in eks:
            value = tree[ek]
            if value & PACKED:
                if self._worker_of(value) == worker_id:
                    out.append(key_of(ek))
            else:
                records = slots[value]
                if any(r.worker_id == worker_id for r in records):
                    out.append(records[0].key)
        return out

    def block_tenants(self, block_hash: str, worker_id: str) -> dict[str, list[KvBlockKey]]:
        """tenant -> block_keys(block_hash, tenant, worker_id), for every tenant that has
        one (audits and the guard's mode "off"; off the strict request path)."""
        out = {}
        for tenant in self._by_block.tenants(block_hash):
            keys = self.block_keys(block_hash, tenant, worker_id)
            if keys:
                out[tenant] = keys
        return out

    def records_of(self, worker_id: str) -> int:
        """How many encoded keys hold a record of worker_id."""
        if worker_id == self._home:
            return self._home_keys
        return len(self._by_worker.get(worker_id, ()))

    def keys_of(self, worker_id: str) -> set[bytes]:
        """The encoded keys where worker_id holds a record (a copy; for the home, one walk
        of the tree)."""
        return set(self._keys(worker_id))

    def _keys(self, worker_id: str):
        return self._home_walk() if worker_id == self._home else self._by_worker.get(worker_id, ())

    # ------------------------------------------------------------------ the home: no key set

    @property
    def home(self) -> Optional[str]:
        return self._home

    def set_home(self, worker_id: str) -> None:
        """Keep no key set for worker_id's records (the store's own holder: its keys are
        most of the index, and a set entry cost 35-105 B a key): ``records_of`` counts
        them, ``keys_of`` and ``clear_worker`` walk the tree (O(keys held): the start-up
        check, a residency listener's start and QC_DEBUG checks; no request asks).  The
        other holders (a pool's records of other nodes) keep their sets.  Once per index."""
        if worker_id == self._home:
            return
        if self._home is not None:
            raise ValueError(f"the index's home is {self._home!r}; cannot make it {worker_id!r}")
        count = self._holder_key_count(worker_id)
        self._drop_key_set(worker_id)
        self._home, self._home_keys = worker_id, count

    def _drop_key_set(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)

    def _home_walk(self) -> list[bytes]:
        """The keys holding a record of the home: packed ones found by the tree's native
        walk, the others from the slots."""
        no = self._numbers.get(self._home)
        out = [] if no is None else self._tree.keys_where(PACKED | WORKER_MASK << WORKER_SHIFT,
                                                           PACKED | no << WORKER_SHIFT)
        return out + self._slot_keys(self._home)

    def _slot_keys(self, worker_id: str) -> list[bytes]:
        """The keys in slot form holding a record of worker_id."""
        return [encode_key(rs[0].key) for rs in self._slots
                if rs is not None and any(r.worker_id == worker_id for r in rs)]

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
            value = int(slots[i])
            if value & PACKED:
                if self._worker_of(value) == worker_id:
                    has[i] = True
                    ok[i] = (value >> TIER_SHIFT & TIER_MASK == TIER_BIT[tier]
                             and value & BYTES_MASK == lengths[i])
                continue
            mine = [r for r in self._slots[value] if r.worker_id == worker_id]
            if mine:
                has[i] = True
                ok[i] = len(mine) == 1 and mine[0].tier is tier and mine[0].bytes == lengths[i]
        return ok, has

    def _holder_key_count(self, worker_id: str) -> int:
        """How many keys hold a record of worker_id."""
        return self.records_of(worker_id)

    # ------------------------------------------------------------------ dump / load

    def iter_records(self) -> Iterator[CacheResidency]:
        """Every record in key order, then worker_id, then tier (sort_residencies order)."""
        for ek, value in self._tree.items():
            yield from self._records_in(value, ek)

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
