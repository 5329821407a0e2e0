"""The node's fixed tunables of its connections (named, with their units)."""
from __future__ import annotations

__all__ = ["WRITE_HIGH_BYTES", "LEASE_MARGIN_S", "SEND_BUFFER_BYTES", "KEY_CACHE_ENTRIES"]

WRITE_HIGH_BYTES = 64 << 20      # bytes waiting in a transport before reading pauses
LEASE_MARGIN_S = 2.0             # seconds: abort a writer whose held lease expires this soon
SEND_BUFFER_BYTES = 4 << 20      # SO_SNDBUF of a client connection (the kernel doubles it, caps at wmem_max)
KEY_CACHE_ENTRIES = 16384        # decoded keys kept per node (encoded bytes -> KvBlockKey), LRU
