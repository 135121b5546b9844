/* bf16 operands written by their producers (issue 19; src/kernels/cpu/cpu.h, tera_cpu_prod): with bf16
 * on the native units, SwiGLU's forward (g), its backward (da1, da3) and the cross-entropy's loss
 * gradient (dlogits) and RMSNorm's output write the bf16 copies of their outputs where the next product looks, and that
 * product takes them instead of rounding again: the same bits as without the producers, the copy
 * really taken (the backend's counter), never taken after any other op ran in between (an op writing
 * the array in place, on the main thread and inside work items), nor past a work item's end; and a
 * whole bf16 training run equals one with TERA_PRODUCER_BF16=0 bit for bit. */
#include <omp.h>

#include "kernels/cpu/cpu.h"
#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/train.h"

static tera_backend *be, *ref; /* producers on, off; created in main */

static int64_t used(const tera_backend *b) { return ((const tera_cpu_matmul *)b->impl)->prod_used; }

static float *vec(int64_t n, uint64_t seed, float a) {
    float *v = tera_malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    tu_fill(v, n, seed, a);
    return v;
}

/* both backends in bf16 (native units when on is 1, else the FMA units), scratch for products of up
 * to `elems` operand elements */
static int set_mode(int native, int64_t elems) {
    if (native && !be->caps.bf16_native(be)) {
        print_message("skip: bf16 on native units (no bf16 GEMM kernels on this CPU)\n");
        return 0;
    }
    const tera_bf16_gemm g = native ? TERA_BF16_NATIVE : TERA_BF16_FMA;
    tera_backend_set_precision(be, TERA_PREC_BF16, g);
    tera_backend_set_precision(ref, TERA_PREC_BF16, g);
    tera_backend_reserve(be, elems, elems);
    tera_backend_reserve(ref, elems, elems);
    return 1;
}

/* SwiGLU forward -> the w2 product (beta 0 and 1): the copy is taken and the bits are those of
 * rounding in the product; an op writing g in place in between (add_forward), or another op at all
 * (rope on an unrelated array), leaves the product to round g itself: the counter does not move and
 * the result is that of the new g. On the FMA units there are no copies. */
static void test_swiglu_forward(void **state) {
    (void)state;
    const int64_t N = 45, F = 64, D = 40;
    float *a1 = vec(N * F, 1, 2.0f), *a3 = vec(N * F, 2, 1.0f), *w2 = vec(D * F, 3, 0.3f), *bias = vec(N * F, 4, 0.5f);
    float *g = vec(N * F, 0, 0.0f), *gr = vec(N * F, 0, 0.0f), *y = vec(N * D, 5, 1.0f), *yr = vec(N * D, 5, 1.0f);
    float *cs = vec(64, 6, 1.0f), *other = vec(4 * 2 * 8, 7, 1.0f);
    for (int native = 1; native >= 0; native--) {
        if (!set_mode(native, 4 * N * (F + D) + D * F)) continue;
        for (int beta = 0; beta < 2; beta++) {
            const int64_t u0 = used(be);
            be->ops.swiglu_forward(be, g, a1, a3, N * F);
            be->ops.linear_forward(be, y, g, w2, N, F, D, (float)beta);
            ref->ops.swiglu_forward(ref, gr, a1, a3, N * F);
            ref->ops.linear_forward(ref, yr, gr, w2, N, F, D, (float)beta);
            assert_same("swiglu g", g, gr, N * F);
            assert_same("w2 product from the producer's copy", y, yr, N * D);
            assert_int_equal(used(be) - u0, native ? 1 : 0);
            assert_int_equal(used(ref), 0);

            /* an op writes g in place between the producer and the product */
            be->ops.swiglu_forward(be, g, a1, a3, N * F);
            be->ops.add_forward(be, g, bias, N * F);
            be->ops.linear_forward(be, y, g, w2, N, F, D, 0.0f);
            ref->ops.add_forward(ref, gr, bias, N * F);
            ref->ops.linear_forward(ref, yr, gr, w2, N, F, D, 0.0f);
            assert_same("after an in-place op", y, yr, N * D);
            assert_int_equal(used(be) - u0, native ? 1 : 0);

            /* any other op in between: the record is gone too (g unchanged, so the bits agree either way) */
            be->ops.swiglu_forward(be, g, a1, a3, N * F);
            be->ops.rope_forward(be, other, cs, cs + 32, 1, 4, 2, 8);
            be->ops.linear_forward(be, y, g, w2, N, F, D, 0.0f);
            assert_int_equal(used(be) - u0, native ? 1 : 0);
            /* the record is for the very array: a product of a part of g rounds */
            be->ops.swiglu_forward(be, g, a1, a3, N * F);
            be->ops.linear_forward(be, y, g, w2, N - 1, F, D, 0.0f);
            be->ops.linear_forward(be, y, g, w2, N, F, D, 0.0f); /* and it was taken by the op before */
            assert_int_equal(used(be) - u0, native ? 1 : 0);
            ref->ops.swiglu_forward(ref, gr, a1, a3, N * F);
            ref->ops.linear_forward(ref, yr, gr, w2, N, F, D, 0.0f);
            assert_same("rounded by the product", y, yr, N * D);
        }
    }
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(ref, TERA_PREC_FP32, TERA_BF16_NATIVE);
    free(a1), free(a3), free(w2), free(bias), free(g), free(gr), free(y), free(yr), free(cs), free(other);
}

/* SwiGLU backward -> the w1 / w3 backward of several products: both gradients' copies taken (dx
 * written and accumulated), the same dx and dw bits. */
static void test_swiglu_backward(void **state) {
    (void)state;
    const int64_t N = 37, F = 48, D = 32;
    float *a1 = vec(N * F, 1, 2.0f), *a3 = vec(N * F, 2, 1.0f), *dg = vec(N * F, 3, 0.5f), *x = vec(N * D, 4, 1.0f);
    float *w1 = vec(F * D, 5, 0.3f), *w3 = vec(F * D, 6, 0.3f);
    float *da1 = vec(N * F, 0, 0.0f), *da3 = vec(N * F, 0, 0.0f), *ra1 = vec(N * F, 0, 0.0f), *ra3 = vec(N * F, 0, 0.0f);
    float *dx = vec(N * D, 7, 1.0f), *rdx = vec(N * D, 7, 1.0f);
    float *dw[2] = {vec(F * D, 8, 0.1f), vec(F * D, 9, 0.1f)}, *rdw[2] = {vec(F * D, 8, 0.1f), vec(F * D, 9, 0.1f)};
    const int64_t out[2] = {F, F};
    const float *w[2] = {w1, w3}, *dyp[2] = {da1, da3}, *ryp[2] = {ra1, ra3};
    if (!set_mode(1, N * (2 * F + D) + F * D + 4)) goto done;
    for (int beta = 0; beta < 2; beta++) {
        const int64_t u0 = used(be);
        be->ops.swiglu_backward(be, da1, da3, dg, a1, a3, N * F);
        tera_linear_backward_multi(be, 2, dx, dw, dyp, x, w, out, N, D, (float)beta, 1.0f);
        ref->ops.swiglu_backward(ref, ra1, ra3, dg, a1, a3, N * F);
        tera_linear_backward_multi(ref, 2, rdx, rdw, ryp, x, w, out, N, D, (float)beta, 1.0f);
        assert_same("swiglu da1", da1, ra1, N * F);
        assert_same("swiglu da3", da3, ra3, N * F);
        assert_same("dx from the producer's copies", dx, rdx, N * D);
        assert_same("dw1", dw[0], rdw[0], F * D);
        assert_same("dw3", dw[1], rdw[1], F * D);
        assert_int_equal(used(be) - u0, 2);
        /* an op writing da3 in place in between: rounded again, the new values */
        be->ops.swiglu_backward(be, da1, da3, dg, a1, a3, N * F);
        be->ops.add_forward(be, da3, a1, N * F);
        tera_linear_backward_multi(be, 2, dx, dw, dyp, x, w, out, N, D, (float)beta, 1.0f);
        ref->ops.add_forward(ref, ra3, a1, N * F);
        tera_linear_backward_multi(ref, 2, rdx, rdw, ryp, x, w, out, N, D, (float)beta, 1.0f);
        assert_same("dx after an in-place op", dx, rdx, N * D);
        assert_same("dw3 after an in-place op", dw[1], rdw[1], F * D);
        assert_int_equal(used(be) - u0, 2);
    }
    /* a scratch that holds the product's operands (one layer's, as reserved before the producers) but
     * not both copies beside them: the product rounds, the same bits, and nothing grows */
    tera_backend_destroy(be);
    be = tera_backend_cpu_create(-1);
    tera_backend_set_precision(be, TERA_PREC_BF16, TERA_BF16_NATIVE);
    tera_backend_reserve(be, N * (F + D) + F * D + 2, N * (F + D) + F * D + 2);
    const int64_t u0 = used(be);
    be->ops.swiglu_backward(be, da1, da3, dg, a1, a3, N * F);
    tera_linear_backward_multi(be, 2, dx, dw, dyp, x, w, out, N, D, 0.0f, 1.0f);
    ref->ops.swiglu_backward(ref, ra1, ra3, dg, a1, a3, N * F);
    tera_linear_backward_multi(ref, 2, rdx, rdw, ryp, x, w, out, N, D, 0.0f, 1.0f);
    assert_same("dx, small scratch", dx, rdx, N * D);
    assert_int_equal(used(be) - u0, 0);
    assert_int_equal(be->ctl.scratch_grows(be), 0);
done:
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(ref, TERA_PREC_FP32, TERA_BF16_NATIVE);
    free(a1), free(a3), free(dg), free(x), free(w1), free(w3), free(da1), free(da3), free(ra1), free(ra3);
    free(dx), free(rdx), free(dw[0]), free(dw[1]), free(rdw[0]), free(rdw[1]);
}

/* The cross-entropy's dlogits (fused, separate backward, vocabulary slice) -> the LM head's backward:
 * taken, the same bits. */
static void test_ce(void **state) {
    (void)state;
    const int64_t N = 24, V = 200, D = 32;
    float *logits = vec(N * V, 1, 3.0f), *lg = vec(N * V, 0, 0.0f), *rl = vec(N * V, 0, 0.0f), *x = vec(N * D, 2, 1.0f);
    float *w = vec(V * D, 3, 0.2f), *dx = vec(N * D, 0, 0.0f), *rdx = vec(N * D, 0, 0.0f);
    float *dw = vec(V * D, 0, 0.0f), *rdw = vec(V * D, 0, 0.0f), *lse = vec(N, 0, 0.0f), *tl = vec(N, 0, 0.0f);
    float *mx = vec(N, 0, 0.0f), *se = vec(2 * N, 0, 0.0f);
    int32_t *tg = malloc(sizeof(int32_t) * (size_t)N);
    for (int64_t n = 0; n < N; n++) tg[n] = (int32_t)((n * 37) % V);
    if (!set_mode(1, N * (V + D) + V * D + 2)) goto done;
    for (int kind = 0; kind < 3; kind++) {
        const int64_t u0 = used(be);
        tera_backend *b[2] = {be, ref};
        float *d[2] = {lg, rl}, *gx[2] = {dx, rdx}, *gw[2] = {dw, rdw};
        for (int k = 0; k < 2; k++) {
            memcpy(d[k], logits, sizeof(float) * (size_t)(N * V));
            if (kind == 0) {
                b[k]->ops.ce_fused(b[k], d[k], lse, tl, d[k], tg, N, V, 0.5f);
            } else if (kind == 1) {
                b[k]->ops.ce_backward(b[k], d[k], d[k], tg, N, V, 0.5f);
            } else { /* a slice of the vocabulary (tensor parallelism's backward), one rank's view */
                b[k]->ops.ce_slice_max(b[k], mx, d[k], N, V);
                b[k]->ops.ce_slice_sums(b[k], se, se + N, d[k], d[k], mx, tg, N, V, 0);
                b[k]->ops.ce_backward_range(b[k], d[k], d[k], se, tg, N, V, 0, 0.5f);
            }
            b[k]->ops.linear_backward(b[k], gx[k], gw[k], d[k], x, w, N, D, V, 0.0f, 1.0f);
        }
        assert_same("dlogits", lg, rl, N * V);
        assert_same("head dx from the producer's copy", dx, rdx, N * D);
        assert_same("head dw from the producer's copy", dw, rdw, V * D);
        assert_int_equal(used(be) - u0, 1);
    }
done:
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(ref, TERA_PREC_FP32, TERA_BF16_NATIVE);
    free(logits), free(lg), free(rl), free(x), free(w), free(dx), free(rdx), free(dw), free(rdw), free(lse), free(tl);
    free(mx), free(se), free(tg);
}

/* RMSNorm's output -> the q/k/v products of one input (linear_forward_multi) and -> one product (the
 * LM head): taken, the same bits; a product of the fp32 units after it (the router) takes nothing
 * and leaves nothing for the next one. */
static void test_rmsnorm(void **state) {
    (void)state;
    const int64_t N = 33, D = 48, out[3] = {48, 16, 16};
    float *x = vec(N * D, 1, 2.0f), *nw = vec(D, 2, 1.0f), *y = vec(N * D, 0, 0.0f), *yr = vec(N * D, 0, 0.0f);
    float *rs = vec(N, 0, 0.0f), *w[3], *q[3], *qr[3];
    for (int i = 0; i < 3; i++) {
        w[i] = vec(out[i] * D, 3 + (uint64_t)i, 0.3f);
        q[i] = vec(N * out[i], 0, 0.0f);
        qr[i] = vec(N * out[i], 0, 0.0f);
    }
    if (!set_mode(1, N * (D + 48) + 48 * D + 2)) goto done;
    int64_t u0 = used(be);
    be->ops.rmsnorm_forward(be, y, rs, x, nw, N, D, 1e-5f);
    tera_linear_forward_multi(be, 3, q, y, (const float *const *)w, out, N, D);
    ref->ops.rmsnorm_forward(ref, yr, rs, x, nw, N, D, 1e-5f);
    tera_linear_forward_multi(ref, 3, qr, yr, (const float *const *)w, out, N, D);
    assert_same("rmsnorm y", y, yr, N * D);
    for (int i = 0; i < 3; i++) assert_same("q/k/v from the producer's copy", q[i], qr[i], N * out[i]);
    assert_int_equal(used(be) - u0, 1);
    be->ops.rmsnorm_forward(be, y, rs, x, nw, N, D, 1e-5f);
    be->ops.linear_forward(be, q[0], y, w[0], N, D, out[0], 0.0f);
    ref->ops.linear_forward(ref, qr[0], yr, w[0], N, D, out[0], 0.0f);
    assert_same("head from the producer's copy", q[0], qr[0], N * out[0]);
    assert_int_equal(used(be) - u0, 2);
    be->ops.rmsnorm_forward(be, y, rs, x, nw, N, D, 1e-5f);
    be->ops.linear_forward_fp32(be, q[1], y, w[1], N, D, out[1], 0.0f); /* fp32: takes the record, uses nothing */
    be->ops.linear_forward(be, q[0], y, w[0], N, D, out[0], 0.0f);
    assert_same("after an fp32 product", q[0], qr[0], N * out[0]);
    assert_int_equal(used(be) - u0, 2);
done:
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(ref, TERA_PREC_FP32, TERA_BF16_NATIVE);
    for (int i = 0; i < 3; i++) free(w[i]), free(q[i]), free(qr[i]);
    free(x), free(nw), free(y), free(yr), free(rs);
}

/* Work items side by side (the experts): each thread's copies are its own and taken by its own next
 * product; an item whose op writes g in place in between takes none (the record is per thread and
 * cleared by every op, the region does not change inside a parallel region); a copy left by an item's
 * last op never reaches a later item. */
enum { NI = 6 };
typedef struct {
    tera_backend *b;
    float *a1, *a3, *g, *y, *w2, *bias;
    int64_t n, F, D;
    int phase; /* 0: produce and consume, odd items an op in between; 1: produce only; 2: consume only */
} items_ctx;

static void item_fn(void *p, int i) {
    const items_ctx *c = p;
    tera_backend *b = c->b;
    const int64_t nf = c->n * c->F;
    float *g = c->g + i * nf, *y = c->y + i * c->n * c->D;
    if (c->phase != 2) b->ops.swiglu_forward(b, g, c->a1 + i * nf, c->a3 + i * nf, nf);
    if (c->phase == 0 && i % 2) b->ops.add_forward(b, g, c->bias, nf);
    if (c->phase != 1) b->ops.linear_forward(b, y, g, c->w2, c->n, c->F, c->D, 0.0f);
}

static void test_items(void **state) {
    (void)state;
    const int64_t n = 29, F = 40, D = 24;
    float *a1 = vec(NI * n * F, 1, 2.0f), *a3 = vec(NI * n * F, 2, 1.0f), *w2 = vec(D * F, 3, 0.3f);
    float *bias = vec(n * F, 4, 0.5f), *g = vec(NI * n * F, 0, 0.0f), *gr = vec(NI * n * F, 0, 0.0f);
    float *y = vec(NI * n * D, 0, 0.0f), *yr = vec(NI * n * D, 0, 0.0f);
    if (!set_mode(1, 2 * n * (F + D) + D * F)) goto done;
    items_ctx c = {.b = be, .a1 = a1, .a3 = a3, .g = g, .y = y, .w2 = w2, .bias = bias, .n = n, .F = F, .D = D};
    items_ctx r = c;
    r.b = ref, r.g = gr, r.y = yr;
    int64_t u0 = used(be);
    be->ops.for_each_item(be, NI, item_fn, &c);
    ref->ops.for_each_item(ref, NI, item_fn, &r);
    assert_same("items: g", g, gr, NI * n * F);
    assert_same("items: y", y, yr, NI * n * D);
    assert_int_equal(used(be) - u0, NI / 2); /* the even items' */
    /* items that only produce, then items that only consume the same arrays: nothing taken */
    u0 = used(be);
    c.phase = r.phase = 1;
    be->ops.for_each_item(be, NI, item_fn, &c);
    ref->ops.for_each_item(ref, NI, item_fn, &r);
    c.phase = r.phase = 2;
    be->ops.for_each_item(be, NI, item_fn, &c);
    ref->ops.for_each_item(ref, NI, item_fn, &r);
    assert_same("items across regions: y", y, yr, NI * n * D);
    assert_int_equal(used(be) - u0, 0);
done:
    tera_backend_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_set_precision(ref, TERA_PREC_FP32, TERA_BF16_NATIVE);
    free(a1), free(a3), free(w2), free(bias), free(g), free(gr), free(y), free(yr);
}

/* steps of bf16 training with the producers on or off (TERA_PRODUCER_BF16=0): losses, final weights,
 * and the copies the products took */
static int64_t train_run(const tera_config *c, int on, double *loss, float **w, int64_t *n) {
    if (on)
        unsetenv("TERA_PRODUCER_BF16");
    else
        setenv("TERA_PRODUCER_BF16", "0", 1);
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, c, "", 0), TERA_OK);
    tera_step_result res;
    for (int s = 0; s < c->training.steps; s++) {
        assert_int_equal(tera_trainer_step(&tr, &res), TERA_OK);
        loss[s] = res.loss;
    }
    *n = tr.model.n_floats;
    *w = malloc(sizeof(float) * (size_t)*n);
    memcpy(*w, tr.model.w, sizeof(float) * (size_t)*n);
    assert_int_equal(tr.model.be->ctl.scratch_grows(tr.model.be), 0);
    const int64_t u = used(tr.model.be);
    tera_trainer_free(&tr);
    unsetenv("TERA_PRODUCER_BF16");
    return u;
}

/* Whole runs of the tiny MoE (a dense first layer, a shared expert, routed experts side by side on two
 * threads): bf16 native with the producers equals it without them bit for bit (grad_accum 1 and 3,
 * full recomputation), and the products took copies in every run; the FMA units take none. */
static void test_training_same_bits(void **state) {
    (void)state;
    const struct {
        const char *units, *recompute;
        int accum;
    } runs[] = {{"native", "none", 1}, {"native", "full", 3}, {"fma", "none", 1}};
    for (int k = 0; k < 3; k++) {
        const int native = !strcmp(runs[k].units, "native");
        if (native && !be->caps.bf16_native(be)) continue;
        tera_config c = tu_tiny_moe_config(2, runs[k].accum);
        snprintf(c.training.precision, sizeof c.training.precision, "bf16");
        snprintf(c.training.bf16_gemm, sizeof c.training.bf16_gemm, "%s", runs[k].units);
        snprintf(c.training.recompute, sizeof c.training.recompute, "%s", runs[k].recompute);
        assert_int_equal(tera_config_finalize(&c), TERA_OK);
        double la[8], lb[8];
        float *wa, *wb;
        int64_t na, nb;
        const int64_t ua = train_run(&c, 1, la, &wa, &na), ub = train_run(&c, 0, lb, &wb, &nb);
        print_message("bf16/%s recompute %s accum %d: %ld operands from their producers, losses %.6f .. %.6f\n",
                      runs[k].units, runs[k].recompute, runs[k].accum, (long)ua, la[0], la[c.training.steps - 1]);
        if (native)
            assert_true(ua > 0);
        else
            assert_int_equal(ua, 0);
        assert_int_equal(ub, 0);
        assert_int_equal(na, nb);
        assert_memory_equal(la, lb, sizeof(double) * (size_t)c.training.steps);
        assert_same("weights after training", wa, wb, na);
        free(wa), free(wb);
    }
}

int main(void) {
    setenv("TERA_GEMM_PRIMITIVE_MIN", "100000", 1); /* read at the first product: small products reach the primitive */
    tera_set_threads(2);
    unsetenv("TERA_PRODUCER_BF16");
    be = tera_backend_cpu_create(-1);
    ref = tera_backend_cpu_create(-1);
    tera_cpu_producer_bf16((tera_cpu_matmul *)ref->impl, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_swiglu_forward),
        cmocka_unit_test(test_swiglu_backward),
        cmocka_unit_test(test_ce),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_items),
        cmocka_unit_test(test_training_same_bits),
    };
    const int failed = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(be);
    tera_backend_destroy(ref);
    return failed;
}
