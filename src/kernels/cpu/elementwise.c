/* Row-wise and element-wise operations: RMSNorm, RoPE, SwiGLU, embedding, softmax,
 * cross-entropy. Parallel over rows (each row owned by one thread); parameter-gradient
 * reductions run over column blocks with rows in a fixed order, so results do not depend on the
 * number of threads. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "tera/bf16.h"
#include "tera/kernels.h"
#include "vmath.h"

#define COL_BLOCK 16

/* ---------------------------------------------------------------- RMSNorm */

void tera_rmsnorm_forward(float *restrict y, float *restrict rstd, const float *restrict x,
                          const float *restrict w, int64_t N, int64_t D, float eps) {
    tera_rmsnorm_forward_bf16(y, NULL, rstd, x, w, N, D, eps); /* cpu.h: y's bf16 copy when given */
}

/* The next row's lines of p[D] fetched into the cache (a row's second pass runs from the cache while
 * the first, a sum over the row, waited on memory: this keeps the next first pass fed). The same
 * bits; measured in docs/PERFORMANCE.md, wave 22. */
static inline void row_prefetch(const float *p, int64_t D, int write) {
    for (int64_t d = 0; d < D; d += 16) {
        if (write)
            __builtin_prefetch(p + d, 1, 3);
        else
            __builtin_prefetch(p + d, 0, 3);
    }
}

void tera_rmsnorm_copy_forward(float *restrict y, float *restrict rstd, float *restrict xcopy,
                               const float *restrict x, const float *restrict w, int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float *yr = y + n * D, *cr = xcopy + n * D;
        float r = 1.0f / sqrtf(tera_sum_sq(xr, D) / (float)D + eps);
        rstd[n] = r;
        if (n + 1 < N) row_prefetch(xr + D, D, 0);
        for (int64_t d = 0; d < D; d++) {
            yr[d] = w[d] * (xr[d] * r);
            cr[d] = xr[d];
        }
    }
}

/* The backward in one pass over the rows (dy and x read once): the rows are cut into nch chunks (a
 * function of N and D only, never of the thread count), each chunk sums its terms of dw into its own
 * row of a partial-sum block, and dw then adds the chunks' sums in chunk order, so dw does not
 * depend on the thread count. The block (RMS_PART_FLOATS) lives on the caller's stack; rows wider
 * than RMS_FUSED_MAXD take the two-pass form below. */
#define RMS_PART_FLOATS 32768 /* 128 KiB */
#define RMS_FUSED_MAXD 4096
#define RMS_MIN_ROWS 32 /* rows per chunk at least */

/* dx[n,:] += r * (dy*w - x * c) of one row; returns nothing, dw untouched */
static inline void rmsnorm_row_dx(float *restrict dxr, const float *restrict dyr, const float *restrict xr,
                                  const float *restrict w, float r, int64_t D) {
    float acc[TERA_LANES] = {0};
    int64_t d = 0;
    for (; d + TERA_LANES <= D; d += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] += dyr[d + l] * w[d + l] * xr[d + l];
    for (; d < D; d++) acc[d % TERA_LANES] += dyr[d] * w[d] * xr[d];
    float dot = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) dot += acc[l];
    const float c = dot * r * r / (float)D;
    for (int64_t j = 0; j < D; j++) dxr[j] += r * (dyr[j] * w[j] - xr[j] * c);
}

void tera_rmsnorm_backward(float *restrict dx, float *restrict dw, const float *restrict dy,
                           const float *restrict x, const float *restrict w, const float *restrict rstd,
                           int64_t N, int64_t D) {
    /* y = w * xhat, xhat = x * r:  dx = r * (dy*w - xhat * mean(dy*w*xhat)) */
    if (D <= RMS_FUSED_MAXD && N > 0) {
        float part[RMS_PART_FLOATS]; /* [nch, D] */
        int64_t nch = (N + RMS_MIN_ROWS - 1) / RMS_MIN_ROWS;
        if (nch > RMS_PART_FLOATS / D) nch = RMS_PART_FLOATS / D;
        const int64_t rows = (N + nch - 1) / nch;
        nch = (N + rows - 1) / rows;
        const int64_t nblk = (D + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t ch = 0; ch < nch; ch++) {
                float *pc = part + ch * D;
                for (int64_t d = 0; d < D; d++) pc[d] = 0.0f;
                const int64_t n1 = (ch + 1) * rows < N ? (ch + 1) * rows : N;
                for (int64_t n = ch * rows; n < n1; n++) {
                    const float *xr = x + n * D, *dyr = dy + n * D;
                    const float r = rstd[n];
                    if (n + 1 < n1) {
                        row_prefetch(xr + D, D, 0);
                        row_prefetch(dyr + D, D, 0);
                        row_prefetch(dx + (n + 1) * D, D, 1);
                    }
                    rmsnorm_row_dx(dx + n * D, dyr, xr, w, r, D);
                    for (int64_t d = 0; d < D; d++) pc[d] += dyr[d] * xr[d] * r;
                }
            }
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < nblk; blk++) {
                const int64_t d0 = blk * COL_BLOCK, d1 = d0 + COL_BLOCK < D ? d0 + COL_BLOCK : D;
                float acc[COL_BLOCK] = {0};
                for (int64_t ch = 0; ch < nch; ch++)
                    for (int64_t d = d0; d < d1; d++) acc[d - d0] += part[ch * D + d];
                for (int64_t d = d0; d < d1; d++) dw[d] += acc[d - d0];
            }
        }
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) rmsnorm_row_dx(dx + n * D, dy + n * D, x + n * D, w, rstd[n], D);
    const int64_t nblk = (D + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t d0 = blk * COL_BLOCK, d1 = d0 + COL_BLOCK < D ? d0 + COL_BLOCK : D;
        float acc[COL_BLOCK] = {0};
        for (int64_t n = 0; n < N; n++)
            for (int64_t d = d0; d < d1; d++) acc[d - d0] += dy[n * D + d] * x[n * D + d] * rstd[n];
        for (int64_t d = d0; d < d1; d++) dw[d] += acc[d - d0];
    }
}

/* ---------------------------------------------------------------- RoPE */

void tera_rope_tables(float *cos_t, float *sin_t, int T, int hd, float theta) {
    const int half = hd / 2;
    for (int j = 0; j < half; j++) {
        /* inv_freq computed as HF does: 1 / theta^(2j/hd), in float32 */
        float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)hd);
        for (int t = 0; t < T; t++) {
            float ang = (float)t * inv_freq;
            cos_t[t * half + j] = cosf(ang);
            sin_t[t * half + j] = sinf(ang);
        }
    }
}

/* x' = x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1):
 *   x1' = x1*c - x2*s,  x2' = x2*c + x1*s. The inverse rotation uses -s. */
static void rope_apply(float *restrict x, const float *restrict cos_t, const float *restrict sin_t,
                       int B, int T, int nh, int hd, float sign) {
    const int half = hd / 2;
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
        const int t = (int)(bt % T);
        const float *c = cos_t + (int64_t)t * half, *s = sin_t + (int64_t)t * half;
        for (int h = 0; h < nh; h++) {
            float *v = x + (bt * nh + h) * hd;
            for (int j = 0; j < half; j++) {
                float x1 = v[j], x2 = v[j + half], sj = sign * s[j];
                v[j] = x1 * c[j] - x2 * sj;
                v[j + half] = x2 * c[j] + x1 * sj;
            }
        }
    }
}

/* q [B,T,H,hd] and k [B,T,Hkv,hd] in one pass over the positions (each position's cos/sin row read
 * once, one parallel region instead of two); per element the same operations as rope_apply. */
static void rope_apply_qk(float *restrict q, float *restrict k, const float *restrict cos_t,
                          const float *restrict sin_t, int B, int T, int H, int Hkv, int hd, float sign) {
    const int half = hd / 2;
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (int64_t)B * T; bt++) {
        const int t = (int)(bt % T);
        const float *c = cos_t + (int64_t)t * half, *s = sin_t + (int64_t)t * half;
        for (int h = 0; h < H + Hkv; h++) {
            float *v = h < H ? q + (bt * H + h) * hd : k + (bt * Hkv + (h - H)) * hd;
            for (int j = 0; j < half; j++) {
                float x1 = v[j], x2 = v[j + half], sj = sign * s[j];
                v[j] = x1 * c[j] - x2 * sj;
                v[j + half] = x2 * c[j] + x1 * sj;
            }
        }
    }
}

void tera_rope_qk_forward(float *q, float *k, const float *cos_t, const float *sin_t, int B, int T, int H, int Hkv,
                          int hd) {
    rope_apply_qk(q, k, cos_t, sin_t, B, T, H, Hkv, hd, 1.0f);
}

void tera_rope_qk_backward(float *dq, float *dk, const float *cos_t, const float *sin_t, int B, int T, int H,
                           int Hkv, int hd) {
    rope_apply_qk(dq, dk, cos_t, sin_t, B, T, H, Hkv, hd, -1.0f);
}

void tera_rope_forward(float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd) {
    rope_apply(x, cos_t, sin_t, B, T, nh, hd, 1.0f);
}

void tera_rope_backward(float *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd) {
    rope_apply(dx, cos_t, sin_t, B, T, nh, hd, -1.0f);
}

/* ---------------------------------------------------------------- SwiGLU */

void tera_swiglu_forward(float *restrict g, const float *restrict a1, const float *restrict a3, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) g[i] = tera_silu(a1[i]) * a3[i];
}

void tera_swiglu_backward(float *restrict da1, float *restrict da3, const float *restrict dg,
                          const float *restrict a1, const float *restrict a3, int64_t n) {
    /* silu(a) = a*s(a); silu'(a) = s(a) * (1 + a*(1 - s(a))) */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float s = tera_sigmoid(a1[i]);
        float silu = a1[i] * s;
        da3[i] = dg[i] * silu;
        da1[i] = dg[i] * a3[i] * s * (1.0f + a1[i] * (1.0f - s));
    }
}

/* ------------------------------------------------ bf16 copies written by the producers (cpu.h) */

/* the products' rounding (include/tera/bf16.h), here on values the caller has just written (in cache) */
static void rne_row(uint16_t *restrict d, const float *restrict s, int64_t n) { tera_bf16_rne_n(d, s, n); }

/* RMSNorm's forward with the bf16 copy of y (the next products' input: q/k/v, the LM head) */
void tera_rmsnorm_forward_bf16(float *restrict y, uint16_t *restrict y16, float *restrict rstd,
                               const float *restrict x, const float *restrict w, int64_t N, int64_t D, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float *yr = y + n * D;
        float r = 1.0f / sqrtf(tera_sum_sq(xr, D) / (float)D + eps);
        rstd[n] = r;
        if (n + 1 < N) row_prefetch(xr + D, D, 0);
        for (int64_t d = 0; d < D; d++) yr[d] = w[d] * (xr[d] * r);
        if (y16) rne_row(y16 + n * D, yr, D);
    }
}

/* The SwiGLU passes in blocks of PROD_BLOCK elements: each block's fp32 outputs by the loop body of
 * tera_swiglu_forward / backward (the same operations, so the same bits), then their rounding while
 * they are in L1. */
#define PROD_BLOCK 512

void tera_swiglu_forward_bf16(float *restrict g, uint16_t *restrict g16, const float *restrict a1,
                              const float *restrict a3, int64_t n) {
    if (!g16) {
        tera_swiglu_forward(g, a1, a3, n);
        return;
    }
    const int64_t nb = (n + PROD_BLOCK - 1) / PROD_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i0 = b * PROD_BLOCK, i1 = i0 + PROD_BLOCK < n ? i0 + PROD_BLOCK : n;
        for (int64_t i = i0; i < i1; i++) g[i] = tera_silu(a1[i]) * a3[i];
        rne_row(g16 + i0, g + i0, i1 - i0);
    }
}

void tera_swiglu_forward_to_bf16(uint16_t *restrict g16, const float *restrict a1, const float *restrict a3, int64_t n) {
    const int64_t nb = (n + PROD_BLOCK - 1) / PROD_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i0 = b * PROD_BLOCK, i1 = i0 + PROD_BLOCK < n ? i0 + PROD_BLOCK : n;
        float g[PROD_BLOCK]; /* the block's fp32 g, in L1 only */
        for (int64_t i = i0; i < i1; i++) g[i - i0] = tera_silu(a1[i]) * a3[i];
        rne_row(g16 + i0, g, i1 - i0);
    }
}

void tera_swiglu_backward_bf16(float *restrict da1, float *restrict da3, uint16_t *restrict da1_16,
                               uint16_t *restrict da3_16, const float *restrict dg, const float *restrict a1,
                               const float *restrict a3, int64_t n) {
    if (!da1_16 || !da3_16) {
        tera_swiglu_backward(da1, da3, dg, a1, a3, n);
        return;
    }
    const int64_t nb = (n + PROD_BLOCK - 1) / PROD_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i0 = b * PROD_BLOCK, i1 = i0 + PROD_BLOCK < n ? i0 + PROD_BLOCK : n;
        for (int64_t i = i0; i < i1; i++) {
            float s = tera_sigmoid(a1[i]);
            float silu = a1[i] * s;
            da3[i] = dg[i] * silu;
            da1[i] = dg[i] * a3[i] * s * (1.0f + a1[i] * (1.0f - s));
        }
        rne_row(da1_16 + i0, da1 + i0, i1 - i0);
        rne_row(da3_16 + i0, da3 + i0, i1 - i0);
    }
}

/* ---------------------------------------------------------------- embedding */

void tera_embedding_forward(float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) memcpy(x + n * D, table + (int64_t)tokens[n] * D, sizeof(float) * (size_t)D);
}

void tera_embedding_backward(float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D) {
    const int64_t nblk = (D + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t d0 = blk * COL_BLOCK, d1 = d0 + COL_BLOCK < D ? d0 + COL_BLOCK : D;
        for (int64_t n = 0; n < N; n++) {
            float *dst = dtable + (int64_t)tokens[n] * D;
            for (int64_t d = d0; d < d1; d++) dst[d] += dx[n * D + d];
        }
    }
}

/* ---------------------------------------------------------------- softmax / cross-entropy */

static float row_lse(const float *restrict r, int64_t V) {
    const float mx = tera_max(r, V);
    return mx + logf(tera_sum_exp(r, V, mx));
}

void tera_softmax_forward(float *restrict probs, float *restrict lse, const float *restrict logits,
                          int64_t N, int64_t E) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * E;
        float l = row_lse(r, E);
        lse[n] = l;
        for (int64_t e = 0; e < E; e++) probs[n * E + e] = tera_vexpf(r[e] - l);
    }
}

void tera_softmax_backward(float *restrict dlogits, const float *restrict dprobs,
                           const float *restrict probs, int64_t N, int64_t E) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E, *dp = dprobs + n * E;
        const float dot = tera_dot(dp, p, E);
        for (int64_t e = 0; e < E; e++) dlogits[n * E + e] = p[e] * (dp[e] - dot);
    }
}

/* Cross-entropy with one exponential per logit: e = exp(x - max) is written to the gradient's memory
 * while it is summed (exp_row: 16 lanes in tera_sum_exp's order, so the sum and the lse are the
 * forward's bit for bit), then that memory alone is scaled by scale / sum (scale_row, in cache):
 * dlogits = e * (scale / sum) - scale * onehot, from the very exponentials the loss summed. */

/* out[i] = exp(x[i] - mx) (out may be x); returns their sum in tera_sum_exp's order. next (NULL:
 * none): the row the caller takes after this one, n floats, fetched into the cache a line per 16
 * exponentials, so that its max pass reads from the cache instead of waiting on memory (the rows are
 * consecutive, but the hardware prefetcher runs only a few lines ahead of the max pass and idles
 * during this one; measured in docs/PERFORMANCE.md, wave 22). The same bits. */
static float exp_row(float *out, const float *x, int64_t n, float mx, const float *next) {
    float acc[TERA_LANES] = {0};
    int64_t i = 0;
#ifdef TERA_VEXPF16
    _Static_assert(TERA_LANES == 16, "one vector of lane sums");
    __m512 vacc = _mm512_setzero_ps();
    const __m512 vmx = _mm512_set1_ps(mx);
    for (; i + TERA_LANES <= n; i += TERA_LANES) {
        if (next) __builtin_prefetch(next + i, 0, 3);
        const __m512 e = tera_vexpf16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmx));
        vacc = _mm512_add_ps(vacc, e);
        _mm512_storeu_ps(out + i, e); /* after the load: out may be x */
    }
    _mm512_storeu_ps(acc, vacc);
#else
    for (; i + TERA_LANES <= n; i += TERA_LANES) {
        if (next) __builtin_prefetch(next + i, 0, 3);
        float e[TERA_LANES];
        for (int l = 0; l < TERA_LANES; l++) e[l] = tera_vexpf(x[i + l] - mx);
        for (int l = 0; l < TERA_LANES; l++) acc[l] += e[l];
        memcpy(out + i, e, sizeof e); /* after the loads: out may be x */
    }
#endif
    for (; i < n; i++) {
        const float e = tera_vexpf(x[i] - mx);
        acc[i % TERA_LANES] += e;
        out[i] = e;
    }
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

/* d[i] = e[i] * k: d is e, or does not overlap it (two loops, each vectorised without an alias check) */
static void scale_copy(float *restrict d, const float *restrict e, int64_t n, float k) {
    for (int64_t i = 0; i < n; i++) d[i] = e[i] * k;
}
static void scale_row(float *d, const float *e, int64_t n, float k) {
    if (d != e) {
        scale_copy(d, e, n, k);
        return;
    }
    for (int64_t i = 0; i < n; i++) d[i] *= k;
}

/* one row of the whole vocabulary: d[V] = scale * (softmax(r) - onehot(t)) (d may be r); returns the
 * row's lse (= row_lse(r, V), the same bits); next: the following row of logits (exp_row), or NULL */
static float ce_row(float *d, const float *r, int64_t V, int64_t t, float scale, const float *next) {
    const float mx = tera_max(r, V);
    const float s = exp_row(d, r, V, mx, next);
    scale_row(d, d, V, scale / s);
    d[t] -= scale;
    return mx + logf(s);
}

double tera_ce_forward(float *lse, const float *logits, const int32_t *targets, int64_t N, int64_t V) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) lse[n] = row_lse(logits + n * V, V);
    double sum = 0.0; /* fixed order: independent of the thread count */
    for (int64_t n = 0; n < N; n++) sum += (double)lse[n] - (double)logits[n * V + targets[n]];
    return sum;
}

void tera_ce_backward(float *dlogits, const float *logits, const int32_t *targets, int64_t N, int64_t V,
                      float scale) {
    tera_ce_backward_bf16(dlogits, NULL, logits, targets, N, V, scale); /* cpu.h: no bf16 copy */
}

/* ------------------------------------------------------------- vocabulary-parallel pieces */

void tera_embedding_forward_range(float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D,
                                  int64_t v0, int64_t Vl) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t v = (int64_t)tokens[n] - v0;
        if (v >= 0 && v < Vl)
            memcpy(x + n * D, table + v * D, sizeof(float) * (size_t)D);
        else
            memset(x + n * D, 0, sizeof(float) * (size_t)D);
    }
}

void tera_embedding_backward_range(float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D,
                                   int64_t v0, int64_t Vl) {
    const int64_t nblk = (D + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t d0 = blk * COL_BLOCK, d1 = d0 + COL_BLOCK < D ? d0 + COL_BLOCK : D;
        for (int64_t n = 0; n < N; n++) {
            const int64_t v = (int64_t)tokens[n] - v0;
            if (v < 0 || v >= Vl) continue;
            float *dst = dtable + v * D;
            for (int64_t d = d0; d < d1; d++) dst[d] += dx[n * D + d];
        }
    }
}

void tera_ce_slice_max(float *rowmax, const float *logits, int64_t N, int64_t Vl) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) rowmax[n] = tera_max(logits + n * Vl, Vl);
}

void tera_ce_slice_sums(float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax,
                        const int32_t *targets, int64_t N, int64_t Vl, int64_t v0) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * Vl;
        const int64_t t = (int64_t)targets[n] - v0;
        tlogit[n] = t >= 0 && t < Vl ? r[t] : 0.0f; /* before e (may be logits) is written */
        sumexp[n] = e ? exp_row(e + n * Vl, r, Vl, rowmax[n], n + 1 < N ? r + Vl : NULL) : tera_sum_exp(r, Vl, rowmax[n]);
    }
}

void tera_ce_backward_range(float *dlogits, const float *e, const float *sumexp, const int32_t *targets,
                            int64_t N, int64_t Vl, int64_t v0, float scale) {
    tera_ce_backward_range_bf16(dlogits, NULL, e, sumexp, targets, N, Vl, v0, scale); /* cpu.h: no bf16 copy */
}

/* Forward and backward in one pass over each row of the logits (ce_row): the row's max, its
 * exponentials written to dlogits and summed (lse, as tera_ce_forward), its target logit kept in
 * tlogit, then dlogits scaled while the row is still in cache (as tera_ce_backward): the same
 * operations per element as the two separate calls, so the same bits, with the logits read from
 * memory once and one exponential per logit. */
double tera_ce_fused(float *dlogits, float *lse, float *tlogit, const float *logits, const int32_t *targets,
                     int64_t N, int64_t V, float scale) {
    return tera_ce_fused_bf16(dlogits, NULL, lse, tlogit, logits, targets, N, V, scale); /* cpu.h: no bf16 copy */
}

/* The cross-entropy passes of the loss gradient (tera_ce_fused / tera_ce_backward /
 * tera_ce_backward_range call these with d16 NULL) with its bf16 copy (cpu.h): each row of dlogits,
 * then, where d16 is given, its rounding into d16 while the row is in cache. */
double tera_ce_fused_bf16(float *dlogits, uint16_t *d16, float *lse, float *tlogit, const float *logits,
                          const int32_t *targets, int64_t N, int64_t V, float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * V;
        const int64_t t = targets[n];
        tlogit[n] = r[t]; /* before dlogits (may be logits) is written */
        lse[n] = ce_row(dlogits + n * V, r, V, t, scale, n + 1 < N ? r + V : NULL);
        if (d16) rne_row(d16 + n * V, dlogits + n * V, V);
    }
    double sum = 0.0; /* fixed order, as tera_ce_forward */
    for (int64_t n = 0; n < N; n++) sum += (double)lse[n] - (double)tlogit[n];
    return sum;
}

void tera_ce_backward_bf16(float *dlogits, uint16_t *d16, const float *logits, const int32_t *targets, int64_t N,
                           int64_t V, float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        ce_row(dlogits + n * V, logits + n * V, V, targets[n], scale, n + 1 < N ? logits + (n + 1) * V : NULL);
        if (d16) rne_row(d16 + n * V, dlogits + n * V, V);
    }
}

void tera_ce_backward_range_bf16(float *dlogits, uint16_t *d16, const float *e, const float *sumexp,
                                 const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *d = dlogits + n * Vl;
        scale_row(d, e + n * Vl, Vl, scale / sumexp[n]);
        const int64_t t = (int64_t)targets[n] - v0;
        if (t >= 0 && t < Vl) d[t] -= scale;
        if (d16) rne_row(d16 + n * Vl, d, Vl);
    }
}
