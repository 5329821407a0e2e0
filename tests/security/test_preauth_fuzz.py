"""A fuzz of the surface before login: many short-lived connections from several loopback
sources, each doing one hostile thing (nothing, garbage, a PING claiming 1 MiB, a bad
HELLO, a frame cut short, a huge header, another opcode, an idle hold), while a client
with a valid token logs in and works throughout, over TCP and the Unix socket.  The node's
RSS must stay within 64 MiB of its start and every valid login must succeed.

10k connections by default; 100k with --slow (QUILLCACHE_SLOW=1)."""
from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from quillcache.settings.convert import hash_token
from tests._support.daemon import Daemon

TOKEN = "alice-secret"
MiB = 1 << 20
RSS_BUDGET = 64 * MiB            # bytes the node may grow by during the fuzz
CONCURRENCY = 64                 # hostile connections at once
SOURCES = [f"127.0.0.{i}" for i in range(2, 34)]     # the valid client is 127.0.0.1 (and the Unix socket)
SHARED_SOURCE = "127.0.0.1"      # some bad HELLOs come from the valid client's own address
STEP_TIMEOUT_S = 2.0             # one hostile connection's bound
_LINGER0 = struct.pack("ii", 1, 0)                   # close with RST: no TIME_WAIT on our side


def _hostile(rng: random.Random) -> tuple[str, bytes, float]:
    """(kind, bytes to send, seconds to hold the connection after sending)."""
    kind = rng.choice(("bare", "garbage", "ping", "bad_hello", "cut", "big_header", "other_op", "hold"))
    hello = encode_frame_header(Opcode.HELLO, 1, header=messages.encode_hello_request(b"guess%d" % rng.getrandbits(32)))
    if kind == "garbage":
        data = rng.randbytes(rng.randint(1, 300))
    elif kind == "ping":
        data = encode_frame_header(Opcode.PING, 1, payload_length=MiB) + b"x" * rng.randint(0, 64)
    elif kind == "bad_hello":
        data = hello
    elif kind == "cut":
        data = hello[:rng.randint(1, len(hello) - 1)]
    elif kind == "big_header":
        data = encode_frame_header(Opcode.HELLO, 1, header=bytes(rng.choice((9000, 1 << 16, 1 << 20))))[:28]
    elif kind == "other_op":
        op = rng.choice((Opcode.GET, Opcode.PUT, Opcode.STATS, Opcode.LIST, Opcode.MAP))
        data = encode_frame_header(op, 1, header=b"k" * rng.randint(0, 40))
    else:
        data = b""
    hold = rng.uniform(0.0, 0.5) if kind in ("hold", "cut") else 0.0
    return kind, data, hold


async def _one(loop, port: int, rng: random.Random) -> None:
    kind, data, hold = _hostile(rng)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.bind((SHARED_SOURCE if kind == "bad_hello" and rng.random() < 0.3 else rng.choice(SOURCES), 0))
        await loop.sock_connect(s, ("127.0.0.1", port))
        if data:
            await loop.sock_sendall(s, data)
        if hold:
            await asyncio.sleep(hold)
        if rng.random() < 0.5:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
    except OSError:
        pass                            # refused, reset: the node defends itself
    finally:
        s.close()


async def _fuzz(port: int, n: int, seed: int) -> int:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)
    done = 0

    async def guarded() -> None:
        nonlocal done
        async with sem:
            try:
                await asyncio.wait_for(_one(loop, port, random.Random(rng.getrandbits(64))), STEP_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
            done += 1

    pending: set = set()
    for _ in range(n):
        while len(pending) >= 4 * CONCURRENCY:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        pending.add(loop.create_task(guarded()))
    if pending:
        await asyncio.wait(pending)
    return done


def _run(tmp_path, n: int, seed: int) -> None:
    d = Daemon(tmp_path)
    d.config.write_text(d.config.read_text() + f'\n[auth]\n[[auth.tenants]]\nname = "alice"\n'
                        f'token = "{hash_token(TOKEN)}"\n')
    with d:
        unix = f"unix:{d.data_dir / 'quillcached.sock'}"
        with Client(d.addr, token=TOKEN) as c:
            c.ping()
        start = d.rss_bytes()
        peak = [start]
        logins = {"ok": 0, "failed": []}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], d.rss_bytes())
                time.sleep(0.05)

        def valid() -> None:
            i = 0
            while not stop.is_set():
                try:
                    with Client(unix if i % 2 else d.addr, token=TOKEN, timeout=10) as c:
                        c.ping()
                    logins["ok"] += 1
                except Exception as exc:        # every one must succeed: collected, asserted below
                    logins["failed"].append(repr(exc))
                i += 1
                time.sleep(0.05)

        threads = [threading.Thread(target=sample), threading.Thread(target=valid)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        try:
            done = asyncio.run(_fuzz(d.port, n, seed))
        finally:
            took = time.monotonic() - t0
            stop.set()
            for t in threads:
                t.join()
        grew = peak[0] - start
        print(f"\npre-auth fuzz: {done} connections in {took:.1f} s ({done / took:.0f}/s); RSS start "
              f"{start / MiB:.1f} MiB, peak {peak[0] / MiB:.1f} MiB (+{grew / MiB:.1f}); valid logins "
              f"{logins['ok']} ok, {len(logins['failed'])} failed")
        assert done == n
        assert not logins["failed"], logins["failed"][:5]
        assert logins["ok"] >= 3
        assert grew < RSS_BUDGET, f"RSS grew by {grew / MiB:.1f} MiB"
        with Client(d.addr, token=TOKEN) as c:
            deadline = time.monotonic() + 10
            while c.info()["Auth"]["unauthenticated"] and time.monotonic() < deadline:
                time.sleep(0.2)             # what the fuzz left waiting goes at its hello deadline
            assert c.info()["Auth"]["unauthenticated"] == 0


def test_preauth_fuzz_10k_connections_keep_rss_bounded_and_valid_logins_working(tmp_path):
    _run(tmp_path, 10_000, seed=22)


@pytest.mark.slow
def test_preauth_fuzz_100k_connections_keep_rss_bounded_and_valid_logins_working(tmp_path):
    _run(tmp_path, 100_000, seed=2022)
