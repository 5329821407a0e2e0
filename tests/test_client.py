"""The client library (sync Client and AsyncClient) against a real quillcached."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from quillcache import AsyncClient, Client, KvBlockKey
from quillcache.errors import ConnectionLost, InvalidArgument, NotFound, QuillCacheError, Timeout
from quillcache.store.tiers import LocalKvStore
from tests.conftest import free_port
from tests.test_daemon import Daemon, content, key


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
    local = LocalKvStore(1 << 20)
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
