"""Predict-on-route keeps the router's index and its page count exact: a prediction adds its
blocks once and takes them away once, however often a prefix is routed again; predictions are
not made in the engine's own event scope (the open tenant's) where the engine sends events, so
the events alone own those blocks and nothing of them outlives the engine's cache; and the
router's approximate mode counts a block predicted twice once.  Before: every routed request of
the open tenant left its prefix's blocks in the index and in the engine's device count for
good (a gateway in front of an engine with a warm cache grew ~1 KiB a request and saw every
engine's KV pages full after ~kv_blocks / blocks-per-request requests), and a prefix predicted
again counted its blocks again."""
import numpy as np

from quillcache.control.router import Router, RouterConfig
from quillcache.gateway import routing
from quillcache.gateway.routing import GatewayRouter
from quillcache.gateway.settings import load_gateway_config
from quillcache.model import IdentityScope
from tests._support.clock import Clock

WITH_EVENTS = ('[[gateway.engines]]\nid = "e0"\nurl = "http://127.0.0.1:9000"\nmodel = "m"\n'
               'kv_events = "tcp://127.0.0.1:9100"\n')
NO_EVENTS = '[[gateway.engines]]\nid = "e0"\nurl = "http://127.0.0.1:9000"\nmodel = "m"\n'
OPEN = IdentityScope("m", "m", None, "")           # no API key: the engine's own event scope
ALICE = IdentityScope("m", "m", None, "alice")


def _router(text: str, clock: Clock) -> tuple[GatewayRouter, Router]:
    cfg = load_gateway_config(text=text + '\n[router]\npolicy = "quillcache"\n')
    gr = GatewayRouter(cfg, clock=clock)
    for spec in cfg.gateway.engines:
        gr.add_engine(spec)
    (mr,) = gr.models.values()
    return gr, mr.router


def _device(r: Router) -> int:
    return int(r.indexer.device_counts()[0])


def test_the_open_tenant_is_not_predicted_where_the_engine_sends_events():
    clock = Clock()
    gr, r = _router(WITH_EVENTS, clock)
    for i in range(50):
        gr.predict("e0", OPEN, [i * 100 + j for j in range(8)])   # 50 routed requests, 8 blocks each
    assert len(gr._predictions) == 0
    assert _device(r) == 0 and len(r.indexer) == 0                 # the events alone say what the engine holds


def test_a_prefix_routed_again_counts_its_blocks_once_and_leaves_with_its_prediction():
    clock = Clock()
    gr, r = _router(WITH_EVENTS, clock)
    prefix = list(range(1, 11))
    for _ in range(5):
        gr.predict("e0", ALICE, prefix)
    assert len(gr._predictions) == 1
    assert _device(r) == 10 and len(r.indexer) == 10
    clock.t += routing.CONFIRM_AFTER_S + 1
    gr.sweep()                                   # the engine's events never showed it: dropped
    assert len(gr._predictions) == 0
    assert _device(r) == 0 and len(r.indexer) == 0


def test_an_engine_without_events_keeps_a_prediction_its_ttl_and_counts_it_once():
    clock = Clock()
    gr, r = _router(NO_EVENTS, clock)
    for who in (OPEN, ALICE):
        for _ in range(3):
            gr.predict("e0", who, [7, 8, 9])
    assert _device(r) == 6 and len(r.indexer) == 6              # two identities, 3 blocks each
    clock.t += gr.predict_ttl + 1
    gr.sweep()
    assert _device(r) == 0 and len(r.indexer) == 0


def test_approximate_mode_counts_a_block_predicted_twice_once():
    r = Router(RouterConfig(policy="prefix", approximate=True, approx_ttl_s=3600.0))
    r.add_worker("w0")
    hashes = list(range(1, 7))
    for _ in range(4):
        r.route(ALICE, hashes=hashes, request_tokens=6 * r.config.block_size)
    assert int(r.indexer.device_counts()[0]) == 6 and len(r.indexer) == 6
    r.expire(now=np.inf)
    assert int(r.indexer.device_counts()[0]) == 0 and len(r.indexer) == 0


def test_a_removed_engine_leaves_no_predicted_block_behind():
    clock = Clock()
    gr, r = _router(NO_EVENTS + NO_EVENTS.replace("e0", "e1").replace("9000", "9001"), clock)
    gr.predict("e0", ALICE, [1, 2, 3])
    gr.predict("e1", ALICE, [1, 2, 3])
    gr.remove_engine("e0")
    assert r.indexer.device_blocks(["e0", "e1"]) == [0, 3]
    m = r.find_matches(ALICE, [1, 2, 3])
    assert [int(m.depth(i)) for i in range(len(m.workers))] == [0 if w == "e0" else 3 for w in m.workers]


def test_where_the_engine_sends_events_a_tenant_s_prediction_is_a_credit_not_more_pages():
    from quillcache.control.events import BlockStored, EventBatch
    clock = Clock()
    gr, r = _router(WITH_EVENTS, clock)
    bs = r.config.block_size
    tokens = tuple(range(10 * bs))
    hashes = r.hashes(tokens)
    gr.predict("e0", ALICE, hashes)               # before any event: the prediction is all it knows
    assert _device(r) == 10
    engine_scope = IdentityScope("m", "m", None, "")
    r.apply_events("e0", EventBatch(0.0, (BlockStored(tuple(range(1, 11)), None, tokens, bs),)), engine_scope)
    assert _device(r) == 10                       # the engine's 10 pages, not 20
    m = r.find_matches(ALICE, hashes)
    assert int(m.depth(list(m.workers).index("e0"))) == 10       # and ALICE keeps her credit
    clock.t += routing.CONFIRM_AFTER_S + 1
    gr.sweep()                                    # confirmed by the events: kept
    assert len(gr._predictions) == 1 and _device(r) == 10
