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

import math

import pytest

from quillcache.connectors.core import ConnectorCore, chain_keys, model_scope
from quillcache.model import IdentityScope
from tests._support import engines
from tests._support.daemon import Daemon

pytestmark = pytest.mark.engines
torch = engines.require("torch")

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD, VOCAB = 2, 128, 4, 2, 32, 512
BLOCK_TOKENS, NUM_BLOCKS = 16, 32
DTYPE = torch.float32


class TinyLM(torch.nn.Module):
    """A decoder (GQA attention with RoPE, MLP); ``lora`` adds a rank-8 delta to q/k/v (an adapter)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=DTYPE) / math.sqrt(s[-1])
        self.emb = r(VOCAB, HIDDEN) * math.sqrt(HIDDEN)
        self.wq = [r(HEADS * HEAD, HIDDEN) for _ in range(LAYERS)]
        self.wkv = [r(2 * KV_HEADS * HEAD, HIDDEN) for _ in range(LAYERS)]
        self.wo = [r(HIDDEN, HEADS * HEAD) for _ in range(LAYERS)]
        self.w1 = [r(4 * HIDDEN, HIDDEN) for _ in range(LAYERS)]
        self.w2 = [r(HIDDEN, 4 * HIDDEN) for _ in range(LAYERS)]
        self.out = r(VOCAB, HIDDEN)
        self.lora = {}
        for name, s in (("lora-a", 101), ("lora-b", 202)):
            ga = torch.Generator().manual_seed(s)
            self.lora[name] = [(torch.randn(2 * KV_HEADS * HEAD, 8, generator=ga) * 0.5,
                                torch.randn(8, HIDDEN, generator=ga) / math.sqrt(HIDDEN)) for _ in range(LAYERS)]

    @staticmethod
    def rope(x, pos):
        half = HEAD // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=DTYPE) / half))
        ang = pos[:, None].to(DTYPE) * freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, tokens, start: int, kv_cache, block_table, adapter=None):
        """Prefill ``tokens`` at positions start.. ; the KV of positions < start is read from the
        paged cache (``block_table``), the new KV is written into it.  Returns the logits."""
        n = len(tokens)
        pos = torch.arange(start, start + n)
        x = self.emb[tokens]
        for layer in range(LAYERS):
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            q = (h @ self.wq[layer].T).view(n, HEADS, HEAD)
            kv = h @ self.wkv[layer].T
            if adapter is not None:
                a, b = self.lora[adapter][layer]
                kv = kv + (h @ b.T) @ a.T
            k, v = kv.view(n, 2, KV_HEADS, HEAD).unbind(1)
            q, k = self.rope(q, pos), self.rope(k, pos)
            cache = kv_cache[layer]                      # [2, blocks, block_tokens, kv_heads, head]
            for i in range(n):                           # write the new KV into its pages
                p = start + i
                blk, off = block_table[p // BLOCK_TOKENS], p % BLOCK_TOKENS
                cache[0, blk, off], cache[1, blk, off] = k[i], v[i]
            total = start + n
            idx = torch.tensor([block_table[p // BLOCK_TOKENS] for p in range(total)])
            off = torch.arange(total) % BLOCK_TOKENS
            keys, vals = cache[0, idx, off], cache[1, idx, off]          # [total, kv_heads, head]
            rep = HEADS // KV_HEADS
            keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            mask = pos[:, None] >= torch.arange(total)[None, :]
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask)
            x = x + att.transpose(0, 1).reshape(n, HEADS * HEAD) @ self.wo[layer].T
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            x = x + torch.nn.functional.silu(h @ self.w1[layer].T) @ self.w2[layer].T
        return torch.nn.functional.rms_norm(x, (HIDDEN,)) @ self.out.T


def new_cache():
    return [torch.zeros(2, NUM_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD, dtype=DTYPE) for _ in range(LAYERS)]


def block_bytes(cache, blk: int):
    """One block of every layer as one contiguous buffer (the connector's unit)."""
    return torch.stack([c[:, blk] for c in cache]).contiguous()


def put_block(cache, blk: int, buf) -> None:
    for layer, c in enumerate(cache):
        c[:, blk] = buf[layer]


def block_hashes(tokens, n_blocks: int):
    """A chained hash per full block (as vLLM chains its block hashes)."""
    import hashlib
    out, prev = [], b""
    for b in range(n_blocks):
        prev = hashlib.sha256(prev + bytes(str(tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS].tolist()),
                                           "ascii")).digest()
        out.append(prev)
    return out


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
