/* The CUDA backend (src/kernels/cuda/) against the CPU backend, op by op, on the same inputs:
 * fp32 results to 1e-5 (relative, with an absolute floor of 1e-5 of the tensor's largest value),
 * bf16/fp16 products to the same bound against the CPU's bf16/fp16 products (both round the
 * operands the same way; only the order of the fp32 sums differs), initialisation and RoPE tables
 * bit for bit. Every op runs on device buffers; a second test runs ops on host buffers (the staging
 * path the model uses today). Also checks that a repeated op gives bit-identical results.
 *
 * Skips (exit 0, one line saying why) in a build without CUDA or on a machine without a device.
 * `test_cuda --bench` prints throughput figures instead (scripts/gpu-check.sh). */
#include "testutil.h"
#include "kernels/cuda/backend_cuda.h"
#include "tera/backend.h"
#include "tera/kernels.h"

#ifndef TERA_CUDA
int main(void) {
    printf("skip: this build has no CUDA backend (configured without nvcc/cuBLAS, or -DTERA_CUDA=OFF)\n");
    return 0;
}
#else

#include <time.h>

static tera_backend *g_cpu, *g_gpu;

/* A float tensor: the CPU backend's copy (h) and the CUDA backend's (d), equal at creation. */
typedef struct {
    float *h, *d;
    int64_t n;
} tbuf;
typedef struct {
    int32_t *h, *d;
    int64_t n;
} ibuf;

static uint64_t g_seed = 1;

static tbuf mk(int64_t n, float a) {
    tbuf b = {malloc(sizeof(float) * (size_t)(n ? n : 1)), g_gpu->mem.alloc(g_gpu, sizeof(float) * (size_t)(n ? n : 1)), n};
    tu_fill(b.h, n, g_seed++, a);
    tera_cuda_copy(b.d, b.h, sizeof(float) * (size_t)n);
    return b;
}
static ibuf mki(const int32_t *v, int64_t n) {
    ibuf b = {malloc(sizeof(int32_t) * (size_t)n), g_gpu->mem.alloc(g_gpu, sizeof(int32_t) * (size_t)n), n};
    memcpy(b.h, v, sizeof(int32_t) * (size_t)n);
    tera_cuda_copy(b.d, b.h, sizeof(int32_t) * (size_t)n);
    return b;
}
static void rel(tbuf *b) {
    free(b->h);
    g_gpu->mem.free(g_gpu, b->d);
}
static void reli(ibuf *b) {
    free(b->h);
    g_gpu->mem.free(g_gpu, b->d);
}

/* The device copy against the CPU's: |gpu - cpu| <= tol (|cpu| + max|cpu|). */
static void check(const char *what, const tbuf *b, double tol) {
    float *got = malloc(sizeof(float) * (size_t)(b->n ? b->n : 1));
    tera_cuda_sync(g_gpu);
    tera_cuda_copy(got, b->d, sizeof(float) * (size_t)b->n);
    double mx = 0.0;
    for (int64_t i = 0; i < b->n; i++) mx = fmax(mx, fabs((double)b->h[i]));
    const double r = tu_close(what, got, b->h, b->n, tol, tol * (mx > 0 ? mx : 1.0));
    free(got);
    if (!(r <= 1.0)) fail_msg("%s differs from the CPU backend beyond %g", what, tol);
}
static void check_exact(const char *what, const tbuf *b) {
    float *got = malloc(sizeof(float) * (size_t)(b->n ? b->n : 1));
    tera_cuda_sync(g_gpu);
    tera_cuda_copy(got, b->d, sizeof(float) * (size_t)b->n);
    if (memcmp(got, b->h, sizeof(float) * (size_t)b->n) != 0) fail_msg("%s is not bit-identical to the CPU's", what);
    free(got);
}

#define TOL 1e-5

static void test_gemm(void **state) {
    (void)state;
    const int64_t M = 37, N = 29, K = 53, ld = 61;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            tbuf A = mk(ld * 64, 1.0f), B = mk(ld * 64, 1.0f), C = mk(M * ld, 1.0f);
            g_cpu->ops.gemm(g_cpu, ta, tb, M, N, K, 0.7f, A.h, ld, B.h, ld, 0.5f, C.h, ld);
            g_gpu->ops.gemm(g_gpu, ta, tb, M, N, K, 0.7f, A.d, ld, B.d, ld, 0.5f, C.d, ld);
            char name[64];
            snprintf(name, sizeof name, "gemm ta=%d tb=%d", ta, tb);
            check(name, &C, TOL);
            rel(&A), rel(&B), rel(&C);
        }
}

/* linear forward and backward in the backends' precision p (both set to p) */
static void linear_case(tera_precision p, double tol) {
    /* the CPU's bf16 units: native where oneDNN has bf16 kernels (AVX-512), else the fp32 ones on
     * bf16-rounded operands (the same numbers up to the order of the sums) */
    tera_backend_set_precision(g_cpu, p, g_cpu->caps.bf16_native(g_cpu) ? TERA_BF16_NATIVE : TERA_BF16_FMA);
    tera_backend_set_precision(g_gpu, p, TERA_BF16_NATIVE);
    const int64_t N = 45, in = 96, out = 72;
    tbuf x = mk(N * in, 1.0f), w = mk(out * in, 0.2f), y = mk(N * out, 1.0f), dy = mk(N * out, 1.0f);
    tbuf dx = mk(N * in, 1.0f), dw = mk(out * in, 1.0f);
    for (int fp32 = 0; fp32 < 2; fp32++) {
        tera_backend *bs[2] = {g_cpu, g_gpu};
        for (int i = 0; i < 2; i++) {
            tera_backend *be = bs[i];
            float *X = i ? x.d : x.h, *W = i ? w.d : w.h, *Y = i ? y.d : y.h, *DY = i ? dy.d : dy.h;
            float *DX = i ? dx.d : dx.h, *DW = i ? dw.d : dw.h;
            if (fp32) {
                be->ops.linear_forward_fp32(be, Y, X, W, N, in, out, 1.0f);
                be->ops.linear_backward_fp32(be, DX, DW, DY, X, W, N, in, out, 1.0f, 1.0f);
            } else {
                be->ops.linear_forward(be, Y, X, W, N, in, out, 0.0f);
                be->ops.linear_backward(be, DX, DW, DY, X, W, N, in, out, 0.0f, 1.0f);
                be->ops.linear_backward(be, NULL, DW, DY, X, W, N, in, out, 0.0f, 1.0f);
                be->ops.linear_backward(be, DX, NULL, DY, X, W, N, in, out, 1.0f, 1.0f);
            }
        }
        char name[96];
        snprintf(name, sizeof name, "linear %s%s y", tera_precision_name(p), fp32 ? " (fp32 op)" : "");
        check(name, &y, fp32 ? TOL : tol);
        snprintf(name, sizeof name, "linear %s%s dx", tera_precision_name(p), fp32 ? " (fp32 op)" : "");
        check(name, &dx, fp32 ? TOL : tol);
        snprintf(name, sizeof name, "linear %s%s dw", tera_precision_name(p), fp32 ? " (fp32 op)" : "");
        check(name, &dw, fp32 ? TOL : tol);
        /* dw_beta 0: dw stored without reading the NaN there (a step's first micro-batch), also for an
         * empty product (N = 0: zeros) */
        for (int n0 = 0; n0 < 2; n0++) {
            for (int i = 0; i < 2; i++) {
                tera_backend *be = bs[i];
                float *X = i ? x.d : x.h, *W = i ? w.d : w.h, *DY = i ? dy.d : dy.h, *DW = i ? dw.d : dw.h;
                for (int64_t k = 0; k < dw.n; k++) dw.h[k] = NAN;
                if (i) tera_cuda_copy(dw.d, dw.h, sizeof(float) * (size_t)dw.n);
                const int64_t rows = n0 ? 0 : N;
                if (fp32) be->ops.linear_backward_fp32(be, NULL, DW, DY, X, W, rows, in, out, 0.0f, 0.0f);
                else be->ops.linear_backward(be, NULL, DW, DY, X, W, rows, in, out, 0.0f, 0.0f);
            }
            snprintf(name, sizeof name, "linear %s%s dw stored%s", tera_precision_name(p), fp32 ? " (fp32 op)" : "",
                     n0 ? " (no rows)" : "");
            check(name, &dw, fp32 ? TOL : tol);
        }
    }
    rel(&x), rel(&w), rel(&y), rel(&dy), rel(&dx), rel(&dw);
    tera_backend_set_precision(g_cpu, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(g_gpu, TERA_PREC_FP32, TERA_BF16_NATIVE);
}

static void test_linear(void **state) {
    (void)state;
    linear_case(TERA_PREC_FP32, TOL);
    /* bf16/fp16: the same rounded operands on both sides, fp32 sums in another order */
    linear_case(TERA_PREC_BF16, TOL);
    linear_case(TERA_PREC_FP16, TOL);
}

/* the bf16 products are really rounded: the CUDA bf16 result is far from the fp32 one */
static void test_bf16_rounds(void **state) {
    (void)state;
    const int64_t N = 16, in = 128, out = 16;
    tbuf x = mk(N * in, 1.0f), w = mk(out * in, 1.0f), y = mk(N * out, 0.0f), y32 = mk(N * out, 0.0f);
    tera_backend_set_precision(g_gpu, TERA_PREC_BF16, TERA_BF16_NATIVE);
    g_gpu->ops.linear_forward(g_gpu, y.d, x.d, w.d, N, in, out, 0.0f);
    tera_backend_set_precision(g_gpu, TERA_PREC_FP32, TERA_BF16_NATIVE);
    g_gpu->ops.linear_forward(g_gpu, y32.d, x.d, w.d, N, in, out, 0.0f);
    tera_cuda_sync(g_gpu);
    tera_cuda_copy(y.h, y.d, sizeof(float) * (size_t)y.n);
    tera_cuda_copy(y32.h, y32.d, sizeof(float) * (size_t)y32.n);
    double diff = 0.0;
    for (int64_t i = 0; i < y.n; i++) diff = fmax(diff, fabs((double)y.h[i] - y32.h[i]));
    assert_true(diff > 1e-3); /* bf16 operands carry 8 significant bits */
    rel(&x), rel(&w), rel(&y), rel(&y32);
}

static void test_rmsnorm(void **state) {
    (void)state;
    const int64_t N = 33, D = 300;
    tbuf x = mk(N * D, 2.0f), w = mk(D, 1.0f), y = mk(N * D, 1.0f), r = mk(N, 1.0f);
    tbuf dy = mk(N * D, 1.0f), dx = mk(N * D, 1.0f), dw = mk(D, 1.0f);
    g_cpu->ops.rmsnorm_forward(g_cpu, y.h, r.h, x.h, w.h, N, D, 1e-5f);
    g_gpu->ops.rmsnorm_forward(g_gpu, y.d, r.d, x.d, w.d, N, D, 1e-5f);
    check("rmsnorm y", &y, TOL);
    check("rmsnorm rstd", &r, TOL);
    g_cpu->ops.rmsnorm_backward(g_cpu, dx.h, dw.h, dy.h, x.h, w.h, r.h, N, D);
    g_gpu->ops.rmsnorm_backward(g_gpu, dx.d, dw.d, dy.d, x.d, w.d, r.d, N, D);
    check("rmsnorm dx", &dx, TOL);
    check("rmsnorm dw", &dw, TOL);
    rel(&x), rel(&w), rel(&y), rel(&r), rel(&dy), rel(&dx), rel(&dw);
}

static void test_rope(void **state) {
    (void)state;
    const int B = 2, T = 19, nh = 3, hd = 16;
    tbuf c = mk(T * hd / 2, 0.0f), s = mk(T * hd / 2, 0.0f), x = mk((int64_t)B * T * nh * hd, 1.0f);
    g_cpu->ops.rope_tables(g_cpu, c.h, s.h, T, hd, 10000.0f);
    g_gpu->ops.rope_tables(g_gpu, c.d, s.d, T, hd, 10000.0f);
    check_exact("rope cos table", &c);
    check_exact("rope sin table", &s);
    g_cpu->ops.rope_forward(g_cpu, x.h, c.h, s.h, B, T, nh, hd);
    g_gpu->ops.rope_forward(g_gpu, x.d, c.d, s.d, B, T, nh, hd);
    check("rope forward", &x, TOL);
    g_cpu->ops.rope_backward(g_cpu, x.h, c.h, s.h, B, T, nh, hd);
    g_gpu->ops.rope_backward(g_gpu, x.d, c.d, s.d, B, T, nh, hd);
    check("rope backward", &x, TOL);
    rel(&c), rel(&s), rel(&x);
}

static void attention_case(int B, int T, int H, int Hkv, int hd) {
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd, nr = (int64_t)B * H * T;
    tbuf q = mk(nq, 1.0f), k = mk(nk, 1.0f), v = mk(nk, 1.0f), o = mk(nq, 0.0f), lse = mk(nr, 0.0f);
    tbuf dout = mk(nq, 1.0f), dq = mk(nq, 0.0f), dk = mk(nk, 0.0f), dv = mk(nk, 0.0f);
    const size_t sc = g_cpu->ops.attention_scratch_floats(g_cpu, B, T, H, Hkv, hd);
    const size_t sg = g_gpu->ops.attention_scratch_floats(g_gpu, B, T, H, Hkv, hd);
    float *scpu = malloc(sizeof(float) * sc);
    float *sgpu = g_gpu->mem.alloc(g_gpu, sizeof(float) * (sg ? sg : 1));
    g_cpu->ops.attention_forward(g_cpu, o.h, lse.h, q.h, k.h, v.h, B, T, H, Hkv, hd, scpu);
    g_gpu->ops.attention_forward(g_gpu, o.d, lse.d, q.d, k.d, v.d, B, T, H, Hkv, hd, sgpu);
    check("attention out", &o, TOL);
    check("attention lse", &lse, TOL);
    /* the backward from the CPU's forward results on both sides */
    tera_cuda_copy(o.d, o.h, sizeof(float) * (size_t)nq);
    tera_cuda_copy(lse.d, lse.h, sizeof(float) * (size_t)nr);
    g_cpu->ops.attention_backward(g_cpu, dq.h, dk.h, dv.h, dout.h, q.h, k.h, v.h, o.h, lse.h, B, T, H, Hkv, hd, scpu);
    g_gpu->ops.attention_backward(g_gpu, dq.d, dk.d, dv.d, dout.d, q.d, k.d, v.d, o.d, lse.d, B, T, H, Hkv, hd, sgpu);
    check("attention dq", &dq, TOL);
    check("attention dk", &dk, TOL);
    check("attention dv", &dv, TOL);
    free(scpu);
    g_gpu->mem.free(g_gpu, sgpu);
    rel(&q), rel(&k), rel(&v), rel(&o), rel(&lse), rel(&dout), rel(&dq), rel(&dk), rel(&dv);
}

static void test_attention(void **state) {
    (void)state;
    attention_case(2, 37, 4, 2, 40); /* GQA, a head width that is not a multiple of 32 */
    attention_case(1, 130, 2, 2, 64);
    attention_case(1, 9, 3, 1, 128);
}

static void test_swiglu_add(void **state) {
    (void)state;
    const int64_t n = 1000;
    tbuf a1 = mk(n, 4.0f), a3 = mk(n, 2.0f), g = mk(n, 0.0f), dg = mk(n, 1.0f), d1 = mk(n, 0.0f), d3 = mk(n, 0.0f);
    g_cpu->ops.swiglu_forward(g_cpu, g.h, a1.h, a3.h, n);
    g_gpu->ops.swiglu_forward(g_gpu, g.d, a1.d, a3.d, n);
    check("swiglu forward", &g, TOL);
    g_cpu->ops.swiglu_backward(g_cpu, d1.h, d3.h, dg.h, a1.h, a3.h, n);
    g_gpu->ops.swiglu_backward(g_gpu, d1.d, d3.d, dg.d, a1.d, a3.d, n);
    check("swiglu da1", &d1, TOL);
    check("swiglu da3", &d3, TOL);
    g_cpu->ops.add_forward(g_cpu, g.h, a1.h, n);
    g_gpu->ops.add_forward(g_gpu, g.d, a1.d, n);
    check_exact("add", &g);
    rel(&a1), rel(&a3), rel(&g), rel(&dg), rel(&d1), rel(&d3);
}

static void test_embedding(void **state) {
    (void)state;
    const int64_t V = 50, D = 24, N = 40, v0 = 20, Vl = 15;
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (int32_t)((i * 7 + 3) % V);
    ibuf t = mki(tok, N);
    tbuf table = mk(V * D, 1.0f), x = mk(N * D, 1.0f), dx = mk(N * D, 1.0f), dtab = mk(V * D, 1.0f);
    g_cpu->ops.embedding_forward(g_cpu, x.h, table.h, t.h, N, D);
    g_gpu->ops.embedding_forward(g_gpu, x.d, table.d, t.d, N, D);
    check_exact("embedding forward", &x);
    g_cpu->ops.embedding_backward(g_cpu, dtab.h, dx.h, t.h, N, D);
    g_gpu->ops.embedding_backward(g_gpu, dtab.d, dx.d, t.d, N, D);
    check_exact("embedding backward", &dtab); /* the same order of sums */
    g_cpu->ops.embedding_forward_range(g_cpu, x.h, table.h + v0 * D, t.h, N, D, v0, Vl);
    g_gpu->ops.embedding_forward_range(g_gpu, x.d, table.d + v0 * D, t.d, N, D, v0, Vl);
    check_exact("embedding forward (range)", &x);
    g_cpu->ops.embedding_backward_range(g_cpu, dtab.h + v0 * D, dx.h, t.h, N, D, v0, Vl);
    g_gpu->ops.embedding_backward_range(g_gpu, dtab.d + v0 * D, dx.d, t.d, N, D, v0, Vl);
    check_exact("embedding backward (range)", &dtab);
    reli(&t), rel(&table), rel(&x), rel(&dx), rel(&dtab);
}

static void test_cross_entropy(void **state) {
    (void)state;
    const int64_t N = 21, V = 333, v0 = 100, Vl = 120;
    int32_t tg[21];
    for (int i = 0; i < 21; i++) tg[i] = (int32_t)((i * 37 + 5) % V);
    ibuf t = mki(tg, N);
    tbuf lg = mk(N * V, 6.0f), lse = mk(N, 0.0f), d = mk(N * V, 0.0f);
    const double lc = g_cpu->ops.ce_forward(g_cpu, lse.h, lg.h, t.h, N, V);
    const double lgpu = g_gpu->ops.ce_forward(g_gpu, lse.d, lg.d, t.d, N, V);
    if (!(fabs(lc - lgpu) <= TOL * fabs(lc))) fail_msg("ce_forward loss %.9g, CPU %.9g", lgpu, lc);
    check("ce_forward lse", &lse, TOL);
    g_cpu->ops.ce_backward(g_cpu, d.h, lg.h, t.h, N, V, 0.25f);
    g_gpu->ops.ce_backward(g_gpu, d.d, lg.d, t.d, N, V, 0.25f);
    check("ce_backward", &d, TOL);
    /* in place (dlogits = logits), as the model calls it */
    g_cpu->ops.ce_backward(g_cpu, lg.h, lg.h, t.h, N, V, 0.25f);
    g_gpu->ops.ce_backward(g_gpu, lg.d, lg.d, t.d, N, V, 0.25f);
    check("ce_backward in place", &lg, TOL);
    /* the slice pieces on the columns [v0, v0 + Vl) of a [N, Vl] slice */
    tbuf sl = mk(N * Vl, 6.0f), mx = mk(N, 0.0f), se = mk(N, 0.0f), tl = mk(N, 0.0f), ds = mk(N * Vl, 0.0f);
    g_cpu->ops.ce_slice_max(g_cpu, mx.h, sl.h, N, Vl);
    g_gpu->ops.ce_slice_max(g_gpu, mx.d, sl.d, N, Vl);
    check_exact("ce_slice_max", &mx);
    g_cpu->ops.ce_slice_sums(g_cpu, se.h, tl.h, NULL, sl.h, mx.h, t.h, N, Vl, v0);
    g_gpu->ops.ce_slice_sums(g_gpu, se.d, tl.d, NULL, sl.d, mx.d, t.d, N, Vl, v0);
    check("ce_slice_sums sumexp", &se, TOL);
    check_exact("ce_slice_sums tlogit", &tl);
    /* the exponentials written too (the same sums) */
    tbuf es = mk(N * Vl, 0.0f);
    g_cpu->ops.ce_slice_sums(g_cpu, se.h, tl.h, es.h, sl.h, mx.h, t.h, N, Vl, v0);
    g_gpu->ops.ce_slice_sums(g_gpu, se.d, tl.d, es.d, sl.d, mx.d, t.d, N, Vl, v0);
    check("ce_slice_sums sumexp (with e)", &se, TOL);
    check_exact("ce_slice_sums tlogit (with e)", &tl);
    check("ce_slice_sums e", &es, TOL);
    /* the backward from the same e and sums on both */
    tera_cuda_copy(es.d, es.h, sizeof(float) * (size_t)(N * Vl));
    tera_cuda_copy(se.d, se.h, sizeof(float) * (size_t)N);
    g_cpu->ops.ce_backward_range(g_cpu, ds.h, es.h, se.h, t.h, N, Vl, v0, 0.5f);
    g_gpu->ops.ce_backward_range(g_gpu, ds.d, es.d, se.d, t.d, N, Vl, v0, 0.5f);
    check("ce_backward_range", &ds, TOL);
    /* in place: e = logits, then dlogits = e */
    g_cpu->ops.ce_slice_sums(g_cpu, se.h, tl.h, sl.h, sl.h, mx.h, t.h, N, Vl, v0);
    g_gpu->ops.ce_slice_sums(g_gpu, se.d, tl.d, sl.d, sl.d, mx.d, t.d, N, Vl, v0);
    check_exact("ce_slice_sums tlogit in place", &tl);
    check("ce_slice_sums e in place", &sl, TOL);
    tera_cuda_copy(sl.d, sl.h, sizeof(float) * (size_t)(N * Vl));
    tera_cuda_copy(se.d, se.h, sizeof(float) * (size_t)N);
    g_cpu->ops.ce_backward_range(g_cpu, sl.h, sl.h, se.h, t.h, N, Vl, v0, 0.5f);
    g_gpu->ops.ce_backward_range(g_gpu, sl.d, sl.d, se.d, t.d, N, Vl, v0, 0.5f);
    check("ce_backward_range in place", &sl, TOL);
    reli(&t), rel(&lg), rel(&lse), rel(&d), rel(&sl), rel(&mx), rel(&se), rel(&tl), rel(&ds), rel(&es);
}

static void test_softmax(void **state) {
    (void)state;
    const int64_t N = 50, E = 17;
    tbuf lg = mk(N * E, 3.0f), p = mk(N * E, 0.0f), lse = mk(N, 0.0f), dp = mk(N * E, 1.0f), dl = mk(N * E, 0.0f);
    g_cpu->ops.softmax_forward(g_cpu, p.h, lse.h, lg.h, N, E);
    g_gpu->ops.softmax_forward(g_gpu, p.d, lse.d, lg.d, N, E);
    check("softmax probs", &p, TOL);
    check("softmax lse", &lse, TOL);
    g_cpu->ops.softmax_backward(g_cpu, dl.h, dp.h, p.h, N, E);
    g_gpu->ops.softmax_backward(g_gpu, dl.d, dp.d, p.d, N, E);
    check("softmax backward", &dl, TOL);
    rel(&lg), rel(&p), rel(&lse), rel(&dp), rel(&dl);
}

/* N tokens, k = 2, a dropped assignment every fifth; R kept rows */
static int moe_plan(int32_t *slot_row, int32_t *row_tok, int N, int k) {
    int R = 0;
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k; j++) {
            if ((t * k + j) % 5 == 4) {
                slot_row[t * k + j] = -1;
                continue;
            }
            slot_row[t * k + j] = R;
            row_tok[R++] = t;
        }
    return R;
}

static void test_moe_tokens(void **state) {
    (void)state;
    enum { N = 23, K = 2 };
    const int64_t D = 40;
    int32_t sr[N * K], rt[N * K];
    const int R = moe_plan(sr, rt, N, K);
    ibuf slot = mki(sr, N * K), rtok = mki(rt, R);
    tbuf x = mk(N * D, 1.0f), xg = mk(R * D, 0.0f), dx = mk(N * D, 1.0f), dxg = mk(R * D, 1.0f);
    tbuf ye = mk(R * D, 1.0f), topw = mk(N * K, 1.0f), out = mk(N * D, 1.0f), dy = mk(N * D, 1.0f);
    tbuf dye = mk(R * D, 0.0f), dtopw = mk(N * K, 0.0f);
    g_cpu->ops.moe_gather_forward(g_cpu, xg.h, x.h, rtok.h, R, D);
    g_gpu->ops.moe_gather_forward(g_gpu, xg.d, x.d, rtok.d, R, D);
    check_exact("moe_gather_forward", &xg);
    g_cpu->ops.moe_gather_backward(g_cpu, dx.h, dxg.h, slot.h, N, K, D);
    g_gpu->ops.moe_gather_backward(g_gpu, dx.d, dxg.d, slot.d, N, K, D);
    check_exact("moe_gather_backward", &dx);
    g_cpu->ops.moe_combine_forward(g_cpu, out.h, ye.h, topw.h, slot.h, N, K, D);
    g_gpu->ops.moe_combine_forward(g_gpu, out.d, ye.d, topw.d, slot.d, N, K, D);
    check("moe_combine_forward", &out, TOL);
    g_cpu->ops.moe_combine_backward(g_cpu, dye.h, dtopw.h, dy.h, ye.h, topw.h, slot.h, N, K, D);
    g_gpu->ops.moe_combine_backward(g_gpu, dye.d, dtopw.d, dy.d, ye.d, topw.d, slot.d, N, K, D);
    check_exact("moe_combine_backward dye", &dye);
    check("moe_combine_backward dtopw", &dtopw, TOL);
    reli(&slot), reli(&rtok), rel(&x), rel(&xg), rel(&dx), rel(&dxg), rel(&ye), rel(&topw), rel(&out), rel(&dy);
    rel(&dye), rel(&dtopw);
}

static void test_fill(void **state) {
    (void)state;
    const int64_t shape[3] = {4, 30, 20}, lo[3] = {1, 5, 2}, len[3] = {2, 10, 15};
    const int64_t n = len[0] * len[1] * len[2];
    tbuf w = mk(n, 0.0f);
    g_cpu->ops.fill_normal_block(g_cpu, w.h, n, shape, lo, len, 0.02f, 1234, 7);
    g_gpu->ops.fill_normal_block(g_gpu, w.d, n, shape, lo, len, 0.02f, 1234, 7);
    check_exact("fill_normal_block", &w);
    rel(&w);
}

/* Host buffers given to the CUDA backend (staged through the device): the path the model uses. */
static void test_host_buffers(void **state) {
    (void)state;
    const int64_t N = 30, in = 64, out = 48;
    float *x = malloc(sizeof(float) * N * in), *w = malloc(sizeof(float) * out * in);
    float *yc = malloc(sizeof(float) * N * out), *yg = malloc(sizeof(float) * N * out);
    tu_fill(x, N * in, 11, 1.0f);
    tu_fill(w, out * in, 12, 0.3f);
    tu_fill(yc, N * out, 13, 1.0f);
    memcpy(yg, yc, sizeof(float) * N * out);
    g_cpu->ops.linear_forward(g_cpu, yc, x, w, N, in, out, 1.0f);
    g_gpu->ops.linear_forward(g_gpu, yg, x, w, N, in, out, 1.0f); /* returns with yg written */
    assert_true(tu_close("linear on host buffers", yg, yc, N * out, TOL, TOL * 10) <= 1.0);
    /* in-place cross-entropy backward on host memory: the same pointer staged once */
    int32_t tg[30];
    for (int i = 0; i < 30; i++) tg[i] = (i * 5) % (int)out;
    float *lc = malloc(sizeof(float) * N), *lgp = malloc(sizeof(float) * N);
    const double a = g_cpu->ops.ce_forward(g_cpu, lc, yc, tg, N, out);
    const double b = g_gpu->ops.ce_forward(g_gpu, lgp, yg, tg, N, out);
    assert_true(fabs(a - b) <= 1e-4 * fabs(a));
    g_cpu->ops.ce_backward(g_cpu, yc, yc, tg, N, out, 1.0f);
    g_gpu->ops.ce_backward(g_gpu, yg, yg, tg, N, out, 1.0f);
    assert_true(tu_close("ce_backward in place on host buffers", yg, yc, N * out, TOL, 1e-6) <= 1.0);
    /* mixed: device weight, host activations */
    float *wd = g_gpu->mem.alloc(g_gpu, sizeof(float) * out * in);
    tera_cuda_copy(wd, w, sizeof(float) * out * in);
    g_cpu->ops.linear_forward(g_cpu, yc, x, w, N, in, out, 0.0f);
    g_gpu->ops.linear_forward(g_gpu, yg, x, wd, N, in, out, 0.0f);
    assert_true(tu_close("linear, device weight and host activations", yg, yc, N * out, TOL, TOL * 10) <= 1.0);
    long long staged = 0;
    size_t bytes = 0;
    tera_cuda_staging_stats(g_gpu, &staged, &bytes);
    assert_true(staged > 0 && bytes > 0);
    g_gpu->mem.free(g_gpu, wd);
    free(x), free(w), free(yc), free(yg), free(lc), free(lgp);
}

/* The same op twice gives the same bits (no atomics in the sums). */
static void test_deterministic(void **state) {
    (void)state;
    const int B = 2, T = 64, H = 4, Hkv = 2, hd = 32;
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd, nr = (int64_t)B * H * T;
    tbuf q = mk(nq, 1.0f), k = mk(nk, 1.0f), v = mk(nk, 1.0f), o = mk(nq, 0.0f), lse = mk(nr, 0.0f);
    tbuf dout = mk(nq, 1.0f), dk1 = mk(nk, 0.0f), dk2 = mk(nk, 0.0f), dq = mk(nq, 0.0f), dv = mk(nk, 0.0f);
    float *s = g_gpu->mem.alloc(g_gpu, sizeof(float) * nr);
    g_gpu->ops.attention_forward(g_gpu, o.d, lse.d, q.d, k.d, v.d, B, T, H, Hkv, hd, s);
    g_gpu->ops.attention_backward(g_gpu, dq.d, dk1.d, dv.d, dout.d, q.d, k.d, v.d, o.d, lse.d, B, T, H, Hkv, hd, s);
    g_gpu->ops.attention_backward(g_gpu, dq.d, dk2.d, dv.d, dout.d, q.d, k.d, v.d, o.d, lse.d, B, T, H, Hkv, hd, s);
    tera_cuda_sync(g_gpu);
    tera_cuda_copy(dk1.h, dk1.d, sizeof(float) * nk);
    tera_cuda_copy(dk2.h, dk2.d, sizeof(float) * nk);
    assert_memory_equal(dk1.h, dk2.h, sizeof(float) * nk);
    g_gpu->mem.free(g_gpu, s);
    rel(&q), rel(&k), rel(&v), rel(&o), rel(&lse), rel(&dout), rel(&dk1), rel(&dk2), rel(&dq), rel(&dv);
}

/* ---- `test_cuda --bench`: throughput of the products and the attention on device buffers */
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int bench(double peak_tflops) {
    tera_backend *be = g_gpu;
    const char *isa = NULL;
    be->caps.bf16_fast(be, &isa);
    printf("{\"device\": \"%s\", \"peak_bf16_tflops\": %.1f}\n", isa ? isa : "?", peak_tflops);
    static const int64_t shapes[][3] = {{8192, 2048, 8192}, {8192, 4096, 4096}, {16384, 4096, 14336}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t N = shapes[si][0], in = shapes[si][1], out = shapes[si][2];
        float *x = be->mem.alloc(be, sizeof(float) * N * in), *w = be->mem.alloc(be, sizeof(float) * out * in);
        float *y = be->mem.alloc(be, sizeof(float) * N * out);
        const int64_t dims[3] = {1, 1, N * in}, lo[3] = {0, 0, 0};
        be->ops.fill_normal_block(be, x, N * in, dims, lo, dims, 1.0f, 1, 1);
        const int64_t dw[3] = {1, 1, out * in};
        be->ops.fill_normal_block(be, w, out * in, dw, lo, dw, 0.02f, 1, 2);
        for (int p = 0; p < 2; p++) {
            tera_backend_set_precision(be, p ? TERA_PREC_BF16 : TERA_PREC_FP32, TERA_BF16_NATIVE);
            be->ops.linear_forward(be, y, x, w, N, in, out, 0.0f); /* warm-up */
            tera_cuda_sync(be);
            const int reps = 10;
            const double t0 = now_s();
            for (int r = 0; r < reps; r++) be->ops.linear_forward(be, y, x, w, N, in, out, 0.0f);
            tera_cuda_sync(be);
            const double dt = (now_s() - t0) / reps;
            const double tf = 2.0 * N * in * out / dt / 1e12;
            printf("{\"bench\": \"linear_forward\", \"precision\": \"%s\", \"N\": %ld, \"in\": %ld, \"out\": %ld, "
                   "\"ms\": %.3f, \"tflops\": %.1f, \"of_bf16_peak\": %.3f}\n",
                   p ? "bf16" : "fp32", (long)N, (long)in, (long)out, 1e3 * dt, tf, tf / peak_tflops);
        }
        be->mem.free(be, x), be->mem.free(be, w), be->mem.free(be, y);
    }
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    const int B = 4, T = 1024, H = 16, Hkv = 4, hd = 64;
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd, nr = (int64_t)B * H * T;
    float *q = be->mem.alloc(be, sizeof(float) * nq), *k = be->mem.alloc(be, sizeof(float) * nk);
    float *v = be->mem.alloc(be, sizeof(float) * nk), *o = be->mem.alloc(be, sizeof(float) * nq);
    float *lse = be->mem.alloc(be, sizeof(float) * nr), *s = be->mem.alloc(be, sizeof(float) * nr);
    float *dq = be->mem.alloc(be, sizeof(float) * nq), *dk = be->mem.alloc(be, sizeof(float) * nk);
    float *dv = be->mem.alloc(be, sizeof(float) * nk);
    const int64_t d1[3] = {1, 1, nq}, d2[3] = {1, 1, nk}, lo[3] = {0, 0, 0};
    be->ops.fill_normal_block(be, q, nq, d1, lo, d1, 1.0f, 2, 1);
    be->ops.fill_normal_block(be, k, nk, d2, lo, d2, 1.0f, 2, 2);
    be->ops.fill_normal_block(be, v, nk, d2, lo, d2, 1.0f, 2, 3);
    be->ops.attention_forward(be, o, lse, q, k, v, B, T, H, Hkv, hd, s);
    tera_cuda_sync(be);
    double t0 = now_s();
    be->ops.attention_forward(be, o, lse, q, k, v, B, T, H, Hkv, hd, s);
    tera_cuda_sync(be);
    const double tf = now_s() - t0;
    t0 = now_s();
    be->ops.attention_backward(be, dq, dk, dv, o, q, k, v, o, lse, B, T, H, Hkv, hd, s);
    tera_cuda_sync(be);
    const double tb = now_s() - t0;
    const double flops_f = 2.0 * 2.0 * B * H * (double)T * T / 2.0 * hd; /* causal: half the scores */
    printf("{\"bench\": \"attention\", \"B\": %d, \"T\": %d, \"H\": %d, \"Hkv\": %d, \"hd\": %d, \"fwd_ms\": %.3f, "
           "\"bwd_ms\": %.3f, \"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f}\n",
           B, T, H, Hkv, hd, 1e3 * tf, 1e3 * tb, flops_f / tf / 1e12, 2.5 * flops_f / tb / 1e12);
    be->mem.free(be, q), be->mem.free(be, k), be->mem.free(be, v), be->mem.free(be, o), be->mem.free(be, lse);
    be->mem.free(be, s), be->mem.free(be, dq), be->mem.free(be, dk), be->mem.free(be, dv);
    return 0;
}

int main(int argc, char **argv) {
    char why[256] = "";
    if (tera_cuda_device_count(why, sizeof why) <= 0) {
        printf("skip: %s: the CUDA backend is built but cannot be tested here\n", why);
        return 0;
    }
    g_cpu = tera_backend_cpu_create(-1);
    g_gpu = tera_backend_cuda_create(-1, why, sizeof why);
    if (!g_gpu) {
        printf("skip: %s\n", why);
        tera_backend_destroy(g_cpu);
        return 0;
    }
    int rc;
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
        rc = bench(argc > 2 ? atof(argv[2]) : 989.0); /* H100/H200 SXM dense bf16 */
    } else {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(test_gemm),          cmocka_unit_test(test_linear),
            cmocka_unit_test(test_bf16_rounds),   cmocka_unit_test(test_rmsnorm),
            cmocka_unit_test(test_rope),          cmocka_unit_test(test_attention),
            cmocka_unit_test(test_swiglu_add),    cmocka_unit_test(test_embedding),
            cmocka_unit_test(test_cross_entropy), cmocka_unit_test(test_softmax),
            cmocka_unit_test(test_moe_tokens),    cmocka_unit_test(test_fill),
            cmocka_unit_test(test_host_buffers),  cmocka_unit_test(test_deterministic),
        };
        rc = cmocka_run_group_tests(tests, NULL, NULL);
    }
    tera_backend_destroy(g_gpu);
    tera_backend_destroy(g_cpu);
    return rc;
}
#endif
