"""Adaptive radix tree benchmark: point lookups vs dict, prefix scans vs a sorted list
with bisect, memory per key, and ArtIndex vs MemoryIndex prefix_scan.

    .venv/bin/python bench/native_art.py              # 1M keys (about a minute)
    .venv/bin/python bench/native_art.py --keys 100000

Keys are 40 bytes shaped like ``model.encode_key`` output: one shared scope prefix,
then a prefix hash shared by a group of 16 blocks, then block index, block hash and
token count.  Both sides of every comparison run in the same process; the ratios are
what to compare (absolute times on a shared machine are noise).
"""
from __future__ import annotations

import argparse
import bisect
import gc
import random
import struct
import time

GROUP = 16                      # blocks per prefix hash
KEY_BYTES = 40
TARGETS = {                     # from the issue: libart C figure x1.5, Python call, scan, memory
    "batch_hit_ns": 1.5 * 354,
    "single_hit_ns": 600,
    "scan_p50_ns": 2000,
    "bytes_per_key": 100,
}


def scope_prefix() -> bytes:
    from quillcache.model import IdentityScope, encode_scope
    return encode_scope(IdentityScope("llama", "tok", None, "acme"))     # 17 bytes


def make_keys(n: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """n keys (groups of GROUP under one prefix hash) and one prefix per group."""
    rnd = random.Random(seed)
    scope = scope_prefix()
    pack_tail = struct.Struct(">I").pack
    tokens = pack_tail(64)
    keys, prefixes = [], []
    seen = set()
    while len(keys) < n:
        h = "%08x" % rnd.getrandbits(32)
        if h in seen:
            continue
        seen.add(h)
        prefix = scope + b"\x08" + h.encode()
        prefixes.append(prefix)
        for i in range(min(GROUP, n - len(keys))):
            keys.append(prefix + pack_tail(i) + b"\x05" + ("%05x" % rnd.getrandbits(20)).encode() + tokens)
    assert all(len(k) == KEY_BYTES for k in keys[:100])
    return keys, prefixes


def miss_keys(keys: list[bytes], count: int, seed: int = 2) -> list[bytes]:
    """Keys with the same shape that are absent: one byte of the block hash changed."""
    rnd = random.Random(seed)
    present = set(keys)
    out = []
    while len(out) < count:
        k = bytearray(rnd.choice(keys))
        k[31] = ord("g") + rnd.randrange(20)      # not a hex digit: never generated
        if bytes(k) not in present:
            out.append(bytes(k))
    return out


def _per_op_ns(fn, items, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(items)
        best = min(best, (time.perf_counter_ns() - t0) / len(items))
    return best


def _percentiles(samples: list[int]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def bench_tree(n: int = 1_000_000, scans: int = 20_000, lookups: int = 200_000) -> dict:
    from quillcache._native.art import AdaptiveRadixTree

    keys, prefixes = make_keys(n)
    values = list(range(n))
    rnd = random.Random(3)
    order = keys[:]
    rnd.shuffle(order)
    out: dict = {"keys": n, "key_bytes": KEY_BYTES}
    gc.disable()
    try:
        tree = AdaptiveRadixTree()
        t0 = time.perf_counter_ns()
        insert = tree.insert
        for k, v in zip(order, values):
            insert(k, v)
        out["insert_ns"] = (time.perf_counter_ns() - t0) / n
        tree2 = AdaptiveRadixTree()
        t0 = time.perf_counter_ns()
        tree2.insert_many(order, values)
        out["insert_many_ns"] = (time.perf_counter_ns() - t0) / n
        del tree2
        d = {}
        t0 = time.perf_counter_ns()
        for k, v in zip(order, values):
            d[k] = v
        out["dict_insert_ns"] = (time.perf_counter_ns() - t0) / n
        out["bytes_per_key"] = tree.memory_bytes() / n
        out["node_counts"] = tree.node_counts()

        hits = order[:lookups]
        misses = miss_keys(keys, lookups)
        get, dget = tree.get, d.get

        def tree_single(ks):
            for k in ks:
                get(k)

        def dict_single(ks):
            for k in ks:
                dget(k)

        out["single_hit_ns"] = _per_op_ns(tree_single, hits)
        out["single_miss_ns"] = _per_op_ns(tree_single, misses)
        out["dict_hit_ns"] = _per_op_ns(dict_single, hits)
        out["dict_miss_ns"] = _per_op_ns(dict_single, misses)
        out["batch_hit_ns"] = _per_op_ns(tree.get_many, hits)           # same keys as single_hit
        out["dict_batch_hit_ns"] = _per_op_ns(lambda ks: list(map(dget, ks)), hits)
        out["batch_miss_ns"] = _per_op_ns(tree.get_many, misses)
        assert tree.get_many(hits[:1000]) == [d[k] for k in hits[:1000]]

        # prefix scans: one call = one 16-entry group
        sample = [rnd.choice(prefixes) for _ in range(scans)]
        scan = tree.scan_prefix
        art_ns = []
        for p in sample:
            t0 = time.perf_counter_ns()
            r = scan(p)
            art_ns.append(time.perf_counter_ns() - t0)
        assert len(r) == GROUP
        sorted_keys = sorted(keys)
        left = bisect.bisect_left

        def list_scan(p):
            i = left(sorted_keys, p)
            res = []
            while i < len(sorted_keys) and sorted_keys[i].startswith(p):
                res.append((sorted_keys[i], d[sorted_keys[i]]))
                i += 1
            return res

        list_ns = []
        for p in sample:
            t0 = time.perf_counter_ns()
            r2 = list_scan(p)
            list_ns.append(time.perf_counter_ns() - t0)
        assert r2 == scan(p)
        out["scan_p50_ns"], out["scan_p99_ns"] = _percentiles(art_ns)
        out["bisect_scan_p50_ns"], out["bisect_scan_p99_ns"] = _percentiles(list_ns)
    finally:
        gc.enable()
    out["ratio_single_hit_vs_dict"] = out["single_hit_ns"] / out["dict_hit_ns"]
    out["ratio_batch_hit_vs_dict"] = out["batch_hit_ns"] / out["dict_batch_hit_ns"]
    out["ratio_scan_p50_vs_bisect"] = out["scan_p50_ns"] / out["bisect_scan_p50_ns"]
    return out


def bench_index(records: int = 100_000, scans: int = 2_000, memory_scans: int = 20) -> dict:
    """ArtIndex.prefix_scan vs MemoryIndex.prefix_scan (a filter over every key)."""
    from quillcache.index.art import ArtIndex
    from quillcache.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey, MemoryIndex

    rnd = random.Random(4)
    scope = IdentityScope("llama", "tok", None, "acme")
    groups = ["%08x" % rnd.getrandbits(32) for _ in range(records // GROUP)]
    art, mem = ArtIndex(), MemoryIndex()
    for g in groups:
        for i in range(GROUP):
            k = KvBlockKey(scope.model_id, scope.tokenizer_id, None, scope.tenant_id, g, "%05x" % i, i)
            r = CacheResidency(k, "w%d" % (i % 4), CacheTier.HBM, 1 << 20)
            art.put(r)
            mem.put(r)
    sample = [rnd.choice(groups) for _ in range(scans)]
    art_ns = []
    for g in sample:
        t0 = time.perf_counter_ns()
        a = art.prefix_scan(scope, g)
        art_ns.append(time.perf_counter_ns() - t0)
    mem_ns = []
    for g in sample[:memory_scans]:
        t0 = time.perf_counter_ns()
        m = mem.prefix_scan(scope, g)
        mem_ns.append(time.perf_counter_ns() - t0)
    assert m == art.prefix_scan(scope, sample[memory_scans - 1]) and len(m) == len(a) == GROUP
    out = {"records": records}
    out["art_index_scan_p50_ns"], out["art_index_scan_p99_ns"] = _percentiles(art_ns)
    out["memory_index_scan_p50_ns"], out["memory_index_scan_p99_ns"] = _percentiles(mem_ns)
    out["speedup_art_vs_memory_index"] = out["memory_index_scan_p50_ns"] / out["art_index_scan_p50_ns"]
    out["art_index_memory_bytes"] = art.metrics().memory_bytes
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys in the tree (default 1M)")
    ap.add_argument("--scans", type=int, default=20_000, help="prefix scans timed one by one")
    ap.add_argument("--records", type=int, default=100_000, help="records for the index comparison")
    args = ap.parse_args(argv)
    tree = bench_tree(args.keys, args.scans, min(200_000, args.keys))
    index = bench_index(args.records)
    print("# ART (%d keys of %d bytes)" % (tree["keys"], tree["key_bytes"]))
    for name, value in tree.items():
        if name in ("keys", "key_bytes"):
            continue
        note = ""
        if name in TARGETS:
            note = "   target <= %g: %s" % (TARGETS[name], "ok" if value <= TARGETS[name] else "MISSED")
        print("%s:%s%s" % (name, "%.1f" % value if isinstance(value, float) else value, note))
    print("# Index prefix_scan (%d records)" % index["records"])
    for name, value in index.items():
        if name != "records":
            print("%s:%s" % (name, "%.1f" % value if isinstance(value, float) else value))


if __name__ == "__main__":
    main()
