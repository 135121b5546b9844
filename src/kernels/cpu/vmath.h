/* Vectorisable float math for the CPU kernels (GCC turns loops over these into AVX-512). */
#ifndef TERA_VMATH_H
#define TERA_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The exponential's constants, shared by every form of it: tera_vexpf and tera_vexpf16 here, the
 * attention kernels' vexp16 (attention_avx512.h) and vexp8 (attention_avx2.c). Cephes range
 * reduction: x / ln 2 rounded by adding 1.5 * 2^23, ln 2 in two parts; then a degree-5 polynomial. */
#define TERA_EXP_LO (-87.0f)
#define TERA_EXP_HI 88.0f
#define TERA_EXP_MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds to the nearest integer */
#define TERA_EXP_LOG2E 1.44269504088896341f
#define TERA_EXP_LN2_HI 0.693359375f
#define TERA_EXP_LN2_LO (-2.12194440e-4f)
#define TERA_EXP_P0 1.9875691500e-4f
#define TERA_EXP_P1 1.3981999507e-3f
#define TERA_EXP_P2 8.3334519073e-3f
#define TERA_EXP_P3 4.1665795894e-2f
#define TERA_EXP_P4 1.6666665459e-1f
#define TERA_EXP_P5 5.0000001201e-1f

/* exp(x), vectorisable (glibc's expf is a scalar call without -ffast-math). Cephes range
 * reduction and polynomial: below 1 ulp on [-87, 0] (0.98 ulp max over 2e7 points against double
 * exp). Exactly 0 below -87 (so -inf gives 0); inputs above 88 are clamped. */
static inline float tera_vexpf(float x) {
    float xc = x < TERA_EXP_LO ? TERA_EXP_LO : (x > TERA_EXP_HI ? TERA_EXP_HI : x);
    const float magic = TERA_EXP_MAGIC;
    const float t = xc * TERA_EXP_LOG2E + magic;
    const float fi = t - magic;
    float r = xc - fi * TERA_EXP_LN2_HI;
    r = r - fi * TERA_EXP_LN2_LO;
    float p = TERA_EXP_P0;
    p = p * r + TERA_EXP_P1;
    p = p * r + TERA_EXP_P2;
    p = p * r + TERA_EXP_P3;
    p = p * r + TERA_EXP_P4;
    p = p * r + TERA_EXP_P5;
    p = p * (r * r) + r + 1.0f;
    uint32_t ti, pi;
    memcpy(&ti, &t, 4);
    memcpy(&pi, &p, 4);
    pi += (ti - 0x4B400000u) << 23; /* t's low mantissa bits hold the rounded integer: p * 2^fi */
    memcpy(&p, &pi, 4);
    return x < TERA_EXP_LO ? 0.0f : p;
}

/* log(x) for normal x > 0 (FLT_MIN and up; finite), vectorisable. Cephes logf: the exponent and a
 * mantissa m in [sqrt(1/2), sqrt(2)) from the bits, a degree-9 polynomial in m - 1. Zero, subnormals,
 * negatives, inf and NaN are the caller's to keep out. */
static inline float tera_vlogf(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    float e = (float)((int32_t)(u >> 23) - 126);
    const uint32_t mu = (u & 0x007FFFFFu) | 0x3F000000u; /* m in [0.5, 1) */
    float m;
    memcpy(&m, &mu, 4);
    const float lo = (float)(m < 0.707106781186547524f); /* then m -> 2m: the exponent one less */
    e -= lo;
    const float f = (m - 1.0f) + lo * m; /* exact: m - 1 or 2m - 1 */
    const float z = f * f;
    float y = 7.0376836292e-2f;
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return (f + y) + 0.693359375f * e;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TERA_VEXPF16 1
/* tera_vexpf on 16 lanes, bit for bit: the same operations in the same order (separate multiplies
 * and adds, as the scalar form compiles without contraction; NaN propagates as there). GCC turned
 * the 16-lane loops over the scalar form into 8-wide code with the lane sums partly scalar, at about
 * twice the time (docs/PERFORMANCE.md, wave 23); tests/test_vmath.c holds the bits equal. Not the
 * attention kernels' vexp16 (attention_avx512.h): that one takes FMA steps, so other bits. */
static inline __m512 tera_vexpf16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(TERA_EXP_LO), hi = _mm512_set1_ps(TERA_EXP_HI), magic = _mm512_set1_ps(TERA_EXP_MAGIC);
    const __mmask16 below = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __m512 xc = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), hi);
    xc = _mm512_mask_mov_ps(xc, below, lo);
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(TERA_EXP_LOG2E)), magic);
    const __m512 fi = _mm512_sub_ps(t, magic);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(fi, _mm512_set1_ps(TERA_EXP_LN2_HI)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(fi, _mm512_set1_ps(TERA_EXP_LN2_LO)));
    __m512 p = _mm512_set1_ps(TERA_EXP_P0);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(TERA_EXP_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(TERA_EXP_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(TERA_EXP_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(TERA_EXP_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(TERA_EXP_P5));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)), 23);
    p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_mask_mov_ps(p, below, _mm512_setzero_ps());
}
#endif

static inline float tera_silu(float x) { return x / (1.0f + tera_vexpf(-x)); }
static inline float tera_sigmoid(float x) { return 1.0f / (1.0f + tera_vexpf(-x)); }

/* Reductions with 16 independent lanes (a fixed order, so GCC vectorises them without
 * -ffast-math and the result does not depend on the thread count). */
#define TERA_LANES 16

static inline float tera_sum_sq(const float *restrict x, int64_t n) {
    float acc[TERA_LANES] = {0};
    int64_t i = 0;
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] += x[i + l] * x[i + l];
    for (; i < n; i++) acc[i % TERA_LANES] += x[i] * x[i];
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

static inline float tera_dot(const float *restrict x, const float *restrict y, int64_t n) {
    float acc[TERA_LANES] = {0};
    int64_t i = 0;
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] += x[i + l] * y[i + l];
    for (; i < n; i++) acc[i % TERA_LANES] += x[i] * y[i];
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

/* The largest of x[0..n) (NaNs skipped; -inf when none). A maximum is exact in any order, so the
 * AVX-512 form keeps four vectors of lanes (GCC gave the 16-lane loop one, a chain of dependent
 * maxima at one vector per 4 cycles: the cross-entropy's rows of 16384 logits waited on it). Only
 * which of two equal zeros is returned can differ from the scalar order, and nothing here tells
 * +0 from -0 after a subtraction or an addition of it. */
static inline float tera_max(const float *restrict x, int64_t n) {
#if defined(__AVX512F__)
    if (n >= 4 * TERA_LANES) {
        __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 4 * TERA_LANES <= n; i += 4 * TERA_LANES) { /* max(x, a): a where either is NaN, as below */
            a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0);
            a1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), a1);
            a2 = _mm512_max_ps(_mm512_loadu_ps(x + i + 32), a2);
            a3 = _mm512_max_ps(_mm512_loadu_ps(x + i + 48), a3);
        }
        for (; i + TERA_LANES <= n; i += TERA_LANES) a0 = _mm512_max_ps(_mm512_loadu_ps(x + i), a0);
        if (i < n) /* the last n - i < 16, -inf in the other lanes */
            a1 = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << (n - i)) - 1u), x + i), a1);
        const __m512 a = _mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3));
        float l[TERA_LANES];
        _mm512_storeu_ps(l, a);
        float m = l[0];
        for (int k = 1; k < TERA_LANES; k++) m = l[k] > m ? l[k] : m;
        return m;
    }
#endif
    float acc[TERA_LANES];
    for (int l = 0; l < TERA_LANES; l++) acc[l] = -INFINITY;
    int64_t i = 0;
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
    for (; i < n; i++) acc[i % TERA_LANES] = x[i] > acc[i % TERA_LANES] ? x[i] : acc[i % TERA_LANES];
    float m = acc[0];
    for (int l = 1; l < TERA_LANES; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

/* sum of exp(x[i] - shift) */
static inline float tera_sum_exp(const float *restrict x, int64_t n, float shift) {
    float acc[TERA_LANES] = {0};
    int64_t i = 0;
#ifdef TERA_VEXPF16
    __m512 vacc = _mm512_setzero_ps();
    const __m512 vs = _mm512_set1_ps(shift);
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        vacc = _mm512_add_ps(vacc, tera_vexpf16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vs)));
    _mm512_storeu_ps(acc, vacc);
#else
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] += tera_vexpf(x[i + l] - shift);
#endif
    for (; i < n; i++) acc[i % TERA_LANES] += tera_vexpf(x[i] - shift);
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

#endif
