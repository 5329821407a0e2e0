"""Trace replay: N simulated engines on one virtual clock, each request placed by the
control plane's ``Router`` (one of its policies), which sees only what it sees in
production: the engines' KV events and its own load accounting (route, first token, end).

The clock is a heap of engine iteration ends and trace arrivals, so a run is deterministic
and as fast as the engine model allows.  Events reach the router at the end of the engine
iteration that produced them (a real router sees them a little later: the best case for
every cache-aware policy alike).

The content of trace block ``h`` is the token ids ``h, 1, 2, .., B - 1`` (B tokens per block):
equal ids are equal tokens, different ids different tokens, as the trace means (the shared
tail keeps building them cheap).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from quillcache.control.events import EventBatch
from quillcache.control.indexer import chain_hashes as router_chain_hashes
from quillcache.control.router import Router, RouterConfig
from quillcache.control.sim.engine import (
    EngineConfig, SimEngine, SimEngineError, SimRequest, StepResult, chain_hashes,
)
from quillcache.control.sim.kvevents import step_events
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest
from quillcache.model import IdentityScope

__all__ = ["ReplayRequest", "PolicyResult", "build_requests", "run_policy", "percentile",
           "block_token_ids", "REPLAY_MODEL"]

REPLAY_MODEL = "llama-3-8b"


_TAILS: dict[int, tuple[int, ...]] = {}


def block_token_ids(hash_id: int, block_tokens: int) -> tuple[int, ...]:
    tail = _TAILS.get(block_tokens)
    if tail is None:
        tail = _TAILS[block_tokens] = tuple(range(1, block_tokens))
    return (hash_id,) + tail


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A trace request made concrete: its identity and both hash chains of its full blocks."""

    trace: TraceRequest
    scope: IdentityScope
    engine_hashes: tuple[bytes, ...]        # identity-keyed: what the engine caches by
    router_hashes: tuple[int, ...]          # the router's hashes of the token ids
    arrival_us: int


def build_requests(trace: Sequence[TraceRequest], speedup: float, model: str = REPLAY_MODEL,
                   block_tokens: int = TRACE_BLOCK_TOKENS) -> list[ReplayRequest]:
    if not speedup > 0:
        raise ValueError(f"speedup {speedup!r}: must be > 0")
    out = []
    scopes: dict[str, IdentityScope] = {}
    for t in trace:
        scope = scopes.setdefault(t.tenant, IdentityScope(model, model, None, t.tenant))
        full = t.hash_ids[:t.input_length // block_tokens]
        contents = [h.to_bytes(8, "big") for h in full]
        tokens: list[int] = []
        for h in full:
            tokens.extend(block_token_ids(h, block_tokens))
        out.append(ReplayRequest(t, scope, tuple(chain_hashes(scope, contents)),
                                 tuple(router_chain_hashes(tokens, block_tokens)),
                                 int(round(t.timestamp_ms * 1000.0 / speedup))))
    return out


@dataclass
class PolicyResult:
    name: str
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    credited_blocks: float = 0.0
    cross_identity_credited_blocks: int = 0
    cross_identity_served_blocks: int = 0
    refused_blocks: int = 0
    refused_requests: int = 0
    makespan_us: int = 0
    busy_us: list[int] = field(default_factory=list)
    decision_us: list[float] = field(default_factory=list)

    def summary(self, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
        n = len(self.ttft_ms)
        good = sum(1 for a, b in zip(self.ttft_ms, self.tpot_ms)
                   if a <= ttft_slo_ms and b <= tpot_slo_ms)
        util = (sum(self.busy_us) / (len(self.busy_us) * self.makespan_us)
                if self.makespan_us and self.busy_us else 0.0)
        return {
            "requests": n,
            "ttft_p50_ms": percentile(self.ttft_ms, 50),
            "ttft_p99_ms": percentile(self.ttft_ms, 99),
            "tpot_p50_ms": percentile(self.tpot_ms, 50),
            "hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "goodput": good / n if n else 0.0,
            "cross_identity_credited_blocks": self.cross_identity_credited_blocks,
            "cross_identity_served_blocks": self.cross_identity_served_blocks,
            "refused_blocks": self.refused_blocks,
            "credited_blocks": self.credited_blocks,
            "refused_requests": self.refused_requests,
            "utilization": util,
            "decision_p50_us": percentile(self.decision_us, 50),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, -(-int(q * len(s)) // 100) - 1))
    return float(s[k])


def run_policy(requests: Sequence[ReplayRequest], policy: str, engines: int, config: EngineConfig,
               seed: int = 0, on_step: Optional[Callable[[int, StepResult], None]] = None,
               ) -> PolicyResult:
    """Replay ``requests`` (sorted by arrival) against ``engines`` fresh engines, routed by
    a fresh ``Router`` with ``policy``."""
    if engines < 1:
        raise ValueError(f"engines {engines!r}: must be at least 1")
    bs = config.block_size
    names = [f"engine-{i}" for i in range(engines)]
    router = Router(RouterConfig(policy=policy, block_size=bs, seed=seed), workers=names)
    sims = [SimEngine(config) for _ in range(engines)]
    running = [False] * engines
    result = PolicyResult(policy)
    heap: list = []        # (time_us, kind, key, engine); kind 0 = iteration end, 1 = arrival
    seq = 0

    arrivals = [r.arrival_us for r in requests]
    next_arrival = 0                        # index of the next request to arrive

    def start(e: int, now: int) -> None:
        nonlocal seq
        until = arrivals[next_arrival] if next_arrival < len(arrivals) else now + (1 << 50)
        plan = sims[e].plan_step(now, until)
        if plan is None:
            running[e] = False
            return
        running[e] = True
        seq += 1
        heapq.heappush(heap, (now + plan.duration_us, 0, seq, e))

    for i, r in enumerate(requests):
        heapq.heappush(heap, (r.arrival_us, 1, i, -1))
    now = 0
    while heap:
        now, kind, key, e = heapq.heappop(heap)
        if kind == 1:
            next_arrival = key + 1
            r = requests[key]
            rid = f"r{r.trace.index}"
            d = router.route(r.scope, hashes=r.router_hashes, request_tokens=r.trace.input_length,
                             request_id=rid)
            e = names.index(d.worker)
            result.credited_blocks += d.credited_blocks
            result.cross_identity_credited_blocks += d.cross_identity_credited_blocks
            result.refused_blocks += d.refused_blocks
            result.decision_us.append(d.latency_us)
            ids = r.trace.hash_ids
            sim = SimRequest(rid, r.scope, r.trace.input_length, r.engine_hashes,
                             r.trace.output_length, now,
                             block_tokens=lambda i, ids=ids: block_token_ids(ids[i], bs), tag=r)
            try:
                sims[e].submit(sim)
            except SimEngineError:
                result.refused_requests += 1
                router.free(rid)
                continue
            if not running[e]:
                start(e, now)
            continue
        res = sims[e].finish_step()
        events = step_events(res, bs)
        if events:
            router.apply_events(names[e], EventBatch(res.end_us / 1e6, tuple(events)),
                                IdentityScope(REPLAY_MODEL, REPLAY_MODEL, None, ""))
        for sim in res.first_tokens:
            result.ttft_ms.append((sim.first_token_us - sim.arrival_us) / 1000.0)
            result.prompt_tokens += sim.prompt_tokens
            result.hit_tokens += sim.hit_blocks * bs
            router.first_token(sim.request_id)
        for sim in res.finished:
            out = sim.max_tokens
            result.tpot_ms.append((sim.finish_us - sim.first_token_us) / 1000.0 / (out - 1)
                                  if out > 1 else 0.0)
            router.free(sim.request_id)
        if on_step is not None:
            on_step(e, res)
        start(e, res.end_us)
    result.makespan_us = now
    result.busy_us = [s.busy_us for s in sims]
    result.cross_identity_served_blocks = sum(s.cross_identity_hits for s in sims)
    return result
