# cython: language_level=3, binding=False
"""``BlockMap``: the residency index's block-hash map (index/art.py ``ArtIndex._by_block``):
block hash -> the encoded keys (model.py's ``encode_key`` layout, "eks") in the index with
that block hash, without a block-hash string per entry.

What it replaces: a dict keyed by the block hash as a ``str``.  The native key
(keys.pyx) holds only its encoding, so that str existed only for the dict: 81 B of str
plus ~40 B of dict entry per resident block.  Here a resident block costs one table slot
of 16 B divided by the load: 21 to 43 B while the map grows (28 B at 300,000 blocks, 34 B
at 1 M), up to 128 B after deletes just before it halves.

Values are exactly what the dict held (so ``add``/``forget``/``eks``/``tenants`` keep the
semantics of art.py's former ``add_block`` and friends):

* the usual block hash has one key: the value is that key's ``bytes`` (its tenant is the
  key's first field);
* a block hash with several keys holds ``{tenant_id: (ek, ...)}`` (the tuple in the order
  of the adds); back to the lone ``bytes`` when one key is left.

Table: open addressing with linear probing over a power-of-two array of
``(uint64 hash, PyObject* value)`` slots; ``value == NULL`` is an empty slot.  The map holds
a strong reference to every value.  It grows (doubles) before an insert would take the
load over 3/4 and shrinks (halves) after a delete leaves it under 1/8 (never below
``MIN_CAPACITY``): the load stays between 1/8 and 3/4 (3/8 to 3/4 while it only grows).
Deletion is by backward shift (no tombstones): a probe run never holds a
dead slot, and a miss stops at the first empty slot.

Hash: ``_Py_HashBytes`` over the block hash's UTF-8 bytes: CPython's siphash13 under the
process's random 128-bit key (the key ``hash(str)`` uses; sys.hash_info).  Block hashes
come from clients and peers: with an unkeyed hash a tenant could send block hashes that
all fall in one probe run and make every lookup of every tenant walk it.  A keyed PRF
makes the slot of a block hash unpredictable without the key, and siphash13 is the one
CPython already ships, tested and exported (3.11), at ~20 ns for a 32-byte hash.  (With
PYTHONHASHSEED=0 the key is fixed, as it is for every dict in the process.)  An ek's
block hash is hashed in place inside the ek (``add``, ``forget``): no str is built.

Collisions: the slot's 64-bit hash is compared first; on a match the value is checked to
really be for the queried block hash (the block-hash field of the value's ek, or of the
first ek of its tenant dict, compared byte for byte), and a probe goes on past a slot
whose hash matches but whose block hash does not.  So two block hashes with the same
64-bit hash are two slots of one probe run, both exact.  ``BlockMap(hash_bits=k)`` keeps
only k bits of the hash (tests force collisions with it; 64 otherwise).

Lookups take the block hash as a ``str`` (the callers': the guard's and REMOVE's request
path); a str that cannot be UTF-8 (a lone surrogate) cannot be any ek's block hash and is a
miss.  Nothing here releases the GIL: every call is a few probes (each bounded by the
load) plus the value's Python objects.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport uint64_t
from libc.string cimport memcmp

from quillcache._native.includes.pyhash cimport PyMem_Calloc, PyUnicode_AsUTF8AndSize, _Py_HashBytes

import sys

__all__ = ["BlockMap", "block_hash_of", "MIN_CAPACITY", "MAX_CAPACITY", "SLOT_BYTES", "HASH_ALGORITHM"]

HASH_ALGORITHM = sys.hash_info.algorithm      # what _Py_HashBytes is in this interpreter (siphash13)

cdef enum:
    BM_MIN_CAPACITY = 8           # slots: the smallest table (and the one after clear())
    BM_GROW_NUM = 3               # grow before the load would pass GROW_NUM / GROW_DEN
    BM_GROW_DEN = 4
    BM_SHRINK_DEN = 8             # shrink after a delete leaves the load under 1 / SHRINK_DEN

ctypedef struct bm_slot:
    uint64_t hash                 # the block hash's keyed hash (masked to hash_bits)
    PyObject* value               # bytes or {tenant_id: (ek, ...)}; NULL: empty slot

MIN_CAPACITY = BM_MIN_CAPACITY    # slots
MAX_CAPACITY = 1 << 40            # slots (16 TiB of table): a larger map is refused before allocating
SLOT_BYTES = sizeof(bm_slot)      # bytes per slot

cdef Py_ssize_t _MAX_CAPACITY = MAX_CAPACITY


cdef int _bh_field(const unsigned char* p, Py_ssize_t n, const char** out, Py_ssize_t* outn) noexcept:
    """Point out/outn at the block_hash field of the encoded key p[:n] (model.encode_key
    layout: version, tenant, model, tokenizer, adapter flag [+ adapter], prefix_hash,
    block_index u32, block_hash, ...); -1 when the bytes end before it."""
    cdef Py_ssize_t pos = 1
    cdef int i
    for i in range(3):                          # tenant, model, tokenizer
        if pos >= n:
            return -1
        pos += 1 + p[pos]
    if pos >= n:
        return -1
    if p[pos] == 0:                             # adapter: absent
        pos += 1
    else:
        if pos + 1 >= n:
            return -1
        pos += 2 + p[pos + 1]
    if pos >= n:
        return -1
    pos += 1 + p[pos] + 4                       # prefix_hash, block_index
    if pos >= n or pos + 1 + p[pos] > n:
        return -1
    out[0] = <const char*>p + pos + 1
    outn[0] = p[pos]
    return 0


cdef int _ek_block_hash(object ek, const char** out, Py_ssize_t* outn) except -1:
    """The block_hash field of ek (bytes) in place; ValueError if ek is not an encoded key."""
    if not PyBytes_CheckExact(ek):
        raise TypeError(f"an encoded key must be bytes, not {type(ek).__name__}")
    if _bh_field(<const unsigned char*>PyBytes_AS_STRING(ek), PyBytes_GET_SIZE(ek), out, outn) < 0:
        raise ValueError(f"not an encoded key (ends before its block hash): {ek[:64]!r}")
    return 0


def block_hash_of(bytes ek not None) -> bytes:
    """The block_hash field of an encoded key (model.encode_key layout), every length
    checked on the way: ValueError for bytes that end before it.  The index's one reader of
    the field outside the native key (index/art.py re-exports it)."""
    cdef const char* b
    cdef Py_ssize_t bn
    _ek_block_hash(ek, &b, &bn)
    return b[:bn]


cdef object _tenant_of(bytes ek):
    """The tenant_id field of an encoded key (the first field after the version byte)."""
    return ek[2:2 + ek[1]].decode("utf-8")


cdef bint _tenant_is(bytes ek, const char* t, Py_ssize_t tn) noexcept:
    """Whether ek's tenant field is exactly the UTF-8 bytes t[:tn]."""
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(ek)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(ek)
    return n >= 2 and p[1] == tn and 2 + tn <= n and memcmp(p + 2, t, tn) == 0


cdef PyObject* _first_ek(PyObject* value) noexcept:
    """The ek a slot's value is checked by: itself, or the first ek of its first tenant."""
    cdef Py_ssize_t pos = 0
    cdef PyObject* k
    cdef PyObject* v
    if PyBytes_CheckExact(<object>value):
        return value
    if PyDict_Next(<object>value, &pos, &k, &v):
        return PyTuple_GET_ITEM(<object>v, 0)
    return NULL                                 # never stored: an empty dict leaves the map


cdef bint _is_for(PyObject* value, const char* q, Py_ssize_t qn) noexcept:
    """Whether the slot's value holds keys of the block hash q[:qn] (a 64-bit hash match is
    not proof: two block hashes can share one)."""
    cdef PyObject* ek = _first_ek(value)
    cdef const char* b
    cdef Py_ssize_t bn
    if ek == NULL or _bh_field(<const unsigned char*>PyBytes_AS_STRING(<object>ek),
                               PyBytes_GET_SIZE(<object>ek), &b, &bn) < 0:
        return False
    return bn == qn and memcmp(b, q, qn) == 0


cdef class BlockMap:
    """block hash -> ek or {tenant_id: (ek, ...)} (module docstring).  ``hash_bits``: keep
    only this many bits of each hash (1..64; below 64 only to force collisions in tests)."""

    cdef bm_slot* _slots
    cdef Py_ssize_t _capacity             # slots, a power of two
    cdef Py_ssize_t _count                # occupied slots (distinct block hashes)
    cdef uint64_t _hash_mask

    def __cinit__(self, int hash_bits=64):
        if not 1 <= hash_bits <= 64:
            raise ValueError(f"hash_bits {hash_bits!r}: must be 1..64")
        self._hash_mask = <uint64_t>-1 if hash_bits == 64 else ((<uint64_t>1 << hash_bits) - 1)
        self._slots = NULL
        self._count = 0
        self._alloc(BM_MIN_CAPACITY)

    def __dealloc__(self):
        self._release_all()
        PyMem_Free(self._slots)
        self._slots = NULL

    # ------------------------------------------------------------------ the table

    cdef int _alloc(self, Py_ssize_t capacity) except -1:
        """A fresh empty table of ``capacity`` slots (the old one is the caller's)."""
        if capacity > _MAX_CAPACITY:
            raise MemoryError(f"block map: {capacity} slots is over MAX_CAPACITY ({_MAX_CAPACITY})")
        cdef bm_slot* slots = <bm_slot*>PyMem_Calloc(capacity, sizeof(bm_slot))
        if slots == NULL:
            raise MemoryError(f"block map: cannot allocate {capacity} slots")
        self._slots = slots
        self._capacity = capacity
        return 0

    cdef int _resize(self, Py_ssize_t capacity) except -1:
        """Move every entry into a table of ``capacity`` slots (by its stored hash: the
        entries are distinct, nothing is compared)."""
        cdef bm_slot* old = self._slots
        cdef Py_ssize_t old_cap = self._capacity, i, j
        cdef uint64_t mask = <uint64_t>capacity - 1
        self._alloc(capacity)                   # on failure the old table stays as it was
        for i in range(old_cap):
            if old[i].value != NULL:
                j = old[i].hash & mask
                while self._slots[j].value != NULL:
                    j = (j + 1) & mask
                self._slots[j] = old[i]
        PyMem_Free(old)
        return 0

    cdef void _release_all(self) noexcept:
        cdef Py_ssize_t i
        cdef PyObject* v
        if self._slots == NULL:
            return
        for i in range(self._capacity):
            v = self._slots[i].value
            if v != NULL:
                self._slots[i].value = NULL
                Py_DECREF(<object>v)
        self._count = 0

    cdef inline uint64_t _hash(self, const char* p, Py_ssize_t n) noexcept:
        return (<uint64_t>_Py_HashBytes(p, n)) & self._hash_mask

    cdef Py_ssize_t _find(self, uint64_t h, const char* q, Py_ssize_t qn, Py_ssize_t* empty) noexcept:
        """The slot holding block hash q[:qn] (hash h), or -1 with ``empty`` set to the
        empty slot that ends its probe run (where it would go)."""
        cdef uint64_t mask = <uint64_t>self._capacity - 1
        cdef Py_ssize_t i = h & mask
        cdef bm_slot* s
        while True:
            s = &self._slots[i]
            if s.value == NULL:
                empty[0] = i
                return -1
            if s.hash == h and _is_for(s.value, q, qn):
                return i
            i = (i + 1) & mask

    cdef void _delete_at(self, Py_ssize_t i) noexcept:
        """Empty slot i (its reference already taken by the caller) by backward shift:
        each later entry of the run moves back unless that would put it before its home."""
        cdef uint64_t mask = <uint64_t>self._capacity - 1
        cdef Py_ssize_t j = i, home
        while True:
            j = (j + 1) & mask
            if self._slots[j].value == NULL:
                break
            home = self._slots[j].hash & mask
            # the entry at j may fill the hole at i only if its home is not in (i, j]
            if (home > i and home <= j) if i <= j else (home > i or home <= j):
                continue
            self._slots[i] = self._slots[j]
            i = j
        self._slots[i].value = NULL
        self._slots[i].hash = 0
        self._count -= 1

    cdef int _after_delete(self) except -1:
        if self._capacity > BM_MIN_CAPACITY and self._count * BM_SHRINK_DEN < self._capacity:
            self._resize(self._capacity // 2)
        return 0

    cdef Py_ssize_t _lookup_str(self, object block_hash) except -2:
        """The slot of block_hash (a str), or -1."""
        cdef Py_ssize_t qn, empty
        cdef const char* q
        if not isinstance(block_hash, str):
            raise TypeError(f"a block hash must be str, not {type(block_hash).__name__}")
        try:
            q = PyUnicode_AsUTF8AndSize(block_hash, &qn)
        except UnicodeEncodeError:
            return -1                           # not UTF-8: no encoded key holds it
        return self._find(self._hash(q, qn), q, qn, &empty)

    # ------------------------------------------------------------------ changes

    def add(self, bytes ek not None, tenant_id=None):
        """ek (an encoded key) is in the index: note it under its block hash (read and
        hashed inside ek).  ``tenant_id``: ek's tenant when the caller has it as a str
        (else it is decoded from ek, only if the block hash already has another key)."""
        cdef const char* b
        cdef Py_ssize_t bn, empty
        cdef uint64_t h
        _ek_block_hash(ek, &b, &bn)
        h = self._hash(b, bn)
        cdef Py_ssize_t i = self._find(h, b, bn, &empty)
        if i < 0:
            if (self._count + 1) * BM_GROW_DEN > self._capacity * BM_GROW_NUM:
                self._resize(self._capacity * 2)
                i = self._find(h, b, bn, &empty)
            Py_INCREF(ek)
            self._slots[empty].hash = h
            self._slots[empty].value = <PyObject*>ek
            self._count += 1
            return
        held = <object>self._slots[i].value
        if type(held) is bytes:
            if held == ek:
                return
            tenants = {_tenant_of(held): (held,)}
            Py_INCREF(tenants)
            self._slots[i].value = <PyObject*>tenants      # the slot's reference to held moves to the dict
            Py_DECREF(held)
        else:
            tenants = held
        if tenant_id is None:
            tenant_id = _tenant_of(ek)
        keys = tenants.get(tenant_id)
        if keys is None:
            tenants[tenant_id] = (ek,)
        elif ek not in keys:
            tenants[tenant_id] = keys + (ek,)

    def forget(self, bytes ek not None, tenant_id=None):
        """ek is no longer in the index (``add`` undone; a key not noted is ignored)."""
        cdef const char* b
        cdef Py_ssize_t bn, empty
        _ek_block_hash(ek, &b, &bn)
        cdef Py_ssize_t i = self._find(self._hash(b, bn), b, bn, &empty)
        if i < 0:
            return
        held = <object>self._slots[i].value
        if type(held) is bytes:
            if held == ek:
                self._delete_at(i)
                Py_DECREF(held)                 # the slot's reference (``held`` keeps its own)
                self._after_delete()
            return
        if tenant_id is None:
            tenant_id = _tenant_of(ek)
        keys = held.get(tenant_id)
        if keys is not None and ek in keys:
            keys = tuple([k for k in keys if k != ek])
            if keys:
                held[tenant_id] = keys
            else:
                del held[tenant_id]
        if not held:
            self._delete_at(i)
            Py_DECREF(held)
            self._after_delete()
        elif len(held) == 1:
            (only,) = held.values()
            if len(only) == 1:                  # back to the one-key form
                lone = only[0]
                Py_INCREF(lone)
                self._slots[i].value = <PyObject*>lone
                Py_DECREF(held)

    def clear(self):
        """Drop every entry; the table goes back to MIN_CAPACITY slots."""
        cdef bm_slot* old = self._slots
        cdef Py_ssize_t old_cap = self._capacity, i
        cdef PyObject* v
        self._alloc(BM_MIN_CAPACITY)
        self._count = 0
        for i in range(old_cap):                # released after the map is consistent
            v = old[i].value
            if v != NULL:
                Py_DECREF(<object>v)
        PyMem_Free(old)

    # ------------------------------------------------------------------ queries (block hash as str)

    def eks(self, block_hash, tenant_id) -> tuple:
        """The encoded keys of one tenant with this block hash; the keys of another tenant
        are never iterated (a lone key's tenant field is compared in place)."""
        cdef Py_ssize_t i = self._lookup_str(block_hash), tn
        cdef const char* t
        if i < 0:
            return ()
        held = <object>self._slots[i].value
        if type(held) is bytes:
            if not isinstance(tenant_id, str):
                raise TypeError(f"a tenant id must be str, not {type(tenant_id).__name__}")
            try:
                t = PyUnicode_AsUTF8AndSize(tenant_id, &tn)
            except UnicodeEncodeError:
                return ()
            return (held,) if _tenant_is(held, t, tn) else ()
        return held.get(tenant_id, ())

    def tenants(self, block_hash) -> list:
        """The tenants holding a key with this block hash."""
        cdef Py_ssize_t i = self._lookup_str(block_hash)
        if i < 0:
            return []
        held = <object>self._slots[i].value
        return [_tenant_of(held)] if type(held) is bytes else list(held)

    def get(self, block_hash, default=None):
        """The entry of block_hash as stored (ek bytes, or the tenant dict: read it, do not
        change it), or ``default``."""
        cdef Py_ssize_t i = self._lookup_str(block_hash)
        return default if i < 0 else <object>self._slots[i].value

    def __contains__(self, block_hash):
        return isinstance(block_hash, str) and self._lookup_str(block_hash) >= 0

    def __len__(self):
        """How many distinct block hashes have keys."""
        return self._count

    def block_hashes(self) -> list:
        """Every block hash with keys (str, decoded from the values; table order)."""
        cdef Py_ssize_t i, bn
        cdef const char* b
        cdef PyObject* ek
        out = []
        for i in range(self._capacity):
            if self._slots[i].value != NULL:
                ek = _first_ek(self._slots[i].value)
                _bh_field(<const unsigned char*>PyBytes_AS_STRING(<object>ek),
                          PyBytes_GET_SIZE(<object>ek), &b, &bn)
                out.append(b[:bn].decode("utf-8"))
        return out

    @property
    def capacity(self) -> int:
        """Slots in the table (a power of two)."""
        return self._capacity

    def memory_bytes(self) -> int:
        """Bytes of the table itself (the values' objects are the index's keys, counted there)."""
        return self._capacity * sizeof(bm_slot)

    def max_probe(self) -> int:
        """The longest distance of an entry from its home slot (tests, QC_DEBUG checks)."""
        cdef Py_ssize_t i, d, worst = 0
        cdef uint64_t mask = <uint64_t>self._capacity - 1
        for i in range(self._capacity):
            if self._slots[i].value != NULL:
                d = (i - <Py_ssize_t>(self._slots[i].hash & mask)) & mask
                if d > worst:
                    worst = d
        return worst
