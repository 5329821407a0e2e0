"""The Transport interface: what the cluster needs from the wire between nodes.

Two operations, shaped so that the bulk path can change medium without touching the
cluster code:

* ``request``: a small control message (ANNOUNCE, WITHDRAW, LOCATE, REPLICATE) and its
  reply body;
* ``fetch``: blocks by key from a holder into memory this node owns (with TCP, buffers
  the reply is received into; with RDMA, registered buffers the holder writes or this
  node reads) -- the result says, per key, found or not, and hands back the bytes.

A replica is not pushed: the holder sends REPLICATE (keys, sizes, CRCs) and the replica
fetches the bytes like any reader, so bytes only ever travel as a FETCH reply.

Every call takes a ``deadline`` (``time.monotonic()`` seconds) and raises
``QuillCacheError`` (Timeout, ConnectionLost, ...) when the peer cannot answer by then.
Every connection is logged in both ways (docs/security.md) before it carries a request.
A transport hands back the bytes as they came: the reader checks each block against the
CRC32C its writer recorded (cluster/reads.py), whatever the medium.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Sequence

__all__ = ["Peer", "FetchResult", "Transport"]


class Peer(NamedTuple):
    node_id: str
    address: str          # host:port
    epoch: int


class FetchResult(NamedTuple):
    epoch: int                          # the holder's epoch when it answered
    blocks: list[Optional[memoryview]]  # per key: the bytes, or None (a miss at the holder)


class Transport(Protocol):
    name: str

    async def request(self, peer: Peer, opcode: int, body: bytes, deadline: float) -> bytes: ...

    async def fetch(self, peer: Peer, tenant: str, keys: Sequence[bytes], deadline: float) -> FetchResult: ...

    def forget(self, peer_node_id: str) -> None: ...

    async def close(self) -> None: ...

    def stats(self) -> dict: ...
