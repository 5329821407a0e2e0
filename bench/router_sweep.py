"""Every routing policy over a grid of loads, with and without a pool, on the conversation trace
and on two generated traces (RAG over shared documents, tool agents with growing contexts):
one markdown table, one PNG (TTFT p50/p99 and goodput against load, a line per policy) and
the JSON they come from.

    python bench/router_sweep.py --conversation ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --limit 3000 --loads 0.3,0.6,0.85 --out docs/router_sweep

Load is set by the speed-up and measured as the engines' busy share (the share of time an
engine had prefill work running or queued) while the trace offers work, from its first arrival
to its last (``PolicyResult.summary``; over the whole replay, drain included, an overload of 2 x
reads as ~0.8, so no target would tell 1.1 x from 2 x): for each trace, target AND pool setting, the
speed-up is found by replaying ``dynamo`` (the baseline the issue measures against) in that
setting (steps, then bisection on log speed-up) until its measured load is within
``--load-tol`` of the target; every policy then replays at that speed-up and its own measured
load is in the table.  A trace too short or too bursty to be paced to a load (all of it
arriving at once is one load at every speed-up) gets the closest speed-up; where that is still
further than ``--load-miss`` from the target, the setting is reported as not reached: its
checks say so (they compare the policies at another load than the one named) and the plot
leaves it out.  A pool takes work off the engines, so the same load needs a higher
speed-up with one than without.  The issue's "with the pool at 0.6" line is printed at the same
load and at the same traffic (``quillcache`` with the pool at the no-pool speed-up), and beside it
what a pool that holds every block and loads it in no time gives there: no pool takes more off.

A verdict at one speed-up can be a coin flip: near a cliff a few requests decide a median, and
a speed-up 3 % away can turn a check.  ``--jitter 0.94,0.97,1.03,1.06`` replays every policy of
every setting at those multiples of its calibrated speed-up too, and says of each check in how
many of the speed-ups (the calibrated one included) it holds: a check that holds at all of them
is a finding, one that holds at some is within the noise.

Engines: ``bench/router_replay.py``'s (one H200 serving Llama-3-8B each).  The engines'
caches hold ``--cache-share`` (default 0.15: under a fifth) of the trace's working set (its
distinct full blocks); the pool, when there is one, holds ``--pool-share`` of it and loads at
the host-to-HBM rate (``--pool-link tcp``: over TCP).  Both shares are rules over the trace,
the same for every trace.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_replay import (BLOCK_BYTES, DEFAULT_TRACE, FREE_LINK, GiB, H200_KV_GIB, add_trace_block_arg, check_trace,
                           engine_config, pool_blocks, reusable_share, working_set_blocks)

from bench._outpath import out_path  # the root is on the path: router_replay puts it there

from quillcache.control.model import SloTarget
from quillcache.control.sim.gen import GENERATORS
from quillcache.control.sim.replay import build_requests, run_policy
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, load_trace
from quillcache.protocol.route import POLICIES

OURS = "quillcache"
PEERS = tuple(p for p in POLICIES if p != OURS)
ADMIT = "quillcache+admission"     # quillcache with [router] admission = "predict", k = 1
PROBE = "dynamo"
BOUND = "bound"     # the tag of the replays with a pool that holds everything and loads in no time

_TRACES: dict = {}
_REQS: dict = {}


def _trace(name: str, args) -> list:
    if name not in _TRACES:
        if name == "conversation":
            _TRACES[name] = load_trace(args.conversation, args.limit, args.trace_block_tokens)
        else:
            _TRACES[name] = GENERATORS[name](args.limit, seed=args.seed)
    return _TRACES[name]


def _requests(name: str, speedup: float, args) -> list:
    key = (name, speedup)
    if key not in _REQS:
        _REQS.clear()
        _REQS[key] = build_requests(_trace(name, args), speedup)
    return _REQS[key]


def sizes(name: str, args, trace: Optional[list] = None) -> tuple[float, float]:
    """(KV GiB per engine, pool GiB) for a trace (``trace``, else the one ``name`` and ``args``
    give): shares of its working set, each engine's cache at least two of the trace's largest
    requests (so it can run what it is sent) and at most an H200's."""
    trace = _trace(name, args) if trace is None else trace
    ws = working_set_blocks(trace) * BLOCK_BYTES / GiB
    largest = max(-(-(t.input_length + t.output_length) // TRACE_BLOCK_TOKENS) for t in trace)
    floor = 2 * largest * BLOCK_BYTES / GiB
    return min(H200_KV_GIB, max(floor, args.cache_share * ws / args.engines)), args.pool_share * ws


def replay(task, bound: bool = False) -> tuple:
    """One policy in one setting.  ``bound``: with a pool that holds every block of the trace and
    loads it in no time, which no pool betters (the most a pool can take off that policy there)."""
    name, target, speedup, policy, pool, args = task
    kv_gib, pool_gib = sizes(name, args)
    link, held = args.pool_link, pool_blocks(pool_gib) if pool else 0
    if bound:
        link, held = FREE_LINK, working_set_blocks(_trace(name, args))
    t0 = time.perf_counter()
    res = run_policy(_requests(name, speedup, args), OURS if policy == ADMIT else policy, args.engines,
                     engine_config(kv_gib, link), seed=args.seed, pool_blocks=held,
                     admission="predict" if policy == ADMIT else "off")
    slo = SloTarget()
    out = res.summary(slo.ttft_ms, slo.tpot_ms)
    out["wall_s"] = time.perf_counter() - t0
    return (name, target, pool, policy), out


def calibrate(name: str, target: float, args, start: float, pool: bool = False) -> tuple[float, float]:
    """The speed-up whose measured load (the probe policy, in this pool setting) is closest to
    the target: multiplicative steps until the target is bracketed, then bisection on log
    speed-up."""
    pts: list[tuple[float, float]] = []
    s = start
    for _ in range(args.probes):
        load = replay((name, target, s, PROBE, pool, args))[1]["load"]
        pts.append((s, load))
        if abs(load - target) <= args.load_tol:
            break
        below = [p for p in pts if p[1] < target]
        above = [p for p in pts if p[1] > target]
        if below and above:
            lo = max(below, key=lambda p: p[0])[0]
            hi = min(above, key=lambda p: p[0])[0]
            s = math.sqrt(lo * hi)
        else:
            s = s * min(4.0, max(0.25, (target / max(load, 1e-3)) ** 1.5))
    return min(pts, key=lambda p: abs(p[1] - target))


def trace_names(spec: str) -> list[str]:
    """``--traces``: the names, comma-separated, blanks dropped."""
    return [t.strip() for t in spec.split(",") if t.strip()]


def reached(target: float, measured: float, args) -> bool:
    """Whether the calibrated load is the target's, within ``--load-miss``."""
    return abs(measured - target) <= args.load_miss


def _replay_tagged(task) -> tuple:
    tag, inner = task
    key, out = replay(inner, bound=tag == BOUND)
    return (tag, key), out


def _calibrate(task) -> tuple:
    (name, target, pool), args = task
    return (name, target, pool), calibrate(name, target, args, args.start_speedup, pool)


class _Serial:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def _pool(args):
    return multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else _Serial()


def _map(mp, fn, tasks):
    return mp.imap_unordered(fn, tasks, chunksize=1) if mp is not None else map(fn, tasks)


def run(args) -> dict:
    traces = trace_names(args.traces)
    loads = [float(x) for x in args.loads.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    settings = [(name, target, pool) for name in traces for target in loads for pool in (False, True)]
    cal: dict = {}
    t0 = time.perf_counter()
    # per trace, not per setting: the engines' share of its working set and its reuse ceiling
    shares = {name: args.engines * sizes(name, args)[0] / (working_set_blocks(_trace(name, args)) * BLOCK_BYTES / GiB)
              for name in traces}
    ceilings = {name: reusable_share(_trace(name, args)) for name in traces}
    with _pool(args) as mp:
        for key, (s, measured) in _map(mp, _calibrate, [(k, args) for k in settings]):
            cal[key] = (s, measured)
            name, target, pool = key
            kv, pool_gib = sizes(name, args)
            missed = ("; NOT REACHED: no speed-up paces this trace to that load"
                      if not reached(target, measured, args) else "")
            print(f"{name} load {target} {'pool' if pool else 'no pool'}: speed-up {s:.3f} (measured "
                  f"{measured:.3f}); KV {kv:.1f} GiB/engine ({shares[name]:.2f} of the working set), pool "
                  f"{pool_gib:.0f} GiB, reuse ceiling {ceilings[name]:.2f}{missed} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        tasks = [(name, target, cal[(name, target, pool)][0], policy, pool, args)
                 for name, target, pool in settings for policy in policies]
        # quillcache with the pool at the speed-up of the no-pool setting: the same offered
        # traffic, for the "pool at 0.6" check at equal traffic as well as at equal load
        same = [(name, target, cal[(name, target, False)][0], OURS, True, args)
                for name, target, pool in settings if not pool and OURS in policies]
        # --jitter: every policy but the admission variant at multiples of each calibrated speed-up
        jittered = [(f, (name, target, cal[(name, target, pool)][0] * f, policy, pool, args))
                    for f in args.jitter for name, target, pool in settings for policy in policies
                    if policy != ADMIT]
        results, same_traffic, bounds, jitter = {}, {}, {}, {}
        todo = [(False, t) for t in tasks] + [(True, t) for t in same] + [(BOUND, t) for t in same] + jittered
        for i, (task_key, out) in enumerate(_map(mp, _replay_tagged, todo), 1):
            tagged, key = task_key
            if tagged is False:
                results[key] = out
            elif tagged is True:
                same_traffic[key] = out
            elif tagged == BOUND:
                bounds[key] = out
            else:
                jitter[(tagged, *key)] = out
            if i % 8 == 0:
                print(f"  {i}/{len(todo)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for (name, target, pool, policy), out in sorted(results.items(), key=lambda kv: (
            traces.index(kv[0][0]), kv[0][1], kv[0][2], policies.index(kv[0][3]))):
        rows.append({"trace": name, "target_load": target, "speedup": cal[(name, target, pool)][0],
                     "calibrated_load": cal[(name, target, pool)][1],
                     "load_reached": reached(target, cal[(name, target, pool)][1], args),
                     "pool": pool, "policy": policy, **out})
    kv = {name: sizes(name, args) for name in traces}

    def at_no_pool_speedup(found: dict, **extra) -> list:
        return [{"trace": k[0], "target_load": k[1], "speedup": cal[(k[0], k[1], False)][0], "pool": True,
                 "policy": OURS, **out, **extra} for k, out in sorted(found.items())]
    same_rows = at_no_pool_speedup(same_traffic)
    bound_rows = at_no_pool_speedup(bounds, pool_link=FREE_LINK)
    jitter_rows = [{"trace": k[1], "target_load": k[2], "factor": k[0], "speedup": cal[(k[1], k[2], k[3])][0] * k[0],
                    "pool": k[3], "policy": k[4], **out} for k, out in sorted(jitter.items())]
    return {"rows": rows, "pool_at_no_pool_speedup": same_rows, "pool_bound_at_no_pool_speedup": bound_rows,
            "jitter_rows": jitter_rows, "config": {
        "traces": traces, "loads": loads, "policies": policies, "engines": args.engines, "jitter": args.jitter,
        "limit": args.limit, "seed": args.seed, "load_miss": args.load_miss, "cache_share": args.cache_share,
        "pool_share": args.pool_share, "pool_link": args.pool_link, "trace_block_tokens": args.trace_block_tokens,
        "kv_gib": {n: v[0] for n, v in kv.items()}, "pool_gib": {n: v[1] for n, v in kv.items()},
        "slo": {"ttft_ms": SloTarget().ttft_ms, "tpot_ms": SloTarget().tpot_ms}}}


def _by_setting(rows) -> dict:
    """``rows`` grouped by setting: (trace, target load, pool) -> policy -> row."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["trace"], r["target_load"], r["pool"]), {})[r["policy"]] = r
    return by


def _best(g: dict, ours: str = OURS) -> tuple[float, float, float]:
    """The best peer's figures in one setting (``g``: policy -> row; at least one peer): the
    lowest TTFT p50 and p99, and the highest goodput.  A peer is any policy but ``ours`` and
    ``quillcache`` with admission (which refuses requests: the issue's checks leave it apart)."""
    peers = [r for p, r in g.items() if p not in (ours, ADMIT)]
    return (min(p["ttft_p50_ms"] for p in peers), min(p["ttft_p99_ms"] for p in peers),
            max(p["goodput"] for p in peers))


def _checks(g: dict, load: float, ours: str = OURS) -> list[tuple[str, bool]]:
    """The issue's checks of ``ours`` (``quillcache`` unless asked of another policy) against
    its peers in one setting (``g``: policy -> row; at least one peer): p50, goodput and p99
    against the best peer, and at 0.8 and above goodput against 1.3 x ``dynamo``'s (not asked
    of ``dynamo`` itself)."""
    q = g[ours]
    p50, p99, good = _best(g, ours)
    checks = [("p50<=1.05xbest", q["ttft_p50_ms"] <= 1.05 * p50),
              ("goodput>=best-0.01", q["goodput"] >= good - 0.01),
              ("p99<=1.2xbest", q["ttft_p99_ms"] <= 1.2 * p99)]
    if load >= 0.8 and "dynamo" in g and ours != "dynamo":
        checks.append(("goodput>=1.3xdynamo", q["goodput"] >= 1.3 * g["dynamo"]["goodput"]))
    return checks


def every_policy(doc: dict) -> str:
    """The same checks asked of every policy in turn, each against the best of all the others
    (``quillcache`` among them) at the calibrated speed-ups: how hard the bar is on these traces.
    Where no one policy holds them all, the best figures of a setting come from policies that
    trade one against another (say, the median against the tail)."""
    by = _by_setting(doc["rows"])
    tally: dict = {}
    for (_, load, _), g in by.items():
        for pol in g:
            if pol == ADMIT or not any(p not in (pol, ADMIT) for p in g):
                continue
            t = tally.setdefault(pol, [0, 0])
            for _, ok in _checks(g, load, pol):
                t[0] += ok
                t[1] += 1
    if len(tally) < 2:
        return ""
    order = sorted(tally, key=lambda p: (-tally[p][0] / tally[p][1], p))
    return ("the same checks for every policy, each against the best of the others: "
            + ", ".join(f"{p} {tally[p][0]}/{tally[p][1]}" for p in order))


def jitter_verdicts(doc: dict) -> list[str]:
    """With ``--jitter``: per setting, in how many of its speed-ups (the calibrated one and its
    multiples) each check holds, then the tally over all of them."""
    jit = doc.get("jitter_rows")
    if not jit:
        return []
    by: dict = {}
    for r in list(doc["rows"]) + list(jit):
        key = (r["trace"], r["target_load"], r["pool"])
        by.setdefault(key, {}).setdefault(r.get("factor", 1.0), {})[r["policy"]] = r
    factors = sorted({1.0, *doc["config"]["jitter"]})
    missed = {(r["trace"], r["target_load"], r["pool"]) for r in doc["rows"] if not r.get("load_reached", True)}
    out, held, made = [], 0, 0
    for (name, load, pool), per in by.items():
        tally: dict = {}
        for f in factors:
            g = per.get(f, {})
            if OURS not in g or not any(p in g for p in PEERS):
                continue
            for check, ok in _checks(g, load):
                t = tally.setdefault(check, [0, 0])
                t[0] += ok
                t[1] += 1
        if not tally:
            continue
        held += sum(t[0] for t in tally.values())
        made += sum(t[1] for t in tally.values())
        out.append(f"{name} load {load} {'pool' if pool else 'no pool'}"
                   f"{' (NOT REACHED: checked at the closest speed-up)' if (name, load, pool) in missed else ''}, speed-up x "
                   f"{', '.join(f'{f:g}' for f in factors)}: "
                   + ", ".join(f"{check} {t[0]}/{t[1]}" for check, t in tally.items()))
    if made:
        out.append(f"across the jittered speed-ups quillcache holds {held} of {made} checks")
    return out


def verdicts(doc: dict) -> list[str]:
    """The issue's 'must hold' points, checked row group by row group."""
    by = _by_setting(doc["rows"])
    out = []
    held = made = 0
    missed = {k for k, g in by.items() if not all(r.get("load_reached", True) for r in g.values())}
    for (name, load, pool), g in by.items():
        if OURS not in g or not any(p in g for p in PEERS):
            continue
        q = g[OURS]
        p50, p99, good = _best(g)
        checks = _checks(g, load)
        if load >= 0.8 and "dynamo" in g and ADMIT in g:
            checks.append(("with admission: goodput>=1.3xdynamo", g[ADMIT]["goodput"] >= 1.3 * g["dynamo"]["goodput"]))
        line = ", ".join(f"{n} {'ok' if ok else 'NO'}" for n, ok in checks)
        counted = [ok for n, ok in checks if not n.startswith("with admission")]
        held, made = held + sum(counted), made + len(counted)
        cal = f", dynamo's load {g['dynamo']['load']:.2f}" if "dynamo" in g else ""
        if (name, load, pool) in missed:
            r = next(iter(g.values()))
            line = (f"NOT REACHED (the closest speed-up, {r['speedup']:.2f}, gives a calibrated load of "
                    f"{r['calibrated_load']:.2f}), checked there: {line}")
        out.append(f"{name} load {load} {'pool' if pool else 'no pool'}: {line} "
                   f"({'calibrated' + cal + '; ' if cal else ''}quillcache p50 {q['ttft_p50_ms']:.0f} / best peer {p50:.0f} ms, p99 "
                   f"{q['ttft_p99_ms']:.0f} / {p99:.0f} ms, goodput {q['goodput']:.3f} / {good:.3f})")
    for (name, load, pool), g in by.items():
        if pool or abs(load - 0.6) > 0.05 or OURS not in g or {(name, load, False), (name, load, True)} & missed:
            continue
        with_pool = by.get((name, load, True), {})
        if OURS not in with_pool:
            continue
        qp, qn = with_pool[OURS], g[OURS]
        ratio = qp["ttft_p50_ms"] / qn["ttft_p50_ms"] if qn["ttft_p50_ms"] else float("nan")
        same = next((r for r in doc.get("pool_at_no_pool_speedup", ())
                     if r["trace"] == name and r["target_load"] == load), None)
        bound = next((r for r in doc.get("pool_bound_at_no_pool_speedup", ())
                      if r["trace"] == name and r["target_load"] == load), None)
        at_same = ""
        if same is not None:
            r2 = same["ttft_p50_ms"] / qn["ttft_p50_ms"] if qn["ttft_p50_ms"] else float("nan")
            at_same = (f"; at the same traffic (the no-pool speed-up {same['speedup']:.2f}, load "
                       f"{same['load']:.2f} with the pool) {r2:.2f} ({'ok' if r2 <= 0.8 else 'NO'} <= 0.8)")
        if bound is not None:
            r3 = bound["ttft_p50_ms"] / qn["ttft_p50_ms"] if qn["ttft_p50_ms"] else float("nan")
            at_same += (f"; there with a pool that holds every block and loads it in no time, the most a pool "
                        f"can take off, {r3:.2f}")
        beats = all(qp["ttft_p50_ms"] < with_pool[p]["ttft_p50_ms"] and qp["goodput"] >= with_pool[p]["goodput"]
                    for p in PEERS if p in with_pool)
        losers = ", ".join(f"{p} {with_pool[p]['ttft_p50_ms']:.0f} ms / {with_pool[p]['goodput']:.3f}"
                           for p in PEERS if p in with_pool and not (
                               qp["ttft_p50_ms"] < with_pool[p]["ttft_p50_ms"]
                               and qp["goodput"] >= with_pool[p]["goodput"]))
        out.append(f"{name} load {load}: quillcache p50 with pool / without at the same load {ratio:.2f} "
                   f"({'ok' if ratio <= 0.8 else 'NO'} <= 0.8){at_same}; beats every peer with the pool "
                   f"(lower p50, goodput >=): {'ok' if beats else 'NO'}"
                   + (f" (quillcache {qp['ttft_p50_ms']:.0f} ms / {qp['goodput']:.3f}; not beaten: {losers})"
                      if losers else ""))
    if made:
        out.append(f"quillcache holds {held} of {made} checks (p50, goodput and p99 against the best peer, goodput "
                   f">= 1.3 x dynamo's at 0.8 and above; the admission and pool lines apart)")
    return out


def table(doc: dict) -> str:
    lines = ["| trace | load (target) | speed-up | pool | policy | TTFT p50 ms | TTFT p99 ms | goodput "
             "| hit rate | pool rate | load (measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        target = r["target_load"] if r.get("load_reached", True) else f"{r['target_load']} (not reached)"
        lines.append(f"| {r['trace']} | {target} | {r['speedup']:.2f} | {'yes' if r['pool'] else 'no'} "
                     f"| {r['policy']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['goodput']:.3f} "
                     f"| {r['hit_rate']:.3f} | {r['pool_rate']:.3f} | {r['load']:.2f} |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = doc["config"]
    groups = [(t, p) for t in c["traces"] for p in (False, True)]
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.2 * len(groups)), squeeze=False)
    for row, (trace, pool) in enumerate(groups):
        for col, (key, title, log) in enumerate((("ttft_p50_ms", "TTFT p50 (ms)", True),
                                                 ("ttft_p99_ms", "TTFT p99 (ms)", True),
                                                 ("goodput", "goodput", False))):
            ax = axes[row][col]
            for policy in c["policies"]:
                pts = sorted((r["target_load"], r[key]) for r in doc["rows"]
                             if r["trace"] == trace and r["pool"] == pool and r["policy"] == policy
                             and r.get("load_reached", True))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            linewidth=2.5 if policy == OURS else 1.2, label=policy)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{trace}, {'pool' if pool else 'no pool'}: {title}", fontsize=9)
            ax.set_xlabel("load (busy share)")
    if axes[0][2].get_legend_handles_labels()[0]:     # none where no load was reached
        axes[0][2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversation", default=DEFAULT_TRACE,
                    help="a Mooncake-format trace replayed as the 'conversation' trace (default: %(default)s)")
    add_trace_block_arg(ap)
    ap.add_argument("--traces", default="conversation,rag,agent",
                    help="comma-separated: conversation (--conversation) and the generated "
                         f"{', '.join(sorted(GENERATORS))} (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=3000, help="requests per trace")
    ap.add_argument("--loads", default="0.3,0.6,0.85")
    ap.add_argument("--load-tol", type=float, default=0.03,
                    help="calibration stops once the probe's load is this close to the target (default: %(default)s)")
    ap.add_argument("--load-miss", type=float, default=0.1,
                    help="a setting whose calibrated load is further than this from its target is reported "
                         "as not reached (default: %(default)s)")
    ap.add_argument("--probes", type=int, default=8, help="calibration replays per load at most")
    ap.add_argument("--start-speedup", type=float, default=1.0)
    ap.add_argument("--policies", default=",".join(POLICIES + (ADMIT,)),
                    help=f"policies to replay; {ADMIT}: quillcache with admission = predict (k = 1)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--cache-share", type=float, default=0.15)
    ap.add_argument("--pool-share", type=float, default=0.5)
    ap.add_argument("--pool-link", choices=("host", "tcp"), default="host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--jitter", default="",
                    help="comma-separated multiples of each calibrated speed-up (say 0.94,0.97,1.03,1.06) to "
                         "replay every setting at too: in how many speed-ups each check holds")
    ap.add_argument("--out", type=out_path, default=None, help="write OUT.md, OUT.png and OUT.json")
    args = ap.parse_args(argv)
    try:
        args.jitter = sorted({float(x) for x in args.jitter.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--jitter {args.jitter!r}: comma-separated numbers")
    if any(not (0.0 < f <= 10.0) or f == 1.0 for f in args.jitter):
        ap.error(f"--jitter: each multiple in (0, 10], other than 1 (the calibrated speed-up itself), "
                 f"not {', '.join(f'{f:g}' for f in args.jitter)}")
    names = trace_names(args.traces)
    unknown = [t for t in names if t != "conversation" and t not in GENERATORS]
    if unknown:
        ap.error(f"--traces: {', '.join(unknown)}: not a trace (conversation, {', '.join(sorted(GENERATORS))})")
    if "conversation" in names:      # read once here; forked workers inherit it
        _TRACES["conversation"] = check_trace(ap, args.conversation, args.limit, args.trace_block_tokens)
    t0 = time.perf_counter()
    doc = run(args)
    text = table(doc)
    checks = verdicts(doc) + jitter_verdicts(doc)
    same_bar = every_policy(doc)
    if same_bar:
        checks.append(same_bar)
    print(text)
    print("\n".join(checks))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        cmd = "python bench/router_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.out + ".md").write_text(f"`{cmd}`\n\n{text}\n\n" + "\n".join(f"- {c}" for c in checks) + "\n")
        plot(doc, args.out + ".png")
        print(f"wrote {args.out}.md, .png, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
