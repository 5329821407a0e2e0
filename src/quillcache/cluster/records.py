"""The residency records a home node keeps: key -> the (node, epoch) pairs holding it.

The records live in the store's own ART residency index (``LocalKvStore.index``,
docs/residency-index.md), next to the store's records of this node's blocks:

* this node's blocks are the store's records (worker id = the store's ``holder``); a
  LOCATE names this node for them with its current epoch, so a home never keeps a
  second record of what it holds itself;
* every other node's blocks are records of worker id ``holder_id(node, epoch)``, one
  ``CacheResidency`` per key (tier ``cpu_dram``: a holder serves from its store, whichever
  local tier the block is in).  Dropping every record of a node's old epoch (its lease
  expired, or it restarted) is ``clear_worker``.

Each record carries the CRC32C the holder computed when it stored the block (ANNOUNCE
brings it, LOCATE returns it: a reader checks the bytes it fetched against it).  The ART
record has no field for it: the CRCs of each holder's records sit beside it, in one dict
per (node, epoch) (``drop_epoch`` drops both together).  This node's
own blocks take their CRC from ``local_crc`` (the cluster hook's table): a block whose CRC
is not known yet is not named (it was not announced yet either).

Other nodes' records are soft state: a persistent index logs and checkpoints only the
records of its ``owner`` (this node), so none of them comes back after a restart; the
holders re-announce to the new epoch.  ``RecordStore`` is the interface the cluster hook
uses; without a shared index (tests) ``ArtRecordStore`` keeps its own.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

from quillcache.index.art import ArtIndex
from quillcache.model import CacheTier, KvBlockKey, encode_key
from quillcache.protocol.cluster import Holder

__all__ = ["Holder", "RecordStore", "ArtRecordStore", "holder_id", "parse_holder_id"]

_REMOTE_TIERS = (CacheTier.CPU_DRAM,)


def holder_id(node_id: str, epoch: int) -> str:
    return f"{node_id}@{epoch:x}"


def parse_holder_id(worker_id: str) -> tuple[str, int]:
    node, _, epoch = worker_id.rpartition("@")
    return node, int(epoch, 16)


class RecordStore(Protocol):
    def add(self, key: KvBlockKey, node_id: str, epoch: int, size: int, crc: int,
            ekey: Optional[bytes] = None) -> None: ...
    def drop(self, key: KvBlockKey, node_id: str, epoch: int, ekey: Optional[bytes] = None) -> int: ...
    def holders(self, key: KvBlockKey) -> list[Holder]: ...
    def holders_encoded(self, ekey: bytes) -> list[Holder]: ...
    def live_holders(self, ekeys: Sequence[bytes],
                     live: Callable[[str, int], bool]) -> list[list[tuple[str, int, int, int]]]: ...
    def drop_epoch(self, node_id: str, epoch: int) -> int: ...
    def epochs(self, node_id: str) -> set[int]: ...
    def nodes(self) -> list[str]: ...
    def __len__(self) -> int: ...


def _anyone(node_id: str, epoch: int) -> bool:
    return True


def _unknown(ekey: bytes) -> Optional[int]:
    return None


class ArtRecordStore:
    """Other nodes' records on an ``ArtIndex``: the store's (``index``, whose records of
    ``local_holder`` are this node's blocks, named ``local()`` = (node id, epoch) in
    answers, with the CRC ``local_crc(ekey)`` says), or a private one when ``index`` is None."""

    def __init__(self, index: Optional[ArtIndex] = None, local_holder: Optional[str] = None,
                 local: Optional[Callable[[], tuple[str, int]]] = None,
                 local_crc: Optional[Callable[[bytes], Optional[int]]] = None) -> None:
        self._index = index if index is not None else ArtIndex()
        self._local_holder = local_holder if local is not None else None
        self._local = local
        self._local_crc = local_crc or _unknown
        self._crcs: dict[str, dict[bytes, int]] = {}      # worker id -> encoded key -> crc
        self._epochs: dict[str, set[int]] = {}
        self._parsed: dict[str, tuple[str, int]] = {}     # worker id of a remote record -> (node, epoch)

    def __len__(self) -> int:
        """Records of other nodes (this node's own are the store's)."""
        records_of = self._index.records_of
        return sum(records_of(w) for w in self._parsed)

    def add(self, key: KvBlockKey, node_id: str, epoch: int, size: int, crc: int,
            ekey: Optional[bytes] = None) -> None:
        worker = holder_id(node_id, epoch)
        ek = ekey or encode_key(key)
        self._index.set_holder(key, ek, worker, _REMOTE_TIERS, size)
        if worker not in self._parsed:
            self._parsed[worker] = (node_id, epoch)
            self._epochs.setdefault(node_id, set()).add(epoch)
            self._crcs[worker] = {}
        self._crcs[worker][ek] = crc

    def drop(self, key: KvBlockKey, node_id: str, epoch: int, ekey: Optional[bytes] = None) -> int:
        worker = holder_id(node_id, epoch)
        if worker not in self._parsed:
            return 0
        ek = ekey or encode_key(key)
        had = self._index.holder(ek, worker)[1]
        self._index.set_holder(key, ek, worker, (), 0)
        self._crcs[worker].pop(ek, None)
        return len(had)

    def holders(self, key: KvBlockKey) -> list[Holder]:
        return self.holders_encoded(encode_key(key))

    def holders_encoded(self, ekey: bytes) -> list[Holder]:
        return [Holder(*h) for h in self.live_holders((ekey,), _anyone)[0]]

    def live_holders(self, ekeys: Sequence[bytes],
                     live: Callable[[str, int], bool]) -> list[list[tuple[str, int, int, int]]]:
        """A LOCATE's answer: for each encoded key, the (node id, epoch, size, crc) of its
        holders that ``live(node id, epoch)`` accepts (asked once per holder per call);
        this node's own blocks are named once, with its current epoch, once their CRC is known."""
        parsed, local_holder, holders_at = self._parsed, self._local_holder, self._index.holders_at
        crcs = self._crcs
        verdict: dict[str, Optional[tuple[str, int]]] = {}     # worker id -> (node, epoch) if live
        out = []
        append = out.append
        for ek in ekeys:
            found = []
            mine = False
            for w, size in holders_at(ek):
                if w == local_holder:
                    if mine:
                        continue                # one answer for its DRAM and SSD records
                    mine = True
                try:
                    ne = verdict[w]
                except KeyError:
                    ne = parsed.get(w)
                    if ne is None:
                        ne = self._local() if w == local_holder else None
                    if ne is not None and not live(*ne):
                        ne = None
                    verdict[w] = ne
                if ne is None:
                    continue
                crc = self._local_crc(ek) if w == local_holder else crcs[w].get(ek)
                if crc is not None:
                    found.append((ne[0], ne[1], size, crc))
            append(found)
        return out

    def drop_epoch(self, node_id: str, epoch: int) -> int:
        worker = holder_id(node_id, epoch)
        if self._parsed.pop(worker, None) is None:
            return 0
        self._crcs.pop(worker, None)
        epochs = self._epochs.get(node_id)
        if epochs is not None:
            epochs.discard(epoch)
            if not epochs:
                del self._epochs[node_id]
        return self._index.clear_worker(worker)

    def epochs(self, node_id: str) -> set[int]:
        return set(self._epochs.get(node_id, ()))

    def nodes(self) -> list[str]:
        return list(self._epochs)
