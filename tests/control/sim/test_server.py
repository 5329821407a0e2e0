"""quillcache-sim-engine as a real process: the OpenAI-compatible API (streaming and not),
identity-keyed reuse seen through usage, and real vLLM-format KV events on ZMQ, consumed by
the control plane's own consumer (gap replay included)."""
import json
import threading
import time
import urllib.request

import pytest

from quillcache.control.events import BlockRemoved, BlockStored, EventConsumer
from quillcache.control.sim.server import tokenize
from tests._support.sim import SimEngine

WAIT_S = 10.0


@pytest.fixture(scope="module")
def engine():
    with SimEngine(block_size=4, capacity_blocks=64, max_num_seqs=8, max_batched_tokens=64,
                   adapters=["sql-lora"], model="sim-8b") as eng:
        yield eng


def sse_events(eng, path, body):
    req = urllib.request.Request(eng.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def test_health_and_models(engine):
    status, _ = engine.request("GET", "/health")
    assert status == 200
    ids = [m["id"] for m in engine.get("/v1/models")["data"]]
    assert ids == ["sim-8b", "sql-lora"]


def test_completion_reports_usage_and_a_prefix_hit_on_repeat(engine):
    prompt = "abcdefghijklmnopq"                       # 17 bytes: 4 full blocks of 4
    first = engine.post("/v1/completions", {"model": "sim-8b", "prompt": prompt, "max_tokens": 5,
                                            "cache_salt": "t-repeat"})
    assert first["object"] == "text_completion"
    assert first["usage"]["prompt_tokens"] == 17 and first["usage"]["completion_tokens"] == 5
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["finish_reason"] == "length" and first["choices"][0]["text"]
    again = engine.post("/v1/completions", {"model": "sim-8b", "prompt": prompt, "max_tokens": 5,
                                            "cache_salt": "t-repeat"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_disaggregated_prefill_hands_its_blocks_to_the_decode_engine():
    """vLLM's NixlConnector protocol: a do_remote_decode prefill answers kv_transfer_params; a
    decode request that brings them back loads those blocks instead of computing them."""
    with SimEngine(block_size=4, model="m", engine_id="p0") as p, SimEngine(block_size=4, model="m") as d:
        prompt = list(range(1, 19))                       # 18 tokens: 4 full blocks + 2
        got = p.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}})
        params = got["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "p0"
        assert params["remote_block_ids"] == [0, 1, 2, 3, 4]
        done = d.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 3,
                                          "kv_transfer_params": params})
        assert done["usage"]["completion_tokens"] == 3 and "kv_transfer_params" not in done
        assert d.stats()["remote_tokens"] == 16 and p.stats()["prompt_tokens"] == 18
        bad = dict(params, remote_block_ids=list(range(9)))
        status, raw = d.request("POST", "/v1/completions", {"model": "m", "prompt": prompt,
                                                            "kv_transfer_params": bad})
        assert status == 400 and b"names 9 blocks" in raw


def test_another_tenant_or_adapter_does_not_reuse_the_prefix(engine):
    prompt = list(range(100, 124))                      # token ids: 6 full blocks
    engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 2},
                headers={"X-Tenant-Id": "alice"})
    bob = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 2},
                      headers={"X-Tenant-Id": "bob"})
    lora = engine.post("/v1/completions", {"model": "sql-lora", "prompt": prompt, "max_tokens": 2},
                       headers={"X-Tenant-Id": "alice"})
    alice = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 2},
                        headers={"X-Tenant-Id": "alice"})
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert alice["usage"]["prompt_tokens_details"]["cached_tokens"] == 20    # 5 of 6: one recomputed
    assert engine.stats()["cross_identity_hits"] == 0


def test_streaming_sends_one_chunk_per_token_then_done(engine):
    events = sse_events(engine, "/v1/completions",
                        {"prompt": "stream me", "max_tokens": 7, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 7
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 6 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 7


def test_chat_streaming_and_not(engine):
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
    reply = engine.post("/v1/chat/completions", body)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    events = sse_events(engine, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 3
    assert chunks[-1]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10 ** 6}, 400, "exceeds"),
    ({"prompt": [1, "a"]}, 400, "prompt must be"),
    ({"prompt": "x", "model": "nope"}, 404, "not served"),
    ({"messages": "x"}, 400, "messages"),
])
def test_bad_requests_get_a_clear_error(engine, body, status, needle):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got, raw = engine.request("POST", path, body)
    assert got == status
    assert needle in json.loads(raw)["error"]["message"]


def test_a_body_that_is_not_json_is_refused(engine):
    req = urllib.request.Request(engine.url + "/v1/completions", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 400


def collect(consumer, until, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until():
        consumer.poll(0.05)
    return until()


def test_kv_events_are_vllm_batches_with_tokens_hashes_and_identity():
    with SimEngine(block_size=4, capacity_blocks=8, max_num_seqs=4, max_batched_tokens=64) as eng:
        got = []
        consumer = EventConsumer(eng.events, lambda seq, batch: got.append((seq, batch)),
                                 replay_endpoint=eng.replay)
        try:
            # The SUB socket may join late: whatever it misses comes back by replay.
            time.sleep(0.2)
            prompt = "0123456789abcdef!"                # 4 full blocks
            eng.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "cache_salt": "acme"})
            def stored():
                return [e for _, b in got for e in b.events if isinstance(e, BlockStored)]
            assert collect(consumer, lambda: sum(len(e.block_hashes) for e in stored()) >= 4)
            events = stored()
            tokens = [t for e in events for t in e.token_ids]
            assert tokens == tokenize(prompt)[:16]
            assert all(e.block_size == 4 and e.medium == "GPU" for e in events)
            assert events[0].parent_block_hash is None
            assert all(isinstance(h, bytes) and len(h) == 32 for e in events for h in e.block_hashes)
            assert events[0].quill_scope is None          # as vLLM: the tenant is not published
            first_hashes = [h for e in events for h in e.block_hashes]
            # A second prompt needs the pages: the first one's blocks are evicted and reported.
            eng.post("/v1/completions", {"prompt": "zyxwvutsrqponmlk!", "max_tokens": 8,
                                         "cache_salt": "acme"})
            def removed():
                return [h for _, b in got for e in b.events if isinstance(e, BlockRemoved)
                                           for h in e.block_hashes]
            assert collect(consumer, lambda: len(removed()) >= 1)
            assert set(removed()) <= set(first_hashes)
            seqs = [s for s, _ in got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        finally:
            consumer.close()


def test_a_consumer_that_joins_late_recovers_the_batches_by_replay():
    with SimEngine(block_size=4, capacity_blocks=64, max_num_seqs=4, max_batched_tokens=64) as eng:
        for i in range(3):
            eng.post("/v1/completions", {"prompt": f"request number {i}!", "max_tokens": 1})
        got = []
        consumer = EventConsumer(eng.events, lambda seq, batch: got.append(seq),
                                 replay_endpoint=eng.replay)
        try:
            consumer.replay(0, 3)                     # a late joiner asks for what it missed
            assert got == [0, 1, 2] and consumer.stats.replayed == 3
            time.sleep(0.2)
            eng.post("/v1/completions", {"prompt": "the last one, late!", "max_tokens": 1})
            assert collect(consumer, lambda: len(got) >= 4)
            assert got == [0, 1, 2, 3]
        finally:
            consumer.close()


def test_a_client_that_goes_away_mid_stream_frees_its_pages():
    with SimEngine(block_size=4, capacity_blocks=256, max_num_seqs=4, max_batched_tokens=64,
                   events=False, time_scale=0.05) as eng:
        req = urllib.request.Request(eng.url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "abcdefgh", "max_tokens": 500,
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=30)
        resp.readline()
        resp.close()                                      # gone after the first token
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and eng.stats()["running"]:
            time.sleep(0.05)
        st = eng.stats()
        assert st["running"] == 0 and st["used_blocks"] == st["cached_blocks"] == 2


def test_the_process_starts_fast_and_stops_on_sigterm():
    t0 = time.monotonic()
    eng = SimEngine(events=False).start()
    started = time.monotonic() - t0
    err = eng.stop()
    assert started < 15, started
    assert "Traceback" not in err


def test_threads_of_requests_are_batched_together():
    # Real time and 10 ms decode iterations: a request decodes for 200 ms, so the threads'
    # requests meet in the engine however slowly a loaded machine starts them.
    with SimEngine(block_size=4, capacity_blocks=256, max_num_seqs=16, max_batched_tokens=256,
                   decode_us_per_token=10_000, time_scale=1.0, events=False) as eng:
        replies = []

        def one(i):
            replies.append(eng.post("/v1/completions", {"prompt": f"prompt {i} " * 4, "max_tokens": 20}))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(replies) == 8
        st = eng.stats()
        # 8 requests x 20 tokens one at a time would be >= 160 iterations.
        assert st["steps"] < 120, st


def test_the_engine_clock_does_not_drift_with_the_loop_s_own_work():
    """A loop that loses 3 ms of wall time per turn to other work (a shared core, streaming,
    publishing) still runs the modelled GPU: back-to-back iterations start at the last one's
    modelled end, so the request's wall time is its modelled busy time, not that plus 3 ms a
    step; the lag is reported, and nothing slipped."""
    import asyncio

    from quillcache.control.sim.engine import EngineConfig, SimEngine as Engine, SimRequest
    from quillcache.control.sim.server import EngineRunner
    from quillcache.model import IdentityScope

    steps, hog_s = 120, 0.003

    async def main():
        engine = Engine(EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=4, max_batched_tokens=64))
        runner = EngineRunner(engine)
        runner.start()
        stop = False

        async def hog():
            while not stop:
                time.sleep(hog_s)                 # blocks the loop, as the process's other work does
                await asyncio.sleep(0)

        h = asyncio.get_running_loop().create_task(hog())
        t0 = time.monotonic()
        p = runner.submit(SimRequest("r", IdentityScope("m", "m", None, ""), 8, [b"a", b"b"], steps))
        while p.sim.state != "finished":
            p.event.clear()
            await p.event.wait()
        wall = time.monotonic() - t0
        stop = True
        await h
        await runner.stop()
        return wall, engine.busy_us / 1e6, runner

    wall, busy, runner = asyncio.run(main())
    assert runner.steps >= steps
    assert wall < busy + steps * hog_s / 2, (wall, busy)  # drifting, it would be >= busy + 0.36 s
    assert runner.late_us > 0 and runner.slipped_us == 0


def test_stats_count_the_prefill_in_flight_for_the_load_while_a_trace_arrives():
    """``prefill_busy_now_us``: the prefill-busy time with the iteration in flight counted up to
    now (what bench/gateway_replay.py reads when the last request is due); ``prefill_busy_us``
    counts an iteration when it ends."""
    # one 800 ms prefill iteration (40 tokens at 20 ms), in real time
    with SimEngine(block_size=4, capacity_blocks=256, max_num_seqs=4, max_batched_tokens=256,
                   prefill_us_per_token=20_000, time_scale=1.0, events=False) as eng:
        done = []
        t = threading.Thread(target=lambda: done.append(
            eng.post("/v1/completions", {"prompt": "abcd " * 8, "max_tokens": 2})))
        t.start()
        deadline = time.monotonic() + WAIT_S
        st = eng.stats()
        while time.monotonic() < deadline and not (st["running"] and st["prefill_busy_now_us"] >= 100_000):
            time.sleep(0.02)
            st = eng.stats()
        assert st["prefill_busy_us"] == 0 < st["prefill_busy_now_us"] <= 800_000
        t.join(WAIT_S)
        assert done
        st = eng.stats()
        assert st["prefill_busy_now_us"] == st["prefill_busy_us"] >= 800_000
