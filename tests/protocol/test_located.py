"""The located-operation bodies (protocol/located.py) against their spec in docs/protocol.md."""
from __future__ import annotations

import struct

import pytest

from quillcache.errors import InvalidArgument
from quillcache.protocol import located
from quillcache.protocol.opcodes import ProtocolLimits

LIMITS = ProtocolLimits(max_batch=8)


def test_located_reply_is_lease_expiry_count_then_packed_18_byte_items():
    items = [(0, 4096, 1000), (3, 0, 0), (0, 1 << 40, 7)]
    body = located.encode_located_reply(9, 123456789, items)
    assert len(body) == 20 + 3 * 18
    assert struct.unpack_from("<QQI", body) == (9, 123456789, 3)
    assert struct.unpack_from("<HQQ", body, 20 + 18) == (3, 0, 0)
    rep = located.decode_located_reply(body, LIMITS)
    assert (rep.lease_id, rep.expires_ns) == (9, 123456789)
    assert [tuple(x) for x in rep.items.tolist()] == items
    assert located.decode_located_reply(located.encode_located_reply(0, 0, []), LIMITS).items.size == 0


def test_all_hits_reply_filled_by_columns_is_the_same_bytes_as_by_items():
    offsets, lengths = [4096, 1 << 40, 0, (1 << 64) - 1], [1000, 7, 1, 0]
    assert located.encode_located_hits(5, 77, offsets, lengths) == \
        located.encode_located_reply(5, 77, [(0, o, n) for o, n in zip(offsets, lengths)])
    assert located.encode_located_hits(0, 0, [], []) == located.encode_located_reply(0, 0, [])


def test_bodies_that_break_the_format_or_a_limit_are_refused():
    with pytest.raises(InvalidArgument):
        located.decode_located_reply(located.encode_located_reply(1, 2, [(0, 0, 1)])[:-1], LIMITS)
    with pytest.raises(InvalidArgument):
        located.decode_located_reply(located.encode_located_reply(1, 2, [(0, 0, 1)] * 9), LIMITS)
    with pytest.raises(InvalidArgument):
        located.encode_release_request(list(range(1, 10)), LIMITS)
    with pytest.raises(InvalidArgument):
        located.decode_release_request(struct.pack("<IQ", 2, 5), LIMITS)
    with pytest.raises(InvalidArgument):
        located.decode_id(b"\0" * 7, "COMMIT")
    with pytest.raises(InvalidArgument):
        located.encode_id(0)
    with pytest.raises(InvalidArgument):
        located.decode_map_reply(b"\0" * 31)


def test_round_trips():
    assert located.decode_release_request(located.encode_release_request([1, 2, 3], LIMITS), LIMITS) == [1, 2, 3]
    rep = located.decode_reserve_reply(located.encode_reserve_reply(5, 77, [0, 256, 1 << 33]), LIMITS)
    assert rep == located.ReserveReply(5, 77, [0, 256, 1 << 33])
    m = located.MapReply(1 << 30, 42, 10**10, 3 * 10**10)
    assert located.decode_map_reply(located.encode_map_reply(m)) == m
    assert located.decode_id(located.encode_id(2**64 - 1), "ABORT") == 2**64 - 1
    assert located.decode_release_count(located.encode_release_count(4)) == 4
