"""Reading from the pool: what a node does when a GET, GET_MANY or located GET misses locally.

``PoolReads`` is mixed into ``ClusterHook`` (it uses the hook's view, ring, records,
transport and counters).  One read is:

1. **locate**: the holders of each key, from the location cache (holders a home named
   before, reused while they stay in the view with the same epoch) or from the key's
   home, one LOCATE per home for the whole batch;
2. **fetch**: one FETCH per holder for the keys it holds, each hop with the
   ``hop_timeout`` deadline; the holder's epoch, and each block's size and CRC32C against
   the record (the CRC its writer computed when it stored the bytes, which the home keeps
   and LOCATE returns: a holder, or anything between, cannot substitute bytes unnoticed)
   are checked before a byte is used or kept;
3. a holder that is gone, stale or answers wrongly is skipped for the next (up to
   ``MAX_HOLDER_TRIES``); if every holder learnt from the cache failed, the home is asked
   once more (a stale hint costs one hop, then a proper locate); none left is a miss.

The holder checks the requesting tenant and applies its identity guard exactly as a
local GET would.  A located GET (the shared-memory path) needs the bytes in this node's
arena: they are stored as an ordinary block, whatever ``cache_remote`` says (see
``serve_located``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Optional, Sequence

from quillcache._native.crc import crc32c
from quillcache.protocol import cluster as wire, messages
from quillcache.cluster.hrw import key_hash
from quillcache.cluster.records import Holder
from quillcache.errors import NotFound, QuillCacheError
from quillcache.model import KvBlockKey, encode_key
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode
from quillcache.transfer.base import Peer

log = logging.getLogger("quillcache.cluster")

__all__ = ["PoolReads", "MAX_HOLDER_TRIES", "LOCATION_CACHE"]

MAX_HOLDER_TRIES = 3        # holders tried per key before a miss
LOCATION_CACHE = 65536      # keys whose holders a node remembers from its last LOCATE (LRU)


class PoolReads:
    """The read side of ``ClusterHook`` (a mixin: ``_reads_init`` from its ``__init__``)."""

    def _reads_init(self) -> None:
        # Holders learnt from homes, reused without a LOCATE while they stay in the view
        # with the same epoch; a holder that no longer has the block costs one FETCH,
        # then the home is asked again.
        self._loc: OrderedDict[bytes, list[Holder]] = OrderedDict()

    def _live(self, holders: list[Holder]) -> list[Holder]:
        view = self.view
        return [h for h in holders if h.node_id != self.node_id
                and (m := view.get(h.node_id)) is not None and m.epoch == h.epoch]

    # ------------------------------------------------------------------ locate

    async def _locate(self, ekeys: Sequence[bytes], use_cache: bool = False) -> list[list[Holder]]:
        """Holders of each key, from its home (one LOCATE per home), live ones only."""
        out: list[list[Holder]] = [[] for _ in ekeys]
        todo: Sequence[int] = range(len(ekeys))
        loc = self._loc
        if use_cache:
            todo = []
            for i, ekey in enumerate(ekeys):
                cached = loc.get(ekey)
                live = self._live(cached) if cached else None
                if live:
                    loc.move_to_end(ekey)
                    out[i] = live
                    self.counters["location_cache_hits"] += 1
                else:
                    todo.append(i)
            if not todo:
                return out
        homes = self.ring.homes([key_hash(ekeys[i]) for i in todo])
        by_home: dict[str, list[int]] = {}
        for i, home in zip(todo, homes):
            by_home.setdefault(home, []).append(i)
        deadline = time.monotonic() + self.hop_timeout

        async def ask(home: str, idx: list[int]) -> None:
            if home == self.node_id:
                for i in idx:
                    out[i] = self.records.holders_encoded(ekeys[i])
                return
            peer = self.peer(home)
            if peer is None:
                return
            self.counters["locates_sent"] += 1
            try:
                body = await self.transport.request(peer, Opcode.LOCATE,
                                                    wire.encode_locate([ekeys[i] for i in idx], self.limits),
                                                    deadline)
                per_key = wire.decode_locate_reply(body, self.limits)
            except QuillCacheError:
                self.counters["locate_failures"] += 1
                return
            if len(per_key) != len(idx):
                self.counters["locate_failures"] += 1
                return
            for i, holders in zip(idx, per_key):
                out[i] = holders

        await _all(ask(h, idx) for h, idx in by_home.items())
        for i in todo:
            out[i] = live = self._live(out[i])
            if live:
                loc[ekeys[i]] = live
                loc.move_to_end(ekeys[i])
            else:
                loc.pop(ekeys[i], None)
        while len(loc) > LOCATION_CACHE:
            loc.popitem(last=False)
        return out

    # ------------------------------------------------------------------ fetch

    async def fetch_many(self, tenant: str, keys: Sequence[KvBlockKey], ekeys: Optional[Sequence[bytes]] = None,
                         *, keep: Optional[bool] = None, skip: Optional[Holder] = None) -> list[Optional[memoryview]]:
        """The bytes of each key from another node, or None (a miss).  ``ekeys``: the
        encoded keys when the caller has them.  ``keep`` (default ``cache_remote``): store
        a copy of what was found, in the background.  ``skip``: a holder whose FETCH just
        failed for these keys (not asked again)."""
        if ekeys is None:
            ekeys = [encode_key(k) for k in keys]
        result: list[Optional[memoryview]] = [None] * len(keys)
        candidates = await self._locate(ekeys, use_cache=True)
        if skip is not None:
            candidates = [[h for h in hs if h != skip] for hs in candidates]
        await self._fetch_rounds(tenant, ekeys, candidates, result)
        stale = [i for i, b in enumerate(result) if b is None and candidates[i]]
        if stale:                       # holders remembered or named by the home failed: ask again
            for i in stale:
                self._loc.pop(ekeys[i], None)
            again = await self._locate([ekeys[i] for i in stale])
            fresh: list[list[Holder]] = [[] for _ in keys]
            for i, hs in zip(stale, again):
                fresh[i] = [h for h in hs if h not in candidates[i][:MAX_HOLDER_TRIES] and h != skip]
            await self._fetch_rounds(tenant, ekeys, fresh, result)
        hits = sum(b is not None for b in result)
        self.counters["remote_hits"] += hits
        self.counters["remote_misses"] += len(keys) - hits
        if (self.cache_remote if keep is None else keep) and hits:
            self.background(self._keep_copies([(k, b) for k, b in zip(keys, result) if b is not None]))
        return result

    async def _fetch_rounds(self, tenant: str, ekeys: Sequence[bytes], candidates: list[list[Holder]],
                            result: list[Optional[memoryview]]) -> None:
        for attempt in range(MAX_HOLDER_TRIES):
            by_holder: dict[tuple[str, int], list[int]] = {}     # (node, epoch): one FETCH each
            for i, hs in enumerate(candidates):
                if result[i] is None and attempt < len(hs):
                    by_holder.setdefault(hs[attempt][:2], []).append(i)
            if not by_holder:
                break
            deadline = time.monotonic() + self.hop_timeout
            await _all(self._fetch_from([candidates[i][attempt] for i in idx], idx, tenant, ekeys, result, deadline)
                       for idx in by_holder.values())

    async def _fetch_from(self, records: Sequence[Holder], idx: Sequence[int], tenant: str,
                          ekeys: Sequence[bytes], result: list[Optional[memoryview]], deadline: float) -> None:
        """One FETCH of ``ekeys[i]`` for i in ``idx`` from one holder, whose record of
        ``ekeys[idx[j]]`` is ``records[j]`` (one node and epoch); what it returns that is the
        copy recorded (the holder's epoch, the recorded size and CRC32C) lands in ``result[i]``."""
        holder = records[0]
        m = self.view.get(holder.node_id)
        if m is None:
            return
        counters = self.counters
        counters["fetches_sent"] += 1
        try:
            res = await self.transport.fetch(Peer(holder.node_id, m.address, holder.epoch), tenant,
                                             [ekeys[i] for i in idx], deadline)
        except QuillCacheError:
            counters["fetch_failures"] += 1
            return
        if res.epoch != holder.epoch:
            counters["stale_hops"] += len(idx)              # it restarted: not the copy recorded
            return
        for i, rec, block in zip(idx, records, res.blocks):
            if block is None:
                counters["stale_hops"] += 1
            elif block.nbytes != rec.size:
                counters["fetch_failures"] += 1             # not the block recorded: skip it
            elif crc32c(block) != rec.crc:
                n = counters["crc_mismatches"] = counters["crc_mismatches"] + 1    # not its writer's bytes
                if n & (n - 1) == 0:                         # the 1st, 2nd, 4th, ...: no log flood
                    log.warning("cluster: %s served a block whose CRC32C is not the one recorded: "
                                "dropped (%d so far)", holder.node_id, n)
            else:
                result[i] = block

    async def _keep_copies(self, items) -> None:
        for key, block in items:
            if self.store.exists(key):
                continue
            try:
                await self.store.put(key, block)
                self.counters["cached_remote"] += 1
            except QuillCacheError:
                pass                    # no room: it stays remote

    def background(self, coro) -> None:
        """Run ``coro`` as a task of this hook's (kept until it ends; not awaited by the caller)."""
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ serving a local miss

    async def serve_get(self, conn, rid: int, key: KvBlockKey, flags: int, miss: QuillCacheError,
                        ekey: Optional[bytes] = None) -> None:
        """GET that missed locally; ``ekey``: the key as the request encoded it.

        The common case, a key read before from a holder still in the view, is one FETCH
        to that holder straight from here (``fetch_many`` would take the same step through
        its batching); anything else, or that FETCH failing, takes ``fetch_many``."""
        tenant = conn.tenant or ""
        try:
            if ekey is None:
                ekey = encode_key(key)
            block = None
            failed = None
            cached = self._loc.get(ekey)
            if cached:
                h = cached[0]
                m = self.view.get(h.node_id)
                if m is not None and m.epoch == h.epoch and h.node_id != self.node_id:
                    self._loc.move_to_end(ekey)
                    self.counters["location_cache_hits"] += 1
                    got: list[Optional[memoryview]] = [None]
                    await self._fetch_from((h,), (0,), tenant, (ekey,), got, time.monotonic() + self.hop_timeout)
                    block = got[0]
                    if block is None:
                        self._loc.pop(ekey, None)           # stale: the home is asked below
                        failed = h
                    else:
                        self.counters["remote_hits"] += 1
                        if self.cache_remote:
                            self.background(self._keep_copies([(key, block)]))
            if block is None:
                block = (await self.fetch_many(tenant, (key,), (ekey,), skip=failed))[0]
        except Exception:               # never a hang or a wrong byte: a miss
            log.exception("cross-node fetch failed")
            block = None
        if block is None:
            conn.finish_error(rid, Opcode.GET, miss)
        else:
            conn.finish_get(rid, block, flags)

    async def serve_get_many(self, conn, rid: int, keys: Sequence[KvBlockKey], views: list, items: list,
                             held: list, flags: int, encode_reply, ekeys: Optional[Sequence[bytes]] = None) -> None:
        """GET_MANY with local misses: ``views[i]``/``items[i]`` are the local results (the
        block's bytes or None, (status, size)), ``held`` the leases that keep those bytes in
        place (released once the reply is written, or on an error); the NotFound ones are
        fetched.  ``ekeys``: the keys as the request encoded them, where the caller has them
        (not encoded again)."""
        try:
            missing = [i for i, (status, _) in enumerate(items) if status == NotFound.status]
            blocks = await self.fetch_many(conn.tenant or "", [keys[i] for i in missing],
                                           None if ekeys is None else [ekeys[i] for i in missing])
            views = list(views)
            for i, block in zip(missing, blocks):
                if block is not None:
                    items[i] = (0, block.nbytes)
                    views[i] = block
            fit, _ = messages.get_many_reply_fit(items, conn.limits.max_payload_bytes)   # the client asks again
            items, views = items[:fit], views[:fit]
            body = encode_reply(items)
            conn.finish(rid, Opcode.GET_MANY, body, [v for v in views if v is not None],
                        crc=bool(flags & FLAG_PAYLOAD_CRC), leases=held)
        except Exception as exc:
            for lease in held:
                lease.release()
            conn.finish_error(rid, Opcode.GET_MANY, exc)

    async def serve_located(self, tenant: str, keys: Sequence[KvBlockKey]) -> list:
        """A located GET's local misses: each key's bytes from another node, stored in this
        node's arena, and a located lease on them (``store.located_nowait``); None where the
        pool has no copy, or no room could be made within ``hop_timeout`` (a miss).

        The copy is an ordinary block of this store, kept after the lease whatever
        ``cache_remote`` says: a located view must point into the arena, so the bytes take
        a slot there anyway; publishing them puts that slot under the one set of rules the
        client's lease already relies on (lease expiry, eviction, withdrawal), instead of a
        second kind of private slot whose lifetime would have to follow the lease; and the
        engine that maps this arena asks this node again for the same prefix, which is
        then a local hit.  It is announced like any block; LRU eviction removes it."""
        out: list = [None] * len(keys)
        try:
            blocks = await self.fetch_many(tenant, keys, keep=False)
        except Exception:
            log.exception("cross-node fetch for a located GET failed")
            return out
        store = self.store
        for i, (key, block) in enumerate(zip(keys, blocks)):
            if block is None:
                continue
            try:
                async with asyncio.timeout(self.hop_timeout):
                    await store.put(key, block)
                out[i] = store.located_nowait(key)      # no await since the put: it is in DRAM
            except (QuillCacheError, TimeoutError) as exc:
                log.debug("located GET: a fetched block was not stored (%s): a miss", exc)
            if out[i] is None:
                self.counters["located_not_stored"] += 1
            else:
                self.counters["located_remote"] += 1
        return out


async def _all(coros) -> None:
    """Run the coroutines concurrently; one alone runs in this task (no Task, no loop turn)."""
    coros = list(coros)
    if len(coros) == 1:
        await coros[0]
    elif coros:
        await asyncio.gather(*coros)
