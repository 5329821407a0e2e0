"""Decision latency of the router: 64 workers, a 128-block request, an index of 1M blocks,
against the same decision over a small index in the same run (the ratio says whether the
per-decision work grows with the blocks indexed; the absolute time is the machine's).

    python bench/router_decision.py --blocks 1000000 --small 10000 --decisions 2000
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np

from quillcache.control.indexer import DEVICE, HOST, POOL, ArtIndexer
from quillcache.control.router import Router, RouterConfig
from quillcache.model import IdentityScope
from quillcache.protocol.route import POLICIES

SCOPE = IdentityScope("llama-3-8b", "llama-3-8b", None, "t0")


def build(total: int, workers: int, seed: int) -> tuple[Router, list[list[int]]]:
    """``total`` blocks spread over the workers as chains of 128 (device, some on host, and a
    pool node holding every fourth chain); returns the router and the chains."""
    idx = ArtIndexer()
    names = [f"w{i}" for i in range(workers)]
    r = Router(RouterConfig(policy="quillcache", block_size=16, seed=seed), idx, names)
    chains = []
    rng = random.Random(seed)
    for c in range(total // 128):
        chain = list(range(c * 128, (c + 1) * 128))
        chains.append(chain)
        w = names[c % workers]
        cut = rng.randrange(64, 129)
        idx.add_blocks(w, SCOPE, chain[:cut], DEVICE)
        if cut < 128:
            idx.add_blocks(w, SCOPE, chain[cut:], HOST)
        if c % 4 == 0:
            idx.add_blocks("pool", SCOPE, chain, POOL)
    return r, chains


def measure(r: Router, chains: list[list[int]], decisions: int, policy: str, seed: int) -> np.ndarray:
    rng = random.Random(seed)
    out = np.empty(decisions)
    for i in range(decisions):
        chain = chains[rng.randrange(len(chains))]
        depth = rng.randrange(1, 129)
        hashes = chain[:depth] + [10**12 + i * 128 + k for k in range(128 - depth)]
        t0 = time.perf_counter()
        r.route(SCOPE, hashes=hashes, request_tokens=128 * 16, policy=policy, track=False)
        out[i] = (time.perf_counter() - t0) * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--policies", default="quillcache,dynamo,mooncake")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    t0 = time.perf_counter()
    big, big_chains = build(args.blocks, args.workers, args.seed)
    small, small_chains = build(args.small, args.workers, args.seed)
    print(f"indexed {len(big.indexer)} and {len(small.indexer)} blocks over {args.workers} workers "
          f"({time.perf_counter() - t0:.1f} s)")
    for policy in [p.strip() for p in args.policies.split(",") if p.strip() in POLICIES]:
        measure(big, big_chains, 200, policy, args.seed)            # warm both
        measure(small, small_chains, 200, policy, args.seed)
        b = measure(big, big_chains, args.decisions, policy, args.seed + 1)
        s = measure(small, small_chains, args.decisions, policy, args.seed + 1)
        print(f"{policy:<11} p50 {np.percentile(b, 50):7.1f} us  p99 {np.percentile(b, 99):7.1f} us at "
              f"{len(big.indexer)} blocks; p50 {np.percentile(s, 50):7.1f} us  p99 {np.percentile(s, 99):7.1f} us "
              f"at {len(small.indexer)}: ratio p50 {np.percentile(b, 50) / np.percentile(s, 50):.2f}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
