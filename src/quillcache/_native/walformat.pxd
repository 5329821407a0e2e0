# cython: language_level=3
"""The WAL's on-disk format in code (docs/wal-format.md): shared by the writer (wal.pyx)
and the reader (walread.pyx).  Only constants and inline helpers: nothing to link."""
from libc.stdint cimport uint32_t

cdef enum:
    WAL_BLOCK_C = 32768        # bytes: the block every physical record stays inside
    WAL_HEADER_C = 7           # bytes: masked crc32c (4) + length (2, LE) + type (1)
    WAL_ZERO = 0               # never written; a zeroed header
    WAL_FULL = 1
    WAL_FIRST = 2
    WAL_MIDDLE = 3
    WAL_LAST = 4


cdef inline uint32_t _mask(uint32_t crc) noexcept nogil:
    """LevelDB's masked CRC: rotate right by 15 bits, add WAL_CRC_MASK_DELTA (0xa282ead8)."""
    return <uint32_t>(((crc >> 15) | (crc << 17)) + <uint32_t>0xa282ead8u)


cdef inline void _put32(char *p, uint32_t v) noexcept nogil:
    p[0] = <char>(v & 0xFF)
    p[1] = <char>((v >> 8) & 0xFF)
    p[2] = <char>((v >> 16) & 0xFF)
    p[3] = <char>((v >> 24) & 0xFF)


cdef inline uint32_t _get32(const unsigned char *p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)
