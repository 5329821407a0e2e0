"""SSD reads that never block the event loop: io_uring reaped on the loop, or a thread pool.

``SsdReader(fd)`` reads extents of the SSD tier's data file for ``SsdTier.read_into_async``
and checks them against their CRC32C.  Two backends, chosen once when it is made:

* ``io_uring`` (default): the read is queued on a ``quillcache._native.ioring.ReadRing``
  and submitted at once; the ring's eventfd is watched by the running loop
  (``loop.add_reader``), whose callback reaps completions and resolves their futures.  No
  thread is involved; up to ``RING_DEPTH`` reads are in the kernel at once (more wait in
  a queue, in order).  The CRC check of a block up to ``CRC_ON_LOOP_BYTES`` runs on the
  loop (CRC32C runs at ~25 GB/s here: 1 MiB is ~40 us, less than a hand-off to a thread);
  a larger block is checked in the pool.
* ``pool``: the read and its check run in a pool of ``READ_THREADS`` threads (preadv and
  the CRC release the GIL).  Used where io_uring setup is refused (seccomp, the sysctl
  ``kernel.io_uring_disabled``, an old kernel, a build without liburing) or when
  ``QUILLCACHE_NO_URING=1`` is in the environment.

``backend`` says which; the daemon reports it in INFO (``# Tiers`` ``ssd_read_backend``).
A caller cancelled while its read is in flight still waits for the read to end before the
cancellation goes on: the kernel or a thread may write into the buffer until then, and the
caller frees or reuses it afterwards.  ``QUILLCACHE_SSD_READ_DELAY_MS`` (quillcache.faults)
delays every read: a sleep in the reading thread, or a timeout linked before the read in
the ring (in the kernel; the loop keeps running either way).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import logging
import os
from typing import Optional

from quillcache import faults
from quillcache._native.crc import crc32c
from quillcache.fsutil import pread_full

__all__ = ["SsdReader", "read_and_check", "READ_THREADS", "RING_DEPTH", "CRC_ON_LOOP_BYTES",
           "READ_BACKENDS"]

log = logging.getLogger("quillcache.store.ssd")

READ_THREADS = 4                  # threads of the read pool: SSD reads (+ CRC) in flight at once
RING_DEPTH = 64                   # reads in the kernel at once through io_uring
CRC_ON_LOOP_BYTES = 1 << 20       # bytes: a block up to this size is CRC-checked on the loop
READ_BACKENDS = ("auto", "io_uring", "pool")


def read_and_check(fd: int, dst: memoryview, offset: int, crc: int) -> str:
    """Read len(dst) bytes at offset and check their CRC32C (any thread); returns "" when
    the bytes are good, else why not (and ``dst`` is zeroed: bad bytes are never handed out)."""
    faults.ssd_read_delay()
    n = pread_full(fd, dst, offset)
    return _check(dst, n, crc)


def _check(dst: memoryview, n: int, crc: int) -> str:
    if n == len(dst) and crc32c(dst) == crc:
        return ""
    dst[:] = bytes(len(dst))
    return "short read" if n != len(dst) else "CRC32C mismatch"


def _uring_refused() -> Optional[str]:
    if os.environ.get("QUILLCACHE_NO_URING", "") not in ("", "0"):
        return "QUILLCACHE_NO_URING is set"
    return None


async def _io(fut: asyncio.Future):
    """The result of an I/O future; a cancellation waits for the I/O to end first."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
            break
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            cancelled = True               # the buffer is still the device's: wait, then cancel
    if cancelled:
        raise asyncio.CancelledError()
    return result


class SsdReader:
    """Reads of one file descriptor off the event loop (see the module docstring)."""

    def __init__(self, fd: int, backend: str = "auto") -> None:
        if backend not in READ_BACKENDS:
            raise ValueError(f"read backend {backend!r}: must be one of {', '.join(READ_BACKENDS)}")
        self.fd = fd
        self._want = backend
        self.refused: Optional[str] = None        # why io_uring is not used, if it is not
        self._ring = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiting: dict[int, asyncio.Future] = {}     # ring slot -> its read's future
        self._queue: collections.deque = collections.deque()   # reads waiting for a ring slot
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.ring_reads = 0
        self.pool_reads = 0
        self._choose()

    # ---- setup
    def _choose(self) -> None:
        if self._want != "pool":
            why = _uring_refused()
            if why is None:
                try:
                    from quillcache._native.ioring import ReadRing
                    self._ring = ReadRing(RING_DEPTH)
                except OSError as exc:
                    why = f"io_uring setup refused: {exc}"
            if why is not None:
                if self._want == "io_uring":
                    raise OSError(errno.ENOSYS, f"SSD reads through io_uring: {why}")
                self.refused = why
                log.info("SSD reads through a pool of %d threads (%s)", READ_THREADS, why)
        self.backend = "io_uring" if self._ring is not None else "pool"

    def _pool_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="qc-ssd-read")
        return self._pool

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the ring's eventfd on this loop (a tier may outlive an asyncio.run)."""
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._ring.fileno())
        loop.add_reader(self._ring.fileno(), self._on_completions)
        self._loop = loop

    # ---- reads
    async def read_extent(self, dst: memoryview, offset: int, crc: int) -> str:
        """Read dst's length at offset and check the CRC32C; "" when good, else why not
        (``dst`` zeroed).  OSError when the read itself fails."""
        loop = asyncio.get_running_loop()
        if self._ring is None:
            self.pool_reads += 1
            return await _io(loop.run_in_executor(self._pool_executor(), read_and_check, self.fd, dst,
                                                  offset, crc))
        self.ring_reads += 1
        self._bind(loop)
        n, done, delay = len(dst), 0, faults.SSD_READ_DELAY_S
        while done < n:                                   # a short read continues where it stopped
            res = await _io(self._submit(loop, dst[done:] if done else dst, offset + done, delay))
            if res < 0:
                raise OSError(-res, f"io_uring read of the SSD data file: {os.strerror(-res)}")
            if res == 0:
                break                                     # end of file: reported as a short read
            done += res
            delay = 0.0
        if n <= CRC_ON_LOOP_BYTES or done != n:
            return _check(dst, done, crc)
        return await _io(loop.run_in_executor(self._pool_executor(), _check, dst, done, crc))

    def _submit(self, loop, dst, offset: int, delay: float) -> asyncio.Future:
        fut = loop.create_future()
        if self._queue:
            self._queue.append((dst, offset, delay, fut))     # in order behind earlier ones
            return fut
        slot = self._ring.submit_read(self.fd, dst, offset, delay)
        if slot < 0:
            self._queue.append((dst, offset, delay, fut))
        else:
            self._waiting[slot] = fut
        return fut

    def _on_completions(self) -> None:
        """The eventfd is readable (on the loop): resolve every finished read, then submit
        queued ones into the slots they freed."""
        for slot, res in self._ring.reap():
            fut = self._waiting.pop(slot, None)
            if fut is not None and not fut.done():
                fut.set_result(res)
        while self._queue:
            dst, offset, delay, fut = self._queue[0]
            try:
                slot = self._ring.submit_read(self.fd, dst, offset, delay)
            except OSError as exc:
                self._queue.popleft()
                fut.set_exception(exc)
                continue
            if slot < 0:
                break
            self._queue.popleft()
            self._waiting[slot] = fut

    # ---- reporting, close
    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._queue)

    def stats(self) -> dict:
        return {"read_backend": self.backend, "ring_reads": self.ring_reads, "pool_reads": self.pool_reads}

    def close(self) -> None:
        """Wait for the reads in flight (their buffers are written until they end), then
        release the ring and the pool."""
        if self._ring is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._ring.fileno())
            self._ring.close()
            for fut in list(self._waiting.values()) + [q[3] for q in self._queue]:
                if not fut.done():
                    fut.set_exception(OSError(errno.ECANCELED, "the SSD tier closed during the read"))
            self._waiting.clear()
            self._queue.clear()
            self._ring = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)     # no read may outlive the descriptor
            self._pool = None
        self.backend = "closed"
