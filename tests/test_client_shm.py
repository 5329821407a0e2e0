"""The shared-memory data path against a real quillcached: the Unix socket, MAP (the
arena fd by SCM_RIGHTS), located GETs and reserved PUTs, trust, and the faults (a mapped
client killed with -9, a daemon restart under a mapping)."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from quillcache import AsyncClient, Client, KvBlockKey
from quillcache.client.calls import SHM_PUT_MIN_BYTES
from quillcache.client.shm import check_lease, release_flow
from quillcache.settings.convert import hash_token
from quillcache.errors import ConnectionLost, InvalidArgument, NotFound, PermissionDenied, Timeout
from tests._support.daemon import Daemon

BLOCK = 64 << 10


def key(i: int, tenant: str = "t0", model: str = "m") -> KvBlockKey:
    return KvBlockKey(model, "tok", None, tenant, "p", f"b{i}", 0, 16)


def content(i: int, size: int = BLOCK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def unix_addr(d: Daemon) -> str:
    return f"unix:{d.data_dir / 'quillcached.sock'}"


def server_info(d: Daemon) -> dict:
    with Client(d.addr) as c:
        return c.info()["Server"]


def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture
def node(tmp_path):
    with Daemon(tmp_path) as d:
        yield d


def test_unix_client_maps_the_arena_and_every_call_round_trips_with_tcp(node):
    sock = node.data_dir / "quillcached.sock"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    with Client(unix_addr(node)) as u, Client(node.addr) as t:
        assert u.shm and not t.shm
        u.put(key(0), content(0))
        assert t.get(key(0)) == content(0)                      # written through the mapping
        t.put(key(1), content(1))
        assert u.get(key(1)) == content(1)
        buf = np.zeros(BLOCK * 2, np.uint8)
        assert u.get_into(key(1), buf) == BLOCK and buf[:BLOCK].tobytes() == content(1)
        u.put_many([(key(i), content(i)) for i in range(2, 10)])
        bufs = [np.zeros(BLOCK, np.uint8) for _ in range(10)]
        got = u.get_many_into([key(i) for i in range(10)] + [key(99)], bufs + [np.zeros(8, np.uint8)])
        assert got == [BLOCK] * 10 + [None]
        assert all(b.tobytes() == content(i) for i, b in enumerate(bufs))
        assert t.get_many([key(i) for i in range(10)]) == [content(i) for i in range(10)]
        with pytest.raises(NotFound):
            u.get(key(99))
        with pytest.raises(PermissionDenied):                   # MAP is for the Unix socket only
            t._exec(t._map_req())
    assert server_info(node)["located_leases"] == 0


def test_encoded_keys_of_a_batch_are_encoded_key_of_each_and_a_bad_key_is_named(node):
    from quillcache.errors import InvalidArgument
    from quillcache.model import encode_key
    with Client(node.addr) as c:
        keys = [key(i) for i in (1, 2, 1, 3)]
        assert c.encoded_keys(keys) == [encode_key(k) for k in keys]
        assert c.encoded_keys(iter(keys)) == [encode_key(k) for k in keys]
        for bad in ("k", ["unhashable"]):
            with pytest.raises(InvalidArgument, match="must be a KvBlockKey"):
                c.encoded_keys([key(1), bad])


def test_located_views_are_read_only_and_leaving_releases_the_lease(node):
    with Client(unix_addr(node)) as u:
        u.put_many([(key(i), content(i)) for i in range(4)])
        with u.get_many_located([key(0), key(7), key(3)]) as views:
            assert views[1] is None and views.extents[1] is None
            assert bytes(views[0]) == content(0) and bytes(views[2]) == content(3)
            assert views[0].readonly
            with pytest.raises(TypeError):
                views[0][0] = 1
            assert server_info(node)["located_leases"] == 2
            # a held lease keeps the block in place: a replacement goes to another slot
            u.put(key(0), content(50))
            assert bytes(views[0]) == content(0)
        assert server_info(node)["located_leases"] == 0
        with pytest.raises(ValueError):                         # the views end with the lease
            bytes(views[0])
        assert u.get(key(0)) == content(50)


def test_a_located_get_sends_its_release_without_waiting_and_every_lease_ends(node):
    """get / get_into / get_many_into over the mapping post their RELEASE (calls.Post): the
    call returns after one round trip, the node frees the leases as it reads the request,
    and the replies nobody waited for are read on the way by the next call's wait."""
    with Client(unix_addr(node)) as u:
        assert u.shm
        u.put_many([(key(i), content(i)) for i in range(4)])
        buf = np.zeros(BLOCK, np.uint8)
        bufs = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
        for r in range(150):
            i = r % 4
            assert u.get_into(key(i), buf) == BLOCK and buf.tobytes() == content(i)
            assert u.get(key(i)) == content(i)
            assert u.get_many_into([key(j) for j in range(4)] + [key(99)], bufs + [buf]) == [BLOCK] * 4 + [None]
            assert [b.tobytes() for b in bufs] == [content(j) for j in range(4)]
        with pytest.raises(InvalidArgument):                   # an error still releases
            u.get_into(key(0), np.zeros(8, np.uint8))
        wait_for(lambda: server_info(node)["located_leases"] == 0)     # no further request on u
        assert u.ping() > 0 and u.get(key(3)) == content(3)
        with Client(node.addr) as t:
            assert t.info()["Store"]["leases"] == 0


def test_a_posted_release_returns_without_its_answer_and_a_lost_answer_is_no_error(node):
    """A posted RELEASE (``release_flow(wait=False)``, what the located GETs send) returns
    at once even with the node stopped, where a waited one would wait for the answer; the
    node then killed, the sync client's next call is a clear ConnectionLost, and the async
    client retrieves the failed reply's future (asyncio logs nothing)."""
    with Client(unix_addr(node), timeout=2) as u:
        assert u.shm
        node.send(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            u._drive(release_flow(u, [123456789], wait=False))
            assert time.monotonic() - t0 < 1.0
            with pytest.raises(Timeout):                        # the waited form does wait
                u._drive(release_flow(u, [123456789]))
        finally:
            node.send(signal.SIGCONT)
    logged: list = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx))
        async with AsyncClient(unix_addr(node), timeout=2) as a:
            assert a.shm
            await a.put(key(1), content(1))
            node.send(signal.SIGSTOP)
            t0 = time.monotonic()
            await a._drive(release_flow(a, [123456789], wait=False))
            assert time.monotonic() - t0 < 1.0
            node.send(signal.SIGKILL)
            node.wait()
            with pytest.raises((ConnectionLost, Timeout)):
                await a.get(key(1))
        gc.collect()
    asyncio.run(main())
    assert logged == []


def test_a_mapped_client_puts_a_small_value_in_one_request_and_a_large_one_through_the_mapping(node):
    """Below SHM_PUT_MIN_BYTES one PUT over the socket (one round trip) beats RESERVE + COMMIT
    (two); from it up the value is copied into a reserved slot.  The node's request count
    tells which way each went; both read back byte for byte."""
    small, large = SHM_PUT_MIN_BYTES - 1, SHM_PUT_MIN_BYTES
    with Client(unix_addr(node)) as u, Client(node.addr) as t:
        assert u.shm

        def requests_of(fn) -> int:
            before = t.info()["Server"]["requests"]
            fn()
            return t.info()["Server"]["requests"] - before - 1      # less the INFO itself
        assert requests_of(lambda: [u.put(key(i), content(i, small)) for i in range(5)]) == 5
        assert requests_of(lambda: [u.put(key(10 + i), content(i, large)) for i in range(5)]) == 10
        assert [u.get(key(i)) for i in range(5)] == [content(i, small) for i in range(5)]
        assert [t.get(key(10 + i)) for i in range(5)] == [content(i, large) for i in range(5)]


def test_reserved_slots_are_invisible_until_commit_and_an_exception_aborts(node):
    with Client(unix_addr(node)) as u, Client(node.addr) as t:
        with u.put_many_reserved([(key(i), BLOCK) for i in range(3)]) as views:
            for i, v in enumerate(views):
                v[:] = content(i)
            assert server_info(node)["located_reserves"] == 3
            for i in range(3):
                with pytest.raises(NotFound):                   # a slot being written is never served
                    t.get(key(i))
        assert [bytes(t.get(key(i))) for i in range(3)] == [content(i) for i in range(3)]
        with pytest.raises(RuntimeError):
            with u.put_many_reserved([(key(5), BLOCK)]) as views:
                views[0][:] = content(5)
                raise RuntimeError("the writer fails half way")
        assert server_info(node)["located_reserves"] == 0
        with pytest.raises(NotFound):
            t.get(key(5))


def test_tcp_and_untrusted_clients_fall_back_to_copies(tmp_path):
    tenants = (f'[[auth.tenants]]\nname = "eng"\ntoken = "{hash_token("e")}"\nshm = true\n'
               f'[[auth.tenants]]\nname = "web"\ntoken = "{hash_token("w")}"\n')
    d = Daemon(tmp_path)
    d.config.write_text(d.config.read_text() + tenants)
    with d:
        with Client(unix_addr(d), token="w") as web, Client(unix_addr(d), token="e") as eng, \
                Client(d.addr, token="e") as tcp:
            assert eng.shm and not web.shm and not tcp.shm
            assert "may not map" in web.shm_refused
            web.put(key(1, "web"), content(1))                  # the copy path over the same socket
            assert web.get(key(1, "web")) == content(1)
            for c in (web, tcp):
                tenant = "web" if c is web else "eng"
                with c.put_many_reserved([(key(2, tenant), 100)]) as views:
                    views[0][:] = content(2, 100)
                with c.get_many_located([key(2, tenant), key(3, tenant)]) as views:
                    assert bytes(views[0]) == content(2, 100) and views[1] is None
                    assert views[0].readonly
            eng.put(key(4, "eng"), content(4))
            # the tenant check runs on located requests exactly as on GET_MANY over TCP
            for c in (eng, tcp):
                with pytest.raises(PermissionDenied):
                    with c.get_many_located([key(1, "web")]):
                        pass
            with eng.get_many_located([key(4, "eng"), key(4, "eng", model="other")]) as views:
                assert bytes(views[0]) == content(4) and views[1] is None    # the guard: a miss


def test_async_client_maps_and_round_trips(node):
    async def main():
        async with AsyncClient(unix_addr(node)) as a:
            assert a.shm
            await a.put_many([(key(i), content(i)) for i in range(4)])
            bufs = [bytearray(BLOCK) for _ in range(4)]
            assert await a.get_many_into([key(i) for i in range(4)], bufs) == [BLOCK] * 4
            assert [bytes(b) for b in bufs] == [content(i) for i in range(4)]
            async with a.get_many_located([key(2)]) as views:
                assert bytes(views[0]) == content(2)
            async with a.put_many_reserved([(key(9), 10)]) as views:
                views[0][:] = b"0123456789"
            assert await a.get(key(9)) == b"0123456789"
            assert await a.ping() > 0
    asyncio.run(main())
    assert server_info(node)["located_leases"] == 0


def test_async_located_and_reserved_abort_and_fall_back_as_the_sync_client_does(node):
    """The steps of both context managers exist once (shm.LocatedRead, shm.ReservedWrite):
    the async client aborts on an exception and falls back to copies over TCP like Client."""
    async def main():
        async with AsyncClient(unix_addr(node)) as u, AsyncClient(node.addr) as t:
            with pytest.raises(RuntimeError):
                async with u.put_many_reserved([(key(20), BLOCK), (key(21), BLOCK)]) as views:
                    views[0][:] = content(20)
                    raise RuntimeError("the writer fails half way")
            assert server_info(node)["located_reserves"] == 0
            for k in (key(20), key(21)):
                with pytest.raises(NotFound):
                    await t.get(k)
            async with t.put_many_reserved([(key(22), 100)]) as views:    # TCP: plain buffers
                assert not t.shm
                views[0][:] = content(22, 100)
            async with t.get_many_located([key(22), key(23)]) as views:
                assert bytes(views[0]) == content(22, 100) and views[0].readonly and views[1] is None
            async with u.get_many_located([key(22), key(23)]) as views:
                assert bytes(views[0]) == content(22, 100) and views[1] is None
                assert server_info(node)["located_leases"] == 1
    asyncio.run(main())
    assert server_info(node)["located_leases"] == 0


_HOLDER = textwrap.dedent("""
    import sys, time
    from quillcache import Client, KvBlockKey
    key = lambda i: KvBlockKey("m", "tok", None, "t0", "p", f"b{i}", 0, 16)
    c = Client(sys.argv[1])
    assert c.shm
    located = c.get_many_located([key(i) for i in range(8)])
    views = located.__enter__()
    reserved = c.put_many_reserved([(key(100 + i), 65536) for i in range(8)])
    slots = reserved.__enter__()
    for v in slots[:4]:
        v[:] = b"x" * 65536                      # half the batch written
    print("ready", flush=True)
    time.sleep(60)
""")


def test_kill9_of_a_mapped_client_mid_batch_releases_its_leases_and_reaps_its_reserves(node):
    with Client(unix_addr(node)) as u:
        u.put_many([(key(i), content(i)) for i in range(8)])
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, unix_addr(node)], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            info = server_info(node)
            assert info["located_leases"] == 8 and info["located_reserves"] == 8
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        wait_for(lambda: server_info(node)["mapped_connections"] == 1)
        info = server_info(node)
        assert info["located_leases"] == 0 and info["located_reserves"] == 0
        with Client(node.addr) as t:
            assert t.info()["Store"]["leases"] == 0 and t.info()["Store"]["puts_in_flight"] == 0
            assert t.get_many([key(100 + i) for i in range(8)]) == [None] * 8   # never published
        u.put_many([(key(100 + i), content(i)) for i in range(8)])          # the keys work again
        assert [u.get(key(100 + i)) for i in range(8)] == [content(i) for i in range(8)]


def test_a_daemon_restart_under_a_mapping_is_a_clear_error_and_reconnect_remaps(node):
    c = Client(unix_addr(node))
    try:
        c.put(key(1), content(1))
        old = c._arena.id
        node.stop()
        node.start()
        with pytest.raises(ConnectionLost, match="reconnect"):
            c.get(key(1))
        c.reconnect()
        assert c.shm and c._arena.id != old
        with pytest.raises(NotFound):                           # DRAM only: the old arena is gone
            c.get(key(1))
        c.put(key(2), content(2))
        assert c.get(key(2)) == content(2)
    finally:
        c.close()


def test_a_lease_that_ran_out_while_the_bytes_were_read_raises_instead_of_returning_them():
    with pytest.raises(Timeout, match="ran out"):
        check_lease(time.monotonic_ns() - 1, "get")
    check_lease(time.monotonic_ns() + 10**9, "get")


def test_durable_reserved_puts_survive_a_restart_and_ssd_only_blocks_are_promoted_when_located(tmp_path):
    with Daemon(tmp_path, ssd=True) as d:
        with Client(unix_addr(d)) as u:
            assert u.shm
            u.put_many([(key(i), content(i)) for i in range(4)], durable=True)   # reserve, copy, COMMIT
        d.stop()
        d.start()                                               # DRAM is empty: the blocks are on SSD only
        with Client(unix_addr(d)) as u:
            with u.get_many_located([key(i) for i in range(4)]) as views:
                assert [bytes(v) for v in views] == [content(i) for i in range(4)]
            tiers = u.info()["Tiers"]
            assert tiers["dram_promotions"] >= 4
