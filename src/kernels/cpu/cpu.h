/* The CPU backend's internals (src/kernels/cpu only): the context of its matrix products (precision,
 * bf16 units, per-thread conversion scratch) and the functions that take it. Everything else the
 * CPU backend runs is declared in include/tera/kernels.h. */
#ifndef TERA_KERNELS_CPU_H
#define TERA_KERNELS_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "tera/backend.h"

#define TERA_CPU_SCRATCH_THREADS 256
typedef struct {
    void *p;
    size_t bytes;
} tera_cpu_scratch_buf;

/* The bf16 shadow of the registered weights (include/tera/backend.h, ctl.weights_*): w16[i] is the
 * bf16 rounding of base[i] for every element of a block whose stamp equals epoch; a stamp of -epoch
 * marks a block one thread is rounding now (the others wait for it). */
typedef struct {
    const float *base;  /* the registered buffer [n], NULL when none */
    int64_t n;
    uint16_t *w16;      /* [n], NULL when off (not bf16 native, nothing registered, TERA_BF16_SHADOW=0) */
    int64_t *stamp;     /* [nblocks] */
    int64_t nblocks;
    int64_t epoch;      /* >= 1 */
    int active;         /* inside a window (weights_begin .. weights_end) */
    int filled;         /* weights_filled: every block current; the next window keeps them */
    int check;          /* verify a filled shadow when the next window opens (ASan builds, TERA_BF16_SHADOW_CHECK=1) */
    int fill;           /* weights_shadow_out hands it out (TERA_BF16_SHADOW_FILL=0: never, the lazy rounding only) */
} tera_cpu_shadow;

/* Operands written by their producers (bf16 on the native units): an op whose output is the next
 * product's activation operand (SwiGLU's g for w2, its backward's da1 and da3 for w1 and w3, the
 * cross-entropy's dlogits for the LM head, RMSNorm's output for q/k/v and the LM head) writes the bf16 rounding of each output element beside the
 * fp32 value, into the calling thread's conversion scratch where that product's rounding would put it
 * (the first operand at element 0, the second after it at an even element), and records it here.
 * The record is good for the next op on the same thread only: every op of the backend starts by
 * taking and clearing its thread's record (tera_cpu_prod_take), so any op in between, an op that
 * writes the array in place included, leaves the product to round the fp32 array as before; a
 * product uses a copy only for the very arrays (pointer and length) recorded, and only when that
 * record was made in the same region (region: advanced by every op outside parallel regions, so a
 * record of a worker thread never outlives its work item's parallel region). */
#define TERA_CPU_PROD_MAX 2
typedef struct {
    const float *src[TERA_CPU_PROD_MAX]; /* the fp32 arrays written */
    int64_t n[TERA_CPU_PROD_MAX];        /* their lengths */
    int64_t off[TERA_CPU_PROD_MAX];      /* their bf16 copies: elements into the thread's scratch */
    int64_t region;                      /* mm->prod_region when recorded */
    int count;                           /* 0: nothing recorded */
    char pad[64 - (3 * TERA_CPU_PROD_MAX + 1) * 8 % 64 - sizeof(int)]; /* one cache line per thread */
} tera_cpu_prod;

typedef struct {
    tera_precision prec;
    tera_bf16_gemm bf16_gemm;
    tera_cpu_scratch_buf scratch[TERA_CPU_SCRATCH_THREADS]; /* thread 0: outside parallel regions */
    int64_t grows;                                          /* products that outgrew their scratch */
    tera_cpu_shadow shadow;
    tera_cpu_prod prod[TERA_CPU_SCRATCH_THREADS]; /* per thread, as the scratch */
    int64_t prod_region;
    int prod_off;      /* producers write no bf16 copies (TERA_PRODUCER_BF16=0 at creation, A/B);
                        * else they do whenever the precision is bf16 on the native units */
    int prod_check;    /* verify every copy a product uses, element by element (ASan builds,
                        * TERA_PRODUCER_BF16_CHECK=1); else a few elements of each */
    int64_t prod_used; /* operands products took from their producers (tests) */
    int act_off;       /* the FFNs' g kept as fp32 even with bf16 products (TERA_ACT_BF16=0 at creation, A/B) */
} tera_cpu_matmul;

/* The CPU backend's ops.linear_forward / linear_backward (include/tera/backend.h): the products of
 * tera_linear_forward_fp32 / backward_fp32 (include/tera/kernels.h) in the precision of mm. */
void tera_cpu_linear_forward(tera_cpu_matmul *mm, float *y, const float *x, const float *w, int64_t N, int64_t in,
                             int64_t out, float beta);
void tera_cpu_linear_backward(tera_cpu_matmul *mm, float *dx, float *dw, const float *dy, const float *x,
                              const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);
/* The format of the FFNs' g between ops.swiglu_forward_act and the products that read it
 * (include/tera/backend.h): 1 for bf16 (bf16 products on the native units, unless act_off), 0 fp32.
 * tera_cpu_linear_forward_x16 / backward_x16: ops.linear_forward_act / backward_act with x [N,in]
 * given as its bf16 rounding (the same products as tera_cpu_linear_forward / backward on x). */
int tera_cpu_act_bf16(const tera_cpu_matmul *mm);
void tera_cpu_linear_forward_x16(tera_cpu_matmul *mm, float *y, const uint16_t *x16, const float *w, int64_t N,
                                 int64_t in, int64_t out, float beta);
void tera_cpu_linear_backward_x16(tera_cpu_matmul *mm, float *dx, float *dw, const float *dy, const uint16_t *x16,
                                  const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta);
/* ops.linear_forward_multi / linear_backward_multi (include/tera/backend.h): x converted once. */
void tera_cpu_linear_forward_multi(tera_cpu_matmul *mm, int n, float *const *y, const float *x,
                                   const float *const *w, const int64_t *out, int64_t N, int64_t in);
void tera_cpu_linear_backward_multi(tera_cpu_matmul *mm, int n, float *dx, float *const *dw, const float *const *dy,
                                    const float *x, const float *const *w, const int64_t *out, int64_t N, int64_t in,
                                    float dx_beta, float dw_beta);
/* Set the precision and units first. */
void tera_cpu_matmul_reserve(tera_cpu_matmul *mm, int64_t main_elems, int64_t thread_elems);
void tera_cpu_matmul_release(tera_cpu_matmul *mm); /* the scratch and the shadow */
/* The weight shadow (ctl.weights_*): register a buffer (NULL: none); sync allocates or frees the
 * shadow after a change of precision or registration (allocation happens here only, never in a
 * product). */
void tera_cpu_shadow_register(tera_cpu_matmul *mm, const float *w, int64_t n);
void tera_cpu_shadow_sync(tera_cpu_matmul *mm);
void tera_cpu_shadow_begin(tera_cpu_matmul *mm, int changed);
void tera_cpu_shadow_end(tera_cpu_matmul *mm);
/* ctl.weights_shadow_out / weights_filled (include/tera/backend.h) */
uint16_t *tera_cpu_shadow_out(tera_cpu_matmul *mm, const float *w, int64_t n);
void tera_cpu_shadow_filled(tera_cpu_matmul *mm);

/* Producers' bf16 copies (tera_cpu_prod above). tera_cpu_prod_sync: clear every record (a change of
 * precision, a new scratch); tera_cpu_prod_init: the switches from the environment (creation).
 * tera_cpu_prod_take: the start of every op on the calling thread: its record, taken and cleared
 * (into *rec when not NULL; rec->count 0 when none or stale). tera_cpu_prod_out: a producer asks for
 * the bf16 destinations of k arrays src[i][n[i]] (k <= TERA_CPU_PROD_MAX): the thread's scratch
 * (copy i at element off[i]), recorded for the next op, or NULL (not bf16 native, off, or the scratch
 * too small: never grown here), when the producer writes fp32 only. tera_cpu_prod_item_end: a work
 * item of for_each_item / for_ranges finished on this thread (its record cleared). */
void tera_cpu_prod_sync(tera_cpu_matmul *mm);
void tera_cpu_prod_init(tera_cpu_matmul *mm);
void tera_cpu_prod_take(tera_cpu_matmul *mm, tera_cpu_prod *rec);
uint16_t *tera_cpu_prod_out(tera_cpu_matmul *mm, int k, const float *const *src, const int64_t *n, int64_t *off);
void tera_cpu_prod_item_end(tera_cpu_matmul *mm);
/* A/B and tests: turn the producers on (1, where bf16 native) or off (0) for this context. */
void tera_cpu_producer_bf16(tera_cpu_matmul *mm, int on);

/* The producers' fused passes (elementwise.c): the functions of include/tera/kernels.h of the same
 * name without _bf16, the same fp32 outputs, and the bf16 rounding (tera_bf16_rne) of each output
 * into y16 / g16 / da1_16, da3_16 / d16 (d16: [N, Vl] of the dlogits) where those are not NULL. */
void tera_rmsnorm_forward_bf16(float *y, uint16_t *y16, float *rstd, const float *x, const float *w, int64_t N,
                               int64_t D, float eps);
void tera_swiglu_forward_bf16(float *g, uint16_t *g16, const float *a1, const float *a3, int64_t n);
/* g16[i] = the bf16 rounding of tera_swiglu_forward's g[i], no fp32 g written (swiglu_forward_act) */
void tera_swiglu_forward_to_bf16(uint16_t *g16, const float *a1, const float *a3, int64_t n);
void tera_swiglu_backward_bf16(float *da1, float *da3, uint16_t *da1_16, uint16_t *da3_16, const float *dg,
                               const float *a1, const float *a3, int64_t n);
double tera_ce_fused_bf16(float *dlogits, uint16_t *d16, float *lse, float *tlogit, const float *logits,
                          const int32_t *targets, int64_t N, int64_t V, float scale);
void tera_ce_backward_bf16(float *dlogits, uint16_t *d16, const float *logits, const int32_t *targets, int64_t N,
                           int64_t V, float scale);
void tera_ce_backward_range_bf16(float *dlogits, uint16_t *d16, const float *e, const float *sumexp,
                                 const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale);

/* fp32 weight gradients (TN products) in primitive pieces and rows-first TN tiles (matmul.c): 1 on
 * (the default), 0 off (the previous tree's products), as TERA_GEMM_PIECES=0; for benchmarks'
 * same-process A/B only (the numbers change with it). */
void tera_cpu_gemm_pieces(int on);
int64_t tera_cpu_gemm_pieces_taken(void); /* how many products ran in pieces so far (tests) */
/* Under AVX2 kernels, fp32 tiles on copies of their operands with padded rows (matmul.c, "Padded
 * operands"; the same bits, faster): 1 on (the default), 0 off, as TERA_GEMM_PAD=0; for benchmarks'
 * A/B and tests. */
void tera_cpu_gemm_pad(int on);
int64_t tera_cpu_gemm_padded_taken(int operand); /* tiles run so far on a padded copy of op(A) (0), op(B) (1) (tests) */

/* fp32 attention's kernels (attention.c): oneDNN sgemm calls, or register-blocked kernels on AVX2 +
 * FMA (attention_avx2.c) or AVX-512. The register-blocked ones give the same bits as each other (the
 * same sums in the same order); sgemm others. The default is the widest built, or the environment's
 * TERA_ATTN_FP32=sgemm|avx2|avx512 where this build has it. */
enum { TERA_ATTN_FP32_SGEMM = 0, TERA_ATTN_FP32_AVX2 = 1, TERA_ATTN_FP32_AVX512 = 2 };
int tera_cpu_attn_fp32_available(int kernel); /* built here (AVX2: x86-64-v3 or later; AVX-512) */
int tera_cpu_attn_fp32(void);                 /* the kernels in use */
int tera_cpu_attn_fp32_set(int kernel);       /* 0, or -1 (not built here; nothing changed) */
const char *tera_cpu_attn_fp32_name(int kernel); /* "sgemm", "avx2", "avx512" */

/* bf16 products on AMX with a short reduction and a fresh output, run on one thread, in row chunks
 * whose output lines are prefetched for writing first (matmul.c, "bf16 outputs written in row
 * chunks"): 1 on (the default where oneDNN has AMX, unless TERA_GEMM_OUT_CHUNK=0), 0 off; the same
 * bits either way (tests/test_gemm_chunks.c). */
void tera_cpu_gemm_out_chunk(int on);
int64_t tera_cpu_gemm_out_chunked(void); /* how many products ran in chunks so far (tests) */

/* Capability probes (behind tera_backend caps). */
int tera_cpu_bf16_fast(const char **isa_name);
int tera_cpu_bf16_has_dot(void);
int tera_cpu_bf16_native(void); /* oneDNN has bf16 GEMM kernels for this CPU (AVX-512 and up) */
int tera_cpu_bf16_probe(double *fma_macs, double *dot_macs); /* measured once per process, then cached */
/* The CPU's bf16 dot products issue at least TERA_BF16_DOT_MARGIN times the FMA's multiply-adds (the
 * probe above; 0 without AVX512-BF16 or where ONEDNN_MAX_CPU_ISA excludes it): the rule of
 * training.bf16_gemm = auto without AMX, and of attention's bf16 kernels there (backend_cpu.c). */
int tera_cpu_bf16_dot_fast(void);

/* Attention with bf16 products on the matrix units (attention.c), same arguments and semantics as
 * tera_attention_forward / backward (include/tera/kernels.h); softmax statistics, dP and dS in fp32.
 * The backend runs it when its precision is bf16 on the native units and oneDNN reports AMX.
 * Available (can run at all): oneDNN 2.x with bf16 kernels for this CPU, unless TERA_ATTN_BF16=0
 * (A/B timing). Its scratch (more than the fp32 path's: bf16 copies of q, k, v, dO) is
 * tera_attention_bf16_scratch_floats(...) floats. */
int tera_attention_bf16_available(void);
size_t tera_attention_bf16_scratch_floats(int B, int T, int H, int Hkv, int hd);
/* Which products the bf16 attention runs: "amx" (AMX tile intrinsics in attention.c: the CPU has
 * AMX-BF16, the OS grants the tile state and ONEDNN_MAX_CPU_ISA allows AMX), else "dot" (AVX512-BF16
 * dot products, attention_dot.c: the CPU has them and ONEDNN_MAX_CPU_ISA allows avx512_core_bf16);
 * TERA_ATTN_BF16=onednn turns both off; or "onednn" (oneDNN matmul primitives per tile); "none" where
 * not available. */
const char *tera_attention_bf16_kernel(void);
void tera_attention_forward_bf16(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                 int T, int H, int Hkv, int hd, float *scratch);
void tera_attention_backward_bf16(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                  const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                  int hd, float *scratch);
/* The bf16 attention's kernels on AVX512-BF16 dot products (attention_dot.c; "dot" above), same
 * arguments and semantics. Available: built for AVX-512 (GCC 11+), the CPU has AVX512-BF16 and
 * oneDNN's ISA (ONEDNN_MAX_CPU_ISA) includes avx512_core_bf16. Scratch: at least
 * tera_attention_dot_scratch_floats(..., nthr) floats for nthr = omp_get_max_threads() at the call
 * (tera_attention_bf16_scratch_floats covers it). */
int tera_attention_dot_available(void);
size_t tera_attention_dot_scratch_floats(int B, int T, int H, int Hkv, int hd, int nthr);
void tera_attention_forward_dot(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                                int H, int Hkv, int hd, float *scratch);
void tera_attention_backward_dot(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                 const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                 int hd, float *scratch);

#endif
