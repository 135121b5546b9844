/* Attention forward/backward throughput on the CPU.
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -march=native -fopenmp -Iinclude src/core/status.c \
 *       src/kernels/cpu/matmul.c src/kernels/cpu/attention.c bench/bench_attention.c \
 *       -o /tmp/bench_attention -ldnnl -lm && /tmp/bench_attention [reps]
 * (add -DATTN_TILE=128 to re-measure the tile size.)
 *
 * GFLOP/s are given two ways: "causal" counts the products actually needed under the causal
 * mask (T*(T+1)/2 query-key pairs), "full" counts T*T pairs as is customary for flash attention:
 * forward 4*B*H*T*T*hd, backward 8*B*H*T*T*hd (recomputing S is not counted). Medians of `reps`. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tera/kernels.h"
#include "bench_median.h"

typedef struct {
    const char *name;
    int B, T, H, Hkv, hd;
} bench_shape;

static float *alloc_rand(size_t n, uint64_t *rng) {
    float *p = malloc(n * sizeof(float));
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

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 21;
    const bench_shape shapes[] = {{"bench-s", 8, 256, 8, 8, 32}, {"bench-m", 4, 512, 8, 8, 64}};
    const int max_threads = 2;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    double *tf = malloc((size_t)reps * sizeof(double)), *tb = malloc((size_t)reps * sizeof(double));
    double *tt = malloc((size_t)reps * sizeof(double));
    printf("%-8s %3s | %9s %9s %9s | fwd GF/s causal/full | bwd GF/s causal/full | fwd+bwd GF/s causal/full\n",
           "shape", "thr", "fwd ms", "bwd ms", "f+b ms");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const bench_shape s = shapes[si];
        const size_t nq = (size_t)s.B * s.T * s.H * s.hd, nk = (size_t)s.B * s.T * s.Hkv * s.hd;
        omp_set_num_threads(max_threads);
        float *q = alloc_rand(nq, &rng), *k = alloc_rand(nk, &rng), *v = alloc_rand(nk, &rng);
        float *dout = alloc_rand(nq, &rng), *out = alloc_rand(nq, &rng), *dq = alloc_rand(nq, &rng);
        float *dk = alloc_rand(nk, &rng), *dv = alloc_rand(nk, &rng);
        float *lse = alloc_rand((size_t)s.B * s.H * s.T, &rng);
        float *scratch = alloc_rand(tera_attention_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd), &rng);
        const double bhd = (double)s.B * s.H * s.hd;
        const double pairs_full = (double)s.T * s.T, pairs_causal = (double)s.T * (s.T + 1) / 2.0;
        for (int thr = 1; thr <= max_threads; thr++) {
            omp_set_num_threads(thr);
            for (int r = -3; r < reps; r++) {
                const double t0 = omp_get_wtime();
                tera_attention_forward(out, lse, q, k, v, s.B, s.T, s.H, s.Hkv, s.hd, scratch);
                const double t1 = omp_get_wtime();
                tera_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, s.B, s.T, s.H, s.Hkv, s.hd,
                                        scratch);
                const double t2 = omp_get_wtime();
                if (r < 0) continue; /* warm-up */
                tf[r] = t1 - t0, tb[r] = t2 - t1, tt[r] = t2 - t0;
            }
            const double mf = median(tf, reps), mb = median(tb, reps), mt = median(tt, reps);
            const double ff = 4 * bhd * pairs_full, fb = 8 * bhd * pairs_full;
            const double cf = 4 * bhd * pairs_causal, cb = 8 * bhd * pairs_causal;
            printf("%-8s %3d | %9.3f %9.3f %9.3f | %8.1f / %-8.1f  | %8.1f / %-8.1f  | %8.1f / %-8.1f\n",
                   s.name, thr, mf * 1e3, mb * 1e3, mt * 1e3, cf / mf * 1e-9, ff / mf * 1e-9,
                   cb / mb * 1e-9, fb / mb * 1e-9, (cf + cb) / mt * 1e-9, (ff + fb) / mt * 1e-9);
        }
        free(q), free(k), free(v), free(dout), free(out), free(dq), free(dk), free(dv), free(lse);
        free(scratch);
    }
    free(tf), free(tb), free(tt);
    return 0;
}
