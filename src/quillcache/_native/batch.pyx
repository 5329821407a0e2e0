# cython: language_level=3
"""The per-key loops of a batch request, one call each: the key caches' lookups (the
node's decoded keys, node/keys.py; the client's encoded keys, client/ops.py), the store's
hold of a located batch and its release (store/batchlease.py, store/dram.py), and the
put path of a batch: its reserve (``place_many``) and its publish (``commit_many``).

``hold_published`` does for each key what ``BatchLeases.located_batch`` does for a key
whose exact entry has a published DRAM slot: take a reference on the slot, stamp the
entry's last access, refresh the key in the DRAM eviction order (with LRU: the published
dict itself, store/policy.py, so the key is moved with its slot).  Every other key (no
entry of that exact key: the identity guard decides; an entry with no DRAM copy: the SSD
tier) is left to the store's per-key path, which is the same code it always ran.

The store's per-block records are the native ones of blocks.pyx, read and written here
field by field; the maps they live in stay the store's (it passes them in, and gets back
which keys, or which puts, it must still handle itself).
"""
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Occurred
from cpython.object cimport PyObject_Hash
from cpython.list cimport PyList_Append
from cpython.ref cimport PyObject

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint64_t

from quillcache._native.alloc cimport ALLOC_OK, OffsetAllocator
from quillcache._native.blocks cimport Entry, PutHandle, Slot, new_handle
from quillcache._native.includes.pydict cimport QC_DictDelKnownHash, QC_DictGetKnownHash, QC_DictSetKnownHash

__all__ = ["cached_values", "hold_published", "drop_refs", "check_columns", "place_many", "commit_many",
           "packed_offsets"]


cdef int _raise_set() except -1:
    return -1           # an exception is set (by a lookup's __eq__): returning -1 raises it


def cached_values(list raws not None, object recent, object refresh, object compute):
    """Per raw, in order: ``recent[raw]`` where present (a hit, then refreshed: ``refresh``
    True moves the raw to the most recent end of ``recent``, a plain dict kept in insertion
    order, here in native code; a callable is called with the raw, an OrderedDict's
    ``move_to_end``; None: no refresh), else ``compute(raw)`` (the cache's own miss path,
    which may insert and evict).  Returns ``(values, hits, error)``: ``error`` is None, or the
    Exception ``compute`` raised, where the loop stopped (the caller counts the hits before
    it and raises it)."""
    cdef Py_ssize_t i, n = len(raws), hits = 0
    cdef PyObject* v
    cdef list out = [None] * n
    cdef object raw, value
    cdef bint move = refresh is True
    cdef Py_hash_t h
    if not isinstance(recent, dict):
        raise TypeError(f"recent must be a dict (or an OrderedDict), not {type(recent).__name__}")
    if move and type(recent) is not dict:
        raise TypeError("refresh=True needs a plain dict (an OrderedDict keeps its own order: pass move_to_end)")
    for i in range(n):
        raw = raws[i]
        v = NULL
        if type(raw) is bytes or not move:      # anything else (a bytearray) is compute's to convert
            h = PyObject_Hash(raw) if type(raw) is bytes else -1
            v = QC_DictGetKnownHash(recent, raw, h) if h != -1 else PyDict_GetItem(recent, raw)
            if v is NULL and PyErr_Occurred():
                _raise_set()
        if v is NULL:
            try:
                out[i] = compute(raw)
            except Exception as exc:
                return out, hits, exc
            continue
        value = <object>v
        out[i] = value
        if move:                        # to the most recent end: deleted and inserted again
            QC_DictDelKnownHash(recent, raw, h)
            QC_DictSetKnownHash(recent, raw, value, h)
        elif refresh is not None:
            refresh(raw)
        hits += 1
    return out, hits, None


def drop_refs(list slots not None, object retired):
    """``refs -= 1`` on each of ``slots``; returns those no reference holds any more whose
    ``state`` is ``retired`` (replaced or removed while held: the caller frees them)."""
    cdef list free = []
    cdef Slot slot
    cdef int state = retired
    for s in slots:
        slot = <Slot?>s
        slot.refs -= 1
        if slot.refs <= 0 and slot.state == state:
            PyList_Append(free, slot)
    return free


def hold_published(list keys not None, type key_type not None, dict entries not None, dict published not None,
                   object now, dict order):
    """For each of ``keys`` (each must be of ``key_type``; TypeError names the first that
    is not): where ``entries[key]`` exists and ``published[entry.key]`` is a slot, take the
    slot (``refs += 1``), set ``entry.last_access = now`` and, where ``order`` (an eviction
    order kept in insertion order: ``LruPolicy.order``, which may be ``published`` itself)
    holds ``entry.key``, move it to the most recent end with its value (deleted and inserted
    again, with the hash already taken); None: reads refresh nothing.

    Returns ``(held, got)``: ``held`` the slots taken, in key order; ``got`` per key the
    slot taken or None (the caller resolves that key itself).  On an exception nothing
    stays taken."""
    cdef Py_ssize_t i, n = len(keys)
    cdef PyObject* e
    cdef PyObject* s
    cdef PyObject* v
    cdef Py_hash_t h
    cdef list held = []
    cdef list got = [None] * n
    cdef object key, served, value
    cdef Entry entry
    cdef Slot slot
    try:
        for i in range(n):
            key = keys[i]
            if type(key) is not key_type:
                raise TypeError(i)
            h = PyObject_Hash(key)      # once: KvBlockKey's __hash__ is Python code
            e = QC_DictGetKnownHash(entries, key, h)
            if e is NULL:
                if PyErr_Occurred():
                    _raise_set()
                continue
            entry = <Entry?><object>e
            served = entry.key
            if served is not key:       # another identity's block (guard modes tenant/off)
                h = PyObject_Hash(served)
            s = QC_DictGetKnownHash(published, served, h)
            if s is NULL:
                if PyErr_Occurred():
                    _raise_set()
                continue
            slot = <Slot?><object>s
            slot.refs += 1              # dram.hold: the slot stays in place while held
            PyList_Append(held, slot)
            got[i] = slot
            entry.last_access = now
            if order is not None:       # LruPolicy.touch: a key the order tracks goes to its end
                v = s if order is published else QC_DictGetKnownHash(order, served, h)
                if v is not NULL:
                    value = <object>v   # a reference of our own across the delete
                    QC_DictDelKnownHash(order, served, h)
                    QC_DictSetKnownHash(order, served, value, h)
                elif PyErr_Occurred():
                    _raise_set()
    except BaseException:
        for s2 in held:
            (<Slot>s2).refs -= 1
        raise
    return held, got


# ---- the put path of a batch: reserve, publish (store/writes.py, store/dram.py) ---------------

def check_columns(list keys not None, list sizes not None, type key_type not None, Py_ssize_t max_size):
    """Total bytes of a batch's ``sizes``; TypeError(i) names the first key not of
    ``key_type`` or size not an int, ValueError(i) the first size outside 1..max_size."""
    cdef Py_ssize_t i, n = len(keys), size, total = 0
    cdef object s
    if len(sizes) != n:
        raise ValueError(-1)
    for i in range(n):
        if type(keys[i]) is not key_type:
            raise TypeError(i)
        s = sizes[i]
        if type(s) is not int:
            raise TypeError(i)
        size = s
        if size < 1 or size > max_size:
            raise ValueError(i)
        total += size
    return total


def place_many(OffsetAllocator alloc not None, list keys not None, list sizes not None, double now,
               dict pending not None, object buf, bint durable, dict register):
    """A slot for each of ``keys`` (sizes checked: ``check_columns``), all or nothing: the
    ``PutHandle``s in order, each slot entered in ``pending`` (slot -> slot) and, where
    ``register`` is a dict, in it (slot -> handle).  None when the allocator has no room
    for all of them: nothing placed (the caller evicts, or waits)."""
    cdef Py_ssize_t i, n = len(keys), failed = 0
    cdef uint64_t* cols
    cdef int rc
    cdef list out
    cdef Slot slot
    cdef PutHandle h
    if n == 0:
        return []
    cols = <uint64_t*>PyMem_Malloc(3 * n * sizeof(uint64_t))
    if cols == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            cols[i] = <uint64_t><Py_ssize_t>sizes[i]
        alloc._enter()
        rc = alloc.c_allocate_many(cols, n, cols + n, cols + 2 * n, &failed)
        if rc != ALLOC_OK:
            return None
        out = [None] * n
        try:
            for i in range(n):
                slot = Slot.__new__(Slot)
                slot.key = keys[i]
                slot.offset = <Py_ssize_t>cols[n + i]
                slot.size = <unsigned int>cols[i]    # checked: 1..max_size (<= blocks.MAX_SIZE)
                slot.handle = cols[2 * n + i]
                slot.refs = 0
                slot.state = 0                  # PENDING
                slot.started = now
                h = new_handle(slot, buf, durable)
                out[i] = h
                pending[slot] = slot
                if register is not None:
                    register[slot] = h
        except BaseException:
            for i in range(n):
                h = out[i]
                if h is not None:
                    pending.pop(h.slot, None)
                    if register is not None:
                        register.pop(h.slot, None)
            alloc.c_free_many(cols + 2 * n, n, &failed)
            raise
        return out
    finally:
        PyMem_Free(cols)


def commit_many(list handles not None, Py_ssize_t start, store, dram, type entry_type not None,
                object versions, double now):
    """Publish ``handles[start:]`` in order, each exactly as ``put_end_nowait`` would, up to
    the first that this loop leaves to it: one not in flight (reaped: its error is the
    store's to give), durable (the SSD write first), or whose key has an SSD copy or may
    have one (the store still holds untouched recovered blocks).  Returns how many it
    published.

    Per handle: the slot leaves the in-flight maps, becomes its key's published slot at
    the most recent end of the published dict (the DRAM eviction order, store/policy.py: a
    replaced key is deleted and inserted again; the slot it replaces is retired: freed now,
    or when its last reference goes), the entry is made or updated (version, size, last
    access).  The residency index
    and the listeners hear of a new key (``store._added(entry)``) or of a changed record
    (``store._record(entry)``); a DRAM block rewritten at the same size changes no record."""
    cdef Py_ssize_t i, n = len(handles), done = 0, delta = 0
    cdef PutHandle h
    cdef Slot slot, old
    cdef Entry entry
    cdef object key, e, o
    cdef dict inflight = store._handles
    cdef dict entries = store._entries
    cdef bint untouched = bool(store._untouched)
    cdef dict pending = dram._pending
    cdef dict published = dram._published
    cdef dict retired = dram._retired
    cdef OffsetAllocator alloc = dram._alloc
    cdef object added = store._added
    cdef object record = store._record
    cdef bint changed
    cdef Py_hash_t kh
    cdef PyObject* pe
    cdef PyObject* po
    try:
        for i in range(start, n):
            h = handles[i]
            slot = h.slot
            if h.durable or inflight.get(slot) is not h or slot not in pending:
                break
            key = slot.key
            kh = PyObject_Hash(key)             # once: KvBlockKey's __hash__ is Python code
            pe = QC_DictGetKnownHash(entries, key, kh)
            if pe is NULL:
                if PyErr_Occurred():
                    _raise_set()
                e = None
                if untouched:
                    break
            else:
                e = <object>pe
                if (<Entry?>e).ssd_version is not None:
                    break
            # -- the DRAM tier: publish the slot (dram.put_end)
            del inflight[slot]
            del pending[slot]
            h.close_view()
            po = QC_DictGetKnownHash(published, key, kh)
            if po is NULL and PyErr_Occurred():
                _raise_set()
            o = None if po is NULL else <object>po
            slot.state = 1                      # PUBLISHED
            slot.started = 0.0
            if o is not None:                   # a re-put goes to the most recent end, as a new key
                QC_DictDelKnownHash(published, key, kh)
            QC_DictSetKnownHash(published, key, slot, kh)
            delta += slot.size
            changed = True
            if o is not None:                   # retired: the key now names the new slot
                old = <Slot>o
                delta -= old.size
                changed = old.size != slot.size
                if old.refs > 0:
                    old.state = 2               # RETIRED
                    retired[old] = old
                else:
                    old.state = 3               # FREED
                    alloc._enter()
                    alloc.c_free(old.handle)
            # -- the store: the entry, the records
            if e is None:
                entry = entry_type(key, slot.size, next(versions), now)
                QC_DictSetKnownHash(entries, key, entry, kh)
            else:
                entry = <Entry>e
                entry.size = slot.size
                entry.version = next(versions)
                entry.last_access = now
            done += 1
            if e is None:
                added(entry)
            elif changed:
                record(entry)
    finally:
        dram.published_bytes += delta
    return done


def packed_offsets(list handles not None):
    """Each handle's slot offset as a little-endian u64, packed (a RESERVE reply's offsets)."""
    cdef Py_ssize_t i, n = len(handles)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 8 * n)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    cdef uint64_t off
    cdef int b
    for i in range(n):
        off = <uint64_t>(<PutHandle?>handles[i]).slot.offset
        for b in range(8):
            p[8 * i + b] = <unsigned char>((off >> (8 * b)) & 0xFF)
    return out
