"""bench/gateway_replay.py at a tiny size, so that it cannot rot: a synthetic trace through a
real gateway process in front of real simulated engines, two policies, two tenants."""
import json

from bench import gateway_replay
from tests._support.sim import synthetic_trace


def test_gateway_replay_prints_the_table_with_every_request_answered(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(synthetic_trace(conversations=6, turns=2)) + "\n")
    out = tmp_path / "out.json"
    # 12 requests over ~12 minutes of trace, compressed 240x; the engines run 50x faster than
    # the modelled GPU (time scale 0.02), so the run takes a few seconds per policy.
    assert gateway_replay.main(["--trace", str(path), "--engines", "2", "--speedup", "240",
                                "--tenants", "2", "--policies", "round_robin,quillcache", "--kv-gib", "3",
                                "--time-scale", "0.02", "--limit", "0", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name in ("round_robin", "quillcache"):
        row = doc["policies"][name]
        assert row["requests"] == 12 and row["errors"] == 0
        assert row["ttft_p50_ms"] > 0 and 0 <= row["goodput"] <= 1
        assert row["cross_identity_served_blocks"] == 0       # the engines key their caches by tenant
        assert row["cross_identity_credited_blocks"] == 0     # quillcache and round robin credit none
    assert doc["config"]["through"] == "quillcache-gateway"
    printed = capsys.readouterr().out
    assert "p50/rr" in printed and "round_robin" in printed and "client errors 0" in printed
