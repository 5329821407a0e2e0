"""Trace replay: N simulated engines on one virtual clock, requests placed by a routing
policy that sees only what a real router sees (the engines' KV events and its own load
accounting), and the per-request TTFT, TPOT and cache figures that come out.

The clock is a heap of engine iteration ends and trace arrivals, so a run is deterministic
and as fast as the engine model allows.  Events reach the policy at the end of the engine
iteration that produced them (a real router sees them a little later: this is the best
case for every cache-aware policy alike).
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from quillcache.control.sim.engine import (
    EngineConfig, Identity, SimEngine, SimRequest, StepResult, chain_hashes,
)
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["ReplayRequest", "RoutePolicy", "Decision", "PolicyResult", "build_requests",
           "run_policy", "percentile", "EngineView", "BLANK_IDENTITY", "BASELINES",
           "RoundRobin", "LeastLoaded", "MaxOverlap"]

BLANK_IDENTITY = Identity(model="")     # hashes content only: what an identity-blind router sees


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A trace request made concrete: its identity and both hash chains of its full blocks."""

    trace: TraceRequest
    identity: Identity
    engine_hashes: tuple[bytes, ...]        # identity-keyed, what the engine caches by
    content_hashes: tuple[bytes, ...]       # identity-blind, what the token ids give
    arrival_us: int

    @property
    def blocks(self) -> int:
        return len(self.engine_hashes)


def build_requests(trace: Sequence[TraceRequest], model: str, speedup: float,
                   block_tokens: int = TRACE_BLOCK_TOKENS) -> list[ReplayRequest]:
    """Hash chains for every request: the content of block ``h`` is the id ``h`` itself."""
    if speedup <= 0:
        raise ValueError(f"speedup {speedup!r}: must be > 0")
    out = []
    identities: dict[str, Identity] = {}
    for t in trace:
        ident = identities.setdefault(t.tenant, Identity(model=model, tenant=t.tenant))
        full = t.input_length // block_tokens
        contents = [h.to_bytes(8, "big") for h in t.hash_ids[:full]]
        out.append(ReplayRequest(t, ident, tuple(chain_hashes(ident, contents)),
                                 tuple(chain_hashes(BLANK_IDENTITY, contents)),
                                 int(round(t.timestamp_ms * 1000.0 / speedup))))
    return out


@dataclass(slots=True)
class Decision:
    engine: int
    credited_blocks: int = 0                # prefix blocks the policy counted as cached there


class EngineView:
    """What a router may know about the engines: their KV events (stored/removed, with the
    identity the event names) and the load it accounts itself."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.active_prefill_tokens = [0] * n
        self.active_decode_blocks = [0] * n
        self.active_requests = [0] * n


class RoutePolicy(Protocol):
    name: str

    def route(self, req: ReplayRequest, now_us: int) -> Decision: ...
    def on_stored(self, engine: int, identity: Identity, hashes: Sequence[bytes],
                  content: Sequence[bytes]) -> None: ...
    def on_removed(self, engine: int, identity: Identity, hashes: Sequence[bytes],
                   content: Sequence[bytes]) -> None: ...
    def on_first_token(self, engine: int, req: ReplayRequest) -> None: ...
    def on_finished(self, engine: int, req: ReplayRequest) -> None: ...


@dataclass
class PolicyResult:
    name: str
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    credited_blocks: int = 0
    cross_identity_credited_blocks: int = 0
    cross_identity_served_blocks: int = 0
    refused: int = 0
    makespan_us: int = 0
    busy_us: list[int] = field(default_factory=list)
    per_engine_requests: list[int] = field(default_factory=list)

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
            "credited_blocks": self.credited_blocks,
            "refused": self.refused,
            "utilization": util,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return float(s[k])


class _ContentResidency:
    """Ground truth for the report: per engine, how many identities hold each content
    chain.  Used to count credit given to blocks the request's identity cannot use."""

    def __init__(self, n: int) -> None:
        self.holders: list[dict[bytes, int]] = [{} for _ in range(n)]

    def add(self, engine: int, content: Sequence[bytes]) -> None:
        d = self.holders[engine]
        for c in content:
            d[c] = d.get(c, 0) + 1

    def remove(self, engine: int, content: Sequence[bytes]) -> None:
        d = self.holders[engine]
        for c in content:
            left = d[c] - 1
            if left:
                d[c] = left
            else:
                del d[c]

    def prefix(self, engine: int, content: Sequence[bytes]) -> int:
        d = self.holders[engine]
        n = 0
        for c in content:
            if c not in d:
                break
            n += 1
        return n


def run_policy(requests: Sequence[ReplayRequest], policy: RoutePolicy, engines: int,
               config: EngineConfig, on_step: Optional[Callable[[int, StepResult], None]] = None,
               ) -> PolicyResult:
    """Replay ``requests`` (sorted by arrival) against ``engines`` fresh engines."""
    if engines < 1:
        raise ValueError(f"engines {engines!r}: must be at least 1")
    sims = [SimEngine(config) for _ in range(engines)]
    running = [False] * engines
    truth = _ContentResidency(engines)
    # engine hash -> content hash, for the blocks the engines report
    content_of: dict[bytes, bytes] = {}
    for r in requests:
        content_of.update(zip(r.engine_hashes, r.content_hashes))
    result = PolicyResult(policy.name, per_engine_requests=[0] * engines)
    heap: list = []        # (time_us, kind, seq, engine); kind 0 = iteration end, 1 = arrival
    seq = 0
    bs = config.block_size
    routed: dict[int, tuple[int, ReplayRequest]] = {}    # id(sim request) -> (engine, req)

    def start(e: int, now: int) -> None:
        nonlocal seq
        plan = sims[e].plan_step(now)
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
            r = requests[key]
            decision = policy.route(r, now)
            e = decision.engine
            usable = sims[e].cached_prefix(r.engine_hashes)
            visible = truth.prefix(e, r.content_hashes)
            credited = decision.credited_blocks
            result.credited_blocks += credited
            result.cross_identity_credited_blocks += max(0, min(credited, visible) - usable)
            sim = SimRequest(f"r{r.trace.index}", r.identity, r.trace.input_length,
                             r.engine_hashes, r.trace.output_length, now, tag=r)
            try:
                sims[e].submit(sim)
            except ValueError:
                result.refused += 1
                policy.on_finished(e, r)
                continue
            routed[id(sim)] = (e, r)
            result.per_engine_requests[e] += 1
            if not running[e]:
                start(e, now)
            continue
        res = sims[e].finish_step()
        for ident, parent, blocks in res.stored:
            hashes = [b.block_hash for b in blocks]
            content = [content_of[h] for h in hashes]
            truth.add(e, content)
            policy.on_stored(e, ident, hashes, content)
        if res.removed:
            for ident, h in res.removed:
                truth.remove(e, (content_of[h],))
                policy.on_removed(e, ident, (h,), (content_of[h],))
        for sim in res.first_tokens:
            r = sim.tag
            result.ttft_ms.append((sim.first_token_us - sim.arrival_us) / 1000.0)
            result.prompt_tokens += sim.prompt_tokens
            result.hit_tokens += sim.hit_blocks * bs
            policy.on_first_token(e, r)
        for sim in res.finished:
            r = sim.tag
            out = sim.max_tokens
            tpot = (sim.finish_us - sim.first_token_us) / 1000.0 / (out - 1) if out > 1 else 0.0
            result.tpot_ms.append(tpot)
            routed.pop(id(sim), None)
            policy.on_finished(e, r)
        if on_step is not None:
            on_step(e, res)
        start(e, res.end_us)
    result.makespan_us = now
    result.busy_us = [s.busy_us for s in sims]
    result.cross_identity_served_blocks = sum(s.cross_identity_hits for s in sims)
    return result


# --------------------------------------------------------------------------- baselines


class _Base:
    """Load accounting shared by every policy, as Dynamo's router keeps it: a request's
    prompt tokens are active prefill from routing to its first token, its blocks are
    active decode blocks from routing to its end."""

    name = "base"

    def __init__(self, engines: int, block_tokens: int, seed: int = 0) -> None:
        self.view = EngineView(engines)
        self.block_tokens = block_tokens
        self.rng = random.Random(seed)

    def _account(self, e: int, req: ReplayRequest) -> None:
        v = self.view
        v.active_prefill_tokens[e] += req.trace.input_length
        v.active_decode_blocks[e] += -(-req.trace.input_length // self.block_tokens)
        v.active_requests[e] += 1

    def on_stored(self, engine, identity, hashes, content) -> None:
        pass

    def on_removed(self, engine, identity, hashes, content) -> None:
        pass

    def on_first_token(self, engine: int, req: ReplayRequest) -> None:
        self.view.active_prefill_tokens[engine] -= req.trace.input_length

    def on_finished(self, engine: int, req: ReplayRequest) -> None:
        v = self.view
        v.active_decode_blocks[engine] -= -(-req.trace.input_length // self.block_tokens)
        v.active_requests[engine] -= 1

    def _argmin(self, costs: Sequence[float]) -> int:
        low = min(costs)
        ties = [i for i, c in enumerate(costs) if c == low]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)


class RoundRobin(_Base):
    name = "round_robin"

    def __init__(self, engines: int, block_tokens: int, seed: int = 0) -> None:
        super().__init__(engines, block_tokens, seed)
        self._next = 0

    def route(self, req: ReplayRequest, now_us: int) -> Decision:
        e = self._next
        self._next = (e + 1) % self.view.n
        self._account(e, req)
        return Decision(e)


class LeastLoaded(_Base):
    """Fewest active requests, then fewest active prefill tokens."""

    name = "least_loaded"

    def route(self, req: ReplayRequest, now_us: int) -> Decision:
        v = self.view
        e = self._argmin([v.active_requests[i] * (1 << 40) + v.active_prefill_tokens[i]
                          for i in range(v.n)])
        self._account(e, req)
        return Decision(e)


class MaxOverlap(_Base):
    """The longest identity-blind prefix match from the events; ties to the least loaded."""

    name = "prefix"

    def __init__(self, engines: int, block_tokens: int, seed: int = 0) -> None:
        super().__init__(engines, block_tokens, seed)
        self._held: list[dict[bytes, int]] = [{} for _ in range(engines)]

    def on_stored(self, engine, identity, hashes, content) -> None:
        d = self._held[engine]
        for c in content:
            d[c] = d.get(c, 0) + 1

    def on_removed(self, engine, identity, hashes, content) -> None:
        d = self._held[engine]
        for c in content:
            left = d.get(c, 0) - 1
            if left > 0:
                d[c] = left
            else:
                d.pop(c, None)

    def route(self, req: ReplayRequest, now_us: int) -> Decision:
        v = self.view
        overlaps = []
        for e in range(v.n):
            d = self._held[e]
            n = 0
            for c in req.content_hashes:
                if c not in d:
                    break
                n += 1
            overlaps.append(n)
        best = max(overlaps)
        e = self._argmin([(best - overlaps[i]) * (1 << 40) + v.active_requests[i]
                          for i in range(v.n)])
        self._account(e, req)
        return Decision(e, overlaps[e])


BASELINES = {p.name: p for p in (RoundRobin, LeastLoaded, MaxOverlap)}
