"""The router against a brute-force scorer, its selection rules, load feedback, the
approximate mode and the decision-latency export."""
import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from quillcache.control.events import BlockStored, EventBatch
from quillcache.control.indexer import _KEY, DEVICE, DISK, HOST, POOL, DictIndexer, chain_hashes
from quillcache.control.inflight import page_wait_us
from quillcache.control.model import H200_LLAMA3_8B as H200
from quillcache.protocol.route import POLICIES
from quillcache.control.router import NoWorkers, Router, RouterConfig
from quillcache.control.sim.kvevents import scope_tuple
from quillcache.model import IdentityScope

A = IdentityScope("m", "t", None, "acme")
B = IdentityScope("m", "t", None, "globex")
BS = 4
W = ["w0", "w1", "w2", "w3"]


def tokens(n_blocks, salt=0):
    return [salt] * BS + list(range(BS * (n_blocks - 1)))


def brute_logits(router, scope, hashes, n_tokens, identity_aware, pool_aware):
    """Dynamo's formula written out block by block over a plain dict of residency."""
    cfg = router.config
    blocks = {_KEY.unpack(k): v for k, v in router.indexer._blocks.items()}   # (sid, hash) -> {w: bits}
    sids = router.indexer._scope_ids
    pool_src = router.indexer._pool_sources
    out = {}
    for name in router.workers:
        w = router.indexer._worker_ids[name]

        def tiers_of(h, w=w):
            bits = 0
            for s, sid in sids.items():
                if identity_aware and s != scope:
                    continue
                bits |= blocks.get((sid, h), {}).get(w, 0)
            return bits

        def in_pool(h):
            sid = sids.get(scope)
            return any(bits & (1 << POOL) for ww, bits in blocks.get((sid, h), {}).items() if ww in pool_src)

        counts = [0, 0, 0, 0]
        level = 0
        for h in hashes:
            bits = tiers_of(h)
            t = next((t for t in (DEVICE, HOST, DISK) if bits & (1 << t)), None)
            if t is not None and t >= level and level < POOL:
                level = t
            elif t is not None and t < level:
                pass                     # a faster tier still extends the slower level's prefix
            elif pool_aware and in_pool(h):
                level = POOL
            else:
                break
            counts[level] += 1
        credit = (cfg.device_weight * counts[0] + cfg.host_weight * counts[1]
                  + cfg.disk_weight * counts[2] + (cfg.pool_weight * counts[3] if pool_aware else 0))
        ld = router.load(name)
        raw = (ld.active_prefill_tokens + n_tokens) / cfg.block_size
        out[name] = cfg.prefill_load_scale * max(raw - credit, 0) + ld.decode_blocks \
            + cfg.active_request_weight * ld.active_requests
    return out


place_st = st.tuples(st.integers(0, 4), st.integers(0, 1), st.integers(0, 3), st.integers(0, 5),
                     st.integers(1, 6))


@settings(max_examples=80, deadline=None)
@given(st.lists(place_st, max_size=25), st.lists(st.integers(0, 400), min_size=4, max_size=4),
       st.integers(1, 8), st.just("dynamo"),
       st.floats(0.5, 2.0), st.floats(0, 3))
def test_logits_match_a_brute_force_scorer(places, loads, qlen, policy, scale, w_active):
    # Dynamo's cost as shipped; quillcache's predictor has its own oracle in test_policies.py
    cfg = RouterConfig(policy=policy, block_size=BS, prefill_load_scale=scale,
                       active_request_weight=w_active, seed=1)
    router = Router(cfg, DictIndexer(), W)
    router.indexer.worker("pool", pool=True)
    chain = chain_hashes(tokens(8), BS)
    for w, s, tier, start, n in places:
        worker = "pool" if w == 4 else W[w]
        router.indexer.add_blocks(worker, (A, B)[s], chain[start:start + n],
                                  POOL if w == 4 else min(tier, DISK))
    for name, extra in zip(W, loads):
        router.load(name).active_prefill_tokens = extra
        router.load(name).decode_blocks = extra // 7
        router.load(name).active_requests = extra % 3
    d = router.route(A, hashes=chain[:qlen], request_tokens=qlen * BS, track=False)
    want = brute_logits(router, A, chain[:qlen], qlen * BS, identity_aware=policy == "quillcache",
                        pool_aware=policy == "quillcache")
    assert d.logits == pytest.approx(want)
    assert d.logits[d.worker] == min(d.logits.values())


def test_identity_scoped_credit_refuses_another_tenants_prefix():
    toks = tokens(8)
    for policy, expect_cross in (("dynamo", 8), ("quillcache", 0)):
        router = Router(RouterConfig(policy=policy, block_size=BS, seed=3), workers=W)
        router.indexer.add_blocks("w2", B, chain_hashes(toks, BS), DEVICE)
        d = router.route(A, toks, track=False)
        if policy == "dynamo":
            assert d.worker == "w2" and d.cross_identity_credited_blocks == expect_cross
            assert d.plan_names() == ["device"] * 8
        else:
            assert d.cross_identity_credited_blocks == 0
            assert d.plan_names() == ["recompute"] * 8
            assert d.refused_blocks in (0, 8) and (d.worker != "w2" or d.refused_blocks == 8)


def test_plan_has_local_hits_then_pool_fetches_then_recompute():
    router = Router(RouterConfig(block_size=BS, seed=0), workers=["w0"])
    h = chain_hashes(tokens(8), BS)
    router.indexer.add_blocks("w0", A, h[:2], DEVICE)
    router.indexer.add_blocks("w0", A, h[2:3], HOST)
    router.indexer.add_blocks("w0", A, h[3:4], DISK)
    router.indexer.add_blocks("node", A, h[:6], POOL)
    d = router.route(A, hashes=h, track=False)
    assert d.plan_names() == ["device", "device", "host", "disk", "pool", "pool", "recompute", "recompute"]
    assert d.credited_blocks == pytest.approx(2 + 0.75 + 0.25 + 2 * 0.5)


def test_zero_temperature_breaks_ties_at_random():
    router = Router(RouterConfig(block_size=BS, seed=7), workers=W)
    seen = Counter(router.route(A, tokens(2), track=False).worker for _ in range(400))
    assert set(seen) == set(W) and min(seen.values()) > 50


def test_positive_temperature_samples_the_softmax_of_the_costs():
    router = Router(RouterConfig(policy="dynamo", block_size=BS, temperature=0.5, seed=11), workers=W)
    for name, extra in zip(W, (0, 40, 80, 160)):
        router.load(name).decode_blocks = extra
    d = router.route(A, tokens(2), track=False)
    c = np.array([d.logits[n] for n in W])
    p = np.exp(-(c - c.min()) / ((c.max() - c.min()) * 0.5))
    p /= p.sum()
    n = 4000
    seen = Counter(router.route(A, tokens(2), track=False).worker for _ in range(n))
    for name, prob in zip(W, p):
        sigma = math.sqrt(n * prob * (1 - prob)) + 1
        assert abs(seen[name] - n * prob) < 5 * sigma, (name, seen, p)


def test_load_feedback_route_first_token_free():
    router = Router(RouterConfig(block_size=BS, seed=0), workers=["w0"])
    d = router.route(A, tokens(4), request_id="r1")
    ld = router.load("w0")
    assert (ld.active_prefill_tokens, ld.decode_blocks, ld.active_requests) == (16, 4, 1)
    assert router.first_token("r1")
    assert (ld.active_prefill_tokens, ld.decode_blocks) == (0, 4)
    assert router.free(d.request_id)
    assert (ld.active_prefill_tokens, ld.decode_blocks, ld.active_requests) == (0, 0, 0)
    assert not router.free("r1")
    router.route(A, tokens(4), request_id="r2")
    assert router.free("r2")                       # aborted before its first token
    assert (ld.active_prefill_tokens, ld.decode_blocks, ld.active_requests) == (0, 0, 0)


def test_load_spreads_requests_without_cache():
    router = Router(RouterConfig(block_size=BS, seed=0), workers=W)
    chosen = [router.route(A, tokens(4, salt=i)).worker for i in range(8)]
    assert Counter(chosen) == Counter(dict.fromkeys(W, 2))


def ehash(toks, i):
    return bytes([toks[0] % 256, i + 1]) * 16


def stored(scope, toks, start, end, parent=None):
    """An engine's BlockStored event for blocks ``start:end`` of ``toks`` (engine hashes made
    up from the first token and the block index: ``ehash``), under ``scope``'s identity."""
    return BlockStored(tuple(ehash(toks, i) for i in range(start, end)),
                       parent, tuple(toks[start * BS:end * BS]), BS, quill_scope=scope_tuple(scope))


def test_prefill_progress_from_the_engines_events_shortens_the_queue():
    """A prompt half computed (its blocks stored, chunk by chunk) is half the work queued there:
    quillcache's queue counts what the events show computed off, for its own requests, under
    their own identity, in arrival order; the last token stays until the first token; the peers'
    load is what it was."""
    toks = tokens(8)
    engine = IdentityScope("m", "t", None, "")
    router = Router(RouterConfig(policy="quillcache", block_size=BS, seed=0, batch_tokens=8), workers=["w0", "w1"])
    router.route(A, toks, request_id="r1", candidates=["w0"])
    router.route(A, tokens(6, salt=5), request_id="r2", candidates=["w0"])
    ld = router.load("w0")

    def probe():
        return router.route(A, tokens(2, salt=9), track=False, candidates=["w0"]).predicted_ttft_us

    before = probe()
    assert (ld.active_prefill_tokens, ld.prefilled_tokens) == (32 + 24, 0)
    # the same tokens stored under another tenant's identity say nothing of r1's progress
    router.apply_events("w0", EventBatch(1.0, (stored(B, toks, 0, 4),)), engine)
    assert ld.prefilled_tokens == 0 and probe() == before
    # r2's blocks stored while r1, ahead of it, has not started: another request's work (the
    # engine admits in order), not r2's progress
    router.apply_events("w0", EventBatch(1.5, (stored(A, tokens(6, salt=5), 0, 2),)), engine)
    assert ld.prefilled_tokens == 0 and router._active["r2"].prefilled == 0
    router.apply_events("w0", EventBatch(2.0, (stored(A, toks, 0, 4),)), engine)
    assert ld.prefilled_tokens == 16 and router._active["r1"].prefilled == 16
    assert before - probe() == pytest.approx(16 * router.config.cost.prefill_us_per_token)
    # every block stored: all but its last token counted off until its first token
    router.apply_events("w0", EventBatch(3.0, (stored(A, toks, 4, 8, ehash(toks, 3)),)), engine)
    assert router._active["r1"].prefilled == 31
    # r1 in its last chunk (under batch_tokens to go): r2 may start beside it, so its blocks count
    assert router._active["r2"].prefilled == 8 and ld.prefilled_tokens == 39
    assert router.first_token("r1")
    assert (ld.active_prefill_tokens, ld.prefilled_tokens) == (24, 8)
    # its progress goes on, and leaves with it when it is aborted in prefill
    t2 = tokens(6, salt=5)
    router.apply_events("w0", EventBatch(4.0, (stored(A, t2, 2, 3, ehash(t2, 1)),)), engine)
    assert ld.prefilled_tokens == 12
    assert router.free("r2") and (ld.active_prefill_tokens, ld.prefilled_tokens) == (0, 0)
    # a request routed behind one whose prompt it extends: what that one stores (its last chunk
    # too, which the engine recomputes for the one behind) is not the progress of the other
    router.route(A, toks, request_id="r3", candidates=["w1"])
    router.route(A, toks + list(range(100, 100 + 4 * BS)), request_id="r4", candidates=["w1"])
    router.apply_events("w1", EventBatch(5.0, (stored(A, toks, 0, 8),)), engine)
    assert (router._active["r3"].prefilled, router._active["r4"].prefilled) == (31, 0)
    # a peer's load counts the whole prompt until its first token, as before
    peer = Router(RouterConfig(policy="dynamo", block_size=BS, seed=0), workers=["w0"])
    peer.route(A, toks, request_id="r1")
    peer.apply_events("w0", EventBatch(1.0, (stored(A, toks, 0, 4),)), engine)
    assert (peer.load("w0").active_prefill_tokens, peer.load("w0").prefilled_tokens) == (32, 0)


def test_approximate_mode_predicts_then_forgets_after_the_ttl():
    router = Router(RouterConfig(block_size=BS, approximate=True, approx_ttl_s=60, seed=0), workers=W)
    toks = tokens(6)
    first = router.route(A, toks, track=False).worker
    again = router.route(A, toks, track=False)
    assert again.worker == first and again.overlap[0] == 6
    router.expire(now=1e18)
    assert router.indexer.find_matches(A, chain_hashes(toks, BS)).device.max() == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_routes_and_plans(policy):
    router = Router(RouterConfig(policy=policy, block_size=BS, seed=0), workers=W)
    router.indexer.add_blocks("w1", A, chain_hashes(tokens(4), BS), DEVICE)
    d = router.route(A, tokens(4), track=False)
    assert d.worker in W and len(d.plan) == 4
    if policy in ("prefix", "dynamo", "quillcache"):
        assert d.worker == "w1"


def test_no_worker_is_a_clear_error():
    with pytest.raises(NoWorkers):
        Router(RouterConfig(block_size=BS)).route(A, tokens(2))
    with pytest.raises(ValueError, match="router policy"):
        RouterConfig(policy="magic")


def test_decision_latency_is_exported_to_prometheus():
    reg = CollectorRegistry()
    router = Router(RouterConfig(block_size=BS, seed=0), workers=W)
    router.export_metrics(reg)
    for i in range(5):
        router.route(A, tokens(3, salt=i), track=False)
    assert reg.get_sample_value("quillcache_router_decision_seconds_count") == 5
    assert reg.get_sample_value("quillcache_router_decision_seconds_sum") > 0
    assert router.latency_percentile(50) > 0


def test_the_predicted_ttft_p99_is_exported_to_prometheus():
    reg = CollectorRegistry()
    router = Router(RouterConfig(policy="quillcache", block_size=BS, seed=0), workers=W)
    router.export_metrics(reg)
    assert math.isnan(reg.get_sample_value("quillcache_router_predicted_ttft_p99_seconds"))
    predicted = []
    for i in range(100):
        d = router.route(A, tokens(3, salt=i), request_id=f"r{i}")
        predicted.append(d.predicted_ttft_us)
        router.free(f"r{i}")
    assert reg.get_sample_value("quillcache_router_predicted_ttft_p99_seconds") == pytest.approx(
        float(np.quantile(predicted, 0.99)) / 1e6)


def busy_router(workers, busy):
    """A quillcache router exporting to a fresh registry, with ``busy`` of its ``workers`` each
    holding a request in prefill (100 tokens) that no arrival ends."""
    reg = CollectorRegistry()
    router = Router(RouterConfig(policy="quillcache", block_size=BS, seed=0), workers=list(workers))
    router.export_metrics(reg)
    for name in busy:
        ld = router.load(name)
        ld.active_prefill_tokens, ld.prefill_requests, ld.active_requests = 100, 1, 1
    return reg, router


def arrive(router, first, n):
    """``n`` tracked arrivals, each freed at once: its own load comes and goes."""
    for i in range(first, first + n):
        router.route(A, tokens(3, salt=i), request_id=f"r{i}")
        router.free(f"r{i}")


def test_the_saturated_busy_reading_is_exported_to_prometheus():
    # 0 until a full window (256) of tracked arrivals has each found every worker in prefill
    reg, router = busy_router(("w0", "w1"), ("w0", "w1"))
    assert reg.get_sample_value("quillcache_router_saturated") == 0.0
    arrive(router, 0, 255)
    assert reg.get_sample_value("quillcache_router_saturated") == 0.0
    arrive(router, 255, 1)
    assert reg.get_sample_value("quillcache_router_saturated") == 1.0
    router.load("w1").prefill_requests = 0            # one arrival finds w1 free
    arrive(router, 256, 1)
    assert reg.get_sample_value("quillcache_router_saturated") == 0.0


def test_the_busy_share_is_exported_to_prometheus():
    reg, router = busy_router(("w0", "w1", "w2"), ("w0", "w1"))
    assert reg.get_sample_value("quillcache_router_busy_share") == 0.0
    arrive(router, 0, 4)
    assert reg.get_sample_value("quillcache_router_busy_share") == pytest.approx(2 / 3)


# ---- the router's fast path (native match, load table, candidate columns) against the
# straightforward scorer: the dict indexer, one worker at a time, the loads as given


def ahead_depth(inflight, name, scope, hashes, batch_tokens):
    """The prefix of ``hashes`` that the requests in prefill on ``name`` (worker, scope, hashes,
    tokens, uncached tokens) will have computed: each its common prefix with the request, less
    its last chunk of prefill."""
    best = 0
    for w, s, hs, n, uncached in inflight:
        if w != name or s != scope:
            continue
        last = (max(uncached, 1) - 1) % batch_tokens + 1
        done = min(len(hs), max(n - last, 0) // BS)
        common = 0
        while common < min(len(hs), len(hashes)) and hs[common] == hashes[common]:
            common += 1
        best = max(best, min(common, done))
    return best


def memory_wait(cfg, inflight, name, scope, hashes, n_tokens, decodes):
    """The wait for KV pages on ``name``, from the requests in flight as routed: the pages they
    hold (their distinct blocks, each one's partial last), what of the request they hold."""
    mine = [(s, hs, n, unc) for w, s, hs, n, unc in inflight if w == name]
    held = len({(s, h) for s, hs, _, _ in mine for h in hs}) + sum(math.ceil(n / BS) - len(hs) for _, hs, n, _ in mine)
    pinned = 0
    for s, hs, _, _ in mine:
        common = 0
        while s == scope and common < min(len(hs), len(hashes)) and hs[common] == hashes[common]:
            common += 1
        pinned = max(pinned, common)
    need = math.ceil(n_tokens / BS) - pinned
    if held + need <= cfg.kv_blocks or not mine:
        return 0.0
    return page_wait_us([(True, unc, 0, math.ceil(n / BS)) for _, _, n, unc in mine], need, cfg.kv_blocks, held,
                        cfg.cost.prefill_us_per_token,
                        cfg.cost.decode_us_per_token + cfg.cost.running_decode_penalty_us * decodes)


def straight(router, ref, loads, scope, hashes, n_tokens, policy, names, inflight=(), branches=(), sent=()):
    """(logits, choices allowed, per-worker facts) computed worker by worker from the dict
    indexer's match, the requests in prefill and the loads as the test set them; ``branches``:
    the (prefix, next block) the arrivals before it recorded (``BranchPoints``); ``sent``: the
    (worker, chain) of the prompts routed before it, which are all ``sglang`` matches (its
    gateway's own tree, not the engines' events)."""
    from quillcache.control.policies import (Candidates, goodput_placement, llmd_scores, mooncake_scores,
                                             predict_placement, sglang_scores)
    from quillcache.control.router import BLIND_POLICIES
    cfg = router.config
    scoped = ref.find_matches(scope, hashes).as_dict()
    blind = ref.find_matches(None, hashes).as_dict()
    zero = (0, 0, 0, 0, 0)
    facts = {}
    for n in names:
        d, h, k, p, refused = scoped.get(n, zero)
        cross = 0
        if policy in BLIND_POLICIES:
            bd, bh, bk, _, _ = blind.get(n, zero)
            cross, refused, p = max(bd + bh + bk - (d + h + k), 0), 0, 0
            d, h, k = bd, bh, bk
        elif policy != "quillcache":
            p = 0
        else:      # the blocks the requests in prefill there compute first are on its device
            a = ahead_depth(inflight, n, scope, hashes, cfg.batch_tokens)
            c1 = max(d, a)
            c2, c3, c4 = max(d + h, c1), max(d + h + k, c1), max(d + h + k + p, c1)
            d, h, k, p = c1, c2 - c1, c3 - c2, c4 - c3
        facts[n] = dict(tiers=(d, h, k, p), refused=refused, cross=cross, offered=p, predicted=0.0, moved=0)
    apt, preq, req, dec = ([loads[n][i] for n in names] for i in range(4))
    logits = []
    for i, n in enumerate(names):
        d, h, k, p = facts[n]["tiers"]
        raw = (apt[i] + n_tokens) / cfg.block_size
        if policy == "dynamo":
            credit = cfg.device_weight * d + cfg.host_weight * h + cfg.disk_weight * k + cfg.pool_weight * p
            logits.append(cfg.prefill_load_scale * max(raw - credit, 0.0) + dec[i]
                          + cfg.active_request_weight * req[i])
        elif policy == "least_loaded":
            logits.append(cfg.prefill_load_scale * raw + dec[i] + cfg.active_request_weight * req[i])
        elif policy in ("prefix", "round_robin"):
            logits.append(-float(d + h + k) if policy == "prefix" else 0.0)
    allowed = None
    if policy in ("sglang", "llmd", "mooncake", "quillcache"):
        col = [np.array([facts[n]["tiers"][t] for n in names], np.int64) for t in range(4)]
        held = {n: {h for w, chain in sent if w == n for h in chain} for n in names}
        trees = np.array([len(held[n]) if policy == "sglang" else 0 for n in names], np.int64)
        a = lambda v: np.array(v, np.int64)
        waits = None
        free = None
        if policy == "quillcache" and cfg.kv_blocks is not None:
            waits = np.array([memory_wait(cfg, inflight, n, scope, hashes, n_tokens, max(req[i] - preq[i], 0))
                              for i, n in enumerate(names)])
            # the engine's pages less its cached device blocks and the blocks routed there to compute
            free = a([max(cfg.kv_blocks - dev - math.ceil(apt[i] / BS), 0)
                      for i, dev in enumerate(ref.device_blocks(names))])
        cand = Candidates(tuple(names), *col, a(apt), a(preq), a(req), trees, n_tokens, len(hashes), cfg.block_size,
                          waits, free)
        if policy == "quillcache":
            # a branch point: an arrival reused the prefix deepest on a device and went on otherwise
            top = int(col[0].max())
            mine = hashes[top] if top < len(hashes) else None
            branched = top > 0 and any(key == (scope, hashes[top - 1]) and (nxt != mine or nxt is None)
                                       for key, nxt in branches)
            pred = predict_placement(cand, cfg.cost, branched=branched, block_bytes=router._block_bytes,
                                     batch_tokens=cfg.batch_tokens, pool_us_per_mb=router._pool_us_per_mb,
                                     device_share=router.stats.device_share, pool_share=router.stats.pool_share,
                                     stretch=router.busy.stretch(len(router.workers)))
            if cfg.goodput_placement:
                pred = goodput_placement(pred, cfg.slo_ttft_ms * 1000.0, tail=router.ttft_tail,
                                         saturated=router.busy.saturated())
            logits = pred.score.tolist()
            for i, n in enumerate(names):
                facts[n]["predicted"] = float(pred.ttft_us[i])
                facts[n]["tiers"] = facts[n]["tiers"][:3] + (int(pred.pool_blocks[i]),)
        elif policy == "mooncake":
            score, moved = mooncake_scores(cand, cfg.cost, cfg.transfer_us_per_mb, router._block_bytes)
            logits = score.tolist()
            for i, n in enumerate(names):
                facts[n]["predicted"], facts[n]["moved"] = float(score[i]), int(moved[i])
        elif policy == "llmd":
            logits = llmd_scores(cand).tolist()
        else:
            lead = [next((j for j, h in enumerate(hashes) if h not in held[n]), len(hashes)) for n in names]
            no = np.zeros(len(names), np.int64)
            score, eligible = sglang_scores(dataclasses.replace(cand, device=a(lead), host=no, disk=no))
            logits = score.tolist()
            allowed = {n for n, e in zip(names, eligible) if e}
    if allowed is None and policy == "prefix":
        depth = {n: sum(facts[n]["tiers"][:3]) for n in names}
        deep = [n for n in names if depth[n] == max(depth.values())]
        load = {n: cfg.prefill_load_scale * (loads[n][0] + n_tokens) / cfg.block_size + loads[n][3] for n in deep}
        allowed = {n for n in deep if load[n] == min(load.values())}
    elif allowed is None:
        allowed = {n for n, v in zip(names, logits) if v == min(logits)} if policy != "round_robin" else set(names)
    return dict(zip(names, logits)), allowed, facts


fast_place = st.tuples(st.integers(0, 6), st.integers(0, 1), st.integers(0, 3), st.integers(0, 7),
                       st.integers(1, 8))
load_st = st.tuples(st.integers(0, 5000), st.integers(0, 6), st.integers(0, 9), st.integers(0, 300))


@settings(max_examples=150, deadline=None)
@given(st.lists(fast_place, max_size=30), st.lists(load_st, min_size=6, max_size=6), st.integers(0, 9),
       st.sampled_from(POLICIES), st.booleans(), st.one_of(st.none(), st.permutations(range(6))),
       st.integers(1, 6), st.integers(0, 3),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1), st.integers(1, 10), st.integers(0, 100)),
                max_size=4), st.sampled_from([None, 8, 30]),
       st.lists(st.tuples(st.integers(0, 1), st.integers(1, 9), st.integers(0, 2)), max_size=6))
def test_fast_decisions_equal_the_straightforward_scorer(places, loads, qlen, policy, pool_first, order,
                                                         n_cand, extra_tokens, inflight, kv_blocks, branched):
    """Random residency (2 identities, every tier, a pool node registered before or after
    the workers), requests in prefill, random loads, random candidate subsets in any order,
    prefixes earlier arrivals branched from, every policy: the router's logits, choice,
    overlap, plan and counters are the straightforward scorer's."""
    names = [f"w{i}" for i in range(6)]
    cfg = RouterConfig(policy=policy, block_size=BS, seed=5, cost=H200, kv_bytes_per_token=131072,
                       batch_tokens=64, kv_blocks=kv_blocks)
    router = Router(cfg)
    ref = DictIndexer()
    if pool_first:
        router.indexer.worker("pool", pool=True)
    ref.worker("pool", pool=True)
    for n in names:
        router.add_worker(n)
        ref.worker(n)
    chain = chain_hashes(tokens(10), BS)
    for w, s, tier, start, n in places:
        worker = "pool" if w == 6 else names[w]
        tier = POOL if w == 6 else min(tier, DISK)
        for idx in (router.indexer, ref):
            idx.add_blocks(worker, (A, B)[s], chain[start:start + n], tier)
    sent = [(names[w], chain[:start + n]) for w, s, tier, start, n in places if w < 6 and s == 0]
    for w, chain_sent in sent:          # prompts sglang's gateway routed: its tree, whatever the engines hold
        router.routed.insert(chain_sent, w)
    routed = []
    for w, s, q, extra in inflight:      # requests in prefill: their blocks are in no event yet
        n_in = q * BS + extra
        di = router.route((A, B)[s], hashes=chain[:q], request_tokens=n_in, candidates=[names[w]],
                          policy="round_robin")
        routed.append((names[w], (A, B)[s], chain[:q], n_in, n_in - sum(di.overlap) * BS))
    given_loads = {}
    for n, (apt, preq, req, dec) in zip(names, loads):
        ld = router.load(n)
        ld.active_prefill_tokens, ld.prefill_requests, ld.active_requests, ld.decode_blocks = apt, preq, req, dec
        given_loads[n] = (apt, preq, req, dec)
    cands = None if order is None else [names[i] for i in order[:n_cand]]
    hashes = chain[:qlen] if qlen else [12345]
    n_tokens = len(hashes) * BS + extra_tokens
    branches = []        # earlier arrivals' prefix and next block: the chain's own, none, another
    for s, depth, kind in branched:
        entry = ((A, B)[s], chain[depth - 1]), (chain[depth], None, 99999)[kind]
        router.branches.add(*entry)
        branches.append(entry)
    d = router.route(A, hashes=hashes, request_tokens=n_tokens, track=False, candidates=cands)
    logits, allowed, facts = straight(router, ref, given_loads, A, hashes, n_tokens, policy, cands or names,
                                      routed, branches, sent)
    assert d.logits == logits                   # exactly: the same numbers, not close ones
    assert d.worker in allowed
    f = facts[d.worker]
    dd, hh, kk, pp = f["tiers"]
    if f["moved"]:
        pp = f["moved"]
        local = {n: sum(facts[n]["tiers"][:3]) for n in (cands or names)}
        assert d.transfer_from in {n for n, v in local.items() if v == max(local.values())}
    assert d.overlap == (dd, hh, kk, pp) and d.transfer_blocks == f["moved"]
    assert d.plan_names() == (["device"] * dd + ["host"] * hh + ["disk"] * kk + ["pool"] * pp
                              + ["recompute"] * (len(hashes) - dd - hh - kk - pp))
    assert d.credited_blocks == (cfg.device_weight * dd + cfg.host_weight * hh + cfg.disk_weight * kk
                                 + cfg.pool_weight * f["offered"])
    assert (d.refused_blocks, d.cross_identity_credited_blocks) == (f["refused"], f["cross"])
    assert d.predicted_ttft_us == f["predicted"]


op_load = st.tuples(st.sampled_from(["route", "first", "free", "remove", "add", "stored"]), st.integers(0, 5),
                    st.integers(1, 40))


@settings(max_examples=80, deadline=None)
@given(st.lists(op_load, max_size=40), st.sampled_from(["least_loaded", "quillcache"]))
def test_load_table_equals_the_sum_over_requests_in_flight(ops, policy):
    """The per-worker load rows after any sequence of routes, first tokens, frees, removals,
    re-additions and engine events storing a request's blocks equal the plain sum over the
    router's requests in flight."""
    names = [f"w{i}" for i in range(6)]
    router = Router(RouterConfig(policy=policy, block_size=BS, seed=0, batch_tokens=8), workers=names[:4])
    rids, toks = [], {}
    for kind, w, n in ops:
        if kind == "route":
            t = tokens(1 + n % 8, salt=n)
            rids.append(router.route(A, t, request_tokens=n * BS).request_id)
            toks[rids[-1]] = t
        elif kind == "first" and rids:
            router.first_token(rids[w % len(rids)])
        elif kind == "free" and rids:
            router.free(rids.pop(w % len(rids)))
        elif kind == "remove" and len(router.workers) > 1:
            router.remove_worker(router.workers[w % len(router.workers)])
        elif kind == "add":
            router.add_worker(names[w])
        elif kind == "stored" and rids:
            rid = rids[w % len(rids)]
            a = router._active.get(rid)
            if a is not None:
                t = toks[rid]
                router.apply_events(a.worker, EventBatch(0.0, (stored(A, t, 0, min(n, len(t) // BS)),)), A)
    for name in router.workers:
        mine = [a for a in router._active.values() if a.worker == name]
        ld = router.load(name)
        assert ld.active_prefill_tokens == sum(a.prefill_tokens for a in mine if a.prefilling)
        assert ld.prefilled_tokens == sum(a.prefilled for a in mine if a.prefilling)
        assert all(0 <= a.prefilled < max(a.prefill_tokens, 1) for a in mine)
        assert policy == "quillcache" or ld.prefilled_tokens == 0
        assert ld.prefill_requests == sum(1 for a in mine if a.prefilling)
        assert ld.active_requests == len(mine)
        assert ld.decode_blocks == sum(a.blocks for a in mine)
        assert ld.pages == len({key for a in mine for key in a.pinned}) + sum(a.private_pages for a in mine)
    # the blocks credited to requests behind one in prefill: exactly those of the requests in prefill
    assert router._ahead.counts() == Counter((key, a.worker) for a in router._active.values() for key in a.ahead)
    assert router._pinned.counts() == Counter((key, a.worker) for a in router._active.values() for key in a.pinned)
    assert all(not a.ahead for a in router._active.values() if not a.prefilling)


@settings(max_examples=100, deadline=None)
@given(st.lists(fast_place, max_size=30), st.lists(load_st, min_size=6, max_size=6), st.integers(1, 9),
       st.integers(0, 3), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1), st.integers(1, 10),
                                             st.integers(0, 100)), min_size=1, max_size=6),
       st.sampled_from([4, 8, 30]))
def test_quillcache_memory_waits_equal_the_straightforward_scorer(places, loads, qlen, extra_tokens, inflight,
                                                                  kv_blocks):
    """The same, for quillcache with KV memory known and requests in flight on small engines:
    the pages they hold and the wait for them."""
    test_fast_decisions_equal_the_straightforward_scorer.hypothesis.inner_test(
        places, loads, qlen, "quillcache", False, None, 6, extra_tokens, inflight, kv_blocks, ())
