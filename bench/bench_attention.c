/* Attention forward/backward throughput on the CPU: the fp32 kernels and the bf16 ones (products on
 * the matrix units, src/kernels/cpu/attention.c) side by side, same shapes, same run.
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -march=native -fopenmp -Iinclude -Isrc src/core/status.c \
 *       src/kernels/cpu/matmul.c src/kernels/cpu/attention.c bench/bench_attention.c \
 *       -o /tmp/bench_attention -ldnnl -lm && /tmp/bench_attention [reps]
 * (add -DATTN_TILE=64 or -DATTN_BF16_TILE=256 to re-measure the tile sizes.)
 *
 * GFLOP/s are given two ways: "causal" counts the products actually needed under the causal
 * mask (T*(T+1)/2 query-key pairs), "full" counts T*T pairs as is customary for flash attention:
 * forward 4*B*H*T*T*hd, backward 8*B*H*T*T*hd (recomputing S is not counted). Medians of `reps`;
 * the fp32 and bf16 repetitions alternate, so a busy moment of the machine hits both alike. The
 * bf16 rows also give the largest difference from the fp32 outputs (out, dq) relative to their
 * largest magnitude, a sanity check that both computed the same thing. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "tera/kernels.h"
#include "bench_median.h"

typedef struct {
    const char *name;
    int B, T, H, Hkv, hd;
} bench_shape;

static float *alloc_rand(size_t n, uint64_t *rng) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        *rng ^= *rng << 13, *rng ^= *rng >> 7, *rng ^= *rng << 17;
        p[i] = (float)((*rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
    }
    return p;
}

static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        d = e > d ? e : d;
        m = fabs(b[i]) > m ? fabs(b[i]) : m;
    }
    return m > 0 ? d / m : d;
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 21;
    const bench_shape shapes[] = {{"bench-s", 8, 256, 8, 8, 32}, {"bench-m", 4, 512, 8, 8, 64}};
    const int max_threads = 2;
    const int bf16 = tera_attention_bf16_available();
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    double *t[2][3];
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 3; j++) t[p][j] = malloc((size_t)reps * sizeof(double));
    const char *isa = "";
    tera_cpu_bf16_fast(&isa);
    printf("oneDNN ISA %s; bf16 attention %s\n", isa, bf16 ? "available" : "not available (fp32 only)");
    printf("%-8s %3s %4s | %9s %9s %9s | fwd GF/s causal/full | bwd GF/s causal/full | f+b GF/s causal/full | %7s | %s\n",
           "shape", "thr", "prec", "fwd ms", "bwd ms", "f+b ms", "speedup", "max rel diff out/dq vs fp32");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const bench_shape s = shapes[si];
        const size_t nq = (size_t)s.B * s.T * s.H * s.hd, nk = (size_t)s.B * s.T * s.Hkv * s.hd;
        const size_t nl = (size_t)s.B * s.H * s.T;
        omp_set_num_threads(max_threads);
        float *q = alloc_rand(nq, &rng), *k = alloc_rand(nk, &rng), *v = alloc_rand(nk, &rng);
        float *dout = alloc_rand(nq, &rng);
        float *out[2], *lse[2], *dq[2], *dk[2], *dv[2];
        for (int p = 0; p < 2; p++) {
            out[p] = alloc_rand(nq, &rng), lse[p] = alloc_rand(nl, &rng), dq[p] = alloc_rand(nq, &rng);
            dk[p] = alloc_rand(nk, &rng), dv[p] = alloc_rand(nk, &rng);
        }
        size_t ns = tera_attention_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd);
        if (bf16 && tera_attention_bf16_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd) > ns)
            ns = tera_attention_bf16_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd);
        float *scratch = alloc_rand(ns, &rng);
        const double bhd = (double)s.B * s.H * s.hd;
        const double pairs_full = (double)s.T * s.T, pairs_causal = (double)s.T * (s.T + 1) / 2.0;
        for (int thr = 1; thr <= max_threads; thr++) {
            omp_set_num_threads(thr);
            for (int r = -3; r < reps; r++) {
                for (int p = 0; p < 1 + bf16; p++) {
                    const double t0 = omp_get_wtime();
                    if (p == 0)
                        tera_attention_forward(out[p], lse[p], q, k, v, s.B, s.T, s.H, s.Hkv, s.hd, scratch);
                    else
                        tera_attention_forward_bf16(out[p], lse[p], q, k, v, s.B, s.T, s.H, s.Hkv, s.hd, scratch);
                    const double t1 = omp_get_wtime();
                    if (p == 0)
                        tera_attention_backward(dq[p], dk[p], dv[p], dout, q, k, v, out[p], lse[p], s.B, s.T, s.H,
                                                s.Hkv, s.hd, scratch);
                    else
                        tera_attention_backward_bf16(dq[p], dk[p], dv[p], dout, q, k, v, out[p], lse[p], s.B, s.T,
                                                     s.H, s.Hkv, s.hd, scratch);
                    const double t2 = omp_get_wtime();
                    if (r < 0) continue; /* warm-up */
                    t[p][0][r] = t1 - t0, t[p][1][r] = t2 - t1, t[p][2][r] = t2 - t0;
                }
            }
            double fp32_total = 0;
            for (int p = 0; p < 1 + bf16; p++) {
                const double mf = median(t[p][0], reps), mb = median(t[p][1], reps), mt = median(t[p][2], reps);
                if (p == 0) fp32_total = mt;
                const double ff = 4 * bhd * pairs_full, fb = 8 * bhd * pairs_full;
                const double cf = 4 * bhd * pairs_causal, cb = 8 * bhd * pairs_causal;
                char diff[64] = "-";
                if (p == 1)
                    snprintf(diff, sizeof diff, "%.2e / %.2e", rel_diff(out[1], out[0], nq), rel_diff(dq[1], dq[0], nq));
                printf("%-8s %3d %4s | %9.3f %9.3f %9.3f | %8.1f / %-8.1f  | %8.1f / %-8.1f  | %8.1f / %-8.1f  | %6.2fx | %s\n",
                       s.name, thr, p ? "bf16" : "fp32", mf * 1e3, mb * 1e3, mt * 1e3, cf / mf * 1e-9, ff / mf * 1e-9,
                       cb / mb * 1e-9, fb / mb * 1e-9, (cf + cb) / mt * 1e-9, (ff + fb) / mt * 1e-9, fp32_total / mt,
                       diff);
            }
        }
        free(q), free(k), free(v), free(dout), free(scratch);
        for (int p = 0; p < 2; p++) free(out[p]), free(lse[p]), free(dq[p]), free(dk[p]), free(dv[p]);
    }
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 3; j++) free(t[p][j]);
    return 0;
}
