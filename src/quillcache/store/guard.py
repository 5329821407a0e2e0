"""The identity guard: KV bytes are reused only by the identity that computed them.

Every block carries its IdentityScope (model, tokenizer, adapter, tenant) in its key.  The
guard asks the store's residency index (index/art.py: block hash -> tenant -> keys) for
resident content with the same ``(prefix_hash, block_hash)``, so a get whose exact key is
absent can tell a true miss from content resident under another identity:

* same tenant, other model / tokenizer / adapter: ``UnsafeReuse(violation)`` (mode strict);
  when several fields differ (over all candidates) the reported one is the first in the
  fixed precedence model > tokenizer > adapter;
* another tenant only: the requester gets exactly a miss (``NotFound``, same message, same
  fields, same work: the request path queues every miss and never looks at other tenants);
  ``flush_audit``, off the request path, classifies the queued misses, counts refusals
  (``reuse_refused_tenant``) and writes an audit line for each, without the other tenant;
* nothing: ``NotFound``.

Modes: ``strict`` (default, the above), ``tenant`` (only tenant isolation: a same-tenant
block of another model/tokenizer/adapter is served), ``off`` (content-hash reuse: any
identity's block with the same content hashes is served; for studies only, a WARNING is
logged when a store is built with it).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Iterable, NamedTuple, Optional, Union

from quillcache.errors import InvalidArgument, NotFound, UnsafeReuse
from quillcache.index.art import ArtIndex
from quillcache.model import CacheResidency, IdentityScope, KvBlockKey

__all__ = ["IdentityGuard", "Refusal", "audit_reuse", "violation_of", "miss_error", "GUARD_MODES",
           "AUDIT_QUEUE_MAX", "LOCAL_HOLDER"]

GUARD_MODES = ("strict", "tenant", "off")
LOCAL_HOLDER = "local"         # the holder id of this node's records when it has no node id
AUDIT_QUEUE_MAX = 16_384       # misses queued for classification between two flush_audit calls
_IDENTITY_PRECEDENCE = ("model", "tokenizer", "adapter")

audit_log = logging.getLogger("quillcache.audit")
log = logging.getLogger("quillcache.store")

Scoped = Union[IdentityScope, KvBlockKey]


def _check_mode(mode: str) -> str:
    if mode not in GUARD_MODES:
        raise InvalidArgument(f"guard mode {mode!r}: must be one of {', '.join(GUARD_MODES)}")
    return mode


def violation_of(request: Scoped, other: Scoped) -> Optional[str]:
    """The first differing identity field in the order tenant > model > tokenizer > adapter."""
    if request.tenant_id != other.tenant_id:
        return "tenant"
    if request.model_id != other.model_id:
        return "model"
    if request.tokenizer_id != other.tokenizer_id:
        return "tokenizer"
    if request.adapter_id != other.adapter_id:
        return "adapter"
    return None


def miss_error(key: KvBlockKey) -> NotFound:
    """The one error every miss raises, whatever else is resident (never an oracle)."""
    return NotFound(f"no block {key.block_hash} (prefix {key.prefix_hash}) for this identity")


class Refusal(NamedTuple):
    item: Union[CacheResidency, KvBlockKey]
    violation: str


def audit_reuse(request_scope: Scoped, candidates: Iterable[Union[CacheResidency, KvBlockKey]],
                mode: str = "strict") -> tuple[list, list[Refusal]]:
    """Split candidates into (allowed, refused) for a requester, honouring the mode.

    Pure: no state, no logging.  A candidate is a CacheResidency or a KvBlockKey; the
    refused ones come back as ``Refusal(item, violation)`` with violation one of
    "tenant", "model", "tokenizer", "adapter".
    """
    _check_mode(mode)
    allowed: list = []
    refused: list[Refusal] = []
    for item in candidates:
        key = item.key if isinstance(item, CacheResidency) else item
        violation = violation_of(request_scope, key)
        if violation is None or mode == "off" or (mode == "tenant" and violation != "tenant"):
            allowed.append(item)
        else:
            refused.append(Refusal(item, violation))
    return allowed, refused


class IdentityGuard:
    """The serve / refuse / miss decision of the store, asked of the residency index.

    The guard keeps no key set of its own: ``index`` (the store's ART, index/art.py) is the
    one record of what is resident, and the guard asks it for the keys with a given block
    hash in one tenant (``ArtIndex.block_keys``) where ``holder`` (this node) holds a
    record.  Records of other holders (other nodes, issue 14) are never served here."""

    def __init__(self, mode: str = "strict", index: Optional[ArtIndex] = None,
                 holder: str = LOCAL_HOLDER) -> None:
        self.mode = _check_mode(mode)
        self.index = index if index is not None else ArtIndex()
        self.holder = holder
        self.refused_tenant = 0
        self.refused = dict.fromkeys(_IDENTITY_PRECEDENCE, 0)
        self.served_cross_identity = 0     # tenant/off modes: served a block of another identity
        self.served_cross_tenant = 0       # off mode only
        self._unclassified: deque = deque(maxlen=AUDIT_QUEUE_MAX)   # misses not yet classified
        self._misses = 0             # misses queued since the start (the deque drops the oldest)
        self._classified = 0
        self.audit_dropped = 0       # misses never classified because the queue overflowed

    # ------------------------------------------------------------------ what the index holds

    def _own(self, key: KvBlockKey) -> list[KvBlockKey]:
        """This tenant's resident keys with the content of key (only this tenant's entries
        of the index are looked at)."""
        return [k for k in self.index.block_keys(key.block_hash, key.tenant_id, self.holder)
                if k.prefix_hash == key.prefix_hash]

    def _by_tenant(self, key: KvBlockKey) -> dict[str, list[KvBlockKey]]:
        """tenant -> resident keys with the content of key, every tenant (off the strict path)."""
        out = {}
        for tenant, keys in self.index.block_tenants(key.block_hash, self.holder).items():
            same = [k for k in keys if k.prefix_hash == key.prefix_hash]
            if same:
                out[tenant] = same
        return out

    def content_keys(self, prefix_hash: str, block_hash: str) -> frozenset:
        """Every resident key (any identity) with this content."""
        probe = KvBlockKey("", "", None, "", prefix_hash, block_hash)
        return frozenset(k for keys in self._by_tenant(probe).values() for k in keys)

    # ------------------------------------------------------------------ decision

    def resolve_missing(self, key: KvBlockKey) -> KvBlockKey:
        """The exact key is not resident: return the key to serve instead, or raise.

        Raises UnsafeReuse (same tenant, strict) or NotFound (a miss, or a refusal across
        tenants: the caller cannot tell those two apart).
        """
        own = self._own(key)
        mode = self.mode
        if own:
            scope = key.scope
            same = [k for k in own if scope.matches(k)]
            if same:
                # Same identity and content, another block_index/token_count: safe to serve.
                return _closest(key, same)
            if mode == "strict":
                raise self._unsafe(key, own)
            self.served_cross_identity += 1
            return _closest(key, own)
        if mode == "off":
            anyone = [k for keys in self._by_tenant(key).values() for k in keys]
            if anyone:
                self.served_cross_identity += 1
                self.served_cross_tenant += 1
                return _closest(key, anyone)
            raise miss_error(key)
        # Decide first, look at other tenants later: every miss does exactly this, so the
        # request path never touches another tenant's data and cannot time it.  flush_audit
        # (maintenance / stats, off the request path) tells refusals from true misses.
        self._unclassified.append(key)
        self._misses += 1
        raise miss_error(key)

    def would_serve(self, key: KvBlockKey) -> Optional[KvBlockKey]:
        """Like resolve_missing without raising, counting or auditing (exists/exists_prefix)."""
        own = self._own(key)
        if own:
            scope = key.scope
            same = [k for k in own if scope.matches(k)]
            if same:
                return _closest(key, same)
            if self.mode != "strict":
                return _closest(key, own)
        if self.mode == "off":
            anyone = [k for keys in self._by_tenant(key).values() for k in keys]
            if anyone:
                return _closest(key, anyone)
        return None

    def _unsafe(self, key: KvBlockKey, own: list) -> UnsafeReuse:
        differing = set()
        for other in own:
            if other.model_id != key.model_id:
                differing.add("model")
            if other.tokenizer_id != key.tokenizer_id:
                differing.add("tokenizer")
            if other.adapter_id != key.adapter_id:
                differing.add("adapter")
        violation = next(v for v in _IDENTITY_PRECEDENCE if v in differing)
        self.refused[violation] += 1
        return UnsafeReuse(violation, f"unsafe reuse refused: block {key.block_hash} is resident only "
                                      f"under another {violation} of this tenant")

    # ------------------------------------------------------------------ audit and stats

    def flush_audit(self) -> int:
        """Classify the queued misses; count and log the cross-tenant refusals among them.

        Runs off the request path (maintenance, stats).  A miss is a refusal when the
        content is resident under another tenant at classification time, at most one
        maintenance interval after the request.  Returns the number of audit lines written.
        """
        queue = self._unclassified
        dropped = self._misses - self._classified - len(queue)
        self._classified += dropped
        self.audit_dropped += dropped
        written = 0
        while queue:
            key = queue.popleft()
            self._classified += 1
            if any(tenant != key.tenant_id for tenant in self._by_tenant(key)):
                self.refused_tenant += 1
                audit_log.info("reuse refused: tenant=%s model=%s prefix=%s block=%s: content resident "
                               "only under another tenant", key.tenant_id, key.model_id,
                               key.prefix_hash, key.block_hash)
                written += 1
        if dropped:
            audit_log.warning("%d misses not classified for cross-tenant refusals (queue of %d full)",
                              dropped, AUDIT_QUEUE_MAX)
        return written

    def stats(self) -> dict:
        self.flush_audit()
        return {
            "mode": self.mode,
            "reuse_refused_tenant": self.refused_tenant,
            "reuse_refused_model": self.refused["model"],
            "reuse_refused_tokenizer": self.refused["tokenizer"],
            "reuse_refused_adapter": self.refused["adapter"],
            "reuse_served_cross_identity": self.served_cross_identity,
            "reuse_served_cross_tenant": self.served_cross_tenant,
            "audit_dropped": self.audit_dropped,
        }


def _closest(key: KvBlockKey, keys) -> KvBlockKey:
    """Deterministic choice among candidates: fewest differing fields by precedence, then block_index."""
    def rank(other: KvBlockKey):
        return (other.tenant_id != key.tenant_id, other.model_id != key.model_id,
                other.tokenizer_id != key.tokenizer_id, other.adapter_id != key.adapter_id,
                other.block_index != key.block_index, other.model_id, other.tokenizer_id,
                other.adapter_id or "", other.tenant_id)
    return min(keys, key=rank)
