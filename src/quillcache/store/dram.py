"""The DRAM tier of one node: one memfd arena, blocks placed by the offset allocator.

The arena is a memfd mapped ``MAP_SHARED``, so that the daemon can hand its fd to a
trusted same-host client (``SCM_RIGHTS``, docs/shm.md) which maps the very same pages.
With ``hugepages`` the memfd is first asked for from the hugetlb pool (``MFD_HUGETLB``,
2 MiB pages, only where the kernel has enough reserved); where it has not, a plain memfd
is advised ``MADV_HUGEPAGE`` (shmem THP, where ``shmem_enabled`` allows it).
``backing`` says which one this arena got.

No per-block Python ``bytes`` on the data path.  A put reserves a slot and hands out a
writable view of it (the daemon receives from the socket straight into that view); a get
hands out a read-only view of the published slot.  Slots are reference counted: a slot
that a reader still holds (a lease) outlives its replacement or removal and is freed when
the last reference is dropped.

Two-phase put, as in Mooncake: ``put_start`` reserves, ``put_end`` publishes, ``put_abort``
frees.  A writer that vanishes between start and end has its slot reclaimed by
``reap_stale(now)`` after ``put_timeout_s``.  Readers only ever see published slots.

Size 0 is refused (``InvalidArgument``): a KV block has at least one byte, and an empty
slot would have no offset of its own in the allocator.
"""
from __future__ import annotations

import errno
import mmap
import os
import time
from typing import Callable, Iterator, Optional

import numpy as np

from quillcache._native import blocks as _blocks
from quillcache._native.alloc import OffsetAllocator
from quillcache._native.batch import drop_refs, place_many
from quillcache.errors import ConfigError, InvalidArgument, NotFound
from quillcache.model import KvBlockKey

__all__ = ["DramTier", "Slot", "PendingPut", "ARENA_UNIT", "MAX_ARENA_BYTES", "MAX_BLOCK_LIMIT",
           "DEFAULT_PUT_TIMEOUT_S"]

ARENA_UNIT = 256                     # bytes: allocation granularity of the arena
MAX_ARENA_BYTES = 1 << 40            # bytes (1 TiB): the allocator counts 256 B units in 32 bits
MAX_BLOCK_LIMIT = _blocks.MAX_SIZE   # bytes (2 GiB): largest max_block_bytes (a record's size is a u32)
DEFAULT_PUT_TIMEOUT_S = 30.0         # seconds a put may stay between start and end
PAGE_BYTES = mmap.PAGESIZE           # bytes: touched once per page when pre-faulting
HUGETLB_BYTES = 2 << 20              # bytes: the hugetlb page size asked for (the x86-64/AArch64 default)
ARENA_NAME = "quillcache-arena"      # the memfd's name (shown in /proc/PID/maps)
_SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)     # Linux 5.14 (Python 3.11 lacks the name)

# Slot states (a Slot's ``state``)
PENDING, PUBLISHED, RETIRED, FREED = _blocks.PENDING, _blocks.PUBLISHED, _blocks.RETIRED, _blocks.FREED

def hugepages_available(path: str = _SHMEM_THP) -> bool:
    """Transparent hugepages can be asked for with madvise (a mode other than never/deny)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return False
    return "[never]" not in text and "[deny]" not in text


def _populate(m: mmap.mmap) -> None:
    """Fault every page of ``m`` in now, writable (``MADV_POPULATE_WRITE``, Linux 5.14; before it,
    one write a page).  Memory the host cannot give is a ``ConfigError`` at start, not a SIGBUS
    at the first put that lands there."""
    try:
        m.madvise(MADV_POPULATE_WRITE)
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:   # EINVAL: a kernel before 5.14; anything else: no memory
            raise ConfigError(f"[store] prefault: the DRAM arena ({len(m)} bytes) could not be faulted "
                              f"in: {exc.strerror}") from None
    np.frombuffer(m, dtype=np.uint8)[::PAGE_BYTES] = 0


def _map_memfd(capacity: int, hugepages: bool, prefault: bool) -> tuple[int, mmap.mmap, str]:
    """(fd, shared mapping, backing) of a fresh memfd of ``capacity`` bytes, every page faulted
    in with ``prefault``."""
    fd, m, backing = _map_fresh(capacity, hugepages)
    # Faulted in after the huge-page advice, not by MAP_POPULATE at mmap: pages faulted before
    # it are small pages and stay so (measured: a prefaulted 256 MiB arena under shmem_enabled =
    # advise got no huge page).
    if prefault:
        try:
            _populate(m)
        except BaseException:
            m.close()
            os.close(fd)
            raise
    return fd, m, backing


def _map_fresh(capacity: int, hugepages: bool) -> tuple[int, mmap.mmap, str]:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    if hugepages and hasattr(os, "MFD_HUGETLB") and capacity % HUGETLB_BYTES == 0:
        fd = -1
        try:
            fd = os.memfd_create(ARENA_NAME, os.MFD_CLOEXEC | os.MFD_HUGETLB)
            os.ftruncate(fd, capacity)
            # mmap reserves the hugetlb pages now: too few reserved fails here, not later by SIGBUS
            return fd, mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=prot), "memfd-hugetlb"
        except OSError:
            if fd >= 0:
                os.close(fd)
    fd = os.memfd_create(ARENA_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        m = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=prot)
    except BaseException:
        os.close(fd)
        raise
    backing = "memfd"
    if hugepages and hugepages_available():
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            backing = "memfd-thp"
        except OSError:
            pass
    return fd, m, backing


# One placed block (key, offset, size, allocator handle, references, state) and a
# reservation of one (its ``slot`` and a writable ``view``): native records (_native/blocks.pyx).
Slot = _blocks.Slot
PendingPut = _blocks.PutHandle


class DramTier:
    """The arena, the key -> published slot map and the slot lifetimes."""

    def __init__(self, capacity: int, *, max_block_bytes: Optional[int] = None,
                 put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S, hugepages: bool = False,
                 prefault: bool = False, clock: Callable[[], float] = time.monotonic):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not ARENA_UNIT <= capacity <= MAX_ARENA_BYTES:
            raise InvalidArgument(f"dram capacity {capacity!r}: must be an integer of "
                                  f"{ARENA_UNIT}..{MAX_ARENA_BYTES} bytes")
        capacity -= capacity % ARENA_UNIT
        if max_block_bytes is None:
            max_block_bytes = min(capacity, MAX_BLOCK_LIMIT)
        if not isinstance(max_block_bytes, int) or not 1 <= max_block_bytes <= min(capacity, MAX_BLOCK_LIMIT):
            raise InvalidArgument(f"max_block_bytes {max_block_bytes!r}: must be 1..{min(capacity, MAX_BLOCK_LIMIT)} "
                                  f"(the dram capacity, at most {MAX_BLOCK_LIMIT}: a block's size is kept in 32 bits)")
        if not put_timeout_s > 0:
            raise InvalidArgument(f"put_timeout_s {put_timeout_s!r}: must be > 0 seconds")
        self.capacity = capacity
        self.max_block_bytes = max_block_bytes
        self.put_timeout_s = float(put_timeout_s)
        self._clock = clock
        # the fd stays open for the tier's life: it is what trusted clients map (SCM_RIGHTS)
        self.fd, self._map, self.backing = _map_memfd(capacity, hugepages, prefault)
        self.hugepages = self.backing != "memfd"
        self._buf = memoryview(self._map)
        self._ro = self._buf.toreadonly()         # what read-only views are sliced from
        self.array = np.frombuffer(self._map, dtype=np.uint8)   # numpy view of the whole arena
        self.prefaulted = bool(prefault)
        self._alloc = OffsetAllocator(capacity, unit=ARENA_UNIT)
        # key -> published slot, in eviction order (least recent first): a publish puts the
        # key at the end; the store's DRAM policy orders it further (store/policy.py)
        self._published: dict[KvBlockKey, Slot] = {}
        # slots by identity (a C-level hash; no number kept per block to name them)
        self._pending: dict[Slot, Slot] = {}     # reserved, not published
        self._retired: dict[Slot, Slot] = {}     # still referenced after replace/remove
        self.published_bytes = 0
        self.closed = False

    # ------------------------------------------------------------------ capacity

    @property
    def used(self) -> int:
        """Bytes the allocator has handed out (pending, published and retired, rounded up)."""
        return self._alloc.used

    def report(self) -> tuple[int, int]:
        """(free bytes, largest free extent)."""
        return self._alloc.report()

    def check_size(self, size: object) -> int:
        if not isinstance(size, int) or isinstance(size, bool):
            raise InvalidArgument(f"block size {size!r}: must be an integer")
        if not 1 <= size <= self.max_block_bytes:
            raise InvalidArgument(f"block size {size} bytes: must be 1..{self.max_block_bytes} bytes")
        return size

    # ------------------------------------------------------------------ two-phase put

    def put_start(self, key: KvBlockKey, size: int) -> PendingPut:
        """Reserve a slot; raises CapacityError (nothing changed) when the arena has no room."""
        self._check_open()
        self.check_size(size)
        alloc = self._alloc.allocate(size)          # CapacityError when full: nothing reserved
        slot = Slot(key, alloc.offset, size, alloc.handle, self._clock())
        self._pending[slot] = slot
        return PendingPut(slot, self._buf)

    def put_start_many(self, keys: list, sizes: list, durable: bool = False,
                       register: Optional[dict] = None) -> Optional[list[PendingPut]]:
        """``put_start`` of each ``(keys[i], sizes[i])`` (sizes already checked), all or
        nothing, in one native pass; each reservation's ``durable`` set, and entered in
        ``register`` (slot -> reservation) where given.  None when the arena has no room
        for all of them: nothing reserved."""
        self._check_open()
        return place_many(self._alloc, keys, sizes, self._clock(), self._pending, self._buf, durable, register)

    def put_end(self, pending: PendingPut) -> Optional[Slot]:
        """Publish; returns the replaced slot (already retired or freed) or None."""
        slot = pending.slot
        if self._pending.pop(slot, None) is None:
            raise InvalidArgument("put handle is not in flight (already ended, aborted or reaped)")
        pending.close_view()            # the writer's view stops working: no writes after publish
        # popped, not overwritten: the key goes to the most recent end of the eviction order
        # (the published dict is the DRAM tier's order: store/policy.py), a re-put as a new key
        old = self._published.pop(slot.key, None)
        slot.state = PUBLISHED
        slot.started = 0.0              # read only while pending (the reaper): no float kept per block
        self._published[slot.key] = slot
        self.published_bytes += slot.size
        if old is not None:
            self._retire(old)
        return old

    def put_abort(self, pending: PendingPut) -> bool:
        slot = pending.slot
        if self._pending.pop(slot, None) is None:
            return False
        pending.close_view()            # the slot is freed even if the writer kept a derived view
        self._free(slot)
        return True

    def is_pending(self, pending: PendingPut) -> bool:
        return pending.slot in self._pending

    def reap_stale(self, now: float) -> list[KvBlockKey]:
        """Free every pending slot older than the put timeout; returns their keys."""
        deadline = now - self.put_timeout_s
        stale = [s for s in self._pending.values() if s.started <= deadline]
        for slot in stale:
            del self._pending[slot]
            self._free(slot)
        return [s.key for s in stale]

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ readers

    def lookup(self, key: KvBlockKey) -> Optional[Slot]:
        return self._published.get(key)

    @property
    def published(self) -> dict:
        """key -> published Slot, for a batch of lookups in one pass (store/batchlease.py),
        and the DRAM eviction order (store/policy.py: a publish puts its key at the most
        recent end, the LRU policy moves a read key there).  Only this tier adds and
        removes keys; the policy only reorders them, values kept."""
        return self._published

    def contains(self, key: KvBlockKey) -> bool:
        return key in self._published

    def acquire(self, slot: Slot) -> memoryview:
        """Take a reference and return a read-only view of the block's bytes."""
        if slot.state != PUBLISHED:
            raise NotFound("slot is no longer published")
        slot.refs += 1
        return self._ro[slot.offset:slot.offset + slot.size]

    def views(self, slots: list) -> list:
        """A read-only view of each of ``slots`` (held by the caller), in order."""
        ro = self._ro
        return [ro[s.offset:s.offset + s.size] for s in slots]

    def hold(self, slot: Slot) -> None:
        """Take a reference without a view (an in-flight copy, e.g. a demotion)."""
        slot.refs += 1

    def release(self, slot: Slot) -> None:
        slot.refs -= 1
        if slot.refs <= 0 and slot.state == RETIRED:
            del self._retired[slot]
            self._free(slot)

    def release_many(self, slots: list) -> None:
        """``release`` of each of ``slots`` (a batch lease's), the references dropped in one pass."""
        for slot in drop_refs(slots, RETIRED):
            del self._retired[slot]
            self._free(slot)

    def raw_view(self, slot: Slot) -> memoryview:
        """A writable view of a slot (promotion fills a pending slot through this)."""
        return self._buf[slot.offset:slot.offset + slot.size]

    def unpublish(self, key: KvBlockKey) -> Optional[Slot]:
        """Make the key invisible now; its slot is freed when no reference holds it."""
        slot = self._published.get(key)
        if slot is None:
            return None
        self._retire(slot)
        return slot

    def keys(self) -> Iterator[KvBlockKey]:
        return iter(list(self._published))

    def __len__(self) -> int:
        return len(self._published)

    # ------------------------------------------------------------------ internals

    def _retire(self, slot: Slot) -> None:
        if self._published.get(slot.key) is slot:
            del self._published[slot.key]
        self.published_bytes -= slot.size
        if slot.refs > 0:
            slot.state = RETIRED
            self._retired[slot] = slot
        else:
            self._free(slot)

    def _free(self, slot: Slot) -> None:
        slot.state = FREED
        self._alloc.free(slot.handle)

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("the dram tier is closed")

    def close(self) -> None:
        """Drop every slot and unmap; views still held by callers keep the mapping alive."""
        if self.closed:
            return
        self.closed = True
        self._published.clear()
        self._pending.clear()
        self._retired.clear()
        self.array = None
        try:
            self._ro.release()
            self._buf.release()
            self._map.close()
        except BufferError:
            pass                # outstanding views: the mapping goes when the last one does
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)        # clients that mapped it keep their mapping (and the pages)
