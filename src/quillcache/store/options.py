"""StoreOptions: what a LocalKvStore is built with (the daemon fills it from [store], [ssd]
and [guard]; tests and benchmarks write it by hand), and the store's fixed limits.

The collaborators (the SSD tier, the residency index, the clock) are not options: they are
objects handed to ``LocalKvStore(options, ssd=..., index=..., clock=...)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from quillcache.errors import InvalidArgument
from quillcache.store.dram import DEFAULT_PUT_TIMEOUT_S
from quillcache.store.guard import LOCAL_HOLDER

__all__ = [
    "StoreOptions", "WRITE_POLICIES", "DEFAULT_LEASE_S", "DEFAULT_MAX_BLOCK_BYTES", "DEFAULT_MAX_LEASES",
    "CLEAN_SCAN_BLOCKS", "EVICT_AHEAD_FRACTION", "EVICT_AHEAD_MAX_BYTES",
    "DEFAULT_MAX_INFLIGHT_PUTS", "MAX_LEASE_S", "MAX_PREFIX_KEYS", "MAX_LIST_PAGE",
    "DEFAULT_MAX_HARD_PIN_FRACTION", "MAX_DEMOTIONS_IN_FLIGHT",
]

WRITE_POLICIES = ("write_back", "write_through")
DEFAULT_LEASE_S = 10.0               # seconds a get's view stays valid
DEFAULT_MAX_BLOCK_BYTES = 16 << 20   # bytes: largest block (capped at the dram capacity)
DEFAULT_MAX_LEASES = 65_536          # leases alive at once
DEFAULT_MAX_INFLIGHT_PUTS = 4_096    # puts between start and end at once
MAX_LEASE_S = 3600.0                 # seconds: longest lease
MAX_PREFIX_KEYS = 65_536             # keys in one exists_prefix call
MAX_LIST_PAGE = 65_536               # keys in one list_page call
DEFAULT_MAX_HARD_PIN_FRACTION = 0.5  # of the dram capacity that hard pins may hold
MAX_DEMOTIONS_IN_FLIGHT = 8          # SSD writes started at once to make room for waiting puts
# DRAM copies a put looks at, from the eviction order's oldest end, for ones that go without I/O
# when the store has an SSD tier (where most may be dirty): a put's cost must not grow with the
# blocks resident (docs/tiering.md, "Making room").  Past it, demotions make the room.
CLEAN_SCAN_BLOCKS = 256
# A put that must evict copies which go without I/O evicts at least this share of the DRAM tier
# (at most EVICT_AHEAD_MAX_BYTES): the next puts then find room without looking at the eviction
# order, whose walk from its oldest end costs more the more keys were evicted since the dict
# was last rebuilt (docs/tiering.md, "Making room").
EVICT_AHEAD_FRACTION = 1 / 1024
EVICT_AHEAD_MAX_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """The settings of one LocalKvStore; every one but the DRAM size has a default.

    Checked when made (``InvalidArgument`` naming the field); what needs the SSD tier to
    judge (``policy = "write_through"``) is checked by the store.  Reloadable values
    (policy, watermarks, demote_after_s, lease_s, put_timeout_s, promote_on_get, guard mode)
    are set on the running store's attributes; this object stays what it was built with."""

    dram_bytes: int                                  # bytes: the DRAM arena (a memfd)
    policy: str = "write_back"                       # one of WRITE_POLICIES (docs/tiering.md)
    high_watermark: float = 0.9                      # fraction of dram_bytes: demote above it ...
    low_watermark: float = 0.75                      # ... down to this fraction
    demote_after_s: Optional[float] = None           # seconds unread before a block is demoted; None: never
    lease_s: float = DEFAULT_LEASE_S                 # seconds a get's lease stays valid, (0, MAX_LEASE_S]
    guard_mode: str = "strict"                       # identity guard mode (store/guard.py GUARD_MODES)
    max_block_bytes: Optional[int] = None            # bytes: largest block; None: min(16 MiB, dram_bytes)
    eviction: str = "lru"                            # victim order (store/policy.py)
    put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S     # seconds a started put may take, or wait for room
    hugepages: bool = False                          # back the arena with huge pages
    prefault: bool = False                           # touch every arena page at start
    max_leases: int = DEFAULT_MAX_LEASES             # leases alive at once (Busy beyond)
    max_inflight_puts: int = DEFAULT_MAX_INFLIGHT_PUTS   # puts between start and end at once (Busy beyond)
    max_hard_pin_fraction: float = DEFAULT_MAX_HARD_PIN_FRACTION   # of dram_bytes: all hard pins together
    promote_on_get: bool = True                      # a get of an SSD-only block copies it into DRAM
    holder: str = LOCAL_HOLDER                       # this node's name on its records in the index
    # bytes: (tenant, hard-pin quota, or None for an even share of the budget) per configured
    # tenant ([[auth.tenants]] pin_bytes); empty: the node's budget only (store/pins.py)
    pin_quotas: tuple[tuple[str, Optional[int]], ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in WRITE_POLICIES:
            raise InvalidArgument(f"policy {self.policy!r}: must be one of {', '.join(WRITE_POLICIES)}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise InvalidArgument(f"watermarks low={self.low_watermark!r} high={self.high_watermark!r}: "
                                  "need 0 < low < high <= 1")
        if self.demote_after_s is not None and not self.demote_after_s > 0:
            raise InvalidArgument(f"demote_after_s {self.demote_after_s!r}: must be > 0 seconds or None")
        if not 0 < self.lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s {self.lease_s!r}: must be in (0, {MAX_LEASE_S}] seconds")
        for name in ("max_leases", "max_inflight_puts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} {value!r}: must be a positive integer")
        if not 0.0 <= self.max_hard_pin_fraction <= 1.0:
            raise InvalidArgument(f"max_hard_pin_fraction {self.max_hard_pin_fraction!r}: must be in [0, 1]")
