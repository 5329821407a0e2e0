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


# ---------------------------------------------------------------- replies over max_payload

MIB = 1 << 20


@pytest.fixture(scope="module")
def small_frames(tmp_path_factory):
    """A node whose frames carry at most 4 MiB: ten 1 MiB values are two and a half replies."""
    with Daemon(tmp_path_factory.mktemp("frames"), dram="64MiB", max_block="2MiB",
                sections={"limits": 'max_payload = "4MiB"'}) as d:
        yield d


def big(i: int, n: int = MIB) -> bytes:
    return (i.to_bytes(2, "big") * (n // 2))[:n]


def test_the_node_cuts_a_get_many_reply_at_max_payload_and_the_client_asks_for_the_rest(small_frames):
    from quillcache.protocol import messages
    from quillcache.protocol.opcodes import Opcode
    ks = keys(10, "cut")
    with Client(small_frames.addr) as c:
        c.put_many([(k, big(i)) for i, k in enumerate(ks)])       # PUT_MANY was already split at max_payload
        raw = c.call(Opcode.GET_MANY, messages.encode_keys_request([c.encoded_key(k) for k in ks], c.limits))
        items = messages.decode_get_many_reply(raw.header, len(raw.payload), c.limits)
        assert [st for st, _ in items] == [0] * 4 and len(raw.payload) == 4 * MIB   # a prefix that fits
        got = c.get_many(ks + keys(1, "absent"))
        assert [bytes(v) for v in got[:10]] == [big(i) for i in range(10)] and got[10] is None
        bufs = [bytearray(MIB) for _ in ks]
        assert c.get_many_into(ks, bufs) == [MIB] * 10 and bufs == [bytearray(big(i)) for i in range(10)]


def test_the_same_over_the_unix_socket_and_with_the_async_client(small_frames):
    ks = keys(10, "cut2")
    with Client(f"unix:{small_frames.data_dir / 'quillcached.sock'}") as c:
        c.put_many([(k, big(i)) for i, k in enumerate(ks)])       # RESERVE split at max_payload too
        assert [bytes(v) for v in c.get_many(ks)] == [big(i) for i in range(10)]
        with c.get_many_located(ks) as views:
            assert [bytes(v) for v in views] == [big(i) for i in range(10)]

    async def main():
        async with AsyncClient(small_frames.addr) as a:
            assert [bytes(v) for v in await a.get_many(ks)] == [big(i) for i in range(10)]
    asyncio.run(main())


def test_a_client_takes_replies_up_to_the_servers_max_payload_not_only_its_own_default(tmp_path):
    """The client's own default is 256 MiB; a node announcing more may send a GET_MANY reply
    that large, and the client takes it instead of dropping the connection."""
    n = 96 * MIB
    with Daemon(tmp_path, dram="512MiB", max_block="128MiB", sections={"limits": 'max_payload = "320MiB"'}) as d:
        ks = keys(3, "large")
        with Client(d.addr, timeout=60) as c:
            assert c.limits.max_payload_bytes == 320 * MIB
            c.put_many([(k, big(i, n)) for i, k in enumerate(ks)])
            got = c.get_many(ks)                                  # one reply of 288 MiB
            assert [len(v) for v in got] == [n] * 3 and all(bytes(v[-2:]) == big(i, 2) for i, v in enumerate(got))


def test_put_many_over_the_mapping_of_more_blocks_than_the_node_lets_wait_for_commit(tmp_path):
    """Over the Unix socket put_many reserves slots, copies and commits; the node refuses
    more than max_inflight_puts (4,096) reserved at once, and a put_many of 5,000 blocks used
    to reserve every one first (Busy).  It now goes a window at a time; the async client too."""
    n = 5000
    with Daemon(tmp_path, dram="64MiB") as d:
        sock = f"unix:{d.data_dir / 'quillcached.sock'}"
        ks = keys(n, "window")
        with Client(sock) as c:
            assert c.shm
            c.put_many([(k, value(i)) for i, k in enumerate(ks)])
            assert [bytes(v) for v in c.get_many(ks)] == [value(i) for i in range(n)]
            assert c.remove_many(ks) == [True] * n

        async def main():
            async with AsyncClient(sock) as a:
                await a.put_many([(k, value(i)) for i, k in enumerate(ks)])
                assert (await a.exists_many(ks))[0] == n
        asyncio.run(main())


def test_a_buffer_too_small_is_named_by_its_position_in_the_callers_list(node):
    from quillcache.errors import InvalidArgument
    ks = keys(N + 500, "small")
    with Client(node.addr) as c:
        c.put_many([(k, value(i)) for i, k in enumerate(ks)])
        bufs = [np.zeros(64, dtype=np.uint8) for _ in ks]
        bufs[1300] = np.zeros(2, dtype=np.uint8)
        with pytest.raises(InvalidArgument, match="buffer 1300 has 2 bytes"):
            c.get_many_into(ks, bufs)
        c.remove_many(ks)
