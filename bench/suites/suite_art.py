"""asv suite: the adaptive radix tree and the ART residency index (100k keys, so setup
stays short; bench/native_art.py runs the 1M-key comparison)."""
import random

from bench.native_art import GROUP, make_keys, miss_keys

N_KEYS = 100_000


class ArtTree:
    timeout = 120

    def setup(self):
        from quillcache._native.art import AdaptiveRadixTree

        self.keys, self.prefixes = make_keys(N_KEYS)
        rnd = random.Random(5)
        rnd.shuffle(self.keys)
        self.tree = AdaptiveRadixTree()
        self.tree.insert_many(self.keys, range(N_KEYS))
        self.hits = self.keys[:10_000]
        self.misses = miss_keys(self.keys, 10_000)
        self.scan_prefixes = [rnd.choice(self.prefixes) for _ in range(1_000)]

    def time_get_hit_single(self):
        get = self.tree.get
        for k in self.hits:
            get(k)

    def time_get_miss_single(self):
        get = self.tree.get
        for k in self.misses:
            get(k)

    def time_get_many_hit(self):
        self.tree.get_many(self.hits)

    def time_scan_prefix_16(self):
        scan = self.tree.scan_prefix
        for p in self.scan_prefixes:
            scan(p)

    def time_insert_many_fresh_tree(self):
        from quillcache._native.art import AdaptiveRadixTree

        AdaptiveRadixTree().insert_many(self.hits, range(len(self.hits)))

    def track_bytes_per_key(self):
        return self.tree.memory_bytes() / N_KEYS

    track_bytes_per_key.unit = "bytes"


class ArtIndexScan:
    timeout = 120

    def setup(self):
        from quillcache.index.art import ArtIndex
        from quillcache.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey

        rnd = random.Random(6)
        self.scope = IdentityScope("llama", "tok", None, "acme")
        self.groups = ["%08x" % rnd.getrandbits(32) for _ in range(20_000 // GROUP)]
        self.index = ArtIndex()
        for g in self.groups:
            for i in range(GROUP):
                k = KvBlockKey("llama", "tok", None, "acme", g, "%05x" % i, i)
                self.index.put(CacheResidency(k, "w%d" % (i % 4), CacheTier.HBM, 1 << 20))

    def time_prefix_scan(self):
        scan = self.index.prefix_scan
        for g in self.groups[:200]:
            scan(self.scope, g)
