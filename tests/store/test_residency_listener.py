"""LocalKvStore.set_residency_listener: every key that becomes resident and every key that
stops being (remove, eviction) is reported by encoded key; what is resident when it is set
is returned (encoded key -> size)."""
import asyncio

from quillcache.model import KvBlockKey, encode_key
from quillcache.store.tiers import LocalKvStore, StoreOptions


def k(i: int) -> KvBlockKey:
    return KvBlockKey("m", "t", None, "ten", "p", f"b{i}")


def test_listener_sees_puts_removes_and_evictions():
    async def run():
        store = LocalKvStore(StoreOptions(1 << 20, max_block_bytes=256 << 10))
        await store.put(k(0), b"x" * 1000)
        added, dropped = [], []
        now = store.set_residency_listener(lambda ek, size: added.append((ek, size)), dropped.append)
        assert now == {encode_key(k(0)): 1000} and added == []     # what is resident now
        await store.put(k(1), b"y" * 2000)
        assert added[-1] == (encode_key(k(1)), 2000)
        await store.put(k(1), b"z" * 2000)              # an overwrite is not a new key
        assert len(added) == 1
        assert await store.remove(k(0))
        assert dropped == [encode_key(k(0))]
        for i in range(2, 12):                          # 10 x 256 KiB in 1 MiB: evictions
            await store.put(k(i), b"w" * (256 << 10))
        resident = (set(now) | {ek for ek, _ in added}) - set(dropped)
        assert resident == {encode_key(key) for key in map(k, range(12)) if store.exists(key)}
        assert len(dropped) > 1
        assert store.resident_size(encode_key(k(11))) == 256 << 10 and store.resident_size(encode_key(k(0))) is None
        assert store.set_residency_listener(None, None) == {}
        await store.put(k(99), b"q")
        assert all(ek != encode_key(k(99)) for ek, _ in added)
        await store.close()
    asyncio.run(run())
