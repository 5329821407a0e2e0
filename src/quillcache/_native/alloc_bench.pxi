# Included by alloc.pyx: the benchmark helper behind OffsetAllocator.bench_pairs (a
# timed free+allocate loop over the cdef API without the GIL).  Not used by the allocator.
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef enum:
    MAX_BATCH_ON_STACK = 256         # entries: bench_pairs batch limit


cdef inline uint64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000 + <uint64_t>ts.tv_nsec


# A module function rather than the method body: an include cannot go inside a class body.
# OffsetAllocator.bench_pairs checks the arguments' types and carries the docstring.
cdef object _bench_pairs(OffsetAllocator self, uint64_t n_pairs, const uint64_t[::1] sizes,
                         uint32_t live, uint32_t batch, uint64_t seed):
    cdef Py_ssize_t ns = sizes.shape[0], failed = 0
    cdef uint64_t* handles
    cdef uint64_t offs[MAX_BATCH_ON_STACK]
    cdef uint64_t bsz[MAX_BATCH_ON_STACK]
    cdef uint64_t done = 0, cursor = 0, t0 = 0, t1 = 0, x = seed | 1, tmp
    cdef uint32_t k, b, r, filled = 0
    cdef uint64_t failed_size = 0
    cdef int rc = ALLOC_OK
    self._enter()
    if ns == 0:
        raise ValueError("sizes must not be empty")
    if batch == 0 or batch > MAX_BATCH_ON_STACK or batch > live:
        raise ValueError(f"batch must be in [1, min(live, {MAX_BATCH_ON_STACK})], got {batch}")
    if self.live_count != 0:
        raise ValueError("bench_pairs needs an empty allocator")
    if live > self.max_live:
        raise ValueError(f"live={live} exceeds max_allocs={self.max_live}")
    handles = <uint64_t*>malloc(live * sizeof(uint64_t))
    if handles == NULL:
        raise MemoryError()
    self.busy = True
    try:
        with nogil:
            while filled < live:
                rc = self.c_allocate(sizes[cursor % ns], &offs[0], &handles[filled])
                if rc != ALLOC_OK:
                    failed_size = sizes[cursor % ns]
                    break
                filled += 1
                cursor += 1
            if rc == ALLOC_OK:
                t0 = _now_ns()
                while done < n_pairs:
                    b = batch if n_pairs - done >= batch else <uint32_t>(n_pairs - done)
                    # move b random distinct live handles to the tail (partial Fisher-Yates)
                    for k in range(b):
                        x ^= x << 13
                        x ^= x >> 7
                        x ^= x << 17
                        r = <uint32_t>(x % (live - k))
                        tmp = handles[r]
                        handles[r] = handles[live - 1 - k]
                        handles[live - 1 - k] = tmp
                        bsz[k] = sizes[cursor % ns]
                        cursor += 1
                    if b == 1:
                        rc = self.c_free(handles[live - 1])
                        if rc == ALLOC_OK:
                            rc = self.c_allocate(bsz[0], &offs[0], &handles[live - 1])
                    else:
                        rc = self.c_free_many(&handles[live - b], b, &failed)
                        if rc == ALLOC_OK:
                            rc = self.c_allocate_many(bsz, b, offs, &handles[live - b], &failed)
                    if rc != ALLOC_OK:
                        failed_size = bsz[failed] if b > 1 else bsz[0]
                        # the freed tail is gone: only [0, live - b) is still live
                        filled = live - b
                        break
                    done += b
                t1 = _now_ns()
            if filled:
                self.c_free_many(handles, filled, &failed)
    finally:
        self.busy = False
        c_free_mem(handles)
    if rc != ALLOC_OK:
        raise self._error(rc, failed_size)
    return t1 - t0
