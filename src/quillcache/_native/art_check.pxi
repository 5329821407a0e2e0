# Included by art.pyx: structural self-check and node census (tests and debugging only;
# nothing here is on a lookup or update path).

ctypedef struct census:
    size_t counts[5]          # index 0 = leaves, else by node type
    size_t mem
    const char* error         # first invariant broken, or NULL

cdef void check_node(census* s, void* p, size_t depth, const uint8_t* path, size_t plen) noexcept nogil:
    """Counts nodes and checks invariants.  p sits at key depth `depth`; every key below
    must start with path[:plen] (bytes of a leaf under the parent)."""
    cdef art_node* n
    cdef art_leaf* l
    cdef art_leaf* lo
    cdef int i, b, seen
    cdef size_t entries
    cdef uint8_t* keys = NULL
    cdef void** children = NULL
    if s.error != NULL:
        return
    if p == NULL:
        s.error = "NULL child pointer"
        return
    if is_leaf(p):
        l = as_leaf(p)
        s.counts[0] += 1
        s.mem += leaf_alloc(l.key_len)
        if l.key_len < depth or (plen and memcmp(leaf_key(l), path, plen) != 0):
            s.error = "leaf key does not match its path"
        return
    n = <art_node*>p
    s.counts[n.type] += 1
    s.mem += node_size(n.type)
    lo = minimum(n)
    if lo == NULL:
        s.error = "inner node without keys"
        return
    if plen and memcmp(leaf_key(lo), path, plen) != 0:
        s.error = "inner node's keys do not match its path"
        return
    path = leaf_key(lo)
    if memcmp(n.prefix, path + depth, min_size(n.prefix_len, ART_MAX_PREFIX)) != 0:
        s.error = "inline prefix differs from the keys below"
        return
    entries = n.num_children + (1 if n.term != NULL else 0)
    if entries < 2:
        s.error = "inner node with fewer than two entries (not collapsed)"
        return
    depth += n.prefix_len
    if n.term != NULL:
        if as_leaf(n.term).key_len != depth:
            s.error = "term leaf length differs from node depth"
            return
        check_node(s, n.term, depth, path, depth)
    if n.type == ART_NODE4 or n.type == ART_NODE16:
        if n.type == ART_NODE4:
            keys = (<art_node4*>n).keys
            children = (<art_node4*>n).children
            if n.num_children > 4:
                s.error = "Node4 over capacity"
        else:
            keys = (<art_node16*>n).keys
            children = (<art_node16*>n).children
            if n.num_children <= SHRINK_16 or n.num_children > 16:
                s.error = "Node16 child count out of range"
        for i in range(n.num_children):
            if i and keys[i - 1] >= keys[i]:
                s.error = "node keys not sorted"
            if s.error != NULL:
                return
            if not is_leaf(children[i]) or as_leaf(children[i]).key_len > depth:
                if minimum(children[i]) == NULL or leaf_key(minimum(children[i]))[depth] != keys[i]:
                    s.error = "child under the wrong byte"
                    return
            check_node(s, children[i], depth + 1, path, depth)
    elif n.type == ART_NODE48:
        seen = 0
        if n.num_children <= SHRINK_48 or n.num_children > 48:
            s.error = "Node48 child count out of range"
            return
        for b in range(256):
            if (<art_node48*>n).child_index[b]:
                seen += 1
                p = (<art_node48*>n).children[(<art_node48*>n).child_index[b] - 1]
                if p == NULL or leaf_key(minimum(p))[depth] != b:
                    s.error = "Node48 index inconsistent"
                    return
                check_node(s, p, depth + 1, path, depth)
        if seen != n.num_children:
            s.error = "Node48 child count wrong"
    else:
        seen = 0
        if n.num_children <= SHRINK_256:
            s.error = "Node256 child count out of range"
            return
        for b in range(256):
            p = (<art_node256*>n).children[b]
            if p != NULL:
                seen += 1
                if leaf_key(minimum(p))[depth] != b:
                    s.error = "Node256 child under the wrong byte"
                    return
                check_node(s, p, depth + 1, path, depth)
        if seen != n.num_children:
            s.error = "Node256 child count wrong"


cdef census tree_census(AdaptiveRadixTree self):
    cdef census s
    memset(&s, 0, sizeof(s))
    if self._t.root != NULL:
        with nogil:
            check_node(&s, self._t.root, 0, NULL, 0)
    return s


cdef dict tree_node_counts(AdaptiveRadixTree self):
    cdef census s = tree_census(self)
    return {"node4": s.counts[ART_NODE4], "node16": s.counts[ART_NODE16],
            "node48": s.counts[ART_NODE48], "node256": s.counts[ART_NODE256], "leaf": s.counts[0]}


cdef int tree_check(AdaptiveRadixTree self) except -1:
    cdef census s = tree_census(self)
    if s.error != NULL:
        raise AssertionError(s.error.decode('ascii'))
    if s.counts[0] != self._t.size:
        raise AssertionError(f"{s.counts[0]} leaves but size {self._t.size}")
    if s.mem != self._t.mem:
        raise AssertionError(f"memory counter {self._t.mem} but nodes and leaves hold {s.mem}")
    return 0
