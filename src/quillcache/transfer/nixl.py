"""NIXL (the NVIDIA Inference Xfer Library, over UCX) for bytes between nodes: one-sided reads
from a holder's registered DRAM arena into this node's registered memory.

``NixlEndpoint`` is one node's pair of agents:

* the holder's: the node's DRAM arena (the memfd mapping) is registered once at start, so any
  peer that holds this agent's metadata and a lease on an extent can read it without this
  node's Python touching the bytes; it has a progress thread, to answer peers it never calls;
* the reader's: a staging area of its own is registered for reads into this node (an
  ``OffsetAllocator`` hands out extents of it; a read holds its extents until the caller
  releases them, or until the last view of a kept read is gone); it has no progress thread:
  it progresses when it posts and polls its own READs;
* peers are added from their metadata when first needed, keyed by node id *and* epoch: a
  restarted peer (new epoch) is a new agent, and the old one is removed.

A READ is posted from the event loop (posting does not wait); one UCX did not finish at once is
polled on one thread of the endpoint's own (``nixl-progress``), as are adding and removing
peers: the event loop only awaits a future, it never waits on UCX.  A transfer that reports an
error, or that is not done by its deadline, is released and raised as
``TransferFailed``/``Timeout``: the caller gets a miss, never bytes the transfer did not finish.
Checking the bytes (the CRC the writer computed) is the caller's, as for TCP.

NIXL is optional: ``nixl_missing()`` says how to install it; nothing here imports it before
an endpoint is made.  The wheel declares torch as a dependency, which host memory does not
need: install it with ``pip install --no-deps nixl-cu12`` (a plain install pulls a CUDA torch).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from quillcache.errors import CapacityError, InvalidArgument, QuillCacheError, Timeout

__all__ = ["NixlEndpoint", "StagedRead", "TransferFailed", "nixl_missing", "agents_made", "exit_past_nixl",
           "make_agent", "NIXL_INSTALL_HINT", "NIXL_MODULE", "DEFAULT_STAGING_BYTES"]

NIXL_MODULE = "nixl_cu12._api"          # the CUDA 12 variant's Python API (host memory needs no GPU)
NIXL_INSTALL_HINT = ("pip install --no-deps 'nixl-cu12==1.5.1' (the [nixl] extra; --no-deps keeps pip "
                     "from pulling a CUDA torch, which host memory does not need)")
DEFAULT_STAGING_BYTES = 64 << 20        # bytes: registered memory reads land in before they are used
STAGING_UNIT = 4096                     # bytes: staging extents are whole pages
POLL_SLEEP_S = 20e-6                    # seconds between state polls of a transfer in flight
PROGRESS_DELAY_US = 100                 # microseconds: the NIXL progress thread's sleep between rounds
# UCX's TCP transport (UCX_TLS=tcp, hosts without RDMA) moves a READ in segments of 8 KiB by
# default: 32 sends and receives on each side per 256 KiB block, on both nodes' progress
# threads.  Segments of 256 KiB, where the environment does not set them, measured (bench/
# cluster_transport.py, nixl-ucx-tcp, one run each, load 7-9): 256 KiB GET 0.09x -> 0.23x of
# local, the holder's CPU per GET 268 -> 73 µs.  It costs UCX receive buffers of that size.
UCX_TCP_SEGMENT = {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}


class TransferFailed(QuillCacheError):
    """A NIXL transfer that ended in error (the peer is gone, an extent it no longer registers)."""


def _api():
    import importlib
    return importlib.import_module(NIXL_MODULE)


_AGENTS_MADE = False


def agents_made() -> bool:
    """Whether this process made a NIXL agent: NIXL 1.5.1's wheel then crashes in an ELF destructor
    at exit (its bundled libnl-route, after ``main`` returned), so such a process ends with
    ``os._exit`` once its own work is done."""
    return _AGENTS_MADE


def exit_past_nixl(code: int) -> int:
    """``code``, for a process to exit with; a process that made an agent ends here instead, with
    its logs flushed, past the destructors that would crash (``agents_made``)."""
    if _AGENTS_MADE:
        import logging
        logging.shutdown()
        os._exit(code)
    return code


def nixl_missing() -> Optional[str]:
    """None when NIXL can be loaded here; otherwise one line saying why and how to install it."""
    try:
        _api()
    except ImportError as exc:
        return f"NIXL is not available ({exc}): {NIXL_INSTALL_HINT}"
    except Exception as exc:   # a broken install (a missing shared library, ...): the same answer
        return f"NIXL failed to load ({type(exc).__name__}: {exc}): {NIXL_INSTALL_HINT}"
    return None


def make_agent(api, name: str, *, progress: bool = True):
    """A NIXL agent with the UCX backend; without ``progress``, one with no progress thread (it
    progresses only when it is called: posting and polling its own READs).  With one, the
    progress thread sleeps ``PROGRESS_DELAY_US`` between rounds.
    NIXL 1.5.1's Python ``nixl_agent`` fixes that delay at 0: its progress thread then
    spins a core while the node is idle (measured: 70-78% of a core per agent, every node of a
    pool on one host).  Without a progress thread a holder's agent never answers a peer (reads
    of it hang), so the thread stays and only its delay is set: through a subclass of the config
    type, in place for the time the agent is made (the wrapper sets ``pthrDelay`` there)."""
    if not progress:
        return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                                          sync_mode=_strict(api)))
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:                    # another layout of the wrapper: its defaults
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], sync_mode=_strict(api)))

    class _Config(base):
        def __setattr__(self, field, value):
            if field == "pthrDelay":
                value = PROGRESS_DELAY_US
            super().__setattr__(field, value)

    bind.nixlAgentConfig = _Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], sync_mode=_strict(api)))
    finally:
        bind.nixlAgentConfig = base


def _strict(api):
    """The thread-safe agent mode: READs are posted from the event loop, the rest runs on the
    endpoint's progress thread."""
    return api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT


class StagedRead:
    """The blocks of one read, as read-only views of this endpoint's staging area.  Either
    ``release()`` gives the staging extent back (the views must not be used after), or ``keep()``
    hands the blocks out as views that own the extent: it is given back when the last of them
    (and of every view made from one) is gone, so a block is served from staging without a copy
    and its extent can never be read into while anything still refers to it."""

    __slots__ = ("blocks", "_endpoint", "_alloc", "_array")

    def __init__(self, endpoint: "NixlEndpoint", alloc, array: np.ndarray, blocks: list[memoryview]) -> None:
        self._endpoint, self._alloc, self._array, self.blocks = endpoint, alloc, array, blocks

    def release(self) -> None:
        if self._alloc is not None:
            self._endpoint.free_staging(self._alloc)
            self._alloc = None
            self.blocks = []
            self._array = None

    def keep(self) -> list[memoryview]:
        """The blocks, each keeping the staging extent taken until it is unreferenced (a weak
        reference to the array every view refers to); ``release()`` does nothing after."""
        if self._alloc is None:
            raise InvalidArgument("NIXL read: its staging was given back already")
        out = self.blocks
        self._endpoint.own_staging(self._array, self._alloc)
        self._alloc, self._array, self.blocks = None, None, []
        return out

    def __enter__(self) -> "StagedRead":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class NixlEndpoint:
    """One node's NIXL agents: the holder's, its arena registered for peers' reads, with a progress
    thread (it must answer peers it never calls); the reader's, its staging area registered, with
    none: it posts and polls its own READs, and a progress thread of its own would spin beside
    every READ it runs (measured: as much CPU as the READ itself, a GET_MANY of 64 x 256 KiB
    5.3 ms of it on top of the loop's 6.8 ms)."""

    def __init__(self, name: str, arena: np.ndarray, *, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
            raise InvalidArgument("arena: must be a 1-D uint8 numpy view of the node's mapping")
        if not STAGING_UNIT <= staging_bytes <= 1 << 40:
            raise InvalidArgument(f"staging_bytes {staging_bytes}: must be {STAGING_UNIT}..{1 << 40}")
        api = _api()
        from quillcache._native.alloc import OffsetAllocator
        global _AGENTS_MADE
        _AGENTS_MADE = True
        for var, value in UCX_TCP_SEGMENT.items():     # read by UCX when the agent starts
            os.environ.setdefault(var, value)
        self.name = name
        self._holder = make_agent(api, name)                  # peers read this one: its name is the node's
        self._agent = make_agent(api, f"{name}/reader", progress=False)
        self.arena_address = int(arena.ctypes.data)
        self.arena_bytes = int(arena.nbytes)
        self._arena = arena                                    # keeps the mapping alive while registered
        self._arena_reg = self._holder.register_memory([(self.arena_address, self.arena_bytes, 0, "")], "DRAM")
        staging_bytes -= staging_bytes % STAGING_UNIT
        self._staging = np.empty(staging_bytes, dtype=np.uint8)
        self._staging_address = int(self._staging.ctypes.data)
        self._staging_reg = self._agent.register_memory([(self._staging_address, staging_bytes, 0, "")], "DRAM")
        self._staging_alloc = OffsetAllocator(staging_bytes, unit=STAGING_UNIT)
        self._owned: dict[int, tuple] = {}  # id(weak ref to a kept read's array) -> (the ref, its extent)
        self.metadata: bytes = self._holder.get_agent_metadata()
        self._peers: dict[str, tuple[int, str, int, int]] = {}  # node id -> (epoch, agent, arena addr, bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl-progress")
        self.counters = {"reads": 0, "reads_inline": 0, "read_bytes": 0, "read_errors": 0, "read_timeouts": 0,
                         "peers_added": 0, "peers_removed": 0, "staging_full": 0}
        self.closed = False
        self._slow_calls = 0            # agent adds/removes on the thread now (the loop's count)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread = 0           # the thread of the loop that reads (the staging allocator's)

    # ------------------------------------------------------------------ peers

    def knows(self, node_id: str, epoch: int) -> bool:
        return self._peers.get(node_id, (None,))[0] == epoch

    async def add_peer(self, node_id: str, epoch: int, metadata: bytes, arena_address: int,
                       arena_bytes: int) -> None:
        """Know ``node_id``'s agent of run ``epoch``: its metadata and where its arena is registered,
        as its node handed them out; an agent of an earlier run of the same node is removed first."""
        if not isinstance(metadata, (bytes, bytearray)) or not metadata:
            raise InvalidArgument(f"NIXL metadata of {node_id}: empty")
        if not (isinstance(arena_address, int) and isinstance(arena_bytes, int) and arena_address > 0
                and arena_bytes > 0):
            raise InvalidArgument(f"NIXL arena of {node_id}: address and size must be positive integers")
        if self.knows(node_id, epoch):
            return
        self._slow_calls += 1
        try:
            await self._run(self._add_peer, node_id, epoch, bytes(metadata), arena_address, arena_bytes)
        finally:
            self._slow_calls -= 1

    def _add_peer(self, node_id: str, epoch: int, metadata: bytes, arena_address: int, arena_bytes: int) -> None:
        if self.knows(node_id, epoch):
            return              # added meanwhile: replacing it would cut reads in flight to it
        old = self._peers.pop(node_id, None)
        if old is not None:
            self._remove_agent(old[1])
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            # Wire up now, on this thread: UCX's first transfer to a peer otherwise pays for it
            # (hundreds of ms under UCX_TLS=tcp), past the deadline of the read that needed it.
            self._agent.make_connection(name)
        except Exception:       # optional: the first READ connects then
            pass
        self._peers[node_id] = (epoch, name, arena_address, arena_bytes)
        self.counters["peers_added"] += 1

    def forget(self, node_id: str) -> None:
        """The peer left the view (or changed epoch): drop its agent (on the progress thread)."""
        old = self._peers.pop(node_id, None)
        if old is not None and not self.closed:
            self._slow_calls += 1
            self._pool.submit(self._remove_agent, old[1]).add_done_callback(self._slow_done)

    def _slow_done(self, _fut) -> None:
        if self._loop is None:  # no loop ever posted a read: nothing to keep in step
            self._slow_calls -= 1
            return
        try:
            self._loop.call_soon_threadsafe(self._slow_dec)
        except RuntimeError:    # the loop is closed: nothing posts reads any more
            pass

    def _slow_dec(self) -> None:
        self._slow_calls -= 1

    def _remove_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:   # already gone on the UCX side: nothing left to drop
            pass
        self.counters["peers_removed"] += 1

    # ------------------------------------------------------------------ reads

    async def read(self, node_id: str, epoch: int, extents: Sequence[tuple[int, int]],
                   deadline: float) -> StagedRead:
        """Read ``extents`` (offset, size) of ``node_id``'s arena (run ``epoch``) in one transfer,
        into this endpoint's staging area; raises ``TransferFailed``, ``Timeout`` or
        ``InvalidArgument`` (an unknown peer, extents past what it registered, no staging room)."""
        peer = self._peers.get(node_id)
        if peer is None or peer[0] != epoch:
            raise InvalidArgument(f"NIXL: no agent of {node_id} at epoch {epoch:x}")
        if not extents:
            raise InvalidArgument("NIXL read: extents must be non-empty and of positive size")
        limit = peer[3]
        total = 0
        for off, n in extents:      # within what the peer registered: checked here, not by UCX
            if n <= 0:
                raise InvalidArgument("NIXL read: extents must be non-empty and of positive size")
            if not 0 <= off <= limit - n:
                raise InvalidArgument(f"NIXL read: extent {off}+{n} outside {node_id}'s {limit}-byte arena")
            total += n
        if not self._loop_thread:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        try:
            alloc = self._staging_alloc.allocate(total)
        except (CapacityError, MemoryError):   # no room now: this read becomes a miss
            self.counters["staging_full"] += 1
            raise InvalidArgument(f"NIXL read: {total} bytes do not fit the free staging area now") from None
        base = alloc[0]
        try:
            # Posted from the loop (posting does not wait: the agent is thread-safe); a READ that
            # UCX finished at once (shared memory / CMA usually does) ends here, without a hop
            # to the progress thread; any other is polled there until done or its deadline.
            # Not while the thread adds or removes an agent: that holds the agent's lock for as
            # long as UCX takes to wire up, and the loop must not wait for it.
            if self._slow_calls:
                await self._run(self._read_on_thread, peer[1], peer[2], extents, base, deadline)
            else:
                handle, state = self._post(peer[1], peer[2], extents, base)
                if state == "DONE" or state == "ERR":
                    self.counters["reads_inline"] += 1
                    self._end(handle, state, peer[1])
                else:
                    await self._run(self._wait, handle, state, peer[1], deadline)
        except BaseException:
            self.free_staging(alloc)
            raise
        array = self._staging[base:base + total]      # one object every block's view refers to
        whole = memoryview(array).toreadonly()        # slices of it are read-only too
        if len(extents) == 1:
            views = [whole]
        else:
            views, off = [], 0
            for _, n in extents:
                views.append(whole[off:off + n])
                off += n
        counters = self.counters
        counters["reads"] += 1
        counters["read_bytes"] += total
        return StagedRead(self, alloc, array, views)

    def _post(self, agent_name: str, arena: int, extents, base: int) -> tuple[Any, str]:
        if self.closed:
            raise TransferFailed("NIXL endpoint is closed")
        local, remote, at = [], [], self._staging_address + base
        for off, n in extents:
            local.append((at, n, 0))
            remote.append((arena + off, n, 0))
            at += n
        agent = self._agent
        # No notification: the holder's agent would receive and keep one per READ (its progress
        # thread's work, and a list nothing here ever drains); its grant table, not NIXL, says
        # when the bytes may move.
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote, "DRAM"), agent_name)
        try:
            return handle, agent.transfer(handle)
        except BaseException:
            agent.release_xfer_handle(handle)
            raise

    def _read_on_thread(self, agent_name: str, arena: int, extents, base: int, deadline: float) -> None:
        handle, state = self._post(agent_name, arena, extents, base)
        self._wait(handle, state, agent_name, deadline)

    def _wait(self, handle, state: str, agent_name: str, deadline: float) -> None:
        try:
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    self.counters["read_timeouts"] += 1
                    raise Timeout(f"NIXL read from {agent_name}: not done by its deadline")
                time.sleep(POLL_SLEEP_S)
                state = self._agent.check_xfer_state(handle)
        except BaseException:
            self._agent.release_xfer_handle(handle)
            raise
        self._end(handle, state, agent_name)

    def _end(self, handle, state: str, agent_name: str) -> None:
        self._agent.release_xfer_handle(handle)
        if state == "ERR":
            self.counters["read_errors"] += 1
            raise TransferFailed(f"NIXL read from {agent_name} failed")

    def free_staging(self, alloc) -> None:
        """Give a read's staging extent back (``StagedRead.release`` calls it)."""
        self._staging_alloc.free(alloc[2])          # (offset, size, handle)

    def own_staging(self, array: np.ndarray, alloc) -> None:
        """``alloc`` is given back when ``array`` (which every view of a kept read refers to) is
        gone: a weak reference's callback, cheaper than ``weakref.finalize`` on the read path."""
        ref = weakref.ref(array, self._owner_gone)
        self._owned[id(ref)] = (ref, alloc)     # keeps the ref (and so its callback) alive

    def _owner_gone(self, ref: weakref.ref) -> None:
        entry = self._owned.pop(id(ref), None)
        if entry is not None:
            self.free_staging_later(entry[1])

    def free_staging_later(self, alloc) -> None:
        """``free_staging`` from wherever the last view of a kept read went away: on the thread
        of the loop that reads (the allocator is that thread's), or handed to it."""
        if self.closed:
            return
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self.free_staging(alloc)
            return
        try:
            loop.call_soon_threadsafe(self.free_staging, alloc)
        except RuntimeError:            # that loop is closed: nothing allocates any more
            pass

    async def _run(self, fn, *args) -> Any:
        if self.closed:
            raise TransferFailed("NIXL endpoint is closed")
        self._loop = asyncio.get_running_loop()
        return await self._loop.run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ life

    def stats(self) -> dict:
        return {**self.counters, "peers": len(self._peers), "staging_bytes": int(self._staging.nbytes),
                "staging_used": int(self._staging_alloc.used)}

    def close(self) -> None:
        """Deregister and drop every peer; the arena mapping may be unmapped after this returns."""
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=True)
        for peer in self._peers.values():
            self._remove_agent(peer[1])
        self._peers.clear()
        for agent, reg in ((self._agent, self._staging_reg), (self._holder, self._arena_reg)):
            try:
                agent.deregister_memory(reg)
            except Exception:   # closing anyway
                pass


def ucx_tls() -> str:
    """The UCX transports asked for (``UCX_TLS``), or "default"."""
    return os.environ.get("UCX_TLS") or "default"


def ucx_tcp_only(tls: str) -> bool:
    """Whether ``UCX_TLS`` as set leaves UCX only TCP between nodes (every name is ``tcp`` or
    ``self``, none negated): such a READ loses to FETCH (docs/nixl.md). "default" and lists naming
    shared memory, CMA or RDMA are not TCP-only; nor is a negated list (UCX picks from the rest)."""
    names = [n.strip().lower() for n in tls.split(",") if n.strip()]
    return bool(names) and all(n in ("tcp", "self") for n in names)

