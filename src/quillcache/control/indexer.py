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
per-slot bitmask of workers for each tier in a numpy array; a lookup is one batched
``get_many`` and a few vector operations.  ``DictIndexer`` is the simple reference (a dict of
sets) that the tests use as an oracle and the benchmark as a baseline.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from quillcache._native.art import AdaptiveRadixTree
from quillcache.control.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from quillcache.model import IdentityScope

__all__ = [
    "DEVICE", "HOST", "DISK", "POOL", "TIER_NAMES", "tier_of_medium", "chain_hashes",
    "Match", "ArtIndexer", "DictIndexer", "IndexerLimits",
]

DEVICE, HOST, DISK, POOL = 0, 1, 2, 3
TIER_NAMES = ("device", "host", "disk", "pool")
_N_TIERS = 4

_MEDIUM_TIER = {
    None: DEVICE, "": DEVICE, "gpu": DEVICE, "cuda": DEVICE, "device": DEVICE, "hbm": DEVICE,
    "cpu": HOST, "host": HOST, "dram": HOST, "cpu_dram": HOST,
    "disk": DISK, "ssd": DISK, "local_ssd": DISK, "nvme": DISK,
}

_ROOT = 0x51C0FFEE          # chain seed of a block with no parent
_KEY = struct.Struct(">Iq")  # scope id, hash
_MASK64 = (1 << 64) - 1


def tier_of_medium(medium: Optional[str]) -> int:
    """The tier of an event's ``medium`` (vLLM: GPU by default, CPU for offloaded blocks)."""
    tier = _MEDIUM_TIER.get(medium.lower() if medium else medium)
    return DISK if tier is None else tier        # an unknown medium is treated as the slowest


def chain_hashes(tokens: Sequence[int], block_size: int, parent: Optional[int] = None) -> list[int]:
    """The router's hash of each full block of ``tokens``: each one covers its block's tokens
    and its parent's hash, so equal hashes mean equal prefixes.  Deterministic across
    processes (hashes of int tuples are not randomised)."""
    if block_size <= 0:
        raise ValueError(f"block_size {block_size}: must be positive")
    toks = tuple(tokens)
    h = _ROOT if parent is None else parent
    out = []
    for start in range(0, len(toks) - block_size + 1, block_size):
        h = hash((h, toks[start:start + block_size]))
        out.append(h)
    return out


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
        # per worker: engine hash -> (scope id, router hash, tier bitmask held)
        self._engine: list[dict[BlockHash, list]] = []
        self._alias: dict[tuple[int, BlockHash], int] = {}
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
            self._engine.append({})
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
        emap = self._engine[w]
        hashes = event.block_hashes
        if event.token_ids and event.block_size > 0:
            parent = None
            if event.parent_block_hash is not None:
                rec = emap.get(event.parent_block_hash)
                if rec is None:
                    self.orphans += 1
                    parent = hash(("orphan", event.parent_block_hash))
                else:
                    parent = rec[1]
            local = chain_hashes(event.token_ids, event.block_size, parent)
            if len(local) != len(hashes):
                self.bad_events += 1
                n = min(len(local), len(hashes))
                local, hashes = local[:n], hashes[:n]
            alias = self._alias
            if len(alias) < self.limits.max_aliases:
                for eh, lh in zip(hashes, local):
                    alias[(sid, eh)] = lh
        else:
            # No tokens (pool residency, or an engine that leaves them out): translate the
            # engine's hashes through what the engines' events taught us.
            local = [self._alias.get((sid, eh)) or hash(("engine", eh)) for eh in hashes]
        bit = 1 << tier
        for eh, lh in zip(hashes, local):
            rec = emap.get(eh)
            if rec is None:
                emap[eh] = [sid, lh, bit]
            else:
                rec[0], rec[1] = sid, lh
                rec[2] |= bit
        self._add(sid, local, w, tier)
        return len(local)

    def removed(self, w: int, hashes: Iterable[BlockHash], tier: int) -> int:
        emap = self._engine[w]
        bit = 1 << tier
        by_scope: dict[int, list[int]] = {}
        for eh in hashes:
            rec = emap.get(eh)
            if rec is None or not rec[2] & bit:
                continue
            rec[2] &= ~bit
            if not rec[2]:
                del emap[eh]
            by_scope.setdefault(rec[0], []).append(rec[1])
        n = 0
        for sid, local in by_scope.items():
            self._remove(sid, local, w, tier)
            n += len(local)
        return n

    def clear_worker(self, worker: str) -> int:
        w = self._worker_ids.get(worker)
        if w is None:
            return 0
        emap = self._engine[w]
        n = 0
        for tier in range(_N_TIERS):
            n += self.removed(w, [eh for eh, rec in emap.items() if rec[2] & (1 << tier)], tier)
        emap.clear()
        return n

    # ---- direct use (tests, the approximate mode): router hashes, no engine hashes
    def add_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int], tier: int) -> None:
        w = self.worker(worker, tier == POOL)
        self._add(self.scope_id(scope), list(hashes), w, tier)

    def remove_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int], tier: int) -> None:
        w = self._worker_ids.get(worker)
        sid = self._scope_ids.get(scope)
        if w is not None and sid is not None:
            self._remove(sid, list(hashes), w, tier)

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        raise NotImplementedError

    def _add(self, sid: int, local: list[int], w: int, tier: int) -> None:
        raise NotImplementedError

    def _remove(self, sid: int, local: list[int], w: int, tier: int) -> None:
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
        self._blocks: dict[tuple[int, int], dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def _add(self, sid, local, w, tier):
        bit = 1 << tier
        for h in local:
            holders = self._blocks.setdefault((sid, h), {})
            holders[w] = holders.get(w, 0) | bit

    def _remove(self, sid, local, w, tier):
        bit = 1 << tier
        for h in local:
            holders = self._blocks.get((sid, h))
            if holders is None or w not in holders:
                continue
            holders[w] &= ~bit
            if not holders[w]:
                del holders[w]
            if not holders:
                del self._blocks[(sid, h)]

    def _held(self, sids: Sequence[int], h: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for sid in sids:
            for w, bits in self._blocks.get((sid, h), {}).items():
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

    def __len__(self) -> int:
        return len(self._tree)

    def memory_bytes(self) -> int:
        return self._tree.memory_bytes() + self._masks.nbytes

    def worker(self, name: str, pool: bool = False) -> int:
        w = super().worker(name, pool)
        if pool:
            self._pool_mask[w >> 6] |= np.uint64(1 << (w & 63))
        return w

    def _slots_for(self, keys: list[bytes]) -> np.ndarray:
        got = self._tree.get_many(keys, -1)
        missing = [i for i, v in enumerate(got) if v == -1]
        if missing:
            first: dict[bytes, int] = {}
            for i in missing:
                first.setdefault(keys[i], i)
            if len(first) < len(missing):          # a hash twice in one event
                for i in missing:
                    if first[keys[i]] != i:
                        got[i] = -2 - first[keys[i]]
                missing = list(first.values())
            new = []
            for _ in missing:
                if self._free:
                    new.append(self._free.pop())
                else:
                    if self._next == len(self._masks):
                        grown = np.zeros((len(self._masks) * 2,) + self._masks.shape[1:], np.uint64)
                        grown[:len(self._masks)] = self._masks
                        self._masks = grown
                    new.append(self._next)
                    self._next += 1
            self._tree.insert_many([keys[i] for i in missing], new)
            for i, s in zip(missing, new):
                got[i] = s
            for i, v in enumerate(got):
                if v <= -2:
                    got[i] = got[-2 - v]
        return np.fromiter(got, dtype=np.int64, count=len(got))

    def _add(self, sid, local, w, tier):
        if not local:
            return
        pack = _KEY.pack
        keys = [pack(sid, h) for h in local]
        slots = self._slots_for(keys)
        self._masks[slots, tier, w >> 6] |= np.uint64(1 << (w & 63))

    def _remove(self, sid, local, w, tier):
        pack = _KEY.pack
        keys = [pack(sid, h) for h in local]
        got = self._tree.get_many(keys, -1)
        idx = [i for i, v in enumerate(got) if v != -1]
        if not idx:
            return
        slots = np.array([got[i] for i in idx], dtype=np.int64)
        self._masks[slots, tier, w >> 6] &= np.uint64(_MASK64 ^ (1 << (w & 63)))
        empty = ~self._masks[slots].reshape(len(slots), -1).any(axis=1)
        for j in np.flatnonzero(empty):
            self._tree.delete(keys[idx[j]])
            self._free.append(int(slots[j]))

    def _rows(self, sids: Sequence[int], hashes: Sequence[int]) -> np.ndarray:
        """Masks of the blocks of ``hashes`` under the scopes ``sids`` (OR-ed), cut at the
        first block that no worker of any tier holds: shape (depth, tiers, words)."""
        pack = _KEY.pack
        acc = None
        for sid in sids:
            got = self._tree.get_many([pack(sid, h) for h in hashes], -1)
            if len(sids) == 1:
                try:
                    n = got.index(-1)
                except ValueError:
                    n = len(got)
                return self._masks[np.fromiter(got[:n], dtype=np.int64, count=n)]
            idx = np.fromiter(got, dtype=np.int64, count=len(got))
            rows = self._masks[np.maximum(idx, 0)]
            rows[idx < 0] = 0
            acc = rows if acc is None else acc | rows
        if acc is None:
            return np.zeros((0, _N_TIERS, self._words), np.uint64)
        held = acc.reshape(len(acc), _N_TIERS * self._words).any(axis=1)   # -1 fails on 0 rows
        n = len(held) if held.all() else int(np.argmin(held))
        return acc[:n]

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        """Per-worker overlap of ``hashes`` under ``scope`` (None: identity-blind, every
        scope's blocks as if one)."""
        nw = len(self._worker_names)
        all_sids = list(self._scope_ids.values())
        if scope is None:
            sids = all_sids
        else:
            sid = self._scope_ids.get(scope)
            sids = [] if sid is None else [sid]
        m = self._rows(sids, hashes)
        dev = m[:, DEVICE]
        host = dev | m[:, HOST]
        disk = host | m[:, DISK]
        pool_any = (m[:, POOL] & self._pool_mask).any(axis=1)
        pool = disk | np.where(pool_any, np.uint64(_MASK64), np.uint64(0))[:, None]
        depth = _prefix_depth(np.stack([dev, host, disk, pool]), nw)
        pool_depth = len(pool_any) if pool_any.all() else int(np.argmin(pool_any))
        refused = np.zeros(nw, np.int64)
        if scope is not None and all_sids and all_sids != sids:
            r = self._rows(all_sids, hashes)
            local = (r[:, DEVICE] | r[:, HOST] | r[:, DISK]) & ~self._pool_mask
            refused = np.maximum(_prefix_depth(local[None], nw)[0] - depth[2], 0)
        return Match(self.workers, depth[0], depth[1] - depth[0], depth[2] - depth[1],
                     depth[3] - depth[2], refused, pool_depth)


def _prefix_depth(levels: np.ndarray, n_workers: int) -> np.ndarray:
    """levels: (L, depth, words) uint64 bit rows -> (L, n_workers) contiguous-prefix depths."""
    if levels.shape[1] == 0 or n_workers == 0:
        return np.zeros((levels.shape[0], n_workers), np.int64)
    run = np.bitwise_and.accumulate(levels, axis=1)
    bits = np.unpackbits(run.view(np.uint8), axis=-1, bitorder="little")  # (L, depth, words*64)
    return bits[:, :, :n_workers].sum(axis=1, dtype=np.int64)
