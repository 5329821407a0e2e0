"""The vLLM V1 connector, built by vLLM's own KVConnectorFactory from a real VllmConfig and driven
in the engine's call order (scheduler: get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta; worker: bind, start_load_kv, wait_for_layer_load, save_kv_layer,
wait_for_save, get_finished; scheduler: request_finished) with real Request objects and their
real block hashes, against a real quillcached.  Tested against vllm 0.33.0."""
from __future__ import annotations

import copy
import logging
import time

import pytest

from tests._support import engines, engines_doc
from tests._support.daemon import Daemon
from tests._support.engine_node import EngineNode

pytestmark = pytest.mark.engines
torch = engines.require("torch")
engines.require("vllm")

from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock, get_request_block_hasher, init_none_hash, maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BS, LAYERS, NBLOCKS, KVH, HD = 16, 3, 24, 2, 32


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def connector(node, role, *, tp: int = 1, rank: int = 0, **extra):
    cfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
                     kv_transfer_config=KVTransferConfig(
        kv_connector="QuillCacheConnector", kv_connector_module_path="quillcache.connectors.vllm",
        kv_role="kv_both", kv_connector_extra_config={
            "address": f"unix:{node.data_dir / 'quillcached.sock'}", "model": "tiny", "block_size": BS,
            "tokenizer_id": "tiny-tok", "dtype": "float32", **extra}))
    return KVConnectorFactory.create_connector(cfg, role, None)


def request(rid: str, tokens: list[int], lora: str | None = None, salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=LoRARequest(lora, 1 if lora == "a" else 2, f"/loras/{lora}") if lora else None,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def step(sched, worker, caches, req, block_ids, hit_tokens, workers=()):
    """One scheduler step for a new request, then the worker's forward (every worker's: the
    same metadata is broadcast to each TP rank), in vLLM's order."""
    blocks = KVCacheBlocks((([KVCacheBlock(b) for b in block_ids]),))
    sched.update_state_after_alloc(req, blocks, hit_tokens)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (block_ids,))]
    out.num_scheduled_tokens = {req.request_id: req.num_prompt_tokens - req.num_computed_tokens - hit_tokens}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    meta = sched.build_connector_meta(out)
    for w, layers in [(worker, caches), *workers]:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for i, c in enumerate(layers):
            w.wait_for_layer_load(f"model.layers.{i}.attn")
            w.save_kv_layer(f"model.layers.{i}.attn", c, None)
        w.wait_for_save()
        w.clear_connector_metadata()
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


def test_vllm_tp_ranks_keep_their_own_shards_and_stored_blocks_become_events_once_all_ranks_stored(node):
    sched = connector(node, KVConnectorRole.SCHEDULER, tp=2, events=True)
    w0 = connector(node, KVConnectorRole.WORKER, tp=2, rank=0, events=True)
    w1 = connector(node, KVConnectorRole.WORKER, tp=2, rank=1, events=True)
    try:
        g = torch.Generator().manual_seed(11)
        shards = []
        for w in (w0, w1):                   # each rank holds other bytes (its KV heads)
            kv = {f"model.layers.{i}.attn": torch.randn(2, NBLOCKS, BS, KVH, HD, generator=g) for i in range(LAYERS)}
            w.register_kv_caches(kv)
            shards.append(list(kv.values()))
        assert (w0.tp_rank, w1.tp_rank) == (0, 1)
        prompt = list(range(3000, 3000 + 3 * BS + 2))
        a = request("A", prompt, "a", "tenant=acme")
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        step(sched, w0, shards[0], a, [0, 1, 2, 3], 0, workers=[(w1, shards[1])])

        # vLLM's own aggregator merges the two workers' outputs; the scheduler publishes an
        # event only for blocks both ranks stored
        agg = KVOutputAggregator(expected_finished_count=2)
        events = []
        for _ in range(200):
            outs = []
            for w in (w0, w1):
                o = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
                o.kv_connector_output = KVConnectorOutput(kv_cache_events=w.get_kv_connector_kv_cache_events())
                outs.append(o)
            sched.update_connector_output(agg.aggregate(outs).kv_connector_output)
            events += list(sched.take_events())
            if events:
                break
            time.sleep(0.01)
        assert len(events) == 1 and isinstance(events[0], BlockStored)
        ev = events[0]
        # the hashes as vLLM's own events carry them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        assert ev.block_hashes == [maybe_convert_block_hash(h) for h in a.block_hashes[:3]]
        assert ev.parent_block_hash is None
        assert ev.token_ids == prompt[:3 * BS] and ev.block_size == BS and ev.lora_name == "a"
        assert ev.medium == "STORAGE"
        assert list(sched.take_events()) == []
        KVEventBatch(ts=0.0, events=events)              # what the scheduler hands its publisher

        # only rank 1 stored request B's blocks: no event until rank 0's arrive in a later step
        b = request("B", list(range(5000, 5000 + BS + 1)), None, "tenant=acme")
        step(sched, w1, shards[1], b, [5, 6], 0)
        deadline = time.monotonic() + 5
        got1 = []
        while not got1 and time.monotonic() < deadline:
            got1 = w1.get_kv_connector_kv_cache_events().get_all_events()
            time.sleep(0.01)
        half = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        c1 = w1.get_kv_connector_kv_cache_events()
        c1.add_events(got1)
        c1.increment_workers(1)                            # rank 0 reported nothing this step
        half.kv_connector_output = KVConnectorOutput(kv_cache_events=c1)
        sched.update_connector_output(half.kv_connector_output)
        assert list(sched.take_events()) == []

        # loads: each rank gets its own shard back (rank-scoped keys), bytes for bytes
        c = request("C", prompt[:3 * BS] + [1, 2], "a", "tenant=acme")
        assert sched.get_num_new_matched_tokens(c, 0) == (3 * BS, False)
        step(sched, w0, shards[0], c, [10, 11, 12, 13], 3 * BS, workers=[(w1, shards[1])])
        for r, layers in enumerate(shards):
            for i, t in enumerate(layers):
                assert torch.equal(t[:, 10:13], t[:, 0:3]), f"rank {r} layer {i}: not its own shard"
        assert not torch.equal(shards[0][0][:, 10:13], shards[1][0][:, 0:3])
        assert w0.get_block_ids_with_load_errors() == set() == w1.get_block_ids_with_load_errors()
    finally:
        for c in (sched, w0, w1):
            c.shutdown()


# ---------------------------------------------------------------------- docs/engines.md, auth on

@pytest.fixture
def auth_node(tmp_path):
    with EngineNode(tmp_path) as d:
        yield d


def doc_connector(node, role, via: str, token_file):
    """The connector exactly as docs/engines.md's command line configures it (its JSON, with
    this node's address and token file), built by vLLM's factory from a real VllmConfig."""
    (j, *_) = engines_doc.doc_json("quillcache.connectors.vllm")
    j = engines_doc.for_node(j, node.addresses[via], str(token_file))
    return KVConnectorFactory.create_connector(VllmConfig(kv_transfer_config=KVTransferConfig(**j)), role, None)


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_following_the_doc_with_auth_on_the_second_request_hits(auth_node, via):
    sched = doc_connector(auth_node, KVConnectorRole.SCHEDULER, via, auth_node.token_file)
    worker = doc_connector(auth_node, KVConnectorRole.WORKER, via, auth_node.token_file)
    try:
        g = torch.Generator().manual_seed(21)
        caches = {f"model.layers.{i}.attn": torch.randn(2, NBLOCKS, BS, KVH, HD, generator=g) for i in range(LAYERS)}
        worker.register_kv_caches(caches)
        layers = list(caches.values())
        prompt = list(range(7000, 7000 + 3 * BS + 1))
        first = request("A", prompt, None, "tenant=acme")       # the engine acts for tenant acme
        assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
        step(sched, worker, layers, first, [0, 1, 2, 3], 0)
        assert finish(sched, worker, first, [0, 1, 2, 3]) == (True, {"A"})
        second = request("B", prompt, None, "tenant=acme")
        assert sched.get_num_new_matched_tokens(second, 0) == (3 * BS, False)
        step(sched, worker, layers, second, [8, 9, 10, 11], 3 * BS)
        for i, c in enumerate(layers):
            assert torch.equal(c[:, 8:11], c[:, 0:3]), f"layer {i}: the hit loaded other bytes"
        assert worker.get_block_ids_with_load_errors() == set()
        s, w = sched.stats(), worker.stats()
        assert s["hit_blocks"] == 3 and s["connect_errors"] == 0 and w["loaded_blocks"] == 3
        assert sched.core.connected_to == auth_node.addresses[via]
        assert auth_node.token not in repr(sched.core)
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_a_wrong_token_is_one_logged_error_and_every_lookup_misses(auth_node, via, caplog):
    with caplog.at_level(logging.ERROR, logger="quillcache.connectors"):
        sched = doc_connector(auth_node, KVConnectorRole.SCHEDULER, via, auth_node.wrong_token_file)
        try:
            prompt = list(range(8000, 8000 + 3 * BS + 1))
            assert sched.get_num_new_matched_tokens(request("A", prompt), 0) == (0, False)
            assert sched.get_num_new_matched_tokens(request("B", prompt), 0) == (0, False)
            s = sched.stats()
            assert s["connect_errors"] >= 2 and s["lookup_errors"] == 2 and s["hit_blocks"] == 0
        finally:
            sched.shutdown()
    errors = [r.getMessage() for r in caplog.records if r.name == "quillcache.connectors"]
    assert len(errors) == 1, errors
    assert errors[0].startswith("vLLM scheduler connector: cannot use the node")
    assert auth_node.addresses[via] in errors[0] and "token matches no tenant" in errors[0]
    assert "not-the-token" not in errors[0]


def test_a_typo_in_the_settings_is_a_warning_and_a_bad_value_stops_the_connector_with_its_name(auth_node, caplog):
    from quillcache.connectors.settings import SettingError
    with caplog.at_level(logging.WARNING, logger="quillcache.connectors.vllm"):
        c = connector(auth_node, KVConnectorRole.SCHEDULER, adress="127.0.0.1:1", token_file=str(auth_node.token_file))
        c.shutdown()
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "quillcache.connectors.vllm"]
    assert "kv_connector_extra_config: unknown QuillCache setting(s) adress ignored" in warning
    with pytest.raises(SettingError, match="kv_connector_extra_config: timeout_s = 'soon': not a number of seconds"):
        connector(auth_node, KVConnectorRole.SCHEDULER, timeout_s="soon")
    with pytest.raises(SettingError, match="token_file '/nonexistent/token': No such file"):
        connector(auth_node, KVConnectorRole.SCHEDULER, token_file="/nonexistent/token")


@pytest.mark.parametrize("program", ["vllm", "lmcache"])
def test_the_docs_command_line_parses_with_vllm_serves_own_parser(program):
    """docs/engines.md's `vllm serve ...` lines (QuillCache's connector, and LMCache's with
    LMCACHE_CONFIG_FILE) through vLLM's own `serve` argument parser."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    argv = engines_doc.engine_command(program)
    if program == "lmcache":
        env, argv = argv[0], argv[1:]
        assert env == "LMCACHE_CONFIG_FILE=/etc/quillcache/lmcache.yaml"
    assert argv[:2] == ["vllm", "serve"]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    kv = ns.kv_transfer_config
    assert isinstance(kv, KVTransferConfig) and kv.kv_role == "kv_both"
    if program == "vllm":
        assert (kv.kv_connector, kv.kv_connector_module_path) == ("QuillCacheConnector", "quillcache.connectors.vllm")
        assert kv.kv_connector_extra_config == {"address": "unix:/run/quillcache/quillcached.sock",
                                                "token_file": "/etc/quillcache/engine.token"}
    else:
        assert kv.kv_connector == "LMCacheConnectorV1"
