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
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
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

cdef inline size_t node_size(uint8_t kind) noexcept nogil:
    if kind == ART_NODE4:
        return sizeof(art_node4)
    if kind == ART_NODE16:
        return sizeof(art_node16)
    if kind == ART_NODE48:
        return sizeof(art_node48)
    return sizeof(art_node256)

cdef art_node* alloc_node(art_tree* t, uint8_t kind) noexcept nogil:
    cdef size_t size = node_size(kind)
    cdef art_node* n = <art_node*>calloc(1, size)
    if n == NULL:
        return NULL
    t.mem += size
    n.type = kind
    return n

cdef inline void free_node(art_tree* t, art_node* n) noexcept nogil:
    t.mem -= node_size(n.type)
    free(n)

cdef inline void copy_header(art_node* dst, const art_node* src) noexcept nogil:
    dst.num_children = src.num_children
    dst.prefix_len = src.prefix_len
    memcpy(dst.prefix, src.prefix, ART_MAX_PREFIX)
    dst.term = src.term

cdef inline size_t min_size(size_t a, size_t b) noexcept nogil:
    return a if a < b else b

cdef inline void** find_child(art_node* n, uint8_t c) noexcept nogil:
    """The slot of the child under byte c, or NULL."""
    cdef unsigned int bits
    cdef uint8_t idx
    if n.type <= ART_NODE16:
        # Node4 and Node16 keep keys[] at the same offset and a Node4 has 16 readable
        # bytes there (its children follow), so one SSE2 compare serves both; the mask
        # drops stale bytes past num_children.
        bits = <unsigned int>_mm_movemask_epi8(_mm_cmpeq_epi8(
            _mm_set1_epi8(<char>c), _mm_loadu_si128(<const __m128i*>(<art_node4*>n).keys)))
        bits &= (<unsigned int>1 << n.num_children) - 1
        if bits == 0:
            return NULL
        if n.type == ART_NODE4:
            return &(<art_node4*>n).children[__builtin_ctz(bits)]
        return &(<art_node16*>n).children[__builtin_ctz(bits)]
    if n.type == ART_NODE48:
        idx = (<art_node48*>n).child_index[c]
        return &(<art_node48*>n).children[idx - 1] if idx else NULL
    return &(<art_node256*>n).children[c] if (<art_node256*>n).children[c] != NULL else NULL

cdef void* first_child(art_node* n) noexcept nogil:
    cdef int b
    cdef art_node48* p48
    cdef art_node256* p256
    if n.num_children == 0:
        return NULL
    if n.type == ART_NODE4:
        return (<art_node4*>n).children[0]
    if n.type == ART_NODE16:
        return (<art_node16*>n).children[0]
    if n.type == ART_NODE48:
        p48 = <art_node48*>n
        for b in range(256):
            if p48.child_index[b]:
                return p48.children[p48.child_index[b] - 1]
        return NULL
    p256 = <art_node256*>n
    for b in range(256):
        if p256.children[b] != NULL:
            return p256.children[b]
    return NULL

cdef void* last_child(art_node* n) noexcept nogil:
    cdef int b
    cdef art_node48* p48
    cdef art_node256* p256
    if n.num_children == 0:
        return NULL
    if n.type == ART_NODE4:
        return (<art_node4*>n).children[n.num_children - 1]
    if n.type == ART_NODE16:
        return (<art_node16*>n).children[n.num_children - 1]
    if n.type == ART_NODE48:
        p48 = <art_node48*>n
        for b in range(255, -1, -1):
            if p48.child_index[b]:
                return p48.children[p48.child_index[b] - 1]
        return NULL
    p256 = <art_node256*>n
    for b in range(255, -1, -1):
        if p256.children[b] != NULL:
            return p256.children[b]
    return NULL

cdef art_leaf* minimum(void* p) noexcept nogil:
    cdef art_node* n
    while p != NULL:
        if is_leaf(p):
            return as_leaf(p)
        n = <art_node*>p
        if n.term != NULL:
            return as_leaf(n.term)      # the shortest key below a node is its smallest
        p = first_child(n)
    return NULL

cdef art_leaf* maximum(void* p) noexcept nogil:
    cdef art_node* n
    while p != NULL:
        if is_leaf(p):
            return as_leaf(p)
        n = <art_node*>p
        if n.num_children == 0:
            return as_leaf(n.term) if n.term != NULL else NULL
        p = last_child(n)
    return NULL

cdef inline void sorted_insert(uint8_t* keys, void** children, int count, uint8_t c, void* child) noexcept nogil:
    cdef int i = 0
    while i < count and keys[i] < c:
        i += 1
    memmove(keys + i + 1, keys + i, count - i)
    memmove(children + i + 1, children + i, (count - i) * sizeof(void*))
    keys[i] = c
    children[i] = child

cdef int add_child(art_tree* t, void** ref, art_node* n, uint8_t c, void* child) noexcept nogil:
    """Add child under byte c (absent); grows n (updating *ref) when full.  0, or -1 with
    the tree unchanged when out of memory."""
    cdef art_node4* p4
    cdef art_node16* p16
    cdef art_node48* p48
    cdef art_node256* p256
    cdef art_node* bigger
    cdef int i, pos
    if n.type == ART_NODE4:
        p4 = <art_node4*>n
        if n.num_children < 4:
            sorted_insert(p4.keys, p4.children, n.num_children, c, child)
            n.num_children += 1
            return 0
        bigger = alloc_node(t, ART_NODE16)
        if bigger == NULL:
            return -1
        copy_header(bigger, n)
        memcpy((<art_node16*>bigger).keys, p4.keys, 4)
        memcpy((<art_node16*>bigger).children, p4.children, 4 * sizeof(void*))
        ref[0] = bigger
        free_node(t, n)
        return add_child(t, ref, bigger, c, child)
    if n.type == ART_NODE16:
        p16 = <art_node16*>n
        if n.num_children < 16:
            sorted_insert(p16.keys, p16.children, n.num_children, c, child)
            n.num_children += 1
            return 0
        bigger = alloc_node(t, ART_NODE48)
        if bigger == NULL:
            return -1
        copy_header(bigger, n)
        p48 = <art_node48*>bigger
        for i in range(16):
            p48.child_index[p16.keys[i]] = <uint8_t>(i + 1)
            p48.children[i] = p16.children[i]
        ref[0] = bigger
        free_node(t, n)
        return add_child(t, ref, bigger, c, child)
    if n.type == ART_NODE48:
        p48 = <art_node48*>n
        if n.num_children < 48:
            pos = 0
            while p48.children[pos] != NULL:
                pos += 1
            p48.children[pos] = child
            p48.child_index[c] = <uint8_t>(pos + 1)
            n.num_children += 1
            return 0
        bigger = alloc_node(t, ART_NODE256)
        if bigger == NULL:
            return -1
        copy_header(bigger, n)
        p256 = <art_node256*>bigger
        for i in range(256):
            if p48.child_index[i]:
                p256.children[i] = p48.children[p48.child_index[i] - 1]
        ref[0] = bigger
        free_node(t, n)
        return add_child(t, ref, bigger, c, child)
    p256 = <art_node256*>n
    p256.children[c] = child
    n.num_children += 1
    return 0

cdef void remove_child(art_tree* t, void** ref, art_node* n, uint8_t c) noexcept nogil:
    """Drop the child under byte c (the caller owns it now); shrink n when it gets sparse.
    Shrinking is best effort: without memory the bigger node stays (still valid)."""
    cdef art_node4* p4
    cdef art_node16* p16
    cdef art_node48* p48
    cdef art_node256* p256
    cdef art_node* smaller
    cdef uint8_t* keys
    cdef void** children
    cdef int i, b, k
    if n.type == ART_NODE4 or n.type == ART_NODE16:
        if n.type == ART_NODE4:
            p4 = <art_node4*>n
            keys = p4.keys
            children = p4.children
        else:
            p16 = <art_node16*>n
            keys = p16.keys
            children = p16.children
        i = 0
        while keys[i] != c:
            i += 1
        memmove(keys + i, keys + i + 1, n.num_children - i - 1)
        memmove(children + i, children + i + 1, (n.num_children - i - 1) * sizeof(void*))
        n.num_children -= 1
        if n.type == ART_NODE16 and n.num_children <= SHRINK_16:
            smaller = alloc_node(t, ART_NODE4)
            if smaller != NULL:
                copy_header(smaller, n)
                memcpy((<art_node4*>smaller).keys, keys, n.num_children)
                memcpy((<art_node4*>smaller).children, children, n.num_children * sizeof(void*))
                ref[0] = smaller
                free_node(t, n)
        return
    if n.type == ART_NODE48:
        p48 = <art_node48*>n
        p48.children[p48.child_index[c] - 1] = NULL
        p48.child_index[c] = 0
        n.num_children -= 1
        if n.num_children <= SHRINK_48:
            smaller = alloc_node(t, ART_NODE16)
            if smaller != NULL:
                copy_header(smaller, n)
                p16 = <art_node16*>smaller
                k = 0
                for b in range(256):
                    if p48.child_index[b]:
                        p16.keys[k] = <uint8_t>b
                        p16.children[k] = p48.children[p48.child_index[b] - 1]
                        k += 1
                ref[0] = smaller
                free_node(t, n)
        return
    p256 = <art_node256*>n
    p256.children[c] = NULL
    n.num_children -= 1
    if n.num_children <= SHRINK_256:
        smaller = alloc_node(t, ART_NODE48)
        if smaller != NULL:
            copy_header(smaller, n)
            p48 = <art_node48*>smaller
            k = 0
            for b in range(256):
                if p256.children[b] != NULL:
                    p48.child_index[b] = <uint8_t>(k + 1)
                    p48.children[k] = p256.children[b]
                    k += 1
            ref[0] = smaller
            free_node(t, n)

cdef void collapse(art_tree* t, void** ref, art_node* n) noexcept nogil:
    """Lazy expansion: a node left with one entry is replaced by it."""
    cdef void* child
    cdef art_node* cn
    cdef uint8_t byte
    cdef uint8_t merged[ART_MAX_PREFIX]
    cdef size_t k, m
    cdef int b
    if n.num_children == 0:
        ref[0] = n.term         # NULL only if the node was empty (never for a valid tree)
        free_node(t, n)
        return
    if n.num_children != 1 or n.term != NULL:
        return
    if n.type == ART_NODE4:
        byte = (<art_node4*>n).keys[0]
        child = (<art_node4*>n).children[0]
    elif n.type == ART_NODE16:
        byte = (<art_node16*>n).keys[0]
        child = (<art_node16*>n).children[0]
    elif n.type == ART_NODE48:
        for b in range(256):
            if (<art_node48*>n).child_index[b]:
                break
        byte = <uint8_t>b
        child = (<art_node48*>n).children[(<art_node48*>n).child_index[b] - 1]
    else:
        for b in range(256):
            if (<art_node256*>n).children[b] != NULL:
                break
        byte = <uint8_t>b
        child = (<art_node256*>n).children[b]
    if not is_leaf(child):
        # child's path becomes n's path + byte + child's path; only the first
        # ART_MAX_PREFIX bytes are kept inline, and those are all known here.
        cn = <art_node*>child
        k = min_size(n.prefix_len, ART_MAX_PREFIX)
        memcpy(merged, n.prefix, k)
        if k < ART_MAX_PREFIX:
            merged[k] = byte
            k += 1
        if k < ART_MAX_PREFIX:
            m = min_size(cn.prefix_len, ART_MAX_PREFIX - k)
            memcpy(merged + k, cn.prefix, m)
        cn.prefix_len = n.prefix_len + 1 + cn.prefix_len
        memcpy(cn.prefix, merged, ART_MAX_PREFIX)
    ref[0] = child
    free_node(t, n)


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

ctypedef struct probe:
    void* p                   # next node or tagged leaf to visit (prefetched)
    const uint8_t* key
    size_t klen
    size_t depth
    Py_ssize_t idx            # position in the batch, -1 = slot idle

cdef inline void prefetch_node(const void* p) noexcept nogil:
    cdef const char* a = <const char*>as_leaf(p)
    cdef int i
    for i in range(PREFETCH_LINES):
        __builtin_prefetch(a + 64 * i, 0, 3)

cdef inline int probe_step(probe* s) noexcept nogil:
    """One node of a lookup: 0 = went down (s.p now prefetched), 1 = done, s.p = the leaf
    found (untagged) or NULL."""
    cdef art_node* n
    cdef void** slot
    cdef void* p = s.p
    if p == NULL:
        return 1
    if is_leaf(p):
        s.p = as_leaf(p) if leaf_matches(as_leaf(p), s.key, s.klen) else NULL
        return 1
    n = <art_node*>p
    if n.prefix_len:
        if s.depth + n.prefix_len > s.klen or memcmp(
                n.prefix, s.key + s.depth, min_size(n.prefix_len, ART_MAX_PREFIX)) != 0:
            s.p = NULL
            return 1
        s.depth += n.prefix_len
    if s.depth == s.klen:
        s.p = as_leaf(n.term) if n.term != NULL and leaf_matches(as_leaf(n.term), s.key, s.klen) else NULL
        return 1
    slot = find_child(n, s.key[s.depth])
    if slot == NULL:
        s.p = NULL
        return 1
    s.p = slot[0]
    s.depth += 1
    prefetch_node(s.p)
    return 0

cdef Py_ssize_t search_batch(art_tree* t, const uint8_t* const* keys, const size_t* lens,
                             Py_ssize_t n, uint64_t* values, char* found) noexcept nogil:
    """art_search for n keys, BATCH_WAYS at a time round-robin (asynchronous memory access
    chaining): while one lookup waits for its next node, the others make progress."""
    cdef probe s[BATCH_WAYS]
    cdef Py_ssize_t nxt = 0, hits = 0
    cdef int j, active = 0
    cdef art_leaf* l
    for j in range(BATCH_WAYS):
        s[j].idx = -1
    while True:
        for j in range(BATCH_WAYS):
            if s[j].idx < 0:
                # idle slot: start the next key (too long = simply not found)
                while nxt < n and lens[nxt] > ART_MAX_KEY:
                    found[nxt] = 0
                    nxt += 1
                if nxt == n:
                    continue
                s[j].idx = nxt
                s[j].key = keys[nxt]
                s[j].klen = lens[nxt]
                s[j].depth = 0
                s[j].p = t.root
                active += 1
                nxt += 1
                if nxt + BATCH_WAYS < n:
                    __builtin_prefetch(keys[nxt + BATCH_WAYS], 0, 3)
            if probe_step(&s[j]):
                l = <art_leaf*>s[j].p
                if l != NULL:
                    values[s[j].idx] = l.value
                    found[s[j].idx] = 1
                    hits += 1
                else:
                    found[s[j].idx] = 0
                s[j].idx = -1
                active -= 1
        if active == 0 and nxt == n:
            return hits

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


# --------------------------------------------------------------------------- ordered walks

ctypedef struct collector:
    art_leaf** out
    size_t n
    size_t cap
    int status                # 0 go on, 1 stopped (full)

cdef void emit(collector* c, art_leaf* l) noexcept nogil:
    if c.n == c.cap:
        c.status = 1          # full: the caller resumes after the last key
        return
    c.out[c.n] = l
    c.n += 1

# visit(c, child, key, klen, depth, mode): mode 0 = whole subtree, 1 = only keys >= key
cdef void walk(collector* c, void* p, const uint8_t* key, size_t klen, size_t depth, bint bounded) noexcept nogil:
    cdef art_node* n
    cdef art_leaf* l
    cdef const uint8_t* pb
    cdef size_t i
    cdef int b
    cdef uint8_t kb = 0
    cdef art_node4* p4
    cdef art_node16* p16
    cdef art_node48* p48
    cdef art_node256* p256
    cdef uint8_t* keys
    cdef void** children
    if is_leaf(p):
        l = as_leaf(p)
        if not bounded or leaf_cmp(l, key, klen) >= 0:
            emit(c, l)
        return
    n = <art_node*>p
    if bounded and n.prefix_len:
        if n.prefix_len <= ART_MAX_PREFIX:
            pb = n.prefix
        else:
            pb = leaf_key(minimum(n)) + depth
        for i in range(n.prefix_len):
            if depth + i == klen or pb[i] > key[depth + i]:
                bounded = False          # every key below is greater
                break
            if pb[i] < key[depth + i]:
                return                   # every key below is smaller
        depth += n.prefix_len
    if bounded and depth == klen:
        bounded = False
    if not bounded:
        if n.term != NULL:
            emit(c, as_leaf(n.term))
            if c.status:
                return
    else:
        kb = key[depth]                  # the term key is a proper prefix of key: smaller
    if n.type == ART_NODE4 or n.type == ART_NODE16:
        if n.type == ART_NODE4:
            p4 = <art_node4*>n
            keys = p4.keys
            children = p4.children
        else:
            p16 = <art_node16*>n
            keys = p16.keys
            children = p16.children
        for b in range(n.num_children):
            if bounded and keys[b] < kb:
                continue
            walk(c, children[b], key, klen, depth + 1, bounded and keys[b] == kb)
            if c.status:
                return
    elif n.type == ART_NODE48:
        p48 = <art_node48*>n
        for b in range(kb if bounded else 0, 256):
            if p48.child_index[b]:
                walk(c, p48.children[p48.child_index[b] - 1], key, klen, depth + 1, bounded and b == kb)
                if c.status:
                    return
    else:
        p256 = <art_node256*>n
        for b in range(kb if bounded else 0, 256):
            if p256.children[b] != NULL:
                walk(c, p256.children[b], key, klen, depth + 1, bounded and b == kb)
                if c.status:
                    return


# --------------------------------------------------------------------------- prefix scans

ctypedef struct leafbuf:
    art_leaf** out            # inline, or malloc'ed once it outgrows inline
    size_t n
    size_t cap
    art_leaf* inline[SCAN_INLINE]

cdef int push_leaf(leafbuf* b, art_leaf* l) noexcept nogil:
    """Append l; -1 (buffer unchanged) when out of memory."""
    cdef art_leaf** bigger
    if b.n == b.cap:
        if b.out == b.inline:
            bigger = <art_leaf**>malloc(2 * b.cap * sizeof(art_leaf*))
            if bigger != NULL:
                memcpy(bigger, b.inline, b.n * sizeof(art_leaf*))
        else:
            bigger = <art_leaf**>realloc(b.out, 2 * b.cap * sizeof(art_leaf*))
        if bigger == NULL:
            return -1
        b.out = bigger
        b.cap *= 2
    __builtin_prefetch(l, 0, 3)       # the list is built from it right after the walk
    b.out[b.n] = l
    b.n += 1
    return 0

cdef int gather(leafbuf* b, void* p) noexcept nogil:
    """Every leaf below p, in key order (term first: it is a prefix of the rest)."""
    cdef art_node* n
    cdef void** children
    cdef void* c
    cdef int i
    cdef uint8_t idx
    if is_leaf(p):
        return push_leaf(b, as_leaf(p))
    n = <art_node*>p
    if n.term != NULL and push_leaf(b, as_leaf(n.term)) < 0:
        return -1
    if n.type <= ART_NODE16:
        if n.type == ART_NODE4:
            children = (<art_node4*>n).children
        else:
            children = (<art_node16*>n).children
        for i in range(n.num_children):
            c = children[i]
            if (push_leaf(b, as_leaf(c)) if is_leaf(c) else gather(b, c)) < 0:
                return -1
    elif n.type == ART_NODE48:
        for i in range(256):
            idx = (<art_node48*>n).child_index[i]
            if idx and gather(b, (<art_node48*>n).children[idx - 1]) < 0:
                return -1
    else:
        for i in range(256):
            c = (<art_node256*>n).children[i]
            if c != NULL and gather(b, c) < 0:
                return -1
    return 0

cdef void* prefix_subtree(art_tree* t, const uint8_t* pfx, size_t plen) noexcept nogil:
    """The node or leaf holding exactly the keys that start with pfx, or NULL if there are
    none.  Optimistic past the inline prefix bytes: the caller checks one leaf below."""
    cdef void* p = t.root
    cdef art_node* n
    cdef void** slot
    cdef size_t depth = 0
    while p != NULL:
        if depth == plen or is_leaf(p):
            return p
        n = <art_node*>p
        if n.prefix_len:
            if memcmp(n.prefix, pfx + depth, min_size(min_size(n.prefix_len, plen - depth), ART_MAX_PREFIX)) != 0:
                return NULL
            if n.prefix_len >= plen - depth:
                return p              # pfx ends inside (or at the end of) n's compressed path
            depth += n.prefix_len
        slot = find_child(n, pfx[depth])
        if slot == NULL:
            return NULL
        p = slot[0]
        depth += 1
    return NULL

cdef list leaf_list(art_leaf** leaves, size_t n):
    """[(key, value)] of n leaves, built in place (no resizing, no bounds checks)."""
    cdef list out = PyList_New(n)
    cdef object k, v
    cdef tuple item
    cdef art_leaf* l
    cdef size_t i
    for i in range(n):
        l = leaves[i]
        k = PyBytes_FromStringAndSize(<char*>leaf_key(l), l.key_len)
        v = PyLong_FromUnsignedLongLong(l.value)
        item = PyTuple_New(2)
        Py_INCREF(k)                     # the SET_ITEMs steal a reference
        PyTuple_SET_ITEM(item, 0, k)
        Py_INCREF(v)
        PyTuple_SET_ITEM(item, 1, v)
        Py_INCREF(item)
        PyList_SET_ITEM(out, i, item)
    return out

cdef list scan(art_tree* t, const uint8_t* pfx, size_t plen):
    cdef leafbuf b
    cdef void* sub
    cdef art_leaf* l
    cdef int r = 0
    b.out = b.inline
    b.n = 0
    b.cap = SCAN_INLINE
    with nogil:
        sub = prefix_subtree(t, pfx, plen)
        if sub != NULL:
            # every key below sub shares its first plen bytes: one leaf settles it
            l = minimum(sub)
            if l.key_len >= plen and memcmp(leaf_key(l), pfx, plen) == 0:
                r = gather(&b, sub)
    try:
        if r < 0:
            raise MemoryError("scan_prefix: out of memory")
        return leaf_list(b.out, b.n)
    finally:
        if b.out != b.inline:
            free(b.out)


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
        cdef tuple ks = tuple(keys)      # holds the key objects while the GIL is released
        cdef Py_ssize_t n = len(ks), i, klen
        cdef const uint8_t** ptrs
        cdef size_t* lens
        cdef uint64_t* vals
        cdef char* found
        cdef list out
        if n == 0:
            return []
        ptrs = <const uint8_t**>PyMem_Malloc(n * (sizeof(void*) + sizeof(size_t) + sizeof(uint64_t) + 1))
        if ptrs == NULL:
            raise MemoryError()
        lens = <size_t*>(ptrs + n)
        vals = <uint64_t*>(lens + n)
        found = <char*>(vals + n)
        try:
            for i in range(n):
                ptrs[i] = key_ptr(ks[i], &klen, ART_MAX_KEY)
                lens[i] = klen
            if n >= BATCH_NOGIL_MIN:
                self._readers += 1
                with nogil:
                    self.get_many_c(ptrs, lens, n, vals, found)
                self._readers -= 1
            else:
                self.get_many_c(ptrs, lens, n, vals, found)
            out = [None] * n
            for i in range(n):
                out[i] = vals[i] if found[i] else default
            return out
        finally:
            PyMem_Free(ptrs)

    def insert_many(self, keys, values):
        """Insert pairs keys[i] -> values[i]; every key and value is checked before the tree
        is touched.  Returns the number of keys that were new."""
        cdef tuple ks = tuple(keys)
        cdef tuple vs = tuple(values)
        cdef Py_ssize_t n = len(ks), i, klen, added
        cdef const uint8_t** ptrs
        cdef size_t* lens
        cdef uint64_t* vals
        if len(vs) != n:
            raise ValueError(f"insert_many: {n} keys but {len(vs)} values")
        writable(self)
        if n == 0:
            return 0
        ptrs = <const uint8_t**>PyMem_Malloc(n * (sizeof(void*) + sizeof(size_t) + sizeof(uint64_t)))
        if ptrs == NULL:
            raise MemoryError()
        lens = <size_t*>(ptrs + n)
        vals = <uint64_t*>(lens + n)
        try:
            for i in range(n):
                ptrs[i] = key_ptr(ks[i], &klen, ART_MAX_KEY)
                lens[i] = klen
                vals[i] = to_u64(vs[i])
            self._readers += 1
            try:
                with nogil:
                    added = self.insert_many_c(ptrs, lens, vals, n)
            finally:
                self._readers -= 1
            return added
        finally:
            PyMem_Free(ptrs)

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


# Module functions rather than cdef methods: those would have to be declared in art.pxd.

cdef list collect(AdaptiveRadixTree self, const uint8_t* start, size_t slen, bint bounded, size_t cap):
    cdef collector c
    c.out = <art_leaf**>malloc(cap * sizeof(art_leaf*))
    if c.out == NULL:
        raise MemoryError()
    c.n = 0
    c.cap = cap
    c.status = 0
    try:
        if self._t.root != NULL:
            self._readers += 1
            with nogil:
                walk(&c, self._t.root, start, slen, 0, bounded)
            self._readers -= 1
        return leaf_list(c.out, c.n)
    finally:
        free(c.out)


cdef class _Items:
    cdef AdaptiveRadixTree tree
    cdef bytes cursor            # next key to fetch from (inclusive), or None = from the start
    cdef list buf
    cdef Py_ssize_t pos
    cdef bint done

    def __cinit__(self, AdaptiveRadixTree tree, start):
        self.tree = tree
        self.cursor = start
        self.buf = []
        self.pos = 0
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        cdef const uint8_t* cp = NULL
        cdef Py_ssize_t clen = 0
        if self.pos == len(self.buf):
            if self.done:
                raise StopIteration
            if self.cursor is not None:
                cp = <const uint8_t*>PyBytes_AS_STRING(self.cursor)
                clen = PyBytes_GET_SIZE(self.cursor)
            self.buf = collect(self.tree, cp, clen, self.cursor is not None, ITER_CHUNK)
            self.pos = 0
            if len(self.buf) < ITER_CHUNK:
                self.done = True
            if not self.buf:
                raise StopIteration
            # the smallest key greater than the last one returned
            self.cursor = self.buf[len(self.buf) - 1][0] + b"\x00"
        item = self.buf[self.pos]
        self.pos += 1
        return item
