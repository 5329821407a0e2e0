# cython: language_level=3
"""CPython's keyed byte hash and the allocator calls the block map (blockmap.pyx) uses.

``_Py_HashBytes(p, n)``: the hash of n bytes with the interpreter's hash function (sys.hash_info:
siphash13 on 64-bit CPython 3.11) under the process's secret key (random per process unless
PYTHONHASHSEED is set); exported by CPython 3.11 (Include/cpython/pyhash.h).  Never -1."""


cdef extern from "Python.h":
    Py_hash_t _Py_HashBytes(const void* src, Py_ssize_t len) nogil
    void* PyMem_Calloc(size_t nelem, size_t elsize)
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
