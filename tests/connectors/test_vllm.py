"""The vLLM V1 connector, built by vLLM's own KVConnectorFactory from a real VllmConfig and driven
in the engine's call order (scheduler: get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta; worker: bind, start_load_kv, wait_for_layer_load, save_kv_layer,
wait_for_save, get_finished; scheduler: request_finished) with real Request objects and their
real block hashes, against a real quillcached.  Tested against vllm 0.33.0."""
from __future__ import annotations

import time

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("vllm")

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BS, LAYERS, NBLOCKS, KVH, HD = 16, 3, 24, 2, 32


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def connector(node, role):
    cfg = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="QuillCacheConnector", kv_connector_module_path="quillcache.connectors.vllm",
        kv_role="kv_both", kv_connector_extra_config={
            "address": f"unix:{node.data_dir / 'quillcached.sock'}", "model": "tiny", "block_size": BS,
            "tokenizer_id": "tiny-tok", "dtype": "float32"}))
    return KVConnectorFactory.create_connector(cfg, role, None)


def request(rid: str, tokens: list[int], lora: str | None = None, salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=LoRARequest(lora, 1 if lora == "a" else 2, f"/loras/{lora}") if lora else None,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def step(sched, worker, caches, req, block_ids, hit_tokens):
    """One scheduler step for a new request, then the worker's forward, in vLLM's order."""
    blocks = KVCacheBlocks((([KVCacheBlock(b) for b in block_ids]),))
    sched.update_state_after_alloc(req, blocks, hit_tokens)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (block_ids,))]
    out.num_scheduled_tokens = {req.request_id: req.num_prompt_tokens - req.num_computed_tokens - hit_tokens}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for i, c in enumerate(caches):
        worker.wait_for_layer_load(f"model.layers.{i}.attn")
        worker.save_kv_layer(f"model.layers.{i}.attn", c, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return meta


def finish(sched, worker, req, block_ids):
    delayed, _ = sched.request_finished(req, block_ids)
    done = set()
    for _ in range(200):
        sending, _ = worker.get_finished({req.request_id})
        done |= sending or set()
        if not delayed or req.request_id in done:
            break
        time.sleep(0.01)
    return delayed, done


def test_vllm_connector_saves_then_loads_the_prefix_and_scopes_adapter_and_tenant(node):
    sched = connector(node, KVConnectorRole.SCHEDULER)
    worker = connector(node, KVConnectorRole.WORKER)
    try:
        from quillcache.connectors.vllm import QuillCacheConnector
        assert isinstance(worker, QuillCacheConnector) and worker.role == KVConnectorRole.WORKER
        g = torch.Generator().manual_seed(3)
        caches = {f"model.layers.{i}.attn": torch.randn(2, NBLOCKS, BS, KVH, HD, generator=g)
                  for i in range(LAYERS)}
        worker.register_kv_caches(caches)
        layers = list(caches.values())
        prompt = list(range(1000, 1000 + 4 * BS + 5))           # 4 full blocks + 5 tokens

        # request A (adapter a, tenant acme): nothing in the pool; its 4 full blocks are saved
        a = request("A", prompt, "a", "tenant=acme")
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        step(sched, worker, layers, a, [0, 1, 2, 3, 4], 0)
        assert finish(sched, worker, a, [0, 1, 2, 3, 4]) == (True, {"A"})   # held until saved
        assert worker.stats()["saved_blocks"] == 4

        # request B: same prompt prefix + another suffix, same identity: 4 blocks matched and loaded
        b = request("B", prompt[:4 * BS] + [7, 8, 9], "a", "tenant=acme")
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, False)
        step(sched, worker, layers, b, [10, 11, 12, 13, 14], 4 * BS)
        for i, c in enumerate(layers):
            assert torch.equal(c[:, 10:14], c[:, 0:4]), f"layer {i}: loaded blocks differ"
        assert worker.get_block_ids_with_load_errors() == set()

        # another adapter, another tenant, the base model: the same tokens miss
        assert sched.get_num_new_matched_tokens(request("C", prompt, "b", "tenant=acme"), 0) == (0, False)
        assert sched.get_num_new_matched_tokens(request("D", prompt, "a", "tenant=other"), 0) == (0, False)
        assert sched.get_num_new_matched_tokens(request("E", prompt, None, "tenant=acme"), 0) == (0, False)

        # the node gone: the matched prefix loads nothing, the blocks are reported for recompute
        node.stop()
        step(sched, worker, layers, request("F", prompt, "a", "tenant=acme"), [15, 16, 17, 18, 19], 4 * BS)
        assert worker.get_block_ids_with_load_errors() == {15, 16, 17, 18}
        assert worker.stats()["load_errors"] == 1
    finally:
        sched.shutdown()
        worker.shutdown()
