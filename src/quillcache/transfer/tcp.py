"""``TcpTransport``: node-to-node requests over the binary protocol on TCP.

One connection per peer (node id + address + epoch) and per epoch of this node, opened
on first use and shared by every request to that peer (the protocol multiplexes by request
id).  A connection that fails is dropped and the next call opens a new one; a peer that
left the view is ``forget``-ed.

Opening one is a login by challenge and response (``login``, docs/security.md): HELLO with
the marker token ``NODE_HELLO_TOKEN`` (no secret), NODE_AUTH with this node's id, epoch
and a fresh nonce, and the peer's id as the view names it; the reply must carry the peer's
nonce and its MAC over both nonces, both ids and both epochs, under the login key derived
from the credential, else the connection is closed and nothing more is sent.  Only then
NODE_PROOF sends this node's MAC (another label: a responder's MAC is never an
initiator's).  An address that is not a member's learns a nonce and a node id, never the
credential nor a MAC it could replay.

FETCH returns the bytes as they came; the reader (cluster/reads.py) checks each block
against the CRC32C its writer recorded, which covers the transfer as well.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional, Sequence

import numpy as np

from quillcache.client import AsyncClient
from quillcache.protocol import cluster as wire
from quillcache.errors import ConnectionLost, InvalidArgument, PermissionDenied, QuillCacheError, Timeout
from quillcache.protocol.opcodes import Opcode, ProtocolLimits
from quillcache.transfer.base import FetchResult, Peer

__all__ = ["TcpTransport", "login"]


async def login(client: AsyncClient, keys, node_id: str, epoch: int, peer_id: str) -> int:
    """Log ``client`` (connected with ``NODE_HELLO_TOKEN``) in as node ``node_id`` of run
    ``epoch`` to the node the view calls ``peer_id``; ``keys``: the pool's ClusterKeys.
    Returns the peer's epoch; PermissionDenied (and nothing more sent) when the peer does
    not prove it holds the credential."""
    step = wire.NodeLogin(keys, node_id, epoch, peer_id)
    reply = await client.call(Opcode.NODE_AUTH, step.request())
    await client.call(Opcode.NODE_PROOF, step.proof(reply.header))
    return step.peer_epoch


class TcpTransport:
    name = "tcp"

    def __init__(self, keys, *, node_id: str, epoch: Callable[[], int], limits: ProtocolLimits,
                 max_fetch_bytes: int) -> None:
        self._keys = keys               # cluster.keys.ClusterKeys (the login MACs)
        self._node_id = node_id
        self._epoch = epoch             # this node's epoch now (a link logs in with it)
        self._name = f"quillcache-node/{node_id}"
        self.limits = limits
        self.max_fetch_bytes = max_fetch_bytes
        self._links: dict[tuple[Peer, int], AsyncClient] = {}
        self._connecting: dict[tuple[Peer, int], asyncio.Future] = {}
        self.counters = {"connects": 0, "connect_failures": 0, "login_failures": 0, "requests": 0,
                         "fetches": 0, "fetched_bytes": 0, "errors": 0}

    async def _link(self, peer: Peer, deadline: float) -> AsyncClient:
        epoch = self._epoch()
        slot = (peer, epoch)
        link = self._links.get(slot)
        if link is not None and link.is_open:
            return link
        self._links.pop(slot, None)
        pending = self._connecting.get(slot)
        if pending is not None:
            return await asyncio.wait_for(asyncio.shield(pending), max(deadline - time.monotonic(), 0.001))
        fut = asyncio.get_running_loop().create_future()
        self._connecting[slot] = fut
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no time left to connect to {peer.node_id}")
            client = AsyncClient(peer.address, token=wire.NODE_HELLO_TOKEN, timeout=left, client_name=self._name)
            try:
                await client.connect()
            except QuillCacheError:
                self.counters["connect_failures"] += 1
                raise
            try:
                await login(client, self._keys, self._node_id, epoch, peer.node_id)
            except BaseException as exc:
                await client.close()
                if isinstance(exc, PermissionDenied):
                    self.counters["login_failures"] += 1
                raise
            self.counters["connects"] += 1
            for old in [s for s in self._links if s[0] == peer]:      # a link of an earlier epoch
                self._drop(old, self._links[old])
            self._links[slot] = client
            fut.set_result(client)
            return client
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else ConnectionLost("cancelled"))
            fut.exception()                     # retrieved: no "never retrieved" warning
            raise
        finally:
            self._connecting.pop(slot, None)

    def _drop(self, slot: tuple[Peer, int], link: AsyncClient) -> None:
        if self._links.get(slot) is link:
            del self._links[slot]
        asyncio.get_running_loop().create_task(link.close())

    async def _call(self, peer: Peer, opcode: int, body: bytes, deadline: float, **kw):
        link = await self._link(peer, deadline)
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"{Opcode(opcode).name} to {peer.node_id}: deadline passed")
        try:
            return await link.call(opcode, body, timeout=left, **kw)
        except (Timeout, ConnectionLost):
            self.counters["errors"] += 1
            for slot in [s for s, v in self._links.items() if v is link]:
                self._drop(slot, link)      # its stream may be mid-reply: never reuse it
            raise

    async def request(self, peer: Peer, opcode: int, body: bytes, deadline: float) -> bytes:
        self.counters["requests"] += 1
        reply = await self._call(peer, opcode, body, deadline)
        return bytes(reply.header)

    async def fetch(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> FetchResult:
        """One FETCH of ``keys``, and another for the keys after the reply's last item where the
        holder cut its reply at its max_payload; a holder whose epoch changed in between has
        restarted: the keys left are misses."""
        epoch, blocks = await self._fetch_once(peer, tenant, keys, deadline)
        while len(blocks) < len(keys):
            again, more = await self._fetch_once(peer, tenant, keys[len(blocks):], deadline)
            if again != epoch:
                blocks += [None] * (len(keys) - len(blocks))
                break
            blocks += more
        return FetchResult(epoch, blocks)

    async def _fetch_once(self, peer: Peer, tenant: str, keys: Sequence[bytes],
                          deadline: float) -> tuple[int, list[Optional[memoryview]]]:
        limit = self.max_fetch_bytes
        holder: list = []

        def into(frame):
            n = frame.payload_length
            if n > limit:
                raise InvalidArgument(f"FETCH reply of {n} bytes, at most {limit}")
            buf = np.empty(n, np.uint8)     # every byte is received into it: no zero fill
            holder.append(buf)
            return memoryview(buf)

        self.counters["fetches"] += 1
        reply = await self._call(peer, Opcode.FETCH, wire.encode_fetch(tenant, keys, self.limits), deadline,
                                 into=into)
        payload = memoryview(holder[0]) if holder else memoryview(b"")
        epoch, items = wire.decode_fetch_reply(reply.header, self.limits, payload.nbytes)
        if len(items) > len(keys) or (keys and not items):
            raise InvalidArgument(f"FETCH reply names {len(items)} items for {len(keys)} keys")
        blocks: list[Optional[memoryview]] = []
        pos = 0
        for status, size in items:
            if status == 0:
                blocks.append(payload[pos:pos + size])
                pos += size
            else:
                blocks.append(None)
        self.counters["fetched_bytes"] += pos
        return epoch, blocks

    def forget(self, peer_node_id: str) -> None:
        for slot in [s for s in self._links if s[0].node_id == peer_node_id]:
            link = self._links.pop(slot)
            asyncio.get_running_loop().create_task(link.close())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()

    def stats(self) -> dict:
        return {"transport": self.name, "links": len(self._links), **self.counters}
