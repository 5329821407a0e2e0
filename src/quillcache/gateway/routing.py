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
  prediction lives ``[gateway] predict_ttl``.

So a tenant-b request never earns credit for tenant a's prefix: the decision counts those
blocks as refused (``x-quillcache-reuse-refused``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from quillcache.control.events import EventConsumer
from quillcache.control.indexer import DEVICE, chain_hashes
from quillcache.control.router import PLAN_CODES, Router, RouterConfig
from quillcache.model import IdentityScope

__all__ = ["Identity", "Decision", "GatewayRouter", "CONFIRM_AFTER_S", "SWEEP_INTERVAL_S",
           "MAX_PREDICTIONS"]

CONFIRM_AFTER_S = 2.0        # seconds an engine with events has to confirm a predicted prefix
SWEEP_INTERVAL_S = 1.0       # seconds between prediction sweeps
MAX_PREDICTIONS = 200_000    # predicted prefixes remembered at once (oldest dropped first)

Identity = IdentityScope
_ROUTER_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}


@dataclass
class Decision:
    """What the gateway tells the client in the x-quillcache-* headers."""

    worker: str
    request_id: str
    blocks: int
    overlap: dict                # tier name -> blocks credited on the chosen worker
    local_hits: int              # device + host + disk blocks on the chosen worker
    refused: int                 # prefix blocks there cached under another identity
    plan_hit: int
    plan_fetch: int
    plan_recompute: int
    decision_us: float


@dataclass
class _Prediction:
    worker: str
    scope: IdentityScope
    hashes: tuple
    checked_at: float            # loop time of the next confirmation check
    expires_at: float            # for engines without events


class _ModelRouter:
    def __init__(self, model: str, specs, config: RouterConfig) -> None:
        self.model = model
        self.router = Router(config, workers=[s.id for s in specs])
        self.specs = {s.id: s for s in specs}


class GatewayRouter:
    """Routers per model, event consumers, and predict-on-route bookkeeping."""

    def __init__(self, cfg, clock: Callable[[], float] = time.monotonic) -> None:
        r = cfg.router                  # the cost knobs shared with a node's [router]
        self._clock = clock
        self.predict_ttl = cfg.gateway.predict_ttl
        by_model: dict[str, list] = {}
        for spec in cfg.gateway.engines:
            by_model.setdefault(spec.model, []).append(spec)
        self.models: dict[str, _ModelRouter] = {}
        self._of_worker: dict[str, _ModelRouter] = {}
        for model, specs in by_model.items():
            knobs = {k: v for k, v in r.as_dict().items() if k in _ROUTER_FIELDS}
            rc = RouterConfig(**{**knobs, "policy": r.policy, "block_size": specs[0].block_size})
            mr = _ModelRouter(model, specs, rc)
            self.models[model] = mr
            for s in specs:
                self._of_worker[s.id] = mr
        self._predictions: dict[tuple, _Prediction] = {}
        self._requests: dict[str, _ModelRouter] = {}
        self._consumers: list[EventConsumer] = []

    # ------------------------------------------------------------------ hashing and deciding

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[int]:
        return chain_hashes(tokens, block_size)

    def decide(self, identity: IdentityScope, hashes: Sequence[int], n_tokens: int,
               candidates: Sequence[str]) -> Decision:
        mr = self._of_worker[candidates[0]]
        # The router counts the request's load from here on: first_token() and finish() release it.
        d = mr.router.route(identity, hashes=hashes, request_tokens=n_tokens, candidates=candidates)
        dev, host, disk, pool = d.overlap
        self._requests[d.request_id] = mr
        plan = d.plan
        # Refused: the most prefix blocks any candidate holds only under another identity,
        # whichever worker was chosen (the chosen one may hold none of them).
        m = mr.router.find_matches(identity, hashes)
        refused = max([int(m.refused[i]) for i, w in enumerate(m.workers) if w in candidates] or [0])
        return Decision(d.worker, d.request_id, len(hashes),
                        {"device": dev, "host": host, "disk": disk, "pool": pool},
                        dev + host + disk, max(refused, d.refused_blocks),
                        plan.count(0) + plan.count(1) + plan.count(2), plan.count(PLAN_CODES.index("pool")),
                        plan.count(PLAN_CODES.index("recompute")), d.latency_us)

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
        return {"active_prefill_tokens": ld.active_prefill_tokens, "decode_blocks": ld.decode_blocks,
                "active_requests": ld.active_requests}

    def hot_prefixes(self, n: int) -> list[dict]:
        out = []
        for model, mr in self.models.items():
            for h, count in mr.router.sketch.top(n):
                out.append({"model": model, "block_hash": f"{h & (1 << 64) - 1:016x}", "count": count})
        out.sort(key=lambda e: -e["count"])
        return out[:n]

    # ------------------------------------------------------------------ predict-on-route

    def predict(self, worker: str, identity: IdentityScope, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        mr = self._of_worker[worker]
        now = self._clock()
        key = (worker, identity, hashes[-1])
        if key in self._predictions:
            p = self._predictions.pop(key)          # re-inserted last: the freshest
        elif len(self._predictions) >= MAX_PREDICTIONS:
            oldest = next(iter(self._predictions))
            self._drop(self._predictions.pop(oldest))
        has_events = bool(mr.specs[worker].kv_events)
        p = _Prediction(worker, identity, tuple(hashes), now + CONFIRM_AFTER_S,
                        float("inf") if has_events else now + self.predict_ttl)
        self._predictions[key] = p
        mr.router.add_blocks(worker, identity, hashes, DEVICE)

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
            if p.scope.tenant_id == "":
                del self._predictions[key]           # the events' own scope: nothing to confirm
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
        scope = IdentityScope(spec.model, spec.identity_tokenizer, None, "")

        def apply(seq, batch) -> None:
            mr.router.apply_events(spec.id, batch, scope)
            on_batch()

        consumer = EventConsumer(spec.kv_events, apply, replay_endpoint=spec.kv_replay or None,
                                 on_reset=lambda: mr.router.clear_source(spec.id))
        consumer.start()
        self._consumers.append(consumer)
        return consumer

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()

    async def close(self) -> None:
        consumers, self._consumers = self._consumers, []
        for c in consumers:
            await asyncio.get_running_loop().run_in_executor(None, c.close)
