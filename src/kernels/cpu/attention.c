/* Causal grouped-query attention, tiled flash-style (FlashAttention-2 schedule) on the CPU.
 *
 * fp32 runs register-blocked kernels (products in registers, transposed scores, no masked blocks
 * computed): the AVX-512 ones at the end of this file where the compiler targets AVX-512 ("fp32 on
 * AVX-512"), else attention_avx2.c's 8-lane form of them where it targets AVX2 + FMA (the same bits;
 * AVX-512 builds have both, TERA_ATTN_FP32=avx2|avx512 picks). The sgemm kernels described here are
 * the path of other builds and of TERA_ATTN_FP32=sgemm (cpu.h: tera_cpu_attn_fp32_set).
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
 * Memory: per thread two TILE x TILE blocks (+ 2 TILE floats; the AVX-512 path's per-thread block
 * is larger, a bounded key chunk, see attn_thread_floats); the backward also keeps
 * D = rowsum(dO * O) for all rows, B*H*T floats. Never a T x T matrix, nothing per thread that
 * grows with T.
 *
 * Inside the OpenMP region each sgemm runs single-threaded (nested parallelism is off).
 * The kernels run omp_get_max_threads() threads, so the scratch must be sized (by
 * tera_attention_scratch_floats) under a thread count at least as large as at the call. */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "cpu.h"
#include "tera/bf16.h"
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

/* Tile edge of the register-blocked fp32 kernels, AVX-512 here and AVX2 in attention_avx2.c (query
 * rows and keys; four vectors of 16 rows, eight of 8). */
#define FT ATTN_FP32_TILE
/* Per-thread scratch of either fp32 path: the sgemm path's blocks, or the AVX-512 path's packed
 * Q^T and dO^T tiles [hd, FT], S^T / P^T and dS^T tiles [FT, FT], row vectors, dense row tiles
 * [FT, hdp] (Q, dO, dQ or O) and one key chunk's dense rows (K, V; dK, dV in the backward);
 * hdp = hd rounded up to 16. */
static size_t attn_hdp(int hd) { return (size_t)ATTN_FP32_HDP(hd); }
/* A key chunk's K, V, dK, dV rows (the backward; the forward uses K, V), in floats: 512 KiB, so
 * 512 keys at hd = 64 (bench-m's whole sequence: K and V copied once per head), 256 at hd = 128.
 * A chunk's rows are dense copies: read in place, H*hd-float strides (a power of two) alias in the
 * caches. Results do not depend on it (-DATTN_CHUNK_FLOATS=16384 gave the same bits). */
#ifndef ATTN_CHUNK_FLOATS
#define ATTN_CHUNK_FLOATS 131072
#endif
static int attn_key_chunk(int hd) { /* key tiles per chunk, at least one */
    const size_t n = ATTN_CHUNK_FLOATS / (4 * (size_t)FT * attn_hdp(hd));
    return n > 0 ? (int)n : 1;
}
static size_t attn_thread_floats(int hd) {
    const size_t fwd = (size_t)hd * FT + (size_t)FT * FT + 3 * (size_t)FT + (size_t)FT * attn_hdp(hd) +
                       2 * (size_t)attn_key_chunk(hd) * FT * attn_hdp(hd);
    const size_t bwd = 2 * (size_t)hd * FT + 2 * (size_t)FT * FT + 3 * (size_t)FT * attn_hdp(hd) +
                       4 * (size_t)attn_key_chunk(hd) * FT * attn_hdp(hd);
    const size_t f = fwd > bwd ? fwd : bwd;
    return f > ATTN_THREAD_FLOATS ? f : ATTN_THREAD_FLOATS;
}

size_t tera_attention_scratch_floats(int B, int T, int H, int Hkv, int hd) {
    /* the per-thread blocks for omp_get_max_threads() threads, then D[B,H,T] for the backward;
     * the output accumulates in place */
    (void)Hkv;
    return (size_t)omp_get_max_threads() * attn_thread_floats(hd) + (size_t)B * H * T;
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

static void attention_forward_sgemm(float *out, float *lse, const float *q, const float *k, const float *v,
                                   int B, int T, int H, int Hkv, int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
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
        float *ws = scratch + (size_t)omp_get_thread_num() * attn_thread_floats(hd);
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

static void attention_backward_sgemm(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                    const float *k, const float *v, const float *out, const float *lse,
                                    int B, int T, int H, int Hkv, int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
    if (B == 0 || T == 0) return;
    const int nthr = omp_get_max_threads();
    float *D = scratch + (size_t)nthr * attn_thread_floats(hd); /* [B,H,T] */
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
        float *ws = scratch + (size_t)omp_get_thread_num() * attn_thread_floats(hd);
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * Hkv; task++)
            backward_group(dq, dk, dv, dout, q, k, v, lse, D, task / Hkv, task % Hkv, T, H, Hkv, hd, ws);
    }
}

/* ------------------------------------------------------------------ bf16 on the matrix units
 *
 * The same schedules with the six products of each tile pair (S = Q K^T, O += P V; backward S,
 * dV += P^T dO, dP = dO V^T, dQ += dS K, dK += dS^T Q) as bf16 x bf16 -> fp32 products through
 * oneDNN matmul primitives (AMX tiles where the CPU has them, AVX512-BF16 dot products otherwise).
 * The softmax statistics (row max, sum, lse), P before rounding, dP, D and dS stay fp32; P and dS
 * are rounded to bf16 only as operands of the next product (scale folded into dS first).
 *
 * oneDNN's fast (brgemm) matmul kernels need dense operands, so the call first rounds q, k, v (and
 * dO in the backward) once into head-major bf16 copies [B, heads, T, hd] in the scratch: every tile
 * operand is then a dense block, a key tile's transpose is a stride. Products write dense fp32
 * blocks of per-thread accumulators (O; dK, dV; the dQ of a task's query heads), copied to the
 * strided outputs once. Each product runs single-threaded inside the OpenMP region on primitives
 * created once per shape and thread (a per-thread cache, created for one thread; the JIT code is
 * shared by oneDNN's own primitive cache). The partition into tasks and each task's order of
 * operations are those of the fp32 path, so results are bit-identical for any thread count.
 * The CPU backend runs the bf16 attention where oneDNN reports AMX or the CPU's bf16 dot products
 * are fast (backend_cpu.c; docs/PERFORMANCE.md "Attention in bf16"). Where the AMX tile
 * instructions can be used directly (attn_amx_on) the entry points run the AMX kernels at the end
 * of this file instead (1.5-2x faster than these primitives per tile), elsewhere where the CPU has
 * AVX512-BF16 (attn_dot_on) the dot-product kernels of attention_dot.c (1.1-1.5x faster than these
 * primitives, bench/bench_attention.c); these remain the path under ONEDNN_MAX_CPU_ISA without
 * AVX512-BF16 (tests) and of TERA_ATTN_BF16=onednn (A/B timing). */
#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdlib.h>

/* bf16 tile edge (query and key). Larger than ATTN_TILE's products pay on the matrix units: the
 * fixed cost of a primitive call is spread over more work. bench/bench_attention.c re-measures. */
#ifndef ATTN_BF16_TILE
#define ATTN_BF16_TILE 128
#endif
#define BT ATTN_BF16_TILE

static size_t up16(size_t n) { return (n + 15) & ~(size_t)15; }

static inline float bf16_val(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One row of P: x[c] = exp(x[c] * scale - m) (fp32, kept) and p16[c] = its bf16 rounding for
 * c < n, both 0 for n <= c < nk. Returns the fp32 sum of the exponentials (16 lanes, fixed order). */
/* vexp16, vbf16 (and ATTN_AVX512) from attention_avx512.h */

static float exp_row_bf16(uint16_t *restrict p16, float *restrict x, int n, int nk, float scale, float m) {
#ifdef ATTN_AVX512
    __m512 acc = _mm512_setzero_ps();
    const __m512 vs = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m);
    for (int c = 0; c < nk; c += 16) {
        const int left = n - c;
        const __mmask16 live = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const __mmask16 in = nk - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nk - c)) - 1);
        if (!live) { /* masked (above the diagonal): zeros, no exponentials */
            _mm512_mask_storeu_ps(x + c, in, _mm512_setzero_ps());
            _mm256_mask_storeu_epi16(p16 + c, in, _mm256_setzero_si256());
            continue;
        }
        const __m512 e = _mm512_maskz_mov_ps(live, vexp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, x + c), vs, vm)));
        acc = _mm512_add_ps(acc, e);
        _mm512_mask_storeu_ps(x + c, in, e);
        _mm256_mask_storeu_epi16(p16 + c, in, vbf16(e));
    }
    return _mm512_reduce_add_ps(acc);
#else
    float acc[16] = {0};
    int c = 0;
    for (; c + 16 <= n; c += 16)
        for (int u = 0; u < 16; u++) {
            const float e = tera_vexpf(x[c + u] * scale - m);
            acc[u] += e;
            x[c + u] = e;
            p16[c + u] = tera_bf16_rne(e);
        }
    for (int u = 0; c + u < n; u++) {
        const float e = tera_vexpf(x[c + u] * scale - m);
        acc[u] += e;
        x[c + u] = e;
        p16[c + u] = tera_bf16_rne(e);
    }
    for (c = n; c < nk; c++) x[c] = 0.0f, p16[c] = 0;
    float sum = 0.0f;
    for (int u = 0; u < 16; u++) sum += acc[u];
    return sum;
#endif
}

/* Scratch layout of the bf16 path, in floats (every section starts at a multiple of 16 floats). */
typedef struct {
    size_t q16, k16, v16, do16, D; /* shared: bf16 copies [B,H|Hkv,T,hd] (2 per float), D [B,H,T] */
    size_t threads, per_thread;    /* then one block per thread (block t at threads + t * per_thread): */
    size_t S, dP, P16, dS16, ml, acc1, acc2, dq; /* offsets inside a thread's block */
    size_t total;
} bf_layout;

static bf_layout bf_layout_of(int B, int T, int H, int Hkv, int hd, int nthr) {
    bf_layout L;
    const size_t nq = (size_t)B * T * H * hd, nk = (size_t)B * T * Hkv * hd;
    L.q16 = 0;
    L.k16 = L.q16 + up16((nq + 1) / 2);
    L.v16 = L.k16 + up16((nk + 1) / 2);
    L.do16 = L.v16 + up16((nk + 1) / 2);
    L.D = L.do16 + up16((nq + 1) / 2);
    const size_t shared = L.D + up16((size_t)B * H * T);
    L.S = 0;
    L.dP = L.S + up16((size_t)BT * BT);
    L.P16 = L.dP + up16((size_t)BT * BT);
    L.dS16 = L.P16 + up16((size_t)BT * BT / 2 + 1);
    L.ml = L.dS16 + up16((size_t)BT * BT / 2 + 1);
    L.acc1 = L.ml + up16(2 * (size_t)BT);
    L.acc2 = L.acc1 + up16((size_t)BT * hd);
    L.dq = L.acc2 + up16((size_t)BT * hd);
    L.per_thread = L.dq + up16((size_t)(H / Hkv) * T * hd);
    L.threads = shared;
    L.total = shared + (size_t)nthr * L.per_thread;
    return L;
}

#if DNNL_VERSION_MAJOR == 2
#define HAVE_BF16_ATTENTION 1

/* oneDNN's bf16 GEMM (exported, not in the 2.x public headers; also used by matmul.c): the fallback
 * for a shape whose primitive cannot be created (the same for every thread). */
dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                    float alpha, const uint16_t *A, dnnl_dim_t lda, const uint16_t *B,
                                    dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);

#define BF_CHECK(call)                                                                             \
    do {                                                                                           \
        dnnl_status_t _st = (call);                                                                \
        TERA_ASSERTF(_st == dnnl_success, "oneDNN call failed (status %d): %s", (int)_st, #call);   \
    } while (0)

typedef struct {
    int ta, tb, M, N, K;
    float beta;
    dnnl_primitive_t prim; /* NULL: creation failed, the GEMM fallback runs */
    dnnl_memory_t a, b, c;
} bf_prim;

/* Distinct tile products per thread: a model has at most a dozen (3 kinds x 4 tile shapes). When full
 * (many attention shapes in one process: tests), the oldest entry is replaced, never bypassed:
 * every product of a shape runs the same kernel on every thread, whatever the history. */
#define BF_CACHE 64
typedef struct {
    dnnl_stream_t stream;
    int n, victim;
    bf_prim e[BF_CACHE];
} bf_thread;

/* one cache per OS thread: OpenMP's pool threads keep theirs from call to call, and callers on
 * different threads (two models side by side) never share one. Allocated at a thread's first call
 * and kept on a list (reachable: the primitives live as long as the process, like matmul.c's). */
typedef struct bf_thread_node {
    bf_thread th;
    struct bf_thread_node *next;
} bf_thread_node;
static _Thread_local bf_thread_node *tl_bf;
static bf_thread_node *g_bf_list;
static pthread_mutex_t g_bf_mu = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t g_bf_engine;
static pthread_once_t g_bf_once = PTHREAD_ONCE_INIT;
static void bf_engine_init(void) { BF_CHECK(dnnl_engine_create(&g_bf_engine, dnnl_cpu, 0)); }

static bf_prim *bf_prim_get(bf_thread *th, int ta, int tb, int M, int N, int K, float beta) {
    for (int i = 0; i < th->n; i++) {
        bf_prim *e = &th->e[i];
        if (e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K && e->beta == beta) return e;
    }
    if (!th->stream) BF_CHECK(dnnl_stream_create(&th->stream, g_bf_engine, dnnl_stream_default_flags));
    bf_prim *e;
    if (th->n < BF_CACHE) {
        e = &th->e[th->n++];
    } else {
        e = &th->e[th->victim];
        th->victim = (th->victim + 1) % BF_CACHE;
        if (e->prim) {
            dnnl_primitive_destroy(e->prim);
            dnnl_memory_destroy(e->a);
            dnnl_memory_destroy(e->b);
            dnnl_memory_destroy(e->c);
        }
    }
    *e = (bf_prim){.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .beta = beta};
    /* dense operands: A [M,K] (ta: stored [K,M]), B [K,N] (tb: stored [N,K]), C [M,N] */
    dnnl_memory_desc_t ad, bd, cd;
    dnnl_dims_t adims = {M, K}, bdims = {K, N}, cdims = {M, N};
    dnnl_dims_t as = {ta ? 1 : K, ta ? M : 1}, bs = {tb ? 1 : N, tb ? K : 1}, cs = {N, 1};
    BF_CHECK(dnnl_memory_desc_init_by_strides(&ad, 2, adims, dnnl_bf16, as));
    BF_CHECK(dnnl_memory_desc_init_by_strides(&bd, 2, bdims, dnnl_bf16, bs));
    BF_CHECK(dnnl_memory_desc_init_by_strides(&cd, 2, cdims, dnnl_f32, cs));
    dnnl_matmul_desc_t md;
    BF_CHECK(dnnl_matmul_desc_init(&md, &ad, &bd, NULL, &cd));
    dnnl_primitive_attr_t attr;
    BF_CHECK(dnnl_primitive_attr_create(&attr));
    if (beta != 0.0f) {
        dnnl_post_ops_t po;
        BF_CHECK(dnnl_post_ops_create(&po));
        BF_CHECK(dnnl_post_ops_append_sum(po, beta));
        BF_CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
        dnnl_post_ops_destroy(po);
    }
    /* oneDNN chooses a kernel's blocking (and so its order of sums) for the thread count it sees at
     * creation: created for one thread, as it runs, whatever the region's size (this sets the
     * calling thread's own setting only) */
    const int nthr = omp_get_max_threads();
    omp_set_num_threads(1);
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, &md, attr, g_bf_engine, NULL) == dnnl_success) {
        if (dnnl_primitive_create(&e->prim, pd) != dnnl_success) e->prim = NULL;
        dnnl_primitive_desc_destroy(pd);
    }
    omp_set_num_threads(nthr);
    dnnl_primitive_attr_destroy(attr);
    if (e->prim) {
        BF_CHECK(dnnl_memory_create(&e->a, &ad, g_bf_engine, DNNL_MEMORY_NONE));
        BF_CHECK(dnnl_memory_create(&e->b, &bd, g_bf_engine, DNNL_MEMORY_NONE));
        BF_CHECK(dnnl_memory_create(&e->c, &cd, g_bf_engine, DNNL_MEMORY_NONE));
    }
    return e;
}

/* C[M,N] = op(A) op(B) + beta C; A, B dense bf16 (A [M,K] or, ta, [K,M]; B [K,N] or, tb, [N,K]),
 * C dense fp32 [M,N]; beta 0 or 1. Single-threaded (called inside the OpenMP region). */
static void bf_mm(bf_thread *th, int ta, int tb, int M, int N, int K, const uint16_t *A, const uint16_t *Bm,
                  float beta, float *C) {
    if (M == 0 || N == 0) return;
    bf_prim *e = bf_prim_get(th, ta, tb, M, N, K, beta);
    if (e->prim) {
        BF_CHECK(dnnl_memory_set_data_handle(e->a, (void *)A));
        BF_CHECK(dnnl_memory_set_data_handle(e->b, (void *)Bm));
        BF_CHECK(dnnl_memory_set_data_handle(e->c, C));
        dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c}};
        BF_CHECK(dnnl_primitive_execute(e->prim, th->stream, 3, args));
        BF_CHECK(dnnl_stream_wait(th->stream));
        return;
    }
    BF_CHECK(dnnl_gemm_bf16bf16f32(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A, ta ? M : K, Bm, tb ? K : N,
                                   beta, C, N));
}

static bf_thread *bf_thread_of(void) {
    if (!tl_bf) {
        tl_bf = tera_calloc(1, sizeof *tl_bf);
        pthread_mutex_lock(&g_bf_mu);
        tl_bf->next = g_bf_list;
        g_bf_list = tl_bf;
        pthread_mutex_unlock(&g_bf_mu);
    }
    return &tl_bf->th;
}
#else
#define HAVE_BF16_ATTENTION 0
#endif

/* The bf16 path on AMX tiles directly (the end of this file): where the CPU has AMX-BF16, the OS
 * grants the tile state and oneDNN's ISA (ONEDNN_MAX_CPU_ISA) includes AMX; elsewhere the oneDNN
 * matmul primitives above. */
#if HAVE_BF16_ATTENTION && defined(ATTN_AVX512) && defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define ATTN_AMX 1
static int attn_amx_on(void);
static size_t amx_scratch_floats(int B, int T, int H, int Hkv, int hd, int nthr);
static void attention_forward_amx(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                                  int H, int Hkv, int hd, float *scratch);
static void attention_backward_amx(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                   const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                   int hd, float *scratch);
#endif

/* The bf16 path on AVX512-BF16 dot products (attention_dot.c) where AMX is not used: the CPU has them
 * and oneDNN's ISA (ONEDNN_MAX_CPU_ISA) includes avx512_core_bf16; TERA_ATTN_BF16=onednn keeps the
 * oneDNN primitives (A/B timing). */
#if HAVE_BF16_ATTENTION
static int g_dot_on;
static pthread_once_t g_dot_once = PTHREAD_ONCE_INIT;
static void dot_init(void) {
    const char *e = getenv("TERA_ATTN_BF16");
    g_dot_on = !(e && !strcmp(e, "onednn")) && tera_attention_dot_available();
}
static int attn_dot_on(void) {
    pthread_once(&g_dot_once, dot_init);
    return g_dot_on;
}
#endif

int tera_attention_bf16_available(void) {
#if HAVE_BF16_ATTENTION
    static int on = -1; /* TERA_ATTN_BF16=0 keeps bf16 runs on the fp32 attention (A/B timing) */
    if (on < 0) {
        const char *e = getenv("TERA_ATTN_BF16");
        on = tera_cpu_bf16_native() && !(e && !strcmp(e, "0"));
    }
    return on;
#else
    return 0;
#endif
}

const char *tera_attention_bf16_kernel(void) {
    if (!tera_attention_bf16_available()) return "none";
#ifdef ATTN_AMX
    if (attn_amx_on()) return "amx";
#endif
#if HAVE_BF16_ATTENTION
    if (attn_dot_on()) return "dot";
#endif
    return "onednn";
}

size_t tera_attention_bf16_scratch_floats(int B, int T, int H, int Hkv, int hd) {
    /* also enough for the fp32 kernels, which run where the bf16 ones cannot (and, given this
     * scratch, in tests) */
    size_t n = bf_layout_of(B, T, H, Hkv, hd, omp_get_max_threads()).total;
#ifdef ATTN_AMX
    const size_t a = amx_scratch_floats(B, T, H, Hkv, hd, omp_get_max_threads());
    n = a > n ? a : n;
#endif
    const size_t d = tera_attention_dot_scratch_floats(B, T, H, Hkv, hd, omp_get_max_threads());
    n = d > n ? d : n;
    const size_t f = tera_attention_scratch_floats(B, T, H, Hkv, hd);
    return n > f ? n : f;
}

#if HAVE_BF16_ATTENTION
/* The rows [B*T] of x [B,T,nh,hd] rounded to bf16 into head-major dst [B,nh,T,hd]: row (b,t). */
static void to_head_major_bf16(uint16_t *dst, const float *x, int64_t row, int T, int nh, int hd) {
    const int64_t b = row / T, t = row % T;
    for (int h = 0; h < nh; h++)
        tera_round_bf16(dst + ((b * nh + h) * T + t) * hd, x + (row * nh + h) * hd, hd);
}

static void forward_tile_bf16(float *out, float *lse, const uint16_t *q16, const uint16_t *k16, const uint16_t *v16,
                              int b, int h, int qt, int T, int H, int Hkv, int hd, float *ws, const bf_layout *L,
                              bf_thread *th) {
    const int64_t ldq = (int64_t)H * hd;
    const int kvh = h / (H / Hkv);
    const float scale = 1.0f / sqrtf((float)hd);
    const int t0 = qt * BT;
    const int nq = T - t0 < BT ? T - t0 : BT;
    float *S = ws + L->S;                        /* [nq, nk] */
    uint16_t *P16 = (uint16_t *)(ws + L->P16);   /* [nq, nk] */
    float *m = ws + L->ml, *l = m + BT;          /* running row max and sum */
    float *O = ws + L->acc1;                     /* [nq, hd] */
    const uint16_t *Qi = q16 + (((int64_t)b * H + h) * T + t0) * hd;
    memset(O, 0, sizeof(float) * (size_t)nq * hd);
    for (int kt = 0; kt <= qt; kt++) {
        const int s0 = kt * BT;
        const int nk = T - s0 < BT ? T - s0 : BT;
        const uint16_t *Kj = k16 + (((int64_t)b * Hkv + kvh) * T + s0) * hd;
        const uint16_t *Vj = v16 + (((int64_t)b * Hkv + kvh) * T + s0) * hd;
        bf_mm(th, 0, 1, nq, nk, hd, Qi, Kj, 0.0f, S); /* S = Q_i K_j^T (unscaled) */
        const int diag = kt == qt;
        for (int r = 0; r < nq; r++) {
            float *restrict Sr = S + (int64_t)r * nk;
            const int n = diag ? r + 1 : nk;
            const float mt = row_max(Sr, n) * scale; /* = the max of the scaled row (scale > 0) */
            if (kt == 0) {
                m[r] = mt;
                l[r] = exp_row_bf16(P16 + (int64_t)r * nk, Sr, n, nk, scale, mt);
            } else {
                const float mn = mt > m[r] ? mt : m[r];
                const float alpha = expf(m[r] - mn);
                m[r] = mn;
                l[r] = l[r] * alpha + exp_row_bf16(P16 + (int64_t)r * nk, Sr, n, nk, scale, mn);
                if (alpha != 1.0f) {
                    float *restrict o = O + (int64_t)r * hd;
                    for (int d = 0; d < hd; d++) o[d] *= alpha;
                }
            }
        }
        bf_mm(th, 0, 0, nq, hd, nk, P16, Vj, 1.0f, O); /* O += P V_j */
    }
    float *lse_row = lse + ((int64_t)b * H + h) * T + t0;
    float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
    for (int r = 0; r < nq; r++) {
        const float inv = 1.0f / l[r];
        const float *restrict o = O + (int64_t)r * hd;
        float *restrict y = oi + (int64_t)r * ldq;
        for (int d = 0; d < hd; d++) y[d] = o[d] * inv;
        lse_row[r] = m[r] + logf(l[r]);
    }
}
#endif

void tera_attention_forward_bf16(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                 int T, int H, int Hkv, int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
#if HAVE_BF16_ATTENTION
    if (B == 0 || T == 0) return;
#ifdef ATTN_AMX
    if (attn_amx_on()) {
        attention_forward_amx(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
        return;
    }
#endif
    if (attn_dot_on()) {
        tera_attention_forward_dot(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
        return;
    }
    pthread_once(&g_bf_once, bf_engine_init);
    const int nthr = omp_get_max_threads();
    const bf_layout L = bf_layout_of(B, T, H, Hkv, hd, nthr);
    uint16_t *q16 = (uint16_t *)(scratch + L.q16), *k16 = (uint16_t *)(scratch + L.k16);
    uint16_t *v16 = (uint16_t *)(scratch + L.v16);
    float *blocks = scratch + L.threads;
    const int nt = (T + BT - 1) / BT;
    const int64_t ntask = (int64_t)B * H * nt, nrow = (int64_t)B * T;
#pragma omp parallel num_threads(nthr)
    {
#pragma omp for schedule(static)
        for (int64_t row = 0; row < nrow; row++) {
            to_head_major_bf16(q16, q, row, T, H, hd);
            to_head_major_bf16(k16, k, row, T, Hkv, hd);
            to_head_major_bf16(v16, v, row, T, Hkv, hd);
        }
        const int t = omp_get_thread_num();
        float *ws = blocks + (size_t)t * L.per_thread;
        bf_thread *th = bf_thread_of();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int qt = nt - 1 - (int)(task / ((int64_t)B * H));
            const int bh = (int)(task % ((int64_t)B * H));
            forward_tile_bf16(out, lse, q16, k16, v16, bh / H, bh % H, qt, T, H, Hkv, hd, ws, &L, th);
        }
    }
#else
    tera_attention_forward(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
#endif
}

#if HAVE_BF16_ATTENTION
static void backward_group_bf16(float *dq, float *dk, float *dv, const uint16_t *q16, const uint16_t *k16,
                                const uint16_t *v16, const uint16_t *do16, const float *lse, const float *D, int b,
                                int kvh, int T, int H, int Hkv, int hd, float *ws, const bf_layout *L,
                                bf_thread *th) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv;
    const float scale = 1.0f / sqrtf((float)hd);
    const int nt = (T + BT - 1) / BT;
    float *P = ws + L->S, *dP = ws + L->dP;        /* [nq, nk] fp32 */
    uint16_t *P16 = (uint16_t *)(ws + L->P16);     /* [nq, nk] bf16 */
    uint16_t *dS16 = (uint16_t *)(ws + L->dS16);   /* [nq, nk] bf16 (scaled) */
    float *dKa = ws + L->acc1, *dVa = ws + L->acc2; /* [nk, hd] */
    float *dQa = ws + L->dq;                       /* [rep, T, hd] */
    memset(dQa, 0, sizeof(float) * (size_t)rep * T * hd);
    for (int kt = 0; kt < nt; kt++) {
        const int s0 = kt * BT;
        const int nk = T - s0 < BT ? T - s0 : BT;
        const uint16_t *Kj = k16 + (((int64_t)b * Hkv + kvh) * T + s0) * hd;
        const uint16_t *Vj = v16 + (((int64_t)b * Hkv + kvh) * T + s0) * hd;
        memset(dKa, 0, sizeof(float) * (size_t)nk * hd);
        memset(dVa, 0, sizeof(float) * (size_t)nk * hd);
        for (int hh = 0; hh < rep; hh++) {
            const int h = kvh * rep + hh;
            for (int qt = kt; qt < nt; qt++) {
                const int t0 = qt * BT;
                const int nq = T - t0 < BT ? T - t0 : BT;
                const int64_t qoff = (((int64_t)b * H + h) * T + t0) * hd;
                const uint16_t *Qi = q16 + qoff, *dOi = do16 + qoff;
                const float *lse_i = lse + ((int64_t)b * H + h) * T + t0;
                const float *D_i = D + ((int64_t)b * H + h) * T + t0;
                const int diag = qt == kt;
                /* P = exp(scale * Q_i K_j^T - lse_i), zero above the diagonal */
                bf_mm(th, 0, 1, nq, nk, hd, Qi, Kj, 0.0f, P);
                for (int r = 0; r < nq; r++)
                    exp_row_bf16(P16 + (int64_t)r * nk, P + (int64_t)r * nk, diag ? r + 1 : nk, nk, scale, lse_i[r]);
                bf_mm(th, 1, 0, nk, hd, nq, P16, dOi, 1.0f, dVa); /* dV_j += P^T dO_i */
                bf_mm(th, 0, 1, nq, nk, hd, dOi, Vj, 0.0f, dP);   /* dP = dO_i V_j^T */
                for (int r = 0; r < nq; r++) { /* dS = scale * P * (dP - D_i), rounded */
                    const float *restrict Pr = P + (int64_t)r * nk, *restrict dPr = dP + (int64_t)r * nk;
                    uint16_t *restrict dSr = dS16 + (int64_t)r * nk;
                    const float Dr = D_i[r];
                    for (int c = 0; c < nk; c++) dSr[c] = tera_bf16_rne(scale * (Pr[c] * (dPr[c] - Dr)));
                }
                bf_mm(th, 0, 0, nq, hd, nk, dS16, Kj, 1.0f, dQa + ((int64_t)hh * T + t0) * hd); /* dQ_i += dS K_j */
                bf_mm(th, 1, 0, nk, hd, nq, dS16, Qi, 1.0f, dKa);                         /* dK_j += dS^T Q_i */
            }
        }
        for (int r = 0; r < nk; r++) {
            const int64_t off = ((int64_t)b * T + s0 + r) * ldk + (int64_t)kvh * hd;
            memcpy(dk + off, dKa + (int64_t)r * hd, sizeof(float) * (size_t)hd);
            memcpy(dv + off, dVa + (int64_t)r * hd, sizeof(float) * (size_t)hd);
        }
    }
    for (int hh = 0; hh < rep; hh++)
        for (int t = 0; t < T; t++)
            memcpy(dq + ((int64_t)b * T + t) * ldq + (int64_t)(kvh * rep + hh) * hd, dQa + ((int64_t)hh * T + t) * hd,
                   sizeof(float) * (size_t)hd);
}
#endif

void tera_attention_backward_bf16(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                  const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                  int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
#if HAVE_BF16_ATTENTION
    if (B == 0 || T == 0) return;
#ifdef ATTN_AMX
    if (attn_amx_on()) {
        attention_backward_amx(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
        return;
    }
#endif
    if (attn_dot_on()) {
        tera_attention_backward_dot(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
        return;
    }
    pthread_once(&g_bf_once, bf_engine_init);
    const int nthr = omp_get_max_threads();
    const bf_layout L = bf_layout_of(B, T, H, Hkv, hd, nthr);
    uint16_t *q16 = (uint16_t *)(scratch + L.q16), *k16 = (uint16_t *)(scratch + L.k16);
    uint16_t *v16 = (uint16_t *)(scratch + L.v16), *do16 = (uint16_t *)(scratch + L.do16);
    float *D = scratch + L.D; /* [B,H,T] */
    float *blocks = scratch + L.threads;
    const int64_t ld = (int64_t)H * hd, nrow = (int64_t)B * T;
#pragma omp parallel num_threads(nthr)
    {
#pragma omp for schedule(static)
        for (int64_t row = 0; row < nrow; row++) {
            const int b = (int)(row / T), t = (int)(row % T);
            to_head_major_bf16(do16, dout, row, T, H, hd);
            for (int h = 0; h < H; h++) {
                /* D[b,h,t] = sum_d dO * O (double accumulation, fixed order) with the rounded dO that
                 * dP = dO V^T sees, so that D = rowsum(P * dP) holds for the same dO */
                const float *o = out + row * ld + (int64_t)h * hd;
                const uint16_t *g = do16 + (((int64_t)b * H + h) * T + t) * hd;
                double s = 0.0;
                for (int d = 0; d < hd; d++) s += (double)o[d] * bf16_val(g[d]);
                D[((int64_t)b * H + h) * T + t] = (float)s;
            }
            to_head_major_bf16(q16, q, row, T, H, hd);
            to_head_major_bf16(k16, k, row, T, Hkv, hd);
            to_head_major_bf16(v16, v, row, T, Hkv, hd);
        }
        const int t = omp_get_thread_num();
        float *ws = blocks + (size_t)t * L.per_thread;
        bf_thread *th = bf_thread_of();
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * Hkv; task++)
            backward_group_bf16(dq, dk, dv, q16, k16, v16, do16, lse, D, task / Hkv, task % Hkv, T, H, Hkv, hd, ws,
                                &L, th);
    }
#else
    tera_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
#endif
}

/* ------------------------------------------------------------------ fp32 on AVX-512
 *
 * The schedules of the sgemm path (forward: tasks of (b, h) or (b, h, query tile); backward: one
 * per (b, kv head)) with FT x FT tiles and every product a register-blocked AVX-512 kernel instead
 * of an sgemm call:
 * hd = 32 or 64 makes sgemm's per-call packing and its small K costly, and its rectangles computed
 * the masked half of each diagonal tile. Here the diagonal tile is split into 16-row / 16-key
 * blocks and only blocks at or below the diagonal are computed.
 *
 * Scores are kept transposed, S^T [keys, FT query rows]: with the query rows in the vector lanes
 * the softmax statistics (row max, sum, lse, D) are per-lane vectors and the softmax passes are
 * vertical (no horizontal reductions). Q (scaled by 1/sqrt(hd)) and dO are packed transposed,
 * [hd, FT], once per query tile; K, V, Q, dO are otherwise copied to dense rows (pack_rows).
 * Every product is one form,
 *     out[i][l] (+)= sum_j M[i*si + j*sj] * L[j*ldl + l]     (l in the vector lanes),
 * M broadcast from any strides, L and out rows read / written as vectors:
 *   S^T = K Q^T, dP^T = V dO^T     (i: key, j: head dim, lanes: query rows)
 *   O += P V, dQ += dS K           (i: query row, j: key, lanes: head dim)
 *   dV += P^T dO, dK += dS^T Q     (i: key, j: query row, lanes: head dim)
 * Each output element is a sum in j order, by one task: bit-identical for any thread count, and a
 * head's results do not depend on the other heads (tensor-parallel head splits). The backward visits
 * key chunks outer, (query head, query tile) and the chunk's key tiles inner: every dK, dV element
 * receives its terms in (head, query tile) order, each dQ element in key tile order.
 * The schedule (forward spans, backward groups) is attention_rb.h's, instantiated here on 16 lanes and
 * in attention_avx2.c on 8; this section holds the 16-lane products, packs and vector operations.
 * TERA_ATTN_FP32=sgemm selects the sgemm kernels above (A/B timing; they are also the path of
 * builds without AVX2), TERA_ATTN_FP32=avx2 attention_avx2.c's form of these. */
#ifdef ATTN_AVX512
#define MK_INLINE static inline __attribute__((always_inline))

/* NR rows of out (stride ldo) x NV vectors of lanes (the last masked by `last`); acc: add to out */
MK_INLINE void mk_body(const int NV, const int NR, int J, const float *restrict M, int64_t si, int64_t sj,
                       const float *restrict L, int64_t ldl, float *restrict O, int64_t ldo, int acc,
                       __mmask16 last) {
    __m512 a[16][4];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            a[r][v] = acc ? _mm512_maskz_loadu_ps(v == NV - 1 ? last : (__mmask16)0xffff, O + r * ldo + 16 * v)
                          : _mm512_setzero_ps();
    for (int j = 0; j < J; j++) {
        const float *restrict Lj = L + (int64_t)j * ldl;
        const float *restrict Mj = M + (int64_t)j * sj;
        __m512 l[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            l[v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : (__mmask16)0xffff, Lj + 16 * v);
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            const __m512 b = _mm512_set1_ps(Mj[r * si]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) a[r][v] = _mm512_fmadd_ps(b, l[v], a[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            _mm512_mask_storeu_ps(O + r * ldo + 16 * v, v == NV - 1 ? last : (__mmask16)0xffff, a[r][v]);
}

#define MK_DEF(NV, NR)                                                                                        \
    static void mk_##NV##_##NR(int J, const float *M, int64_t si, int64_t sj, const float *L, int64_t ldl,    \
                               float *O, int64_t ldo, int acc, __mmask16 last) {                             \
        mk_body(NV, NR, J, M, si, sj, L, ldl, O, ldo, acc, last);                                            \
    }
MK_DEF(4, 4)
MK_DEF(3, 4)
MK_DEF(2, 8)
MK_DEF(1, 16)
MK_DEF(4, 1)
MK_DEF(3, 1)
MK_DEF(2, 1)
MK_DEF(1, 1)

/* out[i*ldo + l] (+)= sum_{j<J} M[i*si + j*sj] * L[j*ldl + l] for i < I, l < nl */
static void mk(int I, int J, int nl, const float *M, int64_t si, int64_t sj, const float *L, int64_t ldl, float *O,
               int64_t ldo, int acc) {
    for (int l0 = 0; l0 < nl; l0 += 64) {
        const int w = nl - l0 < 64 ? nl - l0 : 64;
        const int nv = (w + 15) / 16;
        const __mmask16 last = (w & 15) ? (__mmask16)((1u << (w & 15)) - 1) : (__mmask16)0xffff;
        const int nr = nv >= 3 ? 4 : nv == 2 ? 8 : 16;
        const float *Ll = L + l0;
        float *Ol = O + l0;
        int i = 0;
        for (; i + nr <= I; i += nr) {
            const float *Mi = M + (int64_t)i * si;
            float *Oi = Ol + (int64_t)i * ldo;
            switch (nv) {
            case 4: mk_4_4(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            case 3: mk_3_4(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            case 2: mk_2_8(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            default: mk_1_16(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            }
        }
        for (; i < I; i++) {
            const float *Mi = M + (int64_t)i * si;
            float *Oi = Ol + (int64_t)i * ldo;
            switch (nv) {
            case 4: mk_4_1(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            case 3: mk_3_1(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            case 2: mk_2_1(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            default: mk_1_1(J, Mi, si, sj, Ll, ldl, Oi, ldo, acc, last); break;
            }
        }
    }
}

/* Xt[d*FT + r] = mul * x[r*ld + d] for r < n, 0 for n <= r < FT (d < hd) */
static void pack_t(float *restrict Xt, const float *restrict x, int64_t ld, int n, int hd, float mul) {
    const __m512 vm = _mm512_set1_ps(mul);
    for (int r0 = 0; r0 < FT; r0 += 16)
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const __mmask16 cols = lanes_mask(hd - d0);
            __m512 blk[16];
            for (int i = 0; i < 16; i++)
                blk[i] = r0 + i < n ? _mm512_mul_ps(vm, _mm512_maskz_loadu_ps(cols, x + (int64_t)(r0 + i) * ld + d0))
                                    : _mm512_setzero_ps();
            transpose16(blk);
            for (int c = 0; c < 16 && d0 + c < hd; c++) _mm512_storeu_ps(Xt + (int64_t)(d0 + c) * FT + r0, blk[c]);
        }
}

/* dense rows: X[r*hdp + d] = x[r*ld + d] for r < n, d < hd. Tiles read in place through a row
 * stride of H*hd floats (a power of two in every model config) map to a few L1 sets and evict each
 * other; dense copies do not. */
static void pack_rows(float *restrict X, const float *restrict x, int64_t ld, int n, int hd, int64_t hdp) {
    for (int r = 0; r < n; r++)
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const __mmask16 cols = lanes_mask(hd - d0);
            _mm512_mask_storeu_ps(X + r * hdp + d0, cols, _mm512_maskz_loadu_ps(cols, x + r * ld + d0));
        }
}

/* the operations attention_rb.h's schedule uses, on 16 lanes */
#define RB_VL 16
#define RB_FN(name) name##_avx512
typedef __m512 rb_vec;
typedef __mmask16 rb_mask;
static inline rb_vec rb_ld(const float *p) { return _mm512_loadu_ps(p); }
static inline void rb_st(float *p, rb_vec v) { _mm512_storeu_ps(p, v); }
static inline rb_vec rb_set1(float x) { return _mm512_set1_ps(x); }
static inline rb_vec rb_zero(void) { return _mm512_setzero_ps(); }
static inline rb_vec rb_add(rb_vec a, rb_vec b) { return _mm512_add_ps(a, b); }
static inline rb_vec rb_sub(rb_vec a, rb_vec b) { return _mm512_sub_ps(a, b); }
static inline rb_vec rb_mul(rb_vec a, rb_vec b) { return _mm512_mul_ps(a, b); }
static inline rb_vec rb_max(rb_vec a, rb_vec b) { return _mm512_max_ps(a, b); }
static inline rb_vec rb_fmadd(rb_vec a, rb_vec b, rb_vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline rb_vec rb_exp(rb_vec x) { return vexp16(x); }
static inline rb_mask rb_rows(int n) { return lanes_mask(n); }
static inline rb_mask rb_causal(int c, int g) { return causal_mask(c, g, 1); }
static inline rb_mask rb_mask_and(rb_mask a, rb_mask b) { return (rb_mask)(a & b); }
static inline rb_vec rb_ld_or(rb_mask m, const float *p, rb_vec fill) { return _mm512_mask_loadu_ps(fill, m, p); }
static inline rb_vec rb_keep(rb_mask m, rb_vec v) { return _mm512_maskz_mov_ps(m, v); }
static inline rb_vec rb_max_where(rb_mask m, rb_vec a, rb_vec b) { return _mm512_mask_max_ps(a, m, a, b); }

#include "attention_rb.h"


#endif

#if defined(ATTN_AVX512) || defined(ATTN_AVX2)
#define ATTN_RB 1 /* register-blocked fp32 kernels: the AVX-512 ones above and/or attention_avx2.c's */
#endif

/* Which fp32 kernels run: TERA_ATTN_FP32=sgemm|avx2|avx512 in the environment, else the default (the
 * AVX-512 kernels where built, else the AVX2 ones, else sgemm); tera_cpu_attn_fp32_set changes it. */
static int g_fp32_kernel = -1;
static pthread_once_t g_fp32_once = PTHREAD_ONCE_INIT;
static void fp32_kernel_init(void) {
#if defined(ATTN_AVX512)
    g_fp32_kernel = TERA_ATTN_FP32_AVX512;
#elif defined(ATTN_AVX2)
    g_fp32_kernel = TERA_ATTN_FP32_AVX2;
#else
    g_fp32_kernel = TERA_ATTN_FP32_SGEMM;
#endif
    const char *e = getenv("TERA_ATTN_FP32");
    if (!e || !*e) return;
    for (int kk = 0; kk < 3; kk++)
        if (!strcmp(e, tera_cpu_attn_fp32_name(kk))) {
            if (tera_cpu_attn_fp32_available(kk)) g_fp32_kernel = kk;
            else fprintf(stderr, "tera: TERA_ATTN_FP32=%s: not in this build; using %s\n", e,
                         tera_cpu_attn_fp32_name(g_fp32_kernel));
            return;
        }
    fprintf(stderr, "tera: TERA_ATTN_FP32=%s: unknown (sgemm, avx2 or avx512); using %s\n", e,
            tera_cpu_attn_fp32_name(g_fp32_kernel));
}
const char *tera_cpu_attn_fp32_name(int kernel) {
    return kernel == TERA_ATTN_FP32_AVX512 ? "avx512" : kernel == TERA_ATTN_FP32_AVX2 ? "avx2" : "sgemm";
}
int tera_cpu_attn_fp32_available(int kernel) {
    switch (kernel) {
    case TERA_ATTN_FP32_SGEMM: return 1;
#ifdef ATTN_AVX2
    case TERA_ATTN_FP32_AVX2: return 1;
#endif
#ifdef ATTN_AVX512
    case TERA_ATTN_FP32_AVX512: return 1;
#endif
    default: return 0;
    }
}
int tera_cpu_attn_fp32(void) {
    pthread_once(&g_fp32_once, fp32_kernel_init);
    return g_fp32_kernel;
}
int tera_cpu_attn_fp32_set(int kernel) {
    pthread_once(&g_fp32_once, fp32_kernel_init);
    if (!tera_cpu_attn_fp32_available(kernel)) return -1;
    g_fp32_kernel = kernel;
    return 0;
}

#ifdef ATTN_RB
/* one forward task / backward group on the selected register-blocked kernels */
static void rb_forward_span(int kernel, float *out, float *lse, float *lsum, const float *q, const float *k,
                            const float *v, int b, int h, int qa, int qb, int T, int H, int Hkv, int hd, float *ws) {
#ifdef ATTN_AVX512
    if (kernel == TERA_ATTN_FP32_AVX512) {
        forward_span_avx512(out, lse, lsum, q, k, v, b, h, qa, qb, T, H, Hkv, hd, attn_key_chunk(hd), ws);
        return;
    }
#endif
    (void)kernel;
    tera_attn_avx2_forward_span(out, lse, lsum, q, k, v, b, h, qa, qb, T, H, Hkv, hd, attn_key_chunk(hd), ws);
}
static void rb_backward_group(int kernel, float *dq, float *dk, float *dv, const float *dout, const float *q,
                              const float *k, const float *v, const float *lse, const float *D, int b, int kvh, int T,
                              int H, int Hkv, int hd, float *ws) {
#ifdef ATTN_AVX512
    if (kernel == TERA_ATTN_FP32_AVX512) {
        backward_group_avx512(dq, dk, dv, dout, q, k, v, lse, D, b, kvh, T, H, Hkv, hd, attn_key_chunk(hd), ws);
        return;
    }
#endif
    (void)kernel;
    tera_attn_avx2_backward_group(dq, dk, dv, dout, q, k, v, lse, D, b, kvh, T, H, Hkv, hd, attn_key_chunk(hd), ws);
}

/* D[b,h,t] = sum_d dO * O for the row (b, t) (double accumulation, fixed order) */
static void attention_d_row(float *D, const float *out, const float *dout, int64_t row, int T, int H, int hd) {
    const int64_t ld = (int64_t)H * hd;
    const int b = (int)(row / T), t = (int)(row % T);
    for (int h = 0; h < H; h++) {
        const float *o = out + row * ld + (int64_t)h * hd;
        const float *g = dout + row * ld + (int64_t)h * hd;
        double s = 0.0;
        for (int d = 0; d < hd; d++) s += (double)o[d] * g[d];
        D[((int64_t)b * H + h) * T + t] = (float)s;
    }
}
#endif

void tera_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                            int H, int Hkv, int hd, float *scratch) {
#ifdef ATTN_RB
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
    const int kernel = tera_cpu_attn_fp32();
    if (kernel != TERA_ATTN_FP32_SGEMM) {
        if (B == 0 || T == 0) return;
        const int nt = (T + FT - 1) / FT;
        const int nthr = omp_get_max_threads();
        const size_t per = attn_thread_floats(hd);
        float *lsum = scratch + (size_t)nthr * per; /* [B,H,T], the backward's D block */
        /* one task per head when there are enough heads for the threads (K, V copied once per key
         * chunk for all query tiles), else one per (head, query tile), the longest (last) first:
         * the same results either way, each output row written by one task */
        const int per_head = (int64_t)B * H >= 4 * (int64_t)nthr;
        const int64_t ntask = (int64_t)B * H * (per_head ? 1 : nt);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr)
        for (int64_t task = 0; task < ntask; task++) {
            const int qt = per_head ? 0 : nt - 1 - (int)(task / ((int64_t)B * H));
            const int bh = (int)(task % ((int64_t)B * H));
            rb_forward_span(kernel, out, lse, lsum + (int64_t)bh * T, q, k, v, bh / H, bh % H, qt, per_head ? nt : qt + 1, T,
                                H, Hkv, hd, scratch + (size_t)omp_get_thread_num() * per);
        }
        return;
    }
#endif
    attention_forward_sgemm(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
}

void tera_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                             const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv, int hd,
                             float *scratch) {
#ifdef ATTN_RB
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
    const int kernel = tera_cpu_attn_fp32();
    if (kernel != TERA_ATTN_FP32_SGEMM) {
        if (B == 0 || T == 0) return;
        const int nthr = omp_get_max_threads();
        const size_t per = attn_thread_floats(hd);
        float *D = scratch + (size_t)nthr * per; /* [B,H,T] */
        const int64_t nrow = (int64_t)B * T;
#pragma omp parallel num_threads(nthr)
        {
#pragma omp for schedule(static)
            for (int64_t row = 0; row < nrow; row++) attention_d_row(D, out, dout, row, T, H, hd);
            float *ws = scratch + (size_t)omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < B * Hkv; task++)
                rb_backward_group(kernel, dq, dk, dv, dout, q, k, v, lse, D, task / Hkv, task % Hkv, T, H, Hkv, hd, ws);
        }
        return;
    }
#endif
    attention_backward_sgemm(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
}

/* ------------------------------------------------------------------ bf16 on AMX, intrinsics
 *
 * tera_attention_forward_bf16 / backward_bf16 where attn_amx_on(): the fp32 AVX-512 kernels' shape
 * (FT x FT tiles, scores transposed so that the softmax statistics are per-lane vectors and the
 * softmax passes vertical, no 32 x 32 block above the diagonal computed) with the six products as
 * AMX tile products (bf16 x bf16 -> fp32, TDPBF16PS) in this file instead of oneDNN primitive calls.
 * Every product is C[32 x 32] (+)= A B over K steps of 32 (amx_32x32): A bf16 rows, B in the
 * "VNNI" layout (pairs of consecutive K elements side by side in a 32-bit word, [K/2][N][2]).
 *   forward   S^T [keys, rows] = K Q^T      A: K rows,   B: Q^T pairs of head dims (Qv)
 *             O^T [hd, rows]  += V^T P^T    A: V^T,      B: P^T pairs of keys (Pv)
 *   backward  S^T = K Q^T, dP^T = V dO^T    A: K, V rows, B: Qv, dOv
 *             dV [keys, hd]   += P^T dO     A: P^T rows, B: dO pairs of rows (dOr)
 *             dK [keys, hd]   += dS^T Q     A: dS^T,     B: Q pairs of rows (Qr)
 *             dQ^T [hd, rows] += K^T dS^T   A: K^T,      B: dS^T pairs of keys (dSv)
 * Operands are rounded once: K and V (rows, and transposed: V^T forward, K^T backward) into
 * head-major tiles of the scratch by a pass over the kv heads before the tasks; Q and dO once per
 * (head, query tile) in the task. The head dim is padded with zeros to HP (a multiple of 32), keys
 * and rows of a tile to FT (the padding is masked out of P and dS). The softmax statistics, P and
 * dS before rounding, dP and D stay fp32 as in the oneDNN path. Tasks as in the other paths
 * (forward: (b, h, query tile); backward: (b, kv head), which owns dK, dV of the head and the dQ
 * of its query heads); each output element is summed by one task in a fixed order: bit-identical
 * for any thread count. The scratch (amx_scratch_floats) holds the rounded K, V tiles and per
 * thread the tiles of one query tile plus the backward's dK, dV accumulators of one kv head
 * ([T, HP] fp32 each). */
#ifdef ATTN_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

static int amx_hp(int hd) { return (hd + 31) & ~31; }
static int amx_tp(int T) { return (T + FT - 1) / FT * FT; }

typedef struct {
    size_t D, shared; /* D [B*H*T] */
    size_t kr, vr, kt, xt, qv, dov, qr, dor, st, dpt, pa, dsa, sv, ot, mla, dka, dva, per_thread; /* a thread's block */
} amx_layout;

static amx_layout amx_layout_of(int B, int T, int Hkv, int H, int hd) {
    amx_layout L;
    const size_t HP = (size_t)amx_hp(hd), Tp = (size_t)amx_tp(T), FTs = FT;
    (void)Hkv;
    L.D = 0;
    L.shared = L.D + up16((size_t)B * H * T);
    L.kr = 0;                         /* [Tp, HP] bf16 K rows of the task's kv head */
    L.vr = L.kr + Tp * HP / 2;        /* [Tp, HP] bf16 V rows */
    L.kt = L.vr + Tp * HP / 2;        /* [HP, Tp] bf16 K^T (backward), V^T (forward) */
    L.xt = L.kt + Tp * HP / 2;        /* [HP, FT] fp32: a tile transposed (pack_t) */
    L.qv = L.xt + HP * FTs;           /* [HP/2, FT] pairs: Q^T */
    L.dov = L.qv + HP / 2 * FTs;      /* [HP/2, FT] pairs: dO^T */
    L.qr = L.dov + HP / 2 * FTs;      /* [FT/2, HP] pairs: Q rows */
    L.dor = L.qr + FTs / 2 * HP;      /* [FT/2, HP] pairs: dO rows */
    L.st = L.dor + FTs / 2 * HP;      /* [FT, FT] fp32 S^T */
    L.dpt = L.st + FTs * FTs;         /* [FT, FT] fp32 dP^T */
    L.pa = L.dpt + FTs * FTs;         /* [FT, FT] bf16 P^T */
    L.dsa = L.pa + FTs * FTs / 2;     /* [FT, FT] bf16 dS^T */
    L.sv = L.dsa + FTs * FTs / 2;     /* [FT/2, FT] pairs: P^T (forward), dS^T (backward) */
    L.ot = L.sv + FTs * FTs / 2;      /* [HP, FT] fp32 O^T, dQ^T */
    L.mla = L.ot + HP * FTs;          /* [3, FT] running max, sum, rescale */
    L.dka = L.mla + 3 * FTs;          /* [Tp, HP] fp32 dK, dV of a kv head */
    L.dva = L.dka + Tp * HP;
    L.per_thread = L.dva + Tp * HP;
    return L;
}

static size_t amx_scratch_floats(int B, int T, int H, int Hkv, int hd, int nthr) {
    const amx_layout L = amx_layout_of(B, T, Hkv, H, hd);
    return L.shared + (size_t)nthr * L.per_thread;
}

static int g_amx_on;
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;
static void amx_init(void) {
    const char *e = getenv("TERA_ATTN_BF16"); /* "onednn": the oneDNN primitives (A/B timing) */
    if (e && !strcmp(e, "onednn")) return;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return; /* AMX-BF16, AMX-TILE */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return; /* AVX512-BF16 */
    if (!tera_cpu_bf16_fast(NULL)) return;            /* oneDNN's ISA (ONEDNN_MAX_CPU_ISA) without AMX */
    /* the tile state is granted per process (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return;
    g_amx_on = 1;
}
static int attn_amx_on(void) {
    pthread_once(&g_amx_once, amx_init);
    return g_amx_on;
}

/* palette 1, tiles 0-7 of 16 rows x 64 bytes: C 0-3, A 4-5, B 6-7 */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_cfg;
static const amx_cfg g_amx_cfg = {.palette = 1,
                                  .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                  .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
AMX_FN static void amx_begin(void) { _tile_loadconfig(&g_amx_cfg); }
AMX_FN static void amx_end(void) { _tile_release(); }

/* C[32 x 32] fp32 (row stride ldc floats) = (acc ? C : 0) + sum over K steps k in [k0, k1) of
 * A[32 rows, 32 k-th columns] B[k-th 16 pair rows, 32 columns]: A bf16 rows (stride lda elements),
 * B pairs (stride ldb bf16 elements, its second 16 columns at +32). */
AMX_FN __attribute__((noinline)) static void amx_32x32(float *C, int64_t ldc, const uint16_t *A, int64_t lda,
                                                       const uint16_t *Bm, int64_t ldb, int k0, int k1, int acc) {
    const int64_t sc = ldc * 4, sa = lda * 2, sb = ldb * 2;
    __asm__ volatile("" ::: "memory"); /* tile loads are asm without a memory input */
    if (acc) {
        _tile_loadd(0, C, sc);
        _tile_loadd(1, C + 16, sc);
        _tile_loadd(2, C + 16 * ldc, sc);
        _tile_loadd(3, C + 16 * ldc + 16, sc);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int k = k0; k < k1; k++) {
        const uint16_t *a = A + 32 * k, *b = Bm + 16 * k * ldb;
        _tile_loadd(4, a, sa);
        _tile_loadd(5, a + 16 * lda, sa);
        _tile_loadd(6, b, sb);
        _tile_loadd(7, b + 32, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, C, sc);
    _tile_stored(1, C + 16, sc);
    _tile_stored(2, C + 16 * ldc, sc);
    _tile_stored(3, C + 16 * ldc + 16, sc);
    __asm__ volatile("" ::: "memory");
}

/* Rounding to bf16 by the AVX512-BF16 instructions (to nearest even, like tera_bf16_rne, but
 * subnormals flushed to zero: the tile products treat subnormal bf16 inputs as zero anyway, so the
 * products see the same operands). 16 lanes to 16 bf16: */
AMX_FN static inline __m256i cvt16(__m512 a) { return (__m256i)_mm512_cvtneps_pbh(a); }
/* 16 words: the bf16 roundings of lo (low half) and hi (high half), lane by lane */
AMX_FN static inline __m512i pair16(__m512 lo, __m512 hi) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Xv[p*FT + r] = (x[r][2p], x[r][2p+1]) for p < HP/2, r < FT: rows of x (stride ld) rounded, as
 * 32-bit words, transposed 16 x 16 (zero for rows >= n and d >= hd) */
AMX_FN static void pack_qv(uint32_t *restrict Xv, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int r0 = 0; r0 < FT; r0 += 16)
        for (int d0 = 0; d0 < HP; d0 += 32) {
            const __mmask16 lo = lanes_mask(hd - d0), hi = lanes_mask(hd - d0 - 16);
            __m512 blk[16];
            for (int i = 0; i < 16; i++) {
                const float *xr = x + (int64_t)(r0 + i) * ld + d0;
                blk[i] = r0 + i < n ? _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xr + 16),
                                                                                        _mm512_maskz_loadu_ps(lo, xr)))
                                    : _mm512_setzero_ps();
            }
            transpose16(blk);
            for (int p = 0; p < 16; p++) _mm512_storeu_ps((float *)Xv + (int64_t)(d0 / 2 + p) * FT + r0, blk[p]);
        }
}

/* Xr[rp*HP + d] = (x[2rp][d], x[2rp+1][d]) for rp < FT/2, d < HP (rows of x with stride ld; zero for
 * rows >= n and d >= hd) */
AMX_FN static void pack_pairs_rows(uint32_t *restrict Xr, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int rp = 0; rp < FT / 2; rp++)
        for (int d0 = 0; d0 < HP; d0 += 16) {
            const __mmask16 cols = lanes_mask(hd - d0);
            const __m512 a = 2 * rp < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)(2 * rp) * ld + d0) : _mm512_setzero_ps();
            const __m512 b = 2 * rp + 1 < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)(2 * rp + 1) * ld + d0)
                                            : _mm512_setzero_ps();
            _mm512_storeu_si512(Xr + (int64_t)rp * HP + d0, pair16(a, b));
        }
}

/* Key tile kt of kv head (b, kvh), rounded: rows into the head's Kr [Tp, HP] (and V into Vr) at row
 * kt*FT, transposed into KT [HP, Tp] (and V into VT) at column kt*FT; NULL targets skipped; zero
 * padding. Per task into the thread's block: K, V of one head stay in its cache (a pass over all
 * heads before the tasks left them in memory: the tile loads waited on them). */
AMX_FN static void amx_pack_kv(uint16_t *Kr, uint16_t *Vr, uint16_t *KT, uint16_t *VT, const float *k, const float *v, int b,
                        int kvh, int kt, int T, int Hkv, int hd, float *Xt) {
    const int HP = amx_hp(hd), Tp = amx_tp(T);
    const int64_t ldk = (int64_t)Hkv * hd;
    const int s0 = kt * FT, nk = T - s0 < FT ? T - s0 : FT;
    const int64_t koff = ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd;
    for (int w = 0; w < 2; w++) {
        const float *x = (w ? v : k) + koff;
        uint16_t *R = w ? Vr : Kr, *Tt = w ? VT : KT;
        if (R)
            for (int r = 0; r < FT; r++)
                for (int d0 = 0; d0 < HP; d0 += 16) {
                    const __mmask16 cols = lanes_mask(hd - d0);
                    const __m512 a = r < nk ? _mm512_maskz_loadu_ps(cols, x + (int64_t)r * ldk + d0) : _mm512_setzero_ps();
                    _mm256_storeu_si256((__m256i *)(R + (int64_t)(s0 + r) * HP + d0), cvt16(a));
                }
        if (Tt) {
            pack_t(Xt, x, ldk, nk, hd, 1.0f);
            for (int d = 0; d < HP; d++)
                for (int g = 0; g < FT / 16; g++)
                    _mm256_storeu_si256((__m256i *)(Tt + (int64_t)d * Tp + s0 + 16 * g),
                                        cvt16(d < hd ? _mm512_loadu_ps(Xt + (int64_t)d * FT + 16 * g) : _mm512_setzero_ps()));
        }
    }
}

/* out[r][d] = Ot[d][r] * inv[r] for rows r < nq, d < hd (out rows with stride ldo; inv NULL: 1) */
static void amx_store_t(float *out, int64_t ldo, const float *Ot, const float *inv, int nq, int hd) {
    for (int r0 = 0; r0 < nq; r0 += 16)
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const __m512 iv = inv ? _mm512_loadu_ps(inv + r0) : _mm512_set1_ps(1.0f);
            __m512 blk[16];
            for (int c = 0; c < 16; c++)
                blk[c] = d0 + c < hd ? _mm512_mul_ps(_mm512_loadu_ps(Ot + (int64_t)(d0 + c) * FT + r0), iv) : _mm512_setzero_ps();
            transpose16(blk);
            const __mmask16 cols = lanes_mask(hd - d0);
            for (int i = 0; i < 16 && r0 + i < nq; i++) _mm512_mask_storeu_ps(out + (int64_t)(r0 + i) * ldo + d0, cols, blk[i]);
        }
}

/* S^T [FT keys, FT rows] (row stride FT) = A_rows [keys of the tile, HP] x (pairs of Xv)^T; on the
 * diagonal tile the 32 x 32 blocks above it (key block > row block) are skipped */
static void amx_scores(float *St, const uint16_t *Ar, const uint32_t *Xv, int nk, int HP, int diag) {
    const int nks = (nk + 31) / 32;
    for (int i = 0; i < nks; i++)
        for (int j = 0; j < FT / 32; j++) {
            if (diag && i > j) continue;
            amx_32x32(St + (int64_t)32 * i * FT + 32 * j, FT, Ar + (int64_t)32 * i * HP, HP, (const uint16_t *)Xv + 64 * j,
                      2 * FT, 0, HP / 32, 0);
        }
}

/* One (b, h, query tile) */
AMX_FN static void forward_tile_amx(float *out, float *lse, const float *q, const uint16_t *Kh, const uint16_t *VTh, int b,
                                    int h, int qt, int T, int H, int Hkv, int hd, float *ws, const amx_layout *L) {
    const int64_t ldq = (int64_t)H * hd;
    const int HP = amx_hp(hd), Tp = amx_tp(T);
    const float scale = 1.0f / sqrtf((float)hd);
    const __m512 vs = _mm512_set1_ps(scale);
    const int t0 = qt * FT, nq = T - t0 < FT ? T - t0 : FT;
    (void)Hkv;
    float *St = ws + L->st, *Ot = ws + L->ot;
    uint32_t *Qv = (uint32_t *)(ws + L->qv), *Pv = (uint32_t *)(ws + L->sv);
    float *m = ws + L->mla, *l = m + FT, *al = l + FT;
    float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
    pack_qv(Qv, q + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd, ldq, nq, hd, HP);
    for (int g = 0; g < FT / 16; g++) {
        _mm512_storeu_ps(m + 16 * g, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(l + 16 * g, _mm512_setzero_ps());
    }
    /* the tile products run in bursts, O^T's of key tile j with S^T's of tile j+1: the matrix unit
     * was measured to take ~600 cycles to resume after a long vector pass */
    amx_scores(St, Kh, Qv, T < FT ? T : FT, HP, qt == 0); /* S^T = K_0 Q_i^T (unscaled) */
    for (int kt = 0; kt <= qt; kt++) {
        const int s0 = kt * FT, nk = T - s0 < FT ? T - s0 : FT, diag = kt == qt, nks = (nk + 31) / 32;
        /* online softmax, 16 rows a vector: P = exp(scale S - m) into key pairs (zero where masked) */
        for (int g = 0; g < FT / 16; g++) {
            const int cend = diag && 16 * g + 16 < nk ? 16 * g + 16 : nk;
            __m512 mt = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < cend; c++)
                mt = _mm512_mask_max_ps(mt, causal_mask(c, g, diag), mt, _mm512_loadu_ps(St + (int64_t)c * FT + 16 * g));
            const __m512 mo = _mm512_loadu_ps(m + 16 * g);
            const __m512 mn = _mm512_max_ps(mo, _mm512_mul_ps(mt, vs));
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < FT; c += 2) {
                __m512 e[2];
                for (int u = 0; u < 2; u++)
                    e[u] = c + u < cend ? _mm512_maskz_mov_ps(causal_mask(c + u, g, diag),
                                                              vexp16(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)(c + u) * FT + 16 * g), vs, mn)))
                                        : _mm512_setzero_ps();
                sum = _mm512_add_ps(_mm512_add_ps(sum, e[0]), e[1]);
                _mm512_storeu_si512(Pv + (int64_t)(c / 2) * FT + 16 * g, pair16(e[0], e[1]));
            }
            const __m512 alpha = vexp16(_mm512_sub_ps(mo, mn)); /* 0 at the first tile (mo = -inf) */
            _mm512_storeu_ps(m + 16 * g, mn);
            _mm512_storeu_ps(l + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * g), alpha, sum));
            _mm512_storeu_ps(al + 16 * g, alpha);
        }
        if (kt > 0) /* O^T rows (head dims) rescaled, lane by lane */
            for (int d = 0; d < hd; d++)
                for (int g = 0; g < FT / 16; g++) {
                    float *o = Ot + (int64_t)d * FT + 16 * g;
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(al + 16 * g)));
                }
        /* O^T (+)= V_j^T P^T: row block j sees key steps up to its own on the diagonal */
        for (int i = 0; i < HP / 32; i++)
            for (int j = 0; j < FT / 32; j++) {
                const int k1 = diag && j + 1 < nks ? j + 1 : nks;
                amx_32x32(Ot + (int64_t)32 * i * FT + 32 * j, FT, VTh + (int64_t)32 * i * Tp + s0, Tp,
                          (const uint16_t *)Pv + 64 * j, 2 * FT, 0, k1, kt > 0);
            }
        if (kt < qt) { /* S^T = K_{j+1} Q_i^T */
            const int s1 = s0 + FT;
            amx_scores(St, Kh + (int64_t)s1 * HP, Qv, T - s1 < FT ? T - s1 : FT, HP, kt + 1 == qt);
        }
    }
    for (int g = 0; g < FT / 16; g++) /* 1 / l, into al */
        _mm512_storeu_ps(al + 16 * g, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + 16 * g)));
    amx_store_t(oi, ldq, Ot, al, nq, hd);
    float *lse_row = lse + ((int64_t)b * H + h) * T + t0;
    for (int r = 0; r < nq; r++) lse_row[r] = m[r] + logf(l[r]);
}

static void attention_forward_amx(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                                  int H, int Hkv, int hd, float *scratch) {
    const int nthr = omp_get_max_threads();
    const amx_layout L = amx_layout_of(B, T, Hkv, H, hd);
    float *blocks = scratch + L.shared;
    const int nt = amx_tp(T) / FT;
    /* one task per head when there are enough heads for the threads (K, V^T rounded once for all
     * query tiles), else one per (head, query tile), the longest (last) first, rounding the key
     * tiles up to its own: the same results either way, each output row written by one task */
    const int per_head = (int64_t)B * H >= 4 * (int64_t)nthr;
    const int64_t ntask = (int64_t)B * H * (per_head ? 1 : nt);
#pragma omp parallel num_threads(nthr)
    {
        float *ws = blocks + (size_t)omp_get_thread_num() * L.per_thread;
        uint16_t *Kh = (uint16_t *)(ws + L.kr), *VTh = (uint16_t *)(ws + L.kt);
        amx_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            const int qa = per_head ? 0 : nt - 1 - (int)(task / ((int64_t)B * H)), qb = per_head ? nt : qa + 1;
            const int bh = (int)(task % ((int64_t)B * H)), b = bh / H, h = bh % H;
            for (int kt = 0; kt < qb; kt++) amx_pack_kv(Kh, NULL, NULL, VTh, k, v, b, h / (H / Hkv), kt, T, Hkv, hd, ws + L.xt);
            for (int qt = qa; qt < qb; qt++) forward_tile_amx(out, lse, q, Kh, VTh, b, h, qt, T, H, Hkv, hd, ws, &L);
        }
        amx_end();
    }
}

/* sum_d o[d] * bf16(g[d]) in double, 16 lanes then a fixed-order sum of the lanes */
AMX_FN static float amx_d(const float *o, const float *g, int hd) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int d0 = 0; d0 < hd; d0 += 16) {
        const __mmask16 m = lanes_mask(hd - d0);
        const __m512 gr = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt16(_mm512_maskz_loadu_ps(m, g + d0))), 16));
        const __m512 ov = _mm512_maskz_loadu_ps(m, o + d0);
        a0 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(ov)), _mm512_cvtps_pd(_mm512_castps512_ps256(gr)), a0);
        a1 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ov), 1))),
                             _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(gr), 1))), a1);
    }
    double l[16];
    _mm512_storeu_pd(l, a0);
    _mm512_storeu_pd(l + 8, a1);
    double s = 0.0;
    for (int i = 0; i < 16; i++) s += l[i];
    return (float)s;
}

/* One (b, kv head): dK, dV of the head and dQ of its H/Hkv query heads */
AMX_FN static void backward_group_amx(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *lse,
                                      const float *D, const uint16_t *Kh, const uint16_t *Vh, const uint16_t *KTh, int b,
                                      int kvh, int T, int H, int Hkv, int hd, float *ws, const amx_layout *L) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv, HP = amx_hp(hd), Tp = amx_tp(T), nt = Tp / FT;
    const float scale = 1.0f / sqrtf((float)hd);
    const __m512 vs = _mm512_set1_ps(scale);
    float *St = ws + L->st, *dPt = ws + L->dpt, *dQt = ws + L->ot;
    float *dKa = ws + L->dka, *dVa = ws + L->dva;
    uint32_t *Qv = (uint32_t *)(ws + L->qv), *dOv = (uint32_t *)(ws + L->dov);
    uint32_t *Qr = (uint32_t *)(ws + L->qr), *dOr = (uint32_t *)(ws + L->dor), *dSv = (uint32_t *)(ws + L->sv);
    uint16_t *PA = (uint16_t *)(ws + L->pa), *dSA = (uint16_t *)(ws + L->dsa);
    memset(dKa, 0, sizeof(float) * (size_t)Tp * HP);
    memset(dVa, 0, sizeof(float) * (size_t)Tp * HP);
    for (int hh = 0; hh < rep; hh++) {
        const int h = kvh * rep + hh;
        for (int qt = 0; qt < nt; qt++) {
            const int t0 = qt * FT, nq = T - t0 < FT ? T - t0 : FT, nrs = (nq + 31) / 32;
            const int64_t qoff = ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
            const float *lse_i = lse + ((int64_t)b * H + h) * T + t0, *D_i = D + ((int64_t)b * H + h) * T + t0;
            pack_qv(Qv, q + qoff, ldq, nq, hd, HP);
            pack_qv(dOv, dout + qoff, ldq, nq, hd, HP);
            pack_pairs_rows(Qr, q + qoff, ldq, nq, hd, HP);
            pack_pairs_rows(dOr, dout + qoff, ldq, nq, hd, HP);
            /* tile products in bursts (see the forward): dV, dK, dQ of key tile j with S^T, dP^T of j+1 */
            amx_scores(St, Kh, Qv, T < FT ? T : FT, HP, qt == 0);   /* S^T = K_0 Q_i^T */
            amx_scores(dPt, Vh, dOv, T < FT ? T : FT, HP, qt == 0); /* dP^T = V_0 dO_i^T */
            for (int kt = 0; kt <= qt; kt++) {
                const int s0 = kt * FT, nk = T - s0 < FT ? T - s0 : FT, diag = kt == qt, nks = (nk + 31) / 32;
                for (int g = 0; g < FT / 16; g++) {
                    const int cend = diag && 16 * g + 16 < nk ? 16 * g + 16 : nk;
                    const __mmask16 rows = lanes_mask(nq - 16 * g);
                    const __m512 lv = _mm512_maskz_loadu_ps(rows, lse_i + 16 * g);
                    const __m512 Dv = _mm512_maskz_loadu_ps(rows, D_i + 16 * g);
                    for (int c = 0; c < FT; c += 2) {
                        __m512 ds[2];
                        for (int u = 0; u < 2; u++) {
                            const int cc = c + u;
                            __m512 e = _mm512_setzero_ps();
                            ds[u] = e;
                            if (cc < cend && rows) {
                                /* P = exp(scale S - lse), 0 where masked; dS = scale * P * (dP - D) */
                                e = _mm512_maskz_mov_ps(causal_mask(cc, g, diag) & rows,
                                                        vexp16(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)cc * FT + 16 * g), vs, lv)));
                                ds[u] = _mm512_mul_ps(vs, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_loadu_ps(dPt + (int64_t)cc * FT + 16 * g), Dv)));
                            }
                            _mm256_storeu_si256((__m256i *)(PA + (int64_t)cc * FT + 16 * g), cvt16(e));
                            _mm256_storeu_si256((__m256i *)(dSA + (int64_t)cc * FT + 16 * g), cvt16(ds[u]));
                        }
                        _mm512_storeu_si512(dSv + (int64_t)(c / 2) * FT + 16 * g, pair16(ds[0], ds[1]));
                    }
                }
                /* dV_j += P^T dO_i, dK_j += dS^T Q_i: key block i sees row steps from its own on the diagonal */
                for (int i = 0; i < nks; i++)
                    for (int j = 0; j < HP / 32; j++) {
                        const int k0 = diag ? i : 0;
                        float *o = dVa + (int64_t)(s0 + 32 * i) * HP + 32 * j;
                        amx_32x32(o, HP, PA + (int64_t)32 * i * FT, FT, (const uint16_t *)dOr + 64 * j, 2 * HP, k0, nrs, 1);
                        o = dKa + (int64_t)(s0 + 32 * i) * HP + 32 * j;
                        amx_32x32(o, HP, dSA + (int64_t)32 * i * FT, FT, (const uint16_t *)Qr + 64 * j, 2 * HP, k0, nrs, 1);
                    }
                /* dQ_i^T (+)= K_j^T dS^T */
                for (int i = 0; i < HP / 32; i++)
                    for (int j = 0; j < FT / 32; j++) {
                        const int k1 = diag && j + 1 < nks ? j + 1 : nks;
                        amx_32x32(dQt + (int64_t)32 * i * FT + 32 * j, FT, KTh + (int64_t)32 * i * Tp + s0, Tp,
                                  (const uint16_t *)dSv + 64 * j, 2 * FT, 0, k1, kt > 0);
                    }
                if (kt < qt) {
                    const int s1 = s0 + FT, n1 = T - s1 < FT ? T - s1 : FT;
                    amx_scores(St, Kh + (int64_t)s1 * HP, Qv, n1, HP, kt + 1 == qt);   /* S^T = K_{j+1} Q_i^T */
                    amx_scores(dPt, Vh + (int64_t)s1 * HP, dOv, n1, HP, kt + 1 == qt); /* dP^T = V_{j+1} dO_i^T */
                }
            }
            amx_store_t(dq + qoff, ldq, dQt, NULL, nq, hd);
        }
    }
    for (int t = 0; t < T; t++) {
        const int64_t off = ((int64_t)b * T + t) * ldk + (int64_t)kvh * hd;
        memcpy(dk + off, dKa + (int64_t)t * HP, sizeof(float) * (size_t)hd);
        memcpy(dv + off, dVa + (int64_t)t * HP, sizeof(float) * (size_t)hd);
    }
}

static void attention_backward_amx(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                   const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                   int hd, float *scratch) {
    const int nthr = omp_get_max_threads();
    const amx_layout L = amx_layout_of(B, T, Hkv, H, hd);
    float *D = scratch + L.D, *blocks = scratch + L.shared;
    const int nt = amx_tp(T) / FT;
    const int64_t ld = (int64_t)H * hd, nrow = (int64_t)B * T;
#pragma omp parallel num_threads(nthr)
    {
        float *ws = blocks + (size_t)omp_get_thread_num() * L.per_thread;
        uint16_t *Kh = (uint16_t *)(ws + L.kr), *Vh = (uint16_t *)(ws + L.vr), *KTh = (uint16_t *)(ws + L.kt);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < nrow; row++) {
            const int b = (int)(row / T), t = (int)(row % T);
            for (int h = 0; h < H; h++) {
                /* D = rowsum(dO * O) with the rounded dO that dP = dO V^T sees (double, fixed order) */
                D[((int64_t)b * H + h) * T + t] = amx_d(out + row * ld + (int64_t)h * hd, dout + row * ld + (int64_t)h * hd, hd);
            }
        }
        amx_begin();
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * Hkv; task++) {
            for (int kt = 0; kt < nt; kt++) amx_pack_kv(Kh, Vh, KTh, NULL, k, v, task / Hkv, task % Hkv, kt, T, Hkv, hd, ws + L.xt);
            backward_group_amx(dq, dk, dv, dout, q, lse, D, Kh, Vh, KTh, task / Hkv, task % Hkv, T, H, Hkv, hd, ws, &L);
        }
        amx_end();
    }
}
#endif
