/* Router top-k and the dispatch plan on hand-made routing: ties, bias, capacity, drop policies,
 * grouping by expert; group-limited routing, sigmoid scores and their backward, the routing keys. */
#include "testutil.h"
#include <omp.h>

#include "model/moe.h"

/* One CPU backend for the router functions of the tests (kept for the process). */
static tera_backend *cpu(void) {
    static tera_backend *b;
    if (!b) b = tera_backend_cpu_create(-1);
    return b;
}

static void test_topk(void **state) {
    (void)state;
    /* 3 tokens, 4 experts */
    float probs[12] = {0.1f, 0.4f, 0.4f, 0.1f,   /* tie between 1 and 2: lower index first */
                       0.7f, 0.1f, 0.1f, 0.1f,
                       0.25f, 0.25f, 0.25f, 0.25f};
    int32_t ti[6];
    float tw[6];
    tera_moe_topk(cpu(), ti, tw, probs, NULL, 3, 4, 2);
    assert_int_equal(ti[0], 1);
    assert_int_equal(ti[1], 2);
    assert_true(fabsf(tw[0] - 0.5f) < 1e-7f && fabsf(tw[1] - 0.5f) < 1e-7f);
    assert_int_equal(ti[2], 0);
    assert_int_equal(ti[3], 1); /* 0.1 ties: index 1 */
    assert_true(fabsf(tw[2] - 0.875f) < 1e-6f);
    assert_int_equal(ti[4], 0);
    assert_int_equal(ti[5], 1);
    /* a bias changes the selection but not the weights: weights are renormalised probs */
    float bias[4] = {0.0f, 0.0f, 0.0f, 1.0f};
    tera_moe_topk(cpu(), ti, tw, probs, bias, 3, 4, 2);
    assert_int_equal(ti[0], 3);
    assert_int_equal(ti[1], 1);
    assert_true(fabsf(tw[0] - 0.2f) < 1e-6f && fabsf(tw[1] - 0.8f) < 1e-6f);
}

static void test_plan_dropless(void **state) {
    (void)state;
    enum { B = 2, T = 3, E = 3, K = 2, A = B * T * K };
    int32_t topi[A] = {0, 1, 2, 0, 1, 2, /* seq 0 */ 2, 1, 2, 0, 1, 0 /* seq 1 */};
    float probs[B * T * E] = {0};
    int32_t slot[A], rtok[A], off[E + 1], sel[B * E];
    _Alignas(16) char scratch[1024];
    assert_true(tera_moe_plan_scratch_bytes(A, B, E) <= sizeof scratch);
    int64_t dropped = tera_moe_plan(cpu(), slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 0, TERA_DROP_POSITION);
    assert_int_equal(dropped, 0);
    /* expert counts 4, 4, 4; rows grouped by expert in assignment order */
    assert_int_equal(off[0], 0);
    assert_int_equal(off[1], 4);
    assert_int_equal(off[2], 8);
    assert_int_equal(off[3], 12);
    int32_t want_tok[12] = {0, 1, 4, 5, /* e0 */ 0, 2, 3, 5, /* e1 */ 1, 2, 3, 4 /* e2 */};
    assert_memory_equal(rtok, want_tok, sizeof want_tok);
    for (int a = 0; a < A; a++) {
        assert_true(slot[a] >= off[topi[a]] && slot[a] < off[topi[a] + 1]);
        assert_int_equal(rtok[slot[a]], a / K);
    }
    int32_t want_sel[6] = {2, 2, 2, 2, 2, 2};
    assert_memory_equal(sel, want_sel, sizeof want_sel);
}

static void test_plan_capacity(void **state) {
    (void)state;
    /* one sequence of 4 tokens, k=1, 2 experts, capacity 2; expert 0 gets tokens 0,1,2 */
    enum { B = 1, T = 4, E = 2, K = 1, A = 4 };
    int32_t topi[A] = {0, 0, 0, 1};
    float probs[T * E] = {0.6f, 0.4f, 0.9f, 0.1f, 0.7f, 0.3f, 0.2f, 0.8f};
    int32_t slot[A], rtok[A], off[E + 1], sel[B * E];
    _Alignas(16) char scratch[256];
    int64_t d = tera_moe_plan(cpu(), slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 2, TERA_DROP_POSITION);
    assert_int_equal(d, 1);
    assert_int_equal(slot[2], -1); /* position: the latest token is dropped */
    assert_int_equal(sel[0], 3);   /* selection counts are before drops (aux loss) */
    assert_int_equal(off[E], 3);
    d = tera_moe_plan(cpu(), slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 2, TERA_DROP_PROBABILITY);
    assert_int_equal(d, 1);
    assert_int_equal(slot[0], -1); /* probability: the lowest prob (0.6) is dropped */
    assert_true(slot[1] >= 0 && slot[2] >= 0 && slot[3] >= 0);
    /* capacity is per sequence: two sequences each within capacity drop nothing */
    int32_t topi2[8] = {0, 0, 1, 1, 0, 0, 1, 1};
    float probs2[16] = {0};
    int32_t slot2[8], rtok2[8], sel2[4];
    _Alignas(16) char scratch2[512];
    d = tera_moe_plan(cpu(), slot2, rtok2, off, sel2, scratch2, topi2, probs2, 2, 4, 2, 1, 2, TERA_DROP_POSITION);
    assert_int_equal(d, 0);
}

/* Thousands of experts: top-8 of 4096 against a brute-force reference (k rounds of arg-max over the
 * experts not yet taken, ties to the lower index), scores with many ties and a bias; and the plan
 * with capacity over 4096 experts. */
static void many_experts(int E) {
    enum { N = 16, K = 8 };
    float *probs = malloc(sizeof(float) * N * E), *bias = malloc(sizeof(float) * E);
    int32_t ti[N * K], want[N * K];
    float tw[N * K];
    char *taken = malloc(E);
    uint32_t x = 12345u;
    for (int i = 0; i < N * E; i++) { /* values on a coarse grid: many exact ties */
        x = x * 1664525u + 1013904223u;
        probs[i] = (float)(x >> 24) / 256.0f;
    }
    for (int e = 0; e < E; e++) bias[e] = (e % 7 == 0) ? 0.25f : 0.0f;
    for (int b = 0; b < 2; b++) {
        const float *bs = b ? bias : NULL;
        tera_moe_topk(cpu(), ti, tw, probs, bs, N, E, K);
        for (int n = 0; n < N; n++) {
            memset(taken, 0, E);
            float sum = 0.0f;
            for (int j = 0; j < K; j++) {
                int best = -1;
                for (int e = 0; e < E; e++) {
                    if (taken[e]) continue;
                    const float s = probs[n * E + e] + (bs ? bs[e] : 0.0f);
                    if (best < 0 || s > probs[n * E + best] + (bs ? bs[best] : 0.0f)) best = e;
                }
                taken[best] = 1;
                want[n * K + j] = best;
                sum += probs[n * E + best];
            }
            for (int j = 0; j < K; j++) {
                assert_int_equal(ti[n * K + j], want[n * K + j]);
                assert_true(tw[n * K + j] == probs[n * E + want[n * K + j]] / sum);
            }
        }
    }
    /* the plan: one sequence of N tokens, capacity 1 per expert: every repeat of an expert dropped */
    int32_t slot[N * K], rtok[N * K], *off = malloc(sizeof(int32_t) * (E + 1)), *sel = malloc(sizeof(int32_t) * E);
    void *scratch = malloc(tera_moe_plan_scratch_bytes(N * K, 1, E));
    int64_t repeats = 0;
    memset(taken, 0, E);
    for (int a = 0; a < N * K; a++) repeats += taken[ti[a]]++ > 0;
    const int64_t d = tera_moe_plan(cpu(), slot, rtok, off, sel, scratch, ti, probs, 1, N, E, K, 1, TERA_DROP_POSITION);
    assert_int_equal(d, repeats);
    assert_int_equal(off[E], N * K - repeats);
    for (int a = 0; a < N * K; a++)
        if (slot[a] >= 0) assert_true(slot[a] >= off[ti[a]] && slot[a] < off[ti[a] + 1]);
    free(scratch), free(off), free(sel), free(taken), free(probs), free(bias);
}

/* 4096 experts, and 1001 (the top-k's blocks of 32 experts with a partial last block) */
static void test_many_experts(void **state) {
    (void)state;
    many_experts(4096);
    many_experts(1001);
}

/* Brute force of group-limited routing: group scores by sorting each group, topk_groups rounds of
 * arg-max over groups (ties: lower index), then k rounds of arg-max over the allowed experts. */
static void route_brute(int32_t *want, const float *p, const float *bias, int E, int k, int G, int Gk, int sig) {
    const int gsz = E / G;
    float *gs = malloc(sizeof(float) * G);
    char *gtaken = calloc(G, 1), *taken = calloc(E, 1);
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * gsz; e < (g + 1) * gsz; e++) {
            const float u = p[e] + (bias ? bias[e] : 0.0f);
            if (u > b1) b2 = b1, b1 = u;
            else if (u > b2) b2 = u;
        }
        gs[g] = sig && gsz > 1 ? b1 + b2 : b1;
    }
    for (int r = 0; r < Gk; r++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!gtaken[g] && (best < 0 || gs[g] > gs[best])) best = g;
        gtaken[best] = 1;
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (taken[e] || !gtaken[e / gsz]) continue;
            const float u = p[e] + (bias ? bias[e] : 0.0f);
            if (best < 0 || u > p[best] + (bias ? bias[best] : 0.0f)) best = e;
        }
        taken[best] = 1;
        want[j] = best;
    }
    free(gs), free(gtaken), free(taken);
}

/* Group-limited top-k: a hand-made case per group rule, then 4096 experts in 64 groups (coarse
 * values: many ties, with and without a bias) against the brute force; the routed scale. */
static void test_group_limited(void **state) {
    (void)state;
    /* 8 experts in 4 groups of 2, 2 groups per token, top-2 (values exact in binary).
     *   group sums of two: g0 0.25, g1 0.875 + 0 = 0.875, g2 0.5 + 0.5 = 1, g3 0.625 + 0.25 = 0.875
     *   group max:         g0 0.125, g1 0.875, g2 0.5, g3 0.625 */
    const float p[8] = {0.125f, 0.125f, 0.875f, 0.0f, 0.5f, 0.5f, 0.625f, 0.25f};
    int32_t ti[2];
    float tw[2];
    _Alignas(64) char scratch[4096];
    tera_moe_routing r = {.score = TERA_ROUTER_SIGMOID, .n_groups = 4, .topk_groups = 2, .scale = 1.0f};
    assert_true(tera_moe_route_scratch_bytes(&r, 1) <= sizeof scratch);
    tera_moe_route(cpu(), ti, tw, p, NULL, 1, 8, 2, &r, scratch);
    /* sigmoid: groups 2 (1) and 1 (0.875, tied with g3: lower index); experts 2 (0.875), 4 (0.5) */
    assert_int_equal(ti[0], 2);
    assert_int_equal(ti[1], 4);
    assert_true(fabsf(tw[0] - 0.875f / 1.375f) < 1e-6f && fabsf(tw[1] - 0.5f / 1.375f) < 1e-6f);
    r.score = TERA_ROUTER_SOFTMAX; /* max: groups 1 (0.875) and 3 (0.625): experts 2, 6 */
    r.scale = 2.5f;
    tera_moe_route(cpu(), ti, tw, p, NULL, 1, 8, 2, &r, scratch);
    assert_int_equal(ti[0], 2);
    assert_int_equal(ti[1], 6);
    assert_true(fabsf(tw[0] - 2.5f * 0.875f / 1.5f) < 1e-6f && fabsf(tw[1] - 2.5f * 0.625f / 1.5f) < 1e-6f);
    /* a bias moves the group choice too (DeepSeek-V3: groups are scored on the biased scores) */
    const float bias[8] = {1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    tera_moe_route(cpu(), ti, tw, p, bias, 1, 8, 2, &r, scratch); /* max: g0 1.125, g1 0.875 -> experts 0, 2 */
    assert_int_equal(ti[0], 0);
    assert_int_equal(ti[1], 2);
    assert_true(fabsf(tw[0] - 2.5f * 0.125f / 1.0f) < 1e-6f); /* weights from the unbiased scores */
    /* n_groups = 1, scale 1: exactly tera_moe_topk */
    tera_moe_routing plain = {.score = TERA_ROUTER_SOFTMAX, .n_groups = 1, .topk_groups = 1, .scale = 1.0f};
    int32_t ti2[2];
    float tw2[2];
    tera_moe_route(cpu(), ti, tw, p, bias, 1, 8, 2, &plain, NULL);
    tera_moe_topk(cpu(), ti2, tw2, p, bias, 1, 8, 2);
    assert_memory_equal(ti, ti2, sizeof ti);
    assert_memory_equal(tw, tw2, sizeof tw);

    enum { N = 24, E = 4096, K = 8 };
    float *probs = malloc(sizeof(float) * N * E), *bs = malloc(sizeof(float) * E);
    int32_t got[N * K], want[K];
    float w[N * K];
    uint32_t x = 777u;
    for (int i = 0; i < N * E; i++) {
        x = x * 1664525u + 1013904223u;
        probs[i] = (float)(x >> 26) / 64.0f; /* 64 levels: ties everywhere */
    }
    for (int e = 0; e < E; e++) bs[e] = (e % 5 == 0) ? 0.125f : 0.0f;
    const int groups[][2] = {{64, 8}, {8, 4}, {4096, 8}, {2, 1}};
    for (int gi = 0; gi < 4; gi++)
        for (int sig = 0; sig < 2; sig++)
            for (int b = 0; b < 2; b++) {
                tera_moe_routing rr = {.score = sig ? TERA_ROUTER_SIGMOID : TERA_ROUTER_SOFTMAX,
                                       .n_groups = groups[gi][0], .topk_groups = groups[gi][1], .scale = 1.0f};
                void *scr = malloc(tera_moe_route_scratch_bytes(&rr, omp_get_max_threads()));
                tera_moe_route(cpu(), got, w, probs, b ? bs : NULL, N, E, K, &rr, scr);
                for (int n = 0; n < N; n++) {
                    route_brute(want, probs + (int64_t)n * E, b ? bs : NULL, E, K, rr.n_groups, rr.topk_groups, sig);
                    float sum = 0.0f;
                    for (int j = 0; j < K; j++) sum += probs[(int64_t)n * E + want[j]];
                    for (int j = 0; j < K; j++) {
                        assert_int_equal(got[n * K + j], want[j]);
                        assert_true(w[n * K + j] == probs[(int64_t)n * E + want[j]] / sum);
                    }
                }
                free(scr);
            }
    free(probs), free(bs);
}

/* The loss whose gradient tera_moe_sigmoid_backward gives, in double for fixed routing:
 * sum dtopw * w + aux_scale * sum_b aux_b + z_scale * sum_t lse_t^2. */
static double sigmoid_loss(const double *x, const int32_t *topi, const float *dtopw, const int32_t *cnt, int B, int T,
                           int E, int k, double scale, double aux_scale, double z_scale) {
    double L = 0.0;
    for (int b = 0; b < B; b++) {
        double aux = 0.0;
        for (int e = 0; e < E; e++) {
            double P = 0.0;
            for (int t = 0; t < T; t++) {
                const double *xt = x + ((int64_t)b * T + t) * E;
                double sum = 0.0;
                for (int i = 0; i < E; i++) sum += 1.0 / (1.0 + exp(-xt[i]));
                P += 1.0 / (1.0 + exp(-xt[e])) / sum;
            }
            aux += (double)cnt[b * E + e] / ((double)T * k) * P / T;
        }
        L += aux_scale * E * aux;
    }
    for (int64_t t = 0; t < (int64_t)B * T; t++) {
        const double *xt = x + t * E;
        double S = 0.0, mx = -INFINITY, se = 0.0;
        for (int j = 0; j < k; j++) S += 1.0 / (1.0 + exp(-xt[topi[t * k + j]]));
        for (int j = 0; j < k; j++) L += dtopw[t * k + j] * scale / (1.0 + exp(-xt[topi[t * k + j]])) / S;
        for (int e = 0; e < E; e++) mx = fmax(mx, xt[e]);
        for (int e = 0; e < E; e++) se += exp(xt[e] - mx);
        L += z_scale * (mx + log(se)) * (mx + log(se));
    }
    return L;
}

/* Sigmoid router backward against central differences of the loss above (selection held fixed). */
static void test_sigmoid_backward(void **state) {
    (void)state;
    enum { B = 2, T = 3, E = 8, K = 3, N = B * T };
    float x[N * E], s[N * E], lse[N], tw[N * K], dtw[N * K], dl[N * E], want[N * E];
    int32_t ti[N * K], cnt[B * E] = {0};
    double xd[N * E];
    tu_fill(x, N * E, 5, 2.0f);
    tu_fill(dtw, N * K, 6, 1.0f);
    tera_backend *be = tera_backend_cpu_create(-1);
    tera_moe_score_forward(be, s, lse, x, N, E, TERA_ROUTER_SIGMOID);
    tera_backend_destroy(be);
    for (int i = 0; i < N * E; i++) assert_true(fabsf(s[i] - 1.0f / (1.0f + expf(-x[i]))) < 1e-6f);
    const float scale = 2.5f, aux_s = 0.3f, z_s = 0.05f;
    tera_moe_routing r = {.score = TERA_ROUTER_SIGMOID, .n_groups = 1, .topk_groups = 1, .scale = scale};
    tera_moe_route(cpu(), ti, tw, s, NULL, N, E, K, &r, NULL);
    for (int a = 0; a < N * K; a++) cnt[(a / (T * K)) * E + ti[a]]++;
    tera_moe_sigmoid_backward(cpu(), dl, x, s, lse, ti, tw, dtw, cnt, B, T, E, K, scale, aux_s, z_s);
    for (int i = 0; i < N * E; i++) xd[i] = x[i];
    const double h = 1e-5;
    for (int i = 0; i < N * E; i++) {
        xd[i] = x[i] + h;
        const double lp = sigmoid_loss(xd, ti, dtw, cnt, B, T, E, K, scale, aux_s, z_s);
        xd[i] = x[i] - h;
        const double lm = sigmoid_loss(xd, ti, dtw, cnt, B, T, E, K, scale, aux_s, z_s);
        xd[i] = x[i];
        want[i] = (float)((lp - lm) / (2 * h));
    }
    assert_true(tu_close("sigmoid router backward", dl, want, N * E, 1e-3, 1e-5) <= 1.0);
}

/* The [model] keys of the routing options: defaults, and one message naming the key and value. */
static void test_routing_config(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(c.model.router_score, TERA_ROUTER_SOFTMAX);
    assert_int_equal(c.model.n_groups, 1);
    assert_int_equal(c.model.topk_groups, 1);
    assert_true(c.model.routed_scale == 1.0f);
    assert_int_equal(tera_config_set(&c, "model.router_score=sigmoid"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.n_experts=256"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.top_k=8"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.n_groups=8"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.topk_groups=4"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.router_score=tanh"), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "router_score"));
    const char *bad[][2] = {{"model.n_groups=7", "model.n_groups (7)"},
                            {"model.topk_groups=9", "model.topk_groups (9)"},
                            {"model.n_groups=256", "model.top_k (8)"}}; /* 4 groups of 1 expert */
    for (int i = 0; i < 3; i++) {
        tera_config d = c;
        assert_int_equal(tera_config_set(&d, bad[i][0]), TERA_OK);
        if (tera_config_finalize(&d) != TERA_ERR_CONFIG) {
            fprintf(stderr, "%s: accepted\n", bad[i][0]);
            fail();
        }
        if (!strstr(tera_last_error(), bad[i][1])) {
            fprintf(stderr, "%s: message '%s' lacks '%s'\n", bad[i][0], tera_last_error(), bad[i][1]);
            fail();
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topk),
        cmocka_unit_test(test_plan_dropless),
        cmocka_unit_test(test_plan_capacity),
        cmocka_unit_test(test_many_experts),
        cmocka_unit_test(test_group_limited),
        cmocka_unit_test(test_sigmoid_backward),
        cmocka_unit_test(test_routing_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
