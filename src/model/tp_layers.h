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
 * tensor parallelism).
 *
 * Sequence parallelism (tp->sp, Megatron-Core's sequence_parallel): between those layers each rank
 * keeps only its rows [r0, r0 + Nr) of the residual stream (Nr = N / tp): the layer inputs, the
 * attention output plus residual and the norms' statistics are [Nr, ...] buffers. A norm runs on the
 * rank's rows and writes them into its place in a whole [N, D] buffer, which an all-gather then
 * completes for the column-parallel layers; a layer keeps only its rows of it and gathers them again
 * in the backward (tera_tp_norm_input, tera_tp_input_whole, tera_tp_norm_block_begin); a
 * row-parallel layer's partial output is reduce-scattered into the rank's rows before the residual
 * (tera_tp_row_linear_residual_forward, tera_tp_row_block_end). Backward mirrors it: the gradient of
 * the residual stream is kept in the rank's rows of a whole [N, D] buffer and all-gathered before the
 * layers that read every row (tera_tp_gather_rows), the column-parallel layers' partial input
 * gradients are reduce-scattered (tera_tp_dx_sum), and the norms' weight gradients, now partial over
 * the rows, are summed over the ranks (tera_tp_norm_backward). The same bytes as the all-reduces, plus
 * the backward's all-gathers of the layers' kept input rows (ln1, ln2). */
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
    /* sequence parallelism (tp > 1 and the model's par.sp) */
    int sp;
    int64_t D, Nr, r0;  /* the residual stream's width; this rank's rows [r0, r0 + Nr) */
    int64_t *rows_cnt;  /* [tp] Nr D: the floats of each rank's rows (the all-gathers and reduce-scatters) */
    float *rows_buf;    /* [N, D] a row-parallel layer's (or block's) partial output before its reduce-scatter */
    float *in_buf;      /* [N, D] a column-parallel layers' input gathered whole (tera_tp_input_whole) */
    float *gw;          /* [2, D] the norms' weight gradients over this rank's rows, before their sum over the ranks */
    float *gw_dst[2];   /* where each goes (tera_tp_norm_grads_sum) */
    int gw_n;           /* how many are pending */
    /* parallel.pp_head_split's owner (tera_tp_init_pair): the pair with its helper (rank 0 of it), and what the
     * helper sent, [N, D] at most */
    tera_comm *pair;
    float *pair_buf;
} tera_tp;

/* The head split's messages between helper and owner on their pair (head_split.h), per micro-batch: the
 * rows' maxima [N] (helper to owner, then the maxima over every row of the vocabulary back), the sums of
 * exponentials and target logits [2N] (the same two ways), the helper's partial input gradient [N, D]. */
enum { TERA_PAIR_TAG_MAX = 11, TERA_PAIR_TAG_SUMS = 12, TERA_PAIR_TAG_DX = 13 };

/* Sets up, on backend be, rank `rank` of tp ranks of `group` for a vocabulary of V rows and N rows of
 * width D per micro-batch, with sequence parallelism when sp (and tp > 1): allocates the scratch once
 * (the cross-entropy's; with sp the partial outputs' [N, D] and a norm's [D]); tera_tp_free releases it. */
void tera_tp_init(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t V, int64_t N,
                  int64_t D, int sp);
/* The bytes tera_tp_init allocates for tp ranks, N tokens of width D and sp (0 for one rank). */
int64_t tera_tp_scratch_bytes(int tp, int64_t N, int64_t D, int sp);
/* parallel.pp_head_split's owner (head_split.h): as tera_tp_init for this rank's vocabulary rows [v0, v0 + Vl) of the
 * LM head, with the pair to its helper (this rank is rank 1 of it). The cross-entropy's maxima and sums and the
 * head's input gradient then meet over the pair first, the helper's partial received and put first (the helper
 * sends its partials and receives the cross-entropy's results without taking part in any collective: it never
 * waits for the group), then over the group as tera_tp_init's would; the cross-entropy's results go back to the
 * helper. tera_tp_pair_bytes: what it allocates (one block, freed by tera_tp_free). */
void tera_tp_init_pair(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t v0, int64_t Vl,
                       int64_t N, int64_t D, int sp, tera_comm *pair);
int64_t tera_tp_pair_bytes(int tp, int64_t N, int64_t D, int sp);
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

/* Sequence parallelism: completes buf [N, D] from every rank's rows (an in-place all-gather: this
 * rank's rows [r0, r0 + Nr) are its part). Nothing to do without sp. */
void tera_tp_gather_rows(const tera_tp *tp, float *buf);
/* The sum of the ranks' partial gradients of a replicated input [N, D] of column-parallel layers
 * (tera_tp_copy_backward's role for the residual stream): all-reduced in place, or with sp reduce-scattered
 * (this rank's rows of dx hold the sum, the others are left undefined). _start / tera_tp_copy_backward_wait:
 * the same split around independent work as tera_tp_copy_backward_start. */
void tera_tp_dx_sum(const tera_tp *tp, float *dx);
/* The vocabulary-parallel LM head's backward from this rank's rows of the loss gradient: dx [N, D] =
 * dlogits [N, V] w [V, D], summed over the group (tera_tp_dx_sum; tera_tp_overlapping: started after
 * its product and waited for after the weight gradient's), gw [V, D] = beta gw + dlogits^T x [N, D].
 * The same bits split or not. gw NULL: the input gradient alone (the weight gradient deferred: wgrad.h). */
void tera_tp_head_backward(tera_tp *tp, float *dx, float *gw, const float *dlogits, const float *x, const float *w,
                           int64_t N, int64_t D, int64_t V, float beta);
int tera_tp_dx_sum_start(const tera_tp *tp, float *dx, tera_comm_req *req);
/* RMSNorm of the residual stream into a replicated input of column-parallel layers: y[N,D] = the norm of
 * x with weights w, rstd kept. x, rstd: this rank's rows ([Nr, D], [Nr]); with sp the rows are written
 * into their place in y and gathered (the final norm: y kept whole). */
void tera_tp_norm_forward(const tera_tp *tp, float *y, float *rstd, const float *x, const float *w, int64_t N,
                          int64_t D, float eps);
/* A layer's input kept as this rank's rows (Megatron-Core's sequence parallelism saves the rank's shard
 * of a column-parallel layer's input and all-gathers it again in the backward): with sp a layer keeps
 * yr = its norm's rows [Nr, D], and the whole [N, D] the column-parallel layers read lives in the
 * module's gather buffer (in_buf) until the next gather; without sp yr is the whole [N, D] itself.
 * tera_tp_norm_input: the norm as tera_tp_norm_forward into yr, returning the whole input.
 * tera_tp_input_whole: the whole input again from the kept rows (the backward, a recomputation). */
const float *tera_tp_norm_input(const tera_tp *tp, float *yr, float *rstd, const float *x, const float *w, int64_t N,
                                int64_t D, float eps);
const float *tera_tp_input_whole(const tera_tp *tp, const float *rows);
/* The same gather started, with tp->overlap (parallel.tp_overlap), for work that neither reads the
 * returned buffer nor gathers into it before tera_tp_input_wait(tp, req) (the progress thread of the
 * host-shared segment moves it meanwhile); without sp or overlap done at once (*req inactive). */
const float *tera_tp_input_whole_start(const tera_tp *tp, const float *rows, tera_comm_req *req);
void tera_tp_input_wait(const tera_tp *tp, tera_comm_req *req);
/* Its backward: dx += (this rank's rows of the whole [N, D] buffers dx and dy; x, rstd as in the forward)
 * and dw += the weight gradient. With sp the weight gradient of this rank's rows is kept pending (at most
 * two: a layer's norms) until tera_tp_norm_grads_sum sums them over the ranks in one all-reduce and adds
 * them to their dw: call it before anything reads dw (the end of a layer's backward, of the head's). */
void tera_tp_norm_backward(tera_tp *tp, float *dx, float *dw, const float *dy, const float *x, const float *w,
                           const float *rstd, int64_t N, int64_t D);
void tera_tp_norm_grads_sum(tera_tp *tp);

/* Vocabulary-parallel embedding: x[N,D] = table[tokens[n]] (table: this rank's [Vl, D] rows; each
 * rank looks up the tokens in its slice, the partial rows are summed). Backward: dtable[Vl, D] +=
 * the rows of dx[N,D] whose token is in the slice. tokens: [N] */
void tera_tp_embedding_forward(const tera_tp *tp, float *x, const float *table, const int32_t *tokens, int64_t N,
                               int64_t D); /* sp: x is this rank's rows [Nr, D] */
void tera_tp_embedding_backward(const tera_tp *tp, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                                int64_t D);

/* Row-parallel linear with the residual: y[N,out] = res[N,out] + sum over ranks of x[N,in] w[out,in]^T
 * (x, w: this rank's input slice; sp: y and res are this rank's rows [Nr, out]). Backward: the backend's
 * linear_backward on the slice (dy passes through the sum unchanged; sp: dy gathered), and dy to the
 * residual. */
void tera_tp_row_linear_residual_forward(const tera_tp *tp, float *y, const float *x, const float *w,
                                         const float *res, int64_t N, int64_t in, int64_t out);

/* A row-parallel block's accumulator out[n] begun: at the residual res[n] (tp = 1) or at 0 (tp > 1: the
 * ranks' partial sums get the residual once, in tera_tp_row_block_end). */
void tera_tp_row_block_begin(const tera_tp *tp, float *out, const float *res, int64_t n);
/* A row-parallel block whose layers accumulate into a buffer acc [N, D] (the FFN block: routed experts,
 * shared experts or the dense FFN), out = res + the block: end sums the ranks' partial outputs in acc
 * (tp > 1) and adds the residual res once (nothing to do with tp = 1, where acc is out, begun at the
 * residual). sp: out and res are this rank's rows [Nr, D], acc the module's rows_buf. */
void tera_tp_row_block_end(const tera_tp *tp, float *out, float *acc, const float *res, int64_t N, int64_t D);
/* The FFN block's start after its norm: ln = RMSNorm(x) with weights w (rstd kept; x, rstd: this
 * rank's rows; ln kept as in tera_tp_norm_input: with sp the rank's rows, *lnw the whole [N, D]), and
 * returns the block's acc: out begun at the residual x (tp = 1: copied in the norm's pass over x,
 * ops.rmsnorm_copy_forward, where the backend has it), or a zeroed buffer for the partial sums (tp > 1:
 * out itself, or with sp the module's rows_buf). */
float *tera_tp_norm_block_begin(const tera_tp *tp, float *ln, float *rstd, float *out, const float *x,
                                const float *w, int64_t N, int64_t D, float eps, const float **lnw);

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
