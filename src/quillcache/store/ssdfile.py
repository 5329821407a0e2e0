"""The SSD tier's data file (store/ssd.py): opening it (O_DIRECT where the filesystem
allows it, proved by an aligned read), writing an extent (through page-aligned bounce
buffers under O_DIRECT), the fdatasync before each group commit, closing.  A block's place
in it is an ``Extent``.

A mixin of ``SsdTier``, whose ``__init__`` makes the state it reads (``data_path``,
``capacity``, ``unit``, ``max_block_bytes``, ``_wal``, ``_reads``, ``_counters``).
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

from quillcache import faults
from quillcache.errors import ReadOnlyError
from quillcache.fsutil import fsync_dir
from quillcache._native.crc import crc32c  # any contiguous buffer, in place, GIL released when large

__all__ = ["Extent", "BouncePool", "SsdDataFile", "round_up", "MIN_DIRECT_UNIT", "BOUNCE_BYTES", "BOUNCE_BUFFERS"]

MIN_DIRECT_UNIT = 512             # bytes: smallest unit usable with O_DIRECT
BOUNCE_BYTES = 4 << 20            # bytes per O_DIRECT bounce buffer (a larger block goes in pieces)
BOUNCE_BUFFERS = 4                # bounce buffers in the mmap'd pool (writes in flight at once)


class Extent:
    """A block of the tier: its encoded key, where its bytes are in the data file, their
    CRC32C, its allocator handle and the lsn of its record."""

    __slots__ = ("kb", "offset", "length", "crc", "handle", "lsn", "verified", "readers", "freed")

    def __init__(self, kb, offset, length, crc, handle, lsn=0, verified=False):
        self.kb = kb
        self.offset = offset
        self.length = length
        self.crc = crc
        self.handle = handle
        self.lsn = lsn
        self.verified = verified
        self.readers = 0          # reads in flight on the extent (read_into_async)
        self.freed = False        # unpublished: the extent goes back when the last reader ends


class BouncePool:
    """Page-aligned (mmap'd) buffers for O_DIRECT writes; get() blocks while all are in use."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self._free = [mmap.mmap(-1, nbytes) for _ in range(count)]
        self._sem = threading.Semaphore(count)
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        self._sem.acquire()
        with self._lock:
            return self._free.pop()

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)
        self._sem.release()

    def close(self) -> None:
        for b in self._free:
            b.close()


class SsdDataFile:
    """The data file of an SsdTier: open, write an extent, sync, close."""

    def _open_data(self, direct_io: bool) -> None:
        created = not os.path.exists(self.data_path)
        self._fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        size = os.fstat(self._fd).st_size
        if size < self.capacity:
            os.posix_fallocate(self._fd, 0, self.capacity)
            os.fsync(self._fd)               # the new size must be durable before extents in it are used
        if created:
            fsync_dir(os.path.dirname(os.path.abspath(self.data_path)))   # and the new name
        self._rfd = os.open(self.data_path, os.O_RDONLY | os.O_CLOEXEC)   # buffered reads
        self.direct_io = False
        if direct_io and self.unit >= MIN_DIRECT_UNIT and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(self.data_path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                dfd = -1
            if dfd >= 0:
                probe = mmap.mmap(-1, self.unit)
                try:
                    os.preadv(dfd, [probe], 0)       # an aligned read proves O_DIRECT works here
                    os.close(self._fd)
                    self._fd = dfd
                    self.direct_io = True
                except OSError as exc:
                    os.close(dfd)
                    if exc.errno != errno.EINVAL:
                        raise
                finally:
                    probe.close()
        if self.direct_io:
            self._bounce = BouncePool(max(self.unit, min(BOUNCE_BYTES, round_up(self.max_block_bytes, self.unit))),
                                       BOUNCE_BUFFERS)

    def _close_files(self) -> None:
        if self._reads is not None:
            self._reads.close()                  # no read may outlive the descriptors
            self._reads = None
        for fd in (self._fd, self._rfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._rfd = -1
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None
        if self._wal is not None and not self._wal.closed:
            self._wal.close()

    def _write_extent(self, mv: memoryview, offset: int) -> int:
        """Write ``mv`` at ``offset`` of the data file (a worker thread); return its CRC32C."""
        faults.killpoint("before_data_write")
        if faults.FAULTS_ENABLED and faults.fire("data_enospc"):
            raise OSError(errno.ENOSPC, "injected ENOSPC on a data-file write", self.data_path)
        n = len(mv)
        crc = crc32c(mv)
        if self.direct_io:
            faults.journal_write(offset, round_up(n, self.unit))
            pool = self._bounce
            buf = pool.get()
            try:
                bmv = memoryview(buf)
                done = 0
                while done < n:
                    k = min(n - done, pool.nbytes)
                    bmv[:k] = mv[done:done + k]
                    padded = round_up(k, self.unit)
                    if padded > k:
                        bmv[k:padded] = bytes(padded - k)   # O_DIRECT writes whole units
                    w = os.pwrite(self._fd, bmv[:padded], offset + done)
                    if w != padded:
                        raise OSError(errno.EIO, f"short O_DIRECT write ({w} of {padded} bytes)", self.data_path)
                    done += k
                bmv.release()
            finally:
                pool.put(buf)
        else:
            faults.journal_write(offset, n)
            done = 0
            while done < n:
                done += os.pwrite(self._fd, mv[done:], offset + done)
        faults.killpoint("after_data_write")
        return crc

    def _sync_data(self, data_sync: bool) -> None:
        """Before a WAL commit (commit thread): make the data its records point at durable."""
        if not data_sync:
            return                          # removes only: no block bytes to cover
        covered = faults.journal_sync_begin() if faults.JOURNAL_ENABLED else 0
        try:
            os.fdatasync(self._fd)          # one per group commit, covering every put in the window
            if faults.FAULTS_ENABLED and faults.fire("data_fsync_eio"):
                raise OSError(errno.EIO, "injected EIO on the data file's fdatasync", self.data_path)
        except OSError as exc:
            # fatal: after a failed fsync the page cache may have dropped the data (no retry)
            self._failed = ReadOnlyError(f"fdatasync of {self.data_path} failed: {exc}; the SSD tier is read-only")
            raise self._failed from exc
        faults.killpoint("after_data_fsync")
        faults.journal_sync(covered)
        self._counters["data_syncs"] += 1


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit
