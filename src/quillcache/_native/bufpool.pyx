# cython: language_level=3
"""Receive buffers that keep their pages: ``take(n)`` gives a writable buffer of ``n`` bytes
whose memory comes back to this process's pool when the buffer and every view of it are gone.

Why: a client's ``get_many`` receives its values into buffers it allocates and hands out
views of them.  Fresh memory costs more than the copy into it: on the dev machine a fresh
8 MiB buffer is ~2,000 page faults and the kernel's zero fill, and filling four of them ran at
2.3 GB/s against 25 GB/s into memory already touched.  glibc hands such buffers back to the
kernel on free (above its mmap and trim thresholds), so each call faulted them in again.  A
buffer taken from here is memory some earlier reply already touched; the pool keeps at most
``POOL_BYTES`` of free buffers (beyond that they are freed), in size classes of a quarter of a
power of two (at most a quarter more than asked for).  A buffer's memory is never reused
while any view of it exists (a view holds the buffer, the buffer holds its memory).
"""
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport uint64_t

__all__ = ["take", "pooled_bytes", "POOL_BYTES", "MIN_POOLED"]

POOL_BYTES = 64 << 20           # bytes of free buffers kept, in all
MIN_POOLED = 64 << 10           # smaller buffers come from the allocator (its own free lists reuse them)
cdef enum:
    NCLASSES = 4 * 40           # quarter steps of 2**0 .. 2**39

cdef list _free = [[] for _ in range(NCLASSES)]   # per size class: addresses (ints) of free buffers
cdef Py_ssize_t _free_bytes = 0


cdef inline int _class_of(Py_ssize_t n, Py_ssize_t* cap) noexcept:
    """The size class of n bytes and its capacity (a quarter step of a power of two)."""
    cdef int k = 0
    cdef Py_ssize_t base, step, q
    while (<Py_ssize_t>1 << (k + 1)) <= n:
        k += 1
    base = <Py_ssize_t>1 << k                       # base <= n < 2 * base (n >= MIN_POOLED: k >= 16)
    step = base >> 2
    q = (n - base + step - 1) // step               # 0..4 quarter steps above base
    cap[0] = base + q * step
    return 4 * k + <int>q


cdef class PooledBuffer:
    """A writable buffer of ``len()`` bytes (contents: whatever was there; receive into it
    before reading).  Its memory goes back to the pool when it is freed."""

    cdef char* ptr
    cdef Py_ssize_t size
    cdef Py_ssize_t cap
    cdef int cls

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __dealloc__(self):
        global _free_bytes
        if self.ptr == NULL:
            return
        if self.cls >= 0 and _free_bytes + self.cap <= POOL_BYTES:
            (<list>_free[self.cls]).append(<uint64_t>self.ptr)
            _free_bytes += self.cap
        else:
            PyMem_RawFree(self.ptr)
        self.ptr = NULL


def take(Py_ssize_t n):
    """A ``PooledBuffer`` of ``n`` bytes (n >= 0), from the pool where it has one."""
    global _free_bytes
    cdef PooledBuffer b = PooledBuffer.__new__(PooledBuffer)
    cdef Py_ssize_t cap = n
    cdef int cls = -1
    cdef list bucket
    if n < 0:
        raise ValueError(f"size {n}: must be >= 0")
    if n >= MIN_POOLED:
        cls = _class_of(n, &cap)
        if cls >= NCLASSES:
            cls, cap = -1, n
    if cls >= 0:
        bucket = <list>_free[cls]
        if bucket:
            b.ptr = <char*><uint64_t>bucket.pop()
            _free_bytes -= cap
    if b.ptr == NULL:
        b.ptr = <char*>PyMem_RawMalloc(cap if cap > 0 else 1)
        if b.ptr == NULL:
            raise MemoryError(f"could not allocate a {n}-byte receive buffer")
    b.size = n
    b.cap = cap
    b.cls = cls
    return b


def pooled_bytes():
    """Bytes of free buffers the pool holds now."""
    return _free_bytes
