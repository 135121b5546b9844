/* The optimizer's passes (src/train/optim.c): the fused clip + AdamW + gradient clearing pass and
 * the gradient norm against a double-precision reference of MODEL.md's update; bit-identical
 * results for 1, 2 and 3 threads; a range split in two (ZeRO-1 shards) and separate shard buffers
 * (ZeRO-2/3) giving the whole range's numbers; the plan rebuilt when the tensor table changes; the
 * passes scheduled through the model's backend (ops.for_ranges), with the numbers of one thread in
 * order (a model without a backend). */
#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/train.h"

#define C TERA_OPTIM_CHUNK

/* A model of n_params tensors with the given sizes (tails, chunk multiples, a tensor smaller than
 * a lane block), every second one decayed; w and g filled from seed. */
static const int64_t sizes[] = {5, C + 7, 3 * C, 1, 256, 2 * C - 3, 1000};
#define NP ((int)(sizeof sizes / sizeof sizes[0]))

static tera_backend *g_be; /* the CPU backend on the process's threads (main) */

static void fake_model(tera_model *m, tera_param *p, uint64_t seed) {
    tu_fake_model(m, p, sizes, NP, g_be, seed);
    const int64_t off = m->n_floats;
    for (int64_t i = 0; i < off; i += 97) m->g[i] = 0.0f; /* exact zeros: m, v from zero */
}

static void free_model(tera_model *m) {
    free(m->w);
    free(m->g);
}

static const tera_optim_config oc = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

/* three steps of the reference on copies: w, m, v in double */
static void reference(const tera_model *m0, const float *g_steps, int steps, const float *lr, const float *gs,
                      double *w, double *mm, double *vv, double *usq, double *psq) {
    const int64_t n = m0->n_floats;
    for (int64_t i = 0; i < n; i++) w[i] = m0->w[i], mm[i] = vv[i] = 0.0;
    for (int s = 0; s < steps; s++) {
        const double bc1 = 1.0 - pow(oc.beta1, s + 1), bc2 = 1.0 - pow(oc.beta2, s + 1);
        *usq = *psq = 0.0;
        for (int p = 0; p < m0->n_params; p++)
            for (int64_t j = m0->params[p].offset; j < m0->params[p].offset + m0->params[p].numel; j++) {
                const double g = (double)g_steps[(int64_t)s * n + j] * gs[s], w0 = w[j];
                mm[j] = oc.beta1 * mm[j] + (1.0 - oc.beta1) * g;
                vv[j] = oc.beta2 * vv[j] + (1.0 - oc.beta2) * g * g;
                double wj = m0->params[p].decay ? w0 * (1.0 - lr[s] * oc.weight_decay) : w0;
                wj -= lr[s] / bc1 * mm[j] / (sqrt(vv[j]) / sqrt(bc2) + oc.eps);
                w[j] = wj;
                *usq += (wj - w0) * (wj - w0);
                *psq += w0 * w0;
            }
    }
}

static void to_float(float *d, const double *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = (float)s[i];
}

/* Three steps on m with threads t; the gradients of each step from gsrc (copied in, since the
 * step clears them). Returns the update/param sums and grad norms of the last step. */
typedef struct {
    double usq, psq, gsq, sq[NP], u[NP], pp[NP];
} run_out;

static run_out run(tera_model *m, tera_adamw *o, const float *gsrc, int steps, const float *lr, const float *gs,
                   int threads) {
    tera_set_threads(threads);
    run_out r;
    memset(&r, 0, sizeof r);
    for (int s = 0; s < steps; s++) {
        memcpy(m->g, gsrc + (int64_t)s * m->n_floats, sizeof(float) * (size_t)m->n_floats);
        r.gsq = tera_adamw_grad_sq(o, m, r.sq);
        memset(r.u, 0, sizeof r.u);
        memset(r.pp, 0, sizeof r.pp);
        tera_adamw_step_by_param(o, m, lr[s], gs[s], &oc, 1, &r.usq, &r.psq, r.u, r.pp);
    }
    tera_set_threads(2);
    return r;
}

static const float lrs[3] = {1e-3f, 3e-3f, 2e-3f}, gss[3] = {1.0f, 0.37f, 1.0f};

static float *make_grads(int64_t n, int steps) {
    float *g = malloc(sizeof(float) * (size_t)(n * steps));
    for (int s = 0; s < steps; s++) {
        tu_fill(g + (int64_t)s * n, n, 100 + (uint64_t)s, 0.01f);
        for (int64_t i = s; i < n; i += 89) g[(int64_t)s * n + i] = 0.0f;
    }
    return g;
}

static void test_against_reference(void **state) {
    (void)state;
    tera_param p[NP];
    tera_model m;
    fake_model(&m, p, 1);
    const int64_t n = m.n_floats;
    float *g = make_grads(n, 3);
    double *w = malloc(sizeof(double) * (size_t)n * 3), *mm = w + n, *vv = mm + n, usq, psq;
    reference(&m, g, 3, lrs, gss, w, mm, vv, &usq, &psq);
    tera_adamw o;
    tera_adamw_init(&o, n);
    const run_out r = run(&m, &o, g, 3, lrs, gss, 2);
    float *f = malloc(sizeof(float) * (size_t)n);
    to_float(f, w, n);
    assert_true(tu_close("w", m.w, f, n, 1e-6, 1e-9) <= 1.0);
    to_float(f, mm, n);
    assert_true(tu_close("m", o.m, f, n, 1e-5, 1e-9) <= 1.0);
    to_float(f, vv, n);
    assert_true(tu_close("v", o.v, f, n, 1e-5, 1e-12) <= 1.0);
    for (int64_t i = 0; i < n; i++) assert_true(m.g[i] == 0.0f); /* cleared as consumed */
    assert_true(fabs(r.usq - usq) <= 1e-4 * usq);
    assert_true(fabs(r.psq - psq) <= 1e-5 * psq);
    /* the per-tensor sums add up to the totals; the grad norm of the last step's gradient */
    double us = 0.0, ps = 0.0, gsq_ref = 0.0;
    for (int i = 0; i < NP; i++) us += r.u[i], ps += r.pp[i];
    for (int64_t i = 0; i < n; i++) gsq_ref += (double)g[2 * n + i] * g[2 * n + i];
    assert_true(fabs(us - r.usq) <= 1e-12 * r.usq && fabs(ps - r.psq) <= 1e-12 * r.psq);
    assert_true(fabs(r.gsq - gsq_ref) <= 1e-12 * gsq_ref);
    for (int i = 0; i < NP; i++) {
        double t = 0.0;
        for (int64_t j = p[i].offset; j < p[i].offset + p[i].numel; j++) t += (double)g[2 * n + j] * g[2 * n + j];
        assert_true(fabs(r.sq[i] - t) <= 1e-12 * t + 1e-30);
    }
    assert_int_equal(o.t, 3);
    free(f), free(w), free(g);
    tera_adamw_free(&o);
    free_model(&m);
}

/* 1, 2 and 3 threads: every array and every sum bit-identical */
static void test_threads_bit_identical(void **state) {
    (void)state;
    tera_param p[NP];
    tera_model m[3];
    tera_adamw o[3];
    run_out r[3];
    for (int k = 0; k < 3; k++) fake_model(&m[k], p, 2); /* the same table for all three */
    const int64_t n = m[0].n_floats;
    float *g = make_grads(n, 3);
    for (int k = 0; k < 3; k++) {
        tera_adamw_init(&o[k], n);
        r[k] = run(&m[k], &o[k], g, 3, lrs, gss, k + 1);
    }
    for (int k = 1; k < 3; k++) {
        assert_same("w", m[k].w, m[0].w, n);
        assert_same("m", o[k].m, o[0].m, n);
        assert_same("v", o[k].v, o[0].v, n);
        assert_memory_equal(&r[k], &r[0], sizeof r[0]);
    }
    for (int k = 0; k < 3; k++) tera_adamw_free(&o[k]), free_model(&m[k]);
    free(g);
}

/* [0, n) split at an unaligned point into two optimizers (ZeRO-1 shards), and the second shard on
 * buffers of its own (ZeRO-2/3: o->g, o->w): the same parameters and moments, bit for bit; the
 * per-tensor norms add up to the whole's */
static void test_ranges(void **state) {
    (void)state;
    tera_param p[NP];
    tera_model a, b;
    fake_model(&a, p, 3);
    fake_model(&b, p, 3);
    const int64_t n = a.n_floats, k = 1005; /* inside tensor 1, not on a chunk boundary */
    float *g = make_grads(n, 3);
    tera_adamw whole, lo, hi;
    tera_adamw_init(&whole, n);
    tera_adamw_init_range(&lo, 0, k);
    tera_adamw_init_range(&hi, k, n);
    tera_adamw_plan(&lo, &b);
    tera_adamw_plan(&hi, &b);
    float *hw = malloc(sizeof(float) * (size_t)(n - k)), *hg = malloc(sizeof(float) * (size_t)(n - k));
    memcpy(hw, b.w + k, sizeof(float) * (size_t)(n - k));
    hi.w = hw, hi.g = hg;
    run(&a, &whole, g, 3, lrs, gss, 2);
    for (int s = 0; s < 3; s++) {
        memcpy(b.g, g + (int64_t)s * n, sizeof(float) * (size_t)n);
        memcpy(hg, g + (int64_t)s * n + k, sizeof(float) * (size_t)(n - k));
        double sq_lo[NP], sq_hi[NP], sq_whole[NP];
        const double t = tera_adamw_grad_sq(&lo, &b, sq_lo) + tera_adamw_grad_sq(&hi, &b, sq_hi);
        const double tw = tera_grad_sq_by_param(&b, sq_whole);
        assert_true(fabs(t - tw) <= 1e-12 * tw);
        for (int i = 0; i < NP; i++) {
            if (i > 1) assert_true(sq_lo[i] == 0.0);
            if (i < 1) assert_true(sq_hi[i] == 0.0);
            assert_true(fabs(sq_lo[i] + sq_hi[i] - sq_whole[i]) <= 1e-12 * sq_whole[i]);
        }
        tera_adamw_step(&lo, &b, lrs[s], gss[s], &oc, 1, NULL, NULL);
        tera_adamw_step(&hi, &b, lrs[s], gss[s], &oc, 1, NULL, NULL);
    }
    assert_same("w lo", b.w, a.w, k);
    assert_same("w hi", hw, a.w + k, n - k);
    assert_same("m lo", lo.m, whole.m, k);
    assert_same("m hi", hi.m, whole.m + k, n - k);
    assert_same("v hi", hi.v, whole.v + k, n - k);
    for (int64_t i = 0; i < n - k; i++) assert_true(hg[i] == 0.0f);
    free(hw), free(hg), free(g);
    tera_adamw_free(&whole), tera_adamw_free(&lo), tera_adamw_free(&hi);
    free_model(&a), free_model(&b);
}

/* The clip factor folded into the pass equals clipping first (a power of two: exact); without
 * zero_grad the gradient is left alone; the legacy norm equals the optimizer's */
static void test_scale_and_keep(void **state) {
    (void)state;
    tera_param p[NP];
    tera_model a, b;
    fake_model(&a, p, 4);
    fake_model(&b, p, 4);
    const int64_t n = a.n_floats;
    tera_adamw oa, ob;
    tera_adamw_init(&oa, n);
    tera_adamw_init(&ob, n);
    double sq[NP], sq2[NP];
    const double t1 = tera_adamw_grad_sq(&oa, &a, sq), t2 = tera_grad_sq_by_param(&a, sq2);
    assert_true(t1 == t2);
    assert_memory_equal(sq, sq2, sizeof sq);
    float *g0 = malloc(sizeof(float) * (size_t)n);
    memcpy(g0, a.g, sizeof(float) * (size_t)n);
    tera_adamw_step(&oa, &a, 1e-3f, 0.25f, &oc, 0, NULL, NULL);
    assert_same("g kept", a.g, g0, n); /* zero_grad = 0 */
    for (int64_t i = 0; i < n; i++) b.g[i] *= 0.25f;
    tera_grad_scale(&b, 4.0f); /* exact: back to the original */
    assert_same("g scaled", b.g, g0, n);
    for (int64_t i = 0; i < n; i++) b.g[i] *= 0.25f;
    tera_adamw_step(&ob, &b, 1e-3f, 1.0f, &oc, 0, NULL, NULL);
    assert_same("w", a.w, b.w, n);
    assert_same("m", oa.m, ob.m, n);
    assert_same("v", oa.v, ob.v, n);
    free(g0);
    tera_adamw_free(&oa), tera_adamw_free(&ob);
    free_model(&a), free_model(&b);
}

/* A plan built for one table is rebuilt when the table changes (same sizes in another order):
 * the results equal a fresh optimizer's */
static void test_plan_rebuilt(void **state) {
    (void)state;
    tera_param p[NP], q[NP];
    tera_model a;
    fake_model(&a, p, 6);
    const int64_t n = a.n_floats;
    tera_adamw o, fresh;
    tera_adamw_init(&o, n);
    tera_adamw_plan(&o, &a);
    const struct tera_adamw_plan *first = o.plan;
    assert_non_null(first);
    tera_adamw_plan(&o, &a); /* unchanged table: kept */
    assert_ptr_equal(o.plan, first);
    /* the same elements cut into tensors the other way round */
    int64_t off = 0;
    for (int i = 0; i < NP; i++) {
        q[i] = p[NP - 1 - i];
        q[i].offset = off;
        off += q[i].numel;
    }
    a.params = q;
    double sq[NP], sq2[NP];
    tera_adamw_init(&fresh, n);
    const double t = tera_adamw_grad_sq(&o, &a, sq), t2 = tera_adamw_grad_sq(&fresh, &a, sq2);
    assert_true(t == t2);
    assert_memory_equal(sq, sq2, sizeof sq);
    for (int i = 0; i < NP; i++) {
        double s = 0.0;
        for (int64_t j = q[i].offset; j < q[i].offset + q[i].numel; j++) s += (double)a.g[j] * a.g[j];
        assert_true(fabs(sq[i] - s) <= 1e-12 * s + 1e-30);
    }
    tera_adamw_free(&o), tera_adamw_free(&fresh);
    free_model(&a);
}

/* The gradient norm's order of additions, bit for bit (so that a faster pass cannot change it):
 * per chunk of C elements from the tensor's start, element j's fp64 square into lane j % 32, the 32
 * lanes added in order, the chunks of a tensor added in order, the tensors in table order. */
static void test_norm_order(void **state) {
    (void)state;
    tera_param p[NP];
    tera_model m;
    fake_model(&m, p, 8);
    for (int t = 1; t <= 3; t++) {
        tera_set_threads(t);
        tera_adamw o;
        tera_adamw_init(&o, m.n_floats);
        double sq[NP];
        const double total = tera_adamw_grad_sq(&o, &m, sq);
        double ref_total = 0.0;
        for (int i = 0; i < NP; i++) {
            double t_i = 0.0;
            for (int64_t a = 0; a < p[i].numel; a += C) {
                double acc[32] = {0}, s = 0.0;
                const int64_t len = p[i].numel - a < C ? p[i].numel - a : C;
                for (int64_t j = 0; j < len; j++) {
                    const double x = m.g[p[i].offset + a + j];
                    acc[j % 32] += x * x;
                }
                for (int l = 0; l < 32; l++) s += acc[l];
                t_i += s;
            }
            assert_true(sq[i] == t_i);
            ref_total += t_i;
        }
        assert_true(total == ref_total);
        tera_adamw_free(&o);
    }
    tera_set_threads(2);
    free_model(&m);
}

/* A backend whose for_ranges counts its calls and hands them to the CPU backend's. */
static int g_ranges_calls;

static void counting_for_ranges(tera_backend *be, int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker),
                                void *ctx) {
    (void)be;
    g_ranges_calls++;
    g_be->ops.for_ranges(g_be, n, fn, ctx);
}

/* The passes go through the model's backend: three steps (norm, update, and a gradient scale in
 * between) on 1, 2 and 3 threads of a counting backend make one for_ranges call per pass on more
 * than one thread, and give every array and sum bit for bit as one thread in item order (m->be
 * NULL) does. */
static void test_backend_schedules(void **state) {
    (void)state;
    tera_backend counting = *g_be;
    counting.ops.for_ranges = counting_for_ranges;
    tera_param p[NP];
    tera_model serial, m;
    fake_model(&serial, p, 7);
    serial.be = NULL;
    const int64_t n = serial.n_floats;
    float *g = make_grads(n, 3);
    tera_adamw os;
    tera_adamw_init(&os, n);
    g_ranges_calls = 0;
    const run_out rs = run(&serial, &os, g, 3, lrs, gss, 2);
    assert_int_equal(g_ranges_calls, 0);
    for (int t = 1; t <= 3; t++) {
        fake_model(&m, p, 7);
        m.be = &counting;
        tera_adamw o;
        tera_adamw_init(&o, n);
        g_ranges_calls = 0;
        const run_out r = run(&m, &o, g, 3, lrs, gss, t);
        assert_int_equal(g_ranges_calls, t > 1 ? 6 : 0); /* two passes per step; one thread: inline */
        assert_same("w", m.w, serial.w, n);
        assert_same("m", o.m, os.m, n);
        assert_same("v", o.v, os.v, n);
        assert_memory_equal(&r, &rs, sizeof r);
        tera_set_threads(t);
        g_ranges_calls = 0;
        memcpy(m.g, g, sizeof(float) * (size_t)n);
        memcpy(serial.g, g, sizeof(float) * (size_t)n);
        tera_grad_scale(&m, 0.37f);
        tera_grad_scale(&serial, 0.37f);
        tera_set_threads(2);
        assert_int_equal(g_ranges_calls, 1); /* for_ranges decides itself whether to split */
        assert_same("g scaled", m.g, serial.g, n);
        tera_adamw_free(&o);
        free_model(&m);
    }
    tera_adamw_free(&os);
    free_model(&serial);
    free(g);
}

/* Experts marked absent (tera_model_grads_sparse: their gradients are zero but never written): two
 * expert-stacked tensors of three local experts each, one whose expert slab is not a multiple of the
 * chunk (C + 5: the items split at each expert's start, so none spans two experts) and one of 2 C,
 * between dense tensors. Experts (0, 1) and (1, 0), (1, 2) are marked and their gradient memory holds
 * NaN; three steps of the norm and the update (fp32 moments and bf16 moments with stochastic
 * rounding; 1 and 2 threads) give every weight, moment, norm and sum bit for bit as the same steps
 * with those slabs zeroed and no marks, and leave the NaN where it was (never read, never written).
 * Marks on a buffer other than the model's (ZeRO-2/3's shard) are not applied. */
static void test_absent_experts(void **state) {
    (void)state;
    const int64_t S0 = C + 5, S1 = 2 * C, ex[] = {7, 3 * S0, 1000, 3 * S1, 33};
    const int ne = 5;
    for (int bf = 0; bf < 2; bf++)
        for (int th = 1; th <= 2; th++) {
            tera_param p[2][5];
            tera_model m[2];
            tera_adamw o[2];
            uint8_t marks[6] = {0, 1, 0, 1, 0, 1}; /* [layer * 3 + expert] */
            float *gsrc = make_grads(ex[0] + ex[1] + ex[2] + ex[3] + ex[4], 3);
            for (int k = 0; k < 2; k++) { /* 0: zeros, no marks (the reference); 1: NaN, marked */
                tu_fake_model(&m[k], p[k], ex, ne, g_be, 11);
                p[k][1].expert_stacked = p[k][3].expert_stacked = 1;
                p[k][1].layer = 0, p[k][3].layer = 1;
                p[k][1].len[0] = p[k][3].len[0] = 3;
                p[k][1].decay = p[k][3].decay = 1;
                m[k].g_absent = marks;
                m[k].g_sparse = k;
                if (bf) tera_adamw_init_range_bf16(&o[k], 0, m[k].n_floats, 99);
                else tera_adamw_init(&o[k], m[k].n_floats);
            }
            const int64_t n = m[0].n_floats;
            const int64_t mark_lo[3] = {p[0][1].offset + S0, p[0][3].offset, p[0][3].offset + 2 * S1};
            const int64_t mark_n[3] = {S0, S1, S1};
            tera_set_threads(th);
            for (int st = 0; st < 3; st++) {
                double gsq[2], sq[2][5], usq[2], psq[2], u[2][5] = {{0}}, pp[2][5] = {{0}};
                for (int k = 0; k < 2; k++) {
                    memcpy(m[k].g, gsrc + st * n, sizeof(float) * (size_t)n);
                    for (int r = 0; r < 3; r++)
                        for (int64_t j = mark_lo[r]; j < mark_lo[r] + mark_n[r]; j++) m[k].g[j] = k ? NAN : 0.0f;
                    gsq[k] = tera_adamw_grad_sq(&o[k], &m[k], sq[k]);
                    tera_adamw_step_by_param(&o[k], &m[k], lrs[st], gss[st], &oc, 0, &usq[k], &psq[k], u[k], pp[k]);
                }
                assert_true(isfinite(gsq[1]) && gsq[1] == gsq[0] && usq[1] == usq[0] && psq[1] == psq[0]);
                assert_memory_equal(sq[1], sq[0], sizeof sq[0]);
                assert_memory_equal(u[1], u[0], sizeof u[0]);
                assert_memory_equal(pp[1], pp[0], sizeof pp[0]);
                assert_same("w", m[1].w, m[0].w, n);
                if (bf) {
                    assert_memory_equal(o[1].mh, o[0].mh, sizeof(uint16_t) * (size_t)n);
                    assert_memory_equal(o[1].vh, o[0].vh, sizeof(uint16_t) * (size_t)n);
                } else {
                    assert_same("m", o[1].m, o[0].m, n);
                    assert_same("v", o[1].v, o[0].v, n);
                }
                for (int r = 0; r < 3; r++)
                    for (int64_t j = mark_lo[r]; j < mark_lo[r] + mark_n[r]; j++) assert_true(isnan(m[1].g[j]));
                /* the model's buffer through the public norm: the marks apply */
                assert_true(tera_grad_sq_by_param(&m[1], NULL) == gsq[0]);
                /* a buffer of its own (a ZeRO shard, a copy): the marks are the model buffer's, not applied */
                float *copy = malloc(sizeof(float) * (size_t)n);
                memcpy(copy, m[1].g, sizeof(float) * (size_t)n);
                assert_true(isnan(tera_grad_sq_by_param_at(&m[1], 0, n, copy, NULL)));
                free(copy);
                /* the other experts' gradients are read: a NaN there shows in the norm */
                const int64_t at = p[1][1].offset + 2 * S0 + 3;
                const float keep = m[1].g[at];
                m[1].g[at] = NAN;
                assert_true(isnan(tera_adamw_grad_sq(&o[1], &m[1], NULL)));
                m[1].g[at] = keep;
            }
            tera_set_threads(2);
            for (int k = 0; k < 2; k++) tera_adamw_free(&o[k]), free_model(&m[k]);
            free(gsrc);
        }
}

int main(void) {
    tera_set_threads(2);
    g_be = tera_backend_cpu_create(-1); /* the process's threads: run() sets them per case */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_reference), cmocka_unit_test(test_threads_bit_identical),
        cmocka_unit_test(test_ranges), cmocka_unit_test(test_scale_and_keep),
        cmocka_unit_test(test_plan_rebuilt), cmocka_unit_test(test_backend_schedules),
        cmocka_unit_test(test_norm_order), cmocka_unit_test(test_absent_experts),
    };
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(g_be);
    return rc;
}
