/* Whole-model checks: gradients of every parameter tensor against finite differences (all model
 * options on), bit-identical determinism, gradient accumulation, LR schedule and clipping. */
#include "testutil.h"
#include "tera/kernels.h"
#include "tera/model.h"
#include "tera/train.h"
#include "tera/zero.h"

static tera_model_config tiny_cfg(void) {
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config m = c.model;
    m.vocab_size = 37;
    m.dim = 16;
    m.n_layers = 3;
    m.n_heads = 4;
    m.n_kv_heads = 2;
    m.n_experts = 4;
    m.top_k = 2;
    m.ffn_dim = 12;
    m.n_shared_experts = 1;
    m.first_k_dense = 1;
    m.dense_ffn_dim = 20;
    m.max_seq_len = 64;
    m.init_std = 0.3f;
    m.capacity_factor = 1.25f;
    m.drop_policy = TERA_DROP_POSITION;
    m.aux_coef = 0.1f;
    m.z_coef = 0.01f;
    m.aux_free = 1;
    m.aux_free_rate = 0.01f;
    return m;
}

static double total_loss(tera_model *m, const int32_t *tok, const int32_t *tgt, const tera_loss_scales *s) {
    tera_model_forward(m, tok, tgt);
    return s->ce * m->stats.ce_sum + s->aux * m->stats.aux_sum + s->z * m->stats.z_sum;
}

static void fd_model(tera_model_config mc, const char *label) {
    const int B = 2, T = 19;
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, B, T), TERA_OK);
    tera_model_init_weights(&m, 7);
    for (int i = 0; i < mc.n_layers * mc.n_experts; i++) m.router_bias[i] = 0.02f * (float)((i * 7) % 5 - 2);
    int32_t tok[2 * 19], tgt[2 * 19];
    for (int i = 0; i < B * T; i++) tok[i] = (i * 11 + 3) % mc.vocab_size, tgt[i] = (i * 5 + 1) % mc.vocab_size;
    tera_loss_scales s = {1.0f / (B * T), mc.aux_coef / (float)(m.n_moe_layers * B),
                          mc.z_coef / (float)(m.n_moe_layers * B * T)};
    tera_model_zero_grad(&m);
    total_loss(&m, tok, tgt, &s);
    tera_model_backward(&m, &s);
    const float eps = 2e-3f;
    const double l0 = total_loss(&m, tok, tgt, &s);
    int checked = 0, bad = 0, kinks = 0;
    for (int p = 0; p < m.n_params; p++) {
        const tera_param *pr = &m.params[p];
        int64_t step = pr->numel / 6 + 1;
        for (int64_t j = 0; j < pr->numel; j += step) {
            float *w = m.w + pr->offset + j;
            float keep = *w;
            *w = keep + eps;
            double lp = total_loss(&m, tok, tgt, &s);
            *w = keep - eps;
            double lm = total_loss(&m, tok, tgt, &s);
            *w = keep;
            double fd = (lp - lm) / (2.0 * eps), an = m.g[pr->offset + j];
            /* a routing decision (top-k or capacity) flipping inside [w-eps, w+eps] makes the loss
             * jump: the one-sided slopes then disagree. Such points are not differentiable. */
            double dp = (lp - l0) / eps, dm = (l0 - lm) / eps;
            if (fabs(dp - dm) > 0.25 * fmax(fabs(dp), fabs(dm)) + 1e-2) {
                kinks++;
                continue;
            }
            checked++;
            if (fabs(fd - an) > 2e-4 + 3e-2 * fabs(fd)) {
                bad++;
                fprintf(stderr, "%s: %s[%ld]: analytic %.6g finite-difference %.6g\n", label, pr->name,
                        (long)j, an, fd);
            }
        }
    }
    fprintf(stderr, "%s: %d gradient elements checked, %d off, %d skipped at routing flips\n", label,
            checked, bad, kinks);
    assert_int_equal(bad, 0);
    assert_true(kinks * 20 <= checked);
    assert_true(checked > 100);
    tera_model_destroy(&m);
}

static void test_fd_all_options(void **state) {
    (void)state;
    fd_model(tiny_cfg(), "shared+dense+capacity(position)+z+auxfree+GQA");
}

static void test_fd_dropless_prob(void **state) {
    (void)state;
    tera_model_config c = tiny_cfg();
    c.first_k_dense = 0;
    c.n_shared_experts = 0;
    c.capacity_factor = 1.0f;
    c.drop_policy = TERA_DROP_PROBABILITY;
    c.n_kv_heads = 1;
    c.aux_free = 0;
    fd_model(c, "capacity(probability)+MQA");
    c.capacity_factor = 0.0f;
    c.tie_embeddings = 1;
    c.n_kv_heads = 4;
    fd_model(c, "dropless+tied");
}

/* A trainer on the embedded corpus (byte tokens). */
static tera_config small_train_cfg(int micro, int accum) {
    tera_config c;
    tera_config_defaults(&c);
    c.model.dim = 32;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_experts = 4;
    c.model.ffn_dim = 32;
    c.model.max_seq_len = 64;
    c.training.seq_len = 32;
    c.training.micro_batch = micro;
    c.training.grad_accum = accum;
    c.training.steps = 4;
    c.training.warmup_steps = 1;
    c.logging.progress = 0;
    snprintf(c.training.precision, sizeof c.training.precision, "fp32"); /* tolerances are fp32's */
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    return c;
}

static void run_steps(const tera_config *c, int n, double *losses, float **weights, int64_t *nf) {
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, c, "", 0), TERA_OK);
    tera_step_result r;
    for (int i = 0; i < n; i++) {
        assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
        losses[i] = r.loss;
    }
    *nf = tr.model.n_floats;
    *weights = malloc(sizeof(float) * (size_t)*nf);
    memcpy(*weights, tr.model.w, sizeof(float) * (size_t)*nf);
    tera_trainer_free(&tr);
}

static void test_determinism(void **state) {
    (void)state;
    tera_config c = small_train_cfg(4, 1);
    double l1[4], l2[4];
    float *w1, *w2;
    int64_t n1, n2;
    run_steps(&c, 4, l1, &w1, &n1);
    run_steps(&c, 4, l2, &w2, &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(l1, l2, sizeof l1);
    assert_memory_equal(w1, w2, sizeof(float) * (size_t)n1);
    /* the read-ahead thread changes nothing */
    c.data.prefetch = 0;
    double lp[4];
    float *wp;
    run_steps(&c, 4, lp, &wp, &n2);
    assert_memory_equal(l1, lp, sizeof l1);
    assert_memory_equal(w1, wp, sizeof(float) * (size_t)n1);
    free(wp);
    c.data.prefetch = 2;
    /* a different thread count gives the same losses to float rounding */
    c.training.threads = 1;
    double l3[4];
    float *w3;
    run_steps(&c, 4, l3, &w3, &n2);
    for (int i = 0; i < 4; i++) assert_true(fabs(l3[i] - l1[i]) < 1e-5 * fabs(l1[i]));
    free(w3);
    /* a different seed gives a different model */
    c.training.seed = 99;
    c.training.threads = 0;
    run_steps(&c, 1, l3, &w3, &n2);
    assert_true(l3[0] != l1[0]);
    free(w1);
    free(w2);
    free(w3);
}

static void test_grad_accumulation(void **state) {
    (void)state;
    double la[4], lb[4], lc[4];
    float *wa, *wb, *wc;
    int64_t n;
    tera_config a = small_train_cfg(4, 1), b = small_train_cfg(2, 2), c = small_train_cfg(1, 4);
    run_steps(&a, 3, la, &wa, &n);
    run_steps(&b, 3, lb, &wb, &n);
    run_steps(&c, 3, lc, &wc, &n);
    for (int i = 0; i < 3; i++) {
        assert_true(fabs(la[i] - lb[i]) < 2e-5 * fabs(la[i]));
        assert_true(fabs(la[i] - lc[i]) < 2e-5 * fabs(la[i]));
    }
    assert_true(tu_close("accum 2x2 weights", wb, wa, n, 1e-3, 1e-5) <= 1.0);
    assert_true(tu_close("accum 1x4 weights", wc, wa, n, 1e-3, 1e-5) <= 1.0);
    free(wa);
    free(wb);
    free(wc);
}

/* A non-finite gradient skips the update (weights unchanged, counted) and the data still advances. */
static void test_nonfinite_skip(void **state) {
    (void)state;
    tera_config c = small_train_cfg(2, 1);
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
    tr.faults.nan_step = 1;
    tera_step_result r;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    assert_int_equal(r.skipped, 0);
    float *before = malloc(sizeof(float) * (size_t)tr.model.n_floats);
    memcpy(before, tr.model.w, sizeof(float) * (size_t)tr.model.n_floats);
    const int64_t t_before = tr.sharding->opt.t;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    assert_int_equal(r.skipped, 1);
    assert_true(!isfinite(r.grad_norm));
    assert_int_equal(tr.skipped_steps, 1);
    assert_memory_equal(before, tr.model.w, sizeof(float) * (size_t)tr.model.n_floats);
    assert_int_equal(tr.sharding->opt.t, t_before);
    assert_int_equal(tr.samples_consumed, 4); /* both steps consumed their samples */
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK); /* training goes on */
    assert_int_equal(r.skipped, 0);
    assert_true(isfinite(r.loss) && isfinite(r.grad_norm));
    for (int64_t i = 0; i < tr.model.n_floats; i++) assert_true(isfinite(tr.model.w[i]));
    free(before);
    tera_trainer_free(&tr);
}

static void test_lr_schedule(void **state) {
    (void)state;
    tera_train_config t = {0};
    t.steps = 110;
    t.warmup_steps = 10;
    t.lr = 1.0f;
    t.min_lr = 0.1f;
    assert_true(fabsf(tera_lr_at(&t, 0) - 0.1f) < 1e-7f);
    assert_true(fabsf(tera_lr_at(&t, 9) - 1.0f) < 1e-7f);
    assert_true(fabsf(tera_lr_at(&t, 10) - 1.0f) < 1e-6f);
    assert_true(fabsf(tera_lr_at(&t, 60) - 0.55f) < 1e-6f); /* half-way: (max+min)/2 */
    assert_true(fabsf(tera_lr_at(&t, 110) - 0.1f) < 1e-6f);
    t.warmup_steps = 0;
    t.min_lr = 1.0f;
    for (int s = 0; s < 110; s += 7) assert_true(tera_lr_at(&t, s) == 1.0f); /* constant */
}

static void test_clipping_and_norm(void **state) {
    (void)state;
    tera_model_config mc = tiny_cfg();
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, 1, 4), TERA_OK);
    double ref = 0;
    for (int64_t i = 0; i < m.n_floats; i++) {
        m.g[i] = (float)((i % 17) - 8) * 1e-3f;
        ref += (double)m.g[i] * m.g[i];
    }
    double n = tera_grad_norm(&m);
    assert_true(fabs(n - sqrt(ref)) < 1e-9 * sqrt(ref) + 1e-12);
    tera_grad_scale(&m, 0.5f);
    assert_true(fabs(tera_grad_norm(&m) - 0.5 * n) < 1e-6 * n);
    tera_model_destroy(&m);
}

static void test_param_table(void **state) {
    (void)state;
    tera_model_config mc = tiny_cfg();
    int n;
    int64_t nf;
    tera_param *t = tera_param_table(&mc, &n, &nf);
    /* offsets: the non-expert tensors in table order, then the expert tensors in table order */
    int64_t prev_end = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            if (t[i].expert_stacked != pass) continue;
            assert_true(t[i].offset >= prev_end);        /* no overlap */
            assert_int_equal(t[i].offset % 16, 0);       /* 64-byte aligned */
            prev_end = t[i].offset + t[i].numel;
            assert_int_equal(t[i].decay, t[i].ndim >= 2); /* decay on matrices only */
            for (int d = 0; d < 3; d++) {
                assert_int_equal(t[i].lo[d], 0);
                assert_int_equal(t[i].len[d], t[i].shape[d]);
            }
        }
    assert_true(prev_end <= nf);
    /* expert parallelism: rank r of ep stores experts [r E/ep, (r+1) E/ep) of each expert tensor,
     * the same non-expert region, and 1/ep of the expert region */
    for (int ep = 2; ep <= mc.n_experts; ep *= 2) {
        for (int r = 0; r < ep; r++) {
            int ne;
            int64_t nfe, nde, nd1;
            tera_param *te = tera_param_table_ep(&mc, ep, r, &ne, &nfe, &nde);
            free(tera_param_table_ep(&mc, 1, 0, &ne, &nf, &nd1));
            assert_int_equal(ne, n);
            assert_int_equal(nde, nd1);
            assert_int_equal((nfe - nde) * ep, nf - nd1);
            for (int i = 0; i < n; i++) {
                assert_string_equal(te[i].name, t[i].name);
                if (!te[i].expert_stacked) {
                    assert_int_equal(te[i].offset, t[i].offset);
                    continue;
                }
                assert_true(te[i].offset >= nde);
                assert_int_equal(te[i].len[0] * ep, te[i].shape[0]);
                assert_int_equal(te[i].lo[0], r * te[i].len[0]);
                assert_int_equal(te[i].numel * ep, t[i].numel);
            }
            free(te);
        }
    }
    /* tensor parallelism: Megatron's split (heads of q/k/v and the o_proj input, FFN widths,
     * vocabulary rows); norms and the router whole on every rank */
    mc.vocab_size = 38; /* divisible by tp */
    const int tp = 2;
    for (int r = 0; r < tp; r++) {
        int nt;
        int64_t nft, ndt;
        tera_param *tt = tera_param_table_par(&mc, 2, 1, tp, r, &nt, &nft, &ndt);
        for (int i = 0; i < nt; i++) {
            const tera_param *p = &tt[i];
            int want = -1;
            switch (p->kind) {
            case TERA_P_EMBED: case TERA_P_LM_HEAD: case TERA_P_WQ: case TERA_P_WK: case TERA_P_WV:
            case TERA_P_SHARED_W1: case TERA_P_SHARED_W3: case TERA_P_DENSE_W1: case TERA_P_DENSE_W3: want = 0; break;
            case TERA_P_WO: case TERA_P_SHARED_W2: case TERA_P_DENSE_W2: case TERA_P_EXP_W1: case TERA_P_EXP_W3: want = 1; break;
            case TERA_P_EXP_W2: want = 2; break;
            default: break;
            }
            assert_int_equal(p->tp_dim, want);
            if (want >= 0) {
                assert_int_equal(p->len[want] * tp, p->shape[want]);
                assert_int_equal(p->lo[want], r * p->len[want]);
            }
            if (p->expert_stacked) assert_int_equal(p->lo[0], p->len[0]); /* ep rank 1 of 2 */
            assert_int_equal(p->numel, p->len[0] * p->len[1] * p->len[2]);
        }
        free(tt);
    }
    /* o_proj / w2 use the scaled init std / sqrt(2L) */
    for (int i = 0; i < n; i++)
        if (t[i].kind == TERA_P_WO || t[i].kind == TERA_P_EXP_W2 || t[i].kind == TERA_P_DENSE_W2)
            assert_true(fabsf(t[i].init_std - mc.init_std / sqrtf(2.0f * mc.n_layers)) < 1e-7f);
    free(t);
    /* BENCH.md's parameter counts */
    tera_model_config s = {0};
    s.vocab_size = 4096, s.dim = 256, s.n_layers = 4, s.n_heads = 8, s.n_kv_heads = 8, s.n_experts = 8;
    s.top_k = 2, s.ffn_dim = 512, s.dense_ffn_dim = 1024, s.init_std = 0.02f;
    assert_true(llabs(tera_model_total_params(&s) - 15700000) < 200000);
    assert_true(llabs(tera_model_active_params(&s) - 5200000) < 200000);
}

/* The model's per-group index of its table (tera_model.group_off / group_idx: a group's parameters
 * without a scan of the whole table) gives every group exactly the tensors a scan by layer and kind
 * gives: each group's ranges of both regions equal a scan's, and equal what the model returns with
 * the index taken away (its fallback scan); every tensor is in exactly one group. */
static void test_group_index(void **state) {
    (void)state;
    tera_model_config mc = tiny_cfg();
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, 2, 8), TERA_OK);
    assert_non_null(m.group_off);
    const int L = mc.n_layers;
    assert_int_equal(m.group_off[L + 2], m.n_params); /* every tensor in one group */
    for (int g = -2; g < L; g++) {
        for (int x = 0; x < 2; x++) {
            int64_t lo = INT64_MAX, hi = 0, lo_i, hi_i, lo_s, hi_s;
            for (int i = 0; i < m.n_params; i++) {
                const tera_param *p = &m.params[i];
                const int in = g >= 0                  ? p->layer == g
                               : g == TERA_GROUP_EMBED ? p->kind == TERA_P_EMBED
                                                       : p->kind == TERA_P_FINAL_NORM || p->kind == TERA_P_LM_HEAD;
                if (!in || p->expert_stacked != x || p->numel == 0) continue;
                if (p->offset < lo) lo = p->offset;
                if (p->offset + p->numel > hi) hi = p->offset + p->numel;
            }
            if (hi == 0) lo = 0;
            tera_model_group_range(&m, g, x, &lo_i, &hi_i);
            int *off = m.group_off;
            m.group_off = NULL; /* the fallback: a scan */
            tera_model_group_range(&m, g, x, &lo_s, &hi_s);
            m.group_off = off;
            assert_int_equal(lo_i, lo);
            assert_int_equal(hi_i, hi);
            assert_int_equal(lo_s, lo);
            assert_int_equal(hi_s, hi);
            if (g >= 0 && x == 1 && g >= mc.first_k_dense) assert_true(hi > lo); /* a MoE layer's experts */
        }
    }
    tera_model_destroy(&m);
}

int main(void) {
    tera_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_param_table),     cmocka_unit_test(test_lr_schedule),
        cmocka_unit_test(test_clipping_and_norm), cmocka_unit_test(test_fd_all_options),
        cmocka_unit_test(test_fd_dropless_prob), cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_grad_accumulation), cmocka_unit_test(test_nonfinite_skip),
        cmocka_unit_test(test_group_index),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
