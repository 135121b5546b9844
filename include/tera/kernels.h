/* Operations: an explicit forward and backward per operation, over raw row-major float arrays.
 * Conventions (as llm.c): activation gradients are written (=) unless the name or comment says
 * they accumulate; parameter gradients always accumulate (+=) so micro-batches add up.
 * Shapes use B batch, T sequence, D width, H/Hkv heads, hd head width, E experts, F hidden, V vocab,
 * N rows (= B*T tokens, or routed assignments). These are the CPU backend's implementation
 * (src/kernels/cpu/; matrix products through oneDNN): model code calls them through a backend
 * (include/tera/backend.h), which adds the context (precision, scratch) and the capability probes. */
#ifndef TERA_KERNELS_H
#define TERA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Sets the number of compute threads (OpenMP and oneDNN). 0 = all cores. */
void tera_set_threads(int n);
int tera_get_threads(void);

/* C[M,N] = alpha * op(A) * op(B) + beta * C, row-major, op(X) = X or X^T. */
void tera_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
               int64_t ldc);

/* Elementwise roundings used by the low-precision products (exposed for tests). */
void tera_round_bf16(uint16_t *dst, const float *src, int64_t n);
void tera_round_fp16(float *dst, const float *src, int64_t n);
void tera_round_bf16f(float *dst, const float *src, int64_t n); /* bf16 rounding, kept as fp32 values */
float tera_bf16_to_float(uint16_t h);

/* Linear layers: y[N,out] = x[N,in] w[out,in]^T  (beta = 0 writes, 1 accumulates into y).
 * Backward: dx[N,in] = (or += when dx_beta = 1) dy[N,out] w[out,in];  dw[out,in] = (or += when
 * dw_beta = 1) dy^T x (beta 0 does not read the old contents); dx or
 * dw may be NULL to skip that product. These are fp32; the products in the precision of a backend's
 * context are its ops.linear_forward / linear_backward (include/tera/backend.h). */
void tera_linear_forward_fp32(float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out,
                              float beta);
void tera_linear_backward_fp32(float *dx, float *dw, const float *dy, const float *x, const float *w,
                               int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);

/* y[N,D] = w[D] * x / sqrt(mean(x^2) + eps); rstd[N] saved for backward. */
void tera_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D,
                          float eps);
/* dx[N,D] += ..., dw[D] += ...  (dx accumulates: it is the residual stream's gradient) */
void tera_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                           const float *rstd, int64_t N, int64_t D);
/* The forward that also copies x to xcopy[N,D] in the same pass (the residual a block adds onto). */
void tera_rmsnorm_copy_forward(float *y, float *rstd, float *xcopy, const float *x, const float *w, int64_t N,
                               int64_t D, float eps);

/* cos/sin tables [T, hd/2] for positions 0..T-1 (HF Llama rotate-half convention). */
void tera_rope_tables(float *cos_t, float *sin_t, int T, int hd, float theta);
/* x[B,T,nh,hd] rotated in place; backward applies the inverse rotation to the gradient in place. */
void tera_rope_forward(float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd);
void tera_rope_backward(float *dx, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd);
/* q[B,T,H,hd] and k[B,T,Hkv,hd] in one pass: the same numbers as rope_forward (backward) on each. */
void tera_rope_qk_forward(float *q, float *k, const float *cos_t, const float *sin_t, int B, int T, int H, int Hkv,
                          int hd);
void tera_rope_qk_backward(float *dq, float *dk, const float *cos_t, const float *sin_t, int B, int T, int H,
                           int Hkv, int hd);

/* Causal grouped-query flash attention, tiled: memory O(T * tile) per thread, never a T x T matrix.
 * q: [B,T,H,hd]  k, v: [B,T,Hkv,hd]  out: [B,T,H,hd]  lse: [B,H,T] (log-sum-exp of the scaled
 * scores of each query row, saved for backward). scale = 1/sqrt(hd). H % Hkv == 0; query head h
 * uses kv head h / (H/Hkv). scratch: tera_attention_scratch_floats(...) floats. */
size_t tera_attention_scratch_floats(int B, int T, int H, int Hkv, int hd);
void tera_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                            int B, int T, int H, int Hkv, int hd, float *scratch);
/* dq: [B,T,H,hd], dk, dv: [B,T,Hkv,hd], all written (=). */
void tera_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *q,
                             const float *k, const float *v, const float *out, const float *lse,
                             int B, int T, int H, int Hkv, int hd, float *scratch);

/* g[n] = silu(a1[n]) * a3[n] over n elements;  backward writes da1, da3. */
void tera_swiglu_forward(float *g, const float *a1, const float *a3, int64_t n);
void tera_swiglu_backward(float *da1, float *da3, const float *dg, const float *a1, const float *a3,
                          int64_t n);

/* x[N,D] = table[tokens[n]];  backward: dtable[tokens[n]] += dx[n] (deterministic order). */
void tera_embedding_forward(float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D);
void tera_embedding_backward(float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D);

/* Vocabulary-parallel pieces: this rank holds rows [v0, v0 + Vl) of the table.
 * x[n] = table[tokens[n] - v0] for tokens in range, else 0 (the ranks' x sum to the lookup);
 * backward accumulates only rows in range. */
void tera_embedding_forward_range(float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D,
                                  int64_t v0, int64_t Vl);
void tera_embedding_backward_range(float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D,
                                   int64_t v0, int64_t Vl);
/* Cross-entropy over logits split by vocabulary (this rank: logits[N, Vl] of [v0, v0 + Vl)):
 * rowmax[N] = max of the slice; after the max over ranks, sumexp[N] = sum exp(x - rowmax) of the
 * slice, tlogit[N] = the target's logit when it is in the slice, else 0, and (e not NULL) the
 * exponentials themselves, e[N, Vl] = exp(logits - rowmax) (may alias logits); after sums over ranks
 * lse = rowmax + log(sumexp) and loss = lse - tlogit. */
void tera_ce_slice_max(float *rowmax, const float *logits, int64_t N, int64_t Vl);
void tera_ce_slice_sums(float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax,
                        const int32_t *targets, int64_t N, int64_t Vl, int64_t v0);
/* From those exponentials e[N, Vl] and the sums over ranks sumexp[N]: dlogits[N, Vl] = e * (scale /
 * sumexp) - scale * onehot = scale * (softmax - onehot) on the slice (may alias e). No exponential. */
void tera_ce_backward_range(float *dlogits, const float *e, const float *sumexp, const int32_t *targets,
                            int64_t N, int64_t Vl, int64_t v0, float scale);

/* Cross-entropy of logits[N,V] against targets[N]: writes lse[N], returns the sum of losses. */
double tera_ce_forward(float *lse, const float *logits, const int32_t *targets, int64_t N, int64_t V);
/* dlogits[N,V] = scale * (softmax(logits) - onehot(target)) (may alias logits), recomputing each row's
 * max and sum: e = exp(x - max) written to dlogits while summed (the sum bit-identical to
 * tera_ce_forward's), then dlogits = e * (scale / sum) - scale * onehot; one exponential per logit. */
void tera_ce_backward(float *dlogits, const float *logits, const int32_t *targets, int64_t N, int64_t V,
                      float scale);
/* Both in one pass over the logits: lse[N] and tlogit[N] (each row's target logit) written,
 * dlogits[N,V] = scale * (softmax - onehot) (may alias logits), returns the sum of losses; the same
 * bits as tera_ce_forward followed by tera_ce_backward, one exponential per logit. */
double tera_ce_fused(float *dlogits, float *lse, float *tlogit, const float *logits, const int32_t *targets,
                     int64_t N, int64_t V, float scale);

/* Row softmax: probs[N,E] and lse[N] from logits[N,E]; backward: dlogits = p * (dp - <dp,p>). */
void tera_softmax_forward(float *probs, float *lse, const float *logits, int64_t N, int64_t E);
void tera_softmax_backward(float *dlogits, const float *dprobs, const float *probs, int64_t N, int64_t E);

/* ---- MoE token movement: the row operations of a token dispatcher (src/model/dispatch.c) over
 * the plan of a micro-batch (tera_moe_plan): slot_row[N*k] is the grouped row of assignment
 * t*k + j (token t's j-th expert), -1 when dropped; row_tok[R] the token of each grouped row.
 * Each output row is written by one thread; a row summing several terms adds them in j order. */
/* Permute: xg[R,D], row r = x[row_tok[r]] (x: [N,D]). Backward: dx[N,D] += sum over token t's kept
 * assignments j of dxg[slot_row[t*k+j]] (dxg: [R,D]); dx accumulates. */
void tera_moe_gather_forward(float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D);
void tera_moe_gather_backward(float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k, int64_t D);
/* Combine: out[N,D] += sum_j topw[t,j] ye[slot_row[t*k+j]] (ye: [R,D] expert outputs, topw: [N,k]).
 * Backward: dye[R,D], row slot_row[t*k+j] = topw[t,j] dy[t] (each grouped row is one kept assignment's);
 * dtopw[N,k] = <dy[t], ye[slot_row[t*k+j]]>, 0 when dropped (both written). dy: [N,D] */
void tera_moe_combine_forward(float *out, const float *ye, const float *topw, const int32_t *slot_row, int64_t N,
                              int k, int64_t D);
void tera_moe_combine_backward(float *dye, float *dtopw, const float *dy, const float *ye, const float *topw,
                               const int32_t *slot_row, int64_t N, int k, int64_t D);

/* Residual add: y[n] += x[n]. Its backward is the identity (the gradient reaches both inputs
 * unchanged): no kernel. */
void tera_add_forward(float *y, const float *x, int64_t n);

/* ---- Scheduling (the CPU backend's threads) */
/* Threads a parallel region started now would use: per-thread scratch is sized for this. */
int tera_max_threads(void);
/* Independent work items (the experts of a MoE layer): 1 when n of them are better run side by side,
 * each on one thread with single-threaded products (at least two items per thread), 0 when one after
 * another, each product using every thread. Both give the same numbers. */
int tera_items_side_by_side(int n);
/* Calls fn(ctx, i) once for every i in [0, n), side by side: items are handed out one at a time in
 * index order (so list the largest first), each call runs on exactly one thread, and the kernels it
 * calls run single-threaded inside it. */
void tera_for_each_item(int n, void (*fn)(void *ctx, int i), void *ctx);
/* Calls fn(ctx, lo, hi, worker) for contiguous ranges [lo, hi) that partition [0, n), side by side,
 * worker in [0, tera_max_threads()) naming the thread (for per-thread scratch); the ranges are
 * OpenMP's static schedule. For loops whose iterations are independent (router rows): the numbers
 * do not depend on the partition. */
void tera_for_ranges(int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker), void *ctx);

/* ---- Initialisation: the block [lo, lo + len) (numel = len[0] len[1] len[2] elements, row major)
 * of a tensor of shape[3], element g of the whole tensor = std * tera_rng_normal(seed, stream, g). */
void tera_fill_normal_block(float *w, int64_t numel, const int64_t *shape, const int64_t *lo, const int64_t *len,
                            float std, uint64_t seed, uint64_t stream);

#endif
