/* The model: configuration, the parameter table, and forward/backward over one micro-batch.
 *
 * Every parameter is described by a row of a table (tera_param): its Hugging Face name, global
 * shape, offset into one flat float buffer, weight-decay flag and init. The same table drives
 * allocation (parameters, gradients and optimizer moments are each ONE allocation carved by these
 * offsets), initialisation, export/import, and sharding (each rank's block of every tensor under
 * expert, tensor and pipeline parallelism; ZeRO's ranges). Routed-expert weights are stored
 * stacked with a leading expert dimension ([E, out, in]) so an expert-parallel shard is a slice. */
#ifndef TERA_MODEL_H
#define TERA_MODEL_H

#include <stdint.h>

#include "tera/backend.h"
#include "tera/comm.h"
#include "tera/config.h"
#include "tera/status.h"

typedef enum {
    TERA_P_EMBED, TERA_P_ATTN_NORM, TERA_P_WQ, TERA_P_WK, TERA_P_WV, TERA_P_WO, TERA_P_FFN_NORM,
    TERA_P_ROUTER, TERA_P_EXP_W1, TERA_P_EXP_W3, TERA_P_EXP_W2,
    TERA_P_SHARED_W1, TERA_P_SHARED_W3, TERA_P_SHARED_W2,
    TERA_P_DENSE_W1, TERA_P_DENSE_W3, TERA_P_DENSE_W2,
    TERA_P_FINAL_NORM, TERA_P_LM_HEAD,
    TERA_P_COUNT
} tera_param_kind;

typedef struct {
    char name[128];       /* HF name; expert-stacked: printf pattern with one %d for the expert */
    tera_param_kind kind;
    int layer;            /* layer index, -1 outside the layers */
    int ndim;             /* 1, 2, or 3 for expert-stacked [E, out, in] */
    int64_t shape[3];     /* global shape */
    int64_t lo[3], len[3]; /* the block stored on this rank: [lo[d], lo[d] + len[d]) of each dim
                              (expert parallelism splits dim 0 of expert tensors, tensor
                              parallelism the dim given by tp_dim; else the whole tensor) */
    int tp_dim;           /* dim split over tensor-parallel ranks, -1: replicated on each */
    int64_t numel;        /* elements stored on this rank: len[0] * len[1] * len[2] */
    int64_t offset;       /* in floats, into the flat parameter/gradient/moment buffers */
    int expert_stacked;   /* 1: stored in HF as shape[0] tensors of shape [shape[1], shape[2]] */
    int decay;            /* AdamW weight decay applies (matrices, not norm weights) */
    int init_one;         /* 1: initialise to 1 (norm weights) */
    float init_std;       /* else normal(0, init_std) */
} tera_param;

/* Pointers into the flat buffer for one layer; NULL where the layer has no such tensor. */
typedef struct {
    float *attn_norm;     /* [D] */
    float *wq;            /* [H*hd, D] */
    float *wk, *wv;       /* [Hkv*hd, D] */
    float *wo;            /* [D, H*hd] */
    float *ffn_norm;      /* [D] */
    float *router;        /* [E, D]          MoE layers */
    float *w1, *w3;       /* [El, F, D]      MoE layers: this rank's El = E / ep experts */
    float *w2;            /* [El, D, F]      MoE layers */
    float *sw1, *sw3;     /* [Fs, D]         shared experts, Fs = n_shared * F */
    float *sw2;           /* [D, Fs] */
    float *dw1, *dw3;     /* [Fd, D]         dense layers */
    float *dw2;           /* [D, Fd] */
} tera_layer_view;

typedef struct {
    float *embed;         /* [V, D] */
    tera_layer_view *layers; /* [L] */
    float *final_norm;    /* [D] */
    float *lm_head;       /* [V, D] (== embed when tied) */
} tera_weights_view;

/* Sums produced by one forward; the training loop turns them into the loss of the global batch. */
typedef struct {
    double ce_sum;        /* sum of cross-entropy over this micro-batch's positions */
    int64_t n_positions;  /* B*T */
    double aux_sum;       /* sum over MoE layers and sequences of aux_{l,s} */
    double z_sum;         /* sum over MoE layers and tokens of logsumexp(router logits)^2 */
    int64_t n_assign;     /* routed assignments attempted (MoE layers * B*T*k) */
    int64_t n_dropped;    /* assignments dropped by the capacity limit */
    int ce_from_backward; /* training.loss_chunk in a training step: the forward left ce_sum 0 and the backward
                             computed the loss (ce_sum is then the backward's; 0 after any forward) */
} tera_fwd_stats;

/* Factors that turn this micro-batch's sums into its share of the global-batch loss. */
typedef struct {
    float ce;             /* 1 / (positions in the global batch) */
    float aux;            /* aux_coef / (MoE layers * sequences in the global batch) */
    float z;              /* z_coef / (MoE layers * tokens in the global batch) */
} tera_loss_scales;

typedef struct tera_acts tera_acts; /* activation storage, private to src/model */

/* Expert parallelism: the ep ranks of `group` each hold E / ep routed experts of every MoE layer
 * (rank r: experts [r E/ep, (r+1) E/ep)); tokens travel to their experts' ranks and back by
 * point-to-point exchanges inside forward and backward. Every rank of the group must run the same
 * sequence of forwards and backwards. */
typedef struct {
    int ep;               /* 1: every expert is local (no exchange) */
    tera_comm *group;     /* the expert-parallel group (its size is ep); NULL when ep = 1 */
    int overlap;          /* 1: exchange one source's tokens while computing another's */
    int a2a_compression;  /* rows exchanged as 0 fp32, 1 bf16, 4 fp8 e4m3 with a scale per row (tera_compress_kind) */
    int a2a_rows_bf16;    /* without a2a_compression: the rows to the experts (forward x, backward dy) sent as bf16
                             while the backend's products are bf16 (they round those rows to bf16 anyway: the same
                             bits; tera_a2a_rows_bf16) */
    int hierarchical;     /* 1: the two-stage node-aware exchange when the group spans nodes (tera_hier_alltoallv_u8) */
    /* model.balance_loss = switch_dp: the expert counts are summed over this group (the ranks that see
     * other tokens through the same layers: the data-parallel group); NULL: this rank alone */
    tera_comm *dp_group;
    /* Tensor parallelism (Megatron): the tp ranks of tp_group see the same tokens and split
     * attention by heads, every FFN (dense, shared and routed experts) by its hidden width, and
     * the embedding and LM head by vocabulary; partial sums meet in all-reduces over tp_group
     * (after o_proj, after the FFN block, and their mirrors in backward); the cross-entropy is
     * computed from the vocabulary slices without gathering the logits. */
    int tp;               /* 1: no tensor parallelism */
    tera_comm *tp_group;  /* NULL when tp = 1 */
    /* the backward's input-gradient sums start non-blocking and the weight gradients are computed
     * while they are in flight (parallel.tp_overlap): 1 when the backend's products are fp32, 2 in
     * every precision; 0 each sum blocking (the same bits in every case) */
    int tp_overlap;
    /* sequence parallelism (parallel.sequence_parallel, tp > 1): between the tensor-parallel layers
     * this rank keeps rows [tp_rank N/tp, (tp_rank + 1) N/tp) of the residual stream (layer inputs,
     * attention output plus residual, the norms' statistics); the norms run on those rows, whose
     * outputs are all-gathered before the column-parallel layers, and the row-parallel layers'
     * partial outputs are reduce-scattered into them (backward: the mirror image). */
    int sp;
    /* ZeRO-3 / ZeRO-2: the model allocates no whole parameter / gradient buffer; the trainer binds
     * each group's when use_params / use_grads ask (tera_model_bind_group) */
    int shard_params, shard_grads;
    /* Pipeline parallelism: this rank is pp_rank of pp stages with v model chunks each; it holds
     * the layers of virtual stages chunk * pp + pp_rank (split: layer_first[pp*v + 1]), the
     * embedding on stage 0 and the head on stage pp-1, and n_slots activation sets (one per
     * micro-batch in flight; tera_model_use_slot picks the one forward/backward use). */
    int pp, pp_rank, v, n_slots;
    const int *layer_first;
    /* parallel.pp_head_split (src/model/head_split.h): the LM head's vocabulary rows split between the
     * first stage (1: the helper, rows [0, V/2)) and the last (2: the owner, which keeps the head's
     * parameters); head_group: the two of them (helper rank 0, owner rank 1). 0: no split. */
    int head_role;
    tera_comm *head_group;
    /* parallel.pp_defer_wgrad (src/model/wgrad.h): up to this many micro-batches' LM-head weight
     * gradients wait for the pipeline's gaps (tera_model_wgrad_run / _flush) on the stages that compute
     * the head's products (the last; with the head split, the first too). 0: none. */
    int defer_wgrad;
    /* The compute backend the model runs its operations on (include/tera/backend.h): the model
     * owns it from tera_model_create_par on (destroyed with the model, or when creation fails).
     * NULL: the model creates a CPU backend in fp32 on the process's threads. */
    tera_backend *be;
} tera_model_par;

/* Activation recomputation, chosen per layer (training.recompute; docs/ARCHITECTURE.md):
 *   NONE       every activation the backward needs is kept from the forward;
 *   SELECTIVE  kept except the attention core's outputs (att, att_lse) and the SwiGLU hidden
 *              activations (a1, a3, silu(a1)*a3) of the layer's FFNs (routed experts, shared
 *              experts, dense FFN): the backward recomputes them from the kept q/k/v and FFN inputs;
 *   FULL       only the layer input is kept; the backward reruns the layer's forward.
 * Recomputed values live in one shared work set sized for the largest such layer, and are
 * bit-identical to the kept ones (same code, same inputs); statistics are not counted twice. */
typedef enum { TERA_RECOMPUTE_NONE = 0, TERA_RECOMPUTE_SELECTIVE = 1, TERA_RECOMPUTE_FULL = 2 } tera_recompute;

/* Parses a training.recompute spec ("none", "full", "selective", "full:0-3,selective:4-7"; ""
 * = none) for n_layers layers into policy[n_layers] (tera_recompute values; may be NULL to only
 * validate). Error: TERA_ERR_CONFIG naming the key, the value and the problem. */
tera_status tera_recompute_parse(const char *spec, int n_layers, uint8_t *policy);
const char *tera_recompute_name(int policy); /* "none", "selective", "full" */

/* Parameter groups, the unit of gradient buckets and of ZeRO-3 gathering: layer l (>= 0), the
 * embedding, the head (final norm and, untied, the LM head). */
enum { TERA_GROUP_EMBED = -1, TERA_GROUP_HEAD = -2 };

typedef struct {
    tera_model_config cfg;
    int B, T;             /* micro-batch shape the activations were sized for */
    int n_params;
    tera_param *params;   /* the table */
    int64_t n_floats;     /* parameter floats stored on this rank */
    int64_t n_dense_floats; /* the non-expert tensors are [0, n_dense_floats); routed experts follow */
    tera_model_par par;
    tera_backend *be; /* the compute backend (owned; par.be) */
    int ep_rank;          /* this rank in par.group */
    int tp_rank;          /* this rank in par.tp_group */
    int64_t Hl, Hkvl;     /* query and key/value heads on this rank (H / tp, Hkv / tp) */
    int64_t Fl, Fsl, Fdl; /* routed-expert, shared-expert and dense FFN widths on this rank (/ tp) */
    int64_t Vl, v0;       /* vocabulary rows on this rank: [v0, v0 + Vl) */
    int64_t Nr, r0;       /* rows of the residual stream this rank keeps: [r0, r0 + Nr) of a micro-batch's B T
                             (all of them; par.sp: N / tp from tp_rank N / tp) */
    float *w;             /* parameters [n_floats] */
    float *g;             /* gradients  [n_floats] (accumulated with += over micro-batches) */
    int g_external;       /* g is the caller's (tera_model_adopt_grads), not freed here */
    int w_external;       /* w is the caller's (tera_model_adopt_params), not freed here */
    unsigned char *g_stale; /* [L + 2] per group (layer l; L: the embedding, L + 1: the head): its gradients
                               hold old values, its next backward stores them (tera_model_grads_stale) */
    int *group_off;       /* [L + 3] the table's parameters by group, in table order: those of group slot k
                             (layer l; L: the embedding; L + 1: the head, as g_stale) are group_idx[group_off[k] ..
                             group_off[k + 1]); NULL (a hand-built model): the table is scanned */
    int *group_idx;       /* [n_params] */
    const tera_param *group_tab; /* the table the index was built for: a copy of the model with another
                                    table (a view, a shell) scans instead */
    uint8_t *g_absent;    /* [L, El] routed expert (layer l, local expert e) whose three weight gradients are
                             zero but were not written (no row reached it this step; tera_model_grads_sparse) */
    int g_sparse;         /* 1: the dispatcher marks such experts in g_absent instead of zeroing them */
    tera_weights_view W, G;
    int n_moe_layers;
    float *router_bias;   /* [L, E] aux-loss-free selection bias (state, not a parameter) */
    int64_t *expert_load; /* [L, E] assignments per expert since the last tera_model_reset_load */
    double *router_entropy; /* [L] sum over tokens of the router distribution's entropy (nats), same period */
    int64_t routed_tokens;  /* tokens per MoE layer counted in that period */
    uint8_t *recompute;   /* [L] tera_recompute policy of each layer (from cfg.recompute) */
    tera_acts *acts;      /* the activation slot in use */
    tera_acts *slots;     /* [n_slots] */
    int n_slots;
    unsigned char *held;  /* [L] layers on this rank (pipeline parallelism; else all) */
    int *layer_first;     /* [pp*v + 1] layer split over virtual stages */
    float *logits;        /* [B*T, Vl] after forward (this rank's vocabulary slice); with loss_rows < B*T the
                             head's scratch of [loss_rows, Vl] (read the logits through on_logits) */
    int64_t loss_rows;    /* rows the head and the cross-entropy take at a time (cfg.loss_chunk; B*T: all) */
    /* Called in a forward that is not armed for training (tera_model_arm_fused_loss: evaluation) with each
     * block of the logits as the head computes them: logits [n, Vl] (this rank's vocabulary slice) of
     * positions [r0, r0 + n) with their targets; NULL: not called. */
    void (*on_logits)(void *ctx, const float *logits, const int32_t *targets, int64_t n);
    void *on_logits_ctx;
    tera_fwd_stats stats; /* of the last forward */
    /* Gradient buckets: called during backward as soon as a contiguous range of the flat gradient
     * buffer holds its final value for this micro-batch (the LM head and final norm, then each
     * layer from the last, then the embedding), so a data-parallel reduction can start while
     * backward goes on. NULL: not called. */
    void (*grad_ready)(void *ctx, int64_t offset, int64_t count);
    void *grad_ready_ctx;
    /* Called before a group's parameters are read (forward and backward) and before its gradients
     * are written (backward; a group can be asked twice in one backward: the embedding when tied).
     * NULL: the whole buffers are bound. */
    void (*use_params)(void *ctx, int group);
    void (*use_grads)(void *ctx, int group);
    void *bind_ctx;
    int64_t bytes_params, bytes_grads, bytes_acts, bytes_scratch; /* memory accounting */
    int64_t bytes_comm;   /* expert-parallel exchange buffers (received rows and their results; a part
                             of bytes_acts and bytes_scratch, reported apart) */
    int64_t bytes_comm_acts; /* the part of bytes_comm inside bytes_acts */
    struct tera_head_split *hs; /* par.head_role: the head's vocabulary split (private to src/model), else NULL */
    struct tera_wgrad_queue *wgq; /* par.defer_wgrad on the last stage: the head's deferred weight gradients */
    /* the step's last micro-batch's hand-over of the head's gradient (notify), due when wgq is flushed */
    void (*wgq_ready)(void *ctx, int64_t offset, int64_t count);
    void *wgq_ready_ctx;
    int wgq_due;
    /* Called inside each layer's forward and backward between its blocks (before the FFN block; before the
     * attention's backward and before q/k/v's) and between routed experts run one after another, where
     * nothing of the backend is in use: the pipeline executor serves the head split's other stage there,
     * which waits for it. Set with tera_model_set_yield; NULL: not called. */
    void (*yield)(void *ctx);
    void *yield_ctx;
} tera_model;

/* Builds the table for cfg (without allocating); *n receives the row count. Caller frees. */
tera_param *tera_param_table(const tera_model_config *cfg, int *n, int64_t *n_floats);
/* The groups of the per-group gradient norms (metrics.jsonl grad_norm_by_group, the Prometheus
 * series): the group of a tensor kind, and the groups' names. */
#define TERA_PARAM_GROUPS 7
extern const char *const tera_param_group_names[TERA_PARAM_GROUPS];
int tera_param_group(tera_param_kind k);
/* The same for rank ep_rank of ep expert-parallel ranks (its slice of each expert tensor) and
 * tp_rank of tp tensor-parallel ranks; *n_dense (may be NULL) receives the size of the non-expert
 * region. tera_param_table_ep: tp = 1. */
tera_param *tera_param_table_ep(const tera_model_config *cfg, int ep, int ep_rank, int *n, int64_t *n_floats,
                                int64_t *n_dense);
tera_param *tera_param_table_par(const tera_model_config *cfg, int ep, int ep_rank, int tp, int tp_rank, int *n,
                                 int64_t *n_floats, int64_t *n_dense);
/* Which part of the model one rank holds. Pipeline parallelism: pp ranks, each with v model chunks
 * (virtual stage s = chunk * pp + pp_rank holds layers [layer_first[s], layer_first[s+1]), e.g.
 * tera_pp_split's balanced split); the embedding is on pp rank 0, the final norm and LM head on
 * pp rank pp-1. Tensors of other stages stay in the table with nothing stored (numel 0). */
typedef struct {
    int ep, ep_rank, tp, tp_rank, pp, pp_rank, v;
    const int *layer_first; /* [pp*v + 1] */
} tera_shard_spec;
tera_param *tera_param_table_spec(const tera_model_config *cfg, const tera_shard_spec *spec, int *n, int64_t *n_floats,
                                  int64_t *n_dense);
/* Copies the block [lo, lo + len) of a tensor of shape[3] between the whole tensor (whole, row
 * major) and a contiguous buffer of the block (block, [len0, len1, len2]): to_whole = 1 block ->
 * whole, 0 whole -> block. */
void tera_block_copy(const int64_t *shape, const int64_t *lo, const int64_t *len, float *whole, float *block,
                     int to_whole);
/* Contiguous layer ranges for `stages` virtual stages balancing the modelled compute per stage
 * (model FLOPs per token of each layer, the LM head counted with the last layer): first[stages+1]. */
void tera_pp_split(const tera_model_config *cfg, int stages, int T, int *first);
const tera_param *tera_model_param(const tera_model *m, const char *name); /* NULL if absent */

/* Flat-buffer range [lo, hi) of a group's expert (experts = 1) or other tensors (lo = hi = 0: none). */
void tera_model_group_range(const tera_model *m, int group, int experts, int64_t *lo, int64_t *hi);
/* Points the group's parameter (w*) and gradient (g*) views at buffers holding its non-expert
 * range (wd, gd: the element at the range's lo) and expert range (wx, gx); NULL leaves a view. */
void tera_model_bind_group(tera_model *m, int group, float *wd, float *wx, float *gd, float *gx);
/* Replaces the model's whole gradient buffer (a model made without par.shard_grads) with g
 * [n_floats], which the caller owns; it is zeroed (as the model's own before its first step). g = NULL
 * gives the caller's buffer back: the model has no whole gradient buffer from then on (its views
 * cleared). ZeRO-0/1 with the data-parallel ranks on one host put it in host-shared memory
 * (src/parallel/zero.c). Before the first step. */
void tera_model_adopt_grads(tera_model *m, float *g);
/* Moves the model's whole parameter buffer into w [n_floats], which the caller owns (the values
 * copied). w = NULL gives the caller's buffer back: the model has no whole parameter buffer from then
 * on (its views cleared). ZeRO-1/2 with the data-parallel ranks on one host put it in host-shared
 * memory (src/parallel/zero.c). Before the first step. */
void tera_model_adopt_params(tera_model *m, float *w);
/* Points every view into whole buffers laid out like the flat buffer (NULL: left as they are,
 * or cleared when the model has no whole buffer of its own). */
void tera_model_bind_all(tera_model *m, float *w, float *g);

/* cfg->recompute (a training.recompute spec, NULL = none) sets the per-layer recomputation; the
 * model keeps the parsed policy (m->recompute) and clears m->cfg.recompute. */
tera_status tera_model_create(tera_model *m, const tera_model_config *cfg, int B, int T);
/* The same on one rank of a parallel layout: its experts, tensor-parallel slices, pipeline stages
 * and ZeRO sharding as par says (par NULL: one rank holds the whole model). */
tera_status tera_model_create_par(tera_model *m, const tera_model_config *cfg, int B, int T,
                                  const tera_model_par *par);
void tera_model_destroy(tera_model *m);
/* The bytes tera_model_create_par would take for (cfg, B, T, par), by category, without allocating
 * the model: the same shape, parameter table and activation / scratch carving the allocator runs
 * (its counting pass), for rank 0 of each group (par's groups are not used: the tp and ep slices of
 * the other ranks have the same sizes). par->be NULL: a CPU backend on the process's threads sizes
 * the per-thread scratch. Errors: as tera_model_create_par's configuration checks. The planner's
 * memory model (tera plan) is built on it. */
typedef struct {
    int64_t n_floats, n_dense;   /* parameter floats on the rank, of them non-expert */
    int64_t params, grads;       /* bytes_params, bytes_grads (0 under par's shard_params / shard_grads) */
    int64_t acts, scratch;       /* bytes_acts, bytes_scratch */
    int64_t comm, comm_acts;     /* bytes_comm, bytes_comm_acts */
} tera_model_bytes;
tera_status tera_model_count(const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                             tera_model_bytes *out);
/* The same without the parameter table (n_floats, n_dense, params, grads left 0): for callers that
 * hold the table already (the planner's search). */
tera_status tera_model_count_acts(const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                                  tera_model_bytes *out);
/* Counter-based init: element i of parameter p draws from Philox(seed, p's kind/layer, i), so the
 * values do not depend on how parameters are laid out or sharded. */
void tera_model_init_weights(tera_model *m, uint64_t seed);
void tera_model_zero_grad(tera_model *m);
/* Instead of clearing the gradients between steps (4 bytes written per parameter, then read again
 * by the first micro-batch's products, which add into them): the next backward of each group stores
 * its weight gradients (products with dw_beta 0, which do not read the old values, NaN included) and
 * zeroes first only what it adds into (the 1-D norm weights, the embedding table, the experts no row
 * reaches). group: a TERA_GROUP_* or a layer, or TERA_GROUP_ALL. The same numbers as clearing. */
enum { TERA_GROUP_ALL = -3 };
void tera_model_grads_stale(tera_model *m, int group);
/* Zeroes the gradients of every group still stale (no backward wrote it since): call after the
 * step's micro-batches, before anything reads the gradients. */
void tera_model_grads_settle(tera_model *m);
/* The floats of group's range [lo, hi) of one region (experts 0: non-expert tensors, 1: routed experts;
 * tera_model_group_range) that belong to no tensor (each starts 64-byte aligned), zeroed in base, a
 * buffer holding that range (ZeRO-2/3's staging slots, whose sums read the whole range). */
void tera_model_group_zero_gaps(const tera_model *m, int group, int experts, float *base);
/* Experts without rows: their weight gradients are exactly zero. With sparse on, the backward leaves
 * their memory as it was and sets their mark in m->g_absent ([layer * El + local expert], El the
 * experts per rank) instead of writing 3 D F zeros per expert; every reader of m->g must then treat a
 * marked expert's three slabs (w1, w3, w2 of the expert-stacked tensors) as zero without reading
 * them. The optimizer's passes do (src/train/optim.c: the norm skips them, the update reads zeros);
 * so the ZeRO module turns it on only where nothing else reads the expert gradients (stage 0, one
 * expert-data-parallel replica, src/parallel/zero.c). A later micro-batch whose rows reach a marked
 * expert stores its gradients (dw_beta 0) and clears the mark. Marks are cleared with the group's
 * staleness (tera_model_grads_stale), by tera_model_zero_grad and by tera_model_grads_settle. Turning
 * it off materialises the marks first. The same numbers as zeroing (a zero adds nothing to a sum of
 * squares, and the update reads a zero either way). */
void tera_model_grads_sparse(tera_model *m, int on);
void tera_model_reset_load(tera_model *m);

/* The LM head split over two pipeline stages (par.head_role; src/model/head_split.h), driven by the
 * pipeline executor; every function does nothing on a model without the split. _begin at a step's
 * start (micro-batches of the step), _end at its end. The helper (first stage) serves a micro-batch in
 * phases, each once a message from the owner is in (its input, then the cross-entropy's maxima and sums):
 * _ready returns the micro-batch being served when its next phase can run (-1: none), _pending the
 * request that message arrives by (NULL: none in flight; to wait for it beside another), _serve runs
 * that phase (with tp = 1 every phase) with the micro-batch's targets [B*T] and the loss's gradient scale. */
void tera_model_set_yield(tera_model *m, void (*fn)(void *ctx), void *ctx); /* m->yield (NULL: none) */
/* The scratch bytes the head split adds on a stage of role 1 (helper) or 2 (owner) with tp tensor-parallel ranks
 * (sp: sequence parallelism); 0 otherwise. */
int64_t tera_model_head_split_bytes(const tera_model_config *cfg, int B, int T, int role, int tp, int sp);
void tera_model_head_split_begin(tera_model *m, int micro_batches);
int tera_model_head_split_ready(tera_model *m);
tera_comm_req *tera_model_head_split_pending(tera_model *m);
void tera_model_head_split_serve(tera_model *m, const int32_t *targets, float ce_scale);
void tera_model_head_split_end(tera_model *m);

/* Deferred weight gradients of the LM head (par.defer_wgrad; src/model/wgrad.h), driven by the
 * pipeline executor: the head's backward computes the input gradient and queues the weight gradient.
 * _run computes the oldest queued one, in a pipeline's wait (returns 1, 0 when none was queued);
 * _flush computes the rest at the step's end, then hands the head's gradient on (the head split: the
 * first stage's rows sent to, or received by, the last stage) and returns how many it computed. Both
 * add the seconds of their products to *seconds, and do nothing on a model without the queue.
 * _bytes: the scratch a stage adds (tp, pp_rank of pp; head_role as par.head_role; entries:
 * par.defer_wgrad). */
int tera_model_wgrad_run(tera_model *m, double *seconds);
int tera_model_wgrad_flush(tera_model *m, double *seconds);
int64_t tera_model_wgrad_bytes(const tera_model_config *cfg, int B, int T, int tp, int pp, int pp_rank, int head_role,
                               int entries);

/* tokens, targets: [B, T] int32 (targets[b,t] = next token). Fills m->logits and m->stats. */
void tera_model_forward(tera_model *m, const int32_t *tokens, const int32_t *targets);
/* Training steps: the next forward (with targets, through the head) also writes the cross-entropy's
 * gradient for loss scale ce_scale (the s.ce of the backward that follows, asserted there) over the
 * logits, in the same pass over them as the loss (the same numbers, the logits read once instead of
 * twice, one exponential per logit); m->logits then hold that gradient, not the logits. With tensor
 * parallelism 1 only on a backend with ops.ce_fused (tp > 1: always, the slice's exponentials written
 * in the loss's pass); otherwise, and for any later forward not armed again, nothing changes. */
void tera_model_arm_fused_loss(tera_model *m, float ce_scale);
/* The next forward's weights are those of the previous forward (a later micro-batch of the same
 * step): the backend's bf16 weight shadow (include/tera/backend.h) stays valid instead of being
 * rounded again. For that forward only; without it every forward assumes changed weights. */
void tera_model_weights_unchanged(tera_model *m);
/* Accumulates (+=) parameter gradients of  s.ce*ce_sum + s.aux*aux_sum + s.z*z_sum  into m->g.
 * Must follow the forward of the same micro-batch. */
void tera_model_backward(tera_model *m, const tera_loss_scales *s);
/* Pipeline parallelism: the same over layers [l0, l1) only. Forward: from x_in [N, D] (l0 > 0;
 * l0 = 0 embeds the tokens); the output goes to x_out [N, D] (l1 < L; l1 = L runs the head and the
 * loss). Backward: from dout [N, D], the gradient of the range's output (l1 < L); writes the
 * gradient of its input to dx [N, D] (l0 > 0). Statistics of a forward cover its layers only. */
void tera_model_forward_range(tera_model *m, const int32_t *tokens, const int32_t *targets, int l0, int l1,
                              const float *x_in, float *x_out);
void tera_model_backward_range(tera_model *m, const tera_loss_scales *s, int l0, int l1, const float *dout,
                               float *dx);
/* Selects the activation slot the next forward/backward of a micro-batch use. */
void tera_model_use_slot(tera_model *m, int slot);
/* Aux-loss-free balancing: b_e += rate * sign(mean load - load_e) per MoE layer from expert_load. */
void tera_model_update_router_bias(tera_model *m);
/* Tensor-parallel sums the backward waited for after computing weight gradients while they were in
 * flight (parallel.tp_overlap), since the model was created: 0 with tp = 1 or tp_overlap = 0;
 * *done_early (may be NULL): of those, the ones complete before their wait (at a poll). */
int64_t tera_model_tp_overlapped(const tera_model *m, int64_t *done_early);
/* MoE layers' shared-expert passes (forward hidden activations, backward) run while the layer's rows
 * travelled to and from the other expert-parallel ranks (parallel.ep_overlap), since the model was
 * created: 0 with ep = 1, ep_overlap = 0 or no shared experts. */
int64_t tera_model_shared_overlapped(const tera_model *m);
/* Sets parallel.tp_overlap (0, 1, 2) between steps (every rank of the tensor-parallel group alike:
 * the sums' kind, blocking or not, must match across the group); bench/bench_tp_overlap.c's A/B. */
void tera_model_set_tp_overlap(tera_model *m, int mode);
/* Bytes one row of the expert exchange takes on the wire (ep > 1; else 4 D): back 0 the rows to the
 * experts (forward x, backward dy), 1 their results (y, dx), as the model's dispatcher sends them now
 * (parallel.a2a_compression's encoding, or bf16 rows out while the products are bf16:
 * tera_model_par.a2a_rows_bf16). tera_exchange_row_bytes: the same for an encoding kind
 * (tera_compress_kind, 0 fp32) and width D, without a model (tera plan). */
int64_t tera_model_exchange_row_bytes(const tera_model *m, int back);
int64_t tera_exchange_row_bytes(int kind, int64_t D);
/* The encoding kind of one direction (back 0 the rows out, 1 the results) for a2a_compression's kind
 * (0: none) and rows_bf16 (tera_model_par.a2a_rows_bf16, with the products in bf16): the rule the
 * dispatcher and tera plan share. */
int tera_exchange_wire_kind(int a2a_compression, int rows_bf16, int back);

/* Model FLOPs per token, BENCH.md's convention (6 * active matrix params + 12 * L * D * T). */
double tera_model_flops_per_token(const tera_model_config *cfg, int T);
int64_t tera_model_active_params(const tera_model_config *cfg);
int64_t tera_model_total_params(const tera_model_config *cfg);

#endif
