"""The scoring of the routing peers and of QuillCache's TTFT predictor, over one decision's
candidates: pure functions of numpy arrays (one entry per worker), no lock, no clock.

Peers, each as its project documents it (sources in ``docs/router.md``):

* ``sglang``: the SGLang model gateway's ``cache_aware`` policy.  The load is the worker's
  in-flight request count.  If the load is imbalanced (``max - min > balance_abs_threshold``
  and ``max > balance_rel_threshold * min``) take the least loaded worker; otherwise, if the
  best prefix match ratio (matched tokens / request tokens) is above ``cache_threshold``, the
  worker with the best match; otherwise the worker with the smallest cached tree.  The match and
  the tree are the gateway's own tree of the prompts it routed (``control/routed.py``).
* ``llmd``: llm-d's default scheduler profile: queue scorer (weight 2) plus prefix-cache
  scorer (weight 3), highest sum wins.  The queue scorer is min-max normalised over the
  candidates (shortest queue 1, longest 0, all equal 1); the prefix scorer is the share of the
  request's blocks the worker holds.
* ``mooncake``: the Conductor (Mooncake, FAST '25, Algorithm 1): per instance, TTFT = queue
  time + prefill time of the tokens it lacks; where another instance holds a longer prefix and
  moving it costs less than recomputing it, the transfer time is added and the prefix counted
  as present.  The minimum wins.

``predict_ttft`` is the ``quillcache`` policy's predictor: the predicted time to first token on
each worker in microseconds, from the ``CostModel`` and measured link rates (``RouterConfig``);
``predict_placement`` is how the router asks it (for a prefix that requests branch from, the pool
is the means of a spread, not a reason for one: ``BranchPoints``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

import numpy as np

from quillcache._native.predict import demand_excess as _native_excess, predict as _native_predict
from quillcache.control.model import CostModel

__all__ = ["Candidates", "Prediction", "SGLANG_BALANCE_ABS", "SGLANG_BALANCE_REL", "SGLANG_CACHE_THRESHOLD",
           "LLMD_QUEUE_WEIGHT", "LLMD_PREFIX_WEIGHT", "sglang_scores", "llmd_scores", "mooncake_scores",
           "predict_ttft", "predict_placement", "goodput_placement", "TailQuantile", "BusyShare", "DemandShare",
           "BranchPoints", "chance"]

# SGLang model gateway, cache_aware defaults (sgl-router ``CacheAwareConfig``)
SGLANG_BALANCE_ABS = 64           # requests
SGLANG_BALANCE_REL = 1.5
SGLANG_CACHE_THRESHOLD = 0.3      # matched share of the request
# llm-d's default profile (guides/inference-scheduling: queue-scorer 2, prefix-cache-scorer 3)
LLMD_QUEUE_WEIGHT = 2.0
LLMD_PREFIX_WEIGHT = 3.0


@dataclass(frozen=True, slots=True)
class Candidates:
    """One decision's view of the workers (arrays in the order of ``names``).

    ``device``/``host``/``disk``/``pool``: blocks of contiguous prefix per tier, each tier
    extending the one before (``Match``); ``peer_depth``: the deepest device prefix any
    worker holds (the prefix another instance could hand over).  Loads are the router's own
    accounting: ``prefill_tokens`` uncached prompt tokens routed and not yet past their first
    token, ``prefill_requests`` those requests, ``requests`` every request in flight;
    ``tree_blocks`` the blocks in each worker's tree (``sglang``'s: the prompts routed there)."""

    names: tuple[str, ...]
    device: np.ndarray
    host: np.ndarray
    disk: np.ndarray
    pool: np.ndarray
    prefill_tokens: np.ndarray
    prefill_requests: np.ndarray
    requests: np.ndarray
    tree_blocks: np.ndarray
    n_tokens: int
    n_blocks: int
    block_size: int
    memory_wait_us: Optional[np.ndarray] = None  # until its KV pages fit there (``inflight.page_wait_us``)
    free_pages: Optional[np.ndarray] = None      # KV pages free there (where the router knows ``kv_blocks``)

    @property
    def local(self) -> np.ndarray:
        return self.device + self.host + self.disk

    @property
    def decodes(self) -> np.ndarray:
        return np.maximum(self.requests - self.prefill_requests, 0)


def sglang_scores(c: Candidates) -> tuple[np.ndarray, np.ndarray]:
    """(scores, eligible): the worker to take is an eligible one with the smallest score."""
    load = c.requests.astype(float)
    lo, hi = float(load.min()), float(load.max())
    if hi - lo > SGLANG_BALANCE_ABS and hi > SGLANG_BALANCE_REL * lo:
        return load, load == lo
    match = c.local.astype(float) * c.block_size / max(c.n_tokens, 1)
    best = float(match.max())
    if best > SGLANG_CACHE_THRESHOLD:
        return -match, match == best
    tree = c.tree_blocks.astype(float)
    return tree, tree == tree.min()


def llmd_scores(c: Candidates) -> np.ndarray:
    """The weighted score of each worker, negated (the smallest wins, like every logit here)."""
    q = c.prefill_requests.astype(float)
    lo, hi = float(q.min()), float(q.max())
    queue = np.ones(len(q)) if hi == lo else (hi - q) / (hi - lo)
    prefix = c.local.astype(float) / max(c.n_blocks, 1)
    return -(LLMD_QUEUE_WEIGHT * queue + LLMD_PREFIX_WEIGHT * prefix)


def _typed(a, dtype) -> Optional[np.ndarray]:
    """``a`` as an array of ``dtype`` (itself where it is one already, as the router's columns
    are: no copy), None for None."""
    if a is None or (isinstance(a, np.ndarray) and a.dtype == dtype):
        return a
    return np.asarray(a, dtype)


def _block_us(us_per_mb: float, block_bytes: int) -> float:
    return us_per_mb * block_bytes / (1 << 20)


def mooncake_scores(c: Candidates, cost: CostModel, transfer_us_per_mb: float,
                    block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(estimated TTFT in us, blocks to transfer from the best holder) per instance."""
    per_token = cost.prefill_us_per_token
    queue = per_token * c.prefill_tokens.astype(float)
    have = c.local.astype(float)
    best = float(have.max()) if len(have) else 0.0
    lacking = np.maximum(c.n_tokens - have * c.block_size, 0)
    ttft = queue + per_token * lacking
    gap = best - have
    transfer = gap * _block_us(transfer_us_per_mb, block_bytes)
    recompute = gap * c.block_size * per_token
    move = (gap > 0) & (transfer < recompute)
    lacking_moved = max(c.n_tokens - best * c.block_size, 0)
    ttft = np.where(move, queue + per_token * lacking_moved + transfer, ttft)
    return ttft, np.where(move, gap, 0).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Prediction:
    score: np.ndarray          # what the router minimises: TTFT + the slowdown imposed, us
    ttft_us: np.ndarray        # predicted time to first token, us
    pool_blocks: np.ndarray    # blocks each worker would load from the pool (0 where recompute is cheaper)
    wait_us: np.ndarray        # the part of ttft_us spent behind the work already queued there
    doomed: bool = False       # predicted to miss the SLO everywhere: placed by goodput_placement


class TailQuantile:
    """The ``q`` quantile of the last ``window`` values added, or None until it has
    ``1 / (1 - q)`` of them (a p99 of fewer than 100 values is their maximum, not a tail).
    Bounded: ``window`` floats.  It is asked only for a request doomed everywhere
    (``goodput_placement``) and by ``/metrics``, and recomputed then once 1/128 of the values
    it holds are new
    (~100 us for 8,192 values, so at most ~1.5 us a decision under saturation, when every
    request is doomed); a quantile of 8,192 values moves little over 64 of them."""

    __slots__ = ("q", "_buf", "_n", "_at", "_value")

    def __init__(self, q: float = 0.99, window: int = 8192) -> None:
        if not 0.0 < q < 1.0 or window < 1:
            raise ValueError(f"TailQuantile q={q!r}, window={window!r}: need 0 < q < 1 and window >= 1")
        self.q = q
        self._buf = np.zeros(window)
        self._n = 0
        self._at = 0                 # self._n when _value was computed
        self._value: Optional[float] = None

    def add(self, value: float) -> None:
        self._buf[self._n % len(self._buf)] = value
        self._n += 1

    def value(self) -> Optional[float]:
        n = min(self._n, len(self._buf))
        if n < 1.0 / (1.0 - self.q):
            return None
        if self._value is None or self._n - self._at >= max(n >> 7, 1):
            self._value = float(np.quantile(self._buf[:n], self.q))
            self._at = self._n
        return self._value


class BusyShare:
    """The engines' busy share as the router's decisions see it: at each decision, how many of
    the workers have a request in prefill (routed, first token not yet out), summed over the
    last ``window`` decisions, against the workers counted.  Arrivals see time averages (for
    Poisson arrivals exactly; PASTA), so this estimates the share of time an engine has prefill
    work running or queued: the load ``bench/router_sweep.py`` sets.  Integer sums, so it does
    not drift however long the router runs; bounded: two ``window``-long integer arrays."""

    __slots__ = ("_busy", "_seen", "_n", "_busy_sum", "_seen_sum")

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"BusyShare window={window!r}: need window >= 1")
        self._busy = np.zeros(window, np.int64)
        self._seen = np.zeros(window, np.int64)
        self._n = 0
        self._busy_sum = 0
        self._seen_sum = 0

    def add(self, busy: int, workers: int) -> None:
        """One decision: ``busy`` of ``workers`` had a request in prefill."""
        if not 0 <= busy <= workers:
            raise ValueError(f"BusyShare.add: busy {busy!r} of {workers!r} workers")
        j = self._n % len(self._busy)
        self._busy_sum += busy - int(self._busy[j])
        self._seen_sum += workers - int(self._seen[j])
        self._busy[j], self._seen[j] = busy, workers
        self._n += 1

    def value(self) -> float:
        """The share, 0 before any decision."""
        return self._busy_sum / self._seen_sum if self._seen_sum else 0.0

    def saturated(self) -> bool:
        """Every worker had prefill work at each of the last ``window`` decisions (a full
        window of them): no arrival found a worker free.  Exact: integer sums."""
        return self._n >= len(self._busy) and self._seen_sum > 0 and self._busy_sum == self._seen_sum

    def stretch(self, workers: int) -> float:
        """``1 / (1 - rho)``: how much longer, on average, a busy period lasts for each
        microsecond of work added to it at utilisation ``rho`` (M/G/1: a busy period started
        by work ``w`` lasts ``w / (1 - rho)``).  ``rho`` is capped at ``1 - 1 / workers`` (the
        factor at most the number of workers): near 1 a window of decisions cannot tell a full
        cluster from an overloaded one, and an unbounded factor would let this one term decide
        every placement."""
        cap = 1.0 - 1.0 / workers if workers > 1 else 0.0
        return 1.0 / (1.0 - min(self.value(), cap))


_NO_SLOTS = np.zeros(0, np.intp)


@functools.lru_cache(maxsize=64)
def chance(k: int, window: int) -> float:
    """The excess over an even share that the busiest of ``k`` workers shows, on average, when
    ``window`` arrivals each pick one of them at random: the expected largest of ``k`` standard
    normals (Blom's approximation, ``Phi^-1((k - 0.375) / (k + 0.25))``) times a worker's
    relative standard deviation, ``sqrt((k - 1) / window)``.  0 for one worker."""
    if k <= 1 or window < 1:
        return 0.0
    return NormalDist().inv_cdf((k - 0.375) / (k + 0.25)) * math.sqrt((k - 1) / window)


class DemandShare:
    """Where the router's last ``window`` tracked arrivals would go for their cache, per
    load-table slot, and what each would save there: who will queue behind a request's work
    on each worker, and what they would lose by going elsewhere instead.

    An arrival that finds a deeper device prefix on some candidates than on the others prefers
    those (its one arrival split evenly among them), and saves there the blocks it holds past
    its next-best candidate, which it would recompute elsewhere.  One that finds as much
    everywhere prefers none: the router spreads it, so it counts ``1 / k`` to each of the
    ``k`` candidates.  The count is of what arrivals would choose for their cache, not of
    where the router sent them, which would feed its own placements back into itself.

    Bounded: a ``window``-long ring of each arrival's preferred slots; the per-slot sums are
    recomputed from the ring once per window, so they do not drift.  O(preferred) per arrival."""

    __slots__ = ("_ring", "_n", "_pref", "_saved", "_even")

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"DemandShare window={window!r}: need window >= 1")
        self._ring: list = [None] * window          # (preferred slots, us saved there) per arrival
        self._n = 0
        self._pref = np.zeros(8)                    # per slot: the arrivals preferring it (split)
        self._saved = np.zeros(8)                   # ... times what each saves there, us
        self._even = 0                              # arrivals preferring none, in the window

    def add(self, slots: np.ndarray, device: np.ndarray, block_us: float) -> None:
        """One arrival: the candidates' load-table ``slots`` (distinct), the blocks of its
        prefix each holds on the device, and what recomputing one block costs, us."""
        if len(slots) != len(device):
            raise ValueError(f"DemandShare.add: {len(slots)} slots, {len(device)} device depths")
        if not block_us >= 0.0:
            raise ValueError(f"DemandShare.add: block_us {block_us!r}")
        j = self._n % len(self._ring)
        old = self._ring[j]
        if old is not None:
            if len(old[0]):
                self._pref[old[0]] -= 1.0 / len(old[0])
                self._saved[old[0]] -= old[1] / len(old[0])
            else:
                self._even -= 1
        entry = (_NO_SLOTS, 0.0)
        deepest = device.max() if len(device) else 0
        if len(device) and deepest > device.min():
            top = device == deepest
            entry = (np.asarray(slots, np.intp)[top], float(deepest - device[~top].max()) * block_us)
        best, saved = entry
        if len(best):
            end = int(best.max()) + 1
            if end > len(self._pref):
                size = max(2 * len(self._pref), end)
                self._pref = np.concatenate([self._pref, np.zeros(size - len(self._pref))])
                self._saved = np.concatenate([self._saved, np.zeros(size - len(self._saved))])
            self._pref[best] += 1.0 / len(best)
            self._saved[best] += saved / len(best)
        else:
            self._even += 1
        self._ring[j] = entry
        self._n += 1
        if self._n % len(self._ring) == 0:
            self._pref[:] = 0.0
            self._saved[:] = 0.0
            for b, v in self._ring:
                if len(b):
                    self._pref[b] += 1.0 / len(b)
                    self._saved[b] += v / len(b)

    def excess(self, slots: np.ndarray, beyond_chance: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate: the arrivals that would come there past an even spread over
        ``slots``, against the mean (0 where no more than even), and what each of those saves
        there on average, us.  The part of the window not yet filled counts as arrivals
        preferring none: until the window has seen its arrivals, an even spread, not the first
        few, says who comes where.  All 0 before any arrival.

        With ``beyond_chance``, only what lies past chance counts: ``window`` arrivals spread
        evenly over ``k`` workers still put more on some than on others (a worker's count is
        binomial, its standard deviation ``sqrt((k - 1) / window)`` of the mean), and the
        busiest of the ``k`` shows ``chance(k, window)`` of excess on average.  That much is
        taken off every worker's, so arrivals that merely happened to fall unevenly protect no
        one."""
        even = self._even + max(0, len(self._ring) - self._n)
        noise = chance(len(slots), len(self._ring)) if beyond_chance else 0.0
        # natively (``_native/predict.pyx``): the numpy form it replaced is the tests' oracle
        return _native_excess(self._pref, self._saved, _typed(slots, np.int64), float(even), noise)


class BranchPoints:
    """Which prefixes the router's last ``window`` tracked arrivals branched from.

    Each arrival reuses a prefix: the deepest one any tier holds for it (on a device, in host or
    disk memory, in the pool).  It records the prefix's last block and the block it goes on with
    (None where it ends there).  A prefix is a branch point for a request when some arrival in
    the window reused it and went on otherwise than that request does: a document or a template
    that distinct requests share.  A private context (a session whose next turn extends the last)
    is not: its turns go on alike, each past the last turn's end.  The router asks this of the
    prefix a request finds deepest on a device (``predict_placement``).

    Keys are the caller's (the router's are identity-scoped, so one tenant's traffic says nothing
    of another's prefixes).  Bounded: a ``window``-long ring of (prefix, next block) and a count
    of each pair still in it; O(1) per arrival and per question."""

    __slots__ = ("_ring", "_n", "_next")

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"BranchPoints window={window!r}: need window >= 1")
        self._ring: list = [None] * window      # (prefix, next) per arrival; None: it reused nothing
        self._n = 0
        self._next: dict = {}                   # prefix -> {next block: arrivals in the window}

    def add(self, prefix, nxt) -> None:
        """One arrival that reused the prefix ending at block ``prefix`` and goes on with block
        ``nxt`` (None: it ends there); ``prefix`` None: it reused nothing."""
        j = self._n % len(self._ring)
        old = self._ring[j]
        if old is not None:
            seen = self._next[old[0]]
            seen[old[1]] -= 1
            if not seen[old[1]]:
                del seen[old[1]]
                if not seen:
                    del self._next[old[0]]
        entry = None if prefix is None else (prefix, nxt)
        if entry is not None:
            seen = self._next.setdefault(prefix, {})
            seen[nxt] = seen.get(nxt, 0) + 1
        self._ring[j] = entry
        self._n += 1

    def branched(self, prefix, nxt) -> bool:
        """Whether an arrival in the window reused ``prefix`` and went on otherwise than ``nxt``.
        An arrival that ended at the prefix went on otherwise than any other (its partial last
        block is not in the chain), so a request ending there counts every arrival that reused
        it."""
        seen = self._next.get(prefix)
        if not seen:
            return False
        return nxt is None or None in seen or len(seen) > 1 or nxt not in seen


def goodput_placement(p: Prediction, slo_us: float, tail_slack: float = 0.2,
                      tail: Optional[TailQuantile] = None, saturated: bool = False,
                      admit_us: Optional[float] = None) -> Prediction:
    """Where a request goes that is predicted to miss its SLO on every worker.

    It misses wherever it goes; what its placement still decides is whom it delays.  Its work
    delays the requests queued behind it, and behind a queue that alone already exceeds the SLO
    those miss theirs anyway; on its fastest worker, whose queue is short, it would take
    capacity from requests that can still meet theirs.  So it goes to the best-scored worker
    whose queue is already past the SLO, provided that

    * moving there costs no more work than it spares its fastest worker (its own work there,
      queue excluded, at most twice what it is on the fastest: a long context it would
      recompute stays with the worker that holds it), and
    * it waits no longer than an even spread would make it wait (that queue at most the mean
      queue over the workers), or, up to ``1 + tail_slack`` times the mean, where it does not
      become the tail: its predicted TTFT there is at most ``tail``'s value, the p99 of the
      TTFTs the router predicted for the requests it placed (asked only here, for a request
      doomed everywhere).  Before 100 of them
      there is no p99, and only the first bound applies: a router that has not yet seen its
      tail keeps out of it.  ``tail_slack`` 0.2 is the issue's tail budget (p99 <= 1.2 x the
      best peer's), not a number fitted to a trace.  A doomed request that would wait past the
      mean is most often a long prompt, the tail already; sent behind a long queue too, it
      becomes the new p99.

    ``saturated`` (``BusyShare.saturated``: every worker had prefill work at each of the last
    window of arrivals) with every worker's queue past the SLO is an overload: arrivals outpace
    the cluster, and spread evenly they make every worker late together, so that no queue ever
    drains back under the SLO.  Then the request goes to the *fullest* queue past the SLO
    within ``1 + tail_slack`` times the mean (the first bound above still holds): the overload
    gathers where requests miss anyway, and the other queues drain back to where they serve
    requests in time.  The tail is not asked there: the fullest queue is the tail by
    construction, and the tail budget is what bounds it.

    ``admit_us`` (admission ``predict``: ``admission_k`` x the SLO): a request whose TTFT on its
    best-scored worker is past it is refused, and its placement is left as it is (its predicted
    TTFT there is what the refusal reports); one within it is moved only to workers where it
    stays within it, so that the move never turns an admitted request into a refused one.

    Where no worker qualifies (a request doomed by its own size, or queues all alike) the
    placement is unchanged."""
    if not len(p.ttft_us) or float(p.ttft_us.min()) <= slo_us:
        return p
    own = p.ttft_us - p.wait_us
    best = int(np.argmin(p.score))
    if admit_us is not None and float(p.ttft_us[best]) > admit_us:
        return p
    # the bounds both placements keep: no more work than it spares its fastest worker, admissible
    movable = (own - own[best] <= own[best]) & (p.ttft_us <= (np.inf if admit_us is None else admit_us))
    mean = float(p.wait_us.mean())
    if saturated and float(p.wait_us.min()) >= slo_us:
        past = movable & (p.wait_us <= (1.0 + tail_slack) * mean)
        if past.any():          # the fullest of them alone
            past = np.arange(len(past)) == int(np.argmax(np.where(past, p.wait_us, -1.0)))
    else:
        even = p.wait_us <= mean
        tail_us = tail.value() if tail is not None else None
        if tail_us is not None:
            even |= (p.wait_us <= (1.0 + tail_slack) * mean) & (p.ttft_us <= tail_us)
        past = (p.wait_us >= slo_us) & movable & even
    if not past.any():
        return p
    # The others rank after every doomed worker, in their own order (finite: logits go out as JSON).
    return Prediction(np.where(past, p.score, p.score + float(p.score.max()) + 1.0), p.ttft_us, p.pool_blocks,
                      p.wait_us, True)


def predict_ttft(c: Candidates, cost: CostModel, *, block_bytes: int, batch_tokens: int,
                 pool_us_per_mb: float, device_share: float = 0.0, pool_share: float = 0.0,
                 stretch: float = 1.0, excess: Optional[np.ndarray] = None,
                 saved: Optional[np.ndarray] = None) -> Prediction:
    """The ``quillcache`` policy: per worker, in microseconds,

    * the prefill work admitted there and not yet done (the queue it waits behind) plus its
      own uncached tokens, at ``prefill_us_per_token``;
    * the decode iterations that interleave with that work: one per ``batch_tokens`` of it
      (chunked prefill), each ``decode_us_per_token + running_decode_penalty_us * decodes``;
    * loading what it reuses, tier by tier: device free, host at the CPU-DRAM cost, disk at
      the local-SSD cost, the pool at ``pool_us_per_mb`` (the pool's link), the pool only where
      loading a block costs less than recomputing it;
    * the slowdown its prefill imposes on the decodes running there: its compute time and its
      loads' (the engine's step waits for both), times that worker's share of the cluster's
      running decodes (the mean delay it adds to one);
    * the wait it adds for the requests that will queue behind it: its compute and loads, and
      its wait for KV pages past the compute queue (the engine admits in order, so those behind
      it wait too), times the mean prefill queue over the workers, times ``stretch``
      (``BusyShare.stretch``, 1 / (1 - rho): at utilisation rho each microsecond added to a
      queue keeps it busy 1 / (1 - rho) microseconds longer, and the work arriving meanwhile
      waits it too);
    * the wait it adds for those past an even spread who come to that worker for their cache
      (``excess`` and ``saved``, from ``DemandShare.excess``: a worker holding a prefix many
      arrivals share has more of them behind what is sent there): each waits behind it or
      recomputes what it saves there elsewhere, whichever is less, times as many of them;
    * what its pages evict there: its blocks not on that device, less the pages free there
      (``Candidates.free_pages``, where the router knows the engines' KV pages), times the share
      of routed blocks found on the device (``device_share``, the router's measurement), times
      what finding an evicted block again costs: a pool load for the share of blocks that
      requests found in the pool when not on their device (``pool_share``, measured too), a
      recompute for the rest;
    * what a move strands: sent away from the worker holding its prefix deepest on the device,
      it leaves that copy there, as recently used as anything in that cache, so the engine
      evicts other blocks before it; its next request follows it to its new worker.  The copy
      pushes out as many blocks as it has past the pages free there, charged like the above;
    * with ``Candidates.memory_wait_us`` (the router's, where it knows the engines' KV pages):
      the time until its pages fit in the engine's KV memory; it starts when both that and the
      compute queue allow (the queue drains while it waits for pages).

    The arithmetic per worker runs natively (``_native/predict.pyx``, the same operations in the
    same order as the numpy form the tests keep beside it: the same bits, without ~40 numpy calls
    per decision); the scalars are computed here.
    """
    per_token = cost.prefill_us_per_token
    bs = c.block_size
    pool_us = _block_us(pool_us_per_mb, block_bytes)
    use_pool = pool_us < bs * per_token
    # What finding an evicted block again costs: a pool load for the share of blocks found in
    # the pool when not on the device (``pool_share``, measured by the router), a recompute for
    # the rest.
    refill = bs * per_token
    if use_pool:
        refill = pool_share * pool_us + (1.0 - pool_share) * refill
    i64 = np.int64
    score, ttft, pool, wait = _native_predict(
        _typed(c.device, i64), _typed(c.host, i64), _typed(c.disk, i64), _typed(c.pool, i64),
        _typed(c.prefill_tokens, i64), _typed(c.prefill_requests, i64), _typed(c.requests, i64),
        _typed(c.memory_wait_us, np.float64), _typed(c.free_pages, i64), c.n_tokens, bs,
        max((c.n_tokens - 1) // bs, 0),            # the engine computes at least one token
        -(-c.n_tokens // bs), use_pool, per_token, cost.decode_us_per_token, cost.running_decode_penalty_us,
        float(batch_tokens), _block_us(cost.cpu_dram_us_per_mb, block_bytes),
        _block_us(cost.local_ssd_us_per_mb, block_bytes), pool_us, refill, device_share, stretch,
        None if excess is None else _typed(excess, np.float64), None if saved is None else _typed(saved, np.float64))
    return Prediction(score, ttft, pool, wait)


def predict_placement(c: Candidates, cost: CostModel, *, branched: bool = False, **kw) -> Prediction:
    """``predict_ttft``, with the pool as the means of a spread, not a reason for one, where the
    prefix a request finds deepest on a device is a branch point (``BranchPoints``).

    Credited with the pool, every worker looks nearly as good as the holder of a prefix: loading
    it costs a few microseconds a token.  Requests for a prefix that distinct requests share (a
    document, a template) then leave its holder for any shorter queue; the prefix is copied onto
    every worker, the caches hold the same few prefixes instead of different ones, and short
    requests share every worker with long ones.  None of that is in one request's prediction.  So
    for such a prefix, whether a request leaves the worker(s) holding it deepest on the device is
    decided as if the pool held nothing past what each worker holds: it leaves when recomputing
    elsewhere beats waiting there, the spread of a hot prefix without a pool.  One that leaves is
    placed with the pool credited and loads what it can from the pool.  Where it stays, the
    holders keep their credited scores (a holder loads from the pool what follows its device
    prefix) and the others are scored without the pool; the predicted TTFTs and the blocks
    loaded are the credited ones.

    A private context (``branched`` False) follows the pool to a short queue: moving it copies
    nothing another request needs twice, and what the copy it leaves behind costs is priced
    (``predict_ttft``'s stranded copy).  ``kw`` are ``predict_ttft``'s."""
    credited = predict_ttft(c, cost, **kw)
    if not branched or not len(c.device) or not np.any(c.pool):
        return credited
    top = int(np.max(c.device))
    if top == 0:
        return credited
    alone = predict_ttft(dataclasses.replace(c, pool=np.zeros_like(c.pool)), cost, **kw)
    held = c.device == top
    if not held[int(np.argmin(alone.score))]:
        return credited
    return Prediction(np.where(held, credited.score, alone.score), credited.ttft_us, credited.pool_blocks,
                      credited.wait_us)
