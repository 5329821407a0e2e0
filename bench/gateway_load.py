"""Load on the gateway: N concurrent streaming clients for D seconds, against simulated engines.

Two phases in one run, the same load each: clients straight to the engines (round robin,
the baseline), then through a quillcache-gateway in front of the same engines.  With one
engine (the default) routing cannot help, so the TTFT difference is the gateway's own cost;
with several, it is round robin against cache-aware routing.  Prints
requests, errors (non-200 answers and error events), TTFT p50/p99 of both, the gateway's
added TTFT, and the gateway's RSS at start, peak and end (sampled from /proc).

    .venv/bin/python bench/gateway_load.py [--clients 200] [--seconds 60] [--json-out F]

Every process runs on this machine (loopback); the engines, the gateway and this client
share its cores, so absolute times are noise: the ratio and the difference are the result.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests._support.ports
from bench._outpath import out_path
from bench._serve import Processes
from tests._support.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFIXES = 32                  # shared system prompts the clients draw from
MAX_TOKENS = 16                # tokens per answer


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def prefixes() -> list[str]:
    return [" ".join(f"p{i}w{j}" for j in range(120)) for i in range(PREFIXES)]


async def warm(urls: list[str]) -> None:
    """Each shared prefix once on every engine, before either phase: the first phase would
    otherwise pay for the engines' cold caches and first requests, and the second not."""
    async with aiohttp.ClientSession() as s:
        for url in urls:
            for prefix in prefixes():
                body = {"model": "sim-model", "prompt": prefix, "max_tokens": 1, "stream": False}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise SystemExit(f"gateway_load: warming {url}: HTTP {r.status}: {(await r.read())[:200]!r}")
                    await r.read()


async def load(urls: list[str], clients: int, seconds: float, seed: int, phase: str) -> dict:
    """``clients`` streaming clients for ``seconds``; the prompts draw the same prefixes and lengths
    in each phase (``seed``) and name the phase after the prefix, so that no phase finds the
    other's prompts cached."""
    rng = random.Random(seed)
    prefixes_ = prefixes()
    ttft, errors, done = [], 0, 0
    stop_at = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def client(c: int) -> None:
            nonlocal errors, done
            i = 0
            while time.monotonic() < stop_at:
                url = urls[(c + i) % len(urls)]
                i += 1
                prompt = rng.choice(prefixes_) + f" {phase} question {c} {i} " + "x " * rng.randrange(8, 64)
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            continue
                        first = None
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                            if b'"error"' in chunk:
                                errors += 1
                        ttft.append((first or time.perf_counter()) - t0)
                        done += 1
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    errors += 1
        await asyncio.gather(*(client(c) for c in range(clients)))
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else [0.0] * 99
    return {"requests": done, "errors": errors, "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else 0.0,
            "ttft_p99_ms": 1e3 * q[98]}


async def main_async(args) -> dict:
    procs = Processes("qc-gwload-", "gateway_load")
    ok = False
    try:
        engines = []
        async with aiohttp.ClientSession() as session:
            for i in range(args.engines):
                port, ev, rp = free_port(), free_port(), free_port()
                p = procs.spawn([str(BIN / "quillcache-sim-engine"), "--port", str(port), "--model", "sim-model",
                                 "--kv-events", f"tcp://127.0.0.1:{ev}", "--kv-events-replay",
                                 f"tcp://127.0.0.1:{rp}", "--capacity-blocks", "16384"], f"engine-{i}")
                engines.append((f"http://127.0.0.1:{port}", ev, rp, p))
            for i, (url, _, _, p) in enumerate(engines):
                await procs.wait_http(session, url + "/health", p, f"engine-{i}")
        gport = free_port()
        cfg = procs.tmp / "gateway.toml"
        cfg.write_text(f'[gateway]\nlisten = "127.0.0.1:{gport}"\nadmin_listen = "127.0.0.1:{free_port()}"\nqueue_limit = {10 * args.clients}\n' + "".join(
            f'[[gateway.engines]]\nid = "e{i}"\nurl = "{u}"\nmodel = "sim-model"\n'
            f'kv_events = "tcp://127.0.0.1:{ev}"\nkv_replay = "tcp://127.0.0.1:{rp}"\n'
            for i, (u, ev, rp, _) in enumerate(engines)))
        await warm([u for u, _, _, _ in engines])
        direct = await load([u for u, _, _, _ in engines], args.clients, args.seconds, seed=1,
                            phase="direct")
        gw = procs.spawn([str(BIN / "quillcache-gateway"), "--config", str(cfg)], "gateway")
        async with aiohttp.ClientSession() as session:
            await procs.wait_http(session, f"http://127.0.0.1:{gport}/health", gw, "gateway")
        rss = [rss_kib(gw.pid)]

        async def sample() -> None:
            while True:
                await asyncio.sleep(1.0)
                rss.append(rss_kib(gw.pid))

        sampler = asyncio.create_task(sample())
        via = await load([f"http://127.0.0.1:{gport}"], args.clients, args.seconds, seed=1, phase="gateway")
        sampler.cancel()
        rss.append(rss_kib(gw.pid))
        alive = gw.poll() is None
        ok = alive and direct["errors"] == 0 and via["errors"] == 0
    finally:
        procs.stop(keep=args.keep_logs or not ok)
    return {"clients": args.clients, "seconds": args.seconds, "direct": direct, "gateway": via,
            "gateway_alive_at_end": alive,
            "added_ttft_p50_ms": via["ttft_p50_ms"] - direct["ttft_p50_ms"],
            "added_ttft_p99_ms": via["ttft_p99_ms"] - direct["ttft_p99_ms"],
            "gateway_rss_mib": {"start": rss[0] / 1024, "peak": max(rss) / 1024, "end": rss[-1] / 1024},
            "gateway_rss_mib_each_second": [round(r / 1024, 1) for r in rss]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=1,
                    help="1 (default): routing cannot help, so the difference is the gateway's cost; "
                         "more: direct round robin against the gateway's cache-aware routing")
    ap.add_argument("--json-out", type=out_path)
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the engines' and the gateway's logs (kept anyway where the run fails)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.engines < 1 or not args.seconds > 0:
        ap.error("--clients and --engines must be >= 1, --seconds > 0")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    r = asyncio.run(main_async(args))
    d, g = r["direct"], r["gateway"]
    print(f"{args.clients} streaming clients x {args.seconds:.0f} s, {args.engines} simulated engines\n")
    print("| path | requests | errors | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|")
    print(f"| direct to engines | {d['requests']} | {d['errors']} | {d['ttft_p50_ms']:.1f} | {d['ttft_p99_ms']:.1f} |")
    print(f"| through the gateway | {g['requests']} | {g['errors']} | {g['ttft_p50_ms']:.1f} | {g['ttft_p99_ms']:.1f} |")
    m = r["gateway_rss_mib"]
    print(f"\nadded TTFT: p50 {r['added_ttft_p50_ms']:+.1f} ms, p99 {r['added_ttft_p99_ms']:+.1f} ms; "
          f"gateway RSS {m['start']:.0f} -> peak {m['peak']:.0f} -> end {m['end']:.0f} MiB; "
          f"gateway alive at end: {r['gateway_alive_at_end']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(r, indent=2))
    return 0 if g["errors"] == 0 and r["gateway_alive_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
