# cython: language_level=3
"""CRC32C (Castagnoli): the one place that chooses how it is computed.

google_crc32c's extension links libcrc32c (SSE4.2 / ARMv8 CRC instructions), which
exports ``crc32c_extend(crc, data, n)``.  Its address is looked up once, at import, with
ctypes; it is used only if it computes what ``google_crc32c.value`` computes on a probe
and what the slicing-by-8 table code below computes on test vectors (every length up to
a few cache lines, unaligned starts, a non-zero start value).  Otherwise the table code
runs (~2 GB/s against ~20 GB/s; measured in bench/suite_codec.py).

Other extensions cimport ``crc32c_update`` (crc.pxd); Python code calls ``crc32c``.
"""
from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport uint32_t

from quillcache.errors import InvalidArgument

__all__ = ["crc32c", "crc32c_table", "CRC32C_IMPL"]

cdef enum:
    CRC_NOGIL_BYTES = 65536     # bytes: crc32c() releases the GIL for buffers larger than this

cdef uint32_t _CRC_POLY = 0x82F63B78U  # CRC32C, reflected


# ---- the portable path: slicing-by-8 -----------------------------------------------------------
cdef uint32_t _T[8][256]


cdef void _init_tables() noexcept:
    cdef uint32_t c
    cdef int i, k
    for i in range(256):
        c = <uint32_t>i
        for k in range(8):
            if c & 1:
                c = (c >> 1) ^ _CRC_POLY
            else:
                c = c >> 1
        _T[0][i] = c
    for i in range(256):
        for k in range(1, 8):
            _T[k][i] = (_T[k - 1][i] >> 8) ^ _T[0][_T[k - 1][i] & 0xFF]


_init_tables()


cdef uint32_t _crc32c_table(uint32_t crc, const unsigned char* p, size_t n) noexcept nogil:
    """Slicing-by-8 CRC32C; ``crc`` is a previous result (0 to start)."""
    cdef uint32_t c = ~crc
    cdef uint32_t lo, hi
    while n and (<size_t>p & 7):
        c = _T[0][(c ^ p[0]) & 0xFF] ^ (c >> 8)
        p += 1
        n -= 1
    while n >= 8:
        lo = c ^ (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24))
        hi = <uint32_t>p[4] | (<uint32_t>p[5] << 8) | (<uint32_t>p[6] << 16) | (<uint32_t>p[7] << 24)
        c = (_T[7][lo & 0xFF] ^ _T[6][(lo >> 8) & 0xFF] ^ _T[5][(lo >> 16) & 0xFF] ^ _T[4][lo >> 24]
             ^ _T[3][hi & 0xFF] ^ _T[2][(hi >> 8) & 0xFF] ^ _T[1][(hi >> 16) & 0xFF] ^ _T[0][hi >> 24])
        p += 8
        n -= 8
    while n:
        c = _T[0][(c ^ p[0]) & 0xFF] ^ (c >> 8)
        p += 1
        n -= 1
    return ~c


# ---- the fast path: libcrc32c's crc32c_extend, found once ----------------------------------------
cdef crc32c_extend_fn _found = NULL     # the checked crc32c_extend, NULL if none
cdef crc32c_extend_fn _active = NULL    # what crc32c_update calls; NULL = the table code
_lib = None                             # keeps the CDLL handle that _found points into


def _lookup_crc32c_extend():
    """(address of crc32c_extend in google_crc32c's extension or 0, the CDLL holding it)."""
    try:
        import ctypes
        from google_crc32c import _crc32c
        lib = ctypes.CDLL(_crc32c.__file__)
        return ctypes.cast(lib.crc32c_extend, ctypes.c_void_p).value or 0, lib
    except (ImportError, OSError, AttributeError):
        return 0, None


cdef bint _agrees(crc32c_extend_fn fn) except -1:
    """True if fn computes what google_crc32c.value and the table code compute."""
    cdef bytes probe = bytes(range(256)) * 37
    cdef const unsigned char* p = probe
    cdef size_t n
    try:
        import google_crc32c
    except ImportError:
        return False
    if fn(0, <const unsigned char*>b"123456789", 9) != 0xE3069283U:   # the CRC-32C check value
        return False
    if fn(0, p, <size_t>len(probe)) != google_crc32c.value(probe):
        return False
    for n in (0, 1, 7, 8, 9, 15, 63, 64, 65, 1000, 1280):
        if (fn(0, p + 3, n) != _crc32c_table(0, p + 3, n)
                or fn(0x12345678U, p, n) != _crc32c_table(0x12345678U, p, n)):
            return False
    return True


cdef int _install() except -1:
    global _found, _active, _lib
    addr, lib = _lookup_crc32c_extend()
    cdef crc32c_extend_fn fn = <crc32c_extend_fn><size_t>addr
    if fn != NULL and _agrees(fn):
        _found = fn
        _active = fn
        _lib = lib
    return 0


_install()

CRC32C_IMPL = ("libcrc32c crc32c_extend (from google_crc32c)" if _found != NULL
               else "slicing-by-8 table")


def _select_impl(str which=None):
    """Test hook: "c" (crc32c_extend) or "table" selects the path of every caller in this
    process; returns the one in use.  Not thread-safe: tests only."""
    global _active
    if which == "table":
        _active = NULL
    elif which == "c":
        if _found == NULL:
            raise InvalidArgument("crc32c_extend was not found in google_crc32c")
        _active = _found
    elif which is not None:
        raise InvalidArgument(f"unknown crc32c implementation {which!r}; expected 'c' or 'table'")
    return "c" if _active != NULL else "table"


# ---- the API ---------------------------------------------------------------------------------------
cdef uint32_t crc32c_update(uint32_t crc, const unsigned char* data, size_t n) noexcept nogil:
    """CRC32C of ``n`` bytes at ``data`` continuing ``crc`` (0 to start)."""
    if _active != NULL:
        return _active(crc, data, n)
    return _crc32c_table(crc, data, n)


def crc32c(buffer, uint32_t crc=0):
    """CRC32C of ``buffer`` continuing ``crc`` (0 to start): ``crc32c(b, crc32c(a)) ==
    crc32c(a + b)``.

    ``buffer`` is any C-contiguous buffer (bytes, bytearray, memoryview, mmap, a numpy
    array); it is read in place, not copied, with the GIL released when it is larger than
    64 KiB.  A buffer that is not C-contiguous raises its exporter's error (BufferError;
    ValueError from numpy)."""
    cdef Py_buffer view
    cdef uint32_t out
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        if view.len > CRC_NOGIL_BYTES:
            with nogil:
                out = crc32c_update(crc, <const unsigned char*>view.buf, <size_t>view.len)
        else:
            out = crc32c_update(crc, <const unsigned char*>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return out


def crc32c_table(buffer, uint32_t crc=0):
    """``crc32c`` computed by the slicing-by-8 table code whatever path is selected (tests,
    benchmarks)."""
    cdef Py_buffer view
    cdef uint32_t out
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            out = _crc32c_table(crc, <const unsigned char*>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return out
