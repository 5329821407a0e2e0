# cython: language_level=3
"""Compiler builtins (GCC / Clang) and the SSE2 intrinsics the radix tree uses.

SSE2 is part of the x86-64 baseline, so <emmintrin.h> needs no extra compiler flag
there; other architectures would need a scalar fallback (see art.pyx: find_child).
"""

cdef extern from * nogil:
    # __builtin_prefetch(addr, rw, locality): rw 0 = read; locality 0..3 (3 = keep in all levels)
    void __builtin_prefetch(const void* addr, int rw, int locality)
    # count of trailing zero bits; undefined for 0 (callers test first)
    int __builtin_ctz(unsigned int x)
    int __builtin_ctzll(unsigned long long x)
    # branch hint: returns exp, tells the compiler that exp == c is the likely case
    long __builtin_expect(long exp, long c)

cdef extern from "<emmintrin.h>" nogil:
    ctypedef struct __m128i:
        pass
    __m128i _mm_set1_epi8(char b)
    __m128i _mm_loadu_si128(const __m128i* p)
    __m128i _mm_cmpeq_epi8(__m128i a, __m128i b)
    int _mm_movemask_epi8(__m128i a)
