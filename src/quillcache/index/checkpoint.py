"""The checkpoint file of the persistent ART index (``PersistentArtIndex``): its layout,
writing it, and reading + validating it.

``checkpoint.qck``, all little-endian, every section 8-byte aligned::

    header (64 bytes): magic "QCARTCK1" | u32 version | u32 header_bytes | u64 wal_lsn
        | u64 groups G | u64 records R | u32 workers W | u32 block_hashes B | u64 body_bytes
        | u32 body crc32c | u32 header crc32c (of the 60 bytes before it)
    body: u64 key_off[G+1] | key blob (encoded keys, ascending)      -- one group per key
        | u64 rec_off[G+1] | records R x 32 bytes                    -- a group's records
        | u64 worker_off[W+1] | worker blob                           -- worker id table
        | u64 bh_off[B+1] | bh blob (distinct block hashes, ascending bytes)
        | u64 bh_group_off[B+1] | u32 bh_groups[G]                  -- groups by block hash
    record: u64 bytes | i64 last_access_ms | u32 ref_count | u32 worker | u8 tier | u8 pinned | 6 pad

Tier codes (``TIER_CODE``) are shared with the WAL records of ``persistent``.  A file that
fails a checksum or a structure check raises ``CorruptCheckpoint``; nothing here decides
what recovery does about it.
"""
from __future__ import annotations

import os
import struct
from bisect import bisect_left

import google_crc32c
import numpy as np

from quillcache.errors import CorruptCheckpoint
from quillcache.model import CacheResidency, CacheTier, decode_key

__all__ = ["Checkpoint", "CorruptCheckpoint", "read_checkpoint", "write_checkpoint",
           "CHECKPOINT_NAME", "CHECKPOINT_HEADER", "RECORD_DTYPE", "TIERS", "TIER_CODE"]

CHECKPOINT_NAME = "checkpoint.qck"
CHECKPOINT_MAGIC = b"QCARTCK1"
CHECKPOINT_VERSION = 1
CHECKPOINT_HEADER = struct.Struct("<8sIIQQQIIQII")     # 64 bytes
assert CHECKPOINT_HEADER.size == 64

TIERS = sorted(CacheTier, key=lambda t: t.value)     # code = rank in value order
TIER_CODE = {t: i for i, t in enumerate(TIERS)}
RECORD_DTYPE = np.dtype([("bytes", "<u8"), ("last", "<i8"), ("ref", "<u4"), ("worker", "<u4"),
                         ("tier", "u1"), ("pinned", "u1"), ("pad", "V6")])
assert RECORD_DTYPE.itemsize == 32


# The residency index is rebuilt from the SSD tier's blocks at start (store/residency.py).
_HINT = "move the index directory away: the store rebuilds it from the SSD tier's blocks"


def _corrupt(path: str, problem: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(path, problem, _HINT)


class Checkpoint:
    """A parsed checkpoint: numpy views over one bytes buffer."""

    def __init__(self, path: str, head: bytes, data: bytes) -> None:
        """head: the file's first CHECKPOINT_HEADER.size bytes; data: the rest (the body)."""
        self.path = path
        if len(head) < CHECKPOINT_HEADER.size:
            raise _corrupt(path, f"{len(head)} bytes, shorter than the header")
        (magic, version, hbytes, self.wal_lsn, G, R, W, B, body_bytes, body_crc,
         head_crc) = CHECKPOINT_HEADER.unpack_from(head, 0)
        if magic != CHECKPOINT_MAGIC:
            raise _corrupt(path, f"bad magic {magic!r}")
        if google_crc32c.value(head[:60]) != head_crc:
            raise _corrupt(path, "header checksum mismatch")
        if version != CHECKPOINT_VERSION or hbytes != CHECKPOINT_HEADER.size:
            raise _corrupt(path, f"version {version} (this build reads {CHECKPOINT_VERSION})")
        if len(data) != body_bytes:
            raise _corrupt(path, f"{hbytes + len(data)} bytes, header says {hbytes + body_bytes}")
        if google_crc32c.value(data) != body_crc:
            raise _corrupt(path, "body checksum mismatch")
        self.data = data
        self.n_groups, self.n_records, self.n_workers, self.n_blocks = G, R, W, B
        pos = 0
        try:
            self.key_off, pos = self._arr(pos, "<u8", G + 1)
            key_blob, pos = self._blob(pos, self.key_off)
            self.rec_off, pos = self._arr(pos, "<u8", G + 1)
            self.records, pos = self._arr(pos, RECORD_DTYPE, R)
            worker_off, pos = self._arr(pos, "<u8", W + 1)
            worker_blob, pos = self._blob(pos, worker_off)
            worker_blob = bytes(worker_blob)
            self.bh_off, pos = self._arr(pos, "<u8", B + 1)
            bh_blob, pos = self._blob(pos, self.bh_off)
            self.bh_blob = bytes(bh_blob)
            self.bh_group_off, pos = self._arr(pos, "<u8", B + 1)
            self.bh_groups, pos = self._arr(pos, "<u4", G)
            if pos != len(data) or self.rec_off[-1] != R or self.bh_group_off[-1] != G:
                raise ValueError("section sizes do not add up")
            if G and (np.any(np.diff(self.rec_off.astype(np.int64)) <= 0)
                      or np.any(self.bh_groups >= G)):
                raise ValueError("group tables out of range")
            if R and (int(self.records["worker"].max()) >= W or int(self.records["tier"].max()) >= len(TIERS)):
                raise ValueError("record fields out of range")
            if G and np.any(np.diff(self.key_off.astype(np.int64)) <= 0):
                raise ValueError("empty or unordered keys")
            self.key_blob = key_blob
            wo = worker_off.tolist()
            self.workers = [worker_blob[wo[i]:wo[i + 1]].decode("utf-8") for i in range(W)]
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise _corrupt(path, f"malformed body: {exc}") from None
        self._eks_obj = None
        self._holder_tables: dict = {}
        self._bh = self.bh_off.tolist()

    def ek(self, g: int) -> bytes:
        """The encoded key of group g."""
        return bytes(self.key_blob[int(self.key_off[g]):int(self.key_off[g + 1])])

    @property
    def eks_obj(self) -> np.ndarray:
        """The encoded keys as a numpy object array (made on first use: a million bytes
        objects are a tenth of a second the open does not need)."""
        if self._eks_obj is None:
            ko = self.key_off.tolist()
            blob = self.key_blob
            self._eks_obj = np.empty(self.n_groups, dtype=object)
            self._eks_obj[:] = [bytes(blob[ko[i]:ko[i + 1]]) for i in range(self.n_groups)]
        return self._eks_obj

    def _arr(self, pos, dtype, n):
        dtype = np.dtype(dtype)
        end = pos + dtype.itemsize * n
        if end > len(self.data):
            raise ValueError("section past the end")
        return np.frombuffer(self.data, dtype=dtype, count=n, offset=pos), _align(end)

    def _blob(self, pos, offsets):
        n = int(offsets[-1]) if len(offsets) else 0
        if (len(offsets) and offsets[0] != 0) or np.any(np.diff(offsets.astype(np.int64)) < 0) \
                or pos + n > len(self.data):
            raise ValueError("bad blob offsets")
        return memoryview(self.data)[pos:pos + n], _align(pos + n)

    def holder_table(self, worker_id: str):
        """Per group: how many records of worker_id it holds, and the bytes and tier code
        of (one of) them, as numpy arrays (-1 and 255 where it holds none).  Computed once
        per worker (the file does not change)."""
        got = self._holder_tables.get(worker_id)
        if got is not None:
            return got
        G = self.n_groups
        count = np.zeros(G, np.int64)
        nbytes = np.full(G, -1, np.int64)
        tiers = np.full(G, 255, np.int64)
        if self.n_records and worker_id in self.workers:
            recs = self.records
            mine = recs["worker"] == self.workers.index(worker_id)
            groups = np.repeat(np.arange(G, dtype=np.int64), np.diff(self.rec_off.astype(np.int64)))[mine]
            count = np.bincount(groups, minlength=G)
            nbytes[groups] = recs["bytes"][mine].astype(np.int64)
            tiers[groups] = recs["tier"][mine]
        self._holder_tables[worker_id] = got = (count, nbytes, tiers)
        return got

    def block_hash(self, i: int) -> str:
        """The i-th block hash of the block-hash table (sorted; ``find_block`` finds one)."""
        return self.bh_blob[self._bh[i]:self._bh[i + 1]].decode("utf-8")

    def find_block(self, bh: bytes) -> int:
        off, blob = self._bh, self.bh_blob
        i = bisect_left(range(self.n_blocks), bh, key=lambda j: blob[off[j]:off[j + 1]])
        if i < self.n_blocks and blob[off[i]:off[i + 1]] == bh:
            return i
        return -1

    def group_records(self, g: int) -> list[CacheResidency]:
        key = decode_key(self.ek(g))
        rows = self.records[int(self.rec_off[g]):int(self.rec_off[g + 1])].tolist()
        workers = self.workers
        return [CacheResidency(key, workers[w], TIERS[t], b, last, ref, bool(pin))
                for b, last, ref, w, t, pin, _ in rows]

    def group_rows(self, g: int) -> list:
        workers = self.workers
        return [(workers[w], t, b, last, ref, pin) for b, last, ref, w, t, pin, _ in
                self.records[int(self.rec_off[g]):int(self.rec_off[g + 1])].tolist()]


def read_checkpoint(path: str) -> Checkpoint:
    """Read and validate the checkpoint at path (CorruptCheckpoint if it fails a check)."""
    with open(path, "rb") as f:
        head = f.read(CHECKPOINT_HEADER.size)
        body = f.read()
    return Checkpoint(path, head, body)


def _align(n: int) -> int:
    return (n + 7) & ~7


def write_checkpoint(path: str, wal_lsn: int, groups) -> int:
    """groups: iterable of (ek, block hash bytes, rows) in key order, rows as tuples
    (worker_id, tier code, bytes, last_access_ms, ref_count, pinned).
    Writes path (the caller renames it) and fsyncs it; returns bytes written."""
    eks: list[bytes] = []
    rec_counts: list[int] = []
    worker_ids: dict[str, int] = {}
    cols = ([], [], [], [], [], [])
    bh_of_group: list[bytes] = []
    for ek, bh, rows in groups:
        eks.append(ek)
        rec_counts.append(len(rows))
        bh_of_group.append(bh)
        for w, t, b, last, ref, pin in rows:
            wi = worker_ids.get(w)
            if wi is None:
                wi = worker_ids[w] = len(worker_ids)
            cols[0].append(b)
            cols[1].append(last)
            cols[2].append(ref)
            cols[3].append(wi)
            cols[4].append(t)
            cols[5].append(pin)
    G, R, W = len(eks), len(cols[0]), len(worker_ids)
    rec = np.zeros(R, dtype=RECORD_DTYPE)
    for name, col in zip(("bytes", "last", "ref", "worker", "tier", "pinned"), cols):
        rec[name] = col
    order = sorted(range(G), key=bh_of_group.__getitem__)
    bh_list: list[bytes] = []
    bh_group_off = [0]
    for pos, g in enumerate(order):
        if not bh_list or bh_list[-1] != bh_of_group[g]:
            if bh_list:
                bh_group_off.append(pos)
            bh_list.append(bh_of_group[g])
    if bh_list:
        bh_group_off.append(G)
    B = len(bh_list)

    def offs(items):
        o = np.zeros(len(items) + 1, dtype="<u8")
        np.cumsum([len(x) for x in items], out=o[1:])
        return o

    def pad(b: bytes) -> bytes:
        return b + b"\0" * (_align(len(b)) - len(b))

    parts = [offs(eks).tobytes(), pad(b"".join(eks)),
             np.concatenate(([0], np.cumsum(rec_counts, dtype=np.uint64))).astype("<u8").tobytes(),
             rec.tobytes(),
             offs([w.encode("utf-8") for w in worker_ids]).tobytes(),
             pad(b"".join(w.encode("utf-8") for w in worker_ids)),
             offs(bh_list).tobytes(), pad(b"".join(bh_list)),
             np.asarray(bh_group_off, dtype="<u8").tobytes(),
             pad(np.asarray(order, dtype="<u4").tobytes())]
    body = b"".join(parts)
    head = CHECKPOINT_HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, CHECKPOINT_HEADER.size,
                                  wal_lsn, G, R, W, B, len(body), google_crc32c.value(body), 0)
    head = head[:60] + struct.pack("<I", google_crc32c.value(head[:60]))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(head + body)
        while view:
            view = view[os.write(fd, view):]
        # the data must be on disk before the rename publishes the name
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(head) + len(body)
