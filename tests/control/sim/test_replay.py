"""The trace replay on a small synthetic Mooncake trace: every policy runs through the real
router, identity is enforced by the engines, and the bench script writes its table, PNG and
JSON."""
import argparse
import json
import warnings

import pytest

from bench import router_replay
from quillcache.control.sim.engine import EngineConfig
from quillcache.control.sim.replay import build_requests, percentile, run_policy
from quillcache.control.sim.trace import (
    HUB_CHILDREN, TraceError, TraceRequest, TraceWarning, assign_tenants, conversation_keys, parse_trace,
)
from tests._support.sim import synthetic_trace

BS = 512


def small_config():
    return EngineConfig(block_size=BS, capacity_blocks=96, max_num_seqs=32, max_batched_tokens=4096)


def test_trace_lines_are_validated_with_the_line_named():
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    assert parse_trace([good])[0].hash_ids == (1, 2)
    aliased = parse_trace(['{"timestamp": 0, "input_tokens": 600, "output_tokens": 5, "hash_ids": [1, 2]}'])[0]
    assert (aliased.input_length, aliased.output_length) == (600, 5)
    bad = [
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "expected 2"),
        ('{"timestamp": -1, "input_length": 6, "output_length": 5, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 6, "output_length": 0, "hash_ids": [1]}', "output_length"),
        ('{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [18446744073709551616]}', r"2\*\*64"),
        ('{"session_id": "s", "delay": 5, "input_length": 6, "output_length": 5, "hash_ids": [1]}', "absolute"),
        ('{"timestamp": 0, "input_length": 6, "input_tokens": 7, "output_length": 5, "hash_ids": [1]}', "disagree"),
        ("[1, 2]", "object"),
        ("{nope", "not JSON"),
        # what is missing is named; a prompt given as text has no token counts to replay
        ('{"input_length": 6, "output_length": 5, "hash_ids": [1]}', "no timestamp"),
        ('{"timestamp": 0, "input_length": 6, "hash_ids": [1]}', "no output_length"),
        ('{"timestamp": 0, "text_input": "hi", "output_length": 5}', "given as text_input"),
        ('{"timestamp": 0, "messages": [], "output_length": 5}', "given as messages"),
        ('{"timestamp": NaN, "input_length": 6, "output_length": 5, "hash_ids": [1]}', "timestamp"),
    ]
    for line, needle in bad:
        with pytest.raises(TraceError, match=needle) as exc:
            parse_trace([good, line], name="t.jsonl")
        assert "t.jsonl:2" in str(exc.value)


def row(ts, n_in, ids=None, n_out=5):
    rec = {"timestamp": ts, "input_length": n_in, "output_length": n_out}
    return json.dumps(rec if ids is None else {**rec, "hash_ids": ids})


def test_a_row_without_hash_ids_is_a_prompt_of_its_own():
    # AIPerf's mooncake_trace reads input_length alone as a synthetic prompt that shares nothing:
    # each such row gets ids of its own, one per 512 tokens, that no other row has.
    trace = parse_trace([row(0, 1100, [0, 1, 2]), row(1, 1100), row(2, 600, [0, 3]), row(3, 1100), row(4, 5)])
    named = {h for r in trace if r.index in (0, 2) for h in r.hash_ids}
    own = [trace[i].hash_ids for i in (1, 3, 4)]
    assert [len(ids) for ids in own] == [3, 3, 1]
    flat = [h for ids in own for h in ids]
    assert len(set(flat)) == len(flat) and not set(flat) & named
    assert all(0 <= h < 1 << 64 for h in flat)
    # Re-cut traces too: the ids of its own are in 512-token blocks, beside the re-cut ones.
    cut = parse_trace([row(0, 1100, list(range(18))), row(1, 1100)], block_tokens=64)
    assert len(cut[1].hash_ids) == 3 and not set(cut[1].hash_ids) & set(cut[0].hash_ids)
    # The rows replay: nothing of theirs is credited anywhere.
    res = run_policy(build_requests(trace, speedup=1.0), "quillcache", 2, small_config())
    assert len(res.ttft_ms) == 5


def test_rows_out_of_time_order_are_replayed_in_time_order():
    ordered = [row(t, 600, [t, 1000 + t]) for t in (0, 10, 10, 20, 30, 40)]
    shuffled = [ordered[3], ordered[0], ordered[1], ordered[5], ordered[2], ordered[4]]
    with pytest.warns(TraceWarning, match=r"t.jsonl:2: timestamps go back in time: the 6 requests") as said:
        got = parse_trace(shuffled, name="t.jsonl")
    assert len(said) == 1
    want = parse_trace(ordered)
    assert [(r.index, r.timestamp_ms, r.hash_ids) for r in got] == [(r.index, r.timestamp_ms, r.hash_ids) for r in want]
    # Rows of one timestamp keep the order they are written in (a stable sort).
    assert [r.hash_ids[0] for r in got if r.timestamp_ms == 10] == [10, 10]
    # With a limit, the first rows in time, not in the file: the whole trace is read.
    with pytest.warns(TraceWarning):
        first = parse_trace(shuffled, limit=3)
    assert [r.timestamp_ms for r in first] == [0, 10, 10]
    # A trace in order says nothing and stops reading at the limit (a bad line past it is not read).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(parse_trace(ordered + ["{nope"], limit=6)) == 6


def test_the_cli_says_it_put_the_rows_in_time_order(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([row(5, 600, [1, 2]), row(0, 600, [1, 3])]) + "\n")
    trace = router_replay.check_trace(argparse.ArgumentParser(), str(path))
    assert [r.timestamp_ms for r in trace] == [0, 5]
    assert f"trace {path}:2: timestamps go back in time" in capsys.readouterr().err


def test_tenants_follow_conversations_and_keep_content_shared():
    trace = parse_trace(synthetic_trace())
    keys = conversation_keys(trace)
    # The system block is a hub (24 conversations > HUB_CHILDREN): keys are (0, first own block).
    assert 24 > HUB_CHILDREN and all(len(k) == 2 and k[0] == 0 for k in keys)
    assert len(set(keys)) == 24
    split = assign_tenants(trace, 4, seed=3)
    by_key = {}
    for req, key in zip(split, keys, strict=False):
        by_key.setdefault(key, set()).add(req.tenant)
    assert all(len(t) == 1 for t in by_key.values())          # one tenant per conversation
    assert len({r.tenant for r in split}) == 4
    assert [r.hash_ids for r in split] == [r.hash_ids for r in trace]   # content untouched
    assert [r.tenant for r in assign_tenants(trace, 4, seed=3)] == [r.tenant for r in split]
    assert [r.tenant for r in assign_tenants(trace, 4, seed=4)] != [r.tenant for r in split]


def test_replay_is_deterministic_and_cache_aware_routing_hits_more():
    reqs = build_requests(parse_trace(synthetic_trace()), speedup=1.0)
    runs = {p: run_policy(reqs, p, 3, small_config(), seed=5)
            for p in ("round_robin", "prefix", "quillcache")}
    again = run_policy(reqs, "quillcache", 3, small_config(), seed=5)
    assert again.ttft_ms == runs["quillcache"].ttft_ms
    for res in runs.values():
        assert len(res.ttft_ms) == len(res.tpot_ms) == len(reqs)
        assert min(res.ttft_ms) > 0
    rr, qc = runs["round_robin"].summary(800, 80), runs["quillcache"].summary(800, 80)
    assert qc["hit_rate"] > rr["hit_rate"]
    assert qc["ttft_p50_ms"] < rr["ttft_p50_ms"]


def test_goodput_counts_each_request_by_its_own_ttft_and_tpot():
    # Requests get their first token in one order and finish in another (outputs differ), so
    # goodput must pair each request's own TTFT with its own TPOT.  The engines' own steps say
    # what each request got; the SLOs sit at the medians so that both kinds of miss occur.
    reqs = build_requests(parse_trace(synthetic_trace()), speedup=6.0)
    first, done, ttft, tpot = [], [], {}, {}

    def on_step(_engine, res):
        for sim in res.first_tokens:
            first.append(sim.request_id)
            ttft[sim.request_id] = (sim.first_token_us - sim.arrival_us) / 1000.0
        for sim in res.finished:
            done.append(sim.request_id)
            out = sim.max_tokens
            tpot[sim.request_id] = (sim.finish_us - sim.first_token_us) / 1000.0 / (out - 1) if out > 1 else 0.0

    res = run_policy(reqs, "quillcache", 2, small_config(), seed=5, on_step=on_step)
    assert sorted(ttft) == sorted(tpot) and len(ttft) == len(reqs)
    slo_ttft, slo_tpot = percentile(list(ttft.values()), 50), percentile(list(tpot.values()), 50)
    met = sum(1 for r in ttft if ttft[r] <= slo_ttft and tpot[r] <= slo_tpot)
    # a case that tells the pairings apart: first tokens and finishes in another order, and
    # pairing the i-th first token with the i-th finish would count another number
    assert first != done
    crossed = sum(1 for a, b in zip(first, done, strict=True) if ttft[a] <= slo_ttft and tpot[b] <= slo_tpot)
    assert crossed != met
    assert res.summary(slo_ttft, slo_tpot)["goodput"] == met / len(reqs)
    assert sorted(res.ttft_ms) == sorted(ttft.values()) and sorted(res.tpot_ms) == sorted(tpot.values())


def test_a_slice_from_the_middle_replays_as_the_same_slice_rebased_to_zero():
    # Cut from a trace's middle, timestamps start late: the replay must not wait through the
    # lead-in (the gateway replay paces on the wall clock) nor count it as idle engine time in
    # the measured load, which the sweep calibrates its speed-ups on.
    lines = [json.loads(x) for x in synthetic_trace()]
    late = [json.dumps({**x, "timestamp": x["timestamp"] + 3_600_000}) for x in lines]
    base, shifted = parse_trace(map(json.dumps, lines)), parse_trace(late)
    assert base[0].timestamp_ms == 0
    a, b = build_requests(base, speedup=2.0), build_requests(shifted, speedup=2.0)
    assert b[0].arrival_us == 0
    assert [r.arrival_us for r in a] == [r.arrival_us for r in b]
    ra, rb = (run_policy(x, "quillcache", 3, small_config(), seed=5) for x in (a, b))
    assert ra.ttft_ms == rb.ttft_ms
    assert ra.summary(800, 80)["load"] == rb.summary(800, 80)["load"] > 0.01
    assert build_requests([], speedup=1.0) == []


def test_with_tenants_dynamo_credits_foreign_blocks_and_quillcache_does_not():
    trace = assign_tenants(parse_trace(synthetic_trace(conversations=30, turns=3)), 4, seed=2)
    reqs = build_requests(trace, speedup=1.0)
    dyn = run_policy(reqs, "dynamo", 3, small_config(), seed=1)
    qc = run_policy(reqs, "quillcache", 3, small_config(), seed=1)
    assert dyn.cross_identity_credited_blocks > 0
    assert qc.cross_identity_credited_blocks == 0
    assert dyn.cross_identity_served_blocks == qc.cross_identity_served_blocks == 0   # engines refuse
    assert qc.refused_blocks > 0


def test_percentile_is_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def test_bench_writes_table_json_and_png(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=12, turns=2)) + "\n")
    out = tmp_path / "out.json"
    assert router_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "2",
                               "--tenants", "2", "--policies", "round_robin,dynamo,quillcache",
                               "--kv-gib", "3", "--jobs", "1", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name in ("round_robin", "dynamo", "quillcache"):
        row = doc["policies"][name]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "goodput", "cross_identity_credited_blocks"):
            assert key in row
        assert 0 <= row["goodput"] <= 1
    assert (tmp_path / "out.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "p50/rr" in printed and "quillcache - dynamo goodput" in printed
    # Without round_robin in the run there is no ratio against it: none is printed, not "nan".
    del doc["policies"]["round_robin"]
    text = router_replay.table(doc)
    assert "quillcache - dynamo goodput" in text and "nan" not in text and "quillcache/round_robin" not in text


def test_a_free_pool_link_loads_in_no_time_and_is_said_to_be_free(tmp_path, capsys):
    """``--pool-link free`` is a bound, not a link: a pool load costs nothing, where the measured
    links cost their rate."""
    host, tcp, free = (router_replay.engine_config(3, link) for link in ("host", "tcp", "free"))
    assert 0 < host.pool_load_us(64) < tcp.pool_load_us(64)
    assert free.pool_load_us(64) == 0 and free.cost.cpu_dram_us_per_mb == 0
    assert free.remote_load_us(64) == host.remote_load_us(64) > 0     # moves between engines stay TCP
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=12, turns=2)) + "\n")
    out = tmp_path / "out.json"
    assert router_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "2", "--policies",
                               "quillcache", "--kv-gib", "3", "--pool", "5", "--pool-link", "free",
                               "--jobs", "1", "--json-out", str(out)]) == 0
    assert "over free" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["pool_link"] == "free"
    with pytest.raises(SystemExit):
        router_replay.main(["--trace", str(path), "--pool-link", "rdma"])


def test_the_reuse_ceiling_counts_leading_blocks_an_earlier_request_of_the_tenant_had(tmp_path, capsys):
    def req(i, ids, n, tenant="t0"):
        return TraceRequest(i, float(i), n, 4, tuple(ids), tenant)
    a, b, c = req(0, [1, 2, 3], 1536), req(1, [1, 2, 4], 1536), req(2, [5, 2, 3], 1536)
    assert router_replay.reusable_share([a]) == 0.0
    # b's leading 1, 2 were a's; its last block is new.  c starts with a block nobody had: nothing.
    assert router_replay.reusable_share([a, b, c]) == pytest.approx(1024 / (3 * 1536))
    # a prompt that ends on a block boundary keeps its last token to compute, as an engine does
    assert router_replay.reusable_share([a, req(1, [1, 2, 3], 1536)]) == pytest.approx(1024 / 3072)
    # another tenant's blocks are not there to reuse; order is by arrival, not by the list
    assert router_replay.reusable_share([a, req(1, [1, 2, 4], 1536, "t1")]) == 0.0
    assert router_replay.reusable_share([b, a]) == router_replay.reusable_share([a, b])
    # on a replay no policy, pool or not, reuses more than the ceiling the bench prints
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=12, turns=3)) + "\n")
    out = tmp_path / "out.json"
    assert router_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "2", "--tenants", "2",
                               "--policies", "prefix,quillcache", "--kv-gib", "3", "--pool", "5", "--pool-link",
                               "free", "--jobs", "1", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    ceiling = doc["config"]["reusable_share"]
    assert f"reuse ceiling: {ceiling:.3f} of the prompt tokens" in capsys.readouterr().out
    for row in doc["policies"].values():
        assert 0 < row["hit_rate"] + row["pool_rate"] <= ceiling + 1e-9, (row, ceiling)


def test_before_route_sees_every_arrival_and_changes_nothing():
    """The measurement hook of ``bench/router_predict.py``: called once per arriving request,
    before it is routed, with the router and the engines; probing the router there (track=False)
    leaves the replay's result as it is without the hook."""
    reqs = build_requests(parse_trace(synthetic_trace()), speedup=1.0)
    seen = []

    def probe(router, sims, r, now):
        assert len(sims) == 3 and now == r.arrival_us
        seen.append(r.trace.index)
        for name in router.workers:
            router.route(r.scope, hashes=r.router_hashes, request_tokens=r.trace.input_length,
                         candidates=[name], track=False)

    plain = run_policy(reqs, "quillcache", 3, small_config())
    probed = run_policy(reqs, "quillcache", 3, small_config(), before_route=probe)
    assert seen == [r.trace.index for r in reqs]
    assert probed.ttft_ms == plain.ttft_ms and probed.hit_tokens == plain.hit_tokens


def _steady(n: int, every_ms: int, output: int) -> list:
    """``n`` prompts of 2,048 tokens sharing nothing, one every ``every_ms``."""
    return build_requests(parse_trace(
        json.dumps({"timestamp": i * every_ms, "input_length": 2048, "output_length": output,
                    "hash_ids": [4 * i + j for j in range(4)]}) for i in range(n)), speedup=1.0)


def test_load_is_the_busy_share_while_the_trace_offers_work_not_while_the_engines_drain():
    cfg = small_config()
    alone = run_policy(_steady(1, 0, 2), "round_robin", 1, cfg).prefill_busy_us[0]   # one prompt's prefill
    # One arrival per two prefills' time on one engine: half loaded, whatever follows the last.
    half = run_policy(_steady(40, 2 * alone // 1000, 2), "round_robin", 1, cfg)
    assert abs(half.summary(800, 80)["load"] - 0.5) <= 0.05
    # Twice what two engines can take, with long outputs: past the last arrival the engines
    # drain their queues, then only decode.  Over the whole replay that reads as a moderate
    # load; while the trace offered work the engines never had their prefill queues empty.
    roomy = EngineConfig(block_size=BS, capacity_blocks=2048, max_num_seqs=256, max_batched_tokens=4096)
    over = run_policy(_steady(80, alone // 1000 // 4, 3000), "round_robin", 2, roomy)
    assert over.makespan_us > 3 * over.window_us
    assert over.summary(800, 80)["load"] >= 0.97
    assert sum(over.prefill_busy_us) / (2 * over.makespan_us) < 0.6
    # every arrival at once: no window, so over the whole replay as before
    burst = run_policy(_steady(8, 0, 2), "round_robin", 2, cfg)
    assert burst.window_us == 0 and burst.summary(800, 80)["load"] > 0.5


def _cut(lines: list[str], size: int) -> list[str]:
    """The same trace cut in blocks of ``size`` tokens, in a new id space: each piece named by
    its position and the 512-token ids that cover the tokens up to its end (a prefix-chained
    name, as a generator's rolling hash gives)."""
    names: dict = {}
    out = []
    for line in lines:
        r = json.loads(line)
        n, ids = r["input_length"], r["hash_ids"]
        pieces = [(i, tuple(ids[:(min((i + 1) * size, n) - 1) // BS + 1])) for i in range(-(-n // size))]
        r["hash_ids"] = [names.setdefault(p, 5 * len(names) + 11) for p in pieces]
        out.append(json.dumps(r))
    return out


@pytest.mark.parametrize("size", [16, 64, 100, 1024])
def test_a_trace_in_other_block_sizes_is_recut_to_the_same_shared_prefixes(size):
    lines = synthetic_trace(conversations=6, turns=3)
    cut = _cut(lines, size)
    with pytest.raises(TraceError, match="blocks of 512 tokens") as exc:
        parse_trace(cut)
    assert exc.value.fits == (() if size == 100 else (size,))
    base, recut = parse_trace(lines), parse_trace(cut, block_tokens=size)
    src = [json.loads(x)["hash_ids"] for x in cut]

    def covering(i: int, j: int) -> list:        # request i's source ids up to its block j's end
        return src[i][:-(-min((j + 1) * BS, recut[i].input_length) // size)]

    for i, a in enumerate(recut):
        assert len(a.hash_ids) == len(base[i].hash_ids) and a.input_length == base[i].input_length
        for j, b in enumerate(recut):
            for k in range(min(len(a.hash_ids), len(b.hash_ids))):
                # a 512-token block is shared exactly when every source block up to its end is
                assert (a.hash_ids[:k + 1] == b.hash_ids[:k + 1]) == all(
                    covering(i, m) == covering(j, m) for m in range(k + 1))
            if size in (16, 64):    # sizes that divide 512: the full blocks shared as at 512
                full = min(a.input_length, b.input_length) // BS
                assert (a.hash_ids[:full] == b.hash_ids[:full]) == (base[i].hash_ids[:full] == base[j].hash_ids[:full])
    with pytest.raises(ValueError, match="block_tokens"):
        parse_trace(cut, block_tokens=0)


def test_the_bench_replays_a_trace_cut_in_64_token_blocks_as_its_512_token_original(tmp_path, capsys):
    lines = synthetic_trace()
    orig, cut = tmp_path / "t512.jsonl", tmp_path / "t64.jsonl"
    orig.write_text("\n".join(lines) + "\n")
    cut.write_text("\n".join(_cut(lines, 64)) + "\n")
    common = ["--engines", "2", "--speedup", "4", "--policies", "prefix,quillcache", "--kv-gib", "0.5", "--jobs", "1"]
    with pytest.raises(SystemExit):
        router_replay.main(["--trace", str(cut)] + common)
    err = capsys.readouterr().err
    assert "t64.jsonl:1" in err and "pass --trace-block-tokens 64" in err
    docs = []
    for path, extra in ((orig, []), (cut, ["--trace-block-tokens", "64"])):
        out = tmp_path / (path.stem + ".json")
        assert router_replay.main(["--trace", str(path), "--json-out", str(out)] + common + extra) == 0
        docs.append(json.loads(out.read_text())["policies"])
    for policy in ("prefix", "quillcache"):
        for key in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "goodput"):
            assert docs[0][policy][key] == docs[1][policy][key], (policy, key)
    with pytest.raises(SystemExit):
        router_replay.main(["--trace", str(orig), "--trace-block-tokens", "0"] + common)
    assert "--trace-block-tokens 0" in capsys.readouterr().err


def test_prefix_classes_group_requests_by_the_deepest_run_that_enough_of_them_share():
    def req(i, ids, tenant="t0"):
        return TraceRequest(i, float(i), 512 * len(ids), 4, tuple(ids), tenant)
    template = [req(i, [0, 1, 2, 3, 10 + i]) for i in range(4)]       # 4 of 10: blocks 0-3 shared
    chats = [req(4 + i, [0, 20 + i, 30 + i]) for i in range(4)]       # share block 0 only
    odd = [req(8, [0, 1, 40]), req(9, [50, 51], "t1")]                # 0, 1 (5 requests); nothing
    trace = template + chats + odd
    classes, info = router_replay.prefix_classes(trace, 0.3)          # at least 3 of the 10
    # the template (4 requests) and the run of block 0 alone (the 4 chats) are classes; the
    # request that stops at blocks 0, 1 is the deepest only for itself, so it joins the rest
    assert [i["blocks"] for i in info] == [0, 4, 1] and [i["requests"] for i in info] == [2, 4, 4]
    assert info[1]["first_blocks"] == [0, 1] and info[2]["first_blocks"] == [0]
    assert classes == [1] * 4 + [2] * 4 + [0, 0]
    # a block is shared within a tenant: the same ids under another tenant are another run
    other = [req(i, [0, 1, 2, 3, 60 + i], "t1") for i in range(4)]
    classes, info = router_replay.prefix_classes(template + other, 0.5)
    assert sorted(classes) == [1] * 4 + [2] * 4 and {i["tenant"] for i in info[1:]} == {"t0", "t1"}
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            router_replay.prefix_classes(trace, bad)


def test_by_class_splits_the_summary_by_class_and_counts_refusals_as_misses():
    reqs = build_requests(parse_trace(synthetic_trace(conversations=10, turns=3)), speedup=4.0)
    res = run_policy(reqs, "quillcache", 2, small_config())
    assert sorted(res.request_index) == list(range(len(reqs))) and not res.refused_index
    whole = res.summary(800, 80)
    one = res.by_class([0] * len(reqs), 800, 80)
    assert len(one) == 1 and one[0]["requests"] == len(reqs)
    assert one[0]["ttft_p50_ms"] == whole["ttft_p50_ms"] and one[0]["goodput"] == whole["goodput"]
    assert one[0]["hit_rate"] == whole["hit_rate"] > 0
    odd = [j % 2 for j in range(len(reqs))]
    split = res.by_class(odd, 800, 80)
    for c in (0, 1):
        mine = [t for j, t in zip(res.request_index, res.ttft_ms) if odd[j] == c]
        assert split[c]["requests"] == len(mine)
        assert split[c]["ttft_p90_ms"] == percentile(mine, 90)
    hits = [sum(h for j, h in zip(res.request_index, res.request_hit_tokens) if odd[j] == c) for c in (0, 1)]
    assert sum(hits) == res.hit_tokens
    assert [split[c]["hit_rate"] * sum(n for j, n in zip(res.request_index, res.request_prompt_tokens)
                                       if odd[j] == c) for c in (0, 1)] == pytest.approx(hits)
    # admission refuses what it predicts will miss: each refusal is a miss of its own class
    tight = run_policy(reqs, "quillcache", 1, small_config(), admission="predict")
    assert tight.refused_index, "admission refused nothing: the check below would test nothing"
    rows = tight.by_class([0] * len(reqs), 800, 80)
    assert rows[0]["requests"] == len(tight.ttft_ms) + len(tight.refused_index)
    assert rows[0]["goodput"] == tight.summary(800, 80)["goodput"]


def test_by_prefix_prints_each_class_for_each_policy(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=12, turns=2)) + "\n")
    out = tmp_path / "out.json"
    assert router_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "2", "--policies",
                               "prefix,quillcache", "--kv-gib", "3", "--by-prefix", "0.5", "--jobs", "1",
                               "--json-out", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    spec = doc["config"]["by_prefix"]
    # every prompt starts with the shared system block (id 0), and no conversation is half the trace
    assert [(c["blocks"], c["requests"]) for c in spec["classes"]] == [(0, 0), (1, 24)]
    assert "class 1: 1 block from 0; 24 requests" in text and "class 0: the rest; 0 requests" in text
    for name, row in doc["policies"].items():
        assert row["by_prefix"][1]["ttft_p50_ms"] == row["ttft_p50_ms"]
        assert row["by_prefix"][1]["hit_rate"] == row["hit_rate"]
        assert row["by_prefix"][0]["ttft_p50_ms"] is None
        assert any(line.split()[:1] == [name] and line.split()[1] == "-" for line in text.splitlines())
    with pytest.raises(SystemExit):
        router_replay.main(["--trace", str(path), "--by-prefix", "1.5"])
