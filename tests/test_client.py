"""The client library (sync Client and AsyncClient) against a real quillcached."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest

from quillcache import AsyncClient, Client
from quillcache.client.calls import Req
from quillcache.errors import ConnectionLost, InvalidArgument, NotFound, ProtocolError, QuillCacheError, Timeout
from quillcache.protocol.opcodes import Opcode
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.daemon import Daemon
from tests._support.data import content, key
from tests._support.net import free_port


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("client")).start()
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    with Client(daemon.addr) as c:
        yield c


@pytest.mark.parametrize("size", [1, 4096, 4 << 20])
def test_put_get_round_trip_is_byte_exact(client, size):
    k = key(size, prefix="sizes")
    data = content(size, size)
    client.put(k, data)
    assert client.get(k) == data
    assert client.exists(k)


def test_empty_block_gets_the_same_answer_as_the_local_store(client):
    """A 0-byte put over the wire behaves exactly like LocalKvStore.put of 0 bytes."""
    local = LocalKvStore(StoreOptions(1 << 20))
    try:
        asyncio.run(local.put(key(0), b""))
        local_error = None
    except QuillCacheError as exc:
        local_error = type(exc)
    if local_error is None:
        client.put(key(0, prefix="empty"), b"")
        assert client.get(key(0, prefix="empty")) == b""
    else:
        with pytest.raises(local_error):
            client.put(key(0, prefix="empty"), b"")
        assert client.ping() >= 0               # the connection goes on


def test_get_into_receives_straight_into_a_numpy_array(client):
    arr = np.arange(256 * 1024, dtype=np.float32)
    client.put(key(1, prefix="np"), arr)
    out = np.zeros(256 * 1024 + 16, dtype=np.float32)
    n = client.get_into(key(1, prefix="np"), out)
    assert n == arr.nbytes
    assert np.array_equal(out[:arr.size], arr) and not out[arr.size:].any()
    small = np.zeros(10, dtype=np.uint8)
    with pytest.raises(InvalidArgument):
        client.get_into(key(1, prefix="np"), small)
    assert client.ping() >= 0                   # the refused payload was skipped, stream in sync


def test_put_many_and_get_many_are_pipelined_and_match_by_key(client):
    items = [(key(i, prefix="many"), content(i, 100 + i * 37)) for i in range(300)]
    client.put_many(items)
    keys = [k for k, _ in items] + [key(10_000, prefix="many")]
    got = client.get_many(keys)
    assert got[:-1] == [d for _, d in items]
    assert got[-1] is None


def test_exists_many_reports_the_present_prefix_length(client):
    keys = [key(i, prefix="ex") for i in range(10)]
    client.put_many([(k, b"v") for k in keys[:4]] + [(keys[6], b"v")])
    prefix, present = client.exists_many(keys)
    assert prefix == 4
    assert present == [True] * 4 + [False, False, True] + [False] * 3


def test_remove_returns_whether_the_key_was_there(client):
    k = key(1, prefix="rm")
    client.put(k, b"abc")
    assert client.remove(k) is True
    assert client.remove(k) is False
    with pytest.raises(NotFound):
        client.get(k)


def test_pin_and_unpin(client):
    k = key(1, prefix="pin")
    client.put(k, b"abc")
    assert client.pin(k, 30) is True
    assert client.pin(k, 0, hard=True) is True
    assert client.unpin(k) is True
    assert client.unpin(k) is False
    assert client.pin(key(2, prefix="pin"), 30) is False      # not resident


def test_ls_lists_the_keys_of_one_scope_and_prefix(client):
    keys = [key(i, prefix="ls") for i in range(5)]
    client.put_many([(k, b"x") for k in keys])
    assert sorted(client.ls(keys[0].scope, "ls"), key=lambda k: k.block_index) == keys
    assert client.ls(keys[0].scope, "nothing-here") == []


def test_ls_without_prefix_lists_the_whole_scope_and_nothing_else(client):
    mine = [key(i, prefix=f"scope-{i % 2}", model="ls-model") for i in range(4)]
    other = key(9, prefix="scope-0", model="ls-other-model")
    client.put_many([(k, b"y") for k in mine + [other]])
    listed = client.ls(mine[0].scope)
    assert sorted(listed, key=lambda k: (k.prefix_hash, k.block_index)) == \
        sorted(mine, key=lambda k: (k.prefix_hash, k.block_index))


def test_info_and_stats_are_parsed(client):
    info = client.info()
    assert {"Server", "Store", "Tiers", "Guard", "WAL", "Auth"} <= set(info)
    assert info["Server"]["mode"] == "open"
    assert info["Tiers"]["dram_capacity"] == 64 << 20
    assert info["Tiers"]["dram_backing"] == "memfd"         # [store] hugepages is off by default
    stats = client.stats()
    assert stats["server"]["mode"] == "open" and "dram_hits" in stats["tiers"]


def test_async_client_has_the_same_methods(daemon):
    async def main():
        async with AsyncClient(daemon.addr) as c:
            data = content(7, 70_000)
            await c.put(key(7, prefix="async"), data)
            assert await c.get(key(7, prefix="async")) == data
            buf = bytearray(70_000)
            assert await c.get_into(key(7, prefix="async"), buf) == 70_000 and bytes(buf) == data
            await c.put_many([(key(i, prefix="async"), content(i, 999)) for i in range(50)])
            got = await c.get_many([key(i, prefix="async") for i in range(50)])
            assert got == [content(i, 999) for i in range(50)]
            assert (await c.exists_many([key(0, prefix="async"), key(99, prefix="async")]))[0] == 1
            results = await asyncio.gather(*(c.get(key(i, prefix="async")) for i in range(50)))
            assert results == got
            assert await c.remove(key(0, prefix="async"))
            with pytest.raises(NotFound):
                await c.get(key(0, prefix="async"))
            assert (await c.info())["Server"]["mode"] == "open"
            assert await c.ping() > 0
    asyncio.run(main())


def _silent_server(behaviour: str):
    """A listener that accepts and then closes at once ("close") or never answers ("mute")."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    conns = []

    def run():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            if behaviour == "close":
                c.close()
            else:
                conns.append(c)
    threading.Thread(target=run, daemon=True).start()
    return srv, conns


def test_a_dropped_connection_is_connection_lost_not_a_hang():
    srv, _ = _silent_server("close")
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost):
            Client(f"127.0.0.1:{srv.getsockname()[1]}", timeout=5)
        assert time.monotonic() - t0 < 4
    finally:
        srv.close()


def test_a_server_that_never_answers_gives_timeout():
    srv, conns = _silent_server("mute")
    try:
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            Client(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.5)
        assert time.monotonic() - t0 < 3

        async def main():
            with pytest.raises(Timeout):
                await AsyncClient(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.5).connect()
        asyncio.run(main())
    finally:
        srv.close()
        for c in conns:
            c.close()


def test_connecting_to_nothing_is_connection_lost():
    with pytest.raises(ConnectionLost):
        Client(f"127.0.0.1:{free_port()}", timeout=2)


def test_daemon_stopping_mid_session_gives_connection_lost(tmp_path):
    with Daemon(tmp_path) as d:
        c = Client(d.addr, timeout=5)
        c.put(key(1), b"x")
        d.stop()
        with pytest.raises(ConnectionLost):
            c.get(key(1))
        with pytest.raises(ConnectionLost):     # and stays failed
            c.ping()


# --------------------------------------------------------------------------- data path additions


def test_get_many_returns_a_view_of_exactly_each_value(client):
    items = [(key(i, prefix="gm-mv"), content(i, 5000 + i)) for i in range(20)]
    client.put_many(items)
    got = client.get_many([k for k, _ in items] + [key(99, prefix="gm-mv")])
    assert all(type(v) is memoryview and v.nbytes == len(d) for v, (_, d) in zip(got, items))
    assert [bytes(v) for v in got[:-1]] == [d for _, d in items] and got[-1] is None
    got[0][:4] = b"ZZZZ"                                   # views are bounded to their value
    assert bytes(got[1]) == items[1][1]
    assert np.frombuffer(got[2], dtype=np.uint8).tobytes() == items[2][1]


def test_get_many_into_receives_each_value_into_its_own_buffer(client):
    items = [(key(i, prefix="gmi"), content(i, 3000 * (i + 1))) for i in range(5)]
    client.put_many(items)
    keys = [k for k, _ in items[:2]] + [key(77, prefix="gmi")] + [k for k, _ in items[2:]]
    bufs = [np.full(16_000, 0xEE, dtype=np.uint8) for _ in keys]
    sizes = client.get_many_into(keys, bufs)
    assert sizes == [3000, 6000, None, 9000, 12_000, 15_000]
    for (_k, data), buf in zip(items, bufs[:2] + bufs[3:]):
        n = len(data)
        assert buf[:n].tobytes() == data and (buf[n:] == 0xEE).all()   # nothing past the value
    assert (bufs[2] == 0xEE).all()                                       # the miss touched nothing


def test_get_many_into_spans_several_requests_past_max_batch(client):
    n = client.limits.max_batch + 3
    items = [(key(i, prefix="gmi-batch"), content(i, 64)) for i in range(n)]
    client.put_many(items)
    bufs = [bytearray(64) for _ in range(n)]
    assert client.get_many_into([k for k, _ in items], bufs) == [64] * n
    assert [bytes(b) for b in bufs] == [d for _, d in items]


def test_get_many_into_checks_every_buffer_before_sending(client):
    k = key(1, prefix="gmi-check")
    client.put(k, b"x" * 100)
    with pytest.raises(InvalidArgument):
        client.get_many_into([k, k], [bytearray(100)])              # counts differ
    with pytest.raises(InvalidArgument):
        client.get_many_into([k], [bytes(100)])                     # read-only
    with pytest.raises(InvalidArgument):
        client.get_many_into([k], [np.zeros((10, 20), order="F")])  # not C-contiguous
    with pytest.raises(InvalidArgument):
        client.get_many_into([k], [bytearray(99)])                  # smaller than the value
    assert client.get_many_into([k], [bytearray(100)]) == [100]     # the stream stayed in sync


def test_info_text_is_the_servers_info_verbatim(client):
    from quillcache.client import parse_info
    text = client.info_text()
    assert text.startswith("# Server\r\n") and "\r\nmode:open\r\n" in text
    parsed = parse_info(text)
    assert set(parsed) == set(client.info())
    assert client.info_text("Tiers").startswith("# Tiers\r\n")
    assert set(parse_info(client.info_text("Tiers"))) == {"Tiers"}


def test_unpin_hard_drops_a_hard_pin(client):
    k = key(1, prefix="unpin-hard")
    client.put(k, b"abc")
    assert client.pin(k, 0, hard=True) is True
    assert client.unpin(k, hard=True) is True
    assert client.unpin(k, hard=True) is False
    assert client.unpin(key(2, prefix="unpin-hard"), hard=True) is False     # not resident


def test_a_key_is_sent_as_its_own_encoding_and_a_non_key_is_refused(daemon):
    from quillcache.model import encode_key
    with Client(daemon.addr) as c:
        keys = [key(i, prefix="kc") for i in range(30)]
        for k in keys:
            assert c.encoded_key(k) == encode_key(k)
        # equal keys built separately name the same block
        for i, k in enumerate(keys):
            c.put(k, content(i, 100))
        assert [c.get(key(i, prefix="kc")) for i in range(30)] == [content(i, 100) for i in range(30)]
        with pytest.raises(InvalidArgument):
            c.get("not a key")


def _relay_then(daemon, after_hello):
    """A listener between the client and the daemon: HELLO goes through, then
    ``after_hello(conn, up, request)`` answers the next request."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held: list = []

    def run():
        try:
            conn, _ = srv.accept()
            up = socket.create_connection(("127.0.0.1", daemon.port))
            held.extend((conn, up))
            up.sendall(conn.recv(65536))
            conn.sendall(up.recv(65536))
            after_hello(conn, up, conn.recv(65536))
        except OSError:
            return          # the test closed the sockets: it is over
    threading.Thread(target=run, daemon=True).start()
    return srv, held


_MUTE_CALLS = {"get": lambda c: c.get(key(1)), "get_into": lambda c: c.get_into(key(1), bytearray(100)),
               "put": lambda c: c.put(key(1), b"x" * 1000)}


@pytest.mark.parametrize("op", sorted(_MUTE_CALLS))
def test_sync_wait_neither_ends_early_nor_overruns_its_deadline(daemon, op):
    srv, held = _relay_then(daemon, lambda conn, up, request: time.sleep(3))   # HELLO, then mute
    try:
        c = Client(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.4)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            _MUTE_CALLS[op](c)
        elapsed = time.monotonic() - t0
        assert 0.39 <= elapsed < 1.0
        with pytest.raises(ConnectionLost):                 # the connection was closed
            c.ping()
    finally:
        srv.close()
        for s in held:
            s.close()


def test_async_client_timeout_keeps_the_connection_and_drops_the_late_reply(daemon):
    with Client(daemon.addr) as c:
        c.put(key(1, prefix="late"), b"late" * 25)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held: list = []

    def relay():            # forwards request/reply pairs; the second reply (the GET) comes 0.6 s late
        conn, _ = srv.accept()
        up = socket.create_connection(("127.0.0.1", daemon.port))
        held.extend((conn, up))
        n = 0
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                up.sendall(data)
                reply = up.recv(65536)
                n += 1
                if n == 2:
                    time.sleep(0.6)
                conn.sendall(reply)
        except OSError:
            return          # the test closed the sockets under a blocked recv: it is over

    async def main(port):
        loop = asyncio.get_running_loop()
        async with AsyncClient(f"127.0.0.1:{port}", timeout=0.3) as c:
            t0 = loop.time()
            with pytest.raises(Timeout):
                await c.get(key(1, prefix="late"))
            assert 0.29 <= loop.time() - t0 < 0.6
            # the same connection goes on; the late GET reply is matched to its id and dropped
            c.timeout = 5.0
            assert await c.ping() >= 0
            assert await c.get(key(1, prefix="late")) == b"late" * 25
    threading.Thread(target=relay, daemon=True).start()
    try:
        asyncio.run(main(srv.getsockname()[1]))
    finally:
        srv.close()
        for s in held:
            s.close()


# --------------------------------------------------------------------------- get_into's own path
#
# With nothing else in flight, get_into drives the frame parser itself and hands any event
# it does not expect to the connection's handler.  These tests hold it to what the general
# way does: every outcome, then the next request on the same connection.


def test_get_into_stays_in_step_across_hits_misses_and_refusals(client):
    blocks = {i: content(i, size) for i, size in enumerate((1, 4096, 70_000, 1 << 20))}
    for i, v in blocks.items():
        client.put(key(i, prefix="into"), v)
    buf = bytearray((1 << 20) + 5)
    for _ in range(2):
        for i, v in blocks.items():
            assert client.get_into(key(i, prefix="into"), buf) == len(v) and buf[:len(v)] == v
            with pytest.raises(NotFound):                        # an ERROR reply, no payload
                client.get_into(key(100 + i, prefix="into"), buf)
            if len(v) > 1:
                with pytest.raises(InvalidArgument):             # does not fit: the payload is skipped
                    client.get_into(key(i, prefix="into"), bytearray(len(v) - 1))
            assert client.get(key(i, prefix="into")) == v        # the general way, same connection
            assert client._conn.in_flight == 0                   # nothing left pending
    assert client.ping() >= 0


def _reply_cut_short(conn, up, request):
    up.sendall(request)
    time.sleep(0.2)
    conn.sendall(up.recv(40_000)[:30_000])      # header and part of the payload, then gone
    conn.close()


def _garbage(conn, up, request):
    conn.sendall(bytes(range(64)))


@pytest.mark.parametrize("behaviour, error", [(_reply_cut_short, ConnectionLost), (_garbage, ProtocolError)],
                         ids=["cut_short", "garbage"])
def test_get_into_of_a_broken_reply_raises_and_ends_the_connection(daemon, behaviour, error):
    with Client(daemon.addr) as c:
        c.put(key(1, prefix="broken"), content(1, 200_000))
    _raises_and_ends_the_connection(daemon, behaviour, error,
                                    lambda c: c.get_into(key(1, prefix="broken"), bytearray(200_000)))


def _raises_and_ends_the_connection(daemon, behaviour, error, call) -> None:
    """``call(client)`` through a relay that answers it with ``behaviour`` raises ``error`` well
    within the client's timeout, and the connection cannot be used after it."""
    srv, held = _relay_then(daemon, behaviour)
    try:
        c = Client(f"127.0.0.1:{srv.getsockname()[1]}", timeout=5)
        t0 = time.monotonic()
        with pytest.raises(error):
            call(c)
        assert time.monotonic() - t0 < 4
        with pytest.raises(QuillCacheError):                     # ConnectionLost, or the parse error again
            c.ping()
        c.close()
    finally:
        srv.close()
        for s in held:
            s.close()


# --------------------------------------------------------------------------- put's own path
#
# With nothing else in flight, put sends header and payload in one write and drives the
# parser for its bare OK reply itself; any other event goes to the connection's handler.


def test_put_stays_in_step_across_sizes_refusals_and_the_general_way(client):
    sizes = (1, 1000, 16384 - 200, 16384, 16385, 70_000, 1 << 20)
    for rnd in range(2):
        for i, n in enumerate(sizes):
            k = key(i, prefix=f"put-path-{rnd}")
            client.put(k, content(i + rnd, n))
            assert client._conn.in_flight == 0                   # nothing left pending
            assert client.get(k) == content(i + rnd, n)
        with pytest.raises(InvalidArgument, match="block size"):  # the node's ERROR reply, payload sent
            client.put(key(99, prefix="put-path"), b"x" * ((8 << 20) + 1))
        assert client._conn.in_flight == 0
        with pytest.raises(InvalidArgument, match="durable"):      # the general way: its error
            client.put(key(98, prefix="put-path"), b"x", durable=True)
        with pytest.raises(InvalidArgument):                       # not a key: nothing is sent
            client.put("not a key", b"x")
        with pytest.raises(NotFound):
            client.get(key(99, prefix="put-path"))
        # with a request in flight (a posted ping), put takes the general way
        client._post(Req(Opcode.PING, b"", (), 0, None, lambda r: None))
        client.put(key(97, prefix="put-path"), b"after a posted request")
        assert client.get(key(97, prefix="put-path")) == b"after a posted request"
        # a numpy array, a memoryview of part of a buffer, a bytearray: the same bytes land
        arr = np.arange(1000, dtype=np.float32)
        client.put(key(96, prefix="put-path"), arr)
        assert client.get(key(96, prefix="put-path")) == arr.tobytes()
        buf = bytearray(content(5, 5000))
        client.put(key(95, prefix="put-path"), memoryview(buf)[100:4100])
        buf[100:200] = b"\0" * 100                                # changed after the put returned
        assert client.get(key(95, prefix="put-path")) == content(5, 5000)[100:4100]
    assert client.ping() >= 0


def test_put_sends_the_rest_when_a_signal_cuts_a_send_short(client):
    # A signal that lands in a blocking sendmsg after part of the frame went out returns the
    # part's length: the rest must follow, in order, or the connection's stream is torn.
    import signal
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *a: seen.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        values = {i: content(i, (6 << 20) + i) for i in range(8)}
        for i, v in values.items():
            client.put(key(i, prefix="cut-send"), v)
        client.put_many([(key(10 + i, prefix="cut-send"), v[:1 << 20]) for i, v in values.items()])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert seen                                                    # the sends were interrupted
    for i, v in values.items():
        assert client.get(key(i, prefix="cut-send")) == v
        assert client.get(key(10 + i, prefix="cut-send")) == v[:1 << 20]


def _put_reply_cut_short(conn, up, request):
    up.sendall(request)
    reply = up.recv(65536)
    conn.sendall(reply[:len(reply) // 2])       # half the OK header, then gone
    conn.close()


def _closed(conn, up, request):
    conn.close()


@pytest.mark.parametrize("behaviour, error", [(_put_reply_cut_short, ConnectionLost), (_closed, ConnectionLost),
                                              (_garbage, ProtocolError)], ids=["cut_short", "closed", "garbage"])
def test_put_of_a_broken_reply_raises_and_ends_the_connection(daemon, behaviour, error):
    _raises_and_ends_the_connection(daemon, behaviour, error, lambda c: c.put(key(1, prefix="broken-put"),
                                                                             content(1, 1000)))


def test_remove_many_removes_every_key_across_requests_and_says_which_were_there(client):
    keys = [key(i, prefix="rm-many") for i in range(client.limits.max_batch + 10)]
    client.put_many([(k, b"x" * 10) for k in keys[::2]])
    assert client.remove_many(keys) == [i % 2 == 0 for i in range(len(keys))]
    assert client.exists_many(keys)[1] == [False] * len(keys)
    assert client.remove_many([]) == []


# ---------------------------------------------------------------------------------- busy-polling receives

@pytest.mark.parametrize("bad", [-1, -0.5, 10_000.5, float("nan"), float("inf"), "100", None, True])
def test_a_bad_spin_us_is_refused_before_connecting(bad):
    port = free_port()                         # nothing listens there: a connect would fail otherwise
    with pytest.raises(InvalidArgument, match="spin_us"):
        Client(f"127.0.0.1:{port}", spin_us=bad)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="receives poll only on a machine of 2+ CPUs")
def test_receives_poll_by_default_and_catch_a_local_nodes_replies_byte_exact(daemon):
    values = {i: content(i, size) for i, size in enumerate((1, 1000, 4096, 65536, 300_000))}
    with Client(daemon.addr) as c:
        assert c.spin_us == 100.0
        for _ in range(20):
            for i, v in values.items():
                c.put(key(i, prefix="spin"), v)
                assert c.get(key(i, prefix="spin")) == v
        got = c.get_many([key(i, prefix="spin") for i in values])
        assert [bytes(g) for g in got] == list(values.values())
        stats = c.receive_stats()
    # a local node answers within the poll (how often depends on the machine's load; a client
    # that never polled would catch none)
    assert stats["caught"] >= 20
    assert stats["caught"] + stats["missed"] + stats["skipped"] > 0


def test_spin_us_zero_sleeps_at_once_and_reads_the_same_bytes(daemon):
    v = content(7, 70_000)
    with Client(daemon.addr, spin_us=0) as c:
        c.put(key(7, prefix="nospin"), v)
        for _ in range(50):
            assert c.get(key(7, prefix="nospin")) == v
        assert c.receive_stats() == {"spin_us": 0.0, "caught": 0, "missed": 0, "skipped": 0}


def test_a_mute_node_still_times_out_on_time_while_receives_poll():
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = []
    th = threading.Thread(target=lambda: accepted.append(srv.accept()[0]))
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises((Timeout, ConnectionLost)):
            Client(f"127.0.0.1:{srv.getsockname()[1]}", timeout=0.3, spin_us=10_000)   # HELLO never answered
        assert time.monotonic() - t0 < 3.0
    finally:
        th.join()
        for s in accepted:
            s.close()
        srv.close()
