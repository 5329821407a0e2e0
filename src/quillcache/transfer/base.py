"""The Transport interface: what the cluster needs from the wire between nodes.

Three operations, shaped so that the bulk path can change medium without touching the
cluster code:

* ``request``: a small control message (ANNOUNCE, WITHDRAW, LOCATE) and its reply body;
* ``fetch``: blocks by key from a holder into memory this node owns (with TCP, buffers
  the reply is received into; with RDMA, registered buffers the holder writes or this
  node reads) -- the result says, per key, found or not, and hands back the bytes;
* ``push``: one block to another node's store (a replica).

Every call takes a ``deadline`` (``time.monotonic()`` seconds) and raises
``QuillCacheError`` (Timeout, ConnectionLost, ...) when the peer cannot answer by then.
A transport never returns bytes it did not check: a TCP fetch is covered end to end by
the frame's CRC32C trailer.
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

    async def push(self, peer: Peer, key, data, deadline: float) -> None: ...

    def forget(self, peer_node_id: str) -> None: ...

    async def close(self) -> None: ...

    def stats(self) -> dict: ...
