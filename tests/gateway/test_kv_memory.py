"""[router] kv_blocks at the gateway: the predictor's wait-for-pages term (docs/router.md)
with the gateway's own routers, requests told by their max_tokens how long they hold pages; and
the figure learned from the engines themselves ([router] learn_kv_blocks: vLLM's /metrics,
SGLang's /server_info), against real simulated engines and a peer that answers too much."""
import pytest

from quillcache.gateway.routing import GatewayRouter
from quillcache.gateway.settings import load_gateway_config
from quillcache.model import IdentityScope

ENGINE = '[[gateway.engines]]\nid = "e{0}"\nurl = "http://127.0.0.1:900{0}"\nmodel = "m"\n'
ALICE = IdentityScope("m", "m", None, "alice")


def _routers(router_toml: str) -> GatewayRouter:
    engines = ENGINE.format(0) + ENGINE.format(1)
    cfg = load_gateway_config(text=f'{engines}\n[router]\npolicy = "quillcache"\n{router_toml}')
    gr = GatewayRouter(cfg)
    for spec in cfg.gateway.engines:
        gr.add_engine(spec)
    return gr


def _choice(router_toml: str, learned: int = 0) -> str:
    """e0 runs two requests decoding 1,000 tokens each (12 + 20 pages held), e1 one of 30
    blocks in prefill that decodes 1 token.  A 10-block request fits e1's 40 pages, not e0's.
    ``learned``: the KV tokens each engine says it holds (what the gateway learns)."""
    gr = _routers(router_toml)
    if learned:
        assert [gr.learn_kv(e, learned) for e in ("e0", "e1")] == [learned // 16] * 2
    bs = next(iter(gr.models.values())).router.config.block_size

    def hashes(blocks: int, salt: int) -> list:
        return gr.block_hashes([salt * 1_000_000 + i for i in range(blocks * bs)], bs)

    for blocks, salt in ((12, 1), (20, 2)):
        d = gr.decide(ALICE, hashes(blocks, salt), blocks * bs, ["e0"], decode_tokens=1000)
        gr.first_token(d.request_id)
    gr.decide(ALICE, hashes(30, 3), 30 * bs, ["e1"], decode_tokens=1)
    return gr.decide(ALICE, hashes(10, 4), 10 * bs, ["e0", "e1"], decode_tokens=10).worker


def test_an_engine_whose_kv_memory_is_full_is_avoided_only_when_kv_blocks_is_known():
    assert _choice("") == "e0"                    # memory not known: e0's shorter compute queue wins
    assert _choice("kv_blocks = 40\n") == "e1"    # e0 would wait for a decode to end and free pages
    assert _choice("kv_blocks = 4000\n") == "e0"  # room everywhere: the same choice as without
    # the same figure said by the engines, not written down: the same choices
    assert _choice("", learned=40 * 16) == "e1"
    assert _choice("", learned=4000 * 16) == "e0"
    # the operator's figure wins over what the engines say; learn_kv_blocks = false learns nothing
    gr = _routers("kv_blocks = 40\n")
    assert gr.learn_kv("e0", 4000 * 16) is None and gr.models["m"].router.config.kv_blocks == 40
    gr = _routers("learn_kv_blocks = false\n")
    assert gr.learn_kv("e0", 4000 * 16) is None and gr.models["m"].router.config.kv_blocks is None
    # less than one block said: not a figure
    gr = _routers("")
    assert gr.learn_kv("e0", 15) is None and gr.models["m"].router.config.kv_blocks is None
    with pytest.raises(ValueError):
        gr.models["m"].router.set_kv_blocks(0)


# ---- learning kv_blocks from the engines ([router] learn_kv_blocks)

# vLLM's info gauge as its PrometheusStatLogger writes it: one sample per data-parallel engine,
# the labels every field of its CacheConfig (vllm/v1/metrics/loggers.py, log_metrics_info).
_CACHE_LABELS = ('block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",'
                 'engine="{e}",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="{n}",'
                 'prefix_caching_hash_algo="sha256"')
VLLM_METRICS = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                "# TYPE vllm:cache_config_info gauge\n"
                + "".join(f"vllm:cache_config_info{{{_CACHE_LABELS.format(e=e, n=n)}}} 1.0\n"
                          for e, n in ((0, 27264), (1, 26000))))


def test_the_kv_an_engine_holds_is_read_from_vllm_metrics_and_sglang_server_info():
    from quillcache.gateway.kvpages import MAX_KV_TOKENS, kv_tokens_from_sglang_info, kv_tokens_from_vllm_metrics
    assert kv_tokens_from_vllm_metrics(VLLM_METRICS) == 26000 * 16          # the smaller DP engine
    assert kv_tokens_from_vllm_metrics(VLLM_METRICS.replace('"26000"', '"None"')) == 27264 * 16
    # before the engine profiled its memory, or no such gauge, or garbage: nothing said
    assert kv_tokens_from_vllm_metrics(VLLM_METRICS.replace('"27264"', '"None"').replace('"26000"', '"None"')) is None
    assert kv_tokens_from_vllm_metrics("vllm:num_requests_running 1.0\n") is None
    assert kv_tokens_from_vllm_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="-3"} 1.0') is None
    assert kv_tokens_from_vllm_metrics('vllm:cache_config_info{block_size="16" 1.0') is None
    huge = f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{MAX_KV_TOKENS}"}} 1.0'
    assert kv_tokens_from_vllm_metrics(huge) is None                         # past the bound: not believed
    assert kv_tokens_from_sglang_info({"max_total_num_tokens": 431_000, "page_size": 1}) == 431_000
    for doc in ({}, {"max_total_num_tokens": "many"}, {"max_total_num_tokens": True}, [1], None):
        assert kv_tokens_from_sglang_info(doc) is None


def _gateway_toml(urls, router: str = "") -> str:
    engines = "".join(f'[[gateway.engines]]\nid = "e{i}"\nurl = "{u}"\nmodel = "m"\nblock_size = 16\n'
                      for i, u in enumerate(urls))
    return f'[router]\npolicy = "quillcache"\n{router}\n{engines}'


async def _sim(capacity_blocks: int, block_size: int = 16):
    from quillcache.control.sim.engine import EngineConfig
    from quillcache.control.sim.server import SimServerConfig, start_server
    cfg = SimServerConfig(model="m", engine=EngineConfig(block_size=block_size, capacity_blocks=capacity_blocks))
    runner, listening, close_pub = await start_server(cfg, "127.0.0.1", 0, None, None)
    return runner, close_pub, listening.http


async def _serve_metrics(handler):
    """A plain HTTP server (not an engine) answering GET /metrics with ``handler``: (runner, url)."""
    from aiohttp import web
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, "http://{}:{}".format(*runner.addresses[0][:2])


def test_the_gateway_learns_each_model_s_kv_blocks_from_its_engines():
    """Two real simulated engines (their /metrics as vLLM's): 300 and 200 pages of 16 tokens.
    The model's router takes the smaller, 200 blocks of its 16 tokens; without the smaller
    engine, 300; an engine of 8-token pages counts by its tokens (400 pages = 200 blocks).  The
    operator's kv_blocks wins, and learn_kv_blocks = false learns nothing."""
    import asyncio

    from tests._support.gateway import gateway, wait_until

    async def main():
        sims = [await _sim(300), await _sim(200), await _sim(400, block_size=8)]
        urls = [s[2] for s in sims]
        try:
            async with gateway(_gateway_toml(urls[:2])) as (gw, _, admin, session):
                router = gw.router.models["m"].router
                await wait_until(lambda: router.config.kv_blocks == 200, 10, "kv_blocks learned")
                workers = (await (await session.get(admin + "/quillcache/workers")).json())["workers"]
                assert {w["id"]: (w["kv_blocks"], w["kv_tokens_said"]) for w in workers} == {
                    "e0": (200, 300 * 16), "e1": (200, 200 * 16)}
                await gw.remove_engine("e1")
                assert router.config.kv_blocks == 300
            async with gateway(_gateway_toml(urls[2:])) as (gw, _, _, _):
                router = gw.router.models["m"].router
                await wait_until(lambda: router.config.kv_blocks == 200, 10, "kv_blocks learned by tokens")
            async with gateway(_gateway_toml(urls[:1], "kv_blocks = 50")) as (gw, _, _, _):
                await asyncio.sleep(0.5)
                assert gw.router.models["m"].router.config.kv_blocks == 50 and not gw._kv_asks
            async with gateway(_gateway_toml(urls[:1], "learn_kv_blocks = false")) as (gw, _, _, _):
                await asyncio.sleep(0.5)
                assert gw.router.models["m"].router.config.kv_blocks is None and not gw._kv_asks
        finally:
            for runner, close_pub, _ in sims:
                await runner.cleanup()
                close_pub()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_gauge_is_found_past_megabytes_of_other_metrics_sent_in_pieces():
    """A busy vLLM's /metrics runs to megabytes (histograms per model and adapter), written in
    many chunks; the info gauge may come last.  Read to the end, within the bound: learned."""
    import asyncio

    from aiohttp import web

    from quillcache.gateway.kvpages import fetch_kv_tokens

    async def main():
        async def metrics(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            filler = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{i}",model_name="m"}} {i}.0\n'
                             for i in range(4000)).encode()            # ~290 KB a piece
            for _ in range(8):
                await resp.write(filler)
                await asyncio.sleep(0.01)
            await resp.write(VLLM_METRICS.encode())
            return resp

        runner, url = await _serve_metrics(metrics)
        try:
            import aiohttp
            async with aiohttp.ClientSession() as session:
                assert await fetch_kv_tokens(session, url, 10) == 26000 * 16
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_engine_that_answers_late_or_too_much_costs_a_bounded_read_and_teaches_nothing():
    """An engine up after the gateway is asked again (5 s later) and then learned.  A peer in
    an engine's place that answers 16 MiB of /metrics costs one read of at most 4 MiB: nothing
    is learned from it, and the memory terms stay off for its model."""
    import asyncio

    from aiohttp import web

    from quillcache.gateway.kvpages import MAX_ANSWER_BYTES
    from tests._support.gateway import free_port, gateway, wait_until

    async def main():
        port = free_port()
        sent = []

        async def flood(request):
            resp = web.StreamResponse()
            await resp.prepare(request)
            chunk = b"#" * (1 << 20) + b"\n"
            try:
                for _ in range(16):
                    await resp.write(chunk)
                    sent.append(len(chunk))
            except (ConnectionResetError, RuntimeError):
                pass
            return resp

        bad, bad_url = await _serve_metrics(flood)
        late_url = f"http://127.0.0.1:{port}"
        toml = _gateway_toml([late_url]) + f'[[gateway.engines]]\nid = "x"\nurl = "{bad_url}"\nmodel = "other"\n'
        try:
            async with gateway(toml) as (gw, _, _, _):
                await asyncio.sleep(1.0)
                assert gw.router.models["m"].router.config.kv_blocks is None       # nothing listens yet
                assert gw.router.models["other"].router.config.kv_blocks is None   # told nothing usable
                assert sum(sent) <= MAX_ANSWER_BYTES + 8 * (1 << 20)               # it stopped reading
                from quillcache.control.sim.engine import EngineConfig
                from quillcache.control.sim.server import SimServerConfig, start_server
                cfg = SimServerConfig(model="m", engine=EngineConfig(capacity_blocks=123))
                runner, _, close_pub = await start_server(cfg, "127.0.0.1", port, None, None)
                try:
                    await wait_until(lambda: gw.router.models["m"].router.config.kv_blocks == 123, 15,
                                     "learned from the engine once it was up")
                finally:
                    await runner.cleanup()
                    close_pub()
        finally:
            await bad.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))
