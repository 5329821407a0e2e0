"""The LSM baseline: ``model.IndexBackend`` on RocksDB through rocksdict (a bench extra).

Key spaces in one RocksDB (raw bytes mode), one row per residency record plus one
secondary row, written together in one WriteBatch:

    b"R" + encode_key(key) + esc(worker_id) + u8 tier code   -> u64 bytes | i64 last | u32 ref | u8 pinned
    b"W" + esc(worker_id) + u8 len + block_hash + encode_key(key) + u8 tier -> b""
    b"M"                                                      -> u64 records | u64 resident bytes

``esc`` writes the worker id's UTF-8 with 0x00 escaped as 0x00 0xFF and ends it with
0x00 0x00: order-preserving and self-delimiting, so R rows sort by (key, worker, tier)
(encoded keys are self-delimiting too) and ``prefix_scan`` is one iterator seek to
``b"R" + encode_scope_prefix(...)`` followed by next() while the prefix holds.  The W rows
serve ``clear_worker`` (seek to the worker) and ``remove_block`` (seek to worker +
block hash, then filter by scope).

Write amplification comes from RocksDB's own statistics: physical bytes =
``rocksdb.wal.bytes`` + ``rocksdb.flush.write.bytes`` + ``rocksdb.compact.write.bytes``;
``write_amplification`` divides it by the same logical bytes the ART index uses
(``persistent.encode_put`` per put).  ``sync()`` is the group commit (``flush_wal(True)``).
"""
from __future__ import annotations

import os
import struct

import rocksdict

from quillcache.errors import InvalidArgument
from quillcache.index.persistent import (
    MAX_WORKER_ID_BYTES, TIER_CODE, TIERS, encode_put,
)
from quillcache.model import (
    CacheResidency, IdentityScope, IndexMetrics, KvBlockKey, decode_key, encode_key, encode_scope,
    encode_scope_prefix,
)

__all__ = ["LsmIndex"]

_VALUE = struct.Struct("<QqIB")
_META = struct.Struct("<QQ")
META_KEY = b"M"
DEFAULT_WRITE_BUFFER = 64 << 20        # bytes: memtable size before a flush


def _esc(worker_id: str) -> bytes:
    if not isinstance(worker_id, str):
        raise InvalidArgument(f"worker_id {worker_id!r}: must be a string")
    wb = worker_id.encode("utf-8")
    if len(wb) > MAX_WORKER_ID_BYTES:
        raise InvalidArgument(f"worker_id is {len(wb)} bytes: at most {MAX_WORKER_ID_BYTES}")
    return wb.replace(b"\x00", b"\x00\xff") + b"\x00\x00"


def _unesc(raw: bytes, pos: int) -> tuple[str, int]:
    """Worker id starting at raw[pos]; returns it and the position after its terminator."""
    out = bytearray()
    while True:
        j = raw.index(b"\x00", pos)
        out += raw[pos:j]
        if raw[j + 1] == 0:
            return out.decode("utf-8"), j + 2
        out.append(0)
        pos = j + 2


class LsmIndex:
    """Residency index on RocksDB (persistent; ``sync_every`` = a synced write per mutation)."""

    name = "lsm"
    persistent = True

    def __init__(self, directory, *, sync_every: bool = False,
                 write_buffer_bytes: int = DEFAULT_WRITE_BUFFER) -> None:
        self.directory = os.fspath(directory)
        self._opts = rocksdict.Options(raw_mode=True)
        self._opts.create_if_missing(True)
        self._opts.enable_statistics()
        self._opts.set_write_buffer_size(write_buffer_bytes)
        self._db = rocksdict.Rdict(self.directory, self._opts)
        self._wopts = rocksdict.WriteOptions()
        self._wopts.sync = bool(sync_every)
        meta = self._db.get(META_KEY)
        self._records, self._resident_bytes = _META.unpack(meta) if meta is not None else (0, 0)
        self._puts = self._removes = self._prefix_scans = 0
        self._logical_bytes = 0

    # ------------------------------------------------------------------ helpers

    def _scan(self, prefix: bytes):
        it = self._db.iter()
        it.seek(prefix)
        n = len(prefix)
        while it.valid():
            k = it.key()
            if k[:n] != prefix:
                break
            yield k, it.value()
            it.next()

    @staticmethod
    def _residency(key: KvBlockKey, worker: str, tier_code: int, value: bytes) -> CacheResidency:
        nbytes, last, ref, pinned = _VALUE.unpack(value)
        return CacheResidency(key, worker, TIERS[tier_code], nbytes, last, ref, bool(pinned))


    def _write(self, batch: rocksdict.WriteBatch, d_records: int, d_bytes: int) -> None:
        self._records += d_records
        self._resident_bytes += d_bytes
        batch.put(META_KEY, _META.pack(self._records, self._resident_bytes))
        self._db.write(batch, self._wopts)

    # ------------------------------------------------------------------ IndexBackend

    def put(self, residency: CacheResidency) -> None:
        logical = encode_put(residency)        # validates key, worker and fields first
        r = residency
        ek = encode_key(r.key)
        w = _esc(r.worker_id)
        tier = bytes((TIER_CODE[r.tier],))
        rkey = b"R" + ek + w + tier
        old = self._db.get(rkey)
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.put(rkey, _VALUE.pack(r.bytes, r.last_access_ms, r.ref_count, bool(r.pinned)))
        bh = r.key.block_hash.encode("utf-8")
        batch.put(b"W" + w + bytes((len(bh),)) + bh + ek + tier, b"")
        d_bytes = r.bytes - (_VALUE.unpack(old)[0] if old is not None else 0)
        self._write(batch, 0 if old is not None else 1, d_bytes)
        self._puts += 1
        self._logical_bytes += len(logical)

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        ek = encode_key(key)
        out = []
        for k, v in self._scan(b"R" + ek):
            worker, pos = _unesc(k, 1 + len(ek))
            out.append(self._residency(key, worker, k[pos], v))
        return out

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        prefix = b"R" + encode_scope_prefix(scope, prefix_hash)
        self._prefix_scans += 1
        out = []
        key = None
        key_ek = b""
        for k, v in self._scan(prefix):
            if key is None or k[1:1 + len(key_ek)] != key_ek:
                key, key_ek = self._key_of_row(k)
            worker, pos = _unesc(k, 1 + len(key_ek))
            out.append(self._residency(key, worker, k[pos], v))
        return out

    @staticmethod
    def _key_of_row(k: bytes) -> tuple[KvBlockKey, bytes]:
        # the encoded key is self-delimiting: decode progressively longer candidates would be
        # quadratic, so walk its fields: 1 version, 3 str, adapter, str, u32, str, u32
        pos = 2
        for _ in range(3):
            pos += 1 + k[pos]
        pos = pos + 1 if k[pos] == 0 else pos + 2 + k[pos + 1]
        pos += 1 + k[pos]                  # prefix_hash
        pos += 4                           # block_index
        pos += 1 + k[pos]                  # block_hash
        pos += 4                           # token_count
        ek = k[1:pos]
        return decode_key(ek), ek

    def _remove_rows(self, rows) -> int:
        """rows: [(W-row key, ek, tier byte, worker esc)] to delete with their R rows."""
        if not rows:
            return 0
        batch = rocksdict.WriteBatch(raw_mode=True)
        d_bytes = 0
        for wkey, ek, tier, w in rows:
            rkey = b"R" + ek + w + tier
            old = self._db.get(rkey)
            if old is not None:
                d_bytes -= _VALUE.unpack(old)[0]
                batch.delete(rkey)
            batch.delete(wkey)
        self._write(batch, -len(rows), d_bytes)
        self._removes += len(rows)
        return len(rows)

    def _worker_rows(self, w: bytes, prefix: bytes):
        rows = []
        for wkey, _ in self._scan(prefix):
            pos = 1 + len(w)
            pos += 1 + wkey[pos]                       # block hash
            ek = wkey[pos:-1]
            rows.append((wkey, ek, wkey[-1:], w))
        return rows

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        w = _esc(worker_id)
        bh = block_hash.encode("utf-8")
        if len(bh) > 255:
            return 0
        sp = encode_scope(scope)
        rows = [row for row in self._worker_rows(w, b"W" + w + bytes((len(bh),)) + bh)
                if row[1][:len(sp)] == sp]
        return self._remove_rows(rows)

    def clear_worker(self, worker_id: str) -> int:
        w = _esc(worker_id)
        return self._remove_rows(self._worker_rows(w, b"W" + w))

    def clear(self) -> None:
        self._db.delete_range(b"\x00", b"\xff", self._wopts)
        self._records = self._resident_bytes = 0
        self._db.put(META_KEY, _META.pack(0, 0), self._wopts)

    def snapshot(self) -> list[CacheResidency]:
        out = []
        key = None
        key_ek = b""
        for k, v in self._scan(b"R"):
            if key is None or k[1:1 + len(key_ek)] != key_ek:
                key, key_ek = self._key_of_row(k)
            worker, pos = _unesc(k, 1 + len(key_ek))
            out.append(self._residency(key, worker, k[pos], v))
        return out

    def __len__(self) -> int:
        return self._records

    # ------------------------------------------------------------------ durability and stats

    def sync(self) -> None:
        self._db.flush_wal(True)

    def flush(self) -> None:
        """Flush the memtable to an SST (what a clean shutdown or a full memtable does)."""
        self._db.flush()

    def rocksdb_stats(self) -> dict[str, int]:
        out = {}
        for line in (self._opts.get_statistics() or "").splitlines():
            name, sep, rest = line.partition(" COUNT : ")
            if sep:
                out[name.strip()] = int(rest.split()[0])
        return out

    @property
    def logical_bytes(self) -> int:
        return self._logical_bytes

    @property
    def physical_bytes(self) -> int:
        s = self.rocksdb_stats()
        return (s.get("rocksdb.wal.bytes", 0) + s.get("rocksdb.flush.write.bytes", 0)
                + s.get("rocksdb.compact.write.bytes", 0))

    @property
    def write_amplification(self) -> float:
        return self.physical_bytes / self._logical_bytes if self._logical_bytes else 0.0

    def metrics(self) -> IndexMetrics:
        return IndexMetrics(resident_blocks=self._records, resident_bytes=self._resident_bytes,
                            puts=self._puts, removes=self._removes, prefix_scans=self._prefix_scans,
                            bytes_written=self.physical_bytes,
                            memory_bytes=self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "LsmIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
