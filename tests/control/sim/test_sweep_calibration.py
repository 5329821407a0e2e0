"""bench/router_sweep.py's load calibration at a tiny size: the speed-up is found for each pool
setting on its own, so a row that says load L ran at a busy share near L with the pool too (a
pool takes work off the engines: the same traffic is a lower load with one)."""
import json

import pytest

from bench import gateway_replay, router_predict, router_replay, router_sweep


def test_each_pool_setting_is_calibrated_to_the_target_busy_share(tmp_path):
    out = tmp_path / "sweep"
    assert router_sweep.main(["--traces", "agent", "--limit", "300", "--loads", "0.5", "--policies",
                              "dynamo,quillcache", "--jobs", "1", "--out", str(out)]) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    rows = {(r["pool"], r["policy"]): r for r in doc["rows"]}
    without, with_pool = rows[(False, "dynamo")], rows[(True, "dynamo")]
    assert with_pool["speedup"] > without["speedup"]
    for r in (without, with_pool):
        assert abs(r["load"] - 0.5) <= 0.05, r
    # the pool check is printed at the same load and at the same traffic
    same = doc["pool_at_no_pool_speedup"]
    assert [s["speedup"] for s in same] == [without["speedup"]]


def test_a_missing_or_bad_trace_is_one_usage_error_before_any_worker_starts(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n')
    missing = str(tmp_path / "nowhere.jsonl")
    runs = [(router_sweep.main, ["--conversation", missing, "--traces", "conversation"], "No such file"),
            (router_sweep.main, ["--conversation", str(bad), "--traces", "conversation"],
             f"{bad}:2: 1 hash_ids for input_length 600"),
            (router_replay.main, ["--trace", str(bad)], f"{bad}:2:"),
            (gateway_replay.main, ["--trace", missing], "No such file"),
            (router_predict.main, ["--trace", "conversation", "--conversation", missing, "--speedup", "2"],
             "No such file"),
            (router_sweep.main, ["--traces", "rag,chat"],
             "--traces: chat: not a trace (conversation, agent, apps, rag)")]
    for main, argv, want in runs:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err
    # the default trace is the one beside the checkout, wherever the checkout is
    assert router_replay.DEFAULT_TRACE.endswith("/shared/data/traces/mooncake_conversation_trace.jsonl")
    assert router_sweep.DEFAULT_TRACE == router_replay.DEFAULT_TRACE
