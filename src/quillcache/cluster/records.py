"""The residency records a home node keeps: key -> the (node, epoch) pairs holding it.

``RecordStore`` is the small interface the cluster hook uses; ``ArtRecordStore`` keeps
the records in the ART residency index (``index.ArtIndex``), one ``CacheResidency`` per
holder whose ``worker_id`` is ``holder_id(node, epoch)``.  Dropping every record of a
node's old epoch (its lease expired, or it restarted) is then ``clear_worker``.  When
the store's own ART index (issue 11) takes other nodes' records, this class is the one
place to re-point.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

from quillcache.index.art import ArtIndex
from quillcache.model import CacheResidency, CacheTier, KvBlockKey

__all__ = ["Holder", "RecordStore", "ArtRecordStore", "holder_id", "parse_holder_id"]


class Holder(NamedTuple):
    node_id: str
    epoch: int
    size: int


def holder_id(node_id: str, epoch: int) -> str:
    return f"{node_id}@{epoch:x}"


def parse_holder_id(worker_id: str) -> tuple[str, int]:
    node, _, epoch = worker_id.rpartition("@")
    return node, int(epoch, 16)


class RecordStore(Protocol):
    def add(self, key: KvBlockKey, node_id: str, epoch: int, size: int) -> None: ...
    def drop(self, key: KvBlockKey, node_id: str, epoch: int) -> int: ...
    def holders(self, key: KvBlockKey) -> list[Holder]: ...
    def drop_epoch(self, node_id: str, epoch: int) -> int: ...
    def epochs(self, node_id: str) -> set[int]: ...
    def __len__(self) -> int: ...


class ArtRecordStore:
    """Records on an ``ArtIndex``; the tier field says ``cpu_dram`` (a holder serves from
    its store, whichever local tier the block is in)."""

    def __init__(self) -> None:
        self._index = ArtIndex()
        self._epochs: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._index)

    def add(self, key: KvBlockKey, node_id: str, epoch: int, size: int) -> None:
        self._index.put(CacheResidency(key, holder_id(node_id, epoch), CacheTier.CPU_DRAM, size))
        self._epochs.setdefault(node_id, set()).add(epoch)

    def drop(self, key: KvBlockKey, node_id: str, epoch: int) -> int:
        return self._index.remove_block(key.scope, holder_id(node_id, epoch), key.block_hash)

    def holders(self, key: KvBlockKey) -> list[Holder]:
        out = []
        for r in self._index.locate(key):
            node, epoch = parse_holder_id(r.worker_id)
            out.append(Holder(node, epoch, r.bytes))
        return out

    def drop_epoch(self, node_id: str, epoch: int) -> int:
        epochs = self._epochs.get(node_id)
        if epochs is not None:
            epochs.discard(epoch)
            if not epochs:
                del self._epochs[node_id]
        return self._index.clear_worker(holder_id(node_id, epoch))

    def epochs(self, node_id: str) -> set[int]:
        return set(self._epochs.get(node_id, ()))

    def nodes(self) -> list[str]:
        return list(self._epochs)
