"""The quillcache predictor's native arithmetic (``_native/predict.pyx``) gives the same bits as
its numpy form, the one it replaced, on random candidate sets: pools on and off, the engines'
pages known or not, no decodes anywhere, one worker, ties for the deepest prefix, int and float
cost models, the demand excess on and off; and bad shapes are refused before anything is computed."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache._native.predict import predict
from quillcache.control.model import CostModel
from quillcache.control.policies import Candidates, _block_us, predict_ttft


def numpy_form(c: Candidates, cost: CostModel, *, block_bytes, batch_tokens, pool_us_per_mb, device_share,
               pool_share, stretch=1.0, excess=None, saved=None):
    """``predict_ttft`` as it was written in numpy (the oracle)."""
    per_token = cost.prefill_us_per_token
    bs = c.block_size
    host_us = _block_us(cost.cpu_dram_us_per_mb, block_bytes)
    disk_us = _block_us(cost.local_ssd_us_per_mb, block_bytes)
    pool_us = _block_us(pool_us_per_mb, block_bytes)
    use_pool = pool_us < bs * per_token
    limit = max((c.n_tokens - 1) // bs, 0)
    local = c.device + c.host + c.disk
    pool = np.minimum(c.pool, np.maximum(limit - local, 0)) if use_pool else np.zeros_like(c.pool)
    reuse = np.minimum(local + pool, limit)
    own = c.n_tokens - reuse * bs
    work = c.prefill_tokens + own
    decodes = c.decodes.astype(float)
    per_iter = np.where(decodes > 0, cost.decode_us_per_token + cost.running_decode_penalty_us * decodes, 0.0)
    iters = np.ceil(work / np.maximum(batch_tokens - decodes, 1))
    load = c.host * host_us + c.disk * disk_us + pool * pool_us
    ttft = per_token * work + iters * per_iter + load
    queued = c.prefill_tokens.astype(float)
    wait = per_token * queued + np.ceil(queued / np.maximum(batch_tokens - decodes, 1)) * per_iter
    stall = np.zeros(len(own))
    if c.memory_wait_us is not None:
        stall = np.maximum(c.memory_wait_us - wait, 0.0)
        ttft, wait = ttft + stall, wait + stall
    total = float(decodes.sum())
    busy = per_token * own + load
    imposed = busy * (decodes / total) if total else np.zeros(len(own))
    behind = float(c.prefill_requests.mean()) * stretch if len(own) else 0.0
    imposed = imposed + (busy + stall) * behind
    if excess is not None:
        imposed = imposed + np.minimum(busy + stall, saved) * (behind * excess)
    need = -(-c.n_tokens // bs) - c.device
    if c.free_pages is not None:
        need = np.maximum(need - c.free_pages, 0)
    if len(own):
        h = int(np.argmax(c.device))
        strand = np.maximum(c.device[h] - c.device, 0)
        if c.free_pages is not None:
            strand = np.maximum(strand - c.free_pages[h], 0)
        need = need + strand
    refill = bs * per_token
    if use_pool:
        refill = pool_share * pool_us + (1.0 - pool_share) * refill
    imposed = imposed + device_share * refill * need
    return ttft + imposed, ttft, pool, wait


COSTS = [CostModel(), CostModel(prefill_us_per_token=29, decode_us_per_token=6000, running_decode_penalty_us=100,
                                cpu_dram_us_per_mb=38),
         CostModel(prefill_us_per_token=12.7, decode_us_per_token=31.3, running_decode_penalty_us=7.9,
                   cpu_dram_us_per_mb=17.1, local_ssd_us_per_mb=203.3)]


@st.composite
def cases(draw):
    k = draw(st.integers(1, 12))
    bs = draw(st.sampled_from([1, 4, 16, 512]))
    n_blocks = draw(st.integers(0, 40))
    n_tokens = n_blocks * bs + draw(st.integers(0, bs - 1))
    ints = st.integers(0, 60)

    def col(elems=ints):
        return np.array(draw(st.lists(elems, min_size=k, max_size=k)), np.int64)

    device = col(st.integers(0, n_blocks))
    host, disk, pool = col(st.integers(0, 5)), col(st.integers(0, 5)), col(st.integers(0, n_blocks))
    prefill_requests = col(st.integers(0, 9))
    requests = prefill_requests + (col(st.integers(0, 30)) if draw(st.booleans()) else 0)
    prefill_tokens = col(st.integers(0, 200_000))
    waits = np.array(draw(st.lists(st.floats(0, 5e6), min_size=k, max_size=k))) if draw(st.booleans()) else None
    free = col(st.integers(0, 80)) if draw(st.booleans()) else None
    c = Candidates(tuple(f"w{i}" for i in range(k)), device, host, disk, pool, prefill_tokens, prefill_requests,
                   requests, np.zeros(k, np.int64), n_tokens, n_blocks, bs, waits, free)
    kw = dict(block_bytes=draw(st.sampled_from([1 << 16, 2 << 20, 16 << 20])),
              batch_tokens=draw(st.sampled_from([2, 512, 8192])),
              pool_us_per_mb=draw(st.sampled_from([0, 38, 222, 10_000])),
              device_share=draw(st.floats(0, 1)), pool_share=draw(st.floats(0, 1)),
              stretch=draw(st.sampled_from([1.0, 1.25, 8.0]) | st.floats(1, 64)))
    if draw(st.booleans()):
        kw["excess"] = np.array(draw(st.lists(st.just(0.0) | st.floats(0, 8), min_size=k, max_size=k)))
        kw["saved"] = np.array(draw(st.lists(st.just(0.0) | st.floats(0, 2e6), min_size=k, max_size=k)))
    return c, draw(st.sampled_from(COSTS)), kw


@settings(max_examples=400, deadline=None)
@given(cases())
def test_native_gives_the_numpy_forms_bits(case):
    c, cost, kw = case
    got = predict_ttft(c, cost, **kw)
    want = numpy_form(c, cost, **kw)
    for name, g, w in zip(("score", "ttft", "pool", "wait"), (got.score, got.ttft_us, got.pool_blocks, got.wait_us),
                          want):
        w = np.asarray(w)
        if name == "pool":
            assert g.dtype == np.int64 and np.array_equal(g, w), (name, g, w)
        else:                                   # the same bits, not only equal values
            assert g.dtype == np.float64 and np.array_equal(g.view(np.uint64), w.astype(np.float64).view(np.uint64)), \
                (name, g, w)


def test_the_router_s_strided_columns_and_read_only_arrays_are_read_in_place():
    table = np.arange(64 * 4, dtype=np.int64).reshape(64, 4)          # columns are strided views
    ro = np.arange(64, dtype=np.int64)
    ro.setflags(write=False)
    c = Candidates(tuple(f"w{i}" for i in range(64)), ro % 9, ro % 2, ro % 3, ro % 5, table[:, 0], table[:, 1] % 7,
                   table[:, 2] % 11, np.zeros(64, np.int64), 130 * 16, 130, 16, None, None)
    kw = dict(block_bytes=2 << 20, batch_tokens=8192, pool_us_per_mb=38, device_share=0.3, pool_share=0.2)
    got = predict_ttft(c, CostModel(), **kw)
    want = numpy_form(c, CostModel(), **kw)
    assert all(np.array_equal(g, w) for g, w in zip((got.score, got.ttft_us, got.pool_blocks, got.wait_us), want))


def test_arrays_of_different_lengths_are_refused():
    a, b = np.zeros(3, np.int64), np.zeros(2, np.int64)
    args = (0, 16, 0, 0, True, 45.0, 80.0, 1500.0, 8192.0, 1.0, 1.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="3 workers"):
        predict(a, a, a, a, a, b, a, None, None, *args)
    with pytest.raises(ValueError, match="page arrays"):
        predict(a, a, a, a, a, a, a, np.zeros(2), None, *args)
    with pytest.raises(ValueError, match="page arrays"):
        predict(a, a, a, a, a, a, a, None, b, *args)
    f3, f2 = np.zeros(3), np.zeros(2)
    with pytest.raises(ValueError, match="go together"):
        predict(a, a, a, a, a, a, a, None, None, *args, 1.0, f3, None)
    with pytest.raises(ValueError, match="3 workers"):
        predict(a, a, a, a, a, a, a, None, None, *args, 1.0, f3, f2)
