/* fp32 attention on AVX2 + FMA: attention.c's register-blocked AVX-512 kernels ("fp32 on AVX-512")
 * with 8-lane vectors (see attention_avx2.h). Without them builds without AVX-512 ran the sgemm
 * kernels, whose per-call packing and small reductions (hd = 32 or 64) cost, and whose rectangles
 * computed the masked half of every diagonal tile. Builds with AVX-512 have both (TERA_ATTN_FP32=avx2
 * selects these); their AVX-512 kernels are the faster in whole training steps (docs/PERFORMANCE.md).
 *
 * Same shape as the AVX-512 kernels: FT x FT tiles, scores kept transposed (S^T [keys, FT query
 * rows], the query rows in the vector lanes, so the softmax statistics are per-lane vectors and the
 * softmax passes vertical), Q and dO packed transposed once per query tile, K, V, Q, dO otherwise
 * dense rows, and every product one form
 *     out[i][l] (+)= sum_j M[i*si + j*sj] * L[j*ldl + l]     (l in the vector lanes)
 * here as 16-lane blocks of 6 rows (two vectors a row; 12 accumulators, 2 operand vectors and a
 * broadcast fill 15 of the 16 registers) or 8-lane blocks of 12 rows. Every output element is one
 * FMA chain in j order, by one task: bit-identical for any thread count, and the same arithmetic as
 * the AVX-512 kernels (exponentials by the same polynomial, FMA steps; every sum in the same order),
 * so the same bits as theirs (tests/test_attention.c checks it where both are built).
 *
 * Diagonal tiles are split into 16-key / 16-row blocks and only the blocks at or below the diagonal
 * are computed; the softmax passes run in groups of 8 rows, and a group writes the probabilities of
 * every key of its 16-row block (0 above the diagonal), which the products of that block read.
 * This file holds the 8-lane products, packs and vector operations; the schedule (the forward over a
 * span of query tiles, the backward of a kv head's group) is attention_rb.h's, shared with AVX-512. */
#include "attention_avx2.h"

#ifdef ATTN_AVX2
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define FT ATTN_FP32_TILE
#define MK_INLINE static inline __attribute__((always_inline))

/* lanes i < n all ones (n clamped to [0, 8]) */
static inline __m256i lanes8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* tera_vexpf on 8 lanes: attention_avx512.h's vexp16 (range reduction, polynomial, FMA steps, the
 * same order) with AVX2 instructions; NaN propagates, below -87 gives 0 */
static inline __m256 vexp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(TERA_EXP_LO), magic = _mm256_set1_ps(TERA_EXP_MAGIC);
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(TERA_EXP_HI), _mm256_max_ps(lo, x));
    const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(TERA_EXP_LOG2E), magic);
    const __m256 fi = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(fi, _mm256_set1_ps(TERA_EXP_LN2_HI), xc);
    r = _mm256_fnmadd_ps(fi, _mm256_set1_ps(TERA_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(TERA_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TERA_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TERA_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TERA_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TERA_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TERA_EXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)), 23);
    p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), p);
}

/* lanes of row group g (rows 8g..8g+7) that key c may see: on the diagonal tile r >= c */
static inline __m256 causal8(int c, int g) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(c - 8 * g - 1)));
}

/* NR rows of out (stride ldo) x NV vectors of lanes; MSK: the last vector holds the lanes of `last`
 * only (loads and stores masked); acc: add to out */
MK_INLINE void mk_body(const int NV, const int NR, const int MSK, int J, const float *restrict M, int64_t si,
                       int64_t sj, const float *restrict L, int64_t ldl, float *restrict O, int64_t ldo, int acc,
                       __m256i last) {
    __m256 a[12][2];
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            a[r][v] = !acc                     ? _mm256_setzero_ps()
                      : MSK && v == NV - 1     ? _mm256_maskload_ps(O + r * ldo + 8 * v, last)
                                               : _mm256_loadu_ps(O + r * ldo + 8 * v);
    for (int j = 0; j < J; j++) {
        const float *restrict Lj = L + (int64_t)j * ldl;
        const float *restrict Mj = M + (int64_t)j * sj;
        __m256 l[2];
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            l[v] = MSK && v == NV - 1 ? _mm256_maskload_ps(Lj + 8 * v, last) : _mm256_loadu_ps(Lj + 8 * v);
#pragma GCC unroll 12
        for (int r = 0; r < NR; r++) {
            const __m256 b = _mm256_broadcast_ss(Mj + r * si);
#pragma GCC unroll 2
            for (int v = 0; v < NV; v++) a[r][v] = _mm256_fmadd_ps(b, l[v], a[r][v]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) {
            if (MSK && v == NV - 1)
                _mm256_maskstore_ps(O + r * ldo + 8 * v, last, a[r][v]);
            else
                _mm256_storeu_ps(O + r * ldo + 8 * v, a[r][v]);
        }
}

typedef void (*mk_fn)(int J, const float *M, int64_t si, int64_t sj, const float *L, int64_t ldl, float *O,
                      int64_t ldo, int acc, __m256i last);
#define MK_DEF(NV, NR, MSK)                                                                                   \
    static void mk_##NV##_##NR##_##MSK(int J, const float *M, int64_t si, int64_t sj, const float *L,         \
                                       int64_t ldl, float *O, int64_t ldo, int acc, __m256i last) {           \
        mk_body(NV, NR, MSK, J, M, si, sj, L, ldl, O, ldo, acc, last);                                        \
    }
#define MK_ROWS(NV, MSK)                                                                                      \
    MK_DEF(NV, 1, MSK) MK_DEF(NV, 2, MSK) MK_DEF(NV, 3, MSK) MK_DEF(NV, 4, MSK) MK_DEF(NV, 5, MSK)            \
    MK_DEF(NV, 6, MSK)
MK_ROWS(2, 0)
MK_ROWS(2, 1)
MK_ROWS(1, 0)
MK_ROWS(1, 1)
MK_DEF(1, 7, 0) MK_DEF(1, 8, 0) MK_DEF(1, 9, 0) MK_DEF(1, 10, 0) MK_DEF(1, 11, 0) MK_DEF(1, 12, 0)
MK_DEF(1, 7, 1) MK_DEF(1, 8, 1) MK_DEF(1, 9, 1) MK_DEF(1, 10, 1) MK_DEF(1, 11, 1) MK_DEF(1, 12, 1)
/* [masked][vectors - 1][rows]: up to 6 rows of two vectors, 12 rows of one */
static const mk_fn k_mk[2][2][13] = {
    {{0, mk_1_1_0, mk_1_2_0, mk_1_3_0, mk_1_4_0, mk_1_5_0, mk_1_6_0, mk_1_7_0, mk_1_8_0, mk_1_9_0, mk_1_10_0,
      mk_1_11_0, mk_1_12_0},
     {0, mk_2_1_0, mk_2_2_0, mk_2_3_0, mk_2_4_0, mk_2_5_0, mk_2_6_0}},
    {{0, mk_1_1_1, mk_1_2_1, mk_1_3_1, mk_1_4_1, mk_1_5_1, mk_1_6_1, mk_1_7_1, mk_1_8_1, mk_1_9_1, mk_1_10_1,
      mk_1_11_1, mk_1_12_1},
     {0, mk_2_1_1, mk_2_2_1, mk_2_3_1, mk_2_4_1, mk_2_5_1, mk_2_6_1}},
};

/* out[i*ldo + l] (+)= sum_{j<J} M[i*si + j*sj] * L[j*ldl + l] for i < I, l < nl */
static void mk(int I, int J, int nl, const float *M, int64_t si, int64_t sj, const float *L, int64_t ldl, float *O,
               int64_t ldo, int acc) {
    for (int l0 = 0; l0 < nl; l0 += 16) {
        const int w = nl - l0 < 16 ? nl - l0 : 16;
        const int nv = (w + 7) / 8, msk = (w & 7) != 0;
        const __m256i last = lanes8(w & 7);
        const int nr = nv == 2 ? 6 : 12;
        const mk_fn *row = k_mk[msk][nv - 1];
        const float *Ll = L + l0;
        float *Ol = O + l0;
        int i = 0;
        for (; i + nr <= I; i += nr) row[nr](J, M + (int64_t)i * si, si, sj, Ll, ldl, Ol + (int64_t)i * ldo, ldo, acc, last);
        if (i < I) row[I - i](J, M + (int64_t)i * si, si, sj, Ll, ldl, Ol + (int64_t)i * ldo, ldo, acc, last);
    }
}

/* r[i] = column i of the 8 x 8 block whose rows are r[0..7] */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* u[4i+k], 128-bit half H: column 4H+k of rows 4i..4i+3 */
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

/* Xt[d*FT + r] = mul * x[r*ld + d] for r < n, 0 for n <= r < FT (d < hd) */
static void pack_t(float *restrict Xt, const float *restrict x, int64_t ld, int n, int hd, float mul) {
    const __m256 vm = _mm256_set1_ps(mul);
    for (int r0 = 0; r0 < FT; r0 += 8)
        for (int d0 = 0; d0 < hd; d0 += 8) {
            const __m256i cols = lanes8(hd - d0);
            __m256 blk[8];
            for (int i = 0; i < 8; i++)
                blk[i] = r0 + i < n ? _mm256_mul_ps(vm, _mm256_maskload_ps(x + (int64_t)(r0 + i) * ld + d0, cols))
                                    : _mm256_setzero_ps();
            transpose8(blk);
            for (int c = 0; c < 8 && d0 + c < hd; c++) _mm256_storeu_ps(Xt + (int64_t)(d0 + c) * FT + r0, blk[c]);
        }
}

/* dense rows: X[r*hdp + d] = x[r*ld + d] for r < n, d < hd (see attention.c's pack_rows) */
static void pack_rows(float *restrict X, const float *restrict x, int64_t ld, int n, int hd, int64_t hdp) {
    for (int r = 0; r < n; r++) memcpy(X + r * hdp, x + r * ld, sizeof(float) * (size_t)hd);
}

/* the operations attention_rb.h's schedule uses, on 8 lanes */
#define RB_VL 8
#define RB_FN(name) name##_avx2
typedef __m256 rb_vec;
typedef __m256 rb_mask; /* all ones in the lanes set */
static inline rb_vec rb_ld(const float *p) { return _mm256_loadu_ps(p); }
static inline void rb_st(float *p, rb_vec v) { _mm256_storeu_ps(p, v); }
static inline rb_vec rb_set1(float x) { return _mm256_set1_ps(x); }
static inline rb_vec rb_zero(void) { return _mm256_setzero_ps(); }
static inline rb_vec rb_add(rb_vec a, rb_vec b) { return _mm256_add_ps(a, b); }
static inline rb_vec rb_sub(rb_vec a, rb_vec b) { return _mm256_sub_ps(a, b); }
static inline rb_vec rb_mul(rb_vec a, rb_vec b) { return _mm256_mul_ps(a, b); }
static inline rb_vec rb_max(rb_vec a, rb_vec b) { return _mm256_max_ps(a, b); }
static inline rb_vec rb_fmadd(rb_vec a, rb_vec b, rb_vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline rb_vec rb_exp(rb_vec x) { return vexp8(x); }
static inline rb_mask rb_rows(int n) { return _mm256_castsi256_ps(lanes8(n)); }
static inline rb_mask rb_causal(int c, int g) { return causal8(c, g); }
static inline rb_mask rb_mask_and(rb_mask a, rb_mask b) { return _mm256_and_ps(a, b); }
static inline rb_vec rb_ld_or(rb_mask m, const float *p, rb_vec fill) {
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, _mm256_castps_si256(m)), m);
}
static inline rb_vec rb_keep(rb_mask m, rb_vec v) { return _mm256_and_ps(m, v); }
static inline rb_vec rb_max_where(rb_mask m, rb_vec a, rb_vec b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }

#include "attention_rb.h"

void tera_attn_avx2_forward_span(float *out, float *lse, float *lsum, const float *q, const float *k, const float *v,
                                 int b, int h, int qa, int qb, int T, int H, int Hkv, int hd, int kch, float *ws) {
    forward_span_avx2(out, lse, lsum, q, k, v, b, h, qa, qb, T, H, Hkv, hd, kch, ws);
}

void tera_attn_avx2_backward_group(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                   const float *v, const float *lse, const float *D, int b, int kvh, int T, int H,
                                   int Hkv, int hd, int kch, float *ws) {
    backward_group_avx2(dq, dk, dv, dout, q, k, v, lse, D, b, kvh, T, H, Hkv, hd, kch, ws);
}
#endif
