"""Raw loopback sockets for the benches' floors: a server that answers every 8-byte request
with a fixed reply, and the helpers around it (bench/cluster.py's two-hop floor,
bench/loopback_congestion.py).  No QuillCache code on the path."""
from __future__ import annotations

import os
import socket
import threading

from quillcache.net import set_congestion

__all__ = ["REQUEST", "recv_exact", "listen", "accept", "raw_server"]

REQUEST = b"x" * 8              # what a client sends for one reply


def recv_exact(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n


def listen() -> socket.socket:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    return ls


def accept(ls: socket.socket) -> socket.socket:
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def raw_server(ls: socket.socket, size: int, congestion: str = "") -> None:
    """Answer every 8-byte request with ``size`` bytes; a thread per connection, each sending
    with the TCP congestion control ``congestion`` ("": the system's; a name the kernel refuses
    is left at the system's, so a caller checks it first with ``set_congestion``)."""
    data = os.urandom(size)

    def serve(c: socket.socket) -> None:
        req = memoryview(bytearray(len(REQUEST)))
        try:
            while True:
                recv_exact(c, req)
                c.sendall(data)
        except (EOFError, OSError):
            c.close()

    while True:
        c = accept(ls)
        if congestion:
            set_congestion(c, congestion)
        threading.Thread(target=serve, args=(c,), daemon=True).start()
