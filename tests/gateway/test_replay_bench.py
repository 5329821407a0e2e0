"""bench/gateway_replay.py at a tiny size, so that it cannot rot: a synthetic trace through a
real gateway process in front of real simulated engines, two policies, two tenants."""
import json
import tempfile

from bench import gateway_replay
from quillcache.control.sim.replay import build_requests
from quillcache.control.sim.trace import parse_trace
from tests._support.sim import synthetic_trace


def test_gateway_replay_prints_the_table_with_every_request_answered(tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))     # where each run's logs go
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=6, turns=2)) + "\n")
    out = tmp_path / "out.json"
    # 12 requests over ~12 minutes of trace, compressed 240x; the engines run 50x faster than
    # the modelled GPU (time scale 0.02), so the run takes a few seconds per policy.
    assert gateway_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "240",
                                "--tenants", "2", "--policies", "round_robin,quillcache", "--kv-gib", "3",
                                "--time-scale", "0.02", "--limit", "0", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    reqs = build_requests(parse_trace(path.read_text().splitlines()), 240)
    for name in ("round_robin", "quillcache"):
        row = doc["policies"][name]
        assert row["requests"] == 12 and row["errors"] == 0
        assert row["ttft_p50_ms"] > 0 and 0 <= row["goodput"] <= 1
        assert row["cross_identity_served_blocks"] == 0       # the engines key their caches by tenant
        assert row["cross_identity_credited_blocks"] == 0     # quillcache and round robin credit none
        # the load is the engines' prefill-busy share from the first arrival to the last, read from
        # the engines when the last request is due, as on the virtual clock (here a window of
        # 60 ms of wall time, which a loaded machine may pass before the engines see a request)
        assert row["window_s"] == (reqs[-1].arrival_us - reqs[0].arrival_us) / 1e6 > 0
        # the load's window: the trace's, or up to the read where a loaded machine read it late
        assert row["load_window_s"] >= row["window_s"]
        assert 0 <= row["load"] <= 1
    assert doc["config"]["through"] == "quillcache-gateway"
    printed = capsys.readouterr().out
    assert "p50/rr" in printed and "round_robin" in printed and "client errors 0" in printed
    assert list(scratch.iterdir()) == []        # runs without errors leave no logs behind


def test_two_runs_each_and_the_virtual_clock_give_a_judged_comparison(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=6, turns=2)) + "\n")
    out = tmp_path / "out.json"
    assert gateway_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "240",
                                "--tenants", "1", "--policies", "round_robin,quillcache", "--kv-gib", "3",
                                "--time-scale", "0.02", "--limit", "0", "--repeats", "2", "--virtual",
                                "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [len(doc["runs"][p]) for p in ("round_robin", "quillcache")] == [2, 2]
    assert [len(doc["virtual_runs"][p]) for p in ("round_robin", "quillcache")] == [2, 2]
    for key in ("ttft_p50_ms", "goodput"):
        a = doc["agreement"][key]
        assert a["pairs"] == 1 and a["judged"] == a["concordant"] + len(a["discordant"]) <= 1
        assert sorted(a["live_ranking"]) == sorted(a["virtual_ranking"]) == ["quillcache", "round_robin"]
    for run in doc["runs"]["quillcache"]:
        assert run["engine_late_ms"] >= 0 and run["engine_slipped_ms"] >= 0
    assert doc["config"]["virtual_jitter_ms"] == gateway_replay.VIRTUAL_JITTER_MS
    assert "pairs separated beyond the noise on both clocks" in capsys.readouterr().out


def test_pairs_within_the_noise_are_not_judged():
    sep = gateway_replay.separated
    assert sep([1, 2, 3], [10, 11, 12]) == -1 and sep([10, 11, 12], [1, 2, 3]) == 1
    assert sep([1, 5, 9], [10, 11, 12]) == 0            # apart, but the medians differ by 6 < the spread 8
    assert sep([1, 5, 12], [10, 11, 12]) == 0           # the runs overlap
    assert sep([4.0], [4.0]) == 0 and sep([3.0], [4.0]) == -1
    live = {"a": [1, 1.1, 1.2], "b": [5, 5.1, 5.2], "c": [5.05, 5.1, 5.3], "d": [9, 9.1, 9.2]}
    virt = {"a": [2, 2, 2], "b": [3, 3, 3], "c": [1, 1, 1], "d": [7, 7, 7]}
    got = gateway_replay.agreement(live, virt)
    # b and c are a tie live (within the noise): not judged, though the virtual clock orders them
    assert got["pairs"] == 6 and got["judged"] == 5 and got["discordant"] == [("a", "c")]
    assert got["virtual_only"] == [("b", "c")] and got["live_only"] == []
    assert got["live_ranking"][0] == "a" and got["virtual_ranking"][0] == "c"
    assert gateway_replay.spearman({"x": 1, "y": 2, "z": 3}, {"x": 10, "y": 20, "z": 30}) == 1.0
    assert gateway_replay.ranks({"x": 1, "y": 1, "z": 3}) == {"x": 1.5, "y": 1.5, "z": 3}


def test_the_virtual_repeats_vary_the_arrivals_by_the_live_path_s_jitter():
    # Live, no request reaches its engine at the trace's exact time; on the virtual clock each
    # repeat delays each arrival by its own seeded draw in [0, jitter), so that the virtual spread
    # shows what the exact arrival times decide.
    reqs = build_requests(parse_trace(synthetic_trace(conversations=12, turns=3)), 50)
    assert gateway_replay.jittered(reqs, 0.0, 3) == reqs
    a, b = gateway_replay.jittered(reqs, 10.0, 1), gateway_replay.jittered(reqs, 10.0, 2)
    assert a == gateway_replay.jittered(reqs, 10.0, 1) and a != b
    for got in (a, b):
        assert [r.arrival_us for r in got] == sorted(r.arrival_us for r in got)
        orig = {r.trace.index: r.arrival_us for r in reqs}
        assert sorted(r.trace.index for r in got) == sorted(orig)
        assert all(0 <= r.arrival_us - orig[r.trace.index] < 10_000 for r in got)
        assert any(r.arrival_us != orig[r.trace.index] for r in got)
