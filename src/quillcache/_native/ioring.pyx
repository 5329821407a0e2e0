# cython: language_level=3
"""An io_uring for reads whose completions an event loop reaps: the SSD tier's read path.

``ReadRing(depth)`` sets up a ring and registers an eventfd with it: the kernel signals
the eventfd when a completion is posted, so an event loop watches ``fileno()``
(``loop.add_reader``) and calls ``reap()``, which returns ``(slot, result)`` for every
finished read without blocking.  ``submit_read(fd, buffer, offset)`` pins the buffer (a
buffer-protocol export held until its completion is reaped), queues one read and submits
it (one ``io_uring_enter`` that does not wait); it returns the read's slot, or -1 when
``depth`` reads are in flight.  The result is the byte count or ``-errno``, as the kernel
gives it; a short read is the caller's to continue.

``delay_s`` (fault injection, ``quillcache.faults``) links a timeout before the read
(``IORING_TIMEOUT_ETIME_SUCCESS``, kernel 5.16+): the read starts that much later, in the
kernel, while the loop keeps running.

Not thread-safe: one thread (the loop's) submits and reaps.  ``close()`` waits for every
read in flight (the kernel may still write into their buffers) and then frees the ring.
Setup that the kernel refuses (seccomp, ``io_uring_disabled``, an old kernel, a build
without liburing) raises OSError: the caller falls back to its thread pool.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from libc.errno cimport errno
from libc.stdint cimport uint64_t, int64_t
from libc.stdlib cimport calloc, free
from posix.unistd cimport close as c_close, read as c_read

from quillcache._native.includes.liburing cimport (
    QC_URING_BUILT, IOSQE_IO_LINK, IORING_TIMEOUT_ETIME_SUCCESS, io_uring, io_uring_sqe, io_uring_cqe,
    __kernel_timespec, io_uring_queue_init, io_uring_queue_exit, io_uring_get_sqe, io_uring_prep_read,
    io_uring_prep_timeout, io_uring_sqe_set_flags, io_uring_sqe_set_data64, io_uring_register_eventfd,
    io_uring_submit, io_uring_peek_cqe, io_uring_wait_cqe, io_uring_cqe_seen)
from quillcache._native.includes.posix_extra cimport eventfd, EFD_CLOEXEC, EFD_NONBLOCK

import os

__all__ = ["ReadRing", "HAVE_LIBURING", "MAX_DEPTH"]

HAVE_LIBURING = bool(QC_URING_BUILT)
MAX_DEPTH = 4096                      # reads in flight in one ring
cdef uint64_t DELAY_TAG = 1ULL << 32  # user_data of a linked delay timeout (not reported)
cdef unsigned MAX_READ = 0x7FFFF000   # bytes: the most one read(2) moves


cdef class ReadRing:
    cdef io_uring _ring
    cdef bint _ring_ok
    cdef int _efd
    cdef Py_buffer* _bufs              # one export per slot, held while its read is in flight
    cdef char* _used
    cdef __kernel_timespec* _ts
    cdef list _free
    cdef readonly unsigned depth
    cdef readonly unsigned in_flight

    def __cinit__(self):
        self._efd = -1

    def __init__(self, unsigned depth=64):
        cdef int ret
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth {depth}: must be in 1..{MAX_DEPTH} reads")
        if not QC_URING_BUILT:
            raise OSError(38, "built without liburing")          # ENOSYS
        self._bufs = <Py_buffer*>calloc(depth, sizeof(Py_buffer))
        self._used = <char*>calloc(depth, 1)
        self._ts = <__kernel_timespec*>calloc(depth, sizeof(__kernel_timespec))
        if self._bufs == NULL or self._used == NULL or self._ts == NULL:
            raise MemoryError()
        ret = io_uring_queue_init(2 * depth, &self._ring, 0)     # a delayed read takes two sqes
        if ret < 0:
            raise OSError(-ret, f"io_uring_queue_init: {os.strerror(-ret)}")
        self._ring_ok = True
        self._efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)
        if self._efd < 0:
            raise OSError(errno, f"eventfd: {os.strerror(errno)}")
        ret = io_uring_register_eventfd(&self._ring, self._efd)
        if ret < 0:
            raise OSError(-ret, f"io_uring_register_eventfd: {os.strerror(-ret)}")
        self.depth = depth
        self.in_flight = 0
        self._free = list(range(depth - 1, -1, -1))

    def __dealloc__(self):
        self._shutdown()
        free(self._bufs)
        free(self._used)
        free(self._ts)

    cdef void _shutdown(self):
        cdef io_uring_cqe* cqe
        cdef uint64_t tag
        cdef int ret
        if self._ring_ok:
            # the kernel may still write into the buffers of reads in flight: wait for them
            while self.in_flight:
                with nogil:
                    ret = io_uring_wait_cqe(&self._ring, &cqe)
                if ret < 0:
                    break
                tag = cqe.user_data
                io_uring_cqe_seen(&self._ring, cqe)
                if tag < DELAY_TAG and self._used[tag]:
                    self._release(<unsigned>tag)
            io_uring_queue_exit(&self._ring)
            self._ring_ok = False
        if self._efd >= 0:
            c_close(self._efd)
            self._efd = -1

    cdef void _release(self, unsigned slot):
        PyBuffer_Release(&self._bufs[slot])
        self._used[slot] = 0
        self.in_flight -= 1
        self._free.append(slot)

    def fileno(self):
        """The eventfd the kernel signals when completions are posted."""
        if self._efd < 0:
            raise ValueError("the ring is closed")
        return self._efd

    @property
    def closed(self):
        return not self._ring_ok

    def submit_read(self, int fd, buffer, uint64_t offset, double delay_s=0.0):
        """Read up to len(buffer) bytes at offset into buffer (writable, contiguous);
        returns its slot, or -1 when ``depth`` reads are in flight."""
        cdef unsigned slot
        cdef io_uring_sqe* sqe
        cdef io_uring_sqe* tsqe = NULL
        cdef int ret
        if not self._ring_ok:
            raise ValueError("the ring is closed")
        if not self._free:
            return -1
        slot = self._free.pop()
        try:
            PyObject_GetBuffer(buffer, &self._bufs[slot], PyBUF_WRITABLE)
        except BaseException:
            self._free.append(slot)
            raise
        if self._bufs[slot].len > MAX_READ:
            PyBuffer_Release(&self._bufs[slot])
            self._free.append(slot)
            raise ValueError(f"a read of {self._bufs[slot].len} bytes: at most {MAX_READ}")
        if delay_s > 0:
            tsqe = io_uring_get_sqe(&self._ring)
        sqe = io_uring_get_sqe(&self._ring)
        if sqe == NULL or (delay_s > 0 and tsqe == NULL):
            PyBuffer_Release(&self._bufs[slot])
            self._free.append(slot)
            return -1                      # the submission queue is full (not yet submitted sqes)
        if tsqe != NULL:
            self._ts[slot].tv_sec = <int64_t>delay_s
            self._ts[slot].tv_nsec = <long long>((delay_s - <int64_t>delay_s) * 1e9)
            io_uring_prep_timeout(tsqe, &self._ts[slot], 0, IORING_TIMEOUT_ETIME_SUCCESS)
            io_uring_sqe_set_flags(tsqe, IOSQE_IO_LINK)       # the read starts when it expires
            io_uring_sqe_set_data64(tsqe, DELAY_TAG | slot)
        io_uring_prep_read(sqe, fd, self._bufs[slot].buf, <unsigned>self._bufs[slot].len, offset)
        io_uring_sqe_set_data64(sqe, slot)
        self._used[slot] = 1
        self.in_flight += 1
        ret = io_uring_submit(&self._ring)
        if ret < 0:
            # not submitted: nothing in the kernel refers to the buffer (the sqes are reused)
            self._release(slot)
            raise OSError(-ret, f"io_uring_submit: {os.strerror(-ret)}")
        return slot

    def reap(self):
        """[(slot, result)] of the reads finished since the last call (never blocks);
        result is the byte count or -errno.  Clears the eventfd first, so a completion
        posted meanwhile signals it again."""
        cdef io_uring_cqe* cqe
        cdef uint64_t tag, counter
        cdef int res
        cdef list out = []
        if not self._ring_ok:
            return out
        c_read(self._efd, &counter, 8)     # EAGAIN when nothing was signalled: fine
        while io_uring_peek_cqe(&self._ring, &cqe) == 0 and cqe != NULL:
            tag = cqe.user_data
            res = cqe.res
            io_uring_cqe_seen(&self._ring, cqe)
            if tag >= DELAY_TAG:
                continue                   # the delay before a read (its read reports)
            if self._used[tag]:
                self._release(<unsigned>tag)
                out.append((<unsigned>tag, res))
        return out

    def close(self):
        """Wait for the reads in flight, then free the ring and the eventfd."""
        self._shutdown()
