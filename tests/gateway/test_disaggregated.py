"""Disaggregated serving through the gateway: prefill engines and decode engines of one model,
two hops per request (vLLM's disaggregated-serving protocol), against real simulated engines."""
import asyncio

import pytest

from quillcache.node.settings import ConfigError
from quillcache.gateway.settings import load_gateway_config
from tests._support.gateway import free_port, harness

PROMPT = "the quick brown fox jumps over the lazy dog " * 12        # 528 tokens, 33 blocks of 16


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def decision(headers):
    return {k[len("x-quillcache-"):]: v for k, v in headers.items() if k.lower().startswith("x-quillcache-")}


async def stats(h, i):
    async with h.session.get(h.urls[i] + "/sim/stats") as r:
        return await r.json()


def test_two_hops_prefill_cache_aware_then_decode_streams_with_the_transferred_blocks():
    async def main():
        async with harness(n=3, roles=("prefill", "prefill", "decode")) as h:
            st, hd, data = await h.complete(PROMPT, "acme", max_tokens=5)
            assert st == 200, data
            d = decision(hd)
            assert d["worker"] == "e2" and d["prefill-worker"] in ("e0", "e1")
            assert d["plan"] == "hit=0, fetch=0, recompute=33"
            events = [e for e in data.split(b"\n\n") if e.startswith(b"data: {")]
            assert len(events) == 5 and data.rstrip().endswith(b"data: [DONE]")
            first = d["prefill-worker"]
            p = await stats(h, int(first[1:]))
            dec = await stats(h, 2)
            assert p["prompt_tokens"] == len(PROMPT)               # the prefill engine computed it
            # The decode engine loaded it, less the last block: one prompt token is computed.
            assert dec["remote_tokens"] == 32 * 16
            await asyncio.sleep(0.3)
            # The same prefix again: the prefill hop goes where it is cached, credited.
            st, hd, _ = await h.complete(PROMPT + "more", "acme", max_tokens=2, stream=False)
            d = decision(hd)
            assert st == 200 and d["prefill-worker"] == first and d["local-hits"] == "33"
            # Another tenant is refused the credit, on the prefill hop too.
            st, hd, _ = await h.complete(PROMPT + "other", "globex", max_tokens=2)
            assert st == 200 and decision(hd)["local-hits"] == "0" and "reuse-refused" not in decision(hd)
            await h.wait_idle()
    run(main())


def test_a_prefill_engine_that_fails_is_retried_on_another_and_a_missing_decode_is_503():
    async def main():
        dead = (f'[[gateway.engines]]\nid = "p-dead"\nurl = "http://127.0.0.1:{free_port()}"\nmodel = "m"\n'
                'adapters = ["lora-x"]\nrole = "prefill"\n')
        async with harness(n=2, roles=("prefill", "decode"), extra_engines=(dead,),
                           gateway_toml='[router]\npolicy = "round_robin"') as h:
            retried = set()
            for i in range(3):
                st, hd, data = await h.complete(f"{i} {PROMPT}", max_tokens=2)
                assert st == 200, data
                d = decision(hd)
                assert d["prefill-worker"] == "e0" and d["worker"] == "e1"
                retried.add(d.get("retried"))
            assert "1" in retried and h.gw.engines["p-dead"].errors >= 1
            await h.gw.remove_engine("e1")                 # the only decode engine leaves
            st, _, data = await h.complete(PROMPT, max_tokens=2)
            assert st == 503 and b"no decode engine" in data
            await h.wait_idle()
    run(main())


@pytest.mark.parametrize("roles, message", [
    (("prefill",), "has prefill engines and no decode engine"),
    (("both", "decode"), "not a mix"),
])
def test_role_combinations_the_gateway_cannot_serve_are_config_errors(roles, message):
    text = "".join(f'[[gateway.engines]]\nid = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodel = "m"\n'
                   f'role = "{r}"\n' for i, r in enumerate(roles))
    with pytest.raises(ConfigError, match=message):
        load_gateway_config(text=text)
