"""``NixlTransport``: the reader's side of bytes on NIXL (docs/nixl.md).

Control messages (ANNOUNCE, WITHDRAW, LOCATE, GRANT, ...) stay on the TCP member link
(``TcpTransport``); ``fetch`` becomes:

1. GRANT to the holder (tenant, keys): per key, the block's offset in the holder's arena, its
   size and CRC32C, held in place for the grant's ttl;
2. one NIXL READ for the batch, holder arena -> this node's registered staging area
   (``NixlEndpoint``), on the endpoint's progress thread (the loop only awaits);
3. each block copied out of staging and checked against the CRC the holder sent with the grant
   (a READ that raced a slot moving there: ``nixl_crc_mismatches``); the grant is released by
   the next GRANT to that holder, or by GRANT_RELEASE after ``RELEASE_DELAY_S`` (and ends at
   its ttl anyway).

That check is the holder's word only: like every transport (transfer/base.py), this one hands
the blocks to the reader (cluster/reads.py), which checks each against the CRC32C its writer
recorded (ANNOUNCE, kept by the home, returned by LOCATE): a holder that puts other bytes in
its arena, and grants them with their own CRC, is a miss there (``crc_mismatches``).

The holder's agent is learnt over the member link (NIXL_META: its metadata, where its arena is
registered) the first time a (node, epoch) is read, and forgotten when it leaves the view or
changes epoch.  A holder that has no NIXL (META refused) is read over FETCH from then on, for that
epoch; so are the blocks it holds outside its arena (``STATUS_FETCH``).  A READ that fails (the
agent errs, staging is full) is sent again as one FETCH of the same keys (``nixl_fallbacks``).
A READ not done by the grant's ttl, counted from before GRANT was sent, is a miss: the holder may
have let the slot go.  No byte that failed the grant's CRC is ever returned.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Sequence

import numpy as np

from quillcache._native.crc import crc32c
from quillcache.errors import Busy, ConfigError, ConnectionLost, InvalidArgument, QuillCacheError, Timeout
from quillcache.protocol import grants as wire
from quillcache.protocol.opcodes import Opcode
from quillcache.transfer.base import FetchResult, Peer
from quillcache.transfer.nixl import TransferFailed, nixl_missing, ucx_tls
from quillcache.transfer.tcp import TcpTransport

log = logging.getLogger("quillcache.cluster")

__all__ = ["NixlTransport", "make_endpoint", "TRANSPORT_CHOICES", "TTL_MARGIN_S"]

TRANSPORT_CHOICES = ("auto", "tcp", "nixl")
TTL_MARGIN_S = 0.002        # seconds: a READ must be done this long before its grant's ttl ends
META_TIMEOUT_S = 5.0        # seconds: NIXL_META and GRANT_RELEASE, sent off any read's path
RELEASE_DELAY_S = 0.005     # seconds a read grant waits to ride on the next GRANT before GRANT_RELEASE


class NixlTransport:
    """``Transport`` whose fetch reads the holder's arena with NIXL; everything else is ``tcp``'s."""

    name = "nixl"

    def __init__(self, tcp: TcpTransport, endpoint) -> None:
        self.tcp = tcp
        self.endpoint = endpoint
        self.limits = tcp.limits
        self._tcp_only: set[Peer] = set()                   # holders (of an epoch) without NIXL
        self._adding: set[Peer] = set()                     # agents being learnt
        self._releases: dict[Peer, list[int]] = {}          # grants read, not yet released
        self._bg: set[asyncio.Task] = set()
        self.counters = {"nixl_reads": 0, "nixl_bytes": 0, "nixl_fallbacks": 0, "nixl_late": 0,
                         "nixl_crc_mismatches": 0, "nixl_meta_fetched": 0, "nixl_release_failures": 0,
                         "nixl_tcp_fetches": 0}

    # ------------------------------------------------------------------ Transport

    async def request(self, peer: Peer, opcode: int, body: bytes, deadline: float) -> bytes:
        return await self.tcp.request(peer, opcode, body, deadline)

    def forget(self, peer_node_id: str) -> None:
        self.tcp.forget(peer_node_id)
        self.endpoint.forget(peer_node_id)
        self._tcp_only = {p for p in self._tcp_only if p.node_id != peer_node_id}

    async def close(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await self.tcp.close()
        self.endpoint.close()           # after the grants (the holder side) were ended

    def peer_transport(self, peer: Peer) -> str:
        if peer in self._tcp_only:
            return "tcp"
        return "nixl" if self.endpoint.knows(peer.node_id, peer.epoch) else "unknown"

    def stats(self) -> dict:
        ep = self.endpoint.stats()
        return {**self.tcp.stats(), "transport": self.name, "ucx_tls": ucx_tls(), **self.counters,
                "nixl_peers": ep["peers"], "nixl_tcp_peers": len(self._tcp_only),
                "nixl_staging_used": ep["staging_used"], "nixl_staging_full": ep["staging_full"],
                "nixl_read_errors": ep["read_errors"], "nixl_read_timeouts": ep["read_timeouts"],
                "nixl_reads_inline": ep["reads_inline"]}

    async def fetch(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> FetchResult:
        if peer in self._tcp_only:
            return await self._tcp_fetch(peer, tenant, keys, deadline)
        if not self.endpoint.knows(peer.node_id, peer.epoch):
            # Learn its agent in the background (NIXL_META, add, connect: up to a second under
            # UCX_TLS=tcp); this read goes over FETCH meanwhile, not past its deadline.
            if peer not in self._adding:
                self._adding.add(peer)          # before the task runs: one _know per peer
                self._spawn(self._know(peer))
            return await self._tcp_fetch(peer, tenant, keys, deadline)
        release = self._releases.pop(peer, [])      # grants read since: released by this GRANT
        sent = time.monotonic()
        body = await self.tcp.request(peer, Opcode.GRANT, wire.encode_grant(tenant, keys, self.limits, release),
                                      deadline)
        grant = wire.decode_grant_reply(body, self.limits)
        if len(grant.items) != len(keys):
            raise InvalidArgument(f"GRANT reply names {len(grant.items)} items for {len(keys)} keys")
        blocks: list[Optional[memoryview]] = [None] * len(keys)
        try:
            if grant.epoch != peer.epoch:
                return FetchResult(grant.epoch, blocks)         # another run: not the copy recorded
            granted = [i for i, it in enumerate(grant.items) if it.status == 0 and it.size > 0]
            later = [i for i, it in enumerate(grant.items) if it.status == wire.STATUS_FETCH]
            if granted:
                until = min(deadline, sent + grant.ttl_us / 1e6 - TTL_MARGIN_S)
                try:
                    await self._read(peer, grant, granted, blocks, until)
                except (TransferFailed, InvalidArgument) as exc:
                    # The agent erred or staging is full: the same keys once over FETCH.
                    log.debug("NIXL read from %s failed (%s): FETCH instead", peer.node_id, exc)
                    self.counters["nixl_fallbacks"] += 1
                    later += granted
            if later:
                later.sort()
                res = await self._tcp_fetch(peer, tenant, [keys[i] for i in later], deadline)
                if res.epoch != peer.epoch:
                    return FetchResult(res.epoch, [None] * len(keys))
                for i, block in zip(later, res.blocks):
                    blocks[i] = block
        finally:
            if grant.grant_id:
                self._release(peer, grant.grant_id)
        return FetchResult(grant.epoch, blocks)

    # ------------------------------------------------------------------ steps

    async def _know(self, peer: Peer) -> None:
        """Add ``peer``'s agent (this epoch) from NIXL_META (``peer`` is in ``_adding`` until done).
        A holder that refuses META (no NIXL there) is read over FETCH for the rest of its epoch;
        one that is busy (its agent still starting) or does not answer is asked again later."""
        try:
            body = await self.tcp.request(peer, Opcode.NIXL_META, b"", time.monotonic() + META_TIMEOUT_S)
            meta = wire.decode_meta_reply(body)
            if meta.epoch != peer.epoch:
                return                  # it restarted meanwhile: the view will show the new epoch
            await self.endpoint.add_peer(peer.node_id, peer.epoch, meta.metadata, meta.arena_address,
                                         meta.arena_bytes)
            self.counters["nixl_meta_fetched"] += 1
            log.info("cluster: reading %s (epoch %x) with NIXL", peer.node_id, peer.epoch)
        except (Busy, Timeout, ConnectionLost, TransferFailed) as exc:
            log.debug("NIXL agent of %s not added yet (%s)", peer.node_id, exc)
        except QuillCacheError as exc:
            log.info("cluster: %s (epoch %x) is read over TCP: %s", peer.node_id, peer.epoch, exc)
            self._tcp_only.add(peer)
        finally:
            self._adding.discard(peer)

    async def _read(self, peer: Peer, grant: wire.Grant, granted: list[int], blocks: list,
                    until: float) -> None:
        extents = [(grant.items[i].offset, grant.items[i].size) for i in granted]
        if time.monotonic() >= until:
            self.counters["nixl_late"] += len(granted)
            return
        try:
            staged = await self.endpoint.read(peer.node_id, peer.epoch, extents, until)
        except Timeout:
            self.counters["nixl_late"] += len(granted)      # past the grant: the slots may have moved
            return
        with staged:
            if time.monotonic() > until:
                self.counters["nixl_late"] += len(granted)
                return
            total = sum(n for _, n in extents)
            out = np.empty(total, np.uint8)                 # every byte is copied in: no zero fill
            view = memoryview(out)
            pos = 0
            for i, src in zip(granted, staged.blocks):
                n = src.nbytes
                dst = view[pos:pos + n]
                dst[:] = src
                if crc32c(dst) != grant.items[i].crc:
                    self.counters["nixl_crc_mismatches"] += 1
                else:
                    blocks[i] = dst.toreadonly()
                pos += n
        self.counters["nixl_reads"] += 1
        self.counters["nixl_bytes"] += total

    async def _tcp_fetch(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> FetchResult:
        self.counters["nixl_tcp_fetches"] += 1
        return await self.tcp.fetch(peer, tenant, keys, deadline)

    def _release(self, peer: Peer, grant_id: int) -> None:
        """Release a grant that was read: with the next GRANT to that holder if one goes within
        ``RELEASE_DELAY_S`` (no message of its own), else by GRANT_RELEASE then."""
        pending = self._releases.setdefault(peer, [])
        pending.append(grant_id)
        if len(pending) == 1:
            asyncio.get_running_loop().call_later(RELEASE_DELAY_S, self._flush_releases, peer)

    def _flush_releases(self, peer: Peer) -> None:
        ids = self._releases.pop(peer, None)
        if not ids:
            return

        async def send() -> None:
            try:
                for i in range(0, len(ids), self.limits.max_batch):
                    await self.tcp.request(peer, Opcode.GRANT_RELEASE,
                                           wire.encode_release(ids[i:i + self.limits.max_batch], self.limits),
                                           time.monotonic() + META_TIMEOUT_S)
            except QuillCacheError:
                self.counters["nixl_release_failures"] += 1     # they end at their ttl anyway
        self._spawn(send())

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)


def make_endpoint(choice: str, *, arena, node_id: str, staging_bytes: int):
    """The node's ``NixlEndpoint`` for ``[cluster] transport = choice``, or None (TCP).

    ``nixl`` that cannot load or start raises ``ConfigError`` (exit 78) saying how to install it;
    ``auto`` falls back to TCP with one log line."""
    if choice not in TRANSPORT_CHOICES:
        raise ConfigError(f"[cluster] transport = {choice!r}: one of {', '.join(TRANSPORT_CHOICES)}")
    if choice == "tcp":
        return None
    missing = nixl_missing()
    if missing:
        if choice == "nixl":
            raise ConfigError(f"[cluster] transport = \"nixl\", but {missing}")
        log.info("cluster: transport auto -> tcp (%s)", missing)
        return None
    from quillcache.transfer.nixl import NixlEndpoint
    try:
        endpoint = NixlEndpoint(f"quillcache-{node_id}", arena, staging_bytes=staging_bytes)
    except Exception as exc:        # UCX could not start (no transport it can use): TCP, or exit
        if choice == "nixl":
            raise ConfigError(f"[cluster] transport = \"nixl\", but NIXL failed to start: {exc}") from None
        log.warning("cluster: transport auto -> tcp (NIXL failed to start: %s)", exc)
        return None
    log.info("cluster: transport nixl (UCX_TLS %s)", ucx_tls())
    return endpoint
