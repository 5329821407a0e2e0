# cython: language_level=3
"""The CPython C API calls the block map (blockmap.pyx) uses beyond Cython's own cpython/*.pxd:
the keyed byte hash, a zeroing allocation (tracemalloc sees it) and a str's UTF-8 in place.

``_Py_HashBytes(p, n)``: the hash of n bytes with the interpreter's hash function (sys.hash_info:
siphash13 on 64-bit CPython 3.11) under the process's secret key (random per process unless
PYTHONHASHSEED is set); exported by CPython 3.11 (Include/cpython/pyhash.h).  Never -1."""


cdef extern from "Python.h":
    Py_hash_t _Py_HashBytes(const void* src, Py_ssize_t len) nogil
    void* PyMem_Calloc(size_t nelem, size_t elsize)
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
