"""The PUT path of a connection: PUT and PUT_MANY, received straight into DRAM arena slots.

The PUT header starts the put (``store.reserve_nowait``) and its slot view becomes the
parser's destination, so ``get_buffer`` hands the socket the remaining part of the slot;
``put_end`` runs when the payload is complete and ``put_abort`` on an error or a
disconnect.  When DRAM is full of blocks that must be demoted first, the connection reads
nothing more until the store has the slots (``DEFER``): back-pressure, not an error.
A PUT is acknowledged (and visible) when ``put_end`` returns.

``WritesMixin`` is mixed into ``connection.ServerProtocol``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from quillcache._native.codec import decode_put_body, encode_frame_header
from quillcache.errors import InvalidArgument, QuillCacheError, Timeout
from quillcache.protocol import messages
from quillcache.protocol.connection import DEFER
from quillcache.protocol.opcodes import FLAG_DURABLE, FLAG_REPLY, Opcode

__all__ = ["WritesMixin"]

log = logging.getLogger("quillcache.server")

_PUT = int(Opcode.PUT)


class WritesMixin:
    """PUT / PUT_MANY: the ``ProtocolConnection`` hooks ``_on_put_start/_end/_abort``."""

    def _on_put_start(self, frame):
        rid = frame.request_id
        self._started[rid] = time.perf_counter()
        try:
            node = self.node
            if node.draining or self.peer_node or (not self.tenant and not node.auth.open_mode):
                self._check_access()
            durable = bool(frame.flags & FLAG_DURABLE)
            if frame.opcode == _PUT:
                raw, nbytes = decode_put_body(frame.header, frame.payload_length, self.limits.max_key_bytes)
                keys, sizes = [self._key(raw)], [nbytes]
            else:
                raws, sizes = messages.decode_put_many_columns(frame.header, frame.payload_length, self.limits)
                keys = self._keys_of(raws)
            handles = self.store.reserve_columns_nowait(keys, sizes, durable)     # all or nothing
        except QuillCacheError as exc:
            self._done(rid, frame.opcode, exc.status)
            raise                           # the connection replies it and skips the payload
        if handles is None:                 # DRAM is full of blocks that must be demoted first
            self._defer_put(frame, list(zip(keys, sizes)), durable)
            return DEFER
        return self._put_destination(frame, handles)

    def _put_destination(self, frame, handles: list):
        self._puts[frame.request_id] = handles
        self._reaps_seen = self.store.puts_reaped
        if frame.opcode == _PUT:
            h = handles[0]
            return h.view if h.size else None
        return [h.view for h in handles if h.size]

    def _defer_put(self, frame, items: list, durable: bool) -> None:
        """Back-pressure: read nothing more from this client until the store has the slots."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        # a task, not _spawn: the connection must see DEFER before the slots can arrive
        task = asyncio.get_running_loop().create_task(self._reserve_deferred(frame, items, durable))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._deferred_task = task

    async def _reserve_deferred(self, frame, items: list, durable: bool) -> None:
        rid = frame.request_id
        try:
            handles = await self.store.reserve(items, durable)
        except Exception as exc:
            if not isinstance(exc, QuillCacheError):
                log.exception("internal error reserving a PUT from %s", self.peer)
                exc = InvalidArgument(f"internal error: {exc!r}")
            self._done(rid, frame.opcode, exc.status)
            self.refuse_put(exc)
        else:
            if self.closed or self.failed is not None:
                for h in handles:
                    self.store.put_abort(h)
                return
            self.resume_put(self._put_destination(frame, handles))
        if self._deferred_task is asyncio.current_task():
            self._deferred_task = None
        if self.close_requested and self.transport is not None:
            self.transport.close()
        elif not self.put_deferred and not self._reading_paused and self.transport is not None \
                and not self.transport.is_closing():
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the socket's next bytes go.  A put whose payload comes later than
        ``put_timeout`` has had its slot reaped, and the slot may be another put's now: not
        another byte goes into it (scratch instead), and the connection fails once the
        transport has handed the bytes over (``buffer_updated``: the transport's read is
        still under way here)."""
        if self._puts and self.store.puts_reaped != self._reaps_seen:
            self._reaps_seen = self.store.puts_reaped
            in_flight = self.store.put_in_flight
            if not all(in_flight(h) for handles in self._puts.values() for h in handles):
                self._put_reaped = True
        if self._put_reaped:
            return self.scratch_buffer()
        return super().get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._put_reaped:
            self._put_reaped = False
            self._fail(Timeout(f"a put's payload did not arrive within put_timeout "
                               f"({self.store.put_timeout_s:g} s): it was dropped and the connection is closed"))
            return
        super().buffer_updated(nbytes)

    def _on_put_end(self, frame) -> None:
        rid = frame.request_id
        handles = self._puts.pop(rid, None)
        if handles is None:
            return
        if frame.opcode == _PUT:
            # the hot path of a PUT that needs no I/O: published (in the store's native pass)
            # and acknowledged here, no coroutine (``_finish_put`` for the others: durable, an
            # SSD copy to drop, or a handle no longer in flight, whose error it gives)
            try:
                done = self.store.put_end_many_nowait(handles)
            except Exception as exc:
                self._err(rid, _PUT, exc)
                return
            if done:
                self._ack_put(rid)
                if self.node.cluster is not None and not self.peer_node:
                    self.node.cluster.after_put([handles[0].key])
                return
        self._spawn(self._finish_put(rid, frame.opcode, handles))

    def _ack_put(self, rid: int) -> None:
        """PUT's OK reply, a bare header: ``reply_ok`` without its checks and frame assembly."""
        self.take_request(rid)
        if self.failed is None and not self.closed:
            self._write([encode_frame_header(_PUT, rid, flags=FLAG_REPLY)])
        self._done(rid, _PUT, 0)

    def _on_put_abort(self, frame, exc) -> None:
        for h in self._puts.pop(frame.request_id, ()):
            self.store.put_abort(h)

    async def _finish_put(self, rid: int, opcode: int, handles: list) -> None:
        if opcode == Opcode.PUT:
            try:
                await self.store.put_end(handles[0])
            except Exception as exc:
                self._err(rid, opcode, exc)
            else:
                self._ok(rid, opcode)
                if self.node.cluster is not None and not self.peer_node:
                    self.node.cluster.after_put([handles[0].key])
            return
        statuses = self._publish_nowait(handles, 0, None, "PUT_MANY")
        await self._publish_rest(handles, statuses, "PUT_MANY")
        self._ok(rid, opcode, messages.encode_status_list(statuses, self.limits))
        if self.node.cluster is not None and not self.peer_node:
            self.node.cluster.after_put([h.key for h, st in zip(handles, statuses) if st == 0])

    # ---- publishing a batch (PUT_MANY here, COMMIT in located.py), in order

    def _publish_nowait(self, handles: list, start: int, statuses: Optional[list], what: str) -> list:
        """Publish ``handles[start:]`` that need no I/O, in order, up to the first that does;
        returns the statuses so far (one per handle done)."""
        statuses = [] if statuses is None else statuses
        store = self.store
        i, n = start, len(handles)
        while i < n:
            done = store.put_end_many_nowait(handles, i)     # the common case, in one native pass
            statuses.extend([0] * done)
            i += done
            if i == n:
                break
            try:                             # the one it left: its error, or it needs I/O
                if not store.put_end_nowait(handles[i]):
                    break
                statuses.append(0)
            except QuillCacheError as exc:
                statuses.append(exc.status)         # e.g. reaped after put_timeout
            except Exception:
                log.exception("internal error in %s item from %s", what, self.peer)
                statuses.append(1)
            i += 1
        return statuses

    async def _publish_rest(self, handles: list, statuses: list, what: str) -> None:
        """Publish the rest of ``handles`` after ``statuses``: each that needs I/O (durable:
        fsync before visible) awaited, those after it published at once, in order."""
        while len(statuses) < len(handles):
            h = handles[len(statuses)]
            try:
                await self.store.put_end(h)
                statuses.append(0)
            except QuillCacheError as exc:
                statuses.append(exc.status)
            except Exception:
                log.exception("internal error in %s item from %s", what, self.peer)
                statuses.append(1)
            self._publish_nowait(handles, len(statuses), statuses, what)

    def _put_empty(self, frame) -> None:
        """A PUT/PUT_MANY whose payload is empty arrives as a complete frame."""
        self._on_put_start(frame)           # raises QuillCacheError: replied by the caller
        self._on_put_end(frame)
