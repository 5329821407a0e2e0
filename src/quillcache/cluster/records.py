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
    def holders_encoded(self, ekey: bytes) -> list[Holder]: ...
    def drop_epoch(self, node_id: str, epoch: int) -> int: ...
    def epochs(self, node_id: str) -> set[int]: ...
    def __len__(self) -> int: ...


class _RecordIndex(ArtIndex):
    """The ART index with a lookup by encoded key (a LOCATE names keys encoded: no
    decode and re-encode per key)."""

    def locate_encoded(self, ekey: bytes) -> list[CacheResidency]:
        slot = self._tree.get(ekey)
        return [] if slot is None else self._slots[slot]


class ArtRecordStore:
    """Records on an ``ArtIndex``; the tier field says ``cpu_dram`` (a holder serves from
    its store, whichever local tier the block is in)."""

    def __init__(self) -> None:
        self._index = _RecordIndex()
        self._epochs: dict[str, set[int]] = {}
        self._parsed: dict[str, tuple[str, int]] = {}     # worker_id -> (node, epoch)

    def __len__(self) -> int:
        return len(self._index)

    def add(self, key: KvBlockKey, node_id: str, epoch: int, size: int) -> None:
        self._index.put(CacheResidency(key, holder_id(node_id, epoch), CacheTier.CPU_DRAM, size))
        self._epochs.setdefault(node_id, set()).add(epoch)

    def drop(self, key: KvBlockKey, node_id: str, epoch: int) -> int:
        return self._index.remove_block(key.scope, holder_id(node_id, epoch), key.block_hash)

    def holders(self, key: KvBlockKey) -> list[Holder]:
        return self._holders(self._index.locate(key))

    def holders_encoded(self, ekey: bytes) -> list[Holder]:
        return self._holders(self._index.locate_encoded(ekey))

    def _holders(self, records) -> list[Holder]:
        parsed = self._parsed
        out = []
        for r in records:
            ne = parsed.get(r.worker_id)
            if ne is None:
                ne = parsed[r.worker_id] = parse_holder_id(r.worker_id)
            out.append(Holder(ne[0], ne[1], r.bytes))
        return out

    def drop_epoch(self, node_id: str, epoch: int) -> int:
        self._parsed.pop(holder_id(node_id, epoch), None)
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
