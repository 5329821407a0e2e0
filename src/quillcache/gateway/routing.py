"""The gateway's use of the control plane's router (quillcache.control.router).

One ``Router`` per served model: its workers are the engines serving that model.  Credit
comes from two sources, both identity-scoped:

* the engines' KV events (control.events), applied under the engine's scope with the
  tenant ``""``: engines do not say which tenant a block belongs to, so event-only blocks
  earn credit only for requests of the open (no API key) tenant;
* predict-on-route: after a successful request its prefix is recorded on that engine
  under the request's full identity.  A sweep keeps a prediction while the engine's events
  show the same block chain on that worker (confirmed) and drops it when they do not
  (contradicted: never stored, removed, or cleared).  For an engine without events a
  prediction lives ``[gateway] predict_ttl``.  A request of the open tenant is not predicted
  where its engine sends events (the events' own scope: they alone say what it holds), and a
  prefix predicted again counts its blocks once (the indexer counts ``add_blocks`` per block).

So a tenant-b request never earns credit for tenant a's prefix.  The decision's figures
(overlap, local hits, plan) are the request's own identity's whatever the policy; how many
prefix blocks another identity holds (``refused``) and what the identity-blind ``dynamo``
credited across identities are kept for the operator's metrics, never for the client.

Admission (``[router] admission = "predict"``): the router holds each request to the gateway's
``[gateway] slo_ttft`` (``RouterConfig.slo_ttft_ms``, updated on SIGHUP); a refused decision
(``admitted`` False) is tracked nowhere and the proxy answers it 429.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from quillcache.control.events import EventConsumer
from quillcache.control.indexer import DEVICE, chain_hashes
from quillcache.control.router import PLAN_CODES, Router, RouterConfig
from quillcache.model import IdentityScope
from quillcache.protocol.route import IDENTITY_BLIND

__all__ = ["Identity", "Decision", "GatewayRouter", "CONFIRM_AFTER_S", "SWEEP_INTERVAL_S",
           "MAX_PREDICTIONS"]

CONFIRM_AFTER_S = 2.0        # seconds an engine with events has to confirm a predicted prefix
SWEEP_INTERVAL_S = 1.0       # seconds between prediction sweeps
MAX_PREDICTIONS = 200_000    # predicted prefixes remembered at once (oldest dropped first)

Identity = IdentityScope
_ROUTER_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}


@dataclass
class Decision:
    """One routing decision: the request's own figures (the x-quillcache-* headers) and the
    operator's (``refused``, ``cross_credited``, ``decision_us``: metrics only)."""

    worker: str
    request_id: str
    blocks: int
    overlap: dict                # tier name -> blocks of the request's identity on the chosen worker
    local_hits: int              # device + host + disk blocks of them
    refused: int                 # metrics only: prefix blocks a candidate holds under another identity
    plan_hit: int
    plan_fetch: int
    plan_recompute: int
    decision_us: float           # metrics only: it depends on what other identities cached
    cross_credited: int = 0      # metrics only: blocks credited though another identity cached them
    admitted: bool = True        # False: [router] admission = "predict" refused it (nothing tracked)
    predicted_ttft_us: float = 0.0   # the chosen worker's predicted TTFT (policy quillcache)


@dataclass
class _Prediction:
    worker: str
    scope: IdentityScope
    hashes: tuple
    checked_at: float            # loop time of the next confirmation check
    expires_at: float            # for engines without events


class _ModelRouter:
    def __init__(self, model: str, config: RouterConfig) -> None:
        self.model = model
        self.router = Router(config)
        self.specs: dict = {}


class GatewayRouter:
    """Routers per model, event consumers, and predict-on-route bookkeeping.  Engines come
    and go (``add_engine``, ``remove_engine``): the config's at start, etcd's at any time."""

    def __init__(self, cfg, clock: Callable[[], float] = time.monotonic) -> None:
        r = cfg.router                  # the cost knobs shared with a node's [router]
        # The TTFT objective that admission ([router] admission = "predict") holds a request to
        # is the gateway's own [gateway] slo_ttft, the one its goodput metric counts against.
        self._knobs = {**{k: v for k, v in r.as_dict().items() if k in _ROUTER_FIELDS}, "policy": r.policy,
                       "slo_ttft_ms": cfg.gateway.slo_ttft * 1000.0,
                       "kv_blocks": r.kv_blocks or None}      # 0 in the file: not known
        # Where [router] kv_blocks is 0, the KV tokens each engine said it holds (learn_kv).
        self.learn_kv_blocks = bool(r.learn_kv_blocks and not r.kv_blocks)
        self._kv_tokens: dict[str, int] = {}
        self._clock = clock
        self.predict_ttl = cfg.gateway.predict_ttl
        self.policy = r.policy
        self.models: dict[str, _ModelRouter] = {}
        self._of_worker: dict[str, _ModelRouter] = {}
        # oldest first; an OrderedDict: dropping the oldest is O(1) (a dict's next(iter(d)) walks
        # over the holes of every key deleted at its front before: ~65 us at 200,000 entries)
        self._predictions: OrderedDict[tuple, _Prediction] = OrderedDict()
        self._requests: dict[str, _ModelRouter] = {}
        self._consumers: dict[str, EventConsumer] = {}

    # ------------------------------------------------------------------ engines

    def add_engine(self, spec) -> None:
        """Route to ``spec`` from now on (its model's router is made with its first engine).
        Raises ValueError when the model's router cannot take another worker."""
        mr = self.models.get(spec.model)
        if mr is None:
            mr = _ModelRouter(spec.model, RouterConfig(**{**self._knobs, "block_size": spec.block_size}))
        try:
            mr.router.add_worker(spec.id)
        except ValueError:                      # past the indexer's worker limit
            mr.router.remove_worker(spec.id)
            raise
        self.models[spec.model] = mr
        mr.specs[spec.id] = spec
        self._of_worker[spec.id] = mr

    def detach_events(self, worker: str) -> Optional[EventConsumer]:
        """Take the engine's event consumer away (the caller closes it, off the loop)."""
        return self._consumers.pop(worker, None)

    def remove_engine(self, worker: str) -> None:
        """Forget the engine: its residency, its load, its predictions.  Close its event
        consumer first (``detach_events``), or a late batch would bring the worker back."""
        mr = self._of_worker.pop(worker, None)
        if mr is None:
            return
        for key in [k for k, p in self._predictions.items() if p.worker == worker]:
            del self._predictions[key]
        mr.router.remove_worker(worker)
        del mr.specs[worker]
        if not mr.specs:
            del self.models[mr.model]            # a later engine of this model starts afresh
        if self._kv_tokens.pop(worker, None) is not None and mr.specs:
            self._apply_kv(mr)

    def learn_kv(self, worker: str, kv_tokens: int) -> Optional[int]:
        """The engine says it holds ``kv_tokens`` tokens of KV: its model's router takes the
        smallest figure its engines said, in its blocks, as ``kv_blocks`` (one figure for every
        engine of a model, as the setting is).  Returns that figure (None: not applied: the
        engine is gone, or [router] kv_blocks is set)."""
        mr = self._of_worker.get(worker)
        if mr is None or not self.learn_kv_blocks:
            return None
        self._kv_tokens[worker] = kv_tokens
        return self._apply_kv(mr)

    def _apply_kv(self, mr: "_ModelRouter") -> Optional[int]:
        said = [self._kv_tokens[w] for w in mr.specs if w in self._kv_tokens]
        blocks = min(said) // mr.router.config.block_size if said else 0
        mr.router.set_kv_blocks(blocks or None)
        return blocks or None

    # ------------------------------------------------------------------ hashing and deciding

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[int]:
        return chain_hashes(tokens, block_size)

    def decide(self, identity: IdentityScope, hashes: Sequence[int], n_tokens: int,
               candidates: Sequence[str], policy: Optional[str] = None, decode_tokens: int = 0) -> Decision:
        """``decode_tokens``: the request's max_tokens (0: not said), how long it will hold its
        KV pages ([router] kv_blocks)."""
        mr = self._of_worker[candidates[0]]
        policy = policy or self.policy
        # The router counts the request's load from here on: first_token() and finish() release it.
        d = mr.router.route(identity, hashes=hashes, request_tokens=n_tokens, candidates=candidates,
                            policy=policy, decode_tokens=decode_tokens)
        if d.admitted:
            self._requests[d.request_id] = mr
        # Refused (metrics only): the most prefix blocks any candidate holds only under another
        # identity, whichever worker was chosen (the chosen one may hold none of them).
        m = mr.router.find_matches(identity, hashes)
        refused = max([int(m.refused[i]) for i, w in enumerate(m.workers) if w in candidates] or [0])
        if policy in IDENTITY_BLIND:
            # The operator's identity-blind policy chose; what the client is told of the choice
            # is its own identity's overlap there (no pool: the policy knows none).
            w = list(m.workers).index(d.worker)
            dev, host, disk, pool = int(m.device[w]), int(m.host[w]), int(m.disk[w]), 0
            hit, fetch = dev + host + disk, 0
        else:
            dev, host, disk, pool = d.overlap
            plan = d.plan
            hit = plan.count(0) + plan.count(1) + plan.count(2)
            fetch = plan.count(PLAN_CODES.index("pool"))
        return Decision(d.worker, d.request_id, len(hashes),
                        {"device": dev, "host": host, "disk": disk, "pool": pool},
                        dev + host + disk, max(refused, d.refused_blocks), hit, fetch,
                        len(hashes) - hit - fetch, d.latency_us, d.cross_identity_credited_blocks,
                        d.admitted, d.predicted_ttft_us)

    def reconfigure(self, cfg) -> None:
        """SIGHUP: the reloadable [router] policy, [gateway] predict_ttl and slo_ttft (the next
        decision and the next prediction use them)."""
        self.policy = cfg.router.policy
        self.predict_ttl = cfg.gateway.predict_ttl
        slo_ms = cfg.gateway.slo_ttft * 1000.0
        if slo_ms != self._knobs["slo_ttft_ms"]:
            self._knobs["slo_ttft_ms"] = slo_ms
            for mr in self.models.values():
                mr.router.config = dataclasses.replace(mr.router.config, slo_ttft_ms=slo_ms)

    def first_token(self, request_id: str) -> None:
        mr = self._requests.get(request_id)
        if mr is not None:
            mr.router.first_token(request_id)

    def finish(self, request_id: str) -> None:
        mr = self._requests.pop(request_id, None)
        if mr is not None:
            mr.router.free(request_id)

    def load_of(self, worker: str) -> dict:
        mr = self._of_worker.get(worker)
        if mr is None:
            return {}
        ld = mr.router.load(worker)
        return {"active_prefill_tokens": ld.active_prefill_tokens, "prefilled_tokens": ld.prefilled_tokens,
                "decode_blocks": ld.decode_blocks,
                "active_requests": ld.active_requests, "kv_pages": ld.pages,
                "kv_blocks": mr.router.config.kv_blocks, "kv_tokens_said": self._kv_tokens.get(worker)}

    def hot_prefixes(self, n: int) -> list[dict]:
        out = []
        for model, mr in self.models.items():
            for h, count in mr.router.sketch.top(n):
                out.append({"model": model, "block_hash": f"{h & (1 << 64) - 1:016x}", "count": count})
        out.sort(key=lambda e: -e["count"])
        return out[:n]

    # ------------------------------------------------------------------ predict-on-route

    def predict(self, worker: str, identity: IdentityScope, hashes: Sequence[int]) -> None:
        mr = self._of_worker.get(worker)
        if not hashes or mr is None:             # nothing to record, or the engine left meanwhile
            return
        has_events = bool(mr.specs[worker].kv_events)
        if has_events and identity.tenant_id == "":
            # The engine's own event scope: its events say what it holds, and a prediction
            # would only double their blocks (and outlive them where the events chain the
            # blocks from a parent this gateway never saw, as after a restart).
            return
        now = self._clock()
        key = (worker, identity, hashes[-1])
        old = self._predictions.pop(key, None)
        if old is None and len(self._predictions) >= MAX_PREDICTIONS:
            self._drop(self._predictions.popitem(last=False)[1])
        p = _Prediction(worker, identity, tuple(hashes), now + CONFIRM_AFTER_S,
                        float("inf") if has_events else now + self.predict_ttl)
        self._predictions[key] = p
        mr.router.add_blocks(worker, identity, hashes, DEVICE)
        if old is not None:
            # Predicted again: its blocks count once.  Dropped after the add, so the blocks both
            # hold only change their count (the index is not emptied and refilled).
            self._drop(old)

    def _drop(self, p: _Prediction, keep: int = 0) -> None:
        mr = self._of_worker[p.worker]
        gone = p.hashes[keep:]
        if gone:
            mr.router.remove_blocks(p.worker, p.scope, gone, DEVICE)

    @staticmethod
    def _engine_scope(identity: IdentityScope) -> IdentityScope:
        """The scope the engine's own events are indexed under: no tenant (vLLM names none)."""
        return IdentityScope(identity.model_id, identity.tokenizer_id, identity.adapter_id, "")

    def sweep(self) -> int:
        """Confirm or drop due predictions; returns how many were dropped (fully or in part)."""
        now = self._clock()
        dropped = 0
        for key, p in list(self._predictions.items()):
            if now >= p.expires_at:
                del self._predictions[key]
                self._drop(p)
                dropped += 1
                continue
            if now < p.checked_at or p.expires_at != float("inf"):
                continue
            mr = self._of_worker[p.worker]
            m = mr.router.find_matches(self._engine_scope(p.scope), p.hashes)
            depth = int(m.depth(list(m.workers).index(p.worker))) if p.worker in m.workers else 0
            if depth < len(p.hashes):
                # The engine does not hold (all of) it: keep only the confirmed prefix.
                self._drop(p, keep=depth)
                dropped += 1
                if depth == 0:
                    del self._predictions[key]
                    continue
                p.hashes = p.hashes[:depth]
            p.checked_at = now + CONFIRM_AFTER_S
        return dropped

    # ------------------------------------------------------------------ events

    def start_events(self, spec, on_batch: Callable[[], None]) -> EventConsumer:
        """Consume one engine's KV events on a thread (gaps are replayed by the consumer); a
        publisher that restarted or lost batches for good has its event state dropped."""
        mr = self._of_worker[spec.id]
        if spec.id in self._consumers:
            return self._consumers[spec.id]
        scope = IdentityScope(spec.model, spec.identity_tokenizer, None, "")

        def apply(seq, batch) -> None:
            mr.router.apply_events(spec.id, batch, scope)
            on_batch()

        consumer = EventConsumer(spec.kv_events, apply, replay_endpoint=spec.kv_replay or None,
                                 on_reset=lambda: mr.router.clear_source(spec.id))
        consumer.start()
        self._consumers[spec.id] = consumer
        return consumer

    def event_stats(self, worker: str) -> Optional[dict]:
        """The engine's event consumer counters (batches, gaps, replayed, lost), or None."""
        c = self._consumers.get(worker)
        if c is None:
            return None
        st = c.stats
        return {"batches": st.batches, "events": st.events, "gaps": st.gaps, "replayed": st.replayed,
                "lost": st.lost, "restarts": st.restarts, "decode_errors": st.decode_errors}

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()

    async def close(self) -> None:
        consumers, self._consumers = list(self._consumers.values()), {}
        for c in consumers:
            await asyncio.get_running_loop().run_in_executor(None, c.close)
