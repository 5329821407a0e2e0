"""An O(1) offset allocator for one contiguous space (a DRAM arena or the SSD file).

The algorithm family is TLSF, in the shape of Sebastian Aaltonen's OffsetAllocator:
sizes (in units) map to an 8-bit "small float" bin, 5-bit exponent and 3-bit
mantissa, exact below 8.  256 bins = 32 top bins x 8 leaf bins, found through a
two-level bitmap (a 32-bit top mask, one 8-bit leaf mask per top bin).  A free
region sits in the bin of its size rounded down; allocate() rounds the request up
to a bin and takes the head of the first non-empty bin at or above it (count
trailing zeros), so every node it can find is large enough.  Nodes also link to
their address neighbours; free() merges with free neighbours, so free regions are
maximal and never adjacent.  Node metadata lives outside the managed space in a
fixed pool.

Differences from upstream, on purpose:
- offsets and sizes are 64-bit bytes; the bin math runs on units (capacity/unit
  must fit 32 bits: at most MAX_UNITS units).
- exact fit at the top: when the rounded-up search finds nothing, the one bin that
  may hold a large-enough region (the request's size rounded down) is scanned.
  That runs only when the allocation would otherwise fail, and makes allocate()
  fail only when no free region is large enough: allocate(capacity) on a fresh
  allocator succeeds and largest_free is exact.
- the node pool holds 2 * max_allocs + 1 nodes: free regions are never adjacent,
  so there are at most live + 1 of them, and exactly max_allocs allocations fit.
- handles carry a 32-bit generation: (generation << 32) | node_index.

Not thread-safe: callers serialize (a Python batch call that runs without the GIL
makes concurrent Python calls on the same allocator raise RuntimeError).
"""
cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free as c_free_mem
from cpython.number cimport PyIndex_Check, PyNumber_Index

from quillcache.errors import CapacityError

__all__ = ["OffsetAllocator", "Allocation", "MAX_UNITS", "MAX_ALLOCS", "MAX_UNIT",
           "DEFAULT_MAX_ALLOCS", "bin_round_down", "bin_round_up", "bin_size"]

# Tunables and limits (units in the names/comments).
cdef uint32_t NO_NODE = 0xFFFFFFFF           # "no node" in every link
cdef enum:
    MANTISSA_BITS = 3
    LEAF_BINS = 8                    # bins per top bin (2 ** MANTISSA_BITS)
    TOP_BINS = 32
    NUM_BINS = 256
    DEBRUIJN_CTZ = 0x077CB531        # de Bruijn multipliers for the bit tables (alloc_bins.pxi)
    DEBRUIJN_MSB = 0x07C4ACDD
cdef uint64_t C_MAX_UNITS = 0xFFFFFFFF       # units: sizes/offsets are uint32 units
cdef uint64_t C_MAX_ALLOCS = 1 << 30         # live allocations (2N+1 nodes < 2**32)
cdef uint64_t C_MAX_UNIT = 1 << 30           # bytes
cdef uint64_t C_DEFAULT_MAX_ALLOCS = 1 << 20  # live allocations, when max_allocs=None
MAX_UNITS = C_MAX_UNITS
MAX_ALLOCS = C_MAX_ALLOCS
MAX_UNIT = C_MAX_UNIT
DEFAULT_MAX_ALLOCS = C_DEFAULT_MAX_ALLOCS

cdef enum NodeState:
    NODE_UNUSED = 0
    NODE_FREE = 1
    NODE_USED = 2
    NODE_PENDING = 3                 # free_many(): validated, about to be freed

include "alloc_bins.pxi"


@cython.freelist(64)
@cython.final
cdef class Allocation:
    """One live allocation: ``offset`` and ``size`` in bytes (size is what was
    reserved: the request rounded up to the unit), ``handle`` for free()."""

    def __iter__(self):
        return iter((self.offset, self.size, self.handle))

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return (self.offset, self.size, self.handle)[i]

    def __eq__(self, other):
        if not isinstance(other, Allocation):
            return NotImplemented
        cdef Allocation o = <Allocation>other
        return self.offset == o.offset and self.size == o.size and self.handle == o.handle

    def __hash__(self):
        return hash((self.offset, self.size, self.handle))

    def __repr__(self):
        return f"Allocation(offset={self.offset}, size={self.size}, handle={self.handle:#x})"


cdef inline Allocation _make_allocation(uint64_t offset, uint64_t size, uint64_t handle):
    cdef Allocation a = Allocation.__new__(Allocation)
    a.offset = offset
    a.size = size
    a.handle = handle
    return a


include "alloc_bench.pxi"


cdef uint64_t _as_u64(object value, str what) except? 0xFFFFFFFFFFFFFFFF:
    # A Python int >= 0 that fits 64 bits, or ValueError/TypeError naming it.
    if type(value) is not int:
        if isinstance(value, bool) or not PyIndex_Check(value):
            raise TypeError(f"{what} must be an int, got {type(value).__name__}")
        value = PyNumber_Index(value)
    try:
        return value
    except OverflowError:
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {value!r}") from None


cdef uint64_t _as_handle(object handle) except? 0xFFFFFFFFFFFFFFFF:
    # Anything that is not a 64-bit unsigned int cannot be a handle: ValueError.
    if type(handle) is not int:
        raise ValueError(f"unknown, stale or already freed allocation handle {handle!r}")
    try:
        return handle
    except OverflowError:
        raise ValueError(f"unknown, stale or already freed allocation handle {handle!r}") from None


@cython.final
cdef class OffsetAllocator:
    """OffsetAllocator(capacity, unit=256, max_allocs=None)

    Hands out extents of [0, capacity) bytes in multiples of ``unit`` (a power of
    two, 1 .. MAX_UNIT bytes).  ``capacity`` must be a positive multiple of unit
    and at most MAX_UNITS units.  At most ``max_allocs`` allocations are live at a
    time (default min(capacity/unit, DEFAULT_MAX_ALLOCS)); the node pool holds
    2 * min(max_allocs, capacity/unit) + 1 nodes of 32 bytes, touched lazily.
    """

    def __cinit__(self, capacity, unit=256, max_allocs=None):
        cdef uint64_t cap = _as_u64(capacity, "capacity")
        cdef uint64_t u = _as_u64(unit, "unit")
        cdef uint64_t units, n_max, pool_live
        cdef int shift = 0
        self.nodes = NULL
        self.node_stack = NULL
        if u == 0 or u > C_MAX_UNIT or (u & (u - 1)) != 0:
            raise ValueError(f"unit must be a power of two in [1, {C_MAX_UNIT}] bytes, got {unit!r}")
        while (<uint64_t>1 << shift) != u:
            shift += 1
        if cap == 0 or cap % u != 0:
            raise ValueError(f"capacity must be a positive multiple of unit ({u} bytes), got {capacity!r}")
        units = cap >> shift
        if units > C_MAX_UNITS:
            raise ValueError(
                f"capacity {cap} bytes is {units} units of {u} bytes; at most {C_MAX_UNITS} units "
                f"are supported: use a larger unit")
        if max_allocs is None:
            n_max = units if units < C_DEFAULT_MAX_ALLOCS else C_DEFAULT_MAX_ALLOCS
        else:
            n_max = _as_u64(max_allocs, "max_allocs")
            if n_max == 0 or n_max > C_MAX_ALLOCS:
                raise ValueError(f"max_allocs must be in [1, {C_MAX_ALLOCS}], got {max_allocs!r}")
        # more live allocations than units is impossible: do not size the pool for them
        pool_live = n_max if n_max < units else units
        self.n_nodes = <uint32_t>(2 * pool_live + 1)
        self.nodes = <Node*>malloc(self.n_nodes * sizeof(Node))
        self.node_stack = <uint32_t*>malloc(self.n_nodes * sizeof(uint32_t))
        if self.nodes == NULL or self.node_stack == NULL:
            raise MemoryError(f"cannot allocate the node pool ({self.n_nodes} nodes)")
        self.capacity_bytes = cap
        self.unit_bytes = u
        self.unit_shift = shift
        self.total_units = <uint32_t>units
        self.max_live = <uint32_t>n_max
        self.fresh = 0
        self.busy = False
        self._reset()

    def __dealloc__(self):
        c_free_mem(self.nodes)
        c_free_mem(self.node_stack)

    cdef void _reset(self) noexcept nogil:
        # one free region over everything; nodes already used go back on the stack
        # with their generations (fresh nodes start at generation 0)
        cdef uint32_t i
        for i in range(<uint32_t>NUM_BINS):
            self.bin_heads[i] = NO_NODE
        for i in range(<uint32_t>TOP_BINS):
            self.leaf_masks[i] = 0
        self.top_mask = 0
        self.node_stack_top = 0
        for i in range(self.fresh):
            self.nodes[i].state = NODE_UNUSED
            self.node_stack[self.node_stack_top] = i
            self.node_stack_top += 1
        self.live_count = 0
        i = self._pop_node()
        self.nodes[i].offset = 0
        self.nodes[i].size = self.total_units
        self.nodes[i].nb_prev = NO_NODE
        self.nodes[i].nb_next = NO_NODE
        self.nodes[i].state = NODE_FREE
        self._bin_insert(i)
        self.head = i
        self.hint = i
        self.free_units = self.total_units

    # ---- node pool and bins -------------------------------------------------------

    cdef uint32_t _units(self, uint64_t size) noexcept nogil:
        # size <= capacity_bytes (checked by callers), so no overflow
        return <uint32_t>((size + self.unit_bytes - 1) >> self.unit_shift)

    cdef uint32_t _pop_node(self) noexcept nogil:
        cdef uint32_t i
        if self.node_stack_top:
            self.node_stack_top -= 1
            return self.node_stack[self.node_stack_top]
        if self.fresh < self.n_nodes:
            i = self.fresh
            self.fresh += 1
            self.nodes[i].gen = 0
            return i
        return NO_NODE

    cdef void _push_node(self, uint32_t i) noexcept nogil:
        self.nodes[i].state = NODE_UNUSED
        self.node_stack[self.node_stack_top] = i
        self.node_stack_top += 1

    cdef uint32_t _nodes_available(self) noexcept nogil:
        return self.node_stack_top + (self.n_nodes - self.fresh)

    cdef void _bin_insert(self, uint32_t i) noexcept nogil:
        cdef uint32_t b = _round_down(self.nodes[i].size)
        cdef uint32_t h = self.bin_heads[b]
        self.nodes[i].bin_prev = NO_NODE
        self.nodes[i].bin_next = h
        if h != NO_NODE:
            self.nodes[h].bin_prev = i
        self.bin_heads[b] = i
        self.leaf_masks[b >> MANTISSA_BITS] |= <uint8_t>(1 << (b & (LEAF_BINS - 1)))
        self.top_mask |= (<uint32_t>1) << (b >> MANTISSA_BITS)

    cdef void _bin_remove(self, uint32_t i) noexcept nogil:
        cdef uint32_t b, t
        cdef uint32_t p = self.nodes[i].bin_prev
        cdef uint32_t n = self.nodes[i].bin_next
        if n != NO_NODE:
            self.nodes[n].bin_prev = p
        if p != NO_NODE:
            self.nodes[p].bin_next = n
            return
        b = _round_down(self.nodes[i].size)
        self.bin_heads[b] = n
        if n == NO_NODE:
            t = b >> MANTISSA_BITS
            self.leaf_masks[t] &= <uint8_t>~(1 << (b & (LEAF_BINS - 1)))
            if self.leaf_masks[t] == 0:
                self.top_mask &= ~((<uint32_t>1) << t)

    cdef uint32_t _find_free(self, uint32_t units) noexcept nogil:
        cdef uint32_t b = _round_up(units)
        cdef uint32_t top = b >> MANTISSA_BITS
        cdef uint32_t m = self.leaf_masks[top] & ((<uint32_t>0xFF << (b & (LEAF_BINS - 1))) & 0xFF)
        cdef uint32_t i
        if m:
            return self.bin_heads[(top << MANTISSA_BITS) + _ctz(m)]
        m = self.top_mask & ~((<uint32_t>2 << top) - 1)  # top <= 30, so no shift overflow
        if m:
            top = _ctz(m)
            return self.bin_heads[(top << MANTISSA_BITS) + _ctz(self.leaf_masks[top])]
        # Exact fit: only regions in the request's round-down bin can still fit, and
        # only when the request is not a bin size itself.  Scanned only on the path
        # that would otherwise fail.
        b = _round_down(units)
        if b == _round_up(units):
            return NO_NODE
        i = self.bin_heads[b]
        while i != NO_NODE:
            if self.nodes[i].size >= units:
                return i
            i = self.nodes[i].bin_next
        return NO_NODE

    cdef uint32_t _largest_node(self) noexcept nogil:
        cdef uint32_t t, b, i, best = NO_NODE
        if self.top_mask == 0:
            return NO_NODE
        t = _msb(self.top_mask)
        b = (t << MANTISSA_BITS) + _msb(self.leaf_masks[t])
        i = self.bin_heads[b]
        while i != NO_NODE:
            if best == NO_NODE or self.nodes[i].size > self.nodes[best].size:
                best = i
            i = self.nodes[i].bin_next
        return best

    cdef int _check_handle(self, uint64_t handle) noexcept nogil:
        cdef uint64_t i = <uint32_t>handle
        if i >= self.n_nodes or self.nodes[i].gen != <uint32_t>(handle >> 32):
            return ALLOC_BAD_HANDLE
        if self.nodes[i].state == NODE_USED:
            return ALLOC_OK
        if self.nodes[i].state == NODE_PENDING:
            return ALLOC_DUPLICATE
        return ALLOC_BAD_HANDLE

    cdef void _release(self, uint32_t i) noexcept nogil:
        # i is a USED (or PENDING) node: make it free and merge with free neighbours
        cdef uint32_t p = self.nodes[i].nb_prev
        cdef uint32_t n = self.nodes[i].nb_next
        self.live_count -= 1
        self.free_units += self.nodes[i].size
        self.nodes[i].gen += 1
        self.nodes[i].state = NODE_FREE
        if p != NO_NODE and self.nodes[p].state == NODE_FREE:
            self._bin_remove(p)
            self.nodes[i].offset = self.nodes[p].offset
            self.nodes[i].size += self.nodes[p].size
            self.nodes[i].nb_prev = self.nodes[p].nb_prev
            if self.nodes[p].nb_prev != NO_NODE:
                self.nodes[self.nodes[p].nb_prev].nb_next = i
            if self.head == p:
                self.head = i
            if self.hint == p:
                self.hint = i
            self._push_node(p)
        if n != NO_NODE and self.nodes[n].state == NODE_FREE:
            self._bin_remove(n)
            self.nodes[i].size += self.nodes[n].size
            self.nodes[i].nb_next = self.nodes[n].nb_next
            if self.nodes[n].nb_next != NO_NODE:
                self.nodes[self.nodes[n].nb_next].nb_prev = i
            if self.hint == n:
                self.hint = i
            self._push_node(n)
        self._bin_insert(i)

    cdef uint32_t _containing(self, uint32_t unit_offset) noexcept nogil:
        # the node (free or used) whose extent holds unit_offset (< total_units):
        # walks address order from the last reserve, so rebuilding in offset order is O(1) each
        cdef uint32_t i = self.hint
        if i >= self.n_nodes or self.nodes[i].state == NODE_UNUSED:
            i = self.head
        while unit_offset < self.nodes[i].offset:
            i = self.nodes[i].nb_prev
        while unit_offset - self.nodes[i].offset >= self.nodes[i].size:
            i = self.nodes[i].nb_next
        return i

    # ---- the cdef API ----------------------------------------------------------------

    cdef int c_allocate(self, uint64_t size, uint64_t* offset, uint64_t* handle) noexcept nogil:
        cdef uint32_t units, i, r, rem
        if size == 0:
            return ALLOC_BAD_SIZE
        if size > self.capacity_bytes:
            return ALLOC_NO_SPACE
        if self.live_count >= self.max_live or self._nodes_available() == 0:
            return ALLOC_NO_SLOTS
        units = self._units(size)
        i = self._find_free(units)
        if i == NO_NODE:
            return ALLOC_NO_SPACE
        self._bin_remove(i)
        rem = self.nodes[i].size - units
        if rem:
            # the allocation keeps the low end; the rest stays a free region
            r = self._pop_node()
            self.nodes[r].offset = self.nodes[i].offset + units
            self.nodes[r].size = rem
            self.nodes[r].state = NODE_FREE
            self.nodes[r].nb_prev = i
            self.nodes[r].nb_next = self.nodes[i].nb_next
            if self.nodes[i].nb_next != NO_NODE:
                self.nodes[self.nodes[i].nb_next].nb_prev = r
            self.nodes[i].nb_next = r
            self._bin_insert(r)
        self.nodes[i].size = units
        self.nodes[i].state = NODE_USED
        self.live_count += 1
        self.free_units -= units
        offset[0] = <uint64_t>self.nodes[i].offset << self.unit_shift
        handle[0] = (<uint64_t>self.nodes[i].gen << 32) | i
        return ALLOC_OK

    cdef int c_free(self, uint64_t handle) noexcept nogil:
        cdef int rc = self._check_handle(handle)
        if rc == ALLOC_DUPLICATE:
            rc = ALLOC_BAD_HANDLE
        if rc != ALLOC_OK:
            return rc
        self._release(<uint32_t>handle)
        return ALLOC_OK

    cdef int c_reserve(self, uint64_t offset, uint64_t size, uint64_t* handle) noexcept nogil:
        cdef uint32_t units, uoff, f, l, r, left, right
        if size == 0:
            return ALLOC_BAD_SIZE
        if offset & (self.unit_bytes - 1):
            return ALLOC_UNALIGNED
        if offset >= self.capacity_bytes or size > self.capacity_bytes - offset:
            return ALLOC_OUT_OF_RANGE
        units = self._units(size)   # capacity - offset is a multiple of unit: still inside
        uoff = <uint32_t>(offset >> self.unit_shift)
        f = self._containing(uoff)
        if self.nodes[f].state != NODE_FREE:
            return ALLOC_OVERLAP
        left = uoff - self.nodes[f].offset
        if self.nodes[f].size - left < units:
            return ALLOC_OVERLAP   # runs into the used node after this free region
        if self.live_count >= self.max_live or self._nodes_available() < 2:
            return ALLOC_NO_SLOTS
        right = self.nodes[f].size - left - units
        self._bin_remove(f)
        if left:
            l = self._pop_node()
            self.nodes[l].offset = self.nodes[f].offset
            self.nodes[l].size = left
            self.nodes[l].state = NODE_FREE
            self.nodes[l].nb_prev = self.nodes[f].nb_prev
            self.nodes[l].nb_next = f
            if self.nodes[f].nb_prev != NO_NODE:
                self.nodes[self.nodes[f].nb_prev].nb_next = l
            self.nodes[f].nb_prev = l
            if self.head == f:
                self.head = l
            self._bin_insert(l)
        if right:
            r = self._pop_node()
            self.nodes[r].offset = uoff + units
            self.nodes[r].size = right
            self.nodes[r].state = NODE_FREE
            self.nodes[r].nb_prev = f
            self.nodes[r].nb_next = self.nodes[f].nb_next
            if self.nodes[f].nb_next != NO_NODE:
                self.nodes[self.nodes[f].nb_next].nb_prev = r
            self.nodes[f].nb_next = r
            self._bin_insert(r)
            self.hint = r
        else:
            self.hint = f
        self.nodes[f].offset = uoff
        self.nodes[f].size = units
        self.nodes[f].state = NODE_USED
        self.live_count += 1
        self.free_units -= units
        handle[0] = (<uint64_t>self.nodes[f].gen << 32) | f
        return ALLOC_OK

    cdef int c_extent(self, uint64_t handle, uint64_t* offset, uint64_t* size) noexcept nogil:
        cdef uint32_t i
        if self._check_handle(handle) != ALLOC_OK:
            return ALLOC_BAD_HANDLE
        i = <uint32_t>handle
        offset[0] = <uint64_t>self.nodes[i].offset << self.unit_shift
        size[0] = <uint64_t>self.nodes[i].size << self.unit_shift
        return ALLOC_OK

    cdef void c_report(self, uint64_t* free_bytes, uint64_t* largest_free) noexcept nogil:
        cdef uint32_t i = self._largest_node()
        free_bytes[0] = self.free_units << self.unit_shift
        largest_free[0] = 0 if i == NO_NODE else <uint64_t>self.nodes[i].size << self.unit_shift

    cdef int c_allocate_many(self, const uint64_t* sizes, Py_ssize_t n, uint64_t* offsets,
                             uint64_t* handles, Py_ssize_t* failed_at) noexcept nogil:
        cdef Py_ssize_t k, j
        cdef int rc
        for k in range(n):   # validate first: a bad size changes nothing
            if sizes[k] == 0:
                failed_at[0] = k
                return ALLOC_BAD_SIZE
        if <uint64_t>n > <uint64_t>(self.max_live - self.live_count):
            failed_at[0] = self.max_live - self.live_count
            return ALLOC_NO_SLOTS
        for k in range(n):
            rc = self.c_allocate(sizes[k], &offsets[k], &handles[k])
            if rc != ALLOC_OK:
                failed_at[0] = k
                # undo in reverse order: each free merges back exactly what its allocate split
                j = k - 1
                while j >= 0:
                    self.c_free(handles[j])
                    j -= 1
                return rc
        return ALLOC_OK

    cdef int c_free_many(self, const uint64_t* handles, Py_ssize_t n,
                         Py_ssize_t* failed_at) noexcept nogil:
        cdef Py_ssize_t k, j
        cdef int rc
        for k in range(n):   # validate (and catch duplicates) before freeing anything
            rc = self._check_handle(handles[k])
            if rc != ALLOC_OK:
                for j in range(k):
                    self.nodes[<uint32_t>handles[j]].state = NODE_USED
                failed_at[0] = k
                return rc
            self.nodes[<uint32_t>handles[k]].state = NODE_PENDING
        for k in range(n):
            self._release(<uint32_t>handles[k])
        return ALLOC_OK

    # ---- Python API ------------------------------------------------------------------

    cdef int _enter(self) except -1:
        if self.busy:
            raise RuntimeError("OffsetAllocator is in use by a batch call in another thread")
        return 0

    cdef object _space_error(self, uint64_t requested):
        cdef uint64_t free_b, largest
        self.c_report(&free_b, &largest)
        return CapacityError(requested=requested, free=free_b, largest_free=largest)

    cdef object _slots_error(self, uint64_t requested):
        cdef uint64_t free_b, largest
        self.c_report(&free_b, &largest)
        return CapacityError(
            requested=requested, free=free_b, largest_free=largest,
            message=(f"out of allocation slots: {self.live_count} allocations live, "
                     f"max_allocs={self.max_live}"))

    cdef object _error(self, int rc, uint64_t requested, object handle=None):
        if rc == ALLOC_NO_SPACE:
            return self._space_error(requested)
        if rc == ALLOC_NO_SLOTS:
            return self._slots_error(requested)
        if rc == ALLOC_BAD_SIZE:
            return ValueError("size must be >= 1 byte, got 0")
        if rc == ALLOC_BAD_HANDLE:
            return ValueError(f"unknown, stale or already freed allocation handle {handle!r}")
        if rc == ALLOC_DUPLICATE:
            return ValueError(f"allocation handle {handle!r} appears twice in one batch")
        return ValueError(f"allocator error {rc}")

    def allocate(self, size):
        """allocate(size) -> Allocation.  CapacityError when no free extent is large
        enough or max_allocs allocations are live; ValueError for size < 1."""
        cdef uint64_t s, off, h
        cdef int rc
        self._enter()
        s = _as_u64(size, "size")
        if s == 0:
            raise ValueError(f"size must be >= 1 byte, got {size!r}")
        rc = self.c_allocate(s, &off, &h)
        if rc != ALLOC_OK:
            raise self._error(rc, s)
        return _make_allocation(off, <uint64_t>self.nodes[<uint32_t>h].size << self.unit_shift, h)

    def free(self, handle):
        """free(handle): ValueError naming the handle if it is unknown, stale or freed."""
        cdef uint64_t h
        self._enter()
        h = _as_handle(handle)
        if self.c_free(h) != ALLOC_OK:
            raise ValueError(f"unknown, stale or already freed allocation handle {handle!r}")

    def reserve(self, offset, size):
        """reserve(offset, size) -> handle: claim exactly [offset, offset + size rounded
        up to unit).  ValueError if it is unaligned, leaves [0, capacity) or overlaps a
        live allocation; CapacityError if max_allocs allocations are live."""
        cdef uint64_t o, s, h
        cdef int rc
        self._enter()
        o = _as_u64(offset, "offset")
        s = _as_u64(size, "size")
        rc = self.c_reserve(o, s, &h)
        if rc == ALLOC_OK:
            return h
        raise self._reserve_error(rc, o, s)

    cdef object _reserve_error(self, int rc, uint64_t offset, uint64_t size):
        if rc == ALLOC_UNALIGNED:
            return ValueError(f"reserve({offset}, {size}): offset is not a multiple of unit ({self.unit_bytes} bytes)")
        if rc == ALLOC_OUT_OF_RANGE:
            return ValueError(f"reserve({offset}, {size}): extent leaves the capacity ({self.capacity_bytes} bytes)")
        if rc == ALLOC_OVERLAP:
            return ValueError(f"reserve({offset}, {size}): extent overlaps a live allocation")
        if rc == ALLOC_BAD_SIZE:
            return ValueError(f"reserve({offset}, {size}): size must be >= 1 byte")
        return self._error(rc, size)

    def reserve_many(self, const uint64_t[::1] offsets, const uint64_t[::1] sizes, uint64_t[::1] handles):
        """reserve_many(offsets, sizes, handles): ``handles[i] = reserve(offsets[i],
        sizes[i])`` for every i, in one C loop (uint64 buffers; ascending offsets take one
        sweep).  On the first failure the extents before it stay reserved and ValueError
        (or CapacityError) names its index."""
        cdef Py_ssize_t n = offsets.shape[0], k, failed = -1
        cdef int rc = ALLOC_OK
        if sizes.shape[0] != n or handles.shape[0] != n:
            raise ValueError(f"reserve_many: {n} offsets, {sizes.shape[0]} sizes, {handles.shape[0]} handles")
        self._enter()
        self.busy = True
        with nogil:
            for k in range(n):
                rc = self.c_reserve(offsets[k], sizes[k], &handles[k])
                if rc != ALLOC_OK:
                    failed = k
                    break
        self.busy = False
        if failed >= 0:
            exc = self._reserve_error(rc, offsets[failed], sizes[failed])
            exc.args = (f"reserve_many[{failed}]: {exc.args[0] if exc.args else exc}",) + exc.args[1:]
            raise exc
        return n

    def extent(self, handle):
        """extent(handle) -> (offset, size) in bytes of a live allocation."""
        cdef uint64_t h, o, s
        h = _as_handle(handle)
        self._enter()
        if self.c_extent(h, &o, &s) != ALLOC_OK:
            raise ValueError(f"unknown, stale or already freed allocation handle {handle!r}")
        return (o, s)

    def extents(self):
        """extents() -> [(offset, size, handle)] of the live allocations, by offset."""
        cdef list out = []
        cdef uint32_t i
        self._enter()
        i = self.head
        while i != NO_NODE:
            if self.nodes[i].state == NODE_USED:
                out.append((<uint64_t>self.nodes[i].offset << self.unit_shift,
                            <uint64_t>self.nodes[i].size << self.unit_shift,
                            (<uint64_t>self.nodes[i].gen << 32) | i))
            i = self.nodes[i].nb_next
        return out

    def free_extents(self):
        """free_extents() -> [(offset, size)] of the free regions, by offset."""
        cdef list out = []
        cdef uint32_t i
        self._enter()
        i = self.head
        while i != NO_NODE:
            if self.nodes[i].state == NODE_FREE:
                out.append((<uint64_t>self.nodes[i].offset << self.unit_shift,
                            <uint64_t>self.nodes[i].size << self.unit_shift))
            i = self.nodes[i].nb_next
        return out

    def report(self):
        """report() -> (free_bytes, largest_free): largest_free is the largest free
        extent exactly, so allocate(largest_free) succeeds when it is > 0."""
        cdef uint64_t free_b, largest
        self._enter()
        self.c_report(&free_b, &largest)
        return (free_b, largest)

    def allocate_many(self, sizes):
        """allocate_many(sizes) -> [Allocation]: all or nothing."""
        cdef list seq = list(sizes)
        cdef Py_ssize_t n = len(seq), k, failed = 0
        cdef uint64_t* buf
        cdef int rc
        cdef list out
        self._enter()
        if n == 0:
            return []
        if <uint64_t>n > self.max_live:
            raise CapacityError(requested=0, free=self.free_units << self.unit_shift,
                                message=f"out of allocation slots: a batch of {n} exceeds max_allocs={self.max_live}")
        buf = <uint64_t*>malloc(3 * n * sizeof(uint64_t))
        if buf == NULL:
            raise MemoryError()
        try:
            for k in range(n):
                try:
                    buf[k] = _as_u64(seq[k], "size")
                except (ValueError, TypeError) as e:
                    raise type(e)(f"sizes[{k}]: {e}") from None
                if buf[k] == 0:
                    raise ValueError(f"sizes[{k}]: size must be >= 1 byte, got 0")
            self.busy = True
            with nogil:
                rc = self.c_allocate_many(buf, n, buf + n, buf + 2 * n, &failed)
            self.busy = False
            if rc != ALLOC_OK:
                raise self._error(rc, buf[failed] if failed < n else 0)
            out = [None] * n
            for k in range(n):
                out[k] = _make_allocation(buf[n + k], <uint64_t>self.nodes[<uint32_t>buf[2 * n + k]].size
                                          << self.unit_shift, buf[2 * n + k])
            return out
        finally:
            self.busy = False
            c_free_mem(buf)

    def free_many(self, handles):
        """free_many(handles): all or nothing; ValueError naming the first bad handle."""
        cdef list seq = list(handles)
        cdef Py_ssize_t n = len(seq), k, failed = 0
        cdef uint64_t* buf
        cdef int rc
        self._enter()
        if n == 0:
            return
        if <uint64_t>n > self.live_count:
            raise ValueError(f"free_many: {n} handles but only {self.live_count} allocations are live")
        buf = <uint64_t*>malloc(n * sizeof(uint64_t))
        if buf == NULL:
            raise MemoryError()
        try:
            for k in range(n):
                buf[k] = _as_handle(seq[k])
            self.busy = True
            with nogil:
                rc = self.c_free_many(buf, n, &failed)
            self.busy = False
            if rc != ALLOC_OK:
                raise self._error(rc, 0, seq[failed])
        finally:
            self.busy = False
            c_free_mem(buf)

    def clear(self):
        """Free every allocation (all handles become stale)."""
        cdef uint32_t i
        self._enter()
        i = self.head
        while i != NO_NODE:   # bump generations so old handles stay invalid
            if self.nodes[i].state == NODE_USED:
                self.nodes[i].gen += 1
            i = self.nodes[i].nb_next
        self._reset()

    @property
    def capacity(self):
        """Bytes managed."""
        return self.capacity_bytes

    @property
    def unit(self):
        """Bytes per unit: every offset and size is a multiple of it."""
        return self.unit_bytes

    @property
    def used(self):
        """Bytes in live allocations."""
        return (<uint64_t>self.total_units - self.free_units) << self.unit_shift

    @property
    def live(self):
        """Number of live allocations."""
        return self.live_count

    @property
    def max_allocs(self):
        """The most allocations that can be live at once."""
        return self.max_live

    @property
    def node_pool(self):
        """Nodes in the metadata pool (2 * min(max_allocs, capacity/unit) + 1)."""
        return self.n_nodes

    def __repr__(self):
        return (f"OffsetAllocator(capacity={self.capacity_bytes}, unit={self.unit_bytes}, "
                f"max_allocs={self.max_live}, live={self.live_count}, used={self.used})")

    # ---- benchmark helper (the loop is _bench_pairs in alloc_bench.pxi) -----------

    def bench_pairs(self, uint64_t n_pairs, const uint64_t[::1] sizes not None, uint32_t live,
                    uint32_t batch=64, uint64_t seed=0x9E3779B97F4A7C15):
        """bench_pairs(n_pairs, sizes, live, batch=64, seed=...) -> elapsed ns.

        Fills ``live`` allocations (sizes taken cyclically from ``sizes``, a uint64
        array of bytes), then times ``n_pairs`` free+allocate pairs without the GIL:
        each round frees ``batch`` randomly chosen live allocations through
        c_free_many and allocates the next ``batch`` sizes through c_allocate_many
        (batch=1 uses c_free/c_allocate).  Everything is freed again afterwards; the
        allocator must be empty on entry."""
        return _bench_pairs(self, n_pairs, sizes, live, batch, seed)
