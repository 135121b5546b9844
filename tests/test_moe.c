/* Router top-k and the dispatch plan on hand-made routing: ties, bias, capacity, drop policies,
 * grouping by expert. */
#include "testutil.h"
#include "model/moe.h"

static void test_topk(void **state) {
    (void)state;
    /* 3 tokens, 4 experts */
    float probs[12] = {0.1f, 0.4f, 0.4f, 0.1f,   /* tie between 1 and 2: lower index first */
                       0.7f, 0.1f, 0.1f, 0.1f,
                       0.25f, 0.25f, 0.25f, 0.25f};
    int32_t ti[6];
    float tw[6];
    tera_moe_topk(ti, tw, probs, NULL, 3, 4, 2);
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
    tera_moe_topk(ti, tw, probs, bias, 3, 4, 2);
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
    int64_t dropped = tera_moe_plan(slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 0, TERA_DROP_POSITION);
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
    int64_t d = tera_moe_plan(slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 2, TERA_DROP_POSITION);
    assert_int_equal(d, 1);
    assert_int_equal(slot[2], -1); /* position: the latest token is dropped */
    assert_int_equal(sel[0], 3);   /* selection counts are before drops (aux loss) */
    assert_int_equal(off[E], 3);
    d = tera_moe_plan(slot, rtok, off, sel, scratch, topi, probs, B, T, E, K, 2, TERA_DROP_PROBABILITY);
    assert_int_equal(d, 1);
    assert_int_equal(slot[0], -1); /* probability: the lowest prob (0.6) is dropped */
    assert_true(slot[1] >= 0 && slot[2] >= 0 && slot[3] >= 0);
    /* capacity is per sequence: two sequences each within capacity drop nothing */
    int32_t topi2[8] = {0, 0, 1, 1, 0, 0, 1, 1};
    float probs2[16] = {0};
    int32_t slot2[8], rtok2[8], sel2[4];
    _Alignas(16) char scratch2[512];
    d = tera_moe_plan(slot2, rtok2, off, sel2, scratch2, topi2, probs2, 2, 4, 2, 1, 2, TERA_DROP_POSITION);
    assert_int_equal(d, 0);
}

/* Thousands of experts: top-8 of 4096 against a brute-force reference (k rounds of arg-max over the
 * experts not yet taken, ties to the lower index), scores with many ties and a bias; and the plan
 * with capacity over 4096 experts. */
static void test_many_experts(void **state) {
    (void)state;
    enum { N = 16, E = 4096, K = 8 };
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
        tera_moe_topk(ti, tw, probs, bs, N, E, K);
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
    const int64_t d = tera_moe_plan(slot, rtok, off, sel, scratch, ti, probs, 1, N, E, K, 1, TERA_DROP_POSITION);
    assert_int_equal(d, repeats);
    assert_int_equal(off[E], N * K - repeats);
    for (int a = 0; a < N * K; a++)
        if (slot[a] >= 0) assert_true(slot[a] >= off[ti[a]] && slot[a] < off[ti[a] + 1]);
    free(scratch), free(off), free(sel), free(taken), free(probs), free(bias);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topk),
        cmocka_unit_test(test_plan_dropless),
        cmocka_unit_test(test_plan_capacity),
        cmocka_unit_test(test_many_experts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
