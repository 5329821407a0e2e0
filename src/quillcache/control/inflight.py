"""The blocks of the requests in flight, per worker: what the router knows about an engine's
cache before the engine's events say it.

Two uses (``Router``): the blocks a request in prefill will have computed for the requests
queued behind it on the same worker, and the blocks every request in flight pins in its
engine's KV memory until it ends.  Keys are ``(scope, router hash)``: identity-scoped, as
the engines' caches are.  And once the events do say it: how far the engine has got with the
prompts queued there (``prefill_progress``).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from typing import Callable, Hashable, Iterable, Optional, Sequence

import numpy as np

__all__ = ["InFlightBlocks", "PagePlan", "extend_device", "page_plan", "page_wait_us", "prefill_progress"]


class InFlightBlocks:
    """``(scope, hash) -> {worker: requests}``, the requests with blocks on each worker, and
    the distinct blocks each worker has (a block two requests share counts once)."""

    __slots__ = ("_holders", "_requests", "distinct")

    def __init__(self) -> None:
        self._holders: dict[tuple[Hashable, int], dict[str, int]] = {}
        self._requests: dict[str, int] = {}
        self.distinct: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._holders)

    def add(self, worker: str, keys: Sequence[tuple[Hashable, int]]) -> int:
        """One request's blocks on ``worker``; returns how many were new to that worker."""
        if not keys:
            return 0
        new = 0
        for key in keys:
            holders = self._holders.setdefault(key, {})
            n = holders.get(worker, 0)
            new += n == 0
            holders[worker] = n + 1
        self._requests[worker] = self._requests.get(worker, 0) + 1
        self.distinct[worker] = self.distinct.get(worker, 0) + new
        return new

    def drop(self, worker: str, keys: Sequence[tuple[Hashable, int]]) -> int:
        """The request that added ``keys`` on ``worker`` is gone; returns how many blocks
        no other request there has."""
        if not keys:
            return 0
        gone = 0
        for key in keys:
            holders = self._holders[key]
            if holders[worker] == 1:
                gone += 1
                del holders[worker]
                if not holders:
                    del self._holders[key]
            else:
                holders[worker] -= 1
        left = self._requests[worker] - 1
        if left:
            self._requests[worker] = left
            self.distinct[worker] -= gone
        else:
            del self._requests[worker]
            del self.distinct[worker]
        return gone

    def depths(self, scope: Hashable, hashes: Sequence[int], names: Sequence[str]) -> Optional[np.ndarray]:
        """Per worker in ``names``, the prefix of ``hashes`` its requests in flight hold (None:
        nothing anywhere).  Block hashes chain and a request adds a prefix of its own, so a
        worker that holds block i holds every block before it: the deepest held block is found
        by bisection, then each worker's deepest by walking down from it (no further once every
        worker with requests here is placed)."""
        holders = self._holders
        if not holders or not hashes:
            return None
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (scope, hashes[mid - 1]) in holders:
                lo = mid
            else:
                hi = mid - 1
        if not lo:
            return None
        depth: dict[str, int] = {}
        want = len(self._requests)
        for i in range(lo, 0, -1):
            for w in holders.get((scope, hashes[i - 1]), ()):
                depth.setdefault(w, i)
            if len(depth) == want:
                break
        return np.fromiter((depth.get(n, 0) for n in names), np.int64, len(names))

    def counts(self) -> Counter:
        """``{(key, worker): requests}``: for checking against the requests in flight."""
        return Counter({(key, w): n for key, hs in self._holders.items() for w, n in hs.items()})


def extend_device(ahead: np.ndarray, dev: np.ndarray, host: np.ndarray, disk: np.ndarray,
                  pool: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The per-tier prefix with the device prefix at least ``ahead`` blocks deep: each tier
    extends the one before, so a tier the deeper device prefix covers shrinks."""
    d = np.maximum(dev, ahead)
    h = np.maximum(dev + host, d)
    k = np.maximum(dev + host + disk, d)
    p = np.maximum(dev + host + disk + pool, d)
    return d, h - d, k - h, p - k


def page_wait_us(requests: Iterable[tuple[bool, int, int, int]], need: float, capacity: float, held: float,
                 prefill_us_per_token: float, iteration_us: float) -> float:
    """When a request needing ``need`` KV pages would start on one engine, in us from now:
    ``page_plan`` then ``PagePlan.wait``."""
    return page_plan(requests, capacity, held, prefill_us_per_token, iteration_us).wait(need)


class PagePlan:
    """One engine's KV pages played forward over the requests in flight there: when the last
    of them is admitted (``admitted``), when the compute before a new request is done
    (``computed``), the pages then free, and the ends still to come (time, pages freed by then)."""

    __slots__ = ("admitted", "computed", "free", "ends", "freed")

    def __init__(self, admitted: float, computed: float, free: float, ends: list[tuple[float, float]]) -> None:
        self.admitted, self.computed, self.free = admitted, computed, free
        self.ends = [e for e, _ in ends]
        self.freed = list(itertools.accumulate(p for _, p in ends))

    def wait(self, need: float) -> float:
        """The start of a request needing ``need`` pages: admitted (the first end by which
        enough pages are free, every end where they never are) and the compute before it done."""
        short = need - self.free
        t = self.admitted
        if short > 0 and self.ends:
            i = min(bisect.bisect_left(self.freed, short), len(self.ends) - 1)
            t = max(t, self.ends[i])
        return max(t, self.computed)


def page_plan(requests: Iterable[tuple[bool, int, int, int]], capacity: float, held: float,
              prefill_us_per_token: float, iteration_us: float) -> PagePlan:
    """One engine's FCFS admission under its ``capacity`` KV pages, played forward.

    ``requests``: those in flight there, in arrival order, each ``(in prefill, uncached prompt
    tokens, decode tokens, blocks)``; their blocks are scaled to the pages the engine holds for
    them (``held``: a block two requests share is one page).  A request holds its pages from
    its admission to its last token.  One already decoding ends on average half-way through its
    decode (``decode tokens x iteration_us``).  The ones in prefill are admitted in order, each
    when enough pages are free (no overtaking, as the engine admits), computed in order (the
    engine's compute is one queue), and end after their prefill and decode.  A request routed
    now starts when it is admitted after them and the compute before it is done."""
    reqs = list(requests)
    total = sum(r[3] for r in reqs)
    scale = held / total if total else 0.0
    free = float(capacity)
    ends: list[tuple[float, float]] = []
    for prefilling, _tokens, decode_tokens, blocks in reqs:
        if not prefilling:
            pages = min(blocks * scale, capacity)
            free -= pages
            heapq.heappush(ends, (decode_tokens * iteration_us / 2, pages))
    t = compute = 0.0
    for prefilling, tokens, decode_tokens, blocks in reqs:
        if prefilling:
            pages = min(blocks * scale, capacity)
            while free < pages and ends:
                end, freed = heapq.heappop(ends)
                t = max(t, end)
                free += freed
            free -= pages
            compute = max(compute, t) + tokens * prefill_us_per_token
            heapq.heappush(ends, (compute + decode_tokens * iteration_us, pages))
    return PagePlan(t, compute, free, sorted(ends))


def prefill_progress(requests: Iterable, depth: Callable[[Hashable, Sequence[int]], int], block_size: int,
                     chunk: int) -> int:
    """How much more of the prompts queued on one engine its events show computed: with chunked
    prefill the engine stores a prompt's blocks chunk by chunk, so a long prompt half computed is
    half the work still queued there, not all of it until its first token.

    ``requests``: the router's requests in flight there (``_Active``), in arrival order; read are
    those in prefill with a ``chain`` ((scope, hashes, the blocks that are not its own work: those
    it reused when routed, and those the requests in flight there hold or compute), each at
    ``depth(scope, hashes)``, its device prefix there under its own identity (another identity's
    blocks say nothing of it).  The engine admits in order and gives each iteration's ``chunk``
    tokens to the prompts in that order, so a request can have started only while the work still
    to do ahead of it is under one chunk: the reading stops at the first one behind a chunk or
    more.  A request's last token stays counted until its first token.  Updates each one's
    ``prefilled`` (tokens of its ``prefill_tokens`` done; it only grows) and returns the sum of
    what they grew by."""
    moved = ahead = 0
    for a in requests:
        if not a.prefilling:
            continue
        if ahead >= chunk:
            break
        if a.chain:
            scope, hashes, base = a.chain
            done = min(max(depth(scope, hashes) - base, 0) * block_size, a.prefill_tokens - 1)
            if done > a.prefilled:
                moved += done - a.prefilled
                a.prefilled = done
        ahead += a.prefill_tokens - a.prefilled
    return moved
