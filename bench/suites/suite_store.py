"""asv suite: the local KV store's request path (DRAM only) and the eviction policy.

Standalone studies: bench/identity_study.py (guard vs content-hash reuse) and
bench/trace_hit_rate.py (hit rate of the policy on the Mooncake trace).
"""
import asyncio

from quillcache.model import KvBlockKey

BLOCK = 64 << 10        # bytes per block in the timed puts/gets
N_BLOCKS = 2_000        # resident blocks
ARENA = (N_BLOCKS + 16) * BLOCK


def _keys(n, tenant="t0", model="m"):
    return [KvBlockKey(model, "tok", None, tenant, "root", f"b{i}", i) for i in range(n)]


class StoreGet:
    """get + release of a resident block, per guard mode; and a miss / cross-tenant refusal."""

    params = ["strict", "off"]
    param_names = ["guard"]

    def setup(self, guard):
        from quillcache.store.tiers import LocalKvStore, StoreOptions
        self.store = LocalKvStore(StoreOptions(ARENA, max_block_bytes=BLOCK, guard_mode=guard))
        self.keys = _keys(N_BLOCKS)
        payload = bytes(BLOCK)
        for k in self.keys:
            asyncio.run(self.store.put(k, payload))
        self.victim_key = _keys(1, tenant="other")[0]
        self.unknown = KvBlockKey("m", "tok", None, "t0", "root", "nothing")

    def time_get_release_hits(self, guard):
        get = self.store.get
        for k in self.keys:
            get(k).release()

    def time_get_misses(self, guard):
        get = self.store.get
        for _ in range(N_BLOCKS):
            try:
                get(self.unknown).release()
            except KeyError:
                pass


class StorePut:
    """Two-phase put of 64 KiB blocks into a full arena (every put evicts the LRU block)."""

    def setup(self):
        from quillcache.store.tiers import LocalKvStore, StoreOptions
        self.store = LocalKvStore(StoreOptions(ARENA, max_block_bytes=BLOCK))
        self.payload = bytes(BLOCK)
        self.loop = asyncio.new_event_loop()
        for k in _keys(N_BLOCKS + 16):
            self.loop.run_until_complete(self.store.put(k, self.payload))
        self.keys = _keys(N_BLOCKS, tenant="t1")

    def teardown(self):
        self.loop.close()

    def time_put_evicting(self):
        run = self.loop.run_until_complete
        put = self.store.put
        for k in self.keys:
            run(put(k, self.payload))


class Policy:
    """LruPolicy insert/touch/victim at 100k keys."""

    def setup(self):
        from quillcache.store.policy import LruPolicy
        self.policy = LruPolicy()
        for i in range(100_000):
            self.policy.insert(i)

    def time_touch_and_evict(self):
        p = self.policy
        for i in range(0, 100_000, 2):
            p.touch(i)
        for i in range(100_000, 110_000):
            p.insert(i)
            p.remove(p.victim())
