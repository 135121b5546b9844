/* The run configuration: one struct per config-file section.
 *
 * Files are INI ([section] / key = value / # comment), parsed with inih. Every key, its type,
 * default, valid range or choices and a one-line doc live in ONE table (src/config/config.c); that
 * table drives parsing, command-line overrides (--section.key=value), validation, the resolved dump
 * written into each run directory, and docs/CONFIG.md (`tera config --doc`). */
#ifndef TERA_CONFIG_H
#define TERA_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "tera/status.h"

#define TERA_PATH_MAX 1024

typedef enum {
    TERA_DROP_POSITION = 0, /* over capacity: keep an expert's earliest tokens of the sequence */
    TERA_DROP_PROBABILITY,  /* over capacity: keep an expert's highest-probability assignments */
} tera_drop_policy;

typedef enum {
    TERA_ROUTER_SOFTMAX = 0, /* scores = softmax of the router logits (Mixtral, DeepSeek-V2) */
    TERA_ROUTER_SIGMOID,     /* scores = sigmoid of each logit (DeepSeek-V3) */
} tera_router_score;

typedef enum {
    TERA_BATCH_LR_SQRT = 0, /* LR x sqrt(A / grad_accum) for a step of A micro-batches (Adam's rule) */
    TERA_BATCH_LR_LINEAR,   /* LR x A / grad_accum (SGD's linear scaling rule) */
    TERA_BATCH_LR_NONE,     /* LR unchanged */
} tera_batch_lr_rule;

typedef enum {
    TERA_LR_COSINE = 0, /* warmup, then cosine from lr to min_lr over the remaining steps */
    TERA_LR_LINEAR,     /* warmup, then linear from lr to min_lr */
    TERA_LR_WSD,        /* warmup-stable-decay: lr until the last decay_fraction of the steps, then to min_lr */
} tera_lr_schedule;

typedef enum {
    TERA_DECAY_LINEAR = 0, /* WSD decay factor 1 - p */
    TERA_DECAY_COSINE,     /* (1 + cos(pi p)) / 2 */
    TERA_DECAY_SQRT,       /* 1 - sqrt(p) (Hagele et al. 2024) */
} tera_decay_shape;

typedef enum {
    TERA_BALANCE_SWITCH = 0,        /* per-sequence Switch loss E sum_e f_e P_e (MODEL.md) */
    TERA_BALANCE_SWITCH_GLOBAL,     /* the Switch loss over all tokens of the micro-batch */
    TERA_BALANCE_IMPORTANCE_LOAD,   /* Shazeer et al.'s CV^2 of importance + CV^2 of load, per micro-batch */
    TERA_BALANCE_SWITCH_DP,         /* the Switch loss with f_e over the micro-batches of all data-parallel ranks */
} tera_balance_loss;

typedef struct {
    int vocab_size;        /* V */
    int dim;               /* D, model width */
    int n_layers;          /* L */
    int n_heads;           /* H, query heads; head width hd = D / H */
    int n_kv_heads;        /* Hkv, key/value heads (GQA when < H); 0 in a file means = H */
    int n_experts;         /* E, routed experts per MoE layer */
    int top_k;             /* k, experts per token */
    int ffn_dim;           /* F, routed-expert hidden width */
    int n_shared_experts;  /* shared experts (DeepSeek); hidden width n_shared_experts * F */
    int first_k_dense;     /* the first N layers use a dense SwiGLU FFN instead of MoE */
    int dense_ffn_dim;     /* hidden width of dense layers; 0 in a file means = top_k * F (resolved by
                            * tera_config_finalize when first_k_dense > 0, else left 0: unused) */
    int max_seq_len;       /* longest sequence the model is built for (max_position_embeddings) */
    int sliding_window;    /* a Hugging Face config's attention window (0 = none). tera has no
                            * sliding-window attention: a window must be >= training.seq_len */
    float rope_theta;      /* RoPE base */
    float norm_eps;        /* RMSNorm epsilon */
    float init_std;        /* std of the normal init; o_proj / w2 use init_std / sqrt(2L) */
    int tie_embeddings;    /* lm_head shares embed_tokens (default 0: untied) */
    float capacity_factor; /* 0 = dropless; else capacity per expert per sequence = ceil(cf*T*k/E) */
    tera_drop_policy drop_policy;
    float aux_coef;        /* load-balancing loss coefficient */
    float z_coef;          /* router z-loss coefficient */
    int aux_free;          /* aux-loss-free bias balancing on/off */
    float aux_free_rate;   /* bias update rate u: b_e += u * sign(mean load - load_e) */
    tera_router_score router_score; /* how router logits become scores (top-k and combine weights) */
    int n_groups;          /* group-limited routing: E experts in n_groups equal groups (1 = off) */
    int topk_groups;       /* a token picks its top-k experts inside its topk_groups best groups */
    float routed_scale;    /* routed scaling factor: combine weights = renormalised scores x this */
    tera_balance_loss balance_loss; /* which load-balancing loss aux_coef weighs (docs/ARCHITECTURE.md) */
    int router_force_balance; /* benchmarking only: top-k ignores the scores and takes the fixed balanced
                               * pattern (t k + j + l) mod E of the token's position t (docs/ARCHITECTURE.md) */
    /* Not a [model] key: activation recomputation spec for tera_model_create (the trainer passes
     * training.recompute); NULL or "" = none. */
    const char *recompute;
    /* Not a [model] key either: rows of a micro-batch the LM head and cross-entropy take at a time (the
     * trainer passes training.loss_chunk); 0 = all. */
    int loss_chunk;
} tera_model_config;

typedef struct {
    int steps;             /* optimizer steps */
    int stop_at_step;      /* stop cleanly (with a checkpoint) after this step, schedule of `steps` unchanged; a run
                            * resumed at or past it trains on (0 = off) */
    int seq_len;           /* T, tokens per sequence */
    int micro_batch;       /* sequences per micro-batch (per data-parallel rank) */
    int grad_accum;        /* micro-batches per optimizer step */
    int global_batch;      /* sequences per step when stated (0 = derived), checked against the layout */
    uint64_t seed;         /* seeds init, data shuffling and every other random stream */
    int threads;           /* compute threads (0 = all cores) */
    int warmup_steps;      /* W */
    float lr;              /* max_lr */
    float min_lr;          /* cosine floor */
    tera_lr_schedule lr_schedule; /* cosine | linear | wsd (tera_lr_at) */
    float decay_fraction;  /* wsd: fraction of the steps in the final decay */
    tera_decay_shape decay_shape; /* wsd: shape of the decay */
    float grad_clip;       /* global-norm clip threshold c (0 = off) */
    int eval_every;        /* validation every N steps (0 = off) */
    int eval_batches;      /* micro-batches per validation */
    int spike_window;      /* loss-spike guard window (0 = off) */
    float spike_zscore;    /* spike threshold on the z-score of the loss */
    float spike_grad_zscore; /* and of the grad norm */
    float spike_lr_factor; /* LR multiplier after a spike */
    int spike_lr_steps;    /* for this many steps */
    int nan_rollback_after; /* roll back after this many consecutive non-finite steps (0 = only skip) */
    int batch_rampup_start; /* batch ramp-up: accumulation count at step 0 (0 = no ramp-up) */
    int batch_rampup_steps; /* steps over which it rises linearly to grad_accum */
    float batch_grow_gnorm; /* grow the batch x2 when the windowed mean grad norm exceeds this (0 = off) */
    int batch_grow_window;  /* healthy steps per grad-norm window */
    int batch_grow_max;     /* largest accumulation count growth may reach (0 = 4 x grad_accum) */
    tera_batch_lr_rule batch_lr_scaling; /* LR rule for a batch other than the full one */
    char init_from[TERA_PATH_MAX]; /* a Hugging Face Mixtral directory to start from ("" = random) */
    char precision[8];     /* auto | fp32 | bf16 | fp16: the linear layers' products (tera_precision_resolve) */
    char device[8];        /* cpu | cuda: the compute backend (tera_backend_for_device) */
    char bf16_gemm[8];     /* auto | native | fma: the units bf16 products run on (tera_bf16_gemm_resolve) */
    float loss_scale;      /* fp16: initial dynamic loss scale */
    int loss_scale_window; /* fp16: the scale doubles after this many steps without overflow */
    int loss_scaling;      /* fp16: 0 = dynamic, 1 = fixed (loss_scale stays constant) */
    char recompute[256];   /* activation recomputation per layer range (tera_recompute_parse) */
    int loss_chunk;        /* rows the LM head and cross-entropy take at a time (0: all; tera_model_config) */
    int memory_check;      /* refuse before allocating when the layout cannot fit the host (preflight.c) */
} tera_train_config;

typedef struct {
    float beta1, beta2, eps, weight_decay;
    char name[16];              /* adamw | onebit_adam (src/train/onebit.c) */
    int onebit_warmup_steps;    /* onebit_adam: steps of full AdamW before the variance is frozen */
    int moments;                /* 0 = fp32, 1 = bf16 with stochastic rounding (tera_adamw_init_range_bf16) */
} tera_optim_config;

typedef struct {
    char path[TERA_PATH_MAX];   /* "" = the embedded default corpus */
    char paths[4096];           /* a blend "W1 PREFIX1, W2 PREFIX2, ..." ("" = data.path alone; src/data/blend.c) */
    char format[16];            /* auto | text | bin (Megatron .bin/.idx prefix) | u16 */
    char tokenizer[TERA_PATH_MAX]; /* online tokenization: a tokenizer directory ("" = off; src/data/online.c) */
    int tokenize_workers;       /* online tokenization: encoding threads */
    int stream;                 /* online tokenization: stream the shards during training (src/data/stream.c) */
    int shuffle;                /* 0: sample i = tokens[i*T, i*T+T+1) in order */
    float val_fraction;         /* fraction of samples held out for validation */
    char val_path[TERA_PATH_MAX]; /* a separate validation set, opened as data.path would be ("" = the split above) */
    int prefetch;               /* micro-batches prepared ahead by a background thread (0 = off) */
} tera_data_config;

typedef struct {
    int dp, tp, pp, ep;         /* parallel degrees (1 = off); ep divides dp (experts split inside dp) */
    int ep_overlap;             /* expert parallelism: overlap exchanges with expert compute */
    int tp_overlap;             /* tensor parallelism: weight gradients while the input-gradient sums are in flight
                                   (1: with fp32 products, 2: always, 0: off) */
    int sequence_parallel;      /* tensor parallelism: the residual stream's rows split over the tp ranks */
    int zero_prefetch;          /* ZeRO-3: gather the next layer's parameters while this one computes */
    char pp_schedule[16];       /* gpipe | 1f1b | interleaved */
    int pp_chunks;              /* model chunks per stage (interleaved) */
    int pp_head_split;          /* the LM head's vocabulary rows split between the first and the last stage */
    int pp_defer_wgrad;         /* micro-batches whose LM-head weight gradient may wait for the pipeline's gaps */
    char pp_layers[256];        /* layer counts per virtual stage, "" = balanced */
    int zero;                   /* ZeRO stage 0-3 */
    float timeout_s;            /* collective watchdog: seconds, 0 = off, -1 = automatic from the step times */
    int ranks_per_node;         /* ranks per node (emulated nodes), 0 = the hosts (docs/COMMUNICATION.md) */
    int hierarchical;           /* data-parallel sums inside the node first, then across */
    char grad_compression[8];   /* none | bf16 | fp16 | int8: data-parallel gradient sums in low precision */
    char a2a_compression[8];    /* none | bf16 | fp8: the expert exchange's rows in low precision */
    int ep_hierarchical;        /* expert exchange in two stages: inside the node, then one rail across */
} tera_parallel_config;

typedef struct {
    int every;                  /* save every N steps (0 = only at the end) */
    int keep;                   /* keep the newest K checkpoints (0 = all) */
    int keep_every;             /* also keep checkpoints at multiples of this step (0 = none) */
    int async;                  /* write checkpoints in a background thread */
    int full_every;             /* every N-th save full, the others differential (0 = always full) */
    float every_s;              /* also save when this many seconds passed since the last save (0 = off) */
    float full_every_s;         /* a full save when this many seconds passed since the last full one (0 = off) */
    int64_t max_shard_bytes;    /* safetensors shard size limit for export (0 = one file) */
    int sharded;                /* several ranks: each writes its own blocks (per-rank files) */
    int writer_buffer_mb;       /* several ranks: the bounded window a save streams through (MiB) */
} tera_ckpt_config;

typedef struct {
    char run_dir[TERA_PATH_MAX]; /* the run's own directory */
    int log_every;              /* progress line every N steps */
    int progress;               /* 1: progress line on stderr */
    int profile;                /* 1: per-operation time profile at the end */
    int metrics_port;           /* Prometheus /metrics on this port + world rank (0 = off; docs/MONITORING.md) */
    float peak_tflops;          /* one rank's peak dense TFLOP/s in the precision in use: MFU (0 = not reported) */
    char trace[TERA_PATH_MAX];  /* Chrome trace-event JSON of a window of steps ("" = off; src/obs/trace.c) */
    char trace_steps[32];       /* that window: "FIRST:COUNT" */
    char tensorboard[TERA_PATH_MAX]; /* TensorBoard event files in this directory ("" = off; src/obs/tensorboard.c) */
    int hardware;               /* 1: hardware readings (src/obs/hw.c) in metrics.jsonl's "hw" object */
    char registry[TERA_PATH_MAX]; /* the SQLite run registry ("" = off; src/obs/registry.c, docs/TRACKING.md) */
    char mlflow_uri[TERA_PATH_MAX]; /* an MLflow tracking server's http(s) URI ("" = off; src/obs/mlflow.c) */
    char mlflow_experiment[256]; /* the MLflow experiment runs are logged under */
    int sample_every;           /* a greedy continuation of sample_prompt every N steps (0 = off; src/train/sample.c) */
    char sample_prompt[256];    /* its prompt ("" = a new document) */
    int sample_tokens;          /* its new tokens */
} tera_logging_config;

typedef struct {
    tera_model_config model;
    tera_train_config training;
    tera_optim_config optimizer;
    tera_data_config data;
    tera_parallel_config parallel;
    tera_ckpt_config checkpoint;
    tera_logging_config logging;
    /* Not a key: which [model] keys a file or a --model.* override set (bit i = the i-th [model] key
     * of the table), so that tera_config_from_hf can refuse a value config.json contradicts. */
    uint64_t model_given;
} tera_config;

/* Fills every field with its documented default. */
void tera_config_defaults(tera_config *c);
/* Reads an INI file over the current values. Unknown section/key, unparsable or out-of-range
 * value: TERA_ERR_CONFIG with a message naming file, line, key and the valid choices/range. */
tera_status tera_config_load(tera_config *c, const char *path);
/* Applies one override "section.key=value" (the leading "--" already stripped). */
tera_status tera_config_set(tera_config *c, const char *assignment);
/* Cross-field checks (H divides D, k <= E, hd even, ...) and derived defaults (n_kv_heads,
 * dense_ffn_dim): the one place they are computed. Call after loading and overriding, and again
 * after tera_config_from_hf (idempotent). */
tera_status tera_config_finalize(tera_config *c);
/* The derived model defaults, the one place they are computed (tera_config_finalize calls it):
 * n_kv_heads 0 -> n_heads; dense_ffn_dim 0 -> top_k x ffn_dim with dense layers, 0 without. */
void tera_model_config_derive(tera_model_config *m);
/* parallel.pp_layers parsed (the one parser): first[i] = the first layer of virtual stage i,
 * first[pp * pp_chunks] = n_layers; first holds pp * pp_chunks + 1 ints. An error names the value. */
tera_status tera_config_pp_layers(const tera_parallel_config *p, int n_layers, int *first);
/* The model of a Hugging Face directory (training.init_from, tera eval/export-hf --from): replaces
 * c->model by dir/config.json's values (fields config.json lacks keep a value given in a file or
 * on the command line, else their default; derived defaults are derived again by finalize). A
 * [model] value given in a file or on the command line that config.json contradicts is an error
 * naming the key, both values and the file. c is unchanged on error. Call finalize afterwards. */
tera_status tera_config_from_hf(tera_config *c, const char *dir);
/* Writes the resolved configuration as a loadable INI file. */
tera_status tera_config_write(const tera_config *c, const char *path);
/* Writes docs: every section and key with type, default, range/choices and doc (Markdown). */
void tera_config_write_doc(FILE *f);

#endif
