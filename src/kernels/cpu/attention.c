/* Causal grouped-query attention, tiled flash-style (FlashAttention-2 schedule) on the CPU.
 *
 * Forward: for each (b, h, query tile) the key tiles up to the diagonal are visited in order;
 * S = Q K^T * scale and O += P V are oneDNN sgemm calls reading q/k/v in place through their row
 * strides (H*hd, Hkv*hd), so nothing is transposed or copied. The softmax is online: running row
 * max m and sum l, O rescaled when m grows; O is accumulated directly in `out`. Only the diagonal
 * tile is masked.
 *
 * Backward: P is recomputed from q, k and the saved lse. Work is split over (b, kv head): one
 * thread owns a kv head's dK/dV and the dQ of its whole query-head group, so GQA needs no atomics
 * and every output element is reduced in a fixed order: bit-identical results for any thread count.
 *
 * Memory: per thread two TILE x TILE blocks (+ 2 TILE floats); the backward also keeps
 * D = rowsum(dO * O) for all rows, B*H*T floats. Never a T x T matrix.
 *
 * Inside the OpenMP region each sgemm runs single-threaded (nested parallelism is off).
 * The kernels run omp_get_max_threads() threads, so the scratch must be sized (by
 * tera_attention_scratch_floats) under a thread count at least as large as at the call. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "tera/kernels.h"
#include "vmath.h"
#include "tera/status.h"

/* Query and key tile edge. With bench/bench_attention.c on one AVX-512 core, 128 gave a forward
 * 3-10% faster than 64 (sgemm runs at ~160 GFLOP/s on 128x128x32 products but ~125 on 64x64x32,
 * which outweighs the extra masked work on the diagonal) and an equal backward. */
#ifndef ATTN_TILE /* overridable (-DATTN_TILE=64) only to re-measure */
#define ATTN_TILE 128
#endif
/* Per-thread scratch: S/P block, dP/dS block, running max and sum (a multiple of 16 floats). */
#define ATTN_THREAD_FLOATS ((size_t)(2 * ATTN_TILE * ATTN_TILE + 2 * ATTN_TILE))

/* Fixed-order reductions over n floats with 16 independent lanes (GCC vectorises the lane loop
 * without -ffast-math; the order does not depend on anything but n). */
static float row_max(const float *restrict x, int n) {
    float acc[16];
    for (int u = 0; u < 16; u++) acc[u] = -INFINITY;
    int c = 0;
    for (; c + 16 <= n; c += 16)
        for (int u = 0; u < 16; u++) acc[u] = x[c + u] > acc[u] ? x[c + u] : acc[u];
    for (int u = 0; c + u < n; u++) acc[u] = x[c + u] > acc[u] ? x[c + u] : acc[u];
    float m = acc[0];
    for (int u = 1; u < 16; u++) m = acc[u] > m ? acc[u] : m;
    return m;
}

static float row_sum(const float *restrict x, int n) {
    float acc[16] = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16)
        for (int u = 0; u < 16; u++) acc[u] += x[c + u];
    for (int u = 0; c + u < n; u++) acc[u] += x[c + u];
    float s = 0.0f;
    for (int u = 0; u < 16; u++) s += acc[u];
    return s;
}

/* x[c] = exp(x[c] - m) for c < n */
static void row_exp_sub(float *restrict x, int n, float m) {
    for (int c = 0; c < n; c++) x[c] = tera_vexpf(x[c] - m);
}

static int n_tiles(int T) { return (T + ATTN_TILE - 1) / ATTN_TILE; }

size_t tera_attention_scratch_floats(int B, int T, int H, int Hkv, int hd) {
    /* the per-thread blocks for omp_get_max_threads() threads, then D[B,H,T] for the backward;
     * the head counts and width do not enter (the output accumulates in place) */
    (void)Hkv, (void)hd;
    return (size_t)omp_get_max_threads() * ATTN_THREAD_FLOATS + (size_t)B * H * T;
}

/* One (b, h, query tile): out rows [t0, t0+nq) of head h and their lse. */
static void forward_tile(float *out, float *lse, const float *q, const float *k, const float *v, int b,
                         int h, int qt, int T, int H, int Hkv, int hd, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int kvh = h / (H / Hkv);
    const float scale = 1.0f / sqrtf((float)hd);
    const int t0 = qt * ATTN_TILE;
    const int nq = T - t0 < ATTN_TILE ? T - t0 : ATTN_TILE;
    float *S = ws;                              /* [nq, ATTN_TILE] */
    float *m = ws + 2 * ATTN_TILE * ATTN_TILE;  /* running row max */
    float *l = m + ATTN_TILE;                   /* running row sum */
    const float *qi = q + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
    float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;

    for (int kt = 0; kt <= qt; kt++) {
        const int s0 = kt * ATTN_TILE;
        const int nk = T - s0 < ATTN_TILE ? T - s0 : ATTN_TILE;
        const float *kj = k + ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd;
        const float *vj = v + ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd;
        /* S = scale * Q_i K_j^T */
        tera_gemm(0, 1, nq, nk, hd, scale, qi, ldq, kj, ldk, 0.0f, S, ATTN_TILE);
        const int diag = kt == qt;
        for (int r = 0; r < nq; r++) {
            float *restrict Sr = S + (int64_t)r * ATTN_TILE;
            /* on the diagonal tile (t0 == s0) row r sees keys 0..r */
            const int n = diag ? r + 1 : nk;
            const float mt = row_max(Sr, n);
            if (kt == 0) {
                m[r] = mt;
                row_exp_sub(Sr, n, mt);
                l[r] = row_sum(Sr, n);
            } else {
                const float mn = mt > m[r] ? mt : m[r];
                const float alpha = expf(m[r] - mn);
                m[r] = mn;
                row_exp_sub(Sr, n, mn);
                l[r] = l[r] * alpha + row_sum(Sr, n);
                if (alpha != 1.0f) {
                    float *restrict o = oi + (int64_t)r * ldq;
                    for (int d = 0; d < hd; d++) o[d] *= alpha;
                }
            }
            for (int c = n; c < nk; c++) Sr[c] = 0.0f;
        }
        /* O (+)= P V_j, accumulated in place in out */
        tera_gemm(0, 0, nq, hd, nk, 1.0f, S, ATTN_TILE, vj, ldk, kt == 0 ? 0.0f : 1.0f, oi, ldq);
    }
    float *lse_row = lse + ((int64_t)b * H + h) * T + t0;
    for (int r = 0; r < nq; r++) {
        const float inv = 1.0f / l[r];
        float *restrict o = oi + (int64_t)r * ldq;
        for (int d = 0; d < hd; d++) o[d] *= inv;
        lse_row[r] = m[r] + logf(l[r]);
    }
}

void tera_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                            int B, int T, int H, int Hkv, int hd, float *scratch) {
    TERA_ASSERTF(B >= 0 && T >= 0 && H > 0 && Hkv > 0 && hd > 0 && H % Hkv == 0,
                 "attention: bad shape B=%d T=%d H=%d Hkv=%d hd=%d", B, T, H, Hkv, hd);
    if (B == 0 || T == 0) return;
    const int nt = n_tiles(T);
    const int64_t ntask = (int64_t)B * H * nt;
    const int nthr = omp_get_max_threads();
    /* Tasks in reverse query-tile order: the longest (last) tiles start first. Each output row is
     * written by one task, so the result does not depend on the schedule. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr)
    for (int64_t task = 0; task < ntask; task++) {
        const int qt = nt - 1 - (int)(task / ((int64_t)B * H));
        const int bh = (int)(task % ((int64_t)B * H));
        float *ws = scratch + (size_t)omp_get_thread_num() * ATTN_THREAD_FLOATS;
        forward_tile(out, lse, q, k, v, bh / H, bh % H, qt, T, H, Hkv, hd, ws);
    }
}

/* One (b, kv head): dK, dV of that head and dQ of its H/Hkv query heads. */
static void backward_group(float *dq, float *dk, float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *lse, const float *D, int b,
                           int kvh, int T, int H, int Hkv, int hd, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv;
    const float scale = 1.0f / sqrtf((float)hd);
    const int nt = n_tiles(T);
    float *P = ws;                            /* [nq, ATTN_TILE] */
    float *dS = ws + ATTN_TILE * ATTN_TILE;   /* [nq, ATTN_TILE] */

    for (int kt = 0; kt < nt; kt++) {
        const int s0 = kt * ATTN_TILE;
        const int nk = T - s0 < ATTN_TILE ? T - s0 : ATTN_TILE;
        const int64_t koff = ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd;
        const float *kj = k + koff, *vj = v + koff;
        float *dkj = dk + koff, *dvj = dv + koff;
        for (int hh = 0; hh < rep; hh++) {
            const int h = kvh * rep + hh;
            for (int qt = kt; qt < nt; qt++) {
                const int t0 = qt * ATTN_TILE;
                const int nq = T - t0 < ATTN_TILE ? T - t0 : ATTN_TILE;
                const int64_t qoff = ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
                const float *qi = q + qoff, *doi = dout + qoff;
                float *dqi = dq + qoff;
                const float *lse_i = lse + ((int64_t)b * H + h) * T + t0;
                const float *D_i = D + ((int64_t)b * H + h) * T + t0;
                const float first = (hh == 0 && qt == kt) ? 0.0f : 1.0f; /* beta for dK_j, dV_j */
                const int diag = qt == kt;

                /* P = exp(scale * Q_i K_j^T - lse_i), zero above the diagonal */
                tera_gemm(0, 1, nq, nk, hd, scale, qi, ldq, kj, ldk, 0.0f, P, ATTN_TILE);
                for (int r = 0; r < nq; r++) {
                    float *restrict Pr = P + (int64_t)r * ATTN_TILE;
                    const int n = diag ? r + 1 : nk;
                    row_exp_sub(Pr, n, lse_i[r]);
                    for (int c = n; c < nk; c++) Pr[c] = 0.0f;
                }
                /* dV_j (+)= P^T dO_i */
                tera_gemm(1, 0, nk, hd, nq, 1.0f, P, ATTN_TILE, doi, ldq, first, dvj, ldk);
                /* dP = dO_i V_j^T;  dS = P * (dP - D_i) */
                tera_gemm(0, 1, nq, nk, hd, 1.0f, doi, ldq, vj, ldk, 0.0f, dS, ATTN_TILE);
                for (int r = 0; r < nq; r++) {
                    const float *restrict Pr = P + (int64_t)r * ATTN_TILE;
                    float *restrict dSr = dS + (int64_t)r * ATTN_TILE;
                    const float Dr = D_i[r];
                    for (int c = 0; c < nk; c++) dSr[c] = Pr[c] * (dSr[c] - Dr);
                }
                /* dQ_i (+)= scale * dS K_j  (written at the first key tile) */
                tera_gemm(0, 0, nq, hd, nk, scale, dS, ATTN_TILE, kj, ldk, kt == 0 ? 0.0f : 1.0f, dqi,
                          ldq);
                /* dK_j (+)= scale * dS^T Q_i */
                tera_gemm(1, 0, nk, hd, nq, scale, dS, ATTN_TILE, qi, ldq, first, dkj, ldk);
            }
        }
    }
}

void tera_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                             const float *k, const float *v, const float *out, const float *lse,
                             int B, int T, int H, int Hkv, int hd, float *scratch) {
    TERA_ASSERTF(B >= 0 && T >= 0 && H > 0 && Hkv > 0 && hd > 0 && H % Hkv == 0,
                 "attention: bad shape B=%d T=%d H=%d Hkv=%d hd=%d", B, T, H, Hkv, hd);
    if (B == 0 || T == 0) return;
    const int nthr = omp_get_max_threads();
    float *D = scratch + (size_t)nthr * ATTN_THREAD_FLOATS; /* [B,H,T] */
    const int64_t ld = (int64_t)H * hd;
    const int64_t nrow = (int64_t)B * T;
#pragma omp parallel num_threads(nthr)
    {
        /* D[b,h,t] = sum_d dO * O (double accumulation, fixed order) */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < nrow; row++) {
            const int b = (int)(row / T), t = (int)(row % T);
            for (int h = 0; h < H; h++) {
                const float *o = out + row * ld + (int64_t)h * hd;
                const float *g = dout + row * ld + (int64_t)h * hd;
                double s = 0.0;
                for (int d = 0; d < hd; d++) s += (double)o[d] * g[d];
                D[((int64_t)b * H + h) * T + t] = (float)s;
            }
        }
        float *ws = scratch + (size_t)omp_get_thread_num() * ATTN_THREAD_FLOATS;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * Hkv; task++)
            backward_group(dq, dk, dv, dout, q, k, v, lse, D, task / Hkv, task % Hkv, T, H, Hkv, hd, ws);
    }
}
