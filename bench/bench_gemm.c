/* tera's fp32 products (src/kernels/cpu/matmul.c) on the model's real shapes, three ways alternating
 * repetition by repetition in one process:
 *   tera    tera_gemm as the tree runs it: weight gradients (TN) in primitive pieces where they
 *           apply, else the deterministic tiles, TN ones cut by rows ("Weight gradients in
 *           primitive pieces"), under AVX2 kernels NN and TN tiles on padded copies of their
 *           operands ("Padded operands");
 *   tiles   tera_gemm with the pieces and the padded copies off (tera_cpu_gemm_pieces(0),
 *           tera_cpu_gemm_pad(0), as TERA_GEMM_PIECES=0 TERA_GEMM_PAD=0): the plain tiles (square
 *           tiles for TN too);
 *   onednn  what TERA_GEMM_TILES=0 runs: oneDNN's own threading (dnnl_sgemm on every thread, or the
 *           matmul primitive for products of 2^30 multiply-adds or more outside parallel regions);
 *           numbers that depend on the thread count.
 * The products are those of bench-s and bench-m (configs/bench-*.ini: 2048 tokens per step; expert
 * rows: bench-s 512 (uniform routing) and 1792 (its busiest expert), bench-m 2048 (the collapsed
 * routing the benchmark runs: two experts of 2048 rows) and 256). Expert products ("side") run
 * side by side on 2+ threads in the model (each expert on one thread): with --threads > 1 every
 * thread runs its own copy at once inside one parallel region and the time is per product (wall /
 * threads). Medians of the repetitions in ms and GFLOP/s, and a step estimate: the products' medians
 * times how often a step runs each (the uniform or collapsed expert rows; the other expert rows
 * count 0).
 * Usage: bench_gemm [--threads N] [--reps R] [--config s|m|all] [--only SUBSTRING] */
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_median.h"
#include "kernels/cpu/cpu.h"
#include "tera/kernels.h"

typedef struct {
    const char *cfg, *name;
    int ta, tb;
    int64_t M, N, K;
    int side;  /* an expert's product: side by side on 2+ threads */
    int count; /* products of this shape per step (fwd + bwd) */
} prod;

/* bench-s: T*B 2048, D 256, F 512, V 4096, L 4, E 8 (k 2: 512 rows per expert uniform) */
/* bench-m: T*B 2048, D 512, F 1024, V 16384, L 8; two experts of 2048 rows per layer (collapsed) */
static const prod PRODS[] = {
    {"s", "attn fwd     NT", 0, 1, 2048, 256, 256, 0, 16},
    {"s", "attn dx      NN", 0, 0, 2048, 256, 256, 0, 16},
    {"s", "attn dw      TN", 1, 0, 256, 256, 2048, 0, 16},
    {"s", "w13 fwd r512 NT", 0, 1, 512, 512, 256, 1, 64},
    {"s", "w2 fwd r512  NT", 0, 1, 512, 256, 512, 1, 32},
    {"s", "w2 dx r512   NN", 0, 0, 512, 512, 256, 1, 32},
    {"s", "w2 dw r512   TN", 1, 0, 256, 512, 512, 1, 32},
    {"s", "w13 dx r512  NN", 0, 0, 512, 256, 512, 1, 64},
    {"s", "w13 dw r512  TN", 1, 0, 512, 256, 512, 1, 64},
    {"s", "w2 fwd r1792 NT", 0, 1, 1792, 256, 512, 1, 0},
    {"s", "w2 dw r1792  TN", 1, 0, 256, 512, 1792, 1, 0},
    {"s", "w13 dx r1792 NN", 0, 0, 1792, 256, 512, 1, 0},
    {"s", "w13 dw r1792 TN", 1, 0, 512, 256, 1792, 1, 0},
    {"s", "head fwd     NT", 0, 1, 2048, 4096, 256, 0, 1},
    {"s", "head dx      NN", 0, 0, 2048, 256, 4096, 0, 1},
    {"s", "head dw      TN", 1, 0, 4096, 256, 2048, 0, 1},
    {"m", "attn fwd     NT", 0, 1, 2048, 512, 512, 0, 32},
    {"m", "attn dx      NN", 0, 0, 2048, 512, 512, 0, 32},
    {"m", "attn dw      TN", 1, 0, 512, 512, 2048, 0, 32},
    {"m", "w13 fwd r2k  NT", 0, 1, 2048, 1024, 512, 1, 32},
    {"m", "w2 fwd r2k   NT", 0, 1, 2048, 512, 1024, 1, 16},
    {"m", "w2 dx r2k    NN", 0, 0, 2048, 1024, 512, 1, 16},
    {"m", "w2 dw r2k    TN", 1, 0, 512, 1024, 2048, 1, 16},
    {"m", "w13 dx r2k   NN", 0, 0, 2048, 512, 1024, 1, 32},
    {"m", "w13 dw r2k   TN", 1, 0, 1024, 512, 2048, 1, 32},
    {"m", "w13 dw r256  TN", 1, 0, 1024, 512, 256, 1, 0},
    {"m", "w2 dw r256   TN", 1, 0, 512, 1024, 256, 1, 0},
    {"m", "head fwd     NT", 0, 1, 2048, 16384, 512, 0, 1},
    {"m", "head dx      NN", 0, 0, 2048, 512, 16384, 0, 1},
    {"m", "head dw      TN", 1, 0, 16384, 512, 2048, 0, 1},
};
#define NPRODS (sizeof PRODS / sizeof PRODS[0])
#define NV 3
static const char *VNAME[NV] = {"tera", "tiles", "onednn"};

#if DNNL_VERSION_MAJOR == 2
/* the matmul primitive of TERA_GEMM_TILES=0 (tera's cached primitive: same descriptors), created on
 * every thread */
typedef struct {
    dnnl_engine_t eng;
    dnnl_stream_t stream;
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c;
} primitive;

static void prim_create(primitive *p, const prod *q, int64_t lda, int64_t ldb) {
    dnnl_engine_create(&p->eng, dnnl_cpu, 0);
    dnnl_stream_create(&p->stream, p->eng, dnnl_stream_default_flags);
    dnnl_memory_desc_t ad, bd, cd;
    dnnl_dims_t adims = {q->M, q->K}, bdims = {q->K, q->N}, cdims = {q->M, q->N};
    dnnl_dims_t as = {q->ta ? 1 : lda, q->ta ? lda : 1}, bs = {q->tb ? 1 : ldb, q->tb ? ldb : 1}, cs = {q->N, 1};
    dnnl_memory_desc_init_by_strides(&ad, 2, adims, dnnl_f32, as);
    dnnl_memory_desc_init_by_strides(&bd, 2, bdims, dnnl_f32, bs);
    dnnl_memory_desc_init_by_strides(&cd, 2, cdims, dnnl_f32, cs);
    dnnl_matmul_desc_t md;
    dnnl_matmul_desc_init(&md, &ad, &bd, NULL, &cd);
    dnnl_primitive_attr_t attr;
    dnnl_primitive_attr_create(&attr);
    dnnl_post_ops_t po;
    dnnl_post_ops_create(&po);
    dnnl_post_ops_append_sum(po, 1.0f);
    dnnl_primitive_attr_set_post_ops(attr, po);
    dnnl_post_ops_destroy(po);
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, &md, attr, p->eng, NULL) != dnnl_success) {
        fprintf(stderr, "bench_gemm: no matmul primitive for %s\n", q->name);
        exit(1);
    }
    dnnl_primitive_create(&p->prim, pd);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    dnnl_memory_create(&p->a, &ad, p->eng, DNNL_MEMORY_NONE);
    dnnl_memory_create(&p->b, &bd, p->eng, DNNL_MEMORY_NONE);
    dnnl_memory_create(&p->c, &cd, p->eng, DNNL_MEMORY_NONE);
}

static void prim_run(primitive *p, const float *A, const float *B, float *C) {
    dnnl_memory_set_data_handle(p->a, (void *)A);
    dnnl_memory_set_data_handle(p->b, (void *)B);
    dnnl_memory_set_data_handle(p->c, C);
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, p->a}, {DNNL_ARG_WEIGHTS, p->b}, {DNNL_ARG_DST, p->c}};
    dnnl_primitive_execute(p->prim, p->stream, 3, args);
    dnnl_stream_wait(p->stream);
}

static void prim_destroy(primitive *p) {
    dnnl_memory_destroy(p->a);
    dnnl_memory_destroy(p->b);
    dnnl_memory_destroy(p->c);
    dnnl_primitive_destroy(p->prim);
    dnnl_stream_destroy(p->stream);
    dnnl_engine_destroy(p->eng);
}
#define HAVE_PRIM 1
#else
#define HAVE_PRIM 0
#endif

/* one product of variant v into C (called on one thread inside a region, or outside on all) */
static void run_one(int v, const prod *q, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                    void *prim) {
    if (v == 2) {
#if HAVE_PRIM
        if (prim && !omp_in_parallel()) {
            prim_run((primitive *)prim, A, B, C);
            return;
        }
#else
        (void)prim;
#endif
        dnnl_sgemm(q->ta ? 'T' : 'N', q->tb ? 'T' : 'N', q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C, q->N);
        return;
    }
    tera_cpu_gemm_pieces(v == 0);
    tera_cpu_gemm_pad(v == 0);
    tera_gemm(q->ta, q->tb, q->M, q->N, q->K, 1.0f, A, lda, B, ldb, 1.0f, C, q->N);
}

int main(int argc, char **argv) {
    int threads = 2, reps = 15;
    const char *cfg = "all", *only = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--config")) cfg = argv[i + 1];
        else if (!strcmp(argv[i], "--only")) only = argv[i + 1];
    }
    if (reps < 1 || reps > 1000 || threads < 1 || (strcmp(cfg, "s") && strcmp(cfg, "m") && strcmp(cfg, "all"))) {
        fprintf(stderr, "bench_gemm: --reps 1..1000, --threads >= 1, --config s|m|all\n");
        return 2;
    }
    tera_set_threads(threads);
    printf("threads %d, reps %d (medians; ms per product, side-by-side products per thread)\n", threads, reps);
    printf("%-3s %-16s %6s %6s %6s | %8s %8s %8s | %7s %7s %7s | %6s %6s\n", "cfg", "product", "M", "N", "K", "tera ms",
           "tiles ms", "onednn", "tera GF", "tilesGF", "onednGF", "t/tile", "t/onei");
    double *t[NV];
    for (int v = 0; v < NV; v++) t[v] = malloc(sizeof(double) * (size_t)reps);
    double step[2][NV] = {{0}};
    for (size_t p = 0; p < NPRODS; p++) {
        const prod *q = &PRODS[p];
        if (strcmp(cfg, "all") && strcmp(cfg, q->cfg)) continue;
        if (only && !strstr(q->name, only)) continue;
        const int64_t lda = q->ta ? q->M : q->K, ldb = q->tb ? q->K : q->N;
        const int side = q->side && threads > 1;
        const int copies = side ? threads : 1;
        float *A = malloc(sizeof(float) * (size_t)(q->M * q->K)), *B = malloc(sizeof(float) * (size_t)(q->K * q->N));
        float *C = calloc((size_t)(q->M * q->N * copies), sizeof(float));
        for (int64_t i = 0; i < q->M * q->K; i++) A[i] = (float)((i * 7 % 13) - 6) * 0.01f;
        for (int64_t i = 0; i < q->K * q->N; i++) B[i] = (float)((i * 5 % 11) - 5) * 0.01f;
        void *prim = NULL;
#if HAVE_PRIM
        primitive pr;
        if (!side && q->M * q->N * q->K >= (1LL << 30)) { /* tera_gemm's threshold with TERA_GEMM_TILES=0 */
            prim_create(&pr, q, lda, ldb);
            prim = &pr;
        }
#endif
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up (primitive creation, page faults) */
            for (int s = 0; s < NV; s++) {
                const int v = (s + (r < 0 ? 0 : r)) % NV; /* the order rotated every repetition */
                const double t0 = omp_get_wtime();
                if (side) {
#pragma omp parallel num_threads(threads)
                    run_one(v, q, A, lda, B, ldb, C + (int64_t)omp_get_thread_num() * q->M * q->N, prim);
                } else {
                    run_one(v, q, A, lda, B, ldb, C, prim);
                }
                if (r >= 0) t[v][r] = (omp_get_wtime() - t0) / copies;
            }
        }
        tera_cpu_gemm_pieces(1);
        tera_cpu_gemm_pad(1);
        double med[NV];
        for (int v = 0; v < NV; v++) med[v] = median(t[v], reps);
        const double gf = 2.0 * (double)(q->M * q->N * q->K) * 1e-9;
        printf("%-3s %-16s %6ld %6ld %6ld | %8.3f %8.3f %8.3f | %7.1f %7.1f %7.1f | %6.3f %6.3f\n", q->cfg, q->name,
               (long)q->M, (long)q->N, (long)q->K, med[0] * 1e3, med[1] * 1e3, med[2] * 1e3, gf / med[0], gf / med[1],
               gf / med[2], med[0] / med[1], med[0] / med[2]);
        fflush(stdout);
        for (int v = 0; v < NV; v++) step[q->cfg[0] == 'm'][v] += q->count * med[v];
#if HAVE_PRIM
        if (prim) prim_destroy(&pr);
#endif
        free(A);
        free(B);
        free(C);
    }
    for (int c = 0; c < 2; c++) {
        if (step[c][0] == 0.0) continue;
        printf("step estimate bench-%s (products x their count per step), ms: tera %.1f, tiles %.1f, onednn %.1f "
               "(tera / tiles %.3f, tera / onednn %.3f)\n",
               c ? "m" : "s", step[c][0] * 1e3, step[c][1] * 1e3, step[c][2] * 1e3, step[c][0] / step[c][1],
               step[c][0] / step[c][2]);
    }
    for (int v = 0; v < NV; v++) free(t[v]);
    (void)VNAME;
    return 0;
}
