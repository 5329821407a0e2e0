"""Our KV-event codec and consumer against the real engines' encoders and publishers
(vLLM 0.33.0, SGLang 0.5.23; run in the engines venv, see docs and the Makefile).

- vLLM's msgspec encoder -> our decoder, and our encoder -> vLLM's msgspec decoder.
- A real vLLM ZmqEventPublisher (EventPublisherFactory) -> our SUB consumer, including a
  sequence gap filled by vLLM's own replay ROUTER.
- SGLang's array-like batches -> our decoder.
Endpoints are ipc:// under tmp_path: vLLM binds ipc (it connects to a non-wildcard tcp one)."""
from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.engines

vkv = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")

from quillcache.control.events import (  # noqa: E402
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventConsumer, decode_batch, encode_batch,
)
from quillcache.control.indexer import ArtIndexer, chain_hashes  # noqa: E402
from quillcache.model import IdentityScope  # noqa: E402

VLLM_VERSION = pytest.importorskip("vllm").__version__


def vllm_batch():
    stored = vkv.BlockStored(block_hashes=[b"\x11" * 32, b"\x22" * 32], parent_block_hash=None,
                             token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
                             lora_name=None, group_idx=0)
    stored2 = vkv.BlockStored(block_hashes=[b"\x33" * 32], parent_block_hash=b"\x22" * 32,
                              token_ids=list(range(32, 48)), block_size=16, lora_id=7, medium="CPU",
                              lora_name="ad1")
    removed = vkv.BlockRemoved(block_hashes=[b"\x11" * 32], medium="GPU")
    return vkv.KVEventBatch(ts=1.5, events=[stored, stored2, removed, vkv.AllBlocksCleared()],
                            data_parallel_rank=0)


def test_vllm_encoder_to_our_decoder():
    assert VLLM_VERSION == "0.33.0"
    payload = msgspec.msgpack.Encoder().encode(vllm_batch())
    got = decode_batch(payload)
    assert got == EventBatch(1.5, (
        BlockStored((b"\x11" * 32, b"\x22" * 32), None, tuple(range(32)), 16, None, "GPU", None),
        BlockStored((b"\x33" * 32,), b"\x22" * 32, tuple(range(32, 48)), 16, 7, "CPU", "ad1"),
        BlockRemoved((b"\x11" * 32,), "GPU"),
        AllBlocksCleared(),
    ), 0)


def test_our_encoder_to_the_vllm_decoder():
    ours = EventBatch(2.0, (BlockStored((5, 6), 4, tuple(range(8)), 4, None, "CPU", "ad1",
                                        ("acme", "m", "t", "ad1")),
                            BlockRemoved((5,), "CPU"), AllBlocksCleared()), 3)
    theirs = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(encode_batch(ours))
    assert theirs.ts == 2.0 and theirs.data_parallel_rank == 3
    st, rm, cl = theirs.events
    assert (st.block_hashes, st.parent_block_hash, st.token_ids, st.block_size, st.medium, st.lora_name) == \
        ([5, 6], 4, list(range(8)), 4, "CPU", "ad1")
    assert isinstance(rm, vkv.BlockRemoved) and rm.block_hashes == [5]
    assert isinstance(cl, vkv.AllBlocksCleared)


def _vllm_publisher(tmp_path, buffer_steps=100):
    from vllm.config.kv_events import KVEventsConfig
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                         buffer_steps=buffer_steps, topic="kv@w0")
    return vkv.EventPublisherFactory.create(cfg, 0), cfg


def test_real_vllm_publisher_feeds_the_indexer_and_a_gap_is_replayed(tmp_path):
    pub, cfg = _vllm_publisher(tmp_path)
    seen = []
    idx = ArtIndexer()
    scope = IdentityScope("m", "t", None, "acme")

    def on_batch(seq, batch):
        seen.append(seq)
        idx.apply("w0", batch, scope)

    toks = list(range(64))
    blocks = [bytes([i]) * 32 for i in range(4)]
    # Published before the SUB exists: the consumer only learns of it from the gap when a
    # later batch arrives, and fetches it from vLLM's replay socket.
    pub.publish(vkv.KVEventBatch(ts=0.0, events=[vkv.BlockStored(
        block_hashes=blocks[:2], parent_block_hash=None, token_ids=toks[:32], block_size=16,
        lora_id=None, medium="GPU", lora_name=None)]))
    time.sleep(0.3)
    con = EventConsumer(cfg.endpoint, on_batch, replay_endpoint=cfg.replay_endpoint, topic=b"kv@w0")
    try:
        con.stats.last_seq = -1          # this consumer starts at the stream's beginning
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            pub.publish(vkv.KVEventBatch(ts=1.0, events=[vkv.BlockStored(
                block_hashes=blocks[2:], parent_block_hash=blocks[1], token_ids=toks[32:],
                block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
            con.poll(0.2)
        assert seen[0] == 0 and con.stats.gaps == 1 and con.stats.replayed >= 1
        assert seen == sorted(seen) and len(set(seen)) == len(seen)
        m = idx.find_matches(scope, chain_hashes(toks, 16))
        assert m.as_dict()["w0"] == (4, 0, 0, 0, 0)
    finally:
        con.close()
        pub.shutdown()


def test_sglang_batches_decode():
    skv = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    batch = skv.KVEventBatch(ts=3.0, events=[
        skv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)),
                        block_size=4, lora_id=None),
        skv.BlockRemoved(block_hashes=[2]), skv.AllBlocksCleared()])
    got = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert got.events == (BlockStored((1, 2), None, tuple(range(8)), 4), BlockRemoved((2,)),
                          AllBlocksCleared())
