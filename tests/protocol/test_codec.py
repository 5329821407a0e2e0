"""The frame codec (quillcache._native.codec) against an independent pure-Python reader."""
import os
import random
import struct
import tracemalloc

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache._native import codec
from quillcache._native.codec import (
    EV_FRAME, EV_NEED_DATA, EV_PAYLOAD_CHUNK, EV_PAYLOAD_END, EV_PAYLOAD_START, FLAG_PAYLOAD_CRC,
    FLAG_REPLY, OP_ERROR, FrameParser, MalformedFrame, crc32c, encode_frame_header,
)
from quillcache.errors import InvalidArgument, ProtocolError
from quillcache.protocol.opcodes import KNOWN_FLAGS, REQUEST_OPCODES, Opcode

OPS = sorted(int(o) for o in REQUEST_OPCODES)
FIXED = struct.Struct("<2sBBHHQQI")


def make_parser(replies=False, max_header=1 << 16, max_payload=1 << 22, **kw):
    return FrameParser(OPS, max_header_bytes=max_header, max_payload_bytes=max_payload,
                       replies=replies, allowed_flags=KNOWN_FLAGS, **kw)


def frame_bytes(opcode, rid, header=b"", payload=b"", flags=0, status=0):
    out = encode_frame_header(opcode, rid, flags=flags, header=header, payload_length=len(payload), status=status)
    out += payload
    if flags & FLAG_PAYLOAD_CRC:
        out += struct.pack("<I", google_crc32c.value(payload))
    return out


def ref_parse(data):
    """Reference reader: struct + google_crc32c, whole buffer, valid frames only."""
    out, pos = [], 0
    while pos < len(data):
        magic, ver, op, flags, status, rid, plen, hlen = FIXED.unpack_from(data, pos)
        assert magic == b"QC" and ver == 1
        hdr = data[pos + 28:pos + 28 + hlen]
        (crc,) = struct.unpack_from("<I", data, pos + 28 + hlen)
        assert crc == google_crc32c.value(data[pos:pos + 28 + hlen])
        pos += 32 + hlen
        payload = data[pos:pos + plen]
        pos += plen
        if flags & FLAG_PAYLOAD_CRC:
            (pcrc,) = struct.unpack_from("<I", data, pos)
            assert pcrc == google_crc32c.value(payload)
            pos += 4
        out.append((op, flags, status, rid, hdr, payload))
    return out


def drain(parser, out, on_start=None):
    """Run events into ``out`` as the reference tuples (payload as bytes)."""
    while True:
        ev = parser.next_event()
        if ev == EV_NEED_DATA:
            return
        f = parser.frame
        if ev == EV_FRAME:
            out.append((f.opcode, f.flags, f.status, f.request_id, f.header, b""))
        elif ev == EV_PAYLOAD_START and on_start is not None:
            on_start(parser, f)
        elif ev == EV_PAYLOAD_END:
            p = f.payload
            body = b"".join(bytes(x) for x in p) if isinstance(p, tuple) else bytes(p)
            out.append((f.opcode, f.flags, f.status, f.request_id, f.header, body))


def parse_chunks(chunks, **kw):
    p = make_parser(**kw)
    out = []
    for c in chunks:
        p.feed(c)
        drain(p, out)
    return out


def recv_via_buffers(parser, data, sizes, out, on_start=None):
    """Feed ``data`` through get_buffer/buffer_updated as a socket would, with recv sizes cycling ``sizes``."""
    pos, i = 0, 0
    while pos < len(data):
        view = parser.get_buffer(-1)
        n = min(len(view), sizes[i % len(sizes)], len(data) - pos)
        i += 1
        view[:n] = data[pos:pos + n]
        parser.buffer_updated(n)
        pos += n
        drain(parser, out, on_start)


frame_st = st.tuples(
    st.sampled_from(OPS),
    st.integers(1, (1 << 64) - 1),
    st.binary(max_size=64),
    st.binary(max_size=300),
    st.sampled_from([0, FLAG_PAYLOAD_CRC, 0x0004, 0x0004 | FLAG_PAYLOAD_CRC]),
)


# --------------------------------------------------------------------------- framing


@pytest.mark.parametrize("impl", [crc32c, codec._crc32c_portable])
def test_crc32c_matches_google_crc32c_and_continues(impl):
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000, 65537):
        data = os.urandom(n)
        assert impl(data) == google_crc32c.value(data)
        cut = n // 3
        assert impl(data[cut:], impl(data[:cut])) == google_crc32c.value(data)
        assert impl(memoryview(data)[1:]) == google_crc32c.value(data[1:])    # unaligned start
    assert crc32c(memoryview(bytearray(b"123456789"))) == 0xE3069283   # the CRC-32C check value


def test_header_layout_is_little_endian_with_crc_after_the_variable_header():
    h = encode_frame_header(0x10, 0x0102030405060708, flags=0x0004, header=b"abc", payload_length=0x1122)
    assert len(h) == 28 + 3 + 4
    assert h[:2] == b"QC" and h[2] == 1 and h[3] == 0x10
    assert h[4:6] == b"\x04\x00" and h[6:8] == b"\x00\x00"
    assert h[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert h[16:24] == struct.pack("<Q", 0x1122) and h[24:28] == struct.pack("<I", 3)
    assert h[28:31] == b"abc"
    assert h[31:] == struct.pack("<I", google_crc32c.value(h[:31]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(frame_st, min_size=1, max_size=8), data=st.data())
def test_any_split_gives_the_same_frames_as_whole_buffer_feeding(frames, data):
    stream = b"".join(frame_bytes(*f) for f in frames)
    expected = ref_parse(stream)
    assert [(o, r, h, p) for o, _, _, r, h, p in expected] == [(f[0], f[1], f[2], f[3]) for f in frames]
    assert parse_chunks([stream]) == expected
    assert parse_chunks([stream[i:i + 1] for i in range(len(stream))]) == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    pieces = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    assert parse_chunks(pieces) == expected
    sizes = data.draw(st.lists(st.integers(1, 97), min_size=1, max_size=5))
    out = []
    recv_via_buffers(make_parser(), stream, sizes, out)
    assert out == expected


def test_feed_leaves_nothing_buffered_after_draining():
    p = make_parser()
    stream = frame_bytes(Opcode.GET, 1, b"k" * 10) + frame_bytes(Opcode.PUT, 2, b"k", b"x" * 100)
    p.feed(stream[:50])
    out = []
    drain(p, out)
    p.feed(stream[50:])
    drain(p, out)
    assert p.buffered == 0 and len(out) == 2 and p.stream_offset == len(stream)


# --------------------------------------------------------------------------- payload placement


def test_payload_lands_byte_exact_in_the_destination_via_get_buffer():
    payload = os.urandom(1 << 20)
    stream = frame_bytes(Opcode.PUT, 9, b"key", payload) + frame_bytes(Opcode.PING, 10)
    dest = bytearray(len(payload) + 100)
    p = make_parser()
    out, direct, pos = [], 0, 0
    while pos < len(stream):
        view = p.get_buffer(-1)
        n = min(len(view), 65536, len(stream) - pos)
        view[:n] = stream[pos:pos + n]
        if view.obj is dest:
            direct += n      # the kernel would have written into the slot itself
        p.buffer_updated(n)
        pos += n
        drain(p, out, lambda parser, frame: parser.set_destination(dest))
    assert dest[:len(payload)] == payload and dest[len(payload):] == bytes(100)
    assert out == ref_parse(stream)
    assert direct >= len(payload) - 65536     # all but the first read went straight into dest


def test_scatter_destination_fills_segments_in_order():
    sizes = [1000, 1, 4096, 3000]
    blobs = [os.urandom(n) for n in sizes]
    payload = b"".join(blobs)
    slots = [bytearray(n) for n in sizes]
    stream = frame_bytes(Opcode.PUT_MANY, 3, b"hdr", payload, flags=FLAG_PAYLOAD_CRC)
    for chunking in ([stream], [stream[i:i + 333] for i in range(0, len(stream), 333)]):
        for s in slots:
            s[:] = bytes(len(s))
        p = make_parser()
        frames = []
        for c in chunking:
            p.feed(c)
            while (ev := p.next_event()) != EV_NEED_DATA:
                if ev == EV_PAYLOAD_START:
                    p.set_destination(slots)
                elif ev == EV_PAYLOAD_END:
                    frames.append(p.frame)
        assert [bytes(s) for s in slots] == blobs
        assert [bytes(v) for v in frames[0].payload] == blobs


def test_destination_too_small_is_refused_and_changes_nothing():
    payload = os.urandom(500)
    p = make_parser()
    p.feed(frame_bytes(Opcode.PUT, 1, b"k", payload))
    assert p.next_event() == EV_PAYLOAD_START
    with pytest.raises(InvalidArgument, match="holds 499 bytes"):
        p.set_destination([bytearray(200), bytearray(299)])
    with pytest.raises(InvalidArgument, match="read-only"):
        p.set_destination(bytes(1000))
    assert p.next_event() == EV_PAYLOAD_END       # nothing chosen: collected
    assert isinstance(p.frame.payload, bytearray) and p.frame.payload == payload


def test_destination_of_other_item_size_is_cast_to_bytes():
    np = pytest.importorskip("numpy")
    payload = os.urandom(64)
    arr = np.zeros(16, dtype=np.float32)
    p = make_parser()
    p.feed(frame_bytes(Opcode.PUT, 1, b"k", payload))
    assert p.next_event() == EV_PAYLOAD_START
    p.set_destination(arr)
    assert p.next_event() == EV_PAYLOAD_END
    assert arr.tobytes() == payload


def test_stream_mode_yields_chunks_that_concatenate_to_the_payload():
    payload = os.urandom(10000)
    stream = frame_bytes(Opcode.PING, 5, b"", payload, flags=FLAG_PAYLOAD_CRC) + frame_bytes(Opcode.PING, 6)
    p = make_parser()
    chunks, events = [], []
    for i in range(0, len(stream), 777):
        p.feed(stream[i:i + 777])
        while (ev := p.next_event()) != EV_NEED_DATA:
            events.append(ev)
            if ev == EV_PAYLOAD_START:
                p.stream_payload()
            elif ev == EV_PAYLOAD_CHUNK:
                chunks.append(p.chunk)
    assert b"".join(chunks) == payload
    assert events[0] == EV_PAYLOAD_START and events[-2:] == [EV_PAYLOAD_END, EV_FRAME]


def test_discarded_payload_is_skipped_and_the_next_frame_parses():
    p = make_parser()
    p.feed(frame_bytes(Opcode.PUT, 1, b"k", os.urandom(3000)) + frame_bytes(Opcode.GET, 2, b"k2"))
    assert p.next_event() == EV_PAYLOAD_START
    p.discard_payload()
    assert p.next_event() == EV_PAYLOAD_END and p.frame.payload is None
    assert p.next_event() == EV_FRAME and p.frame.request_id == 2 and p.frame.header == b"k2"


def test_set_destination_outside_a_payload_start_is_an_error():
    p = make_parser()
    with pytest.raises(RuntimeError):
        p.set_destination(bytearray(10))
    with pytest.raises(RuntimeError):
        p.buffer_updated(1)


# --------------------------------------------------------------------------- malformed frames


def _corrupt(offset, value):
    def f(b):
        b = bytearray(b)
        b[offset] = value
        return bytes(b)
    return f


def _set_fixed(fmt, offset, value, recrc=True):
    def f(b):
        b = bytearray(b)
        struct.pack_into(fmt, b, offset, value)
        if recrc:
            hlen = struct.unpack_from("<I", b, 24)[0]
            struct.pack_into("<I", b, 28 + hlen, google_crc32c.value(bytes(b[:28 + hlen])))
        return bytes(b)
    return f


GOOD = frame_bytes(Opcode.PUT, 77, b"some-key", b"0123456789", flags=FLAG_PAYLOAD_CRC)

MALFORMED = {
    "bad_magic": _corrupt(0, ord("X")),
    "bad_version": _set_fixed("<B", 2, 2),
    "unknown_opcode": _set_fixed("<B", 3, 0x7E),
    "bad_flags": _set_fixed("<H", 4, 0x8000),
    "bad_status": _set_fixed("<H", 6, 3),
    "bad_request_id": _set_fixed("<Q", 8, 0),
    "header_too_long": _set_fixed("<I", 24, (1 << 16) + 1, recrc=False),
    "payload_too_large": _set_fixed("<Q", 16, (1 << 22) + 1),
    "bad_header_crc": _corrupt(30, ord("!")),
    "bad_payload_crc": _corrupt(len(GOOD) - 6, ord("!")),
}


def test_every_reason_has_a_malformed_case():
    assert set(MALFORMED) == set(codec.REASONS)


@pytest.mark.parametrize("reason", sorted(MALFORMED))
@pytest.mark.parametrize("via", ["whole", "bytewise", "buffers"])
def test_malformed_frame_fails_the_parser_with_its_reason_for_good(reason, via):
    bad = MALFORMED[reason](GOOD)
    p = make_parser()
    p.feed(frame_bytes(Opcode.PING, 1))           # a good frame first: the offset points past it
    assert p.next_event() == EV_FRAME
    with pytest.raises(MalformedFrame) as info:
        if via == "whole":
            p.feed(bad)
            drain(p, [])
        elif via == "bytewise":
            for i in range(len(bad)):
                p.feed(bad[i:i + 1])
                drain(p, [])
        else:
            recv_via_buffers(p, bad, [3], [])
    exc = info.value
    assert isinstance(exc, ProtocolError) and exc.status == ProtocolError.status == 7
    assert exc.reason == reason and exc.offset == 32
    assert p.failed and p.error is exc
    for call in (lambda: p.feed(GOOD), p.next_event, lambda: p.get_buffer(-1)):
        with pytest.raises(MalformedFrame) as again:
            call()
        assert again.value is exc


def test_reply_flag_is_checked_against_the_parser_role():
    req = frame_bytes(Opcode.GET, 1, b"k")
    rep = frame_bytes(Opcode.GET, 1, b"", flags=FLAG_REPLY)
    with pytest.raises(MalformedFrame, match="a reply where a request was expected"):
        parse_chunks([rep])
    with pytest.raises(MalformedFrame, match="a request where a reply was expected"):
        parse_chunks([req], replies=True)
    assert parse_chunks([rep], replies=True)[0][3] == 1
    err = frame_bytes(OP_ERROR, 0, b"\x00\x00\x00", flags=FLAG_REPLY, status=7)
    assert parse_chunks([err], replies=True)[0][:4] == (OP_ERROR, FLAG_REPLY, 7, 0)
    with pytest.raises(MalformedFrame) as info:      # clients never send ERROR
        parse_chunks([frame_bytes(OP_ERROR, 1, b"", status=7)])
    assert info.value.reason == "unknown_opcode"


def test_a_terabyte_payload_claim_is_refused_without_allocating():
    p = make_parser(max_payload=1 << 30)
    hdr = encode_frame_header(Opcode.PUT, 1, header=b"k", payload_length=1 << 40)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrame) as info:
            p.feed(hdr)
            p.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason == "payload_too_large"
    assert peak < 64 * 1024


def test_a_large_header_claim_grows_the_buffer_only_with_bytes_received():
    p = make_parser(max_header=0xFFFFFFFF)
    fixed = FIXED.pack(b"QC", 1, Opcode.GET, 0, 0, 1, 0, 1 << 30)    # claims a 1 GiB header
    for _ in range(10):
        p.feed(fixed if p.stream_offset == 0 and p.buffered == 0 else b"x" * 10_000)
        assert p.next_event() == EV_NEED_DATA
    assert p.buffered == 28 + 90_000
    assert p.buffer_capacity < 4 * p.buffered


def test_encode_frame_header_rejects_out_of_range_fields():
    for kwargs in ({"opcode": 256, "request_id": 1}, {"opcode": 1, "request_id": -1},
                   {"opcode": 1, "request_id": 1 << 64}, {"opcode": 1, "request_id": 1, "flags": 1 << 16},
                   {"opcode": 1, "request_id": 1, "status": -1},
                   {"opcode": 1, "request_id": 1, "payload_length": -5},
                   {"opcode": 1, "request_id": 1, "header": b"abc", "max_header_bytes": 2}):
        with pytest.raises(InvalidArgument):
            encode_frame_header(**kwargs)


# --------------------------------------------------------------------------- fuzzing


def _consume_randomly(parser, data, rng, counter=None):
    """Feed ``data`` with random splits and random payload choices; only MalformedFrame may
    escape.  Returns the number of frame headers parsed (also kept in ``counter[0]``)."""
    counter = [0] if counter is None else counter
    pos = 0
    while pos < len(data):
        if rng.random() < 0.5:
            n = rng.randint(1, 64)
            parser.feed(data[pos:pos + n])
        else:
            view = parser.get_buffer(-1)
            n = min(len(view), rng.randint(1, 64), len(data) - pos)
            view[:n] = data[pos:pos + n]
            parser.buffer_updated(n)
        pos += n
        while (ev := parser.next_event()) != EV_NEED_DATA:
            counter[0] += ev in (EV_FRAME, EV_PAYLOAD_START)
            if ev == EV_PAYLOAD_START:
                choice = rng.randrange(4)
                if choice == 0:
                    parser.set_destination(bytearray(parser.frame.payload_length + rng.randint(0, 3)))
                elif choice == 1:
                    parser.stream_payload()
                elif choice == 2:
                    parser.discard_payload()
    return counter[0]


def _mutate(data, rng):
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        if kind == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 8)]
        elif kind == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = os.urandom(rng.randint(1, 8))
        else:
            b[rng.randrange(len(b) + 1):] = b""
    return bytes(b)


def _fuzz_one(data, seed):
    """Frames handled: headers parsed, plus one for a refused frame."""
    p = make_parser(max_header=4096, max_payload=1 << 16)
    counter = [0]
    try:
        return _consume_randomly(p, data, random.Random(seed), counter)
    except MalformedFrame as exc:
        assert exc.reason in codec.REASONS and p.failed
        return counter[0] + 1


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(frame_st, max_size=4), seed=st.integers(0, 2**32), garbage=st.binary(max_size=80))
def test_fuzz_mutated_and_random_frames_only_raise_malformed_frame(frames, seed, garbage):
    good = b"".join(frame_bytes(*f) for f in frames)
    _fuzz_one(garbage, seed)
    _fuzz_one(_mutate(good + garbage, random.Random(seed)), seed)


@pytest.mark.slow
def test_fuzz_a_hundred_thousand_frames_never_crashes():
    rng = random.Random(20261122)
    handled = 0
    while handled < 100_000:
        batch = []
        for _ in range(rng.randint(1, 16)):
            op = rng.choice(OPS)
            flags = rng.choice([0, FLAG_PAYLOAD_CRC, 0x0004])
            batch.append(frame_bytes(op, rng.randint(1, 1 << 40), os.urandom(rng.randint(0, 40)),
                                     os.urandom(rng.choice([0, 0, 1, 17, 300])), flags))
        stream = b"".join(batch)
        if rng.random() < 0.3:
            p = make_parser(max_header=4096, max_payload=1 << 16)
            assert _consume_randomly(p, stream, rng) == len(batch)     # intact frames all parse
            handled += len(batch)
        else:
            handled += _fuzz_one(_mutate(stream, rng), rng.getrandbits(32))
    assert handled >= 100_000


def test_a_wrong_magic_is_refused_at_its_first_byte():
    p = make_parser()
    p.feed(b"G")
    with pytest.raises(MalformedFrame) as info:
        p.next_event()
    assert info.value.reason == "bad_magic"
    p = make_parser()
    p.feed(b"QC\x09")
    with pytest.raises(MalformedFrame) as info:
        p.next_event()
    assert info.value.reason == "bad_version"


def test_decode_key_list_reads_a_terminal_key_list_and_refuses_every_bad_one():
    from quillcache._native.codec import decode_key_list
    body = b"\x07hdr" + (2).to_bytes(4, "little") + b"\x01\x00a" + b"\x03\x00bcd"
    assert decode_key_list(body, 4, 16, 8) == [b"a", b"bcd"]
    assert decode_key_list(memoryview(body), 4, 16, 8) == [b"a", b"bcd"]      # any buffer
    for bad, why in [((body, 4, 1, 8), "batch of 2 items"), ((body, 4, 16, 2), "key"),
                     ((body + b"x", 4, 16, 8), "trailing"), ((body[:-1], 4, 16, 8), "truncated"),
                     ((body, 99, 16, 8), "outside"), ((body, -1, 16, 8), "outside"),
                     ((body[:6], 4, 16, 8), "truncated in count"),
                     ((b"\xff\xff\xff\x0f", 0, 1 << 30, 8), "needs at least")]:
        with pytest.raises(InvalidArgument, match=why):
            decode_key_list(*bad)


def test_set_limits_applies_to_the_next_frames_keeps_buffered_bytes_and_refuses_mid_frame():
    p = FrameParser(REQUEST_OPCODES, max_header_bytes=16, max_payload_bytes=0, read_chunk=4096)
    first = encode_frame_header(Opcode.HELLO, 1, header=b"h" * 16)
    second = encode_frame_header(Opcode.PUT, 2, header=b"k" * 100, payload_length=3) + b"abc"
    p.feed(first + second[:10])
    assert p.next_event() == EV_FRAME and p.frame.request_id == 1
    assert p.limits == (16, 0, 4096)
    p.set_limits(max_header_bytes=1 << 20, max_payload_bytes=1 << 20, read_chunk=65536)
    assert p.limits == (1 << 20, 1 << 20, 65536)
    assert p.next_event() == EV_NEED_DATA        # the 10 bytes of the next frame were kept
    p.feed(second[10:30])
    assert p.next_event() == EV_NEED_DATA        # its fixed prefix is parsed, the header is not in
    with pytest.raises(RuntimeError):
        p.set_limits(max_header_bytes=16, max_payload_bytes=0)     # its prefix is parsed: too late
    p.feed(second[30:])
    assert p.next_event() == EV_PAYLOAD_START and p.frame.request_id == 2
    with pytest.raises(InvalidArgument):
        FrameParser(REQUEST_OPCODES, max_header_bytes=1, max_payload_bytes=0).set_limits(
            max_header_bytes=1, max_payload_bytes=0, read_chunk=16)
    small = FrameParser(REQUEST_OPCODES, max_header_bytes=16, max_payload_bytes=0, read_chunk=4096)
    small.feed(encode_frame_header(Opcode.PING, 1, payload_length=1 << 20))
    with pytest.raises(MalformedFrame) as ei:      # the claim is refused on the fixed prefix
        small.next_event()
    assert ei.value.reason == "payload_too_large" and small.buffer_capacity <= 4096


# --------------------------------------------------------------------------- receive_bytes


@pytest.mark.parametrize("flags", [0, FLAG_PAYLOAD_CRC])
@pytest.mark.parametrize("recv_sizes", [[1 << 30], [32, 4096, 65536], [7, 1000]])
def test_receive_bytes_hands_out_a_new_bytes_with_exactly_the_payload(flags, recv_sizes):
    payloads = [os.urandom(n) for n in (0, 1, 4095, 200_000)]
    stream = b"".join(frame_bytes(Opcode.GET, i + 1, b"", pl, flags=flags | FLAG_REPLY)
                      for i, pl in enumerate(payloads))
    out = []
    recv_via_buffers(make_parser(replies=True), stream, recv_sizes, out,
                     lambda parser, frame: parser.receive_bytes())
    assert [body for *_, body in out] == payloads
    p2 = make_parser(replies=True)
    frames = []
    p2.feed(stream)
    while (ev := p2.next_event()) != EV_NEED_DATA:
        if ev == EV_PAYLOAD_START:
            p2.receive_bytes()
        elif ev == EV_PAYLOAD_END:
            frames.append(p2.frame.payload)
    assert all(type(x) is bytes for x in frames)
    assert frames == [pl for pl in payloads if pl or flags]     # 0 bytes without a CRC: EV_FRAME


def test_receive_bytes_allocates_the_payload_once():
    payload = os.urandom(4 << 20)
    stream = frame_bytes(Opcode.GET, 1, b"", payload, flags=FLAG_REPLY | FLAG_PAYLOAD_CRC)
    p = make_parser(replies=True, max_payload=8 << 20)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = []
        recv_via_buffers(p, memoryview(stream), [1 << 20], out, lambda parser, frame: parser.receive_bytes())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert out[0][-1] == payload
    assert peak < len(payload) + (256 << 10)      # one payload-sized allocation (a copy would be two)


def test_receive_bytes_with_a_bad_payload_crc_never_hands_the_bytes_out():
    payload = os.urandom(10_000)
    stream = bytearray(frame_bytes(Opcode.GET, 1, b"", payload, flags=FLAG_REPLY | FLAG_PAYLOAD_CRC))
    stream[-1] ^= 0xFF
    p = make_parser(replies=True)
    p.feed(bytes(stream))
    assert p.next_event() == EV_PAYLOAD_START
    p.receive_bytes()
    with pytest.raises(MalformedFrame) as info:
        p.next_event()
    assert info.value.reason == "bad_payload_crc" and p.frame.payload is None


def test_receive_bytes_outside_a_payload_start_is_an_error():
    p = make_parser(replies=True)
    with pytest.raises(RuntimeError):
        p.receive_bytes()
    p.feed(frame_bytes(Opcode.GET, 1, b"", b"abc", flags=FLAG_REPLY))
    assert p.next_event() == EV_PAYLOAD_START
    p.set_destination(bytearray(3))
    with pytest.raises(RuntimeError):
        p.receive_bytes()


def test_uninitialised_bytearray_has_the_size_asked_and_refuses_a_negative_one():
    assert len(codec.uninitialised_bytearray(12345)) == 12345
    assert codec.uninitialised_bytearray(0) == bytearray()
    with pytest.raises(InvalidArgument):
        codec.uninitialised_bytearray(-1)


def _count_reads(parser, data, on_start):
    """Feed ``data`` as a socket with plenty of bytes ready would (every read fills the view
    offered); returns the number of reads."""
    reads, pos, out = 0, 0, []
    while pos < len(data):
        view = parser.get_buffer(-1)
        n = min(len(view), len(data) - pos)
        view[:n] = data[pos:pos + n]
        parser.buffer_updated(n)
        pos += n
        reads += 1
        drain(parser, out, on_start)
    return reads, out


def test_a_scatter_of_small_values_is_received_in_buffer_sized_reads_not_one_per_value():
    blobs = [os.urandom(1024) for _ in range(500)]
    slots = [bytearray(1024) for _ in blobs]
    stream = memoryview(frame_bytes(Opcode.PUT_MANY, 3, b"hdr", b"".join(blobs), flags=FLAG_PAYLOAD_CRC))
    reads, out = _count_reads(make_parser(), stream, lambda p, f: p.set_destination(slots))
    assert [bytes(s) for s in slots] == blobs and out[0][-1] == b"".join(blobs)
    assert reads <= len(stream) // 65536 + 3          # 64 KiB reads, not 500 of 1 KiB


def test_large_scatter_segments_are_still_received_in_place():
    blobs = [os.urandom(256 << 10) for _ in range(4)]
    slots = [bytearray(256 << 10) for _ in blobs]
    stream = memoryview(frame_bytes(Opcode.PUT_MANY, 3, b"hdr", b"".join(blobs)))
    p = make_parser()
    direct, pos = 0, 0
    while pos < len(stream):
        view = p.get_buffer(-1)
        n = min(len(view), len(stream) - pos)
        view[:n] = stream[pos:pos + n]
        if any(view.obj is s for s in slots):
            direct += n
        p.buffer_updated(n)
        pos += n
        drain(p, [], lambda parser, f: parser.set_destination(slots))
    assert [bytes(s) for s in slots] == blobs
    assert direct >= sum(map(len, blobs)) - 65536     # all but the first read went straight into the slots


def test_total_nbytes_counts_what_writelines_hands_the_transport():
    import numpy as np
    a = np.arange(12, dtype=np.float32)
    parts = [b"abc", bytearray(5), memoryview(a), memoryview(a)[::2], a.reshape(3, 4)[:, :2], memoryview(b"")]
    assert codec.total_nbytes(parts) == sum(memoryview(p).nbytes for p in parts) == 3 + 5 + 48 + 24 + 24
    assert codec.total_nbytes([]) == 0
    with pytest.raises(TypeError):
        codec.total_nbytes([b"x", 7])               # not a buffer: an error, never a wrong count
    with pytest.raises(TypeError):
        codec.total_nbytes((b"x",))                 # a list only, as the connections pass it
