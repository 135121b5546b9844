/* fp32 attention on AVX2 + FMA (attention_avx2.c): the register-blocked kernels of attention.c's
 * "fp32 on AVX-512" section, 8 lanes a vector, in every build whose compiler targets AVX2 and FMA
 * (x86-64-v3; -march=native on an AVX2-only CPU, and on AVX-512 CPUs, where they are selectable).
 * Defines ATTN_AVX2 there. attention.c runs the task loops (the same schedule, scratch layout and tile
 * edge as the AVX-512 kernels) and calls these for each task. */
#ifndef TERA_KERNELS_CPU_ATTENTION_AVX2_H
#define TERA_KERNELS_CPU_ATTENTION_AVX2_H

#include <stdint.h>

#include "attention_avx512.h"

/* Query and key tile edge of both register-blocked fp32 paths (attention.c's FT) */
#define ATTN_FP32_TILE 64
/* A row of their dense head-dim copies (Q, dO, dQ, O, K, V, dK, dV tiles): hd floats rounded up to 16,
 * as attention.c sizes the per-thread scratch */
#define ATTN_FP32_HDP(hd) (((int64_t)(hd) + 15) & ~(int64_t)15)

#if defined(__AVX2__) && defined(__FMA__)
#define ATTN_AVX2 1

/* Query tiles [qa, qb) of (b, h): out rows and their lse (lsum: [T], the head's running sums between
 * key chunks). kch key tiles per chunk; ws: the thread's block of attn_thread_floats(hd) floats. */
void tera_attn_avx2_forward_span(float *out, float *lse, float *lsum, const float *q, const float *k, const float *v,
                                 int b, int h, int qa, int qb, int T, int H, int Hkv, int hd, int kch, float *ws);
/* dQ of the query heads of kv head kvh and its dK, dV, for batch row b (D: [B,H,T] rowsum(dO * O)) */
void tera_attn_avx2_backward_group(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                   const float *v, const float *lse, const float *D, int b, int kvh, int T, int H,
                                   int Hkv, int hd, int kch, float *ws);
#endif

#endif
