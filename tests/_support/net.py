"""Loopback ports and raw client sockets for tests that speak the wire protocol by hand."""
from __future__ import annotations

import socket

from quillcache._native.codec import FrameParser
from quillcache.protocol.opcodes import REQUEST_OPCODES
from tests._support.ports import free_port

__all__ = ["free_port", "raw_connect", "read_frames"]


def raw_connect(port: int, host: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_frames(sock: socket.socket, n: int = 1, timeout: float = 10.0):
    """Read ``n`` reply frames (collected payloads); returns them, or fewer at EOF."""
    parser = FrameParser(REQUEST_OPCODES, max_header_bytes=1 << 24, max_payload_bytes=1 << 30, replies=True)
    frames = []
    sock.settimeout(timeout)
    while len(frames) < n:
        ev = parser.next_event()
        if ev == 0:
            data = sock.recv(1 << 16)
            if not data:
                return frames
            parser.feed(data)
            continue
        if ev in (1, 4):        # EV_FRAME / EV_PAYLOAD_END
            frames.append(parser.frame)
    return frames
