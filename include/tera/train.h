/* Training: AdamW, the LR schedule, global-norm clipping, and the step loop with gradient
 * accumulation, metrics and checkpoints. */
#ifndef TERA_TRAIN_H
#define TERA_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "tera/comm.h"
#include "tera/config.h"
#include "tera/data.h"
#include "tera/model.h"
#include "tera/precision.h"

typedef struct {
    float *m, *v;   /* first and second moments of the flat range [lo, hi), one allocation */
    int64_t t;      /* updates taken (for bias correction) */
    int64_t n;      /* hi - lo */
    int64_t lo, hi; /* the parameters this optimizer updates: all of them, or a ZeRO-1 shard */
} tera_adamw;

void tera_adamw_init(tera_adamw *o, int64_t n_floats);
/* ZeRO-1: moments for the flat range [lo, hi) only. */
void tera_adamw_init_range(tera_adamw *o, int64_t lo, int64_t hi);
void tera_adamw_free(tera_adamw *o);
/* One decoupled-weight-decay Adam update of every parameter of m (decay only where the
 * parameter table says so): p -= lr*wd*p; p -= lr * m_hat / (sqrt(v_hat) + eps), on the gradient
 * times grad_scale (the clipping factor, applied here instead of in a separate pass). With
 * zero_grad, each gradient is cleared right after use (no separate pass either). update_sq and
 * param_sq (may be NULL) receive sum((w_new - w_old)^2) and sum(w_old^2) over all parameters. */
void tera_adamw_step(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                     int zero_grad, double *update_sq, double *param_sq);

/* MODEL.md's schedule: linear warmup (s+1)/W, then cosine from lr to min_lr over steps - W. */
float tera_lr_at(const tera_train_config *t, int64_t step);
/* Global L2 norm of all gradients (fixed reduction order, independent of the thread count). */
double tera_grad_norm(const tera_model *m);
/* The same squared, also per parameter tensor into sq[n_params] (sq may be NULL). */
double tera_grad_sq_by_param(const tera_model *m, double *sq);
/* The same over the flat range [lo, hi) only (a ZeRO shard). */
double tera_grad_sq_by_param_range(const tera_model *m, int64_t lo, int64_t hi, double *sq);
void tera_grad_scale(tera_model *m, float s);

/* One optimizer step's results. */
typedef struct {
    int64_t step;
    double loss, ce_loss, aux_loss, z_loss;
    double grad_norm;
    float lr;
    double dropped_frac;
    double seconds, data_seconds;
    int skipped;    /* 1: non-finite loss or gradient, update skipped */
    double update_ratio; /* ||w_new - w_old|| / ||w_old|| of this step's update */
    int spike;           /* 1: loss spike detected, update dropped (and rolled back when possible) */
    double loss_scale;   /* the loss scale this step's backward used (1 unless fp16) */
} tera_step_result;

typedef struct {
    tera_config cfg;
    tera_model model;
    tera_adamw opt;
    tera_token_source src;
    tera_loader loader;
    int32_t *tokens, *targets;  /* [micro_batch, seq_len] (evaluation, and training without prefetch) */
    tera_prefetcher *prefetch;  /* training read-ahead (NULL when data.prefetch = 0) */
    int64_t step;               /* optimizer steps completed */
    int64_t samples_consumed;   /* training samples read so far: the data position (the next step
                                   reads global samples samples_consumed, +1, ...) */
    FILE *metrics;              /* run_dir/metrics.jsonl (NULL: no run directory) */
    char run_dir[TERA_PATH_MAX];
    double t_start;
    int64_t tokens_per_step;
    int grads_zero;             /* the gradients are known to be zero (cleared by the optimizer) */
    double *grad_sq;            /* [n_params] squared gradient norm per tensor, of the last step */
    int64_t skipped_steps;      /* updates skipped for non-finite loss or gradients */
    int64_t fault_nan_step;     /* fault injection for tests: poison a gradient at this step (-1: off) */
    struct tera_comm *dp;       /* the data-parallel group (the world for now) */
    int rank, world;            /* this rank in it, and its size (= parallel.dp) */
    tera_comm_req *buckets;     /* [n_layers + 2] in-flight gradient reductions */
    int n_buckets;
    int zero;                   /* ZeRO stage in effect (1: optimizer state sharded over dp) */
    double *spike_hist;         /* [2 * spike_window]: recent losses, then grad norms (ring) */
    int spike_n, spike_pos;     /* entries in the ring, next slot */
    int64_t lr_cut_until;       /* steps before this run at spike_lr_factor x LR */
    int64_t skip_lo[64], skip_hi[64]; /* data windows that caused spikes: samples_consumed jumps over them */
    int n_skips;
    int64_t last_spike_step;    /* to stop rolling back when the same step keeps spiking */
    int spike_repeats;
    int64_t spike_events;       /* spikes handled so far */
    int64_t fault_spike_sample; /* fault injection for tests: blow up the batch starting at this sample (-1: off) */
    int64_t *shard_counts;      /* [world] floats of the flat buffer each rank's shard holds */
    struct tera_ckpt_ctx *ckpt; /* checkpoint writer state (src/train/checkpoint.c; NULL until the first save) */
    tera_precision precision;   /* of the linear layers' products (training.precision resolved) */
    const char *precision_note; /* one line: the precision in effect and why */
    tera_loss_scaler scaler;    /* fp16's dynamic loss scale (scale 1 otherwise) */
} tera_trainer;

/* Builds model, optimizer and data from cfg (finalized). Starts from cfg->training.init_from
 * (a Hugging Face directory) when set, else a seeded random init. run_dir "" = no run directory
 * (tests). An existing non-empty run_dir is refused unless overwrite. */
tera_status tera_trainer_init(tera_trainer *tr, const tera_config *cfg, const char *run_dir, int overwrite);
void tera_trainer_free(tera_trainer *tr);
/* One optimizer step over grad_accum micro-batches. */
tera_status tera_trainer_step(tera_trainer *tr, tera_step_result *r);
/* Mean cross-entropy over `batches` micro-batches of the validation split (of the whole dataset
 * in order when data.val_fraction = 0). */
tera_status tera_trainer_eval(tera_trainer *tr, int batches, double *loss);
/* Writes run_dir/checkpoints/step_NNNNNNNN/: HF weights + config.json (with the router bias),
 * optimizer.safetensors (moments), state.json (step, data position, seed) and config.ini. */
tera_status tera_trainer_save(tera_trainer *tr);
/* Restores the newest complete checkpoint of run_dir (weights, moments, step, router bias, data
 * position). The data must be the same token stream (checked: token count, sample length, shuffle,
 * seed); the batch size may differ, since the position is counted in samples. */
tera_status tera_trainer_resume(tera_trainer *tr);
/* Opens run_dir/metrics.jsonl for appending (no-op without a run directory). */
tera_status tera_trainer_open_metrics(tera_trainer *tr, const char *mode);
/* Runs steps until cfg.training.steps, printing progress; returns the final step's result. */
tera_status tera_trainer_run(tera_trainer *tr, tera_step_result *last);

/* ---------------------------------------------------------------- checkpoints
 * (src/train/checkpoint.c; on-disk format and readers in include/tera/ckpt.h, docs/CHECKPOINTS.md)
 * tera_trainer_save snapshots parameters, Adam moments, router bias and the training state into
 * host buffers (allocated once) and, with checkpoint.async, returns while a background thread
 * writes; the next save waits for it. The save at the final step is always full and synchronous
 * and releases the context. */
typedef struct tera_ckpt_ctx tera_ckpt_ctx;
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
