"""Batched calls split at the server's header limit as well as its key count.

A node's default ``[limits] max_header`` is 64 KiB and its ``max_batch`` 1,024 keys.  A
1,024-key batch of ordinary keys (an 8B model's scope, ~150 bytes encoded) is a 150 KiB header,
which the client used to refuse outright ("header body of 155652 bytes, the server allows
65536").  Found on the GPU machine: the vLLM bench's clean-up of 512 blocks failed that way.
Every batched call now sizes its requests by the longest key: tested over TCP, over the mapped
arena, and with the async client, against real quillcached daemons (the default limits, and a
4 KiB header limit that forces hundreds of requests per call).  The 4 KiB case also found the
sync client's in-flight window letting request 257 out: it waited for one earlier reply per
send, which may already have been in, so nothing freed a place (Busy)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from quillcache import AsyncClient, Client, KvBlockKey
from quillcache.client.calls import keys_per_request
from quillcache.protocol.opcodes import ProtocolLimits
from tests._support.daemon import Daemon

N = 1024                                  # the node's max_batch


def keys(n: int, tag: str, long_every: int = 0) -> list[KvBlockKey]:
    out = []
    for i in range(n):
        if long_every and i % long_every == 0:            # every field at its 255-byte limit: ~1.3 KiB
            out.append(KvBlockKey("m" * 255, "t" * 255, "a" * 255, "n" * 255, tag + "s" * 200, f"{i:064x}", 0, 16))
        else:
            out.append(KvBlockKey("meta-llama/Llama-3.1-8B-Instruct", "tok-sha-0123456789abcdef", None, "tenant-a",
                                  tag, f"{i:064x}", 0, 16))
    return out


def value(i: int) -> bytes:
    return i.to_bytes(4, "big") * (8 + i % 5)


@pytest.fixture(scope="module", params=["64KiB", "4KiB"])
def node(request, tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("batches"), sections={"limits": f'max_header = "{request.param}"'}) as d:
        yield d


def run_all(c: Client, ks: list[KvBlockKey]) -> None:
    c.put_many([(k, value(i)) for i, k in enumerate(ks)])
    assert c.exists_many(ks) == (len(ks), [True] * len(ks))
    got = c.get_many(ks)
    assert [bytes(v) for v in got] == [value(i) for i in range(len(ks))]
    bufs = [np.zeros(64, dtype=np.uint8) for _ in ks]
    assert c.get_many_into(ks, bufs) == [len(value(i)) for i in range(len(ks))]
    assert all(bytes(b[:len(value(i))]) == value(i) for i, b in enumerate(bufs))
    assert c.remove_many(ks) == [True] * len(ks)
    assert c.exists_many(ks)[0] == 0


@pytest.mark.parametrize("long_every", [0, 97])
def test_a_full_batch_of_ordinary_keys_goes_through_every_batched_call_over_tcp(node, long_every):
    with Client(node.addr) as c:
        run_all(c, keys(N, f"tcp{long_every}", long_every))


def test_the_same_over_the_mapped_arena(node):
    with Client(f"unix:{node.data_dir / 'quillcached.sock'}") as c:
        assert c.shm
        ks = keys(N, "shm", 131)
        run_all(c, ks)
        with c.put_many_reserved([(k, 16) for k in ks]) as slots:
            for i, s in enumerate(slots):
                s[:] = i.to_bytes(16, "big")
        with c.get_many_located(ks) as views:
            assert [bytes(v) for v in views] == [i.to_bytes(16, "big") for i in range(N)]


def test_the_same_with_the_async_client(node):
    async def main():
        async with AsyncClient(node.addr) as c:
            ks = keys(N, "aio", 61)
            await c.put_many([(k, value(i)) for i, k in enumerate(ks)])
            assert [bytes(v) for v in await c.get_many(ks)] == [value(i) for i in range(N)]
            assert (await c.exists_many(ks))[0] == N
            assert await c.remove_many(ks) == [True] * N
    asyncio.run(main())


def test_keys_per_request_is_bounded_by_count_and_by_header_bytes():
    lim = ProtocolLimits(max_header_bytes=65536, max_batch=1024)
    short = [b"k" * 20] * 2000
    assert keys_per_request(short, lim) == 1024                         # the count binds
    long = [b"k" * 150] * 2000
    per = keys_per_request(long, lim)
    assert per < 1024 and 16 + per * 152 <= 65536 < 16 + (per + 1) * 152   # the header binds
    assert keys_per_request([b"k" * 150, b"k" * 4000], lim) == (65536 - 16) // 4002   # by the longest
    assert keys_per_request([b"k" * 70000], lim) == 1                   # the encoder names what is wrong
    assert keys_per_request([], lim) == 1024
