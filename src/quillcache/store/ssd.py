"""The crash-consistent SSD tier: a preallocated data file, the offset allocator, the WAL.

Layout of a tier directory (docs/ssd-format.md):  ``data.qc`` (the preallocated data file),
``checkpoint`` (a snapshot of the live map), ``wal/`` (the write-ahead log, or ``wal_dir``).

Put: allocate an extent -> write the bytes (O_DIRECT through an aligned bounce buffer when
the filesystem allows it, else buffered) -> the group committer fdatasyncs the data file
once per commit, appends the WAL record (key, offset, length, CRC32C) and commits it ->
only then is the block published and the put acknowledged.  Remove and overwrite free the
old extent only after their record is durable.  Recovery replays checkpoint + WAL
(store/blockmap.py) and rebuilds the allocator in one sweep; the checkpoint's blocks stay
rows of columns until first touched (no object per block at open); blocks whose bytes do
not match their CRC are dropped (eagerly at open, or lazily at the first read: ``verify``).

Construction is synchronous and recovers (``SsdTier(...)``); ``await SsdTier.open(...)``
runs the same in a thread.  Async methods must run on one event loop.

This module is the tier (construction, puts, removes, reads, reporting, close); its parts:
store/ssdfile.py (the data file: open, write an extent, sync), store/ssdrecover.py
(recovery and checkpoints), store/ssdread.py (reads off the event loop), store/blockmap.py
(the WAL records, the checkpoint file and the replay), store/commit.py (the group commit).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
from typing import Iterator, Optional

import numpy as np

from quillcache.fsutil import fsync_dir
from quillcache._native.alloc import MAX_UNITS, OffsetAllocator
from quillcache._native.crc import crc32c  # any contiguous buffer, in place, GIL released when large
from quillcache._native.wal import WAL_SEGMENT_BYTES, WalWriter
from quillcache.errors import InvalidArgument, NotFound, ReadOnlyError
from quillcache.model import KvBlockKey, decode_key, encode_key
from quillcache.store.blockmap import (  # read_checkpoint, Replay, CorruptCheckpoint: re-exported
    ANY_OFFSET, REASON_CRC, REASON_RECOVERY, REASON_REMOVE, BlockMap, CorruptCheckpoint, Replay,
    encode_put, encode_remove, read_checkpoint,
)
from quillcache.store.commit import GroupCommitter
from quillcache.store.ssdfile import BouncePool, Extent, SsdDataFile
from quillcache.store.ssdrecover import SsdRecovery
from quillcache.store.ssdread import READ_BACKENDS, READ_THREADS, SsdReader, read_and_check  # noqa: F401 (READ_THREADS re-exported)

__all__ = ["SsdTier", "crc32c", "DATA_NAME", "CHECKPOINT_NAME", "WAL_DIR_NAME", "CorruptCheckpoint",
           "read_checkpoint", "Replay"]

log = logging.getLogger("quillcache.store.ssd")

# ---- format and tunables (docs/ssd-format.md; records and checkpoint: store/blockmap.py) -------
DATA_NAME = "data.qc"
CHECKPOINT_NAME = "checkpoint"
WAL_DIR_NAME = "wal"
__all__ += ["ANY_OFFSET", "REASON_CRC", "REASON_RECOVERY", "REASON_REMOVE", "encode_put", "encode_remove"]

DEFAULT_UNIT = 4096               # bytes: allocation unit and O_DIRECT alignment
DEFAULT_MAX_BLOCK = 64 << 20      # bytes: largest block accepted by put
MAX_BLOCK_LIMIT = 1 << 30         # bytes: largest max_block_bytes (length is a u32 in records)
MAX_KEY_BYTES = 65535             # bytes: an encoded key (u16 length in records)
DEFAULT_CHECKPOINT_RECORDS = 65536       # WAL records between periodic checkpoints
DEFAULT_CHECKPOINT_WAL_BYTES = 64 << 20  # WAL bytes between periodic checkpoints


class SsdTier(SsdDataFile, SsdRecovery):
    """SsdTier(path_or_dir, capacity, *, wal_dir=None, unit=4096, direct_io=True, verify="lazy",
    commit_window_s=0.001, sync="group", wal_backend="auto", segment_bytes=WAL_SEGMENT_BYTES,
    max_block_bytes=min(64 MiB, capacity), max_blocks=None, checkpoint_records=65536,
    checkpoint_wal_bytes=64 MiB, read_backend="auto")

    ``path_or_dir``: a directory (data file ``data.qc``, ``checkpoint``, WAL in ``wal/``) or the
    path of the data file itself (then ``wal_dir`` is required; the checkpoint sits beside it
    as ``<path>.checkpoint``).  The constructor recovers; ``await SsdTier.open(...)`` does the
    same in a thread.
    """

    def __init__(self, path_or_dir, capacity: int, *, wal_dir=None, unit: int = DEFAULT_UNIT,
                 direct_io: bool = True, verify: str = "lazy", commit_window_s: float = 0.001,
                 sync: str = "group", wal_backend: str = "auto", segment_bytes: int = WAL_SEGMENT_BYTES,
                 max_block_bytes: Optional[int] = None, max_blocks: Optional[int] = None,
                 checkpoint_records: int = DEFAULT_CHECKPOINT_RECORDS,
                 checkpoint_wal_bytes: int = DEFAULT_CHECKPOINT_WAL_BYTES, read_backend: str = "auto") -> None:
        # -- every limit checked before anything is created
        if read_backend not in READ_BACKENDS:
            raise InvalidArgument(f"read_backend must be one of {', '.join(READ_BACKENDS)}, got {read_backend!r}")
        if verify not in ("lazy", "eager"):
            raise InvalidArgument(f"verify must be 'lazy' or 'eager', got {verify!r}")
        if sync not in ("group", "always"):
            raise InvalidArgument(f"sync must be 'group' or 'always', got {sync!r}")
        if not isinstance(unit, int) or unit < 1 or unit & (unit - 1) or unit > (1 << 30):
            raise InvalidArgument(f"unit must be a power of two in [1, 2**30] bytes, got {unit!r}")
        if not isinstance(capacity, int) or capacity <= 0 or capacity % unit:
            raise InvalidArgument(f"capacity must be a positive multiple of unit ({unit} bytes), got {capacity!r}")
        if capacity // unit > MAX_UNITS:
            raise InvalidArgument(f"capacity {capacity} is more than {MAX_UNITS} units of {unit} bytes")
        if max_block_bytes is None:
            max_block_bytes = min(DEFAULT_MAX_BLOCK, capacity)
        if not isinstance(max_block_bytes, int) or not 1 <= max_block_bytes <= min(MAX_BLOCK_LIMIT, capacity):
            raise InvalidArgument(f"max_block_bytes must be in [1, min({MAX_BLOCK_LIMIT}, capacity)], "
                                  f"got {max_block_bytes!r}")
        if checkpoint_records < 1 or checkpoint_wal_bytes < 1:
            raise InvalidArgument("checkpoint_records and checkpoint_wal_bytes must be >= 1")
        path = os.fspath(path_or_dir)
        if os.path.isdir(path) or not os.path.splitext(path)[1]:
            self.directory = path
            self.data_path = os.path.join(path, DATA_NAME)
            self.checkpoint_path = os.path.join(path, CHECKPOINT_NAME)
            wal_dir = os.fspath(wal_dir) if wal_dir is not None else os.path.join(path, WAL_DIR_NAME)
        else:
            if wal_dir is None:
                raise InvalidArgument(f"{path} names a data file: wal_dir is required")
            self.directory = os.path.dirname(os.path.abspath(path))
            self.data_path = path
            self.checkpoint_path = path + ".checkpoint"
            wal_dir = os.fspath(wal_dir)
        self.wal_dir = wal_dir
        self.capacity = capacity
        self.unit = unit
        self.verify = verify
        self.max_block_bytes = max_block_bytes
        self.checkpoint_records = checkpoint_records
        self.checkpoint_wal_bytes = checkpoint_wal_bytes
        # encoded key -> entry of every block written, read or replayed in this process; the
        # blocks recovered from the checkpoint and not touched since stay rows of _cold
        # (columns, no object per block) with their allocator handles in _cold_handles
        self._map: dict[bytes, Extent] = {}
        self._cold = BlockMap()
        self._cold_handles = np.zeros(0, np.uint64)
        self._inflight: collections.Counter = collections.Counter()
        self._fd = self._rfd = -1
        self._bounce: Optional[BouncePool] = None
        self._closed = False
        self._failed: Optional[ReadOnlyError] = None
        self._ckpt_base_records = 0     # committed WAL records at the last checkpoint
        self._ckpt_wal_bytes = 0        # WAL bytes written at the last checkpoint
        self._ckpt_task: Optional[asyncio.Task] = None
        self._reads: Optional[SsdReader] = None          # reads off the event loop (store/ssdread.py)
        self._counters = dict.fromkeys(
            ("puts", "removes", "reads", "crc_failures", "recovered_blocks", "dropped_blocks",
             "wal_corrupt_bytes", "wal_tail_bytes", "checkpoints", "data_syncs"), 0)
        self.recovery_seconds = 0.0

        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            # the directory's name must be durable before the files in it are
            fsync_dir(os.path.dirname(os.path.abspath(self.directory)))
        # the WAL first: its flock makes this the only tier on the directory, and it cuts a
        # torn tail (never acknowledged) before we read the log
        self._wal = WalWriter(wal_dir, segment_bytes=segment_bytes, backend=wal_backend)
        try:
            self._counters["wal_tail_bytes"] = self._wal.recovered_tail_bytes
            self._open_data(direct_io)
            self._reads = SsdReader(self._rfd, read_backend)
            self._committer = GroupCommitter(self._wal, window_s=commit_window_s, sync=sync,
                                             before_commit=self._sync_data,
                                             after_batch=self._after_batch)
            self._recover(max_blocks)
        except BaseException:
            self._close_files()
            raise

    @classmethod
    async def open(cls, path_or_dir, capacity: int, **kwargs) -> "SsdTier":
        """Construct (and recover) in a thread so the event loop keeps serving."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(cls, path_or_dir, capacity, **kwargs))

    # ---- settings changed at run time --------------------------------------------------------------
    def set_commit_window(self, seconds: float) -> None:
        """The group commit's window (``[wal] commit_window``) for the commits that start from now."""
        if not 0 <= seconds <= 1.0:
            raise InvalidArgument(f"commit window {seconds!r}: must be in [0, 1] seconds")
        c = self._committer
        c.window_s = 0.0 if c.sync == "always" else float(seconds)   # sync=always commits each put alone

    # ---- writes ----------------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self._closed:
            raise InvalidArgument("the SSD tier is closed")
        if self._failed is not None:
            raise ReadOnlyError(str(self._failed))
        if self._committer.failed is not None:
            raise ReadOnlyError(f"the SSD tier is read-only after an earlier failure: {self._committer.failed}")

    def _check_put(self, key: KvBlockKey, data):
        self._check_writable()
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key must be a KvBlockKey, got {type(key).__name__}")
        kb = encode_key(key)
        if len(kb) > MAX_KEY_BYTES:
            raise InvalidArgument(f"encoded key is {len(kb)} bytes: at most {MAX_KEY_BYTES}")
        mv = memoryview(data)
        if not mv.contiguous:
            raise InvalidArgument("data must be a contiguous buffer")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        if not 1 <= n <= self.max_block_bytes:
            raise InvalidArgument(f"block of {n} bytes: must be 1..{self.max_block_bytes} bytes (max_block_bytes)")
        return kb, mv

    async def put(self, key: KvBlockKey, data) -> None:
        """Store ``data`` under ``key``; returns when it is durable and published."""
        kb, mv = self._check_put(key, data)
        alloc = self._allocator.allocate(len(mv))     # CapacityError when full: nothing changed
        # shielded: a cancelled caller must not leave an extent half-owned
        await asyncio.shield(self._put(key, kb, mv, alloc))

    async def _put(self, key, kb, mv, alloc) -> None:
        loop = asyncio.get_running_loop()
        self._inflight[key] += 1
        try:
            try:
                crc = await loop.run_in_executor(None, self._write_extent, mv, alloc.offset)
            except BaseException:
                self._allocator.free(alloc.handle)    # no record points at it: reusable now
                raise
            entry = Extent(kb, alloc.offset, len(mv), crc, alloc.handle, verified=True)
            # data before metadata: the record is appended only after the bytes were written,
            # and the committer fdatasyncs the data file before it commits the record
            await self._committer.submit(encode_put(kb, alloc.offset, len(mv), crc),
                                         functools.partial(self._apply_put, entry), data_sync=True)
        finally:
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]

    def _apply_put(self, entry: Extent, lsn: int) -> None:
        entry.lsn = lsn
        old = self._warm(entry.kb)
        self._map[entry.kb] = entry          # published only now: the record is durable
        if old is not None:
            self._free_extent(old)            # the new record is durable: no recovery points at old
        self._counters["puts"] += 1

    def put_sync(self, key: KvBlockKey, data) -> None:
        """Blocking put for tools and tests (no event loop; do not mix with concurrent async puts)."""
        kb, mv = self._check_put(key, data)
        alloc = self._allocator.allocate(len(mv))
        try:
            crc = self._write_extent(mv, alloc.offset)
        except BaseException:
            self._allocator.free(alloc.handle)
            raise
        entry = Extent(kb, alloc.offset, len(mv), crc, alloc.handle, verified=True)
        lsn = self._committer.commit_now([encode_put(kb, alloc.offset, len(mv), crc)], data_sync=True)
        self._apply_put(entry, lsn)
        self._committer.applied_lsn = lsn

    async def remove(self, key: KvBlockKey) -> bool:
        """Remove the block; True if it was there.  The extent is freed once the record is durable."""
        self._check_writable()
        kb = encode_key(key)
        if self._warm(kb) is None and not self._inflight.get(key):
            return False
        rec = encode_remove(kb)
        return await asyncio.shield(self._committer.submit(rec, functools.partial(self._apply_remove, kb)))

    def remove_sync(self, key: KvBlockKey) -> bool:
        self._check_writable()
        kb = encode_key(key)
        if self._warm(kb) is None:
            return False
        lsn = self._committer.commit_now([encode_remove(kb)], data_sync=False)
        self._committer.applied_lsn = lsn
        return self._apply_remove(kb, lsn)

    def _apply_remove(self, kb: bytes, lsn: int) -> bool:
        e = self._warm(kb)
        if e is None:
            return False
        del self._map[kb]
        self._free_extent(e)                 # the remove record is durable: nothing points here now
        self._counters["removes"] += 1
        return True

    def _drop(self, key: KvBlockKey, entry: Extent, why: str) -> None:
        """Unpublish a block whose bytes are bad; free its extent once the drop record is durable."""
        if self._map.get(entry.kb) is entry:
            del self._map[entry.kb]
        self._counters["crc_failures"] += 1
        self._counters["dropped_blocks"] += 1
        log.error("SSD block %r at offset %d (%d bytes) dropped: %s", key, entry.offset, entry.length, why)
        rec = encode_remove(entry.kb, entry.offset, REASON_CRC)

        def free(lsn: int) -> None:
            self._free_extent(entry)

        if self._committer.failed is not None or self._failed is not None or self._closed:
            return                            # read-only: leave the extent allocated (never reused)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._committer.submit_nowait(rec, free).add_done_callback(_ignore_result)
        else:
            try:
                lsn = self._committer.commit_now([rec], data_sync=False)
            except ReadOnlyError:
                return
            free(lsn)

    # ---- reads ----------------------------------------------------------------------------------------
    def _free_extent(self, e: Extent) -> None:
        """Give an unpublished block's extent back, or mark it so that its last reader does."""
        e.freed = True
        if not e.readers:
            self._allocator.free(e.handle)

    def _read_target(self, key: KvBlockKey, buffer):
        """(entry, destination view of its length) for a read; the checks of every read."""
        if self._closed:
            raise InvalidArgument("the SSD tier is closed")
        e = self._warm(encode_key(key))
        if e is None:
            raise NotFound(f"block not on the SSD tier: {key}")
        mv = memoryview(buffer)
        if mv.readonly:
            raise InvalidArgument("read_into needs a writable buffer")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if len(mv) < e.length:
            raise InvalidArgument(f"buffer of {len(mv)} bytes is smaller than the {e.length}-byte block")
        return e, mv[:e.length]

    def _read_done(self, key: KvBlockKey, e: Extent, why: str) -> int:
        if why:
            self._drop(key, e, why)
            raise NotFound(f"block {key} failed verification on the SSD tier and was dropped")
        e.verified = True
        self._counters["reads"] += 1
        return e.length

    def read_into(self, key: KvBlockKey, buffer) -> int:
        """Read the block into ``buffer`` (verifying its CRC32C every time); return its length.

        Blocking (tools, tests, recovery): the daemon reads with ``read_into_async``.
        NotFound if absent or if its bytes do not match the CRC (then it is dropped and counted,
        and the buffer's first ``length`` bytes are zeroed: bad bytes are never handed out)."""
        e, dst = self._read_target(key, buffer)
        return self._read_done(key, e, read_and_check(self._rfd, dst, e.offset, e.crc))

    async def read_into_async(self, key: KvBlockKey, buffer) -> int:
        """``read_into`` off the event loop: through io_uring, completed on the loop, or in
        the tier's read pool where io_uring is refused (store/ssdread.py); the extent is
        kept from reuse until the read ends.

        A block removed or replaced meanwhile was read from its old extent, still intact:
        its bytes are those of the version that was current when the read started."""
        e, dst = self._read_target(key, buffer)
        e.readers += 1
        try:
            why = await self._reads.read_extent(dst, e.offset, e.crc)
        finally:
            e.readers -= 1
            if e.freed and not e.readers and not self._closed:
                self._allocator.free(e.handle)
        if why and self._map.get(e.kb) is not e:
            raise NotFound(f"block not on the SSD tier: {key}")
        return self._read_done(key, e, why)

    def read_view(self, key: KvBlockKey) -> memoryview:
        """The block's verified bytes in a new buffer."""
        size = self.size_of(key)
        if size is None:
            raise NotFound(f"block not on the SSD tier: {key}")
        buf = bytearray(size)
        self.read_into(key, buf)
        return memoryview(buf)

    def extent_of(self, key: KvBlockKey):
        """(fd, offset, length, crc32c) for sendfile, or None when absent, not verified yet,
        or when this tier does not write with O_DIRECT.

        Only blocks whose bytes were checked (written by this process, verified at recovery
        or by a read) are offered: call read_into once first.  A sendfile copy is not checked
        again here: send ``crc32c`` along (the protocol's payload CRC trailer) so that the
        receiver does.  The extent stays valid until the key is removed or overwritten (which
        can happen at the caller's next await); read it within one synchronous step.

        sendfile queues references to page-cache pages, not copies, and a reply can sit unread
        in socket buffers long after the extent was freed and given to another block.  An
        O_DIRECT write drops the old pages from the cache (the reply keeps them, unchanged);
        a buffered write would overwrite them under the reply.  So without O_DIRECT no extent
        is offered and callers read (copy) the bytes instead."""
        if self._closed or not self.direct_io:
            return None
        e = self._map.get(encode_key(key))        # a block not touched yet is not verified
        if e is None or not e.verified:
            return None
        return (self._rfd, e.offset, e.length, e.crc)

    def contains(self, key: KvBlockKey) -> bool:
        return self.size_of(key) is not None

    def __contains__(self, key) -> bool:
        return isinstance(key, KvBlockKey) and self.size_of(key) is not None

    def size_of(self, key: KvBlockKey) -> Optional[int]:
        """The block's length, or None when absent (a recovered block stays untouched)."""
        kb = encode_key(key)
        e = self._map.get(kb)
        if e is not None:
            return e.length
        row = self._cold.row_of(kb) if self._cold.rows_alive else -1
        return None if row < 0 else int(self._cold.length[row])

    def crc_of(self, kb: bytes) -> Optional[int]:
        """The CRC32C recorded when the block under encoded key ``kb`` was written, or None
        when absent; a recovered block stays untouched (the cluster announces it with this)."""
        e = self._map.get(kb)
        if e is not None:
            return e.crc
        row = self._cold.row_of(kb) if self._cold.rows_alive else -1
        return None if row < 0 else int(self._cold.crc[row])

    def keys(self) -> list:
        """Every published key (decodes each: tools and tests)."""
        return [decode_key(kb) for kb in self._encoded_keys()]

    def _encoded_keys(self) -> list:
        return list(self._map) + list(self._cold)

    def __len__(self) -> int:
        return len(self._map) + self._cold.rows_alive

    @property
    def read_backend(self) -> str:
        """How reads leave the event loop: "io_uring" or "pool" (store/ssdread.py)."""
        return self._reads.backend if self._reads is not None else "closed"

    @property
    def untouched(self) -> int:
        """Blocks recovered at open and not touched since (no entry object made yet)."""
        return self._cold.rows_alive

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def allocator(self) -> OffsetAllocator:
        return self._allocator

    def block_table(self) -> tuple:
        """(key blob, key_off, lengths) of every published block, encoded key i being
        ``blob[key_off[i]:key_off[i + 1]]``: what the store checks its index against at
        start, without an object per block."""
        blob, key_off, _offset, length, _crc, _lsn = self._cold.live_table()
        if not self._map:
            return blob, key_off, length
        hot = list(self._map.values())
        kbs = b"".join(e.kb for e in hot)
        ends = np.cumsum([len(e.kb) for e in hot], dtype=np.uint64) + key_off[-1]
        return (bytes(blob) + kbs, np.concatenate((key_off, ends)),
                np.concatenate((length, np.fromiter((e.length for e in hot), np.uint32, len(hot)))))

    def entries(self) -> Iterator[tuple]:
        """(key, offset, length, crc) of every published block (tools and the crash checker)."""
        for kb in self._encoded_keys():
            e = self._map.get(kb)
            if e is not None:
                yield decode_key(kb), e.offset, e.length, e.crc
            else:
                off, length, crc, _ = self._cold.row(self._cold.row_of(kb))
                yield decode_key(kb), off, length, crc

    def stats(self) -> dict:
        ws = self._wal.stats() if not self._wal.closed else {"bytes_written": 0, "backend": self._wal.backend}
        puts = self._counters["puts"]
        return {"blocks": len(self), "bytes": sum(e.length for e in self._map.values()) + self._cold.live_bytes(),
                "untouched_blocks": self._cold.rows_alive,
                "used": self.used, "capacity": self.capacity, **self._counters,
                "wal_backend": ws["backend"], "direct_io": self.direct_io, "verify": self.verify,
                "commits": self._committer.commits, **self._committer.latency(),
                "wal_bytes_per_put": round(ws["bytes_written"] / puts, 1) if puts else 0.0,
                "recovery_seconds": round(self.recovery_seconds, 6),
                **(self._reads.stats() if self._reads is not None else {"read_backend": "closed"}),
                "read_only": self._failed is not None or self._committer.failed is not None}

    # ---- close -------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Commit what is queued, checkpoint (unless read-only), close the files."""
        if self._closed:
            return
        await self._committer.close()
        self._closed = True
        self._finish()

    def close_sync(self) -> None:
        if self._closed:
            return
        if self._committer.running:
            raise InvalidArgument("the committer is running: use 'await close()'")
        self._closed = True
        self._finish()

    def _finish(self) -> None:
        try:
            if self._failed is None and self._committer.failed is None and not self._wal.failed:
                self._write_checkpoint(self._snapshot(), self._committer.applied_lsn)
        finally:
            self._close_files()

    def __repr__(self) -> str:
        return (f"<SsdTier {self.directory!r} blocks={len(self)} used={self.used if not self._closed else '-'}"
                f" capacity={self.capacity} direct_io={self.direct_io}>")


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
