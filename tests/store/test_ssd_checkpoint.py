"""ssd.read_checkpoint and ssd.Replay: the one reading of an SSD checkpoint + WAL, used by the
tier's recovery and by `quillctl wal verify` (cli/ctl_wal.py)."""
import asyncio
import os

import pytest

from quillcache._native.wal import WalReader
from quillcache.model import KvBlockKey, encode_key
from quillcache.store import ssd
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
    recovered = {e.kb: (e.offset, e.length, e.crc) for e in r._map.values()}   # noqa: SLF001 (white box)
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


@pytest.mark.parametrize(("damage", "problem"), [
    ("flip", "checksum mismatch"),
    ("count", "shorter than its entry count"),
    ("magic", "not a version 1 checkpoint"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_problem(tmp_path, damage, problem):
    from quillcache._native.crc import crc32c
    path = tmp_path / "ckpt"
    head = ssd._CKPT_HEAD.pack(ssd.CKPT_MAGIC if damage != "magic" else b"XXXXXXXX", ssd.CKPT_VERSION,  # noqa: SLF001
                               4096, CAP, 7, 5 if damage == "count" else 1)
    kb = encode_key(key(1))
    body = bytearray(head + ssd._CKPT_ENTRY.pack(len(kb), 0, 100, 0, 7) + kb)  # noqa: SLF001
    body += crc32c(bytes(body)).to_bytes(4, "little")
    if damage == "flip":
        body[10] ^= 1
    path.write_bytes(bytes(body))
    with pytest.raises(CorruptCheckpoint) as ei:
        read_checkpoint(str(path))
    assert ei.value.problem == problem and f"checkpoint {path} is corrupt" in str(ei.value)


def test_no_checkpoint_is_an_empty_map(tmp_path):
    assert read_checkpoint(str(tmp_path / "none")) == (0, None, {})
