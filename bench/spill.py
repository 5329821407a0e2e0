"""The spill regime: put MB/s when every put must first demote a dirty block to the SSD tier,
against a raw O_DIRECT sequential write of the same bytes, in the same run.

    .venv/bin/python bench/spill.py [--dir /path/on/the/disk] [--mib 512] [--block-mib 1]
                                     [--dram-mib 64] [--writers 8] [--rounds 3]

The store side: a LocalKvStore (write_back) over an SsdTier with O_DIRECT, its DRAM filled
with dirty blocks first, then ``--mib`` of puts from ``--writers`` concurrent writers
(reserve -> copy into the slot -> put_end, what the daemon does for a PUT minus the socket).
DRAM stays full, so every put waits for demotions (SSD writes + group commits) to make room.
The raw side: one thread, os.pwrite of the same block size with O_DIRECT at increasing
offsets of a preallocated file, then one fdatasync.  Both run interleaved ``--rounds`` times
in one process; the best of each is compared and the ratio printed (target >= 0.7).

All work happens in main() (asv imports only bench/suites/).
"""
from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import shutil
import sys
import tempfile
import time

MiB = 1 << 20


def _key(i):
    from quillcache.model import KvBlockKey
    return KvBlockKey("bench", "tok", None, "t", "spill", f"b{i}", i % 100_000)


def raw_write(path: str, total: int, block: int) -> float:
    """Seconds to write ``total`` bytes sequentially with O_DIRECT, then fdatasync."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
        os.fsync(fd)
        buf = mmap.mmap(-1, block)              # page aligned, as O_DIRECT wants
        buf.write(os.urandom(block))
        t0 = time.perf_counter()
        off = 0
        while off < total:
            off += os.pwrite(fd, buf, off)
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


async def store_spill(directory: str, total: int, block: int, dram: int, writers: int) -> tuple[float, dict]:
    """Seconds for ``total`` bytes of puts into a full DRAM (every put demotes first), and stats."""
    from quillcache.store.ssd import SsdTier
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    ssd = await SsdTier.open(directory, _round(2 * total + 2 * dram, 4096), direct_io=True)
    if not ssd.direct_io:
        raise SystemExit(f"{directory}: O_DIRECT is refused here (tmpfs?): use --dir on a real disk")
    store = LocalKvStore(StoreOptions(dram, max_block_bytes=block), ssd=ssd)
    payload = memoryview(os.urandom(block))
    n_fill = dram // block
    for i in range(n_fill):                     # DRAM full of dirty blocks: nothing to evict for free
        (h,) = store.reserve_nowait([(_key(i), block)])
        h.view[:] = payload
        await store.put_end(h)
    while store.stats()["store"]["demotions_in_flight"]:
        await asyncio.sleep(0.01)               # the watermark's demote-ahead settles first
    n = total // block
    next_i = iter(range(n_fill, n_fill + n))

    async def writer():
        for i in next_i:
            (h,) = await store.reserve([(_key(i), block)])
            h.view[:] = payload
            await store.put_end(h)

    t0 = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(writers)))
    elapsed = time.perf_counter() - t0
    st = store.stats()
    await store.close()
    return elapsed, st


def _round(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=512, help="MiB put in each round")
    ap.add_argument("--block-mib", type=int, default=1)
    ap.add_argument("--dram-mib", type=int, default=64)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    base = tempfile.mkdtemp(prefix="qc-spill-", dir=args.dir)
    total, block, dram = args.mib * MiB, args.block_mib * MiB, args.dram_mib * MiB
    raw_best = store_best = float("inf")
    st: dict = {}
    try:
        for r in range(args.rounds):
            raw_s = raw_write(os.path.join(base, "raw.dat"), total, block)
            d = os.path.join(base, f"ssd{r}")
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                store_s, st = runner.run(store_spill(d, total, block, dram, args.writers))
            shutil.rmtree(d, ignore_errors=True)
            raw_best, store_best = min(raw_best, raw_s), min(store_best, store_s)
            print(f"round {r + 1}: raw O_DIRECT {total / raw_s / MiB:8.1f} MB/s   "
                  f"store spill {total / store_s / MiB:8.1f} MB/s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    s = st["store"]
    print(f"\n{args.mib} MiB in {args.block_mib} MiB blocks, DRAM {args.dram_mib} MiB full of dirty blocks, "
          f"{args.writers} writers")
    print(f"  puts that waited for room: {s['put_waits']} of {total // block}, "
          f"dropped_dirty {s['dropped_dirty']}, demotions {st['dram']['demotions']}")
    print(f"  raw O_DIRECT sequential write: {total / raw_best / MiB:8.1f} MB/s (best of {args.rounds})")
    print(f"  store put, every put demotes:  {total / store_best / MiB:8.1f} MB/s (best of {args.rounds})")
    ratio = raw_best / store_best
    print(f"  ratio store/raw: {ratio:.2f}x (target >= 0.70x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
