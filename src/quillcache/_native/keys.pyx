# cython: language_level=3
"""``KvBlockKey`` (model.py exports it): a key that is its encoding.

A node holds one key per resident block, so a key's memory is per-block memory.  The key
keeps two references and nothing else: ``_ek``, its encoding (model.py's layout, see
``encode_key``; the node's entry, its key cache and the index share this one bytes object),
and ``_scope``, its identity scope (an ``IdentityScope`` of interned strings, shared by every
key of that scope through a small table).  ``prefix_hash``, ``block_hash``, ``block_index``
and ``token_count`` are read from the encoding when asked for (a new str per read); the
hash is the encoding's (cached inside the bytes object), consistent with equality by
encoding (the layout is canonical: one key, one byte string).  About 32 bytes of key
object per block beside its encoding, where the dataclass it replaces held ~330.

``decode_key_fast``: keys off the wire (the node's key cache, node/keys.py) in one native
pass: the bytes are walked in C, the scope comes from the table by its encoded bytes, and
the key keeps ``raw`` itself as its encoding.  Anything it does not decode (any malformed
byte) returns None: the caller decodes it with ``model.decode_key``, which raises the error
naming what is wrong.

_native imports nothing of the domain packages: model.py hands over ``IdentityScope`` and
``KeyError_`` (``bind``) when it is imported, before any key can be made.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy
from sys import intern

__all__ = ["KvBlockKey", "decode_key_fast", "bind", "SCOPE_CACHE_MAX", "MAX_ID_BYTES",
           "MAX_BLOCK_INDEX", "MAX_TOKEN_COUNT", "KEY_FORMAT_VERSION", "DEFAULT_TOKENS_PER_BLOCK"]

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL

MAX_ID_BYTES = 255              # bytes of UTF-8 per identity/hash field of a key
MAX_BLOCK_INDEX = (1 << 32) - 1
MAX_TOKEN_COUNT = (1 << 32) - 1
KEY_FORMAT_VERSION = 1          # first byte of every encoded key
DEFAULT_TOKENS_PER_BLOCK = 64
SCOPE_CACHE_MAX = 4096          # identity scopes remembered (a node serves few; cleared when full)

cdef dict _scopes = {}          # encoded scope bytes -> IdentityScope of interned strings
cdef dict _by_ident = {}        # (tenant, model, tokenizer, adapter) -> (scope bytes, IdentityScope)
cdef object _Scope = None       # model.IdentityScope, handed over by bind()
cdef object _KeyError = ValueError   # model.KeyError_, handed over by bind()


def bind(scope_type, key_error):
    """model.py's ``IdentityScope`` (the type of ``KvBlockKey.scope``) and ``KeyError_``
    (what a bad field raises): _native cannot import model, model imports this."""
    global _Scope, _KeyError
    _Scope = scope_type
    _KeyError = key_error
    _scopes.clear()
    _by_ident.clear()


cdef inline Py_ssize_t _skip_str(const unsigned char* p, Py_ssize_t pos, Py_ssize_t n) noexcept:
    """The position after the u8-length string at pos, or -1 when it runs past n."""
    if pos >= n:
        return -1
    pos += 1 + p[pos]
    return pos if pos <= n else -1


cdef inline Py_ssize_t _scope_end(const unsigned char* p) noexcept:
    """The end of the scope of a well-formed encoding (a key's own)."""
    cdef Py_ssize_t pos = 1
    pos += 1 + p[pos]
    pos += 1 + p[pos]
    pos += 1 + p[pos]
    if p[pos] == 1:
        return pos + 2 + p[pos + 1]
    return pos + 1


cdef object _utf8(const unsigned char* p, Py_ssize_t start, Py_ssize_t end):
    return PyUnicode_DecodeUTF8(<const char*>p + start, end - start, NULL)


cdef inline bint _ascii(const unsigned char* p, Py_ssize_t start, Py_ssize_t end) noexcept:
    cdef Py_ssize_t i
    for i in range(start, end):
        if p[i] >= 0x80:
            return False
    return True


cdef inline unsigned long _u32(const unsigned char* p) noexcept:
    return (<unsigned long>p[0] << 24) | (<unsigned long>p[1] << 16) | (<unsigned long>p[2] << 8) | p[3]


cdef inline void _put_u32(unsigned char* p, unsigned long v) noexcept:
    p[0] = (v >> 24) & 0xff
    p[1] = (v >> 16) & 0xff
    p[2] = (v >> 8) & 0xff
    p[3] = v & 0xff


cdef object _scope_of(bytes raw, const unsigned char* p, Py_ssize_t end):
    """The IdentityScope of the scope bytes p[:end] (well-formed), from the table."""
    cdef bytes sb = raw[:end]
    cdef object got = _scopes.get(sb)
    cdef Py_ssize_t pos = 1, e
    if got is not None:
        return got
    fields = []
    for _ in range(3):
        e = pos + 1 + p[pos]
        fields.append(intern(_utf8(p, pos + 1, e)))
        pos = e
    adapter = intern(_utf8(p, pos + 2, end)) if p[pos] == 1 else None
    tenant, model, tokenizer = fields
    got = _remember(sb, tenant, model, tokenizer, adapter)[1]
    return got


cdef tuple _remember(bytes sb, str tenant, str model, str tokenizer, object adapter):
    if _Scope is None:
        raise RuntimeError("quillcache._native.keys: import quillcache.model first (it binds IdentityScope)")
    if len(_scopes) >= SCOPE_CACHE_MAX or len(_by_ident) >= SCOPE_CACHE_MAX:
        _scopes.clear()
        _by_ident.clear()
    scope = _scopes.get(sb)
    if scope is None:
        scope = _scopes[sb] = _Scope(model, tokenizer, adapter, tenant)
    got = _by_ident[(tenant, model, tokenizer, adapter)] = (sb, scope)
    return got


cdef str _check_id(str name, object value, Py_ssize_t* size):
    """value's UTF-8 bytes' length into size; the error message when it is not a key field."""
    if not isinstance(value, str):
        return f"{name} {value!r}: must be a string"
    try:
        PyUnicode_AsUTF8AndSize(value, size)
    except UnicodeEncodeError:
        return f"{name} {value!r}: not encodable as UTF-8"
    if size[0] > MAX_ID_BYTES:
        return f"{name} is {size[0]} bytes: at most {MAX_ID_BYTES} bytes of UTF-8"
    return None


def check_id(name, value):
    """Raise KeyError_ unless ``value`` is a key field: a str of at most 255 bytes of UTF-8."""
    cdef Py_ssize_t size = 0
    error = _check_id(name, value, &size)
    if error is not None:
        raise _KeyError(error)


cdef tuple _scope_for(str model, str tokenizer, object adapter, str tenant):
    """(scope bytes, IdentityScope) of the (checked) scope fields, from the table or made."""
    cdef Py_ssize_t lt, lm, lk, la = 0, n
    got = _by_ident.get((tenant, model, tokenizer, adapter))
    if got is not None:
        return <tuple>got
    cdef const char* t = PyUnicode_AsUTF8AndSize(tenant, &lt)
    cdef const char* m = PyUnicode_AsUTF8AndSize(model, &lm)
    cdef const char* k = PyUnicode_AsUTF8AndSize(tokenizer, &lk)
    cdef const char* a = NULL
    if adapter is not None:
        a = PyUnicode_AsUTF8AndSize(adapter, &la)
    n = 1 + 1 + lt + 1 + lm + 1 + lk + 1 + (1 + la if adapter is not None else 0)
    cdef bytes sb = PyBytes_FromStringAndSize(NULL, n)
    cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(sb)
    o[0] = 1                                        # KEY_FORMAT_VERSION
    o[1] = <unsigned char>lt
    memcpy(o + 2, t, lt)
    n = 2 + lt
    o[n] = <unsigned char>lm
    memcpy(o + n + 1, m, lm)
    n += 1 + lm
    o[n] = <unsigned char>lk
    memcpy(o + n + 1, k, lk)
    n += 1 + lk
    if adapter is None:
        o[n] = 0
    else:
        o[n] = 1
        o[n + 1] = <unsigned char>la
        memcpy(o + n + 2, a, la)
    return _remember(sb, intern(tenant), intern(model), intern(tokenizer),
                     None if adapter is None else intern(adapter))


cdef inline const unsigned char* _enc(KvBlockKey key) except NULL:
    """The key's encoding; a key made by ``KvBlockKey.__new__`` alone has none."""
    if key._ek is None:
        raise AttributeError("this KvBlockKey was made without its fields (KvBlockKey.__new__)")
    return <const unsigned char*>PyBytes_AS_STRING(key._ek)


@cython.no_gc            # a bytes object and an IdentityScope of strings: it can hold no cycle
@cython.freelist(64)
@cython.final
cdef class KvBlockKey:
    """One KV block: its identity scope, its place in a prefix chain and its size in tokens."""

    cdef readonly bytes _ek         # the encoding (encode_key); its hash is the key's
    cdef readonly object _scope     # the IdentityScope, shared by the keys of that scope

    def __init__(self, model_id, tokenizer_id, adapter_id, tenant_id, prefix_hash, block_hash,
                 block_index=0, token_count=DEFAULT_TOKENS_PER_BLOCK):
        cdef Py_ssize_t lm = 0, lk = 0, lt = 0, lp = 0, lb = 0, la = 0, ls, n
        cdef unsigned long index, tokens
        error = (_check_id("model_id", model_id, &lm) or _check_id("tokenizer_id", tokenizer_id, &lk)
                 or _check_id("tenant_id", tenant_id, &lt) or _check_id("prefix_hash", prefix_hash, &lp)
                 or _check_id("block_hash", block_hash, &lb)
                 or (adapter_id is not None and _check_id("adapter_id", adapter_id, &la)))
        if error:
            raise _KeyError(error)
        if not isinstance(block_index, int) or not 0 <= block_index <= MAX_BLOCK_INDEX:
            raise _KeyError(f"block_index {block_index!r}: must be an integer in 0..{MAX_BLOCK_INDEX}")
        if not isinstance(token_count, int) or not 0 <= token_count <= MAX_TOKEN_COUNT:
            raise _KeyError(f"token_count {token_count!r}: must be an integer in 0..{MAX_TOKEN_COUNT}")
        index = block_index
        tokens = token_count
        if type(model_id) is not str or type(tokenizer_id) is not str or type(tenant_id) is not str or (
                adapter_id is not None and type(adapter_id) is not str):
            # a str subclass: its plain str (the scope's strings are interned, and intern takes str only)
            model_id, tokenizer_id, tenant_id = str.__str__(model_id), str.__str__(tokenizer_id), str.__str__(tenant_id)
            adapter_id = None if adapter_id is None else str.__str__(adapter_id)
        sb, scope = _scope_for(<str>model_id, <str>tokenizer_id, adapter_id, <str>tenant_id)
        cdef const char* pre = PyUnicode_AsUTF8AndSize(prefix_hash, &lp)
        cdef const char* blk = PyUnicode_AsUTF8AndSize(block_hash, &lb)
        ls = PyBytes_GET_SIZE(sb)
        cdef bytes ek = PyBytes_FromStringAndSize(NULL, ls + 1 + lp + 4 + 1 + lb + 4)
        cdef unsigned char* o = <unsigned char*>PyBytes_AS_STRING(ek)
        memcpy(o, PyBytes_AS_STRING(sb), ls)
        n = ls
        o[n] = <unsigned char>lp
        memcpy(o + n + 1, pre, lp)
        n += 1 + lp
        _put_u32(o + n, index)
        n += 4
        o[n] = <unsigned char>lb
        memcpy(o + n + 1, blk, lb)
        n += 1 + lb
        _put_u32(o + n, tokens)
        self._ek = ek
        self._scope = scope

    # ------------------------------------------------------------------ fields

    @property
    def model_id(self):
        return self._scope.model_id

    @property
    def tokenizer_id(self):
        return self._scope.tokenizer_id

    @property
    def adapter_id(self):
        return self._scope.adapter_id

    @property
    def tenant_id(self):
        return self._scope.tenant_id

    @property
    def scope(self):
        return self._scope

    @property
    def prefix_hash(self):
        cdef const unsigned char* p = _enc(self)
        cdef Py_ssize_t s = _scope_end(p)
        return _utf8(p, s + 1, s + 1 + p[s])

    @property
    def block_index(self):
        cdef const unsigned char* p = _enc(self)
        cdef Py_ssize_t s = _scope_end(p)
        return _u32(p + s + 1 + p[s])

    @property
    def block_hash(self):
        cdef const unsigned char* p = _enc(self)
        cdef Py_ssize_t s = _scope_end(p)
        s += 1 + p[s] + 4
        return _utf8(p, s + 1, s + 1 + p[s])

    @property
    def token_count(self):
        cdef const unsigned char* p = _enc(self)
        return _u32(p + PyBytes_GET_SIZE(self._ek) - 4)

    # ------------------------------------------------------------------ identity

    def encoded(self):
        """``encode_key(self)``: made with the key (or the bytes it was decoded from)."""
        return self._ek

    def __hash__(self):
        return hash(self._ek)

    def __richcmp__(self, other, int op):
        # The encoding is canonical (one key, one byte string): equal encodings are equal keys.
        if type(other) is not KvBlockKey or (op != 2 and op != 3):
            return NotImplemented
        same = self is other or self._ek == (<KvBlockKey>other)._ek
        return same if op == 2 else not same

    def __reduce__(self):
        # rebuilt through __init__ from the fields: nothing process-specific travels
        return (KvBlockKey, (self.model_id, self.tokenizer_id, self.adapter_id, self.tenant_id,
                             self.prefix_hash, self.block_hash, self.block_index, self.token_count))

    def __repr__(self):
        return (f"KvBlockKey(model_id={self.model_id!r}, tokenizer_id={self.tokenizer_id!r}, "
                f"adapter_id={self.adapter_id!r}, tenant_id={self.tenant_id!r}, "
                f"prefix_hash={self.prefix_hash!r}, block_hash={self.block_hash!r}, "
                f"block_index={self.block_index!r}, token_count={self.token_count!r})")

    def replace(self, **changes):
        """A key with ``changes`` (field=value) and the rest of this key's fields
        (``dataclasses.replace`` of the dataclass this was)."""
        fields = dict(model_id=self.model_id, tokenizer_id=self.tokenizer_id, adapter_id=self.adapter_id,
                      tenant_id=self.tenant_id, prefix_hash=self.prefix_hash, block_hash=self.block_hash,
                      block_index=self.block_index, token_count=self.token_count)
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"KvBlockKey has no field {sorted(unknown)[0]!r}")
        fields.update(changes)
        return KvBlockKey(**fields)


def decode_key_fast(object raw, type key_type not None):
    """The ``key_type`` (KvBlockKey) that ``raw`` (bytes, model.py's layout) encodes, with
    ``raw`` as its encoding; None when raw is not bytes or not a well-formed key (then
    decode it with ``model.decode_key`` for the error)."""
    if key_type is not KvBlockKey:
        raise TypeError(f"decode_key_fast makes KvBlockKey, not {key_type!r}")
    if type(raw) is not bytes:
        return None
    cdef bytes b = <bytes>raw
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(b)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b), pos, scope_end, pre_end, blk_start, blk_end
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
    blk_start = pre_end + 4
    blk_end = _skip_str(p, blk_start, n)             # block_hash
    if blk_end < 0 or blk_end + 4 != n:             # then token_count, and nothing after it
        return None
    try:
        scope = _scope_of(b, p, scope_end)
        # the hashes are read from the bytes when asked for: here only checked to be UTF-8
        if not _ascii(p, scope_end + 1, pre_end):
            _utf8(p, scope_end + 1, pre_end)
        if not _ascii(p, blk_start + 1, blk_end):
            _utf8(p, blk_start + 1, blk_end)
    except UnicodeDecodeError:
        return None
    cdef KvBlockKey key = KvBlockKey.__new__(KvBlockKey)
    key._ek = b
    key._scope = scope
    return key
