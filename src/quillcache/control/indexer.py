"""The KV indexer: per worker and per tier, how deep each worker's cache matches a request's
chain of block hashes, scoped by identity (model, tokenizer, adapter, tenant).

Block hashes are the router's own, computed from token ids as a hash chain over blocks (as
Dynamo does), so they do not depend on an engine's hash seed: ``chain_hashes(tokens,
block_size, parent)``.  An engine's own block hashes are only used to find a stored block's
parent and to apply ``BlockRemoved``; an event without token ids (a QuillCache node's pool
residency) is translated through the hashes learnt from the engines' events.

Tiers, from fastest: ``DEVICE`` (GPU), ``HOST`` (CPU), ``DISK`` and ``POOL`` (a QuillCache
node: any worker can load from it).  A match reports, per worker, the contiguous prefix held
on the device, then how far host, disk and the pool each extend it.

``ArtIndexer`` keeps ``scope id (4 bytes) + hash (8 bytes)`` -> slot in the native ART and a
per-slot bitmask of workers for each tier in a numpy array; a lookup is one native call
(``kvindex.match_levels``: the keys built, looked up in one batch, the masks walked row by
row), per request block and per scope, whatever the index holds.  ``DictIndexer`` is the simple reference (a dict of
sets) that the tests use as an oracle and the benchmark as a baseline.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Optional, Sequence

import numpy as np

from quillcache._native.art import AdaptiveRadixTree
from quillcache._native.kvindex import chain_hashes, mask_add, mask_remove, match_levels
from quillcache.control.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from quillcache.model import IdentityScope

__all__ = [
    "DEVICE", "HOST", "DISK", "POOL", "TIER_NAMES", "tier_of_medium", "chain_hashes", "engine_hash_text",
    "Match", "ArtIndexer", "DictIndexer", "IndexerLimits",
]

DEVICE, HOST, DISK, POOL = 0, 1, 2, 3
TIER_NAMES = ("device", "host", "disk", "pool")
_N_TIERS = 4

_MEDIUM_TIER = {
    None: DEVICE, "": DEVICE, "gpu": DEVICE, "cuda": DEVICE, "device": DEVICE, "hbm": DEVICE,
    "cpu": HOST, "host": HOST, "dram": HOST, "cpu_dram": HOST,
    "disk": DISK, "ssd": DISK, "local_ssd": DISK, "nvme": DISK, "storage": DISK,
}

_KEY = struct.Struct(">Iq")  # scope id, hash


def engine_hash_text(h: BlockHash) -> bytes:
    """An engine's block hash as a QuillCache key names it (``KvBlockKey.block_hash``): hex
    of a bytes hash, decimal of an int one; a pool node publishes it as these bytes."""
    return h.hex().encode() if isinstance(h, bytes) else str(h).encode()


def tier_of_medium(medium: Optional[str]) -> int:
    """The tier of an event's ``medium`` (vLLM: GPU by default, CPU for offloaded blocks)."""
    tier = _MEDIUM_TIER.get(medium.lower() if medium else medium)
    return DISK if tier is None else tier        # an unknown medium is treated as the slowest


@dataclass(frozen=True, slots=True)
class IndexerLimits:
    max_workers: int = 256        # workers and pool nodes, each one bit of a mask
    max_scopes: int = 1 << 20     # identity scopes (a 4-byte id each)
    max_aliases: int = 4 << 20    # engine hash -> router hash translations kept for pool events


@dataclass(frozen=True, slots=True)
class Match:
    """Per worker (in ``workers`` order): ``device[w]`` blocks of contiguous device prefix,
    then how many more each of host, disk and pool adds.  ``refused[w]``: blocks of the
    prefix that this worker holds only under another identity (no credit)."""

    workers: tuple[str, ...]
    device: np.ndarray
    host: np.ndarray
    disk: np.ndarray
    pool: np.ndarray
    refused: np.ndarray
    pool_depth: int               # contiguous prefix held in the pool alone

    def depth(self, w: int) -> int:
        return int(self.device[w] + self.host[w] + self.disk[w] + self.pool[w])

    def as_dict(self) -> dict[str, tuple[int, int, int, int, int]]:
        return {name: (int(self.device[i]), int(self.host[i]), int(self.disk[i]), int(self.pool[i]),
                       int(self.refused[i])) for i, name in enumerate(self.workers)}


class _Base:
    """Event translation shared by both backends: workers, scopes, engine-hash maps."""

    def __init__(self, limits: IndexerLimits = IndexerLimits()) -> None:
        self.limits = limits
        self._worker_ids: dict[str, int] = {}
        self._worker_names: list[str] = []
        self._pool_sources: set[int] = set()
        self._scope_ids: dict[IdentityScope, int] = {}
        # per worker and tier: engine hash -> (scope id, router hash)
        self._engine: list[tuple[dict[BlockHash, tuple[int, int]], ...]] = []
        self._alias: dict[tuple[int, BlockHash], int] = {}
        # per worker and tier: key -> how many add_blocks calls hold it (less remove_blocks's): a
        # block is added to the index when its first holder comes and leaves with its last
        self._direct: list[tuple[dict[bytes, int], ...]] = []
        # per worker (id order, as a Match's columns): its device blocks, the pages they fill: the
        # events' once the worker has sent one (what the engine holds), else add_blocks's
        self._device_n = np.zeros(8, np.int64)
        self._evented: set[int] = set()             # workers that have sent an event batch
        self.orphans = 0          # stored blocks whose parent this indexer never saw
        self.bad_events = 0       # events with a token count that does not match

    # ---- registries
    def worker(self, name: str, pool: bool = False) -> int:
        w = self._worker_ids.get(name)
        if w is None:
            if len(self._worker_names) >= self.limits.max_workers:
                raise ValueError(f"more than {self.limits.max_workers} workers")
            w = len(self._worker_names)
            self._worker_ids[name] = w
            self._worker_names.append(name)
            self._engine.append(tuple({} for _ in range(_N_TIERS)))
            self._direct.append(tuple({} for _ in range(_N_TIERS)))
            if w == len(self._device_n):
                self._device_n = np.concatenate([self._device_n, np.zeros(w, np.int64)])
        if pool:
            self._pool_sources.add(w)
        return w

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._worker_names)

    def scope_id(self, scope: IdentityScope) -> int:
        s = self._scope_ids.get(scope)
        if s is None:
            if len(self._scope_ids) >= self.limits.max_scopes:
                raise ValueError(f"more than {self.limits.max_scopes} identity scopes")
            s = self._scope_ids[scope] = len(self._scope_ids)
        return s

    def scopes(self) -> list[IdentityScope]:
        return list(self._scope_ids)

    # ---- events
    def apply(self, worker: str, batch: EventBatch, scope: IdentityScope, *, pool: bool = False) -> int:
        """Apply one batch from ``worker`` whose blocks belong to ``scope`` (an event's
        ``lora_name`` replaces the adapter; a pool event's ``quill_scope`` replaces it all).
        Returns the number of blocks stored or removed."""
        w = self.worker(worker, pool)
        if w not in self._evented:
            # From its first event on, a worker's pages are what its events say it holds: a
            # block told by add_blocks (a tenant's predicted prefix) is a credit over the same
            # pages, not more of them.
            self._evented.add(w)
            self._device_n[w] -= len(self._direct[w][DEVICE])
        n = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                n += self.stored(w, event, scope)
            elif isinstance(event, BlockRemoved):
                n += self.removed(w, event.block_hashes, self._tier(w, event.medium))
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker)
        return n

    def _tier(self, w: int, medium: Optional[str]) -> int:
        return POOL if w in self._pool_sources else tier_of_medium(medium)

    def stored(self, w: int, event: BlockStored, scope: IdentityScope) -> int:
        if event.quill_scope is not None:
            tenant, model, tokenizer, adapter = event.quill_scope
            scope = IdentityScope(model, tokenizer, adapter, tenant)
        elif event.lora_name is not None and event.lora_name != scope.adapter_id:
            scope = IdentityScope(scope.model_id, scope.tokenizer_id, event.lora_name, scope.tenant_id)
        sid = self.scope_id(scope)
        tier = self._tier(w, event.medium)
        emaps = self._engine[w]
        hashes = event.block_hashes
        if event.token_ids and event.block_size > 0:
            parent = None
            if event.parent_block_hash is not None:
                for emap in emaps:
                    key = emap.get(event.parent_block_hash)
                    if key is not None:
                        parent = _KEY.unpack(key)[1]
                        break
                else:
                    self.orphans += 1
                    parent = hash(("orphan", event.parent_block_hash))
            local = chain_hashes(event.token_ids, event.block_size, parent)
            if len(local) != len(hashes):
                self.bad_events += 1
                n = min(len(local), len(hashes))
                local, hashes = local[:n], hashes[:n]
            if self._pool_sources and len(self._alias) < self.limits.max_aliases:
                # what a pool node calls these blocks: the engine hash as text (residency.py)
                self._alias.update(zip(map(engine_hash_text, hashes), local))
        else:
            # No tokens (pool residency, or an engine that leaves them out): translate the
            # engine's hashes through what the engines' events taught us.
            alias = self._alias
            local = [alias.get(eh) or hash(("engine", eh)) for eh in hashes]
        keys = list(map(_KEY.pack, repeat(sid), local))
        held = len(emaps[tier])
        emaps[tier].update(zip(hashes, keys))
        if tier == DEVICE:
            self._device_n[w] += len(emaps[tier]) - held
        self._add_keys(keys, w, tier)
        return len(keys)

    def removed(self, w: int, hashes: Iterable[BlockHash], tier: int) -> int:
        pop = self._engine[w][tier].pop
        keys = [k for k in (pop(eh, None) for eh in hashes) if k is not None]
        if keys:
            self._remove_keys(keys, w, tier)
            if tier == DEVICE:
                self._device_n[w] -= len(keys)
        return len(keys)

    def clear_worker(self, worker: str) -> int:
        w = self._worker_ids.get(worker)
        if w is None:
            return 0
        n = 0
        for tier, emap in enumerate(self._engine[w]):
            n += self.removed(w, list(emap), tier)
        for tier, refs in enumerate(self._direct[w]):     # and what was told directly
            keys = list(refs)
            refs.clear()
            if tier == DEVICE:
                self._count_direct(w, -len(keys))
            self._remove_keys(keys, w, tier)
            n += len(keys)
        return n

    def device_blocks(self, names: Sequence[str]) -> list[int]:
        """Blocks each worker holds on its device (GPU) tier: what fills its KV memory, as its
        events told once it has sent one, else as ``add_blocks`` told; O(1) per worker."""
        ids = self._worker_ids
        return [0 if ids.get(n) is None else int(self._device_n[ids[n]]) for n in names]

    def device_counts(self) -> np.ndarray:
        """``device_blocks`` of every worker, in the order of a ``Match``'s columns (a view:
        read it before the next event)."""
        return self._device_n[:len(self._worker_names)]

    # ---- direct use (tests, the approximate mode): router hashes, no engine hashes
    def add_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int], tier: int) -> None:
        """Residency told directly (tests, predict-on-route, the approximate mode), counted:
        a block told twice is indexed and counted once, and leaves with its last
        ``remove_blocks``."""
        w = self.worker(worker, tier == POOL)
        refs = self._direct[w][tier]
        new = []
        for k in map(_KEY.pack, repeat(self.scope_id(scope)), hashes):
            n = refs.get(k, 0)
            refs[k] = n + 1
            if not n:
                new.append(k)
        if tier == DEVICE:
            self._count_direct(w, len(new))
        self._add_keys(new, w, tier)

    def remove_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int], tier: int) -> None:
        """Undo one ``add_blocks`` of each block; one never told is left alone."""
        w = self._worker_ids.get(worker)
        sid = self._scope_ids.get(scope)
        if w is None or sid is None:
            return
        refs = self._direct[w][tier]
        gone = []
        for k in map(_KEY.pack, repeat(sid), hashes):
            n = refs.get(k, 0)
            if n > 1:
                refs[k] = n - 1
            elif n == 1:
                del refs[k]
                gone.append(k)
        if tier == DEVICE:
            self._count_direct(w, -len(gone))
        self._remove_keys(gone, w, tier)

    def _count_direct(self, w: int, n: int) -> None:
        """``n`` more (or fewer) device blocks told by ``add_blocks``: pages only for a worker
        that has sent no event (one that has is counted by its events)."""
        if w not in self._evented:
            self._device_n[w] += n

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        raise NotImplementedError

    # storage: keys are ``_KEY.pack(scope id, router hash)``
    def _add_keys(self, keys: list[bytes], w: int, tier: int) -> None:
        raise NotImplementedError

    def _remove_keys(self, keys: list[bytes], w: int, tier: int) -> None:
        raise NotImplementedError


def _depths(present: list[list[bool]], n_workers: int) -> list[int]:
    out = []
    for w in range(n_workers):
        d = 0
        for row in present:
            if not row[w]:
                break
            d += 1
        out.append(d)
    return out


class DictIndexer(_Base):
    """The reference: ``(scope, hash) -> {worker: tier bits}``, matched block by block."""

    def __init__(self, limits: IndexerLimits = IndexerLimits()) -> None:
        super().__init__(limits)
        self._blocks: dict[bytes, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def _add_keys(self, keys, w, tier):
        bit = 1 << tier
        for k in keys:
            holders = self._blocks.setdefault(k, {})
            holders[w] = holders.get(w, 0) | bit

    def _remove_keys(self, keys, w, tier):
        bit = 1 << tier
        for k in keys:
            holders = self._blocks.get(k)
            if holders is None or w not in holders:
                continue
            holders[w] &= ~bit
            if not holders[w]:
                del holders[w]
            if not holders:
                del self._blocks[k]

    def _held(self, sids: Sequence[int], h: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for sid in sids:
            for w, bits in self._blocks.get(_KEY.pack(sid, h), {}).items():
                out[w] = out.get(w, 0) | bits
        return out

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        n = len(self._worker_names)
        all_sids = list(self._scope_ids.values())
        if scope is None:
            sids = all_sids
        else:
            sid = self._scope_ids.get(scope)
            sids = [] if sid is None else [sid]
        rows = [self._held(sids, h) for h in hashes]
        pools = [any(bits & (1 << POOL) for ww, bits in r.items() if ww in self._pool_sources)
                 for r in rows]
        local = (1 << DEVICE) | (1 << HOST) | (1 << DISK)

        def level(mask: int, with_pool: bool) -> list[int]:
            return _depths([[bool(r.get(w, 0) & mask) or (with_pool and p) for w in range(n)]
                            for r, p in zip(rows, pools)], n)

        dev = level(1 << DEVICE, False)
        hst = level((1 << DEVICE) | (1 << HOST), False)
        dsk = level(local, False)
        pol = level(local, True)
        refused = [0] * n
        if scope is not None:
            blind_rows = [[w not in self._pool_sources and bool(self._held(all_sids, h).get(w, 0) & local)
                           for w in range(n)] for h in hashes]
            refused = [max(b - d, 0) for b, d in zip(_depths(blind_rows, n), dsk)]
        pool_depth = 0
        for p in pools:
            if not p:
                break
            pool_depth += 1
        a = np.array
        return Match(self.workers, a(dev, dtype=np.int64), a(hst, dtype=np.int64) - dev,
                     a(dsk, dtype=np.int64) - hst, a(pol, dtype=np.int64) - dsk,
                     a(refused, dtype=np.int64), pool_depth)


class ArtIndexer(_Base):
    """The fast backend: the native ART maps ``scope id + hash`` to a slot; ``_masks[slot,
    tier]`` holds one bit per worker (``words`` uint64 per tier)."""

    def __init__(self, limits: IndexerLimits = IndexerLimits(), capacity: int = 1 << 16) -> None:
        super().__init__(limits)
        self._tree = AdaptiveRadixTree()
        self._words = (limits.max_workers + 63) // 64
        self._masks = np.zeros((capacity, _N_TIERS, self._words), dtype=np.uint64)
        self._free: list[int] = []
        self._next = 0
        self._pool_mask = np.zeros(self._words, dtype=np.uint64)
        self.lookups = 0          # keys find_matches asked the tree for (the decision's work)

    def __len__(self) -> int:
        return len(self._tree)

    def memory_bytes(self) -> int:
        return self._tree.memory_bytes() + self._masks.nbytes

    def worker(self, name: str, pool: bool = False) -> int:
        w = super().worker(name, pool)
        if pool:
            self._pool_mask[w >> 6] |= np.uint64(1 << (w & 63))
        return w

    def _add_keys(self, keys, w, tier):
        need = self._next + len(keys)
        if need > len(self._masks):
            size = len(self._masks)
            while size < need:
                size *= 2
            grown = np.zeros((size,) + self._masks.shape[1:], np.uint64)
            grown[:len(self._masks)] = self._masks
            self._masks = grown
        self._next = mask_add(self._tree, keys, self._masks, tier, w, self._free, self._next)

    def _remove_keys(self, keys, w, tier):
        mask_remove(self._tree, keys, self._masks, tier, w, self._free)

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        """Per-worker overlap of ``hashes`` under ``scope`` (None: identity-blind, every
        scope's blocks as if one): one native call looks the blocks up and walks the masks
        (``kvindex.match_levels``); ``lookups`` counts the keys it asked the tree for."""
        nw = len(self._worker_names)
        all_sids = list(self._scope_ids.values())
        if scope is None:
            sids = all_sids
        else:
            sid = self._scope_ids.get(scope)
            sids = [] if sid is None else [sid]
        depth = np.empty((4, nw), np.int64)
        pool_depth = match_levels(self._tree, sids, hashes, self._masks, self._pool_mask, depth)
        self.lookups += len(sids) * len(hashes)
        refused = np.zeros(nw, np.int64)
        if scope is not None and all_sids and all_sids != sids:
            local = np.empty((1, nw), np.int64)
            match_levels(self._tree, all_sids, hashes, self._masks, self._pool_mask, local, True)
            self.lookups += len(all_sids) * len(hashes)
            refused = np.maximum(local[0] - depth[2], 0)
        step = np.diff(depth, axis=0)
        return Match(self.workers, depth[0], step[0], step[1], step[2], refused, pool_depth)
