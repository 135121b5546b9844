/* The MoE token dispatcher (private to src/model), after Megatron-Core's token dispatchers: it moves
 * a MoE layer's routed tokens to their experts, runs the experts, and brings the results back, so
 * the layer (model.c) routes, then calls permute -> experts -> combine (and their backwards) without
 * knowing where the experts are. One interface, two implementations chosen at creation:
 *
 *   local       (parallel.ep = 1) every expert is on this rank: permute groups the routed rows by
 *               expert (xg), the experts run over their rows, combine sums the weighted outputs;
 *   all-to-all  (parallel.ep > 1) rank r of the ep group owns experts [r El, (r+1) El), El = E / ep:
 *               permute also exchanges the row counts (all-to-all of E ints), the experts step sends
 *               each peer the block of rows bound for its experts, runs this rank's experts over
 *               each source's block as it arrives (a fixed ring order: own block first; with
 *               parallel.ep_overlap the exchange of later blocks overlaps the compute of earlier
 *               ones) and returns each result block at once; combine is the local one. The
 *               backward mirrors it with the output gradients and the input gradients.
 *               With parallel.ep_hierarchical across nodes the rows move in two node-aware
 *               stages (tera_hier_*), the experts running (ep_overlap) on the blocks already here
 *               while the later stage is in flight; results bit-identical either way. With
 *               ep_overlap the caller's side work (the shared experts: tera_dispatch_side_work)
 *               runs while the rows out travel.
 *
 * Experts: one routine (SwiGLU, y = w2(silu(x w1^T) * (x w3^T))) over (rows, offsets, weights,
 * buffers), the same for both implementations and for the forward, the backward and the
 * recomputation of the hidden activations. The experts of one call run either one after another
 * (each product using every thread) or side by side by descending load (the backend's
 * items_side_by_side and for_each_item: each expert's outputs and weight gradients written by
 * exactly one thread with single-threaded products), an expert too large to share a thread (more
 * rows than a thread's share, or products as large as those the CPU backend gives to its matmul
 * primitive) first and alone (dispatch.c, experts_run); results are bit-identical whatever the
 * thread count chose (tests/test_experts_layout.c).
 *
 * State: the dispatcher owns its scratch (the plan's, the backward's row buffers, the exchange's
 * buffers and requests), allocated once at creation. The per-layer buffers below belong to the
 * layer's activations (carved by the model, so the recomputation policy decides which are kept). */
#ifndef TERA_MODEL_DISPATCH_H
#define TERA_MODEL_DISPATCH_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/model.h"

/* One MoE layer's routed-token buffers. N = B*T tokens, k experts per token, R = the rows this
 * rank's experts process (tera_dispatch_rows). */
typedef struct {
    int32_t *slot_row;   /* [N*k] grouped row of assignment t*k + j, -1 if dropped */
    int32_t *row_tok;    /* [N*k] token of each grouped row */
    int32_t *exp_off;    /* [E+1] rows of expert e are [exp_off[e], exp_off[e+1]) */
    int32_t *sel_count;  /* [B, E] assignments of each sequence selected for each expert, before drops */
    float *xg;           /* [N*k, D] routed rows grouped by expert (local only: the experts' backward reads
                            them; the all-to-all's rows sent are the dispatcher's scratch, xg NULL) */
    float *ye;           /* [N*k, D] their expert outputs, unweighted (all-to-all: as returned) */
    float *a1, *a3;      /* [R, F] the experts' hidden activations x w1^T, x w3^T */
    float *gact;         /* [R, F] silu(a1) * a3 */
    /* all-to-all only: rows received from source rank s for local expert e are rcnt[s*El + e];
     * they sit in xr from row roff[s] on, grouped by expert */
    int32_t *rcnt;       /* [ep, El] */
    int32_t *roff;       /* [ep + 1] */
    float *xr;           /* [R, D] rows received for this rank's experts (their outputs, sent back, are
                            the dispatcher's scratch) */
} tera_dispatch_acts;

typedef struct tera_dispatcher tera_dispatcher;

/* A dispatcher for micro-batches of B x T tokens of model c with this rank's expert hidden width F
 * (tensor parallelism: ffn_dim / tp); par->ep > 1 (with par->group, this rank ep_rank of it):
 * all-to-all, else local. */
tera_dispatcher *tera_dispatch_create(const tera_model_config *c, int B, int T, int64_t F, const tera_model_par *par,
                                      int ep_rank);
void tera_dispatch_destroy(tera_dispatcher *d);
/* A dispatcher that only answers the size queries below (rows, exchange sizes, bytes) for par's
 * ep and exchange settings: no scratch, no requests; par's group and backend are not used
 * (tera_model_count). */
tera_dispatcher *tera_dispatch_create_sizes(const tera_model_config *c, int B, int T, int64_t F, const tera_model_par *par);
const char *tera_dispatch_name(const tera_dispatcher *d); /* "local" or "all-to-all" */
/* R: rows this rank's experts can process in one layer: N*k (local), or the most it can receive
 * from the ep sources (all-to-all: from each, at most min(k, El) per token, and with a capacity at
 * most capacity per sequence for each of the El experts). */
int64_t tera_dispatch_rows(const tera_dispatcher *d);
/* The all-to-all R (ep > 1) for micro-batches of B x T tokens of model c, without a dispatcher
 * (the planner's memory model uses it too). */
int64_t tera_dispatch_rows_max(const tera_model_config *c, int B, int T, int ep);
/* Elements of the exchange's per-layer buffers of tera_dispatch_acts (all 0 for the local one, whose
 * rcnt, roff, xr stay NULL): rcnt [counts], roff [offsets], xr [rows, D]. */
typedef struct {
    int64_t counts, offsets, rows;
} tera_dispatch_sizes;
void tera_dispatch_exchange_sizes(const tera_dispatcher *d, tera_dispatch_sizes *s);
int64_t tera_dispatch_bytes(const tera_dispatcher *d);      /* its scratch */
/* Bytes of one row on the wire now (tera_model_exchange_row_bytes): back 0 rows out, 1 results. */
int64_t tera_dispatch_row_bytes(const tera_dispatcher *d, int back);
int64_t tera_dispatch_comm_bytes(const tera_dispatcher *d); /* the exchange's part of it */

/* Forward of layer l. permute: the plan (capacity and drops: tera_moe_plan over topi [N, k] and
 * probs [N, E]), the routed rows of x [N, D] gathered into t->xg (all-to-all: into the dispatcher's
 * scratch), and (all-to-all) the counts exchanged; returns the dropped assignments. experts: t->ye from
 * those rows (all-to-all: through the exchange, the received rows kept in t->xr). combine: out [N, D] += sum_j topw[t, j] ye[row of (t, j)] (topw: [N, k]). */
int64_t tera_dispatch_permute(tera_dispatcher *d, tera_dispatch_acts *t, const float *x, const int32_t *topi,
                              const float *probs, int l);
void tera_dispatch_experts_forward(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W, int l);
void tera_dispatch_combine_forward(tera_dispatcher *d, float *out, const tera_dispatch_acts *t, const float *topw);
/* Selective recomputation: the experts' hidden activations (t->a1, a3, gact) again from the kept
 * rows (t->xg, or the received t->xr: no exchange). */
void tera_dispatch_experts_recompute(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W);

/* Backward of layer l, in this order. combine: from dy [N, D], the experts' output gradients (the
 * dispatcher's) and dtopw [N, k] (written). experts: their input gradients (through the exchange),
 * weight gradients += into G (dw_beta 1), or stored there (dw_beta 0: the old contents are not read;
 * an expert no row reached gets zeros); da1, da3, dg: [R, F] scratch. absent: NULL, or layer l's marks
 * of its local experts ([El], tera_model_grads_sparse): an expert marked on entry holds no gradient
 * yet, so its first rows store it whatever dw_beta; on return exactly the experts whose gradients
 * hold no value are marked (those no row reached in a storing call, or marked before and reached by
 * none now), and nothing is zeroed. permute: dx [N, D] += the input gradients of token t's kept rows. */
void tera_dispatch_combine_backward(tera_dispatcher *d, float *dtopw, const float *dy, const tera_dispatch_acts *t,
                                    const float *topw);
void tera_dispatch_experts_backward(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                    const tera_layer_view *G, int l, float *da1, float *da3, float *dg, float dw_beta,
                                    uint8_t *absent);
/* The same backward in two parts, for work to overlap (parallel.tp_overlap): _dx the exchange and
 * the input gradients (dxg, as tera_dispatch_experts_backward leaves them; da1, da3, dg [R, F]
 * written and kept), then _dw the weight gradients from what _dx kept (G +=; no exchange), with the
 * same products in the same order: the same bits as the one call. Between experts run on the
 * calling thread, both poll *poll (the caller's operation in flight; NULL: none). */
void tera_dispatch_experts_backward_dx(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                       const tera_layer_view *G, int l, float *da1, float *da3, float *dg,
                                       tera_comm_req *poll);
void tera_dispatch_experts_backward_dw(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                       const tera_layer_view *G, int l, float *da1, float *da3, float *dg,
                                       tera_comm_req *poll, float dw_beta, uint8_t *absent);
void tera_dispatch_permute_backward(tera_dispatcher *d, float *dx, const tera_dispatch_acts *t);

/* Side work: the caller's work that reads and writes none of the dispatcher's buffers (the shared
 * experts), given for the next experts call (forward, backward or its _dx half; a second call before
 * that one aborts). That call runs fn(ctx) once, before its first block of experts: with
 * parallel.ep_overlap and rows to exchange, right after its rows out are posted, so that the work runs
 * while they travel (Megatron-Core's shared-expert overlap); else first thing. Nothing it computes
 * depends on where it runs: the same bits. Its time is not counted in the experts' profile rows. */
void tera_dispatch_side_work(tera_dispatcher *d, void (*fn)(void *ctx), void *ctx);
/* Side work run while rows travelled, since creation (`tera bench`: shared_overlapped_per_step). */
int64_t tera_dispatch_side_inflight(const tera_dispatcher *d);
/* fn(ctx) between two experts run one after another (each on every thread), where no buffer of the
 * dispatcher is in use: the model's yield (tera_model_set_yield); its time is not the experts'. NULL: none. */
void tera_dispatch_set_yield(tera_dispatcher *d, void (*fn)(void *ctx), void *ctx);

#endif
