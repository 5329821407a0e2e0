"""The router: Dynamo's default worker selector, with identity-scoped and pool-aware credit.

For each candidate worker (Dynamo, ``lib/kv-router/src/scheduling/selector/default.rs``)::

    raw_prefill_blocks = (active_prefill_tokens + request_tokens) / block_size
    credit             = 1.0 * device + 0.75 * host + 0.25 * disk   (+ pool_weight * pool)
    logit              = prefill_load_scale * max(raw_prefill_blocks - credit, 0)
                         + decode_blocks + active_request_weight * active_requests

where device, host, disk (and pool) are overlap blocks, each tier extending the contiguous
prefix of the one before.  Temperature 0 takes the smallest logit, ties broken at random;
T > 0 samples ``p ~ exp(-(c - c_min) / ((c_max - c_min) * T))`` (uniform when all equal).

Policies (``POLICIES``): ``round_robin``, ``least_loaded`` (the logit with no credit),
``prefix`` (deepest overlap, then least loaded), ``dynamo`` (the cost above as Dynamo ships
it: it credits a prefix whoever cached it, and knows no pool), the peers ``sglang``, ``llmd``
and ``mooncake`` (``quillcache.control.policies``: identity-blind, as they ship) and
``quillcache``: the predicted time to first token on each worker from the ``CostModel``
(queue, own uncached tokens, tier-by-tier loads, decode interference, what its pages evict,
KV memory where ``kv_blocks`` is known), with credit only for blocks cached under the request's
identity, and the pool as a tier any worker can load from; a request predicted to miss its SLO
everywhere is placed by ``goodput_placement`` (``control/policies.py``).
With ``admission = "predict"`` a request whose predicted TTFT exceeds ``admission_k`` times
its SLO is refused (``Decision.admitted`` False, nothing tracked): the caller answers it
early (the gateway: 429 with ``Retry-After``).

The decision carries the per-block plan on the chosen worker: local hit (device, host,
disk), fetch from the pool, or recompute.  Load feedback: ``route`` adds the request's
prefill tokens and blocks to its worker, ``first_token`` marks its prefill done and ``free``
releases it (end, abort or disconnect).
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from quillcache.control.indexer import DEVICE, ArtIndexer, Match, chain_hashes
from quillcache.control.inflight import InFlightBlocks, PagePlan, extend_device, page_plan, prefill_progress
from quillcache.control.model import H200_LLAMA3_8B, TCP_BYTES_PER_S, CostModel, us_per_mib
from quillcache.control.policies import (
    BranchPoints, BusyShare, Candidates, DemandShare, TailQuantile, goodput_placement, llmd_scores, mooncake_scores,
    predict_placement, sglang_scores,
)
from quillcache.control.routed import RoutedTree, default_max_blocks
from quillcache.protocol.route import POLICIES
from quillcache.control.sketch import CountMinSketch
from quillcache.model import IdentityScope

__all__ = [
    "POLICIES", "RouterConfig", "Router", "Decision", "WorkerLoad", "PLAN_CODES", "NoWorkers",
]


# per-block plan codes (also the ROUTE reply's plan bytes)
PLAN_DEVICE, PLAN_HOST, PLAN_DISK, PLAN_POOL, PLAN_RECOMPUTE = range(5)
PLAN_CODES = ("device", "host", "disk", "pool", "recompute")


class NoWorkers(RuntimeError):
    """The router knows no worker to route to."""


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "quillcache"
    block_size: int = 16                 # tokens per block of the router's hash chain
    prefill_load_scale: float = 1.0
    active_request_weight: float = 0.0   # Dynamo's decode_active_request_weight (w)
    device_weight: float = 1.0           # Dynamo's overlap_score_credit
    host_weight: float = 0.75            # host_cache_hit_weight
    disk_weight: float = 0.25            # disk_cache_hit_weight
    pool_weight: float = 0.5             # ours: a block any worker can load from the pool
    temperature: float = 0.0
    approximate: bool = False            # predict residency from routing (engines without events)
    approx_ttl_s: float = 120.0
    sketch_epsilon: float = 1e-3         # count-min: over-count <= epsilon * total ...
    sketch_delta: float = 1e-3           # ... with probability >= 1 - delta
    seed: Optional[int] = None
    # --- the quillcache predictor and the mooncake peer: what one engine costs (the deployment's
    # measured CostModel), its KV bytes per token and chunked-prefill budget, and the links
    cost: CostModel = H200_LLAMA3_8B         # measured (control/model.py); a deployment sets its own
    kv_bytes_per_token: int = 131072         # Llama-3-8B bf16: 32 layers x 8 heads x 128 x 2 x 2
    batch_tokens: int = 8192                 # tokens per engine iteration (vLLM max_num_batched_tokens)
    pool_us_per_mb: Optional[int] = None     # pool -> HBM; None: the cost model's CPU-DRAM cost
    transfer_us_per_mb: int = us_per_mib(TCP_BYTES_PER_S)   # instance -> instance (mooncake)
    admission: str = "off"                   # "predict": refuse what is predicted to miss k x SLO
    admission_k: float = 1.0
    slo_ttft_ms: float = 800.0
    kv_blocks: Optional[int] = None          # KV pages (of block_size tokens) per engine; None: not known
    goodput_placement: bool = True           # quillcache: a request doomed everywhere goes where queues already miss

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.admission not in ("off", "predict"):
            raise ValueError(f"router admission {self.admission!r}: one of off, predict")
        if not self.admission_k > 0 or not self.slo_ttft_ms > 0:
            raise ValueError("admission_k and slo_ttft_ms must be > 0")
        if self.kv_bytes_per_token <= 0 or self.batch_tokens <= 0:
            raise ValueError("kv_bytes_per_token and batch_tokens must be positive")


# The columns of the load table, in the order a decision reads them (a counter added here is
# one more column of every row and one more property of WorkerLoad).
_PREFILL_TOKENS, _PREFILL_REQUESTS, _REQUESTS, _DECODE_BLOCKS, _PAGES, _PREFILLED = range(6)
_LOAD_COLUMNS = 6


class _LoadTable:
    """Every worker's load counters as one row of an int64 array, so a decision reads the
    candidates' loads with one indexing, not one Python object per worker.  A worker keeps
    its row (slot) while it is known; a removed worker's row is zeroed and reused."""

    def __init__(self, capacity: int = 16) -> None:
        self.rows = np.zeros((capacity, _LOAD_COLUMNS), np.int64)
        self._free: list[int] = []
        self._next = 0

    def alloc(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next == len(self.rows):
            grown = np.zeros((2 * len(self.rows), _LOAD_COLUMNS), np.int64)
            grown[:self._next] = self.rows
            self.rows = grown
        self._next += 1
        return self._next - 1

    def release(self, slot: int) -> None:
        self.rows[slot] = 0
        self._free.append(slot)


def _column(col: int, doc: str) -> property:
    def get(self) -> int:
        return int(self._table.rows[self._slot, col])

    def set(self, value: int) -> None:
        self._table.rows[self._slot, col] = value
    return property(get, set, doc=doc)


class WorkerLoad:
    """One worker's load counters: a live view of its row in the router's load table (a
    ``WorkerLoad()`` of its own has a table of one row)."""

    __slots__ = ("_table", "_slot")

    def __init__(self, table: Optional[_LoadTable] = None, slot: Optional[int] = None) -> None:
        if table is None:
            table = _LoadTable(1)
            slot = table.alloc()
        self._table, self._slot = table, slot

    active_prefill_tokens = _column(_PREFILL_TOKENS, "uncached prompt tokens routed, first token not yet out")
    prefill_requests = _column(_PREFILL_REQUESTS, "requests routed, first token not yet out")
    active_requests = _column(_REQUESTS, "requests in flight")
    decode_blocks = _column(_DECODE_BLOCKS, "blocks of the requests in flight")
    pages = _column(_PAGES, "KV pages the requests in flight hold: their distinct blocks, each one's partial last")
    prefilled_tokens = _column(_PREFILLED, "of those, what the engine's events show done (quillcache's requests)")

    def __repr__(self) -> str:
        return (f"WorkerLoad(active_prefill_tokens={self.active_prefill_tokens}, decode_blocks={self.decode_blocks}, "
                f"active_requests={self.active_requests}, prefill_requests={self.prefill_requests}, "
                f"pages={self.pages}, prefilled_tokens={self.prefilled_tokens})")


@dataclass
class _Active:
    worker: str
    prefill_tokens: int
    blocks: int
    prefilling: bool = True
    pinned: tuple = ()                   # (scope, hash) of its blocks, pinned in KV memory until it ends
    private_pages: int = 0               # its partial last block's page
    decode_tokens: int = 0               # the tokens it will generate (as its caller says; 0: not said)
    ahead: tuple = ()                    # the blocks it computes for those behind it, until its first token
    rid: str = ""
    chain: tuple = ()                    # (scope, hashes, blocks not its own work): its progress is read
    prefilled: int = 0                   # ... and how many of its prefill_tokens the events show computed


@dataclass
class Decision:
    worker: str
    request_id: str
    plan: bytes                          # one PLAN_* code per block of the request
    logits: dict[str, float]
    credited_blocks: float               # the chosen worker's credit (weighted blocks)
    overlap: tuple[int, int, int, int]   # device, host, disk, pool blocks on the chosen worker
    refused_blocks: int                  # prefix held there under another identity, not credited
    cross_identity_credited_blocks: int  # blocks credited though cached under another identity
    latency_us: float = 0.0
    predicted_ttft_us: float = 0.0       # quillcache and mooncake: the chosen worker's estimate
    admitted: bool = True                # False: refused by admission = "predict" (not tracked)
    transfer_from: Optional[str] = None  # mooncake: the instance the prefix is moved from ...
    transfer_blocks: int = 0             # ... and how many blocks (in the plan as "pool")

    def plan_names(self) -> list[str]:
        return [PLAN_CODES[c] for c in self.plan]


@dataclass
class RouterStats:
    decisions: int = 0
    latencies_us: list = field(default_factory=list)    # the last LATENCY_WINDOW decisions
    cross_identity_credited_blocks: int = 0
    refused_blocks: int = 0
    request_blocks: int = 0              # blocks of the requests routed and tracked ...
    device_blocks: int = 0               # ... and of those, found on the chosen worker's device
    pool_blocks: int = 0                 # ... loaded from the pool there


    @property
    def device_share(self) -> float:
        """The share of routed blocks found on the chosen worker's device."""
        return self.device_blocks / self.request_blocks if self.request_blocks else 0.0

    @property
    def pool_share(self) -> float:
        """Of the routed blocks not on the chosen worker's device, the share loaded from the pool."""
        rest = self.request_blocks - self.device_blocks
        return self.pool_blocks / rest if rest > 0 else 0.0


LATENCY_WINDOW = 8192
BUSY_WINDOW = 256         # decisions the busy share is averaged over (BusyShare)
PEERS = ("sglang", "llmd", "mooncake")
BLIND_POLICIES = ("dynamo",) + PEERS     # they know no identity: every scope's blocks count


class Router:
    """One router; thread-safe (one lock), so an event thread and a request loop can share it."""

    def __init__(self, config: RouterConfig = RouterConfig(), indexer: Optional[ArtIndexer] = None,
                 workers: Sequence[str] = ()) -> None:
        self.config = config
        self.indexer = indexer if indexer is not None else ArtIndexer()
        self._rng = random.Random(config.seed)
        self._lock = threading.RLock()
        self._table = _LoadTable()
        self._loads: dict[str, WorkerLoad] = {}
        self._slot_of: dict[str, int] = {}    # a worker's row in the load table
        self._names: tuple[str, ...] = ()     # the workers, in the order they were added
        self._active: dict[str, _Active] = {}
        self._rr = 0
        self._idx_key: Optional[tuple] = None
        self._idx: "slice | np.ndarray" = slice(0, 0)   # the candidates' columns in a Match
        self._slots = np.zeros(0, dtype=np.intp)        # ... and their rows in the load table
        self._no_trees: dict[int, np.ndarray] = {}
        self._ids = itertools.count()
        self._approx: dict[tuple[str, IdentityScope, int], float] = {}
        self._approx_heap: list[tuple[float, str, IdentityScope, int]] = []
        self._ahead = InFlightBlocks()       # what the requests in prefill compute for those behind them
        self._pinned = InFlightBlocks()      # what the requests in flight pin in KV memory
        self._by_worker: dict[str, dict[str, _Active]] = {}    # the requests in flight, in arrival order
        self._page_plans: dict[str, PagePlan] = {}              # their KV pages played forward, per worker
        self.sketch = CountMinSketch.for_error(config.sketch_epsilon, config.sketch_delta, seed=config.seed or 0)
        self.stats = RouterStats()
        # the p99 of the TTFTs predicted for the requests placed (goodput placement's tail bound)
        self.ttft_tail = TailQuantile(0.99, LATENCY_WINDOW)
        # the engines' busy share as the decisions see it (the predictor's queue stretch)
        self.busy = BusyShare(BUSY_WINDOW)
        # where the tracked arrivals would go for their cache (who queues behind what is sent where)
        self.demand = DemandShare(BUSY_WINDOW)
        # which prefixes distinct arrivals branched from (a shared prefix spreads as without a pool)
        self.branches = BranchPoints(BUSY_WINDOW)
        self.routed = RoutedTree(default_max_blocks(config.block_size))    # the sglang peer's own tree
        self._histogram = None
        for w in workers:
            self.add_worker(w)

    # ---- workers and metrics
    def add_worker(self, name: str) -> None:
        with self._lock:
            self._add_load(name)
            self.indexer.worker(name)

    def _add_load(self, name: str) -> None:
        if name not in self._loads:
            slot = self._slot_of[name] = self._table.alloc()
            self._loads[name] = WorkerLoad(self._table, slot)
            self._names = tuple(self._loads)
            self._idx_key = None

    def set_kv_blocks(self, kv_blocks: Optional[int]) -> None:
        """The engines' KV pages (``RouterConfig.kv_blocks``) from now on: what a gateway learns
        from its engines.  None turns the memory terms off."""
        if kv_blocks is not None and kv_blocks < 1:
            raise ValueError(f"kv_blocks {kv_blocks!r}: at least 1, or None")
        with self._lock:
            if kv_blocks != self.config.kv_blocks:
                self.config = replace(self.config, kv_blocks=kv_blocks)
                self._page_plans.clear()          # played forward against the old figure

    def remove_worker(self, name: str) -> None:
        with self._lock:
            if self._loads.pop(name, None) is not None:
                self._table.release(self._slot_of.pop(name))
                self._names = tuple(self._loads)
                self._idx_key = None
            self.indexer.clear_worker(name)
            self.routed.remove_worker(name)
            for rid in [r for r, a in self._active.items() if a.worker == name]:
                self._release(self._active.pop(rid))

    @property
    def workers(self) -> list[str]:
        return list(self._names)

    def load(self, worker: str) -> WorkerLoad:
        return self._loads[worker]

    def export_metrics(self, registry) -> None:
        """Register the decision-latency histogram, the counters and the predicted-TTFT p99
        gauge on a prometheus registry."""
        from prometheus_client import Counter, Gauge, Histogram
        self._histogram = Histogram(
            "quillcache_router_decision_seconds", "Time to score the workers and pick one", registry=registry,
            buckets=(5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 25e-3))
        self._refused_counter = Counter(
            "quillcache_router_refused_blocks", "Cached blocks not credited: another identity's", registry=registry)
        Gauge("quillcache_router_predicted_ttft_p99_seconds",
              f"p99 of the TTFTs predicted for the last {LATENCY_WINDOW:,} requests placed "
              "(quillcache policy; NaN before 100)", registry=registry).set_function(self._predicted_p99_s)
        Gauge("quillcache_router_busy_share",
              f"Share of the workers with a request in prefill, over the last {BUSY_WINDOW} decisions "
              "(the load the quillcache predictor stretches its queue term by)",
              registry=registry).set_function(lambda: self._locked(self.busy.value))
        Gauge("quillcache_router_saturated",
              f"1 while every worker had a request in prefill at each of the last {BUSY_WINDOW} decisions: the "
              "overload in which quillcache gathers requests doomed everywhere on the fullest queue",
              registry=registry).set_function(lambda: float(self._locked(self.busy.saturated)))

    def _locked(self, read):
        """``read()`` under the router's lock (a scrape runs beside the decisions)."""
        with self._lock:
            return read()

    def _predicted_p99_s(self) -> float:
        v = self._locked(self.ttft_tail.value)
        return float("nan") if v is None else v / 1e6

    # ---- events
    def apply_events(self, worker: str, batch, scope: IdentityScope, *, pool: bool = False) -> int:
        with self._lock:
            if not pool:
                self._add_load(worker)
            n = self.indexer.apply(worker, batch, scope, pool=pool)
            if not pool and worker in self._by_worker:
                self._progress(worker)
            return n

    def _progress(self, worker: str) -> None:
        """What the engine's events show done of the prompts queued there (``prefill_progress``)."""
        col = self.indexer.worker(worker)                 # its column in every Match
        moved = prefill_progress(self._by_worker[worker].values(),
                                 lambda scope, hashes: int(self.indexer.find_matches(scope, hashes).device[col]),
                                 self.config.block_size, self.config.batch_tokens)
        if moved:
            self._table.rows[self._slot_of[worker], _PREFILLED] += moved
            self._page_plans.pop(worker, None)

    def clear_source(self, worker: str) -> None:
        with self._lock:
            self.indexer.clear_worker(worker)

    # ---- decisions
    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return chain_hashes(token_ids, self.config.block_size)

    def route(self, scope: IdentityScope, token_ids: Optional[Sequence[int]] = None, *,
              hashes: Optional[Sequence[int]] = None, request_tokens: Optional[int] = None,
              request_id: Optional[str] = None, policy: Optional[str] = None,
              track: bool = True, candidates: Optional[Sequence[str]] = None,
              decode_tokens: Optional[int] = None) -> Decision:
        """Pick a worker for a request given by its tokens (or by the router's block hashes
        and its token count).  With ``track`` the load feedback starts: call ``first_token``
        and ``free`` with the returned ``request_id``.  ``candidates`` limits the choice to
        those workers (healthy, under their queue limit).  ``decode_tokens``: the tokens it
        will generate (its ``max_tokens``), for how long it holds its KV pages."""
        t0 = time.perf_counter()
        cfg = self.config
        if hashes is None:
            if token_ids is None:
                raise ValueError("route needs token_ids or hashes")
            hashes = self.hashes(token_ids)
        n_tokens = request_tokens if request_tokens is not None else (
            len(token_ids) if token_ids is not None else len(hashes) * cfg.block_size)
        policy = policy or cfg.policy
        admit_us = cfg.admission_k * cfg.slo_ttft_ms * 1000.0 if cfg.admission == "predict" else None
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: one of {', '.join(POLICIES)}")
        with self._lock:
            if cfg.approximate:
                self._expire(time.monotonic())
            names = self._names if candidates is None else tuple(n for n in candidates if n in self._loads)
            if not names:
                raise NoWorkers("no worker to route to")
            scoped = self.indexer.find_matches(scope, hashes)
            key = (scoped.workers, names)
            if self._idx_key != key:             # the columns of the candidates, kept while they hold
                self._index_candidates(key)
            idx, k = self._idx, len(names)
            dev, host, disk = scoped.device[idx], scoped.host[idx], scoped.disk[idx]
            pool, refused = scoped.pool[idx], scoped.refused[idx]
            cross = np.zeros(k, np.int64)
            if policy in BLIND_POLICIES:
                blind = self._blind(hashes, names)
                dev, host, disk = blind.device[idx], blind.host[idx], blind.disk[idx]
                pool = np.zeros(k, np.int64)
                cross = np.maximum(dev + host + disk - (scoped.device[idx] + scoped.host[idx]
                                                        + scoped.disk[idx]), 0)
                refused = np.zeros(k, np.int64)
            elif policy != "quillcache":
                pool = np.zeros(k, np.int64)
            else:
                ahead = self._ahead.depths(scope, hashes, names)
                if ahead is not None:
                    dev, host, disk, pool = extend_device(ahead, dev, host, disk, pool)
            lt = self._table.rows[self._slots]
            if track and policy == "quillcache":
                self.demand.add(self._slots, dev, float(cfg.block_size * cfg.cost.prefill_us_per_token))
            if track:       # what this arrival sees, before it is placed (a probe changes nothing)
                self.busy.add(int(np.count_nonzero(self._table.rows[:, _PREFILL_REQUESTS] > 0)), len(self._loads))
            offered = pool                       # what credited_blocks counts (before the plan caps it)
            if policy in ("dynamo", "least_loaded", "prefix"):
                raw = (lt[:, 0] + n_tokens) / cfg.block_size
                decode = lt[:, 3].astype(float)
                active = lt[:, 2].astype(float)
            predicted = np.zeros(k)
            transfer = np.zeros(k, np.int64)
            if policy in PEERS or policy == "quillcache":
                waits = free = None
                if policy == "quillcache" and cfg.kv_blocks is not None:
                    waits = self._memory_waits(scope, hashes, n_tokens, names, lt)
                    free = self._free_pages(self.indexer.device_counts()[idx], lt)
                queued = lt[:, 0] - lt[:, _PREFILLED] if policy == "quillcache" else lt[:, 0]
                cand = Candidates(tuple(names), dev, host, disk, pool, queued, lt[:, 1], lt[:, 2], self._zeros(k),
                                  n_tokens, len(hashes), cfg.block_size, waits, free)
            if policy == "dynamo":
                credit = (cfg.device_weight * dev + cfg.host_weight * host + cfg.disk_weight * disk
                          + cfg.pool_weight * pool)
                logits = cfg.prefill_load_scale * np.maximum(raw - credit, 0.0) + decode \
                    + cfg.active_request_weight * active
                choice = self._select(logits)
            elif policy == "quillcache":
                excess, saved = self.demand.excess(self._slots)
                pred = predict_placement(cand, cfg.cost, branched=self._branched(scope, hashes, dev),
                                         block_bytes=self._block_bytes, batch_tokens=cfg.batch_tokens,
                                         pool_us_per_mb=self._pool_us_per_mb, device_share=self.stats.device_share,
                                         pool_share=self.stats.pool_share, stretch=self.busy.stretch(len(self._loads)),
                                         excess=excess, saved=saved)
                if track:
                    self._branch(scope, hashes, dev + host + disk + pool)
                if cfg.goodput_placement:
                    pred = goodput_placement(pred, cfg.slo_ttft_ms * 1000.0, tail=self.ttft_tail,
                                             saturated=self.busy.saturated(), admit_us=admit_us)
                logits, predicted, pool = pred.score, pred.ttft_us, pred.pool_blocks
                choice = self._select(logits)
            elif policy == "mooncake":
                logits, transfer = mooncake_scores(cand, cfg.cost, cfg.transfer_us_per_mb, self._block_bytes)
                predicted = logits
                choice = self._select(logits)
            elif policy == "llmd":
                logits = llmd_scores(cand)
                choice = self._select(logits)
            elif policy == "sglang":
                # its match and its trees are its gateway's own tree of routed prompts, not the events
                logits, eligible = sglang_scores(replace(cand, device=self.routed.depths(hashes, names),
                                                         host=self._zeros(k), disk=self._zeros(k),
                                                         tree_blocks=self.routed.sizes(names)))
                choice = self._select(np.where(eligible, 0.0, 1.0))
                if track:                           # sgl-router inserts the prompt as it routes it
                    self.routed.insert(hashes, names[choice])
            elif policy == "least_loaded":
                logits = cfg.prefill_load_scale * raw + decode + cfg.active_request_weight * active
                choice = self._select(logits)
            elif policy == "prefix":
                depth = (dev + host + disk).astype(float)
                load = cfg.prefill_load_scale * raw + decode
                logits = -depth
                best = np.flatnonzero(depth == depth.max())
                lmin = load[best].min()
                choice = int(self._rng.choice([int(b) for b in best if load[b] == lmin]))
            else:  # round_robin
                logits = np.zeros(k)
                choice = self._rr % k
                self._rr += 1
            worker = names[choice]
            d, h, k, p = (int(dev[choice]), int(host[choice]), int(disk[choice]), int(pool[choice]))
            credited = (cfg.device_weight * d + cfg.host_weight * h + cfg.disk_weight * k
                        + cfg.pool_weight * int(offered[choice]))
            moved = int(transfer[choice])
            source = None
            if moved:
                local = dev + host + disk
                source = names[int(np.argmax(local))]
                p = moved
            plan = bytes([PLAN_DEVICE] * d + [PLAN_HOST] * h + [PLAN_DISK] * k + [PLAN_POOL] * p
                         + [PLAN_RECOMPUTE] * (len(hashes) - d - h - k - p))
            admitted = not (admit_us is not None and policy == "quillcache" and predicted[choice] > admit_us)
            track = track and admitted
            if track and policy == "quillcache":
                self.ttft_tail.add(float(predicted[choice]))
            rid = request_id if request_id is not None else f"r{next(self._ids)}"
            if track:
                self._start(rid, worker, n_tokens, d + h + k + p, self._load_tokens(policy, h, k, p),
                            decode_tokens or 0)
                if policy == "quillcache" and not cfg.approximate:     # its own progress: past what it reuses
                    held = self._pinned.depths(scope, hashes, (worker,))  # and what the others there compute
                    self._active[rid].chain = (scope, hashes, max(d + h + k + p, 0 if held is None else int(held[0])))
                self._hold(self._active[rid], scope, hashes, n_tokens, n_tokens - (d + h + k + p) * cfg.block_size)
            if cfg.approximate:
                self._predict(worker, scope, hashes)
            for hh in hashes[:1]:
                self.sketch.add(hh)
            latency = (time.perf_counter() - t0) * 1e6
            st = self.stats
            st.decisions += 1
            if track:       # a probe (track=False) changes nothing a later decision reads
                st.request_blocks += len(hashes)
                st.device_blocks += d
                st.pool_blocks += 0 if moved else p      # mooncake's moves are transfers, not pool loads
            if len(st.latencies_us) >= LATENCY_WINDOW:
                del st.latencies_us[:LATENCY_WINDOW // 2]
            st.latencies_us.append(latency)
            st.cross_identity_credited_blocks += int(cross[choice])
            st.refused_blocks += int(refused[choice])
            if self._histogram is not None:
                self._histogram.observe(latency / 1e6)
                self._refused_counter.inc(int(refused[choice]))
            return Decision(worker, rid, plan, dict(zip(names, logits.tolist())),
                            credited, (d, h, k, p), int(refused[choice]),
                            int(cross[choice]), latency, float(predicted[choice]), admitted,
                            source, moved)

    def _index_candidates(self, key: tuple) -> None:
        """Where the candidates' columns are in the indexer's Match (a slice when they are its
        first workers in order: views, no copies) and their rows in the load table."""
        workers, names = key
        if workers[:len(names)] == names:
            idx: "slice | np.ndarray" = slice(0, len(names))
        else:
            col = {name: i for i, name in enumerate(workers)}
            idx = np.array([col[n] for n in names], dtype=np.intp)
        self._idx_key, self._idx = key, idx
        self._slots = np.array([self._slot_of[n] for n in names], dtype=np.intp)

    # ---- the blocks of the requests in flight
    def _hold(self, a: _Active, scope: IdentityScope, hashes: Sequence[int], n_tokens: int, uncached: int) -> None:
        """A request in flight pins its blocks in its engine's KV memory until it ends (a block
        two requests share, once), and its partial last block too.  Until its first token it
        also computes its prompt's blocks there before a request routed after it to the same
        worker is admitted (the engine admits in arrival order), except those of its last chunk
        of prefill: with chunked prefill the engine admits the next request in the iteration
        that computes that chunk (its uncached tokens modulo the batch budget), before those
        blocks are stored, and recomputes them for it."""
        cfg = self.config
        keys = tuple((scope, h) for h in hashes)
        a.pinned = keys
        a.private_pages = max(math.ceil(n_tokens / cfg.block_size) - len(keys), 0)
        pages = self._pinned.add(a.worker, keys) + a.private_pages
        self._table.rows[self._slot_of[a.worker], _PAGES] += pages
        last = (max(uncached, 1) - 1) % cfg.batch_tokens + 1
        done = min(len(keys), max(n_tokens - last, 0) // cfg.block_size)
        a.ahead = keys[:done]
        self._ahead.add(a.worker, a.ahead)

    def _memory_waits(self, scope: IdentityScope, hashes: Sequence[int], n_tokens: int, names: Sequence[str],
                      lt: np.ndarray) -> np.ndarray:
        """Per candidate, how long the request would wait there for its KV pages (``kv_blocks``
        per engine): the engine admits it when every block of it is pinned, its hits too (an
        evictable cached block it reuses is no longer free), so it needs a page for each of its
        blocks the requests in flight there do not already hold (``inflight.page_wait_us``)."""
        cfg = self.config
        held = lt[:, _PAGES]
        pinned = self._pinned.depths(scope, hashes, names)
        need = math.ceil(n_tokens / cfg.block_size) - (pinned if pinned is not None else 0)
        excess = held + need - cfg.kv_blocks
        waits = np.zeros(len(names))
        full = np.flatnonzero(excess > 0)
        if not len(full):
            return waits
        cost = cfg.cost
        needs = np.broadcast_to(need, len(names))[full].tolist()
        plans, by_worker = self._page_plans, self._by_worker
        for i, nd in zip(full.tolist(), needs):
            name = names[i]
            plan = plans.get(name)
            if plan is None:
                acts = by_worker.get(name)
                if not acts:
                    continue
                # played forward once per change of the worker's requests in flight (the plan
                # depends on nothing else), then a bisection per decision
                decodes = max(int(lt[i, _REQUESTS] - lt[i, _PREFILL_REQUESTS]), 0)
                plan = plans[name] = page_plan(
                    ((a.prefilling, a.prefill_tokens - a.prefilled, a.decode_tokens, a.blocks)
                     for a in acts.values()),
                    cfg.kv_blocks, float(held[i]), cost.prefill_us_per_token,
                    cost.decode_us_per_token + cost.running_decode_penalty_us * decodes)
            waits[i] = plan.wait(nd)
        return waits

    def _free_pages(self, cached: np.ndarray, lt: np.ndarray) -> np.ndarray:
        """Per candidate, the KV pages free in its engine (``kv_blocks``): less the blocks its
        events say its device caches (``cached``), and the blocks the requests routed there have
        still to compute (their uncached tokens; they take pages that no event shows yet)."""
        computing = -(-(lt[:, _PREFILL_TOKENS] - lt[:, _PREFILLED]) // self.config.block_size)
        return np.maximum(self.config.kv_blocks - cached - computing, 0)

    @staticmethod
    def _prefix(scope: IdentityScope, hashes: Sequence[int], depths: np.ndarray) -> tuple:
        """The deepest of ``depths`` as ``BranchPoints`` keys it: (its last block, keyed by
        identity; the block the request goes on with, None where it ends there), or (None, None)
        where it is empty."""
        top = int(depths.max()) if len(depths) else 0
        if not top:
            return None, None
        return (scope, hashes[top - 1]), hashes[top] if top < len(hashes) else None

    def _branched(self, scope: IdentityScope, hashes: Sequence[int], dev: np.ndarray) -> bool:
        """Whether the prefix this request finds deepest on a device is one recent arrivals
        branched from (``BranchPoints``)."""
        prefix, nxt = self._prefix(scope, hashes, dev)
        return prefix is not None and self.branches.branched(prefix, nxt)

    def _branch(self, scope: IdentityScope, hashes: Sequence[int], depth: np.ndarray) -> None:
        """Record the prefix this (tracked) arrival reuses: the deepest any tier holds for it."""
        self.branches.add(*self._prefix(scope, hashes, depth))

    def _drop_ahead(self, a: _Active) -> None:
        self._ahead.drop(a.worker, a.ahead)
        a.ahead = ()

    def _zeros(self, n: int) -> np.ndarray:
        z = self._no_trees.get(n)
        if z is None:
            z = self._no_trees[n] = np.zeros(n, np.int64)
            z.flags.writeable = False
        return z

    @property
    def _block_bytes(self) -> int:
        return self.config.block_size * self.config.kv_bytes_per_token

    @property
    def _pool_us_per_mb(self) -> float:
        cfg = self.config
        return cfg.cost.cpu_dram_us_per_mb if cfg.pool_us_per_mb is None else cfg.pool_us_per_mb

    def _blind(self, hashes: Sequence[int], names: Sequence[str]) -> Match:
        """Identity-blind per-tier overlap: every scope's blocks, as if one."""
        return self.indexer.find_matches(None, hashes)

    def _select(self, logits: np.ndarray) -> int:
        t = self.config.temperature
        if t == 0:
            best = np.flatnonzero(logits == logits.min())
            return int(best[0]) if len(best) == 1 else int(self._rng.choice(list(best)))
        lo, hi = float(logits.min()), float(logits.max())
        if lo == hi:
            return self._rng.randrange(len(logits))
        weights = np.exp(-(logits - lo) / ((hi - lo) * t))
        probs = weights / weights.sum()
        u = self._rng.random()
        return int(min(np.searchsorted(np.cumsum(probs), u), len(logits) - 1))

    # ---- load feedback
    def _load_tokens(self, policy: str, host: int, disk: int, fetched: int) -> int:
        """The time the chosen worker will spend loading what the plan reuses, in prefill-token
        equivalents (queued work is counted in tokens): for the policies that plan loads."""
        if policy not in ("quillcache", "mooncake") or not (host or disk or fetched):
            return 0
        cfg = self.config
        mib = self._block_bytes / (1 << 20)
        fetch_us = self._pool_us_per_mb if policy == "quillcache" else cfg.transfer_us_per_mb
        us = mib * (host * cfg.cost.cpu_dram_us_per_mb + disk * cfg.cost.local_ssd_us_per_mb + fetched * fetch_us)
        return round(us / max(cfg.cost.prefill_us_per_token, 1))

    def _start(self, rid: str, worker: str, n_tokens: int, cached_blocks: int, load_tokens: int = 0,
               decode_tokens: int = 0) -> None:
        old = self._active.pop(rid, None)
        if old is not None:
            self._release(old)
        bs = self.config.block_size
        prefill = max(n_tokens - cached_blocks * bs, 0) + load_tokens
        blocks = math.ceil(n_tokens / bs)
        a = self._active[rid] = _Active(worker, prefill, blocks, rid=rid, decode_tokens=decode_tokens)
        self._by_worker.setdefault(worker, {})[rid] = a
        self._page_plans.pop(worker, None)
        row = self._table.rows[self._slot_of[worker]]
        row[_PREFILL_TOKENS] += prefill
        row[_DECODE_BLOCKS] += blocks
        row[_REQUESTS] += 1
        row[_PREFILL_REQUESTS] += 1

    def _release(self, a: _Active) -> None:
        self._page_plans.pop(a.worker, None)
        mine = self._by_worker.get(a.worker)
        if mine is not None and mine.pop(a.rid, None) is not None and not mine:
            del self._by_worker[a.worker]
        self._drop_ahead(a)
        pages = self._pinned.drop(a.worker, a.pinned) + a.private_pages
        a.pinned, a.private_pages = (), 0
        ld = self._loads.get(a.worker)
        if ld is None:
            return
        ld.pages -= pages
        if a.prefilling:
            self._unload_prefill(ld, a)
        ld.decode_blocks -= a.blocks
        ld.active_requests -= 1

    def first_token(self, request_id: str) -> bool:
        """The request's prefill is done: its tokens leave the worker's prefill load."""
        with self._lock:
            a = self._active.get(request_id)
            if a is None or not a.prefilling:
                return False
            a.prefilling = False
            self._page_plans.pop(a.worker, None)
            self._drop_ahead(a)
            ld = self._loads.get(a.worker)
            if ld is not None:
                self._unload_prefill(ld, a)
            return True

    @staticmethod
    def _unload_prefill(ld: WorkerLoad, a: _Active) -> None:
        """Its prefill leaves the worker's load: at its first token, or when it ends before it."""
        ld.active_prefill_tokens -= a.prefill_tokens
        ld.prefilled_tokens -= a.prefilled
        ld.prefill_requests -= 1

    def free(self, request_id: str) -> bool:
        """The request ended, was aborted or its client went away."""
        with self._lock:
            a = self._active.pop(request_id, None)
            if a is None:
                return False
            self._release(a)
            return True

    # ---- residency told by the caller (the gateway's predict-on-route), under the lock
    def add_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int], tier: int = DEVICE) -> None:
        with self._lock:
            self.indexer.add_blocks(worker, scope, hashes, tier)

    def remove_blocks(self, worker: str, scope: IdentityScope, hashes: Sequence[int],
                      tier: int = DEVICE) -> None:
        with self._lock:
            self.indexer.remove_blocks(worker, scope, hashes, tier)

    def find_matches(self, scope: Optional[IdentityScope], hashes: Sequence[int]) -> Match:
        with self._lock:
            return self.indexer.find_matches(scope, hashes)

    # ---- approximate mode: residency predicted from routing, forgotten after a TTL
    def _predict(self, worker: str, scope: IdentityScope, hashes: Sequence[int]) -> None:
        expiry = time.monotonic() + self.config.approx_ttl_s
        # A block predicted again only lives longer: it was added once and _expire removes it once.
        new = [h for h in hashes if (worker, scope, h) not in self._approx]
        if new:
            self.indexer.add_blocks(worker, scope, new, DEVICE)
        for h in hashes:
            self._approx[(worker, scope, h)] = expiry
            heapq.heappush(self._approx_heap, (expiry, worker, scope, h))

    def _expire(self, now: float) -> None:
        heap = self._approx_heap
        gone: dict[tuple[str, IdentityScope], list[int]] = {}
        while heap and heap[0][0] <= now:
            expiry, worker, scope, h = heapq.heappop(heap)
            if self._approx.get((worker, scope, h)) == expiry:
                del self._approx[(worker, scope, h)]
                gone.setdefault((worker, scope), []).append(h)
        for (worker, scope), hs in gone.items():
            self.indexer.remove_blocks(worker, scope, hs, DEVICE)

    def expire(self, now: Optional[float] = None) -> None:
        with self._lock:
            self._expire(time.monotonic() if now is None else now)

    def latency_percentile(self, q: float) -> float:
        lat = self.stats.latencies_us
        return float(np.percentile(lat, q)) if lat else 0.0
