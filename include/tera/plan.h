/* tera plan: the memory of every rank of a parallel layout, computed without allocating anything,
 * a first time model of a training step, and a search over layouts for a device count (issue 18;
 * docs/PLAN.md).
 *
 * Memory: the figures are those tera's allocator would take on each rank (parameter table with the
 * rank's shard spec, the model's activation and scratch carving, the ZeRO shards and staging slots
 * of src/train/layout.c, the pipeline's activation slots from the simulated schedule), to the byte:
 * tests/cli_plan.sh compares them with the "memory bytes per rank" line of `tera train`. Time: FLOPs
 * at a stated fraction of the device's peak, communication by an alpha-beta model over the link each
 * group crosses, and the simulated pipeline bubble; not yet calibrated against measured steps. */
#ifndef TERA_PLAN_H
#define TERA_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/status.h"

/* ------------------------------------------------------------------ hardware descriptions */
typedef enum { TERA_HW_FP32, TERA_HW_BF16, TERA_HW_FP16, TERA_HW_FP8, TERA_HW_NPREC } tera_hw_prec;

typedef struct {
    char name[128];
    double peak_flops[TERA_HW_NPREC]; /* dense FLOP/s per device (0: not supported) */
    double memory_bytes;              /* device memory */
    int devices_per_node;
    double intra_bw, intra_lat;       /* inside a node: bytes/s per device per direction, seconds per message */
    double inter_bw, inter_lat;       /* between nodes: the same */
} tera_hw;

/* Reads a hardware INI file (hardware/NAME.ini): [device] name, memory_gib, peak_tflops_fp32/_bf16/
 * _fp16/_fp8; [node] devices; [intra_node] and [inter_node] bandwidth_gbytes_s, latency_us.
 * Errors name the file, the line and the key. */
tera_status tera_hw_load(tera_hw *hw, const char *path);
tera_hw_prec tera_hw_prec_of(const char *training_precision); /* fp32 | bf16 | fp16 | auto (= fp32) */

/* ------------------------------------------------------------------ memory per rank */
enum {
    TERA_PM_PARAMS,      /* parameters (or the ZeRO-3 shard) */
    TERA_PM_GRADS,       /* gradients (or the ZeRO-2/3 shard) */
    TERA_PM_OPTIMIZER,   /* Adam moments (or the ZeRO-1+ shard) */
    TERA_PM_ACTS,        /* activations: every slot's kept parts, the recompute work set, the head's */
    TERA_PM_SCRATCH,     /* backward buffers, logits, attention, routing and dispatch scratch */
    TERA_PM_COMM,        /* expert-exchange buffers and ZeRO-2/3 staging slots */
    /* the categories above are the six of `tera train`'s "memory bytes per rank" line; these three are
     * allocated too but not in that line */
    TERA_PM_PIPELINE,    /* pipeline send/receive buffers and token slots (src/train/pipeline.c) */
    TERA_PM_CKPT,        /* checkpoint: one rank: the snapshot; several: the writer window + a chunk */
    TERA_PM_OTHER,       /* router state, per-tensor norm scratch, the micro-batch's tokens */
    TERA_PM_N
};
extern const char *const tera_pm_name[TERA_PM_N];

typedef struct {
    int pp_rank, dp_rank, tp_rank;     /* the rank described (ep_rank, edp_rank follow from dp_rank) */
    int n_ranks;                       /* ranks with exactly these figures (a role) */
    int slots;                         /* activation slots (micro-batches in flight on this stage) */
    int layer_lo, layer_hi;            /* first virtual stage's layers (chunk 0) */
    int64_t n_floats, n_dense;         /* parameter floats held, of them non-expert */
    int64_t bytes[TERA_PM_N];
    int64_t total;                     /* sum of all categories */
    int64_t printed_total;             /* sum of the first six (tera train's line) */
} tera_plan_mem;

/* The memory of world rank `wrank` of the layout cfg->parallel describes (world = pp dp tp), for
 * cfg->training's micro-batch, sequence length, grad_accum and recompute; nothing of the model is
 * allocated. threads: the OpenMP thread count the scratch is sized for (attention and routing;
 * <= 0: training.threads, or all cores when that is 0). Errors: the config's layout is invalid. */
tera_status tera_plan_rank_memory(const tera_config *cfg, int wrank, int threads, tera_plan_mem *out);

/* Every distinct rank role of the layout: out[*n] (caller frees), one per distinct figure set with
 * n_ranks counting the ranks sharing it, in world-rank order of their first member. */
tera_status tera_plan_roles(const tera_config *cfg, int threads, tera_plan_mem **out, int *n);

/* ------------------------------------------------------------------ time model */
typedef struct {
    double efficiency;   /* fraction of the peak the matrix products reach (stated, not calibrated) */
    double reserve;      /* fraction of device memory kept free (allocator, CUDA context, fragmentation) */
    int threads;         /* scratch sizing (see tera_plan_rank_memory) */
} tera_plan_opts;

typedef struct {
    double flops_per_step;     /* model FLOPs of one step (6 x active params x tokens + attention) */
    double recompute_flops;    /* extra forward FLOPs of recomputation, per step, whole job */
    double compute_s;          /* busiest stage's compute per step, bubble excluded */
    double bubble_frac;        /* simulated idle fraction of the schedule (0 without a pipeline) */
    double bubble_s;
    double tp_s, ep_s, pp_s;   /* per step: tensor-parallel sums, expert exchange, pipeline sends */
    double dp_s;               /* data-parallel gradient reduction and ZeRO gathers, exposed part */
    double dp_total_s;         /* the same before overlap */
    double step_s;
    double tokens_per_s, mfu;  /* MFU: model FLOPs / (step time x devices x peak) */
    double bytes_tp, bytes_ep, bytes_pp, bytes_dp; /* bytes one rank sends per step, by purpose */
} tera_plan_time;

tera_status tera_plan_time_model(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o,
                                 tera_plan_time *out);

/* ------------------------------------------------------------------ search */
typedef struct {
    tera_config cfg;            /* the layout as a configuration (parallel.*, training.micro_batch, grad_accum, recompute) */
    tera_plan_mem worst;        /* the rank with the largest total */
    tera_plan_time time;
    int fits;
} tera_plan_candidate;

typedef struct {
    int devices, global_batch;  /* sequences per step */
    int max_tp;                 /* 0: devices per node */
    int keep;                   /* best layouts kept */
} tera_plan_search_opts;

/* Enumerates dp, tp, pp, ep, ZeRO stage, schedule and chunks, recompute and micro-batch for
 * base's model and sequence length; keeps the layouts tera_config_finalize accepts; best[*n_best]
 * (caller frees) holds the fitting ones, fastest first; *n_valid, *n_fit count them all. */
tera_status tera_plan_search(const tera_config *base, const tera_hw *hw, const tera_plan_opts *o,
                             const tera_plan_search_opts *so, tera_plan_candidate **best, int *n_best,
                             int64_t *n_valid, int64_t *n_fit);

#endif
