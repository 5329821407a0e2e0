"""What a resident block costs the store beyond its bytes (issue 28: <= 512 B at 1 M blocks
in a real node, ``bench/node_memory.py``; 509 B measured).  In-process, traced by
tracemalloc, a DRAM-only store's share of it: the entry and the DRAM slot (64 B each), one
entry in each of the two dicts keyed by block (the store's entries, the DRAM tier's published
slots, which is also the eviction order) and one slot of the index's block map.  The keys and
their encodings exist before, as the node's decoded request keys do.  Before the block map,
the single eviction dict and the 64-byte records, 464 B a block at 50,000 blocks (309 B
after; the dicts' fill moves it with the count)."""
import gc
import tracemalloc

from quillcache.model import KvBlockKey, encode_key
from quillcache.store.tiers import LocalKvStore, StoreOptions
from quillcache._native.keys import decode_key_fast

SIZE = 1024
N = 20000
BATCH = 500


def _raw_keys(n):
    return [encode_key(KvBlockKey("meta-llama/Llama-3.1-8B", "tok-v1", None, "acme", f"{i - 1:032x}",
                                  f"{i:032x}", block_index=i % 1000, token_count=16)) for i in range(n)]


def _put(store, keys):
    handles = store.reserve_columns_nowait(keys, [SIZE] * len(keys))
    for h in handles:
        h.view[:] = b"x" * SIZE
    assert store.put_end_many_nowait(handles) == len(handles)


def test_a_resident_block_costs_the_store_under_300_bytes_beyond_its_value():
    store = LocalKvStore(StoreOptions(dram_bytes=(N + BATCH) * SIZE + (16 << 20)))
    keys = [decode_key_fast(raw, KvBlockKey) for raw in _raw_keys(N + BATCH)]
    _put(store, keys[:BATCH])                    # first-use allocations out of the count
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(BATCH, N + BATCH, BATCH):
            _put(store, keys[i:i + BATCH])
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / N
    finally:
        tracemalloc.stop()
    with store.get(keys[-1]) as lease:
        assert bytes(lease.view) == b"x" * SIZE
    assert per_block < 300, per_block         # 216 B measured; 345 B before (same N)
