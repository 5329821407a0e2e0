"""The gateway against real simulated engines (HTTP + ZMQ KV events) on loopback."""
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import aiohttp
import pytest

from quillcache.control.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventPublisher, encode_batch,
)
from quillcache.gateway.settings import EngineSpec
from tests._support.gateway import free_port, harness, read_sse

PROMPT = "the quick brown fox jumps over the lazy dog " * 12        # 528 tokens in bytes mode


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def decision(headers):
    return {k[len("x-quillcache-"):]: v for k, v in headers.items() if k.lower().startswith("x-quillcache-")}


async def refused_blocks(h) -> float:
    """The operator's count of prefix blocks refused credit (the admin address's /metrics)."""
    text = await (await h.session.get(h.admin + "/metrics")).text()
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("quillcache_gateway_reuse_refused_blocks_total ")))


def test_stream_passes_through_with_decision_headers_before_the_first_chunk():
    async def main():
        async with harness(time_scale=20.0) as h:       # a slow engine: prefill takes a while
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "stream": True}
            t0 = time.perf_counter()
            async with h.session.post(h.base + "/v1/completions", json=body, headers=h.headers()) as r:
                t_head = time.perf_counter()
                d = decision(r.headers)
                first = await r.content.readany()
                t_first = time.perf_counter()
                rest = await r.read()
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert set(d) >= {"worker", "overlap-blocks", "local-hits", "plan", "prompt-blocks", "tokenizer"}
            assert not set(d) & {"reuse-refused", "decision-us"}      # another identity's, the operator's
            assert d["worker"] in ("e0", "e1") and d["tokenizer"] == "approximate"
            assert d["prompt-blocks"] == str(len(PROMPT) // 16)
            assert d["overlap-blocks"] == "device=0, host=0, disk=0, pool=0"
            assert d["plan"] == f"hit=0, fetch=0, recompute={len(PROMPT) // 16}"
            # The headers were there before the first token (the engine is still prefilling).
            assert t_head - t0 < t_first - t0
            assert first.startswith(b"data: ")
            events = (first + rest).split(b"\n\n")
            assert events[-2] == b"data: [DONE]" and len([e for e in events if e.startswith(b"data: {")]) == 5
            await h.wait_idle()
    run(main())


def test_same_tenant_reuses_another_tenant_is_refused_credit():
    async def main():
        async with harness() as h:
            st, hd, _ = await h.complete(PROMPT, "acme")
            assert st == 200
            first = decision(hd)["worker"]
            # The engine cached it under cache_salt "tenant=acme", the connectors' convention.
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "cache_salt": "tenant=acme"}
            async with h.session.post(h.urls[int(first[1:])] + "/v1/completions", json=body) as r:
                usage = (await r.json())["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == (len(PROMPT) - 1) // 16 * 16
            await asyncio.sleep(1.0)
            st, hd, _ = await h.complete(PROMPT + "again", "acme")
            d = decision(hd)
            assert d["worker"] == first and int(d["local-hits"]) == len(PROMPT) // 16
            assert await refused_blocks(h) == 0
            st, hd, _ = await h.complete(PROMPT + "other", "globex")
            d = decision(hd)
            assert d["local-hits"] == "0" and "reuse-refused" not in d
            assert await refused_blocks(h) == len(PROMPT) // 16          # counted for the operator only
            # an adapter is another identity too, however the request names it: vLLM's model
            # name, SGLang's "base:adapter" or its lora_path field
            for i, how in enumerate(({"model": "lora-x"}, {"model": "m:lora-x"}, {"lora_path": "lora-x"})):
                prompt = f"{i} {PROMPT}"
                assert (await h.complete(prompt, "acme"))[0] == 200         # the base model caches it
                before = await refused_blocks(h)
                st, hd, _ = await h.complete(prompt + "lora", "acme", **how)
                assert st == 200 and decision(hd)["local-hits"] == "0", how
                assert await refused_blocks(h) - before == len(prompt) // 16, how
            st, _, data = await h.complete(PROMPT, "acme", lora_path="nope")
            assert st == 404 and b"adapter 'nope' is not served" in data
            st, _, data = await h.complete(PROMPT, "acme", model="lora-x", lora_path="other")
            assert st == 400 and b"lora_path" in data
            await h.wait_idle()
    run(main())


def test_predictions_are_dropped_when_the_engine_events_contradict_them():
    async def main():
        # A cache of 48 blocks: the second long prompt (38 blocks) evicts the first (33) from it.
        async with harness(n=1, capacity_blocks=48) as h:
            st, _, _ = await h.complete(PROMPT, "acme", stream=False)
            assert st == 200
            await asyncio.sleep(0.2)
            _, hd, _ = await h.complete(PROMPT + "x", "acme")
            assert int(decision(hd)["local-hits"]) == len(PROMPT) // 16
            st, _, body = await h.complete("lazy dog over the fox " * 28, "acme", stream=False)
            assert st == 200, body
            # CONFIRM_AFTER_S, then up to one SWEEP_INTERVAL_S: the sweep checks the events.
            await asyncio.sleep(3.5)
            _, hd, _ = await h.complete(PROMPT + "y", "acme")
            assert int(decision(hd)["local-hits"]) < len(PROMPT) // 16
    run(main())


def test_429_with_retry_after_when_every_engine_is_at_its_queue_limit():
    async def main():
        async with harness(n=1, gateway_toml="queue_limit = 1\nretry_after = \"2s\"", time_scale=5.0) as h:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 50, "stream": True}
            async with h.session.post(h.base + "/v1/completions", json=body, headers=h.headers()) as r1:
                await r1.content.readany()
                st, hd, data = await h.complete("hello", max_tokens=1)
                assert st == 429 and hd["Retry-After"] == "2"
                assert json.loads(data)["error"]["type"] == "rate_limit_error"
                await r1.read()
            await h.wait_idle()
            st, _, _ = await h.complete("hello", max_tokens=1)
            assert st == 200
    run(main())


def test_a_dead_engine_before_the_first_byte_is_retried_once_elsewhere():
    async def main():
        # round_robin: the first request goes to the first engine listed, the dead one.
        async with harness(n=1, dead_engines=1, gateway_toml='[router]\npolicy = "round_robin"') as h:
            seen = set()
            for i in range(4):
                st, hd, data = await h.complete(f"{i} {PROMPT}", stream=bool(i % 2))
                assert st == 200, data
                d = decision(hd)
                assert d["worker"] == "e0"
                seen.add(d.get("retried"))
            assert "1" in seen                 # at least one request first went to the dead engine
            assert h.gw.engines["dead0"].errors >= 1
            metrics = (await (await h.session.get(h.admin + "/metrics")).read()).decode()
            assert "quillcache_gateway_retries_total 1" in metrics or "quillcache_gateway_retries_total 2" in metrics
            await h.wait_idle()
    run(main())


def test_client_disconnect_cancels_upstream_and_frees_router_state():
    async def main():
        async with harness(n=1, time_scale=5.0) as h:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": True}
            r = await h.session.post(h.base + "/v1/completions", json=body, headers=h.headers())
            await r.content.readany()
            assert h.gw.engines["e0"].in_flight == 1
            r.close()                                   # the client goes away mid-answer
            await h.wait_idle(5.0)
            # The engine sees the closed connection at its next token and drops the request
            # (200 tokens at 30 ms each: it would still be running otherwise).
            for _ in range(250):
                async with h.session.get(h.urls[0] + "/sim/stats") as s:
                    stats = await s.json()
                if stats["aborted"]:
                    break
                await asyncio.sleep(0.02)
            assert stats["aborted"] == 1 and stats["running"] == 0
            metrics = (await (await h.session.get(h.admin + "/metrics")).read()).decode()
            assert "quillcache_gateway_client_disconnects_total 1.0" in metrics
    run(main())


@pytest.mark.parametrize("case", ["json", "oversize", "model", "key", "nokey", "prompt", "long", "stream"])
def test_bad_requests_get_a_clear_4xx_and_the_gateway_keeps_serving(case):
    async def main():
        async with harness(n=1, gateway_toml='max_body = "4KiB"\nmax_prompt_tokens = 1000') as h:
            url, hdrs, data = h.base + "/v1/completions", h.headers(), None
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            expect = {"json": 400, "oversize": 413, "model": 404, "key": 401, "nokey": 401, "prompt": 400,
                      "long": 400, "stream": 400}[case]
            if case == "json":
                data = b"{not json"
            elif case == "oversize":
                body["prompt"] = "x" * 8192
            elif case == "model":
                body["model"] = "nope"
            elif case == "key":
                hdrs = {"Authorization": "Bearer wrong"}
            elif case == "nokey":
                hdrs = {}
            elif case == "prompt":
                body["prompt"] = {"a": 1}
            elif case == "long":
                body["prompt"] = "x" * 1001                 # over max_prompt_tokens, under max_body
            elif case == "stream":
                body["stream"] = "yes"
            kw = {"data": data, "headers": {**hdrs, "Content-Type": "application/json"}} if data else \
                {"json": body, "headers": hdrs}
            async with h.session.post(url, **kw) as r:
                assert r.status == expect
                err = (await r.json())["error"]
                assert err["message"] and err["code"] == expect
            st, _, _ = await h.complete("still fine", max_tokens=1)
            assert st == 200
    run(main())


def test_models_health_metrics_and_workers():
    async def main():
        async with harness(n=2) as h:
            await h.complete(PROMPT, stream=True)
            async with h.session.get(h.base + "/v1/models", headers=h.headers()) as r:
                ids = [m["id"] for m in (await r.json())["data"]]
            assert ids == ["m", "lora-x"]
            async with h.session.get(h.base + "/health") as r:
                assert r.status == 200 and sorted((await r.json())["healthy"]) == ["e0", "e1"]
            async with h.session.get(h.admin + "/quillcache/workers") as r:
                workers = {w["id"]: w for w in (await r.json())["workers"]}
            assert sum(w["routed"] for w in workers.values()) == 1
            async with h.session.get(h.admin + "/quillcache/hot?n=3") as r:
                assert len((await r.json())["hot"]) == 1
            text = (await (await h.session.get(h.admin + "/metrics")).read()).decode()
            for name in ("quillcache_gateway_ttft_seconds_bucket", "quillcache_gateway_inter_token_seconds_count",
                         "quillcache_gateway_hit_blocks_total", "quillcache_gateway_decisions_total",
                         "quillcache_gateway_reuse_refused_blocks_total", "quillcache_gateway_slo_requests_total",
                         "quillcache_gateway_upstream_errors", "quillcache_gateway_retries_total"):
                assert name in text, name
            # One streamed request finished: counted once, met or not (its TTFT depends on the load).
            met = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("quillcache_gateway_slo_requests_total{")]
            assert sum(met) == 1.0
    run(main())


def test_an_engine_silent_on_events_while_serving_is_marked_unhealthy():
    async def main():
        # e0 is real; "mute" has a live HTTP server (e0's) but an event endpoint nobody publishes on.
        async with harness(n=1, gateway_toml='unhealthy_after = "0.5s"\n[router]\npolicy = "round_robin"') as h:
            h.gw.add_engine(EngineSpec("mute", "m", h.urls[0], adapters=("lora-x",),
                                       kv_events=f"tcp://127.0.0.1:{free_port()}"))
            workers = [decision((await h.complete(f"{i} {PROMPT}", max_tokens=1))[1])["worker"] for i in range(2)]
            assert "mute" in workers
            await asyncio.sleep(0.8)
            workers = [decision((await h.complete(f"x{i} {PROMPT}", max_tokens=1))[1])["worker"] for i in range(4)]
            assert workers == ["e0"] * 4
            async with h.session.get(h.admin + "/quillcache/workers") as r:
                w = {x["id"]: x for x in (await r.json())["workers"]}
            assert not w["mute"]["healthy"] and "no KV events" in w["mute"]["reason"]
    run(main())


def test_an_event_gap_is_replayed_and_the_blocks_it_carried_are_credited():
    async def main():
        pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        try:
            async with harness(n=1, auth=False) as h:
                # "ext" serves through e0's HTTP server; its events come from this test's publisher.
                h.gw.add_engine(EngineSpec("ext", "m", h.urls[0], adapters=("lora-x",),
                                           kv_events=pub.endpoint, kv_replay=pub.replay_endpoint))
                while not h.gw.router.event_stats("ext")["batches"]:       # the SUB socket joined
                    pub.publish([AllBlocksCleared()])
                    await asyncio.sleep(0.05)
                n = len(PROMPT) // 16
                stored = BlockStored(tuple(range(1000, 1000 + n)), None, tuple(ord(c) for c in PROMPT[:n * 16]), 16)
                with pub._lock:          # test-only: a batch the PUB socket dropped, kept for replay
                    pub._buffer.append((pub._seq, encode_batch(EventBatch(time.time(), (stored,)))))
                    pub._seq += 1
                pub.publish([BlockRemoved((999_999,))])                  # reveals the gap
                while h.gw.router.event_stats("ext")["replayed"] < 1:
                    await asyncio.sleep(0.02)
                st, hd, _ = await h.complete(PROMPT + "after the gap", tenant="")
                d = decision(hd)
                assert st == 200 and d["worker"] == "ext" and d["local-hits"] == str(n)
                async with h.session.get(h.admin + "/quillcache/workers") as r:
                    ev = {x["id"]: x["events"] for x in (await r.json())["workers"]}["ext"]
                assert ev["gaps"] == 1 and ev["replayed"] >= 1 and ev["lost"] == 0
                await h.wait_idle()
        finally:
            pub.close()
    run(main())


def test_the_decision_costs_nothing_measurable_in_ttft_against_a_direct_request():
    async def main():
        # One slow engine (prefill of the prompt ~150 ms); every prompt is new, so no request
        # hits a cache; direct and through-the-gateway requests alternate.
        async with harness(n=1, time_scale=10.0, auth=False) as h:
            ttft = {"direct": [], "gateway": []}
            for i in range(6):
                for path, base in (("direct", h.urls[0]), ("gateway", h.base)):
                    body = {"model": "m", "prompt": f"{i} {path} {PROMPT}", "max_tokens": 2, "stream": True}
                    t0 = time.perf_counter()
                    async with h.session.post(base + "/v1/completions", json=body) as r:
                        first = await r.content.readany()
                        ttft[path].append(time.perf_counter() - t0)
                        await r.read()
                    assert r.status == 200 and first.startswith(b"data: {")
            direct, via = statistics.median(ttft["direct"]), statistics.median(ttft["gateway"])
            print(f"TTFT median direct {direct * 1e3:.1f} ms, through the gateway {via * 1e3:.1f} ms")
            assert direct > 0.1                                      # the prefill dominates
            assert via - direct < max(0.03, 0.1 * direct)
    run(main())


def test_exact_tokenizer_and_chat(tokenizer_file):
    async def main():
        async with harness(n=1, tokenizer=tokenizer_file) as h:
            msgs = [{"role": "user", "content": "hello world " * 20}]
            st, hd, data = await h.complete(msgs, path="/v1/chat/completions")
            assert st == 200 and decision(hd)["tokenizer"] == "exact"
            assert b'"role":"assistant"' in data
            st, hd, _ = await h.complete("the quick brown fox " * 10)
            assert st == 200 and decision(hd)["prompt-blocks"] == str(40 // 16)
    run(main())


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_engine_killed_or_silent_mid_stream_ends_with_an_error_event(tmp_path, how):
    """SIGKILL: the connection breaks; SIGSTOP: it stays open and silent past idle_timeout."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quillcache_cli.sim_engine", "--port", str(port),
                             "--model", "m", "--time-scale", "5"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("READY"), line

        async def main():
            from quillcache.gateway.server import start
            from quillcache.gateway.settings import load_gateway_config
            cfg = load_gateway_config(text='[gateway]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
                                           f'idle_timeout = "0.5s"\n'
                                           f'[[gateway.engines]]\nid = "e0"\nurl = "http://127.0.0.1:{port}"\n'
                                           'model = "m"\n')
            gw, runner, (host, gport) = await start(cfg)
            try:
                async with aiohttp.ClientSession() as s:
                    body = {"model": "m", "prompt": PROMPT, "max_tokens": 500, "stream": True}
                    async with s.post(f"http://{host}:{gport}/v1/completions", json=body) as r:
                        assert r.status == 200
                        await r.content.readany()
                        os.kill(proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                        events = await read_sse(r)
                assert events[-1] == b"[DONE]"
                err = json.loads(events[-2])["error"]
                assert err["type"] == "upstream_error" and "stopped mid-answer" in err["message"]
                assert ("TimeoutError" in err["message"]) == (how == "stopped")
                for _ in range(100):
                    if gw.engines["e0"].in_flight == 0 and not gw.router.load_of("e0")["active_requests"]:
                        break
                    await asyncio.sleep(0.02)
                assert gw.engines["e0"].in_flight == 0
                assert gw.router.load_of("e0")["active_requests"] == 0
            finally:
                await runner.cleanup()
        run(main())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
