"""ssd.read_checkpoint and ssd.Replay: the one reading of an SSD checkpoint + WAL, used by the
tier's recovery and by `quillctl wal verify` (quillcache_cli/ctl_wal.py)."""
import asyncio
import os

import pytest

from quillcache._native.wal import WalReader
from quillcache.model import KvBlockKey, encode_key
from quillcache.store import blockmap, ssd
from quillcache.store.ssd import CorruptCheckpoint, Replay, SsdTier, read_checkpoint
from quillcache_cli.ctl_wal import SsdReplay

CAP = 1 << 20


def key(i: int) -> KvBlockKey:
    return KvBlockKey("m", "tok", None, "t", "p", f"b{i}", i)


def test_the_tier_and_wal_verify_rebuild_the_same_map(tmp_path):
    t = SsdTier(tmp_path, CAP, checkpoint_records=4)

    async def fill():
        for i in range(10):
            await t.put(key(i), bytes([i]) * (1000 + i))
        await t.remove(key(3))
    asyncio.run(fill())
    t.close_sync()
    r = SsdTier(tmp_path, CAP)                  # recovery: checkpoint + replay
    recovered = {encode_key(k): (off, n, crc) for k, off, n, crc in r.entries()}
    r.close_sync()
    lsn, unit, entries = read_checkpoint(os.path.join(tmp_path, ssd.CHECKPOINT_NAME))
    assert unit == ssd.DEFAULT_UNIT
    replay = Replay(lsn, entries)
    for rec_lsn, payload in WalReader(os.path.join(tmp_path, ssd.WAL_DIR_NAME)):
        replay(rec_lsn, payload)
    assert {kb: tuple(v[:3]) for kb, v in replay.entries.items()} == recovered
    assert encode_key(key(3)) not in recovered and len(recovered) == 9
    verify = SsdReplay(os.path.join(tmp_path, ssd.DATA_NAME), os.path.join(tmp_path, ssd.CHECKPOINT_NAME))
    for rec_lsn, payload in WalReader(os.path.join(tmp_path, ssd.WAL_DIR_NAME)):
        verify(rec_lsn, payload)
    assert verify.problem is None and verify.entries == replay.entries


def _v2_checkpoint(path, count_lie=0):
    """A version 2 checkpoint of one block, written by the tier's writer; count_lie: add this
    to the row count in the header (and fix the checksum) to make the body disagree."""
    from quillcache._native.crc import crc32c
    kb = encode_key(key(1))
    blockmap.write_checkpoint(str(path), 4096, CAP, 7, blockmap.BlockMap().live_table(),
                              [(kb, 0, 100, 0, 7)])
    body = bytearray(path.read_bytes())
    if count_lie:
        body[32:40] = (1 + count_lie).to_bytes(8, "little")
        body[-4:] = crc32c(bytes(body[:-4])).to_bytes(4, "little")
    path.write_bytes(bytes(body))
    return kb


@pytest.mark.parametrize(("damage", "problem"), [
    ("flip", "checksum mismatch"),
    ("count", "shorter than its entry count"),
    ("magic", "not a version 1 or 2 checkpoint"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_problem(tmp_path, damage, problem):
    from quillcache._native.crc import crc32c
    path = tmp_path / "ckpt"
    _v2_checkpoint(path, count_lie=4 if damage == "count" else 0)
    body = bytearray(path.read_bytes())
    if damage == "flip":
        body[10] ^= 1
    if damage == "magic":
        body[:8] = b"XXXXXXXX"
        body[-4:] = crc32c(bytes(body[:-4])).to_bytes(4, "little")
    path.write_bytes(bytes(body))
    with pytest.raises(CorruptCheckpoint) as ei:
        read_checkpoint(str(path))
    assert ei.value.problem == problem and f"checkpoint {path} is corrupt" in str(ei.value)


def test_a_version_1_checkpoint_is_still_read(tmp_path):
    # the layout before the columnar one: one variable-length entry per block
    import struct

    from quillcache._native.crc import crc32c
    path = tmp_path / "ckpt"
    kbs = [encode_key(key(i)) for i in range(3)]
    body = bytearray(struct.pack("<8sIIQQQ", b"QCSSDCK1", 1, 4096, CAP, 9, len(kbs)))
    for i, kb in enumerate(reversed(kbs)):            # any order: rows come back by offset
        body += struct.pack("<HQIIQ", len(kb), (2 - i) * 4096, 10 + i, 100 + i, 5) + kb
    body += crc32c(bytes(body)).to_bytes(4, "little")
    path.write_bytes(bytes(body))
    lsn, unit, entries = read_checkpoint(str(path))
    assert (lsn, unit) == (9, 4096)
    assert dict(entries) == {kbs[j]: [j * 4096, 12 - j, 102 - j, 5] for j in range(3)}
    assert entries.offset.tolist() == [0, 4096, 8192]


def test_the_checkpoint_round_trips_in_offset_order_and_damage_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    kb = _v2_checkpoint(path)
    lsn, unit, entries = read_checkpoint(str(path))
    assert (lsn, unit, dict(entries)) == (7, 4096, {kb: [0, 100, 0, 7]})
    # rows written out of offset order come back sorted, keys following their rows
    rows = [(encode_key(key(i)), (5 - i) * 4096, 10 + i, i, i) for i in range(5)]
    blockmap.write_checkpoint(str(path), 4096, CAP, 3, blockmap.BlockMap().live_table(), rows)
    _, _, entries = read_checkpoint(str(path))
    assert entries.offset.tolist() == sorted(r[1] for r in rows)
    assert dict(entries) == {r[0]: [r[1], r[2], r[3], r[4]] for r in rows}
    del entries[rows[2][0]]                            # and a map with dead rows writes only live ones
    blockmap.write_checkpoint(str(path), 4096, CAP, 4, entries.live_table(), [])
    assert len(read_checkpoint(str(path))[2]) == 4


def test_no_checkpoint_is_an_empty_map(tmp_path):
    assert read_checkpoint(str(tmp_path / "none")) == (0, None, {})


def test_recovery_keeps_the_newest_of_blocks_claiming_one_extent_and_drops_bad_rows(tmp_path, caplog):
    """A lost record can leave blocks whose extents overlap: the newest (highest lsn) keeps
    its bytes, each older one is dropped (a REMOVE record, counted); so is a row whose key is
    not an encoded key.  Rows that clash with nothing are recovered untouched."""
    from quillcache._native.crc import crc32c
    zeros = crc32c(bytes(100))
    rows = [(encode_key(key(1)), 0, 8192, 0, 1),            # X: [0, 8192), oldest
            (encode_key(key(2)), 4096, 8192, zeros, 3),     # Y: [4096, 12288), newest: kept
            (encode_key(key(3)), 8192, 4096, 0, 2),         # Z: inside Y, older: dropped
            (encode_key(key(4)), 16384, 100, zeros, 4),     # W: alone: kept
            (b"\x09not-a-key", 24576, 100, 0, 5)]           # another key format: dropped
    os.makedirs(tmp_path / "tier")
    blockmap.write_checkpoint(str(tmp_path / "tier" / ssd.CHECKPOINT_NAME), 4096, CAP, 0,
                              blockmap.BlockMap().live_table(), rows)
    t = SsdTier(tmp_path / "tier", CAP)
    assert sorted(k.block_hash for k in t.keys()) == ["b2", "b4"]
    assert t.stats()["dropped_blocks"] == 3 and t.untouched == 2
    assert [(off, n) for off, n, _ in t.allocator.extents()] == [(4096, 8192), (16384, 4096)]
    assert "it overlaps a newer block" in caplog.text and "not an encoded key" in caplog.text
    buf = bytearray(100)
    assert t.read_into(key(4), buf) == 100 and t.untouched == 1      # first touch: made an entry
    t.close_sync()
    again = SsdTier(tmp_path / "tier", CAP)                          # the drops were logged: stable
    assert sorted(k.block_hash for k in again.keys()) == ["b2", "b4"]
    assert again.stats()["dropped_blocks"] == 0
    again.close_sync()
