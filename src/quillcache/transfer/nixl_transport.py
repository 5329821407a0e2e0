"""``NixlTransport``: the reader's side of bytes on NIXL (docs/nixl.md).

Control messages (ANNOUNCE, WITHDRAW, LOCATE, GRANT, ...) stay on the TCP member link
(``TcpTransport``); ``fetch`` becomes:

1. GRANT to the holder (tenant, keys): per key, the block's offset in the holder's arena, its
   size and CRC32C, held in place for the grant's ttl; keys this reader holds a grant on that is
   still good for reuse (``grant_reuse``) are not asked again;
2. one NIXL READ for the batch, holder arena -> this node's registered staging area
   (``NixlEndpoint``; posted from the loop, polled on the endpoint's thread if UCX did not finish
   it at once);
3. each block handed on as a read-only view of staging that owns its extent (no copy; the
   extent is given back when the last view goes).  A grant is released once its reuse ends
   (at once without reuse): by the next GRANT to that holder, or by GRANT_RELEASE after
   ``RELEASE_DELAY_S``; the holder ends it at its ttl anyway.

No CRC is summed here: like every transport (transfer/base.py), this one hands the blocks to
the reader (cluster/reads.py), which checks each against the CRC32C its writer recorded
(ANNOUNCE, kept by the home, returned by LOCATE).  A holder that puts other bytes in its arena,
and a READ that raced a slot moving, are misses there (``crc_mismatches``).

Reuse is a trade the setting makes explicit: within ``grant_reuse`` a block read again is the
block as it was granted (the slot stays in place), even if the holder put another block under
the key since; the writer's CRC still holds for what is returned.

The holder's agent is learnt over the member link (NIXL_META: its metadata, where its arena is
registered) the first time a (node, epoch) is read, and forgotten, with the grants held of it,
when it leaves the view or changes epoch.  A holder that has no NIXL (META refused) is read over
FETCH from then on, for that epoch; so are the blocks it holds outside its arena
(``STATUS_FETCH``).  A READ that fails (the agent errs, staging is full) is sent again as one
FETCH of the same keys (``nixl_fallbacks``), and the grants held of that holder are dropped.  A
READ not done by the grant's ttl, counted from before GRANT was sent, is a miss: the holder may
have let the slot go.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple, Optional, Sequence

from quillcache.errors import Busy, ConfigError, ConnectionLost, InvalidArgument, QuillCacheError, Timeout
from quillcache.protocol import grants as wire
from quillcache.protocol.opcodes import Opcode
from quillcache.transfer.base import FetchResult, Peer
from quillcache.transfer.nixl import TransferFailed, nixl_missing, ucx_tcp_only, ucx_tls
from quillcache.transfer.tcp import TcpTransport

log = logging.getLogger("quillcache.cluster")

__all__ = ["NixlTransport", "make_endpoint", "TRANSPORT_CHOICES", "TTL_MARGIN_S"]

TRANSPORT_CHOICES = ("auto", "tcp", "nixl")
TTL_MARGIN_S = 0.002        # seconds: a READ must be done this long before its grant's ttl ends
META_TIMEOUT_S = 5.0        # seconds: NIXL_META and GRANT_RELEASE, sent off any read's path
RELEASE_DELAY_S = 0.005     # seconds a read grant waits to ride on the next GRANT before GRANT_RELEASE


class _Grant(NamedTuple):
    epoch: int
    grant_id: int
    items: list
    until: float            # monotonic: a READ of its blocks must be done by then
    reuse_until: float      # monotonic: its blocks are read again without GRANT until then


class NixlTransport:
    """``Transport`` whose fetch reads the holder's arena with NIXL; everything else is ``tcp``'s."""

    name = "nixl"

    def __init__(self, tcp: TcpTransport, endpoint, *, reuse_s: float = 0.0) -> None:
        self.tcp = tcp
        self.endpoint = endpoint
        self.limits = tcp.limits
        self.reuse_s = float(reuse_s)       # seconds a grant's blocks are read again without GRANT
        # grants held for reuse: holder -> (tenant, key) -> (grant id, offset, size, until, reuse until)
        self._held: dict[Peer, dict[tuple[str, bytes], tuple[int, int, int, float, float]]] = {}
        self._by_grant: dict[tuple[Peer, int], list[tuple[str, bytes]]] = {}
        self._busy: dict[tuple[Peer, int], int] = {}       # READs in flight under a held grant
        self._retired: set[tuple[Peer, int]] = set()        # reuse ended while READs ran under it
        self._tcp_only: set[Peer] = set()                   # holders (of an epoch) without NIXL
        self._adding: set[Peer] = set()                     # agents being learnt
        self._releases: dict[Peer, list[int]] = {}          # grants read, not yet released
        self._bg: set[asyncio.Task] = set()
        self.counters = {"nixl_reads": 0, "nixl_bytes": 0, "nixl_fallbacks": 0, "nixl_late": 0,
                         "nixl_grant_reuses": 0, "nixl_meta_fetched": 0, "nixl_release_failures": 0,
                         "nixl_tcp_fetches": 0}

    # ------------------------------------------------------------------ Transport

    async def request(self, peer: Peer, opcode: int, body: bytes, deadline: float) -> bytes:
        return await self.tcp.request(peer, opcode, body, deadline)

    def forget(self, peer_node_id: str) -> None:
        self.tcp.forget(peer_node_id)
        self.endpoint.forget(peer_node_id)
        for peer in [p for p in self._held if p.node_id == peer_node_id]:
            self._drop_held(peer)
        self._releases = {p: ids for p, ids in self._releases.items() if p.node_id != peer_node_id}
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
                "nixl_reads_inline": ep["reads_inline"], "nixl_grants_held": len(self._by_grant)}

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
        blocks: list[Optional[memoryview]] = [None] * len(keys)
        # The blocks to READ: key indexes, (offset, size) extents, and the earliest moment a
        # READ of them must be done by (the grants' ends).
        idx: list[int] = []
        extents: list[tuple[int, int]] = []
        reused: set[int] = set()                            # ids of the held grants this read uses
        ask, until = self._reuse(peer, tenant, keys, idx, extents, reused)
        later: list[int] = []
        grant: Optional[_Grant] = None
        reusable = False
        if reused:
            self._use(peer, reused, 1)      # from now: their release waits for this READ
        try:
            if ask:
                grant = await self._grant(peer, tenant, [keys[i] for i in ask], deadline)
                if grant.epoch != peer.epoch:
                    return FetchResult(grant.epoch, blocks)     # another run: not the copy recorded
                for i, it in zip(ask, grant.items):
                    if it.status == 0 and it.size > 0:
                        idx.append(i)
                        extents.append((it.offset, it.size))
                        if grant.until < until:
                            until = grant.until
                    elif it.status == wire.STATUS_FETCH:
                        later.append(i)
            if idx:
                try:
                    reusable = await self._read(peer, idx, extents, min(until, deadline), blocks)
                except (TransferFailed, InvalidArgument) as exc:
                    # The agent erred or staging is full: the same keys once over FETCH, and no
                    # grant of this holder is read again before it is asked anew.
                    log.debug("NIXL read from %s failed (%s): FETCH instead", peer.node_id, exc)
                    self.counters["nixl_fallbacks"] += 1
                    self._drop_held(peer)
                    later += idx
        finally:
            if reused:
                self._use(peer, reused, -1)
            if grant is not None and grant.grant_id:    # after the READ, never while it may run
                if reusable and grant.epoch == peer.epoch:
                    self._granted(peer, tenant, keys, ask, grant)
                else:
                    self._release(peer, grant.grant_id)
        if later:
            later.sort()
            res = await self._tcp_fetch(peer, tenant, [keys[i] for i in later], deadline)
            if res.epoch != peer.epoch:
                return FetchResult(res.epoch, [None] * len(keys))
            for i, block in zip(later, res.blocks):
                blocks[i] = block
        return FetchResult(peer.epoch, blocks)

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

    async def _grant(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> "_Grant":
        """GRANT of ``keys`` (the grants this reader is done with released first, in the same
        message); its reply with ``until``: the moment a READ of it must be done by."""
        release = self._releases.pop(peer, [])
        sent = time.monotonic()
        body = await self.tcp.request(peer, Opcode.GRANT, wire.encode_grant(tenant, keys, self.limits, release),
                                      deadline)
        grant = wire.decode_grant_reply(body, self.limits)
        if len(grant.items) != len(keys):
            if grant.grant_id:
                self._release(peer, grant.grant_id)
            raise InvalidArgument(f"GRANT reply names {len(grant.items)} items for {len(keys)} keys")
        ttl = grant.ttl_us / 1e6
        # The holder's clock for the ttl starts after ``sent``: a READ done by ``until`` ended
        # before the holder let the slots go.  A grant is reused for at most half its ttl.
        return _Grant(grant.epoch, grant.grant_id, grant.items, sent + ttl - TTL_MARGIN_S,
                      sent + min(self.reuse_s, ttl / 2))

    def _reuse(self, peer: Peer, tenant: str, keys: Sequence[bytes], idx: list, extents: list,
               reused: set) -> tuple[list[int], float]:
        """Append to ``idx``/``extents`` the keys this reader holds a grant on still good for reuse
        (their grant ids in ``reused``); the indexes of the others (to ask GRANT for), and the
        earliest end of the grants used (``inf`` if none)."""
        until = float("inf")
        held = self._held.get(peer)
        if not held:
            return list(range(len(keys))), until
        now = time.monotonic()
        ask = []
        for i, k in enumerate(keys):
            h = held.get((tenant, k))
            if h is not None and now < h[4]:
                idx.append(i)
                extents.append((h[1], h[2]))
                if h[3] < until:
                    until = h[3]
                reused.add(h[0])
            else:
                ask.append(i)
        if reused:
            self.counters["nixl_grant_reuses"] += len(idx)
        return ask, until

    def _granted(self, peer: Peer, tenant: str, keys: Sequence[bytes], ask: list[int], grant: "_Grant") -> None:
        """Keep a grant's blocks for reuse until its reuse ends, then release it; without reuse
        release it at once (it rides on the next GRANT, or GRANT_RELEASE follows)."""
        if not grant.grant_id:
            return
        if grant.reuse_until <= time.monotonic():
            self._release(peer, grant.grant_id)
            return
        held = self._held.setdefault(peer, {})
        names = []
        for i, it in zip(ask, grant.items):
            if it.status == 0 and it.size > 0:
                name = (tenant, keys[i])
                held[name] = (grant.grant_id, it.offset, it.size, grant.until, grant.reuse_until)
                names.append(name)
        self._by_grant[(peer, grant.grant_id)] = names
        # call_later on time.monotonic()'s clock: the loop's own clock need not share its origin
        asyncio.get_running_loop().call_later(grant.reuse_until - time.monotonic(), self._retire, peer,
                                              grant.grant_id)

    def _retire(self, peer: Peer, grant_id: int) -> None:
        """A grant's reuse ended: its blocks are asked again next time, and it is released."""
        names = self._by_grant.pop((peer, grant_id), None)
        if names is None or self.endpoint.closed:
            return                          # dropped with its holder, or closing: it ends at its ttl
        held = self._held.get(peer)
        if held is not None:
            for name in names:
                h = held.get(name)
                if h is not None and h[0] == grant_id:
                    del held[name]
            if not held:
                del self._held[peer]
        if self._busy.get((peer, grant_id)):
            self._retired.add((peer, grant_id))     # released when the READs under it are done
        else:
            self._release(peer, grant_id)

    def _use(self, peer: Peer, grant_ids: set, step: int) -> None:
        """Count READs in flight under held grants (+1 before, -1 after): a grant whose reuse ended
        meanwhile is released after its last READ, never while one may still run."""
        for gid in grant_ids:
            k = (peer, gid)
            n = self._busy.get(k, 0) + step
            if n > 0:
                self._busy[k] = n
                continue
            self._busy.pop(k, None)
            if k in self._retired:
                self._retired.discard(k)
                if self.endpoint.knows(peer.node_id, peer.epoch) and not self.endpoint.closed:
                    self._release(peer, gid)

    def _drop_held(self, peer: Peer) -> None:
        """Forget every grant held of ``peer`` (its READ failed, or it left): none is read again."""
        self._held.pop(peer, None)
        for k in [k for k in self._by_grant if k[0] == peer]:
            del self._by_grant[k]
        self._retired = {k for k in self._retired if k[0] != peer}

    async def _read(self, peer: Peer, idx: list[int], extents: list, until: float, blocks: list) -> bool:
        """One READ of ``extents`` (granted now or held for reuse) into staging; the block of key
        ``idx[j]`` lands in ``blocks`` as a view that owns its staging extent (no copy).  A READ
        not done by ``until`` (the earliest grant's end, or the hop's deadline) is a miss: the
        holder may have let the slot go.  True when the READ was done in time (its grant may be
        read again)."""
        if time.monotonic() >= until:
            self.counters["nixl_late"] += len(idx)
            return False
        try:
            staged = await self.endpoint.read(peer.node_id, peer.epoch, extents, until)
        except Timeout:
            self.counters["nixl_late"] += len(idx)          # past the grant: the slots may have moved
            return False
        if time.monotonic() > until:
            staged.release()
            self.counters["nixl_late"] += len(idx)
            return False
        # No CRC pass here: the reader (cluster/reads.py) checks every block against the CRC32C
        # its writer recorded, whatever carried it, so a block that is not the writer's, a READ
        # that raced its slot included, is a miss there.
        nbytes = 0
        for i, view in zip(idx, staged.keep()):
            blocks[i] = view
            nbytes += view.nbytes
        counters = self.counters
        counters["nixl_reads"] += 1
        counters["nixl_bytes"] += nbytes
        return True

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
    if choice == "auto" and ucx_tcp_only(ucx_tls()):
        log.info("cluster: transport auto -> tcp (UCX_TLS %s: UCX would reach peers over TCP only, "
                 "where FETCH is faster; transport = \"nixl\" forces NIXL)", ucx_tls())
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
