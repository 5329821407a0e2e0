# Included by art.pyx (after the Python API helpers key_ptr / writable / to_u64):
# batch lookups with interleaved, prefetching probes (search_batch, behind get_many_c
# and get_many) and the bodies of get_many / insert_many.

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


# Module functions rather than def bodies in the class: an include cannot go inside a class
# body.  AdaptiveRadixTree.get_many / insert_many call these and carry the docstrings.

cdef list tree_get_many(AdaptiveRadixTree self, keys, default):
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


cdef object tree_insert_many(AdaptiveRadixTree self, keys, values):
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


cdef Py_ssize_t blob_keys(const uint8_t[::1] blob, const uint64_t[::1] key_off, Py_ssize_t n,
                          const uint8_t** ptrs, size_t* lens) except -1:
    """Pointers to the n keys of a key blob (key i = blob[key_off[i]:key_off[i + 1]]),
    every offset checked against the blob and ART_MAX_KEY first."""
    cdef Py_ssize_t i
    cdef uint64_t a, b, size = blob.shape[0]
    cdef const uint8_t* base = &blob[0] if size else <const uint8_t*>""
    for i in range(n):
        a = key_off[i]
        b = key_off[i + 1]
        if a > b or b > size:
            raise ValueError(f"key blob offsets {a}..{b} of key {i}: outside a blob of {size} bytes")
        if b - a > ART_MAX_KEY:
            raise ValueError(f"key {i} is {b - a} bytes: at most {ART_MAX_KEY} bytes")
        ptrs[i] = base + a
        lens[i] = b - a
    return n


cdef Py_ssize_t tree_get_blob(AdaptiveRadixTree self, const uint8_t[::1] blob, const uint64_t[::1] key_off,
                              int64_t[::1] out) except -1:
    cdef Py_ssize_t n = key_off.shape[0] - 1, i, hits
    cdef const uint8_t** ptrs
    cdef size_t* lens
    cdef uint64_t* vals
    cdef char* found
    if n < 0 or out.shape[0] != n:
        raise ValueError(f"get_blob: {max(n, 0)} keys need an output of that many values, got {out.shape[0]}")
    if n == 0:
        return 0
    ptrs = <const uint8_t**>PyMem_Malloc(n * (sizeof(void*) + sizeof(size_t) + sizeof(uint64_t) + 1))
    if ptrs == NULL:
        raise MemoryError()
    lens = <size_t*>(ptrs + n)
    vals = <uint64_t*>(lens + n)
    found = <char*>(vals + n)
    try:
        blob_keys(blob, key_off, n, ptrs, lens)
        self._readers += 1
        with nogil:
            hits = self.get_many_c(ptrs, lens, n, vals, found)
            for i in range(n):
                out[i] = <int64_t>vals[i] if found[i] else -1
        self._readers -= 1
        return hits
    finally:
        PyMem_Free(ptrs)


cdef object tree_insert_blob(AdaptiveRadixTree self, const uint8_t[::1] blob, const uint64_t[::1] key_off,
                             uint64_t first_value):
    cdef Py_ssize_t n = key_off.shape[0] - 1, i, added
    cdef const uint8_t** ptrs
    cdef size_t* lens
    cdef uint64_t* vals
    writable(self)
    if n <= 0:
        return 0
    ptrs = <const uint8_t**>PyMem_Malloc(n * (sizeof(void*) + sizeof(size_t) + sizeof(uint64_t)))
    if ptrs == NULL:
        raise MemoryError()
    lens = <size_t*>(ptrs + n)
    vals = <uint64_t*>(lens + n)
    try:
        blob_keys(blob, key_off, n, ptrs, lens)
        for i in range(n):
            vals[i] = first_value + <uint64_t>i
        self._readers += 1
        try:
            with nogil:
                added = self.insert_many_c(ptrs, lens, vals, n)
        finally:
            self._readers -= 1
        return added
    finally:
        PyMem_Free(ptrs)
