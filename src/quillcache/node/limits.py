"""The node's fixed tunables of its connections (named, with their units)."""
from __future__ import annotations

__all__ = ["WRITE_HIGH_BYTES", "LEASE_MARGIN_S", "SEND_BUFFER_BYTES", "KEY_CACHE_ENTRIES", "HELLO_TIMEOUT_S",
           "IDLE_TIMEOUT_S", "MAX_UNAUTHENTICATED", "MAX_UNAUTHENTICATED_PER_SOURCE"]

WRITE_HIGH_BYTES = 64 << 20      # bytes waiting in a transport before reading pauses
LEASE_MARGIN_S = 2.0             # seconds: abort a writer whose held lease expires this soon
SEND_BUFFER_BYTES = 4 << 20      # SO_SNDBUF of a client connection (the kernel doubles it, caps at wmem_max)
KEY_CACHE_ENTRIES = 16384        # decoded keys kept per node (encoded bytes -> KvBlockKey), LRU

# The defaults of the settings below (node/settings.py has them with their help text).
HELLO_TIMEOUT_S = 5.0            # seconds a connection may take to log in ([node] hello_timeout)
IDLE_TIMEOUT_S = 300.0           # seconds of silence that close a connection, 0: never ([node] idle_timeout)
MAX_UNAUTHENTICATED = 1024       # connections not logged in, all sources ([limits] max_unauthenticated)
MAX_UNAUTHENTICATED_PER_SOURCE = 32   # ... from one source ([limits] max_unauthenticated_per_source)
