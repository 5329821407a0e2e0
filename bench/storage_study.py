"""The storage study: memory / ART / persistent ART / LSM residency indexes on the Mooncake trace.

For each record count (default 100k and 1M) every backend is loaded with the same
residency records, then measured in this one process (absolute times on the shared
2-core machine are noisy; compare the ratios):

* prefix-scan p50/p99: ``prefix_scan(scope, prefix_hash)`` for prefixes drawn from the
  records (the flat map filters everything, so it gets fewer queries at 1M);
* point lookup p50/p99: ``locate(key)``;
* write amplification: physical bytes / logical bytes, where logical = the compact PUT
  record of each put (``persistent.encode_put``); ART = WAL (framed) + checkpoints written,
  LSM = RocksDB's rocksdb.wal.bytes + flush.write.bytes + compact.write.bytes;
* recovery: reopen time; ART = load the checkpoint (taken after 99% of the puts) + replay
  the last 1% from the WAL; LSM = RocksDB open (its own WAL replay), both lazy.

Records: each trace line's ``hash_ids`` is a chain of 512-token blocks; block j of a
request gets prefix_hash = the hash of block j-1 ("root" for j = 0), block_index j,
token_count 512; request i is tenant ``tenant-{i % 4}`` and worker ``worker-{i % 16}``;
tier HBM for j < 4, CPU DRAM for j < 16, else local SSD; bytes = 512 tokens x 128 KiB
(llama-3-8b fp16 KV).  A (key, worker, tier) seen before is skipped.  When the trace is
exhausted it is replayed with every hash id shifted by epoch x (max id + 1), as if new
conversations of the same shape arrived, until the record count is reached.

    .venv/bin/python bench/storage_study.py --records 100000          # quick (~1 min)
    .venv/bin/python bench/storage_study.py                           # 100k and 1M, writes docs/
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # bench.lsm_index when run as a script
from bench._outpath import out_path  # noqa: E402
TOKENS_PER_BLOCK = 512
KV_BYTES_PER_TOKEN = 128 << 10          # bytes: llama-3-8b, fp16, 32 layers x 8 KV heads x 128 x 2 x 2
SYNC_EVERY_PUTS = 1000                  # puts per group commit while loading
RECOVERY_RUNS = 3                       # reopens timed; the fastest is reported (shared machine)


def build_records(n: int, trace: Path = TRACE):
    from quillcache.model import CacheResidency, CacheTier, KvBlockKey
    with open(trace, encoding="utf-8") as f:
        requests = [json.loads(line) for line in f if line.strip()]
    shift = max(max(r["hash_ids"], default=0) for r in requests) + 1
    seen: set = set()
    out = []
    epoch = 0
    while len(out) < n:
        base = epoch * shift
        for i, req in enumerate(requests):
            tenant_no, worker_no = i % 4, i % 16
            parent = "root"
            for j, h in enumerate(req["hash_ids"]):
                tier = CacheTier.HBM if j < 4 else CacheTier.CPU_DRAM if j < 16 else CacheTier.LOCAL_SSD
                ident = (tenant_no, parent, h + base, j, worker_no, tier)
                block = str(h + base)
                if ident not in seen:
                    seen.add(ident)
                    key = KvBlockKey("llama-3-8b", "llama-3", None, f"tenant-{tenant_no}", parent,
                                     block, j, TOKENS_PER_BLOCK)
                    out.append(CacheResidency(key, f"worker-{worker_no}", tier,
                                              TOKENS_PER_BLOCK * KV_BYTES_PER_TOKEN,
                                              int(req.get("timestamp", 0))))
                    if len(out) == n:
                        return out, epoch + 1
                parent = block
        epoch += 1
    return out, epoch


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure_calls(fn, args_list) -> tuple[float, float]:
    """p50 and p99 in microseconds of fn(*args) over args_list."""
    clock = time.perf_counter_ns
    samples = []
    for args in args_list:
        t = clock()
        fn(*args)
        samples.append((clock() - t) / 1000)
    return pct(samples, 0.5), pct(samples, 0.99)


def load(index, records, sync=None) -> float:
    t = time.perf_counter()
    put = index.put
    for i, r in enumerate(records, 1):
        put(r)
        if sync is not None and i % SYNC_EVERY_PUTS == 0:
            sync()
    if sync is not None:
        sync()
    return time.perf_counter() - t


def study(n: int, queries: int, memory_queries: int, workdir: Path, backends: list[str]) -> dict:
    from quillcache.index.art import ArtIndex
    from quillcache.index.persistent import PersistentArtIndex
    from quillcache.model import IdentityScope, MemoryIndex

    t = time.perf_counter()
    records, epochs = build_records(n)
    print(f"[{n}] built {len(records)} records from {epochs} pass(es) of the trace "
          f"in {time.perf_counter() - t:.1f} s", flush=True)
    rng = random.Random(42)
    picks = [records[rng.randrange(len(records))] for _ in range(queries)]
    scans = [(IdentityScope.from_key(r.key), r.key.prefix_hash) for r in picks]
    lookups = [(r.key,) for r in picks]
    rows = {}

    def point_and_scan(name, index, nq):
        scan_p50, scan_p99 = measure_calls(index.prefix_scan, scans[:nq])
        get_p50, get_p99 = measure_calls(index.locate, lookups[:nq])
        hits = sum(len(index.prefix_scan(*q)) for q in scans[:50])
        print(f"[{n}] {name}: scan p50 {scan_p50:.1f} us p99 {scan_p99:.1f} us, "
              f"locate p50 {get_p50:.2f} us ({hits / 50:.1f} records per scan)", flush=True)
        return {"scan_p50_us": scan_p50, "scan_p99_us": scan_p99, "get_p50_us": get_p50,
                "get_p99_us": get_p99, "scan_queries": nq, "records_per_scan": hits / 50}

    if "memory" in backends:
        index = MemoryIndex()
        secs = load(index, records)
        rows["memory"] = {"load_s": secs, **point_and_scan("memory", index, memory_queries),
                          "write_amp": None, "recovery_s": None, "records": len(index)}
        del index
        gc.collect()

    if "art" in backends:
        index = ArtIndex()
        secs = load(index, records)
        rows["art"] = {"load_s": secs, **point_and_scan("art", index, queries),
                       "write_amp": None, "recovery_s": None, "records": len(index),
                       "memory_bytes": index.metrics().memory_bytes}
        del index
        gc.collect()

    if "art-persistent" in backends:
        path = workdir / f"art-{n}"
        index = PersistentArtIndex(path)
        cut = len(records) - len(records) // 100
        secs = load(index, records[:cut], index.sync)
        t = time.perf_counter()
        ck_bytes = index.checkpoint()
        ck_secs = time.perf_counter() - t
        secs += load(index, records[cut:], index.sync) + ck_secs
        row = {"load_s": secs, "checkpoint_s": ck_secs, "checkpoint_bytes": ck_bytes,
               **point_and_scan("art-persistent", index, queries),
               "write_amp": index.write_amplification, "logical_bytes": index.logical_bytes,
               "physical_bytes": index.physical_bytes, "records": len(index),
               "checkpoints": index.stats()["checkpoints"],
               "checkpoints_bytes": index.stats()["checkpoint_bytes_written"]}
        expected_len = len(index)
        index.close()
        del index
        gc.collect()
        runs = []
        for _ in range(RECOVERY_RUNS):
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            again = PersistentArtIndex(path)
            runs.append((time.perf_counter() - t, time.process_time() - c))
            if len(runs) < RECOVERY_RUNS:
                again.close()
                del again
        row["recovery_s"], row["recovery_cpu_s"] = min(runs)
        row["recovery_runs_s"] = [w for w, _ in runs]
        rec = again.recovery
        row["recovery"] = {"checkpoint_records": rec.checkpoint_records, "replayed": rec.replayed,
                           "skipped": rec.skipped, "checkpoint_s": rec.checkpoint_seconds,
                           "replay_s": rec.replay_seconds}
        assert len(again) == expected_len
        cold = point_and_scan("art-persistent (cold, after reopen)", again, min(queries, 1000))
        row["cold_scan_p50_us"], row["cold_scan_p99_us"] = cold["scan_p50_us"], cold["scan_p99_us"]
        t = time.perf_counter()
        again.materialize()
        row["materialize_s"] = time.perf_counter() - t
        print(f"[{n}] art-persistent: write amp {row['write_amp']:.2f}x, recovery "
              f"{row['recovery_s'] * 1000:.0f} ms ({row['recovery']}), full decode "
              f"{row['materialize_s']:.1f} s, checkpoint {ck_secs:.1f} s / {ck_bytes >> 20} MiB", flush=True)
        again.close()
        rows["art-persistent"] = row
        del again
        gc.collect()

    if "lsm" in backends:
        try:
            from bench.lsm_index import LsmIndex
        except ImportError:
            print("rocksdict not installed: LSM skipped (pip install rocksdict)", file=sys.stderr)
        else:
            path = workdir / f"lsm-{n}"
            index = LsmIndex(path)
            secs = load(index, records, index.sync)
            t = time.perf_counter()
            index.flush()       # the memtable to an SST, as the ART ends with a checkpoint
            secs += time.perf_counter() - t
            row = {"load_s": secs, **point_and_scan("lsm", index, queries),
                   "write_amp": index.write_amplification, "logical_bytes": index.logical_bytes,
                   "physical_bytes": index.physical_bytes, "records": len(index),
                   "rocksdb": {k: v for k, v in index.rocksdb_stats().items()
                               if k in ("rocksdb.wal.bytes", "rocksdb.flush.write.bytes",
                                        "rocksdb.compact.write.bytes", "rocksdb.bytes.written")}}
            index.close()
            del index
            gc.collect()
            runs = []
            for _ in range(RECOVERY_RUNS):
                t, c = time.perf_counter(), time.process_time()
                again = LsmIndex(path)
                runs.append((time.perf_counter() - t, time.process_time() - c))
                if len(runs) < RECOVERY_RUNS:
                    again.close()
            row["recovery_s"], row["recovery_cpu_s"] = min(runs)
            row["recovery_runs_s"] = [w for w, _ in runs]
            assert len(again) == row["records"]
            again.close()
            print(f"[{n}] lsm: write amp {row['write_amp']:.2f}x, recovery {row['recovery_s'] * 1000:.0f} ms",
                  flush=True)
            rows["lsm"] = row
    return {"records": n, "trace_passes": epochs, "backends": rows}


def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if unit == "ms":
        return f"{v * 1000:.0f} ms"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def write_markdown(results: list[dict], path: Path, png: Path, command: str) -> None:
    lines = ["# Storage study: residency index backends", "",
             "Generated by `bench/storage_study.py` (the method is in its docstring); command:",
             "", f"    {command}", "",
             "Measured on the shared 2-core development machine while other builds and tests ran:",
             "absolute times are noisy, the ratios within one run are what to read.  Recovery is the",
             f"fastest of {RECOVERY_RUNS} reopens (wall clock, and the process's CPU time during it).", ""]
    for res in results:
        n = res["records"]
        lines += [f"## {n:,} residency records ({res['trace_passes']} pass(es) of the Mooncake trace)", "",
                  "| backend | prefix-scan p50 | p99 | locate p50 | p99 | write amp | recovery (wall / CPU) | load (puts) |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, row in res["backends"].items():
            lines.append(f"| {name} | {fmt(row['scan_p50_us'])} us | {fmt(row['scan_p99_us'])} us | "
                         f"{fmt(row['get_p50_us'])} us | {fmt(row['get_p99_us'])} us | "
                         f"{fmt(row['write_amp'], 'x')} | {fmt(row['recovery_s'], 'ms')}"
                         f"{' / ' + fmt(row['recovery_cpu_s'], 'ms') if row.get('recovery_cpu_s') is not None else ''} | "
                         f"{row['load_s']:.1f} s |")
        b = res["backends"]
        notes = []
        if "memory" in b and "art" in b:
            notes.append(f"prefix-scan p50 flat map / ART = {b['memory']['scan_p50_us'] / b['art']['scan_p50_us']:.0f}x "
                         f"(the flat map ran {b['memory']['scan_queries']} queries, the others {b['art']['scan_queries']}); "
                         f"{b['art']['records_per_scan']:.1f} records per scan on average")
        if "art" in b and "lsm" in b:
            notes.append(f"prefix-scan p50 LSM / ART = {b['lsm']['scan_p50_us'] / b['art']['scan_p50_us']:.1f}x")
        if "art-persistent" in b:
            p = b["art-persistent"]
            notes.append(f"persistent ART: checkpoint of {p['checkpoint_bytes'] / 2**20:.1f} MiB written in "
                         f"{p['checkpoint_s']:.1f} s; recovery = checkpoint ({p['recovery']['checkpoint_records']:,} "
                         f"records, {p['recovery']['checkpoint_s'] * 1000:.0f} ms wall) + replay of "
                         f"{p['recovery']['replayed']:,} WAL records ({p['recovery']['replay_s'] * 1000:.0f} ms wall, "
                         f"{p['recovery']['skipped']:,} already-checkpointed records re-read), "
                         f"{p['recovery_cpu_s'] * 1000:.0f} ms CPU in all; first scans after reopen "
                         f"(records decoded on first touch) p50 {p['cold_scan_p50_us']:.1f} us, p99 "
                         f"{p['cold_scan_p99_us']:.1f} us; decoding everything: {p['materialize_s']:.1f} s")
            wal = p["physical_bytes"] - p["checkpoints_bytes"]
            notes.append(f"persistent ART write amp = (WAL {wal:,} B + {p['checkpoints']} checkpoint(s) "
                         f"{p['checkpoints_bytes']:,} B) / logical {p['logical_bytes']:,} B; the WAL alone is "
                         f"{wal / p['logical_bytes']:.2f}x")
        if "lsm" in b:
            s = b["lsm"]["rocksdb"]
            notes.append("LSM write amp = (" + " + ".join(f"{k.split('rocksdb.')[1]} {v:,} B" for k, v in s.items()
                                                          if k != "rocksdb.bytes.written")
                         + f") / logical {b['lsm']['logical_bytes']:,} B")
        lines += [""] + [f"- {x}" for x in notes] + [""]
    lines += ["## Against the seed", "",
              "The seed reported prefix-scan p50 ART 9.96 us, LSM 16.8 us, flat map 494 us; write amp",
              "1x (ART) vs 10.6x (LSM); recovery 2.6 ms.  Differences to keep in mind:", "",
              "- Write amp here counts the ART's WAL framing and every checkpoint it wrote (one per",
              "  64 MiB of WAL plus the final one), so it is above 1x; the LSM's compaction depends on",
              "  how much data is written (a 1 M load triggers few compactions with a 64 MiB memtable).",
              "- Recovery of the persistent ART is lazy: the tree and the per-worker map are rebuilt at",
              "  open, records are decoded on first touch (the cold-scan numbers above); the cost of",
              "  decoding everything is reported separately.",
              "- The flat map's scan is linear in the index size, so its ratio grows with the records.",
              "- RocksDB's open is lazy (it reads SST index and filter blocks on demand and the memtable",
              "  was flushed), hence its few ms; the persistent ART rebuilds the whole tree in memory at",
              "  open (bulk insert of every key: the bulk of its recovery time) and decodes records lazily.",
              "  Its recovery CPU time is the number to hold against the 1 s target for 1 M records.",
              "- Prefix-scan p99 is dominated by the `root` prefixes (the first block of every request",
              "  of a tenant): thousands of records per scan.  After a reopen the first scan of a",
              "  prefix also decodes its records (the cold p99).", "",
              f"![prefix-scan latency, write amplification and recovery]({png.name})", ""]
    path.write_text("\n".join(lines))


def plot(results: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["memory", "art", "art-persistent", "lsm"]
    width = 0.8 / max(1, len(results))
    for k, res in enumerate(results):
        b = res["backends"]
        xs = [i + k * width for i, nm in enumerate(names) if nm in b]
        present = [nm for nm in names if nm in b]
        axes[0].bar(xs, [b[nm]["scan_p50_us"] for nm in present], width, label=f"{res['records']:,} p50")
        axes[0].scatter(xs, [b[nm]["scan_p99_us"] for nm in present], marker="_", s=200, color="black")
        wa = [nm for nm in present if b[nm]["write_amp"]]
        axes[1].bar([i + k * width for i, nm in enumerate(names) if nm in wa],
                    [b[nm]["write_amp"] for nm in wa], width, label=f"{res['records']:,}")
        rc = [nm for nm in present if b[nm]["recovery_s"] is not None]
        axes[2].bar([i + k * width for i, nm in enumerate(names) if nm in rc],
                    [b[nm]["recovery_s"] * 1000 for nm in rc], width, label=f"{res['records']:,}")
    for ax, title, ylabel in ((axes[0], "prefix_scan latency (bar p50, tick p99)", "us (log)"),
                              (axes[1], "write amplification", "physical / logical bytes"),
                              (axes[2], "recovery (reopen, fastest of 3)", "ms (log)")):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(names))], names)
        ax.legend()
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, action="append",
                    help="record count (repeatable; default 100000 and 1000000)")
    ap.add_argument("--queries", type=int, default=2000, help="scan/lookup queries per backend")
    ap.add_argument("--memory-queries", type=int, default=0,
                    help="queries for the flat map (default: 2000 at 100k, scaled down with size)")
    ap.add_argument("--backends", default="memory,art,art-persistent,lsm")
    ap.add_argument("--workdir", type=Path, default=None, help="where the on-disk backends go (temp)")
    ap.add_argument("--no-docs", action="store_true", help="print only; do not write docs/")
    ap.add_argument("--json-out", type=lambda text: Path(out_path(text)), help="also write the results as JSON here")
    ap.add_argument("--from-json", type=Path,
                    help="do not measure: render docs/ from a --json-out file (or this script's output)")
    args = ap.parse_args(argv)
    if args.from_json:
        text = args.from_json.read_text()
        saved = json.loads(text[text.index("{\n") if text.lstrip().startswith("{") else text.index("\n[\n") + 1:])
        saved = saved if isinstance(saved, dict) else {"results": saved}
        render(saved["results"], saved.get("command", ".venv/bin/python bench/storage_study.py"))
        return 0
    sizes = args.records or [100_000, 1_000_000]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="qc-storage-study-"))
    results = []
    try:
        for n in sizes:
            mq = args.memory_queries or max(20, min(args.queries, args.queries * 5_000 // n))
            results.append(study(n, args.queries, mq, workdir, backends))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    command = (".venv/bin/python bench/storage_study.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if not args.no_docs:
        render(results, command)
    if args.json_out:
        args.json_out.write_text(json.dumps({"command": command, "results": results}, indent=1, default=float))
    print(json.dumps(results, indent=1, default=float))
    return 0


def render(results: list[dict], command: str) -> None:
    (ROOT / "docs").mkdir(exist_ok=True)
    png = ROOT / "docs" / "storage-study.png"
    plot(results, png)
    write_markdown(results, ROOT / "docs" / "storage-study.md", png, command)
    print(f"wrote docs/storage-study.md and {png.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
