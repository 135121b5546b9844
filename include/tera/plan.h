/* tera plan: the memory of every rank of a parallel layout, computed without allocating anything,
 * a time model of a training step, and a search over layouts for a device count (issue 18;
 * docs/PLAN.md).
 *
 * Memory: the figures are those tera's allocator would take on each rank (parameter table with the
 * rank's shard spec, the model's activation and scratch carving, the ZeRO shards and staging slots
 * of src/train/layout.c, the pipeline's activation slots from the simulated schedule), to the byte:
 * tests/cli_plan.sh compares them with the "memory bytes per rank" line of `tera train`. Time: each
 * product at its measured (tera plan --calibrate) or stated rate, the element-wise passes and the
 * optimizer at the memory bandwidth, communication by measured or alpha-beta fits over the link each
 * group crosses, and the simulated pipeline bubble (bench/plan_validate.sh compares it with measured
 * steps). */
#ifndef TERA_PLAN_H
#define TERA_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/status.h"

/* ------------------------------------------------------------------ hardware descriptions */
typedef enum { TERA_HW_FP32, TERA_HW_BF16, TERA_HW_FP16, TERA_HW_FP8, TERA_HW_NPREC } tera_hw_prec;

/* A measured rate of the linear layer's products (tera plan --calibrate): forward and backward of
 * y[m, n] = x[m, k] w[n, k]^T (the three products: 6 m k n FLOPs) at `threads` threads. */
typedef struct {
    int threads;
    tera_hw_prec prec;
    int64_t m, k, n;
    double flops_s;
} tera_hw_gemm;
/* A measured rate of the attention kernel (forward + backward) at a shape; FLOPs counted as the
 * model counts them (12 T H hd per token: 4 forward, 8 backward). */
typedef struct {
    int threads, B, T, H, Hkv, hd;
    double flops_s;
} tera_hw_attn;
/* A collective measured through tera's comm layer on `ranks` ranks of this machine, fitted as
 * alpha + bytes / beta (bytes: what one rank sends, as src/comm/comm.c counts it). TERA_HW_SHARED_SUM
 * ("shared_sum"): the sum of the ranks' buffers in host-shared memory that ZeRO runs where a group's
 * ranks share a host (src/parallel/zero.c: each rank adds its share of every rank's buffer in rank
 * order and writes it into all of them); its bytes are the memory one rank reads and writes (2 x 4 n
 * for a buffer of n floats), so the other forms (a shard's piece, a gathered piece) are priced by
 * their own traffic. */
typedef enum {
    TERA_HW_ALLREDUCE,
    TERA_HW_ALLGATHER,
    TERA_HW_ALLTOALL,
    TERA_HW_P2P,
    TERA_HW_SHARED_SUM,
    TERA_HW_NCOLL
} tera_hw_coll_kind;
typedef struct {
    tera_hw_coll_kind kind;
    int ranks;
    double alpha_s, beta_bytes_s;
} tera_hw_coll;
/* What ranks sharing a node's cores and memory get (tera plan --calibrate under mpirun): with `ranks`
 * processes of `threads` threads each computing at once on the node, each runs the products at
 * `compute` and streams memory at `memory` times its rate alone. */
typedef struct {
    int ranks, threads;
    double compute, memory;
} tera_hw_share;
#define TERA_HW_MAX_GEMM 512
#define TERA_HW_MAX_ATTN 64
#define TERA_HW_MAX_COLL 64
#define TERA_HW_MAX_SHARE 32

typedef struct {
    char name[128];
    double peak_flops[TERA_HW_NPREC]; /* dense FLOP/s per device (0: not supported) */
    double memory_bytes;              /* device memory */
    int devices_per_node;
    double intra_bw, intra_lat;       /* inside a node: bytes/s per device per direction, seconds per message */
    double inter_bw, inter_lat;       /* between nodes: the same */
    /* optional */
    double mem_bw;                    /* [device] memory_bandwidth_gbytes_s: the element-wise passes and the optimizer */
    double gemm_efficiency;           /* [device] gemm_efficiency: fraction of the peak the products reach
                                         where no measured rate applies (0: tera_plan_opts.efficiency) */
    int cores;                        /* [node] cores: ranks x threads beyond it share the cores (a CPU machine) */
    double mem_bw_threads[65];        /* [memory] point = THREADS GBYTES/S: measured streaming bandwidth (0: none) */
    int n_gemm, n_attn, n_coll;       /* measured rates ([gemm], [attention], [collective]: tera plan --calibrate) */
    tera_hw_gemm gemm[TERA_HW_MAX_GEMM];
    tera_hw_attn attn[TERA_HW_MAX_ATTN];
    tera_hw_coll coll[TERA_HW_MAX_COLL];
    int n_share;                      /* [shared] point = RANKS THREADS COMPUTE MEMORY (measured fractions) */
    tera_hw_share share[TERA_HW_MAX_SHARE];
    /* derived by tera_hw_load from the measured points (0: not known): each core's throughput with
     * all `cores` busy in one process, as a fraction of one core alone: [0] the products (the median
     * over the [gemm] shapes measured at 1 and at `cores` threads), [1] streaming memory ([memory]
     * points at 1 and `cores` threads) */
    double all_cores[2];
} tera_hw;

/* Reads a hardware INI file (hardware/NAME.ini): [device] name, memory_gib, peak_tflops_fp32/_bf16/
 * _fp16/_fp8, and optionally memory_bandwidth_gbytes_s, gemm_efficiency; [node] devices (and
 * optionally cores); [intra_node] and [inter_node] bandwidth_gbytes_s, latency_us; and what tera
 * plan --calibrate measured: [gemm] point = THREADS PREC M K N GFLOP/S, [attention] point = THREADS
 * B T H HKV HD GFLOP/S, [collective] KIND = RANKS LATENCY_US GBYTES/S (KIND: allreduce, allgather,
 * alltoall, p2p), [shared] point = RANKS THREADS COMPUTE MEMORY (fractions of the rate alone).
 * Errors name the file, the line and the key. */
tera_status tera_hw_load(tera_hw *hw, const char *path);
/* Writes hw as such a file (to a temporary name, then renamed); `comment` lines go first. */
tera_status tera_hw_write(const tera_hw *hw, const char *path, const char *comment);
extern const char *const tera_hw_prec_name[TERA_HW_NPREC];       /* "fp32", "bf16", "fp16", "fp8" */
extern const char *const tera_hw_coll_name[TERA_HW_NCOLL];       /* "allreduce", ... */
/* The rate the time model uses for a linear layer's products of that shape (forward + backward):
 * a measured point of the same (threads, precision, k, n), interpolated in m (log-log), else the
 * points of that thread count and precision interpolated by FLOPs per call, else efficiency x peak. */
double tera_hw_gemm_rate(const tera_hw *hw, int threads, tera_hw_prec prec, int64_t m, int64_t k, int64_t n,
                         double efficiency);
/* The same for the attention kernel (B, T, H, Hkv, hd); without measured points: the products' rate
 * of the shape [B T, hd] x [hd, T] at precision prec. */
double tera_hw_attn_rate(const tera_hw *hw, int threads, tera_hw_prec prec, int B, int T, int H, int Hkv, int hd,
                         double efficiency);

/* The fraction of its rate alone that each of `ranks` ranks of `threads` threads computing at once on
 * one node gets (memory = 1: streaming memory; 0: the products): 1 where the node has no [node] cores
 * (a device per rank) or for one rank; else the [shared] points of the nearest thread count,
 * interpolated linearly in ranks from (1, 1), and beyond the largest measured count at that count's
 * throughput for the whole node (f x R_max / ranks when R_max x threads >= cores); without points,
 * from one process's rates at 1 and `cores` threads (all_cores, a = the fraction): with W = ranks x
 * threads workers each runs at s(W) of one core alone, s(W) = 1 + (W - 1) (a - 1) / (cores - 1) up to
 * the cores and cores a / W beyond, and a rank at s(W) / s(threads) of its rate alone; without those
 * either (a = 1), min(1, cores / (ranks x threads)) for a rank of threads <= cores. */
double tera_hw_shared(const tera_hw *hw, int ranks, int threads, int memory);

/* tera plan --calibrate: measures this machine for cfg's shapes (see docs/PLAN.md) on the comm
 * world's ranks (collectives when there are several) and merges the result into the file `out`
 * (created when absent). Only world rank 0 writes. */
tera_status tera_plan_calibrate(const tera_config *cfg, const char *out, FILE *log);
/* The same, only the [shared] points (under mpirun; the file's other figures kept as they are). */
tera_status tera_plan_calibrate_shared(const tera_config *cfg, const char *out, FILE *log);
tera_hw_prec tera_hw_prec_of(const char *training_precision); /* fp32 | bf16 | fp16 | auto (= fp32) */

/* ------------------------------------------------------------------ memory per rank */
enum {
    TERA_PM_PARAMS,      /* parameters (or the ZeRO-3 shard) */
    TERA_PM_GRADS,       /* gradients (or the ZeRO-2/3 shard) */
    TERA_PM_OPTIMIZER,   /* Adam moments (or the ZeRO-1+ shard) */
    TERA_PM_ACTS,        /* activations: every slot's kept parts, the recompute work set, the head's */
    TERA_PM_SCRATCH,     /* backward buffers, logits, attention, routing and dispatch scratch */
    TERA_PM_COMM,        /* expert-exchange buffers and ZeRO-2/3 staging slots */
    /* the categories above are the six of `tera train`'s "memory bytes per rank" line; these are
     * allocated too but not in that line */
    TERA_PM_PIPELINE,    /* pipeline send/receive buffers and token slots (src/parallel/pipeline.c) */
    TERA_PM_CKPT,        /* checkpoint: one rank: the snapshot; several: the writer window + a chunk */
    TERA_PM_OTHER,       /* router state, per-tensor norm scratch, the micro-batch's tokens */
    TERA_PM_ONEBIT,      /* optimizer.name = onebit_adam: ZeRO-1's whole momentum, the error feedback and
                            message buffers of its 1-bit all-reduces (src/train/onebit.c) */
    TERA_PM_SHADOW,      /* the bf16 weight shadow, 2 bytes per resident parameter where tera_bf16_shadow_on
                            (include/tera/precision.h) holds; tera train prints it on a line of its own */
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
    double efficiency;   /* fraction of the peak the matrix products reach where the hardware file has
                            no measured rate and no gemm_efficiency */
    double reserve;      /* fraction of device memory kept free (allocator, CUDA context, fragmentation) */
    int threads;         /* scratch sizing (see tera_plan_rank_memory) */
    /* how the run being planned moves experts' rows (defaults: tera's own, 4 and 0): bytes per
     * exchanged element, and the fraction of the exchange hidden behind compute */
    double exchange_bytes, exchange_overlap;
    double comm_overlap; /* fraction of the tensor-parallel sums and of the exposed data-parallel traffic
                            the planned run hides behind compute (tera's own: 0) */
    int products_prec;   /* the precision whose peak the products run at: a tera_hw_prec, or -1
                            (default) for training.precision (e.g. FP8 products, which tera has not) */
} tera_plan_opts;

typedef struct {
    double flops_per_step;     /* model FLOPs of one step (6 x active params x tokens + attention) */
    double matmul_s, memory_s; /* of compute_s: products and attention at their rates; element-wise passes
                                  and the optimizer at the memory bandwidth */
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
    double optimizer_s;        /* of memory_s: the optimizer pass (and zeroing, norms) once a step */
    double ep_hidden_s;        /* per step: expert exchange hidden by parallel.ep_overlap (not in ep_s) */
} tera_plan_time;

/* What parallel.ep_overlap hides of one MoE layer's point-to-point exchange (src/model/dispatch.c):
 * x the seconds of one of its four transfers (rows out or back, forward or backward), c the layer's
 * routed experts' forward + backward seconds (the forward a third), sf and sb the side work the
 * dispatcher runs right after posting the rows out (the shared experts: forward their hidden
 * activations, backward all of it; 0 without). Per direction (c' = c / 3, then 2 c / 3; s' = sf, then
 * sb), the ep source blocks are posted at once and share the link, so the others' blocks are all in at
 * x; the side work and this rank's own block (c' / ep) are computed meanwhile, then the other blocks,
 * each result block sent back at once, the last one back x / (ep-1) later:
 * max(s' + c' / ep, x) + c' (ep-1) / ep + x / (ep-1) against x + s' + c' + x in sequence; hidden = the
 * difference. */
double tera_plan_ep_overlap_hidden(int ep, double x, double c, double sf, double sb);

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
 * (caller frees) holds the fitting ones, fastest first; *n_valid, *n_fit count them all. A layout too
 * large with the whole logits (base's training.loss_chunk 0) is tried again with the LM head and the
 * loss over TERA_PLAN_LOSS_CHUNK rows at a time (when a micro-batch has more); it then fits with
 * training.loss_chunk set in its configuration. */
#define TERA_PLAN_LOSS_CHUNK 1024
tera_status tera_plan_search(const tera_config *base, const tera_hw *hw, const tera_plan_opts *o,
                             const tera_plan_search_opts *so, tera_plan_candidate **best, int *n_best,
                             int64_t *n_valid, int64_t *n_fit);

#endif
