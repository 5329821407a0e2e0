"""A node hosting a router: it consumes the configured engines' KV events (real ZMQ
publishers) and answers ROUTE / ROUTE_UPDATE over its binary protocol; a node with
``[events] publish`` puts its own residency changes on the wire in vLLM's format."""
from __future__ import annotations

import math
import subprocess
import time

import pytest

from quillcache.client import Client
from quillcache.control.events import (
    BlockRemoved, BlockStored, EventConsumer, EventPublisher,
)
from quillcache.control.indexer import chain_hashes
from quillcache.errors import InvalidArgument
from quillcache.model import IdentityScope, KvBlockKey
from tests._support.daemon import QUILLCACHED, Daemon
from tests._support.metrics import has_metric, metric_value, scrape
from tests._support.net import free_port

BS = 4
ACME = IdentityScope("llama", "llama-tok", None, "acme")


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def engine_table(eid, pub, tenant="acme", pool=False):
    return (f'[[router.engines]]\nid = "{eid}"\nendpoint = "{pub.endpoint}"\n'
            f'replay_endpoint = "{pub.replay_endpoint}"\nmodel = "llama"\ntokenizer = "llama-tok"\n'
            f'tenant = "{tenant}"\npool = {"true" if pool else "false"}\n')


def test_node_routes_by_the_engines_events_and_scopes_credit_by_identity(tmp_path):
    e0, e1 = EventPublisher(tcp(), tcp(), topic=""), EventPublisher(tcp(), tcp(), topic="")
    router = ('module = "quillcache"\nblock_size = 4\n' + engine_table("e0", e0) + engine_table("e1", e1))
    toks = list(range(40))                                   # 10 blocks
    stored = BlockStored(tuple(range(100, 110)), None, tuple(toks), BS, medium="GPU")
    try:
        with Daemon(tmp_path, sections={"router": router}) as d, Client(d.addr) as c:
            deadline = time.monotonic() + 20
            while True:                                      # slow joiner: publish until seen
                e1.publish([stored])
                r = c.route(ACME, toks, track=False)
                if r.device == 10 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert (r.worker, r.device, r.block_size) == ("e1", 10, BS)
            assert r.plan == bytes([0] * 10)
            assert set(r.logits) == {"e0", "e1"} and r.logits["e1"] < r.logits["e0"]

            # another tenant's request gets no credit for acme's blocks
            other = IdentityScope("llama", "llama-tok", None, "globex")
            r2 = c.route(other, toks, track=False)
            assert r2.device == 0 and r2.plan == bytes([4] * 10)

            # the same question by the router's block hashes
            r3 = c.route(ACME, hashes=chain_hashes(toks, BS), request_tokens=40, track=False)
            assert (r3.worker, r3.device) == ("e1", 10)

            # load feedback: a tracked request, its first token, its end
            r4 = c.route(ACME, toks, request_id="req-1")
            assert r4.request_id == "req-1"
            assert c.route_update("req-1", first_token=True) is True
            assert c.route_update("req-1") is True
            assert c.route_update("req-1") is False

            # a removed block shortens the match
            e1.publish([BlockRemoved((105,))])
            deadline = time.monotonic() + 10
            while c.route(ACME, toks, track=False).device != 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.route(ACME, toks, track=False).device == 5

            info = c.info("Router")
            assert info["Router"]["module"] == "quillcache" and info["Router"]["decisions"] >= 5
            # the node's /metrics: decisions, and the predicted-TTFT p99 (NaN: under 100 placed)
            text = scrape(d.metrics_port)
            assert metric_value(text, "quillcache_router_decision_seconds_count") >= 5
            assert has_metric(text, "quillcache_router_predicted_ttft_p99_seconds")
            assert math.isnan(metric_value(text, "quillcache_router_predicted_ttft_p99_seconds"))
            # the busy share: probes (track=False) are not arrivals, so none counted yet
            assert metric_value(text, "quillcache_router_busy_share") == 0.0
    finally:
        e0.close()
        e1.close()


def test_route_on_a_node_without_a_router_is_a_clear_error(tmp_path):
    with Daemon(tmp_path) as d, Client(d.addr) as c:
        with pytest.raises(InvalidArgument, match="hosts no router"):
            c.route(ACME, [1, 2, 3, 4])
        assert c.ping() >= 0                                   # the connection stays usable


def test_unknown_router_module_exits_78_naming_the_key(tmp_path):
    d = Daemon(tmp_path, sections={"router": 'module = "llm-d"'})
    proc = subprocess.run([QUILLCACHED, "--config", str(d.config)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 78
    assert "[router] module" in proc.stderr and '"quillcache"' in proc.stderr


def test_node_publishes_its_residency_in_the_vllm_event_format(tmp_path):
    ep, rep = tcp(), tcp()
    events = f'publish = true\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"'
    seen = []
    with Daemon(tmp_path, sections={"events": events}) as d, Client(d.addr) as c:
        con = EventConsumer(ep, lambda s, b: seen.extend(b.events), replay_endpoint=rep)
        try:
            deadline = time.monotonic() + 20
            i = 0
            while not seen and time.monotonic() < deadline:   # slow joiner
                c.put(KvBlockKey("llama", "llama-tok", None, "acme", "root", f"probe{i}", 0, 16), b"x")
                i += 1
                con.poll(0.1)
            seen.clear()
            key = KvBlockKey("llama", "llama-tok", "ad1", "acme", "p0", "deadbeef", 3, 16)
            c.put(key, b"y" * 100)
            c.remove(key)
            deadline = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < deadline:
                con.poll(0.1)
        finally:
            con.close()
    st, rm = seen[0], seen[1]
    assert isinstance(st, BlockStored) and isinstance(rm, BlockRemoved)
    assert st.block_hashes == (b"deadbeef",) and st.parent_block_hash == b"p0"
    assert st.medium == "cpu" and st.block_size == 16 and st.lora_name == "ad1"
    assert st.quill_scope == ("acme", "llama", "llama-tok", "ad1")
    assert rm.block_hashes == (b"deadbeef",)


@pytest.mark.parametrize("engines, message", [
    ('[[router.engines]]\nid = "e0"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\ntokenizer = "t"\n',
     "missing tenant"),
    ('[[router.engines]]\nid = "e0"\nendpoint = "http://x"\nmodel = "m"\ntokenizer = "t"\ntenant = "a"\n',
     "not a ZMQ endpoint"),
    ('[[router.engines]]\nid = "e0"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\ntokenizer = "t"\n'
     'tenant = "a"\ncolour = "red"\n', "unknown key"),
])
def test_bad_engine_tables_are_config_errors_naming_the_key(engines, message):
    from quillcache.node.settings import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"\[router\] engines.*" + message):
        load_config(text='[router]\nmodule = "dynamo"\n' + engines)


def test_router_module_names_come_from_the_registry():
    from quillcache.node.settings import SETTINGS
    from quillcache.control.modules import ROUTER_MODULES, module_policy
    setting = next(s for s in SETTINGS if s.qualname == "router.module")
    for name in ROUTER_MODULES:
        assert setting.convert(name) == name
    assert module_policy("none") is None and module_policy("dynamo") == "dynamo"


def test_a_caller_has_a_bounded_number_of_tracked_requests_and_ids_of_its_own(monkeypatch):
    """In process: the per-caller limit on tracked requests (BUSY past it, nothing allocated),
    and two callers' same request id stay two requests."""
    from quillcache.control import host as host_module
    from quillcache.control.host import RouterHost
    from quillcache.control.router import RouterConfig
    from quillcache.errors import Busy
    from quillcache.protocol.route import ROUTE_TOKENS, RouteRequest
    monkeypatch.setattr(host_module, "MAX_TRACKED_PER_CALLER", 3)
    h = RouterHost("quillcache", RouterConfig(block_size=BS), start=False)
    h.router.add_worker("e0")

    def ask(rid):
        return RouteRequest(ROUTE_TOKENS, None, True, "acme", "llama", "llama-tok", None, rid, 0, list(range(8)))
    for rid in ("a", "b", "c"):
        assert h.route(ask(rid), caller="acme").request_id == rid
    assert h.route(ask("a"), caller="acme").request_id == "a"          # the same id again: no new slot
    with pytest.raises(Busy, match="at most 3 per caller"):
        h.route(ask("d"), caller="acme")
    assert h.router.load("e0").active_requests == 3
    assert h.route(ask("a"), caller="globex").request_id == "a"         # another caller's "a"
    assert h.router.load("e0").active_requests == 4
    assert h.update(2, "a", caller="acme") and h.update(2, "a", caller="globex")
    assert not h.update(2, "a", caller="acme")
    assert h.route(ask("d"), caller="acme").request_id == "d"           # a slot was given back


@pytest.mark.parametrize("line, expected", [("", None), ("kv_blocks = 0\n", None), ("kv_blocks = 512\n", 512)])
def test_a_nodes_router_kv_blocks_reaches_its_router(line, expected):
    """[router] kv_blocks: the engines' KV pages for the predictor's page-wait term; 0: off."""
    from quillcache.control.host import build_router_host
    from quillcache.node.settings import load_config
    engine = ('[[router.engines]]\nid = "e0"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\ntokenizer = "t"\n'
              'tenant = "a"\n')
    cfg = load_config(text=f'[router]\nmodule = "quillcache"\n{line}' + engine)
    host = build_router_host(cfg.router, start=False)
    assert host.router.config.kv_blocks == expected
