"""Deterministic test keys and payloads."""
from __future__ import annotations

import numpy as np

from quillcache.model import KvBlockKey


def key(i: int, tenant: str = "t0", model: str = "m", prefix: str = "p") -> KvBlockKey:
    return KvBlockKey(model, "tok", None, tenant, prefix, f"b{i}", block_index=i % 1000)


def content(i: int, size: int) -> bytes:
    """``size`` pseudo-random bytes, the same for the same ``i``."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
