"""_native/blocks.pyx: the store's per-block records are 64 bytes, read and written from
Python as attributes, refuse a size they cannot hold, and keep no encoded key of their own."""
import pytest

from quillcache._native.blocks import MAX_SIZE, PUBLISHED, Entry, Slot
from quillcache.model import KvBlockKey, decode_key, encode_key
from quillcache.store.dram import MAX_BLOCK_LIMIT


def key(i):
    return KvBlockKey("m", "tok", None, "t", "root", f"b{i}", i)


def test_a_slot_and_an_entry_are_64_bytes():
    assert Slot.__basicsize__ == 64 and Entry.__basicsize__ == 64


def test_an_entrys_ek_is_its_keys_own_encoding():
    k = key(1)
    e = Entry(k, 10, 3, 1.5)
    assert e.ek is k.encoded() and e.ek == encode_key(k)
    d = decode_key(k.encoded())
    assert Entry(d, 10, 3, 1.5).ek == k.encoded()
    with pytest.raises(AttributeError):
        e.ek = b"other"


def test_fields_read_and_write_as_attributes():
    k = key(2)
    e = Entry(k, MAX_SIZE, 7, 2.0)
    assert (e.key, e.size, e.version, e.ssd_version, e.pin_until, e.hard, e.last_access) == (
        k, MAX_SIZE, 7, None, 0.0, False, 2.0)
    e.size, e.version, e.ssd_version, e.pin_until, e.hard, e.last_access = 5, 8, 8, 9.5, True, 3.0
    assert (e.size, e.version, e.ssd_version, e.pin_until, e.hard, e.last_access) == (5, 8, 8, 9.5, True, 3.0)
    s = Slot(k, 1 << 39, MAX_SIZE, (1 << 64) - 1, 4.0)
    assert (s.key, s.offset, s.size, s.handle, s.refs, s.state, s.started) == (
        k, 1 << 39, MAX_SIZE, (1 << 64) - 1, 0, 0, 4.0)
    s.refs += 3
    s.state = PUBLISHED
    assert (s.refs, s.state) == (3, PUBLISHED)


@pytest.mark.parametrize("size", [-1, MAX_SIZE + 1, 1 << 32, 1 << 40])
def test_a_size_a_record_cannot_hold_is_refused_not_wrapped(size):
    with pytest.raises(ValueError, match=f"0..{MAX_SIZE} bytes"):
        Entry(key(3), size, 1, 0.0)
    with pytest.raises(ValueError, match=f"0..{MAX_SIZE} bytes"):
        Slot(key(3), 0, size, 1, 0.0)
    e = Entry(key(3), 1, 1, 0.0)
    with pytest.raises(OverflowError):
        e.size = 1 << 32                 # past the u32 field: refused, never wrapped
    assert e.size == 1


def test_the_store_limit_is_the_record_limit():
    assert MAX_BLOCK_LIMIT == MAX_SIZE == 1 << 31
