"""Header bodies of every request and reply: round trips, limits, truncation."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.errors import (
    STATUS_CLASSES, Busy, CapacityError, InvalidArgument, NotFound, ProtocolError, QuillCacheError,
    UnsafeReuse,
)
from quillcache.model import KvBlockKey, encode_key, encode_scope_prefix
from quillcache.protocol import messages as m
from quillcache.protocol.opcodes import InfoFormat, PinMode, ProtocolLimits

SMALL = ProtocolLimits(max_batch=4, max_key_bytes=16, max_token_bytes=8, max_message_bytes=20)
keys_st = st.lists(st.binary(min_size=1, max_size=64), max_size=20)


def key(i: int) -> bytes:
    return encode_key(KvBlockKey("llama-3-8b", "tok", None, "tenant-a", "root", f"h{i}", i))


def test_put_and_get_round_trip_a_model_key():
    k = key(3)
    body = m.encode_put_request(k, 4096)
    assert m.decode_put_request(body, payload_length=4096) == (k, 4096)
    assert m.decode_get_request(m.encode_get_request(k)) == k


def test_put_body_size_must_match_the_frame_payload():
    body = m.encode_put_request(key(1), 100)
    with pytest.raises(InvalidArgument, match="declares 100 payload bytes, the frame carries 99"):
        m.decode_put_request(body, payload_length=99)


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.tuples(st.binary(min_size=1, max_size=64), st.integers(0, 1 << 23)), max_size=20))
def test_put_many_round_trips_and_checks_the_total(items):
    body = m.encode_put_many_request(items)
    total = sum(n for _, n in items)
    assert m.decode_put_many_request(body, payload_length=total) == [m.PutItem(k, n) for k, n in items]
    if items:
        with pytest.raises(InvalidArgument):
            m.decode_put_many_request(body, payload_length=total + 1)


def test_put_many_total_over_the_payload_limit_is_refused():
    with pytest.raises(InvalidArgument, match="bytes in all, at most"):
        m.encode_put_many_request([(b"a", 1 << 27), (b"b", 1 << 27), (b"c", 1)])


@settings(max_examples=100, deadline=None)
@given(keys=keys_st, bits=st.lists(st.booleans(), max_size=40), statuses=st.lists(st.integers(0, 65535), max_size=20))
def test_key_lists_bitmaps_and_status_lists_round_trip(keys, bits, statuses):
    assert m.decode_keys_request(m.encode_keys_request(keys)) == keys
    assert m.decode_bitmap_reply(m.encode_bitmap_reply(bits)) == bits
    assert m.decode_status_list(m.encode_status_list(statuses)) == statuses
    ex = m.decode_exists_reply(m.encode_exists_reply(bits))
    assert ex.present == bits
    assert ex.prefix_len == (bits.index(False) if False in bits else len(bits))


def test_exists_reply_reports_the_present_prefix_for_batch_exists():
    reply = m.decode_exists_reply(m.encode_exists_reply([True, True, False, True]))
    assert reply == m.ExistsReply(2, [True, True, False, True])


def test_exists_reply_with_an_inconsistent_prefix_is_refused():
    body = bytearray(m.encode_exists_reply([True, False, True]))
    body[4] = 3                     # prefix_len says all three
    with pytest.raises(InvalidArgument, match="prefix_len 3"):
        m.decode_exists_reply(bytes(body))


def test_bitmap_with_bits_past_the_count_is_refused():
    body = bytearray(m.encode_bitmap_reply([True, False, True]))
    body[-1] |= 0x80
    with pytest.raises(InvalidArgument, match="past item 3"):
        m.decode_bitmap_reply(bytes(body))


def test_get_many_reply_round_trips_and_matches_the_payload():
    items = [(0, 100), (NotFound.status, 0), (0, 7)]
    body = m.encode_get_many_reply(items)
    assert m.decode_get_many_reply(body, payload_length=107) == items
    with pytest.raises(InvalidArgument):
        m.decode_get_many_reply(body, payload_length=100)
    with pytest.raises(InvalidArgument, match="non-zero status"):
        m.encode_get_many_reply([(3, 5)])


def test_pin_unpin_round_trip():
    ks = [key(i) for i in range(3)]
    assert m.decode_pin_request(m.encode_pin_request(ks, PinMode.HARD, 60_000)) == (PinMode.HARD, 60_000, ks)
    assert m.decode_unpin_request(m.encode_unpin_request(ks, PinMode.SOFT)) == (PinMode.SOFT, ks)
    with pytest.raises(InvalidArgument, match="pin mode 2"):
        m.decode_pin_request(b"\x02" + m.encode_pin_request(ks)[1:])


def test_list_request_and_reply_round_trip_with_a_scope_prefix():
    k = KvBlockKey("llama-3-8b", "tok", "lora-1", "tenant-a", "root", "h", 0)
    prefix = encode_scope_prefix(k, "root")
    req = m.decode_list_request(m.encode_list_request(prefix, 100, start_after=key(1)))
    assert req == m.ListRequest(prefix, 100, key(1))
    ks = [key(i) for i in range(5)]
    assert m.decode_list_reply(m.encode_list_reply(ks, True)) == m.ListReply(ks, True)
    with pytest.raises(InvalidArgument, match="limit 0"):
        m.encode_list_request(prefix, 0)


def test_stats_request_and_reply_round_trip():
    assert m.decode_stats_request(m.encode_stats_request(InfoFormat.JSON, "memory")) == (InfoFormat.JSON, "memory")
    assert m.decode_stats_reply(m.encode_stats_reply(InfoFormat.TEXT)) is InfoFormat.TEXT
    with pytest.raises(InvalidArgument, match="format 9"):
        m.decode_stats_request(b"\x09\x00\x00")


def test_hello_round_trip_and_version_negotiation():
    req = m.decode_hello_request(m.encode_hello_request(b"secret", min_version=1, max_version=3, client_name="vllm"))
    assert req == m.HelloRequest(1, 3, b"secret", "vllm")
    assert m.negotiate_version(req, min_version=1, max_version=1) == 1
    assert m.negotiate_version(req, min_version=2, max_version=5) == 3
    with pytest.raises(ProtocolError, match="no common protocol version"):
        m.negotiate_version(m.HelloRequest(2, 2, b"", ""), min_version=1, max_version=1)
    limits = ProtocolLimits(max_batch=77, max_in_flight=9)
    rep = m.decode_hello_reply(m.encode_hello_reply(1, "tenant-a", limits, "node-1"))
    assert rep == m.HelloReply(1, "tenant-a", "node-1", limits)


def test_hello_reply_with_impossible_limits_is_refused():
    body = bytearray(m.encode_hello_reply(1, "t", ProtocolLimits()))
    body[-16:-12] = b"\x00\x00\x00\x00"      # max_batch = 0
    with pytest.raises(InvalidArgument, match="max_batch"):
        m.decode_hello_reply(bytes(body))


@pytest.mark.parametrize("status", sorted(STATUS_CLASSES))
def test_error_bodies_round_trip_to_the_same_exception_class(status):
    cls = STATUS_CLASSES[status]
    if cls is UnsafeReuse:
        exc = UnsafeReuse("tokenizer", "resident under tokenizer tok-2 only")
    elif cls is CapacityError:
        exc = CapacityError(4096, 100, 50)
    else:
        exc = cls(f"boom {status}")
    code, body = m.encode_error(exc)
    assert code == status
    back = m.decode_error(code, body)
    assert type(back) is cls and str(back) == str(exc)
    if cls is UnsafeReuse:
        assert back.violation == "tokenizer"
    if cls is CapacityError:
        assert (back.requested, back.free, back.largest_free) == (4096, 100, 50)


def test_error_from_a_foreign_exception_is_internal_and_the_message_is_cut_on_a_character():
    code, body = m.encode_error(RuntimeError("x" * 30), SMALL)
    assert code == 1 and str(m.decode_error(code, body, SMALL)) == "internal error: Runt"  # 20 bytes
    code, body = m.encode_error(Busy("é" * 15), SMALL)       # 30 bytes of UTF-8, limit 20
    assert str(m.decode_error(code, body, SMALL)) == "é" * 10


def test_error_with_a_broken_body_still_gives_the_right_class():
    err = m.decode_error(NotFound.status, b"\x00\xff")
    assert isinstance(err, NotFound) and "malformed ERROR body" in str(err)
    unknown = m.decode_error(999, m.encode_error(QuillCacheError("odd"))[1])
    assert type(unknown) is QuillCacheError and unknown.status == 999


def test_limits_are_enforced_on_both_encode_and_decode():
    with pytest.raises(InvalidArgument, match="batch of 5 items, at most 4"):
        m.encode_keys_request([b"k"] * 5, SMALL)
    with pytest.raises(InvalidArgument, match="batch of 5 items, at most 4"):
        m.decode_keys_request(m.encode_keys_request([b"k"] * 5), SMALL)
    with pytest.raises(InvalidArgument, match="key of 17 bytes, at most 16"):
        m.encode_get_request(b"k" * 17, SMALL)
    with pytest.raises(InvalidArgument, match="key of 17 bytes, at most 16"):
        m.decode_get_request(m.encode_get_request(b"k" * 17), SMALL)
    with pytest.raises(InvalidArgument, match="empty key"):
        m.encode_get_request(b"")
    with pytest.raises(InvalidArgument, match="token of 9 bytes"):
        m.encode_hello_request(b"t" * 9, limits=SMALL)
    with pytest.raises(InvalidArgument, match="must be bytes"):
        m.encode_get_request("a-str-key")


def test_a_count_the_body_cannot_hold_is_refused_before_building_lists():
    body = (1000).to_bytes(4, "little") + b"\x01\x00k"
    with pytest.raises(InvalidArgument, match="count 1000 needs at least 3000 bytes"):
        m.decode_keys_request(body)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.binary(min_size=1, max_size=20), min_size=1, max_size=5), cut=st.integers(0, 200))
def test_truncated_or_extended_bodies_raise_invalid_argument(keys, cut):
    body = m.encode_pin_request(keys, PinMode.SOFT, 5)
    for bad in (body[:cut % len(body)], body + b"\x00"):
        with pytest.raises(InvalidArgument):
            m.decode_pin_request(bad)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64))
def test_random_bodies_only_ever_raise_invalid_argument(body):
    for decode in (m.decode_hello_request, m.decode_hello_reply, m.decode_put_request, m.decode_get_request,
                   m.decode_put_many_request, m.decode_status_list, m.decode_keys_request,
                   m.decode_get_many_reply, m.decode_exists_reply, m.decode_bitmap_reply, m.decode_pin_request,
                   m.decode_unpin_request, m.decode_list_request, m.decode_list_reply,
                   m.decode_stats_request, m.decode_stats_reply):
        try:
            decode(body)
        except InvalidArgument:
            pass
    assert isinstance(m.decode_error(2, body), QuillCacheError)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just(0), st.integers(0, (1 << 64) - 1)),
                          st.tuples(st.integers(1, 0xFFFF), st.just(0))), max_size=40))
def test_the_get_many_reply_is_the_same_bytes_as_its_layout_packed_by_hand(items):
    """The native encoder and decoder (``encode_status_sizes``/``decode_status_sizes``)
    write and read exactly ``u32 count, count * (u16 status, u64 nbytes)``."""
    import struct
    body = m.encode_get_many_reply(items)
    assert body == struct.pack("<I", len(items)) + b"".join(struct.pack("<HQ", s, n) for s, n in items)
    assert m.decode_get_many_reply(body, payload_length=sum(n for _, n in items)) == items
    for cut in range(len(body)):                   # truncated anywhere: a named error, no crash
        with pytest.raises(InvalidArgument):
            m.decode_get_many_reply(body[:cut])
    with pytest.raises(InvalidArgument):
        m.decode_get_many_reply(body + b"\x00")
