# cython: language_level=3
"""Reading the write-ahead log: segment files and the record reader.

Format (docs/wal-format.md, constants in walformat.pxd): 32 KiB blocks of physical
records, each a 7-byte header (masked CRC32C over type + payload, 2-byte LE length,
1-byte type) and a payload; FIRST / MIDDLE / LAST fragments make up a record that did
not fit in what was left of a block.  Segments are files named 000000000001.log.

The reader never raises on bad data (LevelDB's habit): it reports ``(bytes_dropped,
reason)`` and resynchronises at the next block.  It is plain file I/O: it needs neither
liburing nor the writer (quillcache._native.wal, which uses it to recover its tail and
re-exports everything here).
"""
import os
import re

from libc.stdint cimport uint8_t, uint32_t, uint64_t

from quillcache._native.crc cimport crc32c_update
from quillcache._native.walformat cimport (
    WAL_BLOCK_C, WAL_HEADER_C, WAL_ZERO, WAL_FULL, WAL_FIRST, WAL_MIDDLE, WAL_LAST, _mask, _get32)

__all__ = ["WalReader", "segment_name", "list_segments", "WAL_MAX_SEGMENT"]

WAL_MAX_SEGMENT = 1 << 31         # bytes: largest segment (the lsn keeps 32 offset bits)
_SEGMENT_RE = re.compile(r"^([0-9]{12})\.log$")


def segment_name(uint64_t seq):
    """File name of segment ``seq``: 12 decimal digits + ``.log``."""
    return "%012d.log" % seq


def list_segments(directory):
    """Sorted [(seq, path)] of the segment files in ``directory``."""
    out = []
    for name in os.listdir(directory):
        m = _SEGMENT_RE.match(name)
        if m is not None:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    out.sort()
    return out


# ---- the reader ------------------------------------------------------------------------------
cdef bytes _read_full(f, Py_ssize_t n):
    cdef bytes data = f.read(n)
    if data is None:
        data = b""
    while len(data) < n:
        more = f.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _zero_from(f, bytes block, size_t pos, uint64_t next_off, uint64_t limit):
    """True if block[pos:] and the file from next_off to limit hold only zero bytes."""
    if block[pos:].strip(b"\0"):
        return False
    cdef uint64_t at = next_off
    try:
        while at < limit:
            data = f.read(<Py_ssize_t>min(<uint64_t>(1 << 20), limit - at))
            if not data:
                break
            if data.strip(b"\0"):
                return False
            at += len(data)
        return True
    finally:
        f.seek(next_off)


cdef class WalReader:
    """Iterates ``(lsn, payload)`` over a segment file or every segment of a directory.

    Never raises on bad data: dropped bytes are listed in ``corruption`` as
    ``(bytes_dropped, reason)`` (and where they began in ``corruption_lsns``).  A record cut off
    at the end of the last segment is the writer dying: it ends the log, is not corruption, and
    its size is in ``tail_bytes``; ``valid_end`` is the offset in the last segment just past its
    last complete record (where a writer reopening the log truncates), ``end_lsn`` the lsn there.
    A single file is read as the last segment of a log.
    """
    def __init__(self, path, *, uint64_t max_record_bytes=WAL_MAX_SEGMENT):
        path = os.fspath(path)
        self.path = path
        self.max_record_bytes = max_record_bytes
        if os.path.isdir(path):
            self.segments = list_segments(path)
        else:
            m = _SEGMENT_RE.match(os.path.basename(path))
            self.segments = [(int(m.group(1)) if m is not None else 0, path)]
        self.corruption = []
        self.corruption_lsns = []

    cdef _report(self, uint64_t nbytes, str reason, uint64_t lsn):
        self.corruption.append((nbytes, reason))
        self.corruption_lsns.append(lsn)

    cdef _cut(self, bint is_last, uint64_t nbytes, uint64_t lsn):
        if is_last:
            self.tail_bytes += nbytes        # the writer died mid-record: end of log
        else:
            self._report(nbytes, "truncated segment", lsn)

    def __iter__(self):
        self.corruption = []
        self.corruption_lsns = []
        self.tail_bytes = 0
        self.valid_end = 0
        self.end_lsn = 0
        prev = None
        last = len(self.segments) - 1
        for k, (seq, path) in enumerate(self.segments):
            if prev is not None and seq != prev + 1:
                self._report(0, "missing segment", <uint64_t>(prev + 1) << 32)
            prev = seq
            yield from self._segment(seq, path, k == last)

    def _segment(self, uint64_t seq, path, bint is_last):
        cdef uint64_t base = seq << 32
        cdef uint64_t size, limit, block_start = 0, frag_phys = 0, frag_start = 0, rec_start, end
        cdef size_t blen, pos, rem, length, phys
        cdef const unsigned char *p
        cdef uint32_t stored
        cdef uint8_t rtype
        cdef bint in_frag = False, at_eof
        cdef bytes block
        scratch = bytearray()
        self.valid_end = 0
        self.end_lsn = base
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            limit = size if size <= WAL_MAX_SEGMENT else WAL_MAX_SEGMENT
            while block_start < limit:
                block = _read_full(f, <Py_ssize_t>min(<uint64_t>WAL_BLOCK_C, limit - block_start))
                blen = len(block)
                if blen == 0:
                    break
                at_eof = block_start + blen >= limit
                p = <const unsigned char *><const char *>block
                mv = memoryview(block)
                pos = 0
                while pos < blen:
                    rem = blen - pos
                    rec_start = block_start + pos
                    if rem < WAL_HEADER_C:
                        if blen == WAL_BLOCK_C:
                            break                 # the zero-filled tail of a block
                        # the file ends inside a header
                        self._cut(is_last, rem + (frag_phys if in_frag else 0), base | (frag_start if in_frag else rec_start))
                        return
                    stored = _get32(p + pos)
                    length = p[pos + 4] | (<size_t>p[pos + 5] << 8)
                    rtype = p[pos + 6]
                    phys = WAL_HEADER_C + length
                    if rtype == WAL_ZERO and length == 0 and stored == 0:
                        if is_last and _zero_from(f, block, pos, block_start + blen, limit):
                            # zeros to the end: space the writer never filled
                            self._cut(True, (limit - rec_start) + (frag_phys if in_frag else 0), 0)
                            return
                        self._report(rem, "zeroed header", base | rec_start)
                    elif phys > rem:
                        if at_eof and pos + phys <= WAL_BLOCK_C:
                            # the record runs past the end of the file: the writer died mid-write
                            self._cut(is_last, (limit - rec_start) + (frag_phys if in_frag else 0),
                                      base | (frag_start if in_frag else rec_start))
                            return
                        self._report(rem, "bad record length", base | rec_start)
                    elif _mask(crc32c_update(0, p + pos + 6, length + 1)) != stored:
                        self._report(rem, "checksum mismatch", base | rec_start)
                    else:
                        end = rec_start + phys
                        if rtype == WAL_FULL:
                            if in_frag:
                                self._report(frag_phys, "partial record without end", base | frag_start)
                                in_frag = False
                                del scratch[:]
                            if length > self.max_record_bytes:
                                self._report(phys, "record too large", base | rec_start)
                            else:
                                self.valid_end = end
                                self.end_lsn = base | end
                                yield (base | end, block[pos + WAL_HEADER_C:pos + phys])
                        elif rtype == WAL_FIRST:
                            if in_frag:
                                self._report(frag_phys, "partial record without end", base | frag_start)
                            del scratch[:]
                            if length > self.max_record_bytes:
                                self._report(phys, "record too large", base | rec_start)
                                in_frag = False
                            else:
                                scratch += mv[pos + WAL_HEADER_C:pos + phys]
                                in_frag = True
                                frag_phys = phys
                                frag_start = rec_start
                        elif rtype == WAL_MIDDLE or rtype == WAL_LAST:
                            if not in_frag:
                                self._report(phys, "missing start of fragmented record", base | rec_start)
                            elif <uint64_t>len(scratch) + length > self.max_record_bytes:
                                self._report(frag_phys + phys, "record too large", base | frag_start)
                                in_frag = False
                                del scratch[:]
                            else:
                                scratch += mv[pos + WAL_HEADER_C:pos + phys]
                                frag_phys += phys
                                if rtype == WAL_LAST:
                                    in_frag = False
                                    self.valid_end = end
                                    self.end_lsn = base | end
                                    payload = bytes(scratch)
                                    del scratch[:]
                                    yield (base | end, payload)
                        else:
                            self._report(phys, "unknown record type", base | rec_start)
                            if in_frag:
                                self._report(frag_phys, "error in middle of record", base | frag_start)
                                in_frag = False
                                del scratch[:]
                        pos += phys
                        continue
                    # a bad physical record: the rest of this block is dropped (reported above);
                    # a record it interrupted is dropped too; resync at the next block
                    if in_frag:
                        self._report(frag_phys, "error in middle of record", base | frag_start)
                        in_frag = False
                        del scratch[:]
                    break
                mv.release()
                block_start += blen
            if in_frag:
                # FIRST (and MIDDLEs) with no LAST before the end of the file
                self._cut(is_last, frag_phys, base | frag_start)
            if size > limit:
                self._report(size - limit, "segment too large", base | limit)
