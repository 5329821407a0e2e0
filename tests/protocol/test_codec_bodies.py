"""The codec's key field and GET/PUT bodies (codec_bodies.pxi) against a struct oracle, and
messages.py built on them (one format, one writer)."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache._native.codec import (
    decode_key_body, decode_key_field, decode_put_body, encode_key_body, encode_put_body,
)
from quillcache.errors import InvalidArgument
from quillcache.protocol import messages as m
from quillcache.protocol.opcodes import ProtocolLimits

MAX_KEY = 64
keys = st.binary(min_size=1, max_size=MAX_KEY)


@settings(max_examples=300, deadline=None)
@given(key=keys)
def test_key_body_is_u16_length_then_key_and_round_trips(key):
    body = encode_key_body(key, MAX_KEY)
    assert body == struct.pack("<H", len(key)) + key
    assert decode_key_body(body, MAX_KEY) == key
    assert decode_key_body(bytearray(body), MAX_KEY) == key
    assert decode_key_body(memoryview(body), MAX_KEY) == key
    assert m.encode_get_request(key) == body and m.decode_get_request(body) == key


@settings(max_examples=300, deadline=None)
@given(key=keys, nbytes=st.integers(0, 1 << 40))
def test_put_body_is_key_then_u64_and_round_trips(key, nbytes):
    body = encode_put_body(key, nbytes, MAX_KEY, 1 << 40)
    assert body == struct.pack("<H", len(key)) + key + struct.pack("<Q", nbytes)
    assert decode_put_body(body, nbytes, MAX_KEY) == (key, nbytes)
    assert decode_put_body(body, None, MAX_KEY) == (key, nbytes)
    assert m.decode_put_request(body, nbytes, ProtocolLimits(max_payload_bytes=1 << 40)) == (key, nbytes)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(keys, min_size=1, max_size=6))
def test_key_fields_in_sequence_are_read_in_order(parts):
    body = b"".join(encode_key_body(k, MAX_KEY) for k in parts)
    pos, out = 0, []
    while pos < len(body):
        k, pos = decode_key_field(body, pos, MAX_KEY)
        out.append(k)
    assert out == parts and pos == len(body)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=80))
def test_any_bytes_decode_or_raise_invalid_argument_like_the_oracle(body):
    """The oracle: exactly u16 n (1..MAX_KEY) + n bytes is a GET body; anything else raises."""
    ok = len(body) >= 2 and 0 < struct.unpack_from("<H", body)[0] <= MAX_KEY \
        and len(body) == 2 + struct.unpack_from("<H", body)[0]
    if ok:
        assert decode_key_body(body, MAX_KEY) == body[2:]
    else:
        with pytest.raises(InvalidArgument):
            decode_key_body(body, MAX_KEY)


@pytest.mark.parametrize(("body", "message"), [
    (b"", "GET: body truncated in key length (needs 2 bytes at offset 0, has 0)"),
    (b"\x00\x00", "GET: empty key"),
    (b"\x41\x00", "GET: key of 65 bytes, at most 64"),
    (b"\x03\x00ab", "GET: body truncated in key (needs 3 bytes at offset 2, has 2)"),
    (b"\x02\x00abc", "GET: 1 trailing bytes in the body"),
])
def test_bad_get_bodies_name_what_is_wrong(body, message):
    with pytest.raises(InvalidArgument) as ei:
        decode_key_body(body, MAX_KEY)
    assert str(ei.value) == message


def test_bad_put_bodies_and_sizes_name_what_is_wrong():
    key_field = encode_key_body(b"k", MAX_KEY)
    with pytest.raises(InvalidArgument, match=r"PUT: body truncated in nbytes \(needs 8 bytes at offset 3, has 2\)"):
        decode_put_body(key_field + b"\x00\x00", None, MAX_KEY)
    with pytest.raises(InvalidArgument, match="PUT: 1 trailing bytes"):
        decode_put_body(key_field + bytes(9), None, MAX_KEY)
    with pytest.raises(InvalidArgument, match="declares 5 payload bytes, the frame carries 6"):
        decode_put_body(encode_put_body(b"k", 5, MAX_KEY, 100), 6, MAX_KEY)
    with pytest.raises(InvalidArgument, match="PUT: 101 bytes, at most 100"):
        encode_put_body(b"k", 101, MAX_KEY, 100)
    for bad in (-1, 1 << 64, True, 1.5, "5"):
        with pytest.raises(InvalidArgument, match="must be an integer"):
            encode_put_body(b"k", bad, MAX_KEY, 100)
    with pytest.raises(InvalidArgument, match="key must be bytes"):
        encode_key_body("a-str-key", MAX_KEY)
    with pytest.raises(InvalidArgument, match="empty key"):
        encode_put_body(b"", 1, MAX_KEY, 100)
    with pytest.raises(InvalidArgument, match="offset 9 outside a body of 3 bytes"):
        decode_key_field(key_field, 9, MAX_KEY)
