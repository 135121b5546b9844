/* The fused element-wise passes (issue 19): each against the separate operations it replaces, bit for
 * bit where the arithmetic per element is the same (cross-entropy forward+backward, RoPE of q and k,
 * RMSNorm with the residual copy, a whole model step with the loss gradient written in the forward),
 * and the one-pass RMSNorm backward (its dw sums rows in another order) against a double reference,
 * bit-identical across thread counts. */
#include "testutil.h"
#include "tera/backend.h"
#include "tera/config.h"
#include "tera/kernels.h"
#include "tera/model.h"

static float *fbuf(int64_t n) {
    assert_true(n > 0 && n < (1LL << 32));
    return calloc((size_t)n, sizeof(float));
}

/* tera_ce_fused = tera_ce_forward then tera_ce_backward, in place, for 1, 2 and 3 threads */
static void test_ce_fused_bits(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{37, 203}, {9, 4096}, {130, 17}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t N = shapes[si][0], V = shapes[si][1];
        float *x = fbuf(N * V), *ref = fbuf(N * V), *fused = fbuf(N * V);
        float *lse_ref = fbuf(N), *lse = fbuf(N), *tl = fbuf(N);
        int32_t *tg = malloc(sizeof(int32_t) * (size_t)N);
        tu_fill(x, N * V, 11 + si, 6.0f);
        x[3] = 40.0f; /* a dominant logit */
        for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)((n * 7 + 3) % V);
        const float scale = 1.0f / 3.0f; /* not a power of two */
        memcpy(ref, x, sizeof(float) * (size_t)(N * V));
        const double s_ref = tera_ce_forward(lse_ref, ref, tg, N, V);
        tera_ce_backward(ref, ref, tg, N, V, scale);
        for (int th = 1; th <= 3; th++) {
            tera_set_threads(th);
            memcpy(fused, x, sizeof(float) * (size_t)(N * V));
            const double s = tera_ce_fused(fused, lse, tl, fused, tg, N, V, scale);
            assert_true(s == s_ref);
            assert_same("ce_fused lse", lse, lse_ref, N);
            assert_same("ce_fused dlogits", fused, ref, N * V);
            for (int64_t n = 0; n < N; n++) assert_true(tl[n] == x[n * V + tg[n]]);
        }
        free(x), free(ref), free(fused), free(lse_ref), free(lse), free(tl), free(tg);
    }
    tera_set_threads(2);
}

/* One exponential per logit: the gradient is made of the very exponentials the loss summed,
 * dlogits = e * (scale / sum) - scale * onehot with e = exp(x - max), not exp(x - lse) recomputed from
 * the rounded lse. Logits near 1000 make the difference visible: there the lse is rounded to half an ulp
 * of 1000 (3e-5), which would move every exp(x - lse) by up to 3e-5 relative and each row's gradient
 * sum off 0 by as much, where e * (scale / sum) stays within a few ulps of the double softmax (the
 * rounding of e, of the float sum and of the product) and its row sums within that of 0. The same bits
 * for 1, 2 and 3 threads from tera_ce_fused (out of place), tera_ce_backward (in place) and the
 * vocabulary-slice ops on one slice (ce_slice_max, ce_slice_sums writing e in place,
 * ce_backward_range), whose lse = max + log(sum) is the fused lse. */
static void test_ce_one_exponential(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{40, 64}, {33, 100}, {6, 4096}};
    const float scale = 0.75f;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t N = shapes[si][0], V = shapes[si][1];
        /* relative error allowed per element and on each row's sum: the float sum of V / 16 terms per
         * lane and 16 lanes (about 1e-7 per term at worst), an ulp for e, half an ulp each for scale /
         * sum and the product */
        const double rel = V <= 128 ? 1e-6 : 4e-6;
        float *x = fbuf(N * V), *d = fbuf(N * V), *d1 = fbuf(N * V), *d2 = fbuf(N * V);
        float *lse = fbuf(N), *tl = fbuf(N), *mx = fbuf(N), *se = fbuf(N), *tl2 = fbuf(N);
        int32_t *tg = malloc(sizeof(int32_t) * (size_t)N);
        tu_fill(x, N * V, 21 + si, 6.0f);
        for (int64_t i = 0; i < N * V; i++) x[i] += 1000.0f;
        for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)((n * 13 + 5) % V);
        for (int th = 1; th <= 3; th++) {
            tera_set_threads(th);
            const double s = tera_ce_fused(d, lse, tl, x, tg, N, V, scale);
            if (th == 1)
                memcpy(d1, d, sizeof(float) * (size_t)(N * V));
            else
                assert_same("ce_fused dlogits across threads", d, d1, N * V);
            memcpy(d2, x, sizeof(float) * (size_t)(N * V));
            tera_ce_backward(d2, d2, tg, N, V, scale);
            assert_same("ce_backward in place = ce_fused", d2, d1, N * V);
            tera_ce_slice_max(mx, x, N, V);
            memcpy(d2, x, sizeof(float) * (size_t)(N * V));
            tera_ce_slice_sums(se, tl2, d2, d2, mx, tg, N, V, 0);
            tera_ce_backward_range(d2, d2, se, tg, N, V, 0, scale);
            assert_same("slice ops on the whole vocabulary = ce_fused", d2, d1, N * V);
            double s2 = 0.0;
            for (int64_t n = 0; n < N; n++) {
                assert_true(tl2[n] == x[n * V + tg[n]] && tl[n] == tl2[n]);
                const float l = mx[n] + logf(se[n]);
                if (l != lse[n]) fail_msg("V %ld row %ld: slice lse %.9g, fused %.9g", (long)V, (long)n, l, lse[n]);
                s2 += (double)l - (double)tl2[n];
            }
            assert_true(s == s2);
        }
        for (int64_t n = 0; n < N; n++) { /* against the double softmax */
            const float *r = x + n * V, *g = d1 + n * V;
            double m = -INFINITY, sd = 0.0, rowsum = 0.0;
            for (int64_t v = 0; v < V; v++) m = fmax(m, r[v]);
            for (int64_t v = 0; v < V; v++) sd += exp((double)r[v] - m);
            const double l = m + log(sd);
            if (!(fabs(lse[n] - l) <= 2.5e-7 * l)) fail_msg("V %ld row %ld: lse %.9g, double %.12g", (long)V, (long)n, lse[n], l);
            for (int64_t v = 0; v < V; v++) {
                const double p = exp((double)r[v] - m) / sd, want = scale * (p - (v == tg[n] ? 1.0 : 0.0));
                if (!(fabs(g[v] - want) <= rel * scale * p + 6e-8 * fabs(want)))
                    fail_msg("V %ld row %ld col %ld: dlogits %.9g, double %.12g (relative %.3g)", (long)V, (long)n,
                             (long)v, g[v], want, fabs(g[v] - want) / (scale * p));
                rowsum += g[v];
            }
            if (!(fabs(rowsum) <= rel * scale))
                fail_msg("V %ld row %ld: dlogits sum to %.3g (scale %g)", (long)V, (long)n, rowsum, (double)scale);
        }
        free(x), free(d), free(d1), free(d2), free(lse), free(tl), free(mx), free(se), free(tl2), free(tg);
    }
    tera_set_threads(2);
}

/* RoPE of q and k in one pass = rope_forward / rope_backward on each; GQA (Hkv < H) */
static void test_rope_qk_bits(void **state) {
    (void)state;
    const int B = 2, T = 13, H = 4, Hkv = 2, hd = 16;
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd;
    float *cs = fbuf((int64_t)T * hd / 2), *sn = fbuf((int64_t)T * hd / 2);
    tera_rope_tables(cs, sn, T, hd, 10000.0f);
    float *q = fbuf(nq), *k = fbuf(nk), *q2 = fbuf(nq), *k2 = fbuf(nk);
    tu_fill(q, nq, 1, 1.0f);
    tu_fill(k, nk, 2, 1.0f);
    memcpy(q2, q, sizeof(float) * (size_t)nq);
    memcpy(k2, k, sizeof(float) * (size_t)nk);
    tera_rope_forward(q, cs, sn, B, T, H, hd);
    tera_rope_forward(k, cs, sn, B, T, Hkv, hd);
    tera_rope_qk_forward(q2, k2, cs, sn, B, T, H, Hkv, hd);
    assert_same("rope_qk_forward q", q2, q, nq);
    assert_same("rope_qk_forward k", k2, k, nk);
    tera_rope_backward(q, cs, sn, B, T, H, hd);
    tera_rope_backward(k, cs, sn, B, T, Hkv, hd);
    tera_rope_qk_backward(q2, k2, cs, sn, B, T, H, Hkv, hd);
    assert_same("rope_qk_backward q", q2, q, nq);
    assert_same("rope_qk_backward k", k2, k, nk);
    free(cs), free(sn), free(q), free(k), free(q2), free(k2);
}

/* RMSNorm forward with the copy of its input = rmsnorm_forward + memcpy */
static void test_rmsnorm_copy_bits(void **state) {
    (void)state;
    const int64_t N = 21, D = 40;
    float *x = fbuf(N * D), *w = fbuf(D), *y = fbuf(N * D), *r = fbuf(N), *y2 = fbuf(N * D), *r2 = fbuf(N),
          *cp = fbuf(N * D);
    tu_fill(x, N * D, 5, 2.0f);
    tu_fill(w, D, 6, 1.0f);
    tera_rmsnorm_forward(y, r, x, w, N, D, 1e-5f);
    tera_rmsnorm_copy_forward(y2, r2, cp, x, w, N, D, 1e-5f);
    assert_same("rmsnorm_copy y", y2, y, N * D);
    assert_same("rmsnorm_copy rstd", r2, r, N);
    assert_same("rmsnorm_copy copy", cp, x, N * D);
    free(x), free(w), free(y), free(r), free(y2), free(r2), free(cp);
}

/* The one-pass backward: dx (+=) and dw (+=) against a double reference; the same bits for 1, 2 and
 * 3 threads; D = 4100 takes the two-pass form (rows wider than the fused pass's local array). */
static void check_rmsnorm_backward(int64_t N, int64_t D) {
    float *x = fbuf(N * D), *w = fbuf(D), *y = fbuf(N * D), *r = fbuf(N), *dy = fbuf(N * D);
    float *dx0 = fbuf(N * D), *dw0 = fbuf(D), *dx = fbuf(N * D), *dw = fbuf(D), *ex = fbuf(N * D), *ew = fbuf(D);
    tu_fill(x, N * D, 7, 2.0f);
    tu_fill(w, D, 8, 1.0f);
    tu_fill(dy, N * D, 9, 1.0f);
    tu_fill(dx0, N * D, 10, 0.5f); /* both accumulate */
    tu_fill(dw0, D, 12, 0.5f);
    tera_rmsnorm_forward(y, r, x, w, N, D, 1e-5f);
    assert_true(D > 0 && D < (1 << 20));
    double *dwd = calloc((size_t)D, sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        const double rr = r[n];
        double dot = 0.0;
        for (int64_t d = 0; d < D; d++) dot += (double)dy[n * D + d] * w[d] * x[n * D + d];
        const double c = dot * rr * rr / (double)D;
        for (int64_t d = 0; d < D; d++) {
            ex[n * D + d] = (float)(dx0[n * D + d] + rr * ((double)dy[n * D + d] * w[d] - x[n * D + d] * c));
            dwd[d] += (double)dy[n * D + d] * x[n * D + d] * rr;
        }
    }
    for (int64_t d = 0; d < D; d++) ew[d] = (float)(dw0[d] + dwd[d]);
    float *dx1 = fbuf(N * D), *dw1 = fbuf(D);
    for (int th = 1; th <= 3; th++) {
        tera_set_threads(th);
        memcpy(dx, dx0, sizeof(float) * (size_t)(N * D));
        memcpy(dw, dw0, sizeof(float) * (size_t)D);
        tera_rmsnorm_backward(dx, dw, dy, x, w, r, N, D);
        assert_true(tu_close("rmsnorm bwd dx", dx, ex, N * D, 1e-5, 1e-5) <= 1.0);
        assert_true(tu_close("rmsnorm bwd dw", dw, ew, D, 1e-5, 1e-4) <= 1.0);
        if (th == 1) {
            memcpy(dx1, dx, sizeof(float) * (size_t)(N * D));
            memcpy(dw1, dw, sizeof(float) * (size_t)D);
        } else {
            assert_same("rmsnorm bwd dx across threads", dx, dx1, N * D);
            assert_same("rmsnorm bwd dw across threads", dw, dw1, D);
        }
    }
    tera_set_threads(2);
    free(x), free(w), free(y), free(r), free(dy), free(dx0), free(dw0), free(dx), free(dw), free(ex), free(ew);
    free(dwd), free(dx1), free(dw1);
}

static void test_rmsnorm_backward_fused(void **state) {
    (void)state;
    check_rmsnorm_backward(200, 24);  /* 7 chunks of 29 rows, the last partial */
    check_rmsnorm_backward(64, 256);  /* 2 chunks */
    check_rmsnorm_backward(600, 2048); /* chunks limited by the partial-sum block (16 of 38 rows) */
    check_rmsnorm_backward(70, 4100); /* the two-pass form */
}

/* A model step with the loss gradient written by the forward (tera_model_arm_fused_loss) gives the
 * same loss and gradients, bit for bit, as forward then backward; the arming lasts one forward. */
static void test_model_fused_loss(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config mc = c.model;
    mc.vocab_size = 37, mc.dim = 16, mc.n_layers = 2, mc.n_heads = 4, mc.n_kv_heads = 2, mc.n_experts = 4;
    mc.top_k = 2, mc.ffn_dim = 12, mc.first_k_dense = 1, mc.dense_ffn_dim = 20, mc.max_seq_len = 32;
    mc.init_std = 0.3f;
    const int B = 2, T = 11;
    tera_model m;
    assert_int_equal(tera_model_create(&m, &mc, B, T), TERA_OK);
    tera_model_init_weights(&m, 3);
    int32_t tok[2 * 11], tgt[2 * 11];
    for (int i = 0; i < B * T; i++) tok[i] = (i * 11 + 3) % mc.vocab_size, tgt[i] = (i * 5 + 1) % mc.vocab_size;
    const tera_loss_scales s = {1.0f / (float)(3 * B * T), 0.01f, 0.001f};
    tera_model_zero_grad(&m);
    tera_model_forward(&m, tok, tgt);
    const double ce_ref = m.stats.ce_sum;
    tera_model_backward(&m, &s);
    float *g_ref = fbuf(m.n_floats);
    memcpy(g_ref, m.g, sizeof(float) * (size_t)m.n_floats);
    tera_model_zero_grad(&m);
    tera_model_arm_fused_loss(&m, s.ce);
    tera_model_forward(&m, tok, tgt);
    assert_true(m.stats.ce_sum == ce_ref);
    tera_model_backward(&m, &s);
    assert_same("gradients, fused loss", m.g, g_ref, m.n_floats);
    /* not armed again: the forward leaves the logits, and the backward computes the gradient itself */
    tera_model_zero_grad(&m);
    tera_model_forward(&m, tok, tgt);
    float *logits = fbuf((int64_t)B * T * mc.vocab_size);
    memcpy(logits, m.logits, sizeof(float) * (size_t)(B * T * mc.vocab_size));
    tera_model_forward(&m, tok, tgt);
    assert_same("logits of an unarmed forward", m.logits, logits, (int64_t)B * T * mc.vocab_size);
    tera_model_backward(&m, &s);
    assert_same("gradients, unarmed", m.g, g_ref, m.n_floats);
    free(logits);
    free(g_ref);
    tera_model_destroy(&m);
}

int main(void) {
    tera_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_fused_bits),          cmocka_unit_test(test_rope_qk_bits),
        cmocka_unit_test(test_rmsnorm_copy_bits),      cmocka_unit_test(test_rmsnorm_backward_fused),
        cmocka_unit_test(test_model_fused_loss),      cmocka_unit_test(test_ce_one_exponential),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
