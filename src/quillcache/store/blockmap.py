"""The SSD tier's block map on disk: the checkpoint file, the WAL replay over it, and the
rows recovered from it.

``read_checkpoint`` + ``Replay`` are the one reading of a tier's checkpoint and WAL, used
by the tier's recovery (store/ssd.py) and by ``quillctl wal verify`` (quillcache_cli/ctl_wal.py).
docs/ssd-format.md describes both checkpoint versions; this build writes version 2:

    header (48 bytes): magic "QCSSDCK2" | u32 version=2 | u32 unit | u64 capacity | u64 lsn
                       | u64 count n | u64 key blob bytes
    u64 offset[n] | u32 length[n] | u32 crc32c[n] | u64 lsn[n] | u64 key_off[n + 1] | key blob
    u32 crc32c of everything before

Rows are in ascending offset order (the allocator is rebuilt in one sweep).  Version 1
(one variable-length entry per block) is still read.

A ``BlockMap`` is a mapping ``encoded key -> [offset, length, crc32c, lsn]``: the rows of
a checkpoint as numpy columns with an adaptive radix tree from key to row (no Python
object per row), plus a dict of the entries set since (``changed``).  Opening a tier of a
million blocks costs the read, one CRC and the tree build, not a million objects.
"""
from __future__ import annotations

import os
import struct
from collections.abc import MutableMapping
from typing import Iterator, Optional

import numpy as np

from quillcache._native.art import AdaptiveRadixTree
from quillcache._native.crc import crc32c  # any contiguous buffer, in place, GIL released when large
from quillcache.errors import CorruptCheckpoint

__all__ = ["BlockMap", "CorruptCheckpoint", "read_checkpoint", "write_checkpoint", "Replay",
           "encode_put", "encode_remove", "decode_record", "CKPT_VERSION",
           "REC_PUT", "REC_REMOVE", "ANY_OFFSET", "REASON_REMOVE", "REASON_CRC", "REASON_RECOVERY"]

# ---- WAL records -------------------------------------------------------------------------------
REC_PUT = 1                       # payload: type, key_len u16, key, offset u64, length u32, crc u32
REC_REMOVE = 2                    # payload: type, key_len u16, key, offset u64 (ANY_OFFSET), reason u8
ANY_OFFSET = (1 << 64) - 1        # a REMOVE that removes whatever extent the key has
REASON_REMOVE = 0                 # remove/evict by the caller
REASON_CRC = 1                    # the block's bytes did not match its CRC: dropped
REASON_RECOVERY = 2               # recovery could not keep the block (overlap, out of range)
_HDR = struct.Struct("<BH")
_PUT_TAIL = struct.Struct("<QII")
_REM_TAIL = struct.Struct("<QB")

# ---- checkpoint --------------------------------------------------------------------------------
CKPT_MAGIC_V1 = b"QCSSDCK1"
CKPT_MAGIC = b"QCSSDCK2"
CKPT_VERSION = 2
_CKPT_HEAD_V1 = struct.Struct("<8sIIQQQ")    # magic, version, unit, capacity, lsn, count
_CKPT_ENTRY_V1 = struct.Struct("<HQIIQ")     # key_len, offset, length, crc, lsn
_CKPT_HEAD = struct.Struct("<8sIIQQQQ")      # magic, version, unit, capacity, lsn, count, key bytes
_U32 = struct.Struct("<I")
assert _CKPT_HEAD.size == 48


def encode_put(kb: bytes, offset: int, length: int, crc: int) -> bytes:
    return _HDR.pack(REC_PUT, len(kb)) + kb + _PUT_TAIL.pack(offset, length, crc)


def encode_remove(kb: bytes, offset: int = ANY_OFFSET, reason: int = REASON_REMOVE) -> bytes:
    return _HDR.pack(REC_REMOVE, len(kb)) + kb + _REM_TAIL.pack(offset, reason)


def decode_record(payload: bytes):
    """-> ("put", key_bytes, offset, length, crc) | ("remove", key_bytes, offset, reason); ValueError."""
    if len(payload) < _HDR.size:
        raise ValueError("record shorter than its header")
    rtype, klen = _HDR.unpack_from(payload, 0)
    pos = _HDR.size + klen
    kb = bytes(payload[_HDR.size:pos])
    if rtype == REC_PUT:
        if len(payload) != pos + _PUT_TAIL.size:
            raise ValueError(f"put record of {len(payload)} bytes, expected {pos + _PUT_TAIL.size}")
        return ("put", kb) + _PUT_TAIL.unpack_from(payload, pos)
    if rtype == REC_REMOVE:
        if len(payload) != pos + _REM_TAIL.size:
            raise ValueError(f"remove record of {len(payload)} bytes, expected {pos + _REM_TAIL.size}")
        return ("remove", kb) + _REM_TAIL.unpack_from(payload, pos)
    raise ValueError(f"unknown record type {rtype}")


def _key_offsets(lengths) -> np.ndarray:
    off = np.zeros(len(lengths) + 1, dtype=np.uint64)
    np.cumsum(lengths, out=off[1:])
    return off


class BlockMap(MutableMapping):
    """encoded key -> [offset, length, crc32c, lsn]: checkpoint rows (columns + a tree from
    key to row, ``alive`` marks the rows still in the map) and the entries set since."""

    def __init__(self, blob=b"", key_off=None, offset=None, length=None, crc=None, lsn=None) -> None:
        n = 0 if key_off is None else len(key_off) - 1
        self.blob = blob
        self.key_off = np.zeros(1, np.uint64) if key_off is None else key_off
        self.offset = np.zeros(0, np.uint64) if offset is None else offset
        self.length = np.zeros(0, np.uint32) if length is None else length
        self.crc = np.zeros(0, np.uint32) if crc is None else crc
        self.lsn = np.zeros(0, np.uint64) if lsn is None else lsn
        self.alive = np.ones(n, dtype=bool)
        self.rows_alive = n
        self.changed: dict[bytes, list] = {}      # entries set after the checkpoint
        self._tree = AdaptiveRadixTree()
        if n and self._tree.insert_blob(blob, self.key_off) != n:
            raise ValueError("duplicate keys")

    @property
    def rows(self) -> int:
        return len(self.alive)

    def key_of(self, row: int) -> bytes:
        return bytes(self.blob[int(self.key_off[row]):int(self.key_off[row + 1])])

    def row_of(self, kb: bytes) -> int:
        """The live checkpoint row of kb, or -1."""
        row = self._tree.get(kb) if self.rows_alive else None
        return -1 if row is None or not self.alive[row] else row

    def kill(self, row: int) -> None:
        """The row leaves the map (replaced, removed, dropped or taken over by its owner)."""
        if self.alive[row]:
            self.alive[row] = False
            self.rows_alive -= 1

    def row(self, row: int) -> list:
        return [int(self.offset[row]), int(self.length[row]), int(self.crc[row]), int(self.lsn[row])]

    # ---- the mapping (Replay, quillctl wal verify)
    def __getitem__(self, kb: bytes) -> list:
        v = self.changed.get(kb)
        if v is not None:
            return v
        row = self.row_of(kb)
        if row < 0:
            raise KeyError(kb)
        return self.row(row)

    def __setitem__(self, kb: bytes, value) -> None:
        row = self.row_of(kb)
        if row >= 0:
            self.kill(row)
        self.changed[kb] = list(value)

    def __delitem__(self, kb: bytes) -> None:
        if self.changed.pop(kb, None) is not None:
            return
        row = self.row_of(kb)
        if row < 0:
            raise KeyError(kb)
        self.kill(row)

    def __iter__(self) -> Iterator[bytes]:
        for row in np.flatnonzero(self.alive).tolist():
            yield self.key_of(row)
        yield from list(self.changed)

    def __len__(self) -> int:
        return self.rows_alive + len(self.changed)

    def __contains__(self, kb) -> bool:
        return kb in self.changed or (isinstance(kb, bytes) and self.row_of(kb) >= 0)

    def live_bytes(self) -> int:
        """Sum of the lengths of the live checkpoint rows."""
        return int(self.length[self.alive].sum(dtype=np.uint64)) if self.rows_alive else 0

    def live_table(self):
        """(key blob, key_off, offset, length, crc, lsn) of the live checkpoint rows, compacted."""
        if self.rows_alive == self.rows:
            return self.blob, self.key_off, self.offset, self.length, self.crc, self.lsn
        rows = np.flatnonzero(self.alive)
        klen = np.diff(self.key_off.astype(np.int64))
        keep = np.repeat(self.alive, klen)                  # one flag per blob byte
        blob = np.frombuffer(self.blob, np.uint8)[keep].tobytes()
        return (blob, _key_offsets(klen[rows]), self.offset[rows], self.length[rows], self.crc[rows],
                self.lsn[rows])


def _v1_map(path: str, blob: bytes) -> tuple[int, int, BlockMap]:
    magic, version, unit, _capacity, lsn, count = _CKPT_HEAD_V1.unpack_from(blob, 0)
    keys, cols = [], ([], [], [], [])
    pos, end = _CKPT_HEAD_V1.size, len(blob) - 4
    for _ in range(count):
        if pos + _CKPT_ENTRY_V1.size > end:
            raise CorruptCheckpoint(path, "shorter than its entry count")
        klen, off, length, crc, elsn = _CKPT_ENTRY_V1.unpack_from(blob, pos)
        pos += _CKPT_ENTRY_V1.size
        if pos + klen > end:
            raise CorruptCheckpoint(path, "shorter than its entry count")
        keys.append(blob[pos:pos + klen])
        for col, v in zip(cols, (off, length, crc, elsn)):
            col.append(v)
        pos += klen
    order = np.argsort(np.asarray(cols[0], np.uint64), kind="stable")
    keys = [keys[i] for i in order.tolist()]
    arrays = [np.asarray(c, dt)[order] for c, dt in zip(cols, (np.uint64, np.uint32, np.uint32, np.uint64))]
    try:
        return lsn, unit, BlockMap(b"".join(keys), _key_offsets([len(k) for k in keys]), *arrays)
    except ValueError as exc:
        raise CorruptCheckpoint(path, str(exc)) from None


def read_checkpoint(path: str) -> tuple[int, Optional[int], BlockMap]:
    """``(lsn, unit, BlockMap)`` of the checkpoint at ``path``; ``(0, None, empty map)``
    when there is none.  Raises CorruptCheckpoint (never a struct error on bad bytes) and
    OSError when the file cannot be read."""
    if not os.path.exists(path):
        return 0, None, BlockMap()
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < _CKPT_HEAD_V1.size + 4 or crc32c(memoryview(blob)[:-4]) != _U32.unpack_from(blob, len(blob) - 4)[0]:
        raise CorruptCheckpoint(path, "checksum mismatch")
    magic, version = struct.unpack_from("<8sI", blob, 0)
    if magic == CKPT_MAGIC_V1 and version == 1:
        return _v1_map(path, blob)
    if magic != CKPT_MAGIC or version != CKPT_VERSION or len(blob) < _CKPT_HEAD.size + 4:
        raise CorruptCheckpoint(path, f"not a version 1 or {CKPT_VERSION} checkpoint")
    _, _, unit, _capacity, lsn, n, key_bytes = _CKPT_HEAD.unpack_from(blob, 0)
    pos = _CKPT_HEAD.size
    sizes = (8 * n, 4 * n, 4 * n, 8 * n, 8 * (n + 1))
    if pos + sum(sizes) + key_bytes + 4 != len(blob):
        raise CorruptCheckpoint(path, "shorter than its entry count" if pos + sum(sizes) + key_bytes + 4 > len(blob)
                                else "longer than its entry count")
    cols = []
    for size, dt in zip(sizes, ("<u8", "<u4", "<u4", "<u8", "<u8")):
        cols.append(np.frombuffer(blob, dt, size // np.dtype(dt).itemsize, pos))
        pos += size
    key_off = cols[4]
    if key_off[0] != 0 or key_off[-1] != key_bytes or (n and np.any(np.diff(key_off.astype(np.int64)) <= 0)):
        raise CorruptCheckpoint(path, "bad key offsets")
    keys = memoryview(blob)[pos:pos + key_bytes]
    try:
        return lsn, unit, BlockMap(keys, key_off, *cols[:4])
    except ValueError as exc:
        raise CorruptCheckpoint(path, str(exc)) from None


def write_checkpoint(path: str, unit: int, capacity: int, lsn: int, table, changed) -> int:
    """Write a version 2 checkpoint of ``table`` (a ``BlockMap.live_table()`` tuple) plus
    ``changed`` ((key, offset, length, crc, lsn) tuples) to ``path`` and fsync it (the
    caller renames it).  Rows are written in offset order.  Returns the bytes written."""
    blob, key_off, offset, length, crc, elsn = table
    if changed:
        kbs = [c[0] for c in changed]
        blob = bytes(blob) + b"".join(kbs)
        key_off = np.concatenate((key_off, key_off[-1] + np.cumsum([len(k) for k in kbs], dtype=np.uint64)))
        offset = np.concatenate((offset, np.fromiter((c[1] for c in changed), np.uint64, len(changed))))
        length = np.concatenate((length, np.fromiter((c[2] for c in changed), np.uint32, len(changed))))
        crc = np.concatenate((crc, np.fromiter((c[3] for c in changed), np.uint32, len(changed))))
        elsn = np.concatenate((elsn, np.fromiter((c[4] for c in changed), np.uint64, len(changed))))
        if np.any(offset[1:] < offset[:-1]):
            order = np.argsort(offset, kind="stable")
            blob, key_off = _gather_keys(blob, key_off, order)
            offset, length, crc, elsn = offset[order], length[order], crc[order], elsn[order]
    n = len(offset)
    parts = [_CKPT_HEAD.pack(CKPT_MAGIC, CKPT_VERSION, unit, capacity, lsn, n, len(blob)),
             offset.astype("<u8", copy=False).tobytes(), length.astype("<u4", copy=False).tobytes(),
             crc.astype("<u4", copy=False).tobytes(), elsn.astype("<u8", copy=False).tobytes(),
             key_off.astype("<u8", copy=False).tobytes(), bytes(blob)]
    crc_all = 0
    for p in parts:
        crc_all = crc32c(p, crc_all)
    parts.append(_U32.pack(crc_all))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    total = 0
    try:
        for p in parts:
            mv = memoryview(p)
            while mv:
                mv = mv[os.write(fd, mv):]
            total += len(p)
        os.fsync(fd)                     # the new checkpoint's bytes are durable before its name
    finally:
        os.close(fd)
    return total


_GATHER_ROWS = 65536               # rows per step of a key reorder (bounds its index arrays)


def _gather_keys(blob, key_off, order) -> tuple[bytes, np.ndarray]:
    """The keys of a blob in another row order: (new blob, new key_off)."""
    src = np.frombuffer(blob, np.uint8)
    starts = key_off[:-1].astype(np.int64)[order]
    klen = np.diff(key_off.astype(np.int64))[order]
    out = []
    for i in range(0, len(order), _GATHER_ROWS):
        s, k = starts[i:i + _GATHER_ROWS], klen[i:i + _GATHER_ROWS]
        first = np.cumsum(k) - k                    # where each key starts in this piece
        idx = np.repeat(s - first, k) + np.arange(int(k.sum()))
        out.append(src[idx].tobytes())
    return b"".join(out), _key_offsets(klen)


class Replay:
    """The tier's block map rebuilt from a checkpoint and the WAL records after it, exactly
    as recovery does it: call it with every ``(lsn, payload)`` a WalReader yields."""

    def __init__(self, checkpoint_lsn: int, entries: BlockMap) -> None:
        self.checkpoint_lsn = checkpoint_lsn
        self.entries = entries                  # key bytes -> [offset, length, crc, lsn]
        self.replayed = self.puts = self.removes = 0
        self.malformed: list[tuple[int, int, str]] = []     # (lsn, bytes, why) of skipped records

    def __call__(self, lsn: int, payload) -> None:
        if lsn <= self.checkpoint_lsn:
            return                              # the checkpoint already reflects it
        self.replayed += 1
        try:
            rec = decode_record(payload)
        except ValueError as exc:
            self.malformed.append((lsn, len(payload), str(exc)))
            return
        if rec[0] == "put":
            self.puts += 1
            self.entries[rec[1]] = [rec[2], rec[3], rec[4], lsn]
        else:
            self.removes += 1
            cur = self.entries.get(rec[1])
            if cur is not None and (rec[2] == ANY_OFFSET or rec[2] == cur[0]):
                del self.entries[rec[1]]
