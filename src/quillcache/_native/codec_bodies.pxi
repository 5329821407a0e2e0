# The key field and the bodies of the hot requests, encoded and decoded in this one place
# (included by codec.pyx).  quillcache.protocol.messages builds every body that carries a
# key on these, and the fast paths of the server and the client call them directly:
#
#     key      = u16 key_length + key bytes (quillcache.model.encode_key), 1..max_key_bytes
#     GET body = key
#     PUT body = key + u64 nbytes      (nbytes == the frame's payload_length)
#
# Errors are InvalidArgument naming the request (``what``) and the field, as the decoders
# of messages.py word them; nothing is allocated before a length is checked.

cdef uint64_t _U64_MAX = 0xFFFFFFFFFFFFFFFF


cdef inline bytes _key_bytes(object key, str what):
    if type(key) is bytes:
        return <bytes>key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise InvalidArgument(f"{what}: key must be bytes (quillcache.model.encode_key), not {type(key).__name__}")


cdef inline int _check_key_length(Py_ssize_t n, Py_ssize_t max_key_bytes, str what) except -1:
    if n == 0:
        raise InvalidArgument(f"{what}: empty key")
    if n > max_key_bytes or n > 0xFFFF:
        raise InvalidArgument(f"{what}: key of {n} bytes, at most {min(max_key_bytes, 0xFFFF)}")
    return 0


cdef inline Py_ssize_t _key_at(const unsigned char* p, Py_ssize_t have, Py_ssize_t pos,
                               Py_ssize_t max_key_bytes, str what) except -1:
    """The length of the key field at ``pos`` of a body of ``have`` bytes (checked)."""
    cdef Py_ssize_t n
    if have - pos < 2:
        raise InvalidArgument(f"{what}: body truncated in key length "
                              f"(needs 2 bytes at offset {pos}, has {have - pos})")
    n = _get16(p + pos)
    _check_key_length(n, max_key_bytes, what)
    if have - pos - 2 < n:
        raise InvalidArgument(f"{what}: body truncated in key "
                              f"(needs {n} bytes at offset {pos + 2}, has {have - pos - 2})")
    return n


def encode_key_body(key, Py_ssize_t max_key_bytes, str what="GET"):
    """``u16 length + key`` as one ``bytes``: the GET request body, and the key field of
    every other body.  ``key`` is bytes-like (``encode_key``), 1..max_key_bytes long."""
    cdef bytes raw = _key_bytes(key, what)
    cdef Py_ssize_t n = len(raw)
    cdef bytes out
    cdef unsigned char* p
    _check_key_length(n, max_key_bytes, what)
    out = PyBytes_FromStringAndSize(NULL, n + 2)
    p = <unsigned char*>PyBytes_AS_STRING(out)
    _put16(p, <uint16_t>n)
    memcpy(p + 2, PyBytes_AS_STRING(raw), n)
    return out


def decode_key_field(body, Py_ssize_t pos, Py_ssize_t max_key_bytes, str what="GET"):
    """The key field at offset ``pos`` of ``body``: ``(key bytes, offset after it)``."""
    cdef Py_buffer v
    cdef Py_ssize_t n
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        if pos < 0 or pos > v.len:
            raise InvalidArgument(f"{what}: offset {pos} outside a body of {v.len} bytes")
        n = _key_at(<const unsigned char*>v.buf, v.len, pos, max_key_bytes, what)
        return PyBytes_FromStringAndSize(<const char*>v.buf + pos + 2, n), pos + 2 + n
    finally:
        PyBuffer_Release(&v)


def decode_key_list(body, Py_ssize_t pos, Py_ssize_t max_batch, Py_ssize_t max_key_bytes, str what="request"):
    """The ``keys`` list at offset ``pos`` that ends ``body`` (u32 count, count key fields),
    every count and length checked before it is used: a list of ``bytes``."""
    cdef Py_buffer v
    cdef Py_ssize_t n, i, kl, end
    cdef const unsigned char* b
    cdef list out
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        b = <const unsigned char*>v.buf
        end = v.len
        if pos < 0 or pos > end:
            raise InvalidArgument(f"{what}: offset {pos} outside a body of {end} bytes")
        if end - pos < 4:
            raise InvalidArgument(f"{what}: body truncated in count")
        n = <Py_ssize_t>_get32(b + pos)
        pos += 4
        if n > max_batch:
            raise InvalidArgument(f"{what}: batch of {n} items, at most {max_batch}")
        if n * 3 > end - pos:           # u16 length + at least one byte each
            raise InvalidArgument(f"{what}: count {n} needs at least {n * 3} bytes, "
                                  f"the body has {end - pos} left")
        out = [None] * n
        for i in range(n):
            kl = _key_at(b, end, pos, max_key_bytes, what)
            out[i] = PyBytes_FromStringAndSize(<const char*>b + pos + 2, kl)
            pos += 2 + kl
        if pos != end:
            raise InvalidArgument(f"{what}: {end - pos} trailing bytes in the body")
        return out
    finally:
        PyBuffer_Release(&v)


def decode_key_body(body, Py_ssize_t max_key_bytes, str what="GET"):
    """The key of a body that is one key field and nothing else (a GET request)."""
    cdef Py_buffer v
    cdef Py_ssize_t n
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        n = _key_at(<const unsigned char*>v.buf, v.len, 0, max_key_bytes, what)
        if v.len != n + 2:
            raise InvalidArgument(f"{what}: {v.len - n - 2} trailing bytes in the body")
        return PyBytes_FromStringAndSize(<const char*>v.buf + 2, n)
    finally:
        PyBuffer_Release(&v)


def encode_put_body(key, nbytes, Py_ssize_t max_key_bytes, uint64_t max_payload_bytes, str what="PUT"):
    """``key + u64 nbytes``: the PUT request body (``nbytes`` is the payload that follows)."""
    cdef bytes raw = _key_bytes(key, what)
    cdef Py_ssize_t n = len(raw)
    cdef uint64_t size
    cdef bytes out
    cdef unsigned char* p
    _check_key_length(n, max_key_bytes, what)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= _U64_MAX:
        raise InvalidArgument(f"{what}: size {nbytes!r} must be an integer in 0..2**64-1")
    size = nbytes
    if size > max_payload_bytes:
        raise InvalidArgument(f"{what}: {size} bytes, at most {max_payload_bytes}")
    out = PyBytes_FromStringAndSize(NULL, n + 10)
    p = <unsigned char*>PyBytes_AS_STRING(out)
    _put16(p, <uint16_t>n)
    memcpy(p + 2, PyBytes_AS_STRING(raw), n)
    _put64(p + 2 + n, size)
    return out


def decode_put_body(body, payload_length, Py_ssize_t max_key_bytes, str what="PUT"):
    """``(key, nbytes)`` of a PUT body; with ``payload_length`` not None, nbytes must equal it."""
    cdef Py_buffer v
    cdef Py_ssize_t n
    cdef uint64_t size
    cdef const unsigned char* p
    PyObject_GetBuffer(body, &v, PyBUF_SIMPLE)
    try:
        p = <const unsigned char*>v.buf
        n = _key_at(p, v.len, 0, max_key_bytes, what)
        if v.len - n - 2 < 8:
            raise InvalidArgument(f"{what}: body truncated in nbytes "
                                  f"(needs 8 bytes at offset {n + 2}, has {v.len - n - 2})")
        if v.len != n + 10:
            raise InvalidArgument(f"{what}: {v.len - n - 10} trailing bytes in the body")
        size = _get64(p + 2 + n)
        if payload_length is not None and size != payload_length:
            raise InvalidArgument(f"{what}: the body declares {size} payload bytes, "
                                  f"the frame carries {payload_length}")
        return PyBytes_FromStringAndSize(<const char*>p + 2, n), size
    finally:
        PyBuffer_Release(&v)
