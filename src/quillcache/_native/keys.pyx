# cython: language_level=3
"""Keys off the wire: ``decode_key`` (model.py) in one native pass, for the node's key
cache (node/keys.py), where every new key of a batch request is decoded once.

The layout is model.py's (``encode_key``).  What this adds is the cost: the bytes are
walked in C, the identity scope's strings (tenant, model, tokenizer, adapter: the same for
nearly every key) come from a small table by their encoded bytes instead of being decoded
and interned again, and the key is filled in without running ``__init__``'s checks, which
the layout already guarantees (each string at most 255 bytes of valid UTF-8, each integer
a u32).  The key keeps ``raw`` as its encoding (``encode_key`` of it returns it: a
canonical layout decodes only from its own encoding).

Anything this does not decode (any malformed byte) returns None: the caller decodes it
with ``model.decode_key``, which raises the error naming what is wrong.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.object cimport PyObject_GenericSetAttr
from cpython.unicode cimport PyUnicode_DecodeUTF8
from sys import intern

from quillcache._native.blocks import untrack

__all__ = ["decode_key_fast", "SCOPE_CACHE_MAX"]

SCOPE_CACHE_MAX = 4096          # identity scopes remembered (a node serves few; cleared when full)
cdef dict _scopes = {}          # encoded scope bytes -> (tenant, model, tokenizer, adapter), interned

cdef object _model_id = "model_id", _tokenizer_id = "tokenizer_id", _adapter_id = "adapter_id"
cdef object _tenant_id = "tenant_id", _prefix_hash = "prefix_hash", _block_hash = "block_hash"
cdef object _block_index = "block_index", _token_count = "token_count", _hash_name = "_hash", _ek = "_ek"


cdef inline Py_ssize_t _skip_str(const unsigned char* p, Py_ssize_t pos, Py_ssize_t n) noexcept:
    """The position after the u8-length string at pos, or -1 when it runs past n."""
    if pos >= n:
        return -1
    pos += 1 + p[pos]
    return pos if pos <= n else -1


cdef object _utf8(const unsigned char* p, Py_ssize_t start, Py_ssize_t end):
    return PyUnicode_DecodeUTF8(<const char*>p + start, end - start, NULL)


cdef tuple _scope(bytes raw, const unsigned char* p, Py_ssize_t end):
    """(tenant, model, tokenizer, adapter) of the scope bytes p[1:end], interned."""
    cdef bytes sb = raw[1:end]
    cdef object got = _scopes.get(sb)
    cdef Py_ssize_t pos = 1, e
    if got is not None:
        return <tuple>got
    fields = []
    for _ in range(3):
        e = pos + 1 + p[pos]
        fields.append(intern(_utf8(p, pos + 1, e)))
        pos = e
    if p[pos] == 1:
        fields.append(intern(_utf8(p, pos + 2, end)))
    else:
        fields.append(None)
    if len(_scopes) >= SCOPE_CACHE_MAX:
        _scopes.clear()
    got = _scopes[sb] = tuple(fields)
    return <tuple>got


cdef inline unsigned long _u32(const unsigned char* p) noexcept:
    return (<unsigned long>p[0] << 24) | (<unsigned long>p[1] << 16) | (<unsigned long>p[2] << 8) | p[3]


def decode_key_fast(object raw, type key_type not None):
    """The ``key_type`` (KvBlockKey) that ``raw`` (bytes, model.py's layout) encodes, its
    encoding kept; None when raw is not bytes or not a well-formed key (then decode it
    with ``model.decode_key`` for the error)."""
    if type(raw) is not bytes:
        return None
    cdef bytes b = <bytes>raw
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(b)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b), pos, scope_end, pre_end, blk_start, blk_end
    cdef unsigned long index, tokens
    if n < 1 or p[0] != 1:                          # KEY_FORMAT_VERSION
        return None
    pos = 1
    for _ in range(3):                               # tenant, model, tokenizer
        pos = _skip_str(p, pos, n)
        if pos < 0:
            return None
    if pos >= n:
        return None
    if p[pos] == 0:
        pos += 1
    elif p[pos] == 1:
        pos = _skip_str(p, pos + 1, n)
        if pos < 0:
            return None
    else:
        return None
    scope_end = pos
    pre_end = _skip_str(p, pos, n)                   # prefix_hash
    if pre_end < 0 or pre_end + 4 > n:
        return None
    index = _u32(p + pre_end)
    blk_start = pre_end + 4
    blk_end = _skip_str(p, blk_start, n)             # block_hash
    if blk_end < 0 or blk_end + 4 != n:             # then token_count, and nothing after it
        return None
    tokens = _u32(p + blk_end)
    try:
        tenant, model, tokenizer, adapter = _scope(b, p, scope_end)
        prefix = _utf8(p, scope_end + 1, pre_end)
        block = _utf8(p, blk_start + 1, blk_end)
    except UnicodeDecodeError:
        return None
    idx = index
    tok = tokens
    key = key_type.__new__(key_type)
    PyObject_GenericSetAttr(key, _model_id, model)
    PyObject_GenericSetAttr(key, _tokenizer_id, tokenizer)
    PyObject_GenericSetAttr(key, _adapter_id, adapter)
    PyObject_GenericSetAttr(key, _tenant_id, tenant)
    PyObject_GenericSetAttr(key, _prefix_hash, prefix)
    PyObject_GenericSetAttr(key, _block_hash, block)
    PyObject_GenericSetAttr(key, _block_index, idx)
    PyObject_GenericSetAttr(key, _token_count, tok)
    # the hash KvBlockKey.__post_init__ computes, from the same fields in the same order
    PyObject_GenericSetAttr(key, _hash_name, hash((model, tokenizer, adapter, tenant, prefix, block, idx, tok)))
    PyObject_GenericSetAttr(key, _ek, b)
    return untrack(key)         # strings, ints and bytes only: it can hold no cycle
