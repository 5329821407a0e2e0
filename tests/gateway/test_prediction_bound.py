"""The gateway's predicted prefixes are bounded (``MAX_PREDICTIONS``): past the bound the
oldest prediction goes, and its blocks leave the router's index; one predicted again is the
newest.  The bound is an OrderedDict's, O(1) per drop: a dict dropping its oldest with
``next(iter(d))`` walked over every hole its earlier drops left (~65 us a request at 200,000)."""
from quillcache.gateway import routing
from quillcache.gateway.routing import GatewayRouter
from quillcache.gateway.settings import load_gateway_config
from quillcache.model import IdentityScope

ENGINE = '[[gateway.engines]]\nid = "e{0}"\nurl = "http://127.0.0.1:900{0}"\nmodel = "m"\n'
ALICE = IdentityScope("m", "m", None, "alice")


def _depth(gr: GatewayRouter, hashes: list) -> int:
    (mr,) = gr.models.values()
    m = mr.router.find_matches(ALICE, hashes)
    return int(m.depth(list(m.workers).index("e0"))) if "e0" in m.workers else 0


def test_past_the_bound_the_oldest_prediction_and_its_blocks_go(monkeypatch):
    monkeypatch.setattr(routing, "MAX_PREDICTIONS", 4)
    cfg = load_gateway_config(text=ENGINE.format(0) + ENGINE.format(1) + '\n[router]\npolicy = "quillcache"\n')
    gr = GatewayRouter(cfg)
    for spec in cfg.gateway.engines:
        gr.add_engine(spec)
    prefixes = [[p * 1000 + i for i in range(3)] for p in range(7)]
    for h in prefixes[:4]:
        gr.predict("e0", ALICE, h)
    assert [_depth(gr, h) for h in prefixes[:4]] == [3, 3, 3, 3]
    gr.predict("e0", ALICE, prefixes[0])          # again: now the newest
    gr.predict("e0", ALICE, prefixes[4])          # past the bound: prefix 1 (the oldest) goes
    gr.predict("e0", ALICE, prefixes[5])          # ... then prefix 2
    assert len(gr._predictions) == 4
    assert [_depth(gr, h) for h in prefixes[:6]] == [3, 0, 0, 3, 3, 3]
    for p in range(6, 7):
        gr.predict("e0", ALICE, prefixes[p])      # ... then prefix 3
    assert [_depth(gr, h) for h in prefixes] == [3, 0, 0, 0, 3, 3, 3]
