"""connectors/kvquant.py through PagedKVWorker on CPU torch against a real quillcached:
``kv_dtype = "fp8_e4m3"`` quantizes on save (a float32 scale per block, layer and K/V beside
the e4m3 bytes) and dequantizes on load; the stored dtype is in the keys' scope, so a reader
that expects bf16 never gets an FP8 block.

The agreement figures use the 2-layer GQA/RoPE model of test_real_tensors.py: a 512-token
prefix saved through the worker, loaded into fresh caches, then a 1,000-token suffix prefilled
over it, against a full prefill of the whole prompt; once through FP8 and once through a
full-precision reload, for scale.  torch 2.13.0 (CPU), no engine imported."""
from __future__ import annotations

import time

import pytest

from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

from quillcache.client import Client  # noqa: E402
from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope  # noqa: E402
from quillcache.model import IdentityScope  # noqa: E402
from quillcache.connectors.kvquant import FP8_E4M3_MAX, make_codec  # noqa: E402
from quillcache.connectors.paged import PagedKVWorker, Transfer  # noqa: E402
from quillcache.errors import NotFound, UnsafeReuse  # noqa: E402
from tests._support.tinylm import (  # noqa: E402
    BLOCK_TOKENS, DTYPE, HEAD, KV_HEADS, LAYERS, VOCAB, TinyLM, block_hashes,
)

PREFIX_BLOCKS = 32               # 512 tokens reloaded
SUFFIX = 1000                    # suffix positions compared
CACHE_BLOCKS = 96                # (512 + 1000) / 16 rounded up, per layer
MIN_TOP1 = 0.99                  # top-1 agreement of the FP8 reload against full prefill


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("kvquant"), dram="256MiB") as d:
        yield d


def sock(node) -> str:
    return f"unix:{node.data_dir / 'quillcached.sock'}"


def paged(dtype=DTYPE, blocks=CACHE_BLOCKS) -> dict:
    return {f"layers.{i}.attn": torch.zeros(2, blocks, BLOCK_TOKENS, KV_HEADS, HEAD, dtype=dtype)
            for i in range(LAYERS)}


def scope(stored_dtype: str) -> str:
    return model_scope("tiny", dtype=stored_dtype, block_size=BLOCK_TOKENS, num_layers=LAYERS, layout="vllm-2nbhd")


def saved(worker: PagedKVWorker, t: Transfer) -> None:
    worker.wait_for_save([t])
    deadline = time.monotonic() + 30
    while not worker.get_finished({t.req_id}):
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.01)


def loaded(worker: PagedKVWorker, t: Transfer, names) -> set:
    worker.start_load_kv([t])
    for name in names:
        worker.wait_for_layer_load(name)
    return worker.take_load_errors()


# ---------------------------------------------------------------- the codec


def test_fp8_codec_keeps_each_value_within_e4m3_precision_of_its_group_scale():
    g = torch.Generator().manual_seed(3)
    shape = (LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD)
    blocks = torch.randn(5, *shape, generator=g) * torch.logspace(-3, 2, 5)[:, None, None, None, None, None]
    blocks[2, 1, 0] = 0.0                                        # an all-zero (layer, K/V) group
    codec = make_codec("fp8_e4m3", torch.float32)
    rows = codec.encode(blocks)
    assert rows.dtype == torch.uint8 and rows.shape == (5, codec.stored_nbytes(shape, 4))
    assert codec.stored_nbytes(shape, 2) == LAYERS * 2 * 4 + blocks[0].numel()   # about half of bf16
    back = codec.decode(rows, shape)
    assert back.dtype == torch.float32 and back.shape == blocks.shape
    groups = blocks.reshape(5, LAYERS * 2, -1)
    scale = groups.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX
    err = (back.reshape(5, LAYERS * 2, -1) - groups).abs()
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals spaced 2^-9 of the scale
    assert bool((err <= groups.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-12).all())
    assert bool((back[2, 1, 0] == 0).all())
    assert make_codec(None, torch.bfloat16).scope_dtype == "bfloat16"
    assert make_codec("bfloat16", torch.bfloat16).quantized is False
    with pytest.raises(ValueError):
        make_codec("int4", torch.bfloat16)


def test_fp8_encode_in_slices_gives_the_bytes_of_one_whole_pass(monkeypatch):
    """encode quantizes ENCODE_CHUNK_BYTES of float32 at a time (a 128k-token save would need
    32 GiB of temporaries whole); slicing changes no byte, also where the slice is not a divisor."""
    from quillcache.connectors import kvquant
    g = torch.Generator().manual_seed(5)
    shape = (LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD)
    blocks = torch.randn(7, *shape, generator=g) * torch.logspace(-2, 2, 7)[:, None, None, None, None, None]
    codec = make_codec("fp8_e4m3", torch.float32)
    whole = codec.encode(blocks)
    per_block = blocks[0].numel() * 4
    for chunk in (1, 2 * per_block, 3 * per_block):
        monkeypatch.setattr(kvquant, "ENCODE_CHUNK_BYTES", chunk)
        assert torch.equal(codec.encode(blocks), whole), chunk


# ---------------------------------------------------------------- through the worker, on the model


def _reload_figures(node, kv_dtype, tenant: str) -> tuple[float, float, float]:
    """(max |logit diff|, top-1 agreement, logit scale) of prefix-reloaded + suffix prefill
    against a full prefill, the prefix stored through the worker with ``kv_dtype``."""
    torch.manual_seed(0)
    model = TinyLM(seed=7)
    prefix = torch.randint(0, VOCAB, (PREFIX_BLOCKS * BLOCK_TOKENS,))
    suffix = torch.randint(0, VOCAB, (SUFFIX,))
    prompt = torch.cat([prefix, suffix])
    table = list(range(CACHE_BLOCKS))
    core = ConnectorCore(sock(node), timeout=30)
    try:
        writer = PagedKVWorker(core, kv_dtype=kv_dtype)
        kv_a = paged()
        writer.register_kv_caches(kv_a)
        with torch.no_grad():
            model(prefix, 0, list(kv_a.values()), table)
        keys = chain_keys(IdentityScope(scope(writer.codec.scope_dtype), "tiny-tok", None, tenant),
                          block_hashes(prefix, PREFIX_BLOCKS), block_size=BLOCK_TOKENS)
        saved(writer, Transfer("A", keys, table[:PREFIX_BLOCKS]))

        reader = PagedKVWorker(core, kv_dtype=kv_dtype)
        kv_b = paged()
        reader.register_kv_caches(kv_b)
        assert loaded(reader, Transfer("B", keys, table[:PREFIX_BLOCKS]), kv_b) == set()
        with torch.no_grad():
            ref = model(prompt, 0, list(paged().values()), table)[len(prefix):]
            got = model(suffix, len(prefix), list(kv_b.values()), table)
    finally:
        core.close()
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return diff, top1, ref.abs().max().item()


def test_fp8_reload_agrees_with_full_prefill_on_1000_suffix_positions(node):
    fp8_diff, fp8_top1, scale = _reload_figures(node, "fp8_e4m3", "fp8")
    full_diff, full_top1, _ = _reload_figures(node, None, "full")
    print(f"\nreloaded {PREFIX_BLOCKS * BLOCK_TOKENS}-token prefix + {SUFFIX}-token suffix vs full prefill "
          f"(logit scale {scale:.3g}): FP8 e4m3 max|diff| {fp8_diff:.4g}, top-1 agreement {fp8_top1:.2%}; "
          f"full-precision ({DTYPE}) max|diff| {full_diff:.3g}, top-1 agreement {full_top1:.2%}")
    assert fp8_top1 >= MIN_TOP1
    assert full_top1 == 1.0 and full_diff <= 1e-4 * max(1.0, scale)
    assert fp8_diff > 10 * full_diff                  # the FP8 path really went through e4m3


def test_a_bf16_reader_never_gets_an_fp8_block(node, tmp_path):
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    core = ConnectorCore(sock(node), timeout=10)
    try:
        writer = PagedKVWorker(core, kv_dtype="fp8_e4m3")
        kv_w = paged(torch.bfloat16, blocks=8)
        for c in kv_w.values():
            c.normal_()
        writer.register_kv_caches(kv_w)
        fp8_keys = chain_keys(IdentityScope(scope(writer.codec.scope_dtype), "tok", None, "guard"), hashes,
                              block_size=BLOCK_TOKENS)
        saved(writer, Transfer("W", fp8_keys, [0, 1, 2, 3]))
        assert core.lookup(fp8_keys) == 4

        reader = PagedKVWorker(core)                     # kv_dtype default: the caches' bf16
        kv_r = paged(torch.bfloat16, blocks=8)
        reader.register_kv_caches(kv_r)
        assert reader.codec.scope_dtype == "bfloat16"
        bf16_keys = chain_keys(IdentityScope(scope(reader.codec.scope_dtype), "tok", None, "guard"), hashes,
                               block_size=BLOCK_TOKENS)
        assert core.lookup(bf16_keys) == 0                # the scheduler sees a miss
        before = [c.clone() for c in kv_r.values()]
        assert loaded(reader, Transfer("R", bf16_keys, [4, 5, 6, 7]), kv_r) == {4, 5, 6, 7}   # recompute
        assert all(torch.equal(a, b) for a, b in zip(before, kv_r.values()))
    finally:
        core.close()
    with Client(sock(node)) as c:                         # asked directly: the guard refuses the other scope
        with pytest.raises((NotFound, UnsafeReuse)):
            c.get(bf16_keys[0])
