"""Nothing before login can exhaust the node (issue 22, item 3), probed against a real
quillcached with tenants: only HELLO is taken before login and no claimed length is
allocated, a connection that does not log in is closed, bare connections cannot take the
slots of clients with a valid token, and bad input cannot flood the log."""
from __future__ import annotations

import socket
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.errors import PermissionDenied, ProtocolError
from quillcache.protocol.opcodes import Opcode
from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon
from tests._support.net import raw_connect, read_frames

TOKEN = "alice-secret"
AUTH = f'[[auth.tenants]]\nname = "alice"\ntoken = "{hash_token(TOKEN)}"'
MiB = 1 << 20


def _node(tmp_path, node: str = "", limits: str = "") -> Daemon:
    d = Daemon(tmp_path, sections={"node": node, "limits": limits})
    d.config.write_text(d.config.read_text() + "\n[auth]\n" + AUTH + "\n")   # tables go last
    return d


def _connect_from(port: int, source: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_ping_before_hello_is_refused_and_claimed_payloads_are_not_allocated(tmp_path):
    # the probe: 1,000 connections of 33 bytes, a PING claiming 1 MiB, kept open (main: 51 -> 734 MiB)
    with _node(tmp_path) as d:
        with Client(d.addr, token=TOKEN) as c:
            c.ping()
        before = d.rss_bytes()
        frame = encode_frame_header(Opcode.PING, 1, payload_length=MiB) + b"x"
        socks = []
        for i in range(1000):
            s = _connect_from(d.port, f"127.0.0.{2 + i % 50}")
            s.sendall(frame)
            socks.append(s)
        time.sleep(1.0)
        grew = d.rss_bytes() - before
        if grew >= 64 * MiB:
            for s in socks:
                s.close()
            pytest.fail(f"RSS grew by {grew / MiB:.0f} MiB")
        answers = [read_frames(s, 1, timeout=5) for s in socks[-20:]]
        for s in socks:
            s.close()
        for frames in answers:                  # refused at the connection level, then closed
            assert len(frames) == 1 and frames[0].request_id == 0 and frames[0].status != 0
        with Client(d.addr, token=TOKEN) as c:
            c.ping()


def test_a_connection_that_does_not_log_in_is_closed_at_the_hello_deadline(tmp_path):
    with _node(tmp_path) as d:                          # [node] hello_timeout = "5s", the default
        c = Client(d.addr, token=TOKEN)                 # a client that logged in stays past it
        s = raw_connect(d.port)
        half = raw_connect(d.port)
        half.sendall(encode_frame_header(Opcode.HELLO, 1, header=b"x" * 100)[:40])   # a HELLO cut short
        t0 = time.monotonic()
        frames = read_frames(s, 2, timeout=15)          # an error at the deadline, then EOF
        waited = time.monotonic() - t0
        rest = read_frames(half, 2, timeout=5)
        s.close()
        half.close()
        assert len(frames) == 1 and frames[0].request_id == 0 and frames[0].status != 0
        assert len(rest) == 1 and rest[0].request_id == 0
        assert 4.0 < waited < 8.0
        with c:
            time.sleep(max(0.0, t0 + 5.5 - time.monotonic()))     # past the deadline of its connection too
            c.ping()


def test_bare_connections_cannot_take_the_slots_of_clients_with_a_valid_token(tmp_path):
    # the probe, scaled to max_connections = 64: on main 3,200 bare connections of 4,096 slots
    # made the node answer "Busy: connections open" to everyone
    with _node(tmp_path, limits="max_connections = 64") as d:
        early = [Client(d.addr, token=TOKEN) for _ in range(16)]          # logged in before
        bare = [raw_connect(d.port) for _ in range(100)]                   # one source
        bare += [_connect_from(d.port, f"127.0.0.{2 + i % 20}") for i in range(200)]   # many sources
        late = []
        try:
            for _ in range(40):                                             # logged in after
                late.append(Client(d.addr, token=TOKEN))
            for c in early + late:
                c.ping()
            info = late[-1].info()["Auth"]
            assert info["unauthenticated"] <= info["max_unauthenticated"] == 32
        finally:
            for c in early + late:
                c.close()
            for s in bare:
                s.close()


def test_logs_of_malformed_input_are_rate_limited_with_a_count_of_what_was_dropped(tmp_path):
    with _node(tmp_path) as d:
        size0 = len(d.log())
        for i in range(3000):                      # the probe: each connection sends a bad frame
            s = _connect_from(d.port, f"127.0.0.{2 + i % 50}")
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            s.close()
        time.sleep(2.5)                            # the sweep logs what was suppressed
        text = d.log()[size0:]
        lines = text.count("\n")
        assert lines < 200, f"{lines} log lines for 3000 bad connections"
        assert "suppressed" in text
        with Client(d.addr, token=TOKEN) as c:
            c.ping()


@pytest.mark.parametrize("frame", [
    encode_frame_header(Opcode.HELLO, 1, header=bytes(16 * 1024)),          # a header past 8 KiB
    encode_frame_header(Opcode.GET, 1, header=b"k"),                        # not HELLO
])
def test_before_login_a_big_header_or_another_opcode_closes_the_connection(tmp_path, frame):
    with _node(tmp_path) as d:
        s = raw_connect(d.port)
        s.sendall(frame[:64])
        frames = read_frames(s, 2, timeout=10)
        s.close()
        assert len(frames) == 1 and frames[0].request_id == 0
        assert frames[0].status in (PermissionDenied.status, ProtocolError.status)   # the latter: a limit
        with Client(d.addr, token=TOKEN) as c:
            assert c.tenant == "alice"
