"""The checked reader and the small writers every message body is made of (pure functions).

``BodyReader`` checks each length against the bytes actually present (and a count against
``ProtocolLimits``) before building anything, and raises ``InvalidArgument`` naming the
message and the field.  Used by ``messages`` (the data ops), ``route`` (ROUTE) and
``cluster`` (the cluster opcodes).
"""
from __future__ import annotations

import struct

from quillcache._native.codec import decode_key_field
from quillcache.errors import InvalidArgument
from quillcache.protocol.opcodes import ProtocolLimits

__all__ = ["BodyReader", "BytesLike", "DEFAULT_LIMITS", "write_text16", "U8", "U16", "U32", "U64", "F64"]

DEFAULT_LIMITS = ProtocolLimits()

BytesLike = bytes | bytearray | memoryview
U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
F64 = struct.Struct("<d")


class BodyReader:
    __slots__ = ("buf", "pos", "what")

    def __init__(self, body: BytesLike, what: str) -> None:
        self.buf = bytes(body)
        self.pos = 0
        self.what = what

    def _need(self, n: int, field: str) -> None:
        if len(self.buf) - self.pos < n:
            raise InvalidArgument(f"{self.what}: body truncated in {field} "
                                  f"(needs {n} bytes at offset {self.pos}, has {len(self.buf) - self.pos})")

    def u8(self, field: str) -> int:
        self._need(1, field)
        v = self.buf[self.pos]
        self.pos += 1
        return v

    def unpack(self, st: struct.Struct, field: str) -> tuple:
        self._need(st.size, field)
        v = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def u16(self, field: str) -> int:
        return self.unpack(U16, field)[0]

    def u32(self, field: str) -> int:
        return self.unpack(U32, field)[0]

    def u64(self, field: str) -> int:
        return self.unpack(U64, field)[0]

    def take(self, n: int, field: str) -> bytes:
        self._need(n, field)
        v = self.buf[self.pos:self.pos + n]
        self.pos += n
        return v

    def text16(self, field: str, limit: int) -> str:
        n = self.u16(field)
        if n > limit:
            raise InvalidArgument(f"{self.what}: {field} is {n} bytes, at most {limit}")
        raw = self.take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{self.what}: {field} is not UTF-8") from None

    def key(self, limits: ProtocolLimits) -> bytes:
        key, self.pos = decode_key_field(self.buf, self.pos, limits.max_key_bytes, self.what)
        return key

    def count(self, limits: ProtocolLimits, min_item: int) -> int:
        n = self.u32("count")
        if n > limits.max_batch:
            raise InvalidArgument(f"{self.what}: batch of {n} items, at most {limits.max_batch}")
        # Refuse a count the remaining bytes cannot hold before building any list.
        if n * min_item > len(self.buf) - self.pos:
            raise InvalidArgument(f"{self.what}: count {n} needs at least {n * min_item} bytes, "
                                  f"the body has {len(self.buf) - self.pos} left")
        return n

    def keys(self, limits: ProtocolLimits) -> list[bytes]:
        n = self.count(limits, 3)   # u16 length + at least one byte
        return [self.key(limits) for _ in range(n)]

    def bitmap(self, count: int) -> list[bool]:
        raw = self.take((count + 7) // 8, "bitmap")
        bits = [bool(raw[i >> 3] >> (i & 7) & 1) for i in range(count)]
        if count & 7 and raw[-1] >> (count & 7):
            raise InvalidArgument(f"{self.what}: bitmap has bits set past item {count}")
        return bits

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise InvalidArgument(f"{self.what}: {len(self.buf) - self.pos} trailing bytes in the body")


def write_text16(out: bytearray, text: str, limit: int, what: str, field: str) -> None:
    if not isinstance(text, str):
        raise InvalidArgument(f"{what}: {field} must be a string")
    raw = text.encode("utf-8")
    if len(raw) > limit:
        raise InvalidArgument(f"{what}: {field} is {len(raw)} bytes, at most {limit}")
    out += U16.pack(len(raw))
    out += raw
