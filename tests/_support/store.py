"""Small stores and their keys and values, for the put-path tests of tests/store/."""
import numpy as np

from quillcache.errors import NotFound
from quillcache.model import KvBlockKey
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.clock import Clock

BLOCK = 1024


def key(i):
    return KvBlockKey("m", "tok", None, "t", "root", f"b{i}", i)


def data(i, n=BLOCK):
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def make(blocks=4, **options):
    """A DRAM-only store of ``blocks`` blocks of BLOCK bytes, on a hand-set clock."""
    return LocalKvStore(StoreOptions(blocks * BLOCK, max_block_bytes=BLOCK, **options), clock=Clock())


def state(store, ids):
    """What a reader sees (bytes per key, or NotFound) and the store's counters."""
    out = {}
    for i in ids:
        try:
            with store.get(key(i)) as lease:
                out[i] = bytes(lease.view)
        except NotFound:
            out[i] = None
    stats = store.stats()
    return out, stats["dram"], stats["store"]
