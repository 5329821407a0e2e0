"""_native/bufpool.pyx: receive buffers whose memory is reused only once nothing refers to it."""
import gc

import numpy as np
import pytest

from quillcache._native import bufpool

MiB = 1 << 20


def _fill(buf, value):
    np.frombuffer(buf, np.uint8)[:] = value


def test_a_freed_buffer_is_taken_again_and_a_viewed_one_never():
    gc.collect()
    b = bufpool.take(3 * MiB)
    assert len(b) == 3 * MiB and len(memoryview(b)) == 3 * MiB
    _fill(b, 7)
    kept = memoryview(b)[MiB:MiB + 16]          # a view of it, held
    del b
    again = [bufpool.take(3 * MiB) for _ in range(4)]
    for x in again:
        _fill(x, 9)                              # none of them is the viewed buffer's memory
    assert bytes(kept) == bytes([7]) * 16
    before = bufpool.pooled_bytes()
    del kept                                     # the last view: now its memory is the pool's
    assert bufpool.pooled_bytes() > before
    del again


def test_the_pool_keeps_at_most_its_limit():
    bufs = [bufpool.take(8 * MiB) for _ in range(bufpool.POOL_BYTES // (8 * MiB) + 4)]
    del bufs
    assert 0 < bufpool.pooled_bytes() <= bufpool.POOL_BYTES


def test_sizes_small_large_and_odd():
    for n in (0, 1, 100, bufpool.MIN_POOLED - 1, bufpool.MIN_POOLED, 5 * MiB + 3):
        b = bufpool.take(n)
        assert len(b) == n
        m = memoryview(b)
        assert m.nbytes == n and not m.readonly
        if n:
            m[-1] = 1
    with pytest.raises(ValueError):
        bufpool.take(-1)
