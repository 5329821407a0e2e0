"""Layer slices out of the mapped arena by the copy engines (``cudaMemcpy2DAsync``), not a kernel.

``GatherPlan`` (client/gpu.py) reads a layer of a batch with one ``index_select`` over the
registered arena: a kernel that reads host memory over the bus itself.  On an H200 that moved
37-38 GB/s, where one copy from a pinned buffer moves 55, and it takes SMs from the engine's own
kernels while it runs (docs/engines.md, the H200 table).  ``CopyPlan`` has the same interface
and moves each layer with the DMA engines instead: the blocks of a batch that lie at a constant
stride in the arena (blocks saved together sit side by side) are one *run*, and a run's slice of
a layer is one pitched copy, ``height`` rows of ``width`` bytes, ``spitch`` apart, into a
contiguous ``[n, width]`` device buffer.

torch has no host-to-device 2D copy, so the call goes through ctypes to the CUDA runtime that
torch itself loaded (found in ``/proc/self/maps``: its state, current device and streams are
torch's).  ``ctypes`` releases the GIL for the call.  Without CUDA the same runs are copied with
strided tensor copies on the CPU: the run and pitch arithmetic is the same code, and that is
what the CPU tests check, byte for byte.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional, Sequence

from quillcache.client.gpu import _torch, layer_part_spans

__all__ = ["CopyPlan", "runs_of"]

CUDA_MEMCPY_HOST_TO_DEVICE = 1
MAX_PITCH = (1 << 31) - 1                 # bytes: cudaDevAttrMaxPitch on current GPUs; a wider stride is no run
_LOCK = threading.Lock()
_MEMCPY2D: Optional[object] = None          # (cudaMemcpy2DAsync, cudaGetLastError), False where not found


def _memcpy2d():
    """(cudaMemcpy2DAsync, cudaGetLastError) of the CUDA runtime loaded in this process, or None."""
    global _MEMCPY2D
    with _LOCK:
        if _MEMCPY2D is None:
            _MEMCPY2D = False
            # torch's own runtime: the one of its CUDA major version where several are mapped
            major = str(getattr(_torch().version, "cuda", None) or "").split(".")[0]
            found: list[str] = []
            try:
                with open("/proc/self/maps") as maps:
                    found = [line.split()[-1] for line in maps if "libcudart.so" in line]
            except OSError:
                pass
            path = next((f for f in found if major and f"libcudart.so.{major}" in f), found[0] if found else None)
            try:
                lib = ctypes.CDLL(path or "libcudart.so", mode=ctypes.RTLD_GLOBAL)
                fn = lib.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                return None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            clear = lib.cudaGetLastError
            clear.argtypes, clear.restype = [], ctypes.c_int
            _MEMCPY2D = (fn, clear)
        return _MEMCPY2D or None


def runs_of(offsets: Sequence[int], width: int, max_pitch: int = MAX_PITCH) -> list[tuple[int, int, int, int]]:
    """``offsets`` cut into runs ``(first row, end row, offset of the first, stride)``: rows
    j..end-1 lie at ``offset + (j - first) * stride``, with ``width <= stride <= max_pitch``
    (rows may not overlap in a pitched copy, and its pitch is bounded).  A row that starts no
    run of two is a run of one."""
    runs = []
    n = len(offsets)
    j = 0
    while j < n:
        end = j + 1
        stride = width
        if end < n and width <= offsets[end] - offsets[j] <= max_pitch:
            stride = offsets[end] - offsets[j]
            while end < n and offsets[end] - offsets[end - 1] == stride:
                end += 1
        runs.append((j, end, offsets[j], stride))
        j = end
    return runs


class CopyPlan:
    """``GatherPlan``'s interface over pitched copies: ``layer(L)`` -> per part an ``[n, nbytes]``
    uint8 tensor on ``device`` holding part p of layer L of every value, issued on the current
    stream.  ``host`` is the arena as a CPU uint8 tensor over the mapping (``ArenaCopier.host_tensor``)."""

    __slots__ = ("n", "layers", "runs", "_host", "_parts", "_device", "_copy")

    def __init__(self, host, offsets: Sequence[int], layer_parts: Sequence[Sequence[tuple[int, int]]],
                 device) -> None:
        torch = _torch()
        offsets = list(offsets)
        layer_part_spans(host.numel(), offsets, layer_parts, "copy plan")
        self.n, self.layers = len(offsets), len(layer_parts)
        self._host, self._parts = host, [list(parts) for parts in layer_parts]
        self._device = torch.device(device)
        # one cut per part: a run must keep its rows apart by at least that part's width
        self.runs = [runs_of(offsets, nbytes) for _, nbytes in layer_parts[0]]
        if self._device.type == "cuda":
            fns = _memcpy2d()
            if fns is None:
                raise RuntimeError("copy plan: the CUDA runtime's cudaMemcpy2DAsync was not found")
            self._copy = fns
        else:
            self._copy = None

    def layer(self, layer: int) -> list:
        torch = _torch()
        out = []
        for p, (at, nbytes) in enumerate(self._parts[layer]):
            dst = torch.empty((self.n, nbytes), dtype=torch.uint8, device=self._device)
            if self._copy is None:
                for first, end, off, stride in self.runs[p]:
                    dst[first:end].copy_(self._host.as_strided((end - first, nbytes), (stride, 1), off + at))
            else:
                copy, clear = self._copy
                stream = torch.cuda.current_stream(self._device).cuda_stream
                base, src = dst.data_ptr(), self._host.data_ptr() + at
                for first, end, off, stride in self.runs[p]:
                    err = copy(base + first * nbytes, nbytes, src + off, stride, nbytes, end - first,
                               CUDA_MEMCPY_HOST_TO_DEVICE, stream)
                    if err:
                        clear()          # the runtime's last error, so torch's next launch check does not report it
                        raise RuntimeError(f"cudaMemcpy2DAsync of layer {layer}, part {p} failed: error {err}")
            out.append(dst)
        return out
