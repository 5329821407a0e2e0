"""The routing peers against hand-worked examples, the quillcache predictor term by term,
hot-prefix spreading, pool awareness, admission, identity scoping over a replay, and the
decision's work not growing with the index."""
import dataclasses
import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.control.indexer import DEVICE, POOL, ArtIndexer, chain_hashes
from quillcache.control.inflight import page_wait_us
from quillcache.control.model import TCP_BYTES_PER_S, CostModel, us_per_mib
from quillcache.control.policies import BranchPoints, BusyShare, DemandShare, TailQuantile, chance
from quillcache.control.router import Router, RouterConfig
from quillcache.control.sim.engine import EngineConfig, H200_LLAMA3_8B
from quillcache.control.sim.replay import build_requests, run_policy
from quillcache.control.sim.trace import TraceRequest, assign_tenants
from quillcache.model import IdentityScope

A = IdentityScope("m", "t", None, "acme")
B = IdentityScope("m", "t", None, "globex")
BS = 4
KV = 131072                              # bytes per token: a block of 4 tokens is 0.5 MiB
COST = CostModel()                       # 45 us per prefill token, 55 us per MiB from host


def toks(n_blocks, salt=0):
    return [salt] * BS + list(range(BS * (n_blocks - 1)))


def router(policy, workers=("w0", "w1", "w2"), **kw):
    kw.setdefault("batch_tokens", 8192)
    return Router(RouterConfig(policy=policy, block_size=BS, seed=0, cost=COST, kv_bytes_per_token=KV, **kw),
                  workers=list(workers))


def set_load(r, name, prefill_tokens, prefill_requests, requests):
    ld = r.load(name)
    ld.active_prefill_tokens, ld.prefill_requests, ld.active_requests = prefill_tokens, prefill_requests, requests


def three_way(policy):
    """w0 holds 8 of the request's 10 blocks behind a long queue; w1 holds nothing behind a
    short one; w2 holds 2 blocks with an empty queue but more queued tokens than w1.

    sglang: loads 3, 2, 0 are balanced (spread 3 <= 64) and w0's match 0.8 > 0.3 -> w0 (its
          gateway routed those prompts there: its tree is what it routed, not the events).
    llmd: queue scores 0, 1/3, 1 (waiting 3, 2, 0); prefix 0.8, 0, 0.2;
          2q + 3p = 2.4, 0.67, 2.6 -> w2.
    mooncake: TTFT (45 us/token): w0 4000 + 8 tokens; w1 100 + 8 tokens plus moving w0's 8
          blocks over TCP (8 x 0.5 MiB x 233 us = 932 us < 8 x 4 x 45 = 1440 us recomputed)
          = 5792 us; w2 500 + 8 tokens + 6 blocks moved -> w1, with the prefix from w0."""
    r = router(policy)
    h = chain_hashes(toks(10), BS)
    r.indexer.add_blocks("w0", A, h[:8], DEVICE)
    r.indexer.add_blocks("w2", A, h[:2], DEVICE)
    r.routed.insert(h[:8], "w0")
    r.routed.insert(h[:2], "w2")
    set_load(r, "w0", 4000, 3, 3)
    set_load(r, "w1", 100, 2, 2)
    set_load(r, "w2", 500, 0, 0)
    return r.route(A, hashes=h, request_tokens=40, track=False)


def test_the_peers_choose_differently_on_one_hand_worked_example():
    assert three_way("sglang").worker == "w0"
    d = three_way("llmd")
    assert d.worker == "w2"
    assert -d.logits["w0"] == pytest.approx(2.4) and -d.logits["w2"] == pytest.approx(2.6)
    assert -d.logits["w1"] == pytest.approx(2 / 3)
    m = three_way("mooncake")
    assert m.worker == "w1" and m.transfer_from == "w0" and m.transfer_blocks == 8
    assert us_per_mib(TCP_BYTES_PER_S) == 233
    assert m.predicted_ttft_us == pytest.approx(45 * 108 + 8 * 0.5 * 233)
    assert m.plan_names() == ["pool"] * 8 + ["recompute"] * 2


def test_sglang_takes_the_least_loaded_when_imbalanced_else_the_smallest_tree():
    r = router("sglang")
    h = chain_hashes(toks(10), BS)
    r.routed.insert(h, "w0")                                  # a full match ...
    set_load(r, "w0", 0, 0, 100)
    set_load(r, "w1", 0, 0, 30)                               # 100 - 30 > 64 and 100 > 1.5 x 30
    set_load(r, "w2", 0, 0, 31)
    assert r.route(A, hashes=h, request_tokens=40, track=False).worker == "w1"
    set_load(r, "w1", 0, 0, 40)                               # 100 - 40 = 60: balanced -> the match
    set_load(r, "w2", 0, 0, 40)
    assert r.route(A, hashes=h, request_tokens=40, track=False).worker == "w0"
    # no match above 0.3: the smallest tree (w0 was sent 10 blocks, w1 5, w2 2)
    r.routed.insert(chain_hashes(toks(5, salt=1), BS), "w1")
    r.routed.insert(chain_hashes(toks(2, salt=2), BS), "w2")
    other = chain_hashes(toks(10, salt=9), BS)
    assert r.route(A, hashes=other, request_tokens=40, track=False).worker == "w2"


def test_sglang_matches_what_its_gateway_routed_not_what_the_engines_report():
    """sgl-router inserts each prompt into the chosen worker's tree as it routes it.  A burst
    for one new prefix follows its first request before any engine has stored a block; a burst
    of unmatched prompts spreads by the size of what was sent; blocks an engine reports but the
    gateway never sent there attract nothing; a probe (``track=False``) inserts nothing."""
    r = router("sglang", workers=("w0", "w1", "w2", "w3"))
    doc = chain_hashes(toks(10, salt=5), BS)
    first = r.route(A, hashes=doc, request_tokens=40).worker
    assert all(r.route(A, hashes=doc, request_tokens=40).worker == first for _ in range(5))
    assert r.routed.sizes(r.workers).tolist() == [10 if w == first else 0 for w in r.workers]
    # unmatched prompts of 10 blocks: each goes to a worker not yet sent anything, then ties
    sent = [r.route(A, hashes=chain_hashes(toks(10, salt=100 + i), BS), request_tokens=40).worker for i in range(3)]
    assert sorted(sent + [first]) == sorted(r.workers)
    # the engines' events: w3 caches a prompt no one sent it; sglang's tree does not see it
    lone = chain_hashes(toks(10, salt=7), BS)
    r.indexer.add_blocks("w3", A, lone, DEVICE)
    assert r.routed.depths(lone, r.workers).tolist() == [0, 0, 0, 0]
    before = r.routed.sizes(r.workers).tolist()
    r.route(A, hashes=lone, request_tokens=40, track=False)
    assert r.routed.sizes(r.workers).tolist() == before
    r.remove_worker(first)
    assert r.routed.depths(doc, r.workers).tolist() == [0, 0, 0]


def test_the_routed_tree_evicts_leaves_first_and_stays_bounded():
    from quillcache.control.routed import RoutedTree, default_max_blocks
    assert default_max_blocks(512) == 8192          # 2^24 characters at 4 a token, in 512-token blocks
    t = RoutedTree(max_blocks=6)
    old, new = chain_hashes(toks(4), BS), chain_hashes(toks(4, salt=1), BS)
    t.insert(old, "w")
    t.insert(new, "w")                              # 8 blocks: the old prompt's two deepest go
    assert t.sizes(["w"]).tolist() == [6]
    assert t.depths(old, ["w"]).tolist() == [2] and t.depths(new, ["w"]).tolist() == [4]
    t.insert(old[:1], "w")                          # used again: its head is the most recent
    t.insert(chain_hashes(toks(2, salt=2), BS), "w")
    assert t.depths(old, ["w"]).tolist() == [1]     # the head stays, the leaves went
    t.remove_worker("w")
    assert t.sizes(["w"]).tolist() == [0] and not t._held
    with pytest.raises(ValueError):
        RoutedTree(0)


def test_llmd_queue_scorer_is_neutral_when_all_queues_are_equal():
    r = router("llmd")
    h = chain_hashes(toks(10), BS)
    r.indexer.add_blocks("w1", A, h[:5], DEVICE)
    for w in ("w0", "w1", "w2"):
        set_load(r, w, 0, 4, 4)
    d = r.route(A, hashes=h, request_tokens=40, track=False)
    assert d.worker == "w1" and -d.logits["w1"] == pytest.approx(2 + 3 * 0.5)
    assert -d.logits["w0"] == pytest.approx(2.0)


def test_quillcache_prediction_term_by_term():
    """One worker: 1000 tokens queued, 2 decodes running (another 2 elsewhere), the request
    12 blocks = 48 tokens, 4 on the device, 2 more in the pool.
      work     = 1000 + 48 - 6 x 4 = 1024 tokens, x 45 us          = 46080
      decodes  = ceil(1024 / (8192 - 2)) = 1 iteration x (80 + 2 x 1500) = 3080
      pool     = 2 blocks x 0.5 MiB x 55 us                         = 55
      busy     = 24 own tokens x 45 us + the load                   = 1135
      imposed  = busy x (2 / 4 of the decodes)                      = 567.5
    (the engine's step waits for the load as for the compute: both delay what runs there)"""
    r = router("quillcache", workers=("w0", "w1"))
    h = chain_hashes(toks(12), BS)
    r.indexer.add_blocks("w0", A, h[:4], DEVICE)
    r.indexer.add_blocks("node", A, h[:6], POOL)
    set_load(r, "w0", 1000, 1, 3)
    set_load(r, "w1", 10**6, 1, 3)
    d = r.route(A, hashes=h, request_tokens=48, track=False)
    assert d.worker == "w0" and d.overlap == (4, 0, 0, 2)
    assert d.predicted_ttft_us == pytest.approx(46080 + 3080 + 55)
    # the score adds the imposed slowdown and the wait it adds for the queue behind (mean 1)
    assert d.logits["w0"] == pytest.approx(46080 + 3080 + 55 + 567.5 + 1135 * 1.0)


def test_pool_over_a_link_slower_than_recompute_is_not_credited():
    slow = us_per_mib(4.5e6)                                  # 4.5 MB/s: far slower than computing
    r = router("quillcache", workers=("w0",), pool_us_per_mb=slow)
    h = chain_hashes(toks(6), BS)
    r.indexer.add_blocks("node", A, h, POOL)
    d = r.route(A, hashes=h, request_tokens=24, track=False)
    assert d.overlap[3] == 0 and d.plan_names() == ["recompute"] * 6


def test_pool_lets_the_idle_worker_take_the_hot_prefix():
    r = router("quillcache", workers=("w0", "w1"))
    h = chain_hashes(toks(16), BS)
    r.indexer.add_blocks("w0", A, h, DEVICE)
    set_load(r, "w0", 30, 1, 1)                 # w0: (30 + 4) x 45 us = 1530 us
    d = r.route(A, hashes=h, request_tokens=64, track=False)
    assert d.worker == "w0"                     # w1 would recompute 64 tokens: 2880 us
    r.indexer.add_blocks("node", A, h, POOL)    # with the pool, w1: 4 x 45 + 15 x 0.5 MiB x 55 = 592 us
    d = r.route(A, hashes=h, request_tokens=64, track=False)
    assert d.worker == "w1" and d.plan_names() == ["pool"] * 15 + ["recompute"]


def doc_and(*tails):
    """A 16-block document, then one block per tail (a question, a turn)."""
    return chain_hashes(toks(16) + [t for tail in tails for t in [1000 + tail] * BS], BS)


def test_a_prefix_requests_branch_from_leaves_its_holder_as_without_a_pool():
    """w0 holds a 16-block document on its device behind 30 queued tokens (w0: (30 + 4) x 45 =
    1530 us for a request of the document and one block more); the pool holds it too (w1: 4 x
    45 + 16 x 0.5 MiB x 55 us = 620 us).  While no arrival has branched from the document, a
    request follows the pool to w1, as a private context would.  Once an arrival went on from it
    with another block (a second question on the same document), whether to leave w0 is decided
    without the pool: w1 would recompute 68 tokens (3060 us), so it stays."""
    r = router("quillcache", workers=("w0", "w1"))
    r.indexer.add_blocks("w0", A, doc_and()[:16], DEVICE)
    r.indexer.add_blocks("node", A, doc_and()[:16], POOL)
    set_load(r, "w0", 30, 1, 1)
    q1 = doc_and(1)
    d = r.route(A, hashes=q1, request_tokens=68, track=False)
    assert d.worker == "w1" and d.plan_names() == ["pool"] * 16 + ["recompute"]
    r.route(A, hashes=doc_and(2), request_tokens=68, track=False)      # a probe records nothing
    assert r.route(A, hashes=q1, request_tokens=68, track=False).worker == "w1"
    r.route(A, hashes=doc_and(2), request_tokens=68, candidates=["w1"], request_id="q2")  # tracked: it branched off
    r.free("q2")                                                        # (and holds nothing on w1 now)
    set_load(r, "w0", 30, 1, 1)
    set_load(r, "w1", 0, 0, 0)
    d = r.route(A, hashes=q1, request_tokens=68, track=False)
    assert d.worker == "w0" and d.plan_names() == ["device"] * 16 + ["recompute"]
    assert d.predicted_ttft_us == pytest.approx(1530) and d.logits["w1"] > d.logits["w0"]
    # a continuation of the arrival's own chain (its next turn) is no branch: it follows the pool
    d = r.route(A, hashes=doc_and(2, 3), request_tokens=72, track=False)
    assert d.worker == "w1" and d.plan_names() == ["pool"] * 16 + ["recompute"] * 2
    # behind 200 queued tokens it leaves even without the pool (the spread of a hot prefix), and
    # the pool makes the move a load
    set_load(r, "w0", 200, 1, 1)
    d = r.route(A, hashes=q1, request_tokens=68, track=False)
    assert d.worker == "w1" and d.plan_names() == ["pool"] * 16 + ["recompute"]
    assert d.predicted_ttft_us == pytest.approx(620)


def test_another_tenants_branches_say_nothing_of_a_prefix():
    """Tenant B's requests branch from the same document under B's identity (B's own copy on
    w0): A's request still follows the pool, as if B had sent nothing."""
    r = router("quillcache", workers=("w0", "w1"))
    for scope in (A, B):
        r.indexer.add_blocks("w0", scope, doc_and()[:16], DEVICE)
        r.indexer.add_blocks("node", scope, doc_and()[:16], POOL)
    for tail in (1, 2, 3):
        r.route(B, hashes=doc_and(tail), request_tokens=68, candidates=["w1"], request_id=f"b{tail}")
        r.free(f"b{tail}")
    set_load(r, "w0", 30, 1, 1)
    set_load(r, "w1", 0, 0, 0)
    assert r.route(B, hashes=doc_and(4), request_tokens=68, track=False).worker == "w0"   # B's own: branched
    d = r.route(A, hashes=doc_and(4), request_tokens=68, track=False)
    assert d.worker == "w1" and d.plan_names() == ["pool"] * 16 + ["recompute"]


def test_branch_points_over_a_window():
    b = BranchPoints(window=3)
    assert not b.branched("p", "x")                      # nothing seen
    b.add("p", "x")
    assert not b.branched("p", "x") and b.branched("p", "y")
    assert b.branched("p", None)                         # ending at the prefix: unlike any other
    b.add("q", None)
    assert b.branched("q", "x") and b.branched("q", None)
    b.add(None, None)                                    # an arrival that reused nothing
    assert b.branched("p", "y")
    b.add(None, None)                                    # "p" leaves the window of 3
    assert not b.branched("p", "y") and b.branched("q", "x")
    b.add("q", "x")
    b.add("q", "x")                                      # "q"'s None has left: only x now
    assert not b.branched("q", "x") and b.branched("q", "y")
    assert b._next == {"q": {"x": 2}}                    # nothing outlives the window
    with pytest.raises(ValueError, match="BranchPoints"):
        BranchPoints(window=0)


def test_a_hot_prefix_spreads_when_the_holder_queue_exceeds_recomputing_it():
    r = router("quillcache", workers=("w0", "w1"))
    h = chain_hashes(toks(16), BS)
    r.indexer.add_blocks("w0", A, h, DEVICE)
    set_load(r, "w0", 30, 1, 1)                 # 30 tokens queued < 60 to recompute: stay
    assert r.route(A, hashes=h, request_tokens=64, track=False).worker == "w0"
    set_load(r, "w0", 200, 1, 1)                # 200 queued > 60: the prefix spreads to w1
    d = r.route(A, hashes=h, request_tokens=64, request_id="spread")
    assert d.worker == "w1" and d.plan_names() == ["recompute"] * 16
    r.first_token("spread")
    r.indexer.add_blocks("w1", A, h, DEVICE)    # w1's events: it now holds the prefix too
    m = r.find_matches(A, h)
    assert m.as_dict()["w0"][0] == 16 and m.as_dict()["w1"][0] == 16
    set_load(r, "w0", 0, 0, 0)
    set_load(r, "w1", 0, 0, 0)
    # later requests, each computing 10 blocks past the shared 16, use both holders
    longer = chain_hashes(toks(26), BS)
    assert longer[:16] == h
    chosen = [r.route(A, hashes=longer, request_tokens=104, request_id=f"q{i}").worker for i in range(6)]
    assert set(chosen) == {"w0", "w1"}


def test_under_load_the_queue_stretch_keeps_a_request_with_its_prefix():
    """w0 holds all 16 blocks of the request behind Q = 150 queued tokens; w1 is idle and would
    recompute all 64 tokens; w2 and w3 are far behind.  No decodes, pages unknown, no device
    share yet: score = TTFT + busy x mean prefill queue (3 of 4 workers x 1 request = 0.75)
    x stretch.  w0: 45 x (150 + 4) + 45 x 4 x 0.75 x s; w1: 45 x 64 + 45 x 64 x 0.75 x s.
    w1 wins when 45 x 150 > 2,700 + 2,025 x s: at s = 1 (no load seen yet), not at s = 4
    (a busy share of 0.75 or more: every later arrival waits that much longer behind the
    2,880 us w1 would add)."""
    h = chain_hashes(toks(16), BS)
    r = router("quillcache", workers=("w0", "w1", "w2", "w3"))
    r.indexer.add_blocks("w0", A, h, DEVICE)
    set_load(r, "w0", 150, 1, 1)
    set_load(r, "w2", 10_000, 1, 1)
    set_load(r, "w3", 10_000, 1, 1)
    assert r.busy.stretch(4) == 1.0
    assert r.route(A, hashes=h, request_tokens=64, track=False).worker == "w1"
    for _ in range(256):
        r.busy.add(4, 4)                        # every worker busy at every recent arrival
    assert r.busy.stretch(4) == 4.0             # rho capped at 1 - 1/4
    d = r.route(A, hashes=h, request_tokens=64, track=False)
    assert d.worker == "w0" and d.plan_names() == ["device"] * 16


def test_busy_share_is_the_mean_share_of_workers_in_prefill_over_its_window():
    b = BusyShare(window=4)
    assert b.value() == 0.0 and b.stretch(8) == 1.0
    for busy, workers in ((1, 2), (2, 2), (0, 2), (2, 2)):
        b.add(busy, workers)
    assert b.value() == 5 / 8
    b.add(0, 4)                                 # the oldest, (1, 2), leaves the window
    assert b.value() == 4 / 10
    assert b.stretch(10) == pytest.approx(1 / 0.6)
    full = BusyShare(window=4)
    full.add(9, 10)
    assert full.stretch(10) == pytest.approx(10.0) and full.stretch(2) == 2.0   # rho capped at 1 - 1/k
    assert full.stretch(1) == 1.0               # one worker: the cap leaves it 1
    for _ in range(10_000):                     # integer sums: no drift
        b.add(1, 3)
    assert b.value() == 1 / 3
    with pytest.raises(ValueError, match="BusyShare"):
        b.add(4, 3)
    with pytest.raises(ValueError, match="BusyShare"):
        BusyShare(window=0)


def test_busy_share_is_saturated_only_when_no_arrival_of_a_full_window_found_a_worker_free():
    b = BusyShare(window=4)
    assert not b.saturated()                    # no decision yet
    for _ in range(3):
        b.add(3, 3)
    assert not b.saturated()                    # every worker busy, but not yet a full window
    b.add(3, 3)
    assert b.saturated() and b.value() == 1.0
    b.add(2, 3)                                 # one arrival found a worker free
    assert not b.saturated()
    for _ in range(3):
        b.add(3, 3)
    assert not b.saturated()                    # it is still in the window
    b.add(3, 3)
    assert b.saturated()                        # and now it has left it


def test_the_router_measures_the_busy_share_each_tracked_arrival_sees():
    h = chain_hashes(toks(2), BS)
    r = router("quillcache", workers=("w0", "w1", "w2", "w3"))
    for name in ("w0", "w1", "w2"):
        set_load(r, name, 100, 1, 1)
    for i in range(3):
        r.route(A, hashes=h, request_tokens=8, request_id=f"q{i}")
        r.free(f"q{i}")                         # back to 3 of 4 for the next arrival
    assert r.busy.value() == 0.75               # what each saw before it was placed
    set_load(r, "w3", 100, 1, 1)
    r.route(A, hashes=h, request_tokens=8, track=False)
    assert r.busy.value() == 0.75               # a probe is not an arrival (it would see 4 of 4)
    r.route(A, hashes=h, request_tokens=8, request_id="q3")
    assert r.busy.value() == 1.0 * (3 * 0.75 + 1) / 4


def test_demand_share_counts_where_arrivals_would_go_for_their_cache():
    d = DemandShare(window=4)
    slots = np.array([0, 1, 2, 3])
    excess, saved = d.excess(slots, beyond_chance=False)
    assert excess.tolist() == [0.0] * 4 and saved.tolist() == [0.0] * 4
    d.add(slots, np.array([5, 5, 1, 0]), block_us=10.0)     # prefers slots 0 and 1: 4 blocks past the next
    d.add(slots, np.array([2, 2, 2, 2]), block_us=10.0)     # the same everywhere: prefers none
    d.add(slots, np.array([0, 0, 3, 0]), block_us=10.0)     # prefers slot 2: 3 blocks past the next
    d.add(slots, np.array([9, 0, 0, 0]), block_us=10.0)
    # demand: slot 0 = 1/2 + 1 + 1/4, slot 1 = 1/2 + 1/4, slot 2 = 1 + 1/4, slot 3 = 1/4 (of 4)
    excess, saved = d.excess(slots, beyond_chance=False)
    assert excess == pytest.approx([0.75, 0.0, 0.25, 0.0])
    assert saved == pytest.approx([(20 + 90) / 1.5, 40.0, 30.0, 0.0])   # the mean over those preferring it
    d.add(slots, np.array([0, 0, 0, 0]), block_us=10.0)     # the first, (5, 5, 1, 0), leaves the window
    excess, saved = d.excess(slots, beyond_chance=False)                         # slots 0 and 2: 1 + 2/4 each, of 4
    assert excess == pytest.approx([0.5, 0.0, 0.5, 0.0]) and saved == pytest.approx([90.0, 0.0, 30.0, 0.0])
    # over a subset of the workers, against an even spread over that subset: 1 + 2/2 and 0 + 2/2
    assert d.excess(np.array([0, 3]), beyond_chance=False)[0] == pytest.approx([2 * 2 / 3 - 1.0, 0.0])
    # until the window fills, the arrivals it has not seen count as preferring none
    young = DemandShare(window=100)
    young.add(slots, np.array([1, 0, 0, 0]), block_us=1.0)
    assert young.excess(slots, beyond_chance=False)[0] == pytest.approx([4 * (1 + 99 / 4) / 100 - 1.0, 0.0, 0.0, 0.0])
    for i in range(10_000):                                 # recomputed once per window: no drift
        d.add(slots, np.array([1, 1, 1, 0]) if i % 3 else np.array([2, 0, 0, 0]), block_us=7.0)
    want = DemandShare(window=4)
    for i in range(9_996, 10_000):
        want.add(slots, np.array([1, 1, 1, 0]) if i % 3 else np.array([2, 0, 0, 0]), block_us=7.0)
    assert d.excess(slots, beyond_chance=False)[0] == pytest.approx(
        want.excess(slots, beyond_chance=False)[0], rel=1e-12, abs=1e-12)
    d.add(np.array([0, 70]), np.array([0, 4]), block_us=1.0)   # slots past those seen: the sums grow
    assert d.excess(np.array([0, 70]), beyond_chance=False)[1][1] == 4.0
    with pytest.raises(ValueError, match="DemandShare"):
        d.add(slots, np.array([1, 2]), block_us=1.0)
    with pytest.raises(ValueError, match="DemandShare"):
        d.add(slots, np.array([1, 2, 3, 4]), block_us=float("nan"))
    with pytest.raises(ValueError, match="DemandShare"):
        DemandShare(window=0)


def test_demand_past_chance_only_protects_a_worker():
    """An even spread of 256 arrivals over 8 workers still leaves some above the mean: the
    busiest shows Blom's expected maximum of 8 standard normals (1.473) times a worker's relative
    standard deviation (sqrt(7 / 256)) on average.  That much is taken off each worker's excess."""
    assert chance(8, 256) == pytest.approx(NormalDist().inv_cdf(7.625 / 8.25) * math.sqrt(7 / 256))
    assert 0.23 < chance(8, 256) < 0.25 and chance(1, 256) == 0.0 and chance(2, 256) < chance(8, 256)
    rng = np.random.default_rng(7)
    slots = np.arange(8)
    busiest = []
    for _ in range(200):                    # arrivals each preferring one worker, picked at random
        d = DemandShare(window=256)
        for w in rng.integers(0, 8, 256):
            dev = np.zeros(8, np.int64)
            dev[w] = 3
            d.add(slots, dev, block_us=1.0)
        busiest.append(d.excess(slots, beyond_chance=False)[0].max())
        assert d.excess(slots)[0].max() <= max(busiest[-1] - chance(8, 256), 0.0) + 1e-12
    assert np.mean(busiest) == pytest.approx(chance(8, 256), rel=0.1)   # what chance alone shows
    # a worker that draws twice an even share keeps all but chance's part of its excess
    d = DemandShare(window=256)
    for i in range(256):
        dev = np.zeros(8, np.int64)
        dev[0 if i % 4 == 0 else 1 + i % 7] = 3
        d.add(slots, dev, block_us=1.0)
    raw = d.excess(slots, beyond_chance=False)[0]
    assert raw[0] == pytest.approx(1.0) and d.excess(slots)[0][0] == pytest.approx(1.0 - chance(8, 256))


def test_a_long_request_keeps_off_the_worker_many_arrivals_need_for_their_prefix():
    """256 arrivals of a hot 4-block prefix held on w0 (each placed and done before the next:
    no queue, busy share 0, stretch 1) make w0's demand 2 x an even spread's: excess 1, and
    each saves 4 blocks x 4 tokens x 45 us = 720 us there.  Then a 40-block request cached
    nowhere, behind one queued request on each worker (mean prefill queue 1), 100 queued
    tokens on w0 and 110 on w1.  No decodes, no pages known: the terms other than the queue,
    the wait behind and the excess are the same on both.
    Past chance (``chance(2, 256)``: 256 arrivals spread evenly over two workers show ~0.037 of
    excess on the busier) w0's excess is 1 - 0.037.
    w0: 45 x (100 + 160) + 7,200 x 1 + min(7,200, 720) x 1 x (1 - 0.037); w1: 45 x (110 + 160)
    + 7,200 x 1.  w1 scores ~243 us less: without the excess, w0 would by 450 (its shorter queue)."""
    hot = chain_hashes(toks(4), BS)
    r = router("quillcache", workers=("w0", "w1"))
    r.indexer.add_blocks("w0", A, hot, DEVICE)
    for i in range(256):
        d = r.route(A, hashes=hot, request_tokens=16, request_id=f"h{i}")
        assert d.worker == "w0"
        r.first_token(f"h{i}")
        r.free(f"h{i}")
    assert r.busy.value() == 0.0
    set_load(r, "w0", 100, 1, 1)
    set_load(r, "w1", 110, 1, 1)
    long = chain_hashes(toks(40, salt=9), BS)
    d = r.route(A, hashes=long, request_tokens=160, track=False)
    assert d.worker == "w1"
    assert d.logits["w0"] - d.logits["w1"] == pytest.approx(720 * (1 - chance(2, 256)) - 450)
    assert d.predicted_ttft_us == pytest.approx(45 * 270)
    # the hot prefix's own arrivals still go to w0: each adds only its last block there
    assert r.route(A, hashes=hot, request_tokens=16, track=False).worker == "w0"
    # a probe is not an arrival: the demand is as it was
    before = r.route(A, hashes=long, request_tokens=160, track=False).logits
    assert r.route(A, hashes=long, request_tokens=160, track=False).logits == before


def test_admission_refuses_what_is_predicted_to_miss_k_times_the_slo():
    h = chain_hashes(toks(4), BS)
    for admission, admitted in (("off", True), ("predict", False)):
        r = router("quillcache", workers=("w0",), admission=admission, admission_k=2.0, slo_ttft_ms=100)
        set_load(r, "w0", 5000, 5, 5)           # 5000 x 45 us = 225 ms > 2 x 100 ms
        d = r.route(A, hashes=h, request_tokens=16, request_id="x")
        assert d.admitted is admitted and d.predicted_ttft_us > 200_000
        assert r.load("w0").active_requests == (6 if admitted else 5)
    r = router("quillcache", workers=("w0",), admission="predict", admission_k=3.0, slo_ttft_ms=100)
    set_load(r, "w0", 5000, 5, 5)               # 225 ms < 3 x 100 ms: admitted
    assert r.route(A, hashes=h, request_tokens=16, track=False).admitted
    with pytest.raises(ValueError, match="admission"):
        RouterConfig(admission="maybe")


def _trace(n, seed=1):
    """Conversations over a shared system prompt: each turn extends its conversation."""
    rng = np.random.default_rng(seed)
    out, convs, nid = [], [], 1000
    for i in range(n):
        if not convs or rng.random() < 0.3:
            convs.append([0, 1])
        c = convs[int(rng.integers(len(convs)))]
        c.extend(range(nid, nid + 2))
        nid += 2
        out.append(TraceRequest(i, i * 50.0, 512 * len(c), 64, tuple(c)))
    return out


def _engine(capacity_blocks=64):
    return EngineConfig(block_size=512, capacity_blocks=capacity_blocks, max_num_seqs=64,
                        max_batched_tokens=8192, cost=H200_LLAMA3_8B)


def test_four_tenants_quillcache_credits_no_cross_identity_block():
    reqs = build_requests(assign_tenants(_trace(300), 4, seed=5), speedup=1.0)
    assert len({r.scope for r in reqs}) == 4
    blind = run_policy(reqs, "dynamo", 4, _engine(512))
    ours = run_policy(reqs, "quillcache", 4, _engine(512))
    assert blind.cross_identity_credited_blocks > 0          # the shared prompt, other tenants'
    assert ours.cross_identity_credited_blocks == 0
    assert ours.cross_identity_served_blocks == 0


def test_replay_with_a_pool_loads_prefixes_for_every_policy_and_tells_the_router():
    reqs = build_requests(_trace(200), speedup=1.0)
    for policy in ("round_robin", "quillcache"):
        res = run_policy(reqs, policy, 4, _engine(24), pool_blocks=4096)
        assert res.pool_tokens > 0, policy
    none = run_policy(reqs, "quillcache", 4, _engine(24))
    assert none.pool_tokens == 0
    pooled = run_policy(reqs, "quillcache", 4, _engine(24), pool_blocks=4096)
    assert pooled.hit_tokens + pooled.pool_tokens > none.hit_tokens


def test_a_decision_looks_up_only_the_request_blocks_whatever_the_index_holds():
    """The decision's work is per request block and per worker: the keys it asks the tree for
    do not grow with the blocks indexed (10k or 160k here; the bench runs 1M)."""
    looked = []
    for total in (10_000, 160_000):
        idx = ArtIndexer()
        r = Router(RouterConfig(policy="quillcache", block_size=BS, seed=0), idx,
                   [f"w{i}" for i in range(64)])
        per = total // 64
        for w in range(64):
            idx.add_blocks(f"w{w}", A, list(range(w * per, (w + 1) * per)), DEVICE)
        assert len(idx) == 64 * per
        before = idx.lookups                                  # keys handed to the tree
        q = list(range(5 * per, 5 * per + 128))               # 128 blocks held by w5
        d = r.route(A, hashes=q, request_tokens=128 * BS, track=False)
        assert d.worker == "w5"
        looked.append(idx.lookups - before)
    assert looked[0] == looked[1] == 128
    assert math.isfinite(r.latency_percentile(50))


def test_planned_loads_count_as_queued_work_on_the_chosen_worker():
    """15 pool blocks x 0.5 MiB x 55 us = 412.5 us of loading = 9 tokens of prefill at 45 us:
    the worker's queue is its 4 own tokens plus those 9, not 4 (a worker busy loading is busy)."""
    r = router("quillcache", workers=("w0",))
    h = chain_hashes(toks(16), BS)
    r.indexer.add_blocks("node", A, h, POOL)
    d = r.route(A, hashes=h, request_tokens=64, request_id="a")
    assert d.overlap == (0, 0, 0, 15)
    assert r.load("w0").active_prefill_tokens == 4 + 9
    r.first_token("a")
    assert r.load("w0").active_prefill_tokens == 0


def brute_prediction(r, scope, hashes, n_tokens):
    """The predictor's formula worker by worker, from the indexer's per-tier match and the
    loads, in plain Python (the oracle for the vectorised policy)."""
    cfg, cost = r.config, r.config.cost
    mib = BS * KV / (1 << 20)
    m = r.indexer.find_matches(scope, hashes).as_dict()
    loads = {w: r.load(w) for w in r.workers}
    all_decodes = sum(ld.active_requests - ld.prefill_requests for ld in loads.values())
    mean_queue = sum(ld.prefill_requests for ld in loads.values()) / len(loads)
    limit = (n_tokens - 1) // BS
    out = {}
    for w, ld in loads.items():
        dev, host, disk, pool, _ = m[w]
        pool_us = cost.cpu_dram_us_per_mb * mib
        pool = min(pool, max(limit - dev - host - disk, 0)) if pool_us < BS * cost.prefill_us_per_token else 0
        reuse = min(dev + host + disk + pool, limit)
        own = n_tokens - reuse * BS
        work = ld.active_prefill_tokens + own
        decodes = ld.active_requests - ld.prefill_requests
        per_iter = cost.decode_us_per_token + cost.running_decode_penalty_us * decodes if decodes else 0
        iters = math.ceil(work / max(cfg.batch_tokens - decodes, 1))
        load = mib * (host * cost.cpu_dram_us_per_mb + disk * cost.local_ssd_us_per_mb) + pool * pool_us
        ttft = cost.prefill_us_per_token * work + iters * per_iter + load
        busy = cost.prefill_us_per_token * own + load
        imposed = busy * (decodes / all_decodes if all_decodes else 0)
        out[w] = ttft + imposed + busy * mean_queue
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 3), st.integers(0, 6),
                          st.integers(1, 8)), max_size=20),
       st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 4), st.integers(0, 6)), min_size=3, max_size=3),
       st.integers(1, 10), st.integers(0, 3))
def test_quillcache_scores_match_a_brute_force_predictor(places, loads, qlen, extra_tokens):
    r = router("quillcache")
    chain = chain_hashes(toks(10), BS)
    other = IdentityScope("m", "t", None, "globex")
    for w, s, tier, start, n in places:
        worker = "node" if w == 3 else f"w{w}"
        r.indexer.add_blocks(worker, (A, other)[s], chain[start:start + n], POOL if w == 3 else min(tier, 2))
    for name, (tokens_q, pre, extra) in zip(("w0", "w1", "w2"), loads):
        set_load(r, name, tokens_q, pre, pre + extra)
    n_tokens = qlen * BS + extra_tokens
    d = r.route(A, hashes=chain[:qlen], request_tokens=n_tokens, track=False)
    assert d.logits == pytest.approx(brute_prediction(r, A, chain[:qlen], n_tokens))
    assert d.logits[d.worker] == min(d.logits.values())
    assert d.cross_identity_credited_blocks == 0


def queued_case(queues, **kw):
    """A quillcache router, SLO 800 ms, 45 us a token, no decodes, whose workers have ``queues``
    (name -> prefill tokens queued, one request each), and a 5,000-block chain to route."""
    r = router("quillcache", workers=tuple(queues), slo_ttft_ms=800.0, **kw)
    for name, tokens in queues.items():
        set_load(r, name, tokens, 1, 1)
    return r, chain_hashes(toks(5000), BS)


def doomed_case(**kw):
    """Queues: w0 30,000 tokens (1.35 s), w1 25,000 (1.125 s), w2 10,000 (0.45 s); mean wait
    0.975 s, so 1.2 x the mean is 1.17 s.  The request: 20,000 tokens (0.9 s of its own work)."""
    return queued_case({"w0": 30_000, "w1": 25_000, "w2": 10_000}, **kw)


def doomed_case_with_w3():
    """``doomed_case`` and w3 with 40,000 tokens queued (1.8 s): the mean wait is 1.18 s, so
    w1's queue (1.125 s) is past the SLO and within the mean."""
    return queued_case({"w0": 30_000, "w1": 25_000, "w2": 10_000, "w3": 40_000})


def test_a_request_doomed_everywhere_goes_where_the_queue_already_misses_the_slo():
    # w2 is its fastest worker (0.45 + 0.9 s) but still past 0.8 s: it would only take w2's
    # capacity from requests that can meet theirs.  Add w3, 40,000 tokens queued (1.8 s): the
    # mean wait is 1.18 s, and w1's queue (1.125 s) alone misses the SLO within that mean.
    r, h = doomed_case_with_w3()
    d = r.route(A, hashes=h, request_tokens=20_000, track=False)
    assert d.worker == "w1"
    assert d.predicted_ttft_us == pytest.approx(45 * 45_000)
    assert all(math.isfinite(v) for v in d.logits.values())
    # without goodput placement it takes its fastest worker
    r, h = doomed_case(goodput_placement=False)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w2"
    # a request that can meet the SLO on w2 takes w2
    r, h = doomed_case()
    small = chain_hashes(toks(100), BS)
    assert r.route(A, hashes=small, request_tokens=400, track=False).worker == "w2"
    # the only queue past the SLO is w0's, 1.35 s against a mean of 0.75 s (1.2 x: 0.9 s): sending
    # it there would make it wait 80 % longer than an even spread; it takes its fastest worker
    r, h = doomed_case()
    set_load(r, "w1", 10_000, 1, 1)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker in ("w1", "w2")


def test_a_doomed_request_waits_past_the_mean_only_where_it_does_not_become_the_tail():
    # w1's queue (1.125 s) is past the mean (0.975 s) but within 1.2 x it; the request would
    # finish its prefill there at 2.025 s.  Once the router has placed 100 requests, that is
    # allowed only under the p99 of the TTFTs it predicted for them.
    r, h = doomed_case()
    for _ in range(200):
        r.ttft_tail.add(1_500_000.0)
    d = r.route(A, hashes=h, request_tokens=20_000, track=False)
    assert d.worker == "w2" and d.predicted_ttft_us > 800_000      # at w1 it would be the new tail
    r, h = doomed_case()
    for _ in range(200):
        r.ttft_tail.add(3_000_000.0)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w1"
    # before 100 placements there is no p99: a router that has not seen its tail keeps out of it
    r, h = doomed_case()
    for _ in range(99):
        r.ttft_tail.add(3_000_000.0)
    assert r.ttft_tail.value() is None
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w2"
    r.ttft_tail.add(3_000_000.0)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w1"
    # a queue at or under the mean needs no p99: w3 (1.8 s) lifts the mean to 1.18 s
    r, h = doomed_case_with_w3()
    for _ in range(200):
        r.ttft_tail.add(1_500_000.0)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w1"


def saturated_case(w0_tokens=20_000, saturated=True):
    """Queues: w0 20,000 tokens (0.9 s), w1 25,000 (1.125 s), w2 30,000 (1.35 s), w3 40,000
    (1.8 s): every one past the SLO.  The mean wait is 1.294 s, so 1.2 x the mean is 1.553 s.
    ``saturated``: a full window of arrivals found every worker with prefill work."""
    r, h = queued_case({"w0": w0_tokens, "w1": 25_000, "w2": 30_000, "w3": 40_000})
    for _ in range(256):
        r.busy.add(4 if saturated else 3, 4)
    assert r.busy.saturated() == saturated
    return r, h


def test_in_an_overload_a_doomed_request_goes_to_the_fullest_queue_within_the_tail_budget():
    # Not saturated: the best-scored queue past the SLO within the mean (w0, 0.9 s; w1 is
    # 1.125 s), as above.
    r, h = saturated_case(saturated=False)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w0"
    # Saturated, every queue past the SLO: an even spread makes every worker late together.  It
    # goes to the fullest queue within 1.2 x the mean: w2 (1.35 s); w3 (1.8 s) is past it.
    r, h = saturated_case()
    d = r.route(A, hashes=h, request_tokens=20_000, track=False)
    assert d.worker == "w2" and d.predicted_ttft_us == pytest.approx(45 * 50_000)
    # Saturated, but w0's queue (0.45 s) is under the SLO: not every worker is late, and the
    # rule above applies (w1, 1.125 s, the best-scored queue past the SLO within the mean).
    r, h = saturated_case(w0_tokens=10_000)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w1"
    # Saturated, a prefix it holds on w0's device: its own work elsewhere is more than twice
    # its work on w0, so it stays with its holder.
    r, h = saturated_case()
    r.indexer.add_blocks("w0", A, h[:4000], DEVICE)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w0"
    # Without goodput placement, its fastest worker
    r, h = saturated_case()
    r.config = dataclasses.replace(r.config, goodput_placement=False)
    assert r.route(A, hashes=h, request_tokens=20_000, track=False).worker == "w0"


def test_goodput_placement_never_turns_an_admitted_request_into_a_refused_one():
    # saturated_case with a 10,000-token request (0.45 s of its own work): 1.35 s on w0, 1.575
    # on w1, 1.8 on w2, 2.25 on w3.  Gathered, it goes to w2, the fullest queue within 1.2 x the
    # mean (1.553 s).  With admission at k = 2 (1.6 s) it is admissible on its best worker, w0,
    # so it is gathered only among the workers where it stays within 1.6 s: w1, admitted.
    r, h = saturated_case()
    assert r.route(A, hashes=h[:2500], request_tokens=10_000, track=False).worker == "w2"
    r, h = saturated_case()
    r.config = dataclasses.replace(r.config, admission="predict", admission_k=2.0)
    d = r.route(A, hashes=h[:2500], request_tokens=10_000, track=False)
    assert d.worker == "w1" and d.admitted and d.predicted_ttft_us == pytest.approx(45 * 35_000)
    # At k = 1.4 (1.12 s) it is past the limit even on w0: refused, and the refusal reports its
    # TTFT on its best worker (1.35 s), not on the fullest queue
    r, h = saturated_case()
    r.config = dataclasses.replace(r.config, admission="predict", admission_k=1.4)
    d = r.route(A, hashes=h[:2500], request_tokens=10_000, track=False)
    assert not d.admitted and d.worker == "w0" and d.predicted_ttft_us == pytest.approx(45 * 30_000)


def test_the_router_counts_the_ttft_it_predicted_for_each_request_it_places():
    r, h = doomed_case()
    small = chain_hashes(toks(100), BS)
    predicted = []
    for i in range(120):
        d = r.route(A, hashes=small, request_tokens=400, request_id=f"q{i}")
        predicted.append(d.predicted_ttft_us)
        r.free(f"q{i}")
    r.route(A, hashes=small, request_tokens=400, track=False)     # not placed: not counted
    assert r.ttft_tail.value() == pytest.approx(float(np.quantile(predicted, 0.99)))


def test_tail_quantile_is_bounded_and_checks_its_arguments():
    t = TailQuantile(0.99, window=200)
    for v in range(1000):
        t.add(float(v))
    assert t.value() == pytest.approx(float(np.quantile(np.arange(800, 1000, dtype=float), 0.99)))
    assert len(t._buf) == 200
    # recomputed once 1/128 of what it holds is new: at 1,024 values, every 8
    t = TailQuantile(0.5, window=1024)
    for _ in range(1024):
        t.add(1.0)
    assert t.value() == 1.0
    seen = []
    for _ in range(520):
        t.add(5.0)
        seen.append(t.value())
    assert seen[511] == pytest.approx(3.0)           # 512 of 1,024 are 5.0: computed at this add
    assert seen[518] == pytest.approx(3.0)           # 519 are (the median is 5.0): not recomputed yet
    assert seen[519] == 5.0
    for bad in ((0.0, 10), (1.0, 10), (0.5, 0)):
        with pytest.raises(ValueError, match="TailQuantile"):
            TailQuantile(*bad)


def test_a_doomed_request_is_not_moved_where_it_costs_more_than_twice_its_own_work():
    # w2 holds 3,000 of its 5,000 blocks: 8,000 tokens of its own there (0.36 s; 0.81 s with the
    # queue: doomed), 20,000 on w1 (0.9 s).  Moving it would add 0.54 s of work to spare w2
    # 0.36 s: it stays.
    r, h = doomed_case()
    r.indexer.add_blocks("w2", A, h[:3000], DEVICE)
    d = r.route(A, hashes=h, request_tokens=20_000, track=False)
    assert d.worker == "w2" and d.predicted_ttft_us > 800_000


def test_a_request_waits_on_a_worker_whose_kv_memory_it_does_not_fit_until_pages_free():
    """Engines of 40 KV pages, 45 us a prefill token, decode iterations of 80 us + 1,500 us per
    running decode.  w0: two requests decoding 1,000 tokens each (12 and 20 blocks: 32 pages),
    iterations of 80 + 2 x 1,500 = 3,080 us, each on average half-way: they end in 1.54 s.
    w1: one request of 30 blocks (120 tokens) in prefill, 5,400 us of compute.  The request is
    10 blocks (40 tokens).  On w0 it needs 10 pages, 32 + 10 > 40: it starts when a decode
    ends, 1.54 s.  On w1 30 + 10 <= 40 fits: 5,400 + 1,800 = 7,200 us.  Without the memory
    term w0 wins (1,800 + one decode iteration 3,080 = 4,880 us, +1,800 for the two decodes it
    delays, +900 for the mean prefill queue 0.5, against w1's 7,200 + 900)."""
    def case(**kw):
        r = router("quillcache", workers=("w0", "w1"), **kw)
        r.route(A, hashes=chain_hashes(toks(12, salt=1), BS), request_tokens=48, request_id="a",
                candidates=["w0"], decode_tokens=1000)
        r.route(A, hashes=chain_hashes(toks(20, salt=2), BS), request_tokens=80, request_id="a2",
                candidates=["w0"], decode_tokens=1000)
        r.first_token("a"), r.first_token("a2")
        r.route(A, hashes=chain_hashes(toks(30, salt=3), BS), request_tokens=120, request_id="b",
                candidates=["w1"], decode_tokens=1)
        return r
    h = chain_hashes(toks(10), BS)
    d = case().route(A, hashes=h, request_tokens=40, track=False)           # memory not known
    assert d.worker == "w0" and d.predicted_ttft_us == pytest.approx(4880)
    r = case(kv_blocks=40)
    assert r.load("w0").pages == 32 and r.load("w1").pages == 30
    d = r.route(A, hashes=h, request_tokens=40, track=False)
    assert d.worker == "w1" and d.predicted_ttft_us == pytest.approx(7200)
    assert d.logits["w0"] > 1.54e6
    # once "a" ends, w0 has 20 pages held: it fits there at once
    r.free("a")
    assert r.route(A, hashes=h, request_tokens=40, track=False).worker == "w0"


def test_page_wait_plays_the_engine_admission_forward():
    """10 pages, 1 us a prefill token, 100 us a decode iteration.  In flight: one decoding
    (10 tokens, 4 blocks: ends at 10 x 100 / 2 = 500 us) and one in prefill (1,000 tokens, 20
    to decode, 6 blocks: admitted now into the 6 free pages, computed by 1,000 us, ends at
    3,000 us)."""
    reqs = [(False, 0, 10, 4), (True, 1000, 20, 6)]
    # 3 pages: free when the decode ends, but the compute before it is done only at 1,000 us
    assert page_wait_us(reqs, 3, 10, 10, 1.0, 100.0) == 1000
    # 5 pages: the first end frees 4, it waits for the second
    assert page_wait_us(reqs, 5, 10, 10, 1.0, 100.0) == 3000
    # the engine holds 5 pages for their 10 blocks (shared ones): each frees half its blocks
    assert page_wait_us(reqs, 5, 10, 5, 1.0, 100.0) == 1000
    # a second request in prefill (8 blocks) waits for both: admitted at 3,000 us, computed by
    # 3,500, ends at 3,500 + 1,000; the request (2 pages) then fits in what it left free
    reqs.append((True, 500, 10, 8))
    assert page_wait_us(reqs, 2, 10, 18, 1.0, 100.0) == 3500
    assert page_wait_us([], 2, 10, 0, 1.0, 100.0) == 0


def test_the_pages_requests_in_flight_hold_count_a_shared_block_once():
    r = router("quillcache", workers=("w0",), kv_blocks=64)
    h = chain_hashes(toks(10), BS)
    r.indexer.add_blocks("w0", A, h[:4], DEVICE)
    r.indexer.add_blocks("node", A, h[:7], POOL)
    d = r.route(A, hashes=h, request_tokens=42, request_id="a")
    assert d.overlap == (4, 0, 0, 3)
    assert r.load("w0").pages == 10 + 1                  # its hits are pinned too; its partial block
    r.first_token("a")
    assert r.load("w0").pages == 11                      # held while it decodes
    r.route(A, hashes=h[:8], request_tokens=32, request_id="b")
    assert r.load("w0").pages == 11                      # its 8 blocks are a's
    r.free("a")
    assert r.load("w0").pages == 8
    r.free("b")
    assert r.load("w0").pages == 0 and not r._pinned


def test_what_a_move_evicts_on_its_new_worker_is_counted_at_the_measured_device_share():
    """w0 holds 8 of the request's 10 blocks behind 50 queued tokens: (50 + 8) x 45 = 2610 us;
    w1 is idle and would recompute all 40 tokens: 1800 us.  Each page it takes evicts a block
    found again at the device share s and recomputed at 4 x 45 = 180 us: w0 takes 2 pages
    (+360 us), w1 10 (+1800 us) and strands w0's copy of 8 blocks (+1440 us).  s = 0: w1;
    s = 1 (every routed block was on the device): w0."""
    def case(share):
        r = router("quillcache", workers=("w0", "w1"))
        h = chain_hashes(toks(10), BS)
        r.indexer.add_blocks("w0", A, h[:8], DEVICE)
        set_load(r, "w0", 50, 0, 0)
        r.stats.request_blocks, r.stats.device_blocks = 100, int(100 * share)
        return r.route(A, hashes=h, request_tokens=40, track=False)
    assert case(0.0).worker == "w1"
    d = case(1.0)
    assert d.worker == "w0"
    assert d.logits["w0"] == pytest.approx(2610 + 2 * 180) and d.logits["w1"] == pytest.approx(1800 + 18 * 180)


def test_a_move_evicts_only_the_pages_past_those_free_where_the_kv_memory_is_known():
    """The case above at s = 1, where w0 won (2970 against 3600), with the engines' KV pages
    known.  64 pages: w1 is empty, its 10 pages evict nothing, 1800 us; w0 holds 8 blocks and
    its 50 queued tokens take 13 more, 43 free, 2610 us: w1.  A request that starts a session
    on an engine with room costs no one a cached block (before, it was charged as if every
    engine were full and new sessions piled onto the engines that held a shared prefix).
    16 pages and w1 holding 14 blocks of another prefix: 2 free, it evicts 8 and strands w0's 8
    (w0 has no page free), 1800 + 16 x 180 = 4680; w0 (8 + 13 > 16) evicts 2, 2970: w0."""
    def case(kv_blocks, w1_blocks=0):
        r = router("quillcache", workers=("w0", "w1"), kv_blocks=kv_blocks)
        h = chain_hashes(toks(10), BS)
        r.indexer.add_blocks("w0", A, h[:8], DEVICE)
        r.indexer.add_blocks("w1", A, chain_hashes(toks(14, salt=9), BS), DEVICE)
        r.indexer.remove_blocks("w1", A, chain_hashes(toks(14, salt=9), BS)[w1_blocks:], DEVICE)
        set_load(r, "w0", 50, 0, 0)
        r.stats.request_blocks, r.stats.device_blocks = 100, 100
        return r.route(A, hashes=h, request_tokens=40, track=False)
    d = case(64)
    assert d.worker == "w1" and d.logits == pytest.approx({"w0": 2610, "w1": 1800})
    d = case(16, w1_blocks=14)
    assert d.worker == "w0" and d.logits == pytest.approx({"w0": 2610 + 2 * 180, "w1": 1800 + 16 * 180})


def test_a_move_is_charged_the_copy_it_strands_on_a_full_holder_and_not_on_one_with_room():
    """w0 holds 8 of the request's 10 blocks behind 50 queued tokens (13 pages to compute):
    2610 us and 2 pages; w1 is empty, 1800 us, and has room for its 10 pages.  Every routed
    block was on the device (s = 1), a block recomputes in 180 us.  32 pages and w0 full (24
    blocks of another prefix beside the 8): the move leaves w0's 8-block copy as the freshest
    in a full cache, to push 8 other blocks out: w1 1800 + 8 x 180 = 3240 against w0's
    2610 + 2 x 180 = 2970, so the request stays with its context.  w0 without the other
    prefix has 11 pages free, the stranded copy evicts nothing there and w0's 2 pages evict
    nothing: w1 1800 against w0 2610, so it moves."""
    def case(other_blocks):
        r = router("quillcache", workers=("w0", "w1"), kv_blocks=32)
        h = chain_hashes(toks(10), BS)
        r.indexer.add_blocks("w0", A, h[:8], DEVICE)
        if other_blocks:
            r.indexer.add_blocks("w0", A, chain_hashes(toks(other_blocks, salt=7), BS), DEVICE)
        set_load(r, "w0", 50, 0, 0)
        r.stats.request_blocks, r.stats.device_blocks = 100, 100
        return r.route(A, hashes=h, request_tokens=40, track=False)
    d = case(24)
    assert d.worker == "w0" and d.logits == pytest.approx({"w0": 2970, "w1": 3240})
    d = case(0)
    assert d.worker == "w1" and d.logits == pytest.approx({"w0": 2610, "w1": 1800})


def test_an_evicted_block_is_priced_as_a_pool_load_at_the_measured_pool_share():
    """w0 holds 8 of the request's 10 blocks behind 30 queued tokens: (30 + 8) x 45 = 1710 us,
    2 pages.  w1 is empty and loads the 8 blocks from the pool (8 x 0.5 MiB x 55 us = 220 us)
    and computes 8 tokens: 580 us, 10 pages, and strands w0's 8.  Half the routed blocks were
    on the device (s = 0.5).  An evicted block costs r: p x 27.5 us (a pool load) + (1 - p)
    x 180 us (a recompute), p the share of blocks not on the device that were loaded from the
    pool.  w0 = 1710 + 0.5 x 2 r, w1 = 580 + 0.5 x 18 r.  p = 0: r = 180, w0 1890, w1 2200, it
    stays; p = 1: r = 27.5, w0 1737.5, w1 827.5, it moves and loads."""
    def case(p):
        r = router("quillcache", workers=("w0", "w1"))
        h = chain_hashes(toks(10), BS)
        r.indexer.add_blocks("w0", A, h[:8], DEVICE)
        r.indexer.add_blocks("node", A, h[:8], POOL)
        set_load(r, "w0", 30, 0, 0)
        r.stats.request_blocks, r.stats.device_blocks, r.stats.pool_blocks = 100, 50, int(50 * p)
        return r.route(A, hashes=h, request_tokens=40, track=False)
    d = case(0.0)
    assert d.worker == "w0" and d.logits == pytest.approx({"w0": 1890, "w1": 2200})
    d = case(1.0)
    assert d.worker == "w1" and d.logits == pytest.approx({"w0": 1737.5, "w1": 827.5})
    assert d.overlap == (0, 0, 0, 8)
    # the router measures the share over the requests it tracks (a probe counts nothing)
    r = router("quillcache", workers=("w1",))
    h = chain_hashes(toks(10), BS)
    r.indexer.add_blocks("node", A, h[:8], POOL)
    r.route(A, hashes=h, request_tokens=40, track=False)
    assert (r.stats.request_blocks, r.stats.pool_blocks) == (0, 0)
    r.route(A, hashes=h, request_tokens=40, request_id="x")
    assert (r.stats.request_blocks, r.stats.device_blocks, r.stats.pool_blocks) == (10, 0, 8)
    assert r.stats.pool_share == pytest.approx(0.8)
    # mooncake's transfer from another instance is no pool load
    r = router("mooncake", workers=("w0", "w1"))
    r.indexer.add_blocks("w0", A, h[:8], DEVICE)
    set_load(r, "w0", 4000, 3, 3)
    d = r.route(A, hashes=h, request_tokens=40, request_id="m")
    assert (d.worker, d.transfer_blocks) == ("w1", 8)
    assert (r.stats.request_blocks, r.stats.pool_blocks) == (10, 0)


def test_a_request_behind_one_in_prefill_is_credited_the_blocks_that_one_computes():
    """Chunks of 16 tokens.  "a" (10 blocks, 40 tokens, nothing cached) is routed to w0 and is
    in prefill: no event shows its blocks yet.  It computes them in chunks of 16, 16 and 8
    tokens; the engine admits the next request in the iteration of the last chunk, so a request
    queued behind it finds its first 8 blocks.  The next turn (12 blocks, 48 tokens, the same
    first 10): on w0, 40 tokens queued + 16 of its own = 2520 us, plus its own 16 tokens x the
    mean prefill queue 0.5 = 360 us; on w1 (idle) 48 x 45 = 2160 us + 1080 us.  Without the
    credit w0 would be 3960 + 1080 us: it would go to w1 and compute the 10 blocks again."""
    r = router("quillcache", workers=("w0", "w1"), batch_tokens=16)
    h = chain_hashes(toks(12), BS)
    r.route(A, hashes=h[:10], request_tokens=40, request_id="a", candidates=["w0"])
    d = r.route(A, hashes=h, request_tokens=48, track=False)
    assert d.worker == "w0" and d.overlap == (8, 0, 0, 0)
    assert d.predicted_ttft_us == pytest.approx(2520)
    assert d.logits == pytest.approx({"w0": 2520 + 360, "w1": 2160 + 1080})
    # another identity's request finds nothing of it
    other = IdentityScope("m", "t", None, "globex")
    assert r.route(other, hashes=h, request_tokens=48, track=False).overlap == (0, 0, 0, 0)
    # past its first token its blocks are the engine's events' to report: no credit is left
    r.first_token("a")
    assert r.route(A, hashes=h, request_tokens=48, track=False).overlap == (0, 0, 0, 0)
    assert not r._ahead


def test_a_wait_for_kv_pages_counts_for_the_requests_behind_it_like_compute():
    """Engines of 40 KV pages, 45 us a prefill token, no decodes.  w0: one request in prefill
    (20 blocks, 80 tokens: 3,600 us) that will decode 100 tokens at 80 us an iteration, so it
    holds its pages until 11,600 us.  w1: 400 tokens queued by four requests, no pages held.  The
    request: 24 blocks (96 tokens, 4,320 us).  On w0 it needs 24 pages, 20 + 24 > 40: it starts at
    11,600 us, 8,000 us after the compute before it is done, TTFT 3,600 + 4,320 + 8,000 = 15,920 us;
    on w1 it fits, TTFT 18,000 + 4,320 = 22,320 us.  The mean prefill queue is (1 + 4) / 2 = 2.5:
    its 4,320 us of compute delay 2.5 requests on either worker, and on w0 so do the 8,000 us
    the engine's queue waits with it (no overtaking): w0 15,920 + 2.5 x 12,320 = 46,720, w1
    22,320 + 2.5 x 4,320 = 33,120."""
    r = router("quillcache", workers=("w0", "w1"), kv_blocks=40)
    r.route(A, hashes=chain_hashes(toks(20, salt=1), BS), request_tokens=80, request_id="a",
            candidates=["w0"], decode_tokens=100)
    set_load(r, "w1", 400, 4, 4)
    d = r.route(A, hashes=chain_hashes(toks(24), BS), request_tokens=96, track=False)
    assert d.worker == "w1" and d.predicted_ttft_us == pytest.approx(22320)
    assert d.logits == pytest.approx({"w0": 46720, "w1": 33120})


def numpy_excess(d: DemandShare, slots: np.ndarray, beyond_chance: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``DemandShare.excess`` as it was written in numpy (the oracle of the native form)."""
    k = len(slots)
    pref, saved = np.zeros(k), np.zeros(k)
    inside = slots < len(d._pref)
    pref[inside] = d._pref[slots[inside]]
    saved[inside] = d._saved[slots[inside]]
    even = d._even + max(0, len(d._ring) - d._n)
    demand = pref + (even / k if k else 0.0)
    total = float(demand.sum())
    if total <= 0.0:
        return np.zeros(k), np.zeros(k)
    noise = chance(k, len(d._ring)) if beyond_chance else 0.0
    return (np.maximum(0.0, demand * (k / total) - 1.0 - noise),
            np.divide(saved, pref, out=np.zeros(k), where=pref > 0.0))


def test_the_native_demand_excess_gives_the_numpy_forms_bits():
    """``DemandShare.excess`` runs natively; ``numpy_excess`` is the form it replaced.  Over
    random windows, candidate subsets (some past every slot seen), both chance settings and an
    empty window, the two give the same bits."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        k_all = int(rng.integers(1, 70))
        d = DemandShare(window=int(rng.integers(1, 300)))
        slots_all = np.arange(k_all)
        for _ in range(int(rng.integers(0, 400))):
            dev = rng.integers(0, 4, k_all) * rng.integers(0, 2, k_all)
            d.add(slots_all, dev, block_us=float(rng.choice([0.0, 7.0, 23_040.0])))
        cand = rng.choice(k_all + 5, size=int(rng.integers(0, k_all + 1)), replace=False).astype(np.intp)
        for beyond in (True, False):
            got, want = d.excess(cand, beyond), numpy_excess(d, cand, beyond)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype == np.float64 and g.shape == w.shape
                assert g.tobytes() == w.tobytes(), (trial, beyond, g, w)
