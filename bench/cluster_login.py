"""What issue 22's member defences cost, each against its baseline in the same run.

    .venv/bin/python bench/cluster_login.py [--samples 200]

* a node login (TCP connect, HELLO, NODE_AUTH, NODE_PROOF) against a plain client connect
  (TCP connect, HELLO), on a real clustered node, alternating, p50: paid once per link;
* the reader's CRC32C of a fetched block (the check against its writer's CRC), 256 KiB and
  4 MiB, GB/s: paid per cross-node block; it replaces the frame's CRC trailer the holder
  computed and the reader checked before (one pass over the bytes instead of two); against
  one copy of the same block in the same run, the cost the reader pays anyway to move it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quillcache import Client
from quillcache._native.crc import crc32c
from tests._support.cluster import Pool, member
from tests._support.etcd import EtcdServer
from bench._serve import scratch


def login_vs_hello(addr: str, samples: int) -> tuple[float, float]:
    plain, login = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        Client(addr).close()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        member(addr, "bench", peer_id="node-a").close()
        login.append(time.perf_counter() - t0)
    return statistics.median(plain), statistics.median(login)


def crc_rate(size: int, rounds: int = 50) -> tuple[float, float]:
    """GB/s of crc32c over a block, and of one copy of the same block (the baseline: what the
    reader already spends moving it), each the best of ``rounds``, taking turns."""
    buf = memoryview(os.urandom(size))
    dst = bytearray(size)

    def copy(b):
        dst[:] = b

    crc, cp = [], []
    for _ in range(rounds):
        crc.append(_timed(crc32c, buf))
        cp.append(_timed(copy, buf))
    return size / min(crc) / 1e9, size / min(cp) / 1e9


def _timed(f, arg) -> float:
    t0 = time.perf_counter()
    f(arg)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    with scratch("qc-login-", "bench/cluster_login.py") as tmp, EtcdServer(tmp / "etcd") as etcd, \
            Pool(tmp, etcd.endpoint, 1, lease_ttl="3s") as pool:
        pool.wait_members(1)
        plain, login = login_vs_hello(pool["a"].addr, args.samples)
    print(f"connect + HELLO, p50              {plain * 1e3:8.3f} ms")
    print(f"connect + HELLO + node login, p50 {login * 1e3:8.3f} ms   ({login / plain:.2f}x, once per link)")
    for size in (256 << 10, 4 << 20):
        crc, cp = crc_rate(size)
        print(f"crc32c of a {size >> 10:5d} KiB block      {crc:8.1f} GB/s "
              f"({size / crc / 1e3:.1f} us per block; one copy of it {cp:.1f} GB/s: the check costs "
              f"{cp / crc:.2f} copies)")


if __name__ == "__main__":
    main()
