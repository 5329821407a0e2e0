"""Decision latency of the router: 64 workers, a 128-block request, an index of 1M blocks,
against the same decision over a small index in the same run (the ratio says whether the
per-decision work grows with the blocks indexed; the absolute time is the machine's).

    python bench/router_decision.py --blocks 1000000 --small 10000 --decisions 2000

``--in-flight N --kv-blocks K``: first N requests in flight on every worker (tracked, half of
them past their first token) and engines of K KV pages, so the decisions also read the blocks
and pages of the requests in flight (``control/inflight.py``) and play the page waits forward.

``--branch-points``: before each decision (untimed) an arrival is recorded that reused the prefix
the request finds deepest on a device and went on otherwise, so every decision meets a branch
point (``policies.BranchPoints``) and, where the pool holds its chain too, predicts twice: the
worst case of ``predict_placement``.
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


def build(total: int, workers: int, seed: int, kv_blocks: "int | None" = None) -> tuple[Router, list[list[int]]]:
    """``total`` blocks spread over the workers as chains of 128 (device, some on host, and a
    pool node holding every fourth chain); returns the router and the chains."""
    idx = ArtIndexer()
    names = [f"w{i}" for i in range(workers)]
    r = Router(RouterConfig(policy="quillcache", block_size=16, seed=seed, kv_blocks=kv_blocks), idx, names)
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


def fill(r: Router, chains: list[list[int]], per_worker: int, seed: int) -> None:
    """``per_worker`` requests in flight on every worker: a chain's prefix each, half of them
    past their first token, each to decode 16-512 tokens."""
    rng = random.Random(seed)
    for w in r.workers:
        for j in range(per_worker):
            chain = chains[rng.randrange(len(chains))]
            d = r.route(SCOPE, hashes=chain[:rng.randrange(1, 129)], request_tokens=rng.randrange(16, 129) * 16,
                        candidates=[w], decode_tokens=rng.randrange(16, 513))
            if j % 2:
                r.first_token(d.request_id)


def measure(r: Router, chains: list[list[int]], decisions: int, policy: str, seed: int,
            branch_points: bool = False) -> np.ndarray:
    rng = random.Random(seed)
    out = np.empty(decisions)
    for i in range(decisions):
        chain = chains[rng.randrange(len(chains))]
        depth = rng.randrange(1, 129)
        hashes = chain[:depth] + [10**12 + i * 128 + k for k in range(128 - depth)]
        if branch_points:
            top = int(r.find_matches(SCOPE, hashes).device.max())
            if top:
                r.branches.add((SCOPE, hashes[top - 1]), -1 - i)      # a continuation no request has
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
    ap.add_argument("--in-flight", type=int, default=0, help="requests in flight per worker")
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV pages per engine (router blocks)")
    ap.add_argument("--branch-points", action="store_true",
                    help="every decision meets a prefix an earlier arrival branched from")
    args = ap.parse_args(argv)
    if args.in_flight < 0 or (args.kv_blocks is not None and args.kv_blocks <= 0):
        ap.error("--in-flight must be >= 0 and --kv-blocks > 0")
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    t0 = time.perf_counter()
    big, big_chains = build(args.blocks, args.workers, args.seed, args.kv_blocks)
    small, small_chains = build(args.small, args.workers, args.seed, args.kv_blocks)
    if args.in_flight:
        fill(big, big_chains, args.in_flight, args.seed)
        fill(small, small_chains, args.in_flight, args.seed)
    print(f"indexed {len(big.indexer)} and {len(small.indexer)} blocks over {args.workers} workers "
          f"({time.perf_counter() - t0:.1f} s)")
    for policy in [p.strip() for p in args.policies.split(",") if p.strip() in POLICIES]:
        bp = args.branch_points
        measure(big, big_chains, 200, policy, args.seed, bp)            # warm both
        measure(small, small_chains, 200, policy, args.seed, bp)
        b = measure(big, big_chains, args.decisions, policy, args.seed + 1, bp)
        s = measure(small, small_chains, args.decisions, policy, args.seed + 1, bp)
        print(f"{policy:<11} p50 {np.percentile(b, 50):7.1f} us  p99 {np.percentile(b, 99):7.1f} us at "
              f"{len(big.indexer)} blocks; p50 {np.percentile(s, 50):7.1f} us  p99 {np.percentile(s, 99):7.1f} us "
              f"at {len(small.indexer)}: ratio p50 {np.percentile(b, 50) / np.percentile(s, 50):.2f}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
