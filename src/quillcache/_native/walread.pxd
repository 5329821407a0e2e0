# cython: language_level=3
"""The WAL reader's contract for other extensions (cimport quillcache._native.walread).

Python code uses the module (or its re-export in quillcache._native.wal): WalReader,
list_segments, segment_name.
"""
from libc.stdint cimport uint64_t


cdef class WalReader:
    cdef readonly object path
    cdef readonly list segments
    cdef readonly list corruption
    cdef readonly list corruption_lsns
    cdef readonly uint64_t tail_bytes
    cdef readonly uint64_t valid_end
    cdef readonly uint64_t end_lsn
    cdef readonly uint64_t max_record_bytes

    cdef _report(self, uint64_t nbytes, str reason, uint64_t lsn)
    cdef _cut(self, bint is_last, uint64_t nbytes, uint64_t lsn)
