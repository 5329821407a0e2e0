"""The residency index inside the store: LIST, store GET/PUT throughput, restart.

    .venv/bin/python bench/index_residency.py                    # 1 M blocks (a few minutes)
    .venv/bin/python bench/index_residency.py --blocks 100000 --only list,recovery

Three comparisons, each against a baseline measured in the same run:

* list: a store holding N small blocks (one scope, prefixes of 100 blocks).  LIST of one
  100-key prefix and one page of 100 keys of the whole scope, as the server now serves it
  (``LocalKvStore.list_page``: a walk of the ART from the cursor), against the approach it
  replaced (a dict of (scope, prefix) -> keys; a page sorted the encoded keys of the prefix,
  or of the whole scope for a scope LIST).  Target: prefix LIST p50 <= 1 ms at 1 M blocks.
* throughput: store-level put (new keys), put (overwrite) and get (lease + release) of
  256-byte blocks, this tree against the tree before the residency index moved into the
  store (``--baseline``, default e565a04: main just before it moved in), each in a
  subprocess, alternating, best of ``--rounds``.  The baseline is a ``git archive`` of that
  commit with its native extensions (this build's when the sources agree, else built).
* recovery: a real restart of a store whose SSD tier holds N blocks, with a persistent
  index of their N records (checkpoint + a WAL tail of 1 %): the SSD tier opens, the index
  opens, ``LocalKvStore`` checks one against the other; CPU seconds to ready (and it serves
  a GET), against the persistent index's open alone on the same files (the baseline), and
  the same open decoding every record.  The SSD tier is made by writing its checkpoint with
  its own writer (N puts would take minutes of fsyncs).  Target: ready in <= 1 s of CPU.
  Also: attaching a residency listener (what a clustered node does at start) against
  decoding and re-encoding every key (what that attach did before, 2026-11-23).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PER_PREFIX = 100                # blocks per prefix hash
BLOCK = 256                     # bytes per block (small blocks: the arena's unit)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_REV = "e565a04"        # main with pressure and oneplace merged, before the residency index moved into the store


def keys_for(n: int):
    from quillcache.model import KvBlockKey
    return [KvBlockKey("llama-3-8b", "tok-a", None, "acme", "p%07d" % (i // PER_PREFIX),
                       "b%09d" % i, i % PER_PREFIX) for i in range(n)]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# --------------------------------------------------------------------------- list

def bench_list(n: int, queries: int) -> dict:
    from quillcache.model import IdentityScope, encode_key, encode_scope, encode_scope_prefix
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    keys = keys_for(n)
    store = LocalKvStore(StoreOptions(n * BLOCK + (64 << 20), max_block_bytes=BLOCK))
    payload = bytes(BLOCK)
    t0 = time.perf_counter()

    async def fill():
        for k in keys:
            h = store.put_start(k, BLOCK)
            h.view[:] = payload
            await store.put_end(h)
    asyncio.run(fill())
    fill_s = time.perf_counter() - t0
    scope = IdentityScope("llama-3-8b", "tok-a", None, "acme")
    # the replaced approach: (scope, prefix) -> set of keys; a page sorts the encoded keys
    by_prefix: dict = {}
    for k in keys:
        by_prefix.setdefault((k.scope, k.prefix_hash), set()).add(k)

    def old_prefix_page(prefix_hash, start_after, limit):
        ks = by_prefix.get((scope, prefix_hash), ())
        ks = sorted(ks, key=lambda k: (k.block_index, k.block_hash, k.token_count))
        encoded = sorted(encode_key(k) for k in ks)
        if start_after:
            encoded = [e for e in encoded if e > start_after]
        return encoded[:limit], len(encoded) > limit

    def old_scope_page(start_after, limit):
        ks = [k for (sc, _p), s in by_prefix.items() if sc == scope for k in s]
        ks = sorted(ks, key=lambda k: (k.prefix_hash, k.block_index, k.block_hash, k.token_count))
        encoded = sorted(encode_key(k) for k in ks)
        if start_after:
            encoded = [e for e in encoded if e > start_after]
        return encoded[:limit], len(encoded) > limit

    rnd = random.Random(7)
    nprefix = max(1, n // PER_PREFIX)
    picks = ["p%07d" % rnd.randrange(nprefix) for _ in range(queries)]
    new_t, old_t = [], []
    gc.collect()
    for p in picks:                             # interleaved: both see the same machine
        pfx = encode_scope_prefix(scope, p)
        t = time.perf_counter()
        page, more = store.list_page(pfx, b"", PER_PREFIX)
        new_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        page_old, more_old = old_prefix_page(p, b"", PER_PREFIX)
        old_t.append(time.perf_counter() - t)
        assert page == page_old and len(page) == min(PER_PREFIX, n) and more == more_old
    # a page of the whole scope from a random cursor (quillctl ls): the old way sorts the scope
    sp = encode_scope(scope)
    cursors = [encode_key(keys[rnd.randrange(n)]) for _ in range(queries)]
    scope_new = []
    for c in cursors:
        t = time.perf_counter()
        page, more = store.list_page(sp, c, PER_PREFIX)
        scope_new.append(time.perf_counter() - t)
    scope_old = []
    for c in cursors[:max(1, min(5, queries))]:
        t = time.perf_counter()
        page_old, _ = old_scope_page(c, PER_PREFIX)
        scope_old.append(time.perf_counter() - t)
        assert store.list_page(sp, c, PER_PREFIX)[0] == page_old
    out = {
        "blocks": n, "fill_s": fill_s, "queries": queries,
        "prefix_new_p50_us": pct(new_t, 0.5) * 1e6, "prefix_new_p99_us": pct(new_t, 0.99) * 1e6,
        "prefix_old_p50_us": pct(old_t, 0.5) * 1e6, "prefix_old_p99_us": pct(old_t, 0.99) * 1e6,
        "scope_new_p50_us": pct(scope_new, 0.5) * 1e6, "scope_new_p99_us": pct(scope_new, 0.99) * 1e6,
        "scope_old_p50_us": statistics.median(scope_old) * 1e6, "scope_old_runs": len(scope_old),
        "index_records": len(store._index),
    }
    asyncio.run(store.close())
    return out


# --------------------------------------------------------------------------- throughput

THROUGHPUT_CHILD = r'''
import asyncio, json, sys, time
from quillcache.model import KvBlockKey
from quillcache.store.tiers import LocalKvStore, StoreOptions
n = int(sys.argv[1]); BLOCK = 256
keys = [KvBlockKey("llama-3-8b", "tok-a", None, "acme", "p%07d" % (i // 100), "b%09d" % i, i % 100)
        for i in range(n)]
store = LocalKvStore(StoreOptions(n * BLOCK + (64 << 20), max_block_bytes=BLOCK))
payload = bytes(BLOCK)
async def puts():
    for k in keys:
        h = store.put_start(k, BLOCK)
        h.view[:] = payload
        await store.put_end(h)
out = {}
t = time.perf_counter(); asyncio.run(puts()); out["put_new"] = n / (time.perf_counter() - t)
t = time.perf_counter(); asyncio.run(puts()); out["put_overwrite"] = n / (time.perf_counter() - t)
t = time.perf_counter()
for k in keys:
    store.get(k).release()
out["get"] = n / (time.perf_counter() - t)
print(json.dumps(out))
'''


def baseline_tree(rev: str) -> tuple[str, str]:
    """A git archive of rev's src/ with native extensions; (dir, commit).  Where rev's
    native sources are this tree's, this build's extensions are copied in; else rev's own
    are built there (a few minutes)."""
    commit = subprocess.check_output(["git", "rev-parse", rev], cwd=ROOT, text=True).strip()
    diff = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", "src/quillcache/_native/*.pyx",
                           "src/quillcache/_native/*.pxd", "src/quillcache/_native/*.pxi",
                           "src/quillcache/_native/includes"], cwd=ROOT)
    tmp = tempfile.mkdtemp(prefix="qc-baseline-")
    archive = subprocess.run(["git", "archive", commit, "src", "setup.py", "pyproject.toml"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    if diff.returncode == 0:
        native = os.path.join(ROOT, "src", "quillcache", "_native")
        for name in os.listdir(native):
            if name.endswith(".so"):
                shutil.copy(os.path.join(native, name), os.path.join(tmp, "src", "quillcache", "_native", name))
    else:
        print(f"building the native extensions of {commit[:10]} (its native sources differ from HEAD's)",
              file=sys.stderr)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp, check=True,
                       capture_output=True)
    return os.path.join(tmp, "src"), commit


def bench_throughput(n: int, rounds: int, rev: str, base_src: str = None) -> dict:
    """``base_src``: an unpacked baseline src/ with its native extensions built (a machine
    without git); else one is made from ``rev``."""
    made = base_src is None
    if made:
        base_src, commit = baseline_tree(rev)
    else:
        commit = open(os.path.join(base_src, "COMMIT")).read().strip() if os.path.exists(
            os.path.join(base_src, "COMMIT")) else rev
    sides = {"baseline": base_src, "index": os.path.join(ROOT, "src")}
    best: dict = {s: {} for s in sides}
    try:
        for _ in range(rounds):
            for side, src in sides.items():
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    p for p in (src, os.environ.get("PYTHONPATH", "")) if p))
                r = subprocess.run([sys.executable, "-c", THROUGHPUT_CHILD, str(n)], env=env,
                                   capture_output=True, text=True, check=True)
                for op, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                    best[side][op] = max(best[side].get(op, 0.0), v)
    finally:
        if made:
            shutil.rmtree(os.path.dirname(base_src), ignore_errors=True)
    return {"blocks": n, "rounds": rounds, "baseline_commit": commit, **best}


# --------------------------------------------------------------------------- recovery

SSD_UNIT = 512                  # bytes: the SSD tier's unit in the restart benchmark


def build_ssd_tier(root: str, keys, eks) -> int:
    """A real SSD tier directory holding one BLOCK-byte block per key, made by writing its
    checkpoint with the tier's own writer (``blockmap.write_checkpoint``) instead of N puts
    and their fsyncs: the data file is left zero-filled (the tier preallocates it) and each
    row carries the CRC32C of zeros, so a read verifies.  Returns the tier's capacity."""
    import numpy as np

    from quillcache.store import blockmap
    from quillcache.store.ssd import CHECKPOINT_NAME, crc32c
    n = len(keys)
    capacity = n * SSD_UNIT + (1 << 20)
    os.makedirs(root, exist_ok=True)
    table = (b"".join(eks), blockmap._key_offsets([len(k) for k in eks]),
             np.arange(n, dtype=np.uint64) * SSD_UNIT, np.full(n, BLOCK, np.uint32),
             np.full(n, crc32c(bytes(BLOCK)), np.uint32), np.zeros(n, np.uint64))
    blockmap.write_checkpoint(os.path.join(root, CHECKPOINT_NAME), SSD_UNIT, capacity, 0, table, [])
    return capacity


def bench_recovery(n: int) -> dict:
    """A real restart: an SSD tier of n blocks and a persistent index of their n records
    (99 % in its checkpoint, 1 % replayed from its log), opened and checked against each
    other by LocalKvStore, as the daemon does.  CPU seconds to ready, against the
    persistent index's open alone (the baseline, same run, same files)."""
    from quillcache.index.persistent import PersistentArtIndex
    from quillcache.model import CacheTier, decode_key, encode_key
    from quillcache.store.ssd import SsdTier
    from quillcache.store.tiers import LocalKvStore, StoreOptions
    node = "node-a"
    tmp = tempfile.mkdtemp(prefix="qc-restart-")
    out: dict = {"records": n}
    ixdir, ssddir = os.path.join(tmp, "index"), os.path.join(tmp, "ssd")

    def open_index():
        return PersistentArtIndex(ixdir, volatile_tiers=(CacheTier.CPU_DRAM,), checkpoint_wal_bytes=0)

    try:
        keys = keys_for(n)
        eks = [encode_key(k) for k in keys]
        t = time.perf_counter()
        index = open_index()
        head = n - n // 100
        for k, ek in zip(keys[:head], eks[:head]):
            index.set_holder(k, ek, node, (CacheTier.LOCAL_SSD,), BLOCK)
        index.checkpoint()
        for k, ek in zip(keys[head:], eks[head:]):         # a WAL tail after the checkpoint
            index.set_holder(k, ek, node, (CacheTier.LOCAL_SSD,), BLOCK)
        index.sync()
        index.close()
        capacity = build_ssd_tier(ssddir, keys, eks)
        out["build_s"] = time.perf_counter() - t
        del index
        gc.collect()
        runs = []
        for _ in range(3):
            c0 = time.process_time()
            ssd = SsdTier(ssddir, capacity, unit=SSD_UNIT, direct_io=False, max_block_bytes=BLOCK)
            c1 = time.process_time()
            again = open_index()
            c2 = time.process_time()
            store = LocalKvStore(StoreOptions(64 << 20, holder=node, max_block_bytes=BLOCK), ssd=ssd, index=again)
            c3 = time.process_time()
            assert store.reconciled["index_agreed"] == n, store.reconciled
            st = store.stats()["store"]
            # joining a pool: the cluster's residency listener learns every resident block
            c4 = time.process_time()
            held = store.set_residency_listener(lambda ek, size: None, lambda ek: None)
            c5 = time.process_time()
            assert len(held) == n and store.stats()["store"]["entries"] == 0
            store.set_residency_listener(None, None)
            with store.get(keys[n // 2]) as lease:            # ready: it serves (not timed)
                assert bytes(lease.view) == bytes(BLOCK)
            runs.append({"ssd_open_cpu_s": c1 - c0, "index_open_cpu_s": c2 - c1, "store_cpu_s": c3 - c2,
                         "ready_cpu_s": c3 - c0, "entries_at_ready": st["entries"], "attach_cpu_s": c5 - c4,
                         "checkpoint_records": again.recovery.checkpoint_records,
                         "replayed": again.recovery.replayed})
            ssd.close_sync()          # rewrites the same checkpoint (nothing changed)
            again.close()             # no index checkpoint: the next run replays the same tail
            del store, again, ssd
            gc.collect()
        out.update(min(runs, key=lambda r: r["ready_cpu_s"]))
        out["ready_cpu_runs"] = [round(r["ready_cpu_s"], 3) for r in runs]
        # baselines, same files: the index open alone (best of 3), and the same open
        # decoding every record (a non-lazy index)
        opens = []
        for _ in range(3):
            c0 = time.process_time()
            again = open_index()
            opens.append(time.process_time() - c0)
            again.close()
        out["baseline_index_open_cpu_s"] = min(opens)
        # the listener's attach before it spoke encoded keys: decode, then encode, each key
        again = open_index()
        c0 = time.process_time()
        for ek in again.keys_of(node):
            encode_key(decode_key(ek))
        out["attach_decoding_cpu_s"] = time.process_time() - c0
        again.close()
        c0 = time.process_time()
        again = open_index()
        again.materialize()
        out["eager_open_cpu_s"] = time.process_time() - c0
        again.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--throughput-blocks", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE_REV, help="git revision to compare store puts and gets "
                    f"with (default {BASELINE_REV}: the tree before the residency index moved into the store)")
    ap.add_argument("--baseline-src", default=None, help="an unpacked baseline src/ with its extensions built")
    ap.add_argument("--only", default="list,throughput,recovery")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    only = set(args.only.split(","))
    res: dict = {}
    if "list" in only:
        r = res["list"] = bench_list(args.blocks, args.queries)
        print(f"[list] {r['blocks']:,} blocks (filled in {r['fill_s']:.1f} s), {r['queries']} queries")
        print(f"  prefix LIST (100 keys): index walk p50 {r['prefix_new_p50_us']:.1f} us p99 "
              f"{r['prefix_new_p99_us']:.1f} us | old sort p50 {r['prefix_old_p50_us']:.1f} us p99 "
              f"{r['prefix_old_p99_us']:.1f} us | old/new p50 = {r['prefix_old_p50_us'] / r['prefix_new_p50_us']:.1f}x"
              f" | target p50 <= 1000 us: {'met' if r['prefix_new_p50_us'] <= 1000 else 'MISSED'}")
        print(f"  scope LIST page (100 keys from a cursor): index walk p50 {r['scope_new_p50_us']:.1f} us "
              f"p99 {r['scope_new_p99_us']:.1f} us | old sort of the scope p50 {r['scope_old_p50_us'] / 1000:.0f} ms "
              f"({r['scope_old_runs']} runs) | old/new = {r['scope_old_p50_us'] / r['scope_new_p50_us']:.0f}x")
    if "throughput" in only:
        rev = args.baseline
        r = res["throughput"] = bench_throughput(args.throughput_blocks, args.rounds, rev, args.baseline_src)
        print(f"[throughput] {r['blocks']:,} blocks of {BLOCK} B, best of {r['rounds']}, baseline "
              f"{r['baseline_commit'][:10]}")
        for op in ("put_new", "put_overwrite", "get"):
            b, i = r["baseline"][op], r["index"][op]
            print(f"  {op:14s} baseline {b / 1000:8.1f} k/s | index in store {i / 1000:8.1f} k/s | "
                  f"ratio {i / b:.2f}x")
    if "recovery" in only:
        r = res["recovery"] = bench_recovery(args.blocks)
        print(f"[recovery] restart of a store with {r['records']:,} SSD blocks and their persistent "
              f"records ({r['checkpoint_records']:,} from the index checkpoint, {r['replayed']:,} replayed), "
              f"built in {r['build_s']:.1f} s")
        print(f"  ready (best of 3): SSD tier open {r['ssd_open_cpu_s']:.3f} s + index open "
              f"{r['index_open_cpu_s']:.3f} s + store start and check {r['store_cpu_s']:.3f} s = "
              f"{r['ready_cpu_s']:.3f} s CPU (runs: {r['ready_cpu_runs']}); entries made: "
              f"{r['entries_at_ready']} | target <= 1 s: {'met' if r['ready_cpu_s'] <= 1.0 else 'MISSED'}")
        print(f"  baseline, same files: the index open alone {r['baseline_index_open_cpu_s']:.3f} s CPU | "
              f"ready / index open = {r['ready_cpu_s'] / r['baseline_index_open_cpu_s']:.2f}x | open decoding "
              f"every record {r['eager_open_cpu_s']:.2f} s CPU")
        print(f"  a residency listener (the cluster) attached to the ready store: {r['attach_cpu_s']:.3f} s CPU, "
              f"no entry made | baseline, same records: decoding and re-encoding every key "
              f"{r['attach_decoding_cpu_s']:.3f} s CPU | ratio {r['attach_decoding_cpu_s'] / max(r['attach_cpu_s'], 1e-6):.0f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
