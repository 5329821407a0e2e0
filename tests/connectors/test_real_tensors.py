"""The proof on real tensors (CPU torch): a small seeded transformer with paged KV laid out as
vLLM lays it (per layer ``[2, num_blocks, block_size, kv_heads, head_size]``), its blocks saved
through the connector core into a real quillcached and loaded back for a second request.

- same prefix, same adapter: a hit, and prefilling only the suffix over the loaded KV gives the
  logits of a full prefill (within float32 tolerance);
- another adapter or tenant: a miss (the keys differ), so the engine recomputes;
- forced reuse across adapters (the guard bypassed by loading adapter A's blocks for adapter B):
  logits measurably differ.  The numbers are printed and quoted in docs/identity-safe-reuse.md.

Tested with torch 2.13.0 (CPU); no engine package is imported here.
"""
from __future__ import annotations

import pytest

from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope
from quillcache.model import IdentityScope
from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

from tests._support.tinylm import (  # noqa: E402
    BLOCK_TOKENS, DTYPE, LAYERS, VOCAB, TinyLM, block_bytes, block_hashes, new_cache, put_block,
)

SCOPE = model_scope("tiny", dtype="float32", block_size=BLOCK_TOKENS, num_layers=LAYERS, layout="vllm-2nbhd")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("tensors")) as d:
        c = ConnectorCore(f"unix:{d.data_dir / 'quillcached.sock'}")
        yield c
        c.close()


def test_reloaded_prefix_gives_full_prefill_logits_and_wrong_adapter_misses_or_differs(core):
    torch.manual_seed(0)
    model = TinyLM(seed=7)
    prefix_blocks = 4
    prefix = torch.randint(0, VOCAB, (prefix_blocks * BLOCK_TOKENS,))
    suffix = torch.randint(0, VOCAB, (11,))
    prompt_b = torch.cat([prefix, suffix])
    hashes = block_hashes(prefix, prefix_blocks)
    ident_a = IdentityScope(SCOPE, "tiny-tok", "lora-a", "acme")

    # request A (adapter lora-a): prefill the prefix, save its full blocks through the connector
    cache_a, table_a = new_cache(), list(range(0, 8))
    with torch.no_grad():
        model(prefix, 0, cache_a, table_a, adapter="lora-a")
    keys_a = chain_keys(ident_a, hashes, block_size=BLOCK_TOKENS)
    assert core.save(keys_a, [block_bytes(cache_a, table_a[b]).view(torch.uint8).numpy().reshape(-1)
                              for b in range(prefix_blocks)])

    # request B, same adapter: full prefill (the reference) vs load the prefix + prefill the suffix
    with torch.no_grad():
        ref = model(prompt_b, 0, new_cache(), list(range(8, 16)), adapter="lora-a")
    assert core.lookup(keys_a) == prefix_blocks
    cache_b, table_b = new_cache(), list(range(16, 24))
    shape = block_bytes(cache_b, 0).shape
    bufs = [torch.empty(shape, dtype=DTYPE) for _ in range(prefix_blocks)]
    assert core.load(keys_a, [b.view(torch.uint8).numpy().reshape(-1) for b in bufs]) == prefix_blocks
    for b in range(prefix_blocks):
        put_block(cache_b, table_b[b], bufs[b])
    with torch.no_grad():
        got = model(suffix, len(prefix), cache_b, table_b, adapter="lora-a")
    same = (got - ref[len(prefix):]).abs().max().item()

    # another adapter or tenant: the same engine hashes map to other keys: a miss
    assert core.lookup(chain_keys(IdentityScope(SCOPE, "tiny-tok", "lora-b", "acme"), hashes,
                                  block_size=BLOCK_TOKENS)) == 0
    assert core.lookup(chain_keys(IdentityScope(SCOPE, "tiny-tok", "lora-a", "other"), hashes,
                                  block_size=BLOCK_TOKENS)) == 0

    # forced reuse: adapter A's blocks under a request of adapter B (what a key without the
    # adapter would serve), against B's own full prefill
    with torch.no_grad():
        ref_b = model(prompt_b, 0, new_cache(), list(range(8, 16)), adapter="lora-b")
        cache_x, table_x = new_cache(), list(range(24, 32))
        for b in range(prefix_blocks):
            put_block(cache_x, table_x[b], bufs[b])
        wrong = model(suffix, len(prefix), cache_x, table_x, adapter="lora-b")
    cross = (wrong - ref_b[len(prefix):]).abs().max().item()
    top1_changed = (wrong.argmax(-1) != ref_b[len(prefix):].argmax(-1)).float().mean().item()
    scale = ref.abs().max().item()
    print(f"\nlogit max|diff|: same adapter {same:.3g}, forced cross-adapter {cross:.3g} "
          f"(logit scale {scale:.3g}); top-1 changed on {top1_changed:.0%} of suffix tokens")
    assert same <= 1e-4 * max(1.0, scale)
    assert cross > 1000 * max(same, 1e-6)
