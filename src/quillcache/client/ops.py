"""The request builders shared by ``Client`` and ``AsyncClient``: each call builds ``Req``s from
``calls`` and hands them to the client's ``_exec``/``_exec_many`` (blocking or awaited)."""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence

from quillcache._native.codec import (
    encode_key_body,
)
from quillcache.errors import (
    InvalidArgument, NotFound, ProtocolError, UnsafeReuse,
)
from quillcache.model import (
    IdentityScope, KvBlockKey, encode_scope, encode_scope_prefix,
)
from quillcache.protocol import located, messages
from quillcache.protocol.connection import AS_BYTES, ClientProtocolConnection, Reply
from quillcache.protocol.info import parse_info
from quillcache.protocol.opcodes import FLAG_DURABLE, InfoFormat, Opcode, PinMode, ProtocolLimits


from quillcache.client import shm
from quillcache.client.calls import (
    LIST_PAGE, SHM_PUT_MIN_BYTES, Batch, Req, payload_view, dest_view, pack_buffers,
    SIZED_KEY_OVERHEAD, status_error, chunks, keys_per_request, sized_spans,
)

__all__ = ["Ops"]

_GET = int(Opcode.GET)
_KEY_TYPES = frozenset({KvBlockKey})     # encoded_keys' fast path: these carry their encoding
_STALE = " (the arena mapping is no longer the node's: reconnect() maps its new arena)"


class Ops:
    """Request builders shared by Client and AsyncClient; ``_exec``/``_exec_many`` run them."""

    _conn: Optional[ClientProtocolConnection]

    @property
    def arena(self) -> "Optional[shm.Arena]":
        """The node's DRAM arena as this client maps it (the Unix socket with shm), else None.
        The located flows and ``ArenaCopier`` read it; it changes on ``reconnect()``."""
        return self._arena

    @property
    def is_open(self) -> bool:
        """Connected, and the connection has neither failed nor closed."""
        conn = self._conn
        return conn is not None and conn.failed is None and not conn.closed

    @property
    def limits(self) -> ProtocolLimits:
        """The server's limits (from HELLO)."""
        return self._conn.peer_limits if self._conn is not None else ProtocolLimits()

    def encoded_key(self, key) -> bytes:
        """``encode_key(key)``: a ``KvBlockKey`` carries its encoding, made with it (no cache:
        a dict lookup would cost more than reading it)."""
        if not isinstance(key, KvBlockKey):
            raise InvalidArgument(f"key {key!r}: must be a KvBlockKey")
        return key.encoded()

    def encoded_keys(self, keys) -> list[bytes]:
        """``encoded_key`` of each of ``keys``, in order; the first that is not a key is named."""
        if type(keys) is not list:
            keys = list(keys)
        if set(map(type, keys)) <= _KEY_TYPES:
            return [k.encoded() for k in keys]
        return [self.encoded_key(k) for k in keys]

    def get_header(self, key) -> bytes:
        """The GET request body of ``key`` within the server's limits (the codec's format)."""
        return encode_key_body(self.encoded_key(key), self.limits.max_key_bytes)

    # each returns the result (Client) or an awaitable of it (AsyncClient)

    _arena: Optional["shm.Arena"] = None

    @property
    def shm(self) -> bool:
        """Whether the node's arena is mapped (Unix socket, trusted): puts and gets then copy
        through the mapping and the located calls are zero-copy."""
        return self._arena is not None

    def put(self, key: KvBlockKey, data, durable: bool = False):
        mv = payload_view(data)
        if self._arena is not None and mv.nbytes >= SHM_PUT_MIN_BYTES:
            return self._drive(shm.put_many_flow(self, [(key, mv)], durable))
        hdr = messages.encode_put_request(self.encoded_key(key), mv.nbytes, self.limits)
        return self._exec(Req(Opcode.PUT, hdr, [mv] if mv.nbytes else [],
                               FLAG_DURABLE if durable else 0, None, lambda r: None))

    def get(self, key: KvBlockKey):
        """The block's bytes: received straight into a new ``bytes`` of the reply's size (one
        allocation, no copy), or one copy out of the mapped arena.  NotFound on a miss."""
        if self._arena is not None:
            return self._drive(shm.get_flow(self, key, None))
        return self._exec(Req(Opcode.GET, self.get_header(key), (), 0, AS_BYTES,
                               lambda r: b"" if r.payload is None else r.payload))

    def get_into(self, key: KvBlockKey, buffer):
        dst = dest_view(buffer)
        if self._arena is not None:
            return self._drive(shm.get_flow(self, key, dst))
        hdr = self.get_header(key)

        def into(frame):
            if frame.payload_length > dst.nbytes:
                raise InvalidArgument(f"get_into: buffer of {dst.nbytes} bytes, block is "
                                      f"{frame.payload_length} bytes")
            return dst

        def finish(r: Reply) -> int:
            return 0 if r.payload is None else memoryview(r.payload).nbytes

        return self._exec(Req(Opcode.GET, hdr, (), 0, into, finish))

    def exists(self, key: KvBlockKey):
        hdr = messages.encode_keys_request([self.encoded_key(key)], self.limits, "EXISTS")
        return self._exec(Req(Opcode.EXISTS, hdr, (), 0, None,
                               lambda r: messages.decode_exists_reply(r.header, self.limits).present[0]))

    def exists_many(self, keys: Iterable[KvBlockKey]):
        keys = [self.encoded_key(k) for k in keys]
        reqs = [Req(Opcode.EXISTS, messages.encode_keys_request(c, self.limits, "EXISTS"), (), 0, None,
                     lambda r: messages.decode_exists_reply(r.header, self.limits))
                for c in chunks(keys, keys_per_request(keys, self.limits))]

        def combine(results) -> tuple[int, list[bool]]:
            present: list[bool] = []
            for res in results:
                present += res.present
            prefix = next((i for i, p in enumerate(present) if not p), len(present))
            return prefix, present

        return self._exec_many(reqs, combine)

    def remove(self, key: KvBlockKey):
        hdr = messages.encode_keys_request([self.encoded_key(key)], self.limits, "REMOVE")
        return self._exec(Req(Opcode.REMOVE, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def remove_many(self, keys: Iterable[KvBlockKey]):
        """Remove every key (REMOVE requests of up to max_batch keys and max_header bytes, pipelined); returns, per
        key, whether it was there."""
        keys = [self.encoded_key(k) for k in keys]
        lim = self.limits

        def request(chunk: list) -> Req:
            def finish(r: Reply) -> list[bool]:
                done = messages.decode_bitmap_reply(r.header, lim)
                if len(done) != len(chunk):
                    raise ProtocolError(f"REMOVE reply has {len(done)} items for {len(chunk)} keys")
                return done
            return Req(Opcode.REMOVE, messages.encode_keys_request(chunk, lim, "REMOVE"), (), 0, None, finish)

        reqs = [request(c) for c in chunks(keys, keys_per_request(keys, lim))]
        return self._exec_many(reqs, lambda results: [x for res in results for x in res])

    def pin(self, key: KvBlockKey, ttl: float, hard: bool = False):
        if not isinstance(ttl, (int, float)) or ttl < 0:
            raise InvalidArgument(f"pin ttl {ttl!r}: seconds >= 0 (0 = until unpin)")
        ttl_ms = 0 if ttl == 0 else max(1, int(round(ttl * 1000)))
        mode = PinMode.HARD if hard else PinMode.SOFT
        hdr = messages.encode_pin_request([self.encoded_key(key)], mode, ttl_ms, self.limits)
        return self._exec(Req(Opcode.PIN, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def unpin(self, key: KvBlockKey, hard: bool = False):
        """Drop the key's pin; ``hard`` names the pin mode to drop (sent as the UNPIN mode)."""
        hdr = messages.encode_unpin_request([self.encoded_key(key)], PinMode.HARD if hard else PinMode.SOFT,
                                            self.limits)
        return self._exec(Req(Opcode.UNPIN, hdr, (), 0, None,
                               lambda r: messages.decode_bitmap_reply(r.header, self.limits)[0]))

    def put_many(self, items: Iterable[tuple[KvBlockKey, Any]], durable: bool = False):
        """Store every (key, data); raises the first item's error (after all were tried)."""
        views = [(k, payload_view(d)) for k, d in items]
        if self._arena is not None:
            return self._drive(shm.put_many_flow(self, views, durable))
        return self._exec_many(*self.put_many_requests(views, durable))

    def put_many_requests(self, items: list, durable: bool) -> Batch:
        """The PUT_MANY requests of (key, view) over the socket, split at max_batch, max_header
        and max_payload (what ``put_many`` sends; the shm flows send them over TCP too)."""
        prepared = [(self.encoded_key(k), mv) for k, mv in items]
        lim = self.limits
        per = keys_per_request([k for k, _ in prepared], lim, SIZED_KEY_OVERHEAD)
        spans = sized_spans([mv.nbytes for _, mv in prepared], per, lim.max_payload_bytes) or [(0, 0)]
        reqs = []
        for start, end in spans:
            batch = prepared[start:end]
            hdr = messages.encode_put_many_request([(k, mv.nbytes) for k, mv in batch], lim)
            reqs.append(Req(Opcode.PUT_MANY, hdr, [mv for _, mv in batch if mv.nbytes],
                             FLAG_DURABLE if durable else 0, None,
                             lambda r: messages.decode_status_list(r.header, lim)))
        starts = [start for start, _ in spans]

        def combine(results) -> None:
            for start, statuses in zip(starts, results):
                for j, st in enumerate(statuses):
                    if st:
                        raise status_error(st, f"put_many item {start + j}")

        return Batch(reqs, combine)

    def get_many(self, keys: Iterable[KvBlockKey]):
        """``list[memoryview | None]`` in key order; None where the key is not served (not
        found, or refused by the identity guard).  Each value is a writable memoryview of
        exactly its bytes, over one buffer per GET_MANY request that the reply was received
        into (no copy); it compares equal to the same ``bytes``; ``bytes(v)`` makes an
        independent copy.  The shared buffer lives as long as any of its views."""
        return self._drive(self.get_many_flow(keys, None))

    def get_many_into(self, keys: Iterable[KvBlockKey], buffers: Sequence[Any]):
        """Receive each key's value straight into the buffer at the same position (writable,
        C-contiguous; numpy arrays welcome).  Returns ``list[int | None]``: the bytes written
        into each buffer, None where the key is not served.  Every buffer is checked before
        anything is sent; a value larger than its buffer raises InvalidArgument (the values of
        that GET_MANY request are then dropped, other requests' buffers may be filled)."""
        keys = list(keys)
        dsts = [dest_view(b) for b in buffers]
        if len(dsts) != len(keys):
            raise InvalidArgument(f"get_many_into: {len(keys)} keys and {len(dsts)} buffers")
        if self._arena is not None:
            return self._drive(shm.get_many_into_flow(self, keys, dsts))
        return self._drive(self.get_many_flow(keys, dsts))

    def get_many_flow(self, keys, dsts: Optional[list]):
        """GET_MANY over the socket, as a flow (what ``get_many``/``get_many_into`` send; the
        shm flows send it over TCP too): values into ``dsts`` (sizes out), or into packed
        buffers (views out, ``dsts`` None).  The keys go in requests of ``keys_per_request``,
        pipelined; a reply may cover only the leading keys of its request (the server keeps a
        reply within its max_payload), and the keys left are asked for again."""
        ekeys = [self.encoded_key(k) for k in keys]
        per = keys_per_request(ekeys, self.limits)
        out: Optional[list] = None
        todo: Sequence[int] = range(len(ekeys))
        while True:
            spans = [todo[i:i + per] for i in range(0, len(todo), per)] or [todo]
            if out is None:
                reqs = [self.get_many_request(ekeys[sp.start:sp.stop], None if dsts is None else dsts[sp.start:sp.stop],
                                              sp) for sp in spans]
            else:
                reqs = [self.get_many_request([ekeys[p] for p in sp], None if dsts is None else [dsts[p] for p in sp],
                                              sp) for sp in spans]
            results = yield Batch(reqs, list)
            if out is None:
                if all(len(res) == len(sp) for sp, res in zip(spans, results)):
                    return [x for res in results for x in res]     # every reply whole: the usual case
                out = [None] * len(ekeys)
            rest: list = []
            for sp, res in zip(spans, results):
                for p, r in zip(sp, res):
                    out[p] = r
                rest += sp[len(res):]
            if not rest:
                return out
            todo = rest

    def get_many_request(self, chunk: list, dsts: Optional[list], where: Sequence[int] = ()) -> Req:
        """One GET_MANY of encoded keys; its result is the leading keys' values (all of them
        unless the reply was cut at the server's max_payload).  ``where``: the keys' positions
        in the caller's list, for its error messages."""
        lim = self.limits
        count = len(chunk)
        holder: dict = {}

        def check(items) -> None:
            if len(items) > count or (count and not items):
                raise ProtocolError(f"GET_MANY reply has {len(items)} items for {count} keys")

        def into(frame):
            items = messages.decode_get_many_reply(frame.header, frame.payload_length, lim)
            check(items)
            holder["items"] = items
            if dsts is None:
                bufs = holder["bufs"] = pack_buffers([nb for st, nb in items if st == 0 and nb])
                return [b for b, _ in bufs]
            views = []
            for j, (st, nb) in enumerate(items):
                if st == 0 and nb:
                    d = dsts[j]
                    if nb > d.nbytes:
                        raise InvalidArgument(f"get_many_into: buffer {where[j] if where else j} has {d.nbytes} "
                                              f"bytes, its block is {nb} bytes")
                    views.append(d[:nb])
            return views

        def finish(r: Reply):
            items = holder.get("items")
            if items is None:                   # no payload phase: every value empty or missing
                items = messages.decode_get_many_reply(r.header, None, lim)
                check(items)
            views = iter([v for _, vs in holder.get("bufs", ()) for v in vs])
            out: list = []
            for st, nb in items:
                if st == 0:
                    if dsts is not None:
                        out.append(nb)
                    else:
                        out.append(next(views) if nb else memoryview(b""))
                elif st in (NotFound.status, UnsafeReuse.status):
                    out.append(None)
                else:
                    raise status_error(st, "get_many item")
            return out

        return Req(Opcode.GET_MANY, messages.encode_keys_request(chunk, lim, "GET_MANY"), (), 0, into, finish)

    def _list_req(self, prefix: bytes, start_after: bytes) -> Req:
        lim = self.limits
        hdr = messages.encode_list_request(prefix, min(LIST_PAGE, lim.max_batch), start_after, lim)
        return Req(Opcode.LIST, hdr, (), 0, None, lambda r: messages.decode_list_reply(r.header, lim))

    def _stats_req(self, fmt: InfoFormat, section: str, raw: bool = False) -> Req:
        def finish(r: Reply):
            text = bytes(r.payload).decode("utf-8") if r.payload is not None else ""
            if raw:
                return text
            return json.loads(text) if fmt == InfoFormat.JSON else parse_info(text)
        return Req(Opcode.STATS, messages.encode_stats_request(fmt, section), (), 0, None, finish)

    def info(self, section: str = ""):
        """INFO sections as ``{"Server": {...}, "Store": {...}, ...}``."""
        return self._exec(self._stats_req(InfoFormat.TEXT, section))

    def info_text(self, section: str = ""):
        """INFO exactly as the server rendered it (redis-style ``# Section`` / ``key:value`` text)."""
        return self._exec(self._stats_req(InfoFormat.TEXT, section, raw=True))

    def stats(self, section: str = ""):
        return self._exec(self._stats_req(InfoFormat.JSON, section))

    def _map_req(self) -> Req:
        return Req(Opcode.MAP, b"", (), 0, None, lambda r: located.decode_map_reply(r.header))

    def route(self, scope: IdentityScope, token_ids=None, *, hashes=None, policy: "str | None" = None,
              request_id: "str | None" = None, request_tokens: int = 0, track: bool = True):
        """Ask the node's hosted router where to send a request (its token ids, or the
        router's block hashes): a ``messages.RouteReply`` with the worker and the per-block
        plan (0 device, 1 host, 2 disk, 3 pool, 4 recompute).  With ``track`` report the
        request's first token and end with ``route_update``."""
        if (token_ids is None) == (hashes is None):
            raise InvalidArgument("route: give token_ids or hashes")
        kind, items = (messages.ROUTE_TOKENS, token_ids) if hashes is None else (messages.ROUTE_HASHES, hashes)
        hdr = messages.encode_route_request(
            kind, scope.tenant_id, scope.model_id, scope.tokenizer_id, scope.adapter_id, items,
            policy=policy, track=track, request_id=request_id, request_tokens=request_tokens,
            limits=self.limits)
        return self._exec(Req(Opcode.ROUTE, hdr, (), 0, None,
                               lambda r: messages.decode_route_reply(r.header)))

    def route_update(self, request_id: str, *, first_token: bool = False):
        """The routed request produced its first token (``first_token=True``) or ended, was
        aborted or lost its client; returns whether the router knew the request."""
        event = messages.ROUTE_FIRST_TOKEN if first_token else messages.ROUTE_FREE
        return self._exec(Req(Opcode.ROUTE_UPDATE, messages.encode_route_update(event, request_id),
                               (), 0, None, lambda r: bool(r.header[:1] == b"\x01")))

    def _hello_req(self, token: bytes, name: str) -> Req:
        return Req(Opcode.HELLO, messages.encode_hello_request(token, client_name=name), (), 0, None,
                    lambda r: messages.decode_hello_reply(r.header))

    @staticmethod
    def _ping_req() -> Req:
        return Req(Opcode.PING, b"", (), 0, None, lambda r: None)

    @staticmethod
    def _scope_prefix(scope, prefix_hash: "str | None") -> bytes:
        if isinstance(scope, KvBlockKey):
            scope = scope.scope
        if not isinstance(scope, IdentityScope):
            raise InvalidArgument("ls: scope must be an IdentityScope or a KvBlockKey")
        if prefix_hash is None:                 # every block of the scope
            return encode_scope(scope)
        return encode_scope_prefix(scope, prefix_hash)
