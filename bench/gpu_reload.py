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

``--connector`` reloads through the vLLM connector's worker path instead:
``quillcache.connectors.paged.PagedKVWorker`` (what ``QuillCacheConnector`` delegates to; it
imports no vLLM) on per-layer paged caches in vLLM's layout ``[2, blocks, 16, 8, 128]``, in
vLLM's call order: the prefix's 16-token blocks (2 MiB each in bf16) saved once per stored dtype
(``--kv-dtype auto,fp8_e4m3``) through ``wait_for_save`` / ``get_finished``; per request
``start_load_kv``, then ``wait_for_layer_load`` before each layer of the suffix reads its cache
(a paged gather), once per load path (``--load-path layered,staged``: layer by layer out of the
mapped arena, or whole blocks through staging; docs/engines.md).  The suffix runs as vLLM V1
runs a small prefill: each layer's work outside attention as a CUDA graph, the attention (with
torch's lower-right causal bias: a flash kernel) and the per-layer wait eager between them
(``bench/_piecewise.py``; ``--suffix-run eager`` runs it all from Python); the recompute runs
eager.  Columns:
recompute, reload + suffix, their ratio, load alone, from ``start_load_kv`` until layer 0 and
until every layer is usable, suffix alone, save rate, max logit diff; each load is checked bit
for bit (FP8: against the quantize -> dequantize of the saved blocks).  ``--load-only`` leaves
the model out and times the load alone in the shape's KV geometry (bf16; runs on CPU too).
``--layers N`` builds N layers of the shape and scales the times to its layer count.

Issue 26's GPU table, in one command on the GPU machine (DIR as in
../shared/notes/gpu-machine.md; about 9 minutes; rows print as they complete):

    PYTHONPATH=DIR python3 bench/gpu_reload.py --table

(8B shape at 8k, 32k and 128k tokens, 70B shape at 8k and 32k built with 8 layers and scaled
to 80, through the connector with bf16 and FP8 on both load paths, then the direct path at
8k/32k/128k and the raw arena <-> device rates).  On a machine without a GPU (tests run these,
tests/connectors/test_paged.py):

    python bench/gpu_reload.py --connector --device cpu --shape tiny --prefix 128,256 --rounds 1
    python bench/gpu_reload.py --connector --load-only --device cpu --prefix 1024,4096 --kv-dtype auto,fp8_e4m3

It starts its own DRAM-only quillcached (TCP + Unix socket).  Without a CUDA device it
prints ``skipped: no CUDA device`` and exits 0.  Time-bounded: sizes left when
TIME_BUDGET_S (TABLE_TIME_BUDGET_S) is spent are reported as skipped.

Targets (issue 12, H200): arena -> device >= 40 GB/s; reload + suffix <= 1/3 of recompute
at 2k tokens, <= 1/5 at 8k and 16k.
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Shape(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int


SHAPES = {
    "llama-3-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": Shape(80, 8192, 64, 8, 128, 28672, 128256),
    "tiny": Shape(2, 128, 4, 2, 32, 256, 512),        # the CPU run of the connector mode (a test)
}
# --table: issue 26's GPU table in one run (docs/engines.md): (shape, prefixes, layers built)
TABLE = (("llama-3-8b", (8192, 32768, 131072), 0),
         ("llama-3-70b", (8192, 32768), 8))             # 80 layers' weights do not fit beside the KV: 8, scaled
TABLE_TIME_BUDGET_S = 560.0     # seconds: the device machine runs a command for at most 10 minutes
ROPE_THETA = 500000.0
SUFFIX = 128                    # tokens prefilled after the prefix
CHUNK_TOKENS = 512              # tokens per stored block (one layer, K or V): 1 MiB
BLOCK_TOKENS = 16               # connector mode: vLLM's default block size (2 MiB blocks at 8B)
TIME_BUDGET_S = 240.0           # seconds: the whole run stays under 5 minutes
RAW_BYTES = 1 << 30             # bytes moved by the raw device <-> arena measurement
RAW_BLOCK = 4 << 20             # bytes per block there
TCP_BATCH = 128                 # keys per GET_MANY on the TCP baseline (128 MiB replies)


def arena_bytes(resident: int) -> int:
    """The node's DRAM for ``resident`` bytes of values: a quarter more and 256 MiB of slack, in
    whole GiB (a 128k-token 8B prefix: 21 GiB pinned, not the 64 GiB a power of two would be)."""
    return -(-(resident * 5 // 4 + (256 << 20)) // (1 << 30)) << 30


def suffix_attention(model, args=None) -> str:
    how = ("lower-right causal bias (flash on CUDA)" if model.lower_right
           else "boolean mask (SDPA's masked kernel)")
    if args is not None and (args.connector or args.table):
        how += "; suffix run " + ("as piecewise CUDA graphs (vLLM V1)" if args.suffix_run == "piecewise"
                                  and model.dev.type == "cuda" else "eager")
    return how


def skip(reason: str) -> int:
    print(f"skipped: {reason}")
    return 0


class Model:
    def __init__(self, torch, device, shape: Shape, dtype, layers: int = 0, suffix_attention: str = "causal"):
        self.t = torch
        self.dev = device
        if layers and layers < shape.layers:          # time `layers` of the shape, scale by `scale`
            self.scale = shape.layers / layers
            shape = shape._replace(layers=layers)
        else:
            self.scale = 1.0
        self.s = S = shape
        self.dtype = dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims, std=0.02):
            return torch.empty(*dims, dtype=dtype, device=device).normal_(0, std, generator=g)

        LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = S

        self.emb = w(VOCAB, HIDDEN)
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(dict(
                n1=torch.ones(HIDDEN, dtype=dtype, device=device),
                n2=torch.ones(HIDDEN, dtype=dtype, device=device),
                wqkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), wo=w(HIDDEN, HEADS * HEAD_DIM),
                wgu=w(2 * MLP, HIDDEN), wd=w(HIDDEN, MLP)))
        self.norm = torch.ones(HIDDEN, dtype=dtype, device=device)
        self.head = w(VOCAB, HIDDEN)
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=device,
                                                           dtype=torch.float32) / HEAD_DIM))
        self.gqa = self._gqa_supported()
        self.lower_right = suffix_attention == "causal" and self._lower_right_supported()

    def _lower_right_supported(self) -> bool:
        """Whether SDPA takes torch's lower-right causal bias here, and gives what the boolean
        mask gives (on CUDA it then runs a flash kernel, as an engine's prefill over a cached
        prefix does, instead of the masked math kernel)."""
        t, S = self.t, self.s
        try:
            from torch.nn.attention.bias import causal_lower_right
            g = t.Generator(device=self.dev).manual_seed(1)
            q = t.randn(4, S.heads, S.head_dim, generator=g, device=self.dev).to(self.dtype)
            k, v = (t.randn(20, S.kv_heads, S.head_dim, generator=g, device=self.dev).to(self.dtype) for _ in "kv")
            got = self._attend(q, k, v, causal_lower_right(4, 20))
            want = self._attend(q, k, v, t.ones(4, 20, dtype=t.bool, device=self.dev).tril(diagonal=16))
        except (ImportError, TypeError, RuntimeError, ValueError):
            return False
        return bool((got.float() - want.float()).abs().max() < 0.05)

    def _gqa_supported(self) -> bool:
        t, S = self.t, self.s
        q = t.zeros(1, S.heads, 4, S.head_dim, dtype=self.dtype, device=self.dev)
        kv = t.zeros(1, S.kv_heads, 4, S.head_dim, dtype=self.dtype, device=self.dev)
        try:
            t.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):
            return False
        return True

    def _rms(self, x, w):
        F = self.t.nn.functional
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (self.s.hidden,), w, 1e-5)
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
            rep = self.s.heads // self.s.kv_heads
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=mask, is_causal=mask is None)
        return o[0].transpose(0, 1)

    # One layer's pieces, shared by forward and bench/_piecewise.py's PiecewiseSuffix.

    def rope_angles(self, P: int, T: int):
        f = self.t.outer(self.t.arange(P, P + T, device=self.dev).float(), self.inv_freq)
        return f.cos()[:, None, :], f.sin()[:, None, :]

    def suffix_mask(self, T: int, P: int):
        """T suffix queries see the P prefix tokens and themselves causally."""
        if self.lower_right:
            from torch.nn.attention.bias import causal_lower_right
            return causal_lower_right(T, P + T)
        return self.t.ones(T, P + T, dtype=self.t.bool, device=self.dev).tril(diagonal=P)

    def qkv(self, i: int, x, cos, sin):
        """Layer i's norm, QKV projection and RoPE: q [T, heads, d], k and v [T, kv_heads, d]."""
        S, L, T = self.s, self.layers[i], x.shape[0]
        h = self._rms(x, L["n1"])
        q, k, v = (h @ L["wqkv"].T).split([S.heads * S.head_dim, S.kv_heads * S.head_dim,
                                            S.kv_heads * S.head_dim], -1)
        q = self._rope(q.view(T, S.heads, S.head_dim), cos, sin)
        k = self._rope(k.reshape(T, S.kv_heads, S.head_dim), cos, sin)
        return q, k, v.reshape(T, S.kv_heads, S.head_dim)

    def write_paged(self, c, new_blocks, k, v) -> None:
        """These tokens' K and V into their blocks of a layer's paged cache."""
        S = self.s
        c[0, new_blocks] = k.reshape(-1, BLOCK_TOKENS, S.kv_heads, S.head_dim)
        c[1, new_blocks] = v.reshape(-1, BLOCK_TOKENS, S.kv_heads, S.head_dim)

    def read_paged(self, c, table, n: int):
        """The first n tokens' K and V of a request out of a layer's paged cache (a gather)."""
        S = self.s
        return (c[0, table].reshape(-1, S.kv_heads, S.head_dim)[:n],
                c[1, table].reshape(-1, S.kv_heads, S.head_dim)[:n])

    def finish_layer(self, i: int, x, o):
        """Layer i after attention, in place on the residual stream x: output projection,
        residual, norm, MLP, residual.  Returns x."""
        S, L = self.s, self.layers[i]
        x.add_(o.reshape(x.shape[0], S.heads * S.head_dim) @ L["wo"].T)
        h = self._rms(x, L["n2"])
        gate, up = (h @ L["wgu"].T).split([S.mlp, S.mlp], -1)
        return x.add_((self.t.nn.functional.silu(gate) * up) @ L["wd"].T)

    def logits(self, x):
        return (self._rms(x[-1:], self.norm) @ self.head.T).float()

    def forward(self, ids, cache=None, P: int = 0, paged=None, keep: bool = True):
        """ids [T] at positions P..P+T.  ``cache``: per layer (K, V) buffers of at least P+T
        rows whose first P hold the prefix; the new rows are written after them (as an engine
        writes its paged cache).  ``paged``: instead, ``(caches, block_table, wait)``: vLLM's
        per-layer ``[2, blocks, BLOCK_TOKENS, kv_heads, head_dim]`` caches, the request's block
        ids (P + T tokens), and ``wait(layer)`` called before each layer reads its cache (the
        connector's wait_for_layer_load).  Without either the T tokens attend to themselves (a
        full prefill).  Returns (logits of the last token, [(k, v)] of these T tokens)."""
        t = self.t
        T = ids.numel()
        cos, sin = self.rope_angles(P, T)
        x = self.emb[ids]
        new_kv = []
        mask = self.suffix_mask(T, P) if (cache is not None or paged is not None) and P else None
        if paged is not None:
            caches, table, wait = paged
            table = t.as_tensor(table, dtype=t.long, device=self.dev)
            new_blocks = table[P // BLOCK_TOKENS:(P + T) // BLOCK_TOKENS]
        for i in range(len(self.layers)):
            q, k, v = self.qkv(i, x, cos, sin)
            if paged is not None:
                wait(i)
                self.write_paged(caches[i], new_blocks, k, v)
                k, v = self.read_paged(caches[i], table, P + T)
            elif cache is None:
                k, v = k.contiguous(), v.contiguous()
                if keep:                               # a recompute timed alone keeps no KV
                    new_kv.append((k, v))
            else:
                kc, vc = cache[i]
                kc[P:P + T] = k
                vc[P:P + T] = v
                k, v = kc[:P + T], vc[:P + T]
            x = self.finish_layer(i, x, self._attend(q, k, v, mask))
        return self.logits(x), new_kv


def kv_keys(P: int, tag: str, layers: int):
    from quillcache import KvBlockKey
    keys = []
    for layer in range(layers):
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
    S = model.s
    ids = torch.randint(0, S.vocab, (P + SUFFIX,), device=dev)
    with torch.inference_mode():
        full = graphed(torch, lambda: model.forward(ids, keep=False)[0], graphs)
        full_s = timed(full)
        ref_logits = full().clone()
        _, kv = model.forward(ids[:P])
    keys = kv_keys(P, f"p{P}", S.layers)
    save_s = timed(lambda: copier.save(keys, kv_views(kv, P)), 1)
    cache = [(torch.empty(P + SUFFIX, S.kv_heads, S.head_dim, dtype=k.dtype, device=dev),
              torch.empty(P + SUFFIX, S.kv_heads, S.head_dim, dtype=v.dtype, device=dev)) for k, v in kv]
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
    if tcp is None:                                # --no-tcp: the TCP baseline is left out
        return {"full": full_s, "shm": shm_s, "load": load_s, "suffix": suffix_s, "tcp": math.nan, "save": save_s,
                "bytes": nbytes, "diff": (logits - ref_logits).abs().max().item()}
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


def worker_path(path: str) -> dict:
    """A --load-path name as PagedKVWorker arguments: layered, layered-dma (each layer moved by
    the copy engines, client/gpu_dma.py, instead of a gather kernel), staged."""
    if path == "layered-dma":
        return {"load_path": "layered", "layer_copy": "dma"}
    return {"load_path": path}


def path_taken(worker) -> str:
    taken = ",".join(k for k, v in worker.paths_used.items() if v)
    return taken + "-dma" if taken == "layered" and worker.layer_copy == "dma" else taken


def timed_load(worker, transfer, names: list, sync) -> tuple[float, float]:
    """One load through the connector, in vLLM's call order: seconds until the first layer is
    in place (``wait_for_layer_load`` of layer 0) and until every layer is."""
    t0 = time.perf_counter()
    worker.start_load_kv([transfer])
    worker.wait_for_layer_load(names[0])
    sync()
    t1 = time.perf_counter()
    worker.wait_for_layer_load(names[-1])
    sync()
    done = time.perf_counter()
    worker.wait_for_save([])
    return t1 - t0, done - t0


def brief(exc: BaseException) -> str:
    """An error in one line for a table cell (its traceback goes to stderr)."""
    traceback.print_exception(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def failed_row(kv_dtype: str, path: str, exc: BaseException) -> dict:
    """A row that failed: printed as FAILED with its error, so that one failure on a machine
    held for minutes does not lose the rows after it."""
    return {"kv": kv_dtype, "path": path, "error": brief(exc)}


def measure_connector(torch, model, core, P: int, timed, rounds: int, kv_dtypes, paths, sync,
                      suffix_run: str = "eager") -> list[dict]:
    """The vLLM connector's worker path (quillcache.connectors.paged.PagedKVWorker, which the
    vLLM adapter delegates to) on paged caches in vLLM's layout, in vLLM's call order: the
    prefix's blocks saved once per stored dtype (wait_for_save, then get_finished until done);
    per request start_load_kv, then wait_for_layer_load before each layer of the suffix reads
    its cache.  One row per (stored dtype, load path)."""
    from quillcache.connectors.core import chain_keys, model_scope
    from quillcache.connectors.kvquant import make_codec
    from quillcache.model import IdentityScope
    from quillcache.connectors.paged import PagedKVWorker, Transfer
    S, dev, x = model.s, model.dev, model.scale
    nb, ns = P // BLOCK_TOKENS, SUFFIX // BLOCK_TOKENS
    blocks = 2 * nb + ns
    ids = torch.randint(0, S.vocab, (P + SUFFIX,), device=dev)
    with torch.inference_mode():
        full_s = timed(lambda: model.forward(ids, keep=False)[0])
        ref = model.forward(ids, keep=False)[0]
    if dev.type == "cuda":
        torch.cuda.empty_cache()       # the caches get whole segments (at 128k tokens, 8B: 32 GiB beside 15 of weights)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, blocks, BLOCK_TOKENS, S.kv_heads, S.head_dim,
                                                               dtype=model.dtype, device=dev)
              for i in range(S.layers)}
    layers = list(caches.values())
    names = list(caches)
    with torch.inference_mode():      # request A's prefix prefilled straight into blocks 0..nb-1
        model.forward(ids[:P], P=0, paged=(layers, list(range(nb)), lambda i: None))
    table = list(range(nb, 2 * nb)) + list(range(2 * nb, blocks))      # request B: the prefix reloaded
    if suffix_run == "piecewise":                     # vLLM V1's mode: graphs between the attention ops
        from _piecewise import PiecewiseSuffix
        run_suffix = PiecewiseSuffix(model, ids[P:], P, layers, table, BLOCK_TOKENS)
    else:
        def run_suffix(wait):
            with torch.inference_mode():
                return model.forward(ids[P:], P=P, paged=(layers, table, wait))[0]
    suffix_s = timed(lambda: run_suffix(lambda i: None))
    rows = []
    for kv_dtype in kv_dtypes:
        codec = make_codec(kv_dtype, model.dtype)
        scope = model_scope("bench", dtype=codec.scope_dtype, block_size=BLOCK_TOKENS, num_layers=S.layers,
                            layout="vllm-2nbhd")
        keys = chain_keys(IdentityScope(scope, "tok", None, ""),
                          [(P << 32 | i).to_bytes(32, "big") for i in range(nb)], block_size=BLOCK_TOKENS)
        writer = PagedKVWorker(core, kv_dtype=kv_dtype)
        writer.register_kv_caches(caches)

        def save():
            writer.wait_for_save([Transfer("A", keys, list(range(nb)))])
            while not writer.get_finished({"A"}):
                time.sleep(0.0005)
        try:
            failed_before = core.stats()["save_errors"]
            save_s = timed(save, 1)
            if writer.take_stored() == [] or core.stats()["save_errors"] != failed_before:
                raise SystemExit("connector save: the blocks were not stored")
        except (Exception, SystemExit) as exc:             # every load path of this dtype fails with it
            rows += [failed_row(kv_dtype, path, exc) for path in paths]
            writer.shutdown()
            continue
        def want(c):                                     # what a load must leave in request B's blocks
            if not codec.quantized:
                return c[:, :nb]
            one = (1, 2, BLOCK_TOKENS, S.kv_heads, S.head_dim)      # a layer's blocks as 1-layer blocks
            return codec.decode(codec.encode(c[:, :nb].transpose(0, 1).contiguous()[:, None]), one)[:, 0].transpose(0, 1)
        for path in paths:
            worker = PagedKVWorker(core, kv_dtype=kv_dtype, **worker_path(path))
            try:
                worker.register_kv_caches(caches)

                def reload_and_suffix():
                    worker.start_load_kv([Transfer("B", keys, table[:nb])])
                    out = run_suffix(lambda i: worker.wait_for_layer_load(names[i])).clone()
                    worker.wait_for_save([])
                    if worker.take_load_errors():
                        raise SystemExit("connector reload: blocks were reported missing")
                    return out
                marks: list = []

                def load_only():
                    marks.append(timed_load(worker, Transfer("B", keys, table[:nb]), names, sync))
                conn_s = timed(reload_and_suffix, rounds)
                load_s = timed(load_only, rounds)
                first = statistics.median(m[0] for m in marks[1:] or marks)
                every = statistics.median(m[1] for m in marks[1:] or marks)
                for c in layers:
                    c[:, nb:2 * nb].zero_()
                logits = reload_and_suffix()
                for i, c in enumerate(layers):
                    if not torch.equal(c[:, nb:2 * nb].view(torch.uint8), want(c).contiguous().view(torch.uint8)):
                        raise SystemExit(f"connector reload ({kv_dtype}, {path}): layer {i}: not the bytes saved")
                taken = path_taken(worker)                       # layered falls back to staged
                rows.append({"kv": kv_dtype, "path": taken, "full": full_s * x, "conn": conn_s * x,
                             "load": load_s * x, "first": first, "all": every * x, "suffix": suffix_s * x,
                             "save": save_s, "bytes": nb * writer.stored_nbytes, "diff": (logits - ref).abs().max().item()})
            except (Exception, SystemExit) as exc:         # one failed row does not lose the table
                rows.append(failed_row(kv_dtype, path, exc))
            finally:
                worker.shutdown()
        writer.shutdown()
        core.call_async(lambda c, keys=keys: c.remove_many(keys), what="save").result()   # room for the next
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="2048,8192,16384",
                    help=f"prefix lengths (multiples of {CHUNK_TOKENS}; {BLOCK_TOKENS} with --connector)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement (median)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for the forward passes")
    ap.add_argument("--connector", action="store_true",
                    help="reload through the vLLM connector's worker path (paged caches, eager forward)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the connector mode only, to check it on a machine without a GPU")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=0, help="build and time this many layers, scale to the shape's")
    ap.add_argument("--kv-dtype", default="auto", help="connector: stored dtypes, comma-separated (auto,fp8_e4m3)")
    ap.add_argument("--load-path", default="layered,staged",
                    help="connector: load paths, comma-separated (layered, layered-dma, staged)")
    ap.add_argument("--no-tcp", action="store_true", help="direct path: leave out the TCP baseline")
    ap.add_argument("--load-only", action="store_true",
                    help="connector: no model, only the load (first layer vs all layers usable; runs on CPU)")
    ap.add_argument("--table", action="store_true",
                    help="issue 26's GPU table: 8B at 8k/32k/128k, 70B at 8k/32k (8 layers, scaled), through the "
                         "connector (bf16, fp8; layered, staged), the direct path and arena -> device GB/s")
    ap.add_argument("--suffix-attention", choices=("causal", "mask"), default="causal",
                    help="the suffix's attention over prefix + itself: causal = torch's lower-right causal bias "
                         "(a flash kernel on CUDA, as an engine's prefill over a cached prefix), mask = a boolean "
                         "mask (SDPA's masked kernel; the figures before 2026-11-27)")
    ap.add_argument("--suffix-run", choices=("piecewise", "eager"), default="piecewise",
                    help="connector: the suffix's forward pass as vLLM V1 runs a small prefill (piecewise: each "
                         "layer's work outside attention replayed as CUDA graphs, attention and the connector's "
                         "wait eager between them; bench/_piecewise.py) or all eager (the figures before 2026-11-27)")
    ap.add_argument("--budget", type=float, default=0.0,
                    help=f"seconds after which sizes not yet started are skipped (default {TIME_BUDGET_S:.0f}, "
                         f"{TABLE_TIME_BUDGET_S:.0f} with --table)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        import torch
    except ImportError:
        return skip("no CUDA device (torch is not installed)")
    if args.device == "cpu" and not (args.connector or args.table):
        raise SystemExit("--device cpu: only with --connector or --table (the direct path measures CUDA copies)")
    if args.device == "cuda" and not torch.cuda.is_available():
        return skip("no CUDA device")
    prefixes = [int(p) for p in args.prefix.split(",")]
    unit = BLOCK_TOKENS if args.connector else CHUNK_TOKENS
    if any(p % unit for p in prefixes):
        raise SystemExit(f"--prefix: every length must be a multiple of {unit}")
    if args.device == "cuda":
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        sync, dtype, name = torch.cuda.synchronize, torch.bfloat16, torch.cuda.get_device_name(dev)
    else:
        dev, dtype, name = torch.device("cpu"), torch.float32, "CPU"

        def sync():
            pass

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

    print(f"gpu_reload: {name}, torch {torch.__version__}; random {str(dtype)[6:]} weights; suffix {SUFFIX} tokens",
          flush=True)
    if args.table:
        return run_table(torch, dev, dtype, timed, sync, args, started)
    if args.connector and args.load_only:
        return run_load_only(torch, dev, timed, sync, args, prefixes)
    model = Model(torch, dev, SHAPES[args.shape], dtype, args.layers, args.suffix_attention)
    print(f"suffix attention: {suffix_attention(model, args)}", flush=True)
    if args.connector:
        rows = run_connector(torch, model, prefixes, timed, args, started, args.budget or TIME_BUDGET_S, sync)
        print(f"\ntotal {time.monotonic() - started:.0f} s")
        return 1 if count_failed(rows) else 0
    run_direct(torch, model, prefixes, timed, args, started, args.budget or TIME_BUDGET_S)
    return 0


def run_table(torch, dev, dtype, timed, sync, args, started: float) -> int:
    """Issue 26's item 4 in one run, the rows printed as they complete: the connector rows
    first (the targets are about them), then the direct path and the raw copy rates."""
    args.kv_dtype = "auto,fp8_e4m3"
    args.eager = True                 # every forward pass eager, as in the connector rows (and no graph pools)
    args.rounds = min(args.rounds, 3)
    args.no_tcp = True
    budget = args.budget or TABLE_TIME_BUDGET_S
    failed = 0
    for shape, prefixes, layers in TABLE:
        args.shape = shape
        try:
            model = Model(torch, dev, SHAPES[shape], dtype, args.layers or layers, args.suffix_attention)
            print(f"\n{shape}: suffix attention: {suffix_attention(model, args)}", flush=True)
            failed += count_failed(run_connector(torch, model, list(prefixes), timed, args, started, budget, sync))
        except (Exception, SystemExit) as exc:               # the other shape and the direct path still run
            print(f"\n{shape}: FAILED: {brief(exc)}", flush=True)
            failed += 1
        model = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    args.shape = TABLE[0][0]
    if dev.type != "cuda":
        print("\ndirect path: skipped (it measures CUDA copies)")
        return 1 if failed else 0
    try:
        model = Model(torch, dev, SHAPES[args.shape], dtype, TABLE[0][2], args.suffix_attention)
        run_direct(torch, model, list(TABLE[0][1]), timed, args, started, budget)
    except (Exception, SystemExit) as exc:
        print(f"\ndirect path: FAILED: {brief(exc)}", flush=True)
        failed += 1
    return 1 if failed else 0


def run_direct(torch, model, prefixes, timed, args, started: float, budget: float) -> None:
    """The bench's direct path (ArenaCopier.load of per-(layer, K/V, chunk) blocks) and the raw rates."""
    from _local_node import LocalNode
    from quillcache import Client
    from quillcache.client.gpu import ArenaCopier
    S, dev = model.s, model.dev
    per_token = S.layers * 2 * S.kv_heads * S.head_dim * 2
    dram = arena_bytes(sum(prefixes) * per_token + 2 * RAW_BYTES)     # every prefix stays stored
    with LocalNode(dram=f"{dram >> 20}MiB", max_block="64MiB", lease="60s") as node, \
            Client(node.unix, timeout=120) as uni, Client(node.tcp, timeout=120) as tcp:
        if not uni.shm:
            raise SystemExit(f"the Unix client did not map the arena: {uni.shm_refused}")
        t0 = time.perf_counter()
        copier = ArenaCopier(uni, device=dev)
        print(f"\n{args.shape}, arena {dram >> 20} MiB registered with CUDA: {copier.registered} "
              f"({time.perf_counter() - t0:.2f} s); SDPA GQA kernel: {model.gqa}; forward passes as CUDA graphs: "
              f"{not args.eager}", flush=True)
        measure_raw(torch, copier, timed)
        rows = []
        for P in prefixes:
            if time.monotonic() - started > budget:
                rows.append((P, None))
                continue
            try:
                rows.append((P, measure_prefix(torch, model, copier, None if args.no_tcp else tcp, P, timed,
                                               args.rounds, not args.eager)))
            except torch.OutOfMemoryError:
                rows.append((P, None))
            torch.cuda.empty_cache()

    print("\n| prefix tokens | recompute ms | reload shm + suffix ms | x faster | (load ms | suffix ms) "
          "| reload tcp + suffix ms | x faster | save GB/s | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for P, r in rows:
        if r is None:
            print(f"| {P} | skipped: time budget ({budget:.0f} s) spent or out of device memory | | | | | | | | |")
            continue
        print(f"| {P} | {r['full'] * 1e3:.1f} | {r['shm'] * 1e3:.1f} | {r['full'] / r['shm']:.2f} "
              f"| {r['load'] * 1e3:.1f} | {r['suffix'] * 1e3:.1f} | {r['tcp'] * 1e3:.1f} | {r['full'] / r['tcp']:.2f} "
              f"| {r['bytes'] / r['save'] / 1e9:.1f} | {r['diff']:.3f} |", flush=True)
    print(f"\ntotal {time.monotonic() - started:.0f} s; targets: arena -> device >= 40 GB/s, reload+suffix "
          "<= 1/3 of recompute at 2k, <= 1/5 at 8k and 16k")


def measure_load_only(torch, shape: Shape, P: int, dev, core, rounds: int, kv_dtypes, paths, sync) -> list[dict]:
    """No model: the shape's KV geometry in bf16, random bytes saved once per stored dtype, then
    loaded through each path, timing start_load_kv until layer 0, and until every layer, is
    usable (the CPU variant of the pipelining figure; on CUDA too)."""
    from quillcache.connectors.core import chain_keys, model_scope
    from quillcache.connectors.paged import PagedKVWorker, Transfer
    from quillcache.model import IdentityScope
    nb = P // BLOCK_TOKENS
    g = torch.Generator(device=dev).manual_seed(1)
    caches = {f"l{i}": torch.randn(2, 2 * nb, BLOCK_TOKENS, shape.kv_heads, shape.head_dim, generator=g, device=dev)
              .to(torch.bfloat16) for i in range(shape.layers)}
    names, layers = list(caches), list(caches.values())
    rows = []
    for kv_dtype in kv_dtypes:
        writer = PagedKVWorker(core, kv_dtype=kv_dtype)
        writer.register_kv_caches(caches)
        scope = model_scope("load-only", dtype=writer.codec.scope_dtype, block_size=BLOCK_TOKENS,
                            num_layers=shape.layers, layout="vllm-2nbhd")
        keys = chain_keys(IdentityScope(scope, "tok", None, ""), [(P << 32 | i).to_bytes(32, "big") for i in range(nb)],
                          block_size=BLOCK_TOKENS)
        writer.wait_for_save([Transfer("A", keys, list(range(nb)))])
        while not writer.get_finished({"A"}):
            time.sleep(0.001)
        for path in paths:
            worker = PagedKVWorker(core, kv_dtype=kv_dtype, **worker_path(path))
            worker.register_kv_caches(caches)
            marks = []
            for _ in range(rounds + 1):
                sync()
                marks.append(timed_load(worker, Transfer("B", keys, list(range(nb, 2 * nb))), names, sync))
                if worker.take_load_errors():
                    raise SystemExit("load-only: blocks were reported missing")
            if kv_dtype == "auto" and not all(torch.equal(c[:, nb:], c[:, :nb]) for c in layers):
                raise SystemExit(f"load-only ({path}): the blocks loaded differ from the blocks saved")
            rows.append({"kv": kv_dtype, "path": path_taken(worker),
                         "first": statistics.median(m[0] for m in marks[1:]),
                         "all": statistics.median(m[1] for m in marks[1:]), "bytes": nb * writer.stored_nbytes})
            worker.shutdown()
        writer.shutdown()
        core.call_async(lambda c, keys=keys: c.remove_many(keys), what="save").result()
    return rows


def run_load_only(torch, dev, timed, sync, args, prefixes) -> int:
    from _local_node import LocalNode
    from quillcache.connectors.core import ConnectorCore
    shape = SHAPES[args.shape]._replace(layers=args.layers or SHAPES[args.shape].layers)
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    dram = arena_bytes(max(prefixes) * per_token)
    print(f"load only: {args.shape} KV geometry ({shape.layers} layers), bf16, block {BLOCK_TOKENS} tokens, "
          f"arena {dram >> 20} MiB; median of {args.rounds}")
    print("| prefix tokens | stored | load path | MiB moved | first layer usable ms | all layers usable ms | first / all |")
    print("|---|---|---|---|---|---|---|")
    with LocalNode(dram=f"{dram >> 20}MiB", max_block="64MiB", lease="60s") as node:
        core = ConnectorCore(node.unix, timeout=120)
        try:
            for P in prefixes:
                for r in measure_load_only(torch, shape, P, dev, core, args.rounds, args.kv_dtype.split(","),
                                           args.load_path.split(","), sync):
                    print(f"| {P} | {r['kv']} | {r['path']} | {r['bytes'] / 2**20:.0f} | {r['first'] * 1e3:.1f} "
                          f"| {r['all'] * 1e3:.1f} | {r['first'] / r['all']:.2f} |", flush=True)
        finally:
            core.close()
    return 0


def run_connector(torch, model, prefixes, timed, args, started: float, budget: float, sync) -> list:
    """Rows (shape, P, row or None) of the connector mode for one model, on a node of its own."""
    from _local_node import LocalNode
    from quillcache.connectors.core import ConnectorCore
    S = model.s
    per_token = S.layers * 2 * S.kv_heads * S.head_dim * model.t.tensor([], dtype=model.dtype).element_size()
    dram = arena_bytes(max(prefixes) * per_token)     # one prefix and stored dtype at a time: removed after
    kv_dtypes, paths = args.kv_dtype.split(","), args.load_path.split(",")
    rows: list = []
    print_connector(rows, {})
    with LocalNode(dram=f"{dram >> 20}MiB", max_block="64MiB", lease="60s") as node:
        core = ConnectorCore(node.unix, timeout=120)
        try:
            if not core.shm:
                raise SystemExit("the connector's Unix-socket client did not map the arena")
            for P in prefixes:
                if time.monotonic() - started > budget:
                    rows.append((args.shape, P, None, "time budget spent"))
                    continue
                try:
                    got = [(args.shape, P, r, "") for r in
                           measure_connector(torch, model, core, P, timed, args.rounds, kv_dtypes, paths, sync,
                                             args.suffix_run)]
                except torch.OutOfMemoryError as exc:
                    got = [(args.shape, P, None, f"out of device memory ({str(exc).splitlines()[0][:60]})")]
                except (Exception, SystemExit) as exc:      # the next prefix still runs
                    got = [(args.shape, P, None, f"FAILED: {brief(exc)}")]
                print_connector(got, {args.shape: model.scale}, header=False)      # as they complete
                rows += got
                if model.dev.type == "cuda":
                    torch.cuda.empty_cache()
            stats = core.stats()
        finally:
            core.close()
    print(f"\n{args.shape}: connector counters {stats}", flush=True)
    return rows


def count_failed(rows) -> int:
    """Rows of run_connector that failed (not those skipped for time or device memory)."""
    return sum(1 for _, _, r, why in rows if (r is None and why.startswith("FAILED")) or (r and "error" in r))


def print_connector(rows, model_scale: dict, header: bool = True) -> None:
    if header:
        print(f"\nvLLM connector worker path (PagedKVWorker, block {BLOCK_TOKENS} tokens, vLLM layout, forward "
              "passes eager; ratio = reload + suffix / recompute; first = start_load_kv until layer 0 is usable, "
              "all = until every layer is; shapes timed on fewer layers are scaled, first layer not)")
        print("| shape | prefix tokens | stored | load path | recompute ms | reload + suffix ms | ratio | load ms "
              "| first layer ms | all layers ms | suffix ms | save GB/s | max logit diff |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for shape, P, r, why in rows:
        if r is None:
            print(f"| {shape} | {P} | skipped: {why} | | | | | | | | | | |")
            continue
        if "error" in r:
            print(f"| {shape} | {P} | {r['kv']} | {r['path']} | FAILED: {r['error']} | | | | | | | | |", flush=True)
            continue
        scaled = " (scaled)" if model_scale.get(shape, 1.0) != 1.0 else ""
        print(f"| {shape}{scaled} | {P} | {r['kv']} | {r['path']} | {r['full'] * 1e3:.1f} | {r['conn'] * 1e3:.1f} "
              f"| {r['conn'] / r['full']:.3f} | {r['load'] * 1e3:.1f} | {r['first'] * 1e3:.1f} "
              f"| {r['all'] * 1e3:.1f} | {r['suffix'] * 1e3:.1f} | {r['bytes'] / r['save'] / 1e9:.2f} | {r['diff']:.3g} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
