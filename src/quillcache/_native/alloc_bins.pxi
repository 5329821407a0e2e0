# Included by alloc.pyx: the size classes.  A size in units maps to an 8-bit "small
# float" bin (5-bit exponent, 3-bit mantissa, exact below LEAF_BINS): _round_down files
# a free region, _round_up picks the first bin searched for a request, _bin_size is a
# bin's size; bin_round_down / bin_round_up / bin_size expose them for tests.

# De Bruijn tables for count-trailing-zeros and highest-set-bit on 32 bits, built
# at import (pure C arithmetic, no compiler builtins needed).
cdef uint8_t _ctz_table[32]
cdef uint8_t _msb_table[32]


cdef void _init_tables() noexcept:
    cdef uint32_t i, v
    for i in range(32):
        v = (<uint32_t>1) << i
        _ctz_table[<uint32_t>(v * <uint32_t>DEBRUIJN_CTZ) >> 27] = <uint8_t>i
        v = <uint32_t>((<uint64_t>1 << (i + 1)) - 1)
        _msb_table[<uint32_t>(v * <uint32_t>DEBRUIJN_MSB) >> 27] = <uint8_t>i


_init_tables()


cdef inline uint32_t _ctz(uint32_t x) noexcept nogil:
    # x != 0
    return _ctz_table[<uint32_t>((x & (~x + 1)) * <uint32_t>DEBRUIJN_CTZ) >> 27]


cdef inline uint32_t _msb(uint32_t x) noexcept nogil:
    # x != 0
    x |= x >> 1
    x |= x >> 2
    x |= x >> 4
    x |= x >> 8
    x |= x >> 16
    return _msb_table[<uint32_t>(x * <uint32_t>DEBRUIJN_MSB) >> 27]


cdef inline uint32_t _round_down(uint32_t v) noexcept nogil:
    # bin of a free region: the largest bin whose size <= v (v >= 1)
    cdef uint32_t shift
    if v < LEAF_BINS:
        return v
    shift = _msb(v) - MANTISSA_BITS
    return ((shift + 1) << MANTISSA_BITS) | ((v >> shift) & (LEAF_BINS - 1))


cdef inline uint32_t _round_up(uint32_t v) noexcept nogil:
    # bin of a request: the smallest bin whose size >= v (at most 240 for v < 2**32)
    cdef uint32_t shift, b
    if v < LEAF_BINS:
        return v
    shift = _msb(v) - MANTISSA_BITS
    b = ((shift + 1) << MANTISSA_BITS) | ((v >> shift) & (LEAF_BINS - 1))
    if v & ((<uint32_t>1 << shift) - 1):
        b += 1  # a mantissa carry moves to the next exponent, which is the right bin
    return b


cdef inline uint64_t _bin_size(uint32_t b) noexcept nogil:
    cdef uint32_t e = b >> MANTISSA_BITS
    cdef uint64_t m = b & (LEAF_BINS - 1)
    if e == 0:
        return m
    return (m | LEAF_BINS) << (e - 1)


def bin_round_down(uint32_t units):
    """The bin a free region of ``units`` units is filed under (units >= 1)."""
    if units == 0:
        raise ValueError("units must be >= 1")
    return _round_down(units)


def bin_round_up(uint32_t units):
    """The first bin searched for a request of ``units`` units (units >= 1)."""
    if units == 0:
        raise ValueError("units must be >= 1")
    return _round_up(units)


def bin_size(uint32_t b):
    """The size in units that bin ``b`` stands for."""
    if b >= NUM_BINS:
        raise ValueError(f"bin must be < {NUM_BINS}, got {b}")
    return _bin_size(b)
