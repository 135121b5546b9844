/* The run configuration: one table of keys drives defaults, INI parsing (inih), command-line
 * overrides, validation, the resolved dump and the Markdown reference (docs/CONFIG.md).
 *
 * Adding a key: add the field to include/tera/config.h and one line to config__keys below. The
 * type-checking macros make a mismatch between the declared type and the field a compile error. */
#include "tera/config.h"
#include "tera/hf.h"
#include "tera/model.h"

#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------------- */
/* Value types. One X-macro list gives the enum and the name shown in docs. */

#define CONFIG__TYPES(X)                                                                           \
    X(INT, "int")       /* int field, range [imin, imax] */                                        \
    X(INT64, "int64")   /* int64_t field, range [imin, imax] */                                    \
    X(UINT64, "uint64") /* uint64_t field, any value 0 .. 2^64-1 */                                \
    X(FLOAT, "float")   /* float field, finite, range fmin..fmax (ends open or closed) */          \
    X(BOOL, "bool")     /* int field holding 0 or 1 */                                             \
    X(STRING, "string") /* char[size] field, NUL-terminated */                                     \
    X(ENUM, "enum")     /* int-sized enum field holding the index into `choices` */                \
    X(CHOICE, "enum")   /* char[size] field holding one of `choices` verbatim */

typedef enum {
#define CONFIG__TYPE_ENUM(name, text) CONFIG__##name,
    CONFIG__TYPES(CONFIG__TYPE_ENUM)
#undef CONFIG__TYPE_ENUM
} config__type;

static const char *const config__type_names[] = {
#define CONFIG__TYPE_NAME(name, text) text,
    CONFIG__TYPES(CONFIG__TYPE_NAME)
#undef CONFIG__TYPE_NAME
};

/* One configuration key. */
typedef struct {
    const char *section; /* INI section = member of tera_config */
    const char *key;     /* key = member of the section struct */
    config__type type;
    size_t offset;       /* offsetof(tera_config, section.key) */
    size_t size;         /* sizeof the field (the buffer size for strings) */
    const char *def;     /* default, written as in a file; parsed by tera_config_defaults */
    int64_t imin, imax;  /* INT / INT64: inclusive range (imax = the type's max: no upper bound) */
    double fmin, fmax;   /* FLOAT: range; +-INFINITY = unbounded */
    bool fmin_open;      /* FLOAT: fmin itself excluded */
    bool fmax_open;      /* FLOAT: fmax itself excluded */
    const char *choices; /* ENUM / CHOICE: "a|b|c"; for ENUM the stored value is the index */
    const char *doc;     /* one line for docs and for the comment above the key in dumps */
} config__key;

/* A field expression and a compile-time check that it has type T: comparing pointers to distinct
 * types is a diagnostic (an error under -Werror); sizeof keeps it unevaluated and constant. */
#define CONFIG__FIELD(sec, name) (((tera_config *)0)->sec.name)
#define CONFIG__AT(sec, name, T)                                                                   \
    offsetof(tera_config, sec.name),                                                               \
        sizeof CONFIG__FIELD(sec, name) + 0 * sizeof(&CONFIG__FIELD(sec, name) == (T *)0)
#define CONFIG__AT_CHARS(sec, name)                                                                \
    offsetof(tera_config, sec.name),                                                               \
        sizeof CONFIG__FIELD(sec, name) + 0 * sizeof(&CONFIG__FIELD(sec, name)[0] == (char *)0)

/* Table-row constructors, one per type. lo/hi: inclusive integer range. */
#define K_INT(sec, name, def, lo, hi, doc)                                                         \
    {#sec, #name, CONFIG__INT, CONFIG__AT(sec, name, int), def, lo, hi, 0, 0, 0, 0, NULL, doc}
#define K_INT64(sec, name, def, lo, hi, doc)                                                       \
    {#sec, #name, CONFIG__INT64, CONFIG__AT(sec, name, int64_t), def, lo, hi, 0, 0, 0, 0, NULL,  \
     doc}
#define K_UINT64(sec, name, def, doc)                                                              \
    {#sec, #name, CONFIG__UINT64, CONFIG__AT(sec, name, uint64_t), def, 0, 0, 0, 0, 0, 0, NULL,  \
     doc}
/* range: one of the R_* macros below (lo, hi, lo_open, hi_open). */
#define K_FLOAT(sec, name, def, range, doc)                                                        \
    {#sec, #name, CONFIG__FLOAT, CONFIG__AT(sec, name, float), def, 0, 0, range, NULL, doc}
#define K_BOOL(sec, name, def, doc)                                                                \
    {#sec, #name, CONFIG__BOOL, CONFIG__AT(sec, name, int), def, 0, 1, 0, 0, 0, 0, NULL, doc}
#define K_STRING(sec, name, def, doc)                                                              \
    {#sec, #name, CONFIG__STRING, CONFIG__AT_CHARS(sec, name), def, 0, 0, 0, 0, 0, 0, NULL, doc}
#define K_ENUM(sec, name, T, def, choices, doc)                                                    \
    {#sec, #name, CONFIG__ENUM, CONFIG__AT(sec, name, T), def, 0, 0, 0, 0, 0, 0, choices, doc}
#define K_CHOICE(sec, name, def, choices, doc)                                                     \
    {#sec, #name, CONFIG__CHOICE, CONFIG__AT_CHARS(sec, name), def, 0, 0, 0, 0, 0, 0, choices,  \
     doc}

#define R_GT0 0.0, INFINITY, true, false      /* > 0 */
#define R_GE0 0.0, INFINITY, false, false     /* >= 0 */
#define R_UNIT_OPEN 0.0, 1.0, false, true     /* [0, 1) */
#define R_CLOSED(lo, hi) lo, hi, false, false /* [lo, hi] */

/* The sections, in file order, each with a one-line description for docs and dumps. */
typedef struct {
    const char *name;
    const char *doc;
} config__section;

static const config__section config__sections[] = {
    {"model", "Architecture, MoE routing and load balancing."},
    {"training", "Steps, batch shape, learning-rate schedule, evaluation."},
    {"optimizer", "AdamW (decoupled weight decay on 2-D weights only), or 1-bit Adam (optimizer.name)."},
    {"data", "Training corpus."},
    {"parallel", "Parallel layout over MPI ranks: the job runs pp x dp x tp ranks (mpirun -np N; N = 1 without "
                 "mpirun), ep splits the experts inside dp, zero shards optimizer state, gradients and parameters "
                 "(docs/PARALLELISM.md)."},
    {"checkpoint", "Checkpoint saving and export."},
    {"logging", "Run directory and progress output."},
};
#define CONFIG__N_SECTIONS (sizeof config__sections / sizeof config__sections[0])

/* THE table: every key of every section, in section order. Defaults follow the spec (MODEL.md).
 * Ranges here are the per-key checks; cross-field checks live in tera_config_finalize. */
static const config__key config__keys[] = {
    /* [model] ---------------------------------------------------------------------------------- */
    K_INT(model, vocab_size, "256", 2, INT_MAX, "vocabulary size V (token ids 0 .. V-1)"),
    K_INT(model, dim, "128", 1, INT_MAX, "model width D"),
    K_INT(model, n_layers, "4", 1, 65536,
          "transformer layers L (at most 65536: the parameter table holds ~10 tensors a layer)"),
    K_INT(model, n_heads, "4", 1, INT_MAX,
          "query heads H; must divide dim, and head width dim/n_heads must be even (RoPE)"),
    K_INT(model, n_kv_heads, "0", 0, INT_MAX,
          "key/value heads (GQA when < n_heads; must divide n_heads); 0 = n_heads"),
    K_INT(model, n_experts, "8", 1, INT_MAX, "routed experts E per MoE layer"),
    K_INT(model, top_k, "2", 1, INT_MAX, "experts per token k (at most n_experts)"),
    K_INT(model, ffn_dim, "256", 1, INT_MAX, "routed-expert hidden width F"),
    K_INT(
        model, n_shared_experts, "0", 0, INT_MAX,
        "always-applied shared experts (DeepSeek style), hidden width n_shared_experts * ffn_dim"),
    K_INT(model, first_k_dense, "0", 0, INT_MAX,
          "the first N layers use a dense SwiGLU FFN instead of MoE (at most n_layers)"),
    K_INT(model, dense_ffn_dim, "0", 0, INT_MAX,
          "hidden width of the dense layers (first_k_dense); 0 = top_k * ffn_dim (stays 0 without dense layers)"),
    K_INT(model, max_seq_len, "1024", 1, INT_MAX,
          "longest sequence the model is built for (max_position_embeddings)"),
    K_INT(model, sliding_window, "0", 0, INT_MAX,
          "attention window of a Hugging Face config.json (sliding_window; 0 = none, written as null); tera has no "
          "sliding-window attention, so a window must be at least training.seq_len, where it changes nothing"),
    K_FLOAT(model, rope_theta, "10000", R_GT0, "RoPE base theta"),
    K_FLOAT(model, norm_eps, "1e-5", R_GT0, "RMSNorm epsilon"),
    K_FLOAT(model, init_std, "0.02", R_GT0,
            "std of the normal init; o_proj and w2 use init_std / sqrt(2 * n_layers)"),
    K_BOOL(model, tie_embeddings, "false", "lm_head shares the embed_tokens matrix"),
    K_FLOAT(model, capacity_factor, "0", R_GE0,
            "0 = dropless; else capacity per expert per sequence = ceil(cf * T * k / E)"),
    K_ENUM(model, drop_policy, tera_drop_policy, "position", "position|probability",
           "over capacity keep an expert's earliest tokens (position) or highest-probability ones"),
    K_FLOAT(model, aux_coef, "0.01", R_GE0, "load-balancing loss coefficient"),
    K_FLOAT(model, z_coef, "0", R_GE0, "router z-loss coefficient"),
    K_BOOL(model, aux_free, "false",
           "aux-loss-free balancing: per-expert bias on selection scores"),
    K_FLOAT(model, aux_free_rate, "0.001", R_GE0,
            "aux-free bias update rate u: b_e += u * sign(mean load - load_e)"),
    K_ENUM(model, router_score, tera_router_score, "softmax", "softmax|sigmoid",
           "router scores s: softmax over the experts (Mixtral) or sigmoid of each logit (DeepSeek-V3); the top-k "
           "is chosen on s (+ the aux-free bias) and the combine weights are the chosen s renormalised to sum 1; "
           "under sigmoid the balancing loss uses s / sum(s) per token (docs/ARCHITECTURE.md)"),
    K_INT(model, n_groups, "1", 1, INT_MAX,
          "group-limited routing: the experts form n_groups equal groups of consecutive ids (must divide "
          "n_experts; 1 = off); a token chooses its top_k experts inside its topk_groups best groups"),
    K_INT(model, topk_groups, "1", 1, INT_MAX,
          "groups a token may use (in [1, n_groups], top_k <= topk_groups * n_experts / n_groups); a group's score is "
          "its best expert score (softmax) or the sum of its best two (sigmoid)"),
    K_FLOAT(model, routed_scale, "1", R_GT0,
            "routed scaling factor: the combine weights are multiplied by it (DeepSeek's routed_scaling_factor)"),
    K_ENUM(model, balance_loss, tera_balance_loss, "switch", "switch|switch_global|importance_load|switch_dp",
           "load-balancing loss weighted by aux_coef: switch = per sequence (MODEL.md), switch_global = the "
           "Switch loss over all tokens of the micro-batch, importance_load = CV^2 of importance + CV^2 of load "
           "(Shazeer et al. 2017) per micro-batch, switch_dp = switch_global with the expert fractions f_e counted "
           "over the micro-batches of all data-parallel ranks (one all-reduce of E counts per MoE layer and "
           "micro-batch; the same model as one rank running the whole batch; docs/ARCHITECTURE.md)"),
    K_BOOL(model, router_force_balance, "false",
           "benchmarking only: the top-k ignores the router scores and takes a fixed balanced pattern, experts "
           "(t * top_k + j + l) mod n_experts for the token at sequence position t in layer l (j < top_k), the same "
           "in every layout and run (every expert gets T * top_k / n_experts rows of each sequence when that "
           "divides); combine weights are the chosen scores renormalised as usual, so the router still learns; "
           "the aux-free bias is ignored; not with group-limited routing (topk_groups < n_groups). For measuring "
           "layouts (expert parallelism) at even load, as Megatron-Core's --moe-router-force-load-balancing; "
           "not a training method"),

    /* [training] ------------------------------------------------------------------------------- */
    K_INT(training, steps, "300", 1, INT_MAX, "optimizer steps S"),
    K_INT(training, seq_len, "128", 1, INT_MAX,
          "tokens per sequence T (at most model.max_seq_len)"),
    K_INT(training, micro_batch, "8", 1, INT_MAX,
          "sequences per micro-batch (per data-parallel rank)"),
    K_INT(training, grad_accum, "1", 1, INT_MAX,
          "micro-batches per optimizer step (with a pipeline: the micro-batches flowing through it)"),
    K_INT(training, global_batch, "0", 0, INT_MAX,
          "sequences per optimizer step, if given: checked against micro_batch x grad_accum x parallel.dp at start; "
          "0 = not checked"),
    K_UINT64(training, seed, "1234", "seeds init, data shuffling and every other random stream"),
    K_INT(training, threads, "0", 0, 4096,
          "compute threads; 0 = all cores (leave OMP_WAIT_POLICY unset: PASSIVE slows multi-threaded steps, "
          "docs/PERFORMANCE.md Wave 16); at most 4096, as `tera bench --threads` (40000 failed inside the "
          "OpenMP runtime instead: its threads could not be created)"),
    K_INT(training, warmup_steps, "30", 0, INT_MAX, "linear warmup steps W (at most steps)"),
    K_INT(training, stop_at_step, "0", 0, INT_MAX,
          "stop cleanly after this step with a checkpoint, the LR schedule still that of training.steps; --resume "
          "continues as one uninterrupted run would, to a later stop_at_step or (already past it) to the end (tera "
          "tune's rungs); 0 = off"),
    K_FLOAT(training, lr, "3e-3", R_GT0, "peak learning rate max_lr"),
    K_FLOAT(training, min_lr, "3e-4", R_GE0, "cosine floor (at most lr)"),
    K_ENUM(training, lr_schedule, tera_lr_schedule, "cosine", "cosine|linear|wsd",
           "LR after the warmup: cosine or linear from lr to min_lr over the remaining steps, or wsd "
           "(warmup-stable-decay: lr until the last decay_fraction of the steps, then decay_shape to min_lr); "
           "formulas in docs/SCHEDULES.md"),
    K_FLOAT(training, decay_fraction, "0.2", R_CLOSED(0.0, 1.0),
            "wsd: fraction of training.steps in the final decay (it starts no earlier than the warmup's end)"),
    K_ENUM(training, decay_shape, tera_decay_shape, "linear", "linear|cosine|sqrt",
           "wsd: decay factor 1 - p, (1 + cos(pi p)) / 2, or 1 - sqrt(p) over the decay's progress p"),
    K_FLOAT(training, grad_clip, "1.0", R_GE0, "global L2-norm clip threshold; 0 = off"),
    K_INT(training, eval_every, "0", 0, INT_MAX, "validation every N steps; 0 = off"),
    K_INT(training, eval_batches, "4", 1, INT_MAX, "micro-batches per validation"),
    K_INT(training, spike_window, "0", 0, 100000,
          "loss-spike guard: z-scores of loss and grad norm over this many recent steps; 0 = off"),
    K_FLOAT(training, spike_zscore, "12", R_CLOSED(0.5, 1e9),
            "a step whose loss z-score exceeds this is a spike: its update is dropped, the run rolls back "
            "to the newest checkpoint, skips that batch and lowers the LR (clean runs of the test models "
            "peaked at 9.5 over windows of 4-100 steps; docs/PARALLELISM.md)"),
    K_FLOAT(training, spike_grad_zscore, "1000", R_CLOSED(0.5, 1e9),
            "the same for the grad norm: heavy-tailed in clean runs (up to 368; clipping handles those), so "
            "only a blow-up of about 100x the window's mean counts"),
    K_FLOAT(training, spike_lr_factor, "0.5", R_CLOSED(0.0, 1.0), "LR multiplier after a spike"),
    K_INT(training, spike_lr_steps, "100", 0, INT_MAX,
          "after a spike the LR stays lowered until this many steps past it: with a rollback the replayed "
          "steps, then this many from the spike's step on (run again on the batch after the skipped one); "
          "without one, the next this many steps"),
    K_INT(training, nan_rollback_after, "0", 0, INT_MAX,
          "after this many consecutive non-finite steps, roll back to the newest checkpoint, skip their data and "
          "lower the LR as after a spike (spike_lr_factor, spike_lr_steps); a single non-finite step is only "
          "skipped; 0 = never roll back (docs/ELASTIC.md)"),
    K_INT(training, batch_rampup_start, "0", 0, INT_MAX,
          "batch-size ramp-up: micro-batches per step at step 0 (at most grad_accum), rising linearly in "
          "whole micro-batches to grad_accum over batch_rampup_steps; 0 = no ramp-up"),
    K_INT(training, batch_rampup_steps, "0", 0, INT_MAX, "optimizer steps the batch-size ramp-up lasts"),
    K_FLOAT(training, batch_grow_gnorm, "0", R_GE0,
            "after the ramp-up, double the micro-batches per step when the mean grad norm (before clipping) "
            "of a window of batch_grow_window healthy steps exceeds this; 0 = off"),
    K_INT(training, batch_grow_window, "50", 1, INT_MAX, "healthy steps per grad-norm window of the batch growth"),
    K_INT(training, batch_grow_max, "0", 0, INT_MAX,
          "the most micro-batches per step the batch growth may reach; 0 = 4 x grad_accum"),
    K_ENUM(training, batch_lr_scaling, tera_batch_lr_rule, "sqrt", "sqrt|linear|none",
           "LR of a step of A micro-batches: x sqrt(A / grad_accum) (Adam), x A / grad_accum, or unchanged"),
    K_STRING(training, init_from, "",
             "Hugging Face directory (model_type mixtral or tera_moe) or tera checkpoint to start from: the model "
             "comes from its config.json, and a [model] value given here that contradicts it is an error; empty = "
             "random init"),
    K_CHOICE(training, device, "cpu", "cpu|cuda",
             "compute backend: cpu, or cuda (the CUDA backend, docs/GPU.md; an error at start in a build "
             "without CUDA or on a machine without a device)"),
    K_CHOICE(training, precision, "fp32", "auto|fp32|bf16|fp16",
             "matrix products of the linear layers: bf16 = bf16 operands, fp32 accumulation; fp16 = "
             "fp16-rounded operands (emulated on CPUs), fp32 products, dynamic loss scaling; master weights, "
             "optimizer, norms, softmax, router, attention and losses stay fp32; auto = bf16 where the CPU's "
             "bf16 products are faster than fp32 (AMX, or a bf16 dot product that a start-up probe measures at "
             "1.25x the FMA's multiply-adds or more, as bf16_gemm = auto), else fp32, fp32 on every rank if any "
             "rank resolves fp32, so its results depend on the CPU; the default fp32 gives the same "
             "numbers on every CPU up to the order of fp32 sums (README, Precision)"),
    K_CHOICE(training, bf16_gemm, "auto", "auto|native|fma",
             "units for bf16 products (same numbers up to the order of fp32 sums): native = oneDNN's bf16 "
             "kernels (AMX, AVX512-BF16 dot products); fma = bf16-rounded operands on the fp32 FMA kernels; "
             "auto = native with AMX, else whichever instruction a start-up probe measures with more "
             "multiply-adds per cycle (fma unless the dot product is 1.25x faster), agreed over all ranks"),
    K_FLOAT(training, loss_scale, "65536", R_CLOSED(1.0, 1099511627776.0),
            "fp16: initial loss scale, at most 2^40 (halved, and the update skipped, on a non-finite gradient)"),
    K_INT(training, loss_scale_window, "1000", 1, INT_MAX,
          "fp16: the loss scale doubles after this many consecutive steps without overflow"),
    K_ENUM(training, loss_scaling, int, "dynamic", "dynamic|fixed",
           "fp16: dynamic = loss_scale is the initial scale, halved on overflow and doubled after "
           "loss_scale_window clean steps; fixed = loss_scale throughout (a non-finite step is still skipped)"),
    K_STRING(training, recompute, "none",
             "activation recomputation per layer: none, selective (attention core and FFN hidden "
             "activations recomputed in backward), full (only each layer's input kept), or per layer range "
             "as POLICY:FIRST-LAST items, e.g. full:0-3,selective:4-7 (layers not named: none)"),
    K_INT(training, loss_chunk, "0", 0, INT_MAX,
          "rows of a micro-batch the LM head and the cross-entropy take at a time: 0 = all at once (the logits "
          "[micro_batch x seq_len, vocab_size / tp]); R > 0 = R rows at a time, the logits [R, vocab_size / tp]: a "
          "training step then runs the head's product, the loss and its gradient in the backward, chunk by chunk "
          "(no product more), and the head's weight gradient sums over the chunks (other rounding than 0); "
          "large vocabularies (docs/ARCHITECTURE.md)"),
    K_BOOL(training, memory_check, "true",
           "before allocating, compare every host's memory as the planner counts it (tera plan --dry-run) with the "
           "host's available memory (MemAvailable, or a cgroup limit's rest) and refuse a configuration that cannot "
           "fit; false skips it (cpu device only)"),

    /* [optimizer] ------------------------------------------------------------------------------ */
    K_FLOAT(optimizer, beta1, "0.9", R_UNIT_OPEN, "AdamW first-moment decay"),
    K_FLOAT(optimizer, beta2, "0.95", R_UNIT_OPEN, "AdamW second-moment decay"),
    K_FLOAT(optimizer, eps, "1e-8", R_GT0, "AdamW epsilon"),
    K_FLOAT(optimizer, weight_decay, "0.1", R_GE0, "decoupled weight decay (2-D weights only)"),
    K_CHOICE(optimizer, name, "adamw", "adamw|onebit_adam",
             "adamw, or onebit_adam: 1-bit Adam (docs/COMMUNICATION.md): AdamW with fp32 gradient sums for "
             "onebit_warmup_steps steps, then the variance frozen and the momentum exchanged as signs with one scale "
             "per 256 values and error feedback (every parallel.zero; ZeRO-1/2/3 keep a whole momentum per rank, "
             "ZeRO-2/3 also a whole gradient)"),
    K_INT(optimizer, onebit_warmup_steps, "100", 1, INT_MAX,
          "onebit_adam: optimizer steps of full AdamW (fp32 gradient sums) before the variance is frozen"),
    K_ENUM(optimizer, moments, int, "fp32", "fp32|bf16",
           "storage of AdamW's two moments: fp32, or bf16 (4 bytes per parameter less, the step's optimizer passes "
           "move 28 bytes per parameter instead of 36): each update computed in fp32, then rounded stochastically "
           "with random bits keyed by (training.seed, update, parameter element), so the rounding depends on no "
           "thread count or layout; checkpoints still store fp32 moments (saved exactly, loaded rounded to nearest); "
           "not with optimizer.name = onebit_adam"),

    /* [data] ----------------------------------------------------------------------------------- */
    K_STRING(data, path, "",
             "corpus file or Megatron .bin/.idx prefix; empty = the embedded corpus"),
    K_STRING(data, paths, "",
             "a weighted blend of datasets instead of data.path: \"0.7 web, 0.2 code, 0.1 books\" (weight, then a "
             "path or .bin/.idx prefix read as data.path would be; weights normalised); sample g comes from a fixed "
             "interleaving of the global sample index (docs/DATA.md), each dataset has its own validation split"),
    K_CHOICE(data, format, "auto", "auto|text|bin|u16|jsonl",
             "text: byte-level; bin: Megatron .bin/.idx prefix; u16: raw uint16 ids; "
             "auto: bin if PATH.idx exists, u16 if PATH ends in .u16, else text; with data.tokenizer: text = one "
             "document per file, jsonl = one per line (field \"text\"), auto = jsonl for *.jsonl, *.json (.zst, .gz)"),
    K_STRING(data, tokenizer, "",
             "online tokenization: a tokenizer directory (encoder.json + vocab.bpe); data.path (unless a prepared "
             "prefix) is then raw text: a "
             "file, a directory or a glob of shards (*.zst, *.gz decompressed), encoded by data.tokenize_workers "
             "threads while training (data.stream) or at start-up into the stream `tera data prepare` would write "
             "(docs/DATA.md)"),
    K_INT(data, tokenize_workers, "2", 1, 256, "online tokenization: encoding threads"),
    K_BOOL(data, stream, "true",
           "online tokenization: stream the shards during training (each data-parallel rank reads its own shards, "
           "shard i on dp rank i mod dp; tokenized ahead of the steps by data.tokenize_workers threads; validation only "
           "from data.val_path, no shuffle); false = one start-up pass into the whole stream (blends always use it; docs/DATA.md)"),
    K_BOOL(data, shuffle, "false",
           "shuffle sample order; false = sample i is tokens [i*T, i*T+T+1)"),
    K_FLOAT(data, val_fraction, "0", R_CLOSED(0.0, 0.5),
            "fraction of samples held out for validation (the last ones); 0 = no split, every sample trains"),
    K_STRING(data, val_path, "",
             "a separate validation set (a file, a .bin/.idx prefix, or with data.tokenizer raw text: a file, directory "
             "or glob), read whole at start-up as data.path would be with data.stream = false; every data.path sample "
             "then trains (data.val_fraction must be 0); the way to evaluate a streamed run (docs/DATA.md)"),
    K_INT(data, prefetch, "2", 0, 64,
          "micro-batches a background thread prepares ahead of the step; 0 = read in the step"),

    /* [parallel] ------------------------------------------------------------------------------- */
    K_INT(parallel, dp, "1", 1, INT_MAX, "data-parallel degree"),
    K_INT(parallel, tp, "1", 1, INT_MAX,
          "tensor-parallel degree: groups of tp consecutive ranks split attention heads, FFN widths and the vocabulary "
          "(Megatron); the job runs dp x tp ranks"),
    K_INT(parallel, tp_overlap, "1", 0, 2,
          "tensor parallelism: start the backward's input-gradient sums non-blocking and compute the weight "
          "gradients while they are in flight: 1 = with fp32 products (in bf16/fp16 each half of a split product "
          "would round its operands again, which costs more than it hides on CPUs), 2 = in every precision, "
          "0 = each sum blocking where it is produced; results are identical"),
    K_BOOL(parallel, sequence_parallel, "false",
           "tensor parallelism: Megatron's sequence parallelism. Between the tensor-parallel layers each of the tp "
           "ranks keeps 1/tp of the tokens' rows of the residual stream (the layer inputs, the attention output "
           "plus residual, the norms' statistics), normalises only those and adds the residual only to them; "
           "the all-reduces become reduce-scatters into a rank's rows and all-gathers before the column-parallel "
           "layers (the same bytes). Activation memory of those tensors / tp, the norms' work / tp; needs "
           "training.micro_batch x training.seq_len divisible by parallel.tp; no effect with tp = 1"),
    K_INT(parallel, pp, "1", 1, INT_MAX,
          "pipeline-parallel degree: the layers are split into pp stages (the slowest-varying rank dimension); the job "
          "runs pp x dp x tp ranks; training.grad_accum micro-batches flow through the pipeline"),
    K_CHOICE(parallel, pp_schedule, "1f1b", "gpipe|1f1b|interleaved",
             "pipeline schedule: all forwards then all backwards (gpipe), one-forward-one-backward (1f1b, at most pp "
             "micro-batches in flight), or 1f1b over pp_chunks model chunks per stage (interleaved)"),
    K_INT(parallel, pp_chunks, "1", 1, 64,
          "model chunks per pipeline stage (virtual stages; interleaved needs >= 2 and grad_accum a multiple of pp)"),
    K_BOOL(parallel, pp_head_split, "false",
           "pipeline parallelism: the LM head's vocabulary split between the first and the last stage (vocabulary "
           "parallelism over the pipeline's ends): the last stage keeps the head's parameters, sends the first stage "
           "half of its rows each step and each micro-batch's final-norm output, and the two compute half of the "
           "logits, the cross-entropy (partial sums sent to the last stage, results back, as tensor parallelism's "
           "sums) and the gradients each; with parallel.tp > 1 each tp rank's vocabulary slice is split between "
           "the two stages' tp ranks of the same index. Moves half the head's work off the last stage; the loss "
           "agrees with the unsplit head to rounding (the sums over the vocabulary run in two halves). Needs "
           "parallel.pp > 1 with the 1f1b or interleaved schedule, parallel.zero <= 1, a model.vocab_size that "
           "2 x parallel.tp divides, untied embeddings and no training.loss_chunk"),
    K_INT(parallel, pp_defer_wgrad, "0", 0, 4096,
          "pipeline parallelism: up to this many micro-batches' LM-head weight gradients wait for the pipeline's "
          "gaps (the weight-gradient pass of the zero-bubble schedules, for the head's product): the head's "
          "backward computes the input gradient, which the stage below waits for, and queues the weight gradient, "
          "computed while the stage waits for a neighbour or at the step's end (with parallel.pp_head_split on "
          "both stages that compute the head). The same products in the same order, so the same bits. Costs one "
          "[micro_batch*seq_len, vocab_size] buffer per entry on the last stage (half with the split, and half on "
          "the first stage); 0: off. Needs parallel.pp > 1, ZeRO stage 0 or 1, untied embeddings and no "
          "training.loss_chunk"),
    K_STRING(parallel, pp_layers, "",
             "layers of each virtual stage, comma-separated (e.g. \"3,3,2\"); empty = balanced by modelled compute"),
    K_INT(parallel, ep, "1", 1, INT_MAX,
          "expert-parallel degree: the routed experts of each MoE layer are split over groups of ep of the dp "
          "data-parallel ranks (ep must divide parallel.dp and model.n_experts)"),
    K_INT(parallel, ep_overlap, "1", 0, 1,
          "expert parallelism: compute the experts over one source rank's tokens while the other ranks' tokens "
          "are still in flight, and the shared experts (model.n_shared_experts: the forward's hidden activations, "
          "the whole backward) while the layer's rows out travel, as Megatron-Core's shared-expert overlap "
          "(0 = wait for every exchange first, the shared experts before it; results are identical)"),
    K_INT(parallel, zero, "0", 0, 3, "ZeRO stage (optimizer state, gradient, parameter sharding)"),
    K_INT(parallel, zero_prefetch, "1", 0, 1,
          "ZeRO-3: while a layer computes, gather the parameters of the next one in the order of use (forward: "
          "the layer after, backward: the one before; in a pipeline, as the schedule goes) into a second staging "
          "slot (0 = gather each on use; results are identical)"),
    K_FLOAT(parallel, timeout_s, "-1", R_CLOSED(-1.0, 1e9),
            "a wait for other ranks that makes no progress this long aborts every rank, naming the ranks that "
            "stopped answering; -1 = automatic (inside a step, after 3 steps: max(60, 20 x the slowest step); "
            "before that and outside steps: max(600, 20 x the slowest step)); 0 = off"),
    K_INT(parallel, ranks_per_node, "0", 0, INT_MAX,
          "ranks per node: world ranks [k r, (k+1) r) form node k (emulates several nodes on one machine; must divide "
          "the ranks running, or be at least their number: one node); 0 = the ranks sharing a host; bytes across nodes are counted apart (docs/COMMUNICATION.md)"),
    K_BOOL(parallel, hierarchical, "false",
           "data-parallel gradient sums (and ZeRO's reduce-scatter and all-gather) inside the node first, across "
           "the nodes on 1/k of the data, then inside again; equal to the flat sums up to fp32 ordering"),
    K_CHOICE(parallel, grad_compression, "none", "none|bf16|fp16|int8",
             "data-parallel gradient sums sent in low precision with error feedback (int8: a scale per 256 values); "
             "with parallel.hierarchical only the cross-node stage; docs/COMMUNICATION.md"),
    K_CHOICE(parallel, a2a_compression, "none", "none|bf16|fp8",
             "expert parallelism: the rows exchanged with the experts' ranks (tokens out and results back, forward "
             "and backward) sent in bf16 or fp8 e4m3 with one fp32 scale per row (none: under bf16 products the rows "
             "out still go as bf16, which loses nothing); docs/COMMUNICATION.md"),
    K_BOOL(parallel, ep_hierarchical, "false",
           "expert parallelism across nodes: the exchange in two stages, inside the node to the rank with the "
           "destination's local index, then across the nodes among ranks of equal local index (k messages per node "
           "pair instead of k x k); with parallel.ep_overlap the experts run on the rows already here while the "
           "cross-node stage is in flight; results bit-identical; docs/COMMUNICATION.md"),

    /* [checkpoint] ----------------------------------------------------------------------------- */
    K_INT(checkpoint, every, "0", 0, INT_MAX, "save every N steps; 0 = only at the end"),
    K_INT(checkpoint, keep, "3", 0, INT_MAX, "keep the newest K checkpoints; 0 = all"),
    K_INT(checkpoint, keep_every, "0", 0, INT_MAX,
          "also keep every checkpoint whose step is a multiple of N (milestones); 0 = none"),
    K_BOOL(checkpoint, async, "true",
           "snapshot state into host buffers and write in a background thread (one process; the final save is "
           "synchronous); synchronous saves write the state itself, without the snapshot's memory"),
    K_INT(checkpoint, full_every, "0", 0, INT_MAX,
          "every N-th save is full and the others differential (changed chunks, zstd); 0 = always full"),
    K_FLOAT(checkpoint, every_s, "0", R_GE0,
            "also save when this many seconds (wall clock, rank 0's) passed since the last save, differential when "
            "full_every allows; bounds the work a failure loses in time; 0 = off (docs/ELASTIC.md)"),
    K_FLOAT(checkpoint, full_every_s, "0", R_GE0,
            "a full save when this many seconds passed since the last full one (the others stay differential); "
            "0 = off"),
    K_INT64(checkpoint, max_shard_bytes, "0", 0, INT64_MAX,
            "safetensors shard size limit for export in bytes; 0 = one file"),
    K_BOOL(checkpoint, sharded, "false",
           "with several ranks, every rank writes its own blocks of the parameters and Adam moments "
           "(rank-NNNNN.safetensors; the manifest lists the slice each file holds) instead of world rank 0 "
           "writing the whole model; loads under any layout; asynchronous and differential like the others (streamed)"),
    K_INT(checkpoint, writer_buffer_mb, "16", 1, 65536,
          "several ranks: a save streams the model through windows of this many MiB (every rank's one transfer "
          "buffer; no rank holds the whole model); the windows are the step loop's pause"),

    /* [logging] -------------------------------------------------------------------------------- */
    K_STRING(logging, run_dir, "runs/default", "the run's own directory (config, metrics.jsonl, checkpoints); \"\" = write nothing"),
    K_INT(logging, log_every, "10", 1, INT_MAX, "progress line every N steps"),
    K_BOOL(logging, progress, "true", "print the progress line on stderr"),
    K_BOOL(logging, profile, "false", "print a per-operation time profile at the end"),
    K_INT(logging, metrics_port, "0", 0, 65535,
          "serve Prometheus metrics at http://HOST:PORT/metrics, one endpoint per rank on port metrics_port + world "
          "rank (a port in use is an error at start; docs/MONITORING.md); 0 = off"),
    K_FLOAT(logging, peak_tflops, "0", R_GE0,
            "one rank's peak dense TFLOP/s in the precision in use (its accelerator's, or its CPU cores': `tera bench` "
            "measures sgemm_peak_gflops and bf16_peak_gflops); with it the progress line, metrics.jsonl (\"mfu\"), "
            "the Prometheus endpoint (tera_mfu_ratio) and TensorBoard report the model FLOPs utilisation: model "
            "FLOP/s over peak x ranks; 0 = no MFU (model FLOP/s are reported either way; docs/MONITORING.md)"),
    K_STRING(logging, registry, "runs/registry.db",
             "the SQLite run registry every run records itself in (status, heartbeats, command line, config, layout, "
             "git commit, dataset fingerprint, final metrics, checkpoints; `tera runs`, docs/TRACKING.md); world rank 0 "
             "writes; \"\" = off"),
    K_STRING(logging, mlflow_uri, "",
             "log params, metrics, tags and config.ini to this MLflow tracking server (http://HOST:PORT, REST API); a "
             "failure warns once and never stops training; \"\" = off"),
    K_STRING(logging, mlflow_experiment, "tera", "the MLflow experiment the runs are logged under"),
    K_STRING(logging, trace, "",
             "write a Chrome trace-event JSON timeline of the steps logging.trace_steps to this file (every rank's "
             "part merged by rank 0; open it in Perfetto or chrome://tracing); \"\" = off"),
    K_STRING(logging, trace_steps, "1:3", "the traced steps: \"FIRST:COUNT\" (0-based first step, step count)"),
    K_STRING(logging, tensorboard, "",
             "write TensorBoard event files (step scalars, expert-load histograms) into this directory (world rank 0); "
             "\"\" = off"),
    K_BOOL(logging, hardware, "false",
           "add the hardware readings (CPU utilisation, RSS, available memory, network bytes, hwmon temperatures, "
           "RAPL power: those the machine exposes) to each metrics.jsonl line as \"hw\" (the endpoint and "
           "TensorBoard always carry them)"),
    K_INT(logging, sample_every, "0", 0, INT_MAX,
          "every N steps print a greedy continuation of logging.sample_prompt and log it in metrics.jsonl as "
          "{\"step\", \"sample\"} (the run's tokenizer: RUN/tokenizer or the tokenizer/ directory next to data.path, "
          "else bytes for text data; one process only; docs/GENERATE.md); 0 = off"),
    K_STRING(logging, sample_prompt, "", "the prompt of the training samples (\"\" = a new document: the end-of-document "
             "token, or a newline with bytes)"),
    K_INT(logging, sample_tokens, "32", 1, 4096, "new tokens of each training sample"),
};
#define CONFIG__N_KEYS (sizeof config__keys / sizeof config__keys[0])

/* Long enough for any value as text: a full path plus quotes. */
#define CONFIG__VALUE_MAX (TERA_PATH_MAX + 64)
/* inih line buffer: a full path with its key and quotes, with room to spare. */
#define CONFIG__LINE_MAX (4 * TERA_PATH_MAX)

/* ---------------------------------------------------------------------------------------------- */
/* Small helpers. */

/* Appends formatted text to buf (size n), truncating silently at the end of the buffer. */
__attribute__((format(printf, 3, 4))) static void config__append(char *buf, size_t n,
                                                                 const char *fmt, ...) {
    size_t len = strlen(buf);
    if (len + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, n - len, fmt, ap);
    va_end(ap);
}

static const config__section *config__find_section(const char *name) {
    for (size_t i = 0; i < CONFIG__N_SECTIONS; i++)
        if (strcmp(config__sections[i].name, name) == 0) return &config__sections[i];
    return NULL;
}

static const config__key *config__find_key(const char *section, const char *key) {
    for (size_t i = 0; i < CONFIG__N_KEYS; i++)
        if (strcmp(config__keys[i].section, section) == 0 && strcmp(config__keys[i].key, key) == 0)
            return &config__keys[i];
    return NULL;
}

/* The bit of key k in tera_config.model_given: [model] keys come first in the table (checked in
 * config__check_table); 0 for the keys of other sections. */
static uint64_t config__given_bit(const config__key *k) {
    const size_t idx = (size_t)(k - config__keys);
    return strcmp(k->section, "model") == 0 && idx < 64 ? (uint64_t)1 << idx : 0;
}

/* "model, training, ..." */
static const char *config__list_sections(char *buf, size_t n) {
    buf[0] = '\0';
    for (size_t i = 0; i < CONFIG__N_SECTIONS; i++)
        config__append(buf, n, "%s%s", i ? ", " : "", config__sections[i].name);
    return buf;
}

/* "vocab_size, dim, ..." for one section. */
static const char *config__list_keys(const char *section, char *buf, size_t n) {
    buf[0] = '\0';
    for (size_t i = 0; i < CONFIG__N_KEYS; i++)
        if (strcmp(config__keys[i].section, section) == 0)
            config__append(buf, n, "%s%s", buf[0] ? ", " : "", config__keys[i].key);
    return buf;
}

/* "a|b|c" -> "a, b, c" */
static const char *config__list_choices(const char *choices, char *buf, size_t n) {
    buf[0] = '\0';
    for (const char *p = choices; *p; p++) config__append(buf, n, *p == '|' ? ", " : "%c", *p);
    return buf;
}

/* Index of `text` in "a|b|c", or -1. */
static int config__choice_index(const char *choices, const char *text) {
    size_t tlen = strlen(text);
    int idx = 0;
    for (const char *p = choices;; idx++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == tlen && strncmp(p, text, len) == 0) return idx;
        if (!bar) return -1;
        p = bar + 1;
    }
}

/* Writes choice `idx` of "a|b|c" into buf; "" when out of range. */
static const char *config__choice_name(const char *choices, int idx, char *buf, size_t n) {
    buf[0] = '\0';
    const char *p = choices;
    for (int i = 0; i < idx && p; i++) {
        p = strchr(p, '|');
        if (p) p++;
    }
    if (!p || idx < 0) return buf;
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len >= n) len = n - 1;
    memcpy(buf, p, len);
    buf[len] = '\0';
    return buf;
}

/* The valid range of a numeric key in words: "an integer >= 1", "a number in [0, 1)". */
static const char *config__describe_range(const config__key *k, char *buf, size_t n) {
    buf[0] = '\0';
    switch (k->type) {
    case CONFIG__INT:
    case CONFIG__INT64: {
        int64_t type_max = k->type == CONFIG__INT ? INT_MAX : INT64_MAX;
        if (k->imax >= type_max)
            snprintf(buf, n, ">= %" PRId64, k->imin);
        else
            snprintf(buf, n, "[%" PRId64 ", %" PRId64 "]", k->imin, k->imax);
        break;
    }
    case CONFIG__UINT64: snprintf(buf, n, "[0, 18446744073709551615]"); break;
    case CONFIG__FLOAT:
        if (isinf(k->fmax))
            snprintf(buf, n, "%s %g", k->fmin_open ? ">" : ">=", k->fmin);
        else
            snprintf(buf, n, "%s%g, %g%s", k->fmin_open ? "(" : "[", k->fmin, k->fmax,
                     k->fmax_open ? ")" : "]");
        break;
    case CONFIG__BOOL: snprintf(buf, n, "true, false"); break;
    case CONFIG__STRING: snprintf(buf, n, "at most %zu characters", k->size - 1); break;
    case CONFIG__ENUM:
    case CONFIG__CHOICE: config__list_choices(k->choices, buf, n); break;
    }
    return buf;
}

/* A value shortened for messages: the first 80 characters and "...". */
static const char *config__shown(const char *text, char *buf, size_t n) {
    size_t len = strlen(text);
    if (len <= 80)
        snprintf(buf, n, "%s", text);
    else
        snprintf(buf, n, "%.80s...", text);
    return buf;
}

/* The shortest decimal that reads back (strtof) as exactly the same float; %.9g always does. */
static void config__format_float(float v, char *buf, size_t n) {
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, n, "%.*g", prec, (double)v);
        float back = strtof(buf, NULL);
        if (memcmp(&back, &v, sizeof v) == 0) return;
    }
}

/* A string is writable as a loadable INI value unless it contains a control character or a ';'
 * after whitespace (inih would take the rest as an inline comment). Returns a reason or NULL. */
static const char *config__string_problem(const char *s) {
    for (const char *p = s; *p; p++) {
        if ((unsigned char)*p < 0x20 || *p == 0x7f) return "contains a control character";
        if (*p == ';' && p > s && (p[-1] == ' ' || p[-1] == '\t'))
            return "contains whitespace followed by ';', which an INI file reads as a comment";
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* Parsing one value. */

/* Reports a bad value: "<where>: <section>.<key> = "<value>" <problem>". */
__attribute__((format(printf, 5, 6))) static tera_status config__bad(const char *where,
                                                                     const config__key *k,
                                                                     const char *value, size_t len,
                                                                     const char *fmt, ...) {
    char problem[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problem, sizeof problem, fmt, ap);
    va_end(ap);
    return tera_fail(TERA_ERR_CONFIG, "%s: %s.%s = \"%.*s%s\" %s", where, k->section, k->key,
                     (int)(len > 80 ? 80 : len), value, len > 80 ? "..." : "", problem);
}

/* Parses `text` (already trimmed; an enclosing pair of double quotes is stripped) as key k and
 * stores it into c. Errors name `where` ("file:line", "command line"), the key, the value and the
 * valid range or choices. On error c is unchanged. */
static tera_status config__parse_value(tera_config *c, const config__key *k, const char *text,
                                       size_t len, const char *where) {
    char value[CONFIG__VALUE_MAX], range[512];
    if (len > 0 && text[0] == '"') {
        if (len < 2 || text[len - 1] != '"')
            return config__bad(where, k, text, len, "has an unterminated quote");
        text++;
        len -= 2;
    }
    if (len >= sizeof value)
        return config__bad(where, k, text, len, "is too long (%zu characters; at most %zu)", len,
                           k->type == CONFIG__STRING ? k->size - 1 : sizeof value - 1);
    memcpy(value, text, len);
    value[len] = '\0';
    config__describe_range(k, range, sizeof range);

    char *field = (char *)c + k->offset;
    switch (k->type) {
    case CONFIG__INT:
    case CONFIG__INT64: {
        char *end = NULL;
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (end == value || *end != '\0' || value[0] == ' ' || value[0] == '\t')
            return config__bad(where, k, value, len, "is not an integer; valid range: %s", range);
        if (errno == ERANGE || v < k->imin || v > k->imax)
            return config__bad(where, k, value, len, "is out of range; valid range: %s", range);
        if (k->type == CONFIG__INT) {
            int iv = (int)v;
            memcpy(field, &iv, sizeof iv);
        } else {
            int64_t iv = (int64_t)v;
            memcpy(field, &iv, sizeof iv);
        }
        return TERA_OK;
    }
    case CONFIG__UINT64: {
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(value, &end, 10);
        /* strtoull accepts "-1" and wraps it: refuse any sign or leading space. */
        if (end == value || *end != '\0' || !(value[0] >= '0' && value[0] <= '9'))
            return config__bad(where, k, value, len, "is not an unsigned integer; valid range: %s",
                               range);
        if (errno == ERANGE)
            return config__bad(where, k, value, len, "is out of range; valid range: %s", range);
        uint64_t uv = (uint64_t)v;
        memcpy(field, &uv, sizeof uv);
        return TERA_OK;
    }
    case CONFIG__FLOAT: {
        char *end = NULL;
        errno = 0;
        float v = strtof(value, &end);
        if (end == value || *end != '\0' || value[0] == ' ' || value[0] == '\t')
            return config__bad(where, k, value, len, "is not a number; valid range: %s", range);
        if (!isfinite(v))
            return config__bad(where, k, value, len, "is not a finite float; valid range: %s",
                               range);
        double d = (double)v;
        bool low = k->fmin_open ? !(d > k->fmin) : !(d >= k->fmin);
        bool high = k->fmax_open ? !(d < k->fmax) : !(d <= k->fmax);
        if (low || high)
            return config__bad(where, k, value, len, "is out of range; valid range: %s", range);
        memcpy(field, &v, sizeof v);
        return TERA_OK;
    }
    case CONFIG__BOOL: {
        static const char *const yes[] = {"true", "1", "yes", "on"};
        static const char *const no[] = {"false", "0", "no", "off"};
        for (int i = 0; i < 4; i++) {
            int bv = -1;
            if (strcasecmp(value, yes[i]) == 0) bv = 1;
            if (strcasecmp(value, no[i]) == 0) bv = 0;
            if (bv >= 0) {
                memcpy(field, &bv, sizeof bv);
                return TERA_OK;
            }
        }
        return config__bad(where, k, value, len,
                           "is not a boolean; valid: true, false, 1, 0, yes, no, on, off");
    }
    case CONFIG__STRING: {
        if (len >= k->size)
            return config__bad(where, k, value, len, "is too long (%zu characters; at most %zu)",
                               len, k->size - 1);
        const char *problem = config__string_problem(value);
        if (problem) return config__bad(where, k, value, len, "%s", problem);
        memset(field, 0, k->size); /* no stale tail: equal strings give equal structs */
        memcpy(field, value, len);
        return TERA_OK;
    }
    case CONFIG__ENUM:
    case CONFIG__CHOICE: {
        int idx = config__choice_index(k->choices, value);
        if (idx < 0) return config__bad(where, k, value, len, "is not one of: %s", range);
        if (k->type == CONFIG__ENUM)
            memcpy(field, &idx, sizeof idx);
        else { /* every choice fits: checked in config__check_table */
            memset(field, 0, k->size);
            memcpy(field, value, len);
        }
        return TERA_OK;
    }
    }
    return tera_fail(TERA_ERR_CONFIG, "%s: %s.%s has an unknown type", where, k->section, k->key);
}

/* Formats key k's current value as file text (strings quoted, enums by name). Returns a problem
 * that makes the value unwritable/invalid (a non-terminated string), or NULL. */
static const char *config__format_value(const tera_config *c, const config__key *k, char *buf,
                                        size_t n) {
    const char *field = (const char *)c + k->offset;
    buf[0] = '\0';
    switch (k->type) {
    case CONFIG__INT:
    case CONFIG__BOOL:
    case CONFIG__ENUM: {
        int v;
        memcpy(&v, field, sizeof v);
        if (k->type == CONFIG__BOOL && (v == 0 || v == 1))
            snprintf(buf, n, "%s", v ? "true" : "false");
        else if (k->type == CONFIG__ENUM)
            config__choice_name(k->choices, v, buf, n);
        if (!buf[0]) snprintf(buf, n, "%d", v); /* an int, or an invalid bool/enum as a number */
        return NULL;
    }
    case CONFIG__INT64: {
        int64_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%" PRId64, v);
        return NULL;
    }
    case CONFIG__UINT64: {
        uint64_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%" PRIu64, v);
        return NULL;
    }
    case CONFIG__FLOAT: {
        float v;
        memcpy(&v, field, sizeof v);
        config__format_float(v, buf, n);
        return NULL;
    }
    case CONFIG__STRING:
    case CONFIG__CHOICE:
        if (!memchr(field, '\0', k->size)) return "is not NUL-terminated";
        if (k->type == CONFIG__STRING)
            snprintf(buf, n, "\"%s\"", field);
        else
            snprintf(buf, n, "%s", field);
        return NULL;
    }
    return "has an unknown type";
}

/* Checks every key's current value against its type, range and choices (fields may have been set
 * directly, not through the parser): formats it and parses the text back into a scratch copy. */
static tera_status config__check_keys(const tera_config *c) {
    tera_config scratch;
    char text[CONFIG__VALUE_MAX];
    for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
        const config__key *k = &config__keys[i];
        const char *problem = config__format_value(c, k, text, sizeof text);
        if (problem)
            return tera_fail(TERA_ERR_CONFIG, "config: %s.%s %s", k->section, k->key, problem);
        scratch = *c;
        TERA_TRY(config__parse_value(&scratch, k, text, strlen(text), "config"));
    }
    return TERA_OK;
}

/* Sanity of the table itself (run once per tera_config_defaults): field sizes match the types,
 * every section is listed, every choice fits its buffer, no key appears twice. */
static void config__check_table(void) {
    for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
        const config__key *k = &config__keys[i];
        TERA_ASSERTF(config__find_section(k->section), "config key %s.%s: section not listed",
                     k->section, k->key);
        TERA_ASSERTF(config__find_key(k->section, k->key) == k, "config key %s.%s listed twice",
                     k->section, k->key);
        if (k->type == CONFIG__ENUM || k->type == CONFIG__BOOL || k->type == CONFIG__INT)
            TERA_ASSERTF(k->size == sizeof(int), "config key %s.%s: not int-sized", k->section,
                         k->key);
        TERA_ASSERTF(strcmp(k->section, "model") != 0 || (i < 64 && (i == 0 || !strcmp(config__keys[i - 1].section,
                                                                                       "model"))),
                     "config key %s.%s: [model] keys must be the first 64 rows of the table", k->section, k->key);
        if (k->type == CONFIG__CHOICE)
            for (const char *p = k->choices; *p;) {
                const char *bar = strchr(p, '|');
                size_t len = bar ? (size_t)(bar - p) : strlen(p);
                TERA_ASSERTF(len < k->size, "config key %s.%s: choice too long", k->section,
                             k->key);
                p += len + (bar != NULL);
            }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Public API. */

void tera_config_defaults(tera_config *c) {
    config__check_table();
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
        const config__key *k = &config__keys[i];
        tera_status s = config__parse_value(c, k, k->def, strlen(k->def), "default");
        TERA_ASSERTF(s == TERA_OK, "bad default in the config table: %s", tera_last_error());
    }
}

/* State of one tera_config_load. */
typedef struct {
    tera_config *cfg; /* the copy being filled (committed only on success) */
    const char *path;
    FILE *file;
    int line;                     /* lines read so far = the line of the current handler call */
    int key_line[CONFIG__N_KEYS]; /* line where each key was set in this file (0 = not yet) */
    bool failed;                  /* the reader or the handler recorded a message; stop */
    tera_status status;           /* its status */
} config__load_state;

/* inih line reader (fgets-style): counts lines, refuses over-long lines instead of letting inih
 * split them, and checks [section] headers itself because inih calls the handler only for keys
 * (an unknown but empty section would otherwise pass unnoticed). */
static char *config__read_line(char *str, int num, void *stream) {
    config__load_state *st = stream;
    if (st->failed) return NULL;
    /* fgets by hand: a NUL byte would end the line for strlen and cut the value silently */
    size_t len = 0;
    int c = EOF;
    while (len + 1 < (size_t)num && (c = getc(st->file)) != EOF) {
        if (c == 0) {
            st->failed = true;
            st->status = tera_fail(TERA_ERR_CONFIG, "%s:%d: a NUL byte in the line (not a text file?)", st->path,
                                   st->line + 1);
            return NULL;
        }
        str[len++] = (char)c;
        if (c == '\n') break;
    }
    str[len] = '\0';
    if (len == 0) return NULL; /* end of file */
    st->line++;
    if (len == (size_t)num - 1 && str[len - 1] != '\n') {
        int ch = getc(st->file);
        if (ch != EOF) {
            st->failed = true;
            st->status = tera_fail(TERA_ERR_CONFIG, "%s:%d: line longer than %d characters",
                                   st->path, st->line, num - 2);
            return NULL;
        }
    }
    const char *p = str;
    if (st->line == 1 && strncmp(p, "\xEF\xBB\xBF", 3) == 0) p += 3; /* UTF-8 byte-order mark */
    while (*p == ' ' || *p == '\t') p++;
    const char *close = *p == '[' ? strchr(p, ']') : NULL;
    if (close) {
        char name[128], valid[512];
        size_t nlen = (size_t)(close - p - 1);
        if (nlen >= sizeof name) nlen = sizeof name - 1;
        memcpy(name, p + 1, nlen);
        name[nlen] = '\0';
        if (!config__find_section(name)) {
            st->failed = true;
            st->status =
                tera_fail(TERA_ERR_CONFIG, "%s:%d: unknown section [%s]; valid sections: %s",
                          st->path, st->line, name, config__list_sections(valid, sizeof valid));
            return NULL;
        }
    }
    return str;
}

/* inih handler: one key = value in one section. Returns 1 to go on, 0 on error (message kept). */
static int config__handle(void *user, const char *section, const char *name, const char *value) {
    config__load_state *st = user;
    char where[TERA_PATH_MAX + 32], valid[1024];
    if (st->failed) return 0;
    snprintf(where, sizeof where, "%s:%d", st->path, st->line);
    st->failed = true; /* until the key is stored */
    if (!value) {
        st->status = tera_fail(TERA_ERR_CONFIG, "%s: key %s has no value", where, name);
        return 0;
    }
    if (!section[0]) {
        st->status =
            tera_fail(TERA_ERR_CONFIG, "%s: key %s is outside any [section]; valid sections: %s",
                      where, name, config__list_sections(valid, sizeof valid));
        return 0;
    }
    if (!config__find_section(section)) { /* normally caught by the reader already */
        st->status = tera_fail(TERA_ERR_CONFIG, "%s: unknown section [%s]; valid sections: %s",
                               where, section, config__list_sections(valid, sizeof valid));
        return 0;
    }
    const config__key *k = config__find_key(section, name);
    if (!k) {
        st->status =
            tera_fail(TERA_ERR_CONFIG, "%s: unknown key %s.%s; valid keys of [%s]: %s", where,
                      section, name, section, config__list_keys(section, valid, sizeof valid));
        return 0;
    }
    size_t idx = (size_t)(k - config__keys);
    if (st->key_line[idx]) {
        st->status = tera_fail(TERA_ERR_CONFIG, "%s: %s.%s is set twice (lines %d and %d)", where,
                               k->section, k->key, st->key_line[idx], st->line);
        return 0;
    }
    st->status = config__parse_value(st->cfg, k, value, strlen(value), where);
    if (st->status != TERA_OK) return 0;
    st->cfg->model_given |= config__given_bit(k);
    st->key_line[idx] = st->line;
    st->failed = false;
    return 1;
}

tera_status tera_config_load(tera_config *c, const char *path) {
    /* Debian's libinih exposes its build options as globals; only this file uses inih. A heap line
     * buffer lets a full TERA_PATH_MAX path fit on one line (longer lines are refused by the
     * reader); continuation lines are off (an
     * indented line is a line of its own); stop at the first error so ours is the one reported. */
    ini_use_stack = false;
    ini_allow_realloc = false;
    ini_initial_alloc = CONFIG__LINE_MAX; /* the heap buffer's size (no realloc) */
    ini_max_line = CONFIG__LINE_MAX;
    ini_allow_multiline = false;
    ini_stop_on_first_error = true;
    ini_allow_no_value = false;

    tera_config copy = *c;
    config__load_state st = {.cfg = &copy, .path = path, .status = TERA_OK};
    st.file = fopen(path, "r");
    if (!st.file)
        return tera_fail(TERA_ERR_IO, "cannot open config file %s: %s", path, strerror(errno));
    int rc = ini_parse_stream(config__read_line, &st, config__handle, &st);
    bool read_error = ferror(st.file) != 0;
    int saved_errno = errno;
    if (fclose(st.file) != 0 && !st.failed && rc == 0 && !read_error)
        return tera_fail(TERA_ERR_IO, "cannot close config file %s: %s", path, strerror(errno));
    if (st.failed) return st.status;
    if (rc == -2) return tera_fail(TERA_ERR_NOMEM, "%s: out of memory while parsing", path);
    if (rc != 0)
        return tera_fail(TERA_ERR_CONFIG,
                         "%s:%d: syntax error (expected [section], key = value, or a # comment)",
                         path, rc);
    if (read_error)
        return tera_fail(TERA_ERR_IO, "cannot read config file %s: %s", path,
                         strerror(saved_errno));
    *c = copy;
    return TERA_OK;
}

/* Copies [from, to) into buf without surrounding blanks. */
static void config__trim_copy(char *buf, size_t n, const char *from, const char *to) {
    while (from < to && (*from == ' ' || *from == '\t')) from++;
    while (to > from && (to[-1] == ' ' || to[-1] == '\t')) to--;
    size_t len = (size_t)(to - from);
    if (len >= n) len = n - 1;
    memcpy(buf, from, len);
    buf[len] = '\0';
}

tera_status tera_config_set(tera_config *c, const char *assignment) {
    static const char where[] = "command line";
    char shown[128], section[64], name[64], valid[1024];
    const char *eq = strchr(assignment, '=');
    const char *dot = eq ? memchr(assignment, '.', (size_t)(eq - assignment)) : NULL;
    if (!eq || !dot)
        return tera_fail(TERA_ERR_CONFIG, "%s: expected section.key=value, got \"%s\"", where,
                         config__shown(assignment, shown, sizeof shown));
    config__trim_copy(section, sizeof section, assignment, dot);
    config__trim_copy(name, sizeof name, dot + 1, eq);
    if (!config__find_section(section))
        return tera_fail(TERA_ERR_CONFIG, "%s: unknown section [%s] in \"%s\"; valid sections: %s",
                         where, section, config__shown(assignment, shown, sizeof shown),
                         config__list_sections(valid, sizeof valid));
    const config__key *k = config__find_key(section, name);
    if (!k)
        return tera_fail(TERA_ERR_CONFIG, "%s: unknown key %s.%s; valid keys of [%s]: %s", where,
                         section, name, section, config__list_keys(section, valid, sizeof valid));
    const char *v = eq + 1;
    const char *vend = v + strlen(v);
    while (*v == ' ' || *v == '\t') v++;
    while (vend > v && (vend[-1] == ' ' || vend[-1] == '\t')) vend--;
    TERA_TRY(config__parse_value(c, k, v, (size_t)(vend - v), where));
    c->model_given |= config__given_bit(k);
    return TERA_OK;
}

/* Cross-field checks fail through this: "config: <message>". */
#define CONFIG__REQUIRE(cond, ...)                                                                 \
    do {                                                                                           \
        if (!(cond)) return tera_fail(TERA_ERR_CONFIG, "config: " __VA_ARGS__);                    \
    } while (0)

tera_status tera_config_pp_layers(const tera_parallel_config *p, int n_layers, int *first) {
    const int S = p->pp * p->pp_chunks;
    const char *q = p->pp_layers;
    int n = 0;
    long sum = 0;
    first[0] = 0;
    while (*q) {
        char *end;
        const long v = strtol(q, &end, 10);
        if (end == q || v < 1 || v > n_layers || (*end != ',' && *end != 0))
            return tera_fail(TERA_ERR_CONFIG, "config: parallel.pp_layers = \"%s\": expected positive layer counts "
                             "separated by commas", p->pp_layers);
        sum += v;
        if (n < S) first[n + 1] = first[n] + (int)v;
        n++;
        q = *end ? end + 1 : end;
    }
    if (n != S || sum != n_layers)
        return tera_fail(TERA_ERR_CONFIG, "config: parallel.pp_layers = \"%s\": needs %d counts (pp x pp_chunks) adding "
                         "up to model.n_layers = %d (got %d adding up to %ld)", p->pp_layers, S, n_layers, n, sum);
    return TERA_OK;
}

void tera_model_config_derive(tera_model_config *m) {
    if (m->n_kv_heads == 0) m->n_kv_heads = m->n_heads;
    if (m->dense_ffn_dim == 0 && m->first_k_dense > 0) m->dense_ffn_dim = m->top_k * m->ffn_dim; /* checked: fits */
    if (m->first_k_dense == 0) m->dense_ffn_dim = 0; /* no dense layers: unused */
}

tera_status tera_config_finalize(tera_config *c) {
    TERA_TRY(config__check_keys(c));
    tera_model_config *m = &c->model;
    const tera_train_config *t = &c->training;
    const tera_parallel_config *p = &c->parallel;

    /* Derived defaults: computed in tera_model_config_derive only (0 = derived; tera_config_from_hf
     * resets the ones not given so that they follow config.json's values). */
    CONFIG__REQUIRE(m->dense_ffn_dim != 0 || m->first_k_dense == 0 || (int64_t)m->top_k * m->ffn_dim <= INT_MAX,
                    "model.dense_ffn_dim = model.top_k * model.ffn_dim = %" PRId64 " is too large (set model.dense_ffn_dim)",
                    (int64_t)m->top_k * m->ffn_dim);
    tera_model_config_derive(m);

    /* Sizes are counted in 64-bit bytes (the parameter table, the memory check, every buffer): a model
     * or a micro-batch whose counts would not fit is refused here, before anything overflows. The
     * estimates (in double) are generous upper bounds: 2^56 floats is 7.2e16, some 72 000 times a
     * trillion-parameter model, and 16 bytes each still fit. */
    {
        const double D = m->dim, V = m->vocab_size, L = m->n_layers, E = m->n_experts, F = m->ffn_dim,
                     S = m->n_shared_experts, K = m->top_k, Fd = m->first_k_dense > 0 ? m->dense_ffn_dim : 0;
        const double params = 2 * V * D + L * (4 * D * D + E * D + 3 * D * F * (E + S) + 3 * D * Fd + 8 * D);
        const double N = (double)t->micro_batch * t->seq_len;
        const double acts = N * (V + L * (16 * D + 3 * F * (K + S) + 3 * Fd + E));
        const double limit = 72057594037927936.0; /* 2^56 */
        CONFIG__REQUIRE(params <= limit,
                        "a model of about %.3g parameters (model.vocab_size = %d, model.dim = %d, model.n_layers = %d, "
                        "model.n_experts = %d, model.ffn_dim = %d) is beyond the %.3g whose byte counts fit in 64 bits",
                        params, m->vocab_size, m->dim, m->n_layers, m->n_experts, m->ffn_dim, limit);
        CONFIG__REQUIRE(acts <= limit,
                        "training.micro_batch x training.seq_len = %d x %d tokens need about %.3g activation floats a "
                        "micro-batch (model.vocab_size = %d, model.dim = %d, model.n_layers = %d, model.ffn_dim = %d), "
                        "beyond the %.3g whose byte counts fit in 64 bits",
                        t->micro_batch, t->seq_len, acts, m->vocab_size, m->dim, m->n_layers, m->ffn_dim, limit);
    }

    /* Cross-field checks (per-key ranges, e.g. every size >= 1, are in the table). */
    CONFIG__REQUIRE(c->logging.peak_tflops == 0.0f || c->logging.peak_tflops >= 1e-6f,
                    "logging.peak_tflops = %g is below 1e-6 TFLOP/s (1 MFLOP/s): give one rank's peak in TFLOP/s "
                    "(e.g. 0.4 for two CPU cores in fp32, 989 for an H100 SXM in bf16), or 0 for no MFU",
                    (double)c->logging.peak_tflops);
    CONFIG__REQUIRE(m->dim % m->n_heads == 0,
                    "model.dim (%d) must be divisible by model.n_heads (%d)", m->dim, m->n_heads);
    CONFIG__REQUIRE((m->dim / m->n_heads) % 2 == 0,
                    "head width model.dim / model.n_heads = %d / %d = %d must be even (RoPE)",
                    m->dim, m->n_heads, m->dim / m->n_heads);
    CONFIG__REQUIRE(m->n_heads % m->n_kv_heads == 0,
                    "model.n_heads (%d) must be divisible by model.n_kv_heads (%d)", m->n_heads,
                    m->n_kv_heads);
    CONFIG__REQUIRE(m->top_k <= m->n_experts,
                    "model.top_k (%d) must be in [1, model.n_experts = %d]", m->top_k,
                    m->n_experts);
    CONFIG__REQUIRE(m->n_experts % m->n_groups == 0,
                    "model.n_groups (%d) must divide model.n_experts (%d)", m->n_groups, m->n_experts);
    CONFIG__REQUIRE(m->topk_groups <= m->n_groups,
                    "model.topk_groups (%d) must be in [1, model.n_groups = %d]", m->topk_groups, m->n_groups);
    CONFIG__REQUIRE((int64_t)m->top_k <= (int64_t)m->topk_groups * (m->n_experts / m->n_groups),
                    "model.top_k (%d) must be at most model.topk_groups x experts per group = %d x %d = %lld "
                    "(the experts a token may choose from)",
                    m->top_k, m->topk_groups, m->n_experts / m->n_groups,
                    (long long)m->topk_groups * (m->n_experts / m->n_groups));
    CONFIG__REQUIRE(!m->router_force_balance || m->n_groups == 1 || m->topk_groups == m->n_groups,
                    "model.router_force_balance (benchmarking only) picks a fixed balanced pattern of experts that "
                    "ignores expert groups: it cannot be combined with group-limited routing (model.topk_groups = %d "
                    "< model.n_groups = %d); set model.topk_groups = model.n_groups or turn one of them off",
                    m->topk_groups, m->n_groups);
    CONFIG__REQUIRE(m->first_k_dense <= m->n_layers,
                    "model.first_k_dense (%d) must be at most model.n_layers (%d)",
                    m->first_k_dense, m->n_layers);
    CONFIG__REQUIRE(t->seq_len <= m->max_seq_len,
                    "training.seq_len (%d) must be at most model.max_seq_len (%d)", t->seq_len,
                    m->max_seq_len);
    CONFIG__REQUIRE(m->sliding_window == 0 || t->seq_len <= m->sliding_window,
                    "model.sliding_window = %d (a Hugging Face config.json's sliding_window) is smaller than "
                    "training.seq_len = %d: tera has no sliding-window attention (every position attends to all "
                    "earlier ones), so it would compute another model than the config describes; use "
                    "training.seq_len <= %d",
                    m->sliding_window, t->seq_len, m->sliding_window);
    CONFIG__REQUIRE(t->min_lr <= t->lr, "training.min_lr (%g) must be at most training.lr (%g)",
                    (double)t->min_lr, (double)t->lr);
    CONFIG__REQUIRE(t->warmup_steps <= t->steps,
                    "training.warmup_steps (%d) must be at most training.steps (%d)",
                    t->warmup_steps, t->steps);
    CONFIG__REQUIRE(t->batch_rampup_start <= t->grad_accum,
                    "training.batch_rampup_start (%d) must be at most training.grad_accum (%d)",
                    t->batch_rampup_start, t->grad_accum);
    CONFIG__REQUIRE(t->batch_rampup_start == 0 || t->batch_rampup_steps > 0,
                    "training.batch_rampup_start = %d needs training.batch_rampup_steps > 0 (the steps the "
                    "ramp-up lasts)", t->batch_rampup_start);
    CONFIG__REQUIRE(t->batch_grow_max == 0 || t->batch_grow_max >= t->grad_accum,
                    "training.batch_grow_max (%d) must be 0 or at least training.grad_accum (%d)",
                    t->batch_grow_max, t->grad_accum);

    /* the global batch, when stated, must be what the layout makes of it */
    CONFIG__REQUIRE(t->global_batch == 0 || (int64_t)t->global_batch == (int64_t)t->micro_batch * t->grad_accum * p->dp,
                    "training.global_batch = %d, but training.micro_batch x training.grad_accum x parallel.dp = "
                    "%d x %d x %d = %lld sequences", t->global_batch, t->micro_batch, t->grad_accum, p->dp,
                    (long long)t->micro_batch * t->grad_accum * p->dp);
    /* fp16 gradient sums saturate at +-65504: under fp16 training an overflow the loss scaler must
     * see (an infinite gradient) would arrive finite (docs/COMMUNICATION.md) */
    CONFIG__REQUIRE(strcmp(p->grad_compression, "fp16") != 0 || strcmp(t->precision, "fp16") != 0,
                    "parallel.grad_compression = fp16 with training.precision = fp16: fp16 sums saturate at "
                    "+-65504 and would hide overflows from the loss scaler (use bf16 or int8)");
    /* expert parallelism splits the experts over ranks of the data-parallel group */
    CONFIG__REQUIRE(p->dp % p->ep == 0,
                    "parallel.ep (%d) must divide parallel.dp (%d): expert-parallel ranks are data-parallel ranks "
                    "that split the experts among themselves", p->ep, p->dp);
    CONFIG__REQUIRE(m->n_experts % p->ep == 0, "parallel.ep (%d) must divide model.n_experts (%d)", p->ep,
                    m->n_experts);
    /* tensor parallelism splits heads, FFN widths and the vocabulary */
    {
        static const char *const what[] = {"model.vocab_size", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
                                           "model.dense_ffn_dim"};
        const int v[] = {m->vocab_size, m->n_heads, m->n_kv_heads, m->ffn_dim, m->dense_ffn_dim};
        for (int i = 0; i < 5; i++)
            CONFIG__REQUIRE(v[i] % p->tp == 0, "parallel.tp (%d) must divide %s (%d)", p->tp, what[i], v[i]);
        CONFIG__REQUIRE(!p->sequence_parallel || ((int64_t)t->micro_batch * t->seq_len) % p->tp == 0,
                        "parallel.sequence_parallel splits a micro-batch's training.micro_batch x training.seq_len "
                        "(%d x %d) rows over parallel.tp (%d) ranks: it must divide them", t->micro_batch, t->seq_len,
                        p->tp);
    }
    /* pipeline parallelism: the schedule, the chunks and the layer split */
    {
        const int interleaved = strcmp(p->pp_schedule, "interleaved") == 0;
        CONFIG__REQUIRE(!interleaved || p->pp_chunks >= 2,
                        "parallel.pp_schedule = interleaved needs parallel.pp_chunks >= 2 (it is %d)", p->pp_chunks);
        CONFIG__REQUIRE(interleaved || p->pp_chunks == 1,
                        "parallel.pp_chunks = %d needs parallel.pp_schedule = interleaved", p->pp_chunks);
        CONFIG__REQUIRE(!interleaved || t->grad_accum % p->pp == 0,
                        "parallel.pp_schedule = interleaved needs training.grad_accum (%d) to be a multiple of "
                        "parallel.pp (%d)", t->grad_accum, p->pp);
        CONFIG__REQUIRE(p->pp * p->pp_chunks <= m->n_layers,
                        "parallel.pp x parallel.pp_chunks = %d virtual stages need at least as many layers "
                        "(model.n_layers = %d)", p->pp * p->pp_chunks, m->n_layers);
        CONFIG__REQUIRE(p->pp == 1 || !m->tie_embeddings,
                        "parallel.pp = %d with model.tie_embeddings: the embedding and the LM head live on different "
                        "pipeline stages; untie them", p->pp);
        CONFIG__REQUIRE(p->pp == 1 || t->batch_rampup_steps == 0 || t->batch_rampup_start == 0 ||
                            t->batch_rampup_start >= t->grad_accum,
                        "parallel.pp = %d: the pipeline runs training.grad_accum micro-batches every step; a batch "
                        "ramp-up is not supported with it", p->pp);
        CONFIG__REQUIRE(p->pp == 1 || t->batch_grow_gnorm <= 0,
                        "parallel.pp = %d: batch growth (training.batch_grow_gnorm) is not supported with a pipeline",
                        p->pp);
        if (p->pp_head_split) {
            CONFIG__REQUIRE(p->pp > 1, "parallel.pp_head_split splits the LM head between pipeline stages: it needs "
                                       "parallel.pp > 1 (it is %d)", p->pp);
            CONFIG__REQUIRE(strcmp(p->pp_schedule, "gpipe") != 0,
                            "parallel.pp_head_split needs a schedule that runs each micro-batch's last backward right "
                            "after its forward on the last stage: parallel.pp_schedule = 1f1b or interleaved, not gpipe");
            CONFIG__REQUIRE(p->zero <= 1, "parallel.pp_head_split with parallel.zero = %d: needs ZeRO stage 0 or 1 "
                                          "(the head's whole gradient on the last stage)", p->zero);
            CONFIG__REQUIRE(m->vocab_size % (2 * p->tp) == 0,
                            "parallel.pp_head_split halves each tensor-parallel rank's vocabulary slice: model.vocab_size "
                            "(%d) must be a multiple of 2 x parallel.tp (%d)", m->vocab_size, 2 * p->tp);
            CONFIG__REQUIRE(t->loss_chunk == 0 || t->loss_chunk >= t->micro_batch * t->seq_len,
                            "parallel.pp_head_split with training.loss_chunk = %d: the split head takes a "
                            "micro-batch's rows at once", t->loss_chunk);
        }
        if (p->pp_defer_wgrad) {
            CONFIG__REQUIRE(p->pp > 1, "parallel.pp_defer_wgrad defers the LM head's weight gradient into a pipeline's "
                                       "waits: it needs parallel.pp > 1 (it is %d)", p->pp);
            CONFIG__REQUIRE(p->zero <= 1, "parallel.pp_defer_wgrad with parallel.zero = %d: needs ZeRO stage 0 or 1 "
                                          "(the head's whole gradient kept until the step's end)", p->zero);
            CONFIG__REQUIRE(t->loss_chunk == 0 || t->loss_chunk >= t->micro_batch * t->seq_len,
                            "parallel.pp_defer_wgrad with training.loss_chunk = %d: the deferred gradient keeps a "
                            "micro-batch's whole logits; set one of them to 0", t->loss_chunk);
        }
        if (p->pp_layers[0]) {
            int *first = malloc(sizeof(int) * ((size_t)p->pp * (size_t)p->pp_chunks + 1));
            TERA_ASSERT(first);
            const tera_status st = tera_config_pp_layers(p, m->n_layers, first);
            free(first);
            if (st != TERA_OK) return st;
        }
    }
    TERA_TRY(tera_recompute_parse(t->recompute, m->n_layers, NULL));
    return TERA_OK;
}

tera_status tera_config_from_hf(tera_config *c, const char *dir) {
    tera_config given = *c, hf = *c;
    const config__key *kv = config__find_key("model", "n_kv_heads");
    const config__key *dense = config__find_key("model", "dense_ffn_dim");
    /* derived defaults that were not given follow config.json's values (finalize derives them) */
    if (!(c->model_given & config__given_bit(kv)) || given.model.n_kv_heads == 0) hf.model.n_kv_heads = 0;
    if (!(c->model_given & config__given_bit(dense)) || given.model.dense_ffn_dim == 0) hf.model.dense_ffn_dim = 0;
    TERA_TRY(tera_hf_read_config(dir, &hf.model));
    char a[CONFIG__VALUE_MAX], b[CONFIG__VALUE_MAX];
    for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
        const config__key *k = &config__keys[i];
        if (!(c->model_given & config__given_bit(k))) continue;
        if ((k == kv && given.model.n_kv_heads == 0) || (k == dense && given.model.dense_ffn_dim == 0)) continue;
        if (k == dense && hf.model.first_k_dense == 0) continue; /* no dense layer: the width is unused */
        config__format_value(&given, k, a, sizeof a);
        config__format_value(&hf, k, b, sizeof b);
        if (strcmp(a, b) == 0) continue;
        const char *json = tera_hf_config_key(k->offset - offsetof(tera_config, model));
        return tera_fail(TERA_ERR_CONFIG,
                         "%s/config.json: model.%s = %s was given (in a config file or on the command line), but "
                         "config.json has %s = %s; the model comes from config.json when training.init_from or "
                         "--from names a Hugging Face directory: drop the model.%s setting or make it agree",
                         dir, k->key, a, json ? json : k->key, b, k->key);
    }
    c->model = hf.model;
    return TERA_OK;
}

tera_status tera_config_write(const tera_config *c, const char *path) {
    TERA_TRY(config__check_keys(c)); /* only loadable values are written */
    char text[CONFIG__VALUE_MAX];
    for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
        const config__key *k = &config__keys[i];
        if (k->type != CONFIG__STRING) continue;
        const char *problem = config__string_problem((const char *)c + k->offset);
        if (problem)
            return tera_fail(TERA_ERR_CONFIG, "config: %s.%s %s", k->section, k->key, problem);
    }

    /* a regular file (or a new one) is written under a temporary name and renamed into place, so a
     * failed write never destroys the file it replaces; a device or pipe (/dev/stdout) directly */
    struct stat sb; /* lstat: a symbolic link (/dev/stdout) is written through, never replaced */
    const int direct = lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    const char *out = direct ? path : tmp;
    FILE *f = fopen(out, "w");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot create %s: %s", out, strerror(errno));
    fprintf(f, "# tera configuration: every key with its resolved value.\n"
               "# Load it as a config file; any key can be overridden with --section.key=value.\n"
               "# Keys, types and ranges: docs/CONFIG.md.\n");
    for (size_t s = 0; s < CONFIG__N_SECTIONS; s++) {
        const config__section *sec = &config__sections[s];
        fprintf(f, "\n[%s]\n# %s\n", sec->name, sec->doc);
        for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
            const config__key *k = &config__keys[i];
            if (strcmp(k->section, sec->name) != 0) continue;
            const char *problem = config__format_value(c, k, text, sizeof text);
            TERA_ASSERT(problem == NULL); /* config__check_keys passed */
            fprintf(f, "# %s\n%s = %s\n", k->doc, k->key, text);
        }
    }
    bool write_error = fflush(f) != 0 || ferror(f) != 0;
    int saved_errno = errno;
    if (fclose(f) != 0 || write_error) {
        const int e = write_error ? saved_errno : errno;
        if (!direct) unlink(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write %s: %s", path, strerror(e));
    }
    if (!direct && rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write %s: rename: %s", path, strerror(e));
    }
    return TERA_OK;
}

void tera_config_write_doc(FILE *f) {
    char range[512], def[CONFIG__VALUE_MAX];
    for (size_t s = 0; s < CONFIG__N_SECTIONS; s++) {
        const config__section *sec = &config__sections[s];
        fprintf(f, "## [%s]\n\n%s\n\n", sec->name, sec->doc);
        fprintf(f, "| key | type | default | range / choices | meaning |\n");
        fprintf(f, "| --- | --- | --- | --- | --- |\n");
        for (size_t i = 0; i < CONFIG__N_KEYS; i++) {
            const config__key *k = &config__keys[i];
            if (strcmp(k->section, sec->name) != 0) continue;
            config__describe_range(k, range, sizeof range);
            if (k->type == CONFIG__STRING)
                snprintf(def, sizeof def, "\"%s\"", k->def);
            else
                snprintf(def, sizeof def, "%s", k->def);
            fprintf(f, "| `%s` | %s | `%s` | %s | %s |\n", k->key, config__type_names[k->type], def,
                    range, k->doc);
        }
        fprintf(f, "\n");
    }
}
