/* Training: AdamW, the LR schedule, global-norm clipping, and the step loop with gradient
 * accumulation, metrics and checkpoints. */
#ifndef TERA_TRAIN_H
#define TERA_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "tera/comm.h"
#include "tera/config.h"
#include "tera/data.h"
#include "tera/groups.h"
#include "tera/guard.h"
#include "tera/model.h"
#include "tera/pipeline.h"
#include "tera/precision.h"
#include "tera/topology.h"

struct cJSON;

typedef struct {
    float *m, *v;   /* first and second moments of the flat range [lo, hi), one allocation */
    int64_t t;      /* updates taken (for bias correction) */
    int64_t n;      /* hi - lo */
    int64_t lo, hi; /* the parameters this optimizer updates: all of them, or a ZeRO-1 shard */
    float *g;       /* ZeRO-2/3: the shard's gradients [n] (NULL: the model's whole buffer) */
    float *w;       /* ZeRO-3: the shard's parameters [n] (NULL: the model's whole buffer) */
    int view;       /* 1: m and v point into another optimizer's allocation (not freed here) */
    struct tera_adamw_plan *plan; /* the (tensor, chunk) work items of its passes (src/train/optim.c) */
    uint16_t *mh, *vh; /* optimizer.moments = bf16: the moments as bf16 [n] each (m and v are NULL) */
    uint64_t sr_seed;  /* bf16 moments: the stochastic rounding's key is (sr_seed, t) */
    uint16_t *w16;     /* NULL, or for one step: the backend's bf16 weight shadow of [lo, hi) (backend.h,
                        * weights_shadow_out), written with each new weight rounded to nearest even */
} tera_adamw;

void tera_adamw_init(tera_adamw *o, int64_t n_floats);
/* ZeRO-1: moments for the flat range [lo, hi) only. */
void tera_adamw_init_range(tera_adamw *o, int64_t lo, int64_t hi);
void tera_adamw_free(tera_adamw *o);
/* optimizer.moments = bf16 (docs/TRAINING.md, "bf16 moments"): m and v held as bf16 (mh, vh; 4 bytes
 * per parameter instead of 8). Each step computes the new moments in fp32 from the widened bf16 ones,
 * updates the parameter with those fp32 values and stores them rounded stochastically: element e of
 * parameter tensor i (its index in the one-process table, e in that tensor's global shape) at update
 * t draws 32 bits tera_moment_random(tera_moment_key(seed, t), i, e), the low 16 for m, the high 16
 * for v, so the result depends on neither the thread count, the chunking nor the layout (ZeRO shards,
 * data-, expert-, tensor- or pipeline-parallel blocks). */
void tera_adamw_init_range_bf16(tera_adamw *o, int64_t lo, int64_t hi, uint64_t seed);
uint64_t tera_moment_key(uint64_t seed, int64_t t);
/* The rounding the update writes to tera_adamw.w16: the bf16 products' rounding of an operand (round
 * to nearest even on the fp32 pattern, NaN kept quiet), the same bits as tera_round_bf16. */
uint16_t tera_adamw_shadow_round(float x);
uint32_t tera_moment_random(uint64_t key, int tensor, int64_t e);
/* x rounded to bf16 (the top 16 bits of the fp32 pattern): up with probability (low 16 bits) / 2^16
 * given r16 uniform in [0, 2^16), so E[result] = x; exact when x is a bf16 value; NaN stays NaN. */
static inline uint16_t tera_bf16_stochastic(float x, uint32_t r16) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) && !(u & 0x7F0000u) ? 0x40u : 0u));
    return (uint16_t)((u + (r16 & 0xFFFFu)) >> 16);
}
/* x rounded to the nearest bf16, ties to even (loading fp32 moments into bf16 ones); NaN stays NaN. */
static inline uint16_t tera_bf16_nearest(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) && !(u & 0x7F0000u) ? 0x40u : 0u));
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float tera_bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    __builtin_memcpy(&x, &u, 4);
    return x;
}
/* Moments k (1: m, 2: v) of o's elements [lo + a, lo + a + n) into dst as fp32 (bf16: widened, exact),
 * or from src (bf16: rounded to nearest). */
void tera_adamw_moments_get(const tera_adamw *o, int k, int64_t a, int64_t n, float *dst);
void tera_adamw_moments_set(tera_adamw *o, int k, int64_t a, int64_t n, const float *src);
/* Bytes of o's two moments. */
int64_t tera_adamw_moment_bytes(const tera_adamw *o);
/* Builds o's work items over m's tensors: chunks of TERA_OPTIM_CHUNK elements aligned to each
 * tensor's start (clipped to [lo, hi)), one parallel region per pass over all of them, each chunk's
 * sums kept apart and added per tensor in a fixed order (results independent of the thread count).
 * Called at init (the step then allocates nothing); a step or norm on a model whose table no longer
 * matches the plan builds it again. The passes (and tera_grad_scale) run on the threads of the
 * model's backend (m->be: ops.for_ranges); a model without one runs them on the calling thread. */
#define TERA_OPTIM_CHUNK 16384
void tera_adamw_plan(tera_adamw *o, const tera_model *m);
/* Squared gradient norm of o's range [lo, hi) (the gradients at o->g, else m->g + lo), per tensor
 * into sq[n_params] (0 for tensors outside the range; sq may be NULL); returns the total. */
double tera_adamw_grad_sq(tera_adamw *o, const tera_model *m, double *sq);
/* One decoupled-weight-decay Adam update of every parameter of m (decay only where the
 * parameter table says so): p -= lr*wd*p; p -= lr * m_hat / (sqrt(v_hat) + eps), on the gradient
 * times grad_scale (the clipping factor, applied here instead of in a separate pass). With
 * zero_grad, each gradient is cleared right after use (no separate pass either). update_sq and
 * param_sq (may be NULL) receive sum((w_new - w_old)^2) and sum(w_old^2) over all parameters. */
void tera_adamw_step(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                     int zero_grad, double *update_sq, double *param_sq);

/* The same, also adding each tensor's sums into usq[n_params] and psq[n_params]. */
void tera_adamw_step_by_param(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                              int zero_grad, double *update_sq, double *param_sq, double *usq, double *psq);

/* MODEL.md's schedule: linear warmup (s+1)/W, then cosine from lr to min_lr over steps - W. */
float tera_lr_at(const tera_train_config *t, int64_t step);
/* Global L2 norm of all gradients (fixed reduction order, independent of the thread count). */
double tera_grad_norm(const tera_model *m);
/* The same squared, also per parameter tensor into sq[n_params] (sq may be NULL). */
double tera_grad_sq_by_param(const tera_model *m, double *sq);
/* The same over the flat range [lo, hi) only (a ZeRO shard). */
double tera_grad_sq_by_param_range(const tera_model *m, int64_t lo, int64_t hi, double *sq);
/* The same with the gradients of [lo, hi) at glo (a ZeRO-2/3 shard's own buffer). */
double tera_grad_sq_by_param_at(const tera_model *m, int64_t lo, int64_t hi, const float *glo, double *sq);
void tera_grad_scale(tera_model *m, float s);

/* One optimizer step's results. */
typedef struct {
    int64_t step;
    double loss, ce_loss, aux_loss, z_loss;
    double grad_norm;
    float lr;
    double dropped_frac;
    double seconds, data_seconds;
    double comm_seconds; /* of seconds: this rank blocked in communication (tera_comm_traffic.blocked_s) */
    int skipped;    /* 1: non-finite loss or gradient, update skipped */
    double update_ratio; /* ||w_new - w_old|| / ||w_old|| of this step's update */
    int spike;           /* 1: loss spike detected, update dropped (and rolled back when possible) */
    int accum;           /* micro-batches per rank this step (the dynamic batch size) */
    int64_t batch_seqs;  /* global batch of this step in sequences: accum * micro_batch * world */
    double loss_scale;   /* the loss scale this step's backward used (1 unless fp16) */
    double model_flops_s; /* model FLOP/s of the whole job this step: tera_model_flops_per_token x its tokens / seconds */
    double mfu;           /* model_flops_s / (logging.peak_tflops x world ranks); -1 without logging.peak_tflops */
    int pp;               /* pipeline stages (1: none) */
    const double *pp_busy_s, *pp_wait_s; /* [pp] each stage's seconds this step running its operations and
                                            blocked on its neighbours (tera_pipe_last); NULL without a pipeline */
} tera_step_result;

/* ---------------------------------------------------------------- dynamic batch size
 * (src/train/batch_schedule.c). micro_batch stays fixed; the number of accumulated micro-batches
 * A of step s is ramp(s) x grow, at most batch_grow_max:
 *   ramp(s) = batch_rampup_start + floor((grad_accum - batch_rampup_start) * s / batch_rampup_steps)
 *             for s < batch_rampup_steps (and batch_rampup_start > 0), else grad_accum;
 *   grow    = 1, doubled after the ramp-up whenever the mean grad norm (before clipping) of a window
 *             of batch_grow_window healthy steps exceeds batch_grow_gnorm (the window then restarts).
 * The LR of the step is the schedule's times (A / grad_accum)^p, p = 1/2 (sqrt, default), 1
 * (linear) or 0 (none): the warmup/cosine schedule is stated for the full batch. The data position
 * advances by the sequences actually used; the growth state is saved in state.json. */
typedef struct {
    int grow;            /* multiplier of the ramped accumulation count: 1, 2, 4, ... */
    int window_n;        /* healthy steps in the current grad-norm window */
    double window_sum;   /* sum of their grad norms */
} tera_batch_state;

void tera_batch_init(tera_batch_state *b);
/* Micro-batches per rank of step `step`. */
int tera_batch_accum(const tera_train_config *t, const tera_batch_state *b, int64_t step);
/* LR multiplier of a step of `accum` micro-batches (exactly 1 for accum = grad_accum). */
float tera_batch_lr_factor(const tera_train_config *t, int accum);
/* Feeds step `step`'s grad norm (call for healthy steps only); returns 1 when the batch grew
 * (from step + 1 on) and then stores the window's mean grad norm in *mean (may be NULL). */
int tera_batch_observe(const tera_train_config *t, tera_batch_state *b, int64_t step, double grad_norm,
                       double *mean);
/* state.json: adds "batch" to root (the accumulation count of step `step` on `world` data-parallel
 * ranks is informative: it follows from the rest). */
void tera_batch_save(const tera_train_config *t, const tera_batch_state *b, int64_t step, int world,
                     struct cJSON *root);
/* Restores "batch" of root (absent: growth off); path names the file in errors. */
tera_status tera_batch_load(tera_batch_state *b, const struct cJSON *root, const char *path);

/* Fault injection for tests (TERA_FAULT_* environment variables, read at init). */
typedef struct {
    int64_t nan_step;           /* poison a gradient at this step (-1: off) */
    int64_t nan_n, nan_done;    /* "S:N": N steps from S, each once (tera_elastic_fault_nan) */
    int64_t spike_sample;       /* blow up the batch starting at this sample (-1: off) */
} tera_faults;

/* The elastic hooks' state (src/elastic/rank.c owns it): the wall-clock checkpoint cadence and the
 * rollback after training.nan_rollback_after consecutive non-finite steps. */
typedef struct {
    double ckpt_wall_last, ckpt_wall_full; /* when the last save and the last full save ended (tera_now; 0: not yet) */
    int ckpt_full_seen;                    /* full saves counted so far */
    int64_t nonfinite_run, nonfinite_lo;   /* consecutive non-finite steps, the first one's first sample */
    int64_t nan_rollbacks, nan_last_step;  /* rollbacks so far, the first failed step of the last one */
    int nan_repeats;                       /* rollbacks in a row for the same steps */
} tera_elastic_state;

/* The run log (trainer.c): metrics.jsonl and the live exporters. */
typedef struct {
    FILE *metrics;              /* run_dir/metrics.jsonl (NULL: no run directory) */
    FILE *mline;                /* the step line's builder: one memory stream kept for the run (rewound each
                                   step; its buffer mline_buf grows only when a line is longer than any before) */
    char *mline_buf;
    size_t mline_len;
    int metrics_errno;          /* a metrics.jsonl write failed (errno): reported, no more lines written */
    double t_start;             /* when set-up ended (elapsed_s) */
    struct tera_metrics_http *http; /* logging.metrics_port's endpoint (src/obs/metrics_http.c; NULL: off) */
    struct tera_tensorboard *tb;    /* logging.tensorboard's event file (src/obs/tensorboard.c; world rank 0; NULL: off) */
} tera_run_log;

/* The numeric precision in effect (src/train/precision.c resolves it at set-up). */
typedef struct {
    tera_precision precision;   /* of the linear layers' products (training.precision resolved) */
    const char *precision_note; /* one line: the precision in effect and why */
    tera_bf16_gemm bf16_gemm;   /* bf16: the units its products run on (training.bf16_gemm resolved) */
    const char *bf16_gemm_note; /* bf16: one line, the units and why ("" otherwise; static storage) */
    tera_loss_scaler scaler;    /* fp16's dynamic loss scale (scale 1 otherwise) */
} tera_precision_state;

/* The checkpoint engine's state (src/train/checkpoint.c). */
typedef struct {
    struct tera_ckpt_ctx *whole;   /* whole checkpoints: the writer (NULL until the first save) */
    struct tera_shard_ckpt *shard; /* the same for sharded checkpoints */
    int force_full;                /* the next save is full (set by the elastic hooks) */
    int last;                      /* the next save is the run's last: synchronous (nothing would run beside
                                      a background write), so one process writes its state without a snapshot */
} tera_ckpt_engine;

/* The step loop's state; each part is owned by its module. */
typedef struct {
    tera_config cfg;
    tera_topology topo;         /* ranks -> coordinates -> groups (src/parallel/topology.c): the world size
                                   and rank, dp/tp/pp/ep/edp and this rank's index on each (the trainer keeps no
                                   copies) */
    tera_groups groups;         /* the communicators of the topology's groups (include/tera/groups.h) */
    int root;                   /* world rank 0 (writes outputs) */
    tera_model model;
    struct tera_zero *sharding; /* ZeRO sharding: optimizer state, gradient reduction, the optimizer step and
                                   the checkpoint windows of this rank's part (include/tera/zero.h) */
    struct tera_onebit *onebit; /* optimizer.name = onebit_adam (src/train/onebit.c); NULL: AdamW */
    struct tera_pipe *pipe;     /* the pipeline executor (include/tera/pipeline.h), pp > 1 */
    double *step_sums;          /* [5 + 2 pp] the step's statistics summed over the stages: the loss sums,
                                   then with a pipeline each stage's busy and waiting seconds */
    tera_precision_state prec;  /* precision in effect and fp16's loss scale */
    tera_token_source src;
    tera_loader loader;
    tera_prefetcher *prefetch;  /* training read-ahead (NULL when data.prefetch = 0) */
    int32_t *tokens, *targets;  /* [micro_batch, seq_len] (evaluation, and training without prefetch) */
    int64_t step;               /* optimizer steps completed */
    int64_t samples_consumed;   /* training samples read so far: the data position (the next step
                                   reads global samples samples_consumed, +1, ...) */
    int64_t tokens_per_step;
    double flops_per_token;     /* model FLOPs per token, forward and backward (tera_model_flops_per_token) */
    int64_t skipped_steps;      /* updates skipped for non-finite loss or gradients */
    tera_batch_state batch;     /* dynamic batch size: growth state (saved in state.json) */
    tera_spike_guard spike;     /* the loss-spike guard (src/train/spike_guard.c) */
    tera_faults faults;         /* test hooks (fault injection) */
    tera_elastic_state elastic; /* the elastic hooks' state (src/elastic/rank.c) */
    char run_dir[TERA_PATH_MAX];
    tera_run_log log;           /* metrics.jsonl, the /metrics endpoint, TensorBoard */
    tera_ckpt_engine ckpt;      /* checkpoint writers (src/train/checkpoint.c) */
} tera_trainer;

/* The bytes one rank sends in one training step of `accum` micro-batches under the trainer's layout,
 * by kind of transfer (as src/comm/comm.c counts them: collectives at ring-algorithm volume, an
 * all-reduce of n bytes over p ranks sends 2(p-1)/p n, a reduce-scatter or all-gather (p-1)/p n,
 * point-to-point exactly), derived from the layout alone (src/train/comm_volume.c). min: what the
 * layout must move; overhead: the step's statistics and the expert exchange's row counts. */
typedef enum {
    TERA_XFER_ALLREDUCE, TERA_XFER_REDUCE_SCATTER, TERA_XFER_ALLGATHER, TERA_XFER_ALLTOALL, TERA_XFER_P2P,
    TERA_XFER_KINDS
} tera_xfer_kind;
extern const char *const tera_xfer_names[TERA_XFER_KINDS]; /* "allreduce", "reduce_scatter", ... */
typedef struct {
    double min[TERA_XFER_KINDS], overhead[TERA_XFER_KINDS];
    double grad, tp, zero3_gather, ep, pp, stats, counts; /* the same bytes by purpose */
} tera_comm_volume;
tera_comm_volume tera_trainer_comm_volume(const tera_trainer *tr, int accum);
/* Bytes of this rank's optimizer state (the Adam moments it holds). */
int64_t tera_trainer_optimizer_bytes(const tera_trainer *tr);

/* overwrite: 0 = refuse a non-empty run directory, TERA_RUN_CONTINUE = use it as it is (resume),
 * TERA_RUN_FRESH = start over in it (--force: its metrics and checkpoints are removed). */
enum { TERA_RUN_CONTINUE = 1, TERA_RUN_FRESH = 2 };
/* Builds model, optimizer and data from cfg (finalized). Starts from cfg->training.init_from
 * (a Hugging Face directory or a tera checkpoint) when set, else a seeded random init. run_dir "" = no run directory
 * (tests). An existing non-empty run_dir is refused unless overwrite. */
/* Before anything is allocated (src/train/preflight.c): every rank's memory as the planner counts it,
 * summed over the ranks of each host, against the host's available memory (MemAvailable, or the
 * cgroup limit's rest); a host that cannot hold its ranks' figure is named in one error, the same on
 * every rank. Skipped when training.memory_check is false or the device is cuda. Collective. */
tera_status tera_train_memory_check(const tera_config *cfg);
tera_status tera_trainer_init(tera_trainer *tr, const tera_config *cfg, const char *run_dir, int overwrite);
void tera_trainer_free(tera_trainer *tr);
/* One optimizer step over grad_accum micro-batches. */
tera_status tera_trainer_step(tera_trainer *tr, tera_step_result *r);
/* Mean cross-entropy over `batches` micro-batches of the validation split (of the whole dataset
 * in order when data.val_fraction = 0). */
tera_status tera_trainer_eval(tera_trainer *tr, int batches, double *loss);
/* tera_trainer_eval that also gives the next-token accuracy (acc: the fraction of positions whose
 * largest logit is the target; may be NULL). */
tera_status tera_trainer_eval_acc(tera_trainer *tr, int batches, double *loss, double *acc);
/* The same over the validation split of dataset `dataset` of a blend (data.paths; -1: the blend's
 * validation samples, as tera_trainer_eval_acc). */
tera_status tera_trainer_eval_dataset(tera_trainer *tr, int dataset, int batches, double *loss, double *acc);
/* The evaluation line of metrics.jsonl for validation loss vl and accuracy va at step `step`: val_loss,
 * val_ppl, val_acc and, with a blend, val_loss_NAME and val_acc_NAME of every dataset (evaluated here:
 * collective, every rank calls it). Writes line[n] (JSON + newline) and its length. */
tera_status tera_trainer_eval_line(tera_trainer *tr, int64_t step, double vl, double va, char *line, size_t n,
                                   size_t *len);
/* Positions of logits [N, Vl] (this rank's vocabulary rows [v0, v0 + Vl)) whose first largest logit
 * over the whole vocabulary is the target; tp_group: the ranks holding the other rows (NULL or one
 * rank: Vl is the whole vocabulary); scratch: 2 N floats (used when the group has several ranks). */
int64_t tera_count_correct(const float *logits, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0,
                           struct tera_comm *tp_group, float *scratch);
/* Writes run_dir/checkpoints/step_NNNNNNNN/: HF weights + config.json (with the router bias),
 * optimizer.safetensors (moments), state.json (step, data position, seed, batch-growth, loss-scale
 * and spike-guard state), config.ini, manifest.json and COMMIT (docs/CHECKPOINTS.md). */
tera_status tera_trainer_save(tera_trainer *tr);
/* One process: snapshot of its storage (the whole model and its moments) and the background write
 * (src/train/checkpoint.c); a synchronous save (checkpoint.async off, the final or the run's last)
 * writes the storage itself. */
tera_status tera_trainer_save_whole(tera_trainer *tr);
/* Several ranks, whole checkpoint: streamed window by window to world rank 0, which writes the
 * files as tera_trainer_save_whole would (collective, synchronous; no rank holds the whole model). */
tera_status tera_trainer_save_streamed(tera_trainer *tr);
/* The transfer window every rank of a streamed save holds (checkpoint.writer_buffer_mb), bytes. */
int64_t tera_ckpt_writer_buffer_bytes(const tera_config *c);
/* The snapshot a whole save from one rank's storage allocates (at its first save that needs one), bytes,
 * for n_floats parameters: 3 x n_floats + the router bias where a save may run in the background
 * (checkpoint.async with checkpoint.every, every_s or full_every_s) or the moments are bf16
 * (optimizer.moments, widened into it); else 0 (synchronous saves write the state itself). */
int64_t tera_ckpt_snapshot_bytes(const tera_config *c, int64_t n_floats);
/* Whether a save of this layout is whole from world rank 0's own storage (tera_trainer_save_whole):
 * one process, or data-parallel replicas without ZeRO, tensor, pipeline or expert parallelism and
 * without checkpoint.sharded; else it is streamed (or sharded). */
int tera_ckpt_save_is_whole(const tera_config *c, const tera_topology *t);
/* checkpoint.sharded with several ranks: every rank writes its own blocks (collective). */
tera_status tera_trainer_save_sharded(tera_trainer *tr);
/* Restores the newest complete checkpoint of run_dir (weights, moments, step, router bias, data
 * position, batch growth state, loss-spike guard state). The data must be the same token stream
 * (checked: token count, sample length, shuffle, seed); the batch size may differ, since the
 * position is counted in samples. Spike-guard knowledge newer than the checkpoint (a rollback:
 * skipped windows, the LR cut, the last spike) is kept, merged with the checkpoint's. */
tera_status tera_trainer_resume(tera_trainer *tr);
/* The same from one committed checkpoint directory (full, or differential with its base beside it),
 * saved under any layout; the caller verifies it first (tera_ckpt_verify) when it wants the damaged
 * file named. Opens no metrics file (tera ckpt convert). */
tera_status tera_trainer_resume_dir(tera_trainer *tr, const char *dir);
/* Loads this rank's part of a checkpoint's weights (and moments) and the router bias, piece by
 * piece, then checks the regions against the manifest (collective). */
tera_status tera_trainer_load_dir(tera_trainer *tr, const char *dir, int moments);
/* Opens run_dir/metrics.jsonl for appending (no-op without a run directory). */
tera_status tera_trainer_open_metrics(tera_trainer *tr, const char *mode);
/* After a step: a healthy step's grad norm goes to the batch growth trigger; a growth is logged
 * (stderr and metrics.jsonl). */
void tera_trainer_batch_observe(tera_trainer *tr, const tera_step_result *r);
/* Runs steps until cfg.training.steps, printing progress; returns the final step's result. */
tera_status tera_trainer_run(tera_trainer *tr, tera_step_result *last);

/* ---------------------------------------------------------------- layout
 * The communicators are include/tera/groups.h; the optimizer's ranges (ZeRO shards), the gradient
 * reduction, the optimizer step and the conversion between this rank's storage and the whole model
 * (the checkpoint windows) are include/tera/zero.h (src/parallel/zero.c): the trainer holds one
 * tera_zero (tr->sharding) and calls it. */

/* The pipeline executor is include/tera/pipeline.h (src/parallel/pipeline.c); the trainer builds
 * it with its data and ZeRO-3 hooks (trainer.c) when pp > 1. */

/* ---------------------------------------------------------------- checkpoints
 * (src/train/checkpoint.c; on-disk format and readers in include/tera/ckpt.h, docs/CHECKPOINTS.md)
 * tera_trainer_save snapshots parameters, Adam moments, router bias and the training state into
 * host buffers (allocated once) and, with checkpoint.async, returns while a background thread
 * writes; the next save waits for it. The save at the final step is always full and synchronous
 * and releases the context. */
typedef struct tera_ckpt_ctx tera_ckpt_ctx;
typedef struct tera_shard_ckpt tera_shard_ckpt;
typedef struct {
    int saves, full_saves;
    double last_pause_s, max_pause_s, total_pause_s; /* step-loop pause: wait for the previous write + snapshot */
    double last_write_s;        /* the last write's duration (background when async) */
    int64_t last_bytes;         /* the last checkpoint's size on disk */
    int last_full;
    int64_t last_chunks_changed, last_chunks_total; /* differential: 64 KiB chunks stored / all */
} tera_ckpt_stats;
/* The pause of the last save (seconds), and all figures of this process's saves. */
double tera_ckpt_last_pause_seconds(void);
tera_ckpt_stats tera_ckpt_last_stats(void);
/* Waits for a background write and frees the context (call before tera_trainer_free's teardown;
 * returns the background write's error, if any). */
tera_status tera_trainer_ckpt_close(tera_trainer *tr);

#endif
