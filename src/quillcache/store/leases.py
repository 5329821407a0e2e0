"""Letting go of store leases gathered for one reply.

A batch read collects, per key, either a ``Lease`` (the block is held) or a miss: the
exception that said why (GET_MANY), its status code (GET_LOCATED), or None for a block
still to be read from the SSD tier.  When the reply cannot be sent (an error, a cancelled
task, a connection gone meanwhile) every lease among them must be released, once; the
misses hold nothing.
"""
from __future__ import annotations

from typing import Iterable

from quillcache.store.tiers import Lease

__all__ = ["release_leases"]


def release_leases(got: Iterable) -> int:
    """Release every ``Lease`` in ``got``, skipping misses (exceptions, status codes, None);
    returns how many were leases.  Releasing a lease twice is harmless (``Lease.release``)."""
    n = 0
    for item in got:
        if isinstance(item, Lease):
            item.release()
            n += 1
    return n
