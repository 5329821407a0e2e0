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
vLLM's call order: the prefix's 16-token blocks (2 MiB each) saved once through
``wait_for_save`` / ``get_finished``; per request ``start_load_kv``, then ``wait_for_layer_load``
before each layer of the suffix reads its cache (a paged gather).  Forward passes run eager
there (the per-layer waits sit between the layers, as in vLLM), the recompute too.  Columns:
recompute, reload + suffix, x faster, load alone, suffix alone, from ``start_load_kv`` until
layer 0 was ready, save rate, max logit diff.  On the GPU machine (one line; DIR as above):

    PYTHONPATH=DIR python3 bench/gpu_reload.py --connector

and on a machine without a GPU (a test runs this, tests/connectors/test_paged.py):

    python bench/gpu_reload.py --connector --device cpu --shape tiny --prefix 128,256 --rounds 1

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
    "tiny": Shape(2, 128, 4, 2, 32, 256, 512),        # the CPU run of the connector mode (a test)
}
ROPE_THETA = 500000.0
SUFFIX = 128                    # tokens prefilled after the prefix
CHUNK_TOKENS = 512              # tokens per stored block (one layer, K or V): 1 MiB
BLOCK_TOKENS = 16               # connector mode: vLLM's default block size (2 MiB blocks at 8B)
TIME_BUDGET_S = 240.0           # seconds: the whole run stays under 5 minutes
RAW_BYTES = 1 << 30             # bytes moved by the raw device <-> arena measurement
RAW_BLOCK = 4 << 20             # bytes per block there
TCP_BATCH = 128                 # keys per GET_MANY on the TCP baseline (128 MiB replies)


def skip(reason: str) -> int:
    print(f"skipped: {reason}")
    return 0


class Model:
    def __init__(self, torch, device, shape: Shape, dtype):
        self.t = torch
        self.dev = device
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

    def forward(self, ids, cache=None, P: int = 0, paged=None):
        """ids [T] at positions P..P+T.  ``cache``: per layer (K, V) buffers of at least P+T
        rows whose first P hold the prefix; the new rows are written after them (as an engine
        writes its paged cache).  ``paged``: instead, ``(caches, block_table, wait)``: vLLM's
        per-layer ``[2, blocks, BLOCK_TOKENS, kv_heads, head_dim]`` caches, the request's block
        ids (P + T tokens), and ``wait(layer)`` called before each layer reads its cache (the
        connector's wait_for_layer_load).  Without either the T tokens attend to themselves (a
        full prefill).  Returns (logits of the last token, [(k, v)] of these T tokens)."""
        t, S = self.t, self.s
        F = t.nn.functional
        T = ids.numel()
        f = t.outer(t.arange(P, P + T, device=self.dev).float(), self.inv_freq)
        cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
        x = self.emb[ids]
        new_kv = []
        mask = None
        if cache is not None or paged is not None:   # suffix queries see the prefix and themselves causally
            mask = t.ones(T, P + T, dtype=t.bool, device=self.dev).tril(diagonal=P)
        if paged is not None:
            caches, table, wait = paged
            table = t.as_tensor(table, dtype=t.long, device=self.dev)
            new_blocks = table[P // BLOCK_TOKENS:(P + T) // BLOCK_TOKENS]
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["n1"])
            q, k, v = (h @ L["wqkv"].T).split([S.heads * S.head_dim, S.kv_heads * S.head_dim,
                                                S.kv_heads * S.head_dim], -1)
            q = self._rope(q.view(T, S.heads, S.head_dim), cos, sin)
            k = self._rope(k.reshape(T, S.kv_heads, S.head_dim), cos, sin)
            v = v.reshape(T, S.kv_heads, S.head_dim)
            if paged is not None:
                wait(i)
                c = caches[i]
                c[0, new_blocks] = k.reshape(-1, BLOCK_TOKENS, S.kv_heads, S.head_dim)
                c[1, new_blocks] = v.reshape(-1, BLOCK_TOKENS, S.kv_heads, S.head_dim)
                k = c[0, table].reshape(-1, S.kv_heads, S.head_dim)[:P + T]     # paged read (a gather)
                v = c[1, table].reshape(-1, S.kv_heads, S.head_dim)[:P + T]
            elif cache is None:
                k, v = k.contiguous(), v.contiguous()
                new_kv.append((k, v))
            else:
                kc, vc = cache[i]
                kc[P:P + T] = k
                vc[P:P + T] = v
                k, v = kc[:P + T], vc[:P + T]
            o = self._attend(q, k, v, mask)
            x = x + o.reshape(T, S.heads * S.head_dim) @ L["wo"].T
            h = self._rms(x, L["n2"])
            gate, up = (h @ L["wgu"].T).split([S.mlp, S.mlp], -1)
            x = x + (F.silu(gate) * up) @ L["wd"].T
        logits = self._rms(x[-1:], self.norm) @ self.head.T
        return logits.float(), new_kv


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
        full = graphed(torch, lambda: model.forward(ids)[0], graphs)
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


def measure_connector(torch, model, core, P: int, timed, rounds: int) -> dict:
    """The vLLM connector's worker path (quillcache.connectors.paged.PagedKVWorker, which the
    vLLM adapter delegates to) on paged caches in vLLM's layout, in vLLM's call order: the
    prefix's blocks saved once (wait_for_save, then get_finished until done); per request
    start_load_kv, then wait_for_layer_load before each layer of the suffix reads its cache."""
    from quillcache.connectors.core import chain_keys, model_scope
    from quillcache.model import IdentityScope
    from quillcache.connectors.paged import PagedKVWorker, Transfer
    S, dev = model.s, model.dev
    nb, ns = P // BLOCK_TOKENS, SUFFIX // BLOCK_TOKENS
    blocks = 2 * nb + ns
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, blocks, BLOCK_TOKENS, S.kv_heads, S.head_dim,
                                                               dtype=model.dtype, device=dev)
              for i in range(S.layers)}
    layers = list(caches.values())
    names = list(caches)
    worker = PagedKVWorker(core)
    worker.register_kv_caches(caches)
    scope = model_scope("bench", dtype=str(model.dtype).replace("torch.", ""), block_size=BLOCK_TOKENS,
                        num_layers=S.layers, layout="vllm-2nbhd")
    keys = chain_keys(IdentityScope(scope, "tok", None, ""), [(P << 32 | i).to_bytes(32, "big") for i in range(nb)],
                      block_size=BLOCK_TOKENS)
    ids = torch.randint(0, S.vocab, (P + SUFFIX,), device=dev)
    with torch.inference_mode():
        full_s = timed(lambda: model.forward(ids)[0])
        ref = model.forward(ids)[0]
        _, kv = model.forward(ids[:P])
        for c, (k, v) in zip(layers, kv):                 # request A's prefix in blocks 0..nb-1
            c[0, :nb] = k.view(nb, BLOCK_TOKENS, S.kv_heads, S.head_dim)
            c[1, :nb] = v.view(nb, BLOCK_TOKENS, S.kv_heads, S.head_dim)

    def save():
        worker.wait_for_save([Transfer("A", keys, list(range(nb)))])
        while not worker.get_finished({"A"}):
            time.sleep(0.0005)
    save_s = timed(save, 1)
    if worker.take_stored() == [] or core.stats()["save_errors"]:
        raise SystemExit("connector save: the blocks were not stored")
    table = list(range(nb, 2 * nb)) + list(range(2 * nb, blocks))      # request B: the prefix reloaded
    load_t: list = []

    def reload_and_suffix():
        t0 = time.perf_counter()
        worker.start_load_kv([Transfer("B", keys, table[:nb])])

        def wait(i):
            worker.wait_for_layer_load(names[i])
            if i == 0:
                load_t.append(time.perf_counter() - t0)
        with torch.inference_mode():
            out = model.forward(ids[P:], P=P, paged=(layers, table, wait))[0]
        worker.wait_for_save([])
        if worker.take_load_errors():
            raise SystemExit("connector reload: blocks were reported missing")
        return out

    def load_only():
        worker.start_load_kv([Transfer("B", keys, table[:nb])])
        worker.wait_for_layer_load(names[-1])
        worker.wait_for_save([])

    def suffix_only():
        with torch.inference_mode():
            return model.forward(ids[P:], P=P, paged=(layers, table, lambda i: None))[0]

    shm_s = timed(reload_and_suffix, rounds)
    first = statistics.median(load_t[1:] or load_t)
    load_s = timed(load_only, rounds)
    suffix_s = timed(suffix_only, rounds)
    logits = reload_and_suffix()
    for i, c in enumerate(layers):
        if not torch.equal(c[:, nb:2 * nb].view(torch.uint8), c[:, :nb].view(torch.uint8)):
            raise SystemExit(f"connector reload: layer {i}: the blocks read back differ from the blocks saved")
    worker.shutdown()
    return {"full": full_s, "conn": shm_s, "load": load_s, "suffix": suffix_s, "first": first, "save": save_s,
            "bytes": nb * worker.block_nbytes, "diff": (logits - ref).abs().max().item()}


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
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        import torch
    except ImportError:
        return skip("no CUDA device (torch is not installed)")
    if args.device == "cpu" and not args.connector:
        raise SystemExit("--device cpu: only with --connector (the other modes measure CUDA copies)")
    if args.device == "cuda" and not torch.cuda.is_available():
        return skip("no CUDA device")
    prefixes = [int(p) for p in args.prefix.split(",")]
    unit = BLOCK_TOKENS if args.connector else CHUNK_TOKENS
    if any(p % unit for p in prefixes):
        raise SystemExit(f"--prefix: every length must be a multiple of {unit}")
    from _local_node import LocalNode
    from quillcache import Client
    from quillcache.client.gpu import ArenaCopier

    shape = SHAPES[args.shape]
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

    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * (2 if dtype == torch.bfloat16 else 4)
    kv_bytes = (sum(prefixes) if args.connector else max(prefixes)) * per_token
    dram = 1 << math.ceil(math.log2(2 * kv_bytes + (64 << 20 if args.connector else 2 * RAW_BYTES)))
    print(f"gpu_reload: {name}, torch {torch.__version__}; {args.shape} shape, random {str(dtype)[6:]} weights; "
          f"suffix {SUFFIX} tokens; arena {dram >> 20} MiB")
    model = Model(torch, dev, shape, dtype)
    if args.connector:
        return run_connector(torch, model, prefixes, timed, args, dram, started)
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


def run_connector(torch, model, prefixes, timed, args, dram: int, started: float) -> int:
    from _local_node import LocalNode
    from quillcache.connectors.core import ConnectorCore
    rows = []
    with LocalNode(dram=f"{dram >> 20}MiB", max_block="64MiB", lease="60s") as node:
        core = ConnectorCore(node.unix, timeout=120)
        try:
            if not core.shm:
                raise SystemExit("the connector's Unix-socket client did not map the arena")
            for P in prefixes:
                if time.monotonic() - started > TIME_BUDGET_S:
                    rows.append((P, None))
                    continue
                rows.append((P, measure_connector(torch, model, core, P, timed, args.rounds)))
                if model.dev.type == "cuda":
                    torch.cuda.empty_cache()
            stats = core.stats()
        finally:
            core.close()
    print(f"\nvLLM connector worker path (PagedKVWorker, block {BLOCK_TOKENS} tokens, vLLM layout, forward "
          f"passes eager; connector counters: {stats})")
    print("| prefix tokens | recompute ms | reload + suffix ms | x faster | (load ms | suffix ms) "
          "| first layer ready ms | save GB/s | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for P, r in rows:
        if r is None:
            print(f"| {P} | skipped: time budget ({TIME_BUDGET_S:.0f} s) spent | | | | | | | |")
            continue
        print(f"| {P} | {r['full'] * 1e3:.1f} | {r['conn'] * 1e3:.1f} | {r['full'] / r['conn']:.2f} "
              f"| {r['load'] * 1e3:.1f} | {r['suffix'] * 1e3:.1f} | {r['first'] * 1e3:.1f} "
              f"| {r['bytes'] / r['save'] / 1e9:.2f} | {r['diff']:.3g} |")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
