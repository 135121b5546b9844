/* The CUDA backend's kernels (kernels.cu), launched on a stream; every pointer is device memory.
 * Shapes and semantics are those of the CPU function of the same name in include/tera/kernels.h.
 * C++ (nvcc) only: included by the backend's .cu files. */
#ifndef TERA_CUDA_KERNELS_H
#define TERA_CUDA_KERNELS_H

#include <cuda_runtime.h>
#include <stdint.h>

namespace tera_cuda {

/* operand roundings: bf16 (round to nearest even, NaN kept quiet; the CPU's bf16_scalar) and fp16 */
void round_bf16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n);
void round_fp16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n);

void rmsnorm_forward(cudaStream_t s, float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D,
                     float eps);
void rmsnorm_backward(cudaStream_t s, float *dx, float *dw, const float *dy, const float *x, const float *w,
                      const float *rstd, int64_t N, int64_t D);
void rope_apply(cudaStream_t s, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                float sign);
/* scratch: B*H*T floats (the backward's D = rowsum(dO * O)) */
void attention_forward(cudaStream_t s, float *out, float *lse, const float *q, const float *k, const float *v,
                       int B, int T, int H, int Hkv, int hd);
void attention_backward(cudaStream_t s, float *dq, float *dk, float *dv, const float *dout, const float *q,
                        const float *k, const float *v, const float *out, const float *lse, int B, int T, int H,
                        int Hkv, int hd, float *scratch);
void swiglu_forward(cudaStream_t s, float *g, const float *a1, const float *a3, int64_t n);
void swiglu_backward(cudaStream_t s, float *da1, float *da3, const float *dg, const float *a1, const float *a3,
                     int64_t n);
/* the full-table ops are the range ones with v0 = 0, Vl = INT64_MAX */
void embedding_forward_range(cudaStream_t s, float *x, const float *table, const int32_t *tokens, int64_t N,
                             int64_t D, int64_t v0, int64_t Vl);
void embedding_backward_range(cudaStream_t s, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                              int64_t D, int64_t v0, int64_t Vl);
void ce_slice_max(cudaStream_t s, float *rowmax, const float *logits, int64_t N, int64_t Vl);
/* the cross-entropy with one exponential per logit (include/tera/kernels.h): e (may be NULL, or logits)
 * = exp(logits - rowmax); dlogits = e * scale / sumexp - scale * onehot (may be e); ce_backward: both
 * for whole rows, each row's max and sum computed again (dlogits may be logits) */
void ce_slice_sums(cudaStream_t s, float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax,
                   const int32_t *targets, int64_t N, int64_t Vl, int64_t v0);
void ce_backward_range(cudaStream_t s, float *dlogits, const float *e, const float *sumexp,
                       const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale);
void ce_backward(cudaStream_t s, float *dlogits, const float *logits, const int32_t *targets, int64_t N, int64_t V,
                 float scale);
/* lse[N]; *sum (device, one double) = sum over rows of lse - target logit, in row order */
void ce_forward(cudaStream_t s, float *lse, double *sum, const float *logits, const int32_t *targets, int64_t N,
                int64_t V);
void softmax_forward(cudaStream_t s, float *probs, float *lse, const float *logits, int64_t N, int64_t E);
void softmax_backward(cudaStream_t s, float *dlogits, const float *dprobs, const float *probs, int64_t N,
                      int64_t E);
void moe_gather_forward(cudaStream_t s, float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D);
void moe_gather_backward(cudaStream_t s, float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k,
                         int64_t D);
void moe_combine_forward(cudaStream_t s, float *out, const float *ye, const float *topw, const int32_t *slot_row,
                         int64_t N, int k, int64_t D);
void moe_combine_backward(cudaStream_t s, float *dye, float *dtopw, const float *dy, const float *ye,
                          const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D);
void add_forward(cudaStream_t s, float *y, const float *x, int64_t n);

} // namespace tera_cuda

#endif
