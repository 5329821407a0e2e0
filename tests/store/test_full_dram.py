"""A put into a full DRAM tier costs the same whatever the number of blocks resident.

Before (2026-11-27): making room built the list of every evictable block of the order
(``_make_room``), and a store with an SSD tier searched the whole order for a clean copy on
every put (``_evictable_bytes``): each put into a full tier cost ~1.4 us per resident block
(20 ms at 20,000 blocks, 150 ms at 100,000).  Counted here, not timed: the keys of the order a
put looks at (``LocalKvStore._dram.lookup`` calls, the one per key ``_victims`` makes) must not
grow with the blocks resident.  Also: the evictions still go in policy order (the oldest
first), and evicting ahead frees at least ``EVICT_AHEAD_FRACTION`` of the tier at once."""
import asyncio

from quillcache.store.options import CLEAN_SCAN_BLOCKS, EVICT_AHEAD_FRACTION
from quillcache.store.ssd import SsdTier
from quillcache.store.tiers import LocalKvStore, StoreOptions
from tests._support.store import BLOCK, data, key

VALUE = data(1)


class _CountingLookups:
    """The store's own DRAM tier with its ``lookup`` calls counted (every call goes through)."""

    def __init__(self, store) -> None:
        self.calls = 0
        dram = store._dram
        original = dram.lookup

        def lookup(k):
            self.calls += 1
            return original(k)

        dram.lookup = lookup


async def _fill_then_overfill(store, blocks: int, extra: int) -> list:
    """``blocks`` puts that fill DRAM, then ``extra`` more; the lookups of each extra put."""
    for i in range(blocks):
        await store.put(key(i), VALUE)
    counter = _CountingLookups(store)
    per_put = []
    for i in range(blocks, blocks + extra):
        before = counter.calls
        await store.put(key(i), VALUE)
        per_put.append(counter.calls - before)
    return per_put


def _dram_only(blocks: int) -> LocalKvStore:
    return LocalKvStore(StoreOptions(blocks * BLOCK, max_block_bytes=BLOCK))


def test_a_put_into_a_full_dram_only_tier_looks_at_a_few_keys_whatever_the_size():
    small = asyncio.run(_fill_then_overfill(_dram_only(500), 500, 100))
    large = asyncio.run(_fill_then_overfill(_dram_only(5000), 5000, 100))
    # one walk per round of evictions: a handful of keys (before: every resident key, twice)
    assert max(small) <= 16 and max(large) <= 16, (max(small), max(large))
    assert sum(large) <= 2 * sum(small) + 200


def test_evictions_go_oldest_first_and_free_at_least_the_share_ahead():
    blocks = 16384                                       # 16 MiB: a share of 16 blocks
    store = _dram_only(blocks)
    asyncio.run(_fill_then_overfill(store, blocks, 100))
    ahead = int(blocks * BLOCK * EVICT_AHEAD_FRACTION) // BLOCK
    assert ahead == 16
    present = [i for i in range(blocks + 100) if store.exists(key(i))]
    assert present == list(range(present[0], blocks + 100))      # a suffix: the oldest went first
    assert blocks - ahead <= len(present) <= blocks
    assert present[0] >= 100
    assert store.stats()["dram"]["evictions"] == blocks + 100 - len(present)


def test_with_an_ssd_tier_a_put_into_a_full_tier_of_dirty_blocks_looks_at_a_bounded_prefix(tmp_path):
    async def run(blocks: int) -> list:
        ssd = SsdTier(tmp_path / str(blocks), 4 * blocks * BLOCK)
        store = LocalKvStore(StoreOptions(blocks * BLOCK, max_block_bytes=BLOCK), ssd=ssd)
        try:
            return await _fill_then_overfill(store, blocks, 40)
        finally:
            await store.close()

    small = asyncio.run(run(300))
    large = asyncio.run(run(3000))
    # every block is dirty (write_back, never demoted): the search for a clean copy stops after
    # CLEAN_SCAN_BLOCKS keys, and the demotions that make the room look at a few more
    bound = 3 * CLEAN_SCAN_BLOCKS + 64
    assert max(large) <= bound, (max(small), max(large))
    assert max(large) <= 2 * max(small) + 64
