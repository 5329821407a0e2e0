# cython: language_level=3, boundscheck=False, wraparound=False
"""Receiving on a socket with a bounded busy-poll before blocking.

A reply that finds its reader asleep in ``recv`` costs the sender the reader's wake-up and
the reader its return from sleep.  On a virtual machine that is an inter-processor interrupt
through the hypervisor: on the machine this was measured on, about half of a 1 KiB
request's round trip on loopback (docs/protocol.md, "Busy-polling receives").  A reader that
polls for a few microseconds first takes a reply that comes within them without either.

``SpinReceiver(spin_ns).recv_into(fd, buf)`` receives into ``buf`` like
``socket.recv_into``: it polls with ``MSG_DONTWAIT`` for at most ``spin_ns`` nanoseconds,
then blocks (for the socket's ``SO_RCVTIMEO`` at most).  The GIL is released for the whole
wait.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetFromErrno
from libc.errno cimport errno, EINTR
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

from quillcache._native.includes.posix_extra cimport (
    recv, MSG_DONTWAIT, EAGAIN, poll, pollfd, POLLIN,   # EAGAIN = EWOULDBLOCK on Linux
)

MAX_SPIN_NS = 10_000_000        # ns: the longest poll a caller may ask for (10 ms)

cdef enum:
    MISS_LIMIT = 8              # polls in a row that ran out before polling pauses ...
    SKIP_AFTER_MISSES = 64      # ... for this many receives


cdef inline long long _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000LL + ts.tv_nsec


cdef ssize_t _poll(int fd, char* p, size_t n, long long spin_ns) noexcept nogil:
    """recv without blocking until data, EOF or an error come, for at most spin_ns (0: one
    blocking recv instead): the last recv's result (errno set), or -2 if the poll ran out.

    Between the receives it waits on ``poll`` with a zero timeout, not on ``recv``: ``recv``
    takes the socket's lock, and while a caller holds it the ACKs that come in for this
    socket wait in its backlog, which holds back the tail of a large request still being
    sent (a 4 MiB PUT polled with recv ran 0.88x of a sleeping one); ``poll`` reads the
    socket's state without the lock."""
    cdef ssize_t r
    cdef long long end
    cdef pollfd pfd
    if spin_ns <= 0:
        return recv(fd, p, n, 0)
    r = recv(fd, p, n, MSG_DONTWAIT)
    if r >= 0 or errno != EAGAIN:
        return r
    end = _now_ns() + spin_ns
    pfd.fd = fd
    pfd.events = POLLIN
    while True:
        pfd.revents = 0
        if poll(&pfd, 1, 0) != 0:           # readable, hung up, an error (or EINTR): receive
            r = recv(fd, p, n, MSG_DONTWAIT)
            if r >= 0 or errno != EAGAIN:
                return r
        if _now_ns() >= end:
            return -2


cdef class SpinReceiver:
    """``recv_into(fd, buf)``, polling for up to ``spin_ns`` before it blocks, and learning
    when polling does not pay: after ``MISS_LIMIT`` polls in a row that ran out (the peer is
    slower than the poll: a remote node, a busy one, a large reply), the next
    ``SKIP_AFTER_MISSES`` receives block at once, then polling is tried again.  So a reader
    of a slow peer spends at most about a ninth of ``spin_ns`` a receive on polls that fail.

    Counters: ``caught`` (receives whose data came while polling), ``missed`` (polls that ran
    out), ``skipped`` (receives that did not poll because recent polls missed)."""

    cdef readonly long long spin_ns
    cdef readonly unsigned long long caught, missed, skipped
    cdef int _misses_in_row, _skip_left

    def __cinit__(self, long long spin_ns):
        if spin_ns < 0 or spin_ns > MAX_SPIN_NS:
            raise ValueError(f"spin_ns {spin_ns}: must be 0 to {MAX_SPIN_NS}")
        self.spin_ns = spin_ns

    def recv_into(self, int fd, object buf):
        """Receive into the writable contiguous buffer ``buf``: the number of bytes (0: the
        peer closed).  Errors raise the ``OSError`` subclass of their errno
        (``BlockingIOError``: ``SO_RCVTIMEO`` expired); a signal runs its handler and the
        receive goes on, as ``socket.recv_into`` does."""
        cdef Py_buffer view
        cdef ssize_t r
        cdef long long spin = self.spin_ns
        cdef bint polled = False
        if spin and self._skip_left:
            self._skip_left -= 1
            self.skipped += 1
            spin = 0
        PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
        try:
            with nogil:
                r = _poll(fd, <char*>view.buf, <size_t>view.len, spin)
                if r == -2:                         # nothing came while polling: block
                    polled = True
                    r = recv(fd, view.buf, <size_t>view.len, 0)
            if spin:
                if polled:
                    self.missed += 1
                    self._misses_in_row += 1
                    if self._misses_in_row >= MISS_LIMIT:
                        self._misses_in_row = 0
                        self._skip_left = SKIP_AFTER_MISSES
                elif r >= 0:
                    self.caught += 1
                    self._misses_in_row = 0
            while r < 0 and errno == EINTR:
                PyErr_CheckSignals()                # raises what a handler raised
                with nogil:
                    r = recv(fd, view.buf, <size_t>view.len, 0)
            if r < 0:
                PyErr_SetFromErrno(OSError)
            return r
        finally:
            PyBuffer_Release(&view)
