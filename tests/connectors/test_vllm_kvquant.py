"""The vLLM connector's ``kv_dtype`` and ``load_path`` (kv_connector_extra_config), built by vLLM's own
KVConnectorFactory from a real VllmConfig: "fp8_e4m3" puts the stored dtype in every key's scope
and makes the worker quantize; anything else is refused at construction.  vllm 0.33.0, CPU torch."""
from __future__ import annotations

import pytest

from tests._support import engines

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("vllm")

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

BS, LAYERS, NBLOCKS, KVH, HD = 16, 3, 8, 2, 32


def build(role, **extra):
    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="QuillCacheConnector", kv_connector_module_path="quillcache.connectors.vllm",
        kv_role="kv_both", kv_connector_extra_config={
            "address": "unix:/nonexistent/quillcached.sock", "model": "tiny", "block_size": BS,
            "tokenizer_id": "tiny-tok", "dtype": "bfloat16", "num_layers": LAYERS, **extra}))
    return KVConnectorFactory.create_connector(cfg, role, None)


def test_fp8_kv_dtype_is_in_the_scope_and_the_worker_stores_half_the_bytes():
    fp8 = build(KVConnectorRole.WORKER, kv_dtype="fp8_e4m3")
    plain = build(KVConnectorRole.WORKER)
    sched = build(KVConnectorRole.SCHEDULER, kv_dtype="fp8_e4m3")
    try:
        assert "|fp8_e4m3|" in fp8._scope() and "|bfloat16|" in plain._scope()
        assert sched._scope() == fp8._scope()                  # the scheduler looks up what the worker stores
        caches = {f"model.layers.{i}.attn": torch.zeros(2, NBLOCKS, BS, KVH, HD, dtype=torch.bfloat16)
                  for i in range(LAYERS)}
        fp8.register_kv_caches(caches)
        plain.register_kv_caches(caches)
        assert fp8.worker.codec.quantized and not plain.worker.codec.quantized
        assert plain.worker.stored_nbytes == plain.worker.block_nbytes
        assert fp8.worker.stored_nbytes == plain.worker.block_nbytes // 2 + LAYERS * 2 * 4
    finally:
        for c in (fp8, plain, sched):
            c.core.close()


def test_an_unknown_kv_dtype_is_refused_at_construction():
    with pytest.raises(ValueError, match="kv_dtype"):
        build(KVConnectorRole.WORKER, kv_dtype="int4")


def test_load_path_reaches_the_worker_and_an_unknown_one_is_refused():
    layered, staged = build(KVConnectorRole.WORKER), build(KVConnectorRole.WORKER, load_path="staged")
    try:
        assert layered.worker.load_path == "layered" and staged.worker.load_path == "staged"
    finally:
        layered.core.close()
        staged.core.close()
    with pytest.raises(ValueError, match="load_path"):
        build(KVConnectorRole.WORKER, load_path="sideways")
