"""Identity-safe reuse: naive content-hash reuse (guard mode off) vs the identity guard (strict).

Runs two workloads through the real LocalKvStore (DRAM only, large enough that nothing is
evicted, so every difference comes from the guard):

* adversarial: one popular 16-block system prompt shared by every identity of
  4 tenants x 2 models x 3 adapters (None and two LoRAs); each request adds 4 blocks of
  its own;
* adversarial-cold: the same shape with 8 x 4 x 4 = 128 identities and 1/8 of the
  requests, so most identities meet the prompt only a few times;
* realistic: 8 system prompts (Zipf) shared by everyone, multi-turn sessions whose history
  grows 2 blocks a turn; 90% of sessions are the main identity, 5% the same tenant with an
  adapter, 3% a second model of the same tenant, 2% other tenants.

A request looks its blocks up in order; a block that is not served is "computed" (bytes
derived from model, tokenizer and adapter: what a real engine would produce) and put
under the requester's key.  Served bytes are checked against the requester's expected
bytes, so "wrong KV" is measured, not inferred from key fields.

    .venv/bin/python bench/identity_study.py [--requests 2000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import random
import statistics
import sys
import time

BLOCK_BYTES = 1024


def kv_bytes(model: str, tokenizer: str, adapter, block_hash: str) -> bytes:
    """What an engine computes for one block: depends on the model stack, not the tenant."""
    seed = hashlib.blake2b(f"{model}|{tokenizer}|{adapter}|{block_hash}".encode(), digest_size=16).digest()
    return (seed * (BLOCK_BYTES // len(seed) + 1))[:BLOCK_BYTES]


def chain(ident, hashes):
    from quillcache.model import KvBlockKey
    model, tokenizer, adapter, tenant = ident
    keys, parent = [], "root"
    for i, h in enumerate(hashes):
        keys.append(KvBlockKey(model, tokenizer, adapter, tenant, parent, h, i))
        parent = h
    return keys


def adversarial(n_requests: int, rng: random.Random, tenants=4, models=2, adapters=3):
    identities = [(f"model{m}", "tok", None if a == 0 else f"lora-{a}", f"t{t}") for t in range(tenants)
                  for m in range(models) for a in range(adapters)]
    system = [f"sys{i}" for i in range(16)]
    out = []
    for r in range(n_requests):
        ident = rng.choice(identities)
        out.append(chain(ident, system + [f"r{r}u{j}" for j in range(4)]))
    return out


def realistic(n_requests: int, rng: random.Random):
    main = ("llama-8b", "tok", None, "acme")
    kinds = [(0.90, main), (0.05, ("llama-8b", "tok", "lora-support", "acme")),
             (0.03, ("qwen-7b", "tok-q", None, "acme")), (0.01, ("llama-8b", "tok", None, "globex")),
             (0.01, ("llama-8b", "tok", None, "initech"))]
    prompts = [[f"sp{p}b{j}" for j in range(4)] for p in range(8)]
    zipf = [1 / (i + 1) for i in range(8)]
    sessions = []
    for _s in range(max(8, n_requests // 10)):
        x, acc = rng.random(), 0.0
        for w, ident in kinds:  # noqa: B007 (ident is the pick, used after the break)
            acc += w
            if x <= acc:
                break
        sessions.append([ident, rng.choices(range(8), zipf)[0], []])
    out = []
    for _r in range(n_requests):
        sess = rng.choice(sessions)
        ident, p, history = sess
        history += [f"s{id(sess)}t{len(history)}", f"s{id(sess)}t{len(history) + 1}"]
        out.append(chain(ident, prompts[p] + history))
    return out


async def run_workload(requests, mode: str) -> dict:
    from quillcache.errors import NotFound, UnsafeReuse
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    total_blocks = sum(len(r) for r in requests)
    store = LocalKvStore(StoreOptions((total_blocks + 64) * BLOCK_BYTES, max_block_bytes=BLOCK_BYTES, guard_mode=mode))
    perf = time.perf_counter_ns
    get_ns = 0
    res = {"lookups": 0, "hits": 0, "safe": 0, "unsafe": 0, "unsafe_wrong_kv": 0, "unsafe_tenant_leak": 0,
           "misses": 0, "refused_same_tenant": 0, "computed": 0}
    for keys in requests:
        for key in keys:
            res["lookups"] += 1
            expected = kv_bytes(key.model_id, key.tokenizer_id, key.adapter_id, key.block_hash)
            t0 = perf()
            try:
                lease = store.get(key)
                get_ns += perf() - t0
            except UnsafeReuse:
                get_ns += perf() - t0
                res["refused_same_tenant"] += 1
            except NotFound:
                get_ns += perf() - t0
                res["misses"] += 1
            else:
                with lease:
                    res["hits"] += 1
                    if key.scope.matches(lease.key):
                        res["safe"] += 1
                    else:
                        res["unsafe"] += 1
                        res["unsafe_wrong_kv"] += bytes(lease.view) != expected
                        res["unsafe_tenant_leak"] += lease.key.tenant_id != key.tenant_id
                continue
            res["computed"] += 1
            await store.put(key, expected)
    res["refused_cross_tenant"] = store.stats()["guard"]["reuse_refused_tenant"]
    res["refused"] = res["refused_same_tenant"] + res["refused_cross_tenant"]
    res["get_us"] = get_ns / 1e3 / res["lookups"]
    await store.close()
    return res


async def build_store(requests, mode: str):
    """A store holding every identity's blocks (the state a strict run ends in)."""
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    total_blocks = sum(len(r) for r in requests)
    store = LocalKvStore(StoreOptions((total_blocks + 64) * BLOCK_BYTES, max_block_bytes=BLOCK_BYTES, guard_mode=mode))
    for keys in requests:
        for key in keys:
            if not store.exists(key) or not key.scope.matches(store.get(key).key):
                await store.put(key, kv_bytes(key.model_id, key.tokenizer_id, key.adapter_id, key.block_hash))
    for lease in list(store._leases.values()):
        lease.release()
    return store


def replay_gets(store, requests) -> float:
    """Seconds to look up every block once (get + release; errors caught), in one pass."""
    from quillcache.errors import QuillCacheError
    keys = [k for r in requests for k in r]
    get = store.get
    t0 = time.perf_counter()
    for key in keys:
        try:
            get(key).release()
        except QuillCacheError:
            pass
    return time.perf_counter() - t0


def latency_ratio(requests, repeats: int) -> dict:
    """get latency of strict over off on identical store contents, interleaved runs."""
    strict = asyncio.run(build_store(requests, "strict"))
    off = asyncio.run(build_store(requests, "off"))
    n = sum(len(r) for r in requests)
    ratios, ts, to = [], [], []
    replay_gets(strict, requests), replay_gets(off, requests)         # warm up
    for i in range(repeats):              # alternate which side runs first
        timed = _no_gc(replay_gets)
        if i & 1:
            a = timed(strict, requests)
            b = timed(off, requests)
        else:
            b = timed(off, requests)
            a = timed(strict, requests)
        ts.append(a), to.append(b), ratios.append(a / b)
    return {"strict_us_per_get": statistics.median(ts) / n * 1e6,
            "off_us_per_get": statistics.median(to) / n * 1e6,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def oracle_timing(repeats: int) -> dict:
    """A cross-tenant probe vs a true miss: median time of a refused get over a missed get."""
    from quillcache.errors import NotFound
    from quillcache.model import KvBlockKey
    from quillcache.store.tiers import LocalKvStore, StoreOptions

    async def build(block_hash):
        # Both stores hold 20 other tenants' blocks; only the block hash differs, so the one
        # thing that differs between the two probes is whether the content is resident.
        s = LocalKvStore(StoreOptions(1 << 20, max_block_bytes=BLOCK_BYTES))
        for i in range(20):
            await s.put(KvBlockKey("m", "tok", None, f"victim{i}", "root", block_hash), b"x" * 256)
        return s
    refusing = asyncio.run(build("secret"))
    empty = asyncio.run(build("unrelated"))
    control = asyncio.run(build("unrelated"))      # A/A: two stores that differ in nothing
    probe = KvBlockKey("m", "tok", None, "attacker", "root", "secret")

    perf = time.perf_counter_ns

    def one(store):
        t0 = perf()
        try:
            store.get(probe)
        except NotFound:
            pass
        return perf() - t0
    def compare(x, y):
        ratios = []
        for _ in range(repeats):
            a, b = [], []
            for i in range(20000):       # interleaved call by call, alternating which goes first
                if i & 1:
                    a.append(one(x))
                    b.append(one(y))
                else:
                    b.append(one(y))
                    a.append(one(x))
            ratios.append(statistics.median(a) / statistics.median(b))
            x.stats(), y.stats()         # drain the classification queues alike
        return ratios
    ratios = _no_gc(compare)(refusing, empty)
    control_ratios = _no_gc(compare)(control, empty)
    return {"refusal_over_miss_median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "control_median": statistics.median(control_ratios), "control_min": min(control_ratios),
            "control_max": max(control_ratios)}


def summarize(name, off, strict, lat) -> dict:
    return {
        "workload": name, "lookups": off["lookups"],
        "naive_hits": off["hits"], "naive_unsafe": off["unsafe"],
        "naive_unsafe_pct": 100.0 * off["unsafe"] / max(1, off["hits"]),
        "naive_unsafe_wrong_kv": off["unsafe_wrong_kv"], "naive_unsafe_tenant_leak": off["unsafe_tenant_leak"],
        "guard_hits": strict["hits"], "guard_unsafe": strict["unsafe"], "guard_safe_kept": strict["safe"],
        "naive_safe": off["safe"],
        "guard_refused": strict["refused"], "guard_refused_cross_tenant": strict["refused_cross_tenant"],
        "forced_recomputes": strict["computed"] - off["computed"],
        "recompute_overhead_pct": 100.0 * (strict["computed"] - off["computed"]) / off["lookups"],
        "get_latency": lat,
        "replay_get_us": {"strict": strict["get_us"], "off": off["get_us"],
                          "ratio": strict["replay_ratio"]},
    }


def _no_gc(fn):
    """Run fn with the cyclic GC off (collected before): a collection landing in one side's
    timed section is the largest noise source here."""
    def wrapper(*args, **kw):
        gc.collect()
        gc.disable()
        try:
            return fn(*args, **kw)
        finally:
            gc.enable()
    return wrapper


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="identity guard study")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--replays", type=int, default=9, help="whole-workload replays per mode")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import logging
    logging.getLogger("quillcache.store").setLevel(logging.ERROR)   # mode off warns at each build
    logging.getLogger("quillcache.audit").setLevel(logging.ERROR)   # one line per refusal
    rows = []
    workloads = (
        ("adversarial", lambda n, rng: adversarial(n, rng)),
        ("adversarial-cold", lambda n, rng: adversarial(n // 8, rng, tenants=8, models=4, adapters=4)),
        ("realistic", realistic),
    )
    for name, gen in workloads:
        requests = gen(args.requests, random.Random(args.seed))
        ratios = []
        for i in range(args.replays):          # interleaved whole replays; outcomes are deterministic
            replay = _no_gc(lambda mode: asyncio.run(run_workload(requests, mode)))  # called here, in this iteration
            if i & 1:
                off = replay("off")
                strict = replay("strict")
            else:
                strict = replay("strict")
                off = replay("off")
            ratios.append(strict["get_us"] / off["get_us"])
        strict["replay_ratio"] = statistics.median(ratios)
        rows.append(summarize(name, off, strict, latency_ratio(requests, args.repeats)))
    oracle = oracle_timing(args.repeats)
    if args.json:
        print(json.dumps({"rows": rows, "oracle": oracle}, indent=1))
        return 0
    print("| workload | lookups | naive hits | unsafe served (naive) | of which wrong KV / tenant leak | "
          "unsafe served (guard) | safe reuse kept (guard) | forced recomputes | recompute overhead | "
          "get latency strict/off, same contents | get time strict/off, replay (median of replays) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lat = r["get_latency"]
        print(f"| {r['workload']} | {r['lookups']} | {r['naive_hits']} | {r['naive_unsafe']} "
              f"({r['naive_unsafe_pct']:.1f}%) | {r['naive_unsafe_wrong_kv']} / {r['naive_unsafe_tenant_leak']} | "
              f"{r['guard_unsafe']} | {r['guard_safe_kept']} | {r['forced_recomputes']} | "
              f"{r['recompute_overhead_pct']:.1f}% | {lat['ratio_median']:.3f} "
              f"({lat['strict_us_per_get']:.2f} vs {lat['off_us_per_get']:.2f} us) | "
              f"{r['replay_get_us']['ratio']:.3f} |")
    print(f"\ncross-tenant probe vs true miss, time ratio (median of {args.repeats}): "
          f"{oracle['refusal_over_miss_median']:.3f} (min {oracle['min']:.3f}, max {oracle['max']:.3f}); "
          f"A/A control, two miss-only stores: {oracle['control_median']:.3f} "
          f"(min {oracle['control_min']:.3f}, max {oracle['control_max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
