"""Paged KV caches to and from the pool, with no engine imported: the worker side of the vLLM
connector (``vllm.py`` delegates to it), also driven directly by ``bench/gpu_reload.py``.

A cache is one tensor per layer in vLLM's layout, ``[2, num_blocks, block_size, kv_heads,
head_size]`` (K then V), all on one device (CPU or CUDA).  The unit of transfer is one block of
every layer, stored as one contiguous value ``[layers, 2, block_size, kv_heads, head_size]``.

Call order (vLLM's)::

    register_kv_caches(caches)          once
    start_load_kv(loads)                per step: the loads start on the core's I/O thread
    wait_for_layer_load(name)           per layer, before its attention
    save_kv_layer(name, ...)            per layer: nothing (a block is saved across all layers)
    wait_for_save(saves)                per step: the blocks are gathered (a device copy, on
                                        the engine's stream), then sent asynchronously
    get_finished(finished_req_ids)      requests whose saves are all done
    take_load_errors()                  block ids to recompute

Loads (``load_path``, docs/engines.md "Layer-pipelined loads"):

- ``"layered"`` (the default, over ``unix:`` with the arena mapped and addressable from the
  caches' device): one job per step; located GETs of up to ``staging_bytes`` of blocks at a
  time; as soon as a batch is leased its layer 0 is copied, then layers 1.. of every leased
  batch of every request in order, layers 1.. in groups of ``LAYER_GROUP_BYTES`` of one layer,
  each layer of a batch or group one gather straight out of the mapped arena (``GatherPlan``: on
  CUDA a kernel reading the registered arena, no staging copy), FP8 dequantized per layer.
  ``wait_for_layer_load(L)`` waits until layer L is written (CPU) or issued, and then makes
  the engine's stream wait for layer L's event (CUDA): layer L computes while L+1.. copy.
- ``"staged"`` (and the fallback: TCP, or a device that cannot address the arena):
  ``ArenaCopier`` copies up to ``staging_bytes`` of whole blocks into a staging tensor (adjacent
  blocks merged into one copy), then they are scattered layer by layer;
  ``wait_for_layer_load`` waits for the whole copy first.

The stored value is the same either way, so the two paths read each other's blocks.

Every failure is a miss: a load that fails or runs past the core's deadline reports all of its
blocks not loaded before it (``take_load_errors``) and never writes a cache block afterwards (a
layered load cut off by the deadline, or by an error that is not the node's, may leave its
leased blocks with only their first layers written: they are among the blocks reported, and the
recompute overwrites them); a save that
fails is not reported stored (batches the node committed before the failure stay: their bytes
are right).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from quillcache.connectors.core import BATCH_BLOCKS, ConnectorCore, blocks_per_request
from quillcache.connectors.kvquant import make_codec
from quillcache.errors import QuillCacheError, Timeout
from quillcache.model import KvBlockKey

__all__ = ["Transfer", "PagedKVWorker", "STAGING_BYTES", "LOAD_PATHS"]

STAGING_BYTES = 256 << 20        # bytes of blocks per load chunk (staged: the device staging tensor)
LAYER_GROUP_BYTES = 32 << 20     # layered: one layer's bytes (engine dtype) moved by one gather and one scatter
LOAD_PATHS = ("layered", "staged")
LAYER_COPIES = ("kernel", "dma")  # layered: a gather kernel over the registered arena, or the copy engines

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """Blocks of one request: ``keys[i]`` is stored in paged block ``block_ids[i]``."""
    req_id: str
    keys: list[KvBlockKey]
    block_ids: list[int]
    event: Any = None                           # the adapter's, reported once stored (take_stored)


@dataclass
class _Load:
    transfer: Transfer
    future: Optional[Future] = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False                     # set under lock: no scatter is issued after it
    loaded: Optional[int] = None                # leading blocks in place (None: not waited yet)
    events: Optional[list] = None               # per layer, CUDA only
    layered: bool = False                       # the layer-pipelined path (_load_layered)
    ready: int = 0                              # layered: layers 0..ready-1 written (CPU) or issued (CUDA)
    cond: threading.Condition = field(default_factory=threading.Condition)
    after: Any = None                           # CUDA: the engine stream's work before start_load_kv
    result: Optional[tuple] = None              # a step job's outcome for this load: (blocks, events)
    # layered, on the I/O thread: the leased batches ((plan, block ids on the device), with the
    # arena offsets of them all: the first n of the transfer's blocks), their leases, the outcome
    batches: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    leases: Optional[contextlib.ExitStack] = None
    n: int = 0
    failure: Optional[BaseException] = None


def _torch():
    import torch
    return torch


_CANCELLED = Timeout("the load ran past the connector's deadline")
_STOPPED = RuntimeError("the load stopped before every layer was written")


class PagedKVWorker:
    """Moves whole blocks between per-layer paged caches and the pool, through one core."""

    def __init__(self, core: ConnectorCore, *, staging_bytes: int = STAGING_BYTES,
                 kv_dtype: Optional[str] = None, load_path: str = "layered",
                 layer_gate: Optional[Callable[[str, int], None]] = None, layer_copy: str = "kernel") -> None:
        if load_path not in LOAD_PATHS:
            raise ValueError(f"load_path {load_path!r}: one of {', '.join(LOAD_PATHS)}")
        if layer_copy not in LAYER_COPIES:
            raise ValueError(f"layer_copy {layer_copy!r}: one of {', '.join(LAYER_COPIES)}")
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes {staging_bytes}: must be positive")
        self.core = core
        self.staging_bytes = int(staging_bytes)
        self.kv_dtype = kv_dtype            # what the pool stores (kvquant.py); None: the caches' dtype
        self.load_path = load_path          # "layered" where the arena is mapped and addressable, else staged
        # layered: how a layer leaves the arena: "kernel" (GatherPlan: one index_select over the
        # registered mapping) or "dma" (gpu_dma.CopyPlan: pitched copies by the copy engines;
        # not yet measured on a GPU, so not the default)
        self.layer_copy = layer_copy
        # called on the I/O thread as (req_id, layer) before a layered load issues that layer's
        # copies: an observation point for tests and benchmarks (it may block; it delays only that load)
        self.layer_gate = layer_gate
        self.paths_used = dict.fromkeys(LOAD_PATHS, 0)     # loads per path actually taken
        self.codec = None                   # set by register_kv_caches
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._caches: list = []
        self._copier = None
        self._loads: list[_Load] = []
        self._saves: dict[str, list[tuple[Transfer, Future]]] = {}
        self._finishing: set[str] = set()
        self._stored: list[Transfer] = []
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, caches: Mapping[str, Any]) -> None:
        """Per-layer caches, in layer order: ``[2, num_blocks, block_size, kv_heads, head_size]``
        each, one shape, dtype and device."""
        torch = _torch()
        tensors = list(caches.values())
        if not tensors:
            raise ValueError("register_kv_caches: no caches")
        first = tensors[0]
        for name, c in caches.items():
            if not isinstance(c, torch.Tensor) or c.dim() != 5 or c.shape[0] != 2:
                raise ValueError(f"register_kv_caches: {name}: expected [2, num_blocks, block_size, kv_heads, "
                                 f"head_size], got {getattr(c, 'shape', type(c).__name__)}")
            if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"register_kv_caches: {name}: {tuple(c.shape)} {c.dtype} on {c.device} differs "
                                 f"from the first layer's {tuple(first.shape)} {first.dtype} on {first.device}")
        self._names = list(caches)
        self._index = {n: i for i, n in enumerate(self._names)}
        self._caches = tensors
        self.codec = make_codec(self.kv_dtype, first.dtype)

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def device(self):
        return self._caches[0].device

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (len(self._caches), 2, *self._caches[0].shape[2:])

    @property
    def block_nbytes(self) -> int:
        c = self._caches[0]
        return len(self._caches) * 2 * c[0, 0].numel() * c.element_size()

    @property
    def stored_nbytes(self) -> int:
        """Bytes of one stored value: the block, or its quantized form (kvquant.py)."""
        return self.codec.stored_nbytes(self.block_shape, self._caches[0].element_size())

    def _copier_for(self, client):
        from quillcache.client.gpu import ArenaCopier
        if self._copier is None or self._copier.client is not client:     # a reconnect: a new client
            self._copier = ArenaCopier(client, device=self.device)
        return self._copier

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, loads: Sequence[Transfer]) -> None:
        """Start this step's loads: one job on the I/O thread for all of them, so that with the
        layered path layer 0 of every request comes before layer 1 of any."""
        self._finish_loads()
        new = [_Load(t, layered=self.load_path == "layered") for t in loads if t.keys]
        if not new:
            return
        torch = _torch()
        for load in new:
            if self.device.type == "cuda":      # the copies into the blocks wait for what the engine queued
                load.after = torch.cuda.Event()
                load.after.record(torch.cuda.current_stream(self.device))
        fut = self.core.call_async(lambda client: self._load_step(new, client), what="load", default=None)
        for load in new:
            load.future = fut
            fut.add_done_callback(lambda _f, load=load: self._set_ready(load, 0))    # wakes the waiters
        self._loads += new

    def _load_step(self, loads: list, client) -> None:
        """On the I/O thread: the layered path where it can run, else the staged one; each
        load's outcome goes to ``load.result`` (a node failure raised out of here is the core's
        to count, and leaves the loads without a result: misses)."""
        self.core.count("loads", len(loads))
        copier = self._copier_for(client)
        arena = copier.arena_tensor() if self.load_path == "layered" else None
        if arena is not None:
            self.paths_used["layered"] += len(loads)
            self._load_layered(loads, client, copier, arena)
            return
        self.paths_used["staged"] += len(loads)
        for load in loads:
            load.result = self._load_staged(load, copier)

    def _load_layered(self, loads: list, client, copier, arena) -> None:
        """Layer by layer straight out of the mapped arena, for every load of the step: located
        GETs of up to ``staging_bytes`` of blocks at a time, each batch's layer 0 copied as soon
        as it is leased, then layers 1.. of every leased block of every load in order, each layer
        of a group one gather (``_plan``; FP8 dequantized per layer), with the
        load's ``ready`` raised (and on CUDA an event recorded) after each layer, so
        ``wait_for_layer_load(L)`` waits for layer L only.

        No block is left with some layers written and others not: a batch is written only
        once its lease is held, and every leased batch is completed, even after the node
        died (the mapping outlives it, and a leased extent is not reused); a batch whose lease
        may have run out before its first byte was read is not written at all.  Then each
        load's leases are released and their expiry checked: a late one fails that load, and
        its request recomputes (its blocks were written whole, from extents that may have been
        reused: the recompute overwrites them).  Only the core's deadline, or an error that is
        not the node's, stops the writes between layers (the request is then reported whole)."""
        torch = _torch()
        stream = copier.stream
        step = max(1, min(self.staging_bytes // self.stored_nbytes, BATCH_BLOCKS))
        elt = self._caches[0].element_size()
        parts = [self.codec.layer_parts(self.block_shape, elt, layer) for layer in range(self.num_layers)]
        lost: Optional[BaseException] = None          # the connection failed: no more GETs this step
        finished = False                              # every layer of every leased batch was written
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    for load in loads:
                        load.events = [None] * self.num_layers if stream is not None else None
                        load.leases = contextlib.ExitStack()
                        if stream is not None and load.after is not None:
                            stream.wait_event(load.after)
                        if lost is not None:
                            load.failure = lost
                            continue
                        try:
                            self._gate(load.transfer, 0)
                            self._lease_batches(load, client, copier, arena, step, parts)
                        except (QuillCacheError, OSError) as exc:
                            load.failure = exc     # its leased batches are completed: their extents stay put
                            if not isinstance(exc, Timeout):
                                lost = exc
                    for load in loads:
                        self._layer_done(load, 0, stream)
                        if load.batches and load.failure is not _CANCELLED:
                            load.batches = self._regroup(load, copier, arena, parts)
                    for layer in range(1, self.num_layers):
                        for load in loads:
                            if load.batches and load.failure is not _CANCELLED:
                                self._gate(load.transfer, layer)
                                if not self._write_layer(load, layer, load.batches):
                                    load.failure = _CANCELLED      # the deadline: nothing more for this load
                                    continue
                            self._layer_done(load, layer, stream)
                    finished = True
                finally:
                    if stream is not None:
                        stream.synchronize()      # every read of the arena is done before the leases go
        finally:
            for load in loads:                    # release each load's leases and check their expiry
                if not finished and load.failure is None:
                    load.failure = _STOPPED       # an error that is not the node's (device memory, ...)
                if load.leases is not None:
                    try:
                        load.leases.close()
                    except (QuillCacheError, OSError) as exc:
                        load.failure = load.failure or exc
                if load.failure is None:
                    self.core.count("loaded_blocks", load.n)
                elif load.failure is not lost:
                    self.core.count("load_errors")
                load.result = (0 if load.failure is not None else load.n, load.events)
        if lost is not None:
            raise lost                            # the core counts it once and drops the connection

    def _lease_batches(self, load: _Load, client, copier, arena, step: int, parts) -> None:
        """Located GETs of the load's keys, ``step`` at a time, each batch's layer 0 written once
        it is leased; stops at the first block that is not there whole.  A batch is kept as its
        plan (``_plan``: every layer's arena rows, on the device once) and its block ids."""
        t = load.transfer
        stored = self.stored_nbytes
        for a in range(0, len(t.keys), step):
            keys = t.keys[a:a + step]
            asked = time.monotonic_ns()
            views = load.leases.enter_context(client.get_many_located(keys))
            lead = 0
            for ext in views.extents:
                if ext is None or ext[1] != stored:
                    break
                lead += 1
            if not lead:
                return
            # the node granted the lease after `asked`, so it ends no earlier than asked + lease
            if copier.lease_ns and time.monotonic_ns() >= asked + copier.lease_ns:
                raise Timeout("layered load: the located lease may have run out before the copy; "
                              "nothing of this batch is written")
            offsets = [e[0] for e in views.extents[:lead]]
            batch = (self._plan(copier, arena, offsets, parts), self._device_ids(t.block_ids[a:a + lead]))
            if not self._write_layer(load, 0, [batch]):
                load.failure = _CANCELLED
                return
            load.batches.append(batch)
            load.offsets += offsets
            load.n += lead
            if lead < len(keys):
                return

    def _device_ids(self, block_ids: list):
        torch = _torch()
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type != "cpu":                # pinned: the copy does not wait for the stream
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return ids

    def _plan(self, copier, arena, offsets: list, parts):
        """How the layers of blocks at ``offsets`` leave the arena (``layer_copy``)."""
        if self.layer_copy == "dma":
            from quillcache.client.gpu_dma import CopyPlan
            return CopyPlan(copier.host_tensor(), offsets, parts, self.device)
        from quillcache.client.gpu import GatherPlan
        return GatherPlan(arena, offsets, parts)

    def _regroup(self, load: _Load, copier, arena, parts) -> list:
        """Layers 1.. of a load's leased blocks, in groups of ``LAYER_GROUP_BYTES`` of one layer
        rather than in the batches they were leased in: each layer of a group is one gather and
        one scatter, so an 8k-token 8B load issues 2 kernels per layer instead of 2 per batch
        (the I/O thread's launches, not the bus, were what bounded it on an H200)."""
        per = max(1, LAYER_GROUP_BYTES // max(1, self.block_nbytes // self.num_layers))
        if len(load.batches) == 1 or load.batches[0][0].n >= per:
            return load.batches                      # one batch already, or batches as large as a group
        ids = load.transfer.block_ids[:load.n]  # the leased blocks are its first load.n, in order
        return [(self._plan(copier, arena, load.offsets[a:a + per], parts), self._device_ids(ids[a:a + per]))
                for a in range(0, load.n, per)]

    def _gate(self, t: Transfer, layer: int) -> None:
        if self.layer_gate is not None:
            self.layer_gate(t.req_id, layer)

    def _write_layer(self, load: _Load, layer: int, batches) -> bool:
        """Layer ``layer`` of each batch from the arena into its paged blocks; False once the
        load was cancelled (past the deadline nothing more is written)."""
        cache = self._caches[layer]
        layer_shape = self.block_shape[1:]
        with load.lock:
            if load.cancelled:
                return False
            for plan, ids in batches:
                cache.index_copy_(1, ids, self.codec.decode_layer(plan.layer(layer), layer_shape).transpose(0, 1))
        return True

    def _layer_done(self, load: _Load, layer: int, stream) -> None:
        if load.events is not None:
            ev = _torch().cuda.Event()
            ev.record(stream)
            load.events[layer] = ev
        self._set_ready(load, layer + 1)

    @staticmethod
    def _set_ready(load: _Load, ready: int) -> None:
        with load.cond:
            load.ready = max(load.ready, ready)
            load.cond.notify_all()

    def _load_staged(self, load: _Load, copier) -> tuple[int, Optional[list]]:
        """Chunks of whole blocks into staging (one coalesced copy each), then scattered layer by layer."""
        torch = _torch()
        t = load.transfer
        stream = copier.stream
        codec, stored = self.codec, self.stored_nbytes
        per = max(1, min(self.staging_bytes // stored, BATCH_BLOCKS))   # more keys overflow the node's header limit
        events: Optional[list] = [None] * self.num_layers if stream is not None else None
        n = 0
        if stream is not None and load.after is not None:
            stream.wait_event(load.after)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                staging = codec.staging(min(per, len(t.keys)), self.block_shape, self.device)
                for a in range(0, len(t.keys), per):
                    keys = t.keys[a:a + per]
                    got = copier.load(keys, list(staging[:len(keys)]))
                    lead = 0
                    while lead < len(got) and got[lead] == stored:
                        lead += 1
                    if lead:
                        ids = self._device_ids(t.block_ids[a:a + lead])
                        blocks = codec.decode(staging[:lead], self.block_shape)    # FP8: dequantized here
                        with load.lock:
                            if load.cancelled:
                                break
                            for layer, cache in enumerate(self._caches):
                                cache.index_copy_(1, ids, blocks[:, layer].transpose(0, 1))
                                if events is not None:
                                    events[layer] = torch.cuda.Event()
                                    events[layer].record(stream)
                    n += lead
                    if lead < len(keys):
                        break
        except BaseException:
            if stream is not None:
                stream.synchronize()      # what was issued lands before the blocks are recomputed
            raise
        self.core.count("loaded_blocks", n)
        return n, events

    def _resolve(self, load: _Load) -> None:
        if load.loaded is not None:
            return
        try:
            got = self.core.wait(load.future, what="load")
        except Exception:                 # not a node failure (e.g. device memory): still a miss
            log.warning("quillcache: a load failed; its blocks are recomputed", exc_info=True)
            self.core.count("load_errors")
            got = 0
        if load.future.done() and load.result is not None:
            got = load.result                 # the step job's outcome for this load
        if isinstance(got, tuple):
            load.loaded, load.events = got
        else:                             # past the deadline: nothing more may be written
            with load.lock:
                load.cancelled = True
            if self._copier is not None and self._copier.stream is not None:
                self._copier.stream.synchronize()
            load.loaded, load.events = 0, None
        self._load_errors.update(load.transfer.block_ids[load.loaded:])      # the engine recomputes these

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return when ``layer_name``'s blocks are in place for the engine's current stream (on
        CUDA: a stream wait on that layer's event, no host synchronisation).  A layered load is
        waited for that layer only (its leases are checked later, in ``wait_for_save`` /
        ``take_load_errors``); a staged one in full; a name not registered waits for every layer."""
        if not self._loads:
            return
        layer = self._index.get(layer_name)
        i = self.num_layers - 1 if layer is None else layer
        torch = _torch()
        for load in self._loads:
            if layer is not None and load.layered and load.loaded is None and self._wait_layer(load, layer):
                ev = load.events[layer] if load.events is not None else None
                if ev is not None:
                    torch.cuda.current_stream(self.device).wait_event(ev)
                continue
            self._resolve(load)
            if load.events is not None:
                ev = next((e for e in reversed(load.events[:i + 1]) if e is not None), None)
                if ev is not None:
                    torch.cuda.current_stream(self.device).wait_event(ev)

    def _wait_layer(self, load: _Load, layer: int) -> bool:
        """Wait (at most the core's deadline) until a layered load has layer ``layer`` in
        place; False when the job ended or the deadline passed first (the caller resolves it)."""
        deadline = time.monotonic() + self.core.timeout + 1.0
        with load.cond:
            while load.ready <= layer and not load.future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                load.cond.wait(left)
            return load.ready > layer

    def _finish_loads(self) -> None:
        if self._loads:
            self.wait_for_layer_load("")      # every layer: nothing is left running unseen
        self._loads = []

    def take_load_errors(self) -> set[int]:
        """Block ids to recompute; every load is resolved first (its leases checked)."""
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Nothing per layer: a block is saved across every layer in ``wait_for_save``."""

    def wait_for_save(self, saves: Sequence[Transfer]) -> None:
        """Gather each transfer's blocks (a copy on the engine's current stream, so a block
        reused later cannot change what is saved) and send them asynchronously."""
        self._finish_loads()
        torch = _torch()
        for t in saves:
            if not t.keys:
                continue
            ids = torch.tensor(t.block_ids, dtype=torch.long, device=self.device)
            buf = torch.empty((len(ids), *self.block_shape), dtype=self._caches[0].dtype, device=self.device)
            for layer, cache in enumerate(self._caches):
                buf[:, layer] = cache.index_select(1, ids).transpose(0, 1)
            buf = self.codec.encode(buf)         # FP8: quantized on the engine's stream
            ready = None
            if buf.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            fut = self.core.call_async(lambda client, t=t, buf=buf, ready=ready: self._save_job(t, buf, ready, client),
                                       what="save", default=False)
            self._saves.setdefault(t.req_id, []).append((t, fut))

    def _save_job(self, t: Transfer, buf, ready, client) -> bool:
        self.core.count("saves")
        if ready is not None:
            ready.synchronize()              # the gather on the engine's stream is done
        copier = self._copier_for(client)
        rows = list(buf)
        step = blocks_per_request(self.stored_nbytes)
        for a in range(0, len(rows), step):
            copier.save(t.keys[a:a + step], rows[a:a + step])
        self.core.count("saved_blocks", len(rows))
        return True

    def get_finished(self, finished_req_ids: set[str]) -> Optional[set[str]]:
        """The finished requests whose saves have all completed (None if none)."""
        self._collect_saves()
        self._finishing |= {r for r in finished_req_ids if r in self._saves}
        done = set()
        for rid in list(self._finishing):
            if not self._saves.get(rid):
                done.add(rid)
                self._finishing.discard(rid)
                self._saves.pop(rid, None)
        return done or None

    def _collect_saves(self) -> None:
        for futs in self._saves.values():
            left = []
            for t, f in futs:
                if not f.done():
                    left.append((t, f))
                elif f.exception() is not None:
                    log.warning("quillcache: a save failed", exc_info=f.exception())
                    self.core.count("save_errors")
                elif f.result() is True:
                    self._stored.append(t)
            futs[:] = left

    def take_stored(self) -> list[Transfer]:
        """Transfers stored in full since the last call (for the engine's KV events)."""
        self._collect_saves()
        stored, self._stored = self._stored, []
        return stored

    def shutdown(self) -> None:
        self._finish_loads()
        for futs in self._saves.values():
            for _, f in futs:
                try:
                    self.core.wait(f, what="save")
                except Exception:         # counted in _collect_saves' terms; shutting down anyway
                    self.core.count("save_errors")
        self._saves.clear()
