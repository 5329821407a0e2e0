"""KV quantization in the pool: what a paged block becomes as a stored value, and back.

``kv_dtype`` in a connector's config picks the codec:

- ``"auto"`` (the default): the engine's cache dtype; the value is the block's bytes as they
  are (``[layers, 2, block_size, kv_heads, head_size]``).
- ``"fp8_e4m3"``: quantized on save with one float32 scale per (block, layer, K/V), scale =
  amax / 448 (e4m3's largest finite value), and dequantized on load into the engine's dtype.
  The value is the scales (``layers * 2`` float32, little-endian) followed by the e4m3 bytes
  in the block's order: ``4 * layers * 2 + elements`` bytes instead of ``elements * 2`` for
  bf16.  Both directions run where the tensors are (the engine's device: Hopper converts
  e4m3 in hardware; CPU torch works too).

The stored dtype is part of every key's model scope (``KvCodec.scope_dtype`` goes into
``model_scope(dtype=...)``): an FP8 value and a bf16 value of one block have different keys,
so a reader that expects bf16 misses (and the identity guard refuses the other model scope)
instead of reading e4m3 bytes as bf16.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["KV_DTYPES", "FP8_E4M3_MAX", "KvCodec", "make_codec"]

KV_DTYPES = ("auto", "fp8_e4m3")
FP8_E4M3_MAX = 448.0             # largest finite float8_e4m3fn value
_SCALE_BYTES = 4                 # one float32 scale per (block, layer, K/V)
ENCODE_CHUNK_BYTES = 256 << 20   # float32 bytes quantized at a time in encode (its temporaries)


def _torch():
    import torch
    return torch


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class KvCodec:
    """The identity codec: the stored value is the block itself."""

    name = "auto"

    def __init__(self, engine_dtype: Any) -> None:
        self.engine_dtype = engine_dtype

    @property
    def scope_dtype(self) -> str:
        """The dtype named in the keys' model scope: what the stored bytes are."""
        return _dtype_name(self.engine_dtype)

    @property
    def quantized(self) -> bool:
        return False

    def stored_nbytes(self, block_shape: tuple, element_size: int) -> int:
        n = element_size
        for d in block_shape:
            n *= d
        return n

    def staging(self, n: int, block_shape: tuple, device) -> Any:
        """A tensor of ``n`` stored values (rows) for loads to land in."""
        return _torch().empty((n, *block_shape), dtype=self.engine_dtype, device=device)

    def encode(self, blocks) -> Any:
        """``[n, *block_shape]`` blocks in the engine's dtype -> ``n`` stored rows."""
        return blocks

    def decode(self, rows, block_shape: tuple) -> Any:
        """``n`` stored rows -> ``[n, *block_shape]`` blocks in the engine's dtype."""
        return rows

    def layer_parts(self, block_shape: tuple, element_size: int, layer: int) -> list[tuple[int, int]]:
        """Where one layer's bytes lie in a stored value: ``(offset, nbytes)`` per part, in the
        order ``decode_layer`` takes them (the layer-pipelined load reads only these)."""
        n = element_size
        for d in block_shape[1:]:
            n *= d
        return [(layer * n, n)]

    def decode_layer(self, parts: list, layer_shape: tuple) -> Any:
        """One layer of ``n`` values: the ``[n, nbytes]`` uint8 parts of ``layer_parts`` ->
        ``[n, *layer_shape]`` (``[2, block_size, kv_heads, head_size]``) in the engine's dtype,
        element for element what ``decode`` gives for that layer."""
        return parts[0].view(self.engine_dtype).reshape(parts[0].shape[0], *layer_shape)


class Fp8E4m3Codec(KvCodec):
    """e4m3 bytes with a float32 scale per (block, layer, K/V) in front of them."""

    name = "fp8_e4m3"

    def __init__(self, engine_dtype: Any) -> None:
        super().__init__(engine_dtype)
        torch = _torch()
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("kv_dtype = \"fp8_e4m3\" needs torch.float8_e4m3fn (torch >= 2.1)")
        self.fp8 = torch.float8_e4m3fn

    @property
    def scope_dtype(self) -> str:
        return self.name

    @property
    def quantized(self) -> bool:
        return True

    @staticmethod
    def _groups(block_shape: tuple) -> tuple[int, int]:
        """(layers * 2 scale groups, elements per group) of a [layers, 2, ...] block."""
        groups = block_shape[0] * block_shape[1]
        per = 1
        for d in block_shape[2:]:
            per *= d
        return groups, per

    def stored_nbytes(self, block_shape: tuple, element_size: int) -> int:
        groups, per = self._groups(block_shape)
        return groups * _SCALE_BYTES + groups * per

    def staging(self, n: int, block_shape: tuple, device) -> Any:
        return _torch().empty((n, self.stored_nbytes(block_shape, 1)), dtype=_torch().uint8, device=device)

    def encode(self, blocks) -> Any:
        """Blocks ``[n, layers, 2, ...]`` as rows of scales then FP8 bytes, quantized a slice of
        blocks at a time so the float32 temporaries stay under ``ENCODE_CHUNK_BYTES`` (a 128k-token
        save of an 8B model is 16 GiB of bf16: whole, its float copy alone would be 32 GiB)."""
        torch = _torch()
        n = blocks.shape[0]
        groups, per = self._groups(tuple(blocks.shape[1:]))
        head = groups * _SCALE_BYTES
        rows = torch.empty((n, head + groups * per), dtype=torch.uint8, device=blocks.device)
        flat = blocks.reshape(n, groups, per)
        step = max(1, ENCODE_CHUNK_BYTES // (groups * per * 4))
        for a in range(0, n, step):
            x = flat[a:a + step].float()
            amax = x.abs().amax(dim=-1)                              # [blocks, groups]
            scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
            q = (x / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(self.fp8)   # x may be blocks
            rows[a:a + step, :head] = scale.contiguous().view(torch.uint8).reshape(len(x), -1)
            rows[a:a + step, head:] = q.view(torch.uint8).reshape(len(x), -1)
        return rows

    def decode(self, rows, block_shape: tuple) -> Any:
        torch = _torch()
        n = rows.shape[0]
        groups, per = self._groups(block_shape)
        head = groups * _SCALE_BYTES
        scale = rows[:, :head].contiguous().view(torch.float32).reshape(n, groups, 1)
        q = rows[:, head:].contiguous().view(self.fp8).reshape(n, groups, per)
        return (q.float() * scale).to(self.engine_dtype).reshape(n, *block_shape)

    def layer_parts(self, block_shape: tuple, element_size: int, layer: int) -> list[tuple[int, int]]:
        groups, per = self._groups(block_shape)
        kv = block_shape[1]                                          # K and V: the layer's scale groups
        return [(layer * kv * _SCALE_BYTES, kv * _SCALE_BYTES), (groups * _SCALE_BYTES + layer * kv * per, kv * per)]

    def decode_layer(self, parts: list, layer_shape: tuple) -> Any:
        torch = _torch()
        scales, q = parts
        n, kv = q.shape[0], layer_shape[0]
        scale = scales.view(torch.float32).reshape(n, kv, 1)
        q = q.view(self.fp8).reshape(n, kv, -1)
        return q.float().mul_(scale).to(self.engine_dtype).reshape(n, *layer_shape)


_CODECS = {"auto": KvCodec, "fp8_e4m3": Fp8E4m3Codec}


def make_codec(kv_dtype: Optional[str], engine_dtype: Any) -> KvCodec:
    """The codec for a connector's ``kv_dtype`` (None or "auto": the engine's dtype)."""
    name = "auto" if kv_dtype in (None, "") else str(kv_dtype)
    if name == _dtype_name(engine_dtype):
        name = "auto"
    try:
        return _CODECS[name](engine_dtype)
    except KeyError:
        raise ValueError(f"kv_dtype {kv_dtype!r}: one of {', '.join(KV_DTYPES)}") from None
