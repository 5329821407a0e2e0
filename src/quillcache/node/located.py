"""The located (shared-memory) requests of a Unix-socket connection: MAP, GET_LOCATED,
RELEASE, RESERVE, COMMIT, ABORT (opcodes 0x30-0x35).  docs/shm.md has the model.

``LocatedMixin`` is mixed into ``server.ServerProtocol``; it keeps what one connection
holds: its located leases (lease id -> store leases) and its reserves (reserve id -> put
handles).  Both are let go when the connection goes, whatever the reason (a client killed
with -9 included): leases are released, reserved slots aborted, so nothing a dead client
held stays pinned and no slot it was writing is ever published.

Trust: MAP is answered only on the Unix socket, only when ``[node] shm`` is on and the
connection's principal may map (``Authenticator.may_map``).  The identity guard and the
tenant check run on every located request exactly as on GET_MANY / PUT_MANY.
"""
from __future__ import annotations

import array
import itertools
import logging
import math
import os
import socket
import time

from quillcache._native.batch import packed_offsets
from quillcache._native.codec import encode_frame_header
from quillcache.errors import Busy, InvalidArgument, NotFound, PermissionDenied, UnsafeReuse
from quillcache.protocol import located, messages
from quillcache.protocol.opcodes import FLAG_DURABLE, FLAG_REPLY, Opcode
from quillcache.store.batchlease import BatchLease
from quillcache.store.dram import Slot
from quillcache.store.leases import release_leases

__all__ = ["LocatedMixin", "NS"]

log = logging.getLogger("quillcache.server")

NS = 1_000_000_000               # nanoseconds per second (lease and reserve expiries are monotonic ns)
_MISS = (NotFound, UnsafeReuse, Busy)


class LocatedMixin:
    """Located requests and the per-connection state they hold (leases, reserves)."""

    unix = False                 # set by NodeServer.unix_protocol_factory
    mapped = False               # the arena fd was sent on this connection
    _ids = itertools.count(1)    # lease and reserve ids, unique per node process

    def _located_init(self) -> None:
        self._located: dict[int, list] = {}       # lease id -> store leases (a BatchLease first)
        self._reserves: dict[int, list] = {}      # reserve id -> put handles

    def _located_close(self) -> None:
        """The connection is gone: release its leases, abort its reserves."""
        leases, self._located = self._located, {}
        for held in leases.values():
            for lease in held:
                lease.release()
        reserves, self._reserves = self._reserves, {}
        for handles in reserves.values():
            for h in handles:
                self.store.put_abort(h)

    @property
    def located_leases(self) -> int:
        """Blocks held by this connection's located leases."""
        return sum(len(x) if type(x) is BatchLease else 1 for held in self._located.values() for x in held)

    @property
    def located_reserves(self) -> int:
        return sum(len(h) for h in self._reserves.values())

    def _need_mapped(self) -> None:
        if not self.mapped:
            raise PermissionDenied("located requests need the arena mapped (MAP on the Unix socket)")

    # ------------------------------------------------------------------ MAP

    def _map(self, frame) -> None:
        rid = frame.request_id
        node = self.node
        if not self.unix:
            raise PermissionDenied("MAP: the arena is shared only over the Unix socket")
        if not node.shm:
            raise PermissionDenied("MAP: this node does not share its arena ([node] shm = false); "
                                   "use the copy path")
        if not node.auth.may_map(self.tenant or ""):
            raise PermissionDenied(f"MAP: tenant {self.tenant!r} may not map the arena (needs shm = true "
                                   "on its [[auth.tenants]] entry); use the copy path")
        t = self.transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size():
            raise Busy("MAP: replies are queued on this connection; send MAP with nothing in flight")
        store = self.store
        body = located.encode_map_reply(located.MapReply(
            store.arena_bytes, node.arena_id, int(store.lease_s * NS), int(store.put_timeout_s * NS)))
        head = encode_frame_header(Opcode.MAP, rid, flags=FLAG_REPLY, header=body)
        sock = socket.socket(fileno=os.dup(t.get_extra_info("socket").fileno()))
        try:
            # The fd rides on the reply's first byte; nothing is queued before it (checked above).
            n = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [store.arena_fd]))])
        except OSError as exc:
            raise Busy(f"MAP: could not send the arena fd ({exc})") from None
        finally:
            sock.close()
        self.take_request(rid)
        if n < len(head):
            self._write([head[n:]])         # the rest of the frame, in order behind it
        self.mapped = True
        self._done(rid, Opcode.MAP, 0)
        log.info("arena mapped by %s (tenant %r)", self.peer, self.tenant or "")

    # ------------------------------------------------------------------ GET_LOCATED / RELEASE

    def _get_located(self, frame) -> None:
        self._need_mapped()
        keys = self._keys_of(messages.decode_keys_request(frame.header, self.limits, "GET_LOCATED"))
        # per key: a held Slot, a miss status, or None (read the SSD first); one lease for the batch
        batch, got = self.store.located_batch(keys)
        every_key_held = batch is not None and len(batch) == len(got)   # then no scan for misses
        if not every_key_held and (None in got or (NotFound.status in got and self.node.cluster is not None
                                                   and not self.peer_node)):
            self._spawn(self._located_later(frame.request_id, keys, batch, got))
        else:
            self._reply_located(frame.request_id, batch, got)

    async def _located_later(self, rid: int, keys: list, batch, got: list) -> None:
        """SSD-only blocks are read (and promoted into the arena) off the event loop first;
        then, in a pool, the local misses are fetched from other nodes into the arena.
        Those come as leases of their own, held beside the batch's."""
        try:
            for i, lease in enumerate(got):
                if lease is None:
                    try:
                        got[i] = await self.store.get_async(keys[i])
                    except _MISS as exc:
                        got[i] = exc.status
            cluster = self.node.cluster
            missing = [i for i, g in enumerate(got) if g == NotFound.status]   # a status, not a lease
            if missing and cluster is not None and not self.peer_node:
                found = await cluster.serve_located(self.tenant or "", [keys[i] for i in missing])
                for i, lease in zip(missing, found):
                    if lease is not None:
                        got[i] = lease
        except Exception as exc:
            _let_go(batch, got)
            self._err(rid, Opcode.GET_LOCATED, exc)
            return
        except BaseException:
            _let_go(batch, got)
            raise
        if self.closed or self.failed is not None:
            _let_go(batch, got)                  # the connection went meanwhile: nobody to hold them
            return
        self._reply_located(rid, batch, got)

    def _reply_located(self, rid: int, batch, got: list) -> None:
        if batch is not None and len(batch) == len(got):          # every key found, all under the batch
            lease_id = next(self._ids)
            self._located[lease_id] = [batch]
            body = located.encode_located_reply(lease_id, int(batch.expires_at * NS), got)   # Slots: hits
            self._ok(rid, Opcode.GET_LOCATED, body)
            return
        held = []
        items = []
        expires = math.inf
        if batch is not None:
            held.append(batch)
            expires = batch.expires_at
        for g in got:
            if type(g) is int:
                items.append((g, 0, 0))
            elif type(g) is Slot:              # held by the batch's lease
                items.append(g)
            elif g.offset is None:             # served from an SSD buffer (no room): not in the arena
                g.release()
                items.append((NotFound.status, 0, 0))
            else:
                held.append(g)
                expires = min(expires, g.expires_at)
                items.append(g)                # a Lease of its own: offset and size
        lease_id = 0
        if held:
            lease_id = next(self._ids)
            self._located[lease_id] = held
        body = located.encode_located_reply(lease_id, int(expires * NS) if held else 0, items)
        self._ok(rid, Opcode.GET_LOCATED, body)

    def _release(self, frame) -> None:
        ids = located.decode_release_request(frame.header, self.limits)
        n = 0
        for lease_id in ids:
            batch = self._located.pop(lease_id, None)
            if batch is not None:
                n += 1
                for lease in batch:
                    lease.release()
        self._ok(frame.request_id, Opcode.RELEASE, located.encode_release_count(n))

    # ------------------------------------------------------------------ RESERVE / COMMIT / ABORT

    def _reserve(self, frame) -> None:
        self._need_mapped()
        durable = bool(frame.flags & FLAG_DURABLE)
        raws, sizes = messages.decode_put_many_columns(frame.header, None, self.limits, "RESERVE")
        keys = self._keys_of(raws)
        handles = self.store.reserve_columns_nowait(keys, sizes, durable)     # all or nothing
        if handles is None:              # room needs demotions (SSD writes): wait for them
            self._spawn(self._reserve_waiting(frame.request_id, list(zip(keys, sizes)), durable))
        else:
            self._reply_reserved(frame.request_id, handles)

    async def _reserve_waiting(self, rid: int, items: list, durable: bool) -> None:
        try:
            handles = await self.store.reserve(items, durable)     # up to put_timeout, then Busy
        except Exception as exc:
            self._err(rid, Opcode.RESERVE, exc)
            return
        if self.closed or self.failed is not None:
            for h in handles:
                self.store.put_abort(h)
            return
        self._reply_reserved(rid, handles)

    def _reply_reserved(self, rid: int, handles: list) -> None:
        reserve_id = next(self._ids)
        self._reserves[reserve_id] = handles
        expires = time.monotonic() + self.store.put_timeout_s
        self._ok(rid, Opcode.RESERVE,
                 located.encode_reserve_reply(reserve_id, int(expires * NS), packed_offsets(handles)))

    def _commit(self, frame) -> None:
        reserve_id = located.decode_id(frame.header, "COMMIT")
        handles = self._reserves.pop(reserve_id, None)
        if handles is None:
            raise InvalidArgument(f"COMMIT: reserve {reserve_id} is not held by this connection "
                                  "(committed, aborted, or never made)")
        # Published in order; a put that needs I/O first (durable: fsync before visible) and
        # every one after it are finished off the event loop, still in order.
        statuses = self._publish_nowait(handles, 0, None, "COMMIT")
        if len(statuses) < len(handles):
            self._spawn(self._finish_commit(frame.request_id, handles, statuses))
        else:
            self._ok(frame.request_id, Opcode.COMMIT, messages.encode_status_list(statuses, self.limits))

    async def _finish_commit(self, rid: int, handles: list, statuses: list) -> None:
        await self._publish_rest(handles, statuses, "COMMIT")
        self._ok(rid, Opcode.COMMIT, messages.encode_status_list(statuses, self.limits))

    def _abort(self, frame) -> None:
        reserve_id = located.decode_id(frame.header, "ABORT")
        for h in self._reserves.pop(reserve_id, ()):
            self.store.put_abort(h)
        self._ok(frame.request_id, Opcode.ABORT)


def _let_go(batch, got: list) -> None:
    """The reply will not be sent: release the batch's lease and any lease of its own in ``got``."""
    if batch is not None:
        batch.release()
    release_leases(got)


LOCATED_HANDLERS = {
    Opcode.MAP: LocatedMixin._map,
    Opcode.GET_LOCATED: LocatedMixin._get_located,
    Opcode.RELEASE: LocatedMixin._release,
    Opcode.RESERVE: LocatedMixin._reserve,
    Opcode.COMMIT: LocatedMixin._commit,
    Opcode.ABORT: LocatedMixin._abort,
}
