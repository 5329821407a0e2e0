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

from quillcache.control.events import BlockRemoved, BlockStored, EventBatch
from quillcache.control.indexer import chain_hashes as router_chain_hashes
from quillcache.control.indexer import engine_hash_text
from quillcache.control.router import Router, RouterConfig
from quillcache.control.sim.engine import (
    EngineConfig, LruPool, SimEngine, SimEngineError, SimRequest, StepResult, chain_hashes,
)
from quillcache.control.sim.kvevents import scope_tuple, step_events
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest
from quillcache.model import IdentityScope

__all__ = ["ReplayRequest", "PolicyResult", "build_requests", "run_policy", "percentile",
           "block_token_ids", "replay_router_config", "REPLAY_MODEL"]

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
    """Each request with its arrival in microseconds after the trace's first: a slice cut from
    the middle of a trace replays as the same slice rebased to 0 (no idle lead-in to wait
    through on the gateway's wall clock, none counted in the measured load)."""
    if not speedup > 0:
        raise ValueError(f"speedup {speedup!r}: must be > 0")
    # The rounded arrivals shift by one whole amount: a trace that starts at 0 is unchanged.
    origin = int(round(min((t.timestamp_ms for t in trace), default=0.0) * 1000.0 / speedup))
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
                                 int(round(t.timestamp_ms * 1000.0 / speedup)) - origin))
    return out


@dataclass
class PolicyResult:
    """One policy's replay.  ``ttft_ms[i]`` and ``tpot_ms[i]`` are the same request's (the
    replay appends both as it finishes), the one at ``request_index[i]`` in the replayed
    requests, which found ``request_hit_tokens[i]`` of its ``request_prompt_tokens[i]`` on its
    engine's device: goodput counts the requests that meet both SLOs.  ``refused_index``: the requests
    admission refused, each a miss of the SLO."""

    name: str
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    request_index: list[int] = field(default_factory=list)
    request_prompt_tokens: list[int] = field(default_factory=list)
    request_hit_tokens: list[int] = field(default_factory=list)
    refused_index: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    credited_blocks: float = 0.0
    cross_identity_credited_blocks: int = 0
    cross_identity_served_blocks: int = 0
    refused_blocks: int = 0
    refused_requests: int = 0
    admission_refused: int = 0        # refused early by admission = "predict": SLO misses
    pool_tokens: int = 0
    transfer_tokens: int = 0
    makespan_us: int = 0
    window_us: int = 0                # first arrival to last: while the trace offers work
    window_prefill_busy_us: int = 0   # the engines' prefill-busy time in that window, summed
    busy_us: list[int] = field(default_factory=list)
    prefill_busy_us: list[int] = field(default_factory=list)
    decision_us: list[float] = field(default_factory=list)

    def summary(self, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
        n = len(self.ttft_ms)
        good = sum(1 for a, b in zip(self.ttft_ms, self.tpot_ms, strict=True)
                   if a <= ttft_slo_ms and b <= tpot_slo_ms)
        offered = n + self.admission_refused
        # Load: the share of time an engine had prefill work running or queued, i.e. the
        # chance that an arriving request waits behind another's prefill (decode-only
        # iterations take a new request at once), while the trace offers work: from its
        # first arrival to its last.  Past the last arrival the engines only drain, and how
        # long that takes says nothing of the load (over the whole makespan an overload of
        # 2 x reads as ~0.8).  A trace whose arrivals all coincide has no such window: then
        # over the makespan.
        if self.window_us > 0:
            util = self.window_prefill_busy_us / (len(self.busy_us) * self.window_us)
        else:
            span = len(self.busy_us) * self.makespan_us
            util = sum(self.prefill_busy_us) / span if span else 0.0
        return {
            "requests": n,
            "ttft_p50_ms": percentile(self.ttft_ms, 50),
            "ttft_p99_ms": percentile(self.ttft_ms, 99),
            "tpot_p50_ms": percentile(self.tpot_ms, 50),
            "hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "goodput": good / offered if offered else 0.0,
            "pool_rate": self.pool_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "admission_refused": self.admission_refused,
            "cross_identity_credited_blocks": self.cross_identity_credited_blocks,
            "cross_identity_served_blocks": self.cross_identity_served_blocks,
            "refused_blocks": self.refused_blocks,
            "credited_blocks": self.credited_blocks,
            "refused_requests": self.refused_requests,
            "load": util,
            "decision_p50_us": percentile(self.decision_us, 50),
        }

    def by_class(self, classes: Sequence[int], ttft_slo_ms: float, tpot_slo_ms: float) -> list[dict]:
        """``summary``'s TTFT percentiles, goodput and hit rate per class of request: ``classes[j]`` is
        the class (0, 1, ...) of the replayed request at position j.  A class none of whose
        requests finished or was refused has no TTFT (None) and goodput 0."""
        k = max(classes, default=-1) + 1
        ttft: list[list[float]] = [[] for _ in range(k)]
        good, offered, prompt, hit = [0] * k, [0] * k, [0] * k, [0] * k
        for j, a, b, n, h in zip(self.request_index, self.ttft_ms, self.tpot_ms, self.request_prompt_tokens,
                                 self.request_hit_tokens, strict=True):
            c = classes[j]
            ttft[c].append(a)
            offered[c] += 1
            good[c] += a <= ttft_slo_ms and b <= tpot_slo_ms
            prompt[c] += n
            hit[c] += h
        for j in self.refused_index:
            offered[classes[j]] += 1
        return [{"requests": offered[c],
                 "ttft_p50_ms": percentile(ttft[c], 50) if ttft[c] else None,
                 "ttft_p90_ms": percentile(ttft[c], 90) if ttft[c] else None,
                 "ttft_p99_ms": percentile(ttft[c], 99) if ttft[c] else None,
                 "goodput": good[c] / offered[c] if offered[c] else 0.0,
                 "hit_rate": hit[c] / prompt[c] if prompt[c] else 0.0} for c in range(k)]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, -(-int(q * len(s)) // 100) - 1))
    return float(s[k])


POOL_NAME = "pool"


def replay_router_config(policy: str, config: EngineConfig, seed: int = 0, **knobs) -> RouterConfig:
    """The router the replay runs: the engines' own cost model, KV size and batch budget (what
    a deployment measures once), the pool at the engines' pool cost."""
    return RouterConfig(policy=policy, block_size=config.block_size, seed=seed, cost=config.cost,
                        kv_bytes_per_token=config.kv_bytes_per_token,
                        batch_tokens=config.max_batched_tokens,
                        pool_us_per_mb=config.cost.cpu_dram_us_per_mb, kv_blocks=config.capacity_blocks, **knobs)


def _pool_events(pool: LruPool, bs: int) -> list:
    stored, removed = pool.drain()
    events: list = []
    if removed:
        events.append(BlockRemoved(tuple(engine_hash_text(h) for _, h in removed), "cpu"))
    by_scope: dict[IdentityScope, list[bytes]] = {}
    for ident, h in stored:
        by_scope.setdefault(ident, []).append(engine_hash_text(h))
    for ident, hs in by_scope.items():
        events.append(BlockStored(tuple(hs), block_size=bs, medium="cpu", lora_name=ident.adapter_id,
                                  quill_scope=scope_tuple(ident)))
    return events


def run_policy(requests: Sequence[ReplayRequest], policy: str, engines: int, config: EngineConfig,
               seed: int = 0, on_step: Optional[Callable[[int, StepResult], None]] = None,
               pool_blocks: int = 0, admission: str = "off",
               before_route: Optional[Callable[[Router, Sequence[SimEngine], ReplayRequest, int], None]] = None
               ) -> PolicyResult:
    """Replay ``requests`` (sorted by arrival) against ``engines`` fresh engines, routed by
    a fresh ``Router`` with ``policy``.  With ``pool_blocks`` the engines share an ``LruPool``
    of that many blocks: every engine offers it what it computes and evicts and loads from it
    whatever prefix it holds, whatever the policy; its residency reaches the router as a pool
    node's events (only the policies that know a pool use them).  ``before_route`` (a measurement:
    ``bench/router_predict.py``) sees the router, the engines and each request as it arrives,
    before it is routed; it must change neither."""
    if engines < 1:
        raise ValueError(f"engines {engines!r}: must be at least 1")
    bs = config.block_size
    names = [f"engine-{i}" for i in range(engines)]
    router = Router(replay_router_config(policy, config, seed, admission=admission), workers=names)
    pool = LruPool(pool_blocks) if pool_blocks else None
    if pool is not None:
        pool.record = True
        router.indexer.worker(POOL_NAME, pool=True)
    sims = [SimEngine(config, pool) for _ in range(engines)]
    running = [False] * engines
    result = PolicyResult(policy)
    placed: dict[str, int] = {}             # request id -> its position in ``requests``
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
            if next_arrival == len(requests):
                result.window_us = now - arrivals[0]
                result.window_prefill_busy_us = sum(s.prefill_busy_at(now) for s in sims)
            if before_route is not None:
                before_route(router, sims, r, now)
            d = router.route(r.scope, hashes=r.router_hashes, request_tokens=r.trace.input_length,
                             request_id=rid, decode_tokens=r.trace.output_length)
            if not d.admitted:
                result.admission_refused += 1
                result.refused_index.append(key)
                continue
            e = names.index(d.worker)
            result.credited_blocks += d.credited_blocks
            result.cross_identity_credited_blocks += d.cross_identity_credited_blocks
            result.refused_blocks += d.refused_blocks
            result.decision_us.append(d.latency_us)
            ids = r.trace.hash_ids
            sim = SimRequest(rid, r.scope, r.trace.input_length, r.engine_hashes,
                             r.trace.output_length, now,
                             block_tokens=lambda i, ids=ids: block_token_ids(ids[i], bs), tag=r,
                             remote_blocks=sum(d.overlap[:3]) + d.transfer_blocks if d.transfer_blocks else 0)
            result.transfer_tokens += d.transfer_blocks * bs
            try:
                sims[e].submit(sim)
            except SimEngineError:
                result.refused_requests += 1
                router.free(rid)
                continue
            placed[rid] = key
            if not running[e]:
                start(e, now)
            continue
        res = sims[e].finish_step()
        events = step_events(res, bs)
        if events:
            router.apply_events(names[e], EventBatch(res.end_us / 1e6, tuple(events)),
                                IdentityScope(REPLAY_MODEL, REPLAY_MODEL, None, ""))
        if pool is not None:
            pev = _pool_events(pool, bs)
            if pev:
                router.apply_events(POOL_NAME, EventBatch(res.end_us / 1e6, tuple(pev)),
                                    IdentityScope(REPLAY_MODEL, REPLAY_MODEL, None, ""), pool=True)
        for sim in res.first_tokens:
            result.prompt_tokens += sim.prompt_tokens
            result.hit_tokens += sim.hit_blocks * bs
            result.pool_tokens += sim.pool_blocks * bs
            router.first_token(sim.request_id)
        for sim in res.finished:
            out = sim.max_tokens
            # both at its finish: ttft_ms[i] and tpot_ms[i] are one request's (goodput asks both)
            result.ttft_ms.append((sim.first_token_us - sim.arrival_us) / 1000.0)
            result.tpot_ms.append((sim.finish_us - sim.first_token_us) / 1000.0 / (out - 1)
                                  if out > 1 else 0.0)
            result.request_index.append(placed.pop(sim.request_id))
            result.request_prompt_tokens.append(sim.prompt_tokens)
            result.request_hit_tokens.append(sim.hit_blocks * bs)
            router.free(sim.request_id)
        if on_step is not None:
            on_step(e, res)
        start(e, res.end_us)
    result.makespan_us = now
    result.busy_us = [s.busy_us for s in sims]
    result.prefill_busy_us = [s.prefill_busy_us for s in sims]
    result.cross_identity_served_blocks = sum(s.cross_identity_hits for s in sims)
    return result
