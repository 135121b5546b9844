/* The fused element-wise passes of issue 19 against the separate passes they replace, on a model's
 * own shapes (docs/PERFORMANCE.md, "Fused element-wise passes"), timed alternately in one process so
 * that a busy moment of this shared machine hits both alike (read the ratios), with a STREAM-like
 * triad (a = b + s c, 12 bytes per element) over arrays of the same size as each operation's beside
 * them: the bandwidth that size of working set gets, the limit of a memory-bound pass.
 *   cross-entropy: tera_ce_forward + tera_ce_backward (in place) vs tera_ce_fused, N x V logits;
 *   RoPE: tera_rope_forward on q and on k vs tera_rope_qk_forward (N x D each);
 *   RMSNorm forward + the residual copy (memcpy) vs tera_rmsnorm_copy_forward;
 *   RMSNorm backward: the previous two-pass form (rows, then dw by column blocks: kept below as it was)
 *   vs tera_rmsnorm_backward (one pass, dw summed per chunk of rows);
 *   the fused cross-entropy with two exponentials per logit (exp(x - lse) again for dlogits: kept below
 *   as it was) vs tera_ce_fused (one: e = exp(x - max) kept from the sum, scaled): ce_prev / ce_onexp,
 *   a pair of its own timed alternately (8 bytes per logit both).
 * Bytes counted (compulsory traffic per element, each array read or written once per pass):
 * cross-entropy 12 -> 8 per logit (read; read + write -> read + write), RoPE 8 per element of q and
 * k both ways, RMSNorm forward + copy 16 -> 12, backward 24 -> 16 (dy, x read twice -> once; dx
 * read and written).
 * The triads are also given as the best repetition (*_best_gbs: a busy neighbour slows a repetition,
 * never speeds it up, so the best is the machine's, as tera bench's GEMM peaks), and once more over
 * arrays of 64 Mi floats each (768 MiB: far beyond the caches, the limit of the optimizer's passes).
 * Usage: bench_fused [-c CONFIG] [--threads N] [--reps N]; prints one JSON line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "kernels/cpu/vmath.h"
#include "tera/config.h"
#include "tera/kernels.h"
#include "tera/model.h"
#include "tera/profile.h"
#include "tera/status.h"

/* the RMSNorm backward before issue 19's fusion (src/kernels/cpu/elementwise.c at 7db6f32) */
static void rmsnorm_backward_two_pass(float *restrict dx, float *restrict dw, const float *restrict dy,
                                      const float *restrict x, const float *restrict w, const float *restrict rstd,
                                      int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D, *dyr = dy + n * D;
        float *dxr = dx + n * D;
        const float r = rstd[n];
        float acc[16] = {0};
        int64_t d = 0;
        for (; d + 16 <= D; d += 16)
            for (int l = 0; l < 16; l++) acc[l] += dyr[d + l] * w[d + l] * xr[d + l];
        for (; d < D; d++) acc[d % 16] += dyr[d] * w[d] * xr[d];
        float dot = 0.0f;
        for (int l = 0; l < 16; l++) dot += acc[l];
        const float c = dot * r * r / (float)D;
        for (int64_t j = 0; j < D; j++) dxr[j] += r * (dyr[j] * w[j] - xr[j] * c);
    }
    const int64_t nblk = (D + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblk; blk++) {
        const int64_t d0 = blk * 16, d1 = d0 + 16 < D ? d0 + 16 : D;
        float acc[16] = {0};
        for (int64_t n = 0; n < N; n++)
            for (int64_t d = d0; d < d1; d++) acc[d - d0] += dy[n * D + d] * x[n * D + d] * rstd[n];
        for (int64_t d = d0; d < d1; d++) dw[d] += acc[d - d0];
    }
}

/* the fused cross-entropy before one exponential per logit (src/kernels/cpu/elementwise.c at a0272eb) */
static double ce_fused_two_exp(float *dlogits, float *lse, float *tlogit, const float *logits, const int32_t *targets,
                               int64_t N, int64_t V, float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * V;
        float *d = dlogits + n * V;
        const float mx = tera_max(r, V);
        const float l = mx + logf(tera_sum_exp(r, V, mx));
        const int64_t t = targets[n];
        lse[n] = l;
        tlogit[n] = r[t];
        for (int64_t v = 0; v < V; v++) d[v] = scale * tera_vexpf(r[v] - l);
        d[t] -= scale;
    }
    double sum = 0.0;
    for (int64_t n = 0; n < N; n++) sum += (double)lse[n] - (double)tlogit[n];
    return sum;
}

static float *filled(int64_t n, uint64_t seed, float a) {
    float *x = tera_malloc(sizeof(float) * (size_t)n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = a * (2.0f * (float)((s >> 40) & 0xFFFFFF) / 16777216.0f - 1.0f);
    }
    return x;
}

/* CPU seconds of this process (all threads): on this shared machine, with one thread, the compute
 * itself, which other jobs slow down far less than the wall time (printed beside it as *_cpu_ms) */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* seconds of one triad over three arrays of n floats */
static double triad(float *a, const float *b, const float *c, int64_t n) {
    const double t0 = tera_now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + 1e-9f * c[i];
    return tera_now() - t0;
}

enum { CE_SEP, CE_FUSED, CE_TRIAD, ROPE_SEP, ROPE_FUSED, NF_SEP, NF_FUSED, NB_SEP, NB_FUSED, ND_TRIAD, CE_PREV, CE_ONEXP,
       N_T };

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini";
    int threads = 1, reps = 9;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    }
    if (threads < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bench_fused: --threads >= 1, --reps in 1..1000\n");
        return 2;
    }
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK || tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_fused: %s\n", tera_last_error());
        return 1;
    }
    tera_set_threads(threads);
    const tera_model_config *mc = &cfg.model;
    const int B = cfg.training.micro_batch, T = cfg.training.seq_len, H = mc->n_heads;
    const int Hkv = mc->n_kv_heads > 0 ? mc->n_kv_heads : H, hd = mc->dim / H;
    const int64_t N = (int64_t)B * T, D = mc->dim, V = mc->vocab_size, NV = N * V, ND = N * D;
    const int64_t nkv = N * Hkv * hd;
    /* cross-entropy */
    float *logits0 = filled(NV, 1, 4.0f), *logits = tera_malloc(sizeof(float) * (size_t)NV);
    float *lse = tera_malloc(sizeof(float) * (size_t)N), *tl = tera_malloc(sizeof(float) * (size_t)N);
    float *tb = tera_malloc(sizeof(float) * (size_t)NV), *tc = tera_malloc(sizeof(float) * (size_t)NV);
    memcpy(tb, logits0, sizeof(float) * (size_t)NV);
    memcpy(tc, logits0, sizeof(float) * (size_t)NV);
    int32_t *tg = tera_malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)((n * 7919) % V);
    /* RoPE, RMSNorm */
    float *cs = tera_malloc(sizeof(float) * (size_t)(T * hd / 2)), *sn = tera_malloc(sizeof(float) * (size_t)(T * hd / 2));
    tera_rope_tables(cs, sn, T, hd, 10000.0f);
    float *q = filled(ND, 2, 1.0f), *k = filled(nkv, 3, 1.0f);
    float *x = filled(ND, 4, 2.0f), *w = filled(D, 5, 1.0f), *y = filled(ND, 6, 1.0f), *cp = filled(ND, 7, 1.0f);
    float *dy = filled(ND, 8, 1.0f), *dx = filled(ND, 9, 1.0f), *dw = filled(D, 10, 1.0f);
    float *rstd = tera_malloc(sizeof(float) * (size_t)N);
    double *t[N_T], *tc_[N_T];
    for (int i = 0; i < N_T; i++) t[i] = tera_malloc(sizeof(double) * (size_t)reps);
    for (int i = 0; i < N_T; i++) tc_[i] = tera_malloc(sizeof(double) * (size_t)reps);
    double sink = 0.0;
    for (int r = -1; r < reps; r++) { /* r = -1 warms up */
        double s[N_T], c[N_T] = {0}, c0;
        /* alternate which form goes first */
        for (int o = 0; o < 2; o++) {
            const int fused = (o + r + 1) % 2;
            memcpy(logits, logits0, sizeof(float) * (size_t)NV);
            c0 = cpu_now();
            double t0 = tera_now();
            if (fused) {
                sink += tera_ce_fused(logits, lse, tl, logits, tg, N, V, 0.5f);
            } else {
                sink += tera_ce_forward(lse, logits, tg, N, V);
                tera_ce_backward(logits, logits, tg, N, V, 0.5f);
            }
            s[fused ? CE_FUSED : CE_SEP] = tera_now() - t0;
            c[fused ? CE_FUSED : CE_SEP] = cpu_now() - c0;
            c0 = cpu_now();
            t0 = tera_now();
            if (fused) {
                tera_rope_qk_forward(q, k, cs, sn, B, T, H, Hkv, hd);
            } else {
                tera_rope_forward(q, cs, sn, B, T, H, hd);
                tera_rope_forward(k, cs, sn, B, T, Hkv, hd);
            }
            s[fused ? ROPE_FUSED : ROPE_SEP] = tera_now() - t0;
            c[fused ? ROPE_FUSED : ROPE_SEP] = cpu_now() - c0;
            c0 = cpu_now();
            t0 = tera_now();
            if (fused) {
                tera_rmsnorm_copy_forward(y, rstd, cp, x, w, N, D, 1e-5f);
            } else {
                tera_rmsnorm_forward(y, rstd, x, w, N, D, 1e-5f);
                memcpy(cp, x, sizeof(float) * (size_t)ND);
            }
            s[fused ? NF_FUSED : NF_SEP] = tera_now() - t0;
            c[fused ? NF_FUSED : NF_SEP] = cpu_now() - c0;
            c0 = cpu_now();
            t0 = tera_now();
            if (fused)
                tera_rmsnorm_backward(dx, dw, dy, x, w, rstd, N, D);
            else
                rmsnorm_backward_two_pass(dx, dw, dy, x, w, rstd, N, D);
            s[fused ? NB_FUSED : NB_SEP] = tera_now() - t0;
            c[fused ? NB_FUSED : NB_SEP] = cpu_now() - c0;
        }
        for (int o = 0; o < 2; o++) { /* the cross-entropy's two forms of its fused pass, alternately */
            const int one = (o + r + 1) % 2;
            memcpy(logits, logits0, sizeof(float) * (size_t)NV);
            c0 = cpu_now();
            const double t0 = tera_now();
            if (one)
                sink += tera_ce_fused(logits, lse, tl, logits, tg, N, V, 0.5f);
            else
                sink += ce_fused_two_exp(logits, lse, tl, logits, tg, N, V, 0.5f);
            s[one ? CE_ONEXP : CE_PREV] = tera_now() - t0;
            c[one ? CE_ONEXP : CE_PREV] = cpu_now() - c0;
        }
        c0 = cpu_now();
        s[CE_TRIAD] = triad(logits, tb, tc, NV);
        c[CE_TRIAD] = cpu_now() - c0;
        c0 = cpu_now();
        s[ND_TRIAD] = triad(cp, y, dy, ND);
        c[ND_TRIAD] = cpu_now() - c0;
        for (int i = 0; i < N_T && r >= 0; i++) t[i][r] = s[i], tc_[i][r] = c[i];
    }
    double best_nd = t[ND_TRIAD][0], best_logits = t[CE_TRIAD][0];
    for (int r = 1; r < reps; r++) {
        best_nd = t[ND_TRIAD][r] < best_nd ? t[ND_TRIAD][r] : best_nd;
        best_logits = t[CE_TRIAD][r] < best_logits ? t[CE_TRIAD][r] : best_logits;
    }
    /* the DRAM triad: three arrays of 64 Mi floats */
    const int64_t nbig = (int64_t)64 << 20;
    float *ba = filled(nbig, 21, 1.0f), *bb = filled(nbig, 22, 1.0f), *bc = filled(nbig, 23, 1.0f);
    double *tbig = tera_malloc(sizeof(double) * (size_t)reps), best_big = 1e30;
    triad(ba, bb, bc, nbig);
    for (int r = 0; r < reps; r++) {
        tbig[r] = triad(ba, bb, bc, nbig);
        best_big = tbig[r] < best_big ? tbig[r] : best_big;
    }
    const double med_big = median(tbig, reps);
    free(ba), free(bb), free(bc), free(tbig);
    double m[N_T], mc_[N_T];
    for (int i = 0; i < N_T; i++) m[i] = median(t[i], reps), mc_[i] = median(tc_[i], reps);
    const double g = 1e-9;
    printf("{\"config\": \"%s\", \"threads\": %d, \"reps\": %d, \"N\": %lld, \"D\": %lld, \"V\": %lld, "
           "\"ce_sep_ms\": %.3f, \"ce_fused_ms\": %.3f, \"ce_sep_gbs\": %.1f, \"ce_fused_gbs\": %.1f, "
           "\"triad_logits_gbs\": %.1f, "
           "\"rope_sep_ms\": %.3f, \"rope_fused_ms\": %.3f, \"rope_gbs_sep\": %.1f, \"rope_gbs_fused\": %.1f, "
           "\"norm_fwd_copy_sep_ms\": %.3f, \"norm_fwd_copy_fused_ms\": %.3f, \"norm_fwd_sep_gbs\": %.1f, "
           "\"norm_fwd_fused_gbs\": %.1f, \"norm_bwd_sep_ms\": %.3f, \"norm_bwd_fused_ms\": %.3f, "
           "\"norm_bwd_sep_gbs\": %.1f, \"norm_bwd_fused_gbs\": %.1f, \"triad_nd_gbs\": %.1f, \"sink\": %.3e",
           cfg_path, threads, reps, (long long)N, (long long)D, (long long)V, 1e3 * m[CE_SEP], 1e3 * m[CE_FUSED],
           12.0 * g * (double)NV / m[CE_SEP], 8.0 * g * (double)NV / m[CE_FUSED], 12.0 * g * (double)NV / m[CE_TRIAD],
           1e3 * m[ROPE_SEP], 1e3 * m[ROPE_FUSED], 8.0 * g * (double)(ND + nkv) / m[ROPE_SEP],
           8.0 * g * (double)(ND + nkv) / m[ROPE_FUSED], 1e3 * m[NF_SEP], 1e3 * m[NF_FUSED],
           16.0 * g * (double)ND / m[NF_SEP], 12.0 * g * (double)ND / m[NF_FUSED], 1e3 * m[NB_SEP],
           1e3 * m[NB_FUSED], 24.0 * g * (double)ND / m[NB_SEP], 16.0 * g * (double)ND / m[NB_FUSED],
           12.0 * g * (double)ND / m[ND_TRIAD], sink);
    printf(", \"ce_prev_ms\": %.3f, \"ce_onexp_ms\": %.3f, \"ce_prev_gbs\": %.1f, \"ce_onexp_gbs\": %.1f", 1e3 * m[CE_PREV],
           1e3 * m[CE_ONEXP], 8.0 * g * (double)NV / m[CE_PREV], 8.0 * g * (double)NV / m[CE_ONEXP]);
    static const char *const names[N_T] = {"ce_sep", "ce_fused", "triad_logits", "rope_sep", "rope_fused",
                                           "norm_fwd_copy_sep", "norm_fwd_copy_fused", "norm_bwd_sep",
                                           "norm_bwd_fused", "triad_nd", "ce_prev", "ce_onexp"};
    for (int i = 0; i < N_T; i++) printf(", \"%s_cpu_ms\": %.3f", names[i], 1e3 * mc_[i]);
    printf(", \"params\": %lld", (long long)tera_model_total_params(mc));
    printf(", \"triad_nd_best_gbs\": %.1f, \"triad_logits_best_gbs\": %.1f, \"triad_dram_gbs\": %.1f, "
           "\"triad_dram_best_gbs\": %.1f",
           12.0 * g * (double)ND / best_nd, 12.0 * g * (double)NV / best_logits, 12.0 * g * (double)nbig / med_big,
           12.0 * g * (double)nbig / best_big);
    printf("}\n");
    for (int i = 0; i < N_T; i++) free(tc_[i]);
    for (int i = 0; i < N_T; i++) free(t[i]);
    free(logits0), free(logits), free(lse), free(tl), free(tb), free(tc), free(tg), free(cs), free(sn);
    free(q), free(k), free(x), free(w), free(y), free(cp), free(dy), free(dx), free(dw), free(rstd);
    return 0;
}
