"""What answering ROUTE from the requester's identity alone costs: the node's ``RouterHost.route``
(caller-scoped ids, the scoped figures) against the bare ``Router.route`` it wraps, in one
process, interleaved, for the identity-scoped ``quillcache`` module and the operator's
identity-blind ``dynamo`` one (which scores the scoped overlap again for the answer).

    .venv/bin/python bench/route_scope.py --workers 4 --blocks 64 --rounds 20000

Prints the median microseconds per decision of each and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

from quillcache.control.host import RouterHost
from quillcache.control.router import RouterConfig
from quillcache.model import IdentityScope
from quillcache.protocol.route import ROUTE_HASHES, RouteRequest

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per prompt")
    ap.add_argument("--rounds", type=int, default=20000)
    a = ap.parse_args()
    for module in ("quillcache", "dynamo"):
        host = RouterHost(module, RouterConfig(policy=module, block_size=BS, seed=1), start=False)
        router = host.router
        alice = IdentityScope("m", "t", None, "alice")
        bob = IdentityScope("m", "t", None, "bob")
        for w in range(a.workers):
            router.add_worker(f"e{w}")
        # alice's prompts are cached on every worker, bob asks for them
        prompts = [router.hashes(list(range(p * 10_000, p * 10_000 + a.blocks * BS))) for p in range(64)]
        for i, hashes in enumerate(prompts):
            router.add_blocks(f"e{i % a.workers}", alice, hashes)
        reqs = [RouteRequest(ROUTE_HASHES, None, False, "bob", "m", "t", None, None, a.blocks * BS, h)
                for h in prompts]
        host_us, bare_us = [], []
        for r in range(a.rounds):
            req = reqs[r % len(reqs)]
            t0 = time.perf_counter()
            host.route(req, caller="bob")
            t1 = time.perf_counter()
            router.route(bob, hashes=req.items, request_tokens=req.request_tokens, track=False)
            t2 = time.perf_counter()
            host_us.append((t1 - t0) * 1e6)
            bare_us.append((t2 - t1) * 1e6)
        h, b = statistics.median(host_us), statistics.median(bare_us)
        print(f"{module:<11} RouterHost.route {h:7.1f} us   Router.route {b:7.1f} us   ratio {h / b:.2f}x "
              f"({a.workers} workers, {a.blocks} blocks, {a.rounds} rounds)")


if __name__ == "__main__":
    main()
