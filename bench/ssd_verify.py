"""Eager vs lazy CRC verification of the SSD tier: recovery time and first-read latency.

    .venv/bin/python bench/ssd_verify.py [--blocks 10000] [--block-bytes 65536] [--dir DIR]

Fills a tier with ``blocks`` blocks, closes it without the final checkpoint (so recovery
replays the WAL, as after a crash), then for each mode drops the data file's pages from the
page cache (posix_fadvise DONTNEED), recovers, and reads every block once (read_into, which
verifies the CRC on every read).  Both sides run in one process; the ratio is what matters.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time


def _key(i):
    from quillcache.model import KvBlockKey
    return KvBlockKey("bench", "tok", None, "t", "p", f"b{i}", i)


async def _fill(path, capacity, blocks, block_bytes):
    from quillcache.errors import ReadOnlyError
    from quillcache.store.ssd import SsdTier
    tier = await SsdTier.open(path, capacity, checkpoint_records=1 << 30, checkpoint_wal_bytes=1 << 40)
    payload = bytes(range(256)) * (block_bytes // 256) + bytes(block_bytes % 256)
    sem = asyncio.Semaphore(64)

    async def one(i):
        async with sem:
            await tier.put(_key(i), payload)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(blocks)))
    fill_s = time.perf_counter() - t0
    stats = tier.stats()
    # leave the state a crash would leave: no closing checkpoint, recovery replays the WAL
    tier._committer.failed = ReadOnlyError("bench: skip the closing checkpoint")
    await tier.close()
    return fill_s, stats


def _drop_cache(path):
    fd = os.open(os.path.join(path, "data.qc"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _measure(src, work, capacity, blocks, block_bytes, verify):
    from quillcache.store.ssd import SsdTier
    if os.path.exists(work):
        shutil.rmtree(work)
    shutil.copytree(src, work)              # each mode recovers the same crashed state
    _drop_cache(work)
    t0 = time.perf_counter()
    tier = SsdTier(work, capacity, verify=verify)
    recover_s = time.perf_counter() - t0
    buf = bytearray(block_bytes)
    lat = []
    for i in range(blocks):
        t = time.perf_counter()
        tier.read_into(_key(i), buf)
        lat.append(time.perf_counter() - t)
    tier.close_sync()
    lat.sort()
    return {"recover_s": recover_s, "read_p50_us": lat[len(lat) // 2] * 1e6,
            "read_p99_us": lat[int(len(lat) * 0.99)] * 1e6, "read_mean_us": statistics.fmean(lat) * 1e6,
            "total_s": recover_s + sum(lat)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10000)
    p.add_argument("--block-bytes", type=int, default=64 << 10)
    p.add_argument("--dir", default=None, help="where to put the tier (default: a temp dir)")
    args = p.parse_args(argv)
    unit = 4096
    per = -(-args.block_bytes // unit) * unit
    capacity = per * args.blocks + 64 * unit
    base = tempfile.mkdtemp(prefix="qc-ssd-verify-", dir=args.dir)
    try:
        src = os.path.join(base, "src")
        fill_s, st = asyncio.run(_fill(src, capacity, args.blocks, args.block_bytes))
        print(f"fill: {args.blocks} x {args.block_bytes} B in {fill_s:.2f} s "
              f"({args.blocks / fill_s:.0f} puts/s, {st['commits']} group commits, wal {st['wal_backend']}, "
              f"direct_io={st['direct_io']}, commit p50 {st['commit_p50_ms']} ms p99 {st['commit_p99_ms']} ms, "
              f"{st['wal_bytes_per_put']} WAL bytes/put)")
        res = {}
        for verify in ("lazy", "eager"):
            res[verify] = r = _measure(src, os.path.join(base, verify), capacity, args.blocks,
                                       args.block_bytes, verify)
            print(f"{verify:5s}: recovery {r['recover_s'] * 1e3:8.1f} ms   first read p50 {r['read_p50_us']:7.1f} us"
                  f"  p99 {r['read_p99_us']:7.1f} us  mean {r['read_mean_us']:7.1f} us"
                  f"   recovery + read all {r['total_s']:.2f} s")
        lz, eg = res["lazy"], res["eager"]
        print(f"ratio eager/lazy: recovery {eg['recover_s'] / lz['recover_s']:.1f}x, "
              f"first-read mean {eg['read_mean_us'] / lz['read_mean_us']:.2f}x, "
              f"recovery + read all {eg['total_s'] / lz['total_s']:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
