"""connectors/paged.py, the vLLM connector's worker side without vLLM, on CPU torch against a real
quillcached: per-layer paged caches in vLLM's layout, vLLM's call order, chunked staging, misses
and a dead node as load errors; and bench/gpu_reload.py's connector mode (the GPU benchmark of
this path) run on CPU with a tiny shape so that it cannot rot.  Worker semantics follow vllm
0.33.0's KVConnectorBase_V1; torch 2.13.0 (CPU)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope  # noqa: E402
from quillcache.model import IdentityScope  # noqa: E402
from quillcache.connectors.paged import PagedKVWorker, Transfer  # noqa: E402

LAYERS, BLOCKS, BS, KVH, HD = 3, 16, 16, 2, 8
BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def caches(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn(2, BLOCKS, BS, KVH, HD, generator=g).to(torch.bfloat16)
            for i in range(LAYERS)}


def keys(n: int, tenant: str = "acme"):
    scope = model_scope("tiny", dtype="bfloat16", block_size=BS, num_layers=LAYERS, layout="vllm-2nbhd")
    return chain_keys(IdentityScope(scope, "tok", None, tenant), [bytes([i + 1]) * 32 for i in range(n)], block_size=BS)


def saved(worker: PagedKVWorker, t: Transfer) -> None:
    """wait_for_save, then get_finished until the request is reported (vLLM's loop)."""
    worker.wait_for_save([t])
    deadline = time.monotonic() + 10
    while not worker.get_finished({t.req_id}):
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.01)


def test_worker_loads_in_chunks_layer_by_layer_and_reports_misses_for_recompute(node):
    core = ConnectorCore(f"unix:{node.data_dir / 'quillcached.sock'}", timeout=5)
    try:
        w = PagedKVWorker(core, staging_bytes=2 * LAYERS * 2 * BS * KVH * HD * 2)    # 2 blocks per chunk
        kv = caches(1)
        w.register_kv_caches(kv)
        layers = list(kv.values())
        assert w.block_nbytes == LAYERS * 2 * BS * KVH * HD * 2 and w.block_shape == (LAYERS, 2, BS, KVH, HD)
        ks = keys(6)
        saved(w, Transfer("A", ks[:5], [0, 1, 2, 3, 4]))              # 5 of 6 blocks stored
        assert [t.req_id for t in w.take_stored()] == ["A"] and w.take_stored() == []

        # request B: 6 blocks into 8..13; the 6th is missing: blocks 8..12 equal 0..4, 13 untouched
        before = [c[:, 13].clone() for c in layers]
        w.start_load_kv([Transfer("B", ks, [8, 9, 10, 11, 12, 13])])
        for name in kv:
            w.wait_for_layer_load(name)
        w.wait_for_save([])
        assert w.take_load_errors() == {13}
        for i, c in enumerate(layers):
            assert torch.equal(c[:, 8:13].view(torch.uint8), c[:, 0:5].view(torch.uint8)), f"layer {i}"
            assert torch.equal(c[:, 13], before[i])
        assert core.stats()["loaded_blocks"] == 5

        # another tenant: every block is a miss
        w.start_load_kv([Transfer("C", keys(2, tenant="other"), [14, 15])])
        w.wait_for_layer_load("layers.0.attn")
        w.wait_for_save([])
        assert w.take_load_errors() == {14, 15}

        # the node gone: loads and saves fail as errors, never as exceptions
        node.stop()
        w.start_load_kv([Transfer("D", ks[:2], [14, 15])])
        w.wait_for_layer_load("layers.2.attn")
        assert w.take_load_errors() == {14, 15}
        saved(w, Transfer("E", ks[:1], [0]))
        assert w.take_stored() == []
        s = core.stats()
        assert s["load_errors"] >= 1 and s["save_errors"] >= 1
        w.shutdown()
    finally:
        core.close()


def test_register_refuses_caches_not_in_vllms_layout(node):
    core = ConnectorCore(node.addr)
    try:
        w = PagedKVWorker(core)
        with pytest.raises(ValueError, match="expected"):
            w.register_kv_caches({"l0": torch.zeros(BLOCKS, 2, BS, KVH)})
        with pytest.raises(ValueError, match="differs"):
            w.register_kv_caches({"l0": torch.zeros(2, BLOCKS, BS, KVH, HD), "l1": torch.zeros(2, BLOCKS, BS, KVH, 4)})
    finally:
        core.close()


def bench_rows(out: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith(first)]


def test_gpu_reload_connector_mode_runs_on_cpu_with_a_tiny_shape(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_reload
    finally:
        sys.path.remove(str(BENCH))
    rc = gpu_reload.main(["--connector", "--device", "cpu", "--shape", "tiny", "--prefix", "128,256", "--rounds", "1",
                          "--kv-dtype", "auto,fp8_e4m3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "lower-right causal bias" in out               # the probe found it gives the mask's attention
    rows = bench_rows(out, "| tiny |")
    assert len(rows) == 8, out                             # 2 prefixes x 2 stored dtypes x 2 load paths
    assert {(r[1], r[2], r[3]) for r in rows} == {(p, kv, path) for p in ("128", "256")
                                                  for kv in ("auto", "fp8_e4m3") for path in ("layered", "staged")}
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0        # recompute ms, reload + suffix ms
        assert float(r[8]) <= float(r[9])                  # first layer usable no later than all layers
        assert float(r[12]) < (1e-3 if r[2] == "auto" else 0.05)   # float32 on CPU: the same logits; FP8 close
    assert "'load_errors': 0" in out and "'save_errors': 0" in out


def test_gpu_reload_connector_mode_with_the_copy_engine_path_and_the_old_suffix_on_cpu(capsys):
    """The other choices of the connector rows: the copy-engine load path (on CPU its strided
    copies) beside the gather kernel's, and the suffix as before (eager, boolean mask): the same
    logits as the full prefill either way."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_reload
    finally:
        sys.path.remove(str(BENCH))
    rc = gpu_reload.main(["--connector", "--device", "cpu", "--shape", "tiny", "--prefix", "256", "--rounds", "1",
                          "--kv-dtype", "auto,fp8_e4m3", "--load-path", "layered-dma,layered",
                          "--suffix-run", "eager", "--suffix-attention", "mask"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "boolean mask" in out and "suffix run eager" in out
    rows = bench_rows(out, "| tiny |")
    assert {(r[2], r[3]) for r in rows} == {(kv, path) for kv in ("auto", "fp8_e4m3")
                                            for path in ("layered-dma", "layered")}
    for r in rows:
        assert float(r[12]) < (1e-3 if r[2] == "auto" else 0.05)
    assert "'load_errors': 0" in out and "'save_errors': 0" in out


def test_gpu_reload_load_only_mode_times_the_first_layer_against_all_layers_on_cpu(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_reload
    finally:
        sys.path.remove(str(BENCH))
    rc = gpu_reload.main(["--connector", "--load-only", "--device", "cpu", "--shape", "tiny", "--prefix", "256",
                          "--rounds", "1", "--kv-dtype", "auto,fp8_e4m3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = bench_rows(out, "| 256 |")
    assert {(r[1], r[2]) for r in rows} == {(kv, p) for kv in ("auto", "fp8_e4m3") for p in ("layered", "staged")}
    for r in rows:
        assert 0 < float(r[4]) <= float(r[5])
