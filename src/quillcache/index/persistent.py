"""The persistent ART residency index: ``ArtIndex`` + a write-ahead log + checkpoints.

Directory layout::

    <directory>/wal/000000000001.log ...   the native WAL (docs/wal-format.md)
    <directory>/checkpoint.qck             the last checkpoint (flat binary: index/checkpoint.py)
    <directory>/checkpoint.qck.tmp         a checkpoint being written (deleted on open)

Every state change goes through ``ArtIndex._apply_put / _apply_remove / _apply_clear``;
this class logs each one as one WAL record *before* applying it (the record is encoded,
and so validated, before anything changes).  ``sync()`` is the group commit: one write +
fdatasync for everything appended since the last one.  ``sync_every=True`` commits at the
end of every mutating call instead.

The WAL records (PUT, REMOVE, CLEAR: layout, encoders, decoder) are
``quillcache.index.walrecords``; ``clear_worker``/``remove_block`` log one REMOVE per key they
drop (physical, idempotent).  The checkpoint file (layout, writer, reader and its checks) is
``quillcache.index.checkpoint``; the lazy structures of recovery are ``quillcache.index.lazy``.

Recovery = load the checkpoint + replay WAL records with lsn > its wal_lsn.  Both are lazy
so that 1 M records are serving in about a second of CPU: the tree is bulk-built from the
key blob (``insert_many``); a key's ``CacheResidency`` objects are decoded on first touch
(``_COLD`` slots from the checkpoint, ``_RawGroup`` slots replayed from the WAL without
building model objects); the per-worker and per-block-hash side maps are computed per
name on first use (numpy over the checkpoint's records, plus what the replay changed).
``materialize()`` decodes everything.  A checkpoint copies undecoded slots as they are.

Costs to know: the open segment is re-read from its start (records the checkpoint covers
are skipped), so ``segment_bytes`` bounds that re-read; replay costs some microseconds per
record, so ``checkpoint_wal_bytes`` bounds the tail (and each checkpoint rewrites the
whole index: write amplification ~ 1 + checkpoint size / checkpoint_wal_bytes).

A checkpoint whose checksum (or structure) is wrong is refused with ``CorruptCheckpoint``:
the WAL before it was truncated, so replaying the log alone would silently lose records.
A torn WAL tail (the writer died mid-record) is dropped and reported in ``recovery``;
corruption inside the log raises ``CorruptLog`` unless ``strict=False``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from quillcache.fsutil import fsync_dir
from quillcache._native.wal import WalReader, WalWriter
from quillcache.errors import CorruptCheckpoint, InvalidArgument
from quillcache.index.art import BYTES_MASK, PACKED, ArtIndex, key_of, packed_tiers
from quillcache.index.checkpoint import CHECKPOINT_NAME, TIER_CODE, TIERS, Checkpoint, read_checkpoint, write_checkpoint
from quillcache.index.lazy import COLD, LazyBlockMap, LazySlots, LazyWorkerMap, RawGroup, block_hash_of
from quillcache.index.walrecords import (  # CorruptLog, encode_put, MAX_WORKER_ID_BYTES: re-exported
    MAX_WORKER_ID_BYTES, OP_CLEAR, OP_REMOVE, RECORD_ERRORS, CorruptLog, decode_record, encode_clear, encode_put,
    encode_put_ek, encode_remove,
)
from quillcache.model import KEY_FORMAT_VERSION, CacheResidency, CacheTier, IdentityScope, IndexMetrics, encode_key

__all__ = ["PersistentArtIndex", "CorruptCheckpoint", "CorruptLog", "RecoveryInfo",
           "encode_put", "MAX_WORKER_ID_BYTES", "CHECKPOINT_NAME"]

DEFAULT_CHECKPOINT_WAL_BYTES = 64 << 20   # bytes of WAL since the last checkpoint
DEFAULT_SEGMENT_BYTES = 4 << 20           # bytes per WAL segment: truncation granularity, and
                                          # at most this much already-checkpointed WAL is re-read on open


@dataclass
class RecoveryInfo:
    checkpoint_records: int = 0
    checkpoint_lsn: int = 0
    replayed: int = 0                   # WAL records applied after the checkpoint
    skipped: int = 0                    # WAL records already covered by the checkpoint
    tail_bytes: int = 0                 # torn tail dropped (writer died mid-record)
    corruption: list = field(default_factory=list)   # (bytes_dropped, reason) from the reader
    seconds: float = 0.0                # the whole open, wall clock
    cpu_seconds: float = 0.0            # the whole open, CPU time of this process
    checkpoint_seconds: float = 0.0     # of which: reading + bulk-loading the checkpoint
    replay_seconds: float = 0.0         # of which: reading + replaying the WAL


class PersistentArtIndex(ArtIndex):
    """ArtIndex whose mutations are logged to a WAL and checkpointed; reopen recovers it.

    ``sync_every``: commit at the end of every mutating call (else call ``sync()``).
    ``checkpoint_wal_bytes``: ``sync()`` takes a checkpoint when this many WAL bytes were
    written since the last one (0 = only explicit ``checkpoint()``).
    ``strict``: refuse (CorruptLog) a WAL with corruption before its tail.
    ``volatile_tiers``: records of these tiers are kept in memory only (never logged, never
    checkpointed): the store passes CPU_DRAM, whose blocks do not outlive the process.
    ``owner``: when set, only that worker's records are logged and checkpointed; the others
    (a pool's records of other nodes, cluster/records.py: soft state, re-announced to a
    restarted home) are kept in memory only.
    """

    name = "art-persistent"
    persistent = True

    def __init__(self, directory, *, sync_every: bool = False,
                 checkpoint_wal_bytes: int = DEFAULT_CHECKPOINT_WAL_BYTES,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, wal_backend: str = "auto",
                 strict: bool = True, volatile_tiers: Iterable[CacheTier] = (),
                 owner: Optional[str] = None) -> None:
        if not isinstance(checkpoint_wal_bytes, int) or checkpoint_wal_bytes < 0:
            raise InvalidArgument(f"checkpoint_wal_bytes {checkpoint_wal_bytes!r}: must be an integer >= 0")
        super().__init__()
        self.directory = os.fspath(directory)
        self.sync_every = bool(sync_every)
        self.volatile_tiers = frozenset(CacheTier.parse(t) for t in volatile_tiers)
        self.owner = owner
        self.checkpoint_wal_bytes = checkpoint_wal_bytes
        self._logging = False
        self._logical_bytes = 0
        self._checkpoint_bytes = 0
        self._checkpoints = 0
        self._ck: Optional[Checkpoint] = None
        t0, c0 = time.perf_counter(), time.process_time()
        os.makedirs(self.directory, exist_ok=True)
        ck_path = os.path.join(self.directory, CHECKPOINT_NAME)
        self.recovery = RecoveryInfo()
        if os.path.exists(ck_path):
            self._load_checkpoint(ck_path)
        # read the log before the writer opens it: the writer cuts everything after the
        # last valid record of the last segment, and strict recovery must see that first
        self._replay(strict)
        self._wal = WalWriter(os.path.join(self.directory, "wal"), segment_bytes=segment_bytes,
                              backend=wal_backend)
        if self._wal.appended_lsn < self.recovery.checkpoint_lsn:
            # new records would get lsns the checkpoint claims to cover and be skipped later
            end = self._wal.appended_lsn
            self._wal.close()
            raise CorruptLog(f"{self.directory}/wal ends at lsn {end:#x}, before the checkpoint's "
                             f"{self.recovery.checkpoint_lsn:#x}: log segments are missing")
        tmp = ck_path + ".tmp"
        if os.path.exists(tmp):
            os.unlink(tmp)              # a checkpoint that never got published (we hold the lock)
        self._wal_bytes_at_checkpoint = self._wal.stats()["bytes_written"]
        self._logging = True
        self.recovery.seconds = time.perf_counter() - t0
        self.recovery.cpu_seconds = time.process_time() - c0

    # ------------------------------------------------------------------ recovery

    def _load_checkpoint(self, path: str) -> None:
        t0 = time.perf_counter()
        ck = read_checkpoint(path)
        self._ck = ck
        G = ck.n_groups
        if G and self._tree.insert_blob(ck.key_blob, ck.key_off) != G:
            raise CorruptCheckpoint(f"{path}: a key appears twice")
        self._slots = LazySlots(G, ck.group_records)
        self._by_block = LazyBlockMap(ck, self._tree)
        self._by_worker = LazyWorkerMap(ck)
        if ck.n_records:
            self._records = ck.n_records
            self._resident_bytes = int(ck.records["bytes"].sum(dtype=np.uint64))
        self.recovery.checkpoint_records = ck.n_records
        self.recovery.checkpoint_lsn = ck.wal_lsn
        self.recovery.checkpoint_seconds = time.perf_counter() - t0

    def _replay(self, strict: bool) -> None:
        waldir = os.path.join(self.directory, "wal")
        if not os.path.isdir(waldir):
            return
        t0 = time.perf_counter()
        if not isinstance(self._slots, LazySlots):
            self._slots = LazySlots(0, None)
            self._by_block = LazyBlockMap(None, self._tree)
            self._by_worker = LazyWorkerMap(None)
        reader = WalReader(waldir)
        after = self.recovery.checkpoint_lsn
        for lsn, payload in reader:
            if lsn <= after:
                self.recovery.skipped += 1
                continue
            try:
                op, ek, arg = decode_record(payload)
                if op == OP_CLEAR:
                    super()._apply_clear()
                    self._ck = None
                elif op == OP_REMOVE:
                    self._raw_remove(ek, arg)
                else:
                    self._raw_put(ek, arg)
            except RECORD_ERRORS as exc:
                reader.corruption.append((len(payload), f"undecodable index record: {exc}"))
                continue
            self.recovery.replayed += 1
        self.recovery.corruption = list(reader.corruption)
        self.recovery.tail_bytes += reader.tail_bytes
        self.recovery.replay_seconds = time.perf_counter() - t0
        if strict and reader.corruption:
            raise CorruptLog(f"{self.directory}/wal: corrupt records before the tail: "
                             f"{reader.corruption} (open with strict=False to drop them)")

    def _raw_group(self, slot: int, ek: bytes) -> Optional[RawGroup]:
        v = list.__getitem__(self._slots, slot)
        if v is COLD:
            v = RawGroup(ek, self._ck.group_rows(slot))
            list.__setitem__(self._slots, slot, v)
            self._slots.cold[slot] = False
            return v
        return v if type(v) is RawGroup else None

    def _raw_put(self, ek: bytes, row: tuple) -> None:
        """Replay a PUT without building model objects (they are built on first access)."""
        slot = self._tree.get(ek)
        worker = row[0]
        if slot is None:
            # structural check only (the WAL's CRC covers the bytes); decoded on first access
            if not ek or ek[0] != KEY_FORMAT_VERSION:
                raise ValueError("encoded key of another format")
            block_hash = block_hash_of(ek).decode("utf-8")    # UTF-8, before anything changes
            slot = self._new_slot(RawGroup(ek, [row]))
            self._tree.insert(ek, slot)
            self._slots.lazy += 1
            self._by_block.note(ek, block_hash)
        else:
            group = None if slot & PACKED else self._raw_group(slot, ek)
            if group is None:               # already decoded (or packed): the ordinary path
                w, t, b, last, ref, pin = row
                super()._apply_put(CacheResidency(key_of(ek), w, TIERS[t], b, last, ref, bool(pin)), ek)
                return
            rows = group.rows
            order = (worker, row[1])
            for i, r in enumerate(rows):
                o = (r[0], r[1])
                if o == order:
                    self._resident_bytes -= r[2]
                    self._records -= 1
                    rows[i] = row
                    break
                if o > order:
                    rows.insert(i, row)
                    break
            else:
                rows.append(row)
        self._records += 1
        self._resident_bytes += row[2]
        self._by_worker.note(worker, ek)

    def _raw_remove(self, ek: bytes, worker: str) -> None:
        slot = self._tree.get(ek)
        if slot is None:
            return
        group = None if slot & PACKED else self._raw_group(slot, ek)
        if group is None:
            super()._apply_remove(ek, worker)
            return
        keep = [r for r in group.rows if r[0] != worker]
        removed = len(group.rows) - len(keep)
        if not removed:
            return
        self._records -= removed
        self._resident_bytes -= sum(r[2] for r in group.rows if r[0] == worker)
        self._by_worker.forget(worker, ek)
        if keep:
            group.rows = keep
        else:
            self._tree.delete(ek)
            self._release_slot(slot)
            self._slots.lazy -= 1
            self._by_block.unnote(ek)

    # ------------------------------------------------------------------ logged state changes

    def _log(self, payload: bytes) -> None:
        self._wal.append(payload)
        self._logical_bytes += len(payload)

    def _apply_put(self, residency: CacheResidency, ek: Optional[bytes] = None) -> None:
        if ek is None:
            ek = encode_key(residency.key)
        if self._logging and self._durable(residency):
            self._log(encode_put_ek(ek, residency))     # validates before anything changes
        super()._apply_put(residency, ek)

    def _apply_remove(self, ek: bytes, worker_id: str) -> int:
        if self._logging:
            tiers = self.holder(ek, worker_id)[1]
            if not tiers:
                return 0
            if any(self._durable_tier(worker_id, t) for t in tiers):
                self._log(encode_remove(ek, worker_id))
        return super()._apply_remove(ek, worker_id)

    def _replace_packed(self, ek, value, key, worker_id, have, tiers, new) -> None:
        if self._logging:       # logged as set_holder's remove and puts would be
            if any(self._durable_tier(worker_id, t) for t in have):
                self._log(encode_remove(ek, worker_id))
            for t in tiers:
                if self._durable_tier(worker_id, t):
                    self._log(encode_put_ek(ek, CacheResidency(key, worker_id, t, new & BYTES_MASK)))
        super()._replace_packed(ek, value, key, worker_id, have, tiers, new)

    def _durable(self, r: CacheResidency) -> bool:
        """Is this record logged and checkpointed (else kept in memory only)?"""
        return self._durable_tier(r.worker_id, r.tier)

    def _durable_tier(self, worker_id: str, tier: CacheTier) -> bool:
        return tier not in self.volatile_tiers and (self.owner is None or worker_id == self.owner)

    def _apply_clear(self) -> None:
        if self._logging:
            self._log(encode_clear())
        super()._apply_clear()
        self._ck = None

    def _after_mutation(self) -> None:
        if self.sync_every:
            self.sync()

    def put(self, residency: CacheResidency) -> None:
        super().put(residency)
        self._after_mutation()

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        n = super().remove_block(scope, worker_id, block_hash)
        if n:
            self._after_mutation()
        return n

    def clear_worker(self, worker_id: str) -> int:
        n = super().clear_worker(worker_id)
        if n:
            self._after_mutation()
        return n

    def clear(self) -> None:
        super().clear()
        self._after_mutation()

    def load_records(self, records: Iterable[CacheResidency]) -> int:
        n = super().load_records(records)    # logged like puts: they must survive a reopen
        self._after_mutation()
        return n

    # ------------------------------------------------------------------ durability

    def sync(self) -> int:
        """Group commit: make every mutation so far durable; returns the durable lsn.
        Takes a checkpoint when checkpoint_wal_bytes of WAL were written since the last."""
        lsn = self._wal.commit()
        if (self.checkpoint_wal_bytes
                and self._wal.stats()["bytes_written"] - self._wal_bytes_at_checkpoint >= self.checkpoint_wal_bytes):
            self.checkpoint()
        return lsn

    commit = sync

    def checkpoint(self) -> int:
        """Snapshot the tree to checkpoint.qck and drop WAL segments it covers; returns
        the checkpoint's size in bytes.  Records not decoded yet are copied undecoded."""
        # everything applied so far must be durable in the log before the checkpoint claims it
        lsn = self._wal.commit()
        final = os.path.join(self.directory, CHECKPOINT_NAME)
        tmp = final + ".tmp"
        try:
            nbytes = write_checkpoint(tmp, lsn, self._checkpoint_groups())
        except BaseException:
            # a failed write or fsync: that file is never published (the old checkpoint and
            # the whole WAL stay as they were)
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        # rename only after the temp file's data is synced (done in write_checkpoint)
        os.replace(tmp, final)
        # the new name must be durable before the WAL segments it replaces are deleted
        fsync_dir(self.directory)
        # last: the log before lsn is now redundant with a durable checkpoint
        self._wal.truncate_before(lsn + 1)
        self._checkpoint_bytes += nbytes
        self._checkpoints += 1
        self._wal_bytes_at_checkpoint = self._wal.stats()["bytes_written"]
        return nbytes

    def _checkpoint_groups(self):
        slots, ck, code, durable = self._slots, self._ck, TIER_CODE, self._durable
        for ek, slot in self._tree.items():
            if slot & PACKED:
                worker, nbytes = self._worker_of(slot), slot & BYTES_MASK
                rows = [(worker, code[t], nbytes, 0, 0, 0) for t in packed_tiers(slot)
                        if self._durable_tier(worker, t)]
                if rows:
                    yield ek, block_hash_of(ek), rows
                continue
            v = list.__getitem__(slots, slot)
            if v is COLD:
                yield ek, block_hash_of(ek), ck.group_rows(slot)
            elif type(v) is RawGroup:
                yield ek, block_hash_of(ek), v.rows
            else:
                rows = [(r.worker_id, code[r.tier], r.bytes, r.last_access_ms, r.ref_count, int(r.pinned))
                        for r in v if durable(r)]
                if rows:                    # a key held only in memory-only records is not persisted
                    yield ek, v[0].key.block_hash.encode("utf-8"), rows

    def _holder_match(self, worker_id: str, tier: CacheTier, slots, lengths):
        """ArtIndex._holder_match without decoding a key: slots still holding their
        checkpoint group are answered from its record table with numpy, replayed ones from
        their rows."""
        all_slots = self._slots
        if not isinstance(all_slots, LazySlots):
            return super()._holder_match(worker_id, tier, slots, lengths)
        ok = np.zeros(len(slots), dtype=bool)
        has = np.zeros(len(slots), dtype=bool)
        found = slots >= 0
        cold = np.zeros(len(slots), dtype=bool)
        ck, G = self._ck, len(all_slots.cold)
        if ck is not None and G:
            cold[found] = slots[found] < G
            cold[cold] = all_slots.cold[slots[cold]]
            count, nbytes, tiers = ck.holder_table(worker_id)
            g = slots[cold]
            has[cold] = count[g] > 0
            ok[cold] = (count[g] == 1) & (tiers[g] == TIER_CODE[tier]) & (nbytes[g] == lengths[cold])
        code = TIER_CODE[tier]
        for i in np.flatnonzero(found & ~cold).tolist():
            value = int(slots[i])
            if value & PACKED:
                if self._worker_of(value) == worker_id:
                    has[i] = True
                    ok[i] = (packed_tiers(value) == (tier,)
                             and value & BYTES_MASK == lengths[i])
                continue
            v = list.__getitem__(all_slots, value)
            if type(v) is RawGroup:
                mine = [(r[1], r[2]) for r in v.rows if r[0] == worker_id]
            else:
                mine = [(TIER_CODE[r.tier], r.bytes) for r in v if r.worker_id == worker_id]
            if mine:
                has[i] = True
                ok[i] = len(mine) == 1 and mine[0] == (code, lengths[i])
        return ok, has

    def _holder_key_count(self, worker_id: str) -> int:
        """ArtIndex._holder_key_count without building the worker's key set."""
        all_slots = self._slots
        if not isinstance(all_slots, LazySlots) or self._by_worker.is_warm(worker_id):
            return super()._holder_key_count(worker_id)
        n = 0
        G = len(all_slots.cold)
        if self._ck is not None and G:
            n = int(np.count_nonzero(self._ck.holder_table(worker_id)[0][all_slots.cold]))
        warm = np.flatnonzero(~all_slots.cold).tolist() + list(range(G, len(all_slots)))
        for s in warm:
            v = list.__getitem__(all_slots, s)
            if v is None or v is COLD:
                continue
            rows = v.rows if type(v) is RawGroup else v
            if any((r[0] if type(v) is RawGroup else r.worker_id) == worker_id for r in rows):
                n += 1
        number = self._numbers.get(worker_id)
        return n + (self._packed[number] if number is not None else 0)   # packed keys have no slot

    def _drop_key_set(self, worker_id: str) -> None:
        if isinstance(self._by_worker, LazyWorkerMap):
            self._by_worker.drop(worker_id)
        else:
            super()._drop_key_set(worker_id)

    def _slot_keys(self, worker_id: str) -> list[bytes]:
        """ArtIndex._slot_keys without decoding a slot: checkpoint groups still cold are
        read from the checkpoint's record table, replayed ones from their rows."""
        all_slots = self._slots
        if not isinstance(all_slots, LazySlots):
            return super()._slot_keys(worker_id)
        out = []
        G = len(all_slots.cold)
        if self._ck is not None and G:
            held = self._ck.holder_table(worker_id)[0] > 0
            out = self._ck.eks_obj[np.flatnonzero(all_slots.cold & held)].tolist()
        for s in np.flatnonzero(~all_slots.cold).tolist() + list(range(G, len(all_slots))):
            v = list.__getitem__(all_slots, s)
            if v is None or v is COLD:
                continue
            if type(v) is RawGroup:
                if any(r[0] == worker_id for r in v.rows):
                    out.append(v.ek)
            elif any(r.worker_id == worker_id for r in v):
                out.append(encode_key(v[0].key))
        return out

    def materialize(self) -> None:
        """Decode every lazily loaded record now (later calls skip the lazy path)."""
        if isinstance(self._slots, LazySlots):
            slots = self._slots
            for _, slot in self._tree.items():
                if not slot & PACKED:
                    slots[slot]
            self._slots = list(slots)
        if isinstance(self._by_block, LazyBlockMap):
            self._by_block = self._by_block.warm_all()
        if isinstance(self._by_worker, LazyWorkerMap):
            self._by_worker = self._by_worker.warm_all()
        self._ck = None

    # ------------------------------------------------------------------ reporting

    @property
    def logical_bytes(self) -> int:
        """Bytes of index records logged by this process (the PUT/REMOVE/CLEAR payloads)."""
        return self._logical_bytes

    @property
    def physical_bytes(self) -> int:
        """WAL bytes (framed, written by this process) + checkpoint bytes written."""
        return self._wal.stats()["bytes_written"] + self._checkpoint_bytes

    @property
    def write_amplification(self) -> float:
        return self.physical_bytes / self._logical_bytes if self._logical_bytes else 0.0

    def metrics(self) -> IndexMetrics:
        m = super().metrics()
        return IndexMetrics(m.resident_blocks, m.resident_bytes, m.puts, m.removes, m.prefix_scans,
                            bytes_written=self.physical_bytes, memory_bytes=m.memory_bytes)

    def stats(self) -> dict:
        return {"wal": self._wal.stats(), "logical_bytes": self._logical_bytes,
                "checkpoint_bytes_written": self._checkpoint_bytes, "checkpoints": self._checkpoints,
                "write_amplification": self.write_amplification,
                "lazy_slots": getattr(self._slots, "lazy", 0)}

    def close(self) -> None:
        """Commit what is pending and release the WAL (and its directory lock)."""
        self._wal.close()

    def __enter__(self) -> "PersistentArtIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
