"""The key caches of the request path: the node's decoded keys (``node.keys.KeyCache``), and
the client's encoded keys (``Client.encoded_key``: no cache since a ``KvBlockKey`` carries its
encoding), per key, with a working set smaller and larger than the cache.

    .venv/bin/python bench/key_cache.py [--capacity 16384] [--rounds 5]

Each against two baselines measured in the same run: the bare work the cache saves
(``decode_key_fast`` / ``encode_key``, no cache), and the form these caches had before
(2026-11-27): one dict kept in recency order, evicting its oldest with ``del
d[next(iter(d))]``.  CPython's ``iter`` over a dict walks every hole that deletions at its
front left until the dict is rebuilt, so that eviction cost grows with the capacity (~10 us a
key at 16,384 on a 2-vCPU VM), and every request of a node with more keys in use than its
cache paid it.  Target: a node miss costs at most 5x the bare work (it decodes, and it inserts), a node hit
less than the bare work, and the client at most 3x its bare work (an attribute read behind a
type check).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from quillcache._native.keys import decode_key_fast
from quillcache.model import KvBlockKey, encode_key
from quillcache.node.keys import KeyCache


class DictLRU:
    """The node's key cache before: one dict in recency order (the baseline)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.map: dict = {}

    def decode(self, raw: bytes):
        m = self.map
        key = m.get(raw)
        if key is not None:
            del m[raw]
            m[raw] = key
            return key
        key = decode_key_fast(raw, KvBlockKey)
        m[raw] = key
        if len(m) > self.capacity:
            del m[next(iter(m))]
        return key


class DictFIFO:
    """The client's encoded-key cache before: one dict in insertion order (the baseline)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.map: dict = {}

    def encode(self, key) -> bytes:
        cache = self.map
        raw = cache.get(key)
        if raw is None:
            raw = encode_key(key)
            if len(cache) >= self.capacity:
                del cache[next(iter(cache))]
            cache[key] = raw
        return raw


def per_key_us(fn, items: list, rounds: int) -> float:
    """Median over ``rounds`` passes (after one warm-up pass) of µs per call."""
    for x in items:
        fn(x)
    got = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        got.append((time.perf_counter() - t0) / len(items) * 1e6)
    return statistics.median(got)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=16384, help="entries of each cache (the node's default)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    cap = args.capacity
    from quillcache.client.ops import Ops
    encoded_key = Ops.encoded_key.__get__(object())     # it reads nothing of the client
    print(f"key caches of {cap} entries, us per key (median of {args.rounds} passes)")
    print("| cache | working set | this tree | bare work | ratio | dict form (before) | ratio |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for label, n in (("hits (cap / 4)", cap // 4), ("misses (2 x cap)", 2 * cap)):
        keys = [KvBlockKey("bench-model", "bench-tok", None, "default", "root", f"k{i}", 0, 64) for i in range(n)]
        raws = [encode_key(k) for k in keys]
        node = per_key_us(KeyCache(cap).decode, raws, args.rounds)
        bare = per_key_us(lambda r: decode_key_fast(r, KvBlockKey), raws, args.rounds)
        before = per_key_us(DictLRU(cap).decode, raws, args.rounds)
        print(f"| node KeyCache.decode | {label} | {node:.3f} | {bare:.3f} | {node / bare:.2f}x "
              f"| {before:.3f} | {node / before:.2f}x |")
        client = per_key_us(encoded_key, keys, args.rounds)
        cbare = per_key_us(encode_key, keys, args.rounds)
        cbefore = per_key_us(DictFIFO(cap).encode, keys, args.rounds)
        print(f"| client encoded_key | {label} | {client:.3f} | {cbare:.3f} | {client / cbare:.2f}x "
              f"| {cbefore:.3f} | {client / cbefore:.2f}x |")
        ok &= node / bare <= (1.0 if n < cap else 5.0) and client / cbare <= 3.0
    print("target (node: a hit < the bare work, a miss <= 5x it; client <= 3x):", "met" if ok else "MISSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
