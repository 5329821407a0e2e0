"""Recovery and checkpoints of the SSD tier (store/ssd.py): the checkpoint + WAL replay
(store/blockmap.py) rebuilt into the allocator in one sweep, the checkpoint's blocks kept as
columns until first touched (``_warm``), overlapping extents resolved newest-first, eager
CRC verification; the periodic checkpoint (temp file, fsync, rename, fsync dir, then the
WAL it covers is dropped).

A mixin of ``SsdTier``, whose ``__init__`` makes the state it reads.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from typing import Optional

import numpy as np

from quillcache import faults
from quillcache.errors import InvalidArgument
from quillcache.fsutil import fsync_dir, pread_full
from quillcache._native.alloc import OffsetAllocator
from quillcache._native.crc import crc32c  # any contiguous buffer, in place, GIL released when large
from quillcache._native.wal import WalReader
from quillcache.model import KEY_FORMAT_VERSION
from quillcache.store.blockmap import (
    REASON_CRC, REASON_RECOVERY, BlockMap, Replay, encode_remove, read_checkpoint, write_checkpoint,
)
from quillcache.store.ssdfile import Extent

__all__ = ["SsdRecovery", "CHECKPOINT_TMP", "VERIFY_CHUNK"]

log = logging.getLogger("quillcache.store.ssd")

CHECKPOINT_TMP = "checkpoint.tmp"
VERIFY_CHUNK = 8 << 20            # bytes: read size of eager verification


class SsdRecovery:
    """Recovery at open, and checkpoints."""

    def _load_checkpoint(self):
        tmp = os.path.join(os.path.dirname(self.checkpoint_path), CHECKPOINT_TMP)
        if os.path.exists(tmp):
            os.unlink(tmp)                  # a checkpoint that never got renamed: not ours to use
        lsn, unit, entries = read_checkpoint(self.checkpoint_path)
        if unit is not None and unit != self.unit:
            raise InvalidArgument(f"checkpoint {self.checkpoint_path} was written with unit={unit}, "
                                  f"opened with unit={self.unit}")
        return lsn, entries

    def _recover(self, max_blocks: Optional[int]) -> None:
        t0 = time.perf_counter()
        ckpt_lsn, table = self._load_checkpoint()
        reader = WalReader(self.wal_dir)
        replay = Replay(ckpt_lsn, table)
        for lsn, payload in reader:
            replay(lsn, payload)
        replayed = replay.replayed
        for lsn, nbytes, why in replay.malformed:
            log.error("WAL record at lsn %#x is malformed (%s): skipped", lsn, why)
            self._counters["wal_corrupt_bytes"] += nbytes
        for nbytes, reason in reader.corruption:
            log.error("WAL %s: %d bytes dropped (%s)", self.wal_dir, nbytes, reason)
            self._counters["wal_corrupt_bytes"] += nbytes
        self.wal_corruption = list(reader.corruption)
        self._allocator = OffsetAllocator(self.capacity, self.unit, max_blocks)
        drops = self._rebuild(table)         # (kb, offset, reason, handle or None)
        if self.verify == "eager":
            self._verify_all(drops)
        if drops:
            recs = [encode_remove(kb, off, reason) for kb, off, reason, _ in drops]
            self._committer.commit_now(recs, data_sync=False)
            # the drop records are durable: only now can the extents be reused
            for _, _, _, handle in drops:
                if handle is not None:
                    self._allocator.free(handle)
            self._counters["dropped_blocks"] += len(drops)
        self._committer.applied_lsn = self._wal.durable_lsn
        faults.killpoint("mid_recovery")
        if replayed or drops:
            self._write_checkpoint(self._snapshot(), self._wal.durable_lsn)
        self._counters["recovered_blocks"] = len(self)
        self.recovery_seconds = time.perf_counter() - t0
        log.info("SSD tier %s recovered: %d blocks, %d dropped, %d WAL records replayed in %.3f s",
                 self.directory, len(self), len(drops), replayed, self.recovery_seconds)

    def _rebuild(self, table: BlockMap) -> list:
        """The allocator and the map from the recovered ``table`` (checkpoint rows + what the
        WAL changed after it), without an object per checkpoint row: the rows stay columns
        (``_cold``) until a block is first touched.  Returns the blocks it could not keep."""
        changed = list(table.changed.items())
        table.changed = {}
        rows = np.flatnonzero(table.alive)
        # every extent: the live checkpoint rows, then the changed entries
        n_rows = len(rows)
        offset = np.concatenate((table.offset[rows], np.fromiter((v[0] for _, v in changed), np.uint64, len(changed))))
        length = np.concatenate((table.length[rows], np.fromiter((v[1] for _, v in changed), np.uint32, len(changed))))
        lsn = np.concatenate((table.lsn[rows], np.fromiter((v[3] for _, v in changed), np.uint64, len(changed))))
        unit = self.unit
        end = offset + (length.astype(np.uint64) + (unit - 1)) // unit * unit
        if len(end) and int(end.max()) > self.capacity:
            i = int(np.argmax(end))
            raise InvalidArgument(f"capacity {self.capacity} is smaller than the existing data in "
                                  f"{self.data_path} (an extent ends at {int(offset[i]) + int(length[i])}): open "
                                  f"it with a capacity of at least {int(end[i])}")
        kb_of = (lambda i: table.key_of(int(rows[i])) if i < n_rows else changed[i - n_rows][0])
        version_ok = np.ones(len(offset), dtype=bool)
        if n_rows:
            version_ok[:n_rows] = np.frombuffer(table.blob, np.uint8)[
                table.key_off[:-1][rows].astype(np.int64)] == KEY_FORMAT_VERSION
        for i, (kb, _) in enumerate(changed):
            version_ok[n_rows + i] = bool(kb) and kb[0] == KEY_FORMAT_VERSION
        bad = (offset % unit != 0) | (length == 0) | ~version_ok
        drops = []                           # (kb, offset, reason, handle or None)
        for i in np.flatnonzero(bad).tolist():
            log.error("recovery: block at offset %d (%d bytes) dropped: %s", int(offset[i]), int(length[i]),
                      "not an encoded key of this format" if not version_ok[i] else
                      f"unaligned or empty extent ({int(offset[i])}, {int(length[i])})")
            drops.append((kb_of(i), int(offset[i]), REASON_RECOVERY, None))
        order = np.argsort(offset, kind="stable")      # rows are in offset order: linear
        order = order[~bad[order]]
        keep = self._resolve_overlaps(order, offset, end, lsn)
        for i in np.setdiff1d(order, keep, assume_unique=True).tolist():
            log.error("recovery: block at offset %d (%d bytes) dropped: it overlaps a newer block",
                      int(offset[i]), int(length[i]))
            drops.append((kb_of(i), int(offset[i]), REASON_RECOVERY, None))
        handles = np.zeros(len(offset), np.uint64)
        kept_handles = np.zeros(len(keep), np.uint64)
        self._allocator.reserve_many(np.ascontiguousarray(offset[keep]), length[keep].astype(np.uint64),
                                     kept_handles)            # ascending offsets: one sweep
        handles[keep] = kept_handles
        kept = np.zeros(len(offset), dtype=bool)
        kept[keep] = True
        for i in np.flatnonzero(~kept[:n_rows]).tolist():
            table.kill(int(rows[i]))
        self._cold = table
        self._cold_handles = np.zeros(table.rows, np.uint64)
        self._cold_handles[rows] = handles[:n_rows]
        for i, (kb, (off, n, crc, elsn)) in enumerate(changed):
            if kept[n_rows + i]:
                self._map[kb] = Extent(kb, off, n, crc, int(handles[n_rows + i]), elsn)
        return drops

    @staticmethod
    def _resolve_overlaps(order, offset, end, lsn):
        """The extents to keep, ascending by offset: where a lost record left blocks claiming
        the same bytes, the newer (higher lsn) keeps them and the older is dropped."""
        if len(order) < 2:
            return order
        off, e = offset[order], end[order]
        reach = np.maximum.accumulate(e)
        clash = np.concatenate(([False], off[1:] < reach[:-1]))   # overlaps an earlier extent
        if not clash.any():
            return order
        group = np.cumsum(~clash)                   # runs of mutually reachable extents
        keep = ~np.isin(group, group[clash])        # alone in their run: kept as they are
        for g in np.unique(group[clash]).tolist():
            members = np.flatnonzero(group == g)
            taken: list[tuple[int, int]] = []
            for m in sorted(members.tolist(), key=lambda m: -int(lsn[order[m]])):   # newest first
                a, b = int(off[m]), int(e[m])
                if all(b <= x or a >= y for x, y in taken):
                    taken.append((a, b))
                    keep[m] = True
        return order[keep]

    def _warm(self, kb: bytes) -> Optional[Extent]:
        """The entry of kb: in the map, or made from its checkpoint row (first touch)."""
        e = self._map.get(kb)
        if e is None and self._cold.rows_alive:
            row = self._cold.row_of(kb)
            if row >= 0:
                off, length, crc, elsn = self._cold.row(row)
                e = self._map[kb] = Extent(kb, off, length, crc, int(self._cold_handles[row]), elsn)
                self._cold.kill(row)
        return e

    def _warm_all(self) -> None:
        for kb in list(self._cold):
            self._warm(kb)

    def _verify_all(self, drops: list) -> None:
        self._warm_all()
        buf = bytearray(min(VERIFY_CHUNK, max(self.max_block_bytes, 1)))
        bmv = memoryview(buf)
        for kb, e in sorted(self._map.items(), key=lambda kv: kv[1].offset):
            crc = 0
            done = 0
            ok = True
            while done < e.length:
                k = min(len(buf), e.length - done)
                if pread_full(self._rfd, bmv[:k], e.offset + done) != k:
                    ok = False
                    break
                crc = crc32c(bmv[:k], crc)
                done += k
            if ok and crc == e.crc:
                e.verified = True
                continue
            log.error("recovery: block %r at offset %d failed its CRC check: dropped", kb, e.offset)
            self._counters["crc_failures"] += 1
            del self._map[kb]
            drops.append((e.kb, e.offset, REASON_CRC, e.handle))

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _snapshot(self):
        """The published map now (on the loop): the live checkpoint rows (a copy of which are
        live; the columns never change) and an entry tuple for every block in the map."""
        cold = copy.copy(self._cold)
        cold.alive = self._cold.alive.copy()
        return cold, [(e.kb, e.offset, e.length, e.crc, e.lsn) for e in self._map.values()]

    def _write_checkpoint(self, snapshot, lsn: int) -> None:
        """Snapshot -> temp file, fsync, rename, fsync dir, then drop the WAL segments it covers."""
        cold, hot = snapshot
        d = os.path.dirname(self.checkpoint_path)
        tmp = os.path.join(d, CHECKPOINT_TMP)
        write_checkpoint(tmp, self.unit, self.capacity, lsn, cold.live_table(), hot)
        faults.killpoint("mid_checkpoint")
        os.rename(tmp, self.checkpoint_path)  # atomic: a crash leaves the old or the new one
        fsync_dir(d)                        # the rename is durable before the WAL it covers goes
        self._wal.truncate_before(lsn + 1)   # only records with lsn <= the checkpoint's are covered
        self._ckpt_base_records = self._committer.records
        self._ckpt_wal_bytes = self._wal.stats()["bytes_written"]
        self._counters["checkpoints"] += 1

    async def _after_batch(self, lsn: int) -> None:
        wal_bytes = self._wal.stats()["bytes_written"] - self._ckpt_wal_bytes
        if (self._committer.records - self._ckpt_base_records >= self.checkpoint_records
                or wal_bytes >= self.checkpoint_wal_bytes):
            await self.checkpoint()

    async def checkpoint(self) -> None:
        """Write a checkpoint of the published state now (on the commit thread)."""
        snapshot = self._snapshot()
        lsn = self._committer.applied_lsn    # every record <= lsn is reflected in the snapshot
        try:
            await self._committer.run_in_thread(self._write_checkpoint, snapshot, lsn)
        except OSError as exc:
            log.error("checkpoint of %s failed: %s (the WAL still holds everything)", self.directory, exc)
            return
