/* Matrix products through oneDNN's sgemm (AVX-512 / AMX dispatch is oneDNN's). */
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include "tera/kernels.h"
#include "tera/status.h"

static int g_threads = 0;

void tera_set_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    g_threads = n;
    omp_set_num_threads(n);
}

int tera_get_threads(void) { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

void tera_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
               int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
        /* oneDNN rejects K = 0; the product is empty, so C = beta * C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
    dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                  ldb, beta, C, ldc);
    TERA_ASSERTF(st == dnnl_success, "dnnl_sgemm failed (status %d) M=%ld N=%ld K=%ld", (int)st,
                 (long)M, (long)N, (long)K);
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
