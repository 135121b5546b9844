/* Compute backend: the object model code computes through. A backend is a table of operations (the
 * forward and backward of every layer piece the model composes), an allocator for its buffers, and
 * its context: the precision of the linear layers' products, the units bf16 products run on, the
 * thread count and the conversion scratch. Precision is a property of the backend object, not of
 * the process: two backends may run different precisions side by side.
 *
 * The CPU backend (tera_backend_cpu_create, src/kernels/cpu/backend_cpu.c) fills the table with the
 * functions of include/tera/kernels.h (oneDNN products, OpenMP loops) and allocates aligned host
 * memory. Another backend (CUDA, issue 21) fills the same table with its own kernels over device
 * buffers from its allocator; model code does not change. The semantics of each operation (shapes,
 * which outputs are written and which accumulate) are those of the CPU function of the same name in
 * include/tera/kernels.h.
 *
 * One rule on the caller: an op's output that the next op on the same thread takes as a product's
 * operand is not written between the two except through ops (the CPU backend's producers hand that
 * product a bf16 copy of it: SwiGLU's outputs, the cross-entropy's loss gradient; src/kernels/cpu/cpu.h,
 * tera_cpu_prod; any op in between makes the product round the array itself). */
#ifndef TERA_BACKEND_H
#define TERA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "tera/status.h"

/* Precision of the linear layers' products (ops.linear_forward / linear_backward). FP32: fp32
 * throughout. BF16: the operands are rounded to bf16 (round to nearest even) and multiplied with
 * fp32 accumulation into the fp32 output (on the units bf16_gemm names). FP16: the operands are
 * rounded to fp16 (values beyond +-65504 become inf) and multiplied in fp32 (the CPU backend
 * emulates: oneDNN has no f16 matmul on CPUs in this version; the products of fp16 values are exact
 * in fp32, so only the accumulation order differs from an fp16 unit). ops.gemm and the *_fp32
 * variants (the router) always run in fp32. Attention (ops.attention_*) runs in fp32, except BF16 on
 * native units where the CPU has AMX or a bf16 dot product faster than its FMA (the probe): its six
 * products per tile take bf16 operands with fp32 accumulation, its softmax statistics and dS stay
 * fp32 (src/kernels/cpu/attention.c, attention_dot.c; TERA_ATTN_BF16=0 keeps fp32). */
typedef enum { TERA_PREC_FP32 = 0, TERA_PREC_BF16, TERA_PREC_FP16 } tera_precision;
const char *tera_precision_name(tera_precision p);
/* Which units run the bf16 products (the numbers are the same up to the order of the fp32 sums: the
 * product of two bf16 values is exact in fp32). NATIVE: bf16 operand arrays through bf16 kernels
 * (on CPUs oneDNN's: AMX tiles, or AVX512-BF16 dot products). FMA: the operands rounded to bf16 and
 * kept as fp32 values, multiplied by the fp32 FMA kernels; for CPUs whose bf16 dot product issues
 * fewer multiply-adds per cycle than their FMA units (caps.bf16_probe). */
typedef enum { TERA_BF16_NATIVE = 0, TERA_BF16_FMA } tera_bf16_gemm;

typedef struct tera_backend tera_backend;

/* The operations. Every one takes the backend first; arrays are the backend's buffers. */
typedef struct {
    /* C[M,N] = alpha * op(A) * op(B) + beta * C, row-major, op(X) = X or X^T; always fp32. */
    void (*gemm)(tera_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
    /* linear layers in the backend's precision; the _fp32 ones always in fp32 (the router).
     * Backward: dx[N,in] = dx_beta dx + dy[N,out] w[out,in], dw[out,in] = dw_beta dw + dy^T x, each
     * skipped where NULL; a beta of 0 stores without reading the old contents (which may be anything,
     * NaN included): the first micro-batch's weight gradients are stored rather than added to cleared
     * buffers (tera_model_grads_stale, include/tera/model.h). */
    void (*linear_forward)(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in,
                           int64_t out, float beta);
    void (*linear_backward)(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w,
                            int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);
    void (*linear_forward_fp32)(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in,
                                int64_t out, float beta);
    void (*linear_backward_fp32)(tera_backend *be, float *dx, float *dw, const float *dy, const float *x,
                                 const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);
    /* Several products of one input x[N,in] (q, k and v of the same normed rows; an FFN's gate and
     * up projections), in the backend's precision: forward y[i][N,out[i]] = x w[i][out[i],in]^T for
     * i < n (written); backward, for i = 0..n-1 in turn, dx[N,in] = (i == 0 ? dx_beta : 1) * dx +
     * dy[i][N,out[i]] w[i] and dw[i][out[i],in] = dw_beta dw[i] + dy[i]^T x. The same bits as n calls of
     * linear_forward (beta 0) / linear_backward; x is converted once. NULL where a backend has none:
     * tera_linear_forward_multi / tera_linear_backward_multi below then make the n calls. */
    void (*linear_forward_multi)(tera_backend *be, int n, float *const *y, const float *x, const float *const *w,
                                 const int64_t *out, int64_t N, int64_t in);
    void (*linear_backward_multi)(tera_backend *be, int n, float *dx, float *const *dw, const float *const *dy,
                                  const float *x, const float *const *w, const int64_t *out, int64_t N, int64_t in,
                                  float dx_beta, float dw_beta);
    void (*rmsnorm_forward)(tera_backend *be, float *y, float *rstd, const float *x, const float *w, int64_t N,
                            int64_t D, float eps);
    void (*rmsnorm_backward)(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w,
                             const float *rstd, int64_t N, int64_t D);
    void (*rope_tables)(tera_backend *be, float *cos_t, float *sin_t, int T, int hd, float theta);
    void (*rope_forward)(tera_backend *be, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh,
                         int hd);
    void (*rope_backward)(tera_backend *be, float *dx, const float *cos_t, const float *sin_t, int B, int T, int nh,
                          int hd);
    size_t (*attention_scratch_floats)(tera_backend *be, int B, int T, int H, int Hkv, int hd);
    void (*attention_forward)(tera_backend *be, float *out, float *lse, const float *q, const float *k,
                              const float *v, int B, int T, int H, int Hkv, int hd, float *scratch);
    void (*attention_backward)(tera_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *q,
                               const float *k, const float *v, const float *out, const float *lse, int B, int T,
                               int H, int Hkv, int hd, float *scratch);
    void (*swiglu_forward)(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n);
    /* An FFN's hidden activations g[n] kept for products only (the down projection's input, and in
     * the backward its weight gradient's): swiglu_forward_act writes g in the backend's product
     * format, which linear_forward_act / linear_backward_act read as their x [N,in]. The CPU backend's
     * format is bf16 where its products are bf16 on the native units (each value the rounding of
     * swiglu_forward's fp32 g, in the first 2n bytes of g; the rest of g untouched), else fp32: the
     * same numbers as swiglu_forward, linear_forward and linear_backward on the fp32 g, without the
     * fp32 g written in the forward and rounded again in the backward. The format holds while the
     * precision does (from a forward to its backward). NULL where a backend has none:
     * tera_swiglu_forward_act etc. below then call those three. */
    void (*swiglu_forward_act)(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n);
    void (*linear_forward_act)(tera_backend *be, float *y, const float *g, const float *w, int64_t N, int64_t in,
                               int64_t out, float beta);
    void (*linear_backward_act)(tera_backend *be, float *dx, float *dw, const float *dy, const float *g,
                                const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);
    void (*swiglu_backward)(tera_backend *be, float *da1, float *da3, const float *dg, const float *a1,
                            const float *a3, int64_t n);
    void (*embedding_forward)(tera_backend *be, float *x, const float *table, const int32_t *tokens, int64_t N,
                              int64_t D);
    void (*embedding_backward)(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                               int64_t D);
    void (*embedding_forward_range)(tera_backend *be, float *x, const float *table, const int32_t *tokens,
                                    int64_t N, int64_t D, int64_t v0, int64_t Vl);
    void (*embedding_backward_range)(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens,
                                     int64_t N, int64_t D, int64_t v0, int64_t Vl);
    void (*ce_slice_max)(tera_backend *be, float *rowmax, const float *logits, int64_t N, int64_t Vl);
    /* the cross-entropy with one exponential per logit (include/tera/kernels.h): ce_slice_sums writes
     * e = exp(logits - rowmax) where e is not NULL (may alias logits), ce_backward_range scales those
     * (dlogits = e * scale / sumexp - scale * onehot, may alias e), ce_backward recomputes each row's max
     * and sum itself (the same bits as ce_fused's dlogits) */
    void (*ce_slice_sums)(tera_backend *be, float *sumexp, float *tlogit, float *e, const float *logits,
                          const float *rowmax, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0);
    void (*ce_backward_range)(tera_backend *be, float *dlogits, const float *e, const float *sumexp,
                              const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale);
    double (*ce_forward)(tera_backend *be, float *lse, const float *logits, const int32_t *targets, int64_t N,
                         int64_t V);
    void (*ce_backward)(tera_backend *be, float *dlogits, const float *logits, const int32_t *targets, int64_t N,
                        int64_t V, float scale);
    void (*softmax_forward)(tera_backend *be, float *probs, float *lse, const float *logits, int64_t N, int64_t E);
    void (*softmax_backward)(tera_backend *be, float *dlogits, const float *dprobs, const float *probs, int64_t N,
                             int64_t E);
    /* MoE token movement (src/kernels/cpu/tokens.c) */
    void (*moe_gather_forward)(tera_backend *be, float *xg, const float *x, const int32_t *row_tok, int64_t R,
                               int64_t D);
    void (*moe_gather_backward)(tera_backend *be, float *dx, const float *dxg, const int32_t *slot_row, int64_t N,
                                int k, int64_t D);
    void (*moe_combine_forward)(tera_backend *be, float *out, const float *ye, const float *topw,
                                const int32_t *slot_row, int64_t N, int k, int64_t D);
    void (*moe_combine_backward)(tera_backend *be, float *dye, float *dtopw, const float *dy, const float *ye,
                                 const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D);
    void (*add_forward)(tera_backend *be, float *y, const float *x, int64_t n);
    /* Fused passes (include/tera/kernels.h: tera_rmsnorm_copy_forward, tera_rope_qk_*, tera_ce_fused):
     * the same numbers as the separate operations, fewer passes over memory. NULL where a backend has
     * none: the model then calls the separate operations. */
    void (*rmsnorm_copy_forward)(tera_backend *be, float *y, float *rstd, float *xcopy, const float *x,
                                 const float *w, int64_t N, int64_t D, float eps);
    void (*rope_qk_forward)(tera_backend *be, float *q, float *k, const float *cos_t, const float *sin_t, int B,
                            int T, int H, int Hkv, int hd);
    void (*rope_qk_backward)(tera_backend *be, float *dq, float *dk, const float *cos_t, const float *sin_t, int B,
                             int T, int H, int Hkv, int hd);
    double (*ce_fused)(tera_backend *be, float *dlogits, float *lse, float *tlogit, const float *logits,
                       const int32_t *targets, int64_t N, int64_t V, float scale);
    /* parameter initialisation (tera_fill_normal_block) */
    void (*fill_normal_block)(tera_backend *be, float *w, int64_t numel, const int64_t *shape, const int64_t *lo,
                              const int64_t *len, float std, uint64_t seed, uint64_t stream);
    /* scheduling of independent work items (the experts of a MoE layer): tera_max_threads,
     * tera_items_side_by_side, tera_for_each_item */
    int (*max_threads)(tera_backend *be);
    int (*items_side_by_side)(tera_backend *be, int n);
    void (*for_each_item)(tera_backend *be, int n, void (*fn)(void *ctx, int i), void *ctx);
    /* independent rows of host-side loops (the router's scores, top-k, plan and backward):
     * tera_for_ranges (contiguous ranges, worker < max_threads for per-thread scratch) */
    void (*for_ranges)(tera_backend *be, int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker),
                       void *ctx);
} tera_backend_ops;

/* The backend's buffers (on the CPU: 64-byte aligned host memory). */
typedef struct {
    void *(*alloc)(tera_backend *be, size_t bytes);
    void (*free)(tera_backend *be, void *p);
} tera_backend_allocator;

/* Capabilities: what the hardware behind a backend offers (the CPU backend: oneDNN's ISA). */
typedef struct {
    /* 1 when bf16 products are faster than fp32 (CPU: oneDNN reports AMX); isa_name (may be NULL)
     * receives the ISA the backend dispatches to. */
    int (*bf16_fast)(const tera_backend *be, const char **isa_name);
    /* 1 when the backend has native bf16 products at all (CPU: oneDNN's bf16 GEMM needs AVX-512). */
    int (*bf16_native)(const tera_backend *be);
    /* 1 when bf16 products run on dot-product instructions (CPU: AVX512-BF16 or AMX). */
    int (*bf16_has_dot)(const tera_backend *be);
    /* Multiply-adds per second of one core's vector FMA and bf16 dot product (a few ms, best of 3);
     * 0 (both 0) where there is no such instruction. */
    int (*bf16_probe)(const tera_backend *be, double *fma_macs, double *dot_macs);
} tera_backend_caps;

/* Context control. */
typedef struct {
    /* Precision of the linear products and the bf16 units (before reserve). */
    void (*set_precision)(tera_backend *be, tera_precision p, tera_bf16_gemm g);
    /* Conversion scratch, allocated once (not per call): main_elems operand elements (both
     * operands of a product together) for products outside parallel work items, thread_elems for
     * each other thread. A product that needs more grows its buffer and counts in scratch_grows
     * (a test checks that it stays 0 over a run). */
    void (*reserve)(tera_backend *be, int64_t main_elems, int64_t thread_elems);
    int64_t (*scratch_grows)(const tera_backend *be);
    /* The bf16 shadow of the resident weights (CPU backend, bf16 on the native units): a bf16 copy
     * of a registered fp32 buffer (2 bytes per element, allocated once when both a buffer is
     * registered and the precision is bf16 native; TERA_BF16_SHADOW=0 turns it off for A/B timing),
     * so that linear_* round each weight once per change instead of on every call. The trainer
     * registers the model's parameters when at least 4 micro-batches of a step share them
     * (training.grad_accum >= 4, no pipeline): with one or two forwards and backwards per change,
     * rounding the copy lazily was measured to cost more (memory traffic) than the rounding it saves
     * (docs/PERFORMANCE.md, "Operands rounded once"); and at any grad_accum where the AdamW update
     * writes it (ZeRO-0, no pipeline: weights_shadow_out below). It is used only inside a window:
     * weights_begin(be, changed) opens one (the model: at the start of every forward with
     * changed = 1 unless tera_model_weights_unchanged said otherwise, of every backward with
     * changed = 0: the weights are those of the forward), weights_end closes it; changed = 1 marks
     * every element stale, and an element is rounded again at its first use in a product (blocks
     * of a few thousand elements). Between weights_begin and weights_end the registered buffer
     * must hold the current weights and must not change; outside a window (the decoder, benchmarks, any other caller) and for weights
     * outside the buffer (ZeRO-3's gathered groups) products round on the fly. The numbers are the
     * same bits either way (rounding is deterministic). NULL where a backend has none. */
    void (*weights_register)(tera_backend *be, const float *w, int64_t n); /* w = NULL: none */
    void (*weights_begin)(tera_backend *be, int changed);
    void (*weights_end)(tera_backend *be);
    int64_t (*weights_shadow_bytes)(const tera_backend *be); /* 0 when there is none */
    /* The shadow written by the optimizer's update pass, so that the next forward needs no rounding
     * (one micro-batch a step pays too). weights_shadow_out(be, w, n): the shadow itself (w16[n])
     * when w[n] is the registered buffer, a shadow exists and no window is open, else NULL; the
     * caller then writes w16[i] = the bf16 rounding of its new w[i] (round to nearest even on the
     * bit pattern, NaN kept quiet: the products' rounding) for every i, and says so with
     * weights_filled: the next window keeps every element even when opened with changed = 1 (once:
     * any window clears it). Between weights_filled and that window the buffer must not change.
     * NULL where a backend has none. */
    uint16_t *(*weights_shadow_out)(tera_backend *be, const float *w, int64_t n);
    void (*weights_filled)(tera_backend *be);
    void (*destroy)(tera_backend *be); /* frees the scratch and the object */
} tera_backend_ctl;

struct tera_backend {
    const char *name; /* "cpu" */
    tera_backend_ops ops;
    tera_backend_allocator mem;
    tera_backend_caps caps;
    tera_backend_ctl ctl;
    /* context (read-only outside the backend: set through ctl) */
    tera_precision precision;
    tera_bf16_gemm bf16_gemm;
    int threads;
    void *impl; /* the implementation's state (CPU: conversion scratch) */
};

/* The CPU backend. threads: compute threads (OpenMP and oneDNN) it sets, 0 = all cores, -1 = the
 * process's current setting kept. Precision fp32 until set. */
tera_backend *tera_backend_cpu_create(int threads);
/* The backend training.device names: "cpu" (tera_backend_cpu_create) or "cuda" (src/kernels/cuda/,
 * where the build has it). An unknown name, or cuda in a build without CUDA or on a machine without
 * a device, is a config error naming the key (src/kernels/device.c). */
tera_status tera_backend_for_device(const char *device, int threads, tera_backend **out);

static inline void tera_backend_destroy(tera_backend *be) {
    if (be) be->ctl.destroy(be);
}
static inline void tera_backend_set_precision(tera_backend *be, tera_precision p, tera_bf16_gemm g) {
    be->ctl.set_precision(be, p, g);
}
static inline void tera_backend_reserve(tera_backend *be, int64_t main_elems, int64_t thread_elems) {
    be->ctl.reserve(be, main_elems, thread_elems);
}
static inline void tera_backend_weights_register(tera_backend *be, const float *w, int64_t n) {
    if (be->ctl.weights_register) be->ctl.weights_register(be, w, n);
}
static inline void tera_backend_weights_begin(tera_backend *be, int changed) {
    if (be->ctl.weights_begin) be->ctl.weights_begin(be, changed);
}
static inline void tera_backend_weights_end(tera_backend *be) {
    if (be->ctl.weights_end) be->ctl.weights_end(be);
}
static inline int64_t tera_backend_weights_shadow_bytes(const tera_backend *be) {
    return be->ctl.weights_shadow_bytes ? be->ctl.weights_shadow_bytes(be) : 0;
}
static inline uint16_t *tera_backend_weights_shadow_out(tera_backend *be, const float *w, int64_t n) {
    return be && be->ctl.weights_shadow_out ? be->ctl.weights_shadow_out(be, w, n) : NULL;
}
static inline void tera_backend_weights_filled(tera_backend *be) {
    if (be && be->ctl.weights_filled) be->ctl.weights_filled(be);
}
/* ops.swiglu_forward_act / linear_forward_act / linear_backward_act (g [N*in] in the backend's
 * product format), or swiglu_forward / linear_forward / linear_backward on the fp32 g where a backend
 * has none */
static inline void tera_swiglu_forward_act(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n) {
    if (be->ops.swiglu_forward_act)
        be->ops.swiglu_forward_act(be, g, a1, a3, n);
    else
        be->ops.swiglu_forward(be, g, a1, a3, n);
}
static inline void tera_linear_forward_act(tera_backend *be, float *y, const float *g, const float *w, int64_t N,
                                           int64_t in, int64_t out, float beta) {
    if (be->ops.linear_forward_act)
        be->ops.linear_forward_act(be, y, g, w, N, in, out, beta);
    else
        be->ops.linear_forward(be, y, g, w, N, in, out, beta);
}
static inline void tera_linear_backward_act(tera_backend *be, float *dx, float *dw, const float *dy, const float *g,
                                            const float *w, int64_t N, int64_t in, int64_t out, float dx_beta,
                                            float dw_beta) {
    if (be->ops.linear_backward_act)
        be->ops.linear_backward_act(be, dx, dw, dy, g, w, N, in, out, dx_beta, dw_beta);
    else
        be->ops.linear_backward(be, dx, dw, dy, g, w, N, in, out, dx_beta, dw_beta);
}
/* ops.linear_forward_multi / linear_backward_multi, or the n single products where a backend has
 * none. y: n outputs [N,out[i]]; w: n weights [out[i],in]; dy: n gradients [N,out[i]]; dw: n
 * weight gradients [out[i],in]; x [N,in]; dx [N,in]. */
static inline void tera_linear_forward_multi(tera_backend *be, int n, float *const *y, const float *x,
                                             const float *const *w, const int64_t *out, int64_t N, int64_t in) {
    if (be->ops.linear_forward_multi) {
        be->ops.linear_forward_multi(be, n, y, x, w, out, N, in);
        return;
    }
    for (int i = 0; i < n; i++) be->ops.linear_forward(be, y[i], x, w[i], N, in, out[i], 0.0f);
}
static inline void tera_linear_backward_multi(tera_backend *be, int n, float *dx, float *const *dw,
                                              const float *const *dy, const float *x, const float *const *w,
                                              const int64_t *out, int64_t N, int64_t in, float dx_beta,
                                              float dw_beta) {
    if (be->ops.linear_backward_multi) {
        be->ops.linear_backward_multi(be, n, dx, dw, dy, x, w, out, N, in, dx_beta, dw_beta);
        return;
    }
    for (int i = 0; i < n; i++)
        be->ops.linear_backward(be, dx, dw[i], dy[i], x, w[i], N, in, out[i], i == 0 ? dx_beta : 1.0f, dw_beta);
}

#endif
