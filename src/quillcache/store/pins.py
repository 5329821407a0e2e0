"""Pins of LocalKvStore: soft pins (evicted last) and hard pins (never evicted), the budget
all hard pins are held to (``max_hard_pin_fraction`` of DRAM) and each tenant's quota
within it ([[auth.tenants]] ``pin_bytes``; docs/tiering.md "Pins").

A tenant's hard pins are the hard pins of keys of that tenant (``key.tenant_id``, whoever
asked: an engine acting for it spends its quota).  With tenants configured, one without
``pin_bytes`` gets an even share of what the explicit quotas leave of the budget, and a
tenant name that is not configured (named by an engine's ``may_act_for``) gets that share
too, so no tenant can take the budget from the others.  With no tenants (open mode) there
is the node's budget only.

A refusal says only the requester's own figures (its quota, what it holds, what it asked):
nothing of another tenant's pins.

A mixin of ``LocalKvStore`` (store/tiers.py), whose ``__init__`` makes the state it reads.
"""
from __future__ import annotations

from typing import Iterable, Optional

from quillcache.errors import CapacityError, InvalidArgument
from quillcache.model import MAX_PIN_TTL_S, KvBlockKey
from quillcache.store.guard import miss_error

__all__ = ["Pins"]


class Pins:
    """Soft and hard pins, and the tenants' hard-pin quotas."""

    def set_pin_quotas(self, quotas: Iterable[tuple[str, Optional[int]]]) -> None:
        """The tenants' hard-pin quotas: ``(tenant, bytes)``, or ``(tenant, None)`` for an
        even share of what the explicit quotas leave of ``max_hard_pin_bytes``; empty: no
        per-tenant quota (open mode).  Reloadable; pins already held are kept (a tenant
        over its new quota pins nothing more until it is under)."""
        quotas = tuple(quotas)
        for tenant, quota in quotas:
            if quota is not None and (not isinstance(quota, int) or quota < 0):
                raise InvalidArgument(f"tenant {tenant!r}: pin quota {quota!r} must be bytes >= 0 or None")
        explicit = {t: q for t, q in quotas if q is not None}
        shared = [t for t, q in quotas if q is None]
        left = max(0, self.max_hard_pin_bytes - sum(explicit.values()))
        share = left // len(shared) if shared else left
        self._pin_quota: dict[str, int] = {**dict.fromkeys(shared, share), **explicit}
        # the quota of a tenant not configured (named by an engine's may_act_for); None: open mode
        self._pin_share: Optional[int] = share if quotas else None

    def pin_quota(self, tenant: str) -> Optional[int]:
        """Bytes that hard pins of ``tenant``'s keys may hold; None: no per-tenant quota."""
        return self._pin_quota.get(tenant, self._pin_share)

    def pin(self, key: KvBlockKey, ttl_s: float, hard: bool = False) -> None:
        """Keep the block resident for ``ttl_s``: soft pins are evicted last, hard pins never.

        A hard pin past its tenant's quota or the node's hard-pin budget: CapacityError."""
        self._check_key(key)
        if not 0 < ttl_s <= MAX_PIN_TTL_S:
            raise InvalidArgument(f"pin ttl {ttl_s!r}: must be in (0, {MAX_PIN_TTL_S}] seconds")
        entry = self._entry(key)
        if entry is None:
            raise miss_error(key)
        now = self._clock()
        if hard and not (entry.hard and entry.pin_until > now):
            self._check_hard_pin(key.tenant_id, entry.size, now)
        entry.pin_until = max(entry.pin_until, now + ttl_s) if entry.pin_until > now else now + ttl_s
        entry.hard = hard or (entry.hard and entry.pin_until > now)
        self._pinned.add(key)

    def _check_hard_pin(self, tenant: str, size: int, now: float) -> None:
        """Raise CapacityError when ``size`` more bytes of ``tenant``'s hard pins would pass
        its quota or the node's budget; the message names the quota and only its own figures."""
        quota = self.pin_quota(tenant)
        held, own = self._hard_pinned_bytes(now, tenant)
        if quota is not None and own + size > quota:
            self._pins_refused[tenant] = self._pins_refused.get(tenant, 0) + 1
            raise CapacityError(size, max(0, quota - own), 0,
                                f"hard-pin quota of tenant {tenant!r} is {quota} bytes "
                                f"([[auth.tenants]] pin_bytes, or its share of the node's budget): "
                                f"{own} bytes pinned, {size} more asked")
        if held + size > self.max_hard_pin_bytes:
            self._pins_refused[tenant] = self._pins_refused.get(tenant, 0) + 1
            if quota is not None:
                # Within its quota, yet the budget is full: quotas that add up to more than it
                # (or engines pinning for unlisted tenants).  No figure: they are the others'.
                raise CapacityError(size, 0, 0, "hard pin refused: the node's hard-pin budget is full "
                                                "(its tenants' quotas add up to more than it)")
            raise CapacityError(size, max(0, self.max_hard_pin_bytes - held), 0,
                                f"hard pins would hold {held + size} bytes "
                                f"(max {self.max_hard_pin_bytes})")

    def _hard_pinned_bytes(self, now: float, tenant: Optional[str] = None) -> tuple[int, int]:
        """(bytes of every live hard pin, bytes of those of ``tenant``'s keys)."""
        total = own = 0
        for key in self._pinned:
            e = self._entries.get(key)
            if e is not None and e.hard and e.pin_until > now:
                total += e.size
                if key.tenant_id == tenant:
                    own += e.size
        return total, own

    def pin_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant (configured, or with a pin refused): its quota (-1: none), the bytes its
        live hard pins hold, and its hard pins refused.  For the operator (/metrics), never
        a tenant: O(pinned blocks)."""
        if not self._pin_quota and not self._pins_refused:
            return {}                                     # open mode, nothing refused: no walk
        now = self._clock()
        held: dict[str, int] = {}
        for key in self._pinned:
            e = self._entries.get(key)
            if e is not None and e.hard and e.pin_until > now:
                held[key.tenant_id] = held.get(key.tenant_id, 0) + e.size
        out = {}
        for tenant in (*self._pin_quota, *(t for t in self._pins_refused if t not in self._pin_quota)):
            quota = self.pin_quota(tenant)
            out[tenant] = {"pin_quota_bytes": -1 if quota is None else quota,
                           "hard_pinned_bytes": held.get(tenant, 0),
                           "pins_refused": self._pins_refused.get(tenant, 0)}
        return out

    def unpin(self, key: KvBlockKey) -> bool:
        entry = self._entries.get(key)
        if entry is None or key not in self._pinned:
            return False
        entry.pin_until = 0.0
        entry.hard = False
        self._pinned.discard(key)
        return True
