"""Offset allocator throughput: free+allocate pairs per second at a steady live set.

Three sides in one process run, same sizes and the same random victim choice:
  cdef    OffsetAllocator.bench_pairs: the nogil loop over c_free_many/c_allocate_many
          (batch=64) and over c_free/c_allocate (batch=1)
  python  OffsetAllocator.free()/allocate() called from a Python loop
  firstfit  a pure-Python first-fit free list with coalescing (what LMCache does)

Run:  .venv/bin/python bench/native_alloc.py [--pairs N] [--live N]
Importing this module does no work (bench/suites/suite_alloc.py imports its helpers).
"""
import argparse
import bisect
import random
import time

import numpy as np

from quillcache._native.alloc import OffsetAllocator

MIN_SIZE = 256                 # bytes
MAX_SIZE = 4 * 1024 * 1024     # bytes
UNIT = 256                     # bytes
CAPACITY = 16 << 30            # bytes: about 4x the live bytes of 10k mixed sizes


def mixed_sizes(n, seed=1):
    """n sizes in bytes, log-uniform in [MIN_SIZE, MAX_SIZE], as a uint64 array."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(MIN_SIZE), np.log(MAX_SIZE)
    return np.exp(rng.uniform(lo, hi, n)).astype(np.uint64)


class FirstFit:
    """A first-fit allocator over a sorted free list, coalescing on free."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.free_offsets = [0]
        self.free_sizes = [capacity]
        self.live = {}
        self.next_handle = 0

    def allocate(self, size):
        size = -(-size // UNIT) * UNIT
        sizes = self.free_sizes
        for i in range(len(sizes)):
            if sizes[i] >= size:
                off = self.free_offsets[i]
                if sizes[i] == size:
                    del self.free_offsets[i]
                    del sizes[i]
                else:
                    self.free_offsets[i] = off + size
                    sizes[i] -= size
                h = self.next_handle
                self.next_handle += 1
                self.live[h] = (off, size)
                return h
        raise MemoryError(f"first fit: no free extent of {size} bytes")

    def free(self, handle):
        off, size = self.live.pop(handle)
        offs, sizes = self.free_offsets, self.free_sizes
        i = bisect.bisect_left(offs, off)
        if i > 0 and offs[i - 1] + sizes[i - 1] == off:         # merge with the left region
            i -= 1
            sizes[i] += size
        else:
            offs.insert(i, off)
            sizes.insert(i, size)
        if i + 1 < len(offs) and offs[i] + sizes[i] == offs[i + 1]:  # and with the right one
            sizes[i] += sizes[i + 1]
            del offs[i + 1]
            del sizes[i + 1]


def _python_loop(allocate, free, sizes, victims, live):
    """Fill `live`, then time len(victims) free+allocate pairs; returns elapsed ns."""
    sz = sizes.tolist()
    handles = [allocate(sz[i % len(sz)]) for i in range(live)]
    n = len(victims)
    t0 = time.perf_counter_ns()
    for i in range(n):
        j = victims[i]
        free(handles[j])
        handles[j] = allocate(sz[(live + i) % len(sz)])
    elapsed = time.perf_counter_ns() - t0
    for h in handles:
        free(h)
    return elapsed


def cdef_pairs_per_s(n_pairs, live, batch=64, seed=1):
    a = OffsetAllocator(CAPACITY, unit=UNIT, max_allocs=live + 1024)
    sizes = mixed_sizes(1 << 16, seed)
    ns = a.bench_pairs(n_pairs, sizes, live, batch=batch)
    return n_pairs / (ns / 1e9)


def python_pairs_per_s(n_pairs, live, seed=1):
    a = OffsetAllocator(CAPACITY, unit=UNIT, max_allocs=live + 1024)
    alloc = a.allocate

    def allocate(size):
        return alloc(size).handle

    sizes = mixed_sizes(1 << 16, seed)
    rng = random.Random(seed)
    victims = [rng.randrange(live) for _ in range(n_pairs)]
    ns = _python_loop(allocate, a.free, sizes, victims, live)
    assert a.live == 0
    return n_pairs / (ns / 1e9)


def firstfit_pairs_per_s(n_pairs, live, seed=1):
    ff = FirstFit(CAPACITY)
    sizes = mixed_sizes(1 << 16, seed)
    rng = random.Random(seed)
    victims = [rng.randrange(live) for _ in range(n_pairs)]
    ns = _python_loop(ff.allocate, ff.free, sizes, victims, live)
    assert not ff.live and ff.free_sizes == [CAPACITY]
    return n_pairs / (ns / 1e9)


def run(pairs=2_000_000, python_pairs=500_000, firstfit_pairs=20_000, live=10_000):
    """All figures in one process run; returns a dict of pairs/s and ratios."""
    out = {
        "live": live,
        "cdef_batch64_pairs_per_s": cdef_pairs_per_s(pairs, live, batch=64),
        "cdef_single_pairs_per_s": cdef_pairs_per_s(pairs, live, batch=1),
        "python_pairs_per_s": python_pairs_per_s(python_pairs, live),
        "firstfit_pairs_per_s": firstfit_pairs_per_s(firstfit_pairs, live),
    }
    ff = out["firstfit_pairs_per_s"]
    out["ratio_cdef_batch_vs_firstfit"] = out["cdef_batch64_pairs_per_s"] / ff
    out["ratio_python_vs_firstfit"] = out["python_pairs_per_s"] / ff
    out["ratio_cdef_batch_vs_python"] = out["cdef_batch64_pairs_per_s"] / out["python_pairs_per_s"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2_000_000, help="pairs through the cdef path")
    p.add_argument("--python-pairs", type=int, default=500_000, help="pairs through Python calls")
    p.add_argument("--firstfit-pairs", type=int, default=20_000, help="pairs through first fit")
    p.add_argument("--live", type=int, default=10_000, help="live allocations")
    args = p.parse_args(argv)
    r = run(args.pairs, args.python_pairs, args.firstfit_pairs, args.live)
    print(f"# offset allocator, {r['live']} live allocations, sizes {MIN_SIZE} B - {MAX_SIZE >> 20} MiB "
          f"log-uniform, unit {UNIT} B")
    for k, v in r.items():
        if k.endswith("_per_s"):
            print(f"{k}:{v / 1e6:.3f}M")
        elif k.startswith("ratio_"):
            print(f"{k}:{v:.1f}x")
    return r


if __name__ == "__main__":
    main()
