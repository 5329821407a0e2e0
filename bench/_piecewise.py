"""The suffix's forward pass as vLLM V1 runs a small prefill: piecewise CUDA graphs.

vLLM V1 captures every layer's work outside attention as CUDA graphs (for batches up to its
largest capture size, 512 tokens by default) and runs the attention op eagerly between them.
The KV connector's ``wait_for_layer_load`` is called inside that op, before the layer reads
its paged cache.  ``PiecewiseSuffix`` does the same with ``gpu_reload.Model``'s layers:

    per layer:  [norm, QKV, RoPE, the suffix's own K/V into its paged blocks]   a CUDA graph
                wait(layer); gather the request's paged K/V; attention           eager
                [output projection, residual, norm, MLP, residual]              a CUDA graph

so the suffix costs the launches an engine pays for it, not ~25 per layer from Python.
Without CUDA (or with ``capture=False``) the same pieces run eagerly: that is how the
decomposition is checked on a machine without a GPU (logits equal to the eager forward).
"""
from __future__ import annotations


class PiecewiseSuffix:
    """The T suffix tokens ``ids`` at positions P.. over paged ``caches`` (vLLM's per-layer
    ``[2, blocks, block_tokens, kv_heads, head_dim]``) and the request's ``table`` of block ids
    (P + T tokens).  ``__call__(wait)`` returns the last token's logits (a static tensor:
    overwritten by the next call)."""

    def __init__(self, model, ids, P: int, caches, table, block_tokens: int, capture: bool = True) -> None:
        t = model.t
        self.m, self.caches, self.P, self.T = model, caches, P, ids.numel()
        S = model.s
        self.table = t.as_tensor(table, dtype=t.long, device=model.dev)
        self.new_blocks = self.table[P // block_tokens:(P + self.T) // block_tokens]
        self.cos, self.sin = model.rope_angles(P, self.T)
        self.x0 = model.emb[ids].clone()
        self.x = self.x0.clone()                          # the residual stream, updated in place
        self.o = t.empty(self.T, S.heads * S.head_dim, dtype=model.dtype, device=model.dev)
        self.mask = model.suffix_mask(self.T, P)
        self.graphed = capture and model.dev.type == "cuda"
        self.pre: list = []                               # per layer (graph or None, static q)
        self.post: list = []
        self.final = None
        self.logits = None
        with t.inference_mode():
            if not self.graphed:
                return
            side = t.cuda.Stream()
            side.wait_stream(t.cuda.current_stream())
            with t.cuda.stream(side):                     # warm-up outside the captures
                for i in range(S.layers):
                    self._pre(i)
                    self._post(i)
                self._logits()
            t.cuda.current_stream().wait_stream(side)
            try:
                self._capture(t, S.layers)
            except RuntimeError as exc:                   # printed, and the pieces run eager
                print(f"note: piecewise CUDA graph capture failed ({str(exc).splitlines()[0]}): eager", flush=True)
                self.graphed, self.pre, self.post, self.final = False, [], [], None

    def _capture(self, t, layers: int) -> None:
        for i in range(layers):
            g = t.cuda.CUDAGraph()
            with t.cuda.graph(g):
                q = self._pre(i)
            self.pre.append((g, q))
            g = t.cuda.CUDAGraph()
            with t.cuda.graph(g):
                self._post(i)
            self.post.append(g)
        self.final = t.cuda.CUDAGraph()
        with t.cuda.graph(self.final):
            self.logits = self._logits()

    def _pre(self, i: int):
        q, k, v = self.m.qkv(i, self.x, self.cos, self.sin)
        self.m.write_paged(self.caches[i], self.new_blocks, k, v)
        return q

    def _post(self, i: int) -> None:
        self.m.finish_layer(i, self.x, self.o)

    def _logits(self):
        return self.m.logits(self.x)

    def __call__(self, wait):
        m, n = self.m, self.P + self.T
        with m.t.inference_mode():
            self.x.copy_(self.x0)
            for i in range(len(m.layers)):
                if self.graphed:
                    g, q = self.pre[i]
                    g.replay()
                else:
                    q = self._pre(i)
                wait(i)                                   # the connector's wait_for_layer_load
                k, v = m.read_paged(self.caches[i], self.table, n)
                self.o.copy_(m._attend(q, k, v, self.mask).reshape(self.T, -1))
                if self.graphed:
                    self.post[i].replay()
                else:
                    self._post(i)
            if self.graphed:
                self.final.replay()
                return self.logits
            return self._logits()
