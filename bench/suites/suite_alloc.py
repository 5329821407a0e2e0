"""asv suite: the offset allocator at a steady live set of mixed sizes (256 B - 4 MiB).

Standalone comparison with the pure-Python first-fit baseline: bench/native_alloc.py.
"""
import random

from quillcache._native.alloc import OffsetAllocator

from bench.native_alloc import CAPACITY, UNIT, FirstFit, mixed_sizes

LIVE = 10_000          # live allocations
PAIRS = 10_000         # free+allocate pairs per timed call


class CdefPairs:
    """bench_pairs: the nogil loop over the cdef batch API (batch=64) and single calls."""
    params = [1, 64]
    param_names = ["batch"]

    def setup(self, batch):
        self.a = OffsetAllocator(CAPACITY, unit=UNIT, max_allocs=LIVE + 1024)
        self.sizes = mixed_sizes(1 << 16)

    def time_pairs(self, batch):
        self.a.bench_pairs(PAIRS, self.sizes, LIVE, batch=batch)


class PythonPairs:
    """free()/allocate() from Python with LIVE allocations live."""

    def setup(self):
        self.a = OffsetAllocator(CAPACITY, unit=UNIT, max_allocs=LIVE + 1024)
        self.sizes = mixed_sizes(LIVE + PAIRS).tolist()
        self.handles = [self.a.allocate(s).handle for s in self.sizes[:LIVE]]
        rng = random.Random(1)
        self.victims = [rng.randrange(LIVE) for _ in range(PAIRS)]

    def time_pairs(self):
        a, handles, sizes = self.a, self.handles, self.sizes
        for i, j in enumerate(self.victims):
            a.free(handles[j])
            handles[j] = a.allocate(sizes[LIVE + i]).handle

    def time_report(self):
        self.a.report()

    def time_allocate_many_free_many_64(self):
        got = self.a.allocate_many(self.sizes[:64])
        self.a.free_many([x.handle for x in got])


class FirstFitPairs:
    """The pure-Python first-fit baseline, same workload (fewer pairs: it is slow)."""

    def setup(self):
        self.ff = FirstFit(CAPACITY)
        self.sizes = mixed_sizes(LIVE + 1000).tolist()
        self.handles = [self.ff.allocate(s) for s in self.sizes[:LIVE]]
        rng = random.Random(1)
        self.victims = [rng.randrange(LIVE) for _ in range(1000)]

    def time_pairs_1000(self):
        ff, handles, sizes = self.ff, self.handles, self.sizes
        for i, j in enumerate(self.victims):
            ff.free(handles[j])
            handles[j] = ff.allocate(sizes[LIVE + i])
