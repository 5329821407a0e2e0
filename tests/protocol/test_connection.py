"""The sans-I/O connections: a client and a server wired back to back in memory.

The server here is a small dict-backed store written on the hooks the way the real
server will be: PUT payloads land in slots it hands out, GET replies send views.
"""
import os
import struct

import pytest

from quillcache._native.codec import FLAG_PAYLOAD_CRC, encode_frame_header
from quillcache.errors import (
    Busy, ConnectionLost, InvalidArgument, NotFound, PermissionDenied, ProtocolError,
)
from quillcache.model import KvBlockKey, encode_key
from quillcache.protocol import messages as m
from quillcache.protocol.connection import (
    DEFER, PREAUTH_HEADER_BYTES, PREAUTH_READ_CHUNK, ClientProtocolConnection, ProtocolConnection,
)
from quillcache.protocol.opcodes import Opcode, ProtocolLimits, Status

TOKEN = b"s3cret"


def key(i):
    return encode_key(KvBlockKey("llama-3-8b", "tok", None, "tenant-a", "root", f"h{i}", i))


class StoreServer(ProtocolConnection):
    def __init__(self, limits=None, **kw):
        super().__init__(limits, **kw)
        self.out = []
        self.store = {}
        self.slots = {}
        self.aborted = []
        self.errors = []
        self.hold = False
        self.held = []

    def _write(self, data):
        self.out.append(b"".join(bytes(x) for x in data))

    def _on_error(self, exc):
        self.errors.append(exc)

    def _on_request(self, frame):
        if self.hold and frame.opcode == Opcode.GET:
            self.held.append(frame)
            return
        self.serve(frame)

    def serve(self, frame):
        rid, op = frame.request_id, frame.opcode
        if op == Opcode.HELLO:
            req = m.decode_hello_request(frame.header, self.limits)
            if req.token != TOKEN:
                raise PermissionDenied("bad token")
            self.reply_ok(rid, op, m.encode_hello_reply(m.negotiate_version(req), "tenant-a", self.limits))
        elif op == Opcode.PING:
            self.reply_ok(rid, op, b"", [frame.payload] if frame.payload else [])
        elif op == Opcode.GET:
            k = m.decode_get_request(frame.header, self.limits)
            if k not in self.store:
                raise NotFound("no such block")
            self.reply_ok(rid, op, b"", [memoryview(self.store[k])], payload_crc=bool(frame.flags & FLAG_PAYLOAD_CRC))
        elif op == Opcode.GET_MANY:
            ks = m.decode_keys_request(frame.header, self.limits)
            items = [(0, len(self.store[k])) if k in self.store else (Status.NOT_FOUND, 0) for k in ks]
            self.reply_ok(rid, op, m.encode_get_many_reply(items), [self.store[k] for k in ks if k in self.store])
        elif op == Opcode.EXISTS:
            ks = m.decode_keys_request(frame.header, self.limits)
            self.reply_ok(rid, op, m.encode_exists_reply([k in self.store for k in ks]))
        else:
            raise InvalidArgument(f"test server does not serve {op}")

    def _on_put_start(self, frame):
        if frame.opcode == Opcode.PUT:
            item = m.decode_put_request(frame.header, frame.payload_length, self.limits)
            slot = bytearray(item.nbytes)
            self.slots[frame.request_id] = [(item.key, slot)]
            return slot
        items = m.decode_put_many_request(frame.header, frame.payload_length, self.limits)
        self.slots[frame.request_id] = [(it.key, bytearray(it.nbytes)) for it in items]
        return [slot for _, slot in self.slots[frame.request_id]]

    def _on_put_end(self, frame):
        for k, slot in self.slots.pop(frame.request_id):
            self.store[k] = slot
        if frame.opcode == Opcode.PUT:
            self.reply_ok(frame.request_id, Opcode.PUT)
        else:
            n = len(m.decode_put_many_request(frame.header))
            self.reply_ok(frame.request_id, Opcode.PUT_MANY, m.encode_status_list([0] * n))

    def _on_put_abort(self, frame, exc):
        self.slots.pop(frame.request_id, None)
        self.aborted.append((frame.request_id, exc))


class Client(ClientProtocolConnection):
    def __init__(self, limits=None):
        super().__init__(limits)
        self.out = []
        self.replies = {}
        self.order = []
        self.errors = []

    def _write(self, data):
        self.out.append(b"".join(bytes(x) for x in data))

    def _on_reply(self, reply):
        self.replies[reply.request_id] = reply
        self.order.append(reply.request_id)

    def _on_error(self, exc):
        self.errors.append(exc)


def deliver(conn, data, sizes=None):
    if sizes is None:
        conn.data_received(data)
        return
    pos, i = 0, 0
    while pos < len(data):
        view = conn.get_buffer(-1)
        n = min(len(view), sizes[i % len(sizes)], len(data) - pos)
        i += 1
        view[:n] = data[pos:pos + n]
        conn.buffer_updated(n)
        pos += n


def pump(client, server, sizes=None):
    while client.out or server.out:
        data, client.out = b"".join(client.out), []
        deliver(server, data, sizes)
        data, server.out = b"".join(server.out), []
        deliver(client, data, sizes)


def connect(limits=None, sizes=None):
    client, server = Client(), StoreServer(limits)
    rid = client.send_request(Opcode.HELLO, m.encode_hello_request(TOKEN, client_name="test"))
    pump(client, server, sizes)
    assert client.replies[rid].ok and server.hello_done and client.negotiated_version == 1
    return client, server


@pytest.mark.parametrize("sizes", [None, [1, 2, 3, 5, 8], [65536]])
def test_put_lands_in_the_slot_and_get_lands_in_the_callers_buffer(sizes):
    client, server = connect(sizes=sizes)
    blob = os.urandom(300_000)
    rid = client.send_request(Opcode.PUT, m.encode_put_request(key(1), len(blob)), [blob])
    pump(client, server, sizes)
    assert client.replies[rid].ok and bytes(server.store[key(1)]) == blob
    buf = bytearray(len(blob) + 10)
    rid = client.send_request(Opcode.GET, m.encode_get_request(key(1)), into=buf)
    pump(client, server, sizes)
    reply = client.replies[rid].raise_for_status()
    assert reply.payload.obj is buf and bytes(reply.payload) == blob and buf[:len(blob)] == blob
    assert server.in_flight == 0 and client.in_flight == 0


def test_hello_adopts_the_servers_limits_and_tenant():
    client, server = connect(ProtocolLimits(max_batch=8, max_in_flight=3))
    assert client.peer_limits.max_batch == 8 and client.peer_limits.max_in_flight == 3
    assert client.tenant_id == "tenant-a"


def test_bad_token_is_refused_and_a_good_one_then_logs_in_on_the_same_connection():
    client, server = Client(), StoreServer()
    bad = client.send_request(Opcode.HELLO, m.encode_hello_request(b"wrong"))
    pump(client, server)
    assert isinstance(client.replies[bad].error, PermissionDenied)
    assert not server.hello_done and server.failed is None
    assert server.parser.limits == (PREAUTH_HEADER_BYTES, 0, PREAUTH_READ_CHUNK)
    good = client.send_request(Opcode.HELLO, m.encode_hello_request(TOKEN))
    pump(client, server)
    assert client.replies[good].ok and server.hello_done
    limits = server.limits                  # logged in: the connection's own limits
    assert server.parser.limits[:2] == (limits.max_header_bytes, limits.max_payload_bytes)


@pytest.mark.parametrize("what", ["ping", "put", "get", "big_header"])
def test_before_hello_anything_but_a_small_hello_fails_the_connection_before_allocating(what):
    client, server = Client(), StoreServer()
    if what == "ping":
        client.send_request(Opcode.PING)
    elif what == "put":                     # a payload: the parser refuses its length (limit 0)
        client.send_request(Opcode.PUT, m.encode_put_request(key(1), 5), [b"hello"])
    elif what == "get":
        client.send_request(Opcode.GET, m.encode_get_request(key(1)))
    else:                                   # a header past the pre-login limit, claimed, never sent
        server.data_received(encode_frame_header(Opcode.HELLO, 1, header=bytes(PREAUTH_HEADER_BYTES + 1))[:28])
    pump(client, server)
    assert server.failed is not None and server.close_requested and not server.hello_done
    assert key(1) not in server.store
    assert server.parser.buffer_capacity <= 2 * PREAUTH_READ_CHUNK       # nothing grew for a claim
    if what != "big_header":
        assert client.failed is not None and client.failed.status in (PermissionDenied.status, ProtocolError.status)


def test_pipelined_replies_out_of_order_are_matched_by_request_id():
    client, server = connect()
    for i in range(5):
        server.store[key(i)] = bytearray(os.urandom(100 + i))
    server.hold = True
    bufs = [bytearray(200) for _ in range(5)]
    rids = [client.send_request(Opcode.GET, m.encode_get_request(key(i)), into=bufs[i]) for i in range(5)]
    pump(client, server)
    assert server.in_flight == 5 and not client.replies.keys() & set(rids)
    for frame in reversed(server.held):
        server.serve(frame)
    pump(client, server)
    assert client.order[-5:] == rids[::-1]
    for i, rid in enumerate(rids):
        assert bytes(client.replies[rid].payload) == bytes(server.store[key(i)])


def test_not_found_is_a_request_error_and_the_connection_goes_on():
    client, server = connect()
    rid = client.send_request(Opcode.GET, m.encode_get_request(key(9)))
    ping = client.send_request(Opcode.PING, b"", [b"echo"])
    pump(client, server)
    err = client.replies[rid].error
    assert isinstance(err, NotFound) and client.replies[rid].status == NotFound.status
    assert client.replies[ping].payload == b"echo" and server.failed is None


def test_put_many_payload_is_scattered_into_one_slot_per_key():
    client, server = connect()
    blobs = [os.urandom(n) for n in (10, 0, 4096, 3)]
    items = [(key(i), len(b)) for i, b in enumerate(blobs)]
    rid = client.send_request(Opcode.PUT_MANY, m.encode_put_many_request(items), blobs)
    pump(client, server, [1000])
    assert m.decode_status_list(client.replies[rid].header) == [0] * 4
    assert [bytes(server.store[key(i)]) for i in range(4)] == blobs


def test_get_many_receives_each_block_into_the_callers_buffers():
    client, server = connect()
    server.store[key(0)] = bytearray(b"a" * 50)
    server.store[key(2)] = bytearray(b"c" * 70)
    bufs = {i: bytearray(100) for i in range(3)}
    wanted = [key(0), key(1), key(2)]

    def place(frame):
        items = m.decode_get_many_reply(frame.header, frame.payload_length)
        return [memoryview(bufs[i])[:n] for i, (status, n) in enumerate(items) if status == 0]

    rid = client.send_request(Opcode.GET_MANY, m.encode_keys_request(wanted), into=place)
    pump(client, server)
    reply = client.replies[rid].raise_for_status()
    assert m.decode_get_many_reply(reply.header) == [(0, 50), (Status.NOT_FOUND, 0), (0, 70)]
    assert bufs[0][:50] == b"a" * 50 and bufs[2][:70] == b"c" * 70 and bufs[1] == bytearray(100)


def test_get_into_a_too_small_buffer_fails_only_that_request():
    client, server = connect()
    server.store[key(1)] = bytearray(1000)
    rid = client.send_request(Opcode.GET, m.encode_get_request(key(1)), into=bytearray(10))
    ok = client.send_request(Opcode.PING)
    pump(client, server)
    assert isinstance(client.replies[rid].error, InvalidArgument)
    assert client.replies[ok].ok and client.failed is None


def test_payload_crc_round_trips_both_ways():
    client, server = connect()
    blob = os.urandom(5000)
    rid = client.send_request(Opcode.PUT, m.encode_put_request(key(1), len(blob)), [blob], payload_crc=True)
    pump(client, server)
    assert client.replies[rid].ok
    rid = client.send_request(Opcode.GET, m.encode_get_request(key(1)), payload_crc=True)
    pump(client, server)
    assert client.replies[rid].payload == blob


def test_corrupt_payload_aborts_the_put_replies_error_with_id_0_and_closes():
    client, server = connect()
    blob = bytearray(os.urandom(2000))
    client.send_request(Opcode.PUT, m.encode_put_request(key(1), len(blob)), [blob], payload_crc=True)
    wire = bytearray(b"".join(client.out))
    client.out.clear()
    wire[-10] ^= 0xFF                        # flip payload bits in flight
    server.data_received(bytes(wire))
    assert isinstance(server.failed, ProtocolError) and server.failed.reason == "bad_payload_crc"
    assert server.close_requested and server.errors == [server.failed]
    assert [rid for rid, _ in server.aborted] == [2] and not server.slots and key(1) not in server.store
    # The ERROR reply names the connection (request id 0) and carries status 7.
    (reply,) = server.out
    assert struct.unpack_from("<BHHQ", reply, 3) == (Opcode.ERROR, 1, 7, 0)
    server.data_received(b"ignored after failure")          # no exception, nothing sent
    assert server.out == [reply]
    pump(client, server)
    assert isinstance(client.failed, ProtocolError) and "bad_payload_crc" in str(client.failed)
    assert client.errors == [client.failed]
    with pytest.raises(ConnectionLost):
        client.send_request(Opcode.PING)


def test_garbage_gets_an_error_reply_and_close():
    server = StoreServer()
    server.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert server.failed.reason == "bad_magic" and server.close_requested
    assert struct.unpack_from("<HQ", server.out[0], 6) == (7, 0)


def test_in_flight_limit_replies_busy_discards_the_payload_and_keeps_the_connection():
    client, server = connect(ProtocolLimits(max_in_flight=2))
    server.store[key(1)] = bytearray(b"x")
    server.hold = True
    a = client.send_request(Opcode.GET, m.encode_get_request(key(1)))
    b = client.send_request(Opcode.GET, m.encode_get_request(key(1)))
    with pytest.raises(Busy):                 # the client keeps to the server's limit itself
        client.send_request(Opcode.PING)
    pump(client, server)
    # A client that ignores the limit gets Busy for the extra request; its payload is skipped.
    raw = encode_frame_header(Opcode.PUT, 99, header=m.encode_put_request(key(2), 3), payload_length=3)
    server.data_received(raw + b"abc")
    (busy,) = server.out
    server.out.clear()
    assert struct.unpack_from("<BHHQ", busy, 3) == (Opcode.ERROR, 1, Busy.status, 99)
    assert key(2) not in server.store and server.failed is None and server.in_flight == 2
    for frame in server.held:
        server.serve(frame)
    pump(client, server)
    assert client.replies[a].ok and client.replies[b].ok and server.in_flight == 0


def test_duplicate_in_flight_request_id_fails_the_connection():
    server = StoreServer(require_hello=False)
    server.hold = True
    req = encode_frame_header(Opcode.GET, 5, header=m.encode_get_request(key(1)))
    server.data_received(req + req)
    assert "already in flight" in str(server.failed) and server.close_requested


def test_connection_lost_mid_put_aborts_the_slot():
    client, server = connect()
    client.send_request(Opcode.PUT, m.encode_put_request(key(1), 10_000), [os.urandom(10_000)])
    wire = b"".join(client.out)
    client.out.clear()
    server.data_received(wire[:5000])
    assert server.slots
    server.connection_lost(None)
    assert not server.slots and isinstance(server.aborted[0][1], ConnectionLost)
    assert key(1) not in server.store


def test_reply_to_an_unknown_request_id_fails_the_client():
    client, server = connect()
    client.data_received(encode_frame_header(Opcode.PING, 12345, flags=1))
    assert isinstance(client.failed, ProtocolError) and "not pending" in str(client.failed)


def test_reply_ok_for_a_request_not_in_flight_is_a_server_bug():
    server = StoreServer()
    with pytest.raises(InvalidArgument, match="not in flight"):
        server.reply_ok(7, Opcode.PING)


def test_payloads_without_a_destination_are_buffered_only_up_to_the_collect_limit():
    client, server = connect(ProtocolLimits(max_collect_bytes=1000))
    big = client.send_request(Opcode.PING, b"", [bytes(1001)])
    small = client.send_request(Opcode.PING, b"", [b"p" * 1000])
    pump(client, server)
    assert isinstance(client.replies[big].error, InvalidArgument)
    assert client.replies[small].payload == b"p" * 1000 and server.failed is None


class DeferringServer(StoreServer):
    """A store that has no room yet: every PUT is deferred until the test resumes it."""

    def _on_put_start(self, frame):
        self.deferred_frame = frame
        return DEFER


@pytest.mark.parametrize("sizes", [None, [7, 100, 65536]])
def test_a_deferred_put_holds_the_input_until_resume_put_then_everything_goes_on_in_order(sizes):
    client, server = Client(), DeferringServer()
    client.send_request(Opcode.HELLO, m.encode_hello_request(TOKEN, client_name="test"))
    pump(client, server, sizes)
    blob = os.urandom(100_000)
    put = client.send_request(Opcode.PUT, m.encode_put_request(key(1), len(blob)), [blob])
    ping = client.send_request(Opcode.PING, b"", [b"after"])
    pump(client, server, sizes)                   # the payload and the PING arrive, nothing is parsed
    assert server.put_deferred and put not in client.replies and ping not in client.replies
    slot = bytearray(len(blob))
    server.slots[put] = [(key(1), slot)]
    server.resume_put(slot)
    pump(client, server, sizes)
    assert not server.put_deferred and client.replies[put].ok and bytes(server.store[key(1)]) == blob
    assert bytes(client.replies[ping].payload) == b"after" and client.order[-2:] == [put, ping]


def test_a_refused_deferred_put_replies_its_error_drops_the_payload_and_goes_on():
    client, server = Client(), DeferringServer()
    client.send_request(Opcode.HELLO, m.encode_hello_request(TOKEN, client_name="test"))
    pump(client, server)
    put = client.send_request(Opcode.PUT, m.encode_put_request(key(1), 5000), [os.urandom(5000)])
    ping = client.send_request(Opcode.PING)
    pump(client, server)
    server.refuse_put(Busy("dram full: waited"))
    pump(client, server)
    assert isinstance(client.replies[put].error, Busy) and client.replies[ping].ok
    assert key(1) not in server.store and server.in_flight == 0 and not server.errors
