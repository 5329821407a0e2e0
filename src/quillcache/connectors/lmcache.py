"""QuillCache as an LMCache remote storage plugin (tested against lmcache 0.5.6).

LMCache config (YAML, or the matching ``LMCACHE_*`` variables)::

    remote_url: "plugin://quillcache"
    remote_storage_plugins: ["quillcache"]
    remote_serde: "naive"
    extra_config:
      remote_storage_plugin.quillcache.module_path: quillcache.connectors.lmcache
      remote_storage_plugin.quillcache.class_name: QuillCacheRemoteConnector
      remote_storage_plugin.quillcache.address: unix:/run/quillcache/quillcached.sock
      remote_storage_plugin.quillcache.token_file: /etc/quillcache/engine.token

LMCache builds the class as ``QuillCacheRemoteConnector(loop=, local_cpu_backend=, config=)``
(``DynamicConnectorAdapter``), without the engine metadata that ``RemoteConnector.__init__``
asserts, so that constructor is not called: everything a value needs to be rebuilt (shapes,
dtypes, memory format) travels in a small header in front of its bytes.

Identity: an LMCache ``CacheEngineKey`` (model name, world size, worker id, chunk hash, dtype,
tags) becomes a ``KvBlockKey`` whose model scope carries the model name, ``worker_id`` of
``world_size`` (as the TP rank), the dtype, the chunk size and the configured layout; the block
hash is LMCache's chunk hash (hex; a layer-wise key adds ``@L<layer>``, other tags
``@<name>%<value>``).  The tenant is the key's tag ``quillcache_tenant`` (LMCache request
config ``lmcache.tag.quillcache_tenant``), else the ``tenant`` setting; the adapter is the tag
``quillcache_adapter``, else the ``adapter`` setting, else None (LMCache's chunk hash leaves LoRA
out).  LMCache's chunk hash already covers the whole prefix, so ``prefix_hash`` is "".

Every failure (node gone, timeout, a value that does not decode, no memory to receive into) is
a miss: ``get`` returns None, ``exists`` False, ``put`` stores nothing; nothing raises into
LMCache.  The reference ``put`` is handed is released by LMCache's own wrapper when ``put``
returns (``InstrumentedRemoteConnector``, 0.5.6); ``put`` holds a second one of its own until
the I/O thread is done with the bytes (also after a timeout), so a late send never reads
memory LMCache has reused.
"""
from __future__ import annotations

import asyncio
import logging
import struct
import threading
from concurrent.futures import Future
from typing import Any, List, Optional

import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from quillcache.connectors import settings
from quillcache.connectors.core import TENANT_ARG, ConnectorCore, model_scope
from quillcache.model import IdentityScope, KvBlockKey

log = logging.getLogger("quillcache.connectors.lmcache")

__all__ = ["QuillCacheRemoteConnector", "ADAPTER_TAG", "encode_header", "decode_header"]

DEFAULT_PLUGIN = "quillcache"
ADAPTER_TAG = "quillcache_adapter"     # LMCache request config "lmcache.tag.quillcache_adapter"

# value = header + groups + payload.  Header: magic, version, MemoryFormat value, group count,
# payload bytes.  Group: dtype name (LMCache's spelling), ndim, up to MAX_DIMS dims.
MAGIC = b"QLMC"
VERSION = 1
_HEAD = struct.Struct("<4sBBHQ")       # 16 bytes
_GROUP = struct.Struct("<16sB3x5I")    # 40 bytes
MAX_GROUPS = 16
MAX_DIMS = 5


def encode_header(obj: MemoryObj) -> bytes:
    """The header that lets ``get`` allocate ``obj``'s twin (shapes, dtypes, format, size)."""
    shapes, dtypes = obj.get_shapes(), obj.get_dtypes()
    if not 0 < len(shapes) <= MAX_GROUPS or len(shapes) != len(dtypes):
        raise ValueError(f"memory object with {len(shapes)} shapes / {len(dtypes)} dtypes: "
                         f"1..{MAX_GROUPS} groups supported")
    parts = [_HEAD.pack(MAGIC, VERSION, obj.get_memory_format().value, len(shapes),
                        memoryview(obj.byte_array).nbytes)]
    for shape, dtype in zip(shapes, dtypes):
        dims = list(shape)
        if len(dims) > MAX_DIMS:
            raise ValueError(f"shape {tuple(dims)}: at most {MAX_DIMS} dimensions")
        parts.append(_GROUP.pack(TORCH_DTYPE_TO_STR_DTYPE[dtype].encode(), len(dims),
                                 *(dims + [0] * (MAX_DIMS - len(dims)))))
    return b"".join(parts)


def decode_header(value: memoryview) -> Optional[tuple[list, list, MemoryFormat, int]]:
    """(shapes, dtypes, fmt, header bytes) of a stored value, or None if it is not one of ours
    or its payload length disagrees with its size (never raises on bad bytes)."""
    if value.nbytes < _HEAD.size:
        return None
    magic, version, fmt, groups, payload = _HEAD.unpack_from(value, 0)
    hlen = _HEAD.size + groups * _GROUP.size
    if magic != MAGIC or version != VERSION or not 0 < groups <= MAX_GROUPS or value.nbytes != hlen + payload:
        return None
    shapes, dtypes = [], []
    try:
        fmt = MemoryFormat(fmt)
        for g in range(groups):
            name, ndim, *dims = _GROUP.unpack_from(value, _HEAD.size + g * _GROUP.size)
            if ndim > MAX_DIMS:
                return None
            dtypes.append(STR_DTYPE_TO_TORCH_DTYPE[name.rstrip(b"\0").decode()])
            shapes.append(torch.Size(dims[:ndim]))
    except (ValueError, KeyError, UnicodeDecodeError):
        return None
    return shapes, dtypes, fmt, hlen


class QuillCacheRemoteConnector(RemoteConnector):

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None) -> None:
        # RemoteConnector.__init__ is not called: it asserts engine metadata LMCache does not pass
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        extra = dict(getattr(config, "extra_config", None) or {})
        self.plugin_name = self._plugin_name(config, extra)
        prefix = f"remote_storage_plugin.{self.plugin_name}."
        where = f"extra_config {prefix}*"
        mine = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}
        values, unknown = settings.parse(settings.LMCACHE, mine, where, settings.LMCACHE_OWN)
        if unknown:
            log.warning("%s: unknown QuillCache setting(s) %s ignored (known: %s)", where, ", ".join(unknown),
                        ", ".join(s.name for s in settings.LMCACHE))
        self.chunk_size = int(getattr(config, "chunk_size", 0) or 0)
        self.layout = values["layout"]
        self.num_layers = values["num_layers"]
        self.tokenizer_id = values["tokenizer_id"]
        self.tenant = values["tenant"]
        self.adapter = values["adapter"]
        self.core = ConnectorCore(values["address"], token=settings.resolve_token(values, where),
                                  timeout=values["timeout_s"], spin_us=values["spin_us"],
                                  name=f"LMCache plugin {self.plugin_name}")
        self.bad_values = 0          # values that did not decode or found no memory: misses

    @classmethod
    def _plugin_name(cls, config: Any, extra: dict) -> str:
        """LMCache does not tell a dynamic connector its plugin name: find the plugin entries
        that name this class (one at most)."""
        names = [p for p in (getattr(config, "remote_storage_plugins", None) or [])
                 if extra.get(f"remote_storage_plugin.{p}.module_path") == __name__
                 and extra.get(f"remote_storage_plugin.{p}.class_name") == cls.__name__]
        if len(names) > 1:
            raise ValueError(f"remote_storage_plugins {names} all name {__name__}.{cls.__name__}: "
                             "LMCache does not say which one it builds; configure it once")
        return names[0] if names else DEFAULT_PLUGIN

    # ------------------------------------------------------------------ identity

    def block_key(self, key: CacheEngineKey) -> KvBlockKey:
        """The full identity of an LMCache key (module docstring)."""
        tags = {str(k): str(v) for k, v in (key.tags or ())}
        tenant = tags.pop(TENANT_ARG, self.tenant)
        adapter = tags.pop(ADAPTER_TAG, None) or self.adapter
        scope = model_scope(key.model_name, dtype=TORCH_DTYPE_TO_STR_DTYPE[key.dtype],
                            block_size=self.chunk_size, num_layers=self.num_layers, layout=self.layout,
                            tp_rank=key.worker_id, tp_size=key.world_size)
        bh = key.chunk_hash_hex
        if hasattr(key, "layer_id"):
            bh += f"@L{key.layer_id}"
        for k in sorted(tags):
            bh += f"@{k}%{tags[k]}"
        # token_count 0: a partial last chunk has fewer tokens than chunk_size, the key can't say
        return KvBlockKey(scope, str(self.tokenizer_id or key.model_name), adapter, tenant, "", bh, 0, 0)

    # ------------------------------------------------------------------ plumbing

    async def _result(self, fut, default, what: str):
        """The I/O thread's result within the core's deadline; a late one is a miss, counted
        as a ``<what>_errors``."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.core.timeout + 1.0)
        except asyncio.TimeoutError:
            self.core.count(f"{what}_errors")
            return default

    async def _fetch(self, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The memory objects of the leading present keys (each with one reference, the caller's)."""
        kept: list = []
        lock = threading.Lock()
        abandoned = [False]

        def take(i: int, view: memoryview) -> bool:          # on the core's I/O thread
            head = decode_header(view)
            obj = None
            try:
                if head is not None:
                    shapes, dtypes, fmt, hlen = head
                    obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)
                    if obj is not None:
                        memoryview(obj.byte_array).cast("B")[:] = view[hlen:]   # sizes differ: raises
            except Exception:            # LMCache's allocator refusing: a miss, never the engine's error
                if obj is not None:
                    obj.ref_count_down()
                obj = None
            if obj is None:
                self.bad_values += 1
                return False
            with lock:
                if abandoned[0]:
                    obj.ref_count_down()
                    return False
                kept.append(obj)
            return True

        n = await self._result(self.core.fetch_async([self.block_key(k) for k in keys], take), 0, "load")
        with lock:
            abandoned[0] = True
            for obj in kept[n:]:      # after an error or a timeout: nothing counts
                obj.ref_count_down()
            return kept[:n]

    def _save(self, keys: List[CacheEngineKey], objs: List[MemoryObj]):
        """Start the save.  The caller's reference is LMCache's to drop (0.5.6:
        ``InstrumentedRemoteConnector`` drops it as soon as put returns, also after our
        deadline), so the save holds one of its own until the I/O thread is done with the
        bytes: a late send never reads a buffer LMCache has already reused."""
        try:
            bufs = [(encode_header(o), memoryview(o.byte_array).cast("B")) for o in objs]
        except (ValueError, KeyError):   # a layout the header cannot describe: stored nowhere
            self.core.count("save_errors")
            done: Future = Future()
            done.set_result(False)
            return done
        for o in objs:
            o.ref_count_up()
        try:
            fut = self.core.save_async([self.block_key(k) for k in keys], bufs)
        except BaseException:
            for o in objs:
                o.ref_count_down()
            raise

        def release(_f) -> None:
            for o in objs:
                o.ref_count_down()

        fut.add_done_callback(release)
        return fut

    # ------------------------------------------------------------------ RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._result(self.core.lookup_async([self.block_key(key)]), 0, "lookup") == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.core.lookup([self.block_key(key)]) == 1

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        objs = await self._fetch([key])
        return objs[0] if objs else None

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._result(self._save([key], [memory_obj]), False, "save")

    async def list(self) -> List[str]:
        """The keys of this worker's model scope, tenant and adapter, as LMCache key strings
        (``model@world@worker@hash@dtype``); [] without engine metadata (the scheduler side)."""
        md = getattr(self.local_cpu_backend, "metadata", None)
        if md is None:
            return []
        probe = self.block_key(CacheEngineKey(md.model_name, md.world_size, md.worker_id, 0, md.kv_dtype))
        scope = IdentityScope(probe.model_id, probe.tokenizer_id, probe.adapter_id, probe.tenant_id)
        keys = await self._result(self.core.list_keys_async(scope), [], "lookup")
        dtype = TORCH_DTYPE_TO_STR_DTYPE[md.kv_dtype]
        return [f"{md.model_name}@{md.world_size}@{md.worker_id}@{k.block_hash}@{dtype}" for k in keys]

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.core.close)

    # ------------------------------------------------------------------ the batched variants

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        objs = await self._fetch(keys)
        return objs + [None] * (len(keys) - len(objs))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        await self._result(self._save(keys, memory_objs), False, "save")

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self.core.lookup([self.block_key(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await self._result(self.core.lookup_async([self.block_key(k) for k in keys]), 0, "lookup")

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        return await self._fetch(keys)

    def stats(self) -> dict[str, int]:
        return {**self.core.stats(), "bad_values": self.bad_values}
