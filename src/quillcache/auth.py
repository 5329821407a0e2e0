"""Tenants, token checks and the failed-HELLO slow-down.

A tenant is ``(name, "sha256:<hex>")`` from ``[auth] tenants`` (config.hash_token makes
the hash).  A HELLO presents the plain token; we hash it and compare it with every
tenant's stored hash using ``hmac.compare_digest`` and without stopping at the first
match, so the time taken says nothing about which tenant (or how much of a hash)
matched.  With no tenants the node runs open (dev mode): every HELLO succeeds and binds
no tenant.

Failed HELLOs are counted per *source* (an IP address; ``uid,pid`` on the Unix socket):
the n-th failure in a row is answered only after ``FAILED_HELLO_DELAY_S * 2**(n-1)``
seconds, at most ``FAILED_HELLO_DELAY_MAX_S`` (the server waits on a timer, the loop goes
on).  A row ends after ``FAILED_HELLO_WINDOW_S`` without a failure.  Past
``max_failed_hellos`` failures in a row, a failed HELLO also closes its connection.  A
source is never refused: a valid token is checked and answered at once whatever its source
did before, so guessing costs the guesser time and cannot lock anybody out.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from quillcache.errors import InvalidArgument, PermissionDenied

__all__ = ["Authenticator", "FAILED_HELLO_WINDOW_S", "FAILED_HELLO_DELAY_S", "FAILED_HELLO_DELAY_MAX_S",
           "MAX_TRACKED_PEERS", "OPEN_TENANT"]

FAILED_HELLO_WINDOW_S = 60.0     # seconds without a failure that end a source's row of failures
FAILED_HELLO_DELAY_S = 0.05      # seconds before the answer to a source's first failed HELLO
FAILED_HELLO_DELAY_MAX_S = 5.0   # seconds: the delay doubles per failure in a row, up to this
MAX_TRACKED_PEERS = 65_536       # sources with failures remembered at once (least recent dropped)
OPEN_TENANT = ""                 # the tenant name a connection has in open mode

_HASH_PREFIX = "sha256:"


def _digest(token: bytes) -> str:
    return _HASH_PREFIX + hashlib.sha256(token).hexdigest()


class Authenticator:
    """Checks HELLO tokens and slows failed HELLOs down per source."""

    def __init__(self, tenants: Iterable[tuple[str, str]] = (), max_failed_hellos: int = 10, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: OrderedDict[str, list] = OrderedDict()   # source -> [failures in a row, last]
        self.failed_hellos = 0          # total failed HELLOs since start
        self.delayed_s = 0.0            # seconds of delay handed out to failed HELLOs
        self.closed_after_failures = 0  # failed HELLOs whose connection was closed (past the limit)
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

    # ------------------------------------------------------------------ slow-down

    def failures(self, source: str) -> int:
        """Failed HELLOs in a row from ``source`` (0 once its row ended)."""
        entry = self._failures.get(source)
        if entry is None or self._clock() - entry[1] >= FAILED_HELLO_WINDOW_S:
            return 0
        return entry[0]

    def record_failure(self, source: str) -> tuple[float, bool]:
        """Count a failed HELLO from ``source``; returns ``(delay_s, close)``: how long to wait
        before answering it, and whether its connection is to be closed after the answer."""
        now = self._clock()
        self.failed_hellos += 1
        entry = self._failures.pop(source, None)
        if entry is None or now - entry[1] >= FAILED_HELLO_WINDOW_S:
            entry = [0, now]
            if len(self._failures) >= MAX_TRACKED_PEERS:
                self._failures.popitem(last=False)      # forget the least recent source
        entry[0] = min(entry[0] + 1, 1 << 16)
        entry[1] = now
        self._failures[source] = entry                  # most recent last
        n = entry[0]
        delay = FAILED_HELLO_DELAY_MAX_S if n > 16 else min(FAILED_HELLO_DELAY_S * (1 << (n - 1)),
                                                            FAILED_HELLO_DELAY_MAX_S)
        self.delayed_s += delay
        close = n >= self.max_failed_hellos
        if close:
            self.closed_after_failures += 1
        return delay, close

    def stats(self) -> dict:
        return {"mode": "open" if self.open_mode else "auth", "tenants": len(self._tenants),
                "failed_hellos": self.failed_hellos, "failed_hello_delay_s": round(self.delayed_s, 3),
                "failing_sources": len(self._failures), "closed_after_failures": self.closed_after_failures,
                "max_failed_hellos": self.max_failed_hellos}
