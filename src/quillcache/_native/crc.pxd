# cython: language_level=3
"""The CRC32C contract for other extensions (cimport quillcache._native.crc).

CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of the WAL records,
the frame header and the payload trailer.  ``crc32c_update`` continues ``crc`` (0 to
start) over ``n`` bytes at ``data``; it never fails and needs no GIL.  Python code uses
the module: crc32c(buffer, crc=0), CRC32C_IMPL.
"""
from libc.stdint cimport uint32_t

# the signature of libcrc32c's crc32c_extend, and of the table code that stands in for it
ctypedef uint32_t (*crc32c_extend_fn)(uint32_t crc, const unsigned char* data, size_t n) noexcept nogil

cdef uint32_t crc32c_update(uint32_t crc, const unsigned char* data, size_t n) noexcept nogil
