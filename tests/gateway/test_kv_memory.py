"""[router] kv_blocks at the gateway: the predictor's wait-for-pages term (docs/router.md)
with the gateway's own routers, requests told by their max_tokens how long they hold pages."""
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


def _choice(router_toml: str) -> str:
    """e0 runs two requests decoding 1,000 tokens each (12 + 20 pages held), e1 one of 30
    blocks in prefill that decodes 1 token.  A 10-block request fits e1's 40 pages, not e0's."""
    gr = _routers(router_toml)
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
