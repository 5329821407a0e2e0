"""The node-to-node messages: round trips, and bad bodies refused before allocating."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.protocol import cluster as wire
from quillcache.cluster.records import Holder
from quillcache.errors import InvalidArgument
from quillcache.protocol import messages
from quillcache.protocol.opcodes import ProtocolLimits

L = ProtocolLimits(max_batch=16)


def _verdict(decode, *args):
    """What ``decode`` returns, or None where it refuses the input."""
    try:
        return decode(*args)
    except (InvalidArgument, UnicodeDecodeError):
        return None


def test_round_trips():
    items = [(b"k1", 5, 0xFFFFFFFF), (b"key-two", 1 << 33, 7)]
    assert wire.decode_announce(wire.encode_announce("node-a", 2**63 - 1, items, L), L) == ("node-a", 2**63 - 1, items)
    assert wire.decode_withdraw(wire.encode_withdraw("n", 3, [b"a", b"b"], L), L) == ("n", 3, [b"a", b"b"])
    per = [[Holder("a", 1, 10, 0xDEADBEEF), Holder("b", 2, 10, 0)], []]
    assert wire.decode_locate_reply(wire.encode_locate_reply(per, L), L) == per
    assert wire.decode_fetch(wire.encode_fetch("tenant", [b"x"], L), L) == ("tenant", [b"x"])
    body = wire.encode_fetch_reply(9, [(0, 4), (3, 0), (0, 6)], L)
    assert wire.decode_fetch_reply(body, L, 10) == (9, [(0, 4), (3, 0), (0, 6)])
    assert wire.decode_json(wire.encode_json({"a": [1]})) == {"a": [1]}
    assert wire.decode_replicate(wire.encode_replicate(items, L), L) == items
    nonce, mac = bytes(range(32)), bytes(range(32, 64))
    assert wire.decode_node_auth(wire.encode_node_auth("a", 3, "b", nonce)) == ("a", 3, "b", nonce)
    assert wire.decode_node_auth_reply(wire.encode_node_auth_reply("b", 4, nonce, mac)) == ("b", 4, nonce, mac)
    assert wire.decode_node_proof(wire.encode_node_proof(mac)) == mac


@pytest.mark.parametrize("decode, body", [
    (wire.decode_node_auth, wire.encode_node_auth("a", 3, "b", bytes(32))[:-1]),
    (wire.decode_node_auth, wire.encode_node_auth("a", 3, "b", bytes(32)) + b"x"),
    (wire.decode_node_auth_reply, wire.encode_node_auth_reply("b", 4, bytes(32), bytes(32))[:-1]),
    (wire.decode_node_proof, bytes(31)),
    (wire.decode_node_proof, bytes(33)),
])
def test_node_login_bodies_of_the_wrong_length_are_refused(decode, body):
    with pytest.raises(InvalidArgument):
        decode(body)


def test_fetch_reply_whose_sizes_do_not_add_up_to_the_payload_is_refused():
    body = wire.encode_fetch_reply(1, [(0, 4)], L)
    with pytest.raises(InvalidArgument, match="add up"):
        wire.decode_fetch_reply(body, L, 5)


@pytest.mark.parametrize("body", [
    b"", b"\x05ab", wire.encode_withdraw("n", 1, [b"a"], L)[:-1],
    wire.encode_withdraw("n", 1, [b"a"], L) + b"x",
    b"\x01n" + (1).to_bytes(8, "little") + (10**6).to_bytes(4, "little"),   # count beyond the body
])
def test_truncated_long_or_huge_count_bodies_are_refused(body):
    with pytest.raises(InvalidArgument):
        wire.decode_withdraw(body, L)


def test_batch_over_the_limit_is_refused_both_ways():
    with pytest.raises(InvalidArgument, match="batch"):
        wire.encode_announce("n", 1, [(b"k", 1, 0)] * 17, L)
    big = wire.encode_announce("n", 1, [(b"k", 1, 0)] * 17, ProtocolLimits(max_batch=64))
    with pytest.raises(InvalidArgument, match="batch"):
        wire.decode_announce(big, L)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=5), max_size=6), st.integers(0, 20), st.integers(-3, 3), st.binary(max_size=3))
def test_the_key_list_decoder_accepts_and_refuses_exactly_what_the_protocol_decoder_does(keys, count, cut, extra):
    body = (count if count < 17 else len(keys)).to_bytes(4, "little") + b"".join(
        len(k).to_bytes(2, "little") + k for k in keys)
    body = body[:len(body) + cut] if cut < 0 else body + extra[:cut]
    assert _verdict(wire.decode_locate, body, L) == _verdict(messages.decode_keys_request, body, L, "x")


def test_the_key_list_decoder_matches_on_valid_lists():
    keys = [b"a", b"bb" * 40, bytes(range(256)) * 2]
    assert wire.decode_locate(messages.encode_keys_request(keys, L), L) == keys


def _locate_reply_by_reader(body, limits):
    """The LOCATE reply read field by field with the checked ``BodyReader``: the reference
    the one-loop decoder must agree with (a name that is not UTF-8 is its caller's to refuse)."""
    r = messages.BodyReader(body, "LOCATE reply")
    out = []
    for _ in range(r.count(limits, 1)):
        holders = []
        for _ in range(r.u8("holder count")):
            node = r.take(r.u8("node id length"), "node id").decode("utf-8")
            holders.append(Holder(node, r.u64("epoch"), r.u64("size"), r.u32("crc")))
        out.append(holders)
    r.end()
    return out


_holders = st.lists(st.lists(st.tuples(st.text(max_size=6), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                                       st.integers(0, 2**32 - 1)), max_size=3), max_size=5)


@settings(max_examples=300, deadline=None)
@given(_holders, st.integers(-40, 3), st.binary(max_size=3), st.integers(0, 40))
def test_the_locate_reply_decoder_accepts_and_refuses_exactly_what_the_checked_reader_does(per, cut, extra, flip):
    body = wire.encode_locate_reply([[Holder(*h) for h in hs] for hs in per], L)
    assert wire.decode_locate_reply(body, L) == [[Holder(*h) for h in hs] for hs in per]
    body = body[:max(len(body) + cut, 0)] if cut < 0 else body + extra[:cut]
    if body and flip < len(body):               # a count, a length or a byte of a name changed
        body = body[:flip] + bytes([body[flip] ^ 0x81]) + body[flip + 1:]
    assert _verdict(wire.decode_locate_reply, body, L) == _verdict(_locate_reply_by_reader, body, L)
