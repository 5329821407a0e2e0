"""The hot-prefix count-min sketch: never under-counts, and over-counts by at most
epsilon * total for all but about a delta share of the keys."""
import numpy as np
import pytest

from quillcache.control.sketch import MAX_COUNTERS, CountMinSketch


def test_error_bound_holds_on_a_skewed_stream():
    eps, delta = 0.01, 0.01
    sk = CountMinSketch.for_error(eps, delta, seed=5)
    assert sk.width == 272 and sk.depth == 5
    rng = np.random.default_rng(1)
    keys = [(int(z) * 0x9E3779B97F4A7C15) % (1 << 63) for z in rng.zipf(1.3, size=50_000)]
    true = {}
    for k in keys:
        sk.add(k)
        true[k] = true.get(k, 0) + 1
    bound = eps * sk.total
    over = [sk.estimate(k) - c for k, c in true.items()]
    assert min(over) >= 0                                        # never under-counts
    beyond = sum(1 for o in over if o > bound)
    assert beyond <= delta * len(true) + 1, (beyond, len(true))
    # the hottest key is the hottest estimate
    hottest = max(true, key=true.get)
    assert sk.top(1)[0][0] == hottest


def test_negative_keys_and_limits():
    sk = CountMinSketch(64, 3)
    sk.add(-5, 3)
    assert sk.estimate(-5) == 3
    with pytest.raises(ValueError):
        CountMinSketch(MAX_COUNTERS, 2)
    with pytest.raises(ValueError):
        CountMinSketch.for_error(0, 0.1)
