"""The bytes API of the clients: what ``get()`` and ``get_many()`` hand out is received into
once and never changes afterwards (docs/protocol.md, "Which calls copy")."""
from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from quillcache import AsyncClient, Client
from quillcache.errors import NotFound
from tests._support.daemon import Daemon
from tests._support.data import content, key

SIZES = (1, 1024, 64 << 10, 256 << 10, 4 << 20)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("client-bytes"), dram="256MiB").start()
    yield d
    assert d.stop() == 0


@pytest.fixture
def client(daemon):
    with Client(daemon.addr) as c:
        yield c


def test_a_returned_bytes_never_changes_across_further_gets(client):
    items = {size: [(key(i, prefix=f"hold{size}"), content(1000 * size + i, size)) for i in range(3)]
             for size in SIZES}
    for pairs in items.values():
        client.put_many(pairs)
    held = {size: client.get(pairs[0][0]) for size, pairs in items.items()}
    snapshot = {size: bytes(bytearray(v)) for size, v in held.items()}     # an independent copy
    assert all(type(v) is bytes for v in held.values())
    for _ in range(5):                          # the same sizes again: any reuse of a buffer would show
        for size, pairs in items.items():
            for k, data in pairs[1:]:
                assert client.get(k) == data
                buf = bytearray(size)
                assert client.get_into(k, buf) == size
            with pytest.raises(NotFound):
                client.get(key(99, prefix=f"hold{size}"))
            client.put(pairs[0][0], content(7, size))               # the stored block itself changes
    assert held == snapshot
    assert all(held[size] == pairs[0][1] for size, pairs in items.items())


def test_get_many_values_never_change_across_further_gets(client):
    pairs = [(key(i, prefix="hold-many"), content(50 + i, 16 << 10)) for i in range(40)]
    others = [(key(i, prefix="hold-many-2"), content(150 + i, 16 << 10)) for i in range(40)]
    client.put_many(pairs + others)
    held = client.get_many([k for k, _ in pairs])
    for _ in range(3):
        assert client.get_many([k for k, _ in others[::-1]]) == [d for _, d in others[::-1]]
        client.put_many([(k, content(9, 16 << 10)) for k, _ in pairs])     # the stored blocks change
    assert [bytes(v) for v in held] == [d for _, d in pairs]


def test_get_allocates_the_value_once(client):
    size = 4 << 20
    k = key(1, prefix="alloc-once")
    client.put(k, content(3, size))
    client.get(k)                                # warm: the parser's own buffers exist
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = client.get(k)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert got == content(3, size)
    assert peak < size + (256 << 10)             # a bytearray received into, then copied, is two


def test_put_of_bytes_sends_the_callers_buffer_without_a_copy(client):
    size = 4 << 20
    data = content(4, size)
    k = key(2, prefix="put-no-copy")
    client.put(k, data)                          # warm: the key's encoding is cached
    client.put_many([(key(3, prefix="put-no-copy"), data)])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        client.put(k, data)
        client.put_many([(key(3, prefix="put-no-copy"), data), (k, data)])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10                       # frame headers and bookkeeping, never the value
    assert client.get(k) == data


def test_async_get_returns_bytes_that_never_change(daemon):
    async def main():
        async with AsyncClient(daemon.addr) as c:
            pairs = [(key(i, prefix="async-hold"), content(300 + i, 256 << 10)) for i in range(4)]
            await c.put_many(pairs)
            first = await c.get(pairs[0][0])
            assert type(first) is bytes
            for _ in range(5):
                got = await asyncio.gather(*(c.get(k) for k, _ in pairs[1:]))
                assert got == [d for _, d in pairs[1:]]
                await c.put(pairs[0][0], content(8, 256 << 10))
            return first, pairs[0][1]

    first, want = asyncio.run(main())
    assert first == want

