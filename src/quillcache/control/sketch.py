"""A count-min sketch of hot prefixes (Cormode & Muthukrishnan, 2005).

``CountMinSketch.for_error(epsilon, delta)`` sizes it so that an estimate never
under-counts and over-counts by at most ``epsilon * total`` with probability at least
``1 - delta`` per query: ``width = ceil(e / epsilon)`` counters per row and
``depth = ceil(ln(1 / delta))`` rows, each row with its own pairwise-independent hash
``((a * x + b) mod p) mod width`` (p = 2**61 - 1).
"""
from __future__ import annotations

import math
import random
from typing import Optional

import numpy as np

__all__ = ["CountMinSketch"]

_P = (1 << 61) - 1                # a Mersenne prime larger than any 61-bit folded key
MAX_COUNTERS = 1 << 26            # width * depth: bounded before allocating (512 MiB of int64)


class CountMinSketch:
    def __init__(self, width: int, depth: int, seed: int = 0, track_top: int = 32) -> None:
        if width <= 0 or depth <= 0:
            raise ValueError("width and depth must be positive")
        if width * depth > MAX_COUNTERS:
            raise ValueError(f"{width} x {depth} counters: at most {MAX_COUNTERS}")
        self.width, self.depth = width, depth
        rng = random.Random(seed)
        self._ab = [(rng.randrange(1, _P), rng.randrange(0, _P)) for _ in range(depth)]
        self._table = np.zeros((depth, width), dtype=np.int64)
        self.total = 0
        self._track_top = track_top
        self._top: dict[int, int] = {}      # heavy-hitter candidates -> last estimate

    @classmethod
    def for_error(cls, epsilon: float, delta: float, seed: int = 0) -> "CountMinSketch":
        if not 0 < epsilon < 1 or not 0 < delta < 1:
            raise ValueError("epsilon and delta must be in (0, 1)")
        return cls(math.ceil(math.e / epsilon), math.ceil(math.log(1 / delta)), seed)

    @property
    def epsilon(self) -> float:
        return math.e / self.width

    @property
    def delta(self) -> float:
        return math.exp(-self.depth)

    def _cols(self, key: int) -> list[int]:
        x = key % _P
        w = self.width
        return [((a * x + b) % _P) % w for a, b in self._ab]

    def add(self, key: int, count: int = 1) -> int:
        """Count ``key``; returns its new estimate."""
        cols = self._cols(key)
        t = self._table
        est: Optional[int] = None
        for row, col in enumerate(cols):
            t[row, col] += count
            v = int(t[row, col])
            est = v if est is None or v < est else est
        self.total += count
        if self._track_top:
            top = self._top
            top[key] = est
            if len(top) > 2 * self._track_top:
                keep = sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:self._track_top]
                self._top = dict(keep)
        return est

    def estimate(self, key: int) -> int:
        return int(min(self._table[row, col] for row, col in enumerate(self._cols(key))))

    def top(self, k: int = 10) -> list[tuple[int, int]]:
        """The ``k`` hottest keys seen among the tracked candidates, with fresh estimates."""
        items = [(key, self.estimate(key)) for key in self._top]
        return sorted(items, key=lambda kv: kv[1], reverse=True)[:k]
