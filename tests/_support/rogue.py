"""A rogue listener speaking the node protocol, for the security probes (tests/security).

``Rogue(keys=None)`` is an address an attacker registered: it answers HELLO, and NODE_AUTH
with a nonce and a MAC it cannot compute (it has no credential), and records every byte
it receives (``received``) and every opcode (``opcodes``).  ``Rogue(keys, node_id, epoch)``
is a member gone bad (it holds the credential): it logs nodes in properly, then answers
FETCH with the bytes in ``serve`` (encoded key -> bytes) instead of what it announced.

Threads and blocking sockets (no event loop), on a free loopback port; ``close()`` stops it.
"""
from __future__ import annotations

import os
import socket
import threading

from quillcache.protocol import cluster as wire
from quillcache.protocol import messages
from quillcache.protocol.connection import ProtocolConnection
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode

__all__ = ["Rogue"]

_NODE_AUTH = getattr(Opcode, "NODE_AUTH", None)     # absent from a build without node login


class _Conn(ProtocolConnection):
    def __init__(self, rogue: "Rogue", sock: socket.socket) -> None:
        super().__init__(require_hello=False)
        self.rogue, self.sock = rogue, sock
        self._login = None

    def _write(self, data: list) -> None:
        try:
            self.sock.sendall(b"".join(bytes(d) for d in data))
        except OSError:
            pass

    def _on_error(self, exc: BaseException) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _hold_input(self, data: bytes) -> None:
        pass

    def _on_request(self, frame) -> None:
        rogue, op, rid = self.rogue, frame.opcode, frame.request_id
        rogue.opcodes.append(op)
        if op == Opcode.HELLO:
            self.reply_ok(rid, op, messages.encode_hello_reply(1, "", self.limits, rogue.node_id))
        elif op == _NODE_AUTH:
            initiator, epoch, _responder, nonce_i = wire.decode_node_auth(frame.header)
            nonce_r = os.urandom(wire.NONCE_BYTES)
            if rogue.keys is None:          # no credential: the best it can do is guess
                mac = os.urandom(wire.MAC_BYTES)
            else:
                mac = rogue.keys.responder_mac(initiator, epoch, rogue.node_id, rogue.epoch, nonce_i, nonce_r)
            self.reply_ok(rid, op, wire.encode_node_auth_reply(rogue.node_id, rogue.epoch, nonce_r, mac))
        elif op == Opcode.FETCH:
            _tenant, keys = wire.decode_fetch(frame.header, self.limits)
            blocks = [rogue.serve.get(bytes(k)) for k in keys]
            items = [(0, len(b)) if b is not None else (3, 0) for b in blocks]
            body = wire.encode_fetch_reply(rogue.epoch, items, self.limits)
            rogue.fetches += 1
            # the frame's CRC trailer, if asked for, is the rogue's own: it matches its bytes
            self.reply_ok(rid, op, body, [b for b in blocks if b is not None],
                          payload_crc=bool(frame.flags & FLAG_PAYLOAD_CRC))
        else:
            self.reply_ok(rid, op, b"")


class Rogue:
    def __init__(self, keys=None, node_id: str = "evil", epoch: int = 0x5EC) -> None:
        self.keys, self.node_id, self.epoch = keys, node_id, epoch
        self.serve: dict[bytes, bytes] = {}
        self.received = bytearray()
        self.opcodes: list[int] = []
        self.connections = 0
        self.fetches = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(self, sock)
        while not self._stop.is_set():
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.received += data
                try:
                    conn.data_received(data)
                except Exception as exc:        # a bug of the rogue: say so in the test's failure
                    self.errors.append(repr(exc))
                    return

    def close(self) -> None:
        self._stop.set()
        for s in [self._sock, *self._open]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __enter__(self) -> "Rogue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
