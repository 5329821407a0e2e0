"""Replay a Mooncake-format trace through a real quillcache-gateway process in front of N
simulated engines, once per routing policy ([router] policy), in one run; print the table of
bench/router_replay.py (TTFT p50/p99, hit rate, goodput under the SLO, cross-tenant blocks
credited and served), with ratios against round_robin measured in the same run.

    .venv/bin/python bench/gateway_replay.py \\
        --trace /work/shared/data/traces/mooncake_conversation_trace.jsonl \\
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
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import router_replay  # noqa: E402
from quillcache.settings.convert import hash_token  # noqa: E402
from quillcache.control.model import SloTarget  # noqa: E402
from quillcache.protocol.route import POLICIES  # noqa: E402
from quillcache.control.sim.engine import H200_LLAMA3_8B  # noqa: E402
from quillcache.control.sim.replay import REPLAY_MODEL, PolicyResult, block_token_ids, build_requests  # noqa: E402
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, assign_tenants, load_trace  # noqa: E402

START_TIMEOUT_S = 60.0          # seconds each process has to come up
MAX_MODEL_LEN = 1 << 20         # tokens: the engines refuse nothing the router replay would take


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_tokens(hash_ids, input_length: int, bs: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """The prompt of a trace request as token ids: block id h is h, 1, .., bs-1 (router_replay)."""
    out: list[int] = []
    for h in hash_ids:
        out.extend(block_token_ids(h, bs))
    return out[:input_length]


def tenant_key(tenant: str) -> str:
    return f"replay-key-{tenant}-0123456789"


async def wait_http(session, url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"gateway_replay: {what} exited with {proc.returncode}")
        try:
            async with session.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"gateway_replay: {what} did not answer {url} in {START_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.1)


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
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="qc-gwreplay-"))

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    async def start(self, session) -> str:
        a = self.args
        cap = router_replay.engine_config(a.kv_gib)
        engines = []
        for i in range(a.engines):
            port, ev, rp = free_port(), free_port(), free_port()
            p = self._spawn([str(BIN / "quillcache-sim-engine"), "--port", str(port), "--model", REPLAY_MODEL,
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
            await wait_http(session, url + "/health", p, eid)
        gw = self._spawn([str(BIN / "quillcache-gateway"), "--config", str(self.tmp / "gateway.toml")], "gateway")
        base = f"http://127.0.0.1:{gport}"
        await wait_http(session, base + "/health", gw, "quillcache-gateway")
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

    async def replay(self) -> dict:
        a = self.args
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            base = await self.start(s)
            out: list = [None] * len(self.requests)
            t0 = time.monotonic() + 0.2
            await asyncio.gather(*(self.one(s, base, i, t0, out) for i in range(len(self.requests))))
            span_s = time.monotonic() - t0
            stats = []
            for url in self.engine_urls:
                async with s.get(url + "/sim/stats") as r:
                    stats.append(await r.json())
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
        slo = SloTarget()
        summary = res.summary(slo.ttft_ms, slo.tpot_ms)
        summary.update(errors=len(errors), error_samples=errors[:3], wall_s=span_s,
                       credited_hit_rate=decision_hits / prompt_blocks if prompt_blocks else 0.0,
                       retries=int(scrape(metrics, "quillcache_gateway_retries_total")),
                       upstream_errors=int(scrape(metrics, "quillcache_gateway_upstream_errors_total")))
        return summary


def prepare(args):
    trace = assign_tenants(load_trace(args.trace, args.limit), args.tenants, args.seed)
    requests = build_requests(trace, args.speedup)
    bodies = [json.dumps({"model": REPLAY_MODEL, "prompt": prompt_tokens(r.trace.hash_ids, r.trace.input_length),
                          "max_tokens": r.trace.output_length, "stream": True}).encode() for r in requests]
    tenants = sorted({r.trace.tenant for r in requests}) if args.tenants > 1 else ["t0"]
    return requests, bodies, tenants


def run(args) -> dict:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"gateway_replay: unknown policies {unknown} (known: {', '.join(POLICIES)})")
    requests, bodies, tenants = prepare(args)
    results = {}
    for policy in policies:
        r = Run(args, policy, requests, bodies, tenants)
        try:
            results[policy] = asyncio.run(r.replay())
        finally:
            r.stop()
        print(f"  {policy}: {results[policy]['requests']} requests, {results[policy]['errors']} errors, "
              f"{results[policy]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return {"policies": results,
            "config": {"trace": args.trace, "engines": args.engines, "speedup": args.speedup,
                       "tenants": args.tenants, "seed": args.seed, "kv_gib": args.kv_gib, "limit": args.limit,
                       "time_scale": args.time_scale, "through": "quillcache-gateway",
                       "slo": {"ttft_ms": SloTarget().ttft_ms, "tpot_ms": SloTarget().tpot_ms},
                       "cost_model": {"prefill_us_per_token": H200_LLAMA3_8B.prefill_us_per_token,
                                      "decode_us_per_token": H200_LLAMA3_8B.decode_us_per_token,
                                      "running_decode_penalty_us": H200_LLAMA3_8B.running_decode_penalty_us},
                       "capacity_blocks_per_engine": router_replay.engine_config(args.kv_gib).capacity_blocks}}


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
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="wall seconds per modelled second (< 1: faster than the modelled GPU)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.engines < 1 or args.tenants < 1 or not args.speedup > 0 or not args.time_scale > 0:
        ap.error("--engines and --tenants must be >= 1, --speedup and --time-scale > 0")
    t0 = time.perf_counter()
    doc = run(args)
    print(router_replay.table(doc))
    errors = sum(r["errors"] for r in doc["policies"].values())
    print(f"through quillcache-gateway: {args.engines} engines, {args.limit or 'all'} requests, speed-up "
          f"{args.speedup}, {args.tenants} tenant(s), time scale {args.time_scale}; client errors {errors} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
