/* AVX-512 helpers shared by the attention kernels (attention.c: fp32 and AMX; attention_dot.c: bf16 on
 * AVX512-BF16 dot products). Defines ATTN_AVX512 where the compiler targets AVX-512 F/BW/VL. */
#ifndef TERA_KERNELS_CPU_ATTENTION_AVX512_H
#define TERA_KERNELS_CPU_ATTENTION_AVX512_H

#include "tera/bf16.h"
#include "vmath.h"
#include "tera/status.h"

/* The shape every attention entry point accepts (B, T >= 0; H a multiple of Hkv; hd > 0); a
 * macro, so that the abort names the caller's file and line. */
#define ATTN_CHECK_SHAPE(B, T, H, Hkv, hd)                                                        \
    TERA_ASSERTF((B) >= 0 && (T) >= 0 && (H) > 0 && (Hkv) > 0 && (hd) > 0 && (H) % (Hkv) == 0,     \
                 "attention: bad shape B=%d T=%d H=%d Hkv=%d hd=%d", B, T, H, Hkv, hd)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ATTN_AVX512 1

/* vexp16's range reduction and polynomial for xc (clamped to at most 88): returns the polynomial p of
 * the remainder, *t the rounded xc / ln 2 plus 1.5 * 2^23 (its low bits the integer part); the result
 * is p with that integer added to its exponent field */
static inline __m512 vexp16_poly(__m512 xc, __m512 *t) {
    const __m512 magic = _mm512_set1_ps(TERA_EXP_MAGIC);
    *t = _mm512_fmadd_ps(xc, _mm512_set1_ps(TERA_EXP_LOG2E), magic);
    const __m512 fi = _mm512_sub_ps(*t, magic);
    __m512 r = _mm512_fnmadd_ps(fi, _mm512_set1_ps(TERA_EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(fi, _mm512_set1_ps(TERA_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(TERA_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TERA_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TERA_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TERA_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TERA_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TERA_EXP_P5));
    return _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
}

/* tera_vexpf on 16 lanes (same range reduction and polynomial, FMA steps), in 16 vector operations:
 * the integer part goes into the exponent by vscalefps (p * 2^fi, exact: on [-87, 88] the result is
 * a normal number), and inputs below -87 are not clamped but masked to 0 at the end (their remainder
 * may be anything). The same bits as this function's previous form (a clamp to [-87, 88] and the
 * integer part added to the exponent field; tests/test_vmath.c) on every input that is not NaN
 * (checked over all 2^32 inputs); NaN stays NaN, where the previous form's integer add turned most
 * NaN bit patterns into finite numbers. The softmax passes of the attention kernels are mostly this
 * function at head dim 32 (docs/PERFORMANCE.md, "A second AMX CPU"). */
static inline __m512 vexp16(__m512 x) {
    __m512 t;
    const __m512 p = vexp16_poly(_mm512_min_ps(_mm512_set1_ps(TERA_EXP_HI), x), &t);
    const __m512 fi = _mm512_sub_ps(t, _mm512_set1_ps(TERA_EXP_MAGIC));
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(TERA_EXP_LO), _CMP_LT_OQ), _mm512_scalef_ps(p, fi));
}

/* tera_bf16_rne on 16 lanes, packed to 16 bits */
static inline __m256i vbf16(__m512 f) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(tera_bf16_rne16(_mm512_castps_si512(f)), 16));
}

static inline __mmask16 lanes_mask(int n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* r[i] = column i of the 16 x 16 block whose rows are r[0..15] */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i+k], 128-bit lane L: column 4L+k of rows 4i..4i+3 */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        const __m512 c = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD), d = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
        t[k] = _mm512_shuffle_f32x4(a, b, 0x88);
        t[8 + k] = _mm512_shuffle_f32x4(a, b, 0xDD);
        t[4 + k] = _mm512_shuffle_f32x4(c, d, 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(c, d, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* lanes of row group g (rows 16g..16g+15) that key c may see: all, or on the diagonal r >= c */
static inline __mmask16 causal_mask(int c, int g, int diag) {
    const int s = c - 16 * g;
    return !diag || s <= 0 ? (__mmask16)0xffff : (__mmask16)(0xffffu << s);
}
#endif

#endif
