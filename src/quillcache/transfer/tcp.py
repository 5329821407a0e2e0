"""``TcpTransport``: node-to-node requests over the binary protocol on TCP.

One connection per peer (node id + address + epoch), opened on first use with HELLO and
the cluster credential, shared by every request to that peer (the protocol multiplexes
by request id).  A connection that fails is dropped and the next call opens a new one;
a peer that left the view is ``forget``-ed.  FETCH asks for the payload CRC32C trailer,
which the frame parser checks as the bytes arrive: a corrupted or cut reply is an error,
never bytes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional, Sequence

import numpy as np

from quillcache.client import AsyncClient
from quillcache.protocol import cluster as wire
from quillcache.errors import ConnectionLost, InvalidArgument, QuillCacheError, Timeout
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode, ProtocolLimits
from quillcache.transfer.base import FetchResult, Peer

__all__ = ["TcpTransport"]


class TcpTransport:
    name = "tcp"

    def __init__(self, credential: str, *, node_id: str, limits: ProtocolLimits,
                 max_fetch_bytes: int) -> None:
        self._credential = credential
        self._name = f"quillcache-node/{node_id}"
        self.limits = limits
        self.max_fetch_bytes = max_fetch_bytes
        self._links: dict[Peer, AsyncClient] = {}
        self._connecting: dict[Peer, asyncio.Future] = {}
        self.counters = {"connects": 0, "connect_failures": 0, "requests": 0, "fetches": 0,
                         "fetched_bytes": 0, "pushes": 0, "pushed_bytes": 0, "errors": 0}

    async def _link(self, peer: Peer, deadline: float) -> AsyncClient:
        link = self._links.get(peer)
        if link is not None and link.is_open:
            return link
        self._links.pop(peer, None)
        pending = self._connecting.get(peer)
        if pending is not None:
            return await asyncio.wait_for(asyncio.shield(pending), max(deadline - time.monotonic(), 0.001))
        fut = asyncio.get_running_loop().create_future()
        self._connecting[peer] = fut
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no time left to connect to {peer.node_id}")
            client = AsyncClient(peer.address, token=self._credential, timeout=left, client_name=self._name)
            try:
                await client.connect()
            except QuillCacheError:
                self.counters["connect_failures"] += 1
                raise
            self.counters["connects"] += 1
            self._links[peer] = client
            fut.set_result(client)
            return client
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else ConnectionLost("cancelled"))
            fut.exception()                     # retrieved: no "never retrieved" warning
            raise
        finally:
            self._connecting.pop(peer, None)

    def _drop(self, peer: Peer, link: AsyncClient) -> None:
        if self._links.get(peer) is link:
            del self._links[peer]
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
            self._drop(peer, link)          # its stream may be mid-reply: never reuse it
            raise

    async def request(self, peer: Peer, opcode: int, body: bytes, deadline: float) -> bytes:
        self.counters["requests"] += 1
        reply = await self._call(peer, opcode, body, deadline)
        return bytes(reply.header)

    async def fetch(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> FetchResult:
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
                                 flags=FLAG_PAYLOAD_CRC, into=into)
        payload = memoryview(holder[0]) if holder else memoryview(b"")
        epoch, items = wire.decode_fetch_reply(reply.header, self.limits, payload.nbytes)
        if len(items) != len(keys):
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
        return FetchResult(epoch, blocks)

    async def push(self, peer: Peer, key, data, deadline: float) -> None:
        link = await self._link(peer, deadline)
        self.counters["pushes"] += 1
        old = link.timeout
        link.timeout = max(deadline - time.monotonic(), 0.001)
        try:
            await link.put(key, data)
        except (Timeout, ConnectionLost):
            self.counters["errors"] += 1
            self._drop(peer, link)
            raise
        finally:
            link.timeout = old
        self.counters["pushed_bytes"] += memoryview(data).nbytes

    def forget(self, peer_node_id: str) -> None:
        for peer in [p for p in self._links if p.node_id == peer_node_id]:
            link = self._links.pop(peer)
            asyncio.get_running_loop().create_task(link.close())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()

    def stats(self) -> dict:
        return {"transport": self.name, "links": len(self._links), **self.counters}
