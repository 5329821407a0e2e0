# cython: language_level=3
"""The store's per-block records as native objects: a DRAM slot (``Slot``), a put between
reserve and publish (``PutHandle``), a resident block's hot state (``Entry``).

Python code reads and writes their attributes as it did when they were classes with
``__slots__``; what changes is their cost.  Numbers are C fields (no int or float object
per block), and none of them takes part in the cyclic garbage collector (``no_gc``: each
refers only to keys, bytes and views, none of which can refer back), so a node holding
millions of blocks neither pays for them on every collection nor keeps a GC header each.
The batch loops of batch.pyx read and write the fields directly.

Each record is 64 bytes (``__basicsize__``; obmalloc hands out 16-byte multiples, so 64 is
what is allocated): five 8-byte fields and two 4-byte ones after the 16-byte object header.
A block's ``size`` is a u32 field of at most ``MAX_SIZE`` (2 GiB): the DRAM tier refuses a
``max_block_bytes`` above it (``dram.MAX_BLOCK_LIMIT``) and the config a ``[store] max_block``
above it, before any record is made; a record refuses a size outside 0..MAX_SIZE with
ValueError rather than wrap it.  ``Entry`` keeps no encoded key of its own:
``ek`` reads the key's (``KvBlockKey.encoded()``, the one bytes object the key, the index
and the key caches share).  At 1 M blocks that is 16 B less per ``Entry`` (80 -> 64) and
16 B less per ``Slot`` (72, allocated as 80 -> 64).

``PutHandle`` is the one object of a reserved block, for the DRAM tier and the store alike:
its writable ``view`` of the slot is made when first asked for (a client writing through
the mapped arena never asks) and stops working when the put is published or aborted.
"""
cimport cython
from cpython.object cimport PyObject

__all__ = ["Slot", "PutHandle", "Entry", "untrack", "PENDING", "PUBLISHED", "RETIRED", "FREED", "MAX_SIZE"]

cdef extern from "Python.h":
    int PyObject_IS_GC(object o)
    void PyObject_GC_UnTrack(void* op)
    int PyObject_GC_IsTracked(object o)

# Slot states
PENDING = 0      # reserved by a put, invisible to readers
PUBLISHED = 1    # the current version of its key
RETIRED = 2      # replaced or removed; freed when the last reference goes
FREED = 3

# bytes (2 GiB): the largest block size a Slot or an Entry holds (a u32 field; the round limit
# below it that the store enforces: dram.MAX_BLOCK_LIMIT, [store] max_block)
cdef Py_ssize_t _MAX_SIZE = 1 << 31
MAX_SIZE = _MAX_SIZE

cdef unsigned int _record_size(Py_ssize_t size) except? 0:
    if size < 0 or size > _MAX_SIZE:
        raise ValueError(f"block size {size} bytes: a store record holds 0..{MAX_SIZE} bytes")
    return <unsigned int>size


cdef object _RELEASED = memoryview(b"")
_RELEASED.release()                    # what a closed handle's view is: any use raises ValueError


@cython.no_gc
cdef class Slot:
    """One placed block: where it is in the arena and who still holds it."""

    def __init__(self, object key, Py_ssize_t offset, Py_ssize_t size, unsigned long long handle,
                 double started):
        self.key = key
        self.offset = offset
        self.size = _record_size(size)  # the block's bytes (the allocation is rounded up to the unit)
        self.handle = handle
        self.refs = 0               # leases and in-flight copies (demotion) holding the slot
        self.state = PENDING
        self.started = started

    def __repr__(self):
        return f"Slot({self.key.block_hash!r}, offset={self.offset}, size={self.size}, state={self.state})"


@cython.no_gc
@cython.freelist(256)
cdef class PutHandle:
    """A reserved, not yet published slot: write exactly ``size`` bytes into ``view``."""

    def __init__(self, Slot slot not None, object buf, bint durable=False):
        self.slot = slot
        self._buf = buf
        self.durable = durable

    @property
    def key(self):
        return self.slot.key

    @property
    def size(self):
        return self.slot.size

    @property
    def offset(self):
        """Where the reserved slot starts in the DRAM arena (for a client that mapped it)."""
        return self.slot.offset

    @property
    def _pending(self):
        return self                 # the DRAM tier's reservation and the store's put are one object

    @property
    def view(self):
        """Writable, exactly ``size`` bytes; released once the put is published or aborted."""
        if self._view is None:
            if self._closed:
                return _RELEASED
            self._view = self._buf[self.slot.offset:self.slot.offset + self.slot.size]
        return self._view

    cpdef close_view(self):
        """The writer's view stops working (publish, abort): no writes after it."""
        self._closed = True
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                pass                # the writer kept a derived view; its problem, documented
            self._view = _RELEASED


cdef PutHandle new_handle(Slot slot, object buf, bint durable):
    cdef PutHandle h = PutHandle.__new__(PutHandle)
    h.slot = slot
    h._buf = buf
    h.durable = durable
    return h


@cython.no_gc
cdef class Entry:
    """The hot per-key state of a resident block (the version of its bytes, pins, last
    access), cached by exact key for GET/PUT.  What is resident where (tier, size,
    identity) is recorded in the residency index; the store keeps the two in step."""

    def __init__(self, object key, Py_ssize_t size, long long version, double now):
        self.key = key
        self.size = _record_size(size)
        self.version = version      # bumped by every publish of new bytes for the key
        self.ssd_version = None     # the version the SSD copy holds, or None
        self.pin_until = 0.0        # clock time; 0 = not pinned
        self.hard = False
        self.last_access = now

    @property
    def ek(self):
        """The index key: the key's own encoding (``encode_key(key)``, made once with the key)."""
        return self.key.encoded()


def untrack(obj):
    """Take ``obj`` off the cyclic collector's lists and return it.  Only for an object
    that can never be part of a reference cycle: a frozen key (strings, ints, bytes), a
    residency record (a key, strings, an enum member), a list that only ever holds such
    records.  A node holding millions of blocks then does not walk them on every full
    collection (at a million blocks a full collection of their keys and records took
    ~0.5 s, and the collections ~3 us per put).  Tracked again by nothing: a list the
    caller appends to later stays untracked, so it must only ever hold such objects."""
    if PyObject_IS_GC(obj) and PyObject_GC_IsTracked(obj):
        PyObject_GC_UnTrack(<void*><PyObject*>obj)
    return obj
