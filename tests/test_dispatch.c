/* Unit tests of the MoE token dispatcher (src/model/dispatch.c, the local implementation) and of the
 * tensor-parallel layers (src/model/tp_layers.c) in one process.
 *
 * Dispatcher: on a hand-made routing, permute's plan (each expert's rows contiguous, in assignment
 * order; drops under a capacity) and gathered rows; combine of an identity expert (ye = xg) gives back
 * sum_j w_j x; the SwiGLU experts, their backward (weight and input gradients) and the combine
 * weights' gradients against a naive double-precision reference; the same bits whatever the thread
 * count (experts one after another or side by side). The all-to-all implementation needs ep > 1
 * ranks (it exchanges with peer ranks of the ep group), so it is not exercised here: tests/cli_layouts.sh
 * compares ep4, ep2 with ZeRO and pp x ep layouts with one rank.
 *
 * Tensor-parallel layers: with tp = 1 each function is the plain operation bit for bit; the
 * vocabulary-parallel pieces (slice max, slice sums, backward and embedding over a range) over 2 or 4
 * slices, combined by hand, give the whole-vocabulary answer; and the layers' tp > 1 paths, run one
 * simulated rank at a time over a one-rank group (identity all-reduces), give each rank's partial
 * answer, which summed by hand is the whole one. */
#include "testutil.h"

#include "model/dispatch.h"
#include "model/tp_layers.h"
#include "tera/backend.h"
#include "tera/config.h"
#include "tera/kernels.h"

/* The CPU backend the dispatcher and the layers compute through (created in main, on the process's
 * thread setting, fp32). */
static tera_backend *BE;

static float *fnew(int64_t n) { return malloc(sizeof(float) * (size_t)(n > 0 ? n : 1)); }
static float *fzero(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }
static void assert_close_d(const char *what, const float *a, const double *b, int64_t n, double rtol, double atol) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)a[i] - b[i]) <= atol + rtol * fabs(b[i])))
            fail_msg("%s: element %ld = %.8g, reference %.8g", what, (long)i, (double)a[i], b[i]);
}

/* ------------------------------------------------------------------------------ a dispatcher */

typedef struct {
    tera_config cfg;
    int B, T, E, K;
    int64_t N, D, F, R;
    tera_dispatcher *d;
    tera_dispatch_acts t;
    float *w1, *w3, *w2, *g1, *g3, *g2; /* weights [E,F,D], [E,F,D], [E,D,F] and their gradients */
    tera_layer_view W, G;
    float *da1, *da3, *dg;
} fixture;

static void fixture_init(fixture *f, int B, int T, int E, int K, int64_t D, int64_t F, float cf,
                         tera_drop_policy drop) {
    memset(f, 0, sizeof *f);
    tera_config_defaults(&f->cfg);
    tera_model_config *c = &f->cfg.model;
    c->n_experts = E, c->top_k = K, c->dim = (int)D, c->ffn_dim = (int)F;
    c->capacity_factor = cf, c->drop_policy = drop;
    f->B = B, f->T = T, f->E = E, f->K = K, f->N = (int64_t)B * T, f->D = D, f->F = F;
    const tera_model_par par = {.ep = 1, .tp = 1, .be = BE};
    f->d = tera_dispatch_create(c, B, T, F, &par, 0);
    assert_string_equal(tera_dispatch_name(f->d), "local");
    f->R = tera_dispatch_rows(f->d);
    assert_int_equal(f->R, f->N * K);
    tera_dispatch_sizes s;
    tera_dispatch_exchange_sizes(f->d, &s);
    assert_true(s.counts == 0 && s.offsets == 0 && s.rows == 0);
    assert_int_equal(tera_dispatch_comm_bytes(f->d), 0);
    assert_true(tera_dispatch_bytes(f->d) > 0);
    const int64_t NK = f->N * K, R = f->R;
    f->t.slot_row = malloc(sizeof(int32_t) * (size_t)NK);
    f->t.row_tok = malloc(sizeof(int32_t) * (size_t)NK);
    f->t.exp_off = malloc(sizeof(int32_t) * (size_t)(E + 1));
    f->t.sel_count = malloc(sizeof(int32_t) * (size_t)(B * E));
    f->t.xg = fnew(NK * D), f->t.ye = fnew(NK * D);
    f->t.a1 = fnew(R * F), f->t.a3 = fnew(R * F), f->t.gact = fnew(R * F);
    f->w1 = fnew(E * F * D), f->w3 = fnew(E * F * D), f->w2 = fnew(E * D * F);
    tu_fill(f->w1, E * F * D, 71, 0.5f), tu_fill(f->w3, E * F * D, 72, 0.5f), tu_fill(f->w2, E * D * F, 73, 0.5f);
    f->g1 = fzero(E * F * D), f->g3 = fzero(E * F * D), f->g2 = fzero(E * D * F);
    f->W = (tera_layer_view){.w1 = f->w1, .w3 = f->w3, .w2 = f->w2};
    f->G = (tera_layer_view){.w1 = f->g1, .w3 = f->g3, .w2 = f->g2};
    f->da1 = fnew(R * F), f->da3 = fnew(R * F), f->dg = fnew(R * F);
}

static void fixture_free(fixture *f) {
    tera_dispatch_destroy(f->d);
    free(f->t.slot_row), free(f->t.row_tok), free(f->t.exp_off), free(f->t.sel_count);
    free(f->t.xg), free(f->t.ye), free(f->t.a1), free(f->t.a3), free(f->t.gact);
    free(f->w1), free(f->w3), free(f->w2), free(f->g1), free(f->g3), free(f->g2);
    free(f->da1), free(f->da3), free(f->dg);
}

/* The expected plan: assignments grouped by expert, in assignment order inside an expert; keep[a]
 * says which are kept. */
static void check_plan(const fixture *f, const int32_t *topi, const int *keep) {
    const int64_t A = f->N * f->K;
    int32_t row = 0;
    for (int e = 0; e < f->E; e++) {
        if (f->t.exp_off[e] != row) fail_msg("exp_off[%d] = %d, want %d", e, f->t.exp_off[e], row);
        for (int64_t a = 0; a < A; a++) {
            if (topi[a] != e || !keep[a]) continue;
            if (f->t.slot_row[a] != row) fail_msg("slot_row[%ld] = %d, want %d", (long)a, f->t.slot_row[a], row);
            if (f->t.row_tok[row] != a / f->K) fail_msg("row_tok[%d] = %d, want %ld", row, f->t.row_tok[row], (long)(a / f->K));
            row++;
        }
    }
    assert_int_equal(f->t.exp_off[f->E], row);
    for (int64_t a = 0; a < A; a++)
        if (!keep[a] && f->t.slot_row[a] != -1) fail_msg("slot_row[%ld] = %d, want -1 (dropped)", (long)a, f->t.slot_row[a]);
}

/* Hand-made routing: B = 2 sequences of T = 4 tokens, E = 4 experts, k = 2; expert 3 is never chosen.
 *   sequence 0: (0,1) (1,0) (0,2) (2,1)     sequence 1: (1,2) (2,1) (1,0) (0,2) */
static const int32_t HAND_TOPI[16] = {0, 1, 1, 0, 0, 2, 2, 1, 1, 2, 2, 1, 1, 0, 0, 2};

static void test_permute_hand_routing(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 2, 4, 4, 2, 3, 5, 0.0f, TERA_DROP_POSITION);
    float *x = fnew(f.N * f.D), *probs = fnew(f.N * f.E);
    for (int64_t t = 0; t < f.N; t++)
        for (int64_t dd = 0; dd < f.D; dd++) x[t * f.D + dd] = (float)(100 * t + dd); /* row t says t */
    for (int64_t i = 0; i < f.N * f.E; i++) probs[i] = 0.25f;
    assert_int_equal(tera_dispatch_permute(f.d, &f.t, x, HAND_TOPI, probs, 0), 0);
    /* by hand: expert 0 gets assignments 0, 3, 4, 13, 14; expert 1: 1, 2, 7, 8, 11, 12; expert 2: 5, 6,
     * 9, 10, 15; expert 3: none */
    const int32_t want_off[5] = {0, 5, 11, 16, 16};
    const int32_t want_tok[16] = {0, 1, 2, 6, 7, /**/ 0, 1, 3, 4, 5, 6, /**/ 2, 3, 4, 5, 7};
    for (int e = 0; e <= 4; e++) assert_int_equal(f.t.exp_off[e], want_off[e]);
    for (int r = 0; r < 16; r++) assert_int_equal(f.t.row_tok[r], want_tok[r]);
    int keep[16];
    for (int a = 0; a < 16; a++) keep[a] = 1;
    check_plan(&f, HAND_TOPI, keep);
    for (int r = 0; r < 16; r++) /* the gathered rows */
        for (int64_t dd = 0; dd < f.D; dd++) assert_true(f.t.xg[r * f.D + dd] == x[want_tok[r] * f.D + dd]);
    /* selection counts per sequence, before drops */
    const int32_t want_sel[8] = {3, 3, 2, 0, 2, 3, 3, 0};
    for (int i = 0; i < 8; i++) assert_int_equal(f.t.sel_count[i], want_sel[i]);

    /* an identity expert (ye = xg): combine gives back res + sum_j w_j x_t */
    memcpy(f.t.ye, f.t.xg, sizeof(float) * (size_t)(16 * f.D));
    float *topw = fnew(f.N * f.K), *out = fnew(f.N * f.D), *res = fnew(f.N * f.D);
    tu_fill(topw, f.N * f.K, 5, 1.0f), tu_fill(res, f.N * f.D, 6, 1.0f);
    memcpy(out, res, sizeof(float) * (size_t)(f.N * f.D));
    tera_dispatch_combine_forward(f.d, out, &f.t, topw);
    for (int64_t t = 0; t < f.N; t++)
        for (int64_t dd = 0; dd < f.D; dd++) {
            float want = res[t * f.D + dd];
            for (int j = 0; j < f.K; j++) want += topw[t * f.K + j] * x[t * f.D + dd];
            if (out[t * f.D + dd] != want) fail_msg("identity expert: out[%ld][%ld] = %g, want %g", (long)t, (long)dd, out[t * f.D + dd], want);
        }
    free(x), free(probs), free(topw), free(out), free(res);
    fixture_free(&f);
}

/* Capacity: cf 0.6 gives ceil(0.6 * 4 * 2 / 4) = ceil(1.2) = 2 rows per sequence and expert; the
 * position policy keeps an expert's two earliest assignments of each sequence. */
static void test_permute_capacity_drops(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 2, 4, 4, 2, 3, 5, 0.6f, TERA_DROP_POSITION);
    float *x = fnew(f.N * f.D), *probs = fnew(f.N * f.E);
    tu_fill(x, f.N * f.D, 8, 1.0f);
    for (int64_t i = 0; i < f.N * f.E; i++) probs[i] = 0.25f;
    int keep[16], used[2][4] = {{0}}, dropped = 0;
    for (int a = 0; a < 16; a++) {
        const int b = a / (4 * 2);
        keep[a] = used[b][HAND_TOPI[a]]++ < 2;
        dropped += !keep[a];
    }
    assert_int_equal(dropped, 4); /* by hand: assignments 4 (expert 0), 7 (1), 12 (1), 15 (2) */
    assert_true(!keep[4] && !keep[7] && !keep[12] && !keep[15]);
    assert_int_equal(tera_dispatch_permute(f.d, &f.t, x, HAND_TOPI, probs, 0), dropped);
    check_plan(&f, HAND_TOPI, keep);
    for (int r = 0; r < f.t.exp_off[f.E]; r++)
        assert_true(memcmp(f.t.xg + r * f.D, x + (int64_t)f.t.row_tok[r] * f.D, sizeof(float) * (size_t)f.D) == 0);
    free(x), free(probs);
    fixture_free(&f);
}

/* ------------------------------------------------------------------------------ experts, in double */

/* SwiGLU expert e on x[D]: y[D]; keeps a1, a3 [F] for the backward. */
static void ref_expert(const fixture *f, int e, const float *x, double *y, double *a1, double *a3) {
    const int64_t D = f->D, F = f->F;
    const float *w1 = f->w1 + e * F * D, *w3 = f->w3 + e * F * D, *w2 = f->w2 + e * D * F;
    double *g = malloc(sizeof(double) * (size_t)F);
    for (int64_t i = 0; i < F; i++) {
        double s1 = 0, s3 = 0;
        for (int64_t dd = 0; dd < D; dd++) s1 += (double)w1[i * D + dd] * x[dd], s3 += (double)w3[i * D + dd] * x[dd];
        a1[i] = s1, a3[i] = s3;
        g[i] = s1 / (1.0 + exp(-s1)) * s3;
    }
    for (int64_t o = 0; o < D; o++) {
        double s = 0;
        for (int64_t i = 0; i < F; i++) s += (double)w2[o * F + i] * g[i];
        y[o] = s;
    }
    free(g);
}

/* Random routing of N tokens (k distinct experts each among the first `used`; random_routing: E - 1,
 * so the last expert is empty), random weights and probabilities. */
static void random_routing_n(const fixture *f, int32_t *topi, float *topw, float *probs, uint64_t seed, int used) {
    uint64_t s = seed * 2654435761u + 7;
    for (int64_t t = 0; t < f->N; t++)
        for (int j = 0; j < f->K; j++) {
            int e, dup;
            do {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                e = (int)((s >> 33) % (uint64_t)used);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= topi[t * f->K + i] == e;
            } while (dup);
            topi[t * f->K + j] = e;
        }
    tu_fill(topw, f->N * f->K, seed + 1, 1.0f);
    tu_fill(probs, f->N * f->E, seed + 2, 0.5f);
    for (int64_t i = 0; i < f->N * f->E; i++) probs[i] += 0.5f;
}
static void random_routing(const fixture *f, int32_t *topi, float *topw, float *probs, uint64_t seed) {
    random_routing_n(f, topi, topw, probs, seed, f->E - 1);
}

typedef struct {
    float *out, *dtopw, *dx, *g1, *g3, *g2, *ye;
} chain_result;

/* permute -> experts -> combine, then combine -> experts -> permute backward. */
static int64_t run_chain(fixture *f, const float *x, const float *res, const int32_t *topi, const float *topw,
                      const float *probs, const float *dy, chain_result *o) {
    const int64_t N = f->N, D = f->D, E = f->E, F = f->F;
    memset(f->g1, 0, sizeof(float) * (size_t)(E * F * D));
    memset(f->g3, 0, sizeof(float) * (size_t)(E * F * D));
    memset(f->g2, 0, sizeof(float) * (size_t)(E * D * F));
    const int64_t dropped = tera_dispatch_permute(f->d, &f->t, x, topi, probs, 0);
    tera_dispatch_experts_forward(f->d, &f->t, &f->W, 0);
    memcpy(o->out, res, sizeof(float) * (size_t)(N * D));
    tera_dispatch_combine_forward(f->d, o->out, &f->t, topw);
    memcpy(o->ye, f->t.ye, sizeof(float) * (size_t)(f->t.exp_off[E] * D));
    tera_dispatch_combine_backward(f->d, o->dtopw, dy, &f->t, topw);
    tera_dispatch_experts_backward(f->d, &f->t, &f->W, &f->G, 0, f->da1, f->da3, f->dg, 1.0f, NULL);
    memset(o->dx, 0, sizeof(float) * (size_t)(N * D));
    tera_dispatch_permute_backward(f->d, o->dx, &f->t);
    memcpy(o->g1, f->g1, sizeof(float) * (size_t)(E * F * D));
    memcpy(o->g3, f->g3, sizeof(float) * (size_t)(E * F * D));
    memcpy(o->g2, f->g2, sizeof(float) * (size_t)(E * D * F));
    return dropped;
}

static void chain_alloc(const fixture *f, chain_result *o) {
    o->out = fnew(f->N * f->D), o->dtopw = fnew(f->N * f->K), o->dx = fnew(f->N * f->D);
    o->g1 = fnew(f->E * f->F * f->D), o->g3 = fnew(f->E * f->F * f->D), o->g2 = fnew(f->E * f->D * f->F);
    o->ye = fnew(f->N * f->K * f->D);
}
static void chain_free(chain_result *o) {
    free(o->out), free(o->dtopw), free(o->dx), free(o->g1), free(o->g3), free(o->g2), free(o->ye);
}

/* The whole chain against a naive double reference: out = res + sum_j w_j E_j(x_t); dtopw =
 * <dy_t, E_j(x_t)>; dx, dW1, dW3, dW2 by the SwiGLU chain rule over the kept assignments. Then
 * the same bits on 1, 2 and 4 threads (E = 8: side by side on 2 and 4 threads, one after another
 * on 1). */
static void check_chain(int B, int T, int E, int K, int64_t D, int64_t F, float cf, int all_experts) {
    fixture f;
    fixture_init(&f, B, T, E, K, D, F, cf, TERA_DROP_PROBABILITY);
    const int64_t N = f.N;
    float *x = fnew(N * D), *res = fnew(N * D), *topw = fnew(N * K), *probs = fnew(N * E), *dy = fnew(N * D);
    int32_t *topi = malloc(sizeof(int32_t) * (size_t)(N * K));
    tu_fill(x, N * D, 11, 1.0f), tu_fill(res, N * D, 12, 1.0f), tu_fill(dy, N * D, 13, 1.0f);
    random_routing_n(&f, topi, topw, probs, 14, all_experts ? E : E - 1);
    chain_result first, o;
    chain_alloc(&f, &first), chain_alloc(&f, &o);
    const int threads[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        tera_set_threads(threads[i]);
        const int64_t dropped = run_chain(&f, x, res, topi, topw, probs, dy, i == 0 ? &first : &o);
        assert_int_equal(dropped + f.t.exp_off[E], N * K);
        if (cf > 0.0f) assert_true(dropped > 0); /* the capacity case drops some */
        if (i == 0) continue;
        const int64_t R = f.t.exp_off[E];
        assert_same("out across thread counts", o.out, first.out, N * D);
        assert_same("ye across thread counts", o.ye, first.ye, R * D);
        assert_same("dtopw across thread counts", o.dtopw, first.dtopw, N * K);
        assert_same("dx across thread counts", o.dx, first.dx, N * D);
        assert_same("dw1 across thread counts", o.g1, first.g1, E * F * D);
        assert_same("dw3 across thread counts", o.g3, first.g3, E * F * D);
        assert_same("dw2 across thread counts", o.g2, first.g2, E * D * F);
    }
    tera_set_threads(2);
    /* the reference */
    double *rout = malloc(sizeof(double) * (size_t)(N * D)), *rdx = calloc((size_t)(N * D), sizeof(double));
    double *rdw = malloc(sizeof(double) * (size_t)(N * K)), *rg1 = calloc((size_t)(E * F * D), sizeof(double));
    double *rg3 = calloc((size_t)(E * F * D), sizeof(double)), *rg2 = calloc((size_t)(E * D * F), sizeof(double));
    double *y = malloc(sizeof(double) * (size_t)D), *a1 = malloc(sizeof(double) * (size_t)F),
           *a3 = malloc(sizeof(double) * (size_t)F), *dgd = malloc(sizeof(double) * (size_t)F);
    int64_t kept = 0;
    for (int64_t t = 0; t < N; t++) {
        for (int64_t dd = 0; dd < D; dd++) rout[t * D + dd] = res[t * D + dd];
        for (int j = 0; j < K; j++) {
            const int64_t a = t * K + j;
            rdw[a] = 0.0;
            if (f.t.slot_row[a] < 0) continue; /* dropped by the plan (checked by the plan tests) */
            kept++;
            const int e = topi[a];
            const double w = topw[a];
            ref_expert(&f, e, x + t * D, y, a1, a3);
            for (int64_t dd = 0; dd < D; dd++) rout[t * D + dd] += w * y[dd], rdw[a] += (double)dy[t * D + dd] * y[dd];
            const float *w1 = f.w1 + e * F * D, *w3 = f.w3 + e * F * D, *w2 = f.w2 + e * D * F;
            for (int64_t i = 0; i < F; i++) {
                double sdg = 0;
                for (int64_t dd = 0; dd < D; dd++) sdg += (double)w2[dd * F + i] * w * dy[t * D + dd];
                dgd[i] = sdg;
                const double sg = 1.0 / (1.0 + exp(-a1[i])), silu = a1[i] * sg, g = silu * a3[i];
                for (int64_t dd = 0; dd < D; dd++) rg2[e * D * F + dd * F + i] += w * dy[t * D + dd] * g;
                const double da1 = sdg * a3[i] * sg * (1.0 + a1[i] * (1.0 - sg)), da3 = sdg * silu;
                for (int64_t dd = 0; dd < D; dd++) {
                    rdx[t * D + dd] += (double)w1[i * D + dd] * da1 + (double)w3[i * D + dd] * da3;
                    rg1[e * F * D + i * D + dd] += da1 * x[t * D + dd];
                    rg3[e * F * D + i * D + dd] += da3 * x[t * D + dd];
                }
            }
        }
    }
    assert_int_equal(kept, f.t.exp_off[E]);
    if (!all_experts) assert_int_equal(f.t.exp_off[E - 1], f.t.exp_off[E]); /* the last expert is empty */
    for (int e = 0; all_experts && e < E; e++) assert_true(f.t.exp_off[e + 1] > f.t.exp_off[e]);
    /* the drops: with capacity ceil(cf T k / E), each sequence keeps min(selected, capacity) rows of
     * each expert, its highest-probability assignments (the probability policy) */
    const int cap = cf > 0.0f ? (int)ceil((double)cf * T * K / E) : 0;
    for (int b = 0; b < B; b++)
        for (int e = 0; e < E; e++) {
            int sel = 0, kp = 0;
            float min_kept = INFINITY, max_dropped = -INFINITY;
            for (int64_t a = (int64_t)b * T * K; a < (int64_t)(b + 1) * T * K; a++) {
                if (topi[a] != e) continue;
                sel++;
                const float pr = probs[(a / K) * E + e];
                if (f.t.slot_row[a] >= 0) kp++, min_kept = fminf(min_kept, pr);
                else max_dropped = fmaxf(max_dropped, pr);
            }
            assert_int_equal(f.t.sel_count[b * E + e], sel);
            if (kp != (cap > 0 && sel > cap ? cap : sel)) fail_msg("sequence %d expert %d: %d of %d kept, capacity %d", b, e, kp, sel, cap);
            if (!(min_kept >= max_dropped)) fail_msg("sequence %d expert %d: dropped probability %g > kept %g", b, e, max_dropped, min_kept);
        }
    assert_close_d("out", first.out, rout, N * D, 1e-4, 1e-5);
    assert_close_d("dtopw", first.dtopw, rdw, N * K, 1e-4, 1e-5);
    assert_close_d("dx", first.dx, rdx, N * D, 1e-4, 1e-5);
    assert_close_d("dw1", first.g1, rg1, E * F * D, 1e-4, 1e-5);
    assert_close_d("dw3", first.g3, rg3, E * F * D, 1e-4, 1e-5);
    assert_close_d("dw2", first.g2, rg2, E * D * F, 1e-4, 1e-5);
    free(rout), free(rdx), free(rdw), free(rg1), free(rg3), free(rg2), free(y), free(a1), free(a3), free(dgd);
    chain_free(&first), chain_free(&o);
    free(x), free(res), free(topw), free(probs), free(dy), free(topi);
    fixture_free(&f);
}

static void test_chain_dropless_k2(void **state) {
    (void)state;
    check_chain(2, 16, 8, 2, 12, 6, 0.0f, 0);
}
static void test_chain_all_experts_k2(void **state) {
    (void)state;
    check_chain(2, 16, 8, 2, 12, 6, 0.0f, 1); /* no empty expert: every item of the side-by-side run counts */
}
static void test_chain_capacity_k2(void **state) {
    (void)state;
    check_chain(2, 16, 8, 2, 12, 6, 0.7f, 0); /* capacity ceil(2.8) = 3 of ~4.6 per sequence and expert */
}
static void test_chain_k1(void **state) {
    (void)state;
    check_chain(3, 8, 8, 1, 7, 5, 0.0f, 0);
}
static void test_chain_k8(void **state) {
    (void)state;
    check_chain(1, 12, 9, 8, 6, 4, 0.0f, 0); /* k = 8 of the first 8 experts: every one of them */
}

/* Selective recomputation of the hidden activations: the same bits as the forward's. */
static void test_recompute_hidden(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 2, 8, 8, 2, 8, 4, 0.0f, TERA_DROP_POSITION);
    const int64_t N = f.N, R = f.R, F = f.F;
    float *x = fnew(N * f.D), *topw = fnew(N * 2), *probs = fnew(N * 8);
    int32_t *topi = malloc(sizeof(int32_t) * (size_t)(N * 2));
    tu_fill(x, N * f.D, 21, 1.0f);
    random_routing(&f, topi, topw, probs, 22);
    tera_dispatch_permute(f.d, &f.t, x, topi, probs, 0);
    tera_dispatch_experts_forward(f.d, &f.t, &f.W, 0);
    const int64_t n = (int64_t)f.t.exp_off[8] * F;
    float *a1 = fnew(n), *a3 = fnew(n), *g = fnew(n);
    memcpy(a1, f.t.a1, sizeof(float) * (size_t)n), memcpy(a3, f.t.a3, sizeof(float) * (size_t)n);
    memcpy(g, f.t.gact, sizeof(float) * (size_t)n);
    memset(f.t.a1, 0, sizeof(float) * (size_t)(R * F)), memset(f.t.a3, 0, sizeof(float) * (size_t)(R * F));
    memset(f.t.gact, 0, sizeof(float) * (size_t)(R * F));
    tera_set_threads(1); /* another thread layout: one after another */
    tera_dispatch_experts_recompute(f.d, &f.t, &f.W);
    tera_set_threads(2);
    assert_same("recomputed a1", f.t.a1, a1, n);
    assert_same("recomputed a3", f.t.a3, a3, n);
    assert_same("recomputed silu(a1)*a3", f.t.gact, g, n);
    free(a1), free(a3), free(g), free(x), free(topw), free(probs), free(topi);
    fixture_free(&f);
}

/* ------------------------------------------------------------------------------ tensor parallel */

static int32_t *targets_new(int64_t N, int64_t V, uint64_t seed) {
    int32_t *tg = malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)((n * 7919 + seed * 31) % (uint64_t)V);
    return tg;
}

static void test_tp1_is_plain(void **state) {
    (void)state;
    const int64_t N = 13, V = 40, D = 6, in = 10, out = 7;
    tera_tp tp;
    tera_tp_init(&tp, BE, 1, NULL, 0, V, N, D, 0);
    assert_int_equal(tp.tp, 1);
    assert_null(tp.group);
    assert_int_equal(tp.v0, 0);
    assert_int_equal(tp.Vl, V);
    assert_int_equal(tp.bytes, 0);
    /* cross-entropy */
    float *logits = fnew(N * V), *lse = fnew(N), *lse_ref = fnew(N), *dl = fnew(N * V), *dl_ref = fnew(N * V);
    int32_t *tg = targets_new(N, V, 3);
    tu_fill(logits, N * V, 31, 4.0f);
    const double s = tera_tp_ce_forward(&tp, lse, logits, tg, N), s_ref = tera_ce_forward(lse_ref, logits, tg, N, V);
    assert_true(s == s_ref);
    assert_same("tp1 ce lse", lse, lse_ref, N);
    tera_tp_ce_backward(&tp, dl, logits, tg, N, 0.125f);
    tera_ce_backward(dl_ref, logits, tg, N, V, 0.125f);
    assert_same("tp1 ce backward", dl, dl_ref, N * V);
    /* embedding */
    float *table = fnew(V * D), *x = fnew(N * D), *xr = fnew(N * D), *dt = fzero(V * D), *dtr = fzero(V * D);
    tu_fill(table, V * D, 32, 1.0f);
    tera_tp_embedding_forward(&tp, x, table, tg, N, D);
    tera_embedding_forward(xr, table, tg, N, D);
    assert_same("tp1 embedding forward", x, xr, N * D);
    tu_fill(x, N * D, 33, 1.0f);
    tera_tp_embedding_backward(&tp, dt, x, tg, N, D);
    tera_embedding_backward(dtr, x, tg, N, D);
    assert_same("tp1 embedding backward", dt, dtr, V * D);
    /* the all-reduces are the identity */
    float *buf = fnew(50), *buf0 = fnew(50);
    tu_fill(buf0, 50, 34, 1.0f);
    memcpy(buf, buf0, 200);
    tera_tp_reduce_forward(&tp, buf, 50);
    assert_same("tp1 reduce forward", buf, buf0, 50);
    tera_tp_copy_backward(&tp, buf, 50);
    assert_same("tp1 copy backward", buf, buf0, 50);
    /* row-parallel linear with the residual: res + x w^T */
    float *xi = fnew(N * in), *w = fnew(out * in), *res = fnew(N * out), *y = fnew(N * out), *yr = fnew(N * out);
    tu_fill(xi, N * in, 35, 1.0f), tu_fill(w, out * in, 36, 1.0f), tu_fill(res, N * out, 37, 1.0f);
    tera_tp_row_linear_residual_forward(&tp, y, xi, w, res, N, in, out);
    double *yd = malloc(sizeof(double) * (size_t)(N * out));
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < out; o++) {
            double acc = res[n * out + o];
            for (int64_t i = 0; i < in; i++) acc += (double)xi[n * in + i] * w[o * in + i];
            yd[n * out + o] = acc;
        }
    assert_close_d("tp1 row linear + residual", y, yd, N * out, 1e-5, 1e-5);
    memcpy(yr, res, sizeof(float) * (size_t)(N * out));
    BE->ops.linear_forward(BE, yr, xi, w, N, in, out, 1.0f);
    assert_same("tp1 row linear + residual vs the plain product onto the residual", y, yr, N * out);
    /* a row-parallel block: begin starts at the residual, end does nothing */
    tera_tp_row_block_begin(&tp, y, res, N * out);
    assert_same("tp1 block begin", y, res, N * out);
    tu_fill(y, N * out, 38, 1.0f);
    memcpy(yr, y, sizeof(float) * (size_t)(N * out));
    tera_tp_row_block_end(&tp, y, y, res, N, out);
    assert_same("tp1 block end", y, yr, N * out);
    tera_tp_free(&tp);
    free(logits), free(lse), free(lse_ref), free(dl), free(dl_ref), free(tg), free(table), free(x), free(xr), free(dt),
        free(dtr), free(buf), free(buf0), free(xi), free(w), free(res), free(y), free(yr), free(yd);
}

/* The vocabulary split over P slices in one process, the sums over ranks done here by hand. */
static void test_vocab_slices(void **state) {
    (void)state;
    const int64_t N = 11, V = 48, D = 5;
    float *logits = fnew(N * V), *lse_ref = fnew(N), *dl_ref = fnew(N * V);
    int32_t *tg = targets_new(N, V, 5);
    /* targets on the slices' first and last rows (slices of 24 and 12) */
    tg[0] = 0, tg[1] = 12, tg[2] = 24, tg[3] = 36, tg[4] = 47, tg[5] = 23, tg[6] = 11;
    tu_fill(logits, N * V, 41, 6.0f);
    logits[3 * V + 47] = 30.0f; /* a row whose max is in the last slice */
    const double s_ref = tera_ce_forward(lse_ref, logits, tg, N, V);
    tera_ce_backward(dl_ref, logits, tg, N, V, 0.5f);
    float *table = fnew(V * D), *x_ref = fnew(N * D), *dx = fnew(N * D), *dt_ref = fzero(V * D);
    tu_fill(table, V * D, 42, 1.0f), tu_fill(dx, N * D, 43, 1.0f);
    tera_embedding_forward(x_ref, table, tg, N, D);
    tera_embedding_backward(dt_ref, dx, tg, N, D);
    for (int P = 2; P <= 4; P += 2) {
        const int64_t Vl = V / P;
        /* each "rank" sees its slice, contiguous: [N, Vl] */
        float *sl = fnew(N * Vl), *mx = fnew(N), *mxs = fnew(N), *se = fzero(N), *tl = fzero(N), *ses = fnew(N),
              *tls = fnew(N), *dl = fnew(N * Vl), *x = fzero(N * D), *xs = fnew(N * D), *dt = fnew(Vl * D);
        float *es = fnew(N * V), *ses2 = fnew(N), *tls2 = fnew(N); /* each slice's exponentials, [P][N, Vl] */
        for (int64_t n = 0; n < N; n++) mx[n] = -INFINITY;
        for (int p = 0; p < P; p++) { /* the max over ranks */
            tera_tp tp;
            tera_tp_init(&tp, BE, P, tera_comm_world(), p, V, N, D, 0);
            assert_int_equal(tp.tp, P);
            assert_int_equal(tp.Vl, Vl);
            assert_int_equal(tp.v0, p * Vl);
            assert_true(tp.bytes >= (int64_t)(3 * N * sizeof(float)));
            tera_tp_free(&tp);
            for (int64_t n = 0; n < N; n++) memcpy(sl + n * Vl, logits + n * V + p * Vl, sizeof(float) * (size_t)Vl);
            tera_ce_slice_max(mxs, sl, N, Vl);
            for (int64_t n = 0; n < N; n++) {
                float m = -INFINITY;
                for (int64_t v = 0; v < Vl; v++) m = fmaxf(m, sl[n * Vl + v]);
                assert_true(mxs[n] == m);
                mx[n] = fmaxf(mx[n], mxs[n]);
            }
        }
        int hits = 0;
        for (int p = 0; p < P; p++) { /* the sums over ranks */
            for (int64_t n = 0; n < N; n++) memcpy(sl + n * Vl, logits + n * V + p * Vl, sizeof(float) * (size_t)Vl);
            tera_ce_slice_sums(ses, tls, NULL, sl, mx, tg, N, Vl, p * Vl);
            /* with the exponentials written: the same sums, e = exp(x - max) */
            float *e = es + p * N * Vl;
            tera_ce_slice_sums(ses2, tls2, e, sl, mx, tg, N, Vl, p * Vl);
            assert_same("slice sums with e written", ses2, ses, N);
            assert_same("slice target logits with e written", tls2, tls, N);
            for (int64_t n = 0; n < N; n++) {
                float s2 = 0.0f; /* e's sum: 16 lanes */
                float acc[16] = {0};
                for (int64_t v = 0; v < Vl; v++) acc[v % 16] += e[n * Vl + v];
                for (int l = 0; l < 16; l++) s2 += acc[l];
                if (s2 != ses[n]) fail_msg("P %d slice %d row %ld: e sums to %.9g, sumexp %.9g", P, p, (long)n, s2, ses[n]);
                for (int64_t v = 0; v < Vl; v++) { /* exp of the float difference, within 2 ulps */
                    const double want = exp((double)(sl[n * Vl + v] - mx[n]));
                    if (!(fabs(e[n * Vl + v] - want) <= 2.4e-7 * want))
                        fail_msg("P %d slice %d: e[%ld][%ld] = %.9g, want %.12g", P, p, (long)n, (long)v, e[n * Vl + v], want);
                }
            }
            for (int64_t n = 0; n < N; n++) {
                const int in = tg[n] >= p * Vl && tg[n] < (p + 1) * Vl;
                hits += in;
                if (!in && tls[n] != 0.0f) fail_msg("P %d slice %d row %ld: target logit %g of another slice", P, p, (long)n, tls[n]);
                if (in && tls[n] != logits[n * V + tg[n]]) fail_msg("P %d slice %d row %ld: target logit %g, want %g", P, p, (long)n, tls[n], logits[n * V + tg[n]]);
                se[n] += ses[n], tl[n] += tls[n];
            }
        }
        assert_int_equal(hits, N); /* every target in exactly one slice */
        float *lse = fnew(N);
        double s = 0.0;
        for (int64_t n = 0; n < N; n++) {
            lse[n] = mx[n] + logf(se[n]);
            s += (double)lse[n] - (double)tl[n];
        }
        if (!(tu_close("slices: lse", lse, lse_ref, N, 1e-6, 1e-6) <= 1.0)) fail_msg("P %d: lse", P);
        if (!(fabs(s - s_ref) <= 1e-5 * fabs(s_ref))) fail_msg("P %d: loss %.9g, whole vocabulary %.9g", P, s, s_ref);
        for (int p = 0; p < P; p++) { /* backward per slice: its exponentials over the whole sum */
            const float *e = es + p * N * Vl;
            tera_ce_backward_range(dl, e, se, tg, N, Vl, p * Vl, 0.5f);
            for (int64_t n = 0; n < N; n++)
                for (int64_t v = 0; v < Vl; v++) { /* the whole's sum in another order: a few ulps */
                    const float want = dl_ref[n * V + p * Vl + v];
                    if (!(fabsf(dl[n * Vl + v] - want) <= 1e-6f * fabsf(want) + 1e-12f))
                        fail_msg("P %d slice %d: dlogits[%ld][%ld] = %.9g, whole %.9g", P, p, (long)n, (long)v,
                                 dl[n * Vl + v], want);
                }
            /* in place (e written over the logits, then dlogits over e) gives the same */
            for (int64_t n = 0; n < N; n++) memcpy(sl + n * Vl, logits + n * V + p * Vl, sizeof(float) * (size_t)Vl);
            tera_ce_slice_sums(ses2, tls2, sl, sl, mx, tg, N, Vl, p * Vl);
            assert_same("slice exponentials in place", sl, e, N * Vl);
            for (int64_t n = 0; n < N; n++) { /* read before the exponentials overwrote it */
                const int in = tg[n] >= p * Vl && tg[n] < (p + 1) * Vl;
                if (tls2[n] != (in ? logits[n * V + tg[n]] : 0.0f)) fail_msg("P %d slice %d: in-place target logit of row %ld", P, p, (long)n);
            }
            tera_ce_backward_range(sl, sl, se, tg, N, Vl, p * Vl, 0.5f);
            assert_same("slice backward in place", sl, dl, N * Vl);
        }
        free(es), free(ses2), free(tls2);
        for (int p = 0; p < P; p++) { /* embedding: the slices' partial rows sum to the lookup */
            tera_embedding_forward_range(xs, table + p * Vl * D, tg, N, D, p * Vl, Vl);
            for (int64_t i = 0; i < N * D; i++) x[i] += xs[i];
            memset(dt, 0, sizeof(float) * (size_t)(Vl * D));
            tera_embedding_backward_range(dt, dx, tg, N, D, p * Vl, Vl);
            assert_same("embedding backward of a slice = the whole's rows", dt, dt_ref + p * Vl * D, Vl * D);
        }
        assert_same("embedding: slices summed", x, x_ref, N * D);
        free(sl), free(mx), free(mxs), free(se), free(tl), free(ses), free(tls), free(dl), free(x), free(xs), free(dt),
            free(lse);
    }
    free(logits), free(lse_ref), free(dl_ref), free(tg), free(table), free(x_ref), free(dx), free(dt_ref);
}

/* The tp > 1 code paths of the layers, one simulated rank at a time: each rank's object is set up for
 * P ranks over a one-rank group (tera_comm_world() outside mpirun), whose all-reduces are the
 * identity, so each call returns that rank's partial answer; the test combines the ranks' partials
 * by hand and compares with the whole-vocabulary (tp = 1) answer. */
static void test_tp_ranks_by_hand(void **state) {
    (void)state;
    const int64_t N = 9, V = 40, D = 4, in = 12, out = 5;
    float *logits = fnew(N * V), *lse_ref = fnew(N), *dl_ref = fnew(N * V);
    int32_t *tg = targets_new(N, V, 7);
    tg[0] = 0, tg[1] = 10, tg[2] = 20, tg[3] = 39, tg[4] = 19; /* the slices' first and last rows */
    tu_fill(logits, N * V, 51, 5.0f);
    const double s_ref = tera_ce_forward(lse_ref, logits, tg, N, V);
    tera_ce_backward(dl_ref, logits, tg, N, V, 0.25f);
    float *table = fnew(V * D), *x_ref = fnew(N * D), *dx = fnew(N * D), *dt_ref = fzero(V * D);
    tu_fill(table, V * D, 52, 1.0f), tu_fill(dx, N * D, 53, 1.0f);
    tera_embedding_forward(x_ref, table, tg, N, D);
    tera_embedding_backward(dt_ref, dx, tg, N, D);
    float *xi = fnew(N * in), *w = fnew(out * in), *res = fnew(N * out), *y = fnew(N * out), *ysum = fnew(N * out);
    tu_fill(xi, N * in, 54, 1.0f), tu_fill(w, out * in, 55, 1.0f), tu_fill(res, N * out, 56, 1.0f);
    for (int P = 2; P <= 4; P += 2) {
        const int64_t Vl = V / P, inl = in / P;
        float *sl = fnew(N * Vl), *lse = fnew(N * P), *dl = fnew(N * Vl), *xs = fnew(N * D), *xsum = fzero(N * D),
              *dt = fzero(Vl * D), *xp = fnew(N * inl), *wp = fnew(out * inl);
        memset(ysum, 0, sizeof(float) * (size_t)(N * out));
        for (int p = 0; p < P; p++) {
            tera_tp tp;
            tera_tp_init(&tp, BE, P, tera_comm_world(), p, V, N, D, 0);
            for (int64_t n = 0; n < N; n++) memcpy(sl + n * Vl, logits + n * V + p * Vl, sizeof(float) * (size_t)Vl);
            /* cross-entropy: this rank's lse is that of its slice (the sums over one rank) */
            const double sp = tera_tp_ce_forward(&tp, lse + p * N, sl, tg, N);
            double want_sp = 0.0;
            for (int64_t n = 0; n < N; n++) {
                double m = -INFINITY, se = 0.0;
                for (int64_t v = 0; v < Vl; v++) m = fmax(m, sl[n * Vl + v]);
                for (int64_t v = 0; v < Vl; v++) se += exp(sl[n * Vl + v] - m);
                const double l = m + log(se);
                if (!(fabs(lse[p * N + n] - l) <= 1e-5 * (1.0 + fabs(l))))
                    fail_msg("P %d rank %d row %ld: lse %.8g, the slice's %.8g", P, p, (long)n, lse[p * N + n], l);
                const int inside = tg[n] >= p * Vl && tg[n] < (p + 1) * Vl;
                want_sp += (double)lse[p * N + n] - (inside ? (double)logits[n * V + tg[n]] : 0.0);
            }
            if (!(fabs(sp - want_sp) <= 1e-9 * (1.0 + fabs(want_sp)))) fail_msg("P %d rank %d: loss sum %.12g, want %.12g", P, p, sp, want_sp);
            /* backward: the max and sums over the ranks computed again (here over this rank alone), so
             * the softmax of the slice */
            tera_tp_ce_backward(&tp, dl, sl, tg, N, 0.25f);
            for (int64_t n = 0; n < N; n++) {
                double m = -INFINITY, se = 0.0;
                for (int64_t v = 0; v < Vl; v++) m = fmax(m, sl[n * Vl + v]);
                for (int64_t v = 0; v < Vl; v++) se += exp(sl[n * Vl + v] - m);
                for (int64_t v = 0; v < Vl; v++) {
                    const double want = 0.25 * (exp(sl[n * Vl + v] - m) / se - (tg[n] == p * Vl + v ? 1.0 : 0.0));
                    if (!(fabs(dl[n * Vl + v] - want) <= 2e-6 * (0.25 * exp(sl[n * Vl + v] - m) / se) + 6e-8 * fabs(want)))
                        fail_msg("P %d rank %d: dlogits[%ld][%ld] = %.9g, the slice's %.12g", P, p, (long)n, (long)v,
                                 dl[n * Vl + v], want);
                }
            }
            /* armed (the gradient written in the forward's pass, in place): the forward's lse and loss
             * and the backward's dlogits, bit for bit */
            float *sl2 = fnew(N * Vl), *lse2 = fnew(N), *tl2 = fnew(N);
            memcpy(sl2, sl, sizeof(float) * (size_t)(N * Vl));
            double sp2 = 0.0;
            assert_int_equal(tera_tp_ce_fused(&tp, sl2, lse2, tl2, sl2, tg, N, 0.25f, &sp2), 1);
            assert_true(sp2 == sp);
            assert_same("tp ce fused lse", lse2, lse + p * N, N);
            assert_same("tp ce fused dlogits = forward then backward", sl2, dl, N * Vl);
            free(sl2), free(lse2), free(tl2);
            /* embedding: partial rows (zero outside the slice), summed by hand */
            tera_tp_embedding_forward(&tp, xs, table + p * Vl * D, tg, N, D);
            for (int64_t i = 0; i < N * D; i++) xsum[i] += xs[i];
            memset(dt, 0, sizeof(float) * (size_t)(Vl * D));
            tera_tp_embedding_backward(&tp, dt, dx, tg, N, D);
            assert_same("tp embedding backward: the slice's rows of the whole", dt, dt_ref + p * Vl * D, Vl * D);
            /* row-parallel linear: this rank's input columns; y_p = res + x_p w_p^T */
            for (int64_t n = 0; n < N; n++) memcpy(xp + n * inl, xi + n * in + p * inl, sizeof(float) * (size_t)inl);
            for (int64_t o = 0; o < out; o++) memcpy(wp + o * inl, w + o * in + p * inl, sizeof(float) * (size_t)inl);
            tera_tp_row_linear_residual_forward(&tp, y, xp, wp, res, N, inl, out);
            for (int64_t i = 0; i < N * out; i++) ysum[i] += y[i] - res[i];
            /* a row-parallel block starts at 0, end adds the residual once */
            tu_fill(y, N * out, 57, 1.0f);
            tera_tp_row_block_begin(&tp, y, res, N * out);
            for (int64_t i = 0; i < N * out; i++) assert_true(y[i] == 0.0f);
            tu_fill(y, N * out, 58, 1.0f);
            float *y0 = fnew(N * out);
            memcpy(y0, y, sizeof(float) * (size_t)(N * out));
            tera_tp_row_block_end(&tp, y, y, res, N, out);
            for (int64_t i = 0; i < N * out; i++) assert_true(y[i] == y0[i] + res[i]);
            free(y0);
            tera_tp_free(&tp);
        }
        /* the whole lse from the ranks' lse: log sum_p exp(lse_p), and the loss from it */
        double tl_total = 0.0;
        for (int64_t n = 0; n < N; n++) {
            double m = -INFINITY, se = 0.0;
            for (int p = 0; p < P; p++) m = fmax(m, lse[p * N + n]);
            for (int p = 0; p < P; p++) se += exp(lse[p * N + n] - m);
            const double l = m + log(se);
            if (!(fabs(l - lse_ref[n]) <= 1e-5 * (1.0 + fabs(l)))) fail_msg("P %d row %ld: combined lse %.8g, whole %.8g", P, (long)n, l, lse_ref[n]);
            tl_total += (double)lse_ref[n] - (double)logits[n * V + tg[n]];
        }
        if (!(fabs(tl_total - s_ref) <= 1e-5 * fabs(s_ref))) fail_msg("P %d: loss %.9g vs %.9g", P, tl_total, s_ref);
        assert_same("tp embedding: ranks' partial rows summed", xsum, x_ref, N * D);
        double *yd = malloc(sizeof(double) * (size_t)(N * out));
        for (int64_t n = 0; n < N; n++)
            for (int64_t o = 0; o < out; o++) {
                double acc = 0.0;
                for (int64_t i = 0; i < in; i++) acc += (double)xi[n * in + i] * w[o * in + i];
                yd[n * out + o] = acc;
            }
        assert_close_d("tp row linear: ranks' partial products summed", ysum, yd, N * out, 1e-5, 1e-5);
        free(yd);
        free(sl), free(lse), free(dl), free(xs), free(xsum), free(dt), free(xp), free(wp);
    }
    free(logits), free(lse_ref), free(dl_ref), free(tg), free(table), free(x_ref), free(dx), free(dt_ref), free(xi),
        free(w), free(res), free(y), free(ysum);
}

/* A backward that stores (dw_beta 0) over stale gradients (NaN here): the experts no row reached get
 * zeros in every element of their three gradients (dispatch.c's dw_fresh_end, which clears them in
 * blocks of 65536 floats shared out among the threads: D x F = 81920 is a whole and a part block),
 * and the others the same bits as a backward adding into zeros, on 1, 2 and 4 threads. */
static void test_empty_experts_zeroed(void **state) {
    (void)state;
    const int E = 6, K = 1;
    const int64_t D = 128, F = 640;
    fixture f;
    fixture_init(&f, 1, 16, E, K, D, F, 0.0f, TERA_DROP_PROBABILITY);
    const int64_t N = f.N, EFD = E * F * D;
    float *x = fnew(N * D), *res = fnew(N * D), *topw = fnew(N * K), *probs = fnew(N * E), *dy = fnew(N * D);
    float *out = fnew(N * D), *dtopw = fnew(N * K), *ref1 = fnew(EFD), *ref3 = fnew(EFD), *ref2 = fnew(EFD);
    int32_t *topi = malloc(sizeof(int32_t) * (size_t)(N * K));
    tu_fill(x, N * D, 21, 1.0f), tu_fill(res, N * D, 22, 1.0f), tu_fill(dy, N * D, 23, 1.0f);
    random_routing_n(&f, topi, topw, probs, 24, 2); /* experts 0 and 1 only */
    const int threads[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) {
        tera_set_threads(threads[i]);
        for (int stale = 0; stale < 2; stale++) {
            for (int64_t j = 0; j < EFD; j++) f.g1[j] = f.g3[j] = f.g2[j] = stale ? NAN : 0.0f;
            tera_dispatch_permute(f.d, &f.t, x, topi, probs, 0);
            tera_dispatch_experts_forward(f.d, &f.t, &f.W, 0);
            memcpy(out, res, sizeof(float) * (size_t)(N * D));
            tera_dispatch_combine_forward(f.d, out, &f.t, topw);
            tera_dispatch_combine_backward(f.d, dtopw, dy, &f.t, topw);
            tera_dispatch_experts_backward(f.d, &f.t, &f.W, &f.G, 0, f.da1, f.da3, f.dg, stale ? 0.0f : 1.0f, NULL);
            if (!stale) {
                memcpy(ref1, f.g1, sizeof(float) * (size_t)EFD), memcpy(ref3, f.g3, sizeof(float) * (size_t)EFD);
                memcpy(ref2, f.g2, sizeof(float) * (size_t)EFD);
                continue;
            }
            for (int e = 2; e < E; e++) /* no rows: zeros, also over the NaN */
                for (int64_t j = e * F * D; j < (e + 1) * F * D; j++)
                    if (f.g1[j] != 0.0f || f.g3[j] != 0.0f || f.g2[j] != 0.0f || signbit(f.g1[j]))
                        fail_msg("%d threads: expert %d without rows: gradient element %lld is %g / %g / %g", threads[i],
                                 e, (long long)(j - e * F * D), (double)f.g1[j], (double)f.g3[j], (double)f.g2[j]);
            assert_same("dw1 stored over stale values = added into zeros", f.g1, ref1, EFD);
            assert_same("dw3 stored over stale values = added into zeros", f.g3, ref3, EFD);
            assert_same("dw2 stored over stale values = added into zeros", f.g2, ref2, EFD);
        }
    }
    tera_set_threads(2);
    free(x), free(res), free(topw), free(probs), free(dy), free(out), free(dtopw), free(ref1), free(ref3), free(ref2);
    free(topi);
    fixture_free(&f);
}

/* Marks instead of zeros (tera_model_grads_sparse): two micro-batches, the first stores (dw_beta 0)
 * over NaN and reaches experts 0 and 1, the second adds (dw_beta 1) and reaches experts 1 and 2.
 * After the first, experts 2-5 are marked and their NaN untouched; the second stores expert 2 (its
 * mark cleared, its NaN never read) and adds into expert 1; 3-5 stay marked and untouched. Every
 * expert not marked holds the bits of the same two micro-batches added into zeros, on 1 and 2
 * threads; split into its two halves (_dx then _dw, parallel.tp_overlap) the same. */
static void test_empty_experts_marked(void **state) {
    (void)state;
    const int E = 6, K = 1;
    const int64_t D = 64, F = 96;
    fixture f;
    fixture_init(&f, 1, 16, E, K, D, F, 0.0f, TERA_DROP_PROBABILITY);
    const int64_t N = f.N, EFD = E * F * D, FD = F * D;
    float *x = fnew(N * D), *res = fnew(N * D), *topw = fnew(N * K), *probs = fnew(N * E), *dy = fnew(N * D);
    float *out = fnew(N * D), *dtopw = fnew(N * K), *ref[3] = {fnew(EFD), fnew(EFD), fnew(EFD)};
    int32_t *topi[2] = {malloc(sizeof(int32_t) * (size_t)(N * K)), malloc(sizeof(int32_t) * (size_t)(N * K))};
    tu_fill(x, N * D, 31, 1.0f), tu_fill(res, N * D, 32, 1.0f), tu_fill(dy, N * D, 33, 1.0f);
    random_routing_n(&f, topi[0], topw, probs, 34, 2); /* experts 0 and 1 */
    random_routing_n(&f, topi[1], topw, probs, 35, 2);
    for (int64_t i = 0; i < N * K; i++) topi[1][i] += 1; /* experts 1 and 2 */
    for (int th = 1; th <= 2; th++) {
        tera_set_threads(th);
        for (int mode = 0; mode < 3; mode++) { /* 0: zeros, beta 0 then 1 (the reference); 1: marks; 2: marks, split */
            uint8_t absent[6] = {0};
            for (int64_t j = 0; j < EFD; j++) f.g1[j] = f.g3[j] = f.g2[j] = mode ? NAN : 0.0f;
            for (int mb = 0; mb < 2; mb++) {
                const float beta = mode && mb == 0 ? 0.0f : 1.0f;
                tera_dispatch_permute(f.d, &f.t, x, topi[mb], probs, 0);
                tera_dispatch_experts_forward(f.d, &f.t, &f.W, 0);
                memcpy(out, res, sizeof(float) * (size_t)(N * D));
                tera_dispatch_combine_forward(f.d, out, &f.t, topw);
                tera_dispatch_combine_backward(f.d, dtopw, dy, &f.t, topw);
                if (mode == 2) {
                    tera_dispatch_experts_backward_dx(f.d, &f.t, &f.W, &f.G, 0, f.da1, f.da3, f.dg, NULL);
                    tera_dispatch_experts_backward_dw(f.d, &f.t, &f.W, &f.G, 0, f.da1, f.da3, f.dg, NULL, beta, absent);
                } else {
                    tera_dispatch_experts_backward(f.d, &f.t, &f.W, &f.G, 0, f.da1, f.da3, f.dg, beta,
                                                   mode ? absent : NULL);
                }
                if (mode && mb == 0)
                    for (int e = 0; e < E; e++)
                        if (absent[e] != (e >= 2)) fail_msg("after the first micro-batch: expert %d marked %d", e, absent[e]);
            }
            if (mode == 0) {
                memcpy(ref[0], f.g1, sizeof(float) * (size_t)EFD), memcpy(ref[1], f.g3, sizeof(float) * (size_t)EFD);
                memcpy(ref[2], f.g2, sizeof(float) * (size_t)EFD);
                continue;
            }
            for (int e = 0; e < E; e++) {
                if (absent[e] != (e >= 3)) fail_msg("mode %d: expert %d marked %d at the end", mode, e, absent[e]);
                const float *g[3] = {f.g1, f.g3, f.g2};
                for (int k = 0; k < 3; k++)
                    for (int64_t j = e * FD; j < (e + 1) * FD; j++) {
                        const int same = e >= 3 ? isnan(g[k][j]) : memcmp(&g[k][j], &ref[k][j], sizeof(float)) == 0;
                        if (!same)
                            fail_msg("%d threads, mode %d: expert %d tensor %d element %lld: %g, want %g", th, mode, e, k,
                                     (long long)(j - e * FD), (double)g[k][j], e >= 3 ? NAN : (double)ref[k][j]);
                    }
            }
            for (int e = 3; e < E; e++) /* the reference's experts without rows: zeros */
                for (int64_t j = e * FD; j < (e + 1) * FD; j++)
                    if (ref[0][j] != 0.0f || ref[1][j] != 0.0f || ref[2][j] != 0.0f) fail_msg("reference not zero");
        }
    }
    tera_set_threads(2);
    free(x), free(res), free(topw), free(probs), free(dy), free(out), free(dtopw), free(ref[0]), free(ref[1]), free(ref[2]);
    free(topi[0]), free(topi[1]);
    fixture_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_permute_hand_routing),
        cmocka_unit_test(test_permute_capacity_drops),
        cmocka_unit_test(test_chain_dropless_k2),
        cmocka_unit_test(test_chain_all_experts_k2),
        cmocka_unit_test(test_chain_capacity_k2),
        cmocka_unit_test(test_chain_k1),
        cmocka_unit_test(test_chain_k8),
        cmocka_unit_test(test_recompute_hidden),
        cmocka_unit_test(test_empty_experts_zeroed),
        cmocka_unit_test(test_empty_experts_marked),
        cmocka_unit_test(test_tp1_is_plain),
        cmocka_unit_test(test_vocab_slices),
        cmocka_unit_test(test_tp_ranks_by_hand),
    };
    BE = tera_backend_cpu_create(-1);
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(BE);
    return rc;
}
