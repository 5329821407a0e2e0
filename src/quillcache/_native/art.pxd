# cython: language_level=3
"""The contract of quillcache._native.art: an adaptive radix tree (Leis et al., ICDE 2013)
mapping byte-string keys to uint64 values.

Other extensions ``cimport`` this file to call the batch entry points without Python
objects.  The caller must hold a reference to the tree and must not mutate it from
another thread while a batch call runs (the Python methods enforce this; cdef callers
are trusted).
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef enum:
    ART_MAX_PREFIX = 16      # bytes of compressed path kept inline in a node (hybrid scheme)
    ART_MAX_KEY = 4096       # bytes: longest key the tree accepts

cdef enum:
    ART_NODE4 = 1
    ART_NODE16 = 2
    ART_NODE48 = 3
    ART_NODE256 = 4

# Child pointers are tagged: the low bit set means "leaf" (malloc returns >= 8-aligned
# memory, so the bit is free).  An inner node's ``term`` holds the leaf whose key ends
# exactly at this node (after its prefix): that is how a key that is a prefix of
# another key (and the empty key) is stored.
ctypedef struct art_node:
    uint8_t type
    uint8_t _reserved
    uint16_t num_children
    uint32_t prefix_len          # full length of the compressed path (may exceed ART_MAX_PREFIX)
    uint8_t prefix[ART_MAX_PREFIX]   # its first min(prefix_len, ART_MAX_PREFIX) bytes
    void* term                   # tagged leaf or NULL

ctypedef struct art_node4:
    art_node n
    uint8_t keys[4]              # sorted
    void* children[4]

ctypedef struct art_node16:
    art_node n
    uint8_t keys[16]             # sorted
    void* children[16]

ctypedef struct art_node48:
    art_node n
    uint8_t child_index[256]     # 0 = empty, else slot + 1
    void* children[48]

ctypedef struct art_node256:
    art_node n
    void* children[256]

# A leaf is this header followed by key_len key bytes (at byte offset 12).
ctypedef struct art_leaf:
    uint64_t value
    uint32_t key_len

ctypedef struct art_tree:
    void* root
    size_t size                  # keys held
    size_t mem                   # bytes currently malloc'ed for nodes and leaves


cdef class AdaptiveRadixTree:
    cdef art_tree _t
    cdef Py_ssize_t _readers     # batch reads running without the GIL (mutations refused)

    # Look up n keys; found[i] = 1 and values[i] set when keys[i] is present, else found[i] = 0.
    # Keys longer than ART_MAX_KEY are simply not found.  Returns the number found.
    cdef Py_ssize_t get_many_c(self, const uint8_t* const* keys, const size_t* lens,
                               Py_ssize_t n, uint64_t* values, char* found) noexcept nogil

    # Insert or replace n keys (each at most ART_MAX_KEY bytes: the caller checks).
    # Returns the number of keys that were new.  On allocation failure raises MemoryError;
    # the keys before the failing one stay inserted.
    cdef Py_ssize_t insert_many_c(self, const uint8_t* const* keys, const size_t* lens,
                                  const uint64_t* values, Py_ssize_t n) except -1 nogil
