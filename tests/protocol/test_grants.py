"""protocol/grants.py: the NIXL transport's messages (NIXL_META, GRANT, GRANT_RELEASE) round-trip,
and every truncated, trailing or over-limit body is refused with a clear error before a list is
built (a member that sends garbage gets InvalidArgument, nothing is granted or released)."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.errors import InvalidArgument
from quillcache.protocol import grants as gw
from quillcache.protocol.opcodes import ProtocolLimits

LIM = ProtocolLimits(max_batch=64)


def test_round_trips():
    meta = gw.Meta(0xABCDEF, 0x7F00_0000_1000, 256 << 20, b"\x01agent-metadata" * 10)
    assert gw.decode_meta_reply(gw.encode_meta_reply(meta)) == meta
    keys = [b"k1", b"key-two" * 3]
    assert gw.decode_grant(gw.encode_grant("t1", keys, LIM, [7, 9]), LIM) == ([7, 9], "t1", keys)
    assert gw.decode_grant(gw.encode_grant("", keys, LIM), LIM) == ([], "", keys)
    grant = gw.Grant(5, 42, 1_000_000, [gw.GrantItem(0, 4096, 262144, 0xDEADBEEF),
                                        gw.GrantItem(gw.STATUS_FETCH, 0, 0, 0), gw.GrantItem(3, 0, 0, 0)])
    assert gw.decode_grant_reply(gw.encode_grant_reply(grant, LIM), LIM) == grant
    assert gw.decode_release(gw.encode_release([1, 2 ** 64 - 1], LIM), LIM) == [1, 2 ** 64 - 1]
    assert gw.decode_release_reply(gw.encode_release_reply(3)) == 3


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused_with_invalid_argument(body):
    for decode in (gw.decode_meta_reply, gw.decode_release_reply, lambda b: gw.decode_grant(b, LIM),
                   lambda b: gw.decode_grant_reply(b, LIM), lambda b: gw.decode_release(b, LIM)):
        try:
            decode(body)
        except InvalidArgument:
            pass


def test_truncated_and_trailing_bodies_are_refused():
    good = [gw.encode_meta_reply(gw.Meta(1, 4096, 8192, b"m" * 40)),
            gw.encode_grant_reply(gw.Grant(1, 2, 3, [gw.GrantItem(0, 0, 1, 2)] * 3), LIM),
            gw.encode_release([1, 2, 3], LIM)]
    decoders = [gw.decode_meta_reply, lambda b: gw.decode_grant_reply(b, LIM), lambda b: gw.decode_release(b, LIM)]
    for body, decode in zip(good, decoders):
        decode(body)
        for cut in (1, len(body) // 2, len(body) - 1):
            with pytest.raises(InvalidArgument):
                decode(body[:cut])
        with pytest.raises(InvalidArgument):
            decode(body + b"\x00")


def test_counts_over_the_limit_are_refused_before_a_list_is_built():
    with pytest.raises(InvalidArgument, match="at most 64"):
        gw.decode_grant(struct.pack("<I", 10_000_000), LIM)            # releases
    with pytest.raises(InvalidArgument, match="at most 64"):
        gw.decode_grant_reply(struct.pack("<QQII", 1, 2, 3, 10_000_000), LIM)
    with pytest.raises(InvalidArgument, match="1..64"):
        gw.decode_release(struct.pack("<I", 65), LIM)
    with pytest.raises(InvalidArgument, match="1..64"):
        gw.decode_release(struct.pack("<I", 0), LIM)
    with pytest.raises(InvalidArgument, match="metadata of"):
        gw.decode_meta_reply(struct.pack("<QQQI", 1, 4096, 8192, gw.MAX_META_BYTES + 1))
    with pytest.raises(InvalidArgument, match="positive"):
        gw.decode_meta_reply(struct.pack("<QQQI", 1, 0, 8192, 1) + b"m")
    with pytest.raises(InvalidArgument):
        gw.encode_release([], LIM)
    with pytest.raises(InvalidArgument):
        gw.encode_grant("t", [b"k"], LIM, list(range(65)))
