"""HELLO: who a connection is (a tenant, another node of the pool, or anyone in open mode).

A valid token is answered at once, whatever its source did before.  A bad one is answered
after the delay ``Authenticator.record_failure`` gives its source (it grows with the
source's failures in a row, capped), on a timer: the loop serves everyone else meanwhile
and nothing more is read from that connection.  The limits before login (only HELLO, a
small header, no payload, one at a time) are the protocol connection's
(``protocol.connection.PREAUTH_*``); the deadline ([node] hello_timeout) and the slots
(``node.admission``) are the connection's.

``LoginMixin`` is mixed into ``connection.ServerProtocol``.
"""
from __future__ import annotations

import asyncio
import logging

from quillcache.errors import PermissionDenied
from quillcache.protocol import messages
from quillcache.protocol.connection import PREAUTH_HEADER_BYTES, PREAUTH_READ_CHUNK
from quillcache.protocol.opcodes import Opcode

__all__ = ["LoginMixin"]



class LoginMixin:
    """HELLO."""

    def _hello(self, frame) -> None:
        rid = frame.request_id
        auth = self.node.auth
        req = messages.decode_hello_request(frame.header, self.limits)
        version = messages.negotiate_version(req)
        cluster = self.node.cluster
        if cluster is not None and cluster.is_node_hello(req.token):
            # a node about to log in (NODE_AUTH, NODE_PROOF): nothing granted yet, and it stays
            # in the unauthenticated pool until the hook's login succeeds (logged_in_as_node)
            self.tenant = None
            self._ok(rid, Opcode.HELLO, messages.encode_hello_reply(version, "", self.limits, self.node.node_id))
            if self.require_hello:          # the HELLO reply raised the limits: not logged in yet
                self._parser.set_limits(max_header_bytes=min(self.limits.max_header_bytes, PREAUTH_HEADER_BYTES),
                                        max_payload_bytes=0, read_chunk=PREAUTH_READ_CHUNK)
            return
        try:
            tenant = auth.authenticate(req.token)
        except PermissionDenied as exc:
            self._refuse_hello(rid, exc)
            return
        self.tenant = tenant or None
        self._logged_in()
        body = messages.encode_hello_reply(version, tenant, self.limits, self.node.node_id)
        self._ok(rid, Opcode.HELLO, body)

    def _refuse_hello(self, rid: int, exc: PermissionDenied) -> None:
        """A bad token: answered after the source's delay (a timer: the loop goes on), reading
        nothing more from this connection meanwhile; past the limit the connection closes."""
        delay, close = self.node.auth.record_failure(self.source)
        if self._metrics is not None:
            self._metrics.failed_hellos.inc()
        self.node.bad_input_log.log(logging.WARNING, "HELLO from %s refused: bad token (answered after %.2f s%s)",
                                    self.peer, delay, ", then closing" if close else "")
        t = self.transport
        if t is None or t.is_closing():
            return
        t.pause_reading()
        self._hello_refusal = asyncio.get_running_loop().call_later(delay, self._answer_refused_hello, rid, exc, close)

    def _answer_refused_hello(self, rid: int, exc: PermissionDenied, close: bool) -> None:
        self._hello_refusal = None
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return
        if self.is_in_flight(rid):
            self._err(rid, Opcode.HELLO, exc)
        if close or self._close_after_refusal:
            self.close()
        elif not self._reading_paused and not self.put_deferred:
            t.resume_reading()
