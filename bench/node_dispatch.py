"""The node's own Python per request: a real ``NodeServer`` and ``ServerProtocol`` over a real
DRAM store, fed whole frames through ``get_buffer``/``buffer_updated`` as uvloop feeds them,
its replies written to a transport that only counts them.  No socket, no kernel, no loop:
what is left is the request dispatch (frame events, access checks, key cache, store calls,
reply header, metrics), the part the node adds to every round trip in Python.

    .venv/bin/python bench/node_dispatch.py [--size 1024] [--keys 20000] [--rounds 5]

Baseline, measured in the same run: the store's own work for the same request, called
directly (PUT: ``reserve_columns_nowait`` + the payload copy + ``put_end_many_nowait``;
GET: ``get_nowait`` + the lease's release).  The ratio is what the dispatch costs on top
of it.  End to end, against Redis, see ``bench/vs_peers.py`` (docs/benchmarks.md, run R).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from quillcache._native.codec import encode_frame_header, encode_key_body
from quillcache.model import KvBlockKey
from quillcache.node.server import NodeServer
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from quillcache.store.options import StoreOptions
from quillcache.store.tiers import LocalKvStore


class CountingTransport:
    """What ``ServerProtocol`` calls on its transport; every write is counted, none is sent."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data) -> None:
        self.writes += 1

    def writelines(self, parts) -> None:
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def best_of(rounds: int, fn) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


async def run(size: int, nkeys: int, rounds: int) -> None:
    store = LocalKvStore(StoreOptions(max(256 << 20, 4 * size * nkeys), max_block_bytes=max(size, 1 << 20)))
    node = NodeServer(store)
    conn = node.protocol_factory()
    transport = CountingTransport()
    conn.connection_made(transport)
    keys = [KvBlockKey("bench-model", "bench-tok", None, "default", "root", f"k{i}", 0, 64) for i in range(nkeys)]
    value = os.urandom(size)
    puts = [encode_frame_header(Opcode.PUT, i % 60000 + 1, header=messages.encode_put_request(k.encoded(), size),
                                payload_length=size) + value for i, k in enumerate(keys)]
    gets = [encode_frame_header(Opcode.GET, i % 60000 + 1, header=encode_key_body(k.encoded(), 4096))
            for i, k in enumerate(keys)]

    def feed(frames):
        before = transport.writes
        for f in frames:
            mv, off = memoryview(f), 0
            while off < len(f):                 # as the socket would: at most what get_buffer offers
                buf = conn.get_buffer(-1)
                n = min(len(buf), len(f) - off)
                buf[:n] = mv[off:off + n]
                conn.buffer_updated(n)
                off += n
        if transport.writes - before != len(frames):
            raise AssertionError(f"{len(frames)} requests, {transport.writes - before} replies")

    def store_puts():
        for k in keys:
            handles = store.reserve_columns_nowait([k], [size])
            handles[0].view[:] = value
            store.put_end_many_nowait(handles)

    def store_gets():
        for k in keys:
            store.get_nowait(k).release()

    feed(puts)                                      # every key present; the key cache warm
    rows = [("PUT", best_of(rounds, lambda: feed(puts)), best_of(rounds, store_puts)),
            ("GET", best_of(rounds, lambda: feed(gets)), best_of(rounds, store_gets))]
    print(f"node dispatch, {size}-byte values, {nkeys} keys, best of {rounds} passes (us per request)")
    print(f"{'op':4s} {'through the node':>17s} {'store alone':>12s} {'ratio':>7s}")
    for op, node_s, store_s in rows:
        print(f"{op:4s} {node_s / nkeys * 1e6:17.2f} {store_s / nkeys * 1e6:12.2f} {node_s / store_s:6.2f}x")
    await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(run(args.size, args.keys, args.rounds))


if __name__ == "__main__":
    main()
