/* The 16-lane exponential of the CPU kernels (src/kernels/cpu/vmath.h, tera_vexpf16) against the
 * scalar tera_vexpf bit for bit: one input in every 509 of the 2^32 float bit patterns (both signs,
 * subnormals, the clamps at -87 and 88, infinities and NaNs) and the values around the edges; and
 * tera_sum_exp (vectorised where AVX-512 exists) against the scalar 16-lane sum it replaces, on rows
 * of every length from 0 to 70 and a vocabulary's length; tera_max against the plain maximum. Without
 * AVX-512 the vector checks skip. The attention kernels' vexp16 (attention_avx512.h) against the form it
 * replaced (the integer part added to the exponent field, inputs clamped to [-87, 88]): the same bits
 * on every input that is not NaN, NaN for every NaN. */
#include "testutil.h"
#include "kernels/cpu/attention_avx512.h"
#include "kernels/cpu/vmath.h"

#ifdef TERA_VEXPF16
/* the 16 inputs at x through tera_vexpf16 against tera_vexpf one by one; returns the mismatches */
static int check16(const float *x) {
    float v[16];
    _mm512_storeu_ps(v, tera_vexpf16(_mm512_loadu_ps(x)));
    int bad = 0;
    for (int l = 0; l < 16; l++) {
        const uint32_t want = tu_bits(tera_vexpf(x[l])), got = tu_bits(v[l]);
        if (want != got && bad++ < 5)
            print_error("exp(%a) [0x%08x]: 0x%08x, scalar 0x%08x\n", (double)x[l], tu_bits(x[l]), got, want);
    }
    return bad;
}
#endif

static void test_vexpf16_is_the_scalar(void **state) {
    (void)state;
#ifndef TERA_VEXPF16
    skip();
#else
    int bad = 0;
    float x[16];
    int k = 0;
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += 509) {
        x[k++] = tu_float((uint32_t)u);
        if (k == 16) bad += check16(x), k = 0;
    }
    const float edge[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, -87.0f, nextafterf(-87.0f, 0.0f),
                          nextafterf(-87.0f, -100.0f), 88.0f, nextafterf(88.0f, 0.0f), nextafterf(88.0f, 100.0f),
                          1e-45f, -1e-45f, 0.5f, -0.5f};
    bad += check16(edge);
    assert_int_equal(bad, 0);
#endif
}

/* tera_sum_exp's order written out in scalar form: lane i % 16 of 16 sums, then the lanes in order */
static float sum_exp_scalar(const float *x, int64_t n, float shift) {
    float acc[TERA_LANES] = {0};
    for (int64_t i = 0; i < n; i++) acc[i % TERA_LANES] += tera_vexpf(x[i] - shift);
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

static void test_sum_exp_order(void **state) {
    (void)state;
    enum { MAXN = 4099 };
    float *x = malloc(sizeof(float) * MAXN);
    uint64_t r = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < MAXN; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((int64_t)(r >> 40) - (1 << 23)) / (float)(1 << 19); /* about [-16, 16) */
    }
    x[7] = -INFINITY, x[100] = -200.0f;
    for (int64_t n = 0; n <= MAXN; n = n < 70 ? n + 1 : (n == 70 ? 4096 : n + 3)) {
        const float shift = n ? tera_max(x, n) : 0.0f;
        const float got = tera_sum_exp(x, n, shift), want = sum_exp_scalar(x, n, shift);
        if (tu_bits(got) != tu_bits(want)) fail_msg("n %ld: sum %a, scalar order %a", (long)n, (double)got, (double)want);
    }
    free(x);
}

/* the largest non-NaN value, element by element (-inf when none) */
static float max_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* tera_max (four vectors of lanes where AVX-512 exists) against the plain maximum, on every length
 * from 0 to 200 and a vocabulary's, with the maximum at every position of a row of negative values
 * (a tail lane padded with 0 instead of -inf would win), NaNs (skipped) and rows of -inf */
static void test_max_exact(void **state) {
    (void)state;
    enum { MAXN = 4100 };
    float *x = calloc(MAXN, sizeof(float));
    uint64_t r = 0x243F6A8885A308D3ull;
    for (int64_t n = 0; n <= MAXN; n = n < 200 ? n + 1 : (n == 200 ? 4096 : n + 1)) {
        for (int64_t i = 0; i < n; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = -1.0f - (float)(r >> 40) / (float)(1 << 20); /* about [-17, -1) */
        }
        if (tu_bits(tera_max(x, n)) != tu_bits(max_scalar(x, n)))
            fail_msg("n %ld: %a, plain %a", (long)n, (double)tera_max(x, n), (double)max_scalar(x, n));
        for (int64_t at = 0; at < n && n <= 200; at++) { /* the maximum at every position */
            const float keep = x[at];
            x[at] = -0.5f;
            if (tera_max(x, n) != -0.5f) fail_msg("n %ld, maximum at %ld: %a", (long)n, (long)at, (double)tera_max(x, n));
            x[at] = NAN; /* skipped */
            if (tu_bits(tera_max(x, n)) != tu_bits(max_scalar(x, n)))
                fail_msg("n %ld, NaN at %ld: %a, plain %a", (long)n, (long)at, (double)tera_max(x, n), (double)max_scalar(x, n));
            x[at] = keep;
        }
    }
    for (int64_t i = 0; i < 100; i++) x[i] = -INFINITY;
    assert_true(isinf(tera_max(x, 100)) && tera_max(x, 100) < 0);
    x[99] = NAN;
    assert_true(isinf(tera_max(x, 100)) && tera_max(x, 100) < 0);
    free(x);
}

#ifdef ATTN_AVX512
/* vexp16's previous form: the clamp to [-87, 88], the integer part added to the exponent's bits */
static __m512 vexp16_previous(__m512 x) {
    const __m512 lo = _mm512_set1_ps(TERA_EXP_LO);
    __m512 t;
    __m512 p = vexp16_poly(_mm512_min_ps(_mm512_set1_ps(TERA_EXP_HI), _mm512_max_ps(lo, x)), &t);
    const __m512i e = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)), 23);
    p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_mask_mov_ps(p, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
}

/* the 16 inputs at x: vexp16 against the previous form (NaN inputs: NaN); returns the mismatches */
static int check_attn16(const float *x) {
    float got[16], want[16];
    _mm512_storeu_ps(got, vexp16(_mm512_loadu_ps(x)));
    _mm512_storeu_ps(want, vexp16_previous(_mm512_loadu_ps(x)));
    int bad = 0;
    for (int l = 0; l < 16; l++) {
        const int ok = isnan(x[l]) ? isnan(got[l]) : tu_bits(got[l]) == tu_bits(want[l]);
        if (!ok && bad++ < 5)
            print_error("vexp16(%a) [0x%08x]: 0x%08x, previous form 0x%08x\n", (double)x[l], tu_bits(x[l]),
                        tu_bits(got[l]), tu_bits(want[l]));
    }
    return bad;
}
#endif

static void test_attention_vexp16(void **state) {
    (void)state;
#ifndef ATTN_AVX512
    skip();
#else
    int bad = 0, k = 0;
    float x[16];
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += 251) { /* every 251st pattern: all exponents and signs */
        x[k++] = tu_float((uint32_t)u);
        if (k == 16) bad += check_attn16(x), k = 0;
    }
    /* the edges, and NaNs with payloads in the low bits (which the integer add turned into numbers) */
    const float edge[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, -87.0f, nextafterf(-87.0f, 0.0f),
                          nextafterf(-87.0f, -100.0f), 88.0f, nextafterf(88.0f, 0.0f), nextafterf(88.0f, 100.0f),
                          tu_float(0x7f800001u), tu_float(0x7fc00123u), tu_float(0xff8001ffu), -1e30f};
    bad += check_attn16(edge);
    assert_int_equal(bad, 0);
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vexpf16_is_the_scalar),
        cmocka_unit_test(test_sum_exp_order),
        cmocka_unit_test(test_max_exact),
        cmocka_unit_test(test_attention_vexp16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
