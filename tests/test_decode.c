/* The inference forward with a key/value cache (include/tera/decode.h) against tera_model_forward:
 * the same logits at every position, whether the tokens arrive all at once (in chunks), one at a
 * time through the cache (batched over sequences of different lengths), or recomputed from scratch
 * for every position; on a Mixtral-like model and on one with every routing option that applies at
 * inference (dense first layer, shared experts, aux-free bias, sigmoid scores, group-limited
 * routing, routed scale), and under model.router_force_balance. Bad input is refused with a message. */
#include "testutil.h"
#include "tera/decode.h"
#include "tera/model.h"

enum { B = 2, T = 19 };

static tera_model_config mixtral_cfg(void) {
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config m = c.model;
    m.vocab_size = 37;
    m.dim = 32;
    m.n_layers = 3;
    m.n_heads = 4;
    m.n_kv_heads = 2;
    m.n_experts = 4;
    m.top_k = 2;
    m.ffn_dim = 24;
    m.max_seq_len = 64;
    m.init_std = 0.2f;
    m.rope_theta = 500.0f; /* rotations that matter over 19 positions */
    return m;
}

static tera_model_config options_cfg(void) {
    tera_model_config m = mixtral_cfg();
    m.n_experts = 8;
    m.n_shared_experts = 1;
    m.first_k_dense = 1;
    m.dense_ffn_dim = 20;
    m.aux_free = 1;
    m.aux_free_rate = 0.01f;
    m.router_score = TERA_ROUTER_SIGMOID;
    m.n_groups = 4;
    m.topk_groups = 2;
    m.routed_scale = 2.5f;
    m.tie_embeddings = 1;
    return m;
}

static void make_tokens(int32_t *tok, int V) {
    for (int i = 0; i < B * T; i++) tok[i] = (i * 11 + 3 + i / 7) % V;
}

/* Every way of running the decoder gives tera_model_forward's logits (relative 1e-4 of the row's
 * scale: the attention differs from the tiled training kernel only in summation order). */
static void check_model(tera_model_config mc, const char *label) {
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, B, T), TERA_OK);
    tera_model_init_weights(&m, 11);
    for (int i = 0; i < mc.n_layers * mc.n_experts; i++) m.router_bias[i] = 0.03f * (float)((i * 7) % 5 - 2);
    const int V = mc.vocab_size;
    int32_t tok[B * T], tgt[B * T];
    make_tokens(tok, V);
    for (int i = 0; i < B * T; i++) tgt[i] = (i * 5 + 1) % V;
    tera_model_forward(&m, tok, tgt);
    float *ref = malloc(sizeof(float) * B * T * V);
    memcpy(ref, m.logits, sizeof(float) * B * T * V);

    tera_decoder *d;
    assert_int_equal(tera_decoder_create(&d, &m, B, T, 5), TERA_OK); /* chunks of 5: 4 prefill chunks */
    float *got = malloc(sizeof(float) * B * T * V);
    char what[128];
    /* 1. prefill, all logits, sequence by sequence */
    for (int b = 0; b < B; b++) assert_int_equal(tera_decoder_append(d, b, tok + b * T, T, got + b * T * V, 1), TERA_OK);
    snprintf(what, sizeof what, "%s: prefill", label);
    assert_true(tu_close(what, got, ref, (int64_t)B * T * V, 1e-4, 1e-5) <= 1.0);
    /* 2. the cache, one token per step; sequence 1 starts 3 tokens later than sequence 0 (different
     *    positions in one pass) */
    tera_decoder_reset(d, -1);
    memset(got, 0, sizeof(float) * B * T * V);
    float *step = malloc(sizeof(float) * B * V);
    for (int s = 0; s < T + 3; s++) {
        int32_t cur[B];
        uint8_t act[B];
        for (int b = 0; b < B; b++) {
            const int t = s - 3 * b;
            act[b] = t >= 0 && t < T;
            cur[b] = act[b] ? tok[b * T + t] : -1;
        }
        assert_int_equal(tera_decoder_step(d, cur, act, step), TERA_OK);
        for (int b = 0; b < B; b++)
            if (act[b]) memcpy(got + ((int64_t)b * T + (s - 3 * b)) * V, step + (int64_t)b * V, sizeof(float) * V);
    }
    assert_int_equal(tera_decoder_len(d, 0), T);
    assert_int_equal(tera_decoder_len(d, 1), T);
    snprintf(what, sizeof what, "%s: cached steps", label);
    assert_true(tu_close(what, got, ref, (int64_t)B * T * V, 1e-4, 1e-5) <= 1.0);
    /* 3. full recomputation for every position (last logits only) */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            tera_decoder_reset(d, b);
            assert_int_equal(tera_decoder_append(d, b, tok + b * T, t + 1, got + ((int64_t)b * T + t) * V, 0), TERA_OK);
        }
    snprintf(what, sizeof what, "%s: recomputed", label);
    assert_true(tu_close(what, got, ref, (int64_t)B * T * V, 1e-4, 1e-5) <= 1.0);

    /* 4. greedy continuation: cached and recomputed give the same tokens */
    int32_t gen_c[12], gen_r[12], seqbuf[T];
    float *lg = malloc(sizeof(float) * V);
    tera_decoder_reset(d, -1);
    assert_int_equal(tera_decoder_append(d, 0, tok, 5, lg, 0), TERA_OK);
    for (int i = 0; i < 12; i++) {
        int best = 0;
        for (int v = 1; v < V; v++) best = lg[v] > lg[best] ? v : best;
        gen_c[i] = best;
        int32_t cur[B] = {best, 0};
        uint8_t act[B] = {1, 0};
        assert_int_equal(tera_decoder_step(d, cur, act, step), TERA_OK);
        memcpy(lg, step, sizeof(float) * V);
    }
    memcpy(seqbuf, tok, sizeof(int32_t) * 5);
    for (int i = 0; i < 12; i++) {
        tera_decoder_reset(d, 0);
        assert_int_equal(tera_decoder_append(d, 0, seqbuf, 5 + i, lg, 0), TERA_OK);
        int best = 0;
        for (int v = 1; v < V; v++) best = lg[v] > lg[best] ? v : best;
        gen_r[i] = best;
        seqbuf[5 + i] = best;
    }
    assert_memory_equal(gen_c, gen_r, sizeof gen_c);

    /* 5. bad input */
    tera_decoder_reset(d, -1);
    assert_int_equal(tera_decoder_append(d, 0, tok, T, got, 0), TERA_OK);
    assert_int_equal(tera_decoder_append(d, 0, tok, 1, got, 0), TERA_ERR_ARG); /* past the context */
    assert_non_null(strstr(tera_last_error(), "context"));
    int32_t bad[B] = {V, 0};
    assert_int_equal(tera_decoder_append(d, 1, bad, 1, got, 0), TERA_ERR_ARG); /* outside the vocabulary */
    assert_non_null(strstr(tera_last_error(), "vocabulary"));
    assert_int_equal(tera_decoder_append(d, 1, tok, 0, got, 0), TERA_ERR_ARG); /* empty */

    free(lg);
    free(step);
    free(got);
    free(ref);
    tera_decoder_free(d);
    tera_model_destroy(&m);
}

static void test_mixtral(void **state) {
    (void)state;
    check_model(mixtral_cfg(), "mixtral");
}

static void test_options(void **state) {
    (void)state;
    check_model(options_cfg(), "options");
}

/* model.router_force_balance: the decoder takes each row's own position for the fixed pattern, so it
 * selects as the training forward (rows b T + t) does: the same logits every way */
static void test_force_balance(void **state) {
    (void)state;
    tera_model_config m = options_cfg();
    m.n_groups = 1, m.topk_groups = 1, m.router_force_balance = 1;
    check_model(m, "forced balance");
}

static void test_refuses(void **state) {
    (void)state;
    tera_model_config mc = mixtral_cfg();
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, 1, 4), TERA_OK);
    tera_decoder *d = NULL;
    assert_int_equal(tera_decoder_create(&d, &m, 1, mc.max_seq_len + 1, 0), TERA_ERR_ARG);
    assert_null(d);
    assert_non_null(strstr(tera_last_error(), "max_seq_len"));
    tera_model_destroy(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral),
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_force_balance),
        cmocka_unit_test(test_refuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
