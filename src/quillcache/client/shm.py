"""The client's shared-memory data path (docs/shm.md): the mapped arena and the located
operations, written once as generators that both clients drive.

A flow is a generator that yields request descriptions (``calls.Req``, a pipelined
``calls.Batch``, or a ``calls.Post`` it does not wait for) and is sent each one's result;
``Client`` drives it with blocking calls, ``AsyncClient`` with ``await``.  So the steps of a
located GET (locate, copy out of the mapping, release) or of a reserved PUT (reserve, copy
into the mapping, commit) exist once.

Safety on the read side: a located lease names CLOCK_MONOTONIC nanoseconds after which
the node may reuse the extents.  Client and node share the host and its clock, so every
flow checks the expiry after it has read the bytes: a copy that finished after the
lease ran out raises ``Timeout`` (the bytes may be another block's) instead of returning
them.  On the write side a client can only be trusted: the node cannot stop a write
outside a reserved slot, or after the reserve was reaped.
"""
from __future__ import annotations

import array
import ctypes
import mmap
import os
import socket
import time
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from quillcache.errors import InvalidArgument, NotFound, ProtocolError, QuillCacheError, Timeout, status_error
from quillcache.client.calls import SIZED_KEY_OVERHEAD, Post, Req, keys_per_request, sized_spans
from quillcache.protocol import located, messages
from quillcache.protocol.opcodes import FLAG_DURABLE, Opcode

__all__ = ["Arena", "Located", "LocatedViews", "recv_with_fds", "located_flow", "release_flow",
           "get_many_into_flow", "get_flow", "put_many_flow", "reserve_flow", "commit_flow", "abort_flow",
           "check_lease", "LocatedRead", "ReservedWrite"]

_MAX_FDS = 4                       # fds accepted in one MAP reply (one is sent; more is an error)
PUT_MANY_WINDOW = 1024             # items put_many reserves at once over the mapping (see put_many_flow)


class Arena:
    """The node's DRAM arena mapped into this process (MAP_SHARED, read and write)."""

    def __init__(self, fd: int, info: located.MapReply) -> None:
        st = os.fstat(fd)
        if st.st_size < info.arena_bytes:
            raise ProtocolError(f"MAP: the fd is {st.st_size} bytes, the node announced {info.arena_bytes}")
        self.size = info.arena_bytes
        self.id = info.arena_id
        self.lease_ns = info.lease_ns
        self.put_timeout_ns = info.put_timeout_ns
        self.map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)
        self.readonly = self.view.toreadonly()     # what located views are sliced from
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))   # for cudaHostRegister
        self.closed = False

    def close(self) -> None:
        """Unmap; views still held elsewhere keep the pages until they go."""
        if self.closed:
            return
        self.closed = True
        self.array = None
        try:
            self.readonly.release()
            self.view.release()
            self.map.close()
        except BufferError:
            pass


def recv_with_fds(sock: socket.socket, buf: memoryview) -> tuple[int, list[int]]:
    """One recvmsg into ``buf``; returns (bytes, fds received with them)."""
    n, anc, flags, _ = sock.recvmsg_into([buf], socket.CMSG_SPACE(_MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("MAP: ancillary data truncated (more fds than expected)")
    return n, fds


class Located(NamedTuple):
    lease_ids: list[int]                         # what to RELEASE (0s left out)
    expires_ns: int                              # the earliest expiry of the batches
    items: np.ndarray                            # LOCATED_ITEM per key, in order, checked

    @property
    def extents(self) -> list[Optional[tuple[int, int]]]:
        """(offset, length) per key, None for a miss."""
        return _extents(self.items)


def _extents(items: np.ndarray) -> list:
    return [(off, n) if status == 0 else None for status, off, n in items.tolist()]


_NO_ITEMS = np.zeros(0, located.LOCATED_ITEM)


class LocatedViews(list):
    """The views ``get_many_located`` yields (None for a miss), with ``extents``
    ((offset, length) per key) for callers that address the arena themselves (gpu.py)."""

    _extents: Optional[list] = None

    def __init__(self, views=(), items: Optional[np.ndarray] = None) -> None:
        super().__init__(views)
        self._items = items                       # LOCATED_ITEM per key (None: copies)

    @property
    def extents(self) -> list:
        """(offset, length) per key, None for a miss (and for every key of ``copies``);
        made on first use: the views alone need no Python object per block but the view."""
        if self._extents is None:
            self._extents = [None] * len(self) if self._items is None else _extents(self._items)
        return self._extents

    @classmethod
    def copies(cls, blocks) -> "LocatedViews":
        """The TCP fallback: read-only views of ``get_many``'s copies, no extents."""
        return cls(None if v is None else v.toreadonly() for v in blocks)

    @classmethod
    def of_arena(cls, arena: memoryview, items: np.ndarray) -> "LocatedViews":
        """Read-only views into the mapped arena at the leased extents (``items``, checked):
        slices of ``arena``, one read-only view of the whole mapping, made in one pass."""
        return cls(located.located_views(arena, items), items)

    def release_views(self) -> None:
        """Invalidate every view: one used after its lease ends raises ValueError."""
        located.release_views(self)


def check_lease(expires_ns: int, what: str) -> None:
    if time.monotonic_ns() >= expires_ns:
        raise Timeout(f"{what}: the located lease ran out before the bytes were read; they may "
                      "belong to another block now, so they are not returned (retry)")


# --------------------------------------------------------------------------- flows


def located_flow(c, keys: Sequence):
    """GET_LOCATED of every key (batches within max_batch and max_header) -> Located."""
    lim = c.limits
    ekeys = c.encoded_keys(keys)
    ids: list[int] = []
    parts: list = []
    expires = 1 << 63
    try:
        per = keys_per_request(ekeys, lim)
        for start in range(0, len(ekeys), per):
            chunk = ekeys[start:start + per]
            rep = yield Req(Opcode.GET_LOCATED, messages.encode_keys_request(chunk, lim, "GET_LOCATED"), (), 0,
                             None, lambda r: located.decode_located_reply(r.header, lim))
            if len(rep.items) != len(chunk):
                raise ProtocolError(f"GET_LOCATED reply has {len(rep.items)} items for {len(chunk)} keys")
            if rep.lease_id:
                ids.append(rep.lease_id)
                expires = min(expires, rep.expires_ns)
            located.check_located_items(rep.items, c.arena.size)     # before any extent is used
            parts.append(rep.items)
    except BaseException:
        if ids:
            yield from release_flow(c, ids)
        raise
    items = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _NO_ITEMS
    return Located(ids, expires, items)


def release_flow(c, ids: list[int], wait: bool = True):
    """RELEASE the leases ``ids`` (batches of max_batch).  ``wait`` False: posted
    (``calls.Post``), for a read that has copied its bytes and checked its expiry: the node
    frees the leases as it reads the request, and the caller does not wait a round trip for
    the answer (a single located GET then costs one round trip, not two)."""
    lim = c.limits
    for start in range(0, len(ids), lim.max_batch):
        req = Req(Opcode.RELEASE, located.encode_release_request(ids[start:start + lim.max_batch], lim), (), 0,
                  None, lambda r: located.decode_release_count(r.header))
        yield req if wait else Post(req)


def get_many_into_flow(c, keys: Sequence, dsts: Sequence[memoryview]):
    """Located GET, one memcpy per block out of the mapping, expiry check, release."""
    loc = yield from located_flow(c, keys)
    try:
        view = c.arena.view
        out: list = []
        for i, (ext, dst) in enumerate(zip(loc.extents, dsts)):
            if ext is None:
                out.append(None)
                continue
            off, n = ext
            if n > dst.nbytes:
                raise InvalidArgument(f"get_many_into: buffer {i} has {dst.nbytes} bytes, its block is {n} bytes")
            dst[:n] = view[off:off + n]
            out.append(n)
        check_lease(loc.expires_ns, "get_many_into")
    finally:
        if loc.lease_ids:
            yield from release_flow(c, loc.lease_ids, wait=False)
    return out


def get_flow(c, key, dst: Optional[memoryview]):
    """One key: bytes (``dst`` None) or the size copied into ``dst``; NotFound on a miss
    (the GET of the key then names the violation, as the copy path would)."""
    loc = yield from located_flow(c, [key])
    try:
        ext = loc.extents[0]
        if ext is None:
            # a miss: ask the copy path, whose error names the reason (not found, unsafe reuse)
            yield Req(Opcode.GET, c.get_header(key), (), 0, lambda f: bytearray(f.payload_length), lambda r: None)
            raise NotFound("located GET: no such block")   # reached only if the key appeared meanwhile
        off, n = ext
        src = c.arena.view[off:off + n]
        if dst is None:
            out: Any = bytes(src)
        else:
            if n > dst.nbytes:
                raise InvalidArgument(f"get_into: buffer of {dst.nbytes} bytes, block is {n} bytes")
            dst[:n] = src
            out = n
        check_lease(loc.expires_ns, "get")
    finally:
        if loc.lease_ids:
            yield from release_flow(c, loc.lease_ids, wait=False)
    return out


def reserve_flow(c, items: Sequence[tuple[Any, int]], durable: bool):
    """RESERVE (batches within max_batch, max_header and max_payload) -> [(reserve id,
    expires_ns, [offsets])]; all or nothing: on an error every batch already reserved is aborted."""
    lim = c.limits
    sizes = [n for _, n in items]
    ekeys = c.encoded_keys([k for k, _ in items])
    prepared = list(zip(ekeys, sizes))
    out: list = []
    try:
        per = keys_per_request(ekeys, lim, SIZED_KEY_OVERHEAD)
        for start, end in sized_spans(sizes, per, lim.max_payload_bytes):
            chunk = prepared[start:end]
            rep = yield Req(Opcode.RESERVE, messages.encode_put_many_request(chunk, lim), (),
                             FLAG_DURABLE if durable else 0, None,
                             lambda r: located.decode_reserve_reply(r.header, lim))
            if len(rep.offsets) != len(chunk):
                raise ProtocolError(f"RESERVE reply has {len(rep.offsets)} slots for {len(chunk)} keys")
            out.append(rep)
            located.check_slots(rep.offsets, sizes[start:end], c.arena.size)
    except BaseException:
        yield from abort_flow(c, [r.reserve_id for r in out])
        raise
    return out


def commit_flow(c, reserves: list):
    lim = c.limits
    first = None
    i = 0
    for rep in reserves:
        statuses = yield Req(Opcode.COMMIT, located.encode_id(rep.reserve_id), (), 0, None,
                              lambda r: messages.decode_status_list(r.header, lim))
        for st in statuses:
            if st and first is None:
                first = status_error(st, f"put item {i}")
            i += 1
    if first is not None:
        raise first


def abort_flow(c, ids: list[int]):
    for rid in ids:
        try:
            yield Req(Opcode.ABORT, located.encode_id(rid), (), 0, None, lambda r: None)
        except QuillCacheError:
            pass                 # the connection is gone: the node aborts them itself


def put_many_flow(c, items: Sequence[tuple[Any, memoryview]], durable: bool):
    """RESERVE, one memcpy per block into its slot, COMMIT, for at most ``PUT_MANY_WINDOW``
    items at a time: the node refuses (Busy) more than its ``max_inflight_puts`` (4,096 by
    default) reserved and not yet committed, and a put_many of 5,000 blocks reserved them all
    first.  As over TCP, each window is stored on its own."""
    for a in range(0, len(items), PUT_MANY_WINDOW):
        part = items[a:a + PUT_MANY_WINDOW]
        reserves = yield from reserve_flow(c, [(k, mv.nbytes) for k, mv in part], durable)
        try:
            view = c.arena.view
            pos = 0
            for rep in reserves:
                for off in rep.offsets:
                    mv = part[pos][1]
                    view[off:off + mv.nbytes] = mv
                    pos += 1
        except BaseException:
            yield from abort_flow(c, [r.reserve_id for r in reserves])
            raise
        yield from commit_flow(c, reserves)


def slot_views(c, reserves: list, sizes: list[int]) -> list[memoryview]:
    """Writable views of the reserved slots (checked by ``reserve_flow``), in key order."""
    offsets = reserves[0].offsets if len(reserves) == 1 else [off for rep in reserves for off in rep.offsets]
    return located.slot_views(c.arena.view, offsets, sizes)


# --------------------------------------------------------------------------- the two context managers


class LocatedRead:
    """The steps of ``get_many_located``, once for both clients: ``enter()`` and ``exit(ok)``
    are flows (they yield ``Req``/``Batch``); ``Client`` drives them blocking around the
    ``with`` body, ``AsyncClient`` awaits them around the ``async with`` body."""

    def __init__(self, c, keys: Iterable) -> None:
        self.c = c
        self.keys = list(keys)
        self.loc: Optional[Located] = None
        self.views: Optional[LocatedViews] = None

    def enter(self):
        """-> LocatedViews: leased views into the mapping, or (TCP, untrusted) read-only
        views of ``get_many``'s copies."""
        c = self.c
        if c.arena is None:
            blocks = yield from c.get_many_flow(self.keys, None)
            return LocatedViews.copies(blocks)
        self.loc = yield from located_flow(c, self.keys)
        self.views = LocatedViews.of_arena(c.arena.readonly, self.loc.items)
        return self.views

    def exit(self, ok: bool):
        """Invalidate the views and RELEASE the leases; ``ok`` (the body ended without an
        exception): raise Timeout if a lease ran out while the body held it."""
        loc = self.loc
        if loc is None:
            return
        self.views.release_views()
        if loc.lease_ids and self.c.is_open:
            yield from release_flow(self.c, loc.lease_ids)
        if ok:
            check_lease(loc.expires_ns, "get_many_located")


class ReservedWrite:
    """The steps of ``put_many_reserved``, once for both clients: ``enter()`` -> writable
    views; then ``commit()`` after the body, or ``abort()`` when it raised.  Over TCP (or
    untrusted) the views are plain buffers that ``commit()`` sends with PUT_MANY."""

    def __init__(self, c, items: Iterable[tuple[Any, int]], durable: bool) -> None:
        self.c = c
        self.items = [(k, int(n)) for k, n in items]
        self.durable = durable
        self.reserves: Optional[list] = None
        self.views: list = []

    def enter(self):
        c = self.c
        if c.arena is None:
            self.views = [memoryview(bytearray(n)) for _, n in self.items]
            return self.views
        self.reserves = yield from reserve_flow(c, self.items, self.durable)
        self.views = slot_views(c, self.reserves, [n for _, n in self.items])
        return self.views

    def commit(self):
        if self.reserves is None:
            yield self.c.put_many_requests([(k, v) for (k, _), v in zip(self.items, self.views)], self.durable)
            return
        located.release_views(self.views)
        yield from commit_flow(self.c, self.reserves)

    def abort(self):
        if self.reserves is None:
            return
        located.release_views(self.views)
        yield from abort_flow(self.c, [r.reserve_id for r in self.reserves])
