"""Put and get of N LMCache chunks (default 200 chunks of 16 tokens, Llama-3-8B-shaped, bf16:
2 x 32 layers x 16 tokens x 1024 = 2 MiB each) through the LMCache plugin
(quillcache.connectors.lmcache, built by LMCache's CreateConnector with a real LocalCPUBackend),
against the connector core's save/load of the same bytes, in the same run, both over the Unix
socket with the mapped arena:

  overhead put = plugin batched_put / core.save        (the header, the key mapping, the loop)
  overhead get = plugin batched_get / core.load        (+ decoding and allocating each chunk)

Needs the engines' venv:  .venv-engines/bin/python bench/lmcache_plugin.py [--chunks 200] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from bench._local_node import LocalNode
from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope
from quillcache.model import IdentityScope

LAYERS, TOKENS, HIDDEN = 32, 16, 8 * 128          # 8 KV heads x 128
SHAPE = torch.Size([2, LAYERS, TOKENS, HIDDEN])
CHUNK_BYTES = SHAPE.numel() * 2                    # bytes (bf16)


def best_interleaved(fns: dict, rounds: int) -> dict:
    """Best time of each, the sides alternating round by round (a shared machine's noise then
    hits both sides alike)."""
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    n = a.chunks
    gib = n * CHUNK_BYTES / 2**30
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    with LocalNode(dram=f"{int(gib * 2.5) + 1}GiB", max_block="4MiB") as node:
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=TOKENS, local_cpu=True, max_local_cpu_size=gib * 2.2 + 0.1, remote_serde="naive",
            remote_url="plugin://quillcache", remote_storage_plugins=["quillcache"],
            extra_config={"remote_storage_plugin.quillcache.module_path": "quillcache.connectors.lmcache",
                          "remote_storage_plugin.quillcache.class_name": "QuillCacheRemoteConnector",
                          "remote_storage_plugin.quillcache.address": node.unix,
                          "remote_storage_plugin.quillcache.timeout_s": 120})
        md = LMCacheMetadata("llama-3-8b", 1, 1, 0, 0, torch.bfloat16, (LAYERS, 2, TOKENS, 8, 128), chunk_size=TOKENS)
        cpu = LocalCPUBackend(cfg, md)
        plugin = CreateConnector("plugin://quillcache", loop, cpu, cfg, None, plugin_name="quillcache")
        keys = [CacheEngineKey("llama-3-8b", 1, 0, i + 1, torch.bfloat16) for i in range(n)]
        objs = [cpu.allocate([SHAPE], [torch.bfloat16]) for _ in range(n)]
        for i, o in enumerate(objs):
            o.tensor.fill_(float(i % 97))

        core = ConnectorCore(node.unix, timeout=120)
        assert core.shm, "the Unix-socket core did not map the arena"
        scope = model_scope("llama-3-8b", dtype="bfloat16", block_size=TOKENS, num_layers=LAYERS, layout="raw")
        ckeys = chain_keys(IdentityScope(scope, "tok", None, ""), [i.to_bytes(32, "big") for i in range(n)],
                           block_size=TOKENS)
        src = [np.asarray(memoryview(o.byte_array).cast("B")) for o in objs]
        dst = [np.empty(CHUNK_BYTES, np.uint8) for _ in range(n)]

        def plugin_put():
            for o in objs:
                o.ref_count_up()          # as RemoteBackend's serializer does; LMCache's wrapper drops it
            run(plugin.batched_put(keys, objs))

        def plugin_get():
            got = run(plugin.batched_get(keys))
            assert all(g is not None for g in got), "plugin get missed"
            assert float(got[-1].tensor.flatten()[0]) == float((n - 1) % 97), "wrong bytes"
            for g in got:
                g.ref_count_down()

        res = best_interleaved({"core_save": lambda: core.save(ckeys, src), "plugin_put": plugin_put,
                                "core_load": lambda: core.load(ckeys, dst), "plugin_get": plugin_get}, a.rounds)
        st = plugin._connector.stats()
        assert st["load_errors"] == st["save_errors"] == st["bad_values"] == 0, st
        core.close()
        run(plugin.close())
        for o in objs:
            o.ref_count_down()
    loop.call_soon_threadsafe(loop.stop)
    print(f"# LMCache plugin vs connector core (unix, mapped arena): {n} chunks x {CHUNK_BYTES >> 20} MiB "
          f"= {gib:.2f} GiB, best of {a.rounds}")
    for k, t in res.items():
        print(f"{k:10s} {t * 1e3:9.1f} ms  {gib / t:6.2f} GiB/s")
    print(f"overhead put  plugin/core: {res['plugin_put'] / res['core_save']:.3f}")
    print(f"overhead get  plugin/core: {res['plugin_get'] / res['core_load']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
