"""bench/router_sweep.py's load calibration at a tiny size: the speed-up is found for each pool
setting on its own, so a row that says load L ran at a busy share near L with the pool too (a
pool takes work off the engines: the same traffic is a lower load with one)."""
import json

from bench import router_sweep


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
