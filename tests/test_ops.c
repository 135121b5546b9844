/* Every operation's backward against central finite differences of L = sum(out * R). */
#include "testutil.h"
#include "tera/kernels.h"
#include "kernels/cpu/vmath.h"

#include <float.h>

#define EPS 1e-3f

/* Compares analytic gradient `an` of input x[n] with central differences of loss(). */
typedef double (*loss_fn)(void *ctx);

static void fd_check(const char *name, float *x, int64_t n, const float *an, loss_fn f, void *ctx) {
    int64_t step = n > 64 ? n / 64 : 1;
    for (int64_t i = 0; i < n; i += step) {
        float keep = x[i];
        x[i] = keep + EPS;
        double lp = f(ctx);
        x[i] = keep - EPS;
        double lm = f(ctx);
        x[i] = keep;
        double fd = (lp - lm) / (2.0 * EPS);
        double err = fabs(fd - an[i]);
        if (err > 2e-3 + 2e-2 * fabs(fd)) {
            fprintf(stderr, "%s[%ld]: analytic %.6g finite-difference %.6g\n", name, (long)i, an[i], fd);
            fail();
        }
    }
}

static double dot_d(const float *a, const float *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* ---- RMSNorm */
typedef struct { float *y, *rstd, *x, *w, *R; int64_t N, D; } norm_ctx;
static double norm_loss(void *p) {
    norm_ctx *c = p;
    tera_rmsnorm_forward(c->y, c->rstd, c->x, c->w, c->N, c->D, 1e-5f);
    return dot_d(c->y, c->R, c->N * c->D);
}
static void test_rmsnorm(void **state) {
    (void)state;
    enum { N = 5, D = 24 };
    float y[N * D], rstd[N], x[N * D], w[D], R[N * D], dx[N * D] = {0}, dw[D] = {0};
    tu_fill(x, N * D, 1, 1.0f);
    tu_fill(w, D, 2, 1.0f);
    tu_fill(R, N * D, 3, 1.0f);
    norm_ctx c = {y, rstd, x, w, R, N, D};
    norm_loss(&c);
    tera_rmsnorm_backward(dx, dw, R, x, w, rstd, N, D);
    fd_check("rmsnorm dx", x, N * D, dx, norm_loss, &c);
    fd_check("rmsnorm dw", w, D, dw, norm_loss, &c);
    /* dx accumulates: a second call doubles it */
    float dx2[N * D];
    memcpy(dx2, dx, sizeof dx);
    tera_rmsnorm_backward(dx2, dw, R, x, w, rstd, N, D);
    for (int i = 0; i < N * D; i++) assert_true(fabsf(dx2[i] - 2 * dx[i]) <= 1e-6f * (1 + fabsf(dx[i])));
}

/* ---- RoPE */
typedef struct { float *x, *xr, *cs, *sn, *R; int B, T, nh, hd; } rope_ctx;
static double rope_loss(void *p) {
    rope_ctx *c = p;
    int64_t n = (int64_t)c->B * c->T * c->nh * c->hd;
    memcpy(c->xr, c->x, sizeof(float) * n);
    tera_rope_forward(c->xr, c->cs, c->sn, c->B, c->T, c->nh, c->hd);
    return dot_d(c->xr, c->R, n);
}
static void test_rope(void **state) {
    (void)state;
    enum { B = 2, T = 7, NH = 3, HD = 8, N = B * T * NH * HD };
    float x[N], xr[N], R[N], g[N], cs[T * HD / 2], sn[T * HD / 2];
    tera_rope_tables(cs, sn, T, HD, 10000.0f);
    /* position 0 is the identity; position 1, pair 0 rotates by 1 radian */
    assert_true(cs[0] == 1.0f && sn[0] == 0.0f);
    assert_true(fabsf(cs[HD / 2] - cosf(1.0f)) < 1e-6f);
    tu_fill(x, N, 4, 1.0f);
    tu_fill(R, N, 5, 1.0f);
    rope_ctx c = {x, xr, cs, sn, R, B, T, NH, HD};
    rope_loss(&c);
    memcpy(g, R, sizeof g);
    tera_rope_backward(g, cs, sn, B, T, NH, HD);
    fd_check("rope dx", x, N, g, rope_loss, &c);
    /* backward(forward(x)) == x: a rotation */
    rope_loss(&c);
    memcpy(g, xr, sizeof g);
    tera_rope_backward(g, cs, sn, B, T, NH, HD);
    assert_true(tu_close("rope inverse", g, x, N, 1e-5, 1e-6) <= 1.0);
}

/* ---- SwiGLU */
typedef struct { float *g, *a1, *a3, *R; int64_t n; } swiglu_ctx;
static double swiglu_loss(void *p) {
    swiglu_ctx *c = p;
    tera_swiglu_forward(c->g, c->a1, c->a3, c->n);
    return dot_d(c->g, c->R, c->n);
}
static void test_swiglu(void **state) {
    (void)state;
    enum { n = 200 };
    float g[n], a1[n], a3[n], R[n], da1[n], da3[n];
    tu_fill(a1, n, 6, 4.0f);
    tu_fill(a3, n, 7, 2.0f);
    tu_fill(R, n, 8, 1.0f);
    swiglu_ctx c = {g, a1, a3, R, n};
    swiglu_loss(&c);
    for (int i = 0; i < n; i++) {
        double ref = a1[i] / (1.0 + exp(-(double)a1[i])) * a3[i];
        assert_true(fabs(g[i] - ref) <= 1e-6 * (1 + fabs(ref)));
    }
    tera_swiglu_backward(da1, da3, R, a1, a3, n);
    fd_check("swiglu da1", a1, n, da1, swiglu_loss, &c);
    fd_check("swiglu da3", a3, n, da3, swiglu_loss, &c);
}

/* ---- linear */
typedef struct { float *y, *x, *w, *R; int64_t N, in, out; } lin_ctx;
static double lin_loss(void *p) {
    lin_ctx *c = p;
    tera_linear_forward_fp32(c->y, c->x, c->w, c->N, c->in, c->out, 0.0f);
    return dot_d(c->y, c->R, c->N * c->out);
}
static void test_linear(void **state) {
    (void)state;
    enum { N = 6, IN = 10, OUT = 7 };
    float y[N * OUT], x[N * IN], w[OUT * IN], R[N * OUT], dx[N * IN], dw[OUT * IN] = {0};
    tu_fill(x, N * IN, 9, 1.0f);
    tu_fill(w, OUT * IN, 10, 1.0f);
    tu_fill(R, N * OUT, 11, 1.0f);
    lin_ctx c = {y, x, w, R, N, IN, OUT};
    lin_loss(&c);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OUT; o++) {
            double s = 0;
            for (int i = 0; i < IN; i++) s += (double)x[n * IN + i] * w[o * IN + i];
            assert_true(fabs(y[n * OUT + o] - s) < 1e-5);
        }
    tera_linear_backward_fp32(dx, dw, R, x, w, N, IN, OUT, 0.0f, 1.0f);
    fd_check("linear dx", x, N * IN, dx, lin_loss, &c);
    fd_check("linear dw", w, OUT * IN, dw, lin_loss, &c);
}

/* ---- embedding */
static void test_embedding(void **state) {
    (void)state;
    enum { V = 5, D = 20, N = 9 };
    float table[V * D], x[N * D], dx[N * D], dt[V * D] = {0};
    int32_t tok[N] = {0, 3, 3, 1, 4, 0, 3, 2, 2};
    tu_fill(table, V * D, 12, 1.0f);
    tu_fill(dx, N * D, 13, 1.0f);
    tera_embedding_forward(x, table, tok, N, D);
    for (int n = 0; n < N; n++) assert_memory_equal(x + n * D, table + tok[n] * D, sizeof(float) * D);
    tera_embedding_backward(dt, dx, tok, N, D);
    for (int v = 0; v < V; v++)
        for (int d = 0; d < D; d++) {
            float s = 0;
            for (int n = 0; n < N; n++)
                if (tok[n] == v) s += dx[n * D + d];
            assert_true(fabsf(dt[v * D + d] - s) < 1e-6f);
        }
}

/* ---- softmax and cross-entropy */
typedef struct { float *p, *lse, *l, *R; int64_t N, E; const int32_t *tg; } sm_ctx;
static double sm_loss(void *q) {
    sm_ctx *c = q;
    tera_softmax_forward(c->p, c->lse, c->l, c->N, c->E);
    return dot_d(c->p, c->R, c->N * c->E);
}
static double ce_loss(void *q) {
    sm_ctx *c = q;
    return tera_ce_forward(c->lse, c->l, c->tg, c->N, c->E);
}
static void test_softmax_ce(void **state) {
    (void)state;
    enum { N = 4, E = 11 };
    float p[N * E], lse[N], l[N * E], R[N * E], dl[N * E];
    int32_t tg[N] = {0, 10, 5, 5};
    tu_fill(l, N * E, 14, 5.0f);
    tu_fill(R, N * E, 15, 1.0f);
    sm_ctx c = {p, lse, l, R, N, E, tg};
    sm_loss(&c);
    for (int n = 0; n < N; n++) {
        double s = 0;
        for (int e = 0; e < E; e++) s += p[n * E + e];
        assert_true(fabs(s - 1.0) < 1e-5);
    }
    tera_softmax_backward(dl, R, p, N, E);
    fd_check("softmax dlogits", l, N * E, dl, sm_loss, &c);
    double loss = ce_loss(&c);
    double ref = 0;
    for (int n = 0; n < N; n++) {
        double mx = -1e30, s = 0;
        for (int e = 0; e < E; e++) mx = fmax(mx, l[n * E + e]);
        for (int e = 0; e < E; e++) s += exp(l[n * E + e] - mx);
        ref += mx + log(s) - l[n * E + tg[n]];
    }
    assert_true(fabs(loss - ref) < 1e-5 * fabs(ref));
    tera_ce_backward(dl, l, tg, N, E, 1.0f);
    fd_check("cross-entropy dlogits", l, N * E, dl, ce_loss, &c);
}

/* tera_vlogf against double log over every 61st float from FLT_MIN to FLT_MAX (about 35 million), and
 * every float in [0.5, 2) (where log is near 0): at most 2 ulp of the float result (measured: see the
 * message). */
static double vlogf_ulps(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    const double ref = log((double)x), got = tera_vlogf(x);
    const float rf = (float)ref;
    const double ulp = fabs((double)nextafterf(rf, INFINITY) - (double)rf);
    return fabs(got - ref) / ulp;
}

static void test_vlogf(void **state) {
    (void)state;
    double worst = 0.0;
    uint32_t at = 0;
    const uint32_t lo = 0x00800000u, hi = 0x7F7FFFFFu; /* FLT_MIN, FLT_MAX */
    for (uint32_t u = lo; u <= hi - 61; u += 61) {
        const double d = vlogf_ulps(u);
        if (d > worst) worst = d, at = u;
    }
    for (uint32_t u = 0x3F000000u; u < 0x40000000u; u++) { /* [0.5, 2) */
        const double d = vlogf_ulps(u);
        if (d > worst) worst = d, at = u;
    }
    float x;
    memcpy(&x, &at, 4);
    print_message("tera_vlogf: worst %.3f ulp at %.9g\n", worst, (double)x);
    if (!(worst <= 2.0)) fail_msg("tera_vlogf: %.3f ulp at %.9g (bits 0x%08x)", worst, (double)x, at);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),  cmocka_unit_test(test_rope),      cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_linear),   cmocka_unit_test(test_embedding), cmocka_unit_test(test_softmax_ce),
        cmocka_unit_test(test_vlogf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
