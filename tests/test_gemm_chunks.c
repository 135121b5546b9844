/* bf16 products on AMX written in row chunks (src/kernels/cpu/matmul.c, "bf16 outputs written in row
 * chunks"): a product with a short reduction, a fresh output and at least two chunks of rows goes chunk
 * by chunk, each chunk on one thread with its output prefetched for writing; outside a parallel region
 * the chunks are shared out among the threads. The chunks must give the bits of the whole product: the
 * same numbers as the rule off, on one thread (beside another: the experts side by side) and on every
 * thread (oneDNN's own split: an expert that runs alone), and the same chunked either way. The rule's
 * bounds: accumulating products, long reductions, wide outputs and fewer than two chunks stay one call.
 * The bit checks are skipped where oneDNN has no AMX: the rule is off there, which the first test checks
 * wherever the CPU has native bf16 products. */
#include <omp.h>

#include "testutil.h"
#include "kernels/cpu/cpu.h"
#include "tera/backend.h"
#include "tera/kernels.h"

static tera_backend *be;

static int amx(void) { return be->caps.bf16_native(be) && tera_cpu_bf16_fast(NULL); }

/* y[N,out] = x w^T (forward) or dx[N,in] = dy w (backward, dx only) on the bf16 units, run by
 * thread 1 of a 2-thread region (side: one thread beside another) or outside any region. */
static float g_beta = 0.0f; /* the product's beta (1: accumulate into the output) */
static void product(int bwd, int side, float *out, const float *a, const float *w, int64_t N, int64_t in,
                    int64_t o) {
    if (side) {
#pragma omp parallel num_threads(2)
        if (omp_get_thread_num() == omp_get_num_threads() - 1) {
            if (bwd)
                be->ops.linear_backward(be, out, NULL, a, NULL, w, N, in, o, g_beta, 0.0f);
            else
                be->ops.linear_forward(be, out, a, w, N, in, o, g_beta);
        }
    } else if (bwd) {
        be->ops.linear_backward(be, out, NULL, a, NULL, w, N, in, o, g_beta, 0.0f);
    } else {
        be->ops.linear_forward(be, out, a, w, N, in, o, g_beta);
    }
}

/* One shape: side by side and on every thread, with the rule on and off, all four bit for bit the
 * same; chunked says whether the rule applies (the counter moves by one for each of the two calls
 * with the rule on) or not. */
static void one(int bwd, int64_t N, int64_t in, int64_t o, int chunked) {
    const int64_t na = N * (bwd ? o : in), ny = N * (bwd ? in : o);
    float *a = malloc(sizeof(float) * (size_t)na), *w = malloc(sizeof(float) * (size_t)(o * in));
    float *y[4];
    for (int v = 0; v < 4; v++) y[v] = malloc(sizeof(float) * (size_t)ny);
    tu_fill(a, na, 7 + (uint64_t)N, 1.0f);
    tu_fill(w, o * in, 8 + (uint64_t)o, 0.5f);
    for (int v = 0; v < 4; v++)
        for (int64_t i = 0; i < ny; i++) y[v][i] = 0.25f; /* what an accumulating product adds to */
    static const char *const name[4] = {"side, chunks", "every thread, chunks", "side, one call",
                                        "every thread, one call"};
    for (int v = 0; v < 4; v++) { /* v 0, 1: rule on; 2, 3: off; even: side by side, odd: every thread */
        tera_cpu_gemm_out_chunk(v < 2);
        const int64_t c0 = tera_cpu_gemm_out_chunked();
        product(bwd, v % 2 == 0, y[v], a, w, N, in, o);
        assert_int_equal(tera_cpu_gemm_out_chunked() - c0, v < 2 ? chunked : 0);
    }
    tera_cpu_gemm_out_chunk(1);
    for (int v = 1; v < 4; v++)
        for (int64_t i = 0; i < ny; i++)
            if (memcmp(&y[0][i], &y[v][i], sizeof(float)))
                fail_msg("%s %lldx%lldx%lld element %lld: %s %a, %s %a", bwd ? "dx" : "y", (long long)N, (long long)in,
                         (long long)o, (long long)i, name[0], (double)y[0][i], name[v], (double)y[v][i]);
    free(a), free(w);
    for (int v = 0; v < 4; v++) free(y[v]);
}

/* The default, before any test sets it: on exactly where oneDNN has AMX (and TERA_GEMM_OUT_CHUNK is
 * not 0), so an eligible product chunks there and nowhere else. Runs first; needs native bf16 units. */
static void default_only_on_amx(void **state) {
    (void)state;
    if (!be->caps.bf16_native(be)) skip();
    const char *e = getenv("TERA_GEMM_OUT_CHUNK");
    const int want = tera_cpu_bf16_fast(NULL) && !(e && strcmp(e, "0") == 0);
    const int64_t N = 762, in = 256, o = 512;
    float *x = calloc((size_t)(N * in), sizeof(float)), *w = calloc((size_t)(o * in), sizeof(float)),
          *y = malloc(sizeof(float) * (size_t)(N * o));
    const int64_t c0 = tera_cpu_gemm_out_chunked();
    product(0, 1, y, x, w, N, in, o);
    assert_int_equal(tera_cpu_gemm_out_chunked() - c0, want);
    free(x), free(w), free(y);
}

static void chunks_same_bits(void **state) {
    (void)state;
    if (!amx()) skip();
    one(0, 762, 256, 512, 1);   /* bench-s's experts: x w1^T, x w3^T (K 256) */
    one(0, 1071, 512, 1024, 1); /* bench-m's (K 512) */
    one(0, 513, 512, 256, 1);   /* g w2^T in bench-s (K 512), a last chunk of one row */
    one(1, 762, 512, 256, 1);   /* w2's input gradient: dx[N,512] = dy[N,256] w2 (K 256) */
    one(0, 2048, 256, 256, 1);  /* the attention projections' shape */
}

static void rule_bounds(void **state) {
    (void)state;
    if (!amx()) skip();
    one(0, 511, 256, 512, 0);  /* fewer than two chunks */
    one(0, 762, 1024, 512, 0); /* K 1024: a longer reduction */
    one(0, 762, 256, 2048, 0); /* N 2048: a chunk's output would not stay in L2 */
    one(1, 762, 2048, 256, 0); /* dx of 2048 columns */
    g_beta = 1.0f;
    one(0, 762, 256, 512, 0); /* accumulating into its output: read anyway */
    g_beta = 0.0f;
}

int main(void) {
    be = tera_backend_cpu_create(-1);
    tera_backend_set_precision(be, TERA_PREC_BF16, TERA_BF16_NATIVE);
    tera_backend_reserve(be, 1 << 22, 1 << 22);
    const struct CMUnitTest tests[] = {cmocka_unit_test(default_only_on_amx), cmocka_unit_test(chunks_same_bits),
                                       cmocka_unit_test(rule_bounds)};
    const int r = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(be);
    return r;
}
