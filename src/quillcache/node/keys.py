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
    """The keys decoded lately, by their encoded bytes: two generations, each a plain dict of
    at most ``capacity // 2`` entries.

    A lookup tries the young one, then the old one (a hit there moves the key to the young
    one); a key decoded anew goes into the young one.  When the young one is full it becomes
    the old one and the old one is dropped: every operation is O(1), and the cache holds at
    least the last ``capacity // 2`` distinct keys and at most ``capacity``.  (An LRU dict
    evicting its oldest with ``next(iter(d))`` is not O(1): every key deleted at its front
    stays a hole that the next ``iter`` walks over until the dict is rebuilt, ~10 us a miss at
    16,384 entries, paid on every request once more keys are in use than the cache holds.)

    ``decode_key`` is a pure function of the bytes and ``KvBlockKey`` is immutable, so a
    hit is exactly what decoding again would give; only keys that decoded are kept.  The
    tenant check stays per request (it depends on the connection, not the bytes).
    """

    __slots__ = ("capacity", "_generation", "_young", "_old", "hits", "misses")

    def __init__(self, capacity: int = KEY_CACHE_ENTRIES) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(f"key cache capacity {capacity!r}: an integer >= 0")
        self.capacity = capacity
        self._generation = capacity // 2           # entries of each generation, at most
        self._young: dict[bytes, KvBlockKey] = {}
        self._old: dict[bytes, KvBlockKey] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __contains__(self, raw) -> bool:
        return raw in self._young or raw in self._old

    def decode(self, raw: bytes) -> KvBlockKey:
        """``decode_key(raw)``, from the cache when it was seen lately; raises InvalidArgument."""
        if type(raw) is not bytes:
            raw = bytes(raw)
        key = self._young.get(raw)
        if key is not None:
            self.hits += 1
            return key
        key = self._old.get(raw)
        if key is not None:
            self.hits += 1
        else:
            self.misses += 1
            key = decode_key_fast(raw, KvBlockKey)     # None: malformed, decode_key names why
            if key is None:
                try:
                    key = decode_key(raw)
                except KeyError_ as exc:
                    raise InvalidArgument(f"bad key: {exc}") from None
        if self._generation:
            young = self._young
            if len(young) >= self._generation:      # full: it becomes the old one
                self._old, self._young = young, {}
                young = self._young
            young[raw] = key
        return key

    def decode_many(self, raws: list) -> list[KvBlockKey]:
        """``decode`` of each of ``raws`` (a batch request's keys), in order: the young
        generation's hits in one native pass (``cached_values``), the others through
        ``decode``.  Should a miss turn the young generation old within the batch, the
        native pass goes on in that dict: the same keys (a key's decoding never changes),
        only not moved to the new young one."""
        if type(raws) is not list:
            raws = list(raws)
        out, hits, error = cached_values(raws, self._young, None, self.decode)
        self.hits += hits
        if error is not None:
            raise error
        return out
