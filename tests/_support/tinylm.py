"""The tiny seeded transformer of the connector tests (CPU torch): GQA attention with RoPE and an
MLP, its KV in paged caches laid out as vLLM lays them (per layer ``[2, num_blocks, block_size,
kv_heads, head_size]``), and the helpers that move one block of every layer as one buffer.
Used by tests/connectors/test_real_tensors.py and test_kvquant.py."""
from __future__ import annotations

import math

from tests._support import engines

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
