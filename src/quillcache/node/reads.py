"""The read requests of a connection: GET (the hot path), GET_MANY and EXISTS.

Zero copy: a GET reply is ``transport.writelines([header, lease.view])``, the payload going
from the arena to the transport without a Python copy; a GET served from the SSD tier
without promotion is sent from the data file with ``os.sendfile`` (see ``_send_extent``).
The leases a reply refers to are held until the transport handed their bytes to the
kernel (``ServerProtocol._hold``, docs in ``node.connection``).

``ReadsMixin`` is mixed into ``connection.ServerProtocol``.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import Optional

from quillcache._native.codec import decode_key_body, encode_frame_header
from quillcache.errors import Busy, NotFound, UnsafeReuse
from quillcache.fsutil import pread_full
from quillcache.model import KvBlockKey
from quillcache.node.limits import WRITE_HIGH_BYTES
from quillcache.protocol import messages
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, FLAG_REPLY, Opcode
from quillcache.store.leases import release_leases

__all__ = ["ReadsMixin"]

log = logging.getLogger("quillcache.server")

_GET = int(Opcode.GET)
_GET_REPLY_FLAGS = FLAG_REPLY
_EXTENT_REPLY_FLAGS = FLAG_REPLY | FLAG_PAYLOAD_CRC
_U32 = struct.Struct("<I")


class ReadsMixin:
    """GET, GET_MANY, EXISTS."""

    def _get(self, frame) -> None:
        """GET, the hot path: no per-request closure, task or dict entry; one writelines."""
        t0 = time.perf_counter()
        rid = frame.request_id
        key = None
        try:
            node = self.node
            if node.draining or self.peer_node or (not self.tenant and not node.auth.open_mode):
                self._check_access()
            raw = decode_key_body(frame.header, self.limits.max_key_bytes)
            key = self._key(raw)
            lease = self.store.get_nowait(key, extent_ok=self._fd >= 0)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._started[rid] = t0
                if type(exc) is NotFound and key is not None and node.cluster is not None and not self.peer_node:
                    # another node may hold it (raw: the key encoded, as the pool names it)
                    self._spawn(node.cluster.serve_get(self, rid, key, frame.flags, exc, raw))
                    return
                self._err(rid, _GET, exc)
            return
        if lease is None:                   # SSD-only: read off the loop, reply when it is in
            self._spawn(self._get_from_ssd(rid, key, frame.flags, t0))
            return
        self._reply_get(rid, lease, frame.flags, t0)

    async def _get_from_ssd(self, rid: int, key: KvBlockKey, flags: int, t0: float) -> None:
        try:
            lease = await self.store.get_async(key)
        except Exception as exc:
            if self.is_in_flight(rid):
                self._started[rid] = t0
                self._err(rid, _GET, exc)
            return
        if not self.is_in_flight(rid):      # the connection went meanwhile
            lease.release()
            return
        self._reply_get(rid, lease, flags, t0)

    def _reply_get(self, rid: int, lease, flags: int, t0: float) -> None:
        node = self.node
        if lease.extent is not None:
            try:
                self.take_request(rid)
                if self.failed is None and not self.closed:
                    self._send_extent(rid, *lease.extent)
            finally:
                lease.release()             # everything was read from the file in this step
            node.requests += 1
            self._counters.observe(_GET, 0, time.perf_counter() - t0)
            return
        try:
            if flags & FLAG_PAYLOAD_CRC or self.failed is not None or self.closed:
                self._started[rid] = t0
                self._ok(rid, _GET, b"", [lease.view], crc=bool(flags & FLAG_PAYLOAD_CRC))
                return
            self._write_get(rid, lease.view, lease.size, t0)
        finally:
            self._hold((lease,))

    def finish_get(self, rid: int, view, flags: int) -> None:
        """The GET reply of a block another node sent (the cluster hook's call): the write of
        ``_reply_get``, or ``finish`` where the client asked for a payload CRC."""
        if flags & FLAG_PAYLOAD_CRC or self.failed is not None or self.closed:
            self.finish(rid, _GET, b"", (view,), crc=bool(flags & FLAG_PAYLOAD_CRC))
            return
        t0 = self._started.pop(rid, None)
        self._write_get(rid, view, view.nbytes, time.perf_counter() if t0 is None else t0)

    def _write_get(self, rid: int, view, size: int, t0: float) -> None:
        """GET's reply without a payload CRC: header and ``view`` in one writelines."""
        self.take_request(rid)
        head = encode_frame_header(_GET, rid, flags=_GET_REPLY_FLAGS, payload_length=size)
        t = self.transport
        if t is not None and not t.is_closing():
            t.writelines([head, view])
            self._counters.sent_bytes += len(head) + size
            if not self._reading_paused and t.get_write_buffer_size() > WRITE_HIGH_BYTES:
                self._reading_paused = True
                t.pause_reading()
        self.node.requests += 1
        self._counters.observe(_GET, 0, time.perf_counter() - t0)

    def _send_extent(self, rid: int, fd: int, offset: int, length: int, crc: int) -> None:
        """The GET reply for a verified SSD extent: header, sendfile, then whatever the socket
        did not take (preadv, to the transport), then the stored CRC32C as the trailer."""
        t = self.transport
        if t is None or t.is_closing():
            return
        head = encode_frame_header(_GET, rid, flags=_EXTENT_REPLY_FLAGS, payload_length=length)
        sent = direct = 0                       # payload bytes by sendfile, header bytes by write
        sock = self._fd
        if sock >= 0 and t.get_write_buffer_size() == 0:
            # Nothing is queued in the transport, so bytes written to the socket here are in
            # order; from the first byte it does not take, the rest goes through the transport.
            try:
                w = os.write(sock, head)
                direct = w
                head = head[w:]
                while not head and sent < length:
                    n = os.sendfile(sock, fd, offset + sent, length - sent)
                    if n == 0:
                        break                          # past the end of the file: preadv says so below
                    sent += n
            except BlockingIOError:
                pass
            except OSError:
                pass          # a broken connection: the transport's own write reports it below
        parts = [head] if head else []
        rest = length - sent
        if rest:
            buf = bytearray(rest)
            got = pread_full(fd, memoryview(buf), offset + sent)
            if got != rest:
                # The reply's length is promised (and maybe partly sent): the stream cannot
                # be continued.  A preallocated data file makes this an I/O fault.
                log.error("SSD data file short read (%d of %d bytes at %d): closing the connection from %s",
                          got, rest, offset + sent, self.peer)
                t.abort()
                return
            parts.append(buf)
        parts.append(_U32.pack(crc))
        self._write(parts)                      # counts its parts and applies flow control
        counters = self._counters
        counters.sent_bytes += direct + sent    # what went to the socket directly
        counters.sendfile_bytes += sent

    def _get_many(self, frame) -> None:
        raws = messages.decode_keys_request(frame.header, self.limits, "GET_MANY")
        keys = self._keys_of(raws)
        # The DRAM hits under one lease for the batch (the located path's), each miss as its
        # status; only where a key must be read from the SSD tier (None), or fetched from
        # another node, does the per-key path below run.
        try:
            batch, located = self.store.located_batch(keys)
        except Busy:
            batch, located = None, None             # the per-key path reports Busy per key
        if located is not None:
            if None not in located:                 # no SSD read: answered now (or by the pool)
                self._reply_get_many_batch(frame.request_id, batch, located, frame.flags, keys, raws)
                return
            if batch is not None:
                batch.release()
        got = []
        try:
            for key in keys:
                try:
                    lease = self.store.get_nowait(key)
                except (NotFound, UnsafeReuse, Busy) as exc:
                    lease = exc
                if lease is None:           # an SSD-only block: all of it off the loop
                    break
                got.append(lease)
        except BaseException:
            release_leases(got)
            raise
        if len(got) < len(keys):
            release_leases(got)
            self._spawn(self._get_many_async(frame.request_id, keys, frame.flags))
            return
        self._reply_get_many(frame.request_id, got, frame.flags, keys, raws)

    async def _get_many_async(self, rid: int, keys: list, flags: int) -> None:
        got = []
        try:
            for key in keys:
                try:
                    got.append(await self.store.get_async(key))
                except (NotFound, UnsafeReuse, Busy) as exc:
                    got.append(exc)
        except Exception as exc:
            release_leases(got)
            if self.is_in_flight(rid):
                self._err(rid, Opcode.GET_MANY, exc)
            return
        self._reply_get_many(rid, got, flags, keys)

    def _reply_get_many_batch(self, rid: int, batch, located: list, flags: int, keys: list, raws: list) -> None:
        """The reply of a GET_MANY whose every key is a DRAM hit held by ``batch`` or a miss
        status in ``located``."""
        items = [(0, g.size) if type(g) is not int else (g, 0) for g in located]
        if batch is None:
            self._send_get_many(rid, items, [], [], flags, keys, raws)
        else:
            self._send_get_many(rid, items, self.store.held_views(batch), [batch], flags, keys, raws)

    def _reply_get_many(self, rid: int, got: list, flags: int, keys: list, raws: Optional[list] = None) -> None:
        """``got``: per key, its lease or the miss (NotFound, UnsafeReuse, Busy) to report;
        ``raws``: the keys as the request encoded them, where the caller has them."""
        leases = [g for g in got if not isinstance(g, Exception)]
        items = [(g.status, 0) if isinstance(g, Exception) else (0, g.size) for g in got]
        self._send_get_many(rid, items, [lease.view for lease in leases], leases, flags, keys, raws)

    def _send_get_many(self, rid: int, items: list, views: list, held: list, flags: int, keys: list,
                       raws: Optional[list]) -> None:
        """GET_MANY's reply: ``items`` per key (status, size), ``views`` the hits' bytes in key
        order, ``held`` what keeps them in place until written.  In a pool the local NotFound
        ones are fetched from other nodes first (the cluster hook owns ``held`` and replies)."""
        cluster = self.node.cluster
        if cluster is not None and not self.peer_node and any(st == NotFound.status for st, _ in items):
            per_key, hits = [None] * len(items), iter(views)
            for i, (status, _) in enumerate(items):
                if status == 0:
                    per_key[i] = next(hits)
            self._spawn(cluster.serve_get_many(self, rid, keys, per_key, items, held, flags,
                                               lambda it: messages.encode_get_many_reply(it, self.limits), raws))
            return
        try:
            if not self.is_in_flight(rid):
                return
            fit, kept = messages.get_many_reply_fit(items, self.limits.max_payload_bytes)
            if fit < len(items):                # the client asks for the rest again
                items, views = items[:fit], views[:kept]
            body = messages.encode_get_many_reply(items, self.limits)
            self._ok(rid, Opcode.GET_MANY, body, views, crc=bool(flags & FLAG_PAYLOAD_CRC))
        finally:
            self._hold(held)

    def _exists(self, frame) -> None:
        keys = [self._key(k) for k in messages.decode_keys_request(frame.header, self.limits, "EXISTS")]
        present = [self.store.exists(k) for k in keys]
        self._ok(frame.request_id, Opcode.EXISTS, messages.encode_exists_reply(present, self.limits))
