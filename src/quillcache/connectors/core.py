"""The engine-agnostic connector core: engine block chains -> KvBlockKeys, and batched
exists / load / save against one node, where every failure is a miss (and a recompute).

The adapters (vllm.py, sglang.py, lmcache.py) only translate their engine's calls into these.

Identity (docs/engines.md has the table per engine):
  model_id     = ``model_scope(...)``: the served model name plus TP rank, PP rank and the KV
                 layout (dtype, block size, layers, layout name), so two layouts never share a key;
  tokenizer_id = the tokenizer id;
  adapter_id   = the request's LoRA name (None: the base model);
  tenant_id    = ``tenant_from_salt(cache_salt)`` or ``tenant_from_args(extra_args)``;
  prefix_hash  = the parent block's hash (hex; "" for the first block);
  block_hash   = the engine's own block hash (hex).

Data path: over ``unix:`` with the arena mapped, reads copy out of ``get_many_located`` views
and writes fill ``put_many_reserved`` slots (no socket copy); over TCP, ``get_many_into``
receives straight into the destination buffers and ``put_many`` sends them.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence

from quillcache.errors import ConnectionLost, QuillCacheError
from quillcache.model import IdentityScope, KvBlockKey
from quillcache.net import DEFAULT_ADDRESS, DEFAULT_UNIX_SOCKET

__all__ = ["TENANT_SALT_PREFIX", "TENANT_ARG", "model_scope", "hash_hex", "tenant_from_salt",
           "tenant_from_args", "value_nbytes", "value_parts", "blocks_per_request",
           "batch_len", "chain_keys", "default_addresses", "ConnectorCore"]

log = logging.getLogger("quillcache.connectors")

TENANT_SALT_PREFIX = "tenant="      # cache_salt "tenant=<id>[;anything]" names the tenant
TENANT_ARG = "quillcache_tenant"    # or the request's extra args / kv_transfer_params carry it
CALL_LOG_INTERVAL_S = 10.0   # a failing adapter call logs at most one line this often (counted always)
# blocks per request (the client also splits a batch at the node's header limit, by key length)
BATCH_BLOCKS = 256
BATCH_BYTES = 64 << 20       # bytes per load/save request (the node refuses payloads over 256 MiB)
COUNTERS = ("lookups", "lookup_errors", "hit_blocks", "miss_blocks", "loads", "load_errors",
            "loaded_blocks", "saves", "save_errors", "saved_blocks", "reconnects", "connect_errors")
# what each batched operation counts: (calls, errors, blocks done)
_OPS = {"lookup": ("lookups", "lookup_errors", "hit_blocks"),
        "load": ("loads", "load_errors", "loaded_blocks"),
        "save": ("saves", "save_errors", "saved_blocks")}


def default_addresses() -> list[str]:
    """Where a connector with no address looks for the node, in order: the node's default Unix
    socket (the shipped config and unit: docs/shm.md), then its default TCP address."""
    return [f"unix:{DEFAULT_UNIX_SOCKET}", DEFAULT_ADDRESS]


def model_scope(model: str, *, dtype: str, block_size: int, num_layers: int, layout: str,
                tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The model_id of every key: the model and everything that changes the bytes of a block."""
    return (f"{model}|tp{tp_rank}of{tp_size}|pp{pp_rank}of{pp_size}|{dtype}|bs{block_size}"
            f"|L{num_layers}|{layout}")


def hash_hex(h: Any) -> str:
    """An engine block hash as hex: bytes (vLLM, 32 bytes), int, or an already-hex str (SGLang)."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h).hex()
    if isinstance(h, int):
        return format(h & ((1 << 256) - 1), "x")
    if isinstance(h, str):
        return h
    raise TypeError(f"block hash {h!r}: expected bytes, int or str")


def tenant_from_salt(cache_salt: Optional[str], default: str = "") -> str:
    """The tenant a cache_salt names under the convention ``tenant=<id>[;...]``; otherwise
    ``default`` (the engine's own tenant)."""
    if cache_salt and cache_salt.startswith(TENANT_SALT_PREFIX):
        return cache_salt[len(TENANT_SALT_PREFIX):].split(";", 1)[0]
    return default


def tenant_from_args(args: Optional[dict], default: str = "") -> str:
    if args and isinstance(args.get(TENANT_ARG), str):
        return args[TENANT_ARG]
    return default


def value_nbytes(buffer: Any) -> int:
    """The size of one value: a buffer, or a tuple of buffers stored back to back (a header
    and its payload, or the K and V regions of a host page, without joining them first)."""
    if isinstance(buffer, tuple):
        return sum(memoryview(p).nbytes for p in buffer)
    return memoryview(buffer).nbytes


def value_parts(buffer: Any) -> list[memoryview]:
    """The byte views of one value: a buffer, or each part of a tuple in order."""
    return [memoryview(p).cast("B") for p in (buffer if isinstance(buffer, tuple) else (buffer,))]


def blocks_per_request(block_nbytes: int) -> int:
    """Blocks per load/save request for blocks of this size."""
    return max(1, min(BATCH_BLOCKS, BATCH_BYTES // max(block_nbytes, 1)))


def batch_len(buffers: Sequence) -> int:
    """Blocks per request for blocks of this size (engines use one block size)."""
    return blocks_per_request(value_nbytes(buffers[0]) if buffers else 1)


def chain_keys(ident: IdentityScope, block_hashes: Sequence[Any], *, block_size: int, start: int = 0,
               parent: Any = None) -> list[KvBlockKey]:
    """Keys for a chain of engine block hashes; ``start`` is the index of the first one and
    ``parent`` the hash before it (None at the start of the prompt)."""
    keys = []
    prev = "" if parent is None else hash_hex(parent)
    for i, h in enumerate(block_hashes):
        hx = hash_hex(h)
        keys.append(KvBlockKey(ident.model_id, ident.tokenizer_id, ident.adapter_id, ident.tenant_id,
                               prev, hx, start + i, block_size))
        prev = hx
    return keys


class ConnectorCore:
    """One node connection, owned by one I/O thread; the engine thread never waits on the
    network unless it asks to (``wait``).  Every error is counted and becomes a miss.

    ``address`` None tries ``default_addresses()`` in order.  ``token`` is sent at HELLO; it is
    never logged and not in ``repr``.  The core connects at once (on its I/O thread): a node it
    cannot reach or that refuses the token is logged once as an error naming the address and
    the reason, and counted as ``connect_errors``; every call meanwhile is a miss and tries again.
    """

    def __init__(self, address: Optional[str] = None, *, token: Optional[str] = None, timeout: float = 5.0,
                 client_factory: Optional[Callable[[str], Any]] = None, name: str = "quillcache",
                 spin_us: Optional[float] = None) -> None:
        from quillcache.client import Client
        self.address = address or None
        self.candidates = [address] if address else default_addresses()
        self.timeout = float(timeout)
        self.name = name
        spin = {} if spin_us is None else {"spin_us": spin_us}       # None: the client's default
        self._factory = client_factory or (lambda where: Client(where, token=token, timeout=self.timeout, **spin))
        self._client = None
        self.connected_to: Optional[str] = None     # the address of the live connection
        self._failing = False                       # the last connect failed (logged once per outage)
        self._quiet_until = 0.0                     # monotonic time before which _call logs nothing more
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quillcache-conn")
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._io.submit(self._start)

    def __repr__(self) -> str:
        return f"ConnectorCore(address={self.address!r}, connected_to={self.connected_to!r}, timeout={self.timeout})"

    # ------------------------------------------------------------------ plumbing

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def count(self, name: str, n: int = 1) -> None:
        """Count an error an adapter saw itself (a deadline it enforced on its own loop)."""
        self._count(name, n)

    def _start(self) -> None:
        try:
            self._conn()
        except (QuillCacheError, OSError):    # counted and logged by _conn; calls retry
            pass

    def _conn(self):
        if self._client is not None:
            return self._client
        tried = []
        for where in self.candidates:
            try:
                self._client = self._factory(where)
            except ConnectionLost as exc:    # nothing listens there: the next candidate
                tried.append(f"{where}: {exc}")
                continue
            except (QuillCacheError, OSError) as exc:
                tried.append(f"{where}: {type(exc).__name__}: {exc}")
                break
            self.connected_to = where
            self._count("reconnects")
            if self._failing:
                log.info("%s connector: connected to %s again", self.name, where)
            self._failing = False
            return self._client
        self._count("connect_errors")
        reason = "; ".join(tried)
        if not self._failing:
            log.error("%s connector: cannot use the node (%s); every lookup is a miss until it can "
                      "(counted as connect_errors, retried on each call)", self.name, reason)
        self._failing = True
        raise ConnectionLost(reason)

    def _drop(self) -> None:
        c, self._client = self._client, None
        self.connected_to = None
        if c is not None:
            try:
                c.close()
            except Exception:            # closing a broken connection: nothing more to learn
                pass

    @property
    def shm(self) -> bool:
        """True when the node's arena is mapped (the zero-copy path)."""
        def mapped() -> bool:
            try:
                return bool(getattr(self._conn(), "shm", False))
            except (QuillCacheError, OSError):
                return False
        return self._io.submit(mapped).result(self.timeout + 1.0)

    def close(self) -> None:
        self._io.submit(self._drop).result(self.timeout)
        self._io.shutdown(wait=True)

    # ------------------------------------------------------------------ operations (I/O thread)

    def _batches(self, what: str, n: int, step: int, batch: Callable[[int, int], int]) -> Optional[int]:
        """The one loop of every batched operation: counts the call, runs ``batch(i, j)`` on
        items i..j in slices of ``step`` until a slice comes back short, and counts the blocks
        done.  Any node error is counted, drops the connection and returns None (a miss)."""
        calls, errors, blocks = _OPS[what]
        self._count(calls)
        if not n:
            return 0
        done = 0
        try:
            for i in range(0, n, step):
                j = min(i + step, n)
                got = batch(i, j)
                done += got
                if got < j - i:
                    break
        except (QuillCacheError, OSError):
            self._count(errors)
            self._drop()
            return None
        self._count(blocks, done)
        return done

    def _lookup(self, keys: list[KvBlockKey]) -> int:
        prefix = self._batches("lookup", len(keys), BATCH_BLOCKS,
                               lambda i, j: self._conn().exists_many(keys[i:j])[0])
        if prefix is None:
            return 0
        self._count("miss_blocks", len(keys) - prefix)
        return prefix

    def _load(self, keys: list[KvBlockKey], buffers: list) -> int:
        """Fill buffers[i] with keys[i]'s bytes; returns the count of consecutive blocks
        loaded from the start (the rest is recomputed by the engine)."""
        return self._batches("load", len(keys), batch_len(buffers),
                             lambda i, j: self._load_batch(keys[i:j], buffers[i:j])) or 0

    def _load_batch(self, keys: list[KvBlockKey], buffers: list) -> int:
        c = self._conn()
        n = 0
        if getattr(c, "shm", False):
            with c.get_many_located(keys) as views:
                for v, dst in zip(views, buffers):
                    parts = value_parts(dst)
                    if v is None or v.nbytes != sum(p.nbytes for p in parts):
                        break
                    at = 0
                    for p in parts:
                        p[:] = v[at:at + p.nbytes]
                        at += p.nbytes
                    n += 1
        elif any(isinstance(b, tuple) for b in buffers):
            # parts over TCP: received whole into one buffer per value, then scattered
            whole = [bytearray(value_nbytes(b)) for b in buffers]
            for g, w, dst in zip(c.get_many_into(keys, whole), whole, buffers):
                if g is None or g != len(w):
                    break
                at = 0
                for p in value_parts(dst):
                    p[:] = memoryview(w)[at:at + p.nbytes]
                    at += p.nbytes
                n += 1
        else:
            for g, dst in zip(c.get_many_into(keys, buffers), buffers):
                if g is None or g != memoryview(dst).nbytes:
                    break
                n += 1
        return n

    def _fetch(self, keys: list[KvBlockKey], take) -> int:
        """Values of unknown size: ``take(i, view)`` gets keys[i]'s bytes (a read-only view,
        valid during the call only) and returns False to stop; returns the count of leading
        keys taken (0 after any error: the caller releases whatever it kept)."""

        def batch(i: int, j: int) -> int:
            got = 0
            with self._conn().get_many_located(keys[i:j]) as views:
                for v in views:
                    if v is None or not take(i + got, v):
                        break
                    got += 1
            # counted only here: leaving the block checks the lease (a late one may have
            # let the bytes be overwritten), so nothing counts until it returned
            return got

        return self._batches("load", len(keys), BATCH_BLOCKS, batch) or 0

    def _save(self, keys: list[KvBlockKey], buffers: list) -> bool:

        def batch(i: int, j: int) -> int:
            c, ks, bs = self._conn(), keys[i:j], buffers[i:j]
            if getattr(c, "shm", False):
                srcs = [value_parts(b) for b in bs]
                sizes = [sum(p.nbytes for p in s) for s in srcs]
                with c.put_many_reserved(list(zip(ks, sizes))) as slots:
                    for slot, s in zip(slots, srcs):
                        at = 0
                        for p in s:
                            slot[at:at + p.nbytes] = p
                            at += p.nbytes
            else:
                c.put_many([(k, b"".join(b) if isinstance(b, tuple) else b) for k, b in zip(ks, bs)])
            return j - i

        return self._batches("save", len(keys), batch_len(buffers), batch) is not None

    # ------------------------------------------------------------------ the engine's side

    def lookup(self, keys: Iterable[KvBlockKey]) -> int:
        """The length of the present prefix (0 on any failure); waits at most ``timeout``."""
        try:
            return self.lookup_async(keys).result(self.timeout + 1.0)
        except TimeoutError:
            self._count("lookup_errors")
            return 0

    def lookup_async(self, keys: Iterable[KvBlockKey]) -> Future:
        """Start a prefix lookup; the future's result is the length of the present prefix."""
        return self._io.submit(self._lookup, list(keys))

    def fetch_async(self, keys: Iterable[KvBlockKey], take) -> Future:
        """Start a load of values whose size the caller learns from the bytes (see ``_fetch``);
        ``take`` runs on the I/O thread.  The future's result is the count of leading keys taken."""
        return self._io.submit(self._fetch, list(keys), take)

    def load_async(self, keys: Iterable[KvBlockKey], buffers: Sequence) -> Future:
        """Start a load; the future's result is the count of leading blocks loaded.  A buffer
        may be a tuple of parts, filled in order from one value (``value_parts``)."""
        return self._io.submit(self._load, list(keys), list(buffers))

    def _call(self, fn, what: str, default: Any) -> Any:
        try:
            client = self._conn()               # a failed connect is logged there, once per outage
        except (QuillCacheError, OSError):
            self._count(f"{what}_errors")
            return default
        try:
            return fn(client)
        except (QuillCacheError, OSError) as exc:
            self._count(f"{what}_errors")
            now = time.monotonic()
            if now >= self._quiet_until:        # at most one line per CALL_LOG_INTERVAL_S
                self._quiet_until = now + CALL_LOG_INTERVAL_S
                log.warning("%s connector: a %s failed (%s: %s); the connection is dropped (%s_errors counts "
                            "them all)", self.name, what, type(exc).__name__, exc, what)
            self._drop()
            return default

    def call_async(self, fn, *, what: str = "load", default: Any = 0) -> Future:
        """Run ``fn(client)`` on the I/O thread, the connection's one owner, for an adapter that
        moves the bytes itself (``paged.py``: device copies through ``quillcache.client.gpu``).  A node
        failure is counted as ``<what>_errors``, drops the connection and returns ``default``."""
        return self._io.submit(self._call, fn, what, default)

    def save_async(self, keys: Iterable[KvBlockKey], buffers: Sequence) -> Future:
        """Start a save; the buffers must stay unchanged until the future is done.  A buffer
        may be a tuple of parts, stored as one value (``value_nbytes``)."""
        return self._io.submit(self._save, list(keys), list(buffers))

    def wait(self, fut: Future, *, what: str = "load") -> Any:
        """The future's result within the deadline; a late one is a miss (0 / False)."""
        try:
            return fut.result(self.timeout + 1.0)
        except TimeoutError:
            self._count(f"{what}_errors")
            return 0 if what == "load" else False

    def _list(self, scope) -> list[KvBlockKey]:
        try:
            return self._conn().ls(scope)
        except (QuillCacheError, OSError):
            self._count("lookup_errors")
            self._drop()
            return []

    def list_keys_async(self, scope) -> Future:
        """Start a listing of the keys of one identity scope (``[]`` on any failure)."""
        return self._io.submit(self._list, scope)

    def load(self, keys, buffers) -> int:
        return self.wait(self.load_async(keys, buffers), what="load")

    def save(self, keys, buffers) -> bool:
        return self.wait(self.save_async(keys, buffers), what="save")

    def stats(self) -> dict[str, int]:
        """The counters, and what the live connection's receives polled (``spin_us``): replies
        caught while polling, polls that ran out (``Client.receive_stats``; 0 without one)."""
        with self._lock:
            out = dict(self.counters)
        polled = getattr(self._client, "receive_stats", None)
        polled = polled() if polled is not None else {}
        out["receive_polls_caught"] = polled.get("caught", 0)
        out["receive_polls_missed"] = polled.get("missed", 0)
        return out


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0
