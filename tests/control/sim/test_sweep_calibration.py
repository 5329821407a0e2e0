"""bench/router_sweep.py's load calibration at a tiny size: the speed-up is found for each pool
setting on its own, so a row that says load L ran at a busy share near L with the pool too (a
pool takes work off the engines: the same traffic is a lower load with one)."""
import json

import pytest

from bench import gateway_replay, router_predict, router_replay, router_sweep


def test_each_pool_setting_is_calibrated_to_the_target_busy_share(tmp_path):
    out = tmp_path / "sweep"
    assert router_sweep.main(["--traces", "agent", "--limit", "300", "--loads", "0.6", "--policies",
                              "dynamo,quillcache", "--jobs", "1", "--out", str(out)]) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    rows = {(r["pool"], r["policy"]): r for r in doc["rows"]}
    without, with_pool = rows[(False, "dynamo")], rows[(True, "dynamo")]
    assert with_pool["speedup"] > without["speedup"]
    for r in (without, with_pool):
        assert abs(r["load"] - 0.6) <= 0.05, r
        assert r["load_reached"]
    # the tally counts the checks printed above it, ok and NO alike
    lines = router_sweep.verdicts(doc)
    made = [part.strip() for c in lines[:-1] if c.startswith("agent load 0.6 ") for part in c.split(" (")[0].split(",")]
    assert len(made) == 6, made
    assert lines[-1].startswith(f"quillcache holds {sum(p.endswith(' ok') for p in made)} of 6 checks")
    # the pool check is printed at the same load and at the same traffic, and beside it what a
    # pool that holds every block and loads it in no time gives at that traffic
    same = doc["pool_at_no_pool_speedup"]
    assert [s["speedup"] for s in same] == [without["speedup"]]
    bound = doc["pool_bound_at_no_pool_speedup"]
    assert [(b["speedup"], b["pool_link"], b["policy"]) for b in bound] == [(without["speedup"], "free", "quillcache")]
    assert bound[0]["pool_rate"] > 0
    ratio = bound[0]["ttft_p50_ms"] / rows[(False, "quillcache")]["ttft_p50_ms"]
    pool_line = next(c for c in lines if c.startswith("agent load 0.6: quillcache p50 with pool"))
    assert f"loads it in no time, the most a pool can take off, {ratio:.2f}" in pool_line, pool_line


def test_a_load_no_speed_up_reaches_is_reported_wherever_it_shows(tmp_path, capsys):
    """Every request of this trace arrives at once: the speed-up changes nothing, so its one
    load (the engines all busy) is what every target gets.  A target it cannot reach is said to
    be missed, in the printout, the table, the JSON and each check made there: a check at another
    load than the one named would otherwise pass or fail as if at that load."""
    burst = tmp_path / "burst.jsonl"
    burst.write_text("".join(f'{{"timestamp": 5, "input_length": 3000, "output_length": 20, '
                             f'"hash_ids": [7, 8, 9, {100 + i}, {300 + i}, {600 + i}]}}\n' for i in range(80)))
    out = tmp_path / "sweep"
    assert router_sweep.main(["--conversation", str(burst), "--traces", "conversation", "--loads", "0.3",
                              "--policies", "dynamo,quillcache", "--jobs", "1", "--probes", "3",
                              "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["rows"] and not any(r["load_reached"] for r in doc["rows"])
    assert all(abs(r["calibrated_load"] - 0.3) > 0.1 for r in doc["rows"])
    assert printed.count("NOT REACHED") == 4     # calibrated and checked, with and without the pool
    checks = [c for c in router_sweep.verdicts(doc) if c.startswith("conversation load 0.3")]
    assert len(checks) == 2
    for c in checks:
        assert c.split(": ", 1)[1].startswith("NOT REACHED (the closest speed-up,") and "p50<=1.05xbest" in c, c
    assert "| 0.3 (not reached) |" in (tmp_path / "sweep.md").read_text()
    # the flag alone decides: the same rows, marked reached, are checked without the warning
    fine = router_sweep.verdicts({**doc, "rows": [{**r, "load_reached": True} for r in doc["rows"]]})
    assert fine and not any("NOT REACHED" in c for c in fine)


def test_a_missing_or_bad_trace_is_one_usage_error_before_any_worker_starts(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n')
    missing = str(tmp_path / "nowhere.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    runs = [(router_sweep.main, ["--conversation", missing, "--traces", "conversation"], "No such file"),
            (router_sweep.main, ["--conversation", str(bad), "--traces", "conversation"],
             f"{bad}:2: 1 hash_ids for input_length 600"),
            (router_replay.main, ["--trace", str(bad)], f"{bad}:2:"),
            (gateway_replay.main, ["--trace", missing], "No such file"),
            (gateway_replay.main, ["--trace", str(empty)], f"{empty}: no requests"),
            (gateway_replay.main, ["--trace", missing, "--virtual-jitter-ms", "-1"], "--virtual-jitter-ms -1.0"),
            (router_sweep.main, ["--conversation", str(empty), "--traces", "conversation"], "no requests"),
            (router_predict.main, ["--trace", "conversation", "--conversation", missing, "--speedup", "2"],
             "No such file"),
            (router_sweep.main, ["--traces", "rag,chat"],
             "--traces: chat: not a trace (conversation, agent, apps, rag, unique)")]
    for main, argv, want in runs:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err
    # the default trace is the one beside the checkout, wherever the checkout is
    assert router_replay.DEFAULT_TRACE.endswith("/shared/data/traces/mooncake_conversation_trace.jsonl")
    assert router_sweep.DEFAULT_TRACE == router_replay.DEFAULT_TRACE


def test_jitter_replays_each_setting_at_multiples_of_its_speed_up_and_counts_each_check(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert router_sweep.main(["--traces", "agent", "--limit", "300", "--loads", "0.5", "--policies",
                              "dynamo,quillcache,quillcache+admission", "--jobs", "1", "--jitter", "1.1,0.9",
                              "--out", str(out)]) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["config"]["jitter"] == [0.9, 1.1]
    cal = {(r["pool"], r["policy"]): r["speedup"] for r in doc["rows"]}
    jit = doc["jitter_rows"]
    # every policy but the admission variant, at each multiple, with and without the pool
    assert sorted((r["factor"], r["pool"], r["policy"]) for r in jit) == sorted(
        (f, pool, p) for f in (0.9, 1.1) for pool in (False, True) for p in ("dynamo", "quillcache"))
    for r in jit:
        assert r["speedup"] == pytest.approx(cal[(r["pool"], r["policy"])] * r["factor"])
    # a faster replay of the same trace is a higher load
    by = {(r["factor"], r["pool"], r["policy"]): r for r in jit}
    assert by[(0.9, False, "dynamo")]["load"] < by[(1.1, False, "dynamo")]["load"]
    lines = router_sweep.jitter_verdicts(doc)
    assert lines[0].startswith("agent load 0.5 no pool, speed-up x 0.9, 1, 1.1: p50<=1.05xbest ")
    assert lines[-1].startswith("across the jittered speed-ups quillcache holds ")
    assert lines[-1].endswith(" of 18 checks")
    assert lines[-1] in capsys.readouterr().out
    assert lines[-1] in (tmp_path / "sweep.md").read_text()


def test_jitter_verdicts_count_where_a_check_holds_and_where_it_does_not():
    def row(policy, p50, factor=None, load_reached=True):
        r = {"trace": "t", "target_load": 0.85, "pool": False, "policy": policy, "ttft_p50_ms": p50,
             "ttft_p99_ms": 1000.0, "goodput": 0.8 if policy == "quillcache" else 0.5, "load_reached": load_reached}
        return r if factor is None else {**r, "factor": factor}
    doc = {"rows": [row("quillcache", 100.0), row("prefix", 100.0), row("dynamo", 300.0)],
           "jitter_rows": [row("quillcache", 120.0, 0.97), row("prefix", 100.0, 0.97), row("dynamo", 300.0, 0.97),
                           row("quillcache", 90.0, 1.03), row("prefix", 100.0, 1.03), row("dynamo", 300.0, 1.03)],
           "config": {"jitter": [0.97, 1.03]}}
    assert router_sweep.jitter_verdicts(doc) == [
        "t load 0.85 no pool, speed-up x 0.97, 1, 1.03: p50<=1.05xbest 2/3, goodput>=best-0.01 3/3, "
        "p99<=1.2xbest 3/3, goodput>=1.3xdynamo 3/3",
        "across the jittered speed-ups quillcache holds 11 of 12 checks"]
    # a setting no speed-up reached says so here too; without --jitter there is nothing to say
    doc["rows"] = [{**r, "load_reached": False} for r in doc["rows"]]
    assert "NOT REACHED" in router_sweep.jitter_verdicts(doc)[0]
    assert router_sweep.jitter_verdicts({**doc, "jitter_rows": []}) == []


def test_every_policy_is_asked_the_same_checks_against_the_best_of_the_others():
    """Worked by hand: at 0.85 `prefix` has the best median and `dynamo` the best tail, so no
    policy holds all its checks; each is checked against the best of all the others
    (``quillcache`` among them), `dynamo` is not asked for 1.3 x its own goodput, and the
    admission variant is neither asked nor anyone's best."""
    def row(policy, p50, p99, good, load=0.85):
        return {"trace": "t", "target_load": load, "pool": False, "policy": policy, "ttft_p50_ms": p50,
                "ttft_p99_ms": p99, "goodput": good}
    doc = {"rows": [row("quillcache", 120.0, 2000.0, 0.80), row("prefix", 100.0, 9000.0, 0.70),
                    row("dynamo", 240.0, 1500.0, 0.50), row("quillcache+admission", 50.0, 500.0, 0.99)]}
    # quillcache: p50 120 > 105 NO, goodput ok, p99 2000 > 1800 NO, 0.80 >= 0.65 ok -> 2 of 4
    # prefix: p50 ok, goodput 0.70 < 0.79 NO, p99 NO, 0.70 >= 0.65 ok -> 2 of 4
    # dynamo: p50 NO, goodput NO, p99 ok (no 1.3 x its own) -> 1 of 3
    assert router_sweep.every_policy(doc) == ("the same checks for every policy, each against the best of the "
                                             "others: prefix 2/4, quillcache 2/4, dynamo 1/3")
    doc["rows"][0]["ttft_p50_ms"], doc["rows"][0]["ttft_p99_ms"] = 104.0, 1800.0
    assert router_sweep.every_policy(doc).endswith("quillcache 4/4, prefix 2/4, dynamo 1/3")
    assert router_sweep.every_policy({"rows": [row("quillcache", 1.0, 1.0, 1.0)]}) == ""


@pytest.mark.parametrize("jitter", ["1.0", "0.9,1", "-0.5", "abc", "0.9,,x", "12"])
def test_a_bad_jitter_is_a_usage_error(jitter, capsys):
    with pytest.raises(SystemExit) as exc:
        router_sweep.main(["--traces", "agent", "--limit", "50", "--jitter", jitter])
    assert exc.value.code == 2
    assert "--jitter" in capsys.readouterr().err
