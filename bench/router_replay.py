"""Replay a Mooncake-format trace against N simulated engines through the router, once per
policy, in one run; print a table with ratios against round_robin, write a PNG and JSON.

    python bench/router_replay.py --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --engines 8 --policies round_robin,least_loaded,prefix,dynamo,quillcache \\
        --speedup 5.5 --tenants 4 --json-out out.json

The engines model one H200 serving a Llama-3-8B each (``H200_LLAMA3_8B`` in
quillcache.control.sim.engine: prefill 29 us per uncached token as measured, decode 6 ms
per iteration + 0.1 ms per running decode), with vLLM's defaults for a large GPU (8192
batched tokens per iteration, 256 sequences) and a KV cache of ``--kv-gib`` GiB in blocks of
the trace's 512 tokens.  Their caches are keyed by identity: a block cached for one tenant
is recomputed for another, whatever the router credited.

With ``--pool GIB`` the engines share a pool (``LruPool``: LRU, that many GiB): every engine
offers it the blocks it computes and evicts, and loads from it any prefix it holds, whatever the
policy; it loads at the measured host-to-HBM rate (55 GB/s, ``--pool-link host``) or over TCP
(4.5 GB/s, ``--pool-link tcp``).  Only the routing differs between policies.  ``--kv-gib`` small
(a few GiB) gives the regime where a pool matters: the run prints the engines' combined cache
against the trace's working set (its distinct blocks).

``load`` is the share of time the engines had prefill work running or queued (the chance an
arrival waits behind another prefill); pick ``--speedup`` for the load you want.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
import math
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

from quillcache.control.model import HOST_TO_HBM_BYTES_PER_S, TCP_BYTES_PER_S, SloTarget, us_per_mib
from quillcache.protocol.route import POLICIES
from quillcache.control.sim.engine import H200_LLAMA3_8B, KV_BYTES_PER_TOKEN_LLAMA3_8B, EngineConfig, cost_with
from quillcache.control.sim.replay import build_requests, run_policy
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, TraceError, TraceWarning, assign_tenants, load_trace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench._outpath import out_path  # noqa: E402

GiB = 1 << 30
H200_KV_GIB = 100        # 141 GB HBM x 0.9 utilisation - 16 GB of weights - activations
VLLM_MAX_BATCHED_TOKENS = 8192      # vLLM's default for the OpenAI server on a large GPU
VLLM_MAX_NUM_SEQS = 256
BASELINE = "round_robin"


BLOCK_BYTES = TRACE_BLOCK_TOKENS * KV_BYTES_PER_TOKEN_LLAMA3_8B
POOL_LINKS = {"host": HOST_TO_HBM_BYTES_PER_S, "tcp": TCP_BYTES_PER_S}
FREE_LINK = "free"      # not a link: loads that cost nothing, the bound on what any pool can give


def engine_config(kv_gib: float, pool_link: str = "host") -> EngineConfig:
    """One engine; the pool (and a block moved from another engine) loads at ``pool_link``'s
    measured rate (``"free"``: in no time, a bound rather than a link), and instance-to-instance
    moves (mooncake) go over TCP."""
    capacity = int(kv_gib * GiB) // BLOCK_BYTES
    per_mib = 0 if pool_link == FREE_LINK else us_per_mib(POOL_LINKS[pool_link])
    cost = cost_with(H200_LLAMA3_8B, cpu_dram_us_per_mb=per_mib)
    return EngineConfig(block_size=TRACE_BLOCK_TOKENS, capacity_blocks=capacity,
                        max_num_seqs=VLLM_MAX_NUM_SEQS, max_batched_tokens=VLLM_MAX_BATCHED_TOKENS,
                        cost=cost, kv_bytes_per_token=KV_BYTES_PER_TOKEN_LLAMA3_8B,
                        remote_us_per_mb=us_per_mib(TCP_BYTES_PER_S))


def pool_blocks(pool_gib: float) -> int:
    return int(pool_gib * GiB) // BLOCK_BYTES


def working_set_blocks(trace) -> int:
    return len({h for t in trace for h in t.hash_ids[:t.input_length // TRACE_BLOCK_TOKENS]})


def reusable_share(trace) -> float:
    """The share of the prompt tokens that are in leading blocks some earlier request of the same
    tenant had (at most all but a prompt's last token, as an engine hits): what a cache that held
    everything and loaded it in no time would reuse, the ceiling of hit rate plus pool rate."""
    seen: set = set()
    reusable = total = 0
    for t in sorted(trace, key=lambda t: (t.timestamp_ms, t.index)):
        k = 0
        for h in t.hash_ids[:max(0, t.input_length - 1) // TRACE_BLOCK_TOKENS]:
            if (t.tenant, h) not in seen:
                break
            k += 1
        reusable += k * TRACE_BLOCK_TOKENS
        total += t.input_length
        seen.update((t.tenant, h) for h in t.hash_ids[:t.input_length // TRACE_BLOCK_TOKENS])
    return reusable / total if total else 0.0


def prefix_classes(trace, share: float) -> tuple[list[int], list[dict]]:
    """The requests grouped by the prefix they share.  A request's run is the deepest run of its
    leading blocks (its tenant's: what an engine can reuse) that at least ``share`` of the trace's
    requests begin with: a template, a shared document, a system prompt.  Each run that is the
    deepest for at least that many requests is a class (1, 2, ... by size, the deeper first among
    equals); every other request (its run shared by fewer, or no run at all) is in class 0, the
    rest.

    Returns each request's class, in the trace's order, and per class its run's depth in blocks,
    its first two block ids, its tenant and its requests.  Exact (a trie of the leading blocks),
    O(the trace's blocks)."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share {share!r}: must be in (0, 1]")
    need = max(2, math.ceil(share * len(trace)))
    children: dict = {}
    count = [0]                                     # per trie node (0: the root)
    paths = []
    for t in trace:
        node, path = 0, []
        for h in t.hash_ids[:t.input_length // TRACE_BLOCK_TOKENS]:
            key = (node, h) if node else (0, t.tenant, h)
            nxt = children.get(key)
            if nxt is None:
                nxt = children[key] = len(count)
                count.append(0)
            count[nxt] += 1
            node = nxt
            path.append(nxt)
        paths.append(path)
    runs = []                                       # (node, depth): counts only fall along a path
    for path in paths:
        d = 0
        while d < len(path) and count[path[d]] >= need:
            d += 1
        runs.append((path[d - 1], d) if d else (0, 0))
    sizes = Counter(runs)
    kept = sorted((r for r, n in sizes.items() if r[1] and n >= need), key=lambda r: (-sizes[r], -r[1], r[0]))
    number = {r: i + 1 for i, r in enumerate(kept)}
    classes = [number.get(r, 0) for r in runs]
    info = [{"blocks": 0, "first_blocks": [], "tenant": None, "requests": classes.count(0)}]
    for r in kept:
        t = trace[runs.index(r)]
        info.append({"blocks": r[1], "first_blocks": list(t.hash_ids[:min(2, r[1])]), "tenant": t.tenant,
                     "requests": sizes[r]})
    return classes, info


# Mooncake's conversation trace, where the project keeps it: ../shared/data/traces/ beside the
# checkout (any clone placed beside shared/ finds it).
DEFAULT_TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
                    / "mooncake_conversation_trace.jsonl")


def add_trace_block_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace-block-tokens", type=int, default=TRACE_BLOCK_TOKENS, metavar="N",
                    help="tokens per hash id in the trace (default: %(default)s, Mooncake's); a trace cut in "
                         f"blocks of another size is re-cut into {TRACE_BLOCK_TOKENS}-token blocks")


def check_trace(ap: argparse.ArgumentParser, path: str, limit: int = 0,
                block_tokens: int = TRACE_BLOCK_TOKENS) -> list:
    """Read the trace once here: a missing file or a bad line is one usage error naming the
    file and line, not a traceback from a worker process; a trace replayed otherwise than as
    written (rows out of time order) is said on stderr."""
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", TraceWarning)
            trace = load_trace(path, limit, block_tokens)
        for w in said:
            print(f"trace {w.message}", file=sys.stderr)
    except OSError as exc:
        ap.error(f"trace {path}: {exc.strerror or exc}")
    except TraceError as exc:
        hint = f": pass --trace-block-tokens {exc.fits[0]}" if exc.fits else ""
        ap.error(f"trace {exc}{hint}")
    except ValueError as exc:          # parse_trace's own bound on the block size
        ap.error(f"--trace-block-tokens {block_tokens}: {exc}")
    if not trace:
        ap.error(f"trace {path}: no requests")
    return trace


_WORK: dict = {}


def _init(trace, tenants, seed, speedup, by_prefix=0.0):
    trace = assign_tenants(trace, tenants, seed)
    _WORK["requests"] = build_requests(trace, speedup)
    _WORK["working_set_blocks"] = working_set_blocks(trace)
    _WORK["reusable_share"] = reusable_share(trace)
    _WORK["classes"] = prefix_classes(trace, by_prefix) if by_prefix else None


def _one(args):
    policy, engines, kv_gib, seed, pool_gib, pool_link, admission = args
    t0 = time.perf_counter()
    res = run_policy(_WORK["requests"], policy, engines, engine_config(kv_gib, pool_link), seed=seed,
                     pool_blocks=pool_blocks(pool_gib), admission=admission)
    slo = SloTarget()
    out = res.summary(slo.ttft_ms, slo.tpot_ms)
    if _WORK["classes"] is not None:
        out["by_prefix"] = res.by_class(_WORK["classes"][0], slo.ttft_ms, slo.tpot_ms)
    out["wall_s"] = time.perf_counter() - t0
    return policy, out


def run(args, trace: list) -> dict:
    """Every policy over ``trace`` (as ``check_trace`` read it: forked workers inherit it)."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"router_replay: unknown policies {unknown} (known: {', '.join(POLICIES)})")
    work = [(p, args.engines, args.kv_gib, args.seed, args.pool, args.pool_link, args.admission)
            for p in policies]
    _init(trace, args.tenants, args.seed, args.speedup, args.by_prefix)     # once: forked workers inherit it
    if args.jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(args.jobs, len(work))) as pool:
            results = dict(pool.map(_one, work, chunksize=1))
    else:
        results = dict(_one(w) for w in work)
    return {"policies": {p: results[p] for p in policies},
            "config": {"trace": args.trace, "engines": args.engines, "speedup": args.speedup,
                       "tenants": args.tenants, "seed": args.seed, "kv_gib": args.kv_gib,
                       "limit": args.limit, "trace_block_tokens": args.trace_block_tokens,
                       "slo": {"ttft_ms": SloTarget().ttft_ms, "tpot_ms": SloTarget().tpot_ms},
                       "cost_model": {"prefill_us_per_token": H200_LLAMA3_8B.prefill_us_per_token,
                                      "decode_us_per_token": H200_LLAMA3_8B.decode_us_per_token,
                                      "running_decode_penalty_us":
                                          H200_LLAMA3_8B.running_decode_penalty_us},
                       "capacity_blocks_per_engine": engine_config(args.kv_gib).capacity_blocks,
                       "pool_gib": args.pool, "pool_link": args.pool_link, "admission": args.admission,
                       "pool_blocks": pool_blocks(args.pool),
                       "working_set_blocks": _WORK["working_set_blocks"],
                       "reusable_share": _WORK["reusable_share"],
                       "by_prefix": None if _WORK["classes"] is None else
                           {"share": args.by_prefix, "classes": _WORK["classes"][1]},
                       "cache_share_of_working_set":
                           args.engines * engine_config(args.kv_gib).capacity_blocks
                           / max(_WORK["working_set_blocks"], 1)}}


def table(doc: dict) -> str:
    pols = doc["policies"]
    base = pols.get(BASELINE)
    head = (f"{'policy':<13} {'TTFT p50':>9} {'p50/rr':>7} {'TTFT p99':>9} {'hit rate':>8} "
            f"{'goodput':>8} {'pool':>5} {'x-id credited':>13} {'x-id served':>11} {'load':>5}")
    lines = [head, "-" * len(head)]
    for name, r in pols.items():
        ratio = f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x" if base and base["ttft_p50_ms"] else "-"
        lines.append(f"{name:<13} {r['ttft_p50_ms']:>7.0f}ms {ratio:>7} {r['ttft_p99_ms']:>7.0f}ms "
                     f"{r['hit_rate']:>8.3f} {r['goodput']:>8.3f} {r['pool_rate']:>5.2f} "
                     f"{r['cross_identity_credited_blocks']:>13} {r['cross_identity_served_blocks']:>11} "
                     f"{r['load']:>5.2f}")
    if "quillcache" in pols and "dynamo" in pols:
        q, d = pols["quillcache"], pols["dynamo"]
        line = f"quillcache - dynamo goodput: {q['goodput'] - d['goodput']:+.3f}"
        if base and base["ttft_p50_ms"]:          # without round_robin in the run there is no ratio
            line += f"; TTFT p50 quillcache/round_robin: {q['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x"
        lines.append(line)
    return "\n".join(lines)


def class_table(doc: dict) -> str:
    """``--by-prefix``: per class of request, each policy's TTFT p50 / p90 / p99, goodput and hit rate."""
    spec = doc["config"]["by_prefix"]
    lines = [f"by prefix: a request's class is the deepest run of leading blocks that at least "
             f"{spec['share']:.0%} of the requests begin with (class 0: the rest)"]
    def n(k: int, what: str) -> str:
        return f"{k} {what}{'' if k == 1 else 's'}"
    for c, info in enumerate(spec["classes"]):
        what = (f"{n(info['blocks'], 'block')} from {', '.join(map(str, info['first_blocks']))}"
                + (f", tenant {info['tenant']!r}" if doc["config"]["tenants"] > 1 else "")) if c else "the rest"
        lines.append(f"class {c}: {what}; {n(info['requests'], 'request')}")
        lines.append(f"  {'policy':<22} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'goodput':>8} {'hit rate':>8}")
        for name, r in doc["policies"].items():
            row = r["by_prefix"][c]             # one row per class: each has its requests
            if row["ttft_p50_ms"] is None:
                lines.append(f"  {name:<22} {'-':>9} {'-':>8} {'-':>8} {'-':>8} {'-':>8}")
                continue
            lines.append(f"  {name:<22} {row['ttft_p50_ms']:>7.0f}ms {row['ttft_p90_ms']:>6.0f}ms "
                         f"{row['ttft_p99_ms']:>6.0f}ms {row['goodput']:>8.3f} {row['hit_rate']:>8.3f}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pols = doc["policies"]
    names = list(pols)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("TTFT (ms)", ("ttft_p50_ms", "ttft_p99_ms"), ("p50", "p99")),
              ("goodput (share meeting the SLO)", ("goodput",), ("goodput",)),
              ("prefix hit rate (tokens)", ("hit_rate",), ("hit rate",)))
    for ax, (title, keys, labels) in zip(axes, panels, strict=False):
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(zip(keys, labels, strict=False)):
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, [pols[n][key] for n in names], width, label=label)
        ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.set_title(title)
        if len(keys) > 1:
            ax.legend()
    c = doc["config"]
    fig.suptitle(f"{Path(c['trace']).name}: {c['engines']} engines, speed-up {c['speedup']}, "
                 f"{c['tenants']} tenant(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--speedup", type=float, default=1.0, help="trace time divided by this")
    ap.add_argument("--tenants", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="tenant assignment and router tie-breaks")
    ap.add_argument("--kv-gib", type=float, default=H200_KV_GIB, help="KV cache per engine")
    ap.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    add_trace_block_arg(ap)
    ap.add_argument("--jobs", type=int, default=2, help="policies replayed in parallel processes")
    ap.add_argument("--pool", type=float, default=0.0, metavar="GIB", help="a shared pool of GIB GiB (0: none)")
    ap.add_argument("--pool-link", choices=sorted([*POOL_LINKS, FREE_LINK]), default="host",
                    help="how engines load from the pool: host (55 GB/s), tcp (4.5 GB/s) or free (in no "
                         "time: not a link, the bound on what a pool can give)")
    ap.add_argument("--admission", choices=("off", "predict"), default="off",
                    help="quillcache refuses what it predicts will miss the TTFT SLO (a miss)")
    ap.add_argument("--by-prefix", type=float, default=0.0, metavar="SHARE",
                    help="also per class of request: the deepest run of leading blocks that at least SHARE "
                         "(say 0.05) of the requests begin with (a template, a document); 0: off")
    ap.add_argument("--json-out", type=out_path, default=None)
    ap.add_argument("--png-out", type=out_path, default=None, help="default: the JSON path with .png")
    args = ap.parse_args(argv)
    if args.engines < 1 or args.tenants < 1 or not args.speedup > 0 or args.pool < 0:
        ap.error("--engines and --tenants must be >= 1, --speedup > 0 and --pool >= 0")
    if not 0.0 <= args.by_prefix <= 1.0:
        ap.error(f"--by-prefix {args.by_prefix}: a share of the requests, in (0, 1] (0: off)")
    trace = check_trace(ap, args.trace, args.limit, args.trace_block_tokens)
    t0 = time.perf_counter()
    doc = run(args, trace)
    print(table(doc))
    c = doc["config"]
    print(f"engine caches: {c['cache_share_of_working_set']:.2f} of the working set "
          f"({c['working_set_blocks']} blocks); pool: {c['pool_blocks']} blocks over {c['pool_link']}")
    print(f"reuse ceiling: {c['reusable_share']:.3f} of the prompt tokens are in blocks an earlier request "
          f"of the same tenant had (no cache reuses more: hit rate + pool rate)")
    if c["by_prefix"] is not None:
        print(class_table(doc))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    png = args.png_out or (str(Path(args.json_out).with_suffix(".png")) if args.json_out else None)
    if png:
        plot(doc, png)
        print(f"wrote {args.json_out or ''} {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
