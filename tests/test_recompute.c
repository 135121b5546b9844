/* Activation recomputation (training.recompute): the spec parser, bit-identical results of every
 * policy against no recomputation (logits, losses, statistics, every gradient, router bias) over
 * several model options, and the activation bytes each policy keeps (formula below). */
#include "testutil.h"
#include "tera/config.h"
#include "tera/model.h"

/* ------------------------------------------------------------------------------- the parser */

static void expect_policy(const char *spec, int L, const char *want) {
    uint8_t pol[16];
    assert_int_equal(tera_recompute_parse(spec, L, pol), TERA_OK);
    char got[17];
    for (int l = 0; l < L; l++) got[l] = "nsf"[pol[l]];
    got[L] = '\0';
    if (strcmp(got, want) != 0) fail_msg("\"%s\": %s, want %s", spec, got, want);
}

static void expect_error(const char *spec, int L, const char *part) {
    assert_int_equal(tera_recompute_parse(spec, L, NULL), TERA_ERR_CONFIG);
    const char *msg = tera_last_error();
    if (!strstr(msg, "training.recompute") || !strstr(msg, spec) || !strstr(msg, part))
        fail_msg("\"%s\": message \"%s\" lacks the key, the value or \"%s\"", spec, msg, part);
}

static void test_parse(void **state) {
    (void)state;
    expect_policy("", 4, "nnnn");
    {
        uint8_t pol[4] = {9, 9, 9, 9};
        assert_int_equal(tera_recompute_parse(NULL, 4, pol), TERA_OK);
        for (int l = 0; l < 4; l++) assert_int_equal(pol[l], TERA_RECOMPUTE_NONE);
    }
    expect_policy("none", 4, "nnnn");
    expect_policy("full", 4, "ffff");
    expect_policy("selective", 3, "sss");
    expect_policy("full:0-3,selective:4-7", 8, "ffffssss");
    expect_policy("full:1", 4, "nfnn");
    expect_policy("selective:2-3", 5, "nnssn");
    expect_policy("full:0, selective", 4, "fsss"); /* unranged: every layer not named */
    expect_policy("selective, none:3", 4, "sssn");
    expect_error("fast", 4, "is not a policy");
    expect_error("full:0-4", 4, "outside the model's layers 0-3");
    expect_error("full:2-1", 4, "empty");
    expect_error("full:x", 4, "FIRST-LAST");
    expect_error("full:0-", 4, "FIRST-LAST");
    expect_error("full:0-2,selective:2-3", 4, "layer 2 is named by more than one item");
    expect_error("full,selective", 4, "more than one item without a layer range");
    expect_error("full;", 4, "unexpected");
    expect_error("full,", 4, "is not a policy");

    /* through the config: the key's validation knows model.n_layers */
    tera_config c;
    tera_config_defaults(&c);
    assert_string_equal(c.training.recompute, "none");
    assert_int_equal(tera_config_set(&c, "training.recompute=full:0-3"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK); /* 4 layers by default */
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "training.recompute=full:0-4"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "training.recompute = \"full:0-4\""));
    /* and the model refuses a bad spec by itself */
    tera_config_defaults(&c);
    c.model.recompute = "half";
    tera_model m;
    assert_int_equal(tera_model_create(&m, &c.model, 1, 8), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "training.recompute = \"half\""));
}

/* ------------------------------------------------------------------------------ bit identity */

static tera_model_config base_cfg(void) {
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config m = c.model;
    m.vocab_size = 37;
    m.dim = 16;
    m.n_layers = 4;
    m.n_heads = 4;
    m.n_kv_heads = 2;
    m.n_experts = 4;
    m.top_k = 2;
    m.ffn_dim = 12;
    m.max_seq_len = 64;
    m.init_std = 0.3f;
    m.aux_coef = 0.1f;
    m.z_coef = 0.01f;
    m.dense_ffn_dim = m.top_k * m.ffn_dim;
    return m;
}

/* dense first layer, shared experts, capacity factor (position drops), aux-free bias */
static tera_model_config cfg_all_options(void) {
    tera_model_config m = base_cfg();
    m.n_shared_experts = 1;
    m.first_k_dense = 1;
    m.dense_ffn_dim = 20;
    m.capacity_factor = 1.25f;
    m.drop_policy = TERA_DROP_POSITION;
    m.aux_free = 1;
    m.aux_free_rate = 0.01f;
    return m;
}

/* dropless, tied embeddings, many experts (experts run side by side across threads) */
static tera_model_config cfg_dropless_tied(void) {
    tera_model_config m = base_cfg();
    m.n_experts = 8;
    m.tie_embeddings = 1;
    return m;
}

/* two experts, k = 1 (experts one after another), probability drops, two shared experts,
 * two dense layers */
static tera_model_config cfg_prob_drops(void) {
    tera_model_config m = base_cfg();
    m.n_experts = 2;
    m.top_k = 1;
    m.n_shared_experts = 2;
    m.first_k_dense = 2;
    m.dense_ffn_dim = 28;
    m.capacity_factor = 1.0f;
    m.drop_policy = TERA_DROP_PROBABILITY;
    m.aux_free = 1;
    return m;
}

enum { B = 3, T = 13, MICRO = 2 };

typedef struct {
    tera_model m;
    float *logits[MICRO], *dlogits[MICRO];
    tera_fwd_stats stats[MICRO];
} run_result;

/* Two micro-batches of forward + backward (gradients accumulate), then the aux-free bias update. */
static void run(run_result *r, tera_model_config mc, const char *spec) {
    mc.recompute = spec;
    tera_model *m = &r->m;
    assert_int_equal(tera_model_create(m, &mc, B, T), TERA_OK);
    tera_model_init_weights(m, 11);
    for (int i = 0; i < mc.n_layers * mc.n_experts; i++) m->router_bias[i] = 0.03f * (float)((i * 7) % 5 - 2);
    tera_model_zero_grad(m);
    tera_model_reset_load(m);
    const int64_t NV = (int64_t)B * T * mc.vocab_size;
    tera_loss_scales s = {1.0f / (MICRO * B * T), mc.aux_coef / (float)(m->n_moe_layers * MICRO * B),
                          mc.z_coef / (float)(m->n_moe_layers * MICRO * B * T)};
    for (int mb = 0; mb < MICRO; mb++) {
        int32_t tok[B * T], tgt[B * T];
        for (int i = 0; i < B * T; i++)
            tok[i] = (i * 11 + 3 + 7 * mb) % mc.vocab_size, tgt[i] = (i * 5 + 1 + mb) % mc.vocab_size;
        tera_model_forward(m, tok, tgt);
        r->logits[mb] = malloc(sizeof(float) * (size_t)NV);
        memcpy(r->logits[mb], m->logits, sizeof(float) * (size_t)NV);
        r->stats[mb] = m->stats;
        tera_model_backward(m, &s);
        r->dlogits[mb] = malloc(sizeof(float) * (size_t)NV);
        memcpy(r->dlogits[mb], m->logits, sizeof(float) * (size_t)NV);
        assert_memory_equal(&r->stats[mb], &m->stats, sizeof m->stats); /* backward leaves them */
    }
    tera_model_update_router_bias(m);
}

static void free_result(run_result *r) {
    for (int mb = 0; mb < MICRO; mb++) free(r->logits[mb]), free(r->dlogits[mb]);
    tera_model_destroy(&r->m);
}

/* First differing element of two buffers compared as bits, or -1. */
static int64_t first_diff(const void *a, const void *b, int64_t n, size_t elem) {
    const char *x = a, *y = b;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(x + (size_t)i * elem, y + (size_t)i * elem, elem) != 0) return i;
    return -1;
}

static void expect_same(const run_result *a, const run_result *b, const char *label, const char *spec) {
    const tera_model *ma = &a->m, *mb = &b->m;
    const tera_model_config *c = &ma->cfg;
    const int64_t NV = (int64_t)B * T * c->vocab_size, LE = (int64_t)c->n_layers * c->n_experts;
    for (int u = 0; u < MICRO; u++) {
        int64_t i = first_diff(a->logits[u], b->logits[u], NV, sizeof(float));
        if (i >= 0) fail_msg("%s, %s: logits[%d][%ld] differ", label, spec, u, (long)i);
        i = first_diff(a->dlogits[u], b->dlogits[u], NV, sizeof(float));
        if (i >= 0) fail_msg("%s, %s: dlogits[%d][%ld] differ", label, spec, u, (long)i);
        if (memcmp(&a->stats[u], &b->stats[u], sizeof a->stats[u]) != 0)
            fail_msg("%s, %s: forward statistics of micro-batch %d differ (ce %.17g vs %.17g, aux %.17g vs "
                     "%.17g, dropped %ld vs %ld)",
                     label, spec, u, a->stats[u].ce_sum, b->stats[u].ce_sum, a->stats[u].aux_sum,
                     b->stats[u].aux_sum, (long)a->stats[u].n_dropped, (long)b->stats[u].n_dropped);
    }
    for (int p = 0; p < ma->n_params; p++) {
        const tera_param *pr = &ma->params[p];
        int64_t i = first_diff(ma->g + pr->offset, mb->g + pr->offset, pr->numel, sizeof(float));
        if (i >= 0)
            fail_msg("%s, %s: gradient %s[%ld] differs: %.9g vs %.9g", label, spec, pr->name, (long)i,
                     (double)ma->g[pr->offset + i], (double)mb->g[pr->offset + i]);
    }
    assert_int_equal(first_diff(ma->expert_load, mb->expert_load, LE, sizeof(int64_t)), -1);
    assert_int_equal(first_diff(ma->router_entropy, mb->router_entropy, c->n_layers, sizeof(double)), -1);
    assert_int_equal(ma->routed_tokens, mb->routed_tokens);
    assert_int_equal(first_diff(ma->router_bias, mb->router_bias, LE, sizeof(float)), -1);
}

/* ------------------------------------------------------------------------- activation bytes */

/* The formula. Every buffer is rounded up to 64 bytes (r). Per layer, the parts are
 *   XIN    = r(4ND)                                              the input x_in
 *   CORE   = r(4N*H*hd) + r(4*B*H*T)                             att, att_lse
 *   HIDDEN = 3 r(4N*k*F) [MoE] + 3 r(4N*Fx) [Fx > 0]             a1, a3, gact; fa1, fa3, fg
 *   REST   = 3 r(4ND) + 2 r(4N) + r(4N*H*hd) + 2 r(4N*Hkv*hd)    ln1, h, ln2, rstd1/2, q, k, v
 *            + [MoE] 2 r(4NE) + r(4N) + 4 r(4Nk) + r(4(E+1)) + r(4BE) + 2 r(4N*k*D)
 * with Fx = n_shared * F (MoE layer) or dense_ffn_dim (dense layer). A layer keeps all four parts
 * (none), XIN + REST (selective) or XIN (full). The work set holds the parts some layer does not
 * keep (CORE + HIDDEN, + REST if a layer is full), with the MoE fields if a recomputing layer is
 * MoE and the widest recomputing Fx. bytes_acts = sum of kept parts + work set + the head's
 * 2 r(4ND) + 2 r(4N) + 2 r(4*T*hd/2). */
static int64_t r64(int64_t floats) { return (4 * floats + 63) / 64 * 64; }

static int64_t part_bytes(const tera_model_config *c, int part, int moe, int64_t Fx) {
    const int64_t N = (int64_t)B * T, D = c->dim, H = c->n_heads, Hkv = c->n_kv_heads, hd = D / H;
    const int64_t E = c->n_experts, K = c->top_k, F = c->ffn_dim;
    switch (part) {
    case 0: return r64(N * D);
    case 1: return r64(N * H * hd) + r64((int64_t)B * H * T);
    case 2: return (moe ? 3 * r64(N * K * F) : 0) + (Fx > 0 ? 3 * r64(N * Fx) : 0);
    default:
        return 3 * r64(N * D) + 2 * r64(N) + r64(N * H * hd) + 2 * r64(N * Hkv * hd) +
               (moe ? 2 * r64(N * E) + r64(N) + 4 * r64(N * K) + r64(E + 1) + r64((int64_t)B * E) +
                          2 * r64(N * K * D)
                    : 0);
    }
}

static int64_t expected_bytes(const tera_model_config *c, const char *spec) {
    uint8_t pol[16];
    assert_int_equal(tera_recompute_parse(spec, c->n_layers, pol), TERA_OK);
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / c->n_heads;
    int64_t total = 0, work_Fx = 0;
    int work_moe = 0, any_sel = 0, any_full = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const int moe = l >= c->first_k_dense;
        const int64_t Fx = moe ? (int64_t)c->n_shared_experts * c->ffn_dim : c->dense_ffn_dim;
        total += part_bytes(c, 0, moe, Fx);
        if (pol[l] != TERA_RECOMPUTE_FULL) total += part_bytes(c, 3, moe, Fx);
        if (pol[l] == TERA_RECOMPUTE_NONE) total += part_bytes(c, 1, moe, Fx) + part_bytes(c, 2, moe, Fx);
        if (pol[l] != TERA_RECOMPUTE_NONE) {
            work_moe |= moe;
            if (Fx > work_Fx) work_Fx = Fx;
        }
        any_sel |= pol[l] == TERA_RECOMPUTE_SELECTIVE;
        any_full |= pol[l] == TERA_RECOMPUTE_FULL;
    }
    if (any_sel || any_full)
        total += part_bytes(c, 1, work_moe, work_Fx) + part_bytes(c, 2, work_moe, work_Fx);
    if (any_full) total += part_bytes(c, 3, work_moe, work_Fx);
    return total + 2 * r64(N * D) + 2 * r64(N) + 2 * r64((int64_t)T * hd / 2);
}

static const char *const specs[] = {"full", "selective", "full:0-1,selective:2-3", "selective:0,full:2-3",
                                    "full:1", "selective:3"};
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static void check_config(tera_model_config mc, const char *label) {
    run_result ref, got;
    run(&ref, mc, "none");
    assert_int_equal(ref.m.bytes_acts, expected_bytes(&mc, "none"));
    for (int i = 0; i < N_SPECS; i++) {
        run(&got, mc, specs[i]);
        expect_same(&got, &ref, label, specs[i]);
        const int64_t want = expected_bytes(&mc, specs[i]);
        if (got.m.bytes_acts != want)
            fail_msg("%s, %s: bytes_acts %ld, formula %ld", label, specs[i], (long)got.m.bytes_acts, (long)want);
        /* one recomputing layer saves nothing (the work set holds what it does not keep); two or more do */
        if (i < 4)
            assert_true(got.m.bytes_acts < ref.m.bytes_acts);
        else
            assert_int_equal(got.m.bytes_acts, ref.m.bytes_acts);
        fprintf(stderr, "%s, %-24s activations %7ld bytes (none: %ld)\n", label, specs[i], (long)got.m.bytes_acts,
                (long)ref.m.bytes_acts);
        free_result(&got);
    }
    /* with four layers: full keeps less than selective */
    run_result f, s;
    run(&f, mc, "full");
    run(&s, mc, "selective");
    assert_true(f.m.bytes_acts < s.m.bytes_acts);
    free_result(&f);
    free_result(&s);
    free_result(&ref);
}

static void test_all_options(void **state) {
    (void)state;
    check_config(cfg_all_options(), "dense first layer, shared experts, capacity, aux-free");
}

static void test_dropless_tied(void **state) {
    (void)state;
    check_config(cfg_dropless_tied(), "dropless, tied, 8 experts");
}

static void test_prob_drops(void **state) {
    (void)state;
    check_config(cfg_prob_drops(), "probability drops, 2 shared, 2 dense layers");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),         cmocka_unit_test(test_all_options),
        cmocka_unit_test(test_dropless_tied), cmocka_unit_test(test_prob_drops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
