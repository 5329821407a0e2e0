"""The server glue over a real quillcached: bad frames, limits, pipelining, the identity
guard over the wire, a live-daemon fuzz and a mixed load (short always, long with --slow)."""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header
from quillcache.errors import InvalidArgument, NotFound, ProtocolError, UnsafeReuse
from quillcache.model import encode_key
from quillcache.protocol import messages
from quillcache.protocol.opcodes import FLAG_PAYLOAD_CRC, Opcode
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.metrics import metric_value, scrape
from tests._support.net import raw_connect, read_frames

DRAM = 64 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("server"), sections={
        "limits": 'max_payload = "16MiB"\nmax_connections = 64'}).start()
    yield d
    assert d.stop() == 0


def _dram_used(c: Client) -> int:
    return c.info("Tiers")["Tiers"]["dram_used"]


def test_malformed_frame_gets_an_error_and_is_closed_while_others_keep_working(daemon):
    with Client(daemon.addr) as good:
        good.put(key(1), b"still here")
        bad = raw_connect(daemon.port)
        frame = bytearray(encode_frame_header(Opcode.PING, 5))
        frame[28] ^= 0xFF                                   # breaks the header CRC
        bad.sendall(bytes(frame))
        replies = read_frames(bad, 2)
        assert len(replies) == 1                            # one ERROR, then EOF
        err = replies[0]
        assert err.opcode == Opcode.ERROR and err.request_id == 0 and err.status == ProtocolError.status
        assert "crc" in messages.decode_error(err.status, err.header).args[0].lower()
        bad.close()
        assert good.get(key(1)) == b"still here"


def test_bad_magic_is_refused_at_once(daemon):
    s = raw_connect(daemon.port)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    replies = read_frames(s, 2)
    assert len(replies) == 1 and replies[0].status == ProtocolError.status
    s.close()


def test_over_limit_payload_is_refused_before_allocation(daemon):
    with Client(daemon.addr) as c:
        used = _dram_used(c)
        s = raw_connect(daemon.port)
        k = encode_key(key(2))
        n = 1 << 30                                         # max_payload is 16 MiB
        body = messages.encode_put_request(k, n, messages.ProtocolLimits(max_payload_bytes=1 << 31))
        s.sendall(encode_frame_header(Opcode.PUT, 9, header=body, payload_length=n))
        replies = read_frames(s, 2)
        assert len(replies) == 1 and replies[0].status == ProtocolError.status and replies[0].request_id == 0
        s.close()
        assert _dram_used(c) == used


def test_block_over_max_block_is_refused_and_the_connection_goes_on(daemon):
    with Client(daemon.addr) as c:
        used = _dram_used(c)
        with pytest.raises(InvalidArgument, match="block size"):
            c.put(key(3), bytes(9 << 20))                   # max_block is 8 MiB
        assert _dram_used(c) == used
        c.put(key(3), b"fits")
        assert c.get(key(3)) == b"fits"


def test_pipelined_requests_are_answered_by_id(daemon):
    s = raw_connect(daemon.port)
    frames = []
    for i in range(1, 101):
        k = encode_key(key(i, prefix="pipe"))
        data = content(i, 1000 + i)
        frames.append(encode_frame_header(Opcode.PUT, i, header=messages.encode_put_request(k, len(data)),
                                          payload_length=len(data)) + data)
    for i in range(1, 101):
        k = encode_key(key(i, prefix="pipe"))
        frames.append(encode_frame_header(Opcode.PING, 1000 + i))
    s.sendall(b"".join(frames))                 # test-side framing only; payload bytes are the test's
    replies = read_frames(s, 200)
    assert sorted(r.request_id for r in replies) == list(range(1, 101)) + list(range(1001, 1101))
    assert all(r.status == 0 for r in replies)
    s.close()
    with Client(daemon.addr) as c:
        assert c.get_many([key(i, prefix="pipe") for i in range(1, 101)]) == \
            [content(i, 1000 + i) for i in range(1, 101)]


def test_get_reply_carries_a_payload_crc_when_asked(daemon):
    with Client(daemon.addr) as c:
        c.put(key(4), b"crc me" * 100)
    s = raw_connect(daemon.port)
    hdr = messages.encode_get_request(encode_key(key(4)))
    # the flag on a request means a trailer follows its (empty) payload: CRC32C of b"" is 0
    s.sendall(encode_frame_header(Opcode.GET, 3, header=hdr, flags=FLAG_PAYLOAD_CRC) + bytes(4))
    (r,) = read_frames(s, 1)                    # the parser checks the trailer CRC itself
    assert r.status == 0 and r.has_payload_crc and bytes(r.payload) == b"crc me" * 100
    s.close()


def test_guard_unsafe_reuse_crosses_the_wire_with_its_violation(daemon):
    with Client(daemon.addr) as c:
        c.put(key(1, model="llama", prefix="g"), b"kv")
        with pytest.raises(UnsafeReuse) as ei:
            c.get(key(1, model="mistral", prefix="g"))
        assert ei.value.violation == "model"


def test_cross_tenant_probe_is_exactly_a_miss(daemon):
    with Client(daemon.addr) as c:
        c.put(key(1, tenant="alice", prefix="probe"), b"secret")
        with pytest.raises(NotFound) as probe:
            c.get(key(1, tenant="bob", prefix="probe"))
        with pytest.raises(NotFound) as miss:
            c.get(key(2, tenant="bob", prefix="probe"))
        # same class, same message shape: nothing says alice has the block
        assert str(probe.value).replace("b1", "bX") == str(miss.value).replace("b2", "bX")
        assert c.exists(key(1, tenant="bob", prefix="probe")) is False


def test_max_connections_is_enforced(tmp_path):
    with Daemon(tmp_path, sections={"limits": "max_connections = 2"}) as d:
        a, b = Client(d.addr), Client(d.addr)
        s = raw_connect(d.port)
        replies = read_frames(s, 2)
        assert len(replies) == 1 and replies[0].request_id == 0 and replies[0].status == 11  # Busy
        a.close()
        time.sleep(0.2)
        with Client(d.addr) as c:
            assert c.ping() >= 0
        b.close()


# --------------------------------------------------------------------------- live fuzz


_OPS = [Opcode.HELLO, Opcode.PING, Opcode.PUT, Opcode.GET, Opcode.PUT_MANY, Opcode.GET_MANY,
        Opcode.EXISTS, Opcode.REMOVE, Opcode.PIN, Opcode.UNPIN, Opcode.LIST, Opcode.STATS]


def _valid_bodies(rng: random.Random) -> list[tuple[int, bytes, bytes]]:
    k = encode_key(key(rng.randrange(50), prefix="fuzz"))
    data = rng.randbytes(rng.randrange(1, 300))
    return [
        (Opcode.HELLO, messages.encode_hello_request(b"tok"), b""),
        (Opcode.PING, b"", data),
        (Opcode.PUT, messages.encode_put_request(k, len(data)), data),
        (Opcode.GET, messages.encode_get_request(k), b""),
        (Opcode.PUT_MANY, messages.encode_put_many_request([(k, len(data))]), data),
        (Opcode.GET_MANY, messages.encode_keys_request([k, k]), b""),
        (Opcode.EXISTS, messages.encode_keys_request([k]), b""),
        (Opcode.REMOVE, messages.encode_keys_request([k]), b""),
        (Opcode.PIN, messages.encode_pin_request([k], ttl_ms=1000), b""),
        (Opcode.UNPIN, messages.encode_unpin_request([k]), b""),
        (Opcode.LIST, messages.encode_list_request(k[:12], 10), b""),
        (Opcode.STATS, messages.encode_stats_request(), b""),
    ]


def _mutate(rng: random.Random, b: bytes) -> bytes:
    b = bytearray(b)
    for _ in range(rng.randrange(1, 4)):
        what = rng.randrange(4)
        if what == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif what == 1 and b:
            del b[rng.randrange(len(b)):]
        elif what == 2:
            b[rng.randrange(len(b) + 1):0] = rng.randbytes(rng.randrange(1, 16))
        elif b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def _fuzz_frame(rng: random.Random, rid: int) -> tuple[bytes, bool]:
    """(frame bytes, envelope valid?): mostly valid envelopes with mutated bodies."""
    op, body, payload = rng.choice(_valid_bodies(rng))
    r = rng.random()
    if r < 0.6:
        body = _mutate(rng, body)
    elif r < 0.7:
        payload = _mutate(rng, payload) if payload else payload
    plen = len(payload)
    frame = encode_frame_header(op, rid, header=body, payload_length=plen) + payload
    if r >= 0.85:
        return _mutate(rng, frame), False          # raw mutation: usually a connection-level error
    return frame, True


def _drain(sock: socket.socket) -> bool:
    """Read what is there; False when the server closed."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return False
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def _well_behaved(addr: str, stop: threading.Event, errors: list, done: list) -> None:
    try:
        with Client(addr, timeout=30) as c:
            i = 0
            while not stop.is_set():
                k = key(i % 200, tenant="steady", prefix="steady")
                data = content(i, 100 + i % 5000)
                c.put(k, data)
                got = c.get(k)
                if got != data:
                    errors.append(f"wrong bytes for {k}")
                i += 1
            done.append(i)
    except Exception as exc:
        errors.append(repr(exc))


def _fuzz(daemon: Daemon, frames: int, seed: int) -> None:
    rng = random.Random(seed)
    stop = threading.Event()
    errors: list = []
    done: list = []
    steady = threading.Thread(target=_well_behaved, args=(daemon.addr, stop, errors, done))
    steady.start()
    sent = 0
    sock = raw_connect(daemon.port)
    rid = 1
    try:
        while sent < frames:
            batch = []
            for _ in range(rng.randrange(1, 40)):
                frame, _valid = _fuzz_frame(rng, rid)
                rid += 1
                batch.append(frame)
            sent += len(batch)
            try:
                sock.sendall(b"".join(batch))
                alive = _drain(sock)
            except OSError:
                alive = False
            if not alive or rng.random() < 0.02:
                sock.close()
                sock = raw_connect(daemon.port)
    finally:
        sock.close()
        stop.set()
        steady.join(60)
    assert daemon.proc.poll() is None, "the daemon died under fuzz:\n" + daemon.log()[-4000:]
    assert not errors, errors[:5]
    assert done and done[0] > 0
    with Client(daemon.addr) as c:
        assert c.ping() >= 0
        assert c.info()["Server"]["protocol_errors"] > 0


def test_live_fuzz_short_keeps_the_daemon_up_and_others_unaffected(daemon):
    _fuzz(daemon, 20_000, seed=1)


@pytest.mark.slow
def test_live_fuzz_one_million_frames(tmp_path):
    with Daemon(tmp_path, sections={"limits": 'max_payload = "16MiB"'}) as d:
        _fuzz(d, 1_000_000, seed=2)


# --------------------------------------------------------------------------- mixed load


def _load_worker(addr: str, n: int, seconds: float, errors: list, counts: list) -> None:
    rng = random.Random(n)
    ops = 0
    versions: dict[int, int] = {}
    try:
        with Client(addr, timeout=30) as c:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                i = rng.randrange(64)
                k = key(i, tenant=f"load{n}", prefix="load")
                if rng.random() < 0.5 or i not in versions:
                    v = versions.get(i, 0) + 1
                    size = 1 + (i * 7919 + v * 104729) % (256 << 10)
                    c.put(k, content(n * 10_000_000 + i * 1000 + v, size))
                    versions[i] = v
                else:
                    v = versions[i]
                    size = 1 + (i * 7919 + v * 104729) % (256 << 10)
                    try:
                        got = c.get(k)
                    except NotFound:
                        got = None                          # evicted under pressure: a miss, not an error
                    if got is not None and got != content(n * 10_000_000 + i * 1000 + v, size):
                        errors.append(f"client {n}: wrong bytes for block {i} v{v}")
                ops += 1
    except Exception as exc:
        errors.append(f"client {n}: {exc!r}")
    counts.append(ops)


def _load(daemon: Daemon, clients: int, seconds: float, dram: int) -> tuple[int, int]:
    errors: list = []
    counts: list = []
    threads = [threading.Thread(target=_load_worker, args=(daemon.addr, n, seconds, errors, counts))
               for n in range(clients)]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, daemon.rss_bytes())
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert len(counts) == clients and min(counts) > 0
    return sum(counts), peak


def test_mixed_load_short_has_no_errors(daemon):
    ops, _peak = _load(daemon, 8, 3.0, DRAM)
    assert ops > 100


@pytest.mark.slow
def test_mixed_load_64_clients_60_s_bounded_rss(tmp_path):
    dram = 512 << 20
    with Daemon(tmp_path, dram="512MiB", max_block="8MiB") as d:
        ops, peak = _load(d, 64, 60.0, dram)
        print(f"\nload: 64 clients x 60 s: {ops} ops, {ops / 60:.0f} ops/s, peak RSS {peak / 2**20:.0f} MiB")
        assert peak <= dram * 1.15


# --------------------------------------------------------------------------- hot-path pieces


def test_key_cache_returns_exactly_what_decode_key_returns_and_stays_bounded():
    from quillcache.errors import InvalidArgument as BadArg
    from quillcache.model import decode_key
    from quillcache.node.server import KeyCache
    cache = KeyCache(4)                   # two generations of 2
    keys = [key(i, prefix="kc") for i in range(10)]
    raws = [encode_key(k) for k in keys]
    for k, raw in zip(keys, raws):
        assert cache.decode(raw) == k == decode_key(raw)
        assert len(cache) <= 4
    assert cache.misses == 10 and cache.hits == 0
    assert cache.decode(raws[-1]) is cache.decode(bytearray(raws[-1]))      # a hit, by value
    assert cache.hits == 2
    # kept: the last two (the young generation) and the two before them (the old one)
    assert all(raw in cache for raw in raws[6:]) and raws[5] not in cache
    assert cache.decode(raws[6]) is cache.decode(raws[6])    # old, then moved to the young one
    assert cache.hits == 4 and raws[7] not in cache           # ... which was full: it turned
    assert cache.decode(raws[7]) == keys[7] and cache.misses == 11     # decoded again, still right
    with pytest.raises(BadArg):
        cache.decode(raws[0][:-1])        # truncated: refused, not cached
    assert raws[0][:-1] not in cache
    assert len(KeyCache(0).decode(raws[0]).block_hash) and len(KeyCache(0)) == 0


def test_keys_differing_in_one_field_are_never_mixed_up_over_the_wire(daemon):
    from quillcache.model import KvBlockKey
    base = {"model_id": "m", "tokenizer_id": "t", "adapter_id": None, "tenant_id": "t0", "prefix_hash": "p",
                "block_hash": "b"}
    variants = [KvBlockKey(**base, block_index=i, token_count=tc) for i in range(3) for tc in (63, 64)]
    variants.append(KvBlockKey(**{**base, "adapter_id": "a"}, block_index=0, token_count=64))
    with Client(daemon.addr) as c:
        for i, k in enumerate(variants):
            c.put(k, content(i, 1000 + i))
        for _ in range(3):            # the server's decoded-key cache serves the repeats
            for i, k in enumerate(variants):
                assert c.get(k) == content(i, 1000 + i)
                buf = bytearray(2000)
                assert c.get_into(k, buf) == 1000 + i and bytes(buf[:1000 + i]) == content(i, 1000 + i)


def test_a_malformed_get_body_is_refused_by_the_fast_path_and_the_connection_goes_on(daemon):
    s = raw_connect(daemon.port)
    k = encode_key(key(1, prefix="bad-get"))
    bad_len = (len(k) + 5).to_bytes(2, "little") + k          # declared length past the body
    s.sendall(encode_frame_header(Opcode.GET, 1, header=bad_len)
              + encode_frame_header(Opcode.GET, 2, header=b"\x00\x00")          # empty key
              + encode_frame_header(Opcode.GET, 3, header=(3).to_bytes(2, "little") + b"\x07\x00\x01")
              + encode_frame_header(Opcode.PING, 4))
    replies = {r.request_id: r for r in read_frames(s, 4)}
    assert replies[1].opcode == Opcode.ERROR and replies[1].status == InvalidArgument.status
    assert replies[2].opcode == Opcode.ERROR and replies[2].status == InvalidArgument.status
    assert replies[3].opcode == Opcode.ERROR and replies[3].status == InvalidArgument.status
    assert replies[4].status == 0
    s.close()


def test_request_metrics_are_counted_by_opcode_and_status_at_scrape_time(daemon):

    def snapshot():
        text = scrape(daemon.metrics_port)
        return (metric_value(text, "quillcache_requests_total", 'opcode="GET",status="OK"'),
                metric_value(text, "quillcache_requests_total", 'opcode="GET",status="NOT_FOUND"'),
                metric_value(text, "quillcache_request_seconds_count", 'opcode="GET"'),
                metric_value(text, "quillcache_request_seconds_bucket", 'le="+Inf",opcode="GET"'),
                metric_value(text, "quillcache_sent_bytes_total"))
    ok0, miss0, count0, inf0, sent0 = snapshot()
    with Client(daemon.addr) as c:
        c.put(key(1, prefix="metrics"), b"m" * 10_000)
        buf = bytearray(10_000)
        for _ in range(7):
            c.get_into(key(1, prefix="metrics"), buf)
        for _ in range(3):
            with pytest.raises(NotFound):
                c.get(key(2, prefix="metrics"))
    ok1, miss1, count1, inf1, sent1 = snapshot()
    assert (ok1 - ok0, miss1 - miss0) == (7, 3)
    assert count1 - count0 == 10 and inf1 == count1           # +Inf bucket = count
    assert sent1 - sent0 >= 70_000


def test_request_counters_render_as_prometheus_families():
    from prometheus_client import generate_latest

    from quillcache.node.metrics import LATENCY_BUCKETS_S, NodeMetrics
    m = NodeMetrics("n1", "v")
    m.observe(int(Opcode.GET), 0, 30e-6)
    m.observe(int(Opcode.GET), 0, LATENCY_BUCKETS_S[2])       # on a bound: counted in that bucket
    m.observe(int(Opcode.GET), 3, 99.0)                        # past the last bound: +Inf only
    m.add_received(123)
    m.add_sent(456)
    text = generate_latest(m.registry).decode()
    assert 'quillcache_requests_total{opcode="GET",status="OK"} 2.0' in text
    assert 'quillcache_request_seconds_bucket{le="2e-05",opcode="GET"} 0.0' in text
    assert 'quillcache_request_seconds_bucket{le="5e-05",opcode="GET"} 1.0' in text
    assert 'quillcache_request_seconds_bucket{le="0.0001",opcode="GET"} 2.0' in text
    assert 'quillcache_request_seconds_bucket{le="5.0",opcode="GET"} 2.0' in text
    assert 'quillcache_request_seconds_bucket{le="+Inf",opcode="GET"} 3.0' in text
    assert 'quillcache_request_seconds_count{opcode="GET"} 3.0' in text
    assert "quillcache_received_bytes_total 123.0" in text and "quillcache_sent_bytes_total 456.0" in text


def test_a_handler_that_suspends_is_finished_by_a_task_with_its_result_and_its_cancellation():
    import asyncio

    from quillcache.node.tasks import finish_in_task as _finish

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        seen = []

        async def handler():
            await asyncio.sleep(0)              # a bare yield first
            v = await fut
            seen.append(v)
            return v * 2

        coro = handler()
        first = coro.send(None)                 # what ServerProtocol._spawn does
        task = loop.create_task(_finish(coro, first))
        loop.call_later(0.01, fut.set_result, 21)
        assert await task == 42 and seen == [21]

        never = loop.create_future()

        async def stuck():
            try:
                await never
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        coro = stuck()
        task = loop.create_task(_finish(coro, coro.send(None)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen[-1] == "cancelled" and never.cancelled()
    asyncio.run(main())


def test_put_with_a_size_field_that_disagrees_with_the_payload_is_refused(daemon):
    s = raw_connect(daemon.port)
    k = encode_key(key(1, prefix="bad-put"))
    body = messages.encode_put_request(k, 10)
    s.sendall(encode_frame_header(Opcode.PUT, 1, header=body, payload_length=12) + b"x" * 12
              + encode_frame_header(Opcode.PING, 2))
    replies = {r.request_id: r for r in read_frames(s, 2)}
    assert replies[1].opcode == Opcode.ERROR and replies[1].status == InvalidArgument.status
    assert replies[2].status == 0
    s.close()
    with Client(daemon.addr) as c:
        with pytest.raises(NotFound):
            c.get(key(1, prefix="bad-put"))


def test_a_get_many_reply_keeps_its_bytes_while_the_reader_is_slow(daemon):
    """GET_MANY holds its DRAM hits under one lease until the transport has handed every
    byte to the kernel: a reader that reads its reply late still gets exactly the bytes
    that were current when it asked, though they were rewritten and removed meanwhile; a
    miss and another tenant's block in the same batch are both exactly a miss."""
    n, size = 24, 256 << 10                      # 6 MiB of reply: more than the socket buffers
    keys = [key(i, prefix="slow-many") for i in range(n)]
    with Client(daemon.addr) as c:
        c.put_many([(k, content(i, size)) for i, k in enumerate(keys)])
        c.put(key(0, tenant="alice", prefix="slow-many-other"), b"alice's")
    asked = keys + [key(99, prefix="slow-many"), key(0, tenant="t0", prefix="slow-many-other")]
    s = raw_connect(daemon.port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    s.sendall(encode_frame_header(Opcode.GET_MANY, 5, header=messages.encode_keys_request(
        [encode_key(k) for k in asked])))
    time.sleep(0.3)                             # the reply is queued on the node, unread
    with Client(daemon.addr) as c:
        c.put_many([(k, content(1000 + i, size)) for i, k in enumerate(keys[:n // 2])])
        c.remove_many(keys[n // 2:])
    (r,) = read_frames(s, 1, timeout=30)
    s.close()
    items = messages.decode_get_many_reply(r.header, r.payload_length)
    assert [st for st, _ in items[:n]] == [0] * n
    assert items[n][0] == NotFound.status and items[n + 1][0] == NotFound.status
    assert bytes(r.payload) == b"".join(content(i, size) for i in range(n))
    with Client(daemon.addr) as c:
        assert c.get(keys[0]) == content(1000, size)         # the rewrite is what is current now
        with pytest.raises(NotFound):
            c.get(keys[-1])
