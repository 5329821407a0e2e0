"""Login cannot be turned against users (issue 22, item 2), probed against a real quillcached:
failed HELLOs slow their own source down and never lock an address out, Unix-socket peers
are told apart by SO_PEERCRED, and log lines name a real peer."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.errors import PermissionDenied
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon
from tests._support.net import raw_connect, read_frames

TOKEN = "alice-secret"
AUTH = f'[[auth.tenants]]\nname = "alice"\ntoken = "{hash_token(TOKEN)}"\nshm = true'
ANSWER_WITHIN_S = 15.0            # the longest a failed HELLO may wait for its answer, with margin
BAD_HELLO = encode_frame_header(Opcode.HELLO, 1, header=messages.encode_hello_request(b"guess"))


@pytest.fixture()
def node(tmp_path):
    # [[auth.tenants]] is an array of tables: it goes last, after every plain key
    d = Daemon(tmp_path)
    d.config.write_text(d.config.read_text() + "\n[auth]\n" + AUTH + "\n")
    with d:
        yield d


def _bad_hellos_at_once(connect, n: int) -> list[float]:
    """``n`` connections send a bad HELLO together; returns how long each answer took."""
    socks = [connect() for _ in range(n)]
    took = [0.0] * n
    answers: list = []

    def one(i: int) -> None:
        t0 = time.monotonic()
        socks[i].sendall(BAD_HELLO)
        frames = read_frames(socks[i], 1, timeout=ANSWER_WITHIN_S)
        answers.append(frames[0].status if frames else None)
        took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    assert answers == [PermissionDenied.status] * n      # each was answered, and refused
    return took


def test_ten_bad_tokens_from_one_address_then_a_good_one_logs_in_at_once(node):
    took = _bad_hellos_at_once(lambda: raw_connect(node.port), 10)
    assert max(took) >= 1.0                    # the source's later failures waited (50 ms doubling)
    t0 = time.monotonic()
    with Client(node.addr, token=TOKEN) as c:  # the same address: never refused, never delayed
        assert c.tenant == "alice"
        c.ping()
    assert time.monotonic() - t0 < 1.0
    log = node.log()
    assert "HELLO from 127.0.0.1:" in log and "HELLO from  refused" not in log


def test_a_bad_unix_client_does_not_lock_out_the_engine(node):
    path = str(node.data_dir / "quillcached.sock")
    # the bad client is another process: ten wrong tokens at once, one connection each
    code = ("import socket,sys\n"
            "from tests._support.net import read_frames\n"
            f"hello = {BAD_HELLO!r}\n"
            "socks = [socket.socket(socket.AF_UNIX) for _ in range(10)]\n"
            "for s in socks: s.connect(sys.argv[1]); s.sendall(hello)\n"
            f"for s in socks: f = read_frames(s, 1, timeout={ANSWER_WITHIN_S}); assert f and f[0].status, f\n")
    bad = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 0, bad.stderr
    t0 = time.monotonic()
    with Client(f"unix:{path}", token=TOKEN) as engine:
        assert engine.tenant == "alice"
        engine.ping()
    assert time.monotonic() - t0 < 1.0          # another process: not slowed by the bad one
    log = node.log()
    assert "HELLO from unix:uid=" in log and "HELLO from  refused" not in log


def test_a_source_s_failures_do_not_slow_another_source(node):
    took = _bad_hellos_at_once(lambda: raw_connect(node.port), 6)   # 127.0.0.1: its row is long now
    assert max(took) >= 1.0
    s = socket.create_connection(("127.0.0.1", node.port), source_address=("127.0.0.2", 0), timeout=10)
    try:
        t0 = time.monotonic()
        s.sendall(BAD_HELLO)
        assert read_frames(s, 1)[0].status == PermissionDenied.status
        assert time.monotonic() - t0 < 1.0      # 127.0.0.2's first failure: 50 ms
    finally:
        s.close()


def test_before_login_one_hello_at_a_time_and_a_refused_one_holds_the_connection(node):
    s = raw_connect(node.port)
    try:
        bad2 = encode_frame_header(Opcode.HELLO, 2, header=messages.encode_hello_request(b"guess2"))
        s.sendall(BAD_HELLO + bad2)                 # pipelined: the second while the first waits
        frames = {f.request_id: f for f in read_frames(s, 2, timeout=ANSWER_WITHIN_S)}
        assert frames[1].status == PermissionDenied.status
        assert frames[2].status != 0 and "one HELLO at a time" in messages.decode_error(
            frames[2].status, frames[2].header).args[0]
        good = encode_frame_header(Opcode.HELLO, 3, header=messages.encode_hello_request(TOKEN.encode()))
        s.sendall(good)                             # the same connection logs in afterwards
        assert read_frames(s, 1, timeout=ANSWER_WITHIN_S)[0].status == 0
    finally:
        s.close()
