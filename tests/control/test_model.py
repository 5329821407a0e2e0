"""The control plane's data model: workers, engines, request hints and the cost model."""
from quillcache.control.model import (
    BlockHint, CostModel, EngineEndpoint, EngineKind, RequestKvHints, RequestShape, SloTarget,
    WorkerState,
)
from quillcache.model import CacheTier

GiB = 1 << 30
MiB = 1 << 20


def test_worker_state_defaults_and_with_load():
    w = WorkerState("w1")
    assert (w.hbm_capacity_bytes, w.cpu_capacity_bytes) == (80 * GiB, 512 * GiB)
    loaded = w.with_load(1000, 3)
    assert (loaded.queued_prefill_tokens, loaded.running_decodes) == (1000, 3)
    assert w.queued_prefill_tokens == 0
    ep = EngineEndpoint("w2", EngineKind.parse("vLLM"), "http://127.0.0.1:8000", "m", "t", "acme", "rack1")
    assert ep.worker_state() == WorkerState("w2", "rack1")


def test_request_hints_chain_prefix_hashes():
    hints = RequestKvHints(block_hashes=("h1", "h2", "h3"), session_id="sess", adapter_id="lora")
    blocks = hints.to_blocks("m", "t", "acme")
    assert [b.prefix_hash for b in blocks] == ["sess", "h1", "h2"]
    assert [b.block_index for b in blocks] == [0, 1, 2]
    assert all(b.token_count == 64 and b.adapter_id == "lora" and b.tenant_id == "acme" for b in blocks)
    root = RequestKvHints(block_hashes=("x",), block_tokens=16, model_id="m2").to_blocks("m", "t", "acme")
    assert root[0].prefix_hash == "root" and root[0].token_count == 16 and root[0].model_id == "m2"
    shape = RequestShape("r", "m", "t", None, "acme", tuple(blocks))
    assert shape.input_tokens() == 192
    assert SloTarget() == SloTarget(800, 80)
    assert BlockHint("h").token_count == 64


def test_cost_model_seed_defaults_and_functions():
    c = CostModel()
    assert c.prefill_cost_us(100) == 4500
    assert c.decode_cost_us(10, 2) == 800 + 3000
    assert c.queue_cost_us(WorkerState("w").with_load(250, 9)) == 1000
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, True, True) == 5
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, False, True) == 80
    assert c.transfer_cost_us(CacheTier.CPU_DRAM, 1, True, True) == 55          # at least 1 MiB
    assert c.transfer_cost_us(CacheTier.CPU_DRAM, MiB + 1, False, True) == 110  # ceil
    assert c.transfer_cost_us(CacheTier.LOCAL_SSD, 3 * MiB, False, False) == 840 + 350
    assert c.transfer_cost_us(CacheTier.OBJECT_STORE, MiB, True, False) == 1800  # same worker: no penalty
    assert c.transfer_cost_us(CacheTier.HBM, 4 * MiB, True, True) < c.prefill_cost_us(64)
