"""The simulated engine's model: identity-keyed paged prefix cache with LRU eviction,
continuous batching with chunked prefill, timing from the cost model."""
import pytest

from quillcache.control.model import CostModel
from quillcache.control.sim.engine import (
    EngineConfig, LruPool, SimEngine, SimEngineError, SimRequest, chain_hashes, cost_with,
)
from quillcache.model import IdentityScope

A = IdentityScope("m", "tok", None, "tenant-a")
B = IdentityScope("m", "tok", None, "tenant-b")
COST = CostModel(prefill_us_per_token=10, decode_us_per_token=1000, running_decode_penalty_us=100,
                 cpu_dram_us_per_mb=0)


def content(blocks):
    return [b.to_bytes(4, "big") for b in blocks]


def request(rid, scope, blocks, bs, extra_tokens=1, max_tokens=4, arrival=0):
    """A prompt of len(blocks) full blocks (content = the given ids) plus extra tokens."""
    return SimRequest(rid, scope, len(blocks) * bs + extra_tokens, chain_hashes(scope, content(blocks)),
                      max_tokens, arrival, block_tokens=lambda i: [blocks[i]] * bs)


def run(engine, now=0, until=None):
    """Run the engine to idle; returns (end time, every StepResult)."""
    results = []
    while True:
        plan = engine.plan_step(now, until)
        if plan is None:
            return now, results
        res = engine.finish_step()
        now = res.end_us
        results.append(res)


def test_lone_request_timing_follows_the_cost_model():
    eng = SimEngine(EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=8,
                                 max_batched_tokens=1024, cost=COST))
    r = request("r", A, [1, 2, 3], 4, extra_tokens=2, max_tokens=5)
    eng.submit(r)
    run(eng)
    assert r.first_token_us == 14 * 10                      # 14 prompt tokens, one iteration
    # four more tokens, each one decode iteration with one running decode
    assert r.finish_us - r.first_token_us == 4 * (1000 + 100)


def test_a_cached_prefix_is_skipped_for_the_same_identity_only():
    cfg = EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=8, max_batched_tokens=1024, cost=COST)
    eng = SimEngine(cfg)
    first = request("a1", A, [1, 2, 3], 4)
    eng.submit(first)
    now, results = run(eng)
    stored = [blk for res in results for _, _, blocks in res.stored for blk in blocks]
    assert [b.block_hash for b in stored] == list(first.block_hashes)
    assert stored[1].parent_hash == first.block_hashes[0] and stored[0].parent_hash is None
    again = request("a2", A, [1, 2, 3], 4, arrival=now)
    other = request("b1", B, [1, 2, 3], 4, arrival=now)
    eng.submit(again)
    eng.submit(other)
    run(eng, now)
    assert again.hit_blocks == 3
    assert other.hit_blocks == 0               # same tokens, another tenant: recomputed
    assert eng.cross_identity_hits == 0
    assert eng.hit_tokens_total == 12


def test_the_hit_leaves_at_least_one_prompt_token_to_compute():
    eng = SimEngine(EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=8,
                                 max_batched_tokens=1024, cost=COST))
    eng.submit(request("a", A, [1, 2], 4, extra_tokens=0))
    now, _ = run(eng)
    r = request("b", A, [1, 2], 4, extra_tokens=0, arrival=now)
    eng.submit(r)
    run(eng, now)
    assert r.hit_blocks == 1                   # not 2: the last block is computed again
    assert r.first_token_us - now == 4 * 10


def test_lru_eviction_takes_the_least_recent_unreferenced_blocks_and_reports_them():
    cfg = EngineConfig(block_size=4, capacity_blocks=6, max_num_seqs=4, max_batched_tokens=64, cost=COST)
    eng = SimEngine(cfg)
    old = request("old", A, [1, 2], 4, extra_tokens=0, max_tokens=1)     # needs 3 pages
    eng.submit(old)
    now, _ = run(eng)
    mid = request("mid", A, [3, 4], 4, extra_tokens=0, max_tokens=1)
    eng.submit(mid)
    now, _ = run(eng, now)
    assert eng.used_blocks == 4                 # 2 + 2 stored blocks, nothing running
    new = request("new", A, [5, 6], 4, extra_tokens=0, max_tokens=4)    # needs 3 pages: evict 1
    eng.submit(new)
    now, results = run(eng, now)
    removed = [h for res in results for _, h in res.removed]
    assert removed == [old.block_hashes[1]]    # the oldest chain, from its tail
    assert eng.cached_prefix(old.block_hashes) == 1
    assert eng.cached_prefix(mid.block_hashes) == 2


def test_a_request_waits_for_pages_instead_of_preempting():
    cfg = EngineConfig(block_size=4, capacity_blocks=4, max_num_seqs=4, max_batched_tokens=64, cost=COST)
    eng = SimEngine(cfg)
    a = request("a", A, [1], 4, extra_tokens=3, max_tokens=8)       # 15 tokens: 4 pages
    b = request("b", A, [2], 4, extra_tokens=0, max_tokens=1)
    eng.submit(a)
    eng.submit(b)
    run(eng)
    assert b.first_token_us > a.finish_us - 1  # admitted only once a released its pages
    assert eng.used_blocks <= cfg.capacity_blocks


def test_refuses_what_can_never_fit_and_bad_requests():
    eng = SimEngine(EngineConfig(block_size=4, capacity_blocks=4, max_num_seqs=4, max_batched_tokens=64))
    with pytest.raises(SimEngineError, match="need 5 KV blocks"):
        eng.submit(request("big", A, [1, 2, 3, 4], 4, extra_tokens=1, max_tokens=2))
    with pytest.raises(SimEngineError, match="max_tokens"):
        eng.submit(request("zero", A, [1], 4, max_tokens=0))
    with pytest.raises(SimEngineError, match="block hashes"):
        eng.submit(SimRequest("bad", A, 9, [b"x"], 1))
    assert not eng.has_work()
    with pytest.raises(SimEngineError, match="max_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_batched_tokens=32)


def test_chunked_prefill_shares_each_iteration_with_the_running_decodes():
    cfg = EngineConfig(block_size=4, capacity_blocks=256, max_num_seqs=8, max_batched_tokens=20, cost=COST)
    eng = SimEngine(cfg)
    short = request("s", A, [1], 4, extra_tokens=0, max_tokens=50)
    eng.submit(short)
    plan = eng.plan_step(0)
    eng.finish_step()
    assert plan.prefill_tokens == 4 and short.state == "decode"
    long = request("l", A, list(range(10, 20)), 4, extra_tokens=0, max_tokens=2)   # 40 tokens
    eng.submit(long)
    plan = eng.plan_step(100)
    assert plan.decodes == 1 and plan.prefill_tokens == 19          # budget 20 minus one decode
    assert plan.duration_us == 19 * 10 + 1000 + 100
    eng.finish_step()
    assert long.computed == 19 and long.first_token_us is None


def test_a_decode_run_planned_at_once_ends_exactly_as_step_by_step():
    def scenario(until):
        eng = SimEngine(EngineConfig(block_size=4, capacity_blocks=256, max_num_seqs=8,
                                     max_batched_tokens=64, cost=COST))
        reqs = [request(f"r{i}", A, [i], 4, extra_tokens=i, max_tokens=3 + 7 * i) for i in range(4)]
        for r in reqs:
            eng.submit(r)
        end, results = run(eng, 0, until)
        return end, [(r.first_token_us, r.finish_us) for r in reqs], len(results), eng.step_index

    end1, times1, n1, steps1 = scenario(None)
    end2, times2, n2, steps2 = scenario(1 << 40)
    assert (end1, times1, steps1) == (end2, times2, steps2)
    assert n2 < n1                              # fewer driver wake-ups, same outcome


def test_abort_releases_the_pages():
    eng = SimEngine(EngineConfig(block_size=4, capacity_blocks=16, max_num_seqs=4, max_batched_tokens=64,
                                 cost=COST))
    r = request("r", A, [1, 2], 4, extra_tokens=1, max_tokens=20)
    eng.submit(r)
    eng.plan_step(0)
    eng.finish_step()
    assert r.state == "decode" and eng.used_blocks == 8     # (9 + 20) tokens / 4
    eng.abort(r, 10)
    assert r.state == "finished" and not eng.has_work()
    assert eng.used_blocks == 2                 # the two stored blocks stay cached, unreferenced
    assert eng.plan_step(20) is None


def test_cost_knobs_replace_the_h200_defaults_and_are_checked():
    c = cost_with(prefill_us_per_token=7, decode_us_per_token=None)
    assert c.prefill_us_per_token == 7 and c.decode_us_per_token == 6000
    with pytest.raises(SimEngineError):
        cost_with(prefill_us_per_token=-1)
    with pytest.raises(SimEngineError):
        cost_with(bogus=1)


def test_a_prefix_in_the_pool_is_loaded_at_the_pool_cost_not_computed():
    pool = LruPool(capacity_blocks=16)
    cost = CostModel(prefill_us_per_token=1000, decode_us_per_token=1000, running_decode_penalty_us=0,
                     cpu_dram_us_per_mb=50)
    cfg = EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=8, max_batched_tokens=1024,
                       cost=cost, kv_bytes_per_token=1 << 18)        # 1 MiB per block
    writer, reader = SimEngine(cfg, pool), SimEngine(cfg, pool)
    writer.submit(request("w", A, [1, 2, 3], 4, extra_tokens=1, max_tokens=1))
    run(writer)
    assert len(pool) == 3                       # write-through of the computed blocks
    r = request("r", A, [1, 2, 3], 4, extra_tokens=1, max_tokens=1)
    other = request("o", B, [1, 2, 3], 4, extra_tokens=1, max_tokens=1)
    reader.submit(r)
    run(reader)
    assert r.pool_blocks == 3 and r.hit_blocks == 0
    assert r.first_token_us == 3 * 50 + 1 * 1000          # 3 MiB loaded, one token computed
    reader.submit(other)
    now, _ = run(reader, r.finish_us)
    assert other.pool_blocks == 0                         # another tenant: computed
    assert other.first_token_us - r.finish_us == 13 * 1000


def test_blocks_a_prefill_engine_computed_are_loaded_at_the_transfer_cost():
    cost = CostModel(prefill_us_per_token=1000, decode_us_per_token=1000, running_decode_penalty_us=0,
                     cpu_dram_us_per_mb=50)
    cfg = EngineConfig(block_size=4, capacity_blocks=64, max_num_seqs=8, max_batched_tokens=1024,
                       cost=cost, kv_bytes_per_token=1 << 18)        # 1 MiB per block
    decode = SimEngine(cfg)
    r = request("d", A, [1, 2, 3], 4, extra_tokens=1, max_tokens=2)
    r.remote_blocks = 4                                   # every prompt block, the partial one too
    decode.submit(r)
    run(decode)
    assert r.remote_loaded == 3 and r.hit_blocks == 0     # full blocks only: one token is computed
    assert r.first_token_us == 3 * 50 + 1 * 1000
    assert decode.remote_tokens_total == 12 and decode.cached_prefix(r.block_hashes) == 3
    again = request("d2", A, [1, 2, 3], 4, extra_tokens=1, max_tokens=1)
    again.remote_blocks = 4
    decode.submit(again)
    run(decode, r.finish_us)
    assert again.hit_blocks == 3 and again.remote_loaded == 0    # its own cache now holds them
