"""Tenants, token checks and the failed-HELLO rate limit.

A tenant is ``(name, "sha256:<hex>")`` from ``[auth] tenants`` (config.hash_token makes
the hash).  A HELLO presents the plain token; we hash it and compare it with every
tenant's stored hash using ``hmac.compare_digest`` and without stopping at the first
match, so the time taken says nothing about which tenant (or how much of a hash)
matched.  With no tenants the node runs open (dev mode): every HELLO succeeds and binds
no tenant.

Failed HELLOs are counted per peer address in a sliding window of
``FAILED_HELLO_WINDOW_S``; a peer past ``max_failed_hellos`` in the window is refused at
once (the server closes the connection without looking at the token).
"""
from __future__ import annotations

import hashlib
import hmac
import time
from collections import deque
from typing import Callable, Iterable, Optional

from quillcache.errors import InvalidArgument, PermissionDenied

__all__ = ["Authenticator", "FAILED_HELLO_WINDOW_S", "MAX_TRACKED_PEERS", "OPEN_TENANT"]

FAILED_HELLO_WINDOW_S = 60.0     # seconds: the window of [auth] max_failed_hellos
MAX_TRACKED_PEERS = 65_536       # peers with failures remembered at once (oldest dropped)
OPEN_TENANT = ""                 # the tenant name a connection has in open mode

_HASH_PREFIX = "sha256:"


def _digest(token: bytes) -> str:
    return _HASH_PREFIX + hashlib.sha256(token).hexdigest()


class Authenticator:
    """Checks HELLO tokens and rate-limits failed HELLOs per peer address."""

    def __init__(self, tenants: Iterable[tuple[str, str]] = (), max_failed_hellos: int = 10, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: dict[str, deque] = {}
        self.failed_hellos = 0          # total failed HELLOs since start
        self.refused_peers = 0          # connections closed because the peer was over the limit
        self.configure(tenants, max_failed_hellos)

    def configure(self, tenants: Iterable[tuple[str, str]], max_failed_hellos: int) -> None:
        """(Re)load the tenant table and the limit (SIGHUP)."""
        table = []
        shm = set()
        act: dict[str, frozenset] = {}
        for entry in tenants:
            name, stored = entry[0], entry[1]
            if len(entry) > 2 and entry[2]:
                shm.add(name)           # (name, token, True): its Unix-socket clients may map
            if len(entry) > 3 and entry[3]:
                act[name] = frozenset(entry[3])    # (..., shm, names): it may act for these tenants
            if not isinstance(stored, str) or not stored.startswith(_HASH_PREFIX) \
                    or len(stored) != len(_HASH_PREFIX) + 64:
                raise InvalidArgument(f"tenant {name!r}: token must be stored as sha256:<64 hex>")
            table.append((name, stored.encode("ascii")))
        if not isinstance(max_failed_hellos, int) or max_failed_hellos < 1:
            raise InvalidArgument(f"max_failed_hellos {max_failed_hellos!r}: must be a positive integer")
        self._tenants = tuple(table)
        self._shm = frozenset(shm)
        self._act_for = act
        self.max_failed_hellos = max_failed_hellos

    @property
    def open_mode(self) -> bool:
        return not self._tenants

    @property
    def tenant_names(self) -> list[str]:
        return [name for name, _ in self._tenants]

    def may_map(self, tenant: str) -> bool:
        """Whether a Unix-socket client bound to ``tenant`` may map the arena (docs/shm.md):
        every client in open mode (the socket's mode is the fence), else tenants with shm."""
        return self.open_mode or tenant in self._shm

    def may_act_for(self, principal: Optional[str], tenant: str) -> bool:
        """Whether a connection bound to ``principal`` may use keys of ``tenant``: itself
        always; others only where its entry says ``may_act_for`` (docs/engines.md)."""
        if tenant == principal:
            return True
        names = self._act_for.get(principal or "")
        return names is not None and ("*" in names or tenant in names)

    def has_tenant(self, name: str) -> bool:
        return any(n == name for n, _ in self._tenants)

    # ------------------------------------------------------------------ tokens

    def authenticate(self, token: bytes) -> str:
        """The tenant the token belongs to; ``PermissionDenied`` otherwise.  Open mode: ``""``."""
        if self.open_mode:
            return OPEN_TENANT
        presented = _digest(bytes(token)).encode("ascii")
        found: Optional[str] = None
        for name, stored in self._tenants:          # no early exit: constant work per tenant
            if hmac.compare_digest(presented, stored) and found is None:
                found = name
        if found is None or not token:
            raise PermissionDenied("HELLO refused: the token matches no tenant")
        return found

    # ------------------------------------------------------------------ rate limit

    def _window(self, peer: str, now: float) -> Optional[deque]:
        q = self._failures.get(peer)
        if q is None:
            return None
        cutoff = now - FAILED_HELLO_WINDOW_S
        while q and q[0] <= cutoff:
            q.popleft()
        if not q:
            del self._failures[peer]
            return None
        return q

    def blocked(self, peer: str) -> bool:
        """True when ``peer`` already failed ``max_failed_hellos`` HELLOs in the window."""
        q = self._window(peer, self._clock())
        return q is not None and len(q) >= self.max_failed_hellos

    def record_failure(self, peer: str) -> bool:
        """Count a failed HELLO; returns True when the peer is now over the limit."""
        now = self._clock()
        self.failed_hellos += 1
        q = self._window(peer, now)
        if q is None:
            if len(self._failures) >= MAX_TRACKED_PEERS:
                self._failures.pop(next(iter(self._failures)))     # forget the oldest peer
            q = self._failures[peer] = deque()
        q.append(now)
        if len(q) > self.max_failed_hellos:
            q.popleft()         # memory per peer is bounded by the limit
        return len(q) >= self.max_failed_hellos

    def stats(self) -> dict:
        return {"mode": "open" if self.open_mode else "auth", "tenants": len(self._tenants),
                "failed_hellos": self.failed_hellos, "refused_peers": self.refused_peers,
                "max_failed_hellos": self.max_failed_hellos}
