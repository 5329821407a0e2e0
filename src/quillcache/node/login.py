"""HELLO: who a connection is (a tenant, another node of the pool, or anyone in open mode).

``LoginMixin`` is mixed into ``connection.ServerProtocol``.
"""
from __future__ import annotations

import logging

from quillcache.errors import PermissionDenied
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode

__all__ = ["LoginMixin"]

log = logging.getLogger("quillcache.server")


class LoginMixin:
    """HELLO."""

    def _hello(self, frame) -> None:
        rid = frame.request_id
        auth = self.node.auth
        if auth.blocked(self.peer):
            auth.refused_peers += 1
            if self._metrics is not None:
                self._metrics.connections_refused.labels("failed_hellos").inc()
            self._err(rid, Opcode.HELLO, PermissionDenied("too many failed HELLOs from this address; "
                                                          "try again later"))
            self.close()
            return
        req = messages.decode_hello_request(frame.header, self.limits)
        version = messages.negotiate_version(req)
        cluster = self.node.cluster
        if cluster is not None and req.token and cluster.is_credential(req.token):
            self.peer_node = True           # another node of the pool: tenants travel per request
            self.tenant = None
            self._ok(rid, Opcode.HELLO, messages.encode_hello_reply(version, "", self.limits, self.node.node_id))
            return
        try:
            tenant = auth.authenticate(req.token)
        except PermissionDenied as exc:
            over = auth.record_failure(self.peer)
            if self._metrics is not None:
                self._metrics.failed_hellos.inc()
            log.warning("HELLO from %s refused: bad token%s", self.peer,
                        " (rate limit reached: closing)" if over else "")
            self._err(rid, Opcode.HELLO, exc)
            if over:
                self.close()
            return
        self.tenant = tenant or None
        body = messages.encode_hello_reply(version, tenant, self.limits, self.node.node_id)
        self._ok(rid, Opcode.HELLO, body)
