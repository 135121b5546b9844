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
 * every key of its 16-row block (0 above the diagonal), which the products of that block read. */
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
    const __m256 lo = _mm256_set1_ps(-87.0f), magic = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    const __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
    const __m256 fi = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fnmadd_ps(fi, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fi, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
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

/* St[c*FT + r] = sum_d A[c*lda + d] * Bt[d*FT + r] for keys c < nk; on the diagonal tile (diag) key
 * block [c0, c0+16) only for rows r >= c0 (the lanes below c0 are left unwritten) */
static void scores_t(float *St, const float *A, int64_t lda, const float *Bt, int nk, int hd, int diag) {
    if (!diag) {
        mk(nk, hd, FT, A, lda, 1, Bt, FT, St, FT, 0);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        mk(nk - c0 < 16 ? nk - c0 : 16, hd, FT - c0, A + (int64_t)c0 * lda, lda, 1, Bt + c0, FT,
           St + (int64_t)c0 * FT + c0, FT, 0);
}

/* out rows r < nq (stride ldo, lanes hd) (+)= sum_c Pt[c*FT + r] * X[c*ldx + d] over keys c < nk (on
 * the diagonal, 16-row blocks stop at their block's last key) */
static void rows_by_keys(float *out, int64_t ldo, const float *Pt, const float *X, int64_t ldx, int nq, int nk,
                         int hd, int diag, int acc) {
    if (!diag) {
        mk(nq, nk, hd, Pt, 1, FT, X, ldx, out, ldo, acc);
        return;
    }
    for (int r0 = 0; r0 < nq; r0 += 16)
        mk(nq - r0 < 16 ? nq - r0 : 16, nk < r0 + 16 ? nk : r0 + 16, hd, Pt + r0, 1, FT, X, ldx,
           out + (int64_t)r0 * ldo, ldo, acc);
}

/* out rows c < nk (stride ldo, lanes hd) += sum_r Pt[c*FT + r] * X[r*ldx + d] over rows r < nq (on
 * the diagonal, 16-key blocks start at their first key) */
static void keys_by_rows(float *out, int64_t ldo, const float *Pt, const float *X, int64_t ldx, int nq, int nk,
                         int hd, int diag) {
    if (!diag) {
        mk(nk, nq, hd, Pt, FT, 1, X, ldx, out, ldo, 1);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        mk(nk - c0 < 16 ? nk - c0 : 16, nq - c0, hd, Pt + (int64_t)c0 * FT + c0, FT, 1, X + (int64_t)c0 * ldx, ldx,
           out + (int64_t)c0 * ldo, ldo, 1);
}

/* keys the softmax pass of row group g visits: all nk, or on the diagonal those of the group's
 * 16-row block (its probabilities above the diagonal written as 0 for the block's products) */
static inline int group_keys(int g, int nk, int diag) {
    const int end = (g >> 1) * 16 + 16;
    return diag && end < nk ? end : nk;
}

void tera_attn_avx2_forward_span(float *out, float *lse, float *lsum, const float *q, const float *k, const float *v,
                                 int b, int h, int qa, int qb, int T, int H, int Hkv, int hd, int kch, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int kvh = h / (H / Hkv);
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t hdp = ((int64_t)hd + 15) & ~(int64_t)15;
    float *Qt = ws;                                      /* [hd, FT] scale * Q^T */
    float *St = Qt + (size_t)hd * FT;                    /* [FT keys, FT rows] S^T, then P^T */
    float *m = St + FT * FT, *l = m + FT, *al = l + FT;  /* [FT] running max, sum, rescale */
    float *Op = al + FT;                                 /* [FT, hdp] O of the query tile */
    float *Kc = Op + FT * hdp, *Vc = Kc + (int64_t)kch * FT * hdp; /* [kch*FT, hdp] the chunk's K, V */
    float *lse_h = lse + ((int64_t)b * H + h) * T;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int kc0 = 0; kc0 < qb; kc0 += kch) {
        const int kc1 = kc0 + kch < qb ? kc0 + kch : qb; /* no key tile beyond the last query tile */
        const int c0 = kc0 * FT, nkc = (kc1 * FT < T ? kc1 * FT : T) - c0;
        const int64_t koff = ((int64_t)b * T + c0) * ldk + (int64_t)kvh * hd;
        pack_rows(Kc, k + koff, ldk, nkc, hd, hdp);
        pack_rows(Vc, v + koff, ldk, nkc, hd, hdp);
        for (int qt = qa > kc0 ? qa : kc0; qt < qb; qt++) {
            const int t0 = qt * FT;
            const int nq = T - t0 < FT ? T - t0 : FT;
            float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
            pack_t(Qt, q + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd, ldq, nq, hd, scale);
            for (int g = 0; g < FT / 8; g++) { /* pad rows (r >= nq) start afresh in every chunk */
                const __m256i rows = lanes8(nq - 8 * g);
                if (kc0 == 0) {
                    _mm256_storeu_ps(m + 8 * g, ninf);
                    _mm256_storeu_ps(l + 8 * g, _mm256_setzero_ps());
                } else {
                    const __m256 rm = _mm256_castsi256_ps(rows);
                    _mm256_storeu_ps(m + 8 * g, _mm256_blendv_ps(ninf, _mm256_maskload_ps(lse_h + t0 + 8 * g, rows), rm));
                    _mm256_storeu_ps(l + 8 * g, _mm256_maskload_ps(lsum + t0 + 8 * g, rows));
                }
            }
            if (kc0 > 0) pack_rows(Op, oi, ldq, nq, hd, hdp);
            const int kend = qt < kc1 - 1 ? qt : kc1 - 1;
            for (int kt = kc0; kt <= kend; kt++) {
                const int s0 = kt * FT;
                const int nk = T - s0 < FT ? T - s0 : FT;
                const int diag = kt == qt;
                const float *Kp = Kc + (int64_t)(s0 - c0) * hdp, *Vp = Vc + (int64_t)(s0 - c0) * hdp;
                scores_t(St, Kp, hdp, Qt, nk, hd, diag);
                /* online softmax, 8 rows a vector; keys up to the group's first row need no mask; pad
                 * rows see every key of the tile: finite */
                for (int g = 0; g < FT / 8; g++) {
                    const int cend = group_keys(g, nk, diag);
                    const int cfree = diag && 8 * g + 1 < cend ? 8 * g + 1 : cend;
                    __m256 mt = ninf;
                    for (int c = 0; c < cfree; c++) mt = _mm256_max_ps(mt, _mm256_loadu_ps(St + (int64_t)c * FT + 8 * g));
                    for (int c = cfree; c < cend; c++)
                        mt = _mm256_blendv_ps(mt, _mm256_max_ps(mt, _mm256_loadu_ps(St + (int64_t)c * FT + 8 * g)),
                                              causal8(c, g));
                    const __m256 mo = _mm256_loadu_ps(m + 8 * g);
                    const __m256 mn = _mm256_max_ps(mo, mt);
                    __m256 sum = _mm256_setzero_ps();
                    for (int c = 0; c < cend; c++) {
                        float *p = St + (int64_t)c * FT + 8 * g;
                        __m256 e = vexp8(_mm256_sub_ps(_mm256_loadu_ps(p), mn));
                        if (c >= cfree) e = _mm256_and_ps(e, causal8(c, g));
                        _mm256_storeu_ps(p, e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    const __m256 alpha = vexp8(_mm256_sub_ps(mo, mn)); /* 0 at the first tile (mo = -inf) */
                    _mm256_storeu_ps(m + 8 * g, mn);
                    _mm256_storeu_ps(l + 8 * g, _mm256_fmadd_ps(_mm256_loadu_ps(l + 8 * g), alpha, sum));
                    _mm256_storeu_ps(al + 8 * g, alpha);
                }
                if (kt > 0)
                    for (int r = 0; r < nq; r++)
                        if (al[r] != 1.0f) {
                            float *restrict o = Op + (int64_t)r * hdp;
                            for (int d = 0; d < hd; d++) o[d] *= al[r];
                        }
                rows_by_keys(Op, hdp, St, Vp, hdp, nq, nk, hd, diag, kt > 0); /* O (+)= P V_j */
            }
            if (kend == qt) { /* the query tile's last key tile: normalise */
                for (int r = 0; r < nq; r++) {
                    const float inv = 1.0f / l[r];
                    const float *restrict o = Op + (int64_t)r * hdp;
                    float *restrict y = oi + (int64_t)r * ldq;
                    for (int d = 0; d < hd; d++) y[d] = o[d] * inv;
                    lse_h[t0 + r] = m[r] + logf(l[r]);
                }
            } else { /* keep the state for the next chunk */
                for (int r = 0; r < nq; r++) memcpy(oi + (int64_t)r * ldq, Op + (int64_t)r * hdp, sizeof(float) * (size_t)hd);
                memcpy(lse_h + t0, m, sizeof(float) * (size_t)nq);
                memcpy(lsum + t0, l, sizeof(float) * (size_t)nq);
            }
        }
    }
}

void tera_attn_avx2_backward_group(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                   const float *v, const float *lse, const float *D, int b, int kvh, int T, int H,
                                   int Hkv, int hd, int kch, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv;
    const float scale = 1.0f / sqrtf((float)hd);
    const int nt = (T + FT - 1) / FT;
    const int64_t hdp = ((int64_t)hd + 15) & ~(int64_t)15;
    float *Qt = ws, *dOt = Qt + (size_t)hd * FT; /* [hd, FT] scale * Q^T, dO^T */
    float *Pt = dOt + (size_t)hd * FT;           /* [FT keys, FT rows] S^T, then P^T */
    float *dSt = Pt + FT * FT;                   /* [FT keys, FT rows] dP^T, then scale * dS^T */
    float *Qp = dSt + FT * FT, *dOp = Qp + FT * hdp, *dQp = dOp + FT * hdp; /* [FT, hdp] Q_i, dO_i, dQ_i */
    float *Kc = dQp + FT * hdp, *Vc = Kc + (int64_t)kch * FT * hdp;         /* [kch*FT, hdp] the chunk's */
    float *dKc = Vc + (int64_t)kch * FT * hdp, *dVc = dKc + (int64_t)kch * FT * hdp; /* K, V, dK, dV */
    const __m256 vscale = _mm256_set1_ps(scale);
    /* key tiles in chunks [kc0, kc1), as the AVX-512 kernel: every dK, dV element gets its terms in
     * (head, query tile) order, every dQ element in key order */
    for (int kc0 = 0; kc0 < nt; kc0 += kch) {
        const int kc1 = kc0 + kch < nt ? kc0 + kch : nt;
        const int c0 = kc0 * FT, nkc = (kc1 * FT < T ? kc1 * FT : T) - c0; /* keys of the chunk */
        const int64_t koff = ((int64_t)b * T + c0) * ldk + (int64_t)kvh * hd;
        pack_rows(Kc, k + koff, ldk, nkc, hd, hdp);
        pack_rows(Vc, v + koff, ldk, nkc, hd, hdp);
        memset(dKc, 0, sizeof(float) * (size_t)nkc * (size_t)hdp);
        memset(dVc, 0, sizeof(float) * (size_t)nkc * (size_t)hdp);
        for (int hh = 0; hh < rep; hh++) {
            const int h = kvh * rep + hh;
            for (int qt = kc0; qt < nt; qt++) {
                const int t0 = qt * FT;
                const int nq = T - t0 < FT ? T - t0 : FT;
                const int64_t qoff = ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
                const float *qi = q + qoff, *doi = dout + qoff;
                const float *lse_i = lse + ((int64_t)b * H + h) * T + t0;
                const float *D_i = D + ((int64_t)b * H + h) * T + t0;
                pack_t(Qt, qi, ldq, nq, hd, scale);
                pack_t(dOt, doi, ldq, nq, hd, 1.0f);
                pack_rows(Qp, qi, ldq, nq, hd, hdp);
                pack_rows(dOp, doi, ldq, nq, hd, hdp);
                if (kc0 == 0)
                    memset(dQp, 0, sizeof(float) * (size_t)nq * (size_t)hdp);
                else
                    pack_rows(dQp, dq + qoff, ldq, nq, hd, hdp); /* the sum so far */
                const int kend = qt < kc1 - 1 ? qt : kc1 - 1;
                for (int kt = kc0; kt <= kend; kt++) {
                    const int s0 = kt * FT;
                    const int nk = T - s0 < FT ? T - s0 : FT;
                    const int diag = kt == qt;
                    const int64_t co = (int64_t)(s0 - c0) * hdp; /* the tile's rows in the chunk */
                    const float *Kp = Kc + co, *Vp = Vc + co;
                    scores_t(Pt, Kp, hdp, Qt, nk, hd, diag);
                    scores_t(dSt, Vp, hdp, dOt, nk, hd, diag); /* dP^T = V_j dO_i^T */
                    for (int g = 0; g < FT / 8; g++) {
                        const int live = nq - 8 * g; /* rows of the group that exist */
                        if (live <= 0) break;
                        const int cend = group_keys(g, nk, diag);
                        const __m256i rows = lanes8(live);
                        const __m256 lv = _mm256_maskload_ps(lse_i + 8 * g, rows);
                        const __m256 Dv = _mm256_maskload_ps(D_i + 8 * g, rows);
                        for (int c = 0; c < cend; c++) {
                            float *p = Pt + (int64_t)c * FT + 8 * g, *ds = dSt + (int64_t)c * FT + 8 * g;
                            /* P = exp(S - lse), 0 where masked; dS = scale * P * (dP - D) */
                            __m256 keep = _mm256_castsi256_ps(rows);
                            if (diag && c > 8 * g) keep = _mm256_and_ps(keep, causal8(c, g));
                            const __m256 e = _mm256_and_ps(keep, vexp8(_mm256_sub_ps(_mm256_loadu_ps(p), lv)));
                            _mm256_storeu_ps(p, e);
                            _mm256_storeu_ps(ds, _mm256_mul_ps(vscale, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(ds), Dv))));
                        }
                    }
                    keys_by_rows(dVc + co, hdp, Pt, dOp, hdp, nq, nk, hd, diag); /* dV_j += P^T dO_i */
                    keys_by_rows(dKc + co, hdp, dSt, Qp, hdp, nq, nk, hd, diag); /* dK_j += dS^T Q_i */
                    rows_by_keys(dQp, hdp, dSt, Kp, hdp, nq, nk, hd, diag, 1);  /* dQ_i += dS K_j */
                }
                for (int r = 0; r < nq; r++) memcpy(dq + qoff + r * ldq, dQp + r * hdp, sizeof(float) * (size_t)hd);
            }
        }
        for (int r = 0; r < nkc; r++) {
            memcpy(dk + koff + r * ldk, dKc + r * hdp, sizeof(float) * (size_t)hd);
            memcpy(dv + koff + r * ldk, dVc + r * hdp, sizeof(float) * (size_t)hd);
        }
    }
}
#endif
