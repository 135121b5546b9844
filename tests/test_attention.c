/* Tiled causal GQA attention (src/kernels/cpu/attention.c) against a naive O(T^2) double-precision
 * reference: forward out/lse, analytic gradients, central finite differences, bit-determinism
 * across runs and thread counts, every fp32 kernel this build has (the register-blocked ones in the
 * same bits), and the scratch-memory bound. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/cpu/cpu.h"
#include "tera/backend.h"
#include "tera/kernels.h"

typedef struct {
    int B, T, H, Hkv, hd;
} shape;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}
static void fill(float *x, size_t n, float amp) {
    for (size_t i = 0; i < n; i++) x[i] = amp * frand();
}
static float *alloc_f(size_t n) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    assert_non_null(p);
    return p;
}
static double *alloc_d(size_t n) {
    double *p = calloc(n ? n : 1, sizeof(double));
    assert_non_null(p);
    return p;
}

static size_t nq_of(shape s) { return (size_t)s.B * s.T * s.H * s.hd; }
static size_t nk_of(shape s) { return (size_t)s.B * s.T * s.Hkv * s.hd; }

/* Naive reference in double. out [B,T,H,hd], lse [B,H,T]; when dout is non-NULL also the analytic
 * gradients dq, dk, dv (written). */
static void ref_attention(shape s, const float *q, const float *k, const float *v, const float *dout,
                          double *out, double *lse, double *dq, double *dk, double *dv) {
    const int B = s.B, T = s.T, H = s.H, Hkv = s.Hkv, hd = s.hd, rep = H / Hkv;
    const double scale = 1.0 / sqrt((double)hd);
    double *p = alloc_d((size_t)T), *dp = alloc_d((size_t)T);
    if (dout) {
        memset(dq, 0, nq_of(s) * sizeof(double));
        memset(dk, 0, nk_of(s) * sizeof(double));
        memset(dv, 0, nk_of(s) * sizeof(double));
    }
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int g = h / rep;
            for (int t = 0; t < T; t++) {
                const float *qt = q + (((size_t)b * T + t) * H + h) * hd;
                double mx = -INFINITY;
                for (int c = 0; c <= t; c++) {
                    const float *kc = k + (((size_t)b * T + c) * Hkv + g) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++) d += (double)qt[e] * kc[e];
                    p[c] = d * scale;
                    if (p[c] > mx) mx = p[c];
                }
                double sum = 0;
                for (int c = 0; c <= t; c++) sum += exp(p[c] - mx);
                const double l = mx + log(sum);
                lse[((size_t)b * H + h) * T + t] = l;
                for (int c = 0; c <= t; c++) p[c] = exp(p[c] - l);
                double *ot = out + (((size_t)b * T + t) * H + h) * hd;
                for (int e = 0; e < hd; e++) {
                    double a = 0;
                    for (int c = 0; c <= t; c++) a += p[c] * v[(((size_t)b * T + c) * Hkv + g) * hd + e];
                    ot[e] = a;
                }
                if (!dout) continue;
                const float *gt = dout + (((size_t)b * T + t) * H + h) * hd;
                double Dt = 0;
                for (int c = 0; c <= t; c++) {
                    const float *vc = v + (((size_t)b * T + c) * Hkv + g) * hd;
                    double a = 0;
                    for (int e = 0; e < hd; e++) a += (double)gt[e] * vc[e];
                    dp[c] = a;
                    Dt += p[c] * a;
                }
                double *dqt = dq + (((size_t)b * T + t) * H + h) * hd;
                for (int c = 0; c <= t; c++) {
                    const size_t kvo = (((size_t)b * T + c) * Hkv + g) * hd;
                    const double ds = p[c] * (dp[c] - Dt) * scale;
                    for (int e = 0; e < hd; e++) {
                        dv[kvo + e] += p[c] * gt[e];
                        dqt[e] += ds * k[kvo + e];
                        dk[kvo + e] += ds * qt[e];
                    }
                }
            }
        }
    free(p);
    free(dp);
}

/* max over i of |a - r| / (atol + rtol * |r|); <= 1 passes */
static double err_ratio(const float *a, const double *r, size_t n, double atol, double rtol) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - r[i]) / (atol + rtol * fabs(r[i]));
        if (isnan(e)) return e; /* an unwritten (poisoned) or non-finite output */
        if (e > worst) worst = e;
    }
    return worst;
}

typedef struct {
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv, *scratch;
} bufs;

static bufs bufs_new_amp(shape s, float qk_amp) {
    bufs x;
    x.q = alloc_f(nq_of(s));
    x.k = alloc_f(nk_of(s));
    x.v = alloc_f(nk_of(s));
    x.out = alloc_f(nq_of(s));
    x.lse = alloc_f((size_t)s.B * s.H * s.T);
    x.dout = alloc_f(nq_of(s));
    x.dq = alloc_f(nq_of(s));
    x.dk = alloc_f(nk_of(s));
    x.dv = alloc_f(nk_of(s));
    x.scratch = alloc_f(tera_attention_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd));
    fill(x.q, nq_of(s), qk_amp);
    fill(x.k, nk_of(s), qk_amp);
    fill(x.v, nk_of(s), 1.0f);
    fill(x.dout, nq_of(s), 1.0f);
    /* poison outputs: every element must be written */
    for (size_t i = 0; i < nq_of(s); i++) x.out[i] = x.dq[i] = NAN;
    for (size_t i = 0; i < nk_of(s); i++) x.dk[i] = x.dv[i] = NAN;
    return x;
}
/* amplitude 2 for q, k: scores of a few units, softmaxes neither flat nor one-hot */
static bufs bufs_new(shape s) { return bufs_new_amp(s, 2.0f); }
static void bufs_free(bufs *x) {
    free(x->q), free(x->k), free(x->v), free(x->out), free(x->lse), free(x->dout);
    free(x->dq), free(x->dk), free(x->dv), free(x->scratch);
}

static const shape k_shapes[] = {
    {1, 1, 1, 1, 16},   {2, 7, 2, 2, 16},   {1, 64, 2, 2, 32},  {2, 100, 4, 4, 32},
    {1, 200, 8, 2, 32}, {1, 128, 4, 1, 64}, {2, 130, 2, 1, 64}, {1, 200, 8, 8, 16},
    {1, 65, 4, 2, 64},  {1, 300, 2, 2, 32}, {1, 256, 2, 2, 32}, {1, 129, 2, 2, 16},
    /* head dims that are not a multiple of 8 or 16 (the register-blocked kernels' masked lanes) */
    {1, 70, 2, 1, 20},  {2, 33, 3, 3, 12},  {1, 150, 2, 2, 40},
};

static void test_forward_vs_reference(void **state) {
    (void)state;
    for (size_t si = 0; si < sizeof k_shapes / sizeof k_shapes[0]; si++) {
        const shape s = k_shapes[si];
        bufs x = bufs_new(s);
        double *ro = alloc_d(nq_of(s)), *rl = alloc_d((size_t)s.B * s.H * s.T);
        tera_attention_forward(x.out, x.lse, x.q, x.k, x.v, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        ref_attention(s, x.q, x.k, x.v, NULL, ro, rl, NULL, NULL, NULL);
        const double eo = err_ratio(x.out, ro, nq_of(s), 1e-5, 1e-5);
        const double el = err_ratio(x.lse, rl, (size_t)s.B * s.H * s.T, 1e-5, 1e-5);
        if (!(eo <= 1 && el <= 1))
            fail_msg("forward B=%d T=%d H=%d Hkv=%d hd=%d: out err ratio %g, lse err ratio %g", s.B,
                     s.T, s.H, s.Hkv, s.hd, eo, el);
        free(ro), free(rl);
        bufs_free(&x);
    }
}

static void test_backward_vs_reference(void **state) {
    (void)state;
    for (size_t si = 0; si < sizeof k_shapes / sizeof k_shapes[0]; si++) {
        const shape s = k_shapes[si];
        bufs x = bufs_new(s);
        double *ro = alloc_d(nq_of(s)), *rl = alloc_d((size_t)s.B * s.H * s.T);
        double *rq = alloc_d(nq_of(s)), *rk = alloc_d(nk_of(s)), *rv = alloc_d(nk_of(s));
        tera_attention_forward(x.out, x.lse, x.q, x.k, x.v, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        tera_attention_backward(x.dq, x.dk, x.dv, x.dout, x.q, x.k, x.v, x.out, x.lse, s.B, s.T, s.H,
                                s.Hkv, s.hd, x.scratch);
        ref_attention(s, x.q, x.k, x.v, x.dout, ro, rl, rq, rk, rv);
        /* gradients sum over up to T*H/Hkv terms; observed error ratios are <= 0.1 at these bounds */
        const double eq = err_ratio(x.dq, rq, nq_of(s), 1e-5, 1e-5);
        const double ek = err_ratio(x.dk, rk, nk_of(s), 1e-5, 1e-5);
        const double ev = err_ratio(x.dv, rv, nk_of(s), 1e-5, 1e-5);
        if (!(eq <= 1 && ek <= 1 && ev <= 1))
            fail_msg("backward B=%d T=%d H=%d Hkv=%d hd=%d: err ratio dq %g dk %g dv %g", s.B, s.T,
                     s.H, s.Hkv, s.hd, eq, ek, ev);
        free(ro), free(rl), free(rq), free(rk), free(rv);
        bufs_free(&x);
    }
}

/* Scores spanning hundreds of units: most exponentials underflow to 0, rows are near one-hot. */
static void test_peaked_softmax(void **state) {
    (void)state;
    const shape cases[] = {{1, 150, 2, 1, 16}, {2, 70, 4, 2, 64}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const shape s = cases[ci];
        bufs x = bufs_new_amp(s, 8.0f);
        double *ro = alloc_d(nq_of(s)), *rl = alloc_d((size_t)s.B * s.H * s.T);
        double *rq = alloc_d(nq_of(s)), *rk = alloc_d(nk_of(s)), *rv = alloc_d(nk_of(s));
        tera_attention_forward(x.out, x.lse, x.q, x.k, x.v, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        tera_attention_backward(x.dq, x.dk, x.dv, x.dout, x.q, x.k, x.v, x.out, x.lse, s.B, s.T, s.H,
                                s.Hkv, s.hd, x.scratch);
        ref_attention(s, x.q, x.k, x.v, x.dout, ro, rl, rq, rk, rv);
        /* scores ~100 carry float rounding of ~1e-5 absolute into the exponent: a little looser */
        const double eo = err_ratio(x.out, ro, nq_of(s), 2e-5, 2e-5);
        const double el = err_ratio(x.lse, rl, (size_t)s.B * s.H * s.T, 2e-5, 1e-5);
        const double eq = err_ratio(x.dq, rq, nq_of(s), 1e-4, 1e-4);
        const double ek = err_ratio(x.dk, rk, nk_of(s), 1e-4, 1e-4);
        const double ev = err_ratio(x.dv, rv, nk_of(s), 2e-5, 2e-5);
        if (!(eo <= 1 && el <= 1 && eq <= 1 && ek <= 1 && ev <= 1))
            fail_msg("peaked B=%d T=%d H=%d Hkv=%d hd=%d: err ratio out %g lse %g dq %g dk %g dv %g",
                     s.B, s.T, s.H, s.Hkv, s.hd, eo, el, eq, ek, ev);
        free(ro), free(rl), free(rq), free(rk), free(rv);
        bufs_free(&x);
    }
}

/* L = sum(out * R) with the float kernel's forward, accumulated in double */
static double loss_of(shape s, bufs *x, const float *R) {
    tera_attention_forward(x->out, x->lse, x->q, x->k, x->v, s.B, s.T, s.H, s.Hkv, s.hd, x->scratch);
    double L = 0;
    for (size_t i = 0; i < nq_of(s); i++) L += (double)x->out[i] * R[i];
    return L;
}

/* Central differences of the kernel's own forward against its backward (dout = R). */
static void test_backward_finite_differences(void **state) {
    (void)state;
    const shape cases[] = {{1, 150, 4, 2, 16}, {2, 9, 2, 1, 32}}; /* two tiles; MQA */
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const shape s = cases[ci];
        bufs x = bufs_new(s);
        float *dq = x.dq, *dk = x.dk, *dv = x.dv;
        loss_of(s, &x, x.dout);
        tera_attention_backward(dq, dk, dv, x.dout, x.q, x.k, x.v, x.out, x.lse, s.B, s.T, s.H, s.Hkv,
                                s.hd, x.scratch);
        const float eps = 1e-3f;
        struct {
            float *p, *g;
            size_t n;
            const char *name;
        } ts[3] = {{x.q, dq, nq_of(s), "q"}, {x.k, dk, nk_of(s), "k"}, {x.v, dv, nk_of(s), "v"}};
        for (int ti = 0; ti < 3; ti++) {
            for (int sample = 0; sample < 40; sample++) {
                const size_t i = (size_t)((frand() * 0.5f + 0.5f) * (float)ts[ti].n) % ts[ti].n;
                const float saved = ts[ti].p[i];
                ts[ti].p[i] = saved + eps;
                const double lp = loss_of(s, &x, x.dout);
                ts[ti].p[i] = saved - eps;
                const double lm = loss_of(s, &x, x.dout);
                ts[ti].p[i] = saved;
                /* the actual step after float rounding */
                const double h = ((double)(saved + eps) - (double)(saved - eps));
                const double fd = (lp - lm) / h;
                const double an = ts[ti].g[i];
                if (!(fabs(fd - an) <= 2e-3 + 1e-2 * fabs(an)))
                    fail_msg("finite differences B=%d T=%d H=%d Hkv=%d hd=%d: d%s[%zu] analytic %.6g fd %.6g",
                             s.B, s.T, s.H, s.Hkv, s.hd, ts[ti].name, i, an, fd);
            }
        }
        bufs_free(&x);
    }
}

/* One forward + backward on `threads` threads; returns a copy of out|lse|dq|dk|dv. */
static float *run_all(shape s, bufs *x, int threads) {
    omp_set_num_threads(threads);
    tera_attention_forward(x->out, x->lse, x->q, x->k, x->v, s.B, s.T, s.H, s.Hkv, s.hd, x->scratch);
    tera_attention_backward(x->dq, x->dk, x->dv, x->dout, x->q, x->k, x->v, x->out, x->lse, s.B, s.T,
                            s.H, s.Hkv, s.hd, x->scratch);
    const size_t nq = nq_of(s), nk = nk_of(s), nl = (size_t)s.B * s.H * s.T;
    float *all = alloc_f(2 * nq + nl + 2 * nk);
    memcpy(all, x->out, nq * sizeof(float));
    memcpy(all + nq, x->lse, nl * sizeof(float));
    memcpy(all + nq + nl, x->dq, nq * sizeof(float));
    memcpy(all + 2 * nq + nl, x->dk, nk * sizeof(float));
    memcpy(all + 2 * nq + nl + nk, x->dv, nk * sizeof(float));
    return all;
}

static void test_determinism(void **state) {
    (void)state;
    const int saved = omp_get_max_threads();
    const shape cases[] = {{2, 200, 4, 2, 32}, {1, 150, 8, 1, 64}, {3, 70, 2, 2, 16}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const shape s = cases[ci];
        /* scratch sized for the largest thread count used */
        omp_set_num_threads(saved > 3 ? saved : 3);
        bufs x = bufs_new(s);
        const size_t n = 2 * nq_of(s) + (size_t)s.B * s.H * s.T + 2 * nk_of(s);
        float *a = run_all(s, &x, 2);
        float *b = run_all(s, &x, 2);
        float *c = run_all(s, &x, 1);
        float *d = run_all(s, &x, 3);
        assert_memory_equal(a, b, n * sizeof(float));
        assert_memory_equal(a, c, n * sizeof(float));
        assert_memory_equal(a, d, n * sizeof(float));
        free(a), free(b), free(c), free(d);
        bufs_free(&x);
    }
    omp_set_num_threads(saved);
}

/* The fp32 kernels this build has (sgemm; register-blocked on AVX2 + FMA and on AVX-512): the default
 * is the widest built (so an x86-64-v3 build runs the AVX2 kernels, not sgemm); each one matches the
 * reference on every shape; the register-blocked ones give the same bits as each other (the same
 * sums in the same order); selecting one this build lacks is refused and changes nothing. */
static void test_fp32_kernels(void **state) {
    (void)state;
    const int saved = tera_cpu_attn_fp32();
    if (!getenv("TERA_ATTN_FP32")) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        assert_int_equal(saved, TERA_ATTN_FP32_AVX512);
#elif defined(__AVX2__) && defined(__FMA__)
        assert_int_equal(saved, TERA_ATTN_FP32_AVX2);
#else
        assert_int_equal(saved, TERA_ATTN_FP32_SGEMM);
#endif
    }
#if defined(__AVX2__) && defined(__FMA__)
    assert_true(tera_cpu_attn_fp32_available(TERA_ATTN_FP32_AVX2));
#endif
    assert_true(tera_cpu_attn_fp32_available(TERA_ATTN_FP32_SGEMM));
    assert_int_equal(tera_cpu_attn_fp32_set(7), -1);
    if (!tera_cpu_attn_fp32_available(TERA_ATTN_FP32_AVX512))
        assert_int_equal(tera_cpu_attn_fp32_set(TERA_ATTN_FP32_AVX512), -1);
    assert_int_equal(tera_cpu_attn_fp32(), saved);
    const size_t nshape = sizeof k_shapes / sizeof k_shapes[0];
    float *first[sizeof k_shapes / sizeof k_shapes[0]] = {0}; /* the first register-blocked kernel's results */
    int ran = 0;
    for (int kern = TERA_ATTN_FP32_SGEMM; kern <= TERA_ATTN_FP32_AVX512; kern++) {
        if (!tera_cpu_attn_fp32_available(kern)) continue;
        assert_int_equal(tera_cpu_attn_fp32_set(kern), 0);
        assert_int_equal(tera_cpu_attn_fp32(), kern);
        ran++;
        for (size_t si = 0; si < nshape; si++) {
            const shape s = k_shapes[si];
            g_rng = 0x5DEECE66Dull + si; /* the same inputs for every kernel */
            bufs x = bufs_new(s);
            double *ro = alloc_d(nq_of(s)), *rl = alloc_d((size_t)s.B * s.H * s.T);
            double *rq = alloc_d(nq_of(s)), *rk = alloc_d(nk_of(s)), *rv = alloc_d(nk_of(s));
            float *all = run_all(s, &x, omp_get_max_threads());
            ref_attention(s, x.q, x.k, x.v, x.dout, ro, rl, rq, rk, rv);
            const double e[5] = {err_ratio(x.out, ro, nq_of(s), 1e-5, 1e-5),
                                 err_ratio(x.lse, rl, (size_t)s.B * s.H * s.T, 1e-5, 1e-5),
                                 err_ratio(x.dq, rq, nq_of(s), 1e-5, 1e-5), err_ratio(x.dk, rk, nk_of(s), 1e-5, 1e-5),
                                 err_ratio(x.dv, rv, nk_of(s), 1e-5, 1e-5)};
            for (int i = 0; i < 5; i++)
                if (!(e[i] <= 1))
                    fail_msg("fp32 kernels %s, B=%d T=%d H=%d Hkv=%d hd=%d: err ratio %g (out lse dq dk dv: %d)",
                             tera_cpu_attn_fp32_name(kern), s.B, s.T, s.H, s.Hkv, s.hd, e[i], i);
            const size_t n = 2 * nq_of(s) + (size_t)s.B * s.H * s.T + 2 * nk_of(s);
            if (kern == TERA_ATTN_FP32_SGEMM) {
                free(all);
            } else if (!first[si]) {
                first[si] = all;
            } else {
                if (memcmp(first[si], all, n * sizeof(float)))
                    fail_msg("fp32 kernels %s differ from avx2 in bits, B=%d T=%d H=%d Hkv=%d hd=%d",
                             tera_cpu_attn_fp32_name(kern), s.B, s.T, s.H, s.Hkv, s.hd);
                free(all);
            }
            free(ro), free(rl), free(rq), free(rk), free(rv);
            bufs_free(&x);
        }
    }
    printf("fp32 attention kernels checked: %d (default %s)\n", ran, tera_cpu_attn_fp32_name(saved));
    for (size_t si = 0; si < nshape; si++) free(first[si]);
    assert_int_equal(tera_cpu_attn_fp32_set(saved), 0);
}

static void test_scratch_is_small(void **state) {
    (void)state;
    /* per thread a bounded block (tiles, and the backward's K, V, dK, dV rows of one key chunk),
     * independent of T, plus D[B,H,T]: never a T x T matrix, nothing that grows with T per thread */
    const size_t nthr = (size_t)omp_get_max_threads();
    const size_t T = 4096;
    const size_t n = tera_attention_scratch_floats(1, (int)T, 8, 8, 64);
    assert_true(n >= (size_t)8 * T); /* holds D[B,H,T] */
    const size_t per = (n - (size_t)8 * T) / nthr;
    assert_true(per * nthr == n - (size_t)8 * T);
    assert_true(per <= (size_t)256 * 1024); /* at most 1 MiB a thread at hd = 64 */
    const size_t n4 = tera_attention_scratch_floats(1, (int)(4 * T), 8, 8, 64);
    assert_true(n4 - (size_t)8 * 4 * T == n - (size_t)8 * T); /* 4x T: only D grew */
    const size_t n8 = tera_attention_scratch_floats(8, (int)T, 32, 8, 128);
    assert_true(n8 - (size_t)8 * 32 * T <= nthr * (size_t)512 * 1024); /* 2 MiB a thread at hd = 128 */
    assert_true(n8 < T * T / 8 + nthr * (size_t)512 * 1024);
}

/* ------------------------------------------------------------------ bf16 attention
 * tera_attention_forward_bf16 / backward_bf16 round q, k, v, dO to bf16 (8 significant bits, unit
 * roundoff u = 2^-9) and run the six tile products on bf16 operands with fp32 accumulation; the
 * softmax statistics, dP, D and dS are fp32, and P and dS are rounded to bf16 once more as operands
 * of the next product. The reference is the double-precision one on the bf16-rounded inputs, so
 * what remains are the roundings inside the kernel: each output element is a sum of terms one of
 * whose factors was rounded (relative error <= u each), so its error is bounded by about
 * u * (sum of |terms|): out = sum_c P_c v_c (P rounded), dv = sum_i P_i dO_i (P rounded),
 * dq = sum_c dS_c k_c and dk = sum_i dS_i q_i (dS rounded; dS = P (dP - D) also carries the error
 * of D = dO . out, formed from the kernel's own out, so |dS|'s bound adds P * sum|dO| * out's bound
 * sum). The test allows 4u
 * times that sum (plus 1e-6 absolute for fp32 noise on tiny elements); the observed worst ratio is
 * printed (well under 1 in practice). lse never sees a rounded P: fp32 tolerance. */

/* Sums of |terms| of the reference's out, dq, dk, dv (the bounds above), inputs as given. */
static void ref_abs_terms(shape s, const float *q, const float *k, const float *v, const float *dout,
                          double *aout, double *adq, double *adk, double *adv) {
    const int B = s.B, T = s.T, H = s.H, Hkv = s.Hkv, hd = s.hd, rep = H / Hkv;
    const double scale = 1.0 / sqrt((double)hd);
    double *p = alloc_d((size_t)T), *dp = alloc_d((size_t)T);
    memset(adq, 0, nq_of(s) * sizeof(double));
    memset(adk, 0, nk_of(s) * sizeof(double));
    memset(adv, 0, nk_of(s) * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int g = h / rep;
            for (int t = 0; t < T; t++) {
                const float *qt = q + (((size_t)b * T + t) * H + h) * hd;
                double mx = -INFINITY;
                for (int c = 0; c <= t; c++) {
                    const float *kc = k + (((size_t)b * T + c) * Hkv + g) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++) d += (double)qt[e] * kc[e];
                    p[c] = d * scale;
                    if (p[c] > mx) mx = p[c];
                }
                double sum = 0;
                for (int c = 0; c <= t; c++) sum += exp(p[c] - mx);
                const double l = mx + log(sum);
                for (int c = 0; c <= t; c++) p[c] = exp(p[c] - l);
                double *ot = aout + (((size_t)b * T + t) * H + h) * hd;
                for (int e = 0; e < hd; e++) {
                    double a = 0;
                    for (int c = 0; c <= t; c++) a += p[c] * fabs(v[(((size_t)b * T + c) * Hkv + g) * hd + e]);
                    ot[e] = a;
                }
                const float *gt = dout + (((size_t)b * T + t) * H + h) * hd;
                double Dt = 0, Dabs = 0; /* D, and the sum of |terms| of D = dO . out */
                for (int e = 0; e < hd; e++) Dabs += fabs(gt[e]) * ot[e];
                for (int c = 0; c <= t; c++) {
                    const float *vc = v + (((size_t)b * T + c) * Hkv + g) * hd;
                    double a = 0;
                    for (int e = 0; e < hd; e++) a += (double)gt[e] * vc[e];
                    dp[c] = a;
                    Dt += p[c] * a;
                }
                double *dqt = adq + (((size_t)b * T + t) * H + h) * hd;
                for (int c = 0; c <= t; c++) {
                    const size_t kvo = (((size_t)b * T + c) * Hkv + g) * hd;
                    /* dS = P (dP - D) scale: its own terms, and D's error (the kernel's out) through P */
                    const double ds = fabs(p[c] * (dp[c] - Dt) * scale) + p[c] * Dabs * scale;
                    for (int e = 0; e < hd; e++) {
                        adv[kvo + e] += p[c] * fabs(gt[e]);
                        dqt[e] += ds * fabs(k[kvo + e]);
                        adk[kvo + e] += ds * fabs(qt[e]);
                    }
                }
            }
        }
    free(p);
    free(dp);
}

/* max over i of |a - r| / (atol + f * bound_i) */
static double err_bound_ratio(const float *a, const double *r, const double *bound, size_t n, double f) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - r[i]) / (1e-6 + f * bound[i]);
        if (isnan(e)) return e;
        if (e > worst) worst = e;
    }
    return worst;
}

static float *rounded_copy(const float *x, size_t n) {
    float *y = alloc_f(n);
    tera_round_bf16f(y, x, (int64_t)n);
    return y;
}

static void bufs_bf16_scratch(shape s, bufs *x) {
    free(x->scratch);
    x->scratch = alloc_f(tera_attention_bf16_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd));
}

static const shape k_bf16_shapes[] = {
    {1, 1, 1, 1, 16},  {2, 7, 2, 2, 16},   {2, 100, 4, 4, 32}, {1, 200, 8, 2, 32}, {2, 130, 2, 1, 64},
    {1, 129, 4, 2, 16}, {1, 300, 2, 2, 32}, {1, 257, 4, 1, 64}, {1, 256, 2, 2, 32}, {1, 65, 3, 1, 24},
    /* hd 128, the AMX kernels' 32 x 32 blocks cut by odd T on and off the diagonal, odd hd */
    {1, 130, 2, 1, 128}, {2, 97, 4, 2, 64}, {1, 33, 2, 2, 32}, {1, 200, 2, 1, 40}, {1, 70, 2, 2, 15},
};

static void test_bf16_vs_rounded_reference(void **state) {
    (void)state;
    if (!tera_attention_bf16_available()) {
        print_message("skip: no bf16 attention on this CPU / oneDNN\n");
        return;
    }
    const double u = 1.0 / 512.0, f = 4 * u;
    double worst[5] = {0};
    for (size_t si = 0; si < sizeof k_bf16_shapes / sizeof k_bf16_shapes[0]; si++) {
        const shape s = k_bf16_shapes[si];
        bufs x = bufs_new(s);
        bufs_bf16_scratch(s, &x);
        const size_t nl = (size_t)s.B * s.H * s.T;
        float *qr = rounded_copy(x.q, nq_of(s)), *kr = rounded_copy(x.k, nk_of(s));
        float *vr = rounded_copy(x.v, nk_of(s)), *dor = rounded_copy(x.dout, nq_of(s));
        double *ro = alloc_d(nq_of(s)), *rl = alloc_d(nl), *rq = alloc_d(nq_of(s)), *rk = alloc_d(nk_of(s)),
               *rv = alloc_d(nk_of(s));
        double *ao = alloc_d(nq_of(s)), *aq = alloc_d(nq_of(s)), *ak = alloc_d(nk_of(s)), *av = alloc_d(nk_of(s));
        ref_attention(s, qr, kr, vr, dor, ro, rl, rq, rk, rv);
        ref_abs_terms(s, qr, kr, vr, dor, ao, aq, ak, av);
        tera_attention_forward_bf16(x.out, x.lse, x.q, x.k, x.v, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        tera_attention_backward_bf16(x.dq, x.dk, x.dv, x.dout, x.q, x.k, x.v, x.out, x.lse, s.B, s.T, s.H, s.Hkv,
                                     s.hd, x.scratch);
        const double e[5] = {err_bound_ratio(x.out, ro, ao, nq_of(s), f), err_ratio(x.lse, rl, nl, 1e-5, 1e-5),
                             err_bound_ratio(x.dq, rq, aq, nq_of(s), f), err_bound_ratio(x.dk, rk, ak, nk_of(s), f),
                             err_bound_ratio(x.dv, rv, av, nk_of(s), f)};
        for (int i = 0; i < 5; i++) worst[i] = e[i] > worst[i] || isnan(e[i]) ? e[i] : worst[i];
        if (!(e[0] <= 1 && e[1] <= 1 && e[2] <= 1 && e[3] <= 1 && e[4] <= 1))
            fail_msg("bf16 B=%d T=%d H=%d Hkv=%d hd=%d: err ratio out %g lse %g dq %g dk %g dv %g", s.B, s.T, s.H,
                     s.Hkv, s.hd, e[0], e[1], e[2], e[3], e[4]);
        /* the kernel rounds its inputs itself: pre-rounded inputs give the same bits */
        float *out2 = alloc_f(nq_of(s)), *dq2 = alloc_f(nq_of(s));
        float *lse2 = alloc_f(nl), *dk2 = alloc_f(nk_of(s)), *dv2 = alloc_f(nk_of(s));
        tera_attention_forward_bf16(out2, lse2, qr, kr, vr, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        tera_attention_backward_bf16(dq2, dk2, dv2, dor, qr, kr, vr, x.out, x.lse, s.B, s.T, s.H, s.Hkv, s.hd,
                                     x.scratch);
        assert_memory_equal(out2, x.out, nq_of(s) * sizeof(float));
        assert_memory_equal(lse2, x.lse, nl * sizeof(float));
        assert_memory_equal(dq2, x.dq, nq_of(s) * sizeof(float));
        assert_memory_equal(dk2, x.dk, nk_of(s) * sizeof(float));
        assert_memory_equal(dv2, x.dv, nk_of(s) * sizeof(float));
        free(out2), free(dq2), free(lse2), free(dk2), free(dv2);
        free(qr), free(kr), free(vr), free(dor);
        free(ro), free(rl), free(rq), free(rk), free(rv), free(ao), free(aq), free(ak), free(av);
        bufs_free(&x);
    }
    print_message("bf16 attention (%s products): worst error / bound (bound = 4u * sum|terms|): out %.3g dq %.3g dk %.3g "
                  "dv %.3g; lse / fp32 tolerance %.3g\n",
                  tera_attention_bf16_kernel(), worst[0], worst[2], worst[3], worst[4], worst[1]);
    /* the AMX kernels run wherever the CPU and oneDNN's ISA have AMX, else the AVX512-BF16 dot-product
     * kernels wherever they have those (attention_dot.c, in AVX-512 builds); TERA_ATTN_BF16=onednn: the
     * oneDNN primitives (a ctest entry of its own) */
    const char *e = getenv("TERA_ATTN_BF16");
    const int onednn = e && !strcmp(e, "onednn");
    int amx = 0;
    if (tera_cpu_bf16_fast(NULL) && !onednn && __builtin_cpu_supports("amx-bf16") &&
        syscall(SYS_arch_prctl, 0x1023, 18) == 0) { /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: the OS grants tiles */
        assert_string_equal(tera_attention_bf16_kernel(), "amx");
        amx = 1;
    }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__GNUC__) && __GNUC__ >= 11
    if (!amx && !onednn && tera_cpu_bf16_has_dot() && __builtin_cpu_supports("avx512bf16"))
        assert_string_equal(tera_attention_bf16_kernel(), "dot");
#endif
    (void)amx;
    if (onednn) assert_string_equal(tera_attention_bf16_kernel(), "onednn");
}

/* bf16 forward + backward on `threads` threads: out|lse|dq|dk|dv */
static float *run_all_bf16(shape s, bufs *x, int threads) {
    omp_set_num_threads(threads);
    tera_attention_forward_bf16(x->out, x->lse, x->q, x->k, x->v, s.B, s.T, s.H, s.Hkv, s.hd, x->scratch);
    tera_attention_backward_bf16(x->dq, x->dk, x->dv, x->dout, x->q, x->k, x->v, x->out, x->lse, s.B, s.T, s.H,
                                 s.Hkv, s.hd, x->scratch);
    const size_t nq = nq_of(s), nk = nk_of(s), nl = (size_t)s.B * s.H * s.T;
    float *all = alloc_f(2 * nq + nl + 2 * nk);
    memcpy(all, x->out, nq * sizeof(float));
    memcpy(all + nq, x->lse, nl * sizeof(float));
    memcpy(all + nq + nl, x->dq, nq * sizeof(float));
    memcpy(all + 2 * nq + nl, x->dk, nk * sizeof(float));
    memcpy(all + 2 * nq + nl + nk, x->dv, nk * sizeof(float));
    return all;
}

static void test_bf16_determinism(void **state) {
    (void)state;
    if (!tera_attention_bf16_available()) {
        print_message("skip: no bf16 attention on this CPU / oneDNN\n");
        return;
    }
    const int saved = omp_get_max_threads();
    /* first more distinct tile products than a thread's primitive cache holds, on 2 threads: the
     * caches then differ between threads, which must not change any result */
    for (int T = 1; T <= 24; T++) {
        const shape w = {1, T, 2, 1, 16};
        omp_set_num_threads(2);
        bufs x = bufs_new(w);
        bufs_bf16_scratch(w, &x);
        free(run_all_bf16(w, &x, 2));
        bufs_free(&x);
    }
    const shape cases[] = {{2, 300, 4, 2, 32}, {1, 150, 8, 1, 64}, {3, 70, 2, 2, 16}, {1, 140, 4, 2, 128}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const shape s = cases[ci];
        omp_set_num_threads(saved > 3 ? saved : 3); /* scratch for the largest thread count used */
        bufs x = bufs_new(s);
        bufs_bf16_scratch(s, &x);
        const size_t n = 2 * nq_of(s) + (size_t)s.B * s.H * s.T + 2 * nk_of(s);
        float *a = run_all_bf16(s, &x, 2), *b = run_all_bf16(s, &x, 2);
        float *c = run_all_bf16(s, &x, 1), *d = run_all_bf16(s, &x, 3);
        assert_memory_equal(a, b, n * sizeof(float));
        assert_memory_equal(a, c, n * sizeof(float));
        assert_memory_equal(a, d, n * sizeof(float));
        free(a), free(b), free(c), free(d);
        bufs_free(&x);
    }
    omp_set_num_threads(saved);
}

/* The CPU backend runs the bf16 attention exactly when its precision is bf16 on the native units
 * and the CPU has AMX or bf16 dot products faster than its FMA (tera_cpu_bf16_dot_fast; elsewhere it
 * is slower than fp32), and sizes the scratch for both paths. */
static void test_bf16_backend_dispatch(void **state) {
    (void)state;
    const shape s = {2, 150, 4, 2, 32};
    tera_backend *be = tera_backend_cpu_create(-1);
    const size_t want = be->ops.attention_scratch_floats(be, s.B, s.T, s.H, s.Hkv, s.hd);
    assert_true(want >= tera_attention_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd));
    const int units = tera_attention_bf16_available() && (tera_cpu_bf16_fast(NULL) || tera_cpu_bf16_dot_fast());
    if (units) assert_true(want >= tera_attention_bf16_scratch_floats(s.B, s.T, s.H, s.Hkv, s.hd));
    bufs x = bufs_new(s), y = bufs_new(s);
    free(x.scratch);
    x.scratch = alloc_f(want);
    bufs_bf16_scratch(s, &y);
    memcpy(y.q, x.q, nq_of(s) * sizeof(float));
    memcpy(y.k, x.k, nk_of(s) * sizeof(float));
    memcpy(y.v, x.v, nk_of(s) * sizeof(float));
    memcpy(y.dout, x.dout, nq_of(s) * sizeof(float));
    const struct {
        tera_precision p;
        tera_bf16_gemm g;
    } modes[] = {{TERA_PREC_FP32, TERA_BF16_NATIVE}, {TERA_PREC_BF16, TERA_BF16_FMA}, {TERA_PREC_BF16, TERA_BF16_NATIVE}};
    for (int mi = 0; mi < 3; mi++) {
        tera_backend_set_precision(be, modes[mi].p, modes[mi].g);
        const int bf = modes[mi].p == TERA_PREC_BF16 && modes[mi].g == TERA_BF16_NATIVE && units;
        be->ops.attention_forward(be, x.out, x.lse, x.q, x.k, x.v, s.B, s.T, s.H, s.Hkv, s.hd, x.scratch);
        be->ops.attention_backward(be, x.dq, x.dk, x.dv, x.dout, x.q, x.k, x.v, x.out, x.lse, s.B, s.T, s.H, s.Hkv,
                                   s.hd, x.scratch);
        if (bf) {
            tera_attention_forward_bf16(y.out, y.lse, y.q, y.k, y.v, s.B, s.T, s.H, s.Hkv, s.hd, y.scratch);
            tera_attention_backward_bf16(y.dq, y.dk, y.dv, y.dout, y.q, y.k, y.v, y.out, y.lse, s.B, s.T, s.H, s.Hkv,
                                         s.hd, y.scratch);
        } else {
            tera_attention_forward(y.out, y.lse, y.q, y.k, y.v, s.B, s.T, s.H, s.Hkv, s.hd, y.scratch);
            tera_attention_backward(y.dq, y.dk, y.dv, y.dout, y.q, y.k, y.v, y.out, y.lse, s.B, s.T, s.H, s.Hkv,
                                    s.hd, y.scratch);
        }
        assert_memory_equal(x.out, y.out, nq_of(s) * sizeof(float));
        assert_memory_equal(x.dq, y.dq, nq_of(s) * sizeof(float));
        assert_memory_equal(x.dk, y.dk, nk_of(s) * sizeof(float));
        assert_memory_equal(x.dv, y.dv, nk_of(s) * sizeof(float));
    }
    bufs_free(&x);
    bufs_free(&y);
    tera_backend_destroy(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_vs_reference),
        cmocka_unit_test(test_backward_vs_reference),
        cmocka_unit_test(test_peaked_softmax),
        cmocka_unit_test(test_backward_finite_differences),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_fp32_kernels),
        cmocka_unit_test(test_scratch_is_small),
        cmocka_unit_test(test_bf16_vs_rounded_reference),
        cmocka_unit_test(test_bf16_determinism),
        cmocka_unit_test(test_bf16_backend_dispatch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
