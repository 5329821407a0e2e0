# Included by art.pyx: ordered walks (items() and its chunked _Items iterator) and
# prefix scans (scan_prefix: the subtree of a prefix gathered into a leaf buffer, then
# one list built in place).  Both release the GIL for the walk and build the Python
# list after it.

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
    uint64_t mask             # only leaves whose value & mask == want are kept (scan: 0, 0)
    uint64_t want
    art_leaf* inline[SCAN_INLINE]

cdef int push_leaf(leafbuf* b, art_leaf* l) noexcept nogil:
    """Append l; -1 (buffer unchanged) when out of memory."""
    cdef art_leaf** bigger
    if l.value & b.mask != b.want:
        return 0
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
    b.mask = 0
    b.want = 0
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


cdef list scan_where(art_tree* t, uint64_t mask, uint64_t want):
    """[key] of every leaf whose value & mask == want, in key order: one walk of the tree."""
    cdef leafbuf b
    cdef int r = 0
    cdef list out
    cdef object k
    cdef size_t i
    b.out = b.inline
    b.n = 0
    b.cap = SCAN_INLINE
    b.mask = mask
    b.want = want
    with nogil:
        if t.root != NULL:
            r = gather(&b, t.root)
    try:
        if r < 0:
            raise MemoryError("keys_where: out of memory")
        out = PyList_New(b.n)
        for i in range(b.n):
            k = PyBytes_FromStringAndSize(<char*>leaf_key(b.out[i]), b.out[i].key_len)
            Py_INCREF(k)                 # SET_ITEM steals a reference
            PyList_SET_ITEM(out, i, k)
        return out
    finally:
        if b.out != b.inline:
            free(b.out)


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
