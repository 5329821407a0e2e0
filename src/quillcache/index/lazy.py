"""The lazy structures of the persistent index's recovery (index/persistent.py): what lets
a million recovered records serve in about a second of CPU.

* ``LazySlots``: ArtIndex's slots, where a slot still only in the checkpoint (``COLD``) or
  replayed from the WAL without building model objects (``RawGroup``) is decoded on first
  access;
* ``LazyBlockMap`` / ``LazyWorkerMap``: ArtIndex's side maps (block hash -> tenant -> keys,
  a native ``BlockMap``; worker -> keys, a dict), each name's entry computed on first use
  from the checkpoint's tables (numpy) plus what the replay changed (``note`` and
  ``unnote`` / ``forget``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from quillcache._native.blockmap import BlockMap
from quillcache.index.art import block_hash_of
from quillcache.index.checkpoint import TIERS
from quillcache.model import CacheResidency, decode_key

if TYPE_CHECKING:
    from quillcache.index.checkpoint import Checkpoint

__all__ = ["COLD", "RawGroup", "LazySlots", "LazyMap", "LazyBlockMap", "LazyWorkerMap", "block_hash_of"]

COLD = object()     # a slot whose records are still only in the checkpoint buffer


class RawGroup:
    """A slot replayed from the WAL but not decoded yet: its encoded key and rows
    (worker_id, tier code, bytes, last_access_ms, ref_count, pinned) in (worker, tier) order."""

    __slots__ = ("ek", "rows")

    def __init__(self, ek: bytes, rows: list) -> None:
        self.ek = ek
        self.rows = rows

    def decode(self) -> list[CacheResidency]:
        key = decode_key(self.ek)
        return [CacheResidency(key, w, TIERS[t], b, last, ref, bool(pin))
                for w, t, b, last, ref, pin in self.rows]


class LazySlots(list):
    """ArtIndex._slots whose checkpoint-loaded (COLD) and replayed (RawGroup) entries are
    decoded on first access; ``lazy`` counts them and ``cold[g]`` says that slot g still
    holds checkpoint group g as it was loaded (numpy: the start-up check reads the
    checkpoint's record table for those)."""

    def __init__(self, n: int, decode_cold) -> None:
        super().__init__()
        if n:
            self.extend([COLD] * n)
        self.lazy = n
        self.cold = np.ones(n, dtype=bool)
        self._decode_cold = decode_cold

    def __getitem__(self, i):
        v = list.__getitem__(self, i)
        if v is COLD:
            v = self._decode_cold(i)
            self.cold[i] = False
        elif type(v) is RawGroup:
            v = v.decode()
        else:
            return v
        list.__setitem__(self, i, v)
        self.lazy -= 1
        return v

    def clear(self) -> None:
        list.clear(self)
        self.lazy = 0
        self.cold = np.zeros(0, dtype=bool)


class LazyMap(dict):
    """A side map of ArtIndex (name -> set of encoded keys) whose entries are computed on
    first get/setdefault of a name by ``_cold(name)``; after that the dict entry is exact
    (every change to those keys reaches the entry through get/setdefault first)."""

    def __init__(self) -> None:
        super().__init__()
        self._warmed: set = set()

    def _cold(self, name) -> Optional[set]:
        raise NotImplementedError

    def is_warm(self, name) -> bool:
        """Whether ``name``'s entry was computed (then the dict entry is exact)."""
        return name in self._warmed

    def _warm(self, name) -> None:
        if name in self._warmed:
            return
        self._warmed.add(name)
        found = self._cold(name)
        if found:
            dict.setdefault(self, name, set()).update(found)

    def get(self, key, default=None):
        self._warm(key)
        return dict.get(self, key, default)

    def setdefault(self, key, default=None):
        self._warm(key)
        return dict.setdefault(self, key, default)

    def clear(self) -> None:
        dict.clear(self)
        self._warmed.clear()


class LazyBlockMap:
    """ArtIndex._by_block after a recovery: the native ``BlockMap`` (block hash -> the
    encoded keys in the tree with that block hash) whose entry for a block hash is computed
    on first use, from the checkpoint's block-hash table (binary search) plus the keys the
    replay added (``note``), keeping those still in the tree.  ArtIndex calls it as it calls
    a BlockMap (``add``, ``forget``, ``eks``, ``tenants``, ``get``, ``clear``); each call
    computes the entry it touches first.  ``warm_all`` computes the rest and returns the
    BlockMap (``materialize``: the index keeps that)."""

    def __init__(self, ck: "Optional[Checkpoint]", tree) -> None:
        self._map = BlockMap()
        self._warmed: set[str] = set()        # block hashes whose entry is computed (exact)
        self._ck = ck
        self._tree = tree
        self._taken = np.zeros(ck.n_blocks if ck is not None else 0, dtype=bool)
        self._pending: dict[str, set] = {}    # replay adds to entries not computed yet

    def is_warm(self, block_hash: str) -> bool:
        """Whether block_hash's entry was computed (then the map's entry is exact)."""
        return block_hash in self._warmed

    def _warm(self, block_hash) -> None:
        if not isinstance(block_hash, str) or block_hash in self._warmed:
            return
        self._warmed.add(block_hash)
        for ek in sorted(self._cold(block_hash)):
            self._map.add(ek)

    def _cold(self, block_hash: str) -> set:
        found = self._pending.pop(block_hash, set())
        ck = self._ck
        if ck is not None:
            i = ck.find_block(block_hash.encode("utf-8"))
            if i >= 0 and not self._taken[i]:
                self._taken[i] = True
                found.update(ck.ek(g) for g in ck.bh_groups[ck.bh_group_off[i]:ck.bh_group_off[i + 1]].tolist())
        tree = self._tree
        return {ek for ek in found if ek in tree}

    # ArtIndex's calls: BlockMap's, each after computing the entry it touches

    def add(self, ek: bytes, tenant_id: Optional[str] = None) -> None:
        self._warm(block_hash_of(ek).decode("utf-8"))
        self._map.add(ek, tenant_id)

    def forget(self, ek: bytes, tenant_id: Optional[str] = None) -> None:
        self._warm(block_hash_of(ek).decode("utf-8"))
        self._map.forget(ek, tenant_id)

    def eks(self, block_hash: str, tenant_id: str) -> tuple:
        self._warm(block_hash)
        return self._map.eks(block_hash, tenant_id)

    def tenants(self, block_hash: str) -> list:
        self._warm(block_hash)
        return self._map.tenants(block_hash)

    def get(self, block_hash: str, default=None):
        self._warm(block_hash)
        return self._map.get(block_hash, default)

    # the replay's calls: no entry is computed

    def note(self, ek: bytes, block_hash: Optional[str] = None) -> None:
        """Replay: ek (a new key, of ``block_hash`` where the caller read it already) is in
        the tree now."""
        if block_hash is None:
            block_hash = block_hash_of(ek).decode("utf-8")
        if block_hash in self._warmed:
            self._map.add(ek)
        else:
            self._pending.setdefault(block_hash, set()).add(ek)

    def unnote(self, ek: bytes) -> None:
        """Replay: ek left the tree."""
        if block_hash_of(ek).decode("utf-8") in self._warmed:   # else: filtered out when computed
            self._map.forget(ek)

    def warm_all(self) -> BlockMap:
        ck = self._ck
        if ck is not None:
            for i in np.flatnonzero(~self._taken).tolist():
                self._warm(ck.block_hash(i))
        for bh in list(self._pending):
            self._warm(bh)
        return self._map

    def clear(self) -> None:
        self._map.clear()
        self._warmed.clear()
        self._ck = None
        self._pending.clear()
        self._taken = np.zeros(0, dtype=bool)


class LazyWorkerMap(LazyMap):
    """ArtIndex._by_worker: worker id -> encoded keys where it has a record; cold entries
    come from the checkpoint's records (grouped by worker with numpy on first use)."""

    def __init__(self, ck: "Optional[Checkpoint]") -> None:
        super().__init__()
        self._ck = ck
        self._index = {w: i for i, w in enumerate(ck.workers)} if ck is not None else {}
        self._order = None
        self._added: dict[str, set] = {}      # replay changes to entries not computed yet
        self._removed: dict[str, set] = {}

    def note(self, worker: str, ek: bytes) -> None:
        """Replay: worker has a record under ek now (without computing the cold entry)."""
        if worker in self._warmed:
            dict.setdefault(self, worker, set()).add(ek)
        else:
            self._added.setdefault(worker, set()).add(ek)
            self._removed.get(worker, set()).discard(ek)

    def forget(self, worker: str, ek: bytes) -> None:
        """Replay: worker has no record under ek any more."""
        if worker in self._warmed:
            keys = dict.get(self, worker)
            if keys is not None:
                keys.discard(ek)
                if not keys:
                    dict.__delitem__(self, worker)
        else:
            self._removed.setdefault(worker, set()).add(ek)
            self._added.get(worker, set()).discard(ek)

    def drop(self, worker: str) -> None:
        """Keep no entry for worker from now on (ArtIndex.set_home), computed or not."""
        self._warmed.add(worker)
        dict.pop(self, worker, None)
        self._added.pop(worker, None)
        self._removed.pop(worker, None)

    def _cold(self, worker) -> Optional[set]:
        found = self._added.pop(worker, set())
        removed = self._removed.pop(worker, set())
        ck = self._ck
        i = self._index.get(worker) if ck is not None else None
        if i is None:
            return found
        if self._order is None:
            wcol = ck.records["worker"]
            self._order = np.argsort(wcol, kind="stable")
            self._bounds = np.searchsorted(wcol[self._order], np.arange(ck.n_workers + 1))
            self._rec_group = np.repeat(np.arange(ck.n_groups, dtype=np.int64),
                                        np.diff(ck.rec_off.astype(np.int64)))
        recs = self._order[self._bounds[i]:self._bounds[i + 1]]
        cold = set(ck.eks_obj[self._rec_group[recs]])
        cold.difference_update(removed)
        cold.update(found)
        return cold

    def warm_all(self) -> dict:
        for w in list(self._index) + list(self._added):
            self._warm(w)
        return dict(self)

    def clear(self) -> None:
        super().clear()
        self._ck = None
        self._added.clear()
        self._removed.clear()
