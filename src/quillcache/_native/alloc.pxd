# The offset allocator's contract for other Cython code (cimport this file).
#
# Every c_* method is noexcept nogil, touches no Python object and returns 0 (or a
# count) on success and one of the negative AllocStatus codes on failure; a failed
# call changes nothing.  Offsets and sizes are bytes; handles are
# (generation << 32) | node_index, so a stale handle never frees a reused node.
from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef enum AllocStatus:
    ALLOC_OK = 0
    ALLOC_NO_SPACE = -1      # no free extent is large enough
    ALLOC_NO_SLOTS = -2      # max_allocs allocations are live
    ALLOC_BAD_SIZE = -3      # size 0
    ALLOC_BAD_HANDLE = -4    # unknown, stale or already freed handle
    ALLOC_OVERLAP = -5       # reserve(): the extent overlaps a live allocation
    ALLOC_OUT_OF_RANGE = -6  # reserve(): the extent leaves [0, capacity)
    ALLOC_UNALIGNED = -7     # reserve(): the offset is not a multiple of unit
    ALLOC_DUPLICATE = -8     # free_many(): the same handle twice in one batch

# One node per free region or live allocation; metadata never lives in the
# managed space.  32 bytes, so two nodes share a cache line.
cdef struct Node:
    uint32_t offset    # units
    uint32_t size      # units
    uint32_t bin_prev  # free list of the node's bin (FREE nodes only)
    uint32_t bin_next
    uint32_t nb_prev   # address-order neighbours (FREE and USED nodes)
    uint32_t nb_next
    uint32_t gen       # bumped when an allocation is freed: invalidates old handles
    uint8_t state      # NODE_UNUSED / NODE_FREE / NODE_USED / NODE_PENDING


cdef class Allocation:
    cdef readonly uint64_t offset
    cdef readonly uint64_t size
    cdef readonly uint64_t handle


cdef class OffsetAllocator:
    cdef Node* nodes
    cdef uint32_t* node_stack        # indices of unused nodes
    cdef uint32_t node_stack_top
    cdef uint32_t n_nodes
    cdef uint32_t fresh              # nodes [fresh, n_nodes) were never used
    cdef uint32_t head               # the node at offset 0
    cdef uint32_t hint               # reserve(): where the address walk starts
    cdef uint32_t bin_heads[256]
    cdef uint8_t leaf_masks[32]
    cdef uint32_t top_mask
    cdef uint64_t capacity_bytes
    cdef uint64_t unit_bytes
    cdef int unit_shift
    cdef uint32_t total_units
    cdef uint64_t free_units
    cdef uint32_t live_count
    cdef uint32_t max_live
    cdef bint busy                   # a Python batch call runs without the GIL

    # size, offset: bytes.  handle: out.
    cdef int c_allocate(self, uint64_t size, uint64_t* offset, uint64_t* handle) noexcept nogil
    cdef int c_free(self, uint64_t handle) noexcept nogil
    cdef int c_reserve(self, uint64_t offset, uint64_t size, uint64_t* handle) noexcept nogil
    cdef int c_extent(self, uint64_t handle, uint64_t* offset, uint64_t* size) noexcept nogil
    cdef void c_report(self, uint64_t* free_bytes, uint64_t* largest_free) noexcept nogil
    # All or nothing: on failure nothing stays allocated/freed, *failed_at is the
    # index of the size/handle that failed and the status is returned.
    cdef int c_allocate_many(self, const uint64_t* sizes, Py_ssize_t n, uint64_t* offsets,
                             uint64_t* handles, Py_ssize_t* failed_at) noexcept nogil
    cdef int c_free_many(self, const uint64_t* handles, Py_ssize_t n,
                         Py_ssize_t* failed_at) noexcept nogil

    # internals
    cdef uint32_t _units(self, uint64_t size) noexcept nogil
    cdef uint32_t _pop_node(self) noexcept nogil
    cdef void _push_node(self, uint32_t i) noexcept nogil
    cdef void _bin_insert(self, uint32_t i) noexcept nogil
    cdef void _bin_remove(self, uint32_t i) noexcept nogil
    cdef uint32_t _find_free(self, uint32_t units) noexcept nogil
    cdef uint32_t _largest_node(self) noexcept nogil
    cdef int _check_handle(self, uint64_t handle) noexcept nogil
    cdef void _release(self, uint32_t i) noexcept nogil
    cdef uint32_t _containing(self, uint32_t unit_offset) noexcept nogil
    cdef uint32_t _nodes_available(self) noexcept nogil
    cdef void _reset(self) noexcept nogil
    cdef int _enter(self) except -1
    cdef object _space_error(self, uint64_t requested)
    cdef object _slots_error(self, uint64_t requested)
    cdef object _error(self, int rc, uint64_t requested, object handle=*)
    cdef object _reserve_error(self, int rc, uint64_t offset, uint64_t size)
