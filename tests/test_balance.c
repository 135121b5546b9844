/* The load-balancing losses (model.balance_loss: switch, switch_global, importance_load) at the
 * router against the PyTorch reference (tests/ref/make_balance_fixtures.py, fixtures in
 * tests/fixtures/balance/): the selection, the loss value and its gradient with respect to the router
 * logits, under softmax and sigmoid scores. Also: the default (switch) path gives the gradient of the
 * plain tera_moe_router_backward bit for bit, and an extra combine-weight gradient adds linearly.
 * And model.router_force_balance's fixed balanced selection (test_force_balance). */
#include <math.h>

#include "testutil.h"

#include "model/moe.h"
#include "tera/kernels.h"

#ifndef TERA_SOURCE_DIR
#define TERA_SOURCE_DIR "."
#endif

enum { MAXN = 256, MAXE = 64, MAXK = 8 };

typedef struct {
    char kind[32], score[16];
    int B, T, E, k;
    float scale;
    float logits[MAXN * MAXE];
    int32_t topi[MAXN * MAXK];
    double loss;
    float dlogits[MAXN * MAXE];
} fixture;

/* One CPU backend for the router functions of the tests (kept for the process). */
static tera_backend *cpu(void) {
    static tera_backend *b;
    if (!b) b = tera_backend_cpu_create(-1);
    return b;
}

static void load_fixture(fixture *f, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/balance/%s.txt", TERA_SOURCE_DIR, name);
    FILE *fp = fopen(path, "r");
    if (!fp) fail_msg("cannot open %s (regenerate: /usr/bin/python3 tests/ref/make_balance_fixtures.py)", path);
    assert_int_equal(fscanf(fp, "%31s %15s %d %d %d %d %f", f->kind, f->score, &f->B, &f->T, &f->E, &f->k, &f->scale),
                     7);
    const int N = f->B * f->T;
    assert_true(N <= MAXN && f->E <= MAXE && f->k <= MAXK);
    for (int i = 0; i < N * f->E; i++) assert_int_equal(fscanf(fp, "%f", &f->logits[i]), 1);
    for (int i = 0; i < N * f->k; i++) assert_int_equal(fscanf(fp, "%d", &f->topi[i]), 1);
    assert_int_equal(fscanf(fp, "%lf", &f->loss), 1);
    for (int i = 0; i < N * f->E; i++) {
        double d;
        assert_int_equal(fscanf(fp, "%lf", &d), 1);
        f->dlogits[i] = (float)d;
    }
    fclose(fp);
}

static tera_balance_loss kind_of(const char *s) {
    if (!strcmp(s, "switch")) return TERA_BALANCE_SWITCH;
    if (!strcmp(s, "switch_global")) return TERA_BALANCE_SWITCH_GLOBAL;
    assert_string_equal(s, "importance_load");
    return TERA_BALANCE_IMPORTANCE_LOAD;
}

/* Routes the fixture's logits as the model does, then computes the loss value and d loss / d logits
 * (aux_scale 1, no combine-weight gradient unless dtopw0 is given, no z-loss). */
static double run_case_g(const fixture *f, tera_balance_loss kind, const float *dtopw0, float *dl, int32_t *topi,
                         const float *gcnt) {
    const int B = f->B, T = f->T, E = f->E, k = f->k, N = B * T;
    const tera_router_score sc = strcmp(f->score, "sigmoid") ? TERA_ROUTER_SOFTMAX : TERA_ROUTER_SIGMOID;
    static float s[MAXN * MAXE], lse[MAXN], topw[MAXN * MAXK], dtopw[MAXN * MAXK], rsum[MAXN], dsc[MAXN * MAXE];
    int32_t cnt[MAXN * MAXE];
    int64_t load[MAXE] = {0};
    static double psum[(MAXN + 1) * MAXE];
    tera_backend *be = tera_backend_cpu_create(-1);
    tera_moe_score_forward(be, s, lse, f->logits, N, E, sc);
    const tera_moe_routing r = {.score = sc, .n_groups = 1, .topk_groups = 1, .scale = f->scale};
    tera_moe_route(cpu(), topi, topw, s, NULL, N, E, k, &r, NULL);
    memset(cnt, 0, sizeof cnt);
    for (int a = 0; a < N * k; a++) cnt[(a / (T * k)) * E + topi[a]]++;
    const tera_moe_stats st = tera_moe_route_stats(cpu(), load, sc == TERA_ROUTER_SIGMOID ? rsum : NULL, psum, s, f->logits,
                                                   lse, cnt, B, T, E, k, sc);
    const double v = tera_moe_balance_value(kind, st.aux, psum, topi, topw, cnt, gcnt, B, T, E, k);
    for (int i = 0; i < N * k; i++) dtopw[i] = dtopw0 ? dtopw0[i] : 0.0f;
    float aux_scale = 1.0f;
    const float *g = tera_moe_balance_backward_prep(cpu(), kind, psum, dtopw, topi, topw, cnt, gcnt, B, T, E, k, &aux_scale);
    tera_moe_router_backward_g(be, dl, dsc, f->logits, s, lse, topi, topw, dtopw, cnt, g, B, T, E, k, &r, aux_scale,
                               0.0f);
    tera_backend_destroy(be);
    return v;
}

static double run_case(const fixture *f, tera_balance_loss kind, const float *dtopw0, float *dl, int32_t *topi) {
    return run_case_g(f, kind, dtopw0, dl, topi, NULL);
}

/* switch_dp against the switch_global reference: the fixture's B sequences as B data-parallel ranks of
 * one sequence each, every rank given the counts summed over the ranks / B (what the model's
 * all-reduce gives it). The ranks' losses add up to the reference loss of the whole batch, and each
 * rank's gradient is the reference gradient's rows of its sequence: the same model as one rank. A
 * rank on its own counts (no all-reduce) differs. */
static void check_dp_split(const char *name) {
    static fixture f, one;
    load_fixture(&f, name);
    const int B = f.B, T = f.T, E = f.E, k = f.k;
    static float dl[MAXN * MAXE];
    int32_t topi[MAXN * MAXK];
    run_case(&f, TERA_BALANCE_SWITCH_GLOBAL, NULL, dl, topi); /* the whole batch's selection */
    float gcnt[MAXE] = {0};
    for (int a = 0; a < B * T * k; a++) gcnt[topi[a]] += 1.0f;
    for (int e = 0; e < E; e++) gcnt[e] /= (float)B;
    double total = 0.0, alone = 0.0;
    for (int r = 0; r < B; r++) {
        one = f;
        one.B = 1;
        memcpy(one.logits, f.logits + (int64_t)r * T * E, sizeof(float) * (size_t)(T * E));
        total += run_case_g(&one, TERA_BALANCE_SWITCH_DP, NULL, dl, topi, gcnt);
        char what[96];
        snprintf(what, sizeof what, "%s as rank %d of %d", name, r, B);
        assert_true(tu_close(what, dl, f.dlogits + (int64_t)r * T * E, (int64_t)T * E, 1e-4, 1e-6) <= 1.0);
        alone += run_case_g(&one, TERA_BALANCE_SWITCH_DP, NULL, dl, topi, NULL);
    }
    if (!(fabs(total - f.loss) <= 1e-5 * fabs(f.loss) + 1e-7))
        fail_msg("%s: the ranks' switch_dp losses add up to %.9g, the whole batch's reference %.9g", name, total, f.loss);
    if (!(fabs(alone - f.loss) > 1e-4 * fabs(f.loss)))
        fail_msg("%s: ranks on their own counts give %.9g, the same as the whole batch %.9g", name, alone, f.loss);
}

static void test_dp_softmax(void **state) { (void)state, check_dp_split("switch_global_softmax"); }
static void test_dp_sigmoid(void **state) { (void)state, check_dp_split("switch_global_sigmoid"); }

static void check_fixture(const char *name) {
    static fixture f;
    load_fixture(&f, name);
    const int N = f.B * f.T;
    static float dl[MAXN * MAXE];
    int32_t topi[MAXN * MAXK];
    const double v = run_case(&f, kind_of(f.kind), NULL, dl, topi);
    for (int i = 0; i < N * f.k; i++)
        if (topi[i] != f.topi[i]) fail_msg("%s: assignment %d chose expert %d, the reference %d", name, i, topi[i], f.topi[i]);
    if (!(fabs(v - f.loss) <= 1e-5 * fabs(f.loss) + 1e-7))
        fail_msg("%s: loss %.9g, the reference %.9g", name, v, f.loss);
    assert_true(tu_close(name, dl, f.dlogits, (int64_t)N * f.E, 1e-4, 1e-6) <= 1.0);
    /* the gradient is not trivially zero */
    double gmax = 0.0;
    for (int i = 0; i < N * f.E; i++) gmax = fmax(gmax, fabs((double)f.dlogits[i]));
    assert_true(gmax > 1e-3);
}

static void test_switch_softmax(void **state) { (void)state, check_fixture("switch_softmax"); }
static void test_switch_sigmoid(void **state) { (void)state, check_fixture("switch_sigmoid"); }
static void test_global_softmax(void **state) { (void)state, check_fixture("switch_global_softmax"); }
static void test_global_sigmoid(void **state) { (void)state, check_fixture("switch_global_sigmoid"); }
static void test_importance_softmax(void **state) { (void)state, check_fixture("importance_load_softmax"); }
static void test_importance_sigmoid(void **state) { (void)state, check_fixture("importance_load_sigmoid"); }

/* The switch kind through the new entry points is the old router backward bit for bit; the other
 * kinds differ from it; with a combine-weight gradient the balancing gradient adds to it. */
static void test_default_unchanged(void **state) {
    (void)state;
    static fixture f;
    static float a[MAXN * MAXE], b[MAXN * MAXE], c[MAXN * MAXE], d[MAXN * MAXE], e[MAXN * MAXE], dsc[MAXN * MAXE];
    static float s[MAXN * MAXE], lse[MAXN], topw[MAXN * MAXK], dtopw[MAXN * MAXK];
    int32_t topi[MAXN * MAXK], cnt[MAXN * MAXE];
    for (int sig = 0; sig < 2; sig++) {
        load_fixture(&f, sig ? "switch_sigmoid" : "switch_softmax");
        const int B = f.B, T = f.T, E = f.E, k = f.k, N = B * T;
        tu_fill(dtopw, N * k, 7 + sig, 0.5f);
        run_case(&f, TERA_BALANCE_SWITCH, dtopw, a, topi);
        /* the unchanged entry point */
        const tera_router_score sc = sig ? TERA_ROUTER_SIGMOID : TERA_ROUTER_SOFTMAX;
        tera_backend *be = tera_backend_cpu_create(-1);
        tera_moe_score_forward(be, s, lse, f.logits, N, E, sc);
        const tera_moe_routing r = {.score = sc, .n_groups = 1, .topk_groups = 1, .scale = f.scale};
        tera_moe_route(cpu(), topi, topw, s, NULL, N, E, k, &r, NULL);
        memset(cnt, 0, sizeof cnt);
        for (int i = 0; i < N * k; i++) cnt[(i / (T * k)) * E + topi[i]]++;
        tera_moe_router_backward(be, b, dsc, f.logits, s, lse, topi, topw, dtopw, cnt, B, T, E, k, &r, 1.0f, 0.0f);
        assert_same("switch via balance entry points", a, b, (int64_t)N * E);
        /* importance_load with a combine-weight gradient = its own gradient + the combine part alone
         * (the backward is linear in dtopw) */
        tera_moe_router_backward(be, e, dsc, f.logits, s, lse, topi, topw, dtopw, cnt, B, T, E, k, &r, 0.0f, 0.0f);
        tera_backend_destroy(be);
        run_case(&f, TERA_BALANCE_IMPORTANCE_LOAD, dtopw, c, topi);
        run_case(&f, TERA_BALANCE_IMPORTANCE_LOAD, NULL, d, topi);
        for (int i = 0; i < N * E; i++) d[i] += e[i];
        assert_true(tu_close("importance_load + combine gradient", c, d, (int64_t)N * E, 1e-5, 1e-7) <= 1.0);
        int differs = 0;
        for (int i = 0; i < N * E; i++) differs |= c[i] != a[i];
        assert_true(differs);
    }
}

/* model.router_force_balance (benchmarking only): the selection is the fixed pattern
 * (t k + j + layer) mod E of the row's position t whatever the scores and the bias, every expert gets
 * T k / E rows of each sequence, the combine weights are the chosen scores renormalised (times the
 * routed scale), positions may come from an array (decoding); off, tera_moe_route_at is
 * tera_moe_route bit for bit. */
static void test_force_balance(void **state) {
    (void)state;
    enum { FB = 3, FT = 24, FE = 8, FN = FB * FT };
    static float x[FN * FE], s[FN * FE], lse[FN], bias[FE], w[FN * 4], w2[FN * 4];
    int32_t ti[FN * 4], ti2[FN * 4], pos[FN], cnt[FE];
    tu_fill(x, FN * FE, 5, 2.0f);
    for (int e = 0; e < FE; e++) bias[e] = e == 3 ? 100.0f : 0.0f; /* would win every selection if looked at */
    const int ks[] = {1, 2, 3, 4};
    for (int sig = 0; sig < 2; sig++) {
        const tera_router_score sc = sig ? TERA_ROUTER_SIGMOID : TERA_ROUTER_SOFTMAX;
        tera_moe_score_forward(cpu(), s, lse, x, FN, FE, sc);
        for (int ki = 0; ki < 4; ki++) {
            const int k = ks[ki];
            for (int layer = 0; layer < 3; layer++) {
                const tera_moe_routing r = {.score = sc, .n_groups = 1, .topk_groups = 1, .scale = sig ? 2.5f : 1.0f,
                                            .force_balance = 1};
                tera_moe_route_at(cpu(), ti, w, s, layer == 1 ? bias : NULL, FN, FE, k, &r, NULL, FT, NULL, layer);
                for (int64_t n = 0; n < FN; n++) {
                    const int t = (int)(n % FT);
                    float sum = 0.0f;
                    for (int j = 0; j < k; j++) {
                        assert_int_equal(ti[n * k + j], (t * k + j + layer) % FE);
                        sum += s[n * FE + ti[n * k + j]];
                    }
                    for (int j = 0; j < k; j++) {
                        const float want = s[n * FE + ti[n * k + j]] / sum * r.scale;
                        assert_true(fabsf(w[n * k + j] - want) <= 1e-6f * r.scale);
                    }
                }
                /* every expert T k / E rows of each sequence when E divides T k (k = 1: T = 24 = 3 E) */
                for (int b = 0; b < FB; b++) {
                    memset(cnt, 0, sizeof cnt);
                    for (int a = b * FT * k; a < (b + 1) * FT * k; a++) cnt[ti[a]]++;
                    for (int e = 0; e < FE; e++) assert_int_equal(cnt[e], FT * k / FE);
                }
                /* the position is the row mod T: with T = 23 (T k not a multiple of E) the pattern does not
                 * repeat with the row index */
                tera_moe_route_at(cpu(), ti2, w2, s, NULL, FN, FE, k, &r, NULL, FT - 1, NULL, layer);
                for (int64_t n = 0; n < FN; n++)
                    for (int j = 0; j < k; j++)
                        assert_int_equal(ti2[n * k + j], ((int)(n % (FT - 1)) * k + j + layer) % FE);
                /* the same positions given as an array (decoding): the same selection and weights */
                for (int n = 0; n < FN; n++) pos[n] = n % FT;
                tera_moe_route_at(cpu(), ti2, w2, s, bias, FN, FE, k, &r, NULL, 1, pos, layer);
                assert_memory_equal(ti, ti2, sizeof(int32_t) * (size_t)FN * k);
                assert_same("forced balance: positions from an array", w, w2, (int64_t)FN * k);
                /* off: exactly tera_moe_route */
                tera_moe_routing off = r;
                off.force_balance = 0;
                tera_moe_route_at(cpu(), ti, w, s, bias, FN, FE, k, &off, NULL, FT, NULL, layer);
                tera_moe_route(cpu(), ti2, w2, s, bias, FN, FE, k, &off, NULL);
                assert_memory_equal(ti, ti2, sizeof(int32_t) * (size_t)FN * k);
                assert_same("force balance off: tera_moe_route", w, w2, (int64_t)FN * k);
            }
        }
    }
    /* the router still learns: the combine weights' gradient reaches the logits of the chosen experts */
    {
        const int k = 2;
        const tera_moe_routing r = {.score = TERA_ROUTER_SOFTMAX, .n_groups = 1, .topk_groups = 1, .scale = 1.0f,
                                    .force_balance = 1};
        static float dl[FN * FE], dsc[FN * FE], dw[FN * 2];
        int32_t sel[FB * FE];
        tera_moe_score_forward(cpu(), s, lse, x, FN, FE, TERA_ROUTER_SOFTMAX);
        tera_moe_route_at(cpu(), ti, w, s, NULL, FN, FE, k, &r, NULL, FT, NULL, 0);
        memset(sel, 0, sizeof sel);
        for (int a = 0; a < FN * k; a++) sel[(a / (FT * k)) * FE + ti[a]]++;
        for (int b = 0; b < FB; b++)
            for (int e = 0; e < FE; e++) assert_int_equal(sel[b * FE + e], FT * k / FE);
        tu_fill(dw, FN * k, 9, 1.0f);
        tera_moe_router_backward(cpu(), dl, dsc, x, s, lse, ti, w, dw, sel, FB, FT, FE, k, &r, 0.0f, 0.0f);
        double norm = 0.0;
        for (int i = 0; i < FN * FE; i++) norm += (double)dl[i] * dl[i];
        assert_true(norm > 1e-6);
        /* chosen scores that underflowed to exactly 0 (a logit gap beyond ~88): equal weights 1/k, not 0/0,
         * and a finite router gradient; rows whose chosen scores are positive keep their weights' bits */
        static float w0[FN * 2];
        memcpy(w0, w, sizeof w0);
        for (int n = 0; n < FT; n++) /* the first sequence: its chosen scores to 0 */
            for (int j = 0; j < k; j++) s[n * FE + ti[n * k + j]] = 0.0f;
        tera_moe_route_at(cpu(), ti2, w2, s, NULL, FN, FE, k, &r, NULL, FT, NULL, 0);
        for (int a = 0; a < FT * k; a++) assert_true(w2[a] == 0.5f);
        assert_memory_equal(w2 + FT * k, w0 + FT * k, sizeof(float) * (size_t)(FN - FT) * k);
        tera_moe_router_backward(cpu(), dl, dsc, x, s, lse, ti2, w2, dw, sel, FB, FT, FE, k, &r, 0.0f, 0.0f);
        for (int i = 0; i < FN * FE; i++) assert_true(isfinite(dl[i]) && isfinite(dsc[i]));
        const tera_moe_routing rs = {.score = TERA_ROUTER_SIGMOID, .n_groups = 1, .topk_groups = 1, .scale = 1.0f,
                                     .force_balance = 1};
        tera_moe_router_backward(cpu(), dl, dsc, x, s, lse, ti2, w2, dw, sel, FB, FT, FE, k, &rs, 0.0f, 0.0f);
        for (int i = 0; i < FN * FE; i++) assert_true(isfinite(dl[i]) && isfinite(dsc[i]));
    }
    /* the config: off by default; refused with group-limited routing, allowed when every group is open */
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(c.model.router_force_balance, 0);
    assert_int_equal(tera_moe_routing_of(&c.model).force_balance, 0);
    assert_int_equal(tera_config_set(&c, "model.router_force_balance=true"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(tera_moe_routing_of(&c.model).force_balance, 1);
    assert_int_equal(tera_config_set(&c, "model.n_groups=4"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.topk_groups=2"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "router_force_balance"));
    assert_int_equal(tera_config_set(&c, "model.topk_groups=4"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
}

/* The statistics of tera_moe_route_stats on the fixture's logits (width 6) and on logits drawn here at
 * widths 37 and 64 (eight-lane sums with and without a tail), for 1 to 4 sequences of 7 to 256 tokens:
 * - the entropy against the entropy computed here in double precision from the logits (softmax
 *   probabilities, or sigmoid scores normalised per token);
 * - aux against sum_b E sum_e f_{b,e} P_{b,e} summed here over the scores in token order, as the
 *   reference order (the same bits: the sums per expert are split over threads, not reordered), and
 *   psum's rows: per sequence, and (row B) over all tokens in token order;
 * - the same bits on 1, 2 and 3 threads (fixed blocks of tokens, ranges of experts). */
static void check_entropy(const char *name) {
    static fixture f;
    load_fixture(&f, name);
    const int sig = !strcmp(f.score, "sigmoid");
    const tera_router_score sc = sig ? TERA_ROUTER_SIGMOID : TERA_ROUTER_SOFTMAX;
    static float x[MAXN * MAXE], s[MAXN * MAXE], lse[MAXN], rsum[MAXN];
    static int32_t cnt[MAXN * MAXE];
    static double psum[(MAXN + 1) * MAXE];
    const int widths[] = {f.E, 37, MAXE};
    const int shapes[][2] = {{f.B, f.T}, {4, 64}, {1, 99}, {1, 7}}; /* B, T */
    for (int w = 0; w < 3; w++) {
        const int E = widths[w];
        for (int i = 0; i < MAXN * E; i++) /* the fixture's logits, or uniform in [-3, 3] */
            x[i] = E == f.E ? f.logits[i % (f.B * f.T * f.E)] : (float)(6.0 * ((i * 2654435761u) % 10007) / 10007.0 - 3.0);
        for (int sh = 0; sh < 4; sh++) {
            const int B = shapes[sh][0], T = shapes[sh][1], N = B * T;
            for (int b = 0; b < B; b++)
                for (int e = 0; e < E; e++) cnt[b * E + e] = (b + 2 * e) % 3;
            double ref = 0.0;
            for (int n = 0; n < N; n++) {
                const float *xn = x + (size_t)n * E;
                double mx = xn[0], z = 0.0, q[MAXE];
                for (int e = 1; e < E; e++) mx = xn[e] > mx ? xn[e] : mx;
                for (int e = 0; e < E; e++)
                    z += q[e] = sig ? 1.0 / (1.0 + exp(-(double)xn[e])) : exp((double)xn[e] - mx);
                for (int e = 0; e < E; e++) ref -= q[e] / z * log(q[e] / z);
            }
            tera_moe_stats got[3];
            for (int t = 1; t <= 3; t++) {
                tera_set_threads(t);
                int64_t load[MAXE] = {0};
                tera_moe_score_forward(cpu(), s, lse, x, N, E, sc);
                got[t - 1] = tera_moe_route_stats(cpu(), load, sig ? rsum : NULL, psum, s, x, lse, cnt, B, T, E, f.k, sc);
                for (int e = 0; e < E; e++) {
                    int64_t c = 0;
                    for (int b = 0; b < B; b++) c += cnt[b * E + e];
                    if (load[e] != c) fail_msg("%s, width %d, %d tokens: load[%d] = %lld, not %lld", name, E, N, e,
                                               (long long)load[e], (long long)c);
                }
            }
            tera_set_threads(2);
            double aux = 0.0;
            for (int b = 0; b < B; b++) {
                double sb = 0.0;
                for (int e = 0; e < E; e++) {
                    double P = 0.0;
                    for (int t = 0; t < T; t++) {
                        const int64_t n = (int64_t)b * T + t;
                        P += sig ? s[n * E + e] * (1.0f / rsum[n]) : s[n * E + e];
                    }
                    sb += (double)cnt[b * E + e] / ((double)T * f.k) * (P / T);
                    if (psum[b * E + e] != P)
                        fail_msg("%s, width %d: psum[%d, %d] = %.17g, not %.17g", name, E, b, e, psum[b * E + e], P);
                }
                aux += E * sb;
            }
            for (int e = 0; e < E; e++) { /* row B: over all tokens, in token order */
                double G = 0.0;
                for (int n = 0; n < N; n++) G += sig ? s[n * E + e] * (1.0f / rsum[n]) : s[n * E + e];
                if (psum[B * E + e] != G)
                    fail_msg("%s, width %d: psum[B, %d] = %.17g, not %.17g", name, E, e, psum[B * E + e], G);
            }
            if (fabs(got[0].entropy - ref) > 1e-5 * fabs(ref) || got[0].aux != aux ||
                memcmp(&got[0], &got[1], sizeof got[0]) || memcmp(&got[0], &got[2], sizeof got[0]))
                fail_msg("%s, width %d, %d x %d tokens: entropy %.17g (1 thread) %.17g (2) %.17g (3), reference "
                         "%.17g; aux %.17g %.17g %.17g, reference %.17g",
                         name, E, B, T, got[0].entropy, got[1].entropy, got[2].entropy, ref, got[0].aux, got[1].aux,
                         got[2].aux, aux);
        }
    }
}

static void test_entropy(void **state) {
    (void)state;
    check_entropy("switch_softmax");
    check_entropy("switch_sigmoid");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_switch_softmax),     cmocka_unit_test(test_switch_sigmoid),
        cmocka_unit_test(test_global_softmax),     cmocka_unit_test(test_global_sigmoid),
        cmocka_unit_test(test_dp_softmax),         cmocka_unit_test(test_dp_sigmoid),
        cmocka_unit_test(test_importance_softmax), cmocka_unit_test(test_importance_sigmoid),
        cmocka_unit_test(test_default_unchanged), cmocka_unit_test(test_force_balance),
        cmocka_unit_test(test_entropy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
