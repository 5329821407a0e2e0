"""ROUTE and ROUTE_UPDATE bodies: round trips, and bad bodies refused with a clear error."""
import pytest

from quillcache.errors import InvalidArgument
from quillcache.protocol import messages as m
from quillcache.protocol.opcodes import Opcode, ProtocolLimits


def test_route_opcodes_are_in_the_assigned_range():
    assert (Opcode.ROUTE, Opcode.ROUTE_UPDATE) == (0x50, 0x51)


@pytest.mark.parametrize("kind, items", [(m.ROUTE_TOKENS, [0, 1, 2**32 - 1]),
                                         (m.ROUTE_HASHES, [-(2**63), 0, 2**63 - 1])])
def test_route_request_round_trip(kind, items):
    body = m.encode_route_request(kind, "acme", "llama", "tok", "ad1", items, policy="dynamo",
                                  track=False, request_id="r-1", request_tokens=77)
    req = m.decode_route_request(body)
    assert req == m.RouteRequest(kind, "dynamo", False, "acme", "llama", "tok", "ad1", "r-1", 77, items)
    plain = m.decode_route_request(m.encode_route_request(kind, "a", "b", "c", None, []))
    assert (plain.policy, plain.track, plain.adapter, plain.request_id, plain.items) == \
        (None, True, None, None, [])


def test_route_reply_round_trip():
    reply = m.RouteReply("e1", "r9", 16, 2.75, 2, 1, 0, 3, bytes([0, 0, 1, 3, 3, 3, 4]), {"e0": 12.5, "e1": 3.0})
    assert m.decode_route_reply(m.encode_route_reply(reply)) == reply


def test_route_reply_carries_no_figure_of_another_identity():
    assert not [f for f in m.RouteReply._fields if "refused" in f or "cross" in f]


def test_route_update_round_trip_and_bad_event():
    assert m.decode_route_update(m.encode_route_update(m.ROUTE_FREE, "x")) == (m.ROUTE_FREE, "x")
    with pytest.raises(InvalidArgument, match="event 9"):
        m.decode_route_update(bytes([9, 0, 0]))


@pytest.mark.parametrize("body, message", [
    (bytes([7, 0, 0]), "kind 7"),
    (bytes([0, 9, 0]), "policy code 9"),
    (m.encode_route_request(0, "a", "b", "c", None, [1, 2])[:-3], "truncated"),
    (m.encode_route_request(0, "a", "b", "c", None, [1]) + b"\0", "trailing"),
])
def test_bad_route_requests_are_refused(body, message):
    with pytest.raises(InvalidArgument, match=message):
        m.decode_route_request(body)


def test_route_request_encoder_checks_limits_and_items():
    with pytest.raises(InvalidArgument, match="block hashes instead"):
        m.encode_route_request(0, "a", "b", "c", None, list(range(100)),
                               limits=ProtocolLimits(max_header_bytes=128))
    with pytest.raises(InvalidArgument, match="u32 token ids"):
        m.encode_route_request(0, "a", "b", "c", None, [-1])
    with pytest.raises(InvalidArgument, match="policy"):
        m.encode_route_request(0, "a", "b", "c", None, [], policy="best")
