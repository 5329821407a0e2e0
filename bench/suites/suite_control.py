"""asv suite: the control plane's hot paths, no sockets.

  Indexer   KV-event ingestion (BlockStored events already decoded, 16 blocks each) into a
            fresh indexer, and ``find_matches`` of whole 128-block chains; the ART indexer
            and the dict reference indexer side by side (bench/router_index.py runs the
            1M-block comparison)
  Router    one decision (``route`` then ``free``) under each policy of
            ``quillcache.protocol.route.POLICIES``: a policy added there is timed here too
  Gateway   the gateway's decision path without HTTP (gateway/routing.py): block hashes of
            the prompt, ``decide``, predict-on-route, ``first_token``, ``finish``

All of it runs in the benchmark's own thread, so each suite times the process's CPU time
(``timer = time.process_time``): on a shared machine the wall clock also counts the turns of
other processes, and a run at load 10 would read as a regression.
"""
import time

from quillcache.model import IdentityScope
from quillcache.protocol.route import POLICIES

from bench.router_index import build_events, queries

CHAINS = 256                  # conversations in the index
DEPTH = 128                   # blocks per conversation (128 x 16 tokens = a 2k-token prompt)
WORKERS = 8                   # engines that stored them
PER_EVENT = 16                # blocks per BlockStored event
BLOCK = 16                    # tokens per block
QUERIES = 100                 # requests per timed call
SCOPE = IdentityScope("llama", "tok", None, "acme")


def _events():
    return build_events(CHAINS, DEPTH, WORKERS, PER_EVENT, BLOCK, seed=1)


def _indexer(kind):
    from quillcache.control.indexer import ArtIndexer, DictIndexer
    return ArtIndexer(capacity=1 << 16) if kind == "art" else DictIndexer()


class Indexer:
    """CHAINS x DEPTH blocks (32k) stored, plus half of each chain offloaded to a second worker's
    host tier: 49,152 block events per ingestion."""

    params = ["art", "dict"]
    param_names = ["indexer"]
    timeout = 120
    timer = time.process_time

    def setup(self, kind):
        self.events = _events()
        self.index = _indexer(kind)
        self.blocks = sum(self.index.apply(w, b, SCOPE) for w, b in self.events)
        self.queries = queries(self.events, CHAINS, DEPTH, BLOCK, QUERIES, seed=2)
        m = self.index.find_matches(SCOPE, self.queries[0])
        if max(m.device) != DEPTH:
            raise RuntimeError(f"find_matches: the deepest device prefix is {max(m.device)}, not {DEPTH}")

    def time_ingest(self, kind):
        index = _indexer(kind)
        for w, b in self.events:
            index.apply(w, b, SCOPE)

    def time_find_matches_100(self, kind):
        fm = self.index.find_matches
        for h in self.queries:
            fm(SCOPE, h)

    def track_blocks_ingested(self, kind):
        return self.blocks

    track_blocks_ingested.unit = "blocks"


class Router:
    """QUERIES decisions of 128-block prompts over WORKERS workers, each released at once
    (so the load stays where it started)."""

    params = list(POLICIES)
    param_names = ["policy"]
    timeout = 120
    timer = time.process_time

    def setup(self, policy):
        from quillcache.control.router import Router, RouterConfig
        self.router = Router(RouterConfig(policy=policy, block_size=BLOCK, seed=1))
        events = _events()
        for w in sorted({w for w, _ in events}):
            self.router.add_worker(w)
        for w, b in events:
            self.router.apply_events(w, b, SCOPE)
        self.queries = queries(events, CHAINS, DEPTH, BLOCK, QUERIES, seed=2)
        d = self.router.route(SCOPE, hashes=self.queries[0])
        self.router.free(d.request_id)
        if len(d.plan) != DEPTH:
            raise RuntimeError(f"route: a plan of {len(d.plan)} blocks for a {DEPTH}-block prompt")

    def time_route_and_free_100(self, policy):
        route, free = self.router.route, self.router.free
        for h in self.queries:
            free(route(SCOPE, hashes=h).request_id)


class Gateway:
    """QUERIES requests through GatewayRouter over 4 engines of one model (no HTTP, no
    events: the credit comes from predict-on-route, as for an engine without events)."""

    ENGINES = 4
    timeout = 120
    timer = time.process_time

    def setup(self):
        import random

        from quillcache.gateway.routing import GatewayRouter
        from quillcache.gateway.settings import load_gateway_config
        text = "".join(f'[[gateway.engines]]\nid = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodel = "m"\n'
                       for i in range(self.ENGINES))
        cfg = load_gateway_config(text=text)
        self.gw = GatewayRouter(cfg)
        for spec in cfg.gateway.engines:
            self.gw.add_engine(spec)
        self.candidates = [s.id for s in cfg.gateway.engines]
        self.identity = IdentityScope("m", "m", None, "tenant-a")
        rnd = random.Random(3)
        # 20 shared system prompts of 1k tokens, each followed by a 1k-token question
        stems = [[rnd.randrange(50_000) for _ in range(1024)] for _ in range(20)]
        self.prompts = [stems[i % 20] + [rnd.randrange(50_000) for _ in range(1024)] for i in range(QUERIES)]
        for toks in self.prompts[:20]:
            self._one(toks)                   # the stems are predicted on some engine
        d = self.gw.decide(self.identity, self.gw.block_hashes(self.prompts[20], BLOCK), 2048, self.candidates)
        self.gw.finish(d.request_id)
        if d.local_hits < 1024 // BLOCK:
            raise RuntimeError(f"gateway: {d.local_hits} blocks credited for a predicted 64-block stem")

    def _one(self, toks):
        gw = self.gw
        hashes = gw.block_hashes(toks, BLOCK)
        d = gw.decide(self.identity, hashes, len(toks), self.candidates)
        gw.predict(d.worker, self.identity, hashes)
        gw.first_token(d.request_id)
        gw.finish(d.request_id)

    def time_decide_100(self):
        one = self._one
        for toks in self.prompts:
            one(toks)
