/* Operands rounded once (issue 19): the several-products linear ops (one input, several weights)
 * and the bf16 shadow of the resident weights (include/tera/backend.h, ctl.weights_*) give the same
 * bits as rounding every operand on every call; the shadow goes stale never (a window opened with
 * changed = 1 sees new weights), and a whole bf16 training run with it equals one without it. */
#include <omp.h>

#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/train.h"

static tera_backend *be; /* created in main */

static const struct {
    tera_precision p;
    tera_bf16_gemm g;
} MODES[] = {{TERA_PREC_BF16, TERA_BF16_NATIVE}, {TERA_PREC_BF16, TERA_BF16_FMA}, {TERA_PREC_FP16, TERA_BF16_NATIVE}};

static int native_bf16(void) {
    if (be->caps.bf16_native(be)) return 1;
    print_message("skip: bf16 on native units (no bf16 GEMM kernels on this CPU)\n");
    return 0;
}

/* linear_forward_multi / linear_backward_multi against n single products, bit for bit, in every
 * low-precision mode (and fp32), for dx written (beta 0) and accumulated (beta 1). */
static void test_multi_same_bits(void **state) {
    (void)state;
    enum { NP = 3 };
    const int64_t N = 37, in = 48, out[NP] = {64, 24, 24};
    float *x = malloc(sizeof(float) * (size_t)(N * in)), *w[NP], *dy[NP], *y1[NP], *y2[NP], *dw1[NP], *dw2[NP];
    float *dx1 = malloc(sizeof(float) * (size_t)(N * in)), *dx2 = malloc(sizeof(float) * (size_t)(N * in));
    tu_fill(x, N * in, 1, 1.0f);
    for (int i = 0; i < NP; i++) {
        w[i] = malloc(sizeof(float) * (size_t)(out[i] * in));
        dy[i] = malloc(sizeof(float) * (size_t)(N * out[i]));
        y1[i] = malloc(sizeof(float) * (size_t)(N * out[i]));
        y2[i] = malloc(sizeof(float) * (size_t)(N * out[i]));
        dw1[i] = malloc(sizeof(float) * (size_t)(out[i] * in));
        dw2[i] = malloc(sizeof(float) * (size_t)(out[i] * in));
        tu_fill(w[i], out[i] * in, 10 + (uint64_t)i, 0.5f);
        tu_fill(dy[i], N * out[i], 20 + (uint64_t)i, 0.25f);
    }
    for (int m = -1; m < 3; m++) {
        if (m == 0 && !native_bf16()) continue;
        if (m < 0)
            tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
        else
            tera_backend_set_precision(be, MODES[m].p, MODES[m].g);
        for (int i = 0; i < NP; i++) be->ops.linear_forward(be, y1[i], x, w[i], N, in, out[i], 0.0f);
        tera_linear_forward_multi(be, NP, y2, x, (const float *const *)w, out, N, in);
        for (int i = 0; i < NP; i++) assert_same("forward multi", y2[i], y1[i], N * out[i]);
        for (int beta = 0; beta < 2; beta++) {
            tu_fill(dx1, N * in, 30, 1.0f);
            memcpy(dx2, dx1, sizeof(float) * (size_t)(N * in));
            for (int i = 0; i < NP; i++) {
                tu_fill(dw1[i], out[i] * in, 40 + (uint64_t)i, 1.0f);
                memcpy(dw2[i], dw1[i], sizeof(float) * (size_t)(out[i] * in));
            }
            for (int i = 0; i < NP; i++)
                be->ops.linear_backward(be, dx1, dw1[i], dy[i], x, w[i], N, in, out[i], i == 0 ? (float)beta : 1.0f, 1.0f);
            tera_linear_backward_multi(be, NP, dx2, dw2, (const float *const *)dy, x, (const float *const *)w, out, N,
                                       in, (float)beta, 1.0f);
            assert_same("backward multi dx", dx2, dx1, N * in);
            for (int i = 0; i < NP; i++) assert_same("backward multi dw", dw2[i], dw1[i], out[i] * in);
        }
        /* one product (n = 1) is the single op */
        tera_linear_forward_multi(be, 1, y2, x, (const float *const *)w, out, N, in);
        assert_same("forward multi n=1", y2[0], y1[0], N * out[0]);
    }
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    for (int i = 0; i < NP; i++) free(w[i]), free(dy[i]), free(y1[i]), free(y2[i]), free(dw1[i]), free(dw2[i]);
    free(x), free(dx1), free(dx2);
}

/* The shadow: allocated only for bf16 on the native units with a registered buffer; inside a window
 * products read it (a window claiming unchanged weights after a change shows the old rounding: the
 * shadow is really used), a window opened with changed = 1 after a change gives the fresh rounding's
 * bits, and outside a window products round on the fly. */
static void test_shadow_window(void **state) {
    (void)state;
    if (!native_bf16()) return;
    /* two weight tensors in one buffer, the first at an offset inside a shadow block, the second
     * straddling a block boundary (blocks of 8192 elements) */
    const int64_t N = 33, in = 96, out = 100, off1 = 517, off2 = 8100, total = 20000;
    float *buf = tera_malloc(sizeof(float) * (size_t)total);
    tu_fill(buf, total, 3, 0.5f);
    float *x = malloc(sizeof(float) * (size_t)(N * in)), *dy = malloc(sizeof(float) * (size_t)(N * out));
    tu_fill(x, N * in, 4, 1.0f);
    tu_fill(dy, N * out, 5, 0.25f);
    float *ya = malloc(sizeof(float) * (size_t)(N * out)), *yb = malloc(sizeof(float) * (size_t)(N * out));
    float *yold = malloc(sizeof(float) * (size_t)(N * out));
    float *dxa = calloc((size_t)(N * in), sizeof(float)), *dxb = calloc((size_t)(N * in), sizeof(float));
    float *dwa = calloc((size_t)(out * in), sizeof(float)), *dwb = calloc((size_t)(out * in), sizeof(float));

    tera_backend *sb = tera_backend_cpu_create(-1), *ref = tera_backend_cpu_create(-1);
    tera_backend_weights_register(sb, buf, total);
    assert_int_equal(tera_backend_weights_shadow_bytes(sb), 0); /* fp32: none */
    tera_backend_set_precision(sb, TERA_PREC_BF16, TERA_BF16_FMA);
    assert_int_equal(tera_backend_weights_shadow_bytes(sb), 0); /* bf16 on the FMA units: none */
    tera_backend_set_precision(sb, TERA_PREC_BF16, TERA_BF16_NATIVE);
    assert_int_equal(tera_backend_weights_shadow_bytes(sb), total * 2);
    tera_backend_set_precision(ref, TERA_PREC_BF16, TERA_BF16_NATIVE);
    assert_int_equal(tera_backend_weights_shadow_bytes(ref), 0); /* nothing registered */

    for (int t = 0; t < 2; t++) {
        const float *w = buf + (t == 0 ? off1 : off2);
        tera_backend_weights_begin(sb, 1);
        sb->ops.linear_forward(sb, ya, x, w, N, in, out, 0.0f);
        sb->ops.linear_backward(sb, dxa, dwa, dy, x, w, N, in, out, 0.0f, 1.0f);
        tera_backend_weights_end(sb);
        ref->ops.linear_forward(ref, yb, x, w, N, in, out, 0.0f);
        ref->ops.linear_backward(ref, dxb, dwb, dy, x, w, N, in, out, 0.0f, 1.0f);
        assert_same("shadow forward", ya, yb, N * out);
        assert_same("shadow backward dx", dxa, dxb, N * in);
        assert_same("shadow backward dw", dwa, dwb, out * in);
        memcpy(yold, ya, sizeof(float) * (size_t)(N * out));

        /* the weights change (as an optimizer step does): a new window sees them */
        for (int64_t i = 0; i < total; i++) buf[i] = buf[i] * 0.75f + 0.01f;
        tera_backend_weights_begin(sb, 0); /* wrongly claims unchanged: the old rounding, so the shadow is in use */
        sb->ops.linear_forward(sb, ya, x, w, N, in, out, 0.0f);
        tera_backend_weights_end(sb);
        assert_same("stale window (shadow in use)", ya, yold, N * out);
        tera_backend_weights_begin(sb, 1);
        sb->ops.linear_forward(sb, ya, x, w, N, in, out, 0.0f);
        tera_backend_weights_end(sb);
        ref->ops.linear_forward(ref, yb, x, w, N, in, out, 0.0f);
        assert_same("window after a change", ya, yb, N * out);
        assert_true(memcmp(ya, yold, sizeof(float) * (size_t)(N * out)) != 0);
        /* outside a window: rounded on the fly, never the shadow */
        for (int64_t i = 0; i < total; i++) buf[i] -= 0.02f;
        sb->ops.linear_forward(sb, ya, x, w, N, in, out, 0.0f);
        ref->ops.linear_forward(ref, yb, x, w, N, in, out, 0.0f);
        assert_same("outside a window", ya, yb, N * out);
    }

    /* side by side (experts): threads sharing blocks at the tensors' edges round them once */
    tera_backend_weights_begin(sb, 1);
    float *yp[2] = {ya, yb};
#pragma omp parallel for num_threads(2) schedule(static, 1)
    for (int t = 0; t < 2; t++) sb->ops.linear_forward(sb, yp[t], x, buf + (t == 0 ? off2 - out * in / 2 : off2), N, in, out, 0.0f);
    tera_backend_weights_end(sb);
    ref->ops.linear_forward(ref, yold, x, buf + off2 - out * in / 2, N, in, out, 0.0f);
    assert_same("side by side, first", ya, yold, N * out);
    ref->ops.linear_forward(ref, yold, x, buf + off2, N, in, out, 0.0f);
    assert_same("side by side, second", yb, yold, N * out);

    /* back to fp32: the shadow goes */
    tera_backend_set_precision(sb, TERA_PREC_FP32, TERA_BF16_NATIVE);
    assert_int_equal(tera_backend_weights_shadow_bytes(sb), 0);
    tera_backend_destroy(sb);
    tera_backend_destroy(ref);
    free(buf), free(x), free(dy), free(ya), free(yb), free(yold), free(dxa), free(dxb), free(dwa), free(dwb);
}

static tera_config tiny_cfg(const char *precision, const char *units, int accum, const char *recompute) {
    tera_config c = tu_tiny_moe_config(1, accum);
    snprintf(c.training.precision, sizeof c.training.precision, "%s", precision);
    snprintf(c.training.bf16_gemm, sizeof c.training.bf16_gemm, "%s", units);
    snprintf(c.training.recompute, sizeof c.training.recompute, "%s", recompute);
    c.model.tie_embeddings = !strcmp(recompute, "selective"); /* the head's weights are the embedding's */
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    return c;
}

/* steps of training with the shadow on (shadow = 1) or off (TERA_BF16_SHADOW=0): the losses and
 * the final weights; returns the shadow's bytes */
static int64_t train_run(const tera_config *c, int shadow, double *loss, float **w, int64_t *n) {
    if (shadow)
        unsetenv("TERA_BF16_SHADOW");
    else
        setenv("TERA_BF16_SHADOW", "0", 1);
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, c, "", 0), TERA_OK);
    const int64_t bytes = tera_backend_weights_shadow_bytes(tr.model.be);
    tera_step_result r;
    for (int s = 0; s < c->training.steps; s++) {
        assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
        loss[s] = r.loss;
    }
    *n = tr.model.n_floats;
    *w = malloc(sizeof(float) * (size_t)*n);
    memcpy(*w, tr.model.w, sizeof(float) * (size_t)*n);
    assert_int_equal(tr.model.be->ctl.scratch_grows(tr.model.be), 0);
    tera_trainer_free(&tr);
    unsetenv("TERA_BF16_SHADOW");
    return bytes;
}

/* bf16 training with the shadow equals training without it bit for bit, over optimizer steps that
 * change the weights between windows (gradient accumulation: one shadow over the step's
 * micro-batches; recomputation; tied embeddings: the head's weights are the embedding's); the trainer
 * registers it at ZeRO-0 with AdamW at any grad_accum (the update writes it: tests/test_optim_shadow.c,
 * which also checks the lazy rule alone, TERA_BF16_SHADOW=lazy): 2 bytes per resident parameter on
 * the native units, none on the FMA units or in fp32. */
static void test_training_same_bits(void **state) {
    (void)state;
    const struct {
        const char *prec, *units, *recompute;
        int accum;
    } runs[] = {{"bf16", "native", "none", 4}, {"bf16", "native", "full", 4}, {"bf16", "native", "selective", 5},
                {"bf16", "native", "none", 2}, {"bf16", "fma", "none", 4}, {"fp32", "auto", "none", 4}};
    for (int k = 0; k < 6; k++) {
        const int native = !strcmp(runs[k].units, "native");
        if (native && !native_bf16()) continue;
        const tera_config c = tiny_cfg(runs[k].prec, runs[k].units, runs[k].accum, runs[k].recompute);
        double la[8], lb[8];
        float *wa, *wb;
        int64_t na, nb;
        const int64_t bytes = train_run(&c, 1, la, &wa, &na);
        const int64_t off = train_run(&c, 0, lb, &wb, &nb);
        print_message("%s/%s recompute %s accum %d: shadow %ld bytes, losses %.6f .. %.6f\n", runs[k].prec,
                      runs[k].units, runs[k].recompute, runs[k].accum, (long)bytes, la[0], la[c.training.steps - 1]);
        assert_int_equal(bytes, native ? na * 2 : 0);
        assert_int_equal(off, 0);
        assert_int_equal(na, nb);
        assert_memory_equal(la, lb, sizeof(double) * (size_t)c.training.steps);
        assert_same("weights after training", wa, wb, na);
        assert_true(la[c.training.steps - 1] != la[0]); /* the weights did change step to step */
        free(wa), free(wb);
    }
}

int main(void) {
    setenv("TERA_GEMM_PRIMITIVE_MIN", "100000", 1); /* read at the first product: small products reach the primitive */
    tera_set_threads(2);
    be = tera_backend_cpu_create(-1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_multi_same_bits),
        cmocka_unit_test(test_shadow_window),
        cmocka_unit_test(test_training_same_bits),
    };
    const int failed = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(be);
    return failed;
}
