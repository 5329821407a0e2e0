# The batch bodies of the located path (docs/protocol.md, opcodes 0x30-0x35) and of the
# key lists they share with GET_MANY / PUT_MANY, in one place (included by codec.pyx).
# quillcache.protocol.messages and quillcache.protocol.located build and read these bodies
# on these calls; the node and the client reach them only through those modules.
#
#     key list        = u32 count, count * key field                 (GET_MANY, GET_LOCATED, ...)
#     sized key list  = u32 count, count * (u64 nbytes, key field)   (PUT_MANY, RESERVE)
#     located item    = u16 status, u64 offset, u64 length (packed, 18 bytes)
#
# One pass per batch, no Python object per item beyond what the caller gets back.

from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_GetSlice

cdef enum:
    LOCATED_ITEM_BYTES = 18     # u16 status + u64 offset + u64 length


cdef int _check_count(Py_ssize_t n, Py_ssize_t max_batch, str what) except -1:
    if n > max_batch:
        raise InvalidArgument(f"{what}: batch of {n} items, at most {max_batch}")
    return 0


def encode_key_list(keys, Py_ssize_t max_batch, Py_ssize_t max_key_bytes, str what="request"):
    """``u32 count, count * key field`` as one ``bytes``: the body of GET_MANY, GET_LOCATED,
    EXISTS, REMOVE (and the key list of others).  ``keys``: bytes-like (``encode_key``)."""
    cdef list raws = [_key_bytes(k, what) for k in keys]
    cdef Py_ssize_t n = len(raws), i, kl, total = 4
    cdef bytes raw, out
    cdef unsigned char* p
    _check_count(n, max_batch, what)
    for i in range(n):
        kl = len(<bytes>raws[i])
        _check_key_length(kl, max_key_bytes, what)
        total += 2 + kl
    out = PyBytes_FromStringAndSize(NULL, total)
    p = <unsigned char*>PyBytes_AS_STRING(out)
    _put32(p, <uint32_t>n)
    p += 4
    for i in range(n):
        raw = <bytes>raws[i]
        kl = len(raw)
        _put16(p, <uint16_t>kl)
        memcpy(p + 2, PyBytes_AS_STRING(raw), kl)
        p += 2 + kl
    return out


def encode_sized_key_list(items, Py_ssize_t max_batch, Py_ssize_t max_key_bytes,
                          uint64_t max_payload_bytes, str what="PUT_MANY"):
    """``u32 count, count * (u64 nbytes, key field)`` as one ``bytes`` (PUT_MANY, RESERVE);
    ``items``: (key bytes, nbytes); the sizes summed must not pass ``max_payload_bytes``."""
    cdef list raws = []
    cdef list sizes = []
    cdef Py_ssize_t n, i, kl, total = 4
    cdef uint64_t size, payload = 0
    cdef bytes raw, out
    cdef unsigned char* p
    for key, nbytes in items:
        raws.append(_key_bytes(key, what))
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= _U64_MAX:
            raise InvalidArgument(f"{what}: size {nbytes!r} must be an integer in 0..2**64-1")
        sizes.append(nbytes)
    n = len(raws)
    _check_count(n, max_batch, what)
    for i in range(n):
        kl = len(<bytes>raws[i])
        _check_key_length(kl, max_key_bytes, what)
        total += 10 + kl
        size = sizes[i]
        if size > max_payload_bytes or payload + size > max_payload_bytes:
            raise InvalidArgument(f"{what}: {payload + size} bytes in all, at most {max_payload_bytes}")
        payload += size
    out = PyBytes_FromStringAndSize(NULL, total)
    p = <unsigned char*>PyBytes_AS_STRING(out)
    _put32(p, <uint32_t>n)
    p += 4
    for i in range(n):
        raw = <bytes>raws[i]
        kl = len(raw)
        _put64(p, <uint64_t>sizes[i])
        _put16(p + 8, <uint16_t>kl)
        memcpy(p + 10, PyBytes_AS_STRING(raw), kl)
        p += 10 + kl
    return out


def decode_sized_key_list(body, Py_ssize_t max_batch, Py_ssize_t max_key_bytes, str what="PUT_MANY"):
    """The sized key list that is all of ``body``: ``(keys, sizes, total bytes)``, two lists
    in order; every count and length checked before it is used."""
    cdef Py_buffer v
    cdef Py_ssize_t n, i, kl, pos = 0, end
    cdef const unsigned char* b
    cdef list keys, sizes
    cdef uint64_t size
    cdef object total = 0
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        b = <const unsigned char*>v.buf
        end = v.len
        if end < 4:
            raise InvalidArgument(f"{what}: body truncated in count")
        n = <Py_ssize_t>_get32(b)
        pos = 4
        _check_count(n, max_batch, what)
        if n * 11 > end - pos:          # u64 nbytes + u16 length + at least one byte each
            raise InvalidArgument(f"{what}: count {n} needs at least {n * 11} bytes, "
                                  f"the body has {end - pos} left")
        keys = [None] * n
        sizes = [None] * n
        for i in range(n):
            if end - pos < 8:
                raise InvalidArgument(f"{what}: body truncated in nbytes "
                                      f"(needs 8 bytes at offset {pos}, has {end - pos})")
            size = _get64(b + pos)
            kl = _key_at(b, end, pos + 8, max_key_bytes, what)
            keys[i] = PyBytes_FromStringAndSize(<const char*>b + pos + 10, kl)
            sizes[i] = size
            total += size
            pos += 10 + kl
        if pos != end:
            raise InvalidArgument(f"{what}: {end - pos} trailing bytes in the body")
        return keys, sizes, total
    finally:
        PyBuffer_Release(&v)


def encode_located_items(items):
    """The GET_LOCATED reply's items, packed: per item either a ``(status, offset, length)``
    tuple, or an object holding a hit (status 0) with ``offset`` and ``size`` attributes
    (a store ``Slot`` or ``Lease``), so that a batch of hits needs no tuple per item."""
    cdef list seq = items if type(items) is list else list(items)
    cdef Py_ssize_t n = len(seq), i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * LOCATED_ITEM_BYTES)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    cdef object item, status, offset, length
    for i in range(n):
        item = seq[i]
        if type(item) is tuple:
            status, offset, length = <tuple>item
        else:
            status, offset, length = 0, item.offset, item.size
        if not 0 <= status <= 0xFFFF:
            raise InvalidArgument(f"GET_LOCATED reply: status {status!r} is not a u16")
        if not 0 <= offset <= _U64_MAX or not 0 <= length <= _U64_MAX:
            raise InvalidArgument(f"GET_LOCATED reply: extent {offset!r}+{length!r} is not two u64")
        _put16(p, <uint16_t>status)
        _put64(p + 2, <uint64_t>offset)
        _put64(p + 10, <uint64_t>length)
        p += LOCATED_ITEM_BYTES
    return out


cdef inline const unsigned char* _items_of(Py_buffer* v, Py_ssize_t n) except NULL:
    if v.len != n * LOCATED_ITEM_BYTES:
        raise InvalidArgument(f"GET_LOCATED items: {v.len} bytes for {n} items")
    return <const unsigned char*>v.buf


def first_bad_located_item(items, Py_ssize_t n, uint64_t arena_bytes, uint16_t miss_a, uint16_t miss_b):
    """-1 when each of the ``n`` packed items (a buffer) is a hit inside an arena of
    ``arena_bytes`` or a miss (status ``miss_a`` or ``miss_b``); else the first item that
    is neither (the caller names the error)."""
    cdef Py_buffer v
    cdef const unsigned char* p
    cdef Py_ssize_t i
    cdef uint16_t status
    cdef uint64_t off, length
    PyObject_GetBuffer(items, &v, PyBUF_SIMPLE)
    try:
        p = _items_of(&v, n)
        for i in range(n):
            status = _get16(p)
            if status == 0:
                off = _get64(p + 2)
                length = _get64(p + 10)
                if off > arena_bytes or length > arena_bytes - off:    # no u64 wrap
                    return i
            elif status != miss_a and status != miss_b:
                return i
            p += LOCATED_ITEM_BYTES
        return -1
    finally:
        PyBuffer_Release(&v)


def located_views(arena, items, Py_ssize_t n):
    """Per packed item (checked by ``first_bad_located_item`` first): ``arena[offset:offset
    + length]`` for a hit, None for a miss.  ``arena`` is the read-only view of the whole
    mapping; one slice of it per hit and nothing else per item."""
    cdef Py_buffer v
    cdef const unsigned char* p
    cdef Py_ssize_t i, off, length
    cdef list out = PyList_New(n)
    cdef object view
    PyObject_GetBuffer(items, &v, PyBUF_SIMPLE)
    try:
        p = _items_of(&v, n)
        for i in range(n):
            if _get16(p) == 0:
                off = <Py_ssize_t>_get64(p + 2)
                length = <Py_ssize_t>_get64(p + 10)
                view = PySequence_GetSlice(arena, off, off + length)
            else:
                view = None
            Py_INCREF(view)
            PyList_SET_ITEM(out, i, view)
            p += LOCATED_ITEM_BYTES
        return out
    finally:
        PyBuffer_Release(&v)


def release_views(views):
    """``release()`` each memoryview of ``views`` (None skipped); one a caller still exports
    a buffer of (a derived view) stays: its own hazard (docs/shm.md)."""
    for view in views:
        if view is not None:
            try:
                (<memoryview>view).release()
            except BufferError:
                pass


def first_slot_outside(offsets, sizes, uint64_t arena_bytes):
    """-1 when each reserved slot (``offsets[i]``, ``sizes[i]``: the RESERVE reply's
    offsets, the sizes asked for) lies inside an arena of ``arena_bytes``; else the first
    that does not (the caller names the error)."""
    cdef list offs = offsets if type(offsets) is list else list(offsets)
    cdef list lens = sizes if type(sizes) is list else list(sizes)
    cdef Py_ssize_t i, n = len(offs)
    cdef uint64_t off, length
    if len(lens) != n:
        raise InvalidArgument(f"RESERVE: {n} slots for {len(lens)} sizes")
    for i in range(n):
        off = offs[i]
        length = lens[i]
        if off > arena_bytes or length > arena_bytes - off:      # no u64 wrap
            return i
    return -1


def slot_views(arena, offsets, sizes):
    """``arena[offset:offset + size]`` per reserved slot (checked by ``first_slot_outside``
    first): one slice of the writable view of the mapping per slot, in one pass."""
    cdef list offs = offsets if type(offsets) is list else list(offsets)
    cdef list lens = sizes if type(sizes) is list else list(sizes)
    cdef Py_ssize_t i, n = len(offs), off
    cdef list out = PyList_New(n)
    cdef object view
    if len(lens) != n:
        raise InvalidArgument(f"RESERVE: {n} slots for {len(lens)} sizes")
    for i in range(n):
        off = offs[i]
        view = PySequence_GetSlice(arena, off, off + <Py_ssize_t>lens[i])
        Py_INCREF(view)
        PyList_SET_ITEM(out, i, view)
    return out


cdef enum:
    STATUS_SIZE_BYTES = 10      # GET_MANY reply item: u16 status + u64 nbytes


def encode_status_sizes(items, Py_ssize_t max_batch):
    """The GET_MANY reply body ``u32 count, count * (u16 status, u64 nbytes)`` of a list of
    ``(status, nbytes)`` tuples, in one pass; None when an item is not that (or a miss
    carries bytes, or the batch is over ``max_batch``): the caller's checks name it."""
    cdef list seq = items if type(items) is list else list(items)
    cdef Py_ssize_t n = len(seq), i
    cdef object item, status, nbytes
    cdef bytes out
    cdef unsigned char* p
    if n > max_batch:
        return None
    out = PyBytes_FromStringAndSize(NULL, 4 + n * STATUS_SIZE_BYTES)
    p = <unsigned char*>PyBytes_AS_STRING(out)
    _put32(p, <uint32_t>n)
    p += 4
    for i in range(n):
        item = seq[i]
        if type(item) is not tuple or len(<tuple>item) != 2:
            return None
        status, nbytes = <tuple>item
        if type(status) is not int or type(nbytes) is not int or not 0 <= status <= 0xFFFF \
                or not 0 <= nbytes <= _U64_MAX or (status and nbytes):
            return None
        _put16(p, <uint16_t>status)
        _put64(p + 2, <uint64_t>nbytes)
        p += STATUS_SIZE_BYTES
    return out


def decode_status_sizes(body, Py_ssize_t max_batch):
    """``(items, total bytes)`` of a GET_MANY reply body, in one pass: ``items`` a list of
    ``(status, nbytes)``; None when the body is anything but well formed (the caller's
    reader names what is wrong)."""
    cdef Py_buffer v
    cdef const unsigned char* p
    cdef Py_ssize_t n, i
    cdef uint16_t status
    cdef uint64_t nbytes, total = 0
    cdef list out
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        if v.len < 4:
            return None
        p = <const unsigned char*>v.buf
        n = _get32(p)
        if n > max_batch or v.len != 4 + n * STATUS_SIZE_BYTES:
            return None
        p += 4
        out = PyList_New(n)
        for i in range(n):
            status = _get16(p)
            nbytes = _get64(p + 2)
            if (status and nbytes) or total + nbytes < total:     # a miss with bytes; a sum past u64
                return None
            total += nbytes
            item = (status, nbytes)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
            p += STATUS_SIZE_BYTES
        return out, total
    finally:
        PyBuffer_Release(&v)
