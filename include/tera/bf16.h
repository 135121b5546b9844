/* bf16 rounding to nearest even on the fp32 bit pattern (subnormals exact, a NaN kept and made
 * quiet): the one rounding of a bf16 product's operands (src/kernels/cpu/matmul.c), of the bf16
 * attention's P and dS (attention.c) and of the bf16 weight shadow the optimizer writes
 * (src/train/optim.c), which must all give the same bits (tests/test_optim_shadow.c). */
#ifndef TERA_BF16_H
#define TERA_BF16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Branch-free, so that loops of it vectorise. */
static inline uint16_t tera_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)r;
}

#if defined(__AVX512F__)
/* tera_bf16_rne on 16 fp32 bit patterns: the results in the high 16 bits of each lane (the low 16
 * bits to be dropped). vcvtneps2bf16 would flush subnormals. */
static inline __m512i tera_bf16_rne16(__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}
#endif

/* d[i] = tera_bf16_rne(s[i]) for n elements, 16 at a time where AVX-512 exists (the products' operand
 * rounding, matmul.c, and the producers' copies, elementwise.c). */
static inline void tera_bf16_rne_n(uint16_t *d, const float *s, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i r = tera_bf16_rne16(_mm512_loadu_si512((const void *)(s + i)));
        _mm256_storeu_si256((__m256i *)(void *)(d + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
#endif
    for (; i < n; i++) d[i] = tera_bf16_rne(s[i]);
}

#endif
