"""Moving KV blocks between torch tensors and the node's mapped arena (docs/shm.md).

torch is optional and imported only when these helpers are used; the daemon and the
client never import it.

    from quillcache import Client
    from quillcache.client.gpu import ArenaCopier
    with Client("unix:var/quillcached.sock") as c:
        gpu = ArenaCopier(c)                  # registers the mapped arena with CUDA once
        gpu.save(keys, kv_tensors)            # device -> arena slots -> commit
        gpu.load(keys, kv_tensors)            # arena -> device; the lease ends when the copy did

With CUDA and a mapped arena, every block is one ``cudaMemcpyAsync`` (``Tensor.copy_``
with ``non_blocking``) between device memory and the registered (page-locked) arena, all
on one stream; the call returns after one event says they completed, and only then is the
lease released (load) or the batch committed (save).  Without CUDA the same calls copy
between CPU tensors and the arena.  Without a mapping (TCP, or a client that may not map)
they fall back to ``get_many_into`` / ``put_many`` through a host buffer.

A tensor handed to load/save must be contiguous; its bytes are the block (any dtype).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from quillcache.errors import InvalidArgument, NotFound

__all__ = ["ArenaCopier", "GatherPlan", "torch_available", "cuda_available"]

# arena address -> its live registration in this process (gone with the last copier holding it)
_REGISTERED: "weakref.WeakValueDictionary[int, _Registration]" = weakref.WeakValueDictionary()
_REG_LOCK = threading.Lock()
CUDA_HOST_REGISTER_PORTABLE = 1         # cudaHostRegisterPortable: pinned for every CUDA context
CUDA_HOST_REGISTER_MAPPED = 2           # cudaHostRegisterMapped: kernels may read it (``arena_tensor``)
_WORDS = ((8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8"))   # widest element a gather may move


class _MappedArena:
    """``__cuda_array_interface__`` of the registered arena: a CUDA tensor over host memory
    (unified addressing: the host address is the device address of registered memory)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class _Registration:
    """One ``cudaHostRegister`` of a mapped arena, shared by every copier over that mapping and
    undone (``cudaHostUnregister``) when the last of them goes, *before* the mapping can be
    unmapped: it holds a buffer export of the arena's mmap, so ``Arena.close`` cannot unmap
    the pages under it.  An arena unmapped while still registered leaves its range mapped on
    the device, and the next device allocation the kernel places at that address fails with
    cudaErrorAlreadyMapped (seen on an H100: after one node's arena was closed, every later
    allocation of the process failed)."""

    def __init__(self, torch, arena) -> None:
        self.address, self.size = arena.address, arena.size
        self._cudart = torch.cuda.cudart()
        err = self._cudart.cudaHostRegister(self.address, self.size,
                                            CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
        code = int(err) if not hasattr(err, "value") else int(err.value)
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of the {self.size}-byte arena failed: error {code}")
        self._pin = memoryview(arena.map)        # the mapping stays until this registration is undone

    def __del__(self) -> None:
        pin = getattr(self, "_pin", None)
        if pin is None:                          # never registered
            return
        try:
            self._cudart.cudaHostUnregister(self.address)
        except Exception:                        # interpreter shutdown: CUDA may be gone already
            pass
        pin.release()


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise ImportError("quillcache.client.gpu needs torch (pip install torch)") from exc
    return torch


def torch_available() -> bool:
    try:
        _torch()
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    return torch_available() and _torch().cuda.is_available()


def _bytes_of(t, what: str):
    """A flat uint8 view of a contiguous tensor (same storage)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what}: a torch.Tensor, not {type(t).__name__}")
    if not t.is_contiguous():
        raise InvalidArgument(f"{what}: the tensor must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _runs(pairs):
    """Coalesce (arena offset, flat uint8 tensor, nbytes) copies into runs: where the next
    block follows the previous one both in the arena and in the tensor's memory (one
    storage), the two become one copy.  A batch saved in order into a fresh arena and loaded
    into one KV buffer is then a handful of large copies instead of one per block."""
    torch = _torch()
    out = []
    run = None                               # [offset, first tensor, nbytes, storage, start byte]
    for off, t, n in pairs:
        st = t.untyped_storage()
        start = t.storage_offset() * t.element_size()
        if (run is not None and run[0] + run[2] == off and run[3].data_ptr() == st.data_ptr()
                and run[4] + run[2] == start and run[1].device == t.device):
            run[2] += n
            continue
        if run is not None:
            out.append(run)
        run = [off, t, n, st, start]
    if run is not None:
        out.append(run)
    result = []
    for off, t, n, st, start in out:
        if n == t.numel():
            result.append((off, t[:n]))
        else:                                # a view of the whole run in that storage
            view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, start, (n,), (1,))
            result.append((off, view))
    return result


def layer_part_spans(size: int, offsets: list, layer_parts, what: str) -> list[tuple[list[int], int]]:
    """Per part of a value: (its offset in every layer, its size), checked: one positive size
    in every layer, and every value's part inside the ``size``-byte arena (GatherPlan, CopyPlan)."""
    if not offsets or not layer_parts or not layer_parts[0]:
        raise InvalidArgument(f"{what}: nothing to copy")
    lo, hi = min(offsets), max(offsets)
    out = []
    for p, (_, nbytes) in enumerate(layer_parts[0]):
        ats = [parts[p][0] for parts in layer_parts]
        if nbytes <= 0 or any(parts[p][1] != nbytes for parts in layer_parts):
            raise InvalidArgument(f"{what}: part {p} must have one positive size in every layer")
        if lo + min(ats) < 0 or hi + max(ats) > size - nbytes:
            raise InvalidArgument(f"{what}: {hi + max(ats)}+{nbytes} outside the {size}-byte arena")
        out.append((ats, nbytes))
    return out


class GatherPlan:
    """Where a batch of stored values lies in the arena, for reading them a layer at a time.

    ``layer_parts[L]`` lists the ``(offset in a value, nbytes)`` parts of layer L (the same
    sizes in every layer).  Built once per batch: per part a window view of the arena (row j =
    the ``nbytes`` from ``j * step``, ``step`` the largest common divisor of every offset, moved
    in the widest word that divides it) and one ``[layers, n]`` row index, sent to the arena's
    device in one copy.  ``layer(L)`` is then one ``index_select`` per part: no Python per
    block, and no host-to-device copy per layer that would wait for the stream."""

    __slots__ = ("_windows", "_idx", "n", "layers")

    def __init__(self, arena, offsets: Sequence[int], layer_parts: Sequence[Sequence[tuple[int, int]]]) -> None:
        torch = _torch()
        offsets = list(offsets)
        size = arena.numel()
        checked = layer_part_spans(size, offsets, layer_parts, "gather")
        base = 0
        for off in offsets:
            base = math.gcd(base, off)
        self.n, self.layers = len(offsets), len(layer_parts)
        self._windows = []
        rows_of = []
        for ats, nbytes in checked:
            step = base
            for at in ats:
                step = math.gcd(step, at)
            step = step or nbytes
            word, name = next((w, n) for w, n in _WORDS if step % w == 0 and nbytes % w == 0 and size % w == 0)
            words = arena.view(getattr(torch, name)) if word > 1 else arena
            rows = (size - nbytes) // step + 1
            self._windows.append(words.as_strided((rows, nbytes // word), (step // word, 1)))
            rows_of.append(np.add.outer(np.asarray(ats, dtype=np.int64) // step,
                                        np.asarray(offsets, dtype=np.int64) // step))
        idx = torch.from_numpy(np.stack(rows_of))                # [parts, layers, n]
        if arena.device.type != "cpu":                           # pinned: the copy does not wait for the stream
            idx = idx.pin_memory().to(arena.device, non_blocking=True)
        self._idx = idx

    def layer(self, layer: int) -> list:
        """Layer ``layer`` of every value: per part an ``[n, nbytes]`` uint8 tensor on the arena's device."""
        torch = _torch()
        return [torch.index_select(w, 0, self._idx[p, layer]).view(torch.uint8) for p, w in enumerate(self._windows)]


class ArenaCopier:
    """Batched copies between tensors and one client's mapped arena."""

    def __init__(self, client, *, device: Optional[Any] = None, register: bool = True) -> None:
        torch = _torch()
        self.client = client
        self.cuda = torch.cuda.is_available()
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu"))
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._arena = None
        self._host = None                      # uint8 tensor over the whole mapped arena
        self._device_arena = None              # the same bytes as a CUDA tensor (arena_tensor)
        self.registered = False
        self._registration = None
        self._bind()
        if register and self.stream is not None and self._arena is not None:
            self.register()

    def _bind(self) -> None:
        """(Re)attach to the client's current mapping (a reconnect maps a new arena)."""
        torch = _torch()
        arena = getattr(self.client, "arena", None)
        if arena is self._arena:
            return
        self._arena = arena
        self.registered = False
        self._registration = None               # the old mapping's, if no other copier holds it
        self._device_arena = None
        self._host = None if arena is None else torch.frombuffer(arena.map, dtype=torch.uint8)
        if arena is not None and self.stream is not None:
            self.register()

    def register(self) -> None:
        """cudaHostRegister the mapped arena, once per mapping in this process, so that copies
        to and from it run at pinned-memory speed."""
        arena = self._arena
        if arena is None or self.stream is None:
            return
        torch = _torch()
        # under the copier's device: the registration names the device current in this thread
        # (an I/O thread's is device 0), and arena_tensor's view lives on that device
        with _REG_LOCK, torch.cuda.device(self.device):
            reg = _REGISTERED.get(arena.address)
            if reg is None or reg.size != arena.size:
                reg = _Registration(torch, arena)
                _REGISTERED[arena.address] = reg
        self._registration = reg               # unregistered when the last copier over the arena goes
        self.registered = True

    # ------------------------------------------------------------------ layer slices

    @property
    def lease_ns(self) -> int:
        """The node's located lease (0: no mapping)."""
        return int(getattr(self._arena, "lease_ns", 0) or 0) if self._arena is not None else 0

    def host_tensor(self):
        """The mapped arena as a CPU uint8 tensor over the mapping itself (no copy), or None
        without a mapping: the source of ``gpu_dma.CopyPlan``'s pitched copies."""
        self._bind()
        return self._host

    def arena_tensor(self):
        """The mapped arena as a uint8 tensor on the copier's device, for ``GatherPlan``: on CPU
        the mapping itself; on CUDA the registered mapping seen by kernels (a gather kernel then
        reads host memory over the bus, no staging copy).  None without a mapping, or where
        the device cannot address it (the caller falls back to whole-block copies)."""
        self._bind()
        if self._arena is None:
            return None
        if self.stream is None:
            return self._host
        if self._device_arena is None and self.registered:
            torch = _torch()
            try:
                with torch.cuda.device(self.device):
                    t = torch.as_tensor(_MappedArena(self._arena.address, self._arena.size))
                if t.device != self.device:      # never device=: that would copy the whole arena over
                    raise RuntimeError(f"the arena is registered for {t.device}, the caches are on {self.device}")
                probe = min(4096, self._arena.size)
                if not torch.equal(t[:probe].cpu(), self._host[:probe]):
                    raise RuntimeError("the device view of the arena reads other bytes")
            except (RuntimeError, TypeError, ValueError) as exc:
                import logging
                logging.getLogger(__name__).warning("quillcache: kernels cannot read the mapped arena (%s); "
                                                    "loads copy whole blocks", exc)
                self._device_arena = False
            else:
                self._device_arena = t
        return self._device_arena if self._device_arena is not False else None

    # ------------------------------------------------------------------ load

    def load(self, keys: Sequence, dst_tensors: Sequence) -> list[Optional[int]]:
        """Copy each key's block into the tensor at the same position; returns the bytes
        copied per key, None for a miss (that tensor is left as it was)."""
        keys = list(keys)
        dsts = [_bytes_of(t, f"load: tensor {i}") for i, t in enumerate(dst_tensors)]
        if len(dsts) != len(keys):
            raise InvalidArgument(f"load: {len(keys)} keys and {len(dsts)} tensors")
        self._bind()
        if self._arena is None:
            return self._load_copy(keys, dsts)
        torch = _torch()
        out: list = []
        with self.client.get_many_located(keys) as views:
            for i, (ext, dst) in enumerate(zip(views.extents, dsts)):
                if ext is None:
                    out.append(None)
                    continue
                off, n = ext
                if n > dst.numel():
                    raise InvalidArgument(f"load: tensor {i} has {dst.numel()} bytes, its block is {n} bytes")
                out.append(n)
            runs = _runs([(ext[0], dst, n) for ext, dst, n in zip(views.extents, dsts, out) if n is not None])
            if self.stream is None:
                for off, dst in runs:
                    dst.copy_(self._host[off:off + dst.numel()])
            else:
                with torch.cuda.stream(self.stream):
                    for off, dst in runs:
                        dst.copy_(self._host[off:off + dst.numel()],
                                  non_blocking=self.registered and dst.device.type == "cuda")
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()             # the copies completed: now the lease may go
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out

    def _load_copy(self, keys, dsts) -> list[Optional[int]]:
        torch = _torch()
        sizes = []
        for d in dsts:
            sizes.append(d.numel())
        host = [torch.empty(n, dtype=torch.uint8, pin_memory=self.stream is not None) for n in sizes]
        got = self.client.get_many_into(keys, [h.numpy() for h in host])
        for d, h, n in zip(dsts, host, got):
            if n is not None:
                d[:n].copy_(h[:n])
        return got

    # ------------------------------------------------------------------ save

    def save(self, keys: Sequence, src_tensors: Sequence, durable: bool = False) -> None:
        """Store each tensor's bytes under the key at the same position (one batch: reserve,
        copy device -> arena slots on the stream, wait, commit)."""
        keys = list(keys)
        srcs = [_bytes_of(t, f"save: tensor {i}") for i, t in enumerate(src_tensors)]
        if len(srcs) != len(keys):
            raise InvalidArgument(f"save: {len(keys)} keys and {len(srcs)} tensors")
        self._bind()
        if self._arena is None:
            self.client.put_many([(k, s.cpu().numpy()) for k, s in zip(keys, srcs)], durable)
            return
        torch = _torch()
        with self.client.put_many_reserved([(k, s.numel()) for k, s in zip(keys, srcs)], durable) as views:
            runs = _runs([(self._offset_of(v), s, s.numel()) for v, s in zip(views, srcs)])
            if self.stream is None:
                for off, s in runs:
                    self._host[off:off + s.numel()].copy_(s)
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))   # the producer's writes first
                with torch.cuda.stream(self.stream):
                    for off, s in runs:
                        self._host[off:off + s.numel()].copy_(s, non_blocking=self.registered and s.is_cuda)
                done = torch.cuda.Event()
                done.record(self.stream)
                done.synchronize()             # every byte is in its slot before the commit

    def _offset_of(self, view: memoryview) -> int:
        import ctypes
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        off = addr - self._arena.address
        if not 0 <= off <= self._arena.size - view.nbytes:
            raise NotFound("a reserved slot lies outside the mapped arena")
        return off
