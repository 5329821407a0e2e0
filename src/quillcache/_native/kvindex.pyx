# cython: language_level=3
"""The router's block table (quillcache.control.indexer): token-block hash chains, and the
per-slot worker bitmasks kept beside the ART that maps a block key to its slot.

Hash chains: the router's own block hashes.

Each full block of ``block_size`` token ids gets a 64-bit hash of its tokens and of its
parent's hash, so two equal hashes mean two equal prefixes (up to 64-bit collisions),
whatever hash seed the engine that cached them used.  Per block::

    acc = parent * K1 + block_size
    for t in block:  acc = rotl(acc ^ (t * K2), 31) * K1
    hash = splitmix64_finalizer(acc)            (as a signed 64-bit integer)

Token ids are unsigned 32-bit; anything else raises ``OverflowError``/``TypeError`` before
any hashing.  The loop runs without the GIL.

Masks: ``masks[slot, tier, word]`` holds one bit per worker.  ``mask_add`` sets a worker's
bit for a batch of keys (a new key gets a free slot, or the next unused one) and
``mask_remove`` clears it (a key with no bit left leaves the tree, its slot is freed).
They reach the tree through art.pxd's batch entry points.

Matching: ``match_levels`` answers one routing decision's lookup in one call: it builds the
``scope id (4 bytes, big-endian) + hash (8 bytes, big-endian)`` keys of a request's blocks
under each scope, looks them up in one batch and walks the masks row by row, keeping per
level the running AND of the rows; a worker's depth at a level is the row where its bit
drops out.  Its work is per request block, per scope and per mask word: nothing in it grows
with the blocks indexed.
"""
from array import array

from cpython.array cimport array as carray
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from quillcache._native.art cimport ART_MAX_KEY, AdaptiveRadixTree
from quillcache._native.includes.builtins cimport __builtin_ctzll

__all__ = ["chain_hashes", "mask_add", "mask_remove", "match_levels", "ROOT_HASH", "MATCH_KEY_BYTES",
           "MATCH_LEVELS", "MATCH_MAX_KEYS"]

cdef enum:
    KEY_BYTES = 12            # bytes per block key: scope id u32 + hash i64, both big-endian
    N_LEVELS = 4              # device, +host, +disk, +pool
    MAX_WORDS = 64            # mask words (4096 workers) the on-stack running ANDs hold
    MAX_KEYS = 1 << 24        # keys (scopes x blocks) one match_levels call may look up
    NOGIL_MIN = 4096          # keys: smaller lookups (microseconds) keep the GIL

MATCH_KEY_BYTES = KEY_BYTES
MATCH_LEVELS = N_LEVELS
MATCH_MAX_KEYS = MAX_KEYS

cdef uint64_t K1 = 0x9E3779B185EBCA87ULL   # xxhash64 primes: odd, well mixed
cdef uint64_t K2 = 0xC2B2AE3D27D4EB4FULL
ROOT_HASH = 0x51C0FFEE                     # the parent of a chain's first block


cdef inline uint64_t rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t finalize(uint64_t h) noexcept nogil:
    h ^= h >> 30
    h *= 0xBF58476D1CE4E5B9ULL
    h ^= h >> 27
    h *= 0x94D049BB133111EBULL
    h ^= h >> 31
    return h


def chain_hashes(tokens, Py_ssize_t block_size, parent=None):
    """The hash of each full block of ``tokens`` (a partial last block is left out)."""
    cdef carray buf
    cdef const uint32_t[:] toks
    cdef Py_ssize_t n, nblocks, b, i, base
    cdef uint64_t h, acc
    if block_size <= 0:
        raise ValueError(f"block_size {block_size}: must be positive")
    if isinstance(tokens, carray) and (<carray>tokens).ob_descr.typecode == b'I':
        buf = <carray>tokens
    else:
        buf = array("I", tokens)          # OverflowError for a negative or > 32-bit id
    toks = buf
    n = toks.shape[0]
    nblocks = n // block_size
    h = <uint64_t>(<int64_t>(ROOT_HASH if parent is None else parent))   # OverflowError if > 64 bits
    out = array("q", bytes(8 * nblocks))
    cdef int64_t[:] outv = out
    with nogil:
        for b in range(nblocks):
            base = b * block_size
            acc = h * K1 + <uint64_t>block_size
            for i in range(block_size):
                acc = rotl(acc ^ (<uint64_t>toks[base + i] * K2), 31) * K1
            h = finalize(acc)
            outv[b] = <int64_t>h
    return out.tolist()


cdef struct keybuf:
    const uint8_t** ptrs
    size_t* lens
    uint64_t* values
    char* found


cdef int keybuf_fill(keybuf* kb, list keys) except -1:
    """Point at the bytes of each key (the list keeps them alive); MemoryError, TypeError
    or ValueError (a key over ART_MAX_KEY) before the tree is touched."""
    cdef Py_ssize_t n = len(keys), i
    cdef object k
    kb.ptrs = <const uint8_t**>malloc(n * sizeof(uint8_t*) + 1)
    kb.lens = <size_t*>malloc(n * sizeof(size_t) + 1)
    kb.values = <uint64_t*>malloc(n * sizeof(uint64_t) + 1)
    kb.found = <char*>malloc(n + 1)
    if kb.ptrs == NULL or kb.lens == NULL or kb.values == NULL or kb.found == NULL:
        keybuf_free(kb)
        raise MemoryError()
    for i in range(n):
        k = keys[i]
        if type(k) is not bytes:
            keybuf_free(kb)
            raise TypeError("block keys must be bytes")
        if PyBytes_GET_SIZE(k) > ART_MAX_KEY:
            keybuf_free(kb)
            raise ValueError(f"a block key of {PyBytes_GET_SIZE(k)} bytes (at most {ART_MAX_KEY})")
        kb.ptrs[i] = <const uint8_t*>PyBytes_AS_STRING(k)
        kb.lens[i] = <size_t>PyBytes_GET_SIZE(k)
    return 0


cdef void keybuf_free(keybuf* kb) noexcept:
    free(kb.ptrs)
    free(kb.lens)
    free(kb.values)
    free(kb.found)
    kb.ptrs = NULL
    kb.lens = NULL
    kb.values = NULL
    kb.found = NULL


def mask_add(AdaptiveRadixTree tree, list keys, uint64_t[:, :, ::1] masks, Py_ssize_t tier,
             Py_ssize_t worker, list free_slots, Py_ssize_t next_slot):
    """Set ``worker``'s bit at ``tier`` for every key; returns the new ``next_slot``.  The
    caller makes sure ``masks`` has rows up to ``next_slot + len(keys)``."""
    cdef keybuf kb
    cdef Py_ssize_t n = len(keys), i
    cdef uint64_t slot, bit = (<uint64_t>1) << (worker & 63)
    cdef Py_ssize_t word = worker >> 6
    if n == 0:
        return next_slot
    if next_slot + n > masks.shape[0] or not 0 <= tier < masks.shape[1] or \
            not 0 <= word < masks.shape[2]:
        raise ValueError("mask_add: the masks array is too small for this batch")
    keybuf_fill(&kb, keys)
    try:
        tree.get_many_c(kb.ptrs, kb.lens, n, kb.values, kb.found)
        for i in range(n):
            if not kb.found[i]:
                # a key twice in one batch: the first occurrence inserted it
                if tree.get_many_c(&kb.ptrs[i], &kb.lens[i], 1, &kb.values[i], &kb.found[i]) == 0:
                    if free_slots:
                        slot = <uint64_t>free_slots.pop()
                    else:
                        slot = <uint64_t>next_slot
                        next_slot += 1
                    tree.insert_many_c(&kb.ptrs[i], &kb.lens[i], &slot, 1)
                    kb.values[i] = slot
            masks[kb.values[i], tier, word] |= bit
    finally:
        keybuf_free(&kb)
    return next_slot


def mask_remove(AdaptiveRadixTree tree, list keys, uint64_t[:, :, ::1] masks, Py_ssize_t tier,
                Py_ssize_t worker, list free_slots):
    """Clear ``worker``'s bit at ``tier`` for every key held; a key left with no bit leaves
    the tree and its slot goes to ``free_slots``.  Returns the number of keys dropped."""
    cdef keybuf kb
    cdef Py_ssize_t n = len(keys), i, t, j, dropped = 0
    cdef uint64_t slot, keep = ~((<uint64_t>1) << (worker & 63))
    cdef Py_ssize_t word = worker >> 6
    cdef bint empty
    if n == 0:
        return 0
    if not 0 <= tier < masks.shape[1] or not 0 <= word < masks.shape[2]:
        raise ValueError("mask_remove: tier or worker out of the masks array")
    keybuf_fill(&kb, keys)
    try:
        tree.get_many_c(kb.ptrs, kb.lens, n, kb.values, kb.found)
        for i in range(n):
            if not kb.found[i]:
                continue
            slot = kb.values[i]
            masks[slot, tier, word] &= keep
            empty = True
            for t in range(masks.shape[1]):
                for j in range(masks.shape[2]):
                    if masks[slot, t, j]:
                        empty = False
            if empty and tree.pop(keys[i], None) is not None:
                free_slots.append(slot)
                dropped += 1
    finally:
        keybuf_free(&kb)
    return dropped


cdef inline void put_be(uint8_t* p, uint64_t v, int nbytes) noexcept nogil:
    cdef int i
    for i in range(nbytes):
        p[nbytes - 1 - i] = <uint8_t>(v >> (8 * i))


cdef Py_ssize_t walk_levels(const uint64_t* vals, const char* found, Py_ssize_t ns, Py_ssize_t n,
                            const uint64_t[:, :, ::1] masks, const uint64_t[::1] pool_mask,
                            int64_t[:, ::1] depth, bint local_only) noexcept nogil:
    """The row walk of match_levels over looked-up slots (``found[s * n + i]``: block i
    under scope s is held, at slot ``vals[s * n + i]``); returns the pool depth."""
    cdef Py_ssize_t words = masks.shape[2], nw = depth.shape[1], nl = depth.shape[0]
    cdef Py_ssize_t i, j, s, l, k, pool_depth = -1
    cdef uint64_t[MAX_WORDS * N_LEVELS] run
    cdef uint64_t[N_LEVELS] lev
    cdef uint64_t d, h, dk, p, slot, dropped, valid, alive
    cdef bint pool_any, cut = False
    for j in range(words):
        valid = 0 if j * 64 >= nw else (~(<uint64_t>0) if nw - j * 64 >= 64
                                        else ((<uint64_t>1) << (nw - j * 64)) - 1)
        for l in range(nl):
            run[l * words + j] = valid
    for i in range(n):
        pool_any = False
        for j in range(words):
            p = 0
            for s in range(ns):
                k = s * n + i
                if found[k]:
                    p |= masks[vals[k], 3, j]
            if p & pool_mask[j]:
                pool_any = True
        if not pool_any and pool_depth < 0:
            pool_depth = i
        alive = 0
        for j in range(words):
            d = h = dk = 0
            for s in range(ns):
                k = s * n + i
                if found[k]:
                    slot = vals[k]
                    d |= masks[slot, 0, j]
                    h |= masks[slot, 1, j]
                    dk |= masks[slot, 2, j]
            if local_only:
                lev[0] = (d | h | dk) & ~pool_mask[j]
            else:
                lev[0] = d
                lev[1] = d | h
                lev[2] = d | h | dk
                lev[3] = lev[2] | (~(<uint64_t>0) if pool_any else 0)
            for l in range(nl):
                dropped = run[l * words + j] & ~lev[l]
                run[l * words + j] &= lev[l]
                alive |= run[l * words + j]
                while dropped:
                    depth[l, j * 64 + __builtin_ctzll(dropped)] = i
                    dropped &= dropped - 1
        if not alive and pool_depth >= 0:
            cut = True
            break
    if not cut:                                # every row held: what is still running is n deep
        for l in range(nl):
            for j in range(words):
                dropped = run[l * words + j]
                while dropped:
                    depth[l, j * 64 + __builtin_ctzll(dropped)] = n
                    dropped &= dropped - 1
    return n if pool_depth < 0 else pool_depth


def match_levels(AdaptiveRadixTree tree, sids, hashes, const uint64_t[:, :, ::1] masks,
                 const uint64_t[::1] pool_mask, int64_t[:, ::1] depth, bint local_only=False):
    """Per worker, the contiguous prefix of ``hashes`` held under any of ``sids`` (scope
    ids), level by level, written to ``depth[level, worker]`` for the first
    ``depth.shape[1]`` workers; returns the contiguous prefix some pool source (a bit of
    ``pool_mask``) holds at the pool tier.

    Levels (``depth.shape[0]`` must be 4): device; device or host; device, host or disk;
    the last or a block in the pool.  With ``local_only`` (``depth.shape[0]`` 1): device,
    host or disk, pool sources left out (what the identity check compares against).

    The keys are those ``struct.pack(">Iq", sid, hash)`` makes; a hash outside int64 raises
    ``OverflowError``, a scope id outside uint32 too, before the tree is touched."""
    cdef Py_ssize_t ns = len(sids), n = len(hashes), nk, nw = depth.shape[1]
    cdef Py_ssize_t words = masks.shape[2], i, s, k, nl = depth.shape[0], pool_depth
    cdef uint32_t sid
    cdef uint8_t* keys = NULL
    cdef const uint8_t** ptrs = NULL
    cdef size_t* lens = NULL
    cdef uint64_t* vals = NULL
    cdef char* found = NULL
    if nl != (1 if local_only else N_LEVELS):
        raise ValueError(f"match_levels: depth needs {1 if local_only else N_LEVELS} rows, got {nl}")
    if masks.shape[1] != N_LEVELS or pool_mask.shape[0] != words or words > MAX_WORDS \
            or nw > words * 64:
        raise ValueError("match_levels: masks, pool_mask and depth disagree on the workers")
    nk = ns * n
    if nk > MAX_KEYS:
        raise ValueError(f"match_levels: {ns} scopes x {n} blocks is over {MAX_KEYS} keys")
    depth[:, :] = 0
    if nk == 0:
        return 0
    keys = <uint8_t*>malloc(nk * KEY_BYTES)
    ptrs = <const uint8_t**>malloc(nk * sizeof(uint8_t*))
    lens = <size_t*>malloc(nk * sizeof(size_t))
    vals = <uint64_t*>malloc(nk * sizeof(uint64_t))
    found = <char*>malloc(nk)
    try:
        if keys == NULL or ptrs == NULL or lens == NULL or vals == NULL or found == NULL:
            raise MemoryError()
        for s in range(ns):
            sid = <uint32_t>sids[s]           # OverflowError outside uint32
            for i in range(n):
                k = s * n + i
                put_be(keys + k * KEY_BYTES, sid, 4)
                put_be(keys + k * KEY_BYTES + 4, <uint64_t><int64_t>hashes[i], 8)
                ptrs[k] = keys + k * KEY_BYTES
                lens[k] = KEY_BYTES
        if nk >= NOGIL_MIN:
            tree._readers += 1
            with nogil:
                tree.get_many_c(ptrs, lens, nk, vals, found)
                pool_depth = walk_levels(vals, found, ns, n, masks, pool_mask, depth, local_only)
            tree._readers -= 1
        else:
            tree.get_many_c(ptrs, lens, nk, vals, found)
            pool_depth = walk_levels(vals, found, ns, n, masks, pool_mask, depth, local_only)
        return pool_depth
    finally:
        free(keys)
        free(ptrs)
        free(lens)
        free(vals)
        free(found)
