# cython: language_level=3
"""The per-key loops of a batch request, one call each: the key caches' lookups (the
node's decoded keys, node/keys.py; the client's encoded keys, client/ops.py), the store's
hold of a located batch and its release (store/batchlease.py, store/dram.py).

``hold_published`` does for each key what ``BatchLeases.located_batch`` does for a key
whose exact entry has a published DRAM slot: take a reference on the slot, stamp the
entry's last access, refresh the key in the DRAM eviction order.  Every other key (no
entry of that exact key: the identity guard decides; an entry with no DRAM copy: the SSD
tier) is left to the store's per-key path, which is the same code it always ran.

Nothing here knows the store's types beyond the attributes it reads and writes (``key``,
``last_access`` of an entry; ``refs`` of a slot), so the store stays the one owner of its
state: it passes its own maps in and gets back which keys it must still resolve.
"""
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Occurred
from cpython.object cimport PyObject_Hash
from cpython.list cimport PyList_Append
from cpython.ref cimport PyObject

from quillcache._native.includes.pydict cimport QC_DictDelKnownHash, QC_DictGetKnownHash, QC_DictSetKnownHash

__all__ = ["cached_values", "hold_published", "drop_refs"]


def cached_values(list raws not None, object recent, object refresh, object compute):
    """Per raw, in order: ``recent[raw]`` where present (a hit: ``refresh(raw)`` then, an
    OrderedDict's ``move_to_end``: the cache's LRU order; None: no refresh), else ``compute(raw)`` (the
    cache's own miss path, which may insert and evict).  Returns ``(values, hits, error)``:
    ``error`` is None, or the Exception ``compute`` raised, where the loop stopped (the
    caller counts the hits before it and raises it)."""
    cdef Py_ssize_t i, n = len(raws), hits = 0
    cdef PyObject* v
    cdef list out = [None] * n
    cdef object raw
    if not isinstance(recent, dict):
        raise TypeError(f"recent must be a dict (or an OrderedDict), not {type(recent).__name__}")
    for i in range(n):
        raw = raws[i]
        v = PyDict_GetItem(recent, raw)
        if v is NULL:
            try:
                out[i] = compute(raw)
            except Exception as exc:
                return out, hits, exc
            continue
        out[i] = <object>v
        if refresh is not None:
            refresh(raw)
        hits += 1
    return out, hits, None


def drop_refs(list slots not None, object retired):
    """``refs -= 1`` on each of ``slots``; returns those no reference holds any more whose
    ``state`` is ``retired`` (replaced or removed while held: the caller frees them)."""
    cdef list free = []
    cdef object slot
    for slot in slots:
        slot.refs -= 1
        if slot.refs <= 0 and slot.state == retired:
            PyList_Append(free, slot)
    return free


cdef int _raise_set() except -1:
    return -1           # an exception is set (by a lookup's __eq__): returning -1 raises it


def hold_published(list keys not None, type key_type not None, dict entries not None, dict published not None,
                   object now, dict order):
    """For each of ``keys`` (each must be of ``key_type``; TypeError names the first that
    is not): where ``entries[key]`` exists and ``published[entry.key]`` is a slot, take the
    slot (``refs += 1``), set ``entry.last_access = now`` and, where ``order`` (an eviction
    order kept in insertion order: ``LruPolicy.order``) holds ``entry.key``, move it to the
    most recent end (deleted and inserted again, with the hash already taken); None: reads
    refresh nothing.

    Returns ``(held, got)``: ``held`` the slots taken, in key order; ``got`` per key the
    slot taken or None (the caller resolves that key itself).  On an exception nothing
    stays taken."""
    cdef Py_ssize_t i, n = len(keys)
    cdef PyObject* e
    cdef PyObject* s
    cdef Py_hash_t h
    cdef list held = []
    cdef list got = [None] * n
    cdef object key, entry, served, slot
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
            entry = <object>e
            served = entry.key
            if served is not key:       # another identity's block (guard modes tenant/off)
                h = PyObject_Hash(served)
            s = QC_DictGetKnownHash(published, served, h)
            if s is NULL:
                if PyErr_Occurred():
                    _raise_set()
                continue
            slot = <object>s
            slot.refs += 1              # dram.hold: the slot stays in place while held
            PyList_Append(held, slot)
            got[i] = slot
            entry.last_access = now
            if order is not None:       # LruPolicy.touch: a key the order tracks goes to its end
                if QC_DictGetKnownHash(order, served, h) is not NULL:
                    QC_DictDelKnownHash(order, served, h)
                    QC_DictSetKnownHash(order, served, None, h)
                elif PyErr_Occurred():
                    _raise_set()
    except BaseException:
        for slot in held:
            slot.refs -= 1
        raise
    return held, got
