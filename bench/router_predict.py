"""How right the ``quillcache`` predictor is, worker by worker: at every Nth arrival of a replay,
each engine is copied as it is and the copy run forward with the request added and nothing else
arriving, which gives the TTFT the request would really have had on that worker; the prediction
for that worker is the router's own (a probe: ``route(..., candidates=[worker], track=False)``,
whose predicted TTFT depends on no other candidate).  The replay itself goes on as usual.

    python bench/router_predict.py --trace agent --load 0.6            # the sweep's speed-up
    python bench/router_predict.py --trace agent --speedup 14.27 --pool

Engines and cache sizes are ``bench/router_sweep.py``'s (``--cache-share``, ``--pool-share``).
Prints the error (actual - predicted) overall, by the predicted wait, and where the engine
reused fewer or more blocks than the router credited.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_replay import DEFAULT_TRACE, add_trace_block_arg, check_trace, engine_config, pool_blocks
from router_sweep import sizes

from quillcache.control.sim.engine import SimRequest
from quillcache.control.sim.gen import GENERATORS
from quillcache.control.sim.replay import build_requests, run_policy

RUN_LIMIT_STEPS = 1_000_000         # iterations a copy may run before it is given up (a bug, not a wait)


def actual_ttft_us(engine, r, now: int) -> tuple[int, int]:
    """(TTFT, blocks reused from the device) of ``r`` on a copy of ``engine`` with nothing else arriving."""
    eng = copy.deepcopy(engine)
    t = now
    if eng._plan is not None:                 # an iteration in flight: the request waits for its end
        t = eng.finish_step().end_us
    req = SimRequest("probe", r.scope, r.trace.input_length, r.engine_hashes, r.trace.output_length, now)
    eng.submit(req)
    for _ in range(RUN_LIMIT_STEPS):
        if req.first_token_us is not None:
            return req.first_token_us - now, req.hit_blocks
        if eng.plan_step(t) is None:
            break
        t = eng.finish_step().end_us
    raise RuntimeError(f"request {r.trace.index} got no first token on a copy of its engine")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="agent", help="conversation, rag or agent")
    ap.add_argument("--conversation", default=DEFAULT_TRACE)
    add_trace_block_arg(ap)
    ap.add_argument("--load", type=float, default=None,
                    help="take the speed-up docs/router_sweep.json calibrated for this load")
    ap.add_argument("--speedup", type=float, default=None)
    ap.add_argument("--pool", action="store_true")
    ap.add_argument("--limit", type=int, default=1500)
    ap.add_argument("--every", type=int, default=5, help="compare at every Nth arrival")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--cache-share", type=float, default=0.15)
    ap.add_argument("--pool-share", type=float, default=0.5)
    ap.add_argument("--pool-link", choices=("host", "tcp"), default="host")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if (args.load is None) == (args.speedup is None):
        ap.error("give --load or --speedup")
    if args.every < 1:
        ap.error("--every must be >= 1")
    speedup = args.speedup
    if speedup is None:
        rows = json.loads(Path(__file__).resolve().parent.parent.joinpath("docs/router_sweep.json").read_text())["rows"]
        match = [r["speedup"] for r in rows if r["trace"] == args.trace and r["pool"] == args.pool
                 and abs(r["target_load"] - args.load) < 1e-9]
        if not match:
            ap.error(f"docs/router_sweep.json has no {args.trace} row at load {args.load}")
        speedup = match[0]
    trace = (check_trace(ap, args.conversation, args.limit, args.trace_block_tokens) if args.trace == "conversation"
             else GENERATORS[args.trace](args.limit, seed=args.seed))
    kv_gib, pool_gib = sizes(args.trace, args, trace)
    cfg = engine_config(kv_gib, args.pool_link)
    seen = [0]
    out = []          # (predicted us, actual us, credited local blocks, reused device blocks)

    def compare(router, sims, r, now):
        seen[0] += 1
        if seen[0] % args.every:
            return
        for i, name in enumerate(router.workers):
            d = router.route(r.scope, hashes=r.router_hashes, request_tokens=r.trace.input_length,
                             candidates=[name], track=False, decode_tokens=r.trace.output_length)
            ttft, hit = actual_ttft_us(sims[i], r, now)
            out.append((d.predicted_ttft_us, ttft, d.overlap[0], hit))

    res = run_policy(build_requests(trace, speedup), "quillcache", args.engines, cfg, seed=args.seed,
                     pool_blocks=pool_blocks(pool_gib) if args.pool else 0, before_route=compare)
    if not out:
        print(f"router_predict: no prediction compared: --every {args.every} is more than the "
              f"{len(trace)} arrivals", file=sys.stderr)
        return 2
    a = np.array(out, dtype=float)
    pred, act, credited, hit = a[:, 0] / 1e3, a[:, 1] / 1e3, a[:, 2], a[:, 3]
    err = act - pred

    def line(name, m):
        if m.any():
            print(f"  {name:<42} n {int(m.sum()):>5}  predicted {pred[m].mean():>8.0f} ms  actual {act[m].mean():>8.0f} ms"
                  f"  error median {np.median(err[m]):>7.1f} mean {err[m].mean():>7.0f} ms"
                  f"  off > 20 % {np.mean(np.abs(err[m]) > 0.2 * np.maximum(pred[m], 1)):.2f}")

    s = res.summary(800, 80)
    print(f"{args.trace}, speed-up {speedup:.3f}, {'pool' if args.pool else 'no pool'}: quillcache TTFT p50 "
          f"{s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms, goodput {s['goodput']:.3f}, load {s['load']:.2f}; "
          f"{len(a)} predictions (every {args.every}th arrival x {args.engines} workers)")
    line("all", np.ones(len(a), bool))
    line("predicted wait-free (< 50 ms)", pred < 50)
    line("predicted 50 ms - 1 s", (pred >= 50) & (pred < 1000))
    line("predicted >= 1 s", pred >= 1000)
    line("engine reused fewer blocks than credited", hit < credited)
    line("engine reused more blocks than credited", hit > credited)
    return 0


if __name__ == "__main__":
    sys.exit(main())
