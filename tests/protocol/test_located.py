"""The located-operation bodies (protocol/located.py) against their spec in docs/protocol.md."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st

from quillcache.errors import Busy, InvalidArgument, NotFound, ProtocolError, UnsafeReuse
from quillcache.protocol import located, messages
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


class Hit:
    """A hit as the node hands it to the encoder: an object with offset and size (a Slot)."""

    def __init__(self, offset, size):
        self.offset = offset
        self.size = size


_u64 = st.integers(0, (1 << 64) - 1)
_item = st.one_of(st.tuples(st.integers(0, 0xFFFF), _u64, _u64), st.builds(Hit, _u64, _u64))


@given(st.lists(_item, max_size=40))
def test_hits_given_as_objects_encode_as_the_tuples_they_stand_for(items):
    """The codec's one-pass packing against struct, item by item (the simple oracle)."""
    plain = [(0, i.offset, i.size) if isinstance(i, Hit) else i for i in items]
    body = located.encode_located_reply(5, 77, items)
    assert body == struct.pack("<QQI", 5, 77, len(items)) + b"".join(struct.pack("<HQQ", *i) for i in plain)


def test_items_outside_u16_or_u64_are_refused():
    for bad in ([(1 << 16, 0, 0)], [(0, 1 << 64, 0)], [Hit(0, -1)]):
        with pytest.raises((InvalidArgument, OverflowError)):
            located.encode_located_reply(1, 2, bad)


ARENA = 1 << 20
_extent_item = st.one_of(
    st.tuples(st.just(0), st.integers(0, ARENA + 10), st.integers(0, ARENA + 10)),      # a hit, maybe outside
    st.tuples(st.sampled_from([NotFound.status, UnsafeReuse.status, Busy.status]), st.just(0), st.just(0)),
    st.tuples(st.just(0), st.just((1 << 64) - 1), st.just(2)),                           # u64 wrap
)


def _oracle(items):
    """What the client must make of a reply: the first bad item's error, else the extents."""
    for status, off, n in items:
        if status == 0 and (off > ARENA or n > ARENA - off):
            return ProtocolError
        if status not in (0, NotFound.status, UnsafeReuse.status):
            return Busy
    return [(off, n) if status == 0 else None for status, off, n in items]


@given(st.lists(_extent_item, max_size=30))
def test_client_checks_and_views_of_a_reply_match_the_item_by_item_reading(items):
    rep = located.decode_located_reply(located.encode_located_reply(1, 2, items), ProtocolLimits(max_batch=64))
    want = _oracle(items)
    arena = memoryview(bytes(range(251)) * (ARENA // 251 + 1))[:ARENA]
    if not isinstance(want, list):
        with pytest.raises(want):
            located.check_located_items(rep.items, ARENA)
        return
    located.check_located_items(rep.items, ARENA)
    views = located.located_views(arena, rep.items)
    assert [None if v is None else (v.obj is arena.obj, v.nbytes) for v in views] == \
        [None if e is None else (True, e[1]) for e in want]
    for v, e in zip(views, want):
        if v is not None:
            assert v.tobytes() == arena[e[0]:e[0] + e[1]].tobytes()


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


# ---------------------------------------------------------------- key lists (GET_LOCATED, RESERVE bodies)

_raw = st.binary(min_size=1, max_size=40)
LIST_LIMITS = ProtocolLimits(max_batch=16, max_key_bytes=40)


def _key_list_oracle(keys):
    return struct.pack("<I", len(keys)) + b"".join(struct.pack("<H", len(k)) + k for k in keys)


def _sized_list_oracle(items):
    return struct.pack("<I", len(items)) + b"".join(struct.pack("<QH", n, len(k)) + k for k, n in items)


@given(st.lists(_raw, max_size=16))
def test_key_list_body_is_the_spec_and_decodes_back(keys):
    body = messages.encode_keys_request(keys, LIST_LIMITS, "GET_LOCATED")
    assert body == _key_list_oracle(keys)
    assert messages.decode_keys_request(body, LIST_LIMITS, "GET_LOCATED") == keys


@given(st.lists(st.tuples(_raw, st.integers(0, 1 << 20)), max_size=16))
def test_sized_key_list_body_is_the_spec_and_decodes_back(items):
    body = messages.encode_put_many_request(items, LIST_LIMITS)
    assert body == _sized_list_oracle(items)
    total = sum(n for _, n in items)
    assert messages.decode_put_many_columns(body, total, LIST_LIMITS, "RESERVE") == \
        ([k for k, _ in items], [n for _, n in items])
    assert messages.decode_put_many_request(body, total, LIST_LIMITS) == [messages.PutItem(k, n) for k, n in items]
    for cut in range(len(body)):                            # every truncation is refused, never misread
        with pytest.raises(InvalidArgument):
            messages.decode_put_many_columns(body[:cut], None, LIST_LIMITS, "RESERVE")


def test_sized_key_lists_over_a_limit_are_refused_before_building_anything():
    with pytest.raises(InvalidArgument, match="at most 16"):
        messages.encode_put_many_request([(b"k", 1)] * 17, LIST_LIMITS)
    with pytest.raises(InvalidArgument, match="at most 16"):
        messages.decode_put_many_columns(struct.pack("<I", 17) + b"\0" * 11 * 17, None, LIST_LIMITS)
    with pytest.raises(InvalidArgument, match="needs at least"):
        messages.decode_put_many_columns(struct.pack("<I", 16), None, LIST_LIMITS)
    with pytest.raises(InvalidArgument, match="bytes in all"):
        messages.encode_put_many_request([(b"k", 1 << 62), (b"j", 1 << 62), (b"l", 1 << 62)],
                                         ProtocolLimits(max_payload_bytes=(1 << 63) - 1))
    with pytest.raises(InvalidArgument, match="payload"):
        messages.decode_put_many_columns(messages.encode_put_many_request([(b"k", 5)], LIST_LIMITS), 4, LIST_LIMITS)


@given(st.lists(st.tuples(st.integers(0, ARENA + 10), st.integers(1, ARENA + 10)), max_size=20),
       st.sampled_from([None, (1 << 64) - 1]))
def test_reserved_slots_are_checked_against_the_arena_and_viewed_in_place(slots, wrap):
    if wrap is not None:
        slots = slots + [(wrap, 2)]                                 # u64 wrap: outside, never a tiny slot
    offsets, sizes = [o for o, _ in slots], [n for _, n in slots]
    outside = [i for i, (o, n) in enumerate(slots) if o + n > ARENA]
    if outside:
        with pytest.raises(ProtocolError, match=f"slot {offsets[outside[0]]}\\+{sizes[outside[0]]} outside"):
            located.check_slots(offsets, sizes, ARENA)
        return
    located.check_slots(offsets, sizes, ARENA)
    arena = memoryview(bytearray(ARENA))
    views = located.slot_views(arena, offsets, sizes)
    for v, (o, n) in zip(views, slots):
        assert not v.readonly and v.nbytes == n
        v[:1] = b"\x07"
        assert arena[o] == 7
