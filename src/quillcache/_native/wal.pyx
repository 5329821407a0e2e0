# cython: language_level=3
"""The write-ahead log: LevelDB's log format, group commit on io_uring.

Format (docs/wal-format.md): 32 KiB blocks of physical records, each a 7-byte
header (masked CRC32C over type + payload, 2-byte LE length, 1-byte type) and a
payload; a logical record larger than what is left of a block is split into
FIRST / MIDDLE / LAST fragments.  Segments are files named 000000000001.log.

LSN: a 64-bit position, ``segment_seq << 32 | offset just past the record``.
It only grows, and a record is durable iff its lsn <= ``durable_lsn``.

CRC32C: ``crc32c_update`` from quillcache._native.crc (libcrc32c's
``crc32c_extend`` when google_crc32c bundles it, else a table), called over our
copy of each fragment (without the GIL for appends of WAL_NOGIL_APPEND bytes or more).  The reader (WalReader, list_segments,
segment_name) lives in quillcache._native.walread and is re-exported here.
"""
import errno as _errno
import os

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.pythread cimport (PyThread_allocate_lock, PyThread_free_lock, PyThread_acquire_lock,
                               PyThread_release_lock, WAIT_LOCK, NOWAIT_LOCK)
from libc.errno cimport errno, EINTR, ENOSPC, EIO, ENOMEM, EBUSY
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy, memset
from posix.fcntl cimport open as c_open, O_WRONLY, O_CREAT, O_EXCL, O_CLOEXEC
from posix.types cimport off_t
from posix.uio cimport iovec, pwritev
from posix.unistd cimport close as c_close, fdatasync, fsync

from quillcache._native.includes.liburing cimport (
    QC_URING_BUILT, IOSQE_IO_LINK, IORING_FSYNC_DATASYNC, io_uring_sqe, io_uring_cqe,
    io_uring_queue_init, io_uring_queue_exit, io_uring_get_sqe, io_uring_prep_writev,
    io_uring_prep_fsync, io_uring_sqe_set_flags, io_uring_submit_and_wait, io_uring_wait_cqe,
    io_uring_cqe_seen)
from quillcache._native.includes.posix_extra cimport flock, LOCK_EX, LOCK_NB, IOV_MAX, ECANCELED, EWOULDBLOCK
from quillcache._native.crc cimport crc32c_update
from quillcache._native.walread cimport WalReader as _WalReader

from quillcache._native import crc as _crc
from quillcache._native.crc import CRC32C_IMPL
from quillcache._native.walread import WAL_MAX_SEGMENT, WalReader, list_segments, segment_name
from quillcache.errors import Busy, InvalidArgument, ReadOnlyError

__all__ = [
    "WalWriter", "WalReader", "set_fault", "clear_faults", "make_lsn", "lsn_segment", "lsn_offset",
    "segment_name", "list_segments", "WAL_BLOCK", "WAL_HEADER", "WAL_SEGMENT_BYTES",
    "WAL_MAX_RECORD", "WAL_MAX_PENDING", "FULL", "FIRST", "MIDDLE", "LAST", "CRC32C_IMPL",
    "HAVE_LIBURING",
]

# ---- format and tunables -------------------------------------------------------------------
WAL_BLOCK = 32768                 # bytes: block size; no physical record crosses a block
WAL_HEADER = 7                    # bytes: crc (4) + length (2) + type (1)
WAL_CRC_MASK_DELTA = 0xa282ead8   # LevelDB's mask constant (added after a 15-bit rotate)
FULL, FIRST, MIDDLE, LAST = WAL_FULL, WAL_FIRST, WAL_MIDDLE, WAL_LAST
WAL_SEGMENT_BYTES = 64 << 20      # bytes: default segment size before rotation
WAL_MIN_SEGMENT = WAL_BLOCK       # bytes: smallest segment_bytes accepted
# WAL_MAX_SEGMENT (bytes: largest segment_bytes; the lsn keeps 32 offset bits): from walread
WAL_MAX_SEQ = (1 << 32) - 1       # segments: the lsn keeps 32 bits of segment number
WAL_MAX_RECORD = 32 << 20         # bytes: default largest payload of one append
WAL_MAX_PENDING = 256 << 20       # bytes: default limit of framed, not yet committed bytes
WAL_MAX_PENDING_LIMIT = 4 << 30   # bytes: largest max_pending_bytes accepted
cdef enum:
    WAL_CHUNK = 4 << 20           # bytes: pending buffers are allocated in chunks this big
    WAL_SPARE = 8                 # chunks: recycled pending buffers kept (8 x 4 MiB = 32 MiB at most)
    WAL_URING_ENTRIES = 8         # sqes: a commit has at most 2 in flight
    WAL_NOGIL_APPEND = 65536      # bytes: an append this large frames (copy + crc) without the GIL
    OP_WRITE = 1
    OP_FSYNC = 2
    UD_WRITE = 1
    UD_FSYNC = 2

HAVE_LIBURING = bool(QC_URING_BUILT)


def make_lsn(uint64_t seq, uint64_t offset):
    return (seq << 32) | offset


def lsn_segment(uint64_t lsn):
    return lsn >> 32


def lsn_offset(uint64_t lsn):
    return lsn & 0xFFFFFFFF


# ---- CRC32C --------------------------------------------------------------------------------
def _crc_impl(str which=None):
    """Test hook: "c" (crc32c_extend) or "table" selects the CRC32C path; returns the one in
    use.  "python" (the old Python-API fallback, now the table code) means "table".  It
    switches every CRC32C user in the process (quillcache._native.crc._select_impl)."""
    return _crc._select_impl("table" if which == "python" else which)


# ---- framing ---------------------------------------------------------------------------------
cdef size_t _framed_size(size_t block_off, size_t n) noexcept nogil:
    """Bytes that a payload of n bytes takes when framed starting at block offset block_off."""
    cdef size_t total = 0, left = n, frag, avail
    while True:
        if WAL_BLOCK_C - block_off < WAL_HEADER_C:
            total += WAL_BLOCK_C - block_off
            block_off = 0
        avail = WAL_BLOCK_C - block_off - WAL_HEADER_C
        frag = left if left < avail else avail
        total += WAL_HEADER_C + frag
        block_off += WAL_HEADER_C + frag
        left -= frag
        if left == 0:
            return total


cdef size_t _frame(char *dst, size_t block_off, const char *src, size_t n) noexcept nogil:
    """Write the framed record (headers with their CRCs, payload fragments) into dst."""
    cdef char *p = dst
    cdef size_t left = n, frag, avail
    cdef bint begin = True, end
    cdef uint8_t rtype
    while True:
        if WAL_BLOCK_C - block_off < WAL_HEADER_C:
            # a block tail too short for a header is zero-filled
            memset(p, 0, WAL_BLOCK_C - block_off)
            p += WAL_BLOCK_C - block_off
            block_off = 0
        avail = WAL_BLOCK_C - block_off - WAL_HEADER_C
        frag = left if left < avail else avail
        end = frag == left
        if begin:
            rtype = WAL_FULL if end else WAL_FIRST
        else:
            rtype = WAL_LAST if end else WAL_MIDDLE
        p[4] = <char>(frag & 0xFF)
        p[5] = <char>(frag >> 8)
        p[6] = <char>rtype
        if frag:
            memcpy(p + WAL_HEADER_C, src, frag)
        # over our copy of type + payload: what we checksum is what we write
        _put32(p, _mask(crc32c_update(0, <const unsigned char *>(p + 6), frag + 1)))
        p += WAL_HEADER_C + frag
        src += frag
        left -= frag
        block_off += WAL_HEADER_C + frag
        begin = False
        if end:
            return <size_t>(p - dst)


# ---- test-only faults (also used by the crash harness) ---------------------------------------
cdef int _faults_on = 0          # the one check on the hot path
cdef int _fault_fsync = 0        # errno every fsync reports (after really syncing)
cdef int _fault_enospc = 0       # non-zero: every write fails with ENOSPC, nothing written
cdef int64_t _fault_write_short = 0  # bytes: cap on what one write submission carries

_FAULT_KINDS = ("fsync", "write_short", "enospc")


def set_fault(str kind, int value):
    """Inject a fault into every WalWriter of this process (tests and crash harness only).

    "fsync": value = errno that fsync reports; "enospc": value != 0 makes writes fail with
    ENOSPC; "write_short": value = max bytes a single write submission carries (forces the
    short-write continuation path).  Value 0 clears that fault.
    """
    global _faults_on, _fault_fsync, _fault_enospc, _fault_write_short
    if kind not in _FAULT_KINDS:
        raise InvalidArgument(f"unknown WAL fault {kind!r}; expected one of {_FAULT_KINDS}")
    if value < 0:
        raise InvalidArgument(f"WAL fault value must be >= 0, got {value}")
    if kind == "fsync":
        _fault_fsync = value
    elif kind == "enospc":
        _fault_enospc = value
    else:
        _fault_write_short = value
    _faults_on = 1 if (_fault_fsync or _fault_enospc or _fault_write_short) else 0


def clear_faults():
    global _faults_on, _fault_fsync, _fault_enospc, _fault_write_short
    _fault_fsync = _fault_enospc = 0
    _fault_write_short = 0
    _faults_on = 0


def _io_uring_disabled():
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            return int(f.read().strip() or "0") != 0
    except (OSError, ValueError):
        return False


def _oserror(int err, str what, path):
    return OSError(err, f"{what}: {os.strerror(err)}", path)


# ---- the writer ------------------------------------------------------------------------------
cdef class WalWriter:
    """Appends records to the log in ``directory``; ``commit()`` makes them durable.

    ``append`` frames the record into an in-memory buffer and returns its lsn.  ``commit``
    swaps that buffer out under a lock and writes it with one vectored write plus a linked
    fdatasync (io_uring) or pwritev + fdatasync, with the GIL released, then returns the
    durable lsn.  Both are safe to call from different threads.  Any write or fsync error
    is fatal: the writer fails and every later append/commit raises ReadOnlyError.
    """

    def __cinit__(self):
        self._fd = -1
        self._dirfd = -1
        self._lock = PyThread_allocate_lock()
        self._commit_lock = PyThread_allocate_lock()
        if self._lock == NULL or self._commit_lock == NULL:
            raise MemoryError()

    def __init__(self, directory, *, uint64_t segment_bytes=WAL_SEGMENT_BYTES, str backend="auto",
                 max_record_bytes=None, uint64_t max_pending_bytes=WAL_MAX_PENDING):
        cdef int ret
        cdef uint64_t fits
        if backend not in ("auto", "uring", "io_uring", "pwritev"):
            raise InvalidArgument(f"backend must be 'auto', 'uring' or 'pwritev', got {backend!r}")
        if not WAL_MIN_SEGMENT <= segment_bytes <= WAL_MAX_SEGMENT:
            raise InvalidArgument(f"segment_bytes must be in [{WAL_MIN_SEGMENT}, {WAL_MAX_SEGMENT}], "
                                  f"got {segment_bytes}")
        if max_record_bytes is None:
            # the default: WAL_MAX_RECORD, or less when a segment holds less once framed
            fits = (segment_bytes // WAL_BLOCK_C) * (WAL_BLOCK_C - WAL_HEADER_C)
            if segment_bytes % WAL_BLOCK_C > WAL_HEADER_C:
                fits += segment_bytes % WAL_BLOCK_C - WAL_HEADER_C
            max_record_bytes = min(fits, WAL_MAX_RECORD)
        if max_record_bytes < 0:
            raise InvalidArgument(f"max_record_bytes must be >= 0, got {max_record_bytes}")
        if max_record_bytes > WAL_MAX_SEGMENT or _framed_size(0, max_record_bytes) > segment_bytes:
            raise InvalidArgument(f"max_record_bytes={max_record_bytes} does not fit in a segment of "
                                  f"segment_bytes={segment_bytes} once framed")
        if not _framed_size(0, max_record_bytes) <= max_pending_bytes <= WAL_MAX_PENDING_LIMIT:
            raise InvalidArgument(f"max_pending_bytes must be in [framed max_record_bytes "
                                  f"({_framed_size(0, max_record_bytes)}), {WAL_MAX_PENDING_LIMIT}], "
                                  f"got {max_pending_bytes}")
        self.directory = os.fspath(directory)
        self.segment_bytes = segment_bytes
        self.max_record_bytes = max_record_bytes
        self.max_pending_bytes = max_pending_bytes

        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            # the new directory's name must be durable before files in it are
            parent = os.open(os.path.dirname(os.path.abspath(self.directory)), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(parent)
            finally:
                os.close(parent)
        self._dirfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # one writer per directory (the lock goes with the fd, also within one process)
        if flock(self._dirfd, LOCK_EX | LOCK_NB) != 0:
            err = errno
            if err == EWOULDBLOCK:
                raise Busy(f"WAL directory {self.directory} is locked by another writer")
            raise _oserror(err, "flock", self.directory)

        if backend == "pwritev":
            self._use_uring = False
        elif backend == "auto" and (not QC_URING_BUILT or _io_uring_disabled()):
            self._use_uring = False
        else:
            ret = io_uring_queue_init(WAL_URING_ENTRIES, &self._ring, 0)
            if ret == 0:
                self._ring_ok = True
                self._use_uring = True
            elif backend == "auto":
                self._use_uring = False       # EPERM/ENOSYS: seccomp, old kernel, disabled
            else:
                raise _oserror(-ret, "io_uring_queue_init", None)

        segs = list_segments(self.directory)
        if segs:
            seq, path = segs[len(segs) - 1]
            if seq > WAL_MAX_SEQ:
                raise InvalidArgument(f"segment number {seq} of {path} exceeds {WAL_MAX_SEQ}")
            reader = _WalReader(path)
            for _ in reader:
                pass
            size = os.path.getsize(path)
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            if size > reader.valid_end:
                # cut the torn tail and sync the cut before appending: a crash must not leave
                # the old tail bytes behind records we write next
                os.ftruncate(self._fd, reader.valid_end)
                os.fdatasync(self._fd)
                self.recovered_tail_bytes = size - reader.valid_end
            self._fd_seq = seq
            self._tail_seq = seq
            self._tail_off = reader.valid_end
        else:
            path = os.path.join(self.directory, segment_name(1))
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            # the first segment's name must be durable before any record in it is
            os.fsync(self._dirfd)
            self._fd_seq = 1
            self._tail_seq = 1
            self._tail_off = 0
        self._appended_lsn = (self._tail_seq << 32) | self._tail_off
        self._durable_lsn = self._appended_lsn

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self._nchunks):
            free(self._chunks[i].buf)
        free(self._chunks)
        for i in range(self._nspare):
            free(self._spare[i])
        if self._ring_ok:
            io_uring_queue_exit(&self._ring)
        if self._fd >= 0:
            c_close(self._fd)
        if self._dirfd >= 0:
            c_close(self._dirfd)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)
        if self._commit_lock != NULL:
            PyThread_free_lock(self._commit_lock)

    # -- properties
    @property
    def backend(self):
        return "io_uring" if self._use_uring else "pwritev"

    @property
    def durable_lsn(self):
        return self._durable_lsn

    @property
    def appended_lsn(self):
        return self._appended_lsn

    @property
    def pending_bytes(self):
        return self._pending_bytes

    @property
    def failed(self):
        """The OSError that made the log fail, or None."""
        return self._error

    @property
    def closed(self):
        return self._closed

    def stats(self):
        return {"backend": self.backend, "durable_lsn": self._durable_lsn,
                "appended_lsn": self._appended_lsn, "pending_bytes": self._pending_bytes,
                "commits": self._n_commits, "records": self._n_records,
                "bytes_written": self._bytes_written, "segment": self._tail_seq,
                "failed": self._error is not None, "crc32c": CRC32C_IMPL}

    # -- locking and failure
    cdef int _lock_acquire(self, PyThread_type_lock lock) except -1:
        if PyThread_acquire_lock(lock, NOWAIT_LOCK):
            return 0
        with nogil:                       # never wait for our lock while holding the GIL
            PyThread_acquire_lock(lock, WAIT_LOCK)
        return 0

    cdef int _fail(self, int err, str what) except -1:
        path = os.path.join(self.directory, segment_name(self._fd_seq))
        self._error = _oserror(err, what, path)
        raise ReadOnlyError(f"WAL {what} of {path} failed: [Errno {err}] "
                            f"{_errno.errorcode.get(err, '?')} ({os.strerror(err)}); "
                            f"the log is read-only") from self._error

    cdef _check_usable(self):
        if self._error is not None:
            e = self._error
            raise ReadOnlyError(f"WAL failed earlier ({e.strerror}, errno {e.errno} "
                                f"{_errno.errorcode.get(e.errno, '?')}, {e.filename}); "
                                f"the log is read-only") from e
        if self._closed:
            raise InvalidArgument("WAL writer is closed")

    # -- append
    def append(self, payload):
        """Frame ``payload`` (any bytes-like) into the pending buffer; return its lsn."""
        cdef Py_buffer view
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        try:
            return self._append(<const char *>view.buf, <size_t>view.len)
        finally:
            PyBuffer_Release(&view)

    cdef uint64_t _append(self, const char *src, size_t n) except? 0:
        cdef uint64_t seq, off, lsn
        cdef size_t framed, written, cap
        cdef WalChunk *c
        cdef WalChunk *grown
        cdef char *buf
        self._check_usable()
        if n > self.max_record_bytes:
            raise InvalidArgument(f"WAL record of {n} bytes exceeds max_record_bytes={self.max_record_bytes}")
        self._lock_acquire(self._lock)
        try:
            self._check_usable()          # a commit may have failed while we waited
            seq = self._tail_seq
            off = self._tail_off
            framed = _framed_size(off % WAL_BLOCK_C, n)
            if off + framed > self.segment_bytes and off > 0:
                # records never span segments: this one starts the next segment
                seq += 1
                off = 0
                framed = _framed_size(0, n)
                if seq > WAL_MAX_SEQ:
                    raise InvalidArgument(f"WAL segment numbers exhausted ({WAL_MAX_SEQ})")
            if self._pending_bytes + framed > self.max_pending_bytes:
                raise Busy(f"WAL pending buffer full: {self._pending_bytes} + {framed} bytes > "
                           f"max_pending_bytes={self.max_pending_bytes}; commit first")
            c = NULL
            if self._nchunks > 0:
                c = &self._chunks[self._nchunks - 1]
                if c.seq != seq or c.cap - c.len < framed:
                    c = NULL
            if c == NULL:
                if self._nchunks == self._cap_chunks:
                    cap = 16 if self._cap_chunks == 0 else 2 * self._cap_chunks
                    grown = <WalChunk *>realloc(self._chunks, cap * sizeof(WalChunk))
                    if grown == NULL:
                        raise MemoryError()
                    self._chunks = grown
                    self._cap_chunks = cap
                if framed <= WAL_CHUNK and self._nspare > 0:
                    self._nspare -= 1
                    buf = self._spare[self._nspare]
                    cap = WAL_CHUNK
                else:
                    cap = framed if framed > WAL_CHUNK else WAL_CHUNK
                    buf = <char *>malloc(cap)
                    if buf == NULL:
                        raise MemoryError()
                c = &self._chunks[self._nchunks]
                self._nchunks += 1
                c.buf = buf
                c.len = 0
                c.cap = cap
                c.seq = seq
                c.off = off
            if n >= WAL_NOGIL_APPEND:
                with nogil:
                    written = _frame(c.buf + c.len, off % WAL_BLOCK_C, src, n)
            else:
                written = _frame(c.buf + c.len, off % WAL_BLOCK_C, src, n)
            c.len += written
            self._pending_bytes += written
            self._tail_seq = seq
            self._tail_off = off + written
            lsn = (seq << 32) | self._tail_off
            self._appended_lsn = lsn
            self._n_records += 1
            return lsn
        finally:
            PyThread_release_lock(self._lock)

    # -- commit
    def commit(self):
        """Write everything appended so far, fdatasync it, return the durable lsn."""
        cdef WalChunk *chunks = NULL
        cdef Py_ssize_t n = 0, i, j
        cdef uint64_t target, seq, nbytes = 0
        cdef int rc, op = 0, fd
        cdef bytes cpath
        cdef const char *p
        self._check_usable()
        self._lock_acquire(self._commit_lock)
        try:
            self._check_usable()
            self._lock_acquire(self._lock)
            chunks = self._chunks
            n = self._nchunks
            target = self._appended_lsn
            self._chunks = NULL
            self._nchunks = 0
            self._cap_chunks = 0
            self._pending_bytes = 0
            PyThread_release_lock(self._lock)
            if n == 0:
                return self._durable_lsn
            i = 0
            while i < n:
                j = i
                while j < n and chunks[j].seq == chunks[i].seq:
                    nbytes += chunks[j].len
                    j += 1
                seq = chunks[i].seq
                if seq != self._fd_seq:
                    # rotation: the previous segment was fully written and fdatasync'ed by the
                    # group that last wrote it, before the next segment exists
                    cpath = os.fsencode(os.path.join(self.directory, segment_name(seq)))
                    p = cpath
                    with nogil:
                        fd = c_open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o644)
                        rc = errno if fd < 0 else 0
                    if fd < 0:
                        self._fd_seq = seq
                        self._fail(rc, "create")
                    c_close(self._fd)
                    self._fd = fd
                    self._fd_seq = seq
                with nogil:
                    rc = self._write_group(chunks + i, j - i, &op)
                if rc != 0:
                    self._fail(rc, "fsync" if op == OP_FSYNC else "write")
                if chunks[i].off == 0:
                    # a new segment's name must be durable before its records are reported durable
                    with nogil:
                        rc = fsync(self._dirfd)
                        if rc != 0:
                            rc = errno
                    if rc != 0:
                        self._fail(rc, "directory fsync")
                i = j
            self._durable_lsn = target      # publish only after data + fdatasync completed
            self._n_commits += 1
            self._bytes_written += nbytes
            return target
        finally:
            if chunks != NULL:
                self._recycle(chunks, n)
            PyThread_release_lock(self._commit_lock)

    cdef _recycle(self, WalChunk *chunks, Py_ssize_t n):
        cdef Py_ssize_t i
        self._lock_acquire(self._lock)
        for i in range(n):
            if chunks[i].cap == WAL_CHUNK and self._nspare < WAL_SPARE:
                self._spare[self._nspare] = chunks[i].buf
                self._nspare += 1
            else:
                free(chunks[i].buf)
        PyThread_release_lock(self._lock)
        free(chunks)

    cdef int _sync_submit(self, iovec *iov, int cnt, uint64_t off, bint do_write, bint do_fsync,
                          int *wres, int *fres) noexcept nogil:
        """One io_uring submission: writev (optional) linked to an fdatasync (optional).
        Returns 0 or a negative errno from the ring itself."""
        cdef io_uring_sqe *sqe
        cdef io_uring_cqe *cqe
        cdef int nr = 0, got = 0, ret
        if do_write:
            sqe = io_uring_get_sqe(&self._ring)
            if sqe == NULL:
                return -EBUSY
            io_uring_prep_writev(sqe, self._fd, iov, cnt, off)
            sqe.user_data = UD_WRITE
            if do_fsync:
                # the fsync runs only after the write completed in full (a short write
                # or an error severs the link and the fsync completes with -ECANCELED)
                io_uring_sqe_set_flags(sqe, IOSQE_IO_LINK)
            nr += 1
        if do_fsync:
            sqe = io_uring_get_sqe(&self._ring)
            if sqe == NULL:
                return -EBUSY
            io_uring_prep_fsync(sqe, self._fd, IORING_FSYNC_DATASYNC)
            sqe.user_data = UD_FSYNC
            nr += 1
        ret = io_uring_submit_and_wait(&self._ring, nr)
        if ret < 0 and ret != -EINTR:
            return ret
        while got < nr:
            ret = io_uring_wait_cqe(&self._ring, &cqe)
            if ret == -EINTR:
                continue
            if ret < 0:
                return ret
            if cqe.user_data == UD_WRITE:
                wres[0] = cqe.res
            else:
                fres[0] = cqe.res
            io_uring_cqe_seen(&self._ring, cqe)
            got += 1
        return 0

    cdef int _write_group(self, WalChunk *chunks, Py_ssize_t n, int *failed_op) noexcept nogil:
        """Write n chunks (contiguous in one segment) and fdatasync them; 0 or a positive errno."""
        cdef iovec *iov = <iovec *>malloc(n * sizeof(iovec))
        cdef Py_ssize_t idx = 0, k, cnt
        cdef uint64_t off = chunks[0].off, total = 0, want, cap
        cdef size_t saved_len = 0
        cdef Py_ssize_t trimmed = -1
        cdef int wres, fres, ret, err = 0
        cdef bint synced = False, covers
        if iov == NULL:
            failed_op[0] = OP_WRITE
            return ENOMEM
        for k in range(n):
            iov[k].iov_base = chunks[k].buf
            iov[k].iov_len = chunks[k].len
            total += chunks[k].len
        while total > 0:
            cnt = n - idx
            if cnt > IOV_MAX:
                cnt = IOV_MAX
            trimmed = -1
            if _faults_on and _fault_write_short > 0:
                # test fault: carry at most _fault_write_short bytes, as a short write would
                cap = <uint64_t>_fault_write_short
                want = 0
                for k in range(idx, idx + cnt):
                    if want + iov[k].iov_len > cap:
                        trimmed = k
                        saved_len = iov[k].iov_len
                        iov[k].iov_len = cap - want
                        cnt = k - idx + 1
                        break
                    want += iov[k].iov_len
            want = 0
            for k in range(idx, idx + cnt):
                want += iov[k].iov_len
            covers = want == total
            wres = 0
            fres = -ECANCELED
            if _faults_on and _fault_enospc:
                wres = -ENOSPC
            elif self._use_uring:
                ret = self._sync_submit(iov + idx, <int>cnt, off, True, covers, &wres, &fres)
                if ret < 0:
                    err = -ret
                    failed_op[0] = OP_WRITE
                    break
            else:
                while True:
                    wres = <int>pwritev(self._fd, iov + idx, <int>cnt, <off_t>off)
                    if wres >= 0:
                        break
                    if errno != EINTR:
                        wres = -errno
                        break
            if trimmed >= 0:
                iov[trimmed].iov_len = saved_len
            if wres < 0:
                err = -wres
                failed_op[0] = OP_WRITE
                break
            if wres == 0 and want > 0:
                err = EIO                # no progress: do not spin
                failed_op[0] = OP_WRITE
                break
            total -= <uint64_t>wres
            off += <uint64_t>wres
            while wres > 0:
                if <size_t>wres >= iov[idx].iov_len:
                    wres -= <int>iov[idx].iov_len
                    idx += 1
                else:
                    iov[idx].iov_base = <char *>iov[idx].iov_base + wres
                    iov[idx].iov_len -= <size_t>wres
                    wres = 0
            if total == 0 and self._use_uring and covers and fres != -ECANCELED:
                if fres < 0:
                    err = -fres
                    failed_op[0] = OP_FSYNC
                synced = True
        free(iov)
        if err:
            return err
        if not synced:
            if self._use_uring:
                fres = 0
                ret = self._sync_submit(NULL, 0, 0, False, True, &wres, &fres)
                if ret < 0:
                    failed_op[0] = OP_FSYNC
                    return -ret
                if fres < 0:
                    failed_op[0] = OP_FSYNC
                    return -fres
            else:
                while fdatasync(self._fd) != 0:
                    if errno != EINTR:
                        failed_op[0] = OP_FSYNC
                        return errno
        if _faults_on and _fault_fsync:
            failed_op[0] = OP_FSYNC
            return _fault_fsync
        return 0

    # -- segments and checkpoints
    def segments(self):
        """[(seq, path)] of the segment files, oldest first."""
        return list_segments(self.directory)

    def truncate_before(self, uint64_t lsn):
        """Delete whole segments whose records all have lsn < ``lsn`` (never the open one).

        Returns the [(seq, path)] deleted.  The caller has persisted elsewhere what they
        protected."""
        cdef int rc = 0
        removed = []
        self._check_usable()
        self._lock_acquire(self._commit_lock)
        try:
            for seq, path in list_segments(self.directory):
                if seq >= self._fd_seq or seq >= self._tail_seq:
                    break
                if ((<uint64_t>seq << 32) | <uint64_t>os.path.getsize(path)) >= lsn:
                    break
                # oldest first: a crash midway leaves a contiguous run of segments
                os.unlink(path)
                removed.append((seq, path))
            if removed:
                # make the unlinks durable now: the caller may drop its own copies next
                with nogil:
                    rc = fsync(self._dirfd)
                    if rc != 0:
                        rc = errno
                if rc != 0:
                    raise _oserror(rc, "directory fsync", self.directory)
            return removed
        finally:
            PyThread_release_lock(self._commit_lock)

    def close(self):
        """Commit what is pending (unless the log failed), then release the files."""
        if self._closed:
            return
        try:
            if self._error is None and self._nchunks > 0:
                self.commit()
        finally:
            self._lock_acquire(self._commit_lock)
            self._closed = True
            if self._ring_ok:
                io_uring_queue_exit(&self._ring)
                self._ring_ok = False
            if self._fd >= 0:
                c_close(self._fd)
                self._fd = -1
            if self._dirfd >= 0:
                c_close(self._dirfd)
                self._dirfd = -1
            PyThread_release_lock(self._commit_lock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"<WalWriter {self.directory!r} backend={self.backend} "
                f"durable_lsn={self._durable_lsn:#x} appended_lsn={self._appended_lsn:#x}>")
