"""The work a single PUT and a single GET cost: counted in calls of the project's own Python,
not timed (a timed test on a shared machine measures its neighbours).

The node side runs a real ``NodeServer`` over a real DRAM store on a real transport (a
socketpair accepted by the event loop), fed frame by frame from the other end; the client side
a real ``Client`` against a real daemon.  Each bound is at or a little above what the path costs
today and well below what the general way costs (docs/benchmarks.md, run R): a PUT through
``_exec`` on the client (26 calls) or through the node before its own path (43) fails here.
"""
from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from quillcache import Client
from quillcache._native.codec import encode_frame_header, encode_key_body
from quillcache.model import KvBlockKey
from quillcache.node.server import NodeServer
from quillcache.protocol import messages
from quillcache.protocol.opcodes import Opcode
from quillcache.store.options import StoreOptions
from quillcache.store.tiers import LocalKvStore
from tests._support.daemon import Daemon
from tests._support.data import content, key

NODE_PUT_CALLS = 28         # 27 on an open node, 2026-11-28 (43 before the node's PUT path)
NODE_GET_CALLS = 27         # 27 (33 on 2026-11-27)
CLIENT_PUT_CALLS = 19       # 16 (26 the general way, through _exec)
CLIENT_GET_CALLS = 22       # 19


class OwnCalls:
    """Inside ``with``: the calls of quillcache's own Python functions, in order (``names``)."""

    MARKER = os.sep + "quillcache" + os.sep

    def __init__(self) -> None:
        self.names: list[str] = []

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and self.MARKER in frame.f_code.co_filename:
            self.names.append(frame.f_code.co_name)

    def __enter__(self) -> "OwnCalls":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def test_the_node_answers_a_put_and_a_get_in_few_calls_of_its_own():
    async def main():
        store = LocalKvStore(StoreOptions(64 << 20, max_block_bytes=1 << 20))
        node = NodeServer(store)
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(node.protocol_factory, ours)
        theirs.setblocking(False)
        k = KvBlockKey("m", "t", None, "default", "root", "request-path", 0, 64)
        value = content(1, 1000)
        body = messages.encode_put_request(k.encoded(), len(value))

        def put(rid):
            return encode_frame_header(Opcode.PUT, rid, header=body, payload_length=len(value)) + value

        def get(rid):
            return encode_frame_header(Opcode.GET, rid, header=encode_key_body(k.encoded(), 4096))

        async def round_trip(frame) -> bytes:
            await loop.sock_sendall(theirs, frame)
            return await loop.sock_recv(theirs, 65536)

        for rid in (1, 3):                       # warm: the key cached, the entry made
            await round_trip(put(rid))
            await round_trip(get(rid + 1))
        counted = {}
        for name, frame in (("PUT", put(5)), ("GET", get(6))):
            with OwnCalls() as calls:
                reply = await round_trip(frame)
            assert reply                            # answered while counted
            counted[name] = calls.names
        transport.close()
        theirs.close()
        await store.close()
        return counted

    counted = asyncio.run(main())
    assert "_on_put_start" in counted["PUT"] and "_ack_put" in counted["PUT"]
    assert "_write_get" in counted["GET"]
    assert len(counted["PUT"]) <= NODE_PUT_CALLS, counted["PUT"]
    assert len(counted["GET"]) <= NODE_GET_CALLS, counted["GET"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("request-path")).start()
    yield d
    assert d.stop() == 0


def test_the_client_puts_and_gets_in_few_calls_of_its_own(daemon):
    with Client(daemon.addr) as c:
        k, value = key(1, prefix="request-path"), content(2, 1000)
        c.put(k, value)
        c.get(k)
        with OwnCalls() as calls:
            c.put(k, value)
        put_calls = calls.names
        with OwnCalls() as calls:
            c.get(k)
        get_calls = calls.names
        assert "send_bare" in put_calls and "_exec" not in put_calls, put_calls
        assert len(put_calls) <= CLIENT_PUT_CALLS, put_calls
        assert len(get_calls) <= CLIENT_GET_CALLS, get_calls
        assert c.get(k) == value
