# Included by art.pyx: the four inner node kinds (Node4/16/48/256) and what changes them:
# allocation, child lookup (SSE2 for Node16), first/last child, minimum/maximum leaf,
# growing on add_child, shrinking on remove_child, and collapsing a one-child Node4.
# Needs the leaf helpers of art.pyx (included after them).

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
