/* Tensor-parallel layers (Megatron-Core's tensor_parallel package; private to src/model).
 *
 * The tp ranks of a group see the same tokens and split attention by heads, every FFN (dense,
 * shared and routed experts) by its hidden width, and the embedding and LM head by vocabulary.
 * Partial results meet in all-reduces over the group, named by the role they play:
 *   - a row-parallel layer's output (o_proj, an FFN's down projection, the vocabulary-parallel
 *     lookup) is a partial sum: tera_tp_reduce_forward sums it (backward: the identity);
 *   - a replicated input read by column-parallel layers (q/k/v from ln1, the FFN from ln2, the
 *     head from lnf, the combine weights of the experts' partial outputs) gets partial gradients
 *     from each rank: tera_tp_copy_backward sums them (forward: the identity).
 * The cross-entropy is computed from the vocabulary slices with three sums of N floats, never
 * gathering the logits. The model composes these and never sums across ranks itself. With tp = 1
 * every function is the plain one-rank operation (the same code and bits as a model without
 * tensor parallelism). */
#ifndef TERA_MODEL_TP_LAYERS_H
#define TERA_MODEL_TP_LAYERS_H

#include <stdint.h>

#include "tera/backend.h"
#include "tera/comm.h"

typedef struct {
    int tp;           /* ranks in the group; 1: no tensor parallelism */
    tera_comm *group; /* the tensor-parallel group; NULL when tp = 1 */
    int64_t v0, Vl;   /* this rank's vocabulary rows: [v0, v0 + Vl) */
    int64_t N;        /* rows (tokens) of a micro-batch */
    float *ce_buf;    /* [3, N] tp > 1: per-row max, sum of exponentials, target logit */
    int64_t bytes;    /* bytes this module allocated (scratch) */
    tera_backend *be; /* the model's compute backend (not owned) */
    int overlap;      /* parallel.tp_overlap (0, 1, 2): see tera_tp_overlapping */
    int64_t overlapped; /* sums waited for after work overlapped them (tera_tp_copy_backward_wait) */
    int64_t done_early; /* of those, the ones complete before their wait (at a poll: no time blocked) */
} tera_tp;

/* Sets up, on backend be, rank `rank` of tp ranks of `group` for a vocabulary of V rows and N rows per
 * micro-batch (allocates the cross-entropy's scratch once); tera_tp_free releases it. */
void tera_tp_init(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t V, int64_t N);
/* The bytes tera_tp_init allocates for tp ranks and N tokens (the cross-entropy buffer; 0 for one rank). */
int64_t tera_tp_scratch_bytes(int tp, int64_t N);
void tera_tp_free(tera_tp *tp);

/* Sum of the ranks' partial outputs of a row-parallel layer, in place: buf [n]. */
void tera_tp_reduce_forward(const tera_tp *tp, float *buf, int64_t n);
/* Sum of the ranks' partial gradients of a replicated input of column-parallel layers, in place:
 * dx [n]. */
void tera_tp_copy_backward(const tera_tp *tp, float *dx, int64_t n);
/* The same sum split around independent work (Megatron's asynchronous tensor-parallel all-reduce:
 * a column-parallel layer's weight gradients while its input gradient is summed): start returns 1
 * with the sum in flight in *req (tp > 1 and tp->overlap: dx must not be read or written until
 * tera_tp_copy_backward_wait), else 0 with the sum done (blocking, as tera_tp_copy_backward; *req
 * inactive). tera_tp_poll lets an operation in flight progress between pieces of work (Open MPI's
 * non-blocking collectives move only inside MPI calls); wait completes it (an inactive req returns
 * at once) and counts it in tp->overlapped. An all-reduce's result does not depend on when it is
 * waited for: the same bits as tera_tp_copy_backward. */
int tera_tp_copy_backward_start(const tera_tp *tp, float *dx, int64_t n, tera_comm_req *req);
/* Whether start leaves sums in flight: tp > 1 and overlap 2, or overlap 1 with the backend's
 * products in fp32 (bf16/fp16 halves of a split product would each round their operands). */
int tera_tp_overlapping(const tera_tp *tp);
void tera_tp_poll(const tera_tp *tp, tera_comm_req *req);
void tera_tp_copy_backward_wait(tera_tp *tp, tera_comm_req *req);

/* Vocabulary-parallel embedding: x[N,D] = table[tokens[n]] (table: this rank's [Vl, D] rows; each
 * rank looks up the tokens in its slice, the partial rows are summed). Backward: dtable[Vl, D] +=
 * the rows of dx[N,D] whose token is in the slice. tokens: [N] */
void tera_tp_embedding_forward(const tera_tp *tp, float *x, const float *table, const int32_t *tokens, int64_t N,
                               int64_t D);
void tera_tp_embedding_backward(const tera_tp *tp, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                                int64_t D);

/* Row-parallel linear with the residual: y[N,out] = res[N,out] + sum over ranks of x[N,in] w[out,in]^T
 * (x, w: this rank's input slice). Backward: the backend's linear_backward on the slice (dy passes through
 * the sum unchanged), and dy to the residual. */
void tera_tp_row_linear_residual_forward(const tera_tp *tp, float *y, const float *x, const float *w,
                                         const float *res, int64_t N, int64_t in, int64_t out);

/* A row-parallel block whose layers accumulate into out[n] (the FFN block: routed experts, shared
 * experts or the dense FFN): begin starts out at the residual res[n] (tp = 1) or at 0 (the ranks'
 * partial sums are added to the residual once, by end); end sums the partial outputs and adds the
 * residual (tp > 1; nothing to do with tp = 1). */
void tera_tp_row_block_begin(const tera_tp *tp, float *out, const float *res, int64_t n);
void tera_tp_row_block_end(const tera_tp *tp, float *out, const float *res, int64_t n);
/* The FFN block's start after its norm: ln[N,D] = RMSNorm(x[N,D]) with weights w (rstd[N] kept) and out
 * begun as tera_tp_row_block_begin(tp, out, x, N*D) does; with tp = 1 the residual is copied in the
 * norm's pass over x (ops.rmsnorm_copy_forward, where the backend has it). */
void tera_tp_norm_block_begin(const tera_tp *tp, float *ln, float *rstd, float *out, const float *x, const float *w,
                              int64_t N, int64_t D, float eps);

/* Vocabulary-parallel cross-entropy of logits[N, Vl] (this rank's slice of the vocabulary) against
 * targets[N]: writes lse[N] (of the whole vocabulary) and returns the sum of the N losses, the same
 * on every rank. Backward: dlogits[N, Vl] = scale * (softmax - onehot) on the slice (may alias
 * logits), from each row's max and sum of exponentials computed again (tp > 1: with the ranks, a max
 * and a sum over them), one exponential per logit: the same bits as tera_tp_ce_fused's dlogits. */
double tera_tp_ce_forward(const tera_tp *tp, float *lse, const float *logits, const int32_t *targets, int64_t N);
void tera_tp_ce_backward(const tera_tp *tp, float *dlogits, const float *logits, const int32_t *targets, int64_t N,
                         float scale);
/* Both in the forward (tp = 1: one pass over the logits, with a backend that has ops.ce_fused; tp > 1:
 * the slice's exponentials written to dlogits while summed, scaled after the sums over the ranks):
 * lse[N] and the sum of losses (*sum) as tera_tp_ce_forward, dlogits[N, Vl] as tera_tp_ce_backward
 * with scale (may alias logits), tlogit[N] scratch (each row's target logit); returns 1, or 0 having
 * done nothing (tp = 1 on a backend without ops.ce_fused: the separate passes then). */
int tera_tp_ce_fused(const tera_tp *tp, float *dlogits, float *lse, float *tlogit, const float *logits,
                     const int32_t *targets, int64_t N, float scale, double *sum);

#endif
