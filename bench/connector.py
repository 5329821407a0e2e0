"""Save and load of N blocks (default 1,000 blocks of 16 tokens, vLLM layout, Llama-3-8B-shaped:
32 layers x K,V x 16 tokens x 8 KV heads x 128 x bf16 = 2 MiB per block) through the connector
core (quillcache.connectors.core), over the Unix socket with the mapped arena and over TCP, against
the raw client calls on the same bytes in the same run:

  overhead = core.load (TCP) / Client.get_many_into (TCP)      target <= 1.10
  shm gain = core.load (TCP) / core.load (unix, mapped arena)

    python bench/connector.py [--blocks 1000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._local_node import LocalNode
from quillcache import Client
from quillcache.connectors.core import (
    ConnectorCore, batch_len, chain_keys, model_scope,
)
from quillcache.model import IdentityScope

BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2          # bytes: one 16-token block of an 8B model, bf16


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    n = a.blocks
    gib = n * BLOCK_BYTES / 2**30
    scope = model_scope("llama-3-8b", dtype="bfloat16", block_size=16, num_layers=32, layout="vllm-2nbhd")
    keys = chain_keys(IdentityScope(scope, "llama-3-tok", None, ""), [i.to_bytes(32, "big") for i in range(n)],
                      block_size=16)
    src = [np.full(BLOCK_BYTES, i % 251, np.uint8) for i in range(n)]
    dst = [np.empty(BLOCK_BYTES, np.uint8) for _ in range(n)]
    dram = f"{int(gib * 1.25) + 1}GiB"
    with LocalNode(dram=dram, max_block="4MiB") as node:
        raw = Client(node.tcp, timeout=120)
        ctcp = ConnectorCore(node.tcp, timeout=120)
        cuni = ConnectorCore(node.unix, timeout=120)
        assert cuni.shm, "the Unix-socket core did not map the arena"
        res = {}
        B = batch_len(src)                     # the same batches as the core's (one request each)
        res["raw_put"] = best(lambda: [raw.put_many(list(zip(keys[i:i + B], src[i:i + B])))
                                       for i in range(0, n, B)], a.rounds)
        res["raw_get"] = best(lambda: [raw.get_many_into(keys[i:i + B], dst[i:i + B]) for i in range(0, n, B)],
                              a.rounds)
        res["tcp_save"] = best(lambda: ctcp.save(keys, src), a.rounds)
        res["tcp_load"] = best(lambda: ctcp.load(keys, dst), a.rounds)
        res["shm_save"] = best(lambda: cuni.save(keys, src), a.rounds)
        res["shm_load"] = best(lambda: cuni.load(keys, dst), a.rounds)
        assert all(int(d[0]) == i % 251 and int(d[-1]) == i % 251 for i, d in enumerate(dst)), "wrong bytes"
        s = ctcp.stats()
        assert s["load_errors"] == 0 and s["save_errors"] == 0, s
        raw.close()
        ctcp.close()
        cuni.close()
    print(f"# connector core: {n} blocks x {BLOCK_BYTES >> 20} MiB = {gib:.2f} GiB, best of {a.rounds}")
    for k, t in res.items():
        print(f"{k:9s} {t * 1e3:9.1f} ms  {gib / t:6.2f} GiB/s")
    print(f"overhead load  core/raw (TCP): {res['tcp_load'] / res['raw_get']:.3f}  (target <= 1.10)")
    print(f"overhead save  core/raw (TCP): {res['tcp_save'] / res['raw_put']:.3f}")
    print(f"shm vs TCP load: {res['tcp_load'] / res['shm_load']:.2f}x   save: {res['tcp_save'] / res['shm_save']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
