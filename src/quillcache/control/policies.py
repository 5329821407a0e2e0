"""The scoring of the routing peers and of QuillCache's TTFT predictor, over one decision's
candidates: pure functions of numpy arrays (one entry per worker), no lock, no clock.

Peers, each as its project documents it (sources in ``docs/router.md``):

* ``sglang``: the SGLang model gateway's ``cache_aware`` policy.  The load is the worker's
  in-flight request count.  If the load is imbalanced (``max - min > balance_abs_threshold``
  and ``max > balance_rel_threshold * min``) take the least loaded worker; otherwise, if the
  best prefix match ratio (matched tokens / request tokens) is above ``cache_threshold``, the
  worker with the best match; otherwise the worker with the smallest cached tree.
* ``llmd``: llm-d's default scheduler profile: queue scorer (weight 2) plus prefix-cache
  scorer (weight 3), highest sum wins.  The queue scorer is min-max normalised over the
  candidates (shortest queue 1, longest 0, all equal 1); the prefix scorer is the share of the
  request's blocks the worker holds.
* ``mooncake``: the Conductor (Mooncake, FAST '25, Algorithm 1): per instance, TTFT = queue
  time + prefill time of the tokens it lacks; where another instance holds a longer prefix and
  moving it costs less than recomputing it, the transfer time is added and the prefix counted
  as present.  The minimum wins.

``predict_ttft`` is the ``quillcache`` policy: the predicted time to first token on each worker
in microseconds, from the ``CostModel`` and measured link rates (``RouterConfig``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quillcache.control.model import CostModel

__all__ = ["Candidates", "Prediction", "SGLANG_BALANCE_ABS", "SGLANG_BALANCE_REL", "SGLANG_CACHE_THRESHOLD",
           "LLMD_QUEUE_WEIGHT", "LLMD_PREFIX_WEIGHT", "sglang_scores", "llmd_scores", "mooncake_scores",
           "predict_ttft"]

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
    ``tree_blocks`` the blocks each worker's events say it caches."""

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


def predict_ttft(c: Candidates, cost: CostModel, *, block_bytes: int, batch_tokens: int,
                 pool_us_per_mb: float) -> Prediction:
    """The ``quillcache`` policy: per worker, in microseconds,

    * the prefill work admitted there and not yet done (the queue it waits behind) plus its
      own uncached tokens, at ``prefill_us_per_token``;
    * the decode iterations that interleave with that work: one per ``batch_tokens`` of it
      (chunked prefill), each ``decode_us_per_token + running_decode_penalty_us * decodes``;
    * loading what it reuses, tier by tier: device free, host at the CPU-DRAM cost, disk at
      the local-SSD cost, the pool at ``pool_us_per_mb`` (the pool's link), the pool only where
      loading a block costs less than recomputing it;
    * the slowdown its prefill imposes on the decodes running there: its compute time, times
      that worker's share of the cluster's running decodes (the mean delay it adds to one).
    """
    per_token = cost.prefill_us_per_token
    bs = c.block_size
    host_us = _block_us(cost.cpu_dram_us_per_mb, block_bytes)
    disk_us = _block_us(cost.local_ssd_us_per_mb, block_bytes)
    pool_us = _block_us(pool_us_per_mb, block_bytes)
    use_pool = pool_us < bs * per_token
    limit = max((c.n_tokens - 1) // bs, 0)          # the engine computes at least one token
    pool = np.minimum(c.pool, np.maximum(limit - c.local, 0)) if use_pool else np.zeros_like(c.pool)
    reuse = np.minimum(c.local + pool, limit)
    own = c.n_tokens - reuse * bs
    work = c.prefill_tokens + own
    decodes = c.decodes.astype(float)
    per_iter = np.where(decodes > 0, cost.decode_us_per_token + cost.running_decode_penalty_us * decodes, 0.0)
    iters = np.ceil(work / np.maximum(batch_tokens - decodes, 1))
    load = c.host * host_us + c.disk * disk_us + pool * pool_us
    ttft = per_token * work + iters * per_iter + load
    total = float(decodes.sum())
    imposed = per_token * own * (decodes / total) if total else np.zeros(len(own))
    # Each microsecond of compute it adds is one more of waiting for the requests that will
    # queue behind it; the mean prefill queue over the workers says how many that is.
    behind = float(c.prefill_requests.mean()) if len(own) else 0.0
    imposed = imposed + per_token * own * behind
    return Prediction(ttft + imposed, ttft, pool)
