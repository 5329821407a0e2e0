"""The residency index's block-hash map: the native ``BlockMap`` (_native/blockmap.pyx)
against the dict keyed by block-hash strings that it replaced, in one process run.

    PYTHONPATH=src .venv/bin/python bench/block_map.py [--blocks 300000] [--lookups 200000]

Both sides hold the same N encoded keys (one tenant per key, 1 in 16 block hashes shared by
a second tenant: the per-tenant form), built from native keys as the store holds them.
Timed, best of 3, ns per call:

* hit / miss / cross-tenant: the lookup of the guard and of REMOVE (``eks(block_hash,
  tenant)``; the dict side is ``dict.get`` plus the lone key's tenant check, as art.py did);
* add + forget: the index's put and remove of a key (the dict side builds the block-hash
  str from the key, as ``key.block_hash`` did);
* bytes per block: tracemalloc growth while each side is filled (the dict side counts its
  block-hash strings: they existed only for the dict).

Ratios are native / dict (below 1.0: the native map is faster or smaller); absolute
times on a shared machine are noise.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc


def make_keys(n: int, seed: int = 1) -> list:
    """n native keys: 32-hex block hashes, every 16th block hash also in tenant "beta"."""
    from quillcache._native.keys import decode_key_fast
    from quillcache.model import KvBlockKey, encode_key
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        shared = i % 16 == 15                       # the previous key's block hash, another tenant
        bh = out[-1].block_hash if shared else "%032x" % rnd.getrandbits(128)
        k = KvBlockKey("meta-llama/Llama-3.1-8B", "tok-v1", None, "beta" if shared else "acme",
                       "%032x" % (i // 16), bh, block_index=i % 1000, token_count=16)
        out.append(decode_key_fast(encode_key(k), KvBlockKey))
    return out


# ---------------------------------------------------------------------- the dict it replaced

def _tenant_of(ek: bytes) -> str:
    return ek[2:2 + ek[1]].decode("utf-8")


def dict_add(d: dict, block_hash: str, tenant_id: str, ek: bytes) -> None:
    held = d.get(block_hash)
    if held is None:
        d[block_hash] = ek
        return
    if type(held) is bytes:
        if held == ek:
            return
        held = d[block_hash] = {_tenant_of(held): (held,)}
    keys = held.get(tenant_id)
    if keys is None:
        held[tenant_id] = (ek,)
    elif ek not in keys:
        held[tenant_id] = keys + (ek,)


def dict_forget(d: dict, block_hash: str, tenant_id: str, ek: bytes) -> None:
    held = d.get(block_hash)
    if held is None:
        return
    if type(held) is bytes:
        if held == ek:
            del d[block_hash]
        return
    keys = held.get(tenant_id)
    if keys is not None and ek in keys:
        keys = tuple(k for k in keys if k != ek)
        if keys:
            held[tenant_id] = keys
        else:
            del held[tenant_id]
    if not held:
        del d[block_hash]
    elif len(held) == 1:
        (only,) = held.values()
        if len(only) == 1:
            d[block_hash] = only[0]


def dict_eks(d: dict, block_hash: str, tenant_id: str) -> tuple:
    held = d.get(block_hash)
    if held is None:
        return ()
    if type(held) is bytes:
        return (held,) if _tenant_of(held) == tenant_id else ()
    return held.get(tenant_id, ())


# ---------------------------------------------------------------------- the runs

def _best_ns(fn, n: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def run(blocks: int, lookups: int) -> dict:
    from quillcache._native.blockmap import BlockMap
    from quillcache.model import encode_key
    keys = make_keys(blocks)
    eks = [encode_key(k) for k in keys]                # the key's own encoding (no copy)
    tenants = [k.tenant_id for k in keys]
    out: dict = {"blocks": blocks}
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        m0 = tracemalloc.get_traced_memory()[0]
        native = BlockMap()
        for ek, t in zip(eks, tenants):
            native.add(ek, t)
        m1 = tracemalloc.get_traced_memory()[0]
        d: dict = {}
        for k, ek, t in zip(keys, eks, tenants):
            dict_add(d, k.block_hash, t, ek)
        m2 = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out["native_bytes_per_block"] = (m1 - m0) / blocks
        out["dict_bytes_per_block"] = (m2 - m1) / blocks
        assert len(native) == len(d)

        rnd = random.Random(2)
        pick = [rnd.randrange(blocks) for _ in range(lookups)]
        hit_q = [(keys[i].block_hash, tenants[i]) for i in pick]
        miss_q = [("%032x" % rnd.getrandbits(128), "acme") for _ in range(lookups)]
        cross_q = [(bh, "other") for bh, _ in hit_q]
        assert all(native.eks(bh, t) == dict_eks(d, bh, t) for bh, t in hit_q[:2000] + cross_q[:2000])

        def lookups_native(qs):
            f = native.eks
            return lambda: [f(bh, t) for bh, t in qs]

        def lookups_dict(qs):
            return lambda: [dict_eks(d, bh, t) for bh, t in qs]

        for name, qs in (("hit", hit_q), ("miss", miss_q), ("cross_tenant", cross_q)):
            out[f"{name}_native_ns"] = _best_ns(lookups_native(qs), lookups)
            out[f"{name}_dict_ns"] = _best_ns(lookups_dict(qs), lookups)

        churn = pick[:lookups // 4]

        def churn_native():
            add, forget = native.add, native.forget
            for i in churn:
                forget(eks[i])
                add(eks[i], tenants[i])

        def churn_dict():
            for i in churn:
                bh = keys[i].block_hash              # the str the dict needed (a new str per read)
                dict_forget(d, bh, tenants[i], eks[i])
                dict_add(d, keys[i].block_hash, tenants[i], eks[i])

        out["forget_add_native_ns"] = _best_ns(churn_native, len(churn))
        out["forget_add_dict_ns"] = _best_ns(churn_dict, len(churn))
    finally:
        gc.enable()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=300_000)
    ap.add_argument("--lookups", type=int, default=200_000)
    a = ap.parse_args(argv)
    r = run(a.blocks, a.lookups)
    print(f"block map, {r['blocks']} blocks (native / dict; < 1.0: native faster or smaller)")
    print(f"  bytes per block      {r['native_bytes_per_block']:8.1f} B  {r['dict_bytes_per_block']:8.1f} B"
          f"  ratio {r['native_bytes_per_block'] / r['dict_bytes_per_block']:.2f}")
    for name in ("hit", "miss", "cross_tenant", "forget_add"):
        nat, dic = r[f"{name}_native_ns"], r[f"{name}_dict_ns"]
        print(f"  {name:<20} {nat:8.1f} ns {dic:8.1f} ns  ratio {nat / dic:.2f}")


if __name__ == "__main__":
    main()
