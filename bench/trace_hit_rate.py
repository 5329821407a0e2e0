"""Replay the Mooncake conversation trace through the store's eviction policy.

Each trace line is one request whose ``hash_ids`` are its 512-token prefix blocks.  The
simulation keeps two tiers of the given capacities (in blocks) with the same policy
class the byte store uses (quillcache.store.policy) and the same tier logic:

* a DRAM hit refreshes the block; an SSD hit promotes it into DRAM (the SSD copy stays:
  it is clean), refreshing it in both tiers;
* a miss is computed by the engine and put into DRAM;
* when DRAM is over capacity its victim is demoted to SSD (if the SSD copy is not there
  already); when SSD is over capacity its victim's SSD copy is dropped.

Demotion happens at the moment of overflow (the store does it in maintenance() between
watermarks; with the trace's block granularity that only shifts when, not what, is kept).

Block hit rate = hits / blocks requested (the infinite cache gives 0.366 on this trace);
prefix hit rate counts only the leading run of hits of each request (what an engine with
prefix caching can actually skip).

    .venv/bin/python bench/trace_hit_rate.py                 # the docs/tiering.md table
    .venv/bin/python bench/trace_hit_rate.py --dram 10000 --ssd 50000 --policy lru
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_DRAM = (2_000, 10_000, 40_000)
DEFAULT_SSD = (0, 20_000, 80_000)


def load_trace(path: Path = TRACE) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def infinite_reuse(requests: list[list[int]]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for blocks in requests:
        for b in blocks:
            total += 1
            hits += b in seen
            seen.add(b)
    return hits / total


class TierSim:
    """Two tiers of block capacities driven by one policy class each."""

    def __init__(self, dram_blocks: int, ssd_blocks: int, policy: str = "lru"):
        from quillcache.store.policy import make_policy
        self.dram_cap = dram_blocks
        self.ssd_cap = ssd_blocks
        self.dram = make_policy(policy)
        self.ssd = make_policy(policy)
        self.dram_hits = self.ssd_hits = self.misses = 0
        self.prefix_hits = 0
        self.demotions = self.promotions = self.evictions = 0

    def request(self, blocks: list[int]) -> None:
        leading = True
        for b in blocks:
            if b in self.dram:
                self.dram_hits += 1
                self.dram.touch(b)
                hit = True
            elif b in self.ssd:
                self.ssd_hits += 1
                self.ssd.touch(b)
                self.promotions += 1
                self._into_dram(b)
                hit = True
            else:
                self.misses += 1
                self._into_dram(b)
                hit = False
            leading = leading and hit
            self.prefix_hits += leading

    def _into_dram(self, b: int) -> None:
        self.dram.insert(b)
        while len(self.dram) > self.dram_cap:
            victim = self.dram.victim()
            self.dram.remove(victim)
            if self.ssd_cap and victim not in self.ssd:
                self.demotions += 1
                self.ssd.insert(victim)
                while len(self.ssd) > self.ssd_cap:
                    self.ssd.remove(self.ssd.victim())
                    self.evictions += 1
            elif not self.ssd_cap:
                self.evictions += 1

    def result(self) -> dict:
        total = self.dram_hits + self.ssd_hits + self.misses
        return {"dram": self.dram_cap, "ssd": self.ssd_cap, "policy": self.dram.name,
                "hit_rate": (self.dram_hits + self.ssd_hits) / total,
                "dram_hit_rate": self.dram_hits / total, "ssd_hit_rate": self.ssd_hits / total,
                "prefix_hit_rate": self.prefix_hits / total,
                "demotions": self.demotions, "promotions": self.promotions, "evictions": self.evictions}


def replay(requests, dram_blocks: int, ssd_blocks: int, policy: str = "lru") -> dict:
    sim = TierSim(dram_blocks, ssd_blocks, policy)
    for blocks in requests:
        sim.request(blocks)
    return sim.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--dram", type=int, nargs="*", default=list(DEFAULT_DRAM), help="DRAM capacities (blocks)")
    ap.add_argument("--ssd", type=int, nargs="*", default=list(DEFAULT_SSD), help="SSD capacities (blocks)")
    ap.add_argument("--policy", nargs="*", default=["lru", "fifo"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    requests = load_trace(args.trace)
    total = sum(len(r) for r in requests)
    inf = infinite_reuse(requests)
    unique = len({b for r in requests for b in r})
    rows = []
    for policy in args.policy:
        for dram in args.dram:
            for ssd in args.ssd:
                row = replay(requests, dram, ssd, policy)
                row["vs_infinite"] = row["hit_rate"] / inf
                rows.append(row)
    if args.json:
        print(json.dumps({"requests": len(requests), "blocks": total, "unique": unique,
                          "infinite_hit_rate": inf, "rows": rows}, indent=1))
        return 0
    print(f"trace: {len(requests)} requests, {total} blocks requested, {unique} unique; "
          f"infinite-cache block hit rate {inf:.3f}")
    print("| policy | DRAM blocks | SSD blocks | hit rate | of infinite | DRAM hits | SSD hits | prefix hit rate | demotions | evictions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['dram']} | {r['ssd']} | {r['hit_rate']:.3f} | {r['vs_infinite']:.1%} | "
              f"{r['dram_hit_rate']:.3f} | {r['ssd_hit_rate']:.3f} | {r['prefix_hit_rate']:.3f} | "
              f"{r['demotions']} | {r['evictions']} |")
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
