/* tera_gemm's deterministic tiles (src/kernels/cpu/matmul.c) against oneDNN's own threading of the
 * same product (dnnl_sgemm on every thread), alternating repetitions in one process, on bench-s's
 * fp32 products (D 256, F 512, V 4096, T*B 2048 tokens, 512 rows per expert). Medians in ms and
 * GFLOP/s. The products of 2^30 multiply-adds or more go through the matmul primitive in tera_gemm
 * (NN/NT) unless TERA_GEMM_TILES=0 (every transpose); the raw column is always sgemm.
 * Usage: bench_gemm [--threads N] [--reps R] */
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_median.h"
#include "tera/kernels.h"

typedef struct {
    const char *name;
    int ta, tb;
    int64_t M, N, K;
} prod;

static const prod PRODS[] = {
    {"attn proj fwd   NT", 0, 1, 2048, 256, 256},  {"attn proj dx    NN", 0, 0, 2048, 256, 256},
    {"attn proj dw    TN", 1, 0, 256, 256, 2048},  {"expert w13 fwd  NT", 0, 1, 512, 512, 256},
    {"expert w13 dx   NN", 0, 0, 512, 256, 512},   {"expert w13 dw   TN", 1, 0, 512, 256, 512},
    {"expert w2 fwd   NT", 0, 1, 512, 256, 512},   {"expert w2 dx    NN", 0, 0, 512, 512, 256},
    {"expert w2 dw    TN", 1, 0, 256, 512, 512},   {"lm head fwd     NT", 0, 1, 2048, 4096, 256},
    {"lm head dx      NN", 0, 0, 2048, 256, 4096}, {"lm head dw      TN", 1, 0, 4096, 256, 2048},
};

int main(int argc, char **argv) {
    int threads = 2, reps = 15;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    }
    if (reps < 1 || reps > 1000 || threads < 1) {
        fprintf(stderr, "bench_gemm: --reps 1..1000, --threads >= 1\n");
        return 2;
    }
    tera_set_threads(threads);
    const char *tiles = getenv("TERA_GEMM_TILES");
    printf("threads %d, reps %d, TERA_GEMM_TILES=%s\n", threads, reps, tiles ? tiles : "(unset: tiles on)");
    printf("%-20s %10s %10s %10s %10s %8s\n", "product", "tera ms", "GFLOP/s", "sgemm ms", "GFLOP/s", "ratio");
    double *ta = malloc(sizeof(double) * (size_t)reps), *tb = malloc(sizeof(double) * (size_t)reps);
    for (size_t p = 0; p < sizeof PRODS / sizeof PRODS[0]; p++) {
        const prod *q = &PRODS[p];
        const int64_t lda = q->ta ? q->M : q->K, ldb = q->tb ? q->K : q->N;
        float *A = malloc(sizeof(float) * (size_t)(q->M * q->K)), *B = malloc(sizeof(float) * (size_t)(q->K * q->N));
        float *C = malloc(sizeof(float) * (size_t)(q->M * q->N));
        for (int64_t i = 0; i < q->M * q->K; i++) A[i] = (float)((i * 7 % 13) - 6) * 0.01f;
        for (int64_t i = 0; i < q->K * q->N; i++) B[i] = (float)((i * 5 % 11) - 5) * 0.01f;
        memset(C, 0, sizeof(float) * (size_t)(q->M * q->N));
        /* warm-up: primitive creation, page faults */
        tera_gemm(q->ta, q->tb, q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C, q->N);
        dnnl_sgemm(q->ta ? 'T' : 'N', q->tb ? 'T' : 'N', q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C, q->N);
        for (int r = 0; r < reps; r++) { /* alternating, the order swapped every repetition */
            for (int s = 0; s < 2; s++) {
                const int which = (r + s) & 1;
                const double t0 = omp_get_wtime();
                if (which == 0)
                    tera_gemm(q->ta, q->tb, q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C, q->N);
                else
                    dnnl_sgemm(q->ta ? 'T' : 'N', q->tb ? 'T' : 'N', q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C,
                               q->N);
                (which == 0 ? ta : tb)[r] = omp_get_wtime() - t0;
            }
        }
        const double ma = median(ta, reps), mb = median(tb, reps), gf = 2.0 * (double)(q->M * q->N * q->K) * 1e-9;
        printf("%-20s %10.3f %10.1f %10.3f %10.1f %8.3f\n", q->name, ma * 1e3, gf / ma, mb * 1e3, gf / mb, mb / ma);
        free(A);
        free(B);
        free(C);
    }
    free(ta);
    free(tb);
    return 0;
}
