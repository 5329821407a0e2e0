"""The other requests of a connection: PING, REMOVE, PIN, UNPIN, LIST, STATS (INFO),
the cluster's opcodes (handed to the cluster hook) and the hosted router's ROUTE.

``OpsMixin`` is mixed into ``connection.ServerProtocol``.
"""
from __future__ import annotations

import json

from quillcache.errors import InvalidArgument, NotFound, UnsafeReuse
from quillcache.model import MAX_PIN_TTL_S
from quillcache.node.keys import decode_scope_prefix
from quillcache.protocol import messages
from quillcache.protocol.info import render_info
from quillcache.protocol.opcodes import CLUSTER_OPCODES, FLAG_PAYLOAD_CRC, InfoFormat, Opcode, PinMode

__all__ = ["OpsMixin"]


class OpsMixin:
    """PING, REMOVE, PIN, UNPIN, LIST, STATS, cluster requests, ROUTE, ROUTE_UPDATE."""

    def _ping(self, frame) -> None:
        payload = frame.payload
        self._ok(frame.request_id, Opcode.PING, b"", [payload] if payload else [],
                 crc=bool(frame.flags & FLAG_PAYLOAD_CRC))

    def _remove(self, frame) -> None:
        keys = [self._key(k) for k in messages.decode_keys_request(frame.header, self.limits, "REMOVE")]
        self._spawn(self._finish_remove(frame.request_id, keys))

    async def _finish_remove(self, rid: int, keys: list) -> None:
        try:
            done = [await self.store.remove(k) for k in keys]
        except Exception as exc:
            self._err(rid, Opcode.REMOVE, exc)
            return
        self._ok(rid, Opcode.REMOVE, messages.encode_bitmap_reply(done, self.limits))

    def _pin(self, frame) -> None:
        req = messages.decode_pin_request(frame.header, self.limits)
        keys = [self._key(k) for k in req.keys]
        # ttl 0 ("until UNPIN") and anything longer become the store's longest pin
        ttl_s = min(req.ttl_ms / 1000.0, MAX_PIN_TTL_S) if req.ttl_ms else MAX_PIN_TTL_S
        done = []
        for key in keys:
            try:
                self.store.pin(key, ttl_s, hard=req.mode == PinMode.HARD)
                done.append(True)
            except (NotFound, UnsafeReuse):
                done.append(False)
        self._ok(frame.request_id, Opcode.PIN, messages.encode_bitmap_reply(done, self.limits))

    def _unpin(self, frame) -> None:
        _mode, raw = messages.decode_unpin_request(frame.header, self.limits)
        keys = [self._key(k) for k in raw]
        done = [self.store.unpin(k) for k in keys]
        self._ok(frame.request_id, Opcode.UNPIN, messages.encode_bitmap_reply(done, self.limits))

    def _list(self, frame) -> None:
        req = messages.decode_list_request(frame.header, self.limits)
        scope, _prefix_hash = decode_scope_prefix(req.prefix)     # validates it
        self._own(scope.tenant_id)
        # a walk of the store's residency index from the cursor: no sort of the scope
        page, more = self.store.list_page(req.prefix, req.start_after, req.limit)
        self._ok(frame.request_id, Opcode.LIST, messages.encode_list_reply(page, more, self.limits))

    def _cluster_request(self, frame) -> None:
        if frame.opcode not in CLUSTER_OPCODES:
            raise InvalidArgument(f"opcode {frame.opcode:#04x} has no handler")
        if self.node.cluster is None:
            raise InvalidArgument(f"{Opcode(frame.opcode).name}: this node is not in a cluster "
                                  "([cluster] enabled = false)")
        self.node.cluster.on_request(self, frame)

    def _stats(self, frame) -> None:
        req = messages.decode_stats_request(frame.header)
        sections = self.node.info_sections(self)
        if req.section:
            wanted = req.section.lower()
            sections = {k: v for k, v in sections.items() if k.lower() == wanted}
            if not sections:
                raise InvalidArgument(f"INFO: no section {req.section!r}")
        if req.format == InfoFormat.JSON:
            text = json.dumps({k.lower(): v for k, v in sections.items()}, sort_keys=True)
        else:
            text = render_info(sections)
        raw = text.encode("utf-8")
        self._ok(frame.request_id, Opcode.STATS, messages.encode_stats_reply(req.format), [raw])

    # ------------------------------------------------------------------ ROUTE (the hosted router)

    def _hosted_router(self):
        if self.node.router is None:
            raise InvalidArgument('ROUTE: this node hosts no router ([router] module = "none")')
        return self.node.router

    def _route(self, frame) -> None:
        router = self._hosted_router()
        req = messages.decode_route_request(frame.header, self.limits)
        self._own(req.tenant)
        # The caller is the connection's tenant: its request ids are its own (control/host.py).
        reply = router.route(req, caller=self.tenant or "")
        self._ok(frame.request_id, Opcode.ROUTE, messages.encode_route_reply(reply))

    def _route_update(self, frame) -> None:
        router = self._hosted_router()
        event, rid = messages.decode_route_update(frame.header)
        updated = router.update(event, rid, caller=self.tenant or "")
        self._ok(frame.request_id, Opcode.ROUTE_UPDATE, bytes((updated,)))
