"""Replay a Mooncake-format trace through a real quillcache-gateway process in front of N
simulated engines, once per routing policy ([router] policy), in one run; print the table of
bench/router_replay.py (TTFT p50/p99, hit rate, goodput under the SLO, cross-tenant blocks
credited and served), with ratios against round_robin measured in the same run.

    .venv/bin/python bench/gateway_replay.py \\
        --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --engines 4 --limit 160 --speedup 2.75 --tenants 4 --json-out gw.json

Where router_replay.py drives the engine model on a virtual clock, this is the real thing in
real time: each policy gets N fresh ``quillcache-sim-engine`` processes (the same H200
Llama-3-8B cost model, vLLM's batching defaults, a KV cache of ``--kv-gib`` in blocks of the
trace's 512 tokens, KV events on ZMQ) and a fresh gateway process; this process is the
clients: each trace request is sent at its (compressed) arrival time as a streaming
``/v1/completions`` with the prompt as token ids (block id ``h`` is the tokens ``h, 1, .., 511``
as in router_replay.py, the partial last block a prefix of its block), ``max_tokens`` = its
output length, and the API key of its tenant (``--tenants`` > 1; one tenant runs open).

Measured at the client: TTFT (request sent -> first token) and TPOT; from the engines'
``/sim/stats``: the prefix hit rate (tokens), cross-identity blocks served (0: the engines key
their caches by tenant) and the prefill load; from the gateway's ``/metrics``: blocks credited
across identities.  With ``--time-scale`` s < 1 the engines run 1/s times faster than the
modelled GPU and the arrivals come 1/s times closer: every time is reported in modelled ms
(wall / s), so the gateway's own latency counts 1/s times; keep 1.0 (the default) for the
figures to quote.  Every process shares this machine's cores with this client.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import router_replay  # noqa: E402
from bench._outpath import out_path  # noqa: E402
from bench._serve import Processes  # noqa: E402
from quillcache.settings.convert import hash_token  # noqa: E402
from quillcache.control.model import SloTarget  # noqa: E402
from quillcache.protocol.route import POLICIES  # noqa: E402
from quillcache.control.sim.engine import H200_LLAMA3_8B  # noqa: E402
from quillcache.control.sim.replay import (  # noqa: E402
    REPLAY_MODEL, PolicyResult, block_token_ids, build_requests, run_policy,
)
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, assign_tenants  # noqa: E402
from tests._support.ports import free_port  # noqa: E402

MAX_MODEL_LEN = 1 << 20         # tokens: the engines refuse nothing the router replay would take
# What the live path adds to a request before its engine sees it (client, two HTTP hops, the
# gateway's parse and routing), measured here (docs/router.md, "Live: through the gateway"): a
# request alone on an idle engine reaches its first token 4-10 ms later live than on the virtual
# clock, from 300 to 20,000 prompt tokens.  The virtual repeats vary the arrivals by that much.
VIRTUAL_JITTER_MS = 10.0


def prompt_tokens(hash_ids, input_length: int, bs: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """The prompt of a trace request as token ids: block id h is h, 1, .., bs-1 (router_replay)."""
    out: list[int] = []
    for h in hash_ids:
        out.extend(block_token_ids(h, bs))
    return out[:input_length]


def tenant_key(tenant: str) -> str:
    return f"replay-key-{tenant}-0123456789"


def scrape(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Run:
    """One policy: fresh engines, a fresh gateway, the trace replayed, the figures gathered."""

    def __init__(self, args, policy: str, requests, bodies, tenants: list[str]) -> None:
        self.args = args
        self.policy = policy
        self.requests = requests
        self.bodies = bodies
        self.tenants = tenants
        self.procs = Processes("qc-gwreplay-", f"gateway_replay ({policy})")
        self.tmp = self.procs.tmp

    async def start(self, session) -> str:
        a = self.args
        cap = router_replay.engine_config(a.kv_gib)
        engines = []
        for i in range(a.engines):
            port, ev, rp = free_port(), free_port(), free_port()
            p = self.procs.spawn([str(BIN / "quillcache-sim-engine"), "--port", str(port), "--model", REPLAY_MODEL,
                             "--block-size", str(cap.block_size), "--capacity-blocks", str(cap.capacity_blocks),
                             "--max-num-seqs", str(cap.max_num_seqs), "--max-batched-tokens",
                             str(cap.max_batched_tokens), "--max-model-len", str(MAX_MODEL_LEN),
                             "--time-scale", repr(a.time_scale), "--kv-events", f"tcp://127.0.0.1:{ev}",
                             "--kv-events-replay", f"tcp://127.0.0.1:{rp}"], f"engine-{i}")
            engines.append((f"engine-{i}", f"http://127.0.0.1:{port}", ev, rp, p))
        gport, self.admin_port = free_port(), free_port()
        text = (f'[gateway]\nlisten = "127.0.0.1:{gport}"\nadmin_listen = "127.0.0.1:{self.admin_port}"\nqueue_limit = 100000\nmax_body = "64MiB"\n'
                'first_byte_timeout = "3600s"\nidle_timeout = "3600s"\n'
                f'[router]\npolicy = "{self.policy}"\n')
        if len(self.tenants) > 1:
            text += "".join(f'[[auth.tenants]]\nname = "{t}"\ntoken = "{hash_token(tenant_key(t))}"\n'
                            for t in self.tenants)
        text += "".join(f'[[gateway.engines]]\nid = "{eid}"\nurl = "{url}"\nmodel = "{REPLAY_MODEL}"\n'
                        f'block_size = {cap.block_size}\nkv_events = "tcp://127.0.0.1:{ev}"\n'
                        f'kv_replay = "tcp://127.0.0.1:{rp}"\n' for eid, url, ev, rp, _ in engines)
        (self.tmp / "gateway.toml").write_text(text)
        for eid, url, _, _, p in engines:
            await self.procs.wait_http(session, url + "/health", p, eid)
        gw = self.procs.spawn([str(BIN / "quillcache-gateway"), "--config", str(self.tmp / "gateway.toml")], "gateway")
        base = f"http://127.0.0.1:{gport}"
        await self.procs.wait_http(session, base + "/health", gw, "gateway")
        await asyncio.sleep(0.5)                  # ZMQ slow joiner: the event subscriptions connect
        self.engine_urls = [url for _, url, _, _, _ in engines]
        return base

    async def one(self, session, base: str, i: int, t0: float, out: list) -> None:
        a = self.args
        r = self.requests[i]
        at = t0 + r.arrival_us / 1e6 * a.time_scale
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        headers = {"Content-Type": "application/json"}
        if len(self.tenants) > 1:
            headers["Authorization"] = f"Bearer {tenant_key(r.trace.tenant)}"
        sent = time.monotonic()
        first = last = None
        n = 0
        try:
            async with session.post(base + "/v1/completions", data=self.bodies[i], headers=headers) as resp:
                if resp.status != 200:
                    out[i] = ("error", f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                    return
                dec = {k[len("x-quillcache-"):]: v for k, v in resp.headers.items()
                       if k.startswith("x-quillcache-")}
                async for chunk in resp.content.iter_any():
                    now = time.monotonic()
                    if b'"error"' in chunk:
                        out[i] = ("error", chunk[:200].decode(errors="replace"))
                        return
                    k = chunk.count(b'"text"')
                    if k:
                        first = first or now
                        last = now
                        n += k
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            out[i] = ("error", f"{type(exc).__name__}: {exc}")
            return
        if first is None:
            out[i] = ("error", "no token")
            return
        out[i] = ("ok", sent, first, last, n, dec)

    @property
    def trace_window_us(self) -> int:
        """From the trace's first arrival to its last."""
        return self.requests[-1].arrival_us - self.requests[0].arrival_us

    async def window_busy(self, session, t0: float) -> tuple[int, int]:
        """The engines' prefill-busy time (modelled us) from the first arrival to the last, and
        the window it covers: read from each engine when the last request is due (both start at
        ``t0``: the engines idle before it).  Where the read comes late (a loaded machine wakes
        this task after the last arrival), the engines went on working meanwhile, and the window
        is the one the read covers: from the first arrival to the read, in modelled time."""
        scale = self.args.time_scale
        first = t0 + self.requests[0].arrival_us / 1e6 * scale
        last = t0 + self.requests[-1].arrival_us / 1e6 * scale
        await asyncio.sleep(max(0.0, last - time.monotonic()))
        busy = sum(int(st["prefill_busy_now_us"]) for st in await self.engine_stats(session))
        return busy, max(self.trace_window_us, round((time.monotonic() - first) / scale * 1e6))

    async def engine_stats(self, session) -> list[dict]:
        """Each engine's ``/sim/stats``, in the order of ``engine_urls``."""
        stats = []
        for url in self.engine_urls:
            async with session.get(url + "/sim/stats") as r:
                stats.append(await r.json())
        return stats

    async def replay(self) -> dict:
        a = self.args
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            base = await self.start(s)
            out: list = [None] * len(self.requests)
            t0 = time.monotonic() + 0.2
            window = asyncio.create_task(self.window_busy(s, t0))
            await asyncio.gather(*(self.one(s, base, i, t0, out) for i in range(len(self.requests))))
            span_s = time.monotonic() - t0
            window_busy_us, window_us = await window
            stats = await self.engine_stats(s)
            async with s.get(f"http://127.0.0.1:{self.admin_port}/metrics") as r:      # the operator's
                metrics = await r.text()
        scale = a.time_scale
        res = PolicyResult(self.policy)
        errors = [o[1] for o in out if o[0] == "error"]
        decision_hits = prompt_blocks = 0
        for o in out:
            if o[0] != "ok":
                continue
            _, sent, first, last, n, dec = o
            res.ttft_ms.append((first - sent) * 1e3 / scale)
            res.tpot_ms.append((last - first) * 1e3 / scale / (n - 1) if n > 1 else 0.0)
            decision_hits += int(dec.get("local-hits", 0))
            prompt_blocks += int(dec.get("prompt-blocks", 0))
        res.prompt_tokens = sum(st["prompt_tokens"] for st in stats)
        res.hit_tokens = sum(st["hit_tokens"] for st in stats)
        res.cross_identity_served_blocks = sum(st["cross_identity_hits"] for st in stats)
        # The decision time is the operator's (no client header carries it): its mean, from the histogram.
        n_decisions = scrape(metrics, "quillcache_gateway_decision_seconds_count")
        if n_decisions:
            res.decision_us.append(1e6 * scrape(metrics, "quillcache_gateway_decision_seconds_sum") / n_decisions)
        res.cross_identity_credited_blocks = int(scrape(metrics, "quillcache_gateway_cross_identity_credited_blocks_total"))
        res.refused_blocks = int(scrape(metrics, "quillcache_gateway_reuse_refused_blocks_total"))
        res.makespan_us = int(span_s * 1e6 / scale)
        res.busy_us = [st["busy_us"] for st in stats]
        res.prefill_busy_us = [st["prefill_busy_us"] for st in stats]
        # the load while the trace arrives, as on the virtual clock (PolicyResult.summary)
        res.window_us = window_us
        res.window_prefill_busy_us = window_busy_us
        slo = SloTarget()
        summary = res.summary(slo.ttft_ms, slo.tpot_ms)
        summary.update(errors=len(errors), error_samples=errors[:3], wall_s=span_s,
                       window_s=self.trace_window_us / 1e6,
                       load_window_s=window_us / 1e6,
                       credited_hit_rate=decision_hits / prompt_blocks if prompt_blocks else 0.0,
                       engine_late_ms=sum(st.get("late_us", 0) for st in stats) / 1e3,
                       engine_late_max_ms=max((st.get("late_max_us", 0) for st in stats), default=0) / 1e3,
                       engine_slipped_ms=sum(st.get("slipped_us", 0) for st in stats) / 1e3,
                       retries=int(scrape(metrics, "quillcache_gateway_retries_total")),
                       upstream_errors=int(scrape(metrics, "quillcache_gateway_upstream_errors_total")))
        return summary


def prepare(args, trace: list):
    trace = assign_tenants(trace, args.tenants, args.seed)
    requests = build_requests(trace, args.speedup)
    bodies = [json.dumps({"model": REPLAY_MODEL, "prompt": prompt_tokens(r.trace.hash_ids, r.trace.input_length),
                          "max_tokens": r.trace.output_length, "stream": True}).encode() for r in requests]
    tenants = sorted({r.trace.tenant for r in requests}) if args.tenants > 1 else ["t0"]
    return requests, bodies, tenants


# What the two clocks are compared on: (summary key, True when higher is better)
RANK_METRICS = (("ttft_p50_ms", False), ("goodput", True))


def separated(a: list[float], b: list[float]) -> int:
    """-1 when ``a`` is below ``b`` beyond the run-to-run noise, +1 above, 0 a tie within it.
    Beyond the noise: every run of one is below every run of the other, and their medians
    differ by more than the larger spread (max - min) of the two.  One run each has no
    noise measured: its values are compared as they are."""
    gap = statistics.median(b) - statistics.median(a)
    spread = max(max(a) - min(a), max(b) - min(b))
    if max(a) < min(b) and gap > spread:
        return -1
    if min(a) > max(b) and -gap > spread:
        return 1
    return 0


def ranks(values: dict[str, float]) -> dict[str, float]:
    """1 for the smallest; tied values share their mean rank."""
    order = sorted(values, key=values.get)
    out: dict[str, float] = {}
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: dict[str, float], y: dict[str, float]) -> float:
    rx, ry = ranks(x), ranks(y)
    names = list(x)
    mx, my = statistics.mean(rx.values()), statistics.mean(ry.values())
    cov = sum((rx[n] - mx) * (ry[n] - my) for n in names)
    vx = sum((rx[n] - mx) ** 2 for n in names)
    vy = sum((ry[n] - my) ** 2 for n in names)
    return cov / math.sqrt(vx * vy) if vx and vy else float("nan")


def agreement(live: dict[str, list[float]], virtual: dict[str, list[float]]) -> dict:
    """Pairs of policies ordered on both clocks: judged where both clocks separate them beyond
    their run-to-run noise (``separated``), concordant when they order them the same way."""
    names = list(live)
    judged, discordant, live_only, virtual_only = 0, [], [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            s_live, s_virt = separated(live[a], live[b]), separated(virtual[a], virtual[b])
            if s_live and s_virt:
                judged += 1
                if s_live != s_virt:
                    discordant.append((a, b))
            elif s_live:
                live_only.append((a, b))
            elif s_virt:
                virtual_only.append((a, b))
    med_live = {n: statistics.median(v) for n, v in live.items()}
    med_virt = {n: statistics.median(v) for n, v in virtual.items()}
    return {"pairs": len(names) * (len(names) - 1) // 2, "judged": judged, "concordant": judged - len(discordant),
            "discordant": discordant, "live_only": live_only, "virtual_only": virtual_only,
            "spearman_medians": spearman(med_live, med_virt),
            "live_ranking": sorted(names, key=med_live.get), "virtual_ranking": sorted(names, key=med_virt.get)}


def jittered(requests: list, jitter_ms: float, seed: int) -> list:
    """``requests`` with each arrival later by a uniform draw in [0, ``jitter_ms``) (seeded), in
    arrival order: live, a request reaches its engine after the client's send, two HTTP hops and
    the gateway's parse and routing, none of which takes the same time twice."""
    if not jitter_ms > 0:
        return list(requests)
    rng = random.Random(seed)
    out = [dataclasses.replace(r, arrival_us=r.arrival_us + int(rng.random() * jitter_ms * 1000)) for r in requests]
    out.sort(key=lambda r: r.arrival_us)
    return out


def virtual_runs(args, requests, policies: list[str]) -> dict[str, list[dict]]:
    """The same requests on the virtual clock (router_replay's engines), ``--repeats`` times: run
    ``i`` with router seed ``i`` (its tie breaks) and arrivals jittered by ``--virtual-jitter-ms``
    with seed ``i`` (the live path's own variation), so that the virtual clock's spread, like the
    live one's, shows how far the exact arrival times move a figure."""
    slo = SloTarget()
    cfg = router_replay.engine_config(args.kv_gib)
    return {p: [run_policy(jittered(requests, args.virtual_jitter_ms, seed), p, args.engines, cfg,
                           seed=seed).summary(slo.ttft_ms, slo.tpot_ms)
                for seed in range(args.repeats)] for p in policies}


def compare(live_runs: dict[str, list[dict]], virtual: dict[str, list[dict]]) -> dict:
    out = {}
    for key, higher_better in RANK_METRICS:
        sign = -1.0 if higher_better else 1.0       # rank so that 1 is the best
        out[key] = agreement({p: [sign * r[key] for r in rs] for p, rs in live_runs.items()},
                             {p: [sign * r[key] for r in rs] for p, rs in virtual.items()})
    return out


def run(args, trace: list) -> dict:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"gateway_replay: unknown policies {unknown} (known: {', '.join(POLICIES)})")
    requests, bodies, tenants = prepare(args, trace)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for rep in range(args.repeats):
        # each repeat starts one policy later, so a drift in the machine's load spreads over all
        for policy in policies[rep % len(policies):] + policies[:rep % len(policies)]:
            r = Run(args, policy, requests, bodies, tenants)
            try:
                got = asyncio.run(r.replay())
            except BaseException:
                r.procs.stop(keep=True)
                raise
            r.procs.stop(keep=args.keep_logs or got["errors"] > 0)
            got["loadavg"] = os.getloadavg()[0]
            runs[policy].append(got)
            print(f"  {policy} (run {rep + 1}/{args.repeats}): {got['requests']} requests, {got['errors']} errors, "
                  f"TTFT p50 {got['ttft_p50_ms']:.0f} ms, goodput {got['goodput']:.3f}, engines late "
                  f"{got['engine_late_ms']:.0f} ms (max {got['engine_late_max_ms']:.1f}), slipped "
                  f"{got['engine_slipped_ms']:.0f} ms, load average {got['loadavg']:.1f}", file=sys.stderr, flush=True)
    results = {p: median_run(rs) for p, rs in runs.items()}
    doc = {"policies": results, "runs": runs,
            "config": {"trace": args.trace, "engines": args.engines, "speedup": args.speedup,
                       "tenants": args.tenants, "seed": args.seed, "kv_gib": args.kv_gib, "limit": args.limit,
                       "trace_block_tokens": args.trace_block_tokens,
                       "time_scale": args.time_scale, "through": "quillcache-gateway",
                       "virtual_jitter_ms": args.virtual_jitter_ms if args.virtual else None,
                       "slo": {"ttft_ms": SloTarget().ttft_ms, "tpot_ms": SloTarget().tpot_ms},
                       "cost_model": {"prefill_us_per_token": H200_LLAMA3_8B.prefill_us_per_token,
                                      "decode_us_per_token": H200_LLAMA3_8B.decode_us_per_token,
                                      "running_decode_penalty_us": H200_LLAMA3_8B.running_decode_penalty_us},
                       "capacity_blocks_per_engine": router_replay.engine_config(args.kv_gib).capacity_blocks,
                       "repeats": args.repeats}}
    if args.virtual:
        virtual = virtual_runs(args, requests, policies)
        doc["virtual"] = {p: median_run(rs) for p, rs in virtual.items()}
        doc["virtual_runs"] = virtual
        doc["agreement"] = compare(runs, virtual)
    return doc


def median_run(rs: list[dict]) -> dict:
    """The run whose TTFT p50 is the median of the repeats (the table shows one real run)."""
    return sorted(rs, key=lambda r: r["ttft_p50_ms"])[(len(rs) - 1) // 2]


def agreement_text(doc: dict) -> str:
    lines = []
    for key, a in doc["agreement"].items():
        lines.append(f"{key}: live {' < '.join(a['live_ranking'])}")
        lines.append(f"{' ' * len(key)}  virtual {' < '.join(a['virtual_ranking'])}")
        lines.append(f"{' ' * len(key)}  pairs separated beyond the noise on both clocks {a['judged']} of "
                     f"{a['pairs']}: {a['concordant']} in the same order, discordant {a['discordant'] or 'none'}; "
                     f"separated live only {len(a['live_only'])}, virtual only {len(a['virtual_only'])}; "
                     f"Spearman of the medians {a['spearman_medians']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--speedup", type=float, default=2.75, help="trace time divided by this")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="tenant assignment")
    ap.add_argument("--kv-gib", type=float, default=router_replay.H200_KV_GIB, help="KV cache per engine")
    ap.add_argument("--limit", type=int, default=160, help="replay only the first N requests (0: all)")
    router_replay.add_trace_block_arg(ap)
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="wall seconds per modelled second (< 1: faster than the modelled GPU)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="live runs per policy (the run-to-run noise), and virtual runs (router seed and arrival jitter each)")
    ap.add_argument("--virtual", action="store_true",
                    help="also replay on the virtual clock and compare the rankings beyond the noise")
    ap.add_argument("--virtual-jitter-ms", type=float, default=VIRTUAL_JITTER_MS, metavar="MS",
                    help="on the virtual clock, each arrival later by a uniform draw in [0, MS) per repeat, "
                         "the variation the live path adds (default: %(default)s; 0: the trace's exact times)")
    ap.add_argument("--json-out", type=out_path, default=None)
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep each run's engine and gateway logs (they are kept anyway where a run fails)")
    args = ap.parse_args(argv)
    if args.engines < 1 or args.tenants < 1 or not args.speedup > 0 or not args.time_scale > 0 \
            or args.repeats < 1:
        ap.error("--engines, --tenants and --repeats must be >= 1, --speedup and --time-scale > 0")
    if not 0 <= args.virtual_jitter_ms <= 60_000:
        ap.error(f"--virtual-jitter-ms {args.virtual_jitter_ms}: must be in 0..60000")
    trace = router_replay.check_trace(ap, args.trace, args.limit, args.trace_block_tokens)
    t0 = time.perf_counter()
    doc = run(args, trace)
    print(router_replay.table(doc))
    if "virtual" in doc:
        print("the same requests on the virtual clock:")
        print(router_replay.table({"policies": doc["virtual"], "config": doc["config"]}))
        print(agreement_text(doc))
    errors = sum(r["errors"] for r in doc["policies"].values())
    print(f"through quillcache-gateway: {args.engines} engines, {args.limit or 'all'} requests, speed-up "
          f"{args.speedup}, {args.tenants} tenant(s), time scale {args.time_scale}; client errors {errors} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
