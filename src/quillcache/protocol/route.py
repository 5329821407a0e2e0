"""ROUTE's vocabulary on the wire: the routing policies, in their wire order (a ROUTE request
names one by index + 1).  The policies themselves live in ``quillcache.control.router``; the
wire layer only needs their names, so it imports nothing from the control plane."""

__all__ = ["POLICIES"]

POLICIES = ("round_robin", "least_loaded", "prefix", "dynamo", "quillcache", "sglang", "llmd", "mooncake")
