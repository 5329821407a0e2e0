"""Recompute a prefix, or reload its KV through the pool: a Llama-3-8B-shaped model on one GPU.

The model has random bf16 weights (32 layers, hidden 4096, 32 heads, 8 KV heads x 128,
MLP 14336, vocab 128256, RoPE, SDPA attention); only its shape matters for time.  For a
prefix of P tokens and a suffix of 128:

  recompute       prefill of P + 128 tokens
  reload shm      ArenaCopier.load of the prefix KV (located GET, arena -> device on one
                  stream from the registered mapping) + prefill of the 128 suffix tokens
  reload tcp      get_many_into a pinned host buffer over loopback TCP, one host -> device
                  copy, + the suffix (the path before issue 12)

plus the raw device <-> arena rate of save/load (1 GiB in 4 MiB blocks).  The KV is stored
per (layer, K or V, chunk of CHUNK_TOKENS tokens): 1 MiB blocks, 128 KiB per token in all.
Reloaded and recomputed logits of the last token are compared (max |diff|; bf16 and another
attention kernel for the suffix make them close, not equal).

    PYTHONPATH=DIR python3 bench/gpu_reload.py [--prefix 2048,8192,16384] [--rounds 5]

It starts its own DRAM-only quillcached (TCP + Unix socket).  Without a CUDA device it
prints ``skipped: no CUDA device`` and exits 0.  Time-bounded: sizes left when
TIME_BUDGET_S is spent are reported as skipped.

Targets (issue 12, H200): arena -> device >= 40 GB/s; reload + suffix <= 1/3 of recompute
at 2k tokens, <= 1/5 at 8k and 16k.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
ROPE_THETA = 500000.0
SUFFIX = 128                    # tokens prefilled after the prefix
CHUNK_TOKENS = 512              # tokens per stored block (one layer, K or V): 1 MiB
TIME_BUDGET_S = 240.0           # seconds: the whole run stays under 5 minutes
RAW_BYTES = 1 << 30             # bytes moved by the raw device <-> arena measurement
RAW_BLOCK = 4 << 20             # bytes per block there
TCP_BATCH = 128                 # keys per GET_MANY on the TCP baseline (128 MiB replies)


def skip(reason: str) -> int:
    print(f"skipped: {reason}")
    return 0


class Model:
    def __init__(self, torch, device):
        self.t = torch
        self.dev = device
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape, std=0.02):
            return torch.empty(*shape, dtype=torch.bfloat16, device=device).normal_(0, std, generator=g)

        self.emb = w(VOCAB, HIDDEN)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(dict(
                n1=torch.ones(HIDDEN, dtype=torch.bfloat16, device=device),
                n2=torch.ones(HIDDEN, dtype=torch.bfloat16, device=device),
                wqkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), wo=w(HIDDEN, HEADS * HEAD_DIM),
                wgu=w(2 * MLP, HIDDEN), wd=w(HIDDEN, MLP)))
        self.norm = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
        self.head = w(VOCAB, HIDDEN)
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=device,
                                                           dtype=torch.float32) / HEAD_DIM))
        self.gqa = self._gqa_supported()

    def _gqa_supported(self) -> bool:
        t = self.t
        q = t.zeros(1, HEADS, 4, HEAD_DIM, dtype=t.bfloat16, device=self.dev)
        kv = t.zeros(1, KV_HEADS, 4, HEAD_DIM, dtype=t.bfloat16, device=self.dev)
        try:
            t.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):
            return False
        return True

    def _rms(self, x, w):
        F = self.t.nn.functional
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (HIDDEN,), w, 1e-5)
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.t.rsqrt(v + 1e-5)).to(x.dtype) * w

    def _rope(self, x, cos, sin):
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
        return self.t.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)

    def _attend(self, q, k, v, mask):
        F = self.t.nn.functional
        q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if self.gqa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        else:
            rep = HEADS // KV_HEADS
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=mask, is_causal=mask is None)
        return o[0].transpose(0, 1)

    def forward(self, ids, cache=None, P: int = 0):
        """ids [T] at positions P..P+T.  ``cache``: per layer (K, V) buffers of at least P+T
        rows whose first P hold the prefix; the new rows are written after them (as an engine
        writes its paged cache).  Without a cache the T tokens attend to themselves (a full
        prefill).  Returns (logits of the last token, [(k, v)] of these T tokens)."""
        t = self.t
        F = t.nn.functional
        T = ids.numel()
        f = t.outer(t.arange(P, P + T, device=self.dev).float(), self.inv_freq)
        cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
        x = self.emb[ids]
        new_kv = []
        mask = None
        if cache is not None:      # suffix queries see the whole prefix and themselves causally
            mask = t.ones(T, P + T, dtype=t.bool, device=self.dev).tril(diagonal=P)
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["n1"])
            q, k, v = (h @ L["wqkv"].T).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q = self._rope(q.view(T, HEADS, HEAD_DIM), cos, sin)
            k = self._rope(k.reshape(T, KV_HEADS, HEAD_DIM), cos, sin)
            v = v.reshape(T, KV_HEADS, HEAD_DIM)
            if cache is None:
                k, v = k.contiguous(), v.contiguous()
                new_kv.append((k, v))
            else:
                kc, vc = cache[i]
                kc[P:P + T] = k
                vc[P:P + T] = v
                k, v = kc[:P + T], vc[:P + T]
            o = self._attend(q, k, v, mask)
            x = x + o.reshape(T, HEADS * HEAD_DIM) @ L["wo"].T
            h = self._rms(x, L["n2"])
            gate, up = (h @ L["wgu"].T).split([MLP, MLP], -1)
            x = x + (F.silu(gate) * up) @ L["wd"].T
        logits = self._rms(x[-1:], self.norm) @ self.head.T
        return logits.float(), new_kv


def kv_keys(P: int, tag: str):
    from quillcache import KvBlockKey
    keys = []
    for layer in range(LAYERS):
        for kind in "kv":
            for c in range(P // CHUNK_TOKENS):
                keys.append(KvBlockKey("llama-3-8b-shape", "tok", None, "", tag, f"{layer}{kind}{c}", 0,
                                       CHUNK_TOKENS))
    return keys


def kv_views(kv, P: int):
    """The tensors matching kv_keys: per layer, K then V, each cut in CHUNK_TOKENS rows."""
    out = []
    for k, v in kv:
        for whole in (k, v):
            out += [whole[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS] for c in range(P // CHUNK_TOKENS)]
    return out


def measure_raw(torch, copier, timed) -> None:
    """device <-> arena through the pool, 1 GiB in RAW_BLOCK blocks, against a pinned buffer."""
    from quillcache import KvBlockKey
    dev = copier.device
    n = RAW_BYTES // RAW_BLOCK
    keys = [KvBlockKey("raw", "tok", None, "", "raw", f"r{i}", 0, 1) for i in range(n)]
    src = torch.randint(0, 255, (RAW_BYTES,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    save_s = timed(lambda: copier.save(keys, list(src.view(n, RAW_BLOCK))), 3)
    load_s = timed(lambda: copier.load(keys, list(dst.view(n, RAW_BLOCK))), 3)
    if not torch.equal(src, dst):
        raise SystemExit("raw load: wrong bytes")
    host = torch.empty(RAW_BYTES, dtype=torch.uint8, pin_memory=True)
    h2d = timed(lambda: dst.copy_(host, non_blocking=True), 3)
    d2h = timed(lambda: host.copy_(src, non_blocking=True), 3)
    print(f"\nraw, 1 GiB in {RAW_BLOCK >> 20} MiB blocks (GB = 1e9 bytes):")
    print("| direction | through the pool (shm) GB/s | pinned buffer, one copy GB/s |")
    print("|---|---|---|")
    print(f"| device -> arena (save) | {RAW_BYTES / save_s / 1e9:.1f} | {RAW_BYTES / d2h / 1e9:.1f} |")
    print(f"| arena -> device (load) | {RAW_BYTES / load_s / 1e9:.1f} | {RAW_BYTES / h2d / 1e9:.1f} |")


def graphed(torch, fn, enabled: bool):
    """``fn`` (static inputs and outputs) captured as a CUDA graph and replayed: one launch
    instead of ~1,500 kernel launches from Python, as engines run their forward passes.
    Falls back to calling ``fn`` where capture is off or fails."""
    if not enabled:
        return fn
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            fn()
            fn()                                   # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.inference_mode():
            out = fn()
    except RuntimeError as exc:
        print(f"note: CUDA graph capture failed ({str(exc).splitlines()[0]}): eager")
        return fn

    def replay():
        g.replay()
        return out
    return replay


def measure_prefix(torch, model, copier, tcp, P: int, timed, rounds: int, graphs: bool) -> dict:
    dev = copier.device
    ids = torch.randint(0, VOCAB, (P + SUFFIX,), device=dev)
    with torch.inference_mode():
        full = graphed(torch, lambda: model.forward(ids)[0], graphs)
        full_s = timed(full)
        ref_logits = full().clone()
        _, kv = model.forward(ids[:P])
    keys = kv_keys(P, f"p{P}")
    save_s = timed(lambda: copier.save(keys, kv_views(kv, P)), 1)
    cache = [(torch.empty(P + SUFFIX, KV_HEADS, HEAD_DIM, dtype=k.dtype, device=dev),
              torch.empty(P + SUFFIX, KV_HEADS, HEAD_DIM, dtype=v.dtype, device=dev)) for k, v in kv]
    dsts = kv_views([(k[:P], v[:P]) for k, v in cache], P)

    def load():
        if None in copier.load(keys, dsts):
            raise SystemExit("reload: a block was missing")

    def suffix_eager():
        with torch.inference_mode():
            return model.forward(ids[P:], cache, P)[0]

    copier.load(keys, dsts)                        # the cache holds the prefix before the capture
    suffix = graphed(torch, suffix_eager, graphs)

    def reload_shm():
        load()
        return suffix()

    shm_s = timed(reload_shm, rounds)
    load_s = timed(load, rounds)
    suffix_s = timed(suffix, rounds)
    logits = reload_shm().clone()
    if not all(torch.equal(a, b) for a, b in zip(kv_views(kv, P), dsts)):
        raise SystemExit("reload: the KV read back differs from the KV saved")
    nbytes = len(keys) * dsts[0].numel() * dsts[0].element_size()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pviews = list(pinned.view(len(keys), -1).numpy())
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev).view(len(keys), -1)

    def reload_tcp():
        got = []
        for i in range(0, len(keys), TCP_BATCH):       # a GET_MANY reply stays under max_payload
            got += tcp.get_many_into(keys[i:i + TCP_BATCH], pviews[i:i + TCP_BATCH])
        if None in got:
            raise SystemExit("reload over TCP: a block was missing")
        flat.view(-1).copy_(pinned, non_blocking=True)
        for i, d in enumerate(dsts):
            d.view(-1).view(torch.uint8).copy_(flat[i])
        return suffix()

    tcp_s = timed(reload_tcp, max(1, rounds // 2))
    return {"full": full_s, "shm": shm_s, "load": load_s, "suffix": suffix_s, "tcp": tcp_s, "save": save_s,
            "bytes": nbytes, "diff": (logits - ref_logits).abs().max().item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="2048,8192,16384", help="prefix lengths (multiples of %d)" % CHUNK_TOKENS)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement (median)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for the forward passes")
    args = ap.parse_args()
    started = time.monotonic()
    try:
        import torch
    except ImportError:
        return skip("no CUDA device (torch is not installed)")
    if not torch.cuda.is_available():
        return skip("no CUDA device")
    prefixes = [int(p) for p in args.prefix.split(",")]
    if any(p % CHUNK_TOKENS for p in prefixes):
        raise SystemExit(f"--prefix: every length must be a multiple of {CHUNK_TOKENS}")
    from _local_node import LocalNode
    from quillcache import Client
    from quillcache.gpu import ArenaCopier

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize

    def timed(fn, rounds=args.rounds):
        fn()
        sync()
        ts = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    kv_bytes = max(prefixes) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    dram = 1 << math.ceil(math.log2(2 * kv_bytes + 2 * RAW_BYTES))
    print(f"gpu_reload: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; "
          f"Llama-3-8B shape, random bf16 weights; suffix {SUFFIX} tokens; arena {dram >> 30} GiB")
    model = Model(torch, dev)
    with LocalNode(dram=f"{dram >> 20}MiB", max_block="64MiB", lease="60s") as node, \
            Client(node.unix, timeout=120) as uni, Client(node.tcp, timeout=120) as tcp:
        if not uni.shm:
            raise SystemExit(f"the Unix client did not map the arena: {uni.shm_refused}")
        t0 = time.perf_counter()
        copier = ArenaCopier(uni, device=dev)
        print(f"arena registered with CUDA: {copier.registered} ({time.perf_counter() - t0:.2f} s); "
              f"SDPA GQA kernel: {model.gqa}; forward passes as CUDA graphs: {not args.eager}")
        measure_raw(torch, copier, timed)
        rows = []
        for P in prefixes:
            if time.monotonic() - started > TIME_BUDGET_S:
                rows.append((P, None))
                continue
            rows.append((P, measure_prefix(torch, model, copier, tcp, P, timed, args.rounds, not args.eager)))
            torch.cuda.empty_cache()

    print("\n| prefix tokens | recompute ms | reload shm + suffix ms | x faster | (load ms | suffix ms) "
          "| reload tcp + suffix ms | x faster | save GB/s | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for P, r in rows:
        if r is None:
            print(f"| {P} | skipped: time budget ({TIME_BUDGET_S:.0f} s) spent | | | | | | | | |")
            continue
        print(f"| {P} | {r['full'] * 1e3:.1f} | {r['shm'] * 1e3:.1f} | {r['full'] / r['shm']:.2f} "
              f"| {r['load'] * 1e3:.1f} | {r['suffix'] * 1e3:.1f} | {r['tcp'] * 1e3:.1f} | {r['full'] / r['tcp']:.2f} "
              f"| {r['bytes'] / r['save'] / 1e9:.1f} | {r['diff']:.3f} |")
    print(f"\ntotal {time.monotonic() - started:.0f} s; targets: arena -> device >= 40 GB/s, reload+suffix "
          "<= 1/3 of recompute at 2k, <= 1/5 at 8k and 16k")
    return 0


if __name__ == "__main__":
    sys.exit(main())
