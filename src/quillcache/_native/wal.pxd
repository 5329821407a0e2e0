# cython: language_level=3
"""The WAL writer's contract for other extensions (cimport quillcache._native.wal).

Format constants (walformat.pxd, see docs/wal-format.md) and the writer's layout; the
reader's contract is walread.pxd.  Python code uses the module: WalWriter, WalReader
(re-exported from walread), set_fault, clear_faults.
"""
from libc.stdint cimport uint64_t
from cpython.pythread cimport PyThread_type_lock
from posix.uio cimport iovec
from quillcache._native.includes.liburing cimport io_uring
from quillcache._native.walformat cimport (
    WAL_BLOCK_C, WAL_HEADER_C, WAL_ZERO, WAL_FULL, WAL_FIRST, WAL_MIDDLE, WAL_LAST, _mask, _put32)


cdef struct WalChunk:
    char *buf
    size_t len
    size_t cap
    uint64_t seq               # segment the bytes belong to
    uint64_t off               # file offset of buf[0] in that segment


cdef class WalWriter:
    cdef readonly object directory
    cdef readonly uint64_t segment_bytes
    cdef readonly uint64_t max_record_bytes
    cdef readonly uint64_t max_pending_bytes
    cdef readonly uint64_t recovered_tail_bytes
    cdef bint _use_uring
    cdef bint _ring_ok
    cdef io_uring _ring
    cdef int _dirfd
    cdef int _fd                 # the open segment (seq _fd_seq), -1 when none
    cdef uint64_t _fd_seq
    cdef uint64_t _tail_seq      # where the next appended byte goes
    cdef uint64_t _tail_off
    cdef uint64_t _appended_lsn
    cdef uint64_t _durable_lsn
    cdef WalChunk *_chunks       # pending, framed, not yet written
    cdef Py_ssize_t _nchunks
    cdef Py_ssize_t _cap_chunks
    cdef uint64_t _pending_bytes
    cdef PyThread_type_lock _lock         # guards the pending buffer and the tail
    cdef PyThread_type_lock _commit_lock  # serialises commits (file, ring)
    cdef object _error                    # the OSError that made the log fail
    cdef bint _closed
    cdef uint64_t _n_commits
    cdef uint64_t _n_records
    cdef uint64_t _bytes_written
    cdef char *_spare[8]         # recycled WAL_CHUNK-sized buffers (WAL_SPARE of them)
    cdef int _nspare

    cdef int _lock_acquire(self, PyThread_type_lock lock) except -1
    cdef int _fail(self, int err, str what) except -1
    cdef _check_usable(self)
    cdef uint64_t _append(self, const char *src, size_t n) except? 0
    cdef _recycle(self, WalChunk *chunks, Py_ssize_t n)
    cdef int _write_group(self, WalChunk *chunks, Py_ssize_t n, int *failed_op) noexcept nogil
    cdef int _sync_submit(self, iovec *iov, int cnt, uint64_t off, bint do_write, bint do_fsync,
                          int *wres, int *fres) noexcept nogil
