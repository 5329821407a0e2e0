# cython: language_level=3, binding=False
"""An adaptive radix tree (Leis, Kemper, Neumann, ICDE 2013): byte-string keys -> uint64.

* Node4 / Node16 / Node48 / Node256 inner nodes that grow when full and shrink when
  sparse (Node256 -> Node48 at <= 37 children, Node48 -> Node16 at <= 12, Node16 ->
  Node4 at <= 3), so a subtree's size follows its fan-out.
* Path compression, hybrid: a node keeps the first ``ART_MAX_PREFIX`` bytes of its
  compressed path inline; longer paths are checked against a leaf below it (lookups
  skip them optimistically and compare the whole key at the leaf).
* Lazy expansion: a subtree with a single key is just that leaf; a Node4 left with one
  entry is collapsed into its child (prefixes merged) or its leaf.
* A key that is a proper prefix of other keys (and the empty key) lives in the ``term``
  slot of the node where it ends, so arbitrary byte strings work without a terminator.

Every malloc and free updates ``memory_bytes()``.  Single-key calls hold the GIL (each is
bounded by the key length and is cheaper than releasing it); batch calls and ordered
walks release it, and mutations are refused (RuntimeError) while one runs.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_Check, PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_New, PyTuple_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset

from quillcache._native.includes.builtins cimport (
    __builtin_ctz, __builtin_expect, __builtin_prefetch, __m128i, _mm_cmpeq_epi8, _mm_loadu_si128,
    _mm_movemask_epi8, _mm_set1_epi8,
)

__all__ = ["AdaptiveRadixTree", "MAX_KEY_BYTES", "MAX_PREFIX_INLINE"]

MAX_KEY_BYTES = ART_MAX_KEY          # bytes
MAX_PREFIX_INLINE = ART_MAX_PREFIX   # bytes

cdef enum:
    LEAF_HEADER = 12          # bytes before a leaf's key (value u64 + key_len u32)
    LEAF_MIN_ALLOC = 16       # bytes: a leaf allocation is never smaller than its struct
    ITER_CHUNK = 256          # entries fetched per refill of an items() iterator
    SCAN_INLINE = 64          # entries: scan_prefix result buffer on the stack (beyond it: malloc)
    BATCH_NOGIL_MIN = 16      # keys: smaller get_many batches keep the GIL
    BATCH_WAYS = 8            # lookups in flight in a batch: each step of one hides a cache miss of another
    PREFETCH_LINES = 3        # cache lines prefetched per node (a Node16 is 176 bytes)
    SHRINK_256 = 37           # children: Node256 at or below this becomes a Node48
    SHRINK_48 = 12            # children: Node48 -> Node16
    SHRINK_16 = 3             # children: Node16 -> Node4


# --------------------------------------------------------------------------- leaves

cdef inline bint is_leaf(const void* p) noexcept nogil:
    return (<uintptr_t>p) & 1

cdef inline art_leaf* as_leaf(const void* p) noexcept nogil:
    return <art_leaf*>((<uintptr_t>p) & ~(<uintptr_t>1))

cdef inline void* tag_leaf(art_leaf* l) noexcept nogil:
    return <void*>((<uintptr_t>l) | 1)

cdef inline uint8_t* leaf_key(art_leaf* l) noexcept nogil:
    return (<uint8_t*>l) + LEAF_HEADER

cdef inline size_t leaf_alloc(size_t klen) noexcept nogil:
    cdef size_t s = LEAF_HEADER + klen
    return s if s >= LEAF_MIN_ALLOC else LEAF_MIN_ALLOC

cdef inline bint leaf_matches(art_leaf* l, const uint8_t* key, size_t klen) noexcept nogil:
    return l.key_len == klen and memcmp(leaf_key(l), key, klen) == 0

cdef inline int leaf_cmp(art_leaf* l, const uint8_t* key, size_t klen) noexcept nogil:
    cdef size_t n = l.key_len if l.key_len < klen else klen
    cdef int c = memcmp(leaf_key(l), key, n)
    if c != 0:
        return c
    if l.key_len == klen:
        return 0
    return -1 if l.key_len < klen else 1

cdef void* make_leaf(art_tree* t, const uint8_t* key, size_t klen, uint64_t value) noexcept nogil:
    cdef size_t size = leaf_alloc(klen)
    cdef art_leaf* l = <art_leaf*>malloc(size)
    if l == NULL:
        return NULL
    t.mem += size
    l.value = value
    l.key_len = <uint32_t>klen
    memcpy(leaf_key(l), key, klen)
    return tag_leaf(l)

cdef inline void free_leaf(art_tree* t, art_leaf* l) noexcept nogil:
    t.mem -= leaf_alloc(l.key_len)
    free(l)


# --------------------------------------------------------------------------- nodes

include "art_nodes.pxi"


# --------------------------------------------------------------------------- operations

cdef inline art_leaf* art_search(art_tree* t, const uint8_t* key, size_t klen) noexcept nogil:
    cdef void* p = t.root
    cdef art_node* n
    cdef art_leaf* l
    cdef void** slot
    cdef size_t depth = 0
    while p != NULL:
        if is_leaf(p):
            l = as_leaf(p)
            return l if leaf_matches(l, key, klen) else NULL
        n = <art_node*>p
        if n.prefix_len:
            # Optimistic beyond the inline bytes: the leaf comparison settles it.
            if depth + n.prefix_len > klen:
                return NULL
            if memcmp(n.prefix, key + depth, min_size(n.prefix_len, ART_MAX_PREFIX)) != 0:
                return NULL
            depth += n.prefix_len
        if depth == klen:
            if n.term != NULL and leaf_matches(as_leaf(n.term), key, klen):
                return as_leaf(n.term)
            return NULL
        slot = find_child(n, key[depth])
        if slot == NULL:
            return NULL
        p = slot[0]
        depth += 1
    return NULL

cdef size_t prefix_mismatch(art_node* n, const uint8_t* key, size_t klen, size_t depth) noexcept nogil:
    """How many bytes of n's compressed path match key[depth:] (pessimistic: checks all)."""
    cdef size_t avail = klen - depth
    cdef size_t limit = min_size(min_size(n.prefix_len, ART_MAX_PREFIX), avail)
    cdef size_t i
    cdef uint8_t* lk
    for i in range(limit):
        if n.prefix[i] != key[depth + i]:
            return i
    if n.prefix_len <= ART_MAX_PREFIX or limit < ART_MAX_PREFIX:
        return limit
    lk = leaf_key(minimum(n)) + depth
    limit = min_size(n.prefix_len, avail)
    for i in range(ART_MAX_PREFIX, limit):
        if lk[i] != key[depth + i]:
            return i
    return limit

cdef inline void node4_place(art_node* n, void* leaf, const uint8_t* key, size_t klen, size_t d) noexcept nogil:
    cdef art_node4* p4 = <art_node4*>n
    if klen == d:
        n.term = leaf
    else:
        sorted_insert(p4.keys, p4.children, n.num_children, key[d], leaf)
        n.num_children += 1

cdef int art_insert(art_tree* t, void** ref, const uint8_t* key, size_t klen, size_t depth,
                    uint64_t value, uint64_t* old) noexcept nogil:
    """Returns 1 if key was new, 0 if its value was replaced (old set), -1 if out of memory
    (tree unchanged)."""
    cdef void* p
    cdef void* newleaf
    cdef art_leaf* l
    cdef art_node* n
    cdef art_node* nn
    cdef uint8_t* lk
    cdef size_t i, limit, pm
    cdef uint8_t b
    cdef void** slot
    while True:
        p = ref[0]
        if p == NULL:
            newleaf = make_leaf(t, key, klen, value)
            if newleaf == NULL:
                return -1
            ref[0] = newleaf
            return 1
        if is_leaf(p):
            l = as_leaf(p)
            if leaf_matches(l, key, klen):
                old[0] = l.value
                l.value = value
                return 0
            # Split the leaf: a Node4 over the common part of both keys.
            lk = leaf_key(l)
            limit = min_size(l.key_len, klen)
            i = depth
            while i < limit and lk[i] == key[i]:
                i += 1
            nn = alloc_node(t, ART_NODE4)
            if nn == NULL:
                return -1
            newleaf = make_leaf(t, key, klen, value)
            if newleaf == NULL:
                free_node(t, nn)
                return -1
            nn.prefix_len = <uint32_t>(i - depth)
            memcpy(nn.prefix, key + depth, min_size(i - depth, ART_MAX_PREFIX))
            node4_place(nn, p, lk, l.key_len, i)
            node4_place(nn, newleaf, key, klen, i)
            ref[0] = nn
            return 1
        n = <art_node*>p
        if n.prefix_len:
            pm = prefix_mismatch(n, key, klen, depth)
            if pm < n.prefix_len:
                # The key leaves the compressed path after pm bytes: split it.
                nn = alloc_node(t, ART_NODE4)
                if nn == NULL:
                    return -1
                newleaf = make_leaf(t, key, klen, value)
                if newleaf == NULL:
                    free_node(t, nn)
                    return -1
                nn.prefix_len = <uint32_t>pm
                memcpy(nn.prefix, n.prefix, min_size(pm, ART_MAX_PREFIX))
                if n.prefix_len <= ART_MAX_PREFIX:
                    b = n.prefix[pm]
                    n.prefix_len -= <uint32_t>(pm + 1)
                    memmove(n.prefix, n.prefix + pm + 1, n.prefix_len)
                else:
                    lk = leaf_key(minimum(n))
                    b = lk[depth + pm]
                    n.prefix_len -= <uint32_t>(pm + 1)
                    memcpy(n.prefix, lk + depth + pm + 1, min_size(n.prefix_len, ART_MAX_PREFIX))
                (<art_node4*>nn).keys[0] = b
                (<art_node4*>nn).children[0] = n
                nn.num_children = 1
                node4_place(nn, newleaf, key, klen, depth + pm)
                ref[0] = nn
                return 1
            depth += n.prefix_len
        if depth == klen:
            if n.term != NULL:
                l = as_leaf(n.term)     # the whole path was verified: same key
                old[0] = l.value
                l.value = value
                return 0
            newleaf = make_leaf(t, key, klen, value)
            if newleaf == NULL:
                return -1
            n.term = newleaf
            return 1
        slot = find_child(n, key[depth])
        if slot != NULL:
            ref = slot
            depth += 1
            continue
        newleaf = make_leaf(t, key, klen, value)
        if newleaf == NULL:
            return -1
        if add_child(t, ref, n, key[depth], newleaf) < 0:
            free_leaf(t, as_leaf(newleaf))
            return -1
        return 1

cdef art_leaf* art_delete(art_tree* t, void** ref, const uint8_t* key, size_t klen, size_t depth) noexcept nogil:
    """Detach the leaf of key (the caller frees it) and restructure; NULL if absent."""
    cdef void* p = ref[0]
    cdef art_node* n
    cdef art_leaf* l
    cdef void** slot
    cdef void* child
    if p == NULL:
        return NULL
    if is_leaf(p):
        l = as_leaf(p)
        if leaf_matches(l, key, klen):
            ref[0] = NULL
            return l
        return NULL
    n = <art_node*>p
    if n.prefix_len:
        if depth + n.prefix_len > klen:
            return NULL
        if memcmp(n.prefix, key + depth, min_size(n.prefix_len, ART_MAX_PREFIX)) != 0:
            return NULL
        depth += n.prefix_len
    if depth == klen:
        if n.term == NULL or not leaf_matches(as_leaf(n.term), key, klen):
            return NULL
        l = as_leaf(n.term)
        n.term = NULL
        collapse(t, ref, n)
        return l
    slot = find_child(n, key[depth])
    if slot == NULL:
        return NULL
    child = slot[0]
    if not is_leaf(child):
        return art_delete(t, slot, key, klen, depth + 1)
    l = as_leaf(child)
    if not leaf_matches(l, key, klen):
        return NULL
    remove_child(t, ref, n, key[depth])
    collapse(t, ref, <art_node*>ref[0])
    return l

cdef void destroy(art_tree* t, void* p) noexcept nogil:
    cdef art_node* n
    cdef int i
    if p == NULL:
        return
    if is_leaf(p):
        free_leaf(t, as_leaf(p))
        return
    n = <art_node*>p
    destroy(t, n.term)
    if n.type == ART_NODE4:
        for i in range(n.num_children):
            destroy(t, (<art_node4*>n).children[i])
    elif n.type == ART_NODE16:
        for i in range(n.num_children):
            destroy(t, (<art_node16*>n).children[i])
    elif n.type == ART_NODE48:
        for i in range(48):
            destroy(t, (<art_node48*>n).children[i])
    else:
        for i in range(256):
            destroy(t, (<art_node256*>n).children[i])
    free_node(t, n)


# --------------------------------------------------------------------------- ordered walks, prefix scans

include "art_walk.pxi"


include "art_check.pxi"


# --------------------------------------------------------------------------- Python API

cdef inline const uint8_t* key_ptr(object key, Py_ssize_t* klen, Py_ssize_t limit) except NULL:
    if not PyBytes_Check(key):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    klen[0] = PyBytes_GET_SIZE(key)
    if klen[0] > limit:
        raise ValueError(f"key is {klen[0]} bytes: at most {limit} bytes")
    return <const uint8_t*>PyBytes_AS_STRING(key)

cdef inline int writable(AdaptiveRadixTree tree) except -1:
    if tree._readers:
        raise RuntimeError("AdaptiveRadixTree mutated while a batch read runs in another thread")
    return 0

cdef inline uint64_t to_u64(object value) except? 0xFFFFFFFFFFFFFFFF:
    if not PyLong_Check(value):
        raise TypeError(f"value must be an int, not {type(value).__name__}")
    return value                      # OverflowError outside 0..2**64-1

cdef inline object leaf_item(art_leaf* l):
    return (PyBytes_FromStringAndSize(<char*>leaf_key(l), l.key_len), l.value)


# --------------------------------------------------------------------------- batches

include "art_batch.pxi"


cdef class AdaptiveRadixTree:
    """Ordered map of byte strings (at most MAX_KEY_BYTES each) to uint64 values.

    ``delete(key)`` raises KeyError when key is absent; ``pop(key, default)`` does not.
    """

    def __cinit__(self):
        self._t.root = NULL
        self._t.size = 0
        self._t.mem = 0
        self._readers = 0

    def __dealloc__(self):
        with nogil:
            destroy(&self._t, self._t.root)
        self._t.root = NULL

    def __len__(self):
        return self._t.size

    def __contains__(self, key):
        cdef Py_ssize_t klen
        if not PyBytes_Check(key):
            return False
        klen = PyBytes_GET_SIZE(key)
        return art_search(&self._t, <const uint8_t*>PyBytes_AS_STRING(key), klen) != NULL

    def get(self, key, default=None):
        cdef Py_ssize_t klen
        cdef const uint8_t* kp = key_ptr(key, &klen, ART_MAX_KEY)
        cdef art_leaf* l = art_search(&self._t, kp, klen)
        if l == NULL:
            return default
        return l.value

    def __getitem__(self, key):
        cdef Py_ssize_t klen
        cdef const uint8_t* kp = key_ptr(key, &klen, ART_MAX_KEY)
        cdef art_leaf* l = art_search(&self._t, kp, klen)
        if l == NULL:
            raise KeyError(key)
        return l.value

    def insert(self, key, value):
        """Set key to value (an int in 0..2**64-1); returns the old value or None."""
        cdef Py_ssize_t klen
        cdef const uint8_t* kp = key_ptr(key, &klen, ART_MAX_KEY)
        cdef uint64_t v = to_u64(value)  # TypeError / OverflowError before the tree is touched
        cdef uint64_t old = 0
        cdef int r
        writable(self)
        r = art_insert(&self._t, &self._t.root, kp, klen, 0, v, &old)
        if r < 0:
            raise MemoryError("AdaptiveRadixTree: out of memory")
        if r == 1:
            self._t.size += 1
            return None
        return old

    def __setitem__(self, key, value):
        self.insert(key, value)

    def delete(self, key):
        """Remove key and return its value; KeyError if absent."""
        cdef Py_ssize_t klen
        cdef const uint8_t* kp = key_ptr(key, &klen, ART_MAX_KEY)
        cdef art_leaf* l
        cdef uint64_t v
        writable(self)
        l = art_delete(&self._t, &self._t.root, kp, klen, 0)
        if l == NULL:
            raise KeyError(key)
        v = l.value
        free_leaf(&self._t, l)
        self._t.size -= 1
        return v

    def __delitem__(self, key):
        self.delete(key)

    def pop(self, key, default=None):
        """Remove key and return its value, or default if absent."""
        cdef Py_ssize_t klen
        cdef const uint8_t* kp = key_ptr(key, &klen, ART_MAX_KEY)
        cdef art_leaf* l
        cdef uint64_t v
        writable(self)
        l = art_delete(&self._t, &self._t.root, kp, klen, 0)
        if l == NULL:
            return default
        v = l.value
        free_leaf(&self._t, l)
        self._t.size -= 1
        return v

    def clear(self):
        writable(self)
        with nogil:
            destroy(&self._t, self._t.root)
        self._t.root = NULL
        self._t.size = 0

    def memory_bytes(self):
        """Bytes currently allocated by the tree (nodes and leaves, as requested from malloc)."""
        return self._t.mem

    def minimum(self):
        cdef art_leaf* l = minimum(self._t.root)
        return None if l == NULL else leaf_item(l)

    def maximum(self):
        cdef art_leaf* l = maximum(self._t.root)
        return None if l == NULL else leaf_item(l)

    # ---- batches

    cdef Py_ssize_t get_many_c(self, const uint8_t* const* keys, const size_t* lens,
                               Py_ssize_t n, uint64_t* values, char* found) noexcept nogil:
        return search_batch(&self._t, keys, lens, n, values, found)

    cdef Py_ssize_t insert_many_c(self, const uint8_t* const* keys, const size_t* lens,
                                  const uint64_t* values, Py_ssize_t n) except -1 nogil:
        cdef Py_ssize_t i, added = 0
        cdef uint64_t old
        cdef int r
        for i in range(n):
            r = art_insert(&self._t, &self._t.root, keys[i], lens[i], 0, values[i], &old)
            if r < 0:
                with gil:
                    raise MemoryError(f"AdaptiveRadixTree: out of memory after {i} of {n} inserts")
            if r == 1:
                added += 1
                self._t.size += 1
        return added

    def get_many(self, keys, default=None):
        """[get(k, default) for k in keys], looked up in one C loop without the GIL."""
        return tree_get_many(self, keys, default)

    def insert_many(self, keys, values):
        """Insert pairs keys[i] -> values[i]; every key and value is checked before the tree
        is touched.  Returns the number of keys that were new."""
        return tree_insert_many(self, keys, values)

    def get_blob(self, blob, key_off, out):
        """Look up the keys of a key blob (key i is ``blob[key_off[i]:key_off[i + 1]]``,
        ``key_off`` a uint64 buffer of n + 1 offsets) in one C loop without the GIL:
        ``out[i]`` (an int64 buffer of n) = its value, or -1 when absent.  Returns the
        number found.  No bytes object is made per key."""
        return tree_get_blob(self, blob, key_off, out)

    def insert_blob(self, blob, key_off, first_value=0):
        """Insert the keys of a key blob (as in ``get_blob``): key i -> first_value + i.
        Every offset is checked before the tree is touched.  Returns the number of keys
        that were new."""
        return tree_insert_blob(self, blob, key_off, to_u64(first_value))

    # ---- ordered access

    def scan_prefix(self, prefix):
        """[(key, value)] for every key starting with prefix, in key order."""
        cdef Py_ssize_t plen
        cdef const uint8_t* pp = key_ptr(prefix, &plen, ART_MAX_KEY)
        cdef list out
        self._readers += 1
        try:
            out = scan(&self._t, pp, plen)
        finally:
            self._readers -= 1
        return out

    def keys_where(self, mask, want):
        """[key] of every key whose value & mask == want, in key order (one walk of the
        whole tree without the GIL: O(keys held))."""
        cdef uint64_t m = to_u64(mask), w = to_u64(want)
        cdef list out
        self._readers += 1
        try:
            out = scan_where(&self._t, m, w)
        finally:
            self._readers -= 1
        return out

    def items(self, start=None):
        """Iterator of (key, value) in key order from the first key >= start.  It fetches
        ITER_CHUNK entries at a time and resumes after the last key it returned, so the
        tree may be changed between steps (later steps see the changes)."""
        cdef Py_ssize_t slen
        if start is not None:
            key_ptr(start, &slen, ART_MAX_KEY)
        return _Items(self, start)

    def keys(self, start=None):
        return (k for k, _ in self.items(start))

    def __iter__(self):
        return self.keys()

    # ---- introspection

    def node_counts(self):
        """{"node4": n, "node16": n, "node48": n, "node256": n, "leaf": n}."""
        return tree_node_counts(self)

    def check(self):
        """Verify the structural invariants; raises AssertionError naming the first broken one."""
        tree_check(self)

    def __reduce__(self):
        raise TypeError("AdaptiveRadixTree is not picklable; dump items() instead")
