/* Matrix products through oneDNN (AVX-512 / AMX dispatch is oneDNN's).
 *
 * Two oneDNN entry points, chosen per call:
 * - the matmul primitive for large products (the LM head): faster than sgemm there, on one thread
 *   (TN 16384x512x2048: 164 vs 105 GFLOP/s) and more so on two (272 vs 110), docs/PERFORMANCE.md;
 * - dnnl_sgemm for small products and inside parallel regions (attention tiles, experts run side by
 *   side), where creating a primitive would cost more than the product.
 * Both are deterministic for a given shape and thread count. */
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tera/kernels.h"
#include "tera/status.h"

static int g_threads = 0;

void tera_set_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    g_threads = n;
    omp_set_num_threads(n);
}

int tera_get_threads(void) { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

#define DNNL_CHECK(call)                                                                           \
    do {                                                                                           \
        dnnl_status_t _st = (call);                                                                \
        TERA_ASSERTF(_st == dnnl_success, "oneDNN call failed (status %d): %s", (int)_st, #call);   \
    } while (0)

#if DNNL_VERSION_MAJOR == 2
static dnnl_engine_t g_engine;
static dnnl_stream_t g_stream;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void engine_init(void) {
    DNNL_CHECK(dnnl_engine_create(&g_engine, dnnl_cpu, 0));
    DNNL_CHECK(dnnl_stream_create(&g_stream, g_engine, dnnl_stream_default_flags));
}

/* Primitives are created once per distinct product (shape, transposes, strides, beta) and kept
 * with their memory objects; a call only points the memory objects at its arrays, so the step loop
 * allocates nothing. A model has a few dozen distinct products. Only the calling thread that is
 * outside any parallel region uses this path, so the cache needs no lock. */
typedef struct {
    int ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    int accumulate;                  /* beta != 0 (beta is 0 or 1 in tera) */
    float beta;
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c;
} prim_entry;

#define PRIM_CACHE 128
static prim_entry g_cache[PRIM_CACHE];
static int g_cached = 0;

static prim_entry *prim_get(int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, float beta,
                            int64_t ldc) {
    for (int i = 0; i < g_cached; i++) {
        prim_entry *e = &g_cache[i];
        if (e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K && e->lda == lda && e->ldb == ldb &&
            e->ldc == ldc && e->beta == beta)
            return e;
    }
    if (g_cached == PRIM_CACHE) return NULL; /* full: the caller falls back to sgemm */
    prim_entry *e = &g_cache[g_cached];
    *e = (prim_entry){.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .lda = lda, .ldb = ldb, .ldc = ldc, .beta = beta};
    dnnl_memory_desc_t ad, bd, cd;
    dnnl_dims_t adims = {M, K}, bdims = {K, N}, cdims = {M, N};
    dnnl_dims_t as = {ta ? 1 : lda, ta ? lda : 1}, bs = {tb ? 1 : ldb, tb ? ldb : 1}, cs = {ldc, 1};
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&ad, 2, adims, dnnl_f32, as));
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&bd, 2, bdims, dnnl_f32, bs));
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&cd, 2, cdims, dnnl_f32, cs));
    dnnl_matmul_desc_t md;
    DNNL_CHECK(dnnl_matmul_desc_init(&md, &ad, &bd, NULL, &cd));
    dnnl_primitive_attr_t attr;
    DNNL_CHECK(dnnl_primitive_attr_create(&attr));
    if (beta != 0.0f) {
        dnnl_post_ops_t po;
        DNNL_CHECK(dnnl_post_ops_create(&po));
        DNNL_CHECK(dnnl_post_ops_append_sum(po, beta));
        DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
        dnnl_post_ops_destroy(po);
    }
    dnnl_primitive_desc_t pd;
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &md, attr, g_engine, NULL));
    DNNL_CHECK(dnnl_primitive_create(&e->prim, pd));
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    DNNL_CHECK(dnnl_memory_create(&e->a, &ad, g_engine, DNNL_MEMORY_NONE));
    DNNL_CHECK(dnnl_memory_create(&e->b, &bd, g_engine, DNNL_MEMORY_NONE));
    DNNL_CHECK(dnnl_memory_create(&e->c, &cd, g_engine, DNNL_MEMORY_NONE));
    g_cached++;
    return e;
}

/* C[M,N] = op(A) op(B) + beta C with a cached matmul primitive; returns 0 if the cache is full. */
static int matmul_primitive(int ta, int tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                            const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    pthread_once(&g_once, engine_init);
    prim_entry *e = prim_get(ta, tb, M, N, K, lda, ldb, beta, ldc);
    if (!e) return 0;
    DNNL_CHECK(dnnl_memory_set_data_handle(e->a, (void *)A));
    DNNL_CHECK(dnnl_memory_set_data_handle(e->b, (void *)B));
    DNNL_CHECK(dnnl_memory_set_data_handle(e->c, C));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c}};
    DNNL_CHECK(dnnl_primitive_execute(e->prim, g_stream, 3, args));
    DNNL_CHECK(dnnl_stream_wait(g_stream));
    return 1;
}
#define HAVE_MATMUL_PRIMITIVE 1
#else
#define HAVE_MATMUL_PRIMITIVE 0
#endif

/* Products of at least this many multiply-adds use the matmul primitive: below it the primitive was
 * measured no faster than sgemm (bench-s/bench-m A/B with TERA_GEMM=sgemm). */
static int64_t g_primitive_min_macs = 1LL << 30; /* TERA_GEMM_PRIMITIVE_MIN overrides (A/B timing) */

void tera_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
               int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
        /* oneDNN rejects K = 0; the product is empty, so C = beta * C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
#if HAVE_MATMUL_PRIMITIVE
    static int use_primitive = -1; /* TERA_GEMM=sgemm forces sgemm everywhere (for A/B timing) */
    if (use_primitive < 0) {
        const char *e = getenv("TERA_GEMM");
        use_primitive = !(e && strcmp(e, "sgemm") == 0);
        const char *mn = getenv("TERA_GEMM_PRIMITIVE_MIN");
        if (mn) g_primitive_min_macs = atoll(mn);
    }
    if (use_primitive && alpha == 1.0f && M * N * K >= g_primitive_min_macs && !omp_in_parallel() &&
        matmul_primitive(trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc))
        return;
#endif
    DNNL_CHECK(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}

void tera_linear_forward(float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out,
                         float beta) {
    /* y[N,out] = x[N,in] w[out,in]^T */
    tera_gemm(0, 1, N, out, in, 1.0f, x, in, w, in, beta, y, out);
}

void tera_linear_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                          int64_t N, int64_t in, int64_t out, float dx_beta) {
    /* dx[N,in] = dy[N,out] w[out,in] */
    if (dx) tera_gemm(0, 0, N, in, out, 1.0f, dy, out, w, in, dx_beta, dx, in);
    /* dw[out,in] += dy^T[out,N] x[N,in] */
    if (dw) tera_gemm(1, 0, out, in, N, 1.0f, dy, out, x, in, 1.0f, dw, in);
}
