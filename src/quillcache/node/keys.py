"""Keys as the node reads them off the wire: the decoded-key cache and LIST's scope prefix."""
from __future__ import annotations

from typing import Optional

from quillcache._native.batch import cached_values
from quillcache._native.keys import decode_key_fast
from quillcache.errors import InvalidArgument
from quillcache.model import KEY_FORMAT_VERSION, IdentityScope, KeyError_, KvBlockKey, decode_key
from quillcache.node.limits import KEY_CACHE_ENTRIES

__all__ = ["KeyCache", "decode_scope_prefix"]


def decode_scope_prefix(raw: bytes) -> tuple[IdentityScope, Optional[str]]:
    """Parse ``encode_scope`` or ``encode_scope_prefix`` bytes."""
    pos = 0

    def take_str(what: str) -> str:
        nonlocal pos
        if pos >= len(raw):
            raise InvalidArgument(f"LIST prefix truncated in {what}")
        n = raw[pos]
        if pos + 1 + n > len(raw):
            raise InvalidArgument(f"LIST prefix truncated in {what}")
        s = raw[pos + 1:pos + 1 + n]
        pos += 1 + n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"LIST prefix: {what} is not UTF-8") from None

    if not raw or raw[0] != KEY_FORMAT_VERSION:
        raise InvalidArgument("LIST prefix must be encode_scope(...) or encode_scope_prefix(...) bytes")
    pos = 1
    tenant, model, tokenizer = take_str("tenant_id"), take_str("model_id"), take_str("tokenizer_id")
    if pos >= len(raw) or raw[pos] not in (0, 1):
        raise InvalidArgument("LIST prefix: bad adapter flag")
    flag = raw[pos]
    pos += 1
    adapter = take_str("adapter_id") if flag else None
    prefix_hash = take_str("prefix_hash") if pos < len(raw) else None
    if pos != len(raw):
        raise InvalidArgument(f"LIST prefix has {len(raw) - pos} trailing bytes")
    return IdentityScope(model, tokenizer, adapter, tenant), prefix_hash


class KeyCache:
    """The last ``capacity`` keys decoded, by their encoded bytes (LRU).

    ``decode_key`` is a pure function of the bytes and ``KvBlockKey`` is immutable, so a
    hit is exactly what decoding again would give; only keys that decoded are kept.  The
    tenant check stays per request (it depends on the connection, not the bytes).
    """

    __slots__ = ("capacity", "_map", "hits", "misses")

    def __init__(self, capacity: int = KEY_CACHE_ENTRIES) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(f"key cache capacity {capacity!r}: an integer >= 0")
        self.capacity = capacity
        self._map: dict[bytes, KvBlockKey] = {}     # in insertion order: the oldest first
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._map)

    def decode(self, raw: bytes) -> KvBlockKey:
        """``decode_key(raw)``, from the cache when it was seen lately; raises InvalidArgument."""
        if type(raw) is not bytes:
            raw = bytes(raw)
        m = self._map
        key = m.get(raw)
        if key is not None:
            del m[raw]
            m[raw] = key                # the most recent end
            self.hits += 1
            return key
        self.misses += 1
        key = decode_key_fast(raw, KvBlockKey)     # None: malformed, decode_key names why
        if key is None:
            try:
                key = decode_key(raw)
            except KeyError_ as exc:
                raise InvalidArgument(f"bad key: {exc}") from None
        if self.capacity:
            m[raw] = key
            if len(m) > self.capacity:
                del m[next(iter(m))]        # the least recently used
        return key

    def decode_many(self, raws: list) -> list[KvBlockKey]:
        """``decode`` of each of ``raws`` (a batch request's keys), in order: the hits in
        one native pass (``cached_values``), each miss through ``decode``."""
        m = self._map
        out, hits, error = cached_values(raws if type(raws) is list else list(raws), m, True, self.decode)
        self.hits += hits
        if error is not None:
            raise error
        return out
