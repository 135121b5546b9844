/* ZeRO sharding (src/parallel/zero.c): the optimizer state, gradients and parameters of one rank
 * of a data-parallel layout, their reduction, the AdamW step on them, and the conversion between
 * this rank's storage and the whole model as one process holds it (the checkpoint windows). It
 * works on the model (its parameter table, buffers and group hooks), the topology and the
 * data-parallel communicators; it does not know the trainer, so it runs in a test with nothing
 * else (tests/test_zero.c).
 *
 * Flat buffers hold this rank's blocks (its pipeline stages' tensors, their tensor-parallel slices)
 * of the non-expert tensors first, [0, n_dense), the same on every rank of the data-parallel group,
 * then this rank's slices of the expert tensors, [n_dense, n). Gradients of the first region are
 * summed over dp, of the second over edp (the ranks holding the same experts). ZeRO stage 1 shards
 * the first region's Adam moments over dp and the second's over edp (consecutive 16-float aligned
 * shards, tera_zero.shard_counts / shard_counts_x); stage 2 also the gradients (reduce-scattered
 * group by group during backward into the shards' own buffers, opt.g / opt_x.g); stage 3 also
 * the fp32 parameters (opt.w / opt_x.w, all-gathered group by group into staging slots before use).
 * Stage 0: every rank holds all of it and the gradients are all-reduced in buckets during the last
 * backward of a step. */
#ifndef TERA_ZERO_H
#define TERA_ZERO_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/config.h"
#include "tera/model.h"
#include "tera/status.h"
#include "tera/topology.h"
#include "tera/train.h"

typedef struct {
    tera_model *model;            /* this rank's model, created with par.shard_grads = stage >= 2 and
                                     par.shard_params = stage >= 3 (tera_zero_stage_in_effect) */
    const tera_topology *topo;    /* copied */
    struct tera_comm *dp, *edp;   /* the data-parallel group (size topo.dp, rank topo.dp_rank) and the
                                     expert-data-parallel group (the dp group itself when ep = 1) */
    int stage;                    /* parallel.zero requested (0-3) */
    int prefetch;                 /* parallel.zero_prefetch: ZeRO-3 gathers the next layer while one computes */
    int planned;                  /* a pipeline stage: the executor names the order of use (tera_zero_plan) */
    const char *grad_compression; /* parallel.grad_compression (NULL: "none") */
    int hierarchical;             /* parallel.hierarchical */
    int bf16_moments;             /* optimizer.moments = bf16 (tera_adamw_init_range_bf16) */
    uint64_t seed;                /* training.seed: the key of the bf16 moments' stochastic rounding */
} tera_zero_env;

struct tera_zero_staging;
struct tera_greducer;

typedef struct tera_zero {
    tera_model *model;
    tera_topology topo;
    struct tera_comm *dp, *edp;
    int stage;                     /* in effect: 0 with one data-parallel rank */
    tera_adamw opt;                /* the non-expert region [0, n_dense) (or this rank's shard of it) */
    tera_adamw opt_x;              /* the routed-expert region [n_dense, n) (or this rank's shard) */
    int64_t *shard_counts;         /* [topo.dp] shards of the non-expert region */
    int64_t *shard_counts_x;       /* [topo.edp] shards of the expert region */
    struct tera_greducer *gred[2]; /* [non-expert over dp, experts over edp] hierarchical / compressed sums
                                      (include/tera/comm_hier.h); NULL: the plain collectives */
    double *grad_sq;               /* [4 n_params]: the last step's squared gradient norm per tensor, then
                                      the step's scratch (per-tensor update and parameter squares) */
    int grads_zero;                /* the gradients are known to be zero (cleared by the optimizer) */
    int grads_lazy;                /* gradients marked stale, not cleared (tera_model_grads_stale: a group's
                                      first backward stores them): stages 0/1 the model's buffer between
                                      steps, ZeRO-2/3 each staging slot when a group binds it;
                                      TERA_GRADS_CLEARED=1 clears them as before (A/B) */
    int stale_nan;                 /* test hook (TERA_TEST_STALE_NAN=1): stale gradients are set to NaN first,
                                      which no backward may read (tests/cli_grads.sh) */
    int64_t bytes_staging;         /* ZeRO-2/3 staging slots: one group's gradients (and parameters) at a time,
                                      and a second layer gradient buffer (its sums in flight) */
    tera_comm_req *buckets;        /* [n_buckets] stages 0 and 1: gradient sums in flight during the last
                                      backward (all-reduces; ZeRO-1: reduce-scatters) */
    int n_buckets;
    int rs_overlap;                /* gradient reduce-scatters non-blocking (TERA_ZERO_RS_OVERLAP != 0): ZeRO-1's
                                      buckets, ZeRO-2/3's groups (their staging also turns it off for the
                                      hierarchical / compressed reducers) */
    int host_shared;               /* gradient sums and ZeRO-3 gathers in host-shared memory where a group's ranks
                                      share one host (TERA_ZERO_SHARED != 0, no hierarchical / compressed
                                      reducer; zero.c, "on one host") */
    int rs1_started;               /* ZeRO-1: this step's buckets were started (tera_zero_reduce_grads waits) */
    unsigned char *rs1_nb;         /* [n_buckets] ZeRO-1: the bucket's sum started non-blocking over several ranks */
    int64_t rs1[3];                /* ZeRO-1: reduce-scatters over several ranks, started non-blocking, done
                                      before their wait (tera_zero_rs_counts) */
    int64_t *rs_cnt;               /* [max(dp, edp)] ZeRO-1: one bucket's counts per rank */
    int poison;                    /* test hook armed (ZeRO-2/3): a NaN into the first gradient piece summed */
    struct tera_zero_staging *zs;  /* ZeRO-2/3 staging (NULL otherwise) */
    struct tera_zero_whole *zw;    /* ZeRO-0/1: the whole gradient buffer in host-shared memory (NULL otherwise) */
    struct tera_zero_pw *pw;       /* ZeRO-1/2: the whole parameter buffer in host-shared memory (NULL otherwise) */
    int *xwho;                     /* [edp] with zw or pw: the data-parallel ranks holding this rank's experts,
                                      in their expert-data-parallel group's rank order */
    float *local_g;                /* ZeRO-2/3 with 1-bit Adam past its freeze: this rank's own whole gradient
                                      [n] (tera_zero_local_grads; the caller's buffer), NULL otherwise */
    int moments_rounded;           /* bf16 moments: the last tera_zero_load read fp32 moments of this rank that
                                      were not bf16 values (an fp32-moment checkpoint: rounded to nearest) */
} tera_zero;

/* The stage in effect for `requested` on topology t: ZeRO needs more than one data-parallel rank. */
static inline int tera_zero_stage_in_effect(const tera_topology *t, int requested) { return t->dp > 1 ? requested : 0; }

/* Creates the optimizer ranges (shards), the ZeRO-2/3 staging and the reducers, and binds the
 * model's group hooks (stage >= 2); collective over dp and edp when they have several ranks.
 * Fails (nothing allocated) on a bad grad_compression. */
tera_status tera_zero_create(const tera_zero_env *env, tera_zero **out);
/* Frees everything (the model's hooks are left as they were); NULL: no-op. */
void tera_zero_destroy(tera_zero *z);

/* ---- the step */
/* Clears the gradients this rank accumulates into (the model's buffer, or the ZeRO-2/3 shards);
 * disarms the test hook. */
void tera_zero_zero_grads(tera_zero *z);
/* Before a step's first backward: the gradients ready to be written. Stages 0/1 (z->grads_lazy):
 * marked stale, nothing written (each group's first backward stores its gradients); clear (a test
 * hook about to put a NaN into them), or otherwise: cleared unless the optimizer left them so. */
void tera_zero_grads_begin(tera_zero *z, int clear);
/* After the step's last backward, before the gradients are summed or read: zeroes what no backward
 * wrote (tera_model_grads_settle). */
void tera_zero_grads_end(tera_zero *z);
/* The model's gradient callback (model.grad_ready, ctx z) for a micro-batch's backward: stage 2/3
 * every micro-batch (the group's pieces reduce-scattered into the shards); stage 0 with several
 * ranks and no hierarchical/compressed reducer the last micro-batch (`last`: the buckets' all-reduce
 * starts while backward continues); NULL when none is needed. */
void (*tera_zero_grad_ready(tera_zero *z, int last))(void *, int64_t, int64_t);
/* Sum of the gradients over the ranks that hold each part (after the last backward; stage 1: each
 * rank sums only its own shard; stage 2/3: done during backward). */
void tera_zero_reduce_grads(tera_zero *z);
/* Global squared gradient norm (the same value on every rank, collective over the world), per
 * tensor into z->grad_sq[n_params]. */
double tera_zero_grad_sq(tera_zero *z);
/* The AdamW step on this rank's ranges with gradients times grad_scale, then the parameters every
 * rank needs (stage 1/2: all-gather). sums[2]: update and parameter squares over the whole model
 * (collective over the world). Stage 0 without grads_lazy clears the gradients as it goes (z->grads_zero). */
void tera_zero_adamw_step(tera_zero *z, float lr, float grad_scale, const tera_optim_config *oc, double *sums);
/* After an optimizer step on this rank's parameter ranges (the model's buffer; ZeRO-3: the shards
 * opt.w / opt_x.w): stages 1/2 all-gather every shard's new parameters, stage 3 marks the gathered
 * ones stale (the next use gathers again); stage 0: nothing. tera_zero_adamw_step calls it. */
void tera_zero_params_updated(tera_zero *z);
/* 1-bit Adam past its freeze under ZeRO-2/3 (src/train/onebit.c): g [n floats, the whole flat
 * buffer] receives this rank's own gradients instead of the staging slots: each group's backward
 * accumulates into its range of g micro-batch after micro-batch, nothing is reduce-scattered (no
 * gradient callback: tera_zero_grad_ready returns NULL, tera_zero_reduce_grads does nothing), and
 * tera_zero_zero_grads and the test hooks act on g. NULL: back to the shards. Between steps only;
 * stages 0/1: no-op (their gradients are the model's whole buffer already). */
void tera_zero_local_grads(tera_zero *z, float *g);
/* Test hooks: scale every gradient; a NaN in this rank's gradient where its own backward would have
 * produced one (call after tera_zero_zero_grads; stage 2/3: armed, it goes into the first gradient
 * piece summed this step). */
void tera_zero_grad_scale(tera_zero *z, float s);
void tera_zero_poison_grad(tera_zero *z);
/* ZeRO-3 prefetch in a pipeline stage (env.planned): before each operation the executor names its last
 * layer in the order of use (forward: the chunk's last, backward: its first) and the first layer the
 * next operation uses (-1: none); no-op otherwise. */
void tera_zero_plan(tera_zero *z, int last, int next);
/* ZeRO-3, since creation: layer parameter gathers, how many of them a prefetch had started,
 * prefetches discarded unused, and gathers through host-shared memory (every rank sharing a region on
 * one host; zero.c, "ZeRO-3 on one host"; 0 with TERA_ZERO_SHARED=0) (0 each otherwise). */
void tera_zero_counts(const tera_zero *z, int64_t *gathered, int64_t *prefetched, int64_t *unused, int64_t *shared);
/* Since creation: gradient sums done straight from the ranks' buffers in host-shared memory (every rank
 * sharing the region on one host; zero.c, "ZeRO-0 and ZeRO-1 on one host" and "ZeRO-2/3 on one host"):
 * ZeRO-0/1's buckets, ZeRO-2/3's layer regions (0 with TERA_ZERO_SHARED=0 and where they go through the
 * collectives). */
int64_t tera_zero_shared_sums(const tera_zero *z);
/* ZeRO-1/2, since creation: all-gathers of the updated parameters done in host-shared memory (every
 * rank's pieces written straight into the others' buffers; zero.c, "ZeRO-1/2's parameters on one
 * host"; 0 with TERA_ZERO_SHARED=0, for other stages, and where the all-gather runs). */
int64_t tera_zero_shared_param_gathers(const tera_zero *z);
/* ZeRO-0/1's sum on one host, also what `tera plan --calibrate` times (its shared_sum rate): floats
 * [lo, hi) of `ranks` buffers `stride` floats apart at base (member r's: buffer which[r], or r when
 * which is NULL), added in rank order, written into every member's buffer (dst < 0, ZeRO-0) or into
 * buffer dst only (ZeRO-1's shard piece). */
void tera_zero_shared_sum(float *base, int64_t stride, int ranks, const int *which, int64_t lo, int64_t hi, int dst);
/* ZeRO-1/2/3, since creation: the gradient reduce-scatters over groups of more than one rank, how many
 * of them started non-blocking (overlapping the backward that follows them; none with
 * TERA_ZERO_RS_OVERLAP=0 in the environment or a hierarchical / compressed reducer), and how many of
 * those were complete before they were waited for (0 each otherwise). ZeRO-1 counts one per bucket
 * (a layer's non-expert or expert tensors, the embedding, the head) when overlapped, and none when its
 * regions are reduce-scattered blocking after the backward. */
void tera_zero_rs_counts(const tera_zero *z, int64_t *total, int64_t *nonblocking, int64_t *early);
/* The seeded init of this rank's part (ZeRO-3: of its parameter shards only; the same values as the
 * one-process init's, element by element). */
void tera_zero_init_weights(tera_zero *z, uint64_t seed);
/* Bytes of this rank's Adam moments (4 per element fp32, 2 bf16: optimizer.moments). */
int64_t tera_zero_optimizer_bytes(const tera_zero *z);
/* Floats of ZeRO-2/3's staging slots (bytes_staging / 4, host-shared parts included) for the largest
 * group of each slot, size[slot][x] (slot 0 the embedding, 1 the head, 2 a layer; x 0 non-expert, 1
 * expert): per slot a gradient buffer (and for stage 3 a parameter buffer), each rounded up to 16
 * floats; the layer's spare gradient buffer and, with prefetch (stage 3), its prefetch buffer. With
 * untied embeddings (tied 0) the embedding and the head share one gradient buffer of the larger size:
 * the head's backward is the step's first and its sums complete before the embedding's backward,
 * the last, writes there (and the embedding's before the next micro-batch's head). Used by the
 * allocation and by `tera plan`'s count. */
int64_t tera_zero_staging_floats(const int64_t size[3][2], int stage, int prefetch, int tied);

/* ---- the whole model, window by window (checkpoints; no rank holds the whole model) */
/* A model shell with m's one-process parameter table (ep = 1, tp = 1, pp = 1) and no buffers (caller
 * sets w; frees shell->params). */
void tera_zero_global_shell(const tera_model *m, tera_model *shell);
/* Window [a, b) of region k (0 weights, 1 exp_avg, 2 exp_avg_sq) of the one-process flat buffer
 * (shell: tera_zero_global_shell) into win (room for b - a floats rounded up to even), assembled
 * bit-exactly from every rank's blocks and shards; collective over the world. root_only: only world
 * rank 0 needs the window (the others' win is then undefined). */
void tera_zero_gather_window(tera_zero *z, const tera_model *shell, int k, int64_t a, int64_t b, float *win,
                             int root_only);
/* Window [a, b) of region k of this rank's own flat buffer inside its non-expert (x = 0) or expert
 * (x = 1) range; collective over the ranks sharing the range's shards (dp or edp) when sharded. */
void tera_zero_local_window(tera_zero *z, int k, int x, int64_t a, int64_t b, float *dst);
/* Reads this rank's part (its blocks, its shards; moments too when asked) and the router bias from
 * a checkpoint, piece by piece. */
struct tera_ckpt_reader;
tera_status tera_zero_load(tera_zero *z, struct tera_ckpt_reader *rd, int moments);
/* This rank takes its part of the whole model (gm, gv may be NULL: moments untouched). */
void tera_zero_scatter(tera_zero *z, const float *gw, const float *gm, const float *gv);
/* The model-parallel group (the ranks that together hold one copy of the model): this rank's index
 * in it, (pp_rank * ep + ep_rank) * tp + tp_rank; the table of member `member` of model m's layout
 * (*n_floats: its storage; free the result); whether that member writes its block of p in a sharded
 * checkpoint; whether this rank does (every element of the model by exactly one rank of the world). */
int tera_zero_member(const tera_topology *t);
tera_param *tera_zero_member_table(const tera_model *m, const tera_topology *t, int member, int64_t *n_floats);
int tera_zero_member_writes(const tera_topology *t, int member, const tera_param *p);
int tera_zero_writes(const tera_topology *t, const tera_param *p);

#endif
