"""``GrantTable``: the holder's side of the NIXL transport (docs/nixl.md).

A peer that reads blocks of this node with NIXL first asks for a grant (GRANT, on the member
link): the same checks as FETCH (the requesting tenant, as the holder's own server would decide;
the store's identity guard), then, for each block found in the DRAM arena, a store lease that
holds its slot in place (the slot is neither evicted nor reused while held), and the block's
offset, size and CRC32C.  The peer then reads the bytes one-sided from this node's registered
arena: this process never copies or sends them.

A grant ends when the peer releases it (GRANT_RELEASE) or when its ttl ends, whichever is first;
only then are its store leases released and the slots free to move.  A reader whose READ was not
complete by the ttl it was told (counted from before it sent GRANT) treats the blocks as misses.

The CRC sent is the one the node keeps of each block it holds (``hook.crcs``: computed once when
the block is announced, dropped when its bytes change), so a grant reads no byte of the block;
only a block whose CRC is not kept yet is summed here, in C (``grant_crcs_computed``).  It is
this holder's word only: the reader checks every block against the CRC32C its writer recorded
(LOCATE's, cluster/reads.py), as it does for bytes that came by FETCH, so a slot that changed
under a READ (a peer that reads late reads whatever is there) is a miss there.

A reader may read a grant's blocks again, without asking, until its reuse ends (``[cluster]
grant_reuse``, at most half the ttl) and releases it then: a block read often costs this node
one GRANT per reuse window, not one per read, and stays in place that long.

Limits: at most ``MAX_GRANTED_BLOCKS`` blocks held by grants at once (past it: Busy, which the
reader turns into a FETCH), and a ttl of at most the store's lease (a store lease is reaped at
its end).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable, Optional

from quillcache._native.crc import crc32c
from quillcache.errors import Busy, NotFound, PermissionDenied, UnsafeReuse
from quillcache.protocol import grants as wire
from quillcache.protocol.opcodes import Opcode, ProtocolLimits
from quillcache.store.leases import release_leases as _release

log = logging.getLogger("quillcache.cluster")

__all__ = ["GrantTable", "MAX_GRANTED_BLOCKS", "GRANT_OPCODES", "serve", "use_transport"]

MAX_GRANTED_BLOCKS = 65536      # blocks held by grants at once, over every peer
GRANT_OPCODES = frozenset({Opcode.NIXL_META, Opcode.GRANT, Opcode.GRANT_RELEASE})
_MISS = (NotFound, UnsafeReuse, Busy)
_LATER = object()               # a block on SSD only: read (and promoted) off the loop first


class GrantTable:
    """Grants of one node: id -> the store leases it holds, ended by release or ttl."""

    def __init__(self, *, store, endpoint, limits: ProtocolLimits, ttl_s: float,
                 epoch: Callable[[], int], may_read: Callable,
                 kept_crc: Callable[[bytes], Optional[int]] = lambda ekey: None) -> None:
        self.store = store
        self.endpoint = endpoint            # NixlEndpoint (its metadata, where the arena is registered)
        self.limits = limits
        self.ttl_s = min(float(ttl_s), float(store.lease_s))   # a store lease is reaped at its end
        self._epoch = epoch
        self._may_read = may_read
        self._kept_crc = kept_crc           # the CRC32C the node keeps of a block it holds (hook.crcs)
        self._ids = itertools.count(1)
        self._grants: dict[int, tuple[list, asyncio.TimerHandle]] = {}
        self.held_blocks = 0
        self.counters = {"grants": 0, "granted_blocks": 0, "granted_bytes": 0, "grant_releases": 0,
                         "grants_expired": 0, "grant_fetch_items": 0, "grant_crcs_computed": 0,
                         "meta_served": 0}

    # ------------------------------------------------------------------ requests

    def on_request(self, conn, frame) -> None:
        op = frame.opcode
        rid = frame.request_id
        if self.endpoint is None:
            raise Busy(f"{Opcode(op).name}: this node's NIXL agent is starting")
        if op == Opcode.NIXL_META:
            self.counters["meta_served"] += 1
            ep = self.endpoint
            conn.finish(rid, op, wire.encode_meta_reply(
                wire.Meta(self._epoch(), ep.arena_address, ep.arena_bytes, ep.metadata)))
        elif op == Opcode.GRANT:
            release, tenant, ekeys = wire.decode_grant(frame.header, self.limits)
            for grant_id in release:
                self.release(grant_id)
            keys = [(conn.key_of(ekey), ekey) for ekey in ekeys]
            self._grant(conn, rid, tenant, keys)
        elif op == Opcode.GRANT_RELEASE:
            held = sum(self.release(g) for g in wire.decode_release(frame.header, self.limits))
            conn.finish(rid, op, wire.encode_release_reply(held))

    def _grant(self, conn, rid: int, tenant: str, keys: list) -> None:
        """GRANT: leases on the blocks in DRAM, in this loop turn; the first block that must be
        read from the SSD tier first sends the rest off the loop (``_grant_async``)."""
        leases: list = []
        items: list[wire.GrantItem] = []
        try:
            for i, (key, ekey) in enumerate(keys):
                lease = self._lease(tenant, key, ekey, items, len(leases))
                if lease is _LATER:
                    conn.spawn(self._grant_async(conn, rid, tenant, keys[i:], leases, items))
                    return
                if lease is not None:
                    leases.append(lease)
        except BaseException as exc:
            self._failed(conn, rid, leases, exc)
            return
        self._reply(conn, rid, leases, items)

    async def _grant_async(self, conn, rid: int, tenant: str, keys: list, leases: list, items: list) -> None:
        try:
            for key, ekey in keys:
                lease = self._lease(tenant, key, ekey, items, len(leases))
                if lease is _LATER:
                    try:
                        lease = await self.store.get_async(key)     # SSD: promoted into DRAM where there is room
                    except _MISS as exc:
                        items.append(wire.GrantItem(exc.status, 0, 0, 0))
                        continue
                    lease = self._granted(lease, ekey, items)
                if lease is not None:
                    leases.append(lease)
        except BaseException as exc:
            self._failed(conn, rid, leases, exc)
            return
        self._reply(conn, rid, leases, items)

    def _lease(self, tenant: str, key, ekey: bytes, items: list, taken: int):
        """The store lease for one key, its item appended; None (a miss, or not in the arena) or
        ``_LATER`` (on SSD only: ``get_async`` first, its item not appended yet)."""
        # Another tenant's key is a miss, the same as an absent one (as FETCH answers).
        if not self._may_read(tenant, key):
            items.append(wire.GrantItem(NotFound.status, 0, 0, 0))
            return None
        if self.held_blocks + taken >= MAX_GRANTED_BLOCKS:
            items.append(wire.GrantItem(wire.STATUS_FETCH, 0, 0, 0))
            return None
        try:
            lease = self.store.get_nowait(key)
        except _MISS as exc:
            items.append(wire.GrantItem(exc.status, 0, 0, 0))
            return None
        if lease is None:
            return _LATER
        return self._granted(lease, ekey, items)

    def _granted(self, lease, ekey: bytes, items: list):
        if lease.offset is None or lease.view is None:      # not in the arena: FETCH sends it
            lease.release()
            self.counters["grant_fetch_items"] += 1
            items.append(wire.GrantItem(wire.STATUS_FETCH, 0, 0, 0))
            return None
        # The CRC the node keeps of the block it holds (its writer's, recorded when it was put,
        # dropped when the bytes change; in this loop turn it is the leased block's), else
        # computed from the arena: the bytes are not read when the node knows it already.
        crc = self._kept_crc(ekey)
        if crc is None:
            crc = crc32c(lease.view)
            self.counters["grant_crcs_computed"] += 1
        items.append(wire.GrantItem(0, lease.offset, lease.size, crc))
        return lease

    def _failed(self, conn, rid: int, leases: list, exc: BaseException) -> None:
        _release(leases)
        if not isinstance(exc, Exception):
            raise exc
        conn.finish_error(rid, Opcode.GRANT, exc)

    def _reply(self, conn, rid: int, leases: list, items: list) -> None:
        try:
            if not conn.is_in_flight(rid):
                _release(leases)
                return
            grant_id = next(self._ids) if leases else 0
            body = wire.encode_grant_reply(wire.Grant(self._epoch(), grant_id, int(self.ttl_s * 1e6), items),
                                           self.limits)
        except BaseException as exc:
            self._failed(conn, rid, leases, exc)
            return
        if leases:
            # Held from now until released or the ttl ends: the reader counts its ttl from
            # before it sent GRANT, so it never reads past the moment this releases them.
            timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, grant_id)
            self._grants[grant_id] = (leases, timer)
            self.held_blocks += len(leases)
            self.counters["grants"] += 1
            self.counters["granted_blocks"] += len(leases)
            self.counters["granted_bytes"] += sum(lease.size for lease in leases)
        conn.finish(rid, Opcode.GRANT, body)

    def _expire(self, grant_id: int) -> None:
        if self._end(grant_id):
            self.counters["grants_expired"] += 1

    def release(self, grant_id: int) -> bool:
        """End a grant the reader is done with; False when it ended already (released or expired)."""
        ended = self._end(grant_id)
        if ended:
            self.counters["grant_releases"] += 1
        return ended

    def _end(self, grant_id: int) -> bool:
        got = self._grants.pop(grant_id, None)
        if got is None:
            return False
        leases, timer = got
        timer.cancel()
        self.held_blocks -= len(leases)
        _release(leases)
        return True

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        for grant_id in list(self._grants):
            self._end(grant_id)

    def stats(self) -> dict:
        return {**self.counters, "grants_held": len(self._grants), "grant_held_blocks": self.held_blocks,
                "grant_ttl_ms": round(self.ttl_s * 1000, 3)}


def serve(table: Optional[GrantTable], conn, frame) -> None:
    """NIXL_META, GRANT or GRANT_RELEASE from a member connection (the hook refused them to any
    other): ``table``'s, or refused where this node does not use NIXL (the reader then uses FETCH)."""
    if table is None:
        raise PermissionDenied(f"{Opcode(frame.opcode).name}: this node does not use NIXL ([cluster] transport)")
    table.on_request(conn, frame)


def use_transport(hook, store) -> Optional[GrantTable]:
    """Give ``hook`` the transport its ``[cluster] transport`` asks for: with NIXL, the reader's
    ``NixlTransport`` over the hook's TCP links, and the holder's ``GrantTable`` on the same
    endpoint (its arena: a second mapping of the store's memfd, the same pages).  Returns the
    table, or None when blocks go over TCP.

    ``nixl`` makes the agent before the node serves, and raises ``ConfigError`` (exit 78) if it
    cannot; ``auto`` makes it in the background (about a second): the node joins the pool at once
    on TCP, its grant table answers Busy until the agent is there, then reads move to NIXL."""
    import asyncio
    import mmap

    import numpy as np

    from quillcache.transfer.nixl_transport import NixlTransport, make_endpoint

    s = hook.settings
    if s.transport == "tcp":
        return None
    arena = np.frombuffer(mmap.mmap(store.arena_fd, store.arena_bytes, flags=mmap.MAP_SHARED), dtype=np.uint8)
    table = GrantTable(store=store, endpoint=None, limits=hook.limits, ttl_s=s.grant_ttl,
                       epoch=lambda: hook.epoch,
                       may_read=hook.may_read,    # FETCH's own tenant rule, one place for it
                       kept_crc=hook.crcs.get)

    def made(endpoint) -> Optional[GrantTable]:
        if endpoint is None:
            return None
        table.endpoint = endpoint
        hook.transport = NixlTransport(hook.transport, endpoint, reuse_s=s.grant_reuse)
        return table

    def make():
        return make_endpoint(s.transport, arena=arena, node_id=hook.node_id, staging_bytes=s.nixl_staging)

    if s.transport == "nixl":
        return made(make())

    async def settle() -> None:
        endpoint = await asyncio.get_running_loop().run_in_executor(None, make)
        if made(endpoint) is None:
            hook.grants = None          # holders' GRANT/NIXL_META now refused: peers read it over TCP

    hook.background(settle())
    return table
