/* The CPU backend: the table of include/tera/backend.h filled with the functions of
 * include/tera/kernels.h, host memory as its buffers, and its context (precision, bf16 units,
 * threads, conversion scratch) in the object. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "tera/kernels.h"
#include "tera/status.h"

typedef struct {
    tera_backend be; /* first: a tera_backend * is a cpu_backend * */
    tera_cpu_matmul mm;
} cpu_backend;

static cpu_backend *cpu_of(tera_backend *be) { return (cpu_backend *)be; }

/* The start of every op that writes memory: the calling thread's record of a producer's bf16 copies
 * (cpu.h, tera_cpu_prod) is good for the next op only, so each op takes and clears it (the products
 * in matmul.c take it for themselves; the producers below record their own after). */
static void take(tera_backend *be) { tera_cpu_prod_take(&cpu_of(be)->mm, NULL); }

static void cpu_gemm(tera_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    take(be);
    tera_gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static void cpu_linear_forward(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out, float beta) {
    tera_cpu_linear_forward(&cpu_of(be)->mm, y, x, w, N, in, out, beta);
}

static void cpu_linear_backward(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    tera_cpu_linear_backward(&cpu_of(be)->mm, dx, dw, dy, x, w, N, in, out, dx_beta, dw_beta);
}

static void cpu_linear_forward_multi(tera_backend *be, int n, float *const *y, const float *x, const float *const *w,
                                     const int64_t *out, int64_t N, int64_t in) {
    tera_cpu_linear_forward_multi(&cpu_of(be)->mm, n, y, x, w, out, N, in);
}

static void cpu_linear_backward_multi(tera_backend *be, int n, float *dx, float *const *dw, const float *const *dy,
                                      const float *x, const float *const *w, const int64_t *out, int64_t N, int64_t in,
                                      float dx_beta, float dw_beta) {
    tera_cpu_linear_backward_multi(&cpu_of(be)->mm, n, dx, dw, dy, x, w, out, N, in, dx_beta, dw_beta);
}

static void cpu_linear_forward_fp32(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out, float beta) {
    take(be);
    tera_linear_forward_fp32(y, x, w, N, in, out, beta);
}

static void cpu_linear_backward_fp32(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    take(be);
    tera_linear_backward_fp32(dx, dw, dy, x, w, N, in, out, dx_beta, dw_beta);
}

/* The start of a producer op with one output y[n] (tera_cpu_prod, cpu.h): the thread's record taken,
 * and the place of y's bf16 copy for the next product (NULL: none, the op writes fp32 only). */
static uint16_t *prod_out1(tera_backend *be, const float *y, int64_t n) {
    tera_cpu_matmul *mm = &cpu_of(be)->mm;
    tera_cpu_prod_take(mm, NULL);
    const float *src[1] = {y};
    int64_t off[1];
    uint16_t *s = tera_cpu_prod_out(mm, 1, src, &n, off);
    return s ? s + off[0] : NULL;
}

/* a producer: y is the input of the next products (q/k/v, the LM head) */
static void cpu_rmsnorm_forward(tera_backend *be, float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D, float eps) {
    tera_rmsnorm_forward_bf16(y, prod_out1(be, y, N * D), rstd, x, w, N, D, eps);
}

static void cpu_rmsnorm_backward(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w, const float *rstd, int64_t N, int64_t D) {
    take(be);
    tera_rmsnorm_backward(dx, dw, dy, x, w, rstd, N, D);
}

static void cpu_rope_tables(tera_backend *be, float *cos_t, float *sin_t, int T, int hd, float theta) {
    take(be);
    tera_rope_tables(cos_t, sin_t, T, hd, theta);
}

static void cpu_rope_forward(tera_backend *be, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd) {
    take(be);
    tera_rope_forward(x, cos_t, sin_t, B, T, nh, hd);
}

static void cpu_rope_backward(tera_backend *be, float *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd) {
    take(be);
    tera_rope_backward(dx, cos_t, sin_t, B, T, nh, hd);
}

/* Attention runs its products in bf16 on the native units when the linear layers do (attention.c),
 * on CPUs whose bf16 products beat the fp32 FMA: AMX, or AVX512-BF16 dot products that the probe
 * measures at least TERA_BF16_DOT_MARGIN times the FMA's multiply-adds (tera_cpu_bf16_dot_fast: an
 * AMD EPYC of this project's machines, 1.8x; there the bf16 kernels were measured 1.6x the fp32 ones
 * at head dim 64, docs/PERFORMANCE.md "Wave 9"). Elsewhere (dot products no faster than the FMA:
 * measured 0.66-0.82x the fp32 kernels' speed; oneDNN's AVX-512 emulation of bf16: 0.31-0.40x,
 * "Attention in bf16") it stays fp32 even when native bf16 products are forced. The
 * scratch is sized for both paths, since it is carved before the precision is set. */
static int cpu_attention_bf16_units(void) {
    return tera_attention_bf16_available() && (tera_cpu_bf16_fast(NULL) || tera_cpu_bf16_dot_fast());
}

static int cpu_attention_bf16(const tera_backend *be) {
    return be->precision == TERA_PREC_BF16 && be->bf16_gemm == TERA_BF16_NATIVE && cpu_attention_bf16_units();
}

static size_t cpu_attention_scratch_floats(tera_backend *be, int B, int T, int H, int Hkv, int hd) {
    (void)be;
    const size_t f = tera_attention_scratch_floats(B, T, H, Hkv, hd);
    const size_t h = cpu_attention_bf16_units() ? tera_attention_bf16_scratch_floats(B, T, H, Hkv, hd) : 0;
    return f > h ? f : h;
}

static void cpu_attention_forward(tera_backend *be, float *out, float *lse, const float *q, const float *k, const float *v, int B, int T, int H, int Hkv, int hd, float *scratch) {
    take(be);
    if (cpu_attention_bf16(be))
        tera_attention_forward_bf16(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
    else
        tera_attention_forward(out, lse, q, k, v, B, T, H, Hkv, hd, scratch);
}

static void cpu_attention_backward(tera_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k, const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv, int hd, float *scratch) {
    take(be);
    if (cpu_attention_bf16(be))
        tera_attention_backward_bf16(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
    else
        tera_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, scratch);
}

/* Producers (cpu.h, tera_cpu_prod): SwiGLU's g is the w2 product's input, its backward's da1 and da3
 * the gradients of the w1 and w3 products (linear_backward_multi), the cross-entropy's dlogits that of
 * the LM head (RMSNorm's output above: q/k/v's and the LM head's input); with bf16 on the native
 * units each writes the bf16 copies where those products look. */
static void cpu_swiglu_forward(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n) {
    tera_cpu_matmul *mm = &cpu_of(be)->mm;
    tera_cpu_prod_take(mm, NULL);
    const float *src[1] = {g};
    int64_t off[1];
    uint16_t *s = tera_cpu_prod_out(mm, 1, src, &n, off);
    tera_swiglu_forward_bf16(g, s ? s + off[0] : NULL, a1, a3, n);
}

/* The FFNs' g for products only (include/tera/backend.h): its bf16 rounding in place where the
 * products are bf16 on the native units (tera_cpu_act_bf16), else the fp32 ops */
static void cpu_swiglu_forward_act(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n) {
    if (!tera_cpu_act_bf16(&cpu_of(be)->mm)) {
        cpu_swiglu_forward(be, g, a1, a3, n);
        return;
    }
    take(be);
    tera_swiglu_forward_to_bf16((uint16_t *)g, a1, a3, n);
}

static void cpu_linear_forward_act(tera_backend *be, float *y, const float *g, const float *w, int64_t N, int64_t in,
                                   int64_t out, float beta) {
    tera_cpu_matmul *mm = &cpu_of(be)->mm;
    if (tera_cpu_act_bf16(mm))
        tera_cpu_linear_forward_x16(mm, y, (const uint16_t *)g, w, N, in, out, beta);
    else
        tera_cpu_linear_forward(mm, y, g, w, N, in, out, beta);
}

static void cpu_linear_backward_act(tera_backend *be, float *dx, float *dw, const float *dy, const float *g, const float *w,
                                    int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    tera_cpu_matmul *mm = &cpu_of(be)->mm;
    if (tera_cpu_act_bf16(mm))
        tera_cpu_linear_backward_x16(mm, dx, dw, dy, (const uint16_t *)g, w, N, in, out, dx_beta, dw_beta);
    else
        tera_cpu_linear_backward(mm, dx, dw, dy, g, w, N, in, out, dx_beta, dw_beta);
}

static void cpu_swiglu_backward(tera_backend *be, float *da1, float *da3, const float *dg, const float *a1, const float *a3, int64_t n) {
    tera_cpu_matmul *mm = &cpu_of(be)->mm;
    tera_cpu_prod_take(mm, NULL);
    const float *src[2] = {da1, da3};
    const int64_t len[2] = {n, n};
    int64_t off[2];
    uint16_t *s = tera_cpu_prod_out(mm, 2, src, len, off);
    tera_swiglu_backward_bf16(da1, da3, s ? s + off[0] : NULL, s ? s + off[1] : NULL, dg, a1, a3, n);
}

static void cpu_embedding_forward(tera_backend *be, float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D) {
    take(be);
    tera_embedding_forward(x, table, tokens, N, D);
}

static void cpu_embedding_backward(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D) {
    take(be);
    tera_embedding_backward(dtable, dx, tokens, N, D);
}

static void cpu_embedding_forward_range(tera_backend *be, float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D, int64_t v0, int64_t Vl) {
    take(be);
    tera_embedding_forward_range(x, table, tokens, N, D, v0, Vl);
}

static void cpu_embedding_backward_range(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D, int64_t v0, int64_t Vl) {
    take(be);
    tera_embedding_backward_range(dtable, dx, tokens, N, D, v0, Vl);
}

static void cpu_ce_slice_max(tera_backend *be, float *rowmax, const float *logits, int64_t N, int64_t Vl) {
    take(be);
    tera_ce_slice_max(rowmax, logits, N, Vl);
}

static void cpu_ce_slice_sums(tera_backend *be, float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0) {
    take(be);
    tera_ce_slice_sums(sumexp, tlogit, e, logits, rowmax, targets, N, Vl, v0);
}


static void cpu_ce_backward_range(tera_backend *be, float *dlogits, const float *e, const float *sumexp, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale) {
    tera_ce_backward_range_bf16(dlogits, prod_out1(be, dlogits, N * Vl), e, sumexp, targets, N, Vl, v0, scale);
}

static double cpu_ce_forward(tera_backend *be, float *lse, const float *logits, const int32_t *targets, int64_t N, int64_t V) {
    take(be);
    return tera_ce_forward(lse, logits, targets, N, V);
}

static void cpu_ce_backward(tera_backend *be, float *dlogits, const float *logits, const int32_t *targets, int64_t N, int64_t V, float scale) {
    tera_ce_backward_bf16(dlogits, prod_out1(be, dlogits, N * V), logits, targets, N, V, scale);
}

static void cpu_softmax_forward(tera_backend *be, float *probs, float *lse, const float *logits, int64_t N, int64_t E) {
    take(be);
    tera_softmax_forward(probs, lse, logits, N, E);
}

static void cpu_softmax_backward(tera_backend *be, float *dlogits, const float *dprobs, const float *probs, int64_t N, int64_t E) {
    take(be);
    tera_softmax_backward(dlogits, dprobs, probs, N, E);
}

static void cpu_moe_gather_forward(tera_backend *be, float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D) {
    take(be);
    tera_moe_gather_forward(xg, x, row_tok, R, D);
}

static void cpu_moe_gather_backward(tera_backend *be, float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    take(be);
    tera_moe_gather_backward(dx, dxg, slot_row, N, k, D);
}

static void cpu_moe_combine_forward(tera_backend *be, float *out, const float *ye, const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    take(be);
    tera_moe_combine_forward(out, ye, topw, slot_row, N, k, D);
}

static void cpu_moe_combine_backward(tera_backend *be, float *dye, float *dtopw, const float *dy, const float *ye, const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    take(be);
    tera_moe_combine_backward(dye, dtopw, dy, ye, topw, slot_row, N, k, D);
}

static void cpu_add_forward(tera_backend *be, float *y, const float *x, int64_t n) {
    take(be);
    tera_add_forward(y, x, n);
}

static void cpu_rmsnorm_copy_forward(tera_backend *be, float *y, float *rstd, float *xcopy, const float *x,
                                     const float *w, int64_t N, int64_t D, float eps) {
    take(be);
    tera_rmsnorm_copy_forward(y, rstd, xcopy, x, w, N, D, eps);
}

static void cpu_rope_qk_forward(tera_backend *be, float *q, float *k, const float *cos_t, const float *sin_t, int B,
                                int T, int H, int Hkv, int hd) {
    take(be);
    tera_rope_qk_forward(q, k, cos_t, sin_t, B, T, H, Hkv, hd);
}

static void cpu_rope_qk_backward(tera_backend *be, float *dq, float *dk, const float *cos_t, const float *sin_t, int B,
                                 int T, int H, int Hkv, int hd) {
    take(be);
    tera_rope_qk_backward(dq, dk, cos_t, sin_t, B, T, H, Hkv, hd);
}

static double cpu_ce_fused(tera_backend *be, float *dlogits, float *lse, float *tlogit, const float *logits,
                           const int32_t *targets, int64_t N, int64_t V, float scale) {
    return tera_ce_fused_bf16(dlogits, prod_out1(be, dlogits, N * V), lse, tlogit, logits, targets, N, V, scale);
}

static void cpu_fill_normal_block(tera_backend *be, float *w, int64_t numel, const int64_t *shape, const int64_t *lo, const int64_t *len, float std, uint64_t seed, uint64_t stream) {
    take(be);
    tera_fill_normal_block(w, numel, shape, lo, len, std, seed, stream);
}

static int cpu_max_threads(tera_backend *be) {
    (void)be;
    return tera_max_threads();
}

static int cpu_items_side_by_side(tera_backend *be, int n) {
    (void)be;
    return tera_items_side_by_side(n);
}

/* Work items run the caller's code, which calls ops on worker threads: a record made by an item's
 * last op is cleared when the item ends (its region ends too: cpu.h). */
typedef struct {
    tera_cpu_matmul *mm;
    void (*item)(void *ctx, int i);
    void (*range)(void *ctx, int64_t lo, int64_t hi, int worker);
    void *ctx;
} item_call;

static void item_tramp(void *p, int i) {
    const item_call *c = p;
    c->item(c->ctx, i);
    tera_cpu_prod_item_end(c->mm);
}

static void range_tramp(void *p, int64_t lo, int64_t hi, int worker) {
    const item_call *c = p;
    c->range(c->ctx, lo, hi, worker);
    tera_cpu_prod_item_end(c->mm);
}

static void cpu_for_each_item(tera_backend *be, int n, void (*fn)(void *ctx, int i), void *ctx) {
    take(be);
    item_call c = {.mm = &cpu_of(be)->mm, .item = fn, .ctx = ctx};
    tera_for_each_item(n, item_tramp, &c);
}

static void cpu_for_ranges(tera_backend *be, int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker),
                           void *ctx) {
    take(be);
    item_call c = {.mm = &cpu_of(be)->mm, .range = fn, .ctx = ctx};
    tera_for_ranges(n, range_tramp, &c);
}

static void *cpu_alloc(tera_backend *be, size_t bytes) {
    (void)be;
    return tera_malloc(bytes); /* 64-byte aligned */
}

static void cpu_free(tera_backend *be, void *p) {
    (void)be;
    free(p);
}

static int cpu_bf16_fast(const tera_backend *be, const char **isa_name) {
    (void)be;
    return tera_cpu_bf16_fast(isa_name);
}

static int cpu_bf16_native(const tera_backend *be) {
    (void)be;
    return tera_cpu_bf16_native();
}

static int cpu_bf16_has_dot(const tera_backend *be) {
    (void)be;
    return tera_cpu_bf16_has_dot();
}

static int cpu_bf16_probe(const tera_backend *be, double *fma_macs, double *dot_macs) {
    (void)be;
    return tera_cpu_bf16_probe(fma_macs, dot_macs);
}

static void cpu_set_precision(tera_backend *be, tera_precision p, tera_bf16_gemm g) {
    cpu_backend *c = cpu_of(be);
    be->precision = c->mm.prec = p;
    be->bf16_gemm = c->mm.bf16_gemm = g;
    tera_cpu_shadow_sync(&c->mm); /* allocated or freed for the new mode, never in a product */
    tera_cpu_prod_sync(&c->mm);
}

static void cpu_weights_register(tera_backend *be, const float *w, int64_t n) {
    tera_cpu_shadow_register(&cpu_of(be)->mm, w, n);
}

static void cpu_weights_begin(tera_backend *be, int changed) { tera_cpu_shadow_begin(&cpu_of(be)->mm, changed); }

static void cpu_weights_end(tera_backend *be) { tera_cpu_shadow_end(&cpu_of(be)->mm); }

static uint16_t *cpu_weights_shadow_out(tera_backend *be, const float *w, int64_t n) {
    return tera_cpu_shadow_out(&cpu_of(be)->mm, w, n);
}

static void cpu_weights_filled(tera_backend *be) { tera_cpu_shadow_filled(&cpu_of(be)->mm); }

static int64_t cpu_weights_shadow_bytes(const tera_backend *be) {
    const tera_cpu_shadow *s = &((const cpu_backend *)be)->mm.shadow;
    return s->w16 ? s->n * (int64_t)sizeof(uint16_t) : 0;
}

static void cpu_reserve(tera_backend *be, int64_t main_elems, int64_t thread_elems) {
    tera_cpu_matmul_reserve(&cpu_of(be)->mm, main_elems, thread_elems);
}

static int64_t cpu_scratch_grows(const tera_backend *be) { return ((const cpu_backend *)be)->mm.grows; }

static void cpu_destroy(tera_backend *be) {
    tera_cpu_matmul_release(&cpu_of(be)->mm);
    free(be);
}

tera_backend *tera_backend_cpu_create(int threads) {
    if (threads >= 0) tera_set_threads(threads);
    cpu_backend *c = tera_calloc(1, sizeof *c);
    tera_backend *be = &c->be;
    be->name = "cpu";
    be->ops = (tera_backend_ops){
        .gemm = cpu_gemm,
        .linear_forward = cpu_linear_forward,
        .linear_backward = cpu_linear_backward,
        .linear_forward_fp32 = cpu_linear_forward_fp32,
        .linear_backward_fp32 = cpu_linear_backward_fp32,
        .linear_forward_multi = cpu_linear_forward_multi,
        .linear_backward_multi = cpu_linear_backward_multi,
        .rmsnorm_forward = cpu_rmsnorm_forward,
        .rmsnorm_backward = cpu_rmsnorm_backward,
        .rope_tables = cpu_rope_tables,
        .rope_forward = cpu_rope_forward,
        .rope_backward = cpu_rope_backward,
        .attention_scratch_floats = cpu_attention_scratch_floats,
        .attention_forward = cpu_attention_forward,
        .attention_backward = cpu_attention_backward,
        .swiglu_forward = cpu_swiglu_forward,
        .swiglu_backward = cpu_swiglu_backward,
        .swiglu_forward_act = cpu_swiglu_forward_act,
        .linear_forward_act = cpu_linear_forward_act,
        .linear_backward_act = cpu_linear_backward_act,
        .embedding_forward = cpu_embedding_forward,
        .embedding_backward = cpu_embedding_backward,
        .embedding_forward_range = cpu_embedding_forward_range,
        .embedding_backward_range = cpu_embedding_backward_range,
        .ce_slice_max = cpu_ce_slice_max,
        .ce_slice_sums = cpu_ce_slice_sums,
        .ce_backward_range = cpu_ce_backward_range,
        .ce_forward = cpu_ce_forward,
        .ce_backward = cpu_ce_backward,
        .softmax_forward = cpu_softmax_forward,
        .softmax_backward = cpu_softmax_backward,
        .moe_gather_forward = cpu_moe_gather_forward,
        .moe_gather_backward = cpu_moe_gather_backward,
        .moe_combine_forward = cpu_moe_combine_forward,
        .moe_combine_backward = cpu_moe_combine_backward,
        .add_forward = cpu_add_forward,
        .rmsnorm_copy_forward = cpu_rmsnorm_copy_forward,
        .rope_qk_forward = cpu_rope_qk_forward,
        .rope_qk_backward = cpu_rope_qk_backward,
        .ce_fused = cpu_ce_fused,
        .fill_normal_block = cpu_fill_normal_block,
        .max_threads = cpu_max_threads,
        .items_side_by_side = cpu_items_side_by_side,
        .for_each_item = cpu_for_each_item,
        .for_ranges = cpu_for_ranges,
    };
    be->mem = (tera_backend_allocator){.alloc = cpu_alloc, .free = cpu_free};
    be->caps = (tera_backend_caps){.bf16_fast = cpu_bf16_fast, .bf16_has_dot = cpu_bf16_has_dot,
                                   .bf16_native = cpu_bf16_native,
                                   .bf16_probe = cpu_bf16_probe};
    be->ctl = (tera_backend_ctl){.set_precision = cpu_set_precision, .reserve = cpu_reserve,
                                 .scratch_grows = cpu_scratch_grows, .destroy = cpu_destroy,
                                 .weights_register = cpu_weights_register, .weights_begin = cpu_weights_begin,
                                 .weights_end = cpu_weights_end, .weights_shadow_bytes = cpu_weights_shadow_bytes,
                                 .weights_shadow_out = cpu_weights_shadow_out, .weights_filled = cpu_weights_filled};
    be->threads = tera_get_threads();
    be->impl = &c->mm;
    tera_cpu_prod_init(&c->mm);
    cpu_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    return be;
}
