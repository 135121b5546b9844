/* Mixed precision: bf16 and fp16 linear products against fp32 (stated error bounds), the roundings,
 * the fp32 router variant, the conversion scratch, the rule for `auto`, and the loss scaler. */
#include <omp.h>

#include "testutil.h"
#include "tera/bf16.h"
#include "tera/kernels.h"
#include "tera/precision.h"
#include "tera/train.h"
#include "tera/zero.h"

/* The CPU backend the products run on (created in main; a test that releases its scratch makes a
 * fresh one) */
static tera_backend *be;

static void be_fresh(void) {
    tera_backend_destroy(be);
    be = tera_backend_cpu_create(-1);
}

/* Reference y[N,out] = x w^T in double, with each operand first rounded as the mode rounds it. */
static void ref_linear(double *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out,
                       tera_precision p) {
    float *xr = malloc(sizeof(float) * (size_t)(N * in)), *wr = malloc(sizeof(float) * (size_t)(out * in));
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)((N > out ? N : out) * in));
    if (p == TERA_PREC_BF16) {
        tera_round_bf16(h, x, N * in);
        for (int64_t i = 0; i < N * in; i++) xr[i] = tera_bf16_to_float(h[i]);
        tera_round_bf16(h, w, out * in);
        for (int64_t i = 0; i < out * in; i++) wr[i] = tera_bf16_to_float(h[i]);
    } else if (p == TERA_PREC_FP16) {
        tera_round_fp16(xr, x, N * in);
        tera_round_fp16(wr, w, out * in);
    } else {
        memcpy(xr, x, sizeof(float) * (size_t)(N * in));
        memcpy(wr, w, sizeof(float) * (size_t)(out * in));
    }
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < out; o++) {
            double s = 0;
            for (int64_t k = 0; k < in; k++) s += (double)xr[n * in + k] * wr[o * in + k];
            y[n * out + o] = s;
        }
    free(xr);
    free(wr);
    free(h);
}

/* Checks a low-precision forward against (a) the exact product of the rounded operands: fp32
 * accumulation only, |err| <= K * 2^-23 * sum|x||w|; (b) the fp32 product: operand rounding,
 * |err| <= (2u + u^2 + K * 2^-23) * sum|x||w| with u = 2^-8 (bf16) or 2^-11 (fp16). Returns the
 * largest error against fp32 relative to sum|x||w| (> 0: the operands really were rounded). */
static double check_forward(tera_precision p, int64_t N, int64_t in, int64_t out, int in_parallel) {
    float *x = malloc(sizeof(float) * (size_t)(N * in)), *w = malloc(sizeof(float) * (size_t)(out * in));
    float *y = malloc(sizeof(float) * (size_t)(N * out));
    double *yr = malloc(sizeof(double) * (size_t)(N * out)), *y32 = malloc(sizeof(double) * (size_t)(N * out));
    tu_fill(x, N * in, 11 + (uint64_t)N, 1.0f);
    tu_fill(w, out * in, 12 + (uint64_t)out, 0.5f);
    tera_backend_set_precision(be, p, be->bf16_gemm);
    if (in_parallel) {
#pragma omp parallel num_threads(2)
        if (omp_get_thread_num() == 1) be->ops.linear_forward(be, y, x, w, N, in, out, 0.0f);
    } else {
        be->ops.linear_forward(be, y, x, w, N, in, out, 0.0f);
    }
    tera_backend_set_precision(be, TERA_PREC_FP32, be->bf16_gemm);
    ref_linear(yr, x, w, N, in, out, p);
    ref_linear(y32, x, w, N, in, out, TERA_PREC_FP32);
    const double u = p == TERA_PREC_BF16 ? 1.0 / 256 : 1.0 / 2048, acc = (double)in * ldexp(1.0, -23);
    double worst = 0.0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < out; o++) {
            double mag = 0;
            for (int64_t k = 0; k < in; k++) mag += fabs((double)x[n * in + k] * w[o * in + k]);
            const double e_acc = fabs(y[n * out + o] - yr[n * out + o]), e32 = fabs(y[n * out + o] - y32[n * out + o]);
            if (e_acc > acc * mag + 1e-30 || e32 > (2 * u + u * u + acc) * mag) {
                fprintf(stderr, "%s %ldx%ldx%ld [%ld,%ld]: got %.9g, rounded-operand product %.9g, fp32 %.9g\n",
                        tera_precision_name(p), (long)N, (long)in, (long)out, (long)n, (long)o, y[n * out + o],
                        yr[n * out + o], y32[n * out + o]);
                fail();
            }
            if (e32 / mag > worst) worst = e32 / mag;
        }
    free(x), free(w), free(y), free(yr), free(y32);
    return worst;
}

/* The modes under test: bf16 on both kinds of units, then fp16. */
static const struct {
    tera_precision p;
    tera_bf16_gemm g;
} MODES[] = {{TERA_PREC_BF16, TERA_BF16_NATIVE}, {TERA_PREC_BF16, TERA_BF16_FMA}, {TERA_PREC_FP16, TERA_BF16_NATIVE}};
#define N_MODES 3
/* bf16 on the native units exists only where oneDNN has bf16 GEMM kernels (AVX-512 and up; not
 * under ONEDNN_MAX_CPU_ISA=AVX2): elsewhere that mode is skipped, saying so */
static int mode_runs(int m) {
    if (MODES[m].p != TERA_PREC_BF16 || MODES[m].g != TERA_BF16_NATIVE || be->caps.bf16_native(be)) return 1;
    print_message("skip: bf16 on native units (no bf16 GEMM kernels on this CPU)\n");
    return 0;
}

static void test_forward_bounds(void **state) {
    (void)state;
    for (int m = 0; m < N_MODES; m++) {
        if (!mode_runs(m)) continue;
        const tera_precision p = MODES[m].p;
        tera_backend_set_precision(be, be->precision, MODES[m].g);
        tera_backend_reserve(be, 1 << 20, 1 << 20);
        /* small (oneDNN gemm), large enough for the matmul primitive (TERA_GEMM_PRIMITIVE_MIN set in
         * main), and inside a parallel region (per-thread scratch) */
        const double a = check_forward(p, 7, 33, 5, 0), b = check_forward(p, 96, 80, 70, 0),
                     c = check_forward(p, 40, 24, 17, 1);
        const double lo = p == TERA_PREC_BF16 ? 1e-4 : 1e-5; /* rounding is visible: not an fp32 product */
        assert_true(a > lo && b > lo && c > lo);
        be_fresh();
    }
    tera_backend_set_precision(be, be->precision, TERA_BF16_NATIVE);
}

/* bf16 on the FMA units is exactly the fp32 product of the bf16-rounded operands (the same kernel on
 * the same shapes), forward and both backward products; and the rounded operands are bf16 values. */
static void test_bf16_fma_is_rounded_fp32(void **state) {
    (void)state;
    enum { N = 300, IN = 72, OUT = 40 };
    float *x = malloc(sizeof(float) * N * IN), *w = malloc(sizeof(float) * OUT * IN), *dy = malloc(sizeof(float) * N * OUT);
    float *xr = malloc(sizeof(float) * N * IN), *wr = malloc(sizeof(float) * OUT * IN), *dyr = malloc(sizeof(float) * N * OUT);
    float *y = malloc(sizeof(float) * N * OUT), *y2 = malloc(sizeof(float) * N * OUT);
    float *dx = malloc(sizeof(float) * N * IN), *dx2 = malloc(sizeof(float) * N * IN);
    float *dw = calloc(OUT * IN, sizeof(float)), *dw2 = calloc(OUT * IN, sizeof(float));
    tu_fill(x, N * IN, 21, 1.0f);
    tu_fill(w, OUT * IN, 22, 0.5f);
    tu_fill(dy, N * OUT, 23, 1.0f);
    tera_round_bf16f(xr, x, N * IN);
    tera_round_bf16f(wr, w, OUT * IN);
    tera_round_bf16f(dyr, dy, N * OUT);
    int changed = 0;
    for (int i = 0; i < N * IN; i++) {
        uint32_t u;
        memcpy(&u, &xr[i], sizeof u);
        assert_true((u & 0xffffu) == 0);
        changed += xr[i] != x[i];
    }
    assert_true(changed > N * IN / 2);
    tera_backend_set_precision(be, TERA_PREC_BF16, be->bf16_gemm);
    tera_backend_set_precision(be, be->precision, TERA_BF16_FMA);
    tera_backend_reserve(be, 1 << 16, 1 << 16);
    be->ops.linear_forward(be, y, x, w, N, IN, OUT, 0.0f);
    be->ops.linear_backward(be, dx, dw, dy, x, w, N, IN, OUT, 0.0f, 1.0f);
    tera_backend_set_precision(be, TERA_PREC_FP32, be->bf16_gemm);
    tera_backend_set_precision(be, be->precision, TERA_BF16_NATIVE);
    be->ops.linear_forward(be, y2, xr, wr, N, IN, OUT, 0.0f);
    be->ops.linear_backward(be, dx2, dw2, dyr, xr, wr, N, IN, OUT, 0.0f, 1.0f);
    assert_memory_equal(y, y2, sizeof(float) * N * OUT);
    assert_memory_equal(dx, dx2, sizeof(float) * N * IN);
    assert_memory_equal(dw, dw2, sizeof(float) * OUT * IN);
    assert_int_equal(be->ctl.scratch_grows(be), 0);
    be_fresh();
    free(x), free(w), free(dy), free(xr), free(wr), free(dyr), free(y), free(y2), free(dx), free(dx2), free(dw), free(dw2);
}

/* Backward: dx = dy w and dw += dy^T x against the rounded-operand double products (dw accumulates
 * into what is there). */
static void test_backward_bounds(void **state) {
    (void)state;
    enum { N = 50, IN = 24, OUT = 36 };
    float x[N * IN], w[OUT * IN], dy[N * OUT], dx[N * IN], dw[OUT * IN];
    tu_fill(x, N * IN, 1, 1.0f);
    tu_fill(w, OUT * IN, 2, 0.5f);
    tu_fill(dy, N * OUT, 3, 1.0f);
    for (int m = 0; m < N_MODES; m++) {
        if (!mode_runs(m)) continue;
        const tera_precision p = MODES[m].p;
        tera_backend_set_precision(be, be->precision, MODES[m].g);
        tera_backend_reserve(be, 1 << 16, 1 << 16);
        for (int i = 0; i < OUT * IN; i++) dw[i] = 1.0f;
        tera_backend_set_precision(be, p, be->bf16_gemm);
        be->ops.linear_backward(be, dx, dw, dy, x, w, N, IN, OUT, 0.0f, 1.0f);
        tera_backend_set_precision(be, TERA_PREC_FP32, be->bf16_gemm);
        /* dx[n,i] = sum_o dy[n,o] w[o,i]: as a forward of dy against w^T */
        float wt[IN * OUT], dyt[OUT * N], xt[IN * N];
        for (int o = 0; o < OUT; o++)
            for (int i = 0; i < IN; i++) wt[i * OUT + o] = w[o * IN + i];
        for (int n = 0; n < N; n++) {
            for (int o = 0; o < OUT; o++) dyt[o * N + n] = dy[n * OUT + o];
            for (int i = 0; i < IN; i++) xt[i * N + n] = x[n * IN + i];
        }
        double rdx[N * IN], rdw[OUT * IN];
        ref_linear(rdx, dy, wt, N, OUT, IN, (tera_precision)p);
        ref_linear(rdw, dyt, xt, OUT, N, IN, (tera_precision)p);
        for (int i = 0; i < N * IN; i++) assert_true(fabs(dx[i] - rdx[i]) <= OUT * ldexp(1.0, -23) * 20 + 1e-6);
        for (int i = 0; i < OUT * IN; i++) assert_true(fabs(dw[i] - (1.0 + rdw[i])) <= N * ldexp(1.0, -23) * 20 + 1e-6);
        be_fresh();
    }
    tera_backend_set_precision(be, be->precision, TERA_BF16_NATIVE);
}

/* dw_beta 0 stores the weight gradient without reading what was there (NaN here): bit for bit what
 * adding into zeros gives (the first micro-batch of a step, tera_model_grads_stale), in fp32 and every
 * low-precision mode, for one product, the fused products of one input (with and without dx) and the
 * router's fp32 variant; a small shape, one that takes fp32's primitive pieces (K = 1024 >= 512,
 * 512 x 1024 outputs; tiles where oneDNN has no brgemm), and no rows (stored: zeros). */
static void test_dw_store(void **state) {
    (void)state;
    const int64_t shapes[3][3] = {{50, 24, 36}, {1024, 1024, 512}, {0, 24, 36}}; /* N, in, out; no rows: zeros */
    for (int s = 0; s < 3; s++) {
        const int64_t N = shapes[s][0], IN = shapes[s][1], OUT = shapes[s][2];
        float *x = malloc(sizeof(float) * (size_t)(N * IN + 1)), *w = malloc(sizeof(float) * (size_t)(2 * OUT * IN));
        float *dy = malloc(sizeof(float) * (size_t)(2 * N * OUT + 1)), *dx = malloc(sizeof(float) * (size_t)(N * IN + 1));
        float *ga = malloc(sizeof(float) * (size_t)(2 * OUT * IN)), *gb = malloc(sizeof(float) * (size_t)(2 * OUT * IN));
        tu_fill(x, N * IN, 21, 1.0f);
        tu_fill(w, 2 * OUT * IN, 22, 0.5f);
        tu_fill(dy, 2 * N * OUT, 23, 1.0f);
        for (int m = -1; m < N_MODES; m++) { /* -1: fp32 */
            if (m >= 0 && !mode_runs(m)) continue;
            tera_backend_set_precision(be, be->precision, m >= 0 ? MODES[m].g : TERA_BF16_NATIVE);
            tera_backend_reserve(be, 4 * (N * IN + 2 * N * OUT + 2 * OUT * IN), 1 << 16);
            const tera_precision p = m >= 0 ? MODES[m].p : TERA_PREC_FP32;
            for (int call = 0; call < 4; call++) { /* single, single without dx, multi, the fp32 variant */
                for (int b = 0; b < 2; b++) {
                    float *g = b ? gb : ga;
                    for (int64_t i = 0; i < 2 * OUT * IN; i++) g[i] = b ? 0.0f : NAN;
                    const float beta = b ? 1.0f : 0.0f;
                    tera_backend_set_precision(be, p, be->bf16_gemm);
                    float *const dws[2] = {g, g + OUT * IN};
                    const float *const dys[2] = {dy, dy + N * OUT}, *const ws[2] = {w, w + OUT * IN};
                    const int64_t outs[2] = {OUT, OUT};
                    if (call == 0) be->ops.linear_backward(be, dx, g, dy, x, w, N, IN, OUT, 0.0f, beta);
                    if (call == 1) be->ops.linear_backward(be, NULL, g, dy, x, w, N, IN, OUT, 0.0f, beta);
                    if (call == 2) tera_linear_backward_multi(be, 2, dx, dws, dys, x, ws, outs, N, IN, 0.0f, beta);
                    if (call == 3) be->ops.linear_backward_fp32(be, dx, g, dy, x, w, N, IN, OUT, 0.0f, beta);
                    tera_backend_set_precision(be, TERA_PREC_FP32, be->bf16_gemm);
                }
                const int64_t n = (call == 2 ? 2 : 1) * OUT * IN;
                if (memcmp(ga, gb, sizeof(float) * (size_t)n)) {
                    fprintf(stderr, "%s %ldx%ldx%ld call %d: the stored weight gradient differs from adding into zeros\n",
                            tera_precision_name(p), (long)N, (long)IN, (long)OUT, call);
                    fail();
                }
            }
            be_fresh();
        }
        free(x), free(w), free(dy), free(dx), free(ga), free(gb);
    }
    tera_backend_set_precision(be, be->precision, TERA_BF16_NATIVE);
}

/* An FFN's g kept in the backend's product format (ops.swiglu_forward_act, linear_forward_act,
 * linear_backward_act): in every mode, y, dx and dw bit-identical to swiglu_forward, linear_forward
 * and linear_backward on the fp32 g (forward with beta 0 and 1; backward with dx and dw, dx only, dw
 * only, betas 0 and 1); with bf16 on the native units g holds the bf16 roundings of the fp32 g in its
 * first 2n bytes and the rest of its buffer untouched, elsewhere the fp32 g itself; and the helpers
 * on a backend without the ops (NULL) make the fp32 calls. Shapes: odd sizes, the experts' */
static void test_act_format(void **state) {
    (void)state;
    const int64_t shapes[3][3] = {{37, 24, 19}, {512, 512, 256}, {1, 8, 4}}; /* N, in (g's width), out */
    for (int sh = 0; sh < 3; sh++) {
        const int64_t N = shapes[sh][0], IN = shapes[sh][1], OUT = shapes[sh][2], n = N * IN;
        float *a1 = malloc(sizeof(float) * (size_t)n), *a3 = malloc(sizeof(float) * (size_t)n);
        float *g = malloc(sizeof(float) * (size_t)n), *ga = malloc(sizeof(float) * (size_t)n);
        float *w = malloc(sizeof(float) * (size_t)(OUT * IN)), *dy = malloc(sizeof(float) * (size_t)(N * OUT));
        float *y[2], *dx[2], *dw[2];
        for (int k = 0; k < 2; k++) {
            y[k] = malloc(sizeof(float) * (size_t)(N * OUT));
            dx[k] = malloc(sizeof(float) * (size_t)n);
            dw[k] = malloc(sizeof(float) * (size_t)(OUT * IN));
        }
        tu_fill(a1, n, 31 + (uint64_t)sh, 4.0f);
        tu_fill(a3, n, 32 + (uint64_t)sh, 1.0f);
        tu_fill(w, OUT * IN, 33, 0.5f);
        tu_fill(dy, N * OUT, 34, 1.0f);
        for (int m = -1; m < N_MODES; m++) { /* -1: fp32 */
            if (m >= 0 && !mode_runs(m)) continue;
            const tera_precision p = m >= 0 ? MODES[m].p : TERA_PREC_FP32;
            tera_backend_set_precision(be, p, m >= 0 ? MODES[m].g : TERA_BF16_NATIVE);
            const int bf16_act = m >= 0 && p == TERA_PREC_BF16 && MODES[m].g == TERA_BF16_NATIVE;
            be->ops.swiglu_forward(be, g, a1, a3, n);
            for (int64_t i = 0; i < n; i++) ga[i] = NAN; /* the untouched half stays NaN */
            tera_swiglu_forward_act(be, ga, a1, a3, n);
            const uint16_t *g16 = (const uint16_t *)ga;
            int64_t bad = -1;
            for (int64_t i = 0; i < n && bad < 0; i++)
                if (bf16_act ? g16[i] != tera_bf16_rne(g[i]) : memcmp(&ga[i], &g[i], sizeof(float)) != 0) bad = i;
            for (int64_t i = (n + 1) / 2; bf16_act && i < n && bad < 0; i++)
                if (!isnan(ga[i])) bad = i;
            if (bad >= 0) fail_msg("%s %ldx%ld: g in the product format at element %ld", tera_precision_name(p), (long)N, (long)IN, (long)bad);
            for (int beta = 0; beta < 2; beta++) {
                for (int k = 0; k < 2; k++) tu_fill(y[k], N * OUT, 35, 1.0f);
                be->ops.linear_forward(be, y[0], g, w, N, IN, OUT, (float)beta);
                tera_linear_forward_act(be, y[1], ga, w, N, IN, OUT, (float)beta);
                if (memcmp(y[0], y[1], sizeof(float) * (size_t)(N * OUT)))
                    fail_msg("%s %ldx%ldx%ld beta %d: linear_forward_act differs", tera_precision_name(p), (long)N, (long)IN, (long)OUT, beta);
                for (int call = 0; call < 3; call++) { /* dx and dw, dx only, dw only */
                    for (int k = 0; k < 2; k++) tu_fill(dx[k], n, 36, 1.0f), tu_fill(dw[k], OUT * IN, 37, 1.0f);
                    float *dx0 = call == 2 ? NULL : dx[0], *dx1 = call == 2 ? NULL : dx[1];
                    float *dw0 = call == 1 ? NULL : dw[0], *dw1 = call == 1 ? NULL : dw[1];
                    be->ops.linear_backward(be, dx0, dw0, dy, g, w, N, IN, OUT, (float)beta, (float)beta);
                    tera_linear_backward_act(be, dx1, dw1, dy, ga, w, N, IN, OUT, (float)beta, (float)beta);
                    if (memcmp(dx[0], dx[1], sizeof(float) * (size_t)n) || memcmp(dw[0], dw[1], sizeof(float) * (size_t)(OUT * IN)))
                        fail_msg("%s %ldx%ldx%ld beta %d call %d: linear_backward_act differs", tera_precision_name(p), (long)N,
                                 (long)IN, (long)OUT, beta, call);
                }
            }
            /* a backend without the ops (taken out for the while): the helpers call the fp32 ones */
            const tera_backend_ops keep = be->ops;
            be->ops.swiglu_forward_act = NULL, be->ops.linear_forward_act = NULL, be->ops.linear_backward_act = NULL;
            tera_swiglu_forward_act(be, ga, a1, a3, n);
            assert_memory_equal(ga, g, sizeof(float) * (size_t)n);
            tera_linear_forward_act(be, y[1], ga, w, N, IN, OUT, 0.0f);
            be->ops.linear_forward(be, y[0], g, w, N, IN, OUT, 0.0f);
            assert_memory_equal(y[0], y[1], sizeof(float) * (size_t)(N * OUT));
            tera_linear_backward_act(be, dx[1], dw[1], dy, ga, w, N, IN, OUT, 0.0f, 0.0f);
            be->ops.linear_backward(be, dx[0], dw[0], dy, g, w, N, IN, OUT, 0.0f, 0.0f);
            assert_memory_equal(dx[0], dx[1], sizeof(float) * (size_t)n);
            assert_memory_equal(dw[0], dw[1], sizeof(float) * (size_t)(OUT * IN));
            be->ops = keep;
            tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
        }
        free(a1), free(a3), free(g), free(ga), free(w), free(dy);
        for (int k = 0; k < 2; k++) free(y[k]), free(dx[k]), free(dw[k]);
    }
}

/* The router's fp32 variant ignores the mode: bit-identical to the fp32 product. */
static void test_fp32_variant(void **state) {
    (void)state;
    enum { N = 16, IN = 32, OUT = 8 };
    float x[N * IN], w[OUT * IN], a[N * OUT], b[N * OUT];
    tu_fill(x, N * IN, 4, 1.0f);
    tu_fill(w, OUT * IN, 5, 1.0f);
    be->ops.linear_forward(be, a, x, w, N, IN, OUT, 0.0f);
    tera_backend_set_precision(be, TERA_PREC_BF16, be->bf16_gemm);
    tera_linear_forward_fp32(b, x, w, N, IN, OUT, 0.0f);
    tera_backend_set_precision(be, TERA_PREC_FP32, be->bf16_gemm);
    assert_memory_equal(a, b, sizeof a);
}

static void test_roundings(void **state) {
    (void)state;
    /* fp16: ties to even, the largest finite value, overflow to inf, subnormals; vector body and
     * scalar tail agree (37 elements) */
    float s[37], d[37];
    const float in[] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65504.0f, 65519.0f, 65520.0f, -70000.0f, 0x1p-25f,
                        3 * 0x1p-26f, 1e-3f, -2.5f};
    const float want[] = {1.0f, 1.0f + 0x1p-9f, 65504.0f, 65504.0f, INFINITY, -INFINITY, 0.0f, 0x1p-24f,
                          0.0010004043579101562f, -2.5f};
    for (int rep = 0; rep < 2; rep++) { /* rep 0: in the vector body; rep 1: in the scalar tail */
        for (int i = 0; i < 37; i++) s[i] = 0.25f;
        for (int i = 0; i < 10; i++) s[rep ? 27 + i : i] = in[i];
        tera_round_fp16(d, s, 37);
        for (int i = 0; i < 10; i++) {
            const float g = d[rep ? 27 + i : i];
            if (!(g == want[i])) {
                fprintf(stderr, "fp16(%.9g) = %.9g, want %.9g\n", in[i], g, want[i]);
                fail();
            }
        }
    }
    /* bf16: ties to even, NaN stays NaN, inf stays inf */
    float b[40];
    uint16_t h[40];
    for (int i = 0; i < 40; i++) b[i] = 1.0f;
    b[3] = 1.0f + 0x1p-8f, b[4] = 1.0f + 3 * 0x1p-8f, b[5] = NAN, b[6] = INFINITY;
    b[35] = 1.0f + 0x1p-8f, b[36] = NAN;
    tera_round_bf16(h, b, 40);
    assert_true(tera_bf16_to_float(h[3]) == 1.0f && tera_bf16_to_float(h[35]) == 1.0f);
    assert_true(tera_bf16_to_float(h[4]) == 1.0f + 0x1p-6f);
    assert_true(isnan(tera_bf16_to_float(h[5])) && isnan(tera_bf16_to_float(h[36])));
    assert_true(isinf(tera_bf16_to_float(h[6])));
    /* the vector body and the scalar tail round alike, subnormals included (rounded, not flushed);
     * the fp32-kept rounding (the fma units' operands) is the same value */
    enum { NR = 1000 };
    float r[NR], rf[NR];
    uint16_t rh[NR];
    tu_fill(r, NR, 7, 3.0f);
    for (int i = 0; i < NR; i += 7) r[i] *= 0x1p-130f; /* subnormal fp32 */
    r[100] = 0x1p-149f * 3, r[101] = -0x1p-149f * 0x18000, r[102] = NAN, r[103] = -INFINITY, r[999] = 0x1p-140f * 1.00390625f;
    tera_round_bf16(rh, r, NR);
    tera_round_bf16f(rf, r, NR);
    for (int i = 0; i < NR; i++) {
        uint32_t u, expect;
        memcpy(&u, &r[i], sizeof u);
        if (isnan(r[i])) {
            assert_true(isnan(rf[i]) && isnan(tera_bf16_to_float(rh[i])));
            continue;
        }
        expect = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; /* round to nearest even on the bit pattern */
        if (rh[i] != expect || memcmp(&rf[i], &(float){tera_bf16_to_float(rh[i])}, sizeof(float)) != 0) {
            fprintf(stderr, "bf16(%a) [%d] = %04x / %a, want %04x\n", r[i], i, rh[i], rf[i], expect);
            fail();
        }
    }
    assert_true(tera_bf16_to_float(rh[100]) == 0.0f && tera_bf16_to_float(rh[101]) == -0x1p-132f); /* a tie on a subnormal, to even */
}

/* training.bf16_gemm: set values are taken as given; auto gives one of the two with a reason, and
 * the probe measures both instructions where the CPU has the dot product. */
static void test_bf16_gemm_resolve(void **state) {
    (void)state;
    const char *note;
    /* native where the CPU has bf16 GEMM kernels; else fma, saying why */
    assert_int_equal(tera_bf16_gemm_resolve(be, "native", &note),
                     be->caps.bf16_native(be) ? TERA_BF16_NATIVE : TERA_BF16_FMA);
    assert_int_equal(tera_bf16_gemm_resolve(be, "fma", &note), TERA_BF16_FMA);
    const tera_bf16_gemm g = tera_bf16_gemm_resolve(be, "auto", &note);
    assert_true(strstr(note, "(auto: ") != NULL);
    double fma, dot;
    if (be->caps.bf16_probe(be, &fma, &dot)) {
        assert_true(fma > 1e8 && dot > 1e8);
        if (!be->caps.bf16_fast(be, NULL))
            assert_true(strstr(note, "probe") != NULL);
        fprintf(stderr, "bf16 units: %s (this probe: FMA %.1f G, dot %.1f G multiply-adds/s)\n", note, fma * 1e-9, dot * 1e-9);
    } else {
        assert_true(fma == 0.0 && dot == 0.0);
        assert_int_equal(g, be->caps.bf16_fast(be, NULL) ? TERA_BF16_NATIVE : TERA_BF16_FMA);
    }
}

/* The scaler: doubles after `window` clean steps, halves (and reports a skip) on overflow, and
 * stays within its bounds. */
static void test_scaler(void **state) {
    (void)state;
    tera_loss_scaler s;
    tera_scaler_init(&s, 8.0f, 3);
    assert_int_equal(tera_scaler_update(&s, 1), 0);
    assert_int_equal(tera_scaler_update(&s, 1), 0);
    assert_true(s.scale == 8.0f);
    assert_int_equal(tera_scaler_update(&s, 1), 1);
    assert_true(s.scale == 16.0f && s.good_steps == 0);
    assert_int_equal(tera_scaler_update(&s, 1), 0);
    assert_int_equal(tera_scaler_update(&s, 0), -1);
    assert_true(s.scale == 8.0f && s.good_steps == 0 && s.overflows == 1);
    assert_int_equal(tera_scaler_update(&s, 1), 0); /* the count restarted after the overflow */
    assert_int_equal(tera_scaler_update(&s, 1), 0);
    assert_int_equal(tera_scaler_update(&s, 1), 1);
    assert_true(s.scale == 16.0f);
    tera_scaler_init(&s, 1e30f, 1);
    assert_true(s.scale == TERA_LOSS_SCALE_MAX);
    tera_scaler_update(&s, 1);
    assert_true(s.scale == TERA_LOSS_SCALE_MAX);
    tera_scaler_init(&s, TERA_LOSS_SCALE_MIN, 1);
    assert_int_equal(tera_scaler_update(&s, 0), -1);
    assert_true(s.scale == TERA_LOSS_SCALE_MIN);
}

static tera_config tiny_cfg(const char *precision) {
    tera_config c;
    tera_config_defaults(&c);
    c.model.dim = 32;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_experts = 4;
    c.model.ffn_dim = 48;
    c.model.max_seq_len = 32;
    c.model.n_shared_experts = 1;
    c.training.seq_len = 32;
    c.training.micro_batch = 4;
    c.training.steps = 3;
    c.training.warmup_steps = 1;
    c.logging.progress = 0;
    snprintf(c.training.precision, sizeof c.training.precision, "%s", precision);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    return c;
}

/* Training steps in bf16 and fp16 convert inside the scratch reserved at set-up (no growth in the
 * step loop); `auto` follows its rule (AMX or the dot-product probe); the backend holding the mode goes with the trainer. */
static void test_trainer_modes(void **state) {
    (void)state;
    const char *names[] = {"bf16", "fp16", "auto", "bf16"};
    for (int i = 0; i < 4; i++) {
        tera_config c = tiny_cfg(names[i]);
        snprintf(c.training.bf16_gemm, sizeof c.training.bf16_gemm, "%s", i == 0 ? "native" : "fma");
        tera_trainer tr;
        assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
        double fma = 0.0, dot = 0.0; /* auto: AMX, or a dot product the probe measures 1.25x the FMA */
        const int auto_bf16 = be->caps.bf16_fast(be, NULL) || (be->caps.bf16_probe(be, &fma, &dot) && dot >= 1.25 * fma);
        const tera_precision want = i == 0 || i == 3 ? TERA_PREC_BF16 : i == 1 ? TERA_PREC_FP16
                                    : auto_bf16 ? TERA_PREC_BF16 : TERA_PREC_FP32;
        assert_int_equal(tr.prec.precision, want);
        if (want == TERA_PREC_BF16)
            assert_int_equal(tr.model.be->bf16_gemm, i == 0 && be->caps.bf16_native(be) ? TERA_BF16_NATIVE : TERA_BF16_FMA);
        assert_int_equal(tr.model.be->precision, want);
        tera_step_result r;
        for (int s = 0; s < 3; s++) {
            assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
            assert_true(isfinite(r.loss) && !r.skipped);
            assert_true(r.loss_scale == (want == TERA_PREC_FP16 ? c.training.loss_scale : 1.0f));
        }
        assert_int_equal(tr.model.be->ctl.scratch_grows(tr.model.be), 0);
        tera_trainer_free(&tr);
        assert_null(tr.model.be); /* the backend, its mode and scratch, went with the model */
    }
}

/* fp16 with a scale far too large: the gradient overflows, the update is skipped (weights and Adam
 * step count unchanged) and the scale halves, step after step, until a step goes through. */
static void test_fp16_overflow_skip(void **state) {
    (void)state;
    tera_config c = tiny_cfg("fp16");
    c.training.loss_scale = 0x1p36f;
    c.training.steps = 40;
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
    float *w0 = malloc(sizeof(float) * (size_t)tr.model.n_floats);
    memcpy(w0, tr.model.w, sizeof(float) * (size_t)tr.model.n_floats);
    tera_step_result r;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    assert_true(r.skipped && r.loss_scale == 0x1p36f && tr.prec.scaler.scale == 0x1p35f);
    assert_memory_equal(w0, tr.model.w, sizeof(float) * (size_t)tr.model.n_floats);
    assert_int_equal(tr.sharding->opt.t, 0);
    int steps = 1;
    while (r.skipped && steps < 40) {
        assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
        steps++;
    }
    assert_false(r.skipped);
    assert_int_equal(tr.sharding->opt.t, 1);
    assert_int_equal(tr.prec.scaler.overflows, steps - 1);
    assert_true(r.loss_scale == ldexpf(1.0f, 36 - (steps - 1)));
    free(w0);
    tera_trainer_free(&tr);
}

int main(void) {
    setenv("TERA_GEMM_PRIMITIVE_MIN", "100000", 1); /* read at the first product: small products reach the primitive */
    tera_set_threads(2);
    be = tera_backend_cpu_create(-1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_bounds), cmocka_unit_test(test_backward_bounds),
        cmocka_unit_test(test_bf16_fma_is_rounded_fp32), cmocka_unit_test(test_bf16_gemm_resolve),
        cmocka_unit_test(test_fp32_variant),   cmocka_unit_test(test_roundings),
        cmocka_unit_test(test_scaler),         cmocka_unit_test(test_trainer_modes),
        cmocka_unit_test(test_fp16_overflow_skip), cmocka_unit_test(test_dw_store), cmocka_unit_test(test_act_format),
    };
    const int failed = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(be);
    return failed;
}
