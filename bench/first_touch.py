"""Should a pool node prefault its arena?  The first-touch cost of a fresh arena, measured:
a DRAM-only quillcached started with ``[store] prefault = false`` and with ``true``, taking
turns, each with a fresh client process's ``put_many`` passes over the same working set.

    python bench/first_touch.py [--dram 1GiB] [--size 64K] [--working-set 64MiB] [--runs 3]

Per node: how long it took to start (until its port answers: MAP_POPULATE zeroes the whole
budget then), its RSS right after start, and MB/s of three passes of PUTs (``put_many`` of
``batch`` values, about 4 MiB a request) and one of GETs (``get_many``) over the working set.
Pass 1 writes fresh arena pages unless the arena was prefaulted; a replaced value's slot is
freed after its new one is published, so pass 2 may still land on pages never touched.
MiB = 2^20 bytes; "MB/s" here is MiB/s.  Best of ``--runs`` per column; the last row is
each column with the prefault over the same column without it, both measured in this run.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._local_node import LocalNode

BATCH_BYTES = 4 << 20          # bytes a request aims at
PASSES = 3                     # PUT passes over the working set


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.upper().removesuffix("IB").removesuffix("B")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def one(prefault: bool, args) -> dict:
    from quillcache.client import Client
    from quillcache.model import KvBlockKey
    n = max(1, args.working_set // args.size)
    batch = max(1, min(500, BATCH_BYTES // args.size))
    t0 = time.perf_counter()
    with LocalNode(dram=args.dram, prefault=prefault, hugepages=False) as node:
        started = time.perf_counter() - t0
        rss = _rss(node.proc.pid)
        with Client(node.tcp, timeout=120) as c:
            tenant = c.tenant or "default"
            keys = [KvBlockKey("m", "t", None, tenant, "p%05d" % (i // 100), "b%07d" % i, i % 100) for i in range(n)]
            base = os.urandom(args.size)
            vals = [i.to_bytes(8, "little") + base[8:] for i in range(n)]
            out = {"start_s": started, "rss_after_start": rss}
            for p in range(PASSES):
                t = time.perf_counter()
                for s in range(0, n, batch):
                    c.put_many(list(zip(keys[s:s + batch], vals[s:s + batch])))
                out[f"put{p + 1}"] = n * args.size / (time.perf_counter() - t) / 2**20
            t = time.perf_counter()
            for s in range(0, n, batch):
                got = c.get_many(keys[s:s + batch])
                assert all(g is not None for g in got)
            out["get"] = n * args.size / (time.perf_counter() - t) / 2**20
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dram", default="1GiB")
    ap.add_argument("--size", type=_bytes, default=64 << 10, help="bytes per value (K, M suffixes)")
    ap.add_argument("--working-set", type=_bytes, default=64 << 20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    best = {False: {}, True: {}}
    for _ in range(args.runs):
        for prefault in (False, True):
            r = one(prefault, args)
            for k, v in r.items():
                keep = min if k in ("start_s", "rss_after_start") else max
                best[prefault][k] = keep(best[prefault].get(k, v), v)
    print(f"load average {os.getloadavg()[0]:.2f}; dram {args.dram}, values of {args.size} B, "
          f"working set {args.working_set >> 20} MiB, best of {args.runs}")
    print("| prefault | start s | RSS after start MiB | PUT pass 1 MB/s | pass 2 | pass 3 | GET MB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for prefault in (False, True):
        b = best[prefault]
        print(f"| {str(prefault).lower()} | {b['start_s']:.2f} | {b['rss_after_start'] / 2**20:.0f} | {b['put1']:.0f} | "
              f"{b['put2']:.0f} | {b['put3']:.0f} | {b['get']:.0f} |")
    off, on = best[False], best[True]
    cols = ("start_s", "rss_after_start", "put1", "put2", "put3", "get")
    print("| true / false | " + " | ".join(f"{on[k] / off[k]:.2f}x" if off[k] else "-" for k in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
