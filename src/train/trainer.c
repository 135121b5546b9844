/* The step loop: micro-batches, gradient accumulation, clipping, AdamW, metrics, checkpoints. */
#include <dirent.h>
#include <ftw.h>
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tera/ckpt.h"
#include "tera/compress.h"
#include "tera/elastic.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/kernels.h"
#include "tera/metrics_http.h"
#include "tera/hw.h"
#include "tera/tensorboard.h"
#include "tera/trace.h"
#include "tera/zero.h"
#include "tera/profile.h"
#include "tera/safetensors.h"
#include "tera/sample.h"
#include "tera/train.h"
#include "onebit.h"

static int dir_nonempty(const char *path) {
    DIR *d = opendir(path);
    if (!d) return 0;
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, TERA_RUN_LOCK_NAME) &&
            strcmp(e->d_name, "elastic")) /* tera launch's own files (src/cli/cmd_launch.c) */
            n++;
    closedir(d);
    return n > 0;
}

/* The first field (by config key name) on which two model configs differ, or NULL. Derived
 * defaults (0 = derived) are resolved first; dense_ffn_dim only matters with dense layers. */
static const char *model_config_diff(const tera_model_config *a0, const tera_model_config *b0) {
    tera_model_config a = *a0, b = *b0;
    tera_model_config *both[2] = {&a, &b};
    for (int i = 0; i < 2; i++) tera_model_config_derive(both[i]);
#define DIFF(f)                                                                                    \
    if (a.f != b.f) return #f
    DIFF(vocab_size); DIFF(dim); DIFF(n_layers); DIFF(n_heads); DIFF(n_kv_heads); DIFF(n_experts);
    DIFF(top_k); DIFF(ffn_dim); DIFF(n_shared_experts); DIFF(first_k_dense); DIFF(dense_ffn_dim);
    DIFF(rope_theta); DIFF(norm_eps); DIFF(tie_embeddings);
#undef DIFF
    return NULL;
}

/* Everything a rank sets up by itself, without collectives (so that a failure on one rank cannot
 * leave the others waiting); tera_trainer_init then makes the ranks agree. */
/* The low-precision conversion scratch, sized once for the model's largest product (set the
 * precision and the bf16 units first). */
static void reserve_scratch(const tera_trainer *tr) {
    if (tr->prec.precision == TERA_PREC_FP32) return;
    const tera_train_config *t = &tr->cfg.training;
    int64_t me, te;
    tera_precision_scratch_elems(&tr->cfg.model, t->micro_batch, t->seq_len, tr->topo.ep, &me, &te);
    tera_backend_reserve(tr->model.be, me, te);
}

/* The pipeline executor's hooks (include/tera/pipeline.h): micro-batch `micro` of the current step
 * from the loader, and ZeRO-3's prefetch plan. */
static double pipe_load(void *ctx, int micro, int32_t *tokens, int32_t *targets) {
    tera_trainer *tr = ctx;
    const int B = tr->cfg.training.micro_batch, T = tr->cfg.training.seq_len;
    const int64_t g0 = tera_loader_step_sample(tr->samples_consumed, B, micro, tr->topo.dp_rank, tr->topo.dp, 0);
    const double t0 = tera_now();
    for (int b = 0; b < B; b++)
        tera_loader_train_sample(&tr->loader, g0 + b, tokens + (int64_t)b * T, targets + (int64_t)b * T);
    return tera_now() - t0;
}

static void pipe_plan(void *ctx, int last, int next) { tera_zero_plan(((tera_trainer *)ctx)->sharding, last, next); }

/* Rank 0's run directory: refused when it holds a run (unless continued or --force), the old run's
 * metrics and checkpoints removed under --force, config.ini written for a fresh run. */
static tera_status setup_run_dir(tera_trainer *tr, int overwrite) {
    if (!tr->run_dir[0] || !tr->root) return TERA_OK;
    if (dir_nonempty(tr->run_dir) && !overwrite)
        return tera_fail(TERA_ERR_EXISTS,
                         "run directory '%s' already exists and is not empty; choose another "
                         "logging.run_dir, pass --resume to continue it, or --force to overwrite it",
                         tr->run_dir);
    char path[TERA_PATH_MAX + 64];
    if (overwrite == TERA_RUN_FRESH && dir_nonempty(tr->run_dir)) {
        /* --force: the old run's metrics and checkpoints go, so a later --resume cannot mix runs */
        snprintf(path, sizeof path, "%s/metrics.jsonl", tr->run_dir);
        if (unlink(path) != 0 && errno != ENOENT) return tera_fail(TERA_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
        /* only tera's entries (step_N, .tmp, .deleting), then checkpoints/ once empty: anything else
         * there stays (--force on a directory that was not a tera run must not take its files) */
        snprintf(path, sizeof path, "%s/checkpoints", tr->run_dir);
        TERA_TRY(tera_ckpt_remove_listed(path, 0));
        (void)rmdir(path); /* fails, harmlessly, when other files remain or it is not there */
    }
    TERA_TRY(tera_mkdirs(tr->run_dir));
    snprintf(path, sizeof path, "%s/config.ini", tr->run_dir);
    /* continuing (--resume, ckpt convert): written once the checkpoint has been accepted */
    if (overwrite != TERA_RUN_CONTINUE) TERA_TRY(tera_config_write(&tr->cfg, path));
    return TERA_OK;
}

static tera_status init_local(tera_trainer *tr, const tera_config *cfg, const char *run_dir, int overwrite) {
    memset(tr, 0, sizeof *tr);
    tr->cfg = *cfg;
    const tera_train_config *t = &cfg->training;
    tera_set_threads(t->threads);
    tera_comm *world = tera_comm_world();
    tera_comm_set_timeout(cfg->parallel.timeout_s);
    tr->root = tera_comm_rank(world) == 0;
    /* ranks -> coordinates -> groups (src/parallel/topology.c): validated once, each group a split
     * of the world. Collectives: every rank makes the same calls. The trainer keeps no copies of
     * the coordinates: tr->topo is the one place (world, rank, dp/tp/pp/ep/edp and their ranks). */
    tera_status tst = tera_topology_init(&tr->topo, tera_comm_size(world), tera_comm_rank(world), cfg->parallel.pp,
                                         cfg->parallel.dp, cfg->parallel.tp, cfg->parallel.ep);
    if (tst != TERA_OK) return tst;
    /* the communicators of every group, the ranks placed on nodes (include/tera/groups.h) */
    if ((tst = tera_groups_create(&tr->groups, &tr->topo, cfg->parallel.ranks_per_node)) != TERA_OK) return tst;
    if (cfg->parallel.pp_head_split && tr->topo.pp > 1) tera_groups_ends(&tr->groups, &tr->topo);
    snprintf(tr->run_dir, sizeof tr->run_dir, "%s", run_dir ? run_dir : "");

    tera_status st = tera_source_open(&tr->src, &cfg->data, cfg->model.vocab_size);
    if (st != TERA_OK) return st;
    st = tera_loader_init(&tr->loader, &tr->src, t->seq_len, cfg->data.val_fraction, cfg->data.shuffle, t->seed);
    if (st != TERA_OK) goto fail_src;
    /* streamed data (data.stream): this rank's shards and the sample mapping (src/data/stream.c) */
    if ((st = tera_loader_bind(&tr->loader, tr->topo.dp_rank, tr->topo.dp, t->micro_batch, t->eval_every)) != TERA_OK) goto fail_src;
    if (t->eval_every > 0 && tr->loader.n_val == 0) {
        st = tera_fail(TERA_ERR_CONFIG, "training.eval_every = %d needs held-out data: set data.val_fraction > 0 "
                                        "or a validation set data.val_path (data '%s' has %ld samples)",
                       t->eval_every, cfg->data.path[0] ? cfg->data.path : "embedded corpus",
                       (long)tr->loader.n_samples);
        goto fail_src;
    }
    {
        /* pipeline: the layers of each virtual stage (configured, or balanced by modelled compute) */
        const int S = tr->topo.pp * cfg->parallel.pp_chunks;
        int *first = tera_calloc((size_t)S + 1, sizeof(int));
        if (cfg->parallel.pp_layers[0]) {
            st = tera_config_pp_layers(&cfg->parallel, cfg->model.n_layers, first); /* validated by the config */
            TERA_ASSERT(st == TERA_OK);
        } else {
            tera_pp_split(&cfg->model, S, t->seq_len, first);
        }
        int slots = 1;
        if (tr->topo.pp > 1 && (st = tera_pipe_slots(cfg->parallel.pp_schedule, tr->topo.pp, tr->topo.pp_rank,
                                                     t->grad_accum, cfg->parallel.pp_chunks, &slots)) != TERA_OK) {
            free(first);
            goto fail_src;
        }
        const int zero = tera_zero_stage_in_effect(&tr->topo, cfg->parallel.zero);
        tera_backend *be = NULL; /* training.device */
        if ((st = tera_backend_for_device(t->device, t->threads, &be)) != TERA_OK) {
            free(first);
            goto fail_src;
        }
        const tera_model_par par = {.ep = tr->topo.ep, .group = tr->groups.ep, .overlap = cfg->parallel.ep_overlap,
                                    .a2a_compression = tera_compress_parse(cfg->parallel.a2a_compression),
                                    .a2a_rows_bf16 = tera_a2a_rows_bf16(cfg),
                                    .hierarchical = cfg->parallel.ep_hierarchical, .dp_group = tr->groups.dp,
                                    .tp = tr->topo.tp, .tp_group = tr->groups.tp, .tp_overlap = cfg->parallel.tp_overlap,
                                    .sp = cfg->parallel.sequence_parallel,
                                    .shard_grads = zero >= 2,
                                    .shard_params = zero >= 3, .pp = tr->topo.pp, .pp_rank = tr->topo.pp_rank,
                                    .v = cfg->parallel.pp_chunks, .layer_first = first,
                                    .n_slots = slots, .be = be,
                                    /* parallel.pp_head_split: the first stage helps (1), the last owns (2) */
                                    .head_role = !tr->groups.ends ? 0 : tr->topo.pp_rank == 0 ? 1 : 2,
                                    .head_group = tr->groups.ends, .defer_wgrad = cfg->parallel.pp_defer_wgrad};
        tera_model_config mc = cfg->model;
        mc.recompute = t->recompute;
        mc.loss_chunk = t->loss_chunk;
        st = tera_model_create_par(&tr->model, &mc, t->micro_batch, t->seq_len, &par);
        free(first);
    }
    if (st != TERA_OK) goto fail_src;
    if (tr->topo.pp > 1) {
        const tera_pipe_env pe = {.model = &tr->model, .group = tr->groups.pp, .stage = tr->topo.pp_rank,
                                  .stages = tr->topo.pp, .micro_batches = t->grad_accum, .micro_batch = t->micro_batch,
                                  .seq_len = t->seq_len, .schedule = cfg->parallel.pp_schedule,
                                  .load = pipe_load, .plan = pipe_plan, .ctx = tr};
        if ((st = tera_pipe_create(&pe, &tr->pipe)) != TERA_OK) goto fail_model;
    }
    tr->step_sums = tera_calloc((size_t)(5 + (tr->topo.pp > 1 ? 2 * tr->topo.pp : 0)), sizeof(double));
    { /* optimizer ranges: the whole model, or ZeRO shards (include/tera/zero.h) */
        const tera_zero_env ze = {.model = &tr->model, .topo = &tr->topo, .dp = tr->groups.dp, .edp = tr->groups.edp,
                                  .stage = cfg->parallel.zero, .prefetch = cfg->parallel.zero_prefetch,
                                  .planned = tr->topo.pp > 1, .grad_compression = cfg->parallel.grad_compression,
                                  .hierarchical = cfg->parallel.hierarchical,
                                  .bf16_moments = cfg->optimizer.moments, .seed = t->seed}; /* optimizer.moments */
        if ((st = tera_zero_create(&ze, &tr->sharding)) != TERA_OK) goto fail_model;
    }
    if ((st = tera_onebit_init(tr)) != TERA_OK) goto fail_model; /* optimizer.name = onebit_adam (src/train/onebit.c) */
    if (t->init_from[0]) {
        tera_model_config hc = cfg->model;
        st = tera_hf_read_config(t->init_from, &hc);
        if (st != TERA_OK) goto fail_model;
        const char *diff = model_config_diff(&hc, &cfg->model);
        if (diff) {
            st = tera_fail(TERA_ERR_CONFIG,
                           "training.init_from '%s': config.json disagrees with the [model] section on "
                           "model.%s (`tera train` takes the model from config.json when init_from is set)",
                           t->init_from, diff);
            goto fail_model;
        }
        /* a tera checkpoint (manifest.json: whole, differential or sharded) or a Hugging Face
         * directory: each rank reads its own part range by range (no rank holds the whole model) */
        if ((st = tera_trainer_load_dir(tr, t->init_from, 0)) != TERA_OK) goto fail_model;
    } else {
        tera_zero_init_weights(tr->sharding, t->seed);
    }
    tera_spike_init(&tr->spike, t);
    tera_batch_init(&tr->batch);
    {
        const char *f = getenv("TERA_FAULT_SPIKE_SAMPLE"); /* test hook: a batch whose loss and gradients blow up */
        tr->faults.spike_sample = f ? atoll(f) : -1;
        /* test hook: a poisoned batch, "S" (the global batch starting at sample S) or "S:N" samples */
        const char *p = getenv("TERA_FAULT_POISON_SAMPLE");
        if (p) {
            const char *colon = strchr(p, ':');
            tr->loader.poison_lo = atoll(p);
            tr->loader.poison_hi = tr->loader.poison_lo + (colon ? atoll(colon + 1)
                                   : (int64_t)t->micro_batch * t->grad_accum * tr->topo.dp);
            tr->loader.poison_vocab = cfg->model.vocab_size;
        }
    }
    tr->faults.nan_step = -1;
    {
        /* test hook: a NaN in this rank's gradient at step S ("S", every rank, or "S@R", world rank R only;
         * "S:N": steps S .. S+N-1, once each: tera_elastic_fault_nan) */
        const char *f = getenv("TERA_FAULT_NAN_STEP");
        const char *at = f ? strchr(f, '@') : NULL, *colon = f ? strchr(f, ':') : NULL;
        if (f && (!at || atoi(at + 1) == tr->topo.rank)) tr->faults.nan_step = atoll(f);
        if (colon && (!at || colon < at)) tr->faults.nan_n = atoll(colon + 1);
    }
    const size_t bt = (size_t)t->micro_batch * (size_t)t->seq_len;
    tr->tokens = tera_malloc(sizeof(int32_t) * bt);
    tr->targets = tera_malloc(sizeof(int32_t) * bt);
    tr->tokens_per_step = (int64_t)bt * t->grad_accum * tr->topo.dp; /* the global batch */
    tr->flops_per_token = tera_model_flops_per_token(&cfg->model, t->seq_len);
    if (cfg->data.prefetch > 0 && tr->topo.pp == 1 && /* the pipeline reads its micro-batches as it goes */
        (st = tera_prefetch_start(&tr->prefetch, &tr->loader, t->micro_batch, cfg->data.prefetch + 1)) != TERA_OK)
        goto fail_all;

    /* logging.metrics_port: before the run directory is touched, so a port in use leaves nothing behind */
    if ((st = tera_metrics_http_start(&tr->log.http, tr)) != TERA_OK) goto fail_all;
    if ((st = tera_trace_start(&cfg->logging, cfg->model.n_layers, tr->topo.rank, tr->topo.world)) != TERA_OK) goto fail_all;
    if (tr->topo.rank == 0 && (st = tera_tensorboard_open(&tr->log.tb, cfg->logging.tensorboard, tr)) != TERA_OK) goto fail_all;
    /* several ranks: only once every rank's set-up succeeded (tera_trainer_init), so that a run refused
     * on another rank (its metrics port, its trace file) neither creates the run directory nor clears
     * the old run's checkpoints under --force */
    if (tera_comm_size(tera_comm_world()) == 1 && (st = setup_run_dir(tr, overwrite)) != TERA_OK) goto fail_all;
    /* mixed precision (src/train/precision.c): set the model's backend's precision and size its
     * conversion scratch once */
    tr->prec.precision = tera_precision_resolve(tr->model.be, t->precision, &tr->prec.precision_note);
    tr->prec.bf16_gemm = TERA_BF16_NATIVE;
    tr->prec.bf16_gemm_note = "";
    if (tr->prec.precision == TERA_PREC_BF16)
        tr->prec.bf16_gemm = tera_bf16_gemm_resolve(tr->model.be, t->bf16_gemm, &tr->prec.bf16_gemm_note);
    tera_backend_set_precision(tr->model.be, tr->prec.precision, tr->prec.bf16_gemm);
    reserve_scratch(tr);
    /* bf16 weight shadow (backend.h): written by the AdamW update at ZeRO-0 at any grad_accum (measured
     * 4-8% faster steps on bench-s bf16 and 14-27% on bench-m at one micro-batch, docs/PERFORMANCE.md
     * "Wave 7"), rounded lazily elsewhere where at least 4 micro-batches share it; the rule, with its
     * A/B switches (TERA_BF16_SHADOW), is tera_bf16_shadow_on (include/tera/precision.h), which tera
     * plan counts too */
    if (tera_bf16_shadow_on(cfg, tr->sharding->stage, tr->prec.precision, tr->prec.bf16_gemm)) {
        TERA_ASSERTF(tr->model.w && tr->topo.pp == 1, "bf16 shadow without the whole weights resident");
        tera_backend_weights_register(tr->model.be, tr->model.w, tr->model.n_floats);
    }
    tera_scaler_init(&tr->prec.scaler, tr->prec.precision == TERA_PREC_FP16 ? t->loss_scale : 1.0f,
                     t->loss_scaling ? 0 : t->loss_scale_window); /* 0: fixed (training.loss_scaling) */
    if (tr->root && tr->run_dir[0] && cfg->logging.progress) { /* what a save adds to each rank */
        const int64_t snap = tera_ckpt_snapshot_bytes(cfg, tr->model.n_floats);
        if (tera_ckpt_save_is_whole(cfg, &tr->topo))
            fprintf(stderr, "tera: checkpoint memory per rank: snapshot %ld bytes (%s)\n", (long)snap,
                    snap ? "world rank 0's weights, moments and router bias, allocated at the first save that runs in "
                           "the background (checkpoint.async) or widens bf16 moments"
                         : "none: saves are synchronous and write the training state itself");
        else
            fprintf(stderr, "tera: checkpoint memory per rank: writer window %ld bytes (checkpoint.writer_buffer_mb) + "
                    "one %d-byte chunk; saves are streamed, no rank holds the whole model\n",
                    (long)tera_ckpt_writer_buffer_bytes(cfg), TERA_CKPT_CHUNK_BYTES);
    }
    tr->log.t_start = tera_now();
    return TERA_OK;

fail_all:
    tera_metrics_http_stop(tr->log.http);
    tera_tensorboard_close(tr->log.tb);
    tr->log.tb = NULL;
    tera_spike_free(&tr->spike);
    tera_prefetch_stop(tr->prefetch);
    tera_trace_stop(); /* after the prefetcher */
    free(tr->tokens);
    free(tr->targets);
fail_model:
    tera_onebit_free(tr); /* its reducers use the groups */
    tera_zero_destroy(tr->sharding);
    tr->sharding = NULL;
    tera_pipe_destroy(tr->pipe);
    tr->pipe = NULL;
    free(tr->step_sums);
    tr->step_sums = NULL;
    tera_model_destroy(&tr->model);
fail_src:
    tera_groups_free(&tr->groups);
    tera_source_close(&tr->src);
    return st;
}

tera_status tera_trainer_init(tera_trainer *tr, const tera_config *cfg, const char *run_dir, int overwrite) {
    tera_status st = init_local(tr, cfg, run_dir, overwrite);
    tera_comm *w = tera_comm_world();
    if (tera_comm_size(w) == 1) return st;
    /* every rank learns whether every rank is ready (rank 0 alone created the run directory) */
    int64_t failed = st != TERA_OK;
    tera_comm_allreduce_i64(w, &failed, 1);
    if (failed == 0) {
        /* precision = auto: every rank trains in the same precision (fp32 if any rank's CPU has no
         * faster bf16 products); a rank that resolved bf16 drops its bf16 mode and weight shadow */
        if (!strcmp(cfg->training.precision, "auto")) {
            int64_t n_fp32 = tr->prec.precision != TERA_PREC_BF16;
            tera_comm_allreduce_i64(w, &n_fp32, 1);
            if (n_fp32 > 0 && tr->prec.precision == TERA_PREC_BF16) {
                tr->prec.precision = TERA_PREC_FP32;
                tr->prec.precision_note = "fp32 (auto: another rank's CPU has no faster bf16 products)";
                tr->prec.bf16_gemm = TERA_BF16_NATIVE;
                tr->prec.bf16_gemm_note = "";
                tera_backend_weights_register(tr->model.be, NULL, 0);
                tera_backend_set_precision(tr->model.be, TERA_PREC_FP32, TERA_BF16_NATIVE);
            }
        }
        /* bf16 units: every rank runs the same kernels (fma if any rank's probe chose it) */
        if (tr->prec.precision == TERA_PREC_BF16 && !strcmp(cfg->training.bf16_gemm, "auto")) {
            int64_t fma = tr->prec.bf16_gemm == TERA_BF16_FMA;
            tera_comm_allreduce_i64(w, &fma, 1);
            if (fma > 0 && tr->prec.bf16_gemm != TERA_BF16_FMA) {
                tr->prec.bf16_gemm = TERA_BF16_FMA;
                tr->prec.bf16_gemm_note = "fma (auto: chosen by another rank's probe)";
                tera_backend_set_precision(tr->model.be, tr->prec.precision, TERA_BF16_FMA);
                reserve_scratch(tr);
            }
        }
        /* the run directory, now that every rank is ready (rank 0's failure stops every rank) */
        st = setup_run_dir(tr, overwrite);
        int64_t dir_failed = st != TERA_OK;
        tera_comm_allreduce_i64(w, &dir_failed, 1);
        if (dir_failed == 0) return TERA_OK;
        tera_trainer_free(tr);
        return st != TERA_OK ? st : tera_fail(TERA_ERR_IO, "set-up failed on another rank (see its message)");
    }
    if (st == TERA_OK) {
        tera_trainer_free(tr);
        return tera_fail(TERA_ERR_IO, "set-up failed on another rank (see its message)");
    }
    /* the same failure everywhere (a config or data error): rank 0 reports it, the others stay quiet */
    if (failed == tera_comm_size(w) && tera_comm_rank(w) != 0)
        return tera_fail(st, "set-up failed on every rank (see rank 0's message)");
    return st;
}

void tera_trainer_free(tera_trainer *tr) {
    tera_trainer_ckpt_close(tr); /* waits for a background checkpoint write still in flight */
    tera_metrics_http_stop(tr->log.http);
    tera_tensorboard_close(tr->log.tb); /* an error was reported by tera_trainer_run */
    if (tr->log.metrics) fclose(tr->log.metrics);
    if (tr->log.mline) fclose(tr->log.mline); /* the memory stream's buffer stays the caller's */
    free(tr->log.mline_buf);
    tera_prefetch_stop(tr->prefetch);
    tera_trace_stop(); /* after the threads that record into it */
    tera_spike_free(&tr->spike);
    free(tr->tokens);
    free(tr->targets);
    tera_onebit_free(tr); /* its reducers use the groups freed below */
    tera_zero_destroy(tr->sharding);
    tr->sharding = NULL;
    tera_pipe_destroy(tr->pipe);
    tr->pipe = NULL;
    free(tr->step_sums);
    tr->step_sums = NULL;
    tera_model_destroy(&tr->model);
    tera_groups_free(&tr->groups);
    tera_source_close(&tr->src); /* the backend (precision, scratch) went with the model */
    memset(tr, 0, sizeof *tr);
}

tera_status tera_trainer_open_metrics(tera_trainer *tr, const char *mode) {
    if (!tr->run_dir[0] || tr->log.metrics || !tr->root) return TERA_OK;
    char path[TERA_PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/metrics.jsonl", tr->run_dir);
    tr->log.metrics = fopen(path, mode);
    if (!tr->log.metrics) return tera_fail(TERA_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    return TERA_OK;
}


/* Appends one complete line to metrics.jsonl, checked: a failed write (a full disk, a file size
 * limit) is reported once, naming the file and the error; the partial line is cut off again, no
 * more lines are written, and the run ends with an error (tera_trainer_run). */
static void metrics_put(tera_trainer *tr, const char *text, size_t n) {
    if (!tr->log.metrics || tr->log.metrics_errno) return;
    int err = fflush(tr->log.metrics) != 0 ? (errno ? errno : EIO) : 0; /* lines other code wrote through the FILE */
    const int fd = fileno(tr->log.metrics);
    const off_t at = lseek(fd, 0, SEEK_END); /* the end of the last complete line (opened for appending) */
    for (size_t done = 0; !err && done < n;) {
        const ssize_t k = write(fd, text + done, n - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) err = k < 0 ? errno : ENOSPC;
        else done += (size_t)k;
    }
    if (!err) return;
    if (at >= 0 && ftruncate(fd, at) != 0) { /* best effort: --resume also cuts a torn last line */ }
    tr->log.metrics_errno = err;
    fprintf(stderr, "tera: warning: %s/metrics.jsonl: write failed: %s; no more metrics are written (the run goes "
            "on and ends with an error)\n", tr->run_dir, strerror(err));
}

/* A JSON number (null when not finite: JSON has no NaN or infinity). */
static void put_num(FILE *f, const char *fmt, double v) {
    char buf[64];
    fputs(tera_json_num(buf, sizeof buf, fmt, v), f);
}

/* One JSON object per step: the training figures, then health metrics (per-group gradient
 * norms, update/parameter ratio, router entropy and expert load per MoE layer). The line is
 * built in memory and appended whole. */
static void write_metrics(tera_trainer *tr, const tera_step_result *r) {
    const char *const *groups = tera_param_group_names;
    const tera_model *m = &tr->model;
    if (!tr->log.mline) tr->log.mline = open_memstream(&tr->log.mline_buf, &tr->log.mline_len); /* once: no allocation per step */
    FILE *f = tr->log.mline;
    if (!f) return;
    rewind(f);
    const struct {
        const char *key, *fmt;
        double v;
    } nums[] = {
        {"loss", "%.7g", r->loss}, {"ce_loss", "%.7g", r->ce_loss}, {"aux_loss", "%.7g", r->aux_loss},
        {"z_loss", "%.7g", r->z_loss},
        /* what the two router losses added to the loss (coefficient x raw mean) */
        {"aux_loss_weighted", "%.7g", tr->cfg.model.aux_coef * r->aux_loss},
        {"z_loss_weighted", "%.7g", tr->cfg.model.z_coef * r->z_loss},
        {"lr", "%.7g", r->lr}, {"grad_norm", "%.7g", r->grad_norm},
        {"tokens_per_s", "%.1f", (double)(r->batch_seqs * tr->cfg.training.seq_len) / r->seconds},
        {"elapsed_s", "%.3f", tera_now() - tr->log.t_start}, {"step_s", "%.4f", r->seconds},
        {"data_wait_s", "%.6f", r->data_seconds}, {"comm_wait_s", "%.6f", r->comm_seconds},
        {"dropped_frac", "%.5f", r->dropped_frac}, {"model_tflops", "%.6g", 1e-12 * r->model_flops_s},
    };
    fprintf(f, "{\"step\": %ld", (long)r->step);
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        fprintf(f, ", \"%s\": ", nums[i].key);
        put_num(f, nums[i].fmt, nums[i].v);
    }
    if (r->mfu >= 0.0) {
        fprintf(f, ", \"mfu\": ");
        put_num(f, "%.5f", r->mfu);
    }
    for (int w = 0; w < 2 && r->pp > 1 && r->pp_busy_s; w++) /* each pipeline stage's busy / waiting seconds */
        for (int q = 0; q < r->pp; q++) {
            fprintf(f, "%s", q ? ", " : w ? "], \"pp_wait_s\": [" : ", \"pp_busy_s\": [");
            put_num(f, "%.6f", (w ? r->pp_wait_s : r->pp_busy_s)[q]);
            if (w && q == r->pp - 1) fprintf(f, "]");
        }
    fprintf(f, ", \"skipped\": %d, \"skipped_total\": %ld, \"update_ratio\": ", r->skipped, (long)tr->skipped_steps);
    put_num(f, "%.5g", r->update_ratio);
    fprintf(f, ", \"batch\": %ld, \"accum\": %d, \"loss_scale\": ", (long)r->batch_seqs, r->accum);
    put_num(f, "%.17g", r->loss_scale);
    fprintf(f, ", \"grad_norm_by_group\": {");
    double gsq[7] = {0};
    int present[7] = {0};
    for (int i = 0; i < m->n_params; i++) {
        int g = tera_param_group(m->params[i].kind);
        gsq[g] += tr->sharding->grad_sq[i];
        present[g] = 1;
    }
    int first = 1;
    for (int g = 0; g < 7; g++) {
        if (!present[g]) continue;
        fprintf(f, "%s\"%s\": ", first ? "" : ", ", groups[g]);
        put_num(f, "%.5g", sqrt(gsq[g]));
        first = 0;
    }
    if (tr->cfg.logging.hardware) { /* hardware readings (src/obs/hw.c): those the machine exposes */
        fprintf(f, "}, \"hw\": {");
        const tera_hw_reading *hw = tera_hw_latest();
        for (int i = 0; i < hw->n; i++) {
            fprintf(f, "%s\"%s\": ", i ? ", " : "", hw->name[i]);
            put_num(f, "%.6g", hw->value[i]);
        }
    }
    fprintf(f, "}, \"router_entropy\": [");
    const int E = m->cfg.n_experts;
    first = 1;
    for (int l = m->cfg.first_k_dense; l < m->cfg.n_layers; l++) {
        fputs(first ? "" : ", ", f);
        put_num(f, "%.5g", m->routed_tokens ? m->router_entropy[l] / (double)m->routed_tokens : 0.0);
        first = 0;
    }
    fprintf(f, "], \"expert_load_max_over_mean\": [");
    first = 1;
    for (int l = m->cfg.first_k_dense; l < m->cfg.n_layers; l++) {
        int64_t mx = 0, sum = 0;
        for (int e = 0; e < E; e++) {
            int64_t v = m->expert_load[(int64_t)l * E + e];
            sum += v;
            if (v > mx) mx = v;
        }
        fprintf(f, "%s%.4f", first ? "" : ", ", sum ? (double)mx * E / (double)sum : 0.0);
        first = 0;
    }
    fprintf(f, "]}\n");
    if (fflush(f) == 0) metrics_put(tr, tr->log.mline_buf, (size_t)ftello(f)); /* the line just written */
}

/* A spike's update was dropped. Roll back to the newest committed checkpoint when there is one
 * (steps after it replay the same data), skip the batch that caused the spike, and lower the LR to
 * spike_lr_factor x LR until spike_lr_steps steps past the spike: for the replayed steps and the
 * spike_lr_steps steps from the spike's step on (with a rollback the spike's step index is run again
 * on the batch after the skipped one), or, without a rollback, the spike_lr_steps steps after it.
 * Logged to stderr and metrics.jsonl. */
static tera_status handle_spike(tera_trainer *tr, const tera_step_result *r, int64_t sample, int64_t seqs) {
    const tera_train_config *t = &tr->cfg.training;
    const int64_t spike_step = r->step;
    tera_spike_guard *g = &tr->spike;
    int64_t back = -1;
    /* roll back, unless the same step keeps spiking on fresh data (then go on past it) or the
     * table of skipped windows is full */
    if (tera_spike_event(g, spike_step) && tr->run_dir[0]) {
        tera_trainer_ckpt_close(tr); /* a checkpoint still being written is the one to roll back to */
        const int64_t consumed = tr->samples_consumed;
        if (tera_trainer_resume(tr) == TERA_OK) {
            back = tr->step;
            /* the replay would reach this batch again: skip it */
            if (tr->samples_consumed <= sample) tera_spike_add_skip(g, sample, sample + seqs);
        } else {
            tr->samples_consumed = consumed;
        }
    }
    if (back < 0) tr->step = spike_step + 1; /* no rollback: this batch is already consumed */
    /* the first step on the data after the spike's batch, then spike_lr_steps steps in all from it */
    const int64_t cut = (back < 0 ? spike_step + 1 : spike_step) + t->spike_lr_steps;
    tera_spike_cut(g, cut); /* the window refills from healthy steps */
    if (tr->root) {
        fprintf(stderr,
                "tera: loss spike at step %ld (loss %.4f, grad norm %.4g, z %.1f): update dropped, %s, "
                "samples [%ld, %ld) skipped, LR x %.2g until step %ld\n",
                (long)spike_step, r->loss, r->grad_norm, tera_spike_last_z(g),
                back >= 0 ? "rolled back to the newest checkpoint" : "no checkpoint to roll back to", (long)sample,
                (long)(sample + seqs), t->spike_lr_factor, (long)g->lr_cut_until);
        if (back >= 0) fprintf(stderr, "tera: resuming at step %ld\n", (long)back);
        if (tr->log.metrics) {
            fprintf(tr->log.metrics,
                    "{\"step\": %ld, \"event\": \"loss_spike\", \"loss\": %.7g, \"grad_norm\": %.7g, \"z\": %.4g, "
                    "\"rolled_back_to\": %ld, \"skipped_samples\": [%ld, %ld], \"lr_factor\": %.4g, "
                    "\"lr_cut_until\": %ld}\n",
                    (long)spike_step, r->loss, r->grad_norm, tera_spike_last_z(g), (long)back,
                    (long)sample, (long)(sample + seqs), t->spike_lr_factor, (long)g->lr_cut_until);
            fflush(tr->log.metrics);
        }
    }
    return TERA_OK;
}

tera_status tera_trainer_step(tera_trainer *tr, tera_step_result *r) {
    const tera_config *cfg = &tr->cfg;
    const int B = cfg->training.micro_batch, T = cfg->training.seq_len;
    const int A = tera_batch_accum(&cfg->training, &tr->batch, tr->step); /* the dynamic batch size */
    tera_model *m = &tr->model;
    const double t0 = tera_now();
    memset(r, 0, sizeof *r);
    r->step = tr->step;
    const double blocked0 = tera_comm_traffic_get().blocked_s; /* the step's time blocked in communication */
    tera_comm_step_begin(tr->step); /* the watchdog's automatic timeout is measured on steps */
    tera_trace_step_begin(tr->step); /* logging.trace: on inside its window of steps */

    const int64_t seqs = (int64_t)A * B * tr->topo.dp; /* the global batch */
    r->accum = A, r->batch_seqs = seqs;
    const int nmoe = m->n_moe_layers > 0 ? m->n_moe_layers : 1;
    const float ls = tr->prec.scaler.scale; /* fp16's loss scale (1 otherwise) */
    r->loss_scale = ls;
    tera_loss_scales s = {
        .ce = ls / (float)(seqs * T),
        .aux = ls * cfg->model.aux_coef / (float)(nmoe * seqs),
        .z = ls * cfg->model.z_coef / (float)((int64_t)nmoe * seqs * T),
    };
    /* data windows that caused spikes: a batch that would touch one starts after it instead (the
     * batch size of a replay may differ), checked again against every window */
    tr->samples_consumed = tera_spike_next_clean(&tr->spike, tr->samples_consumed, seqs);
    const int64_t step_sample = tr->samples_consumed;
    tera_zero *zr = tr->sharding;
    const int poison = tera_elastic_fault_nan(tr);
    tera_zero_grads_begin(zr, poison); /* the hook's NaN goes into cleared gradients */
    if (poison) { /* test hook (ZeRO-2/3: armed for the first gradient piece summed) */
        tera_zero_poison_grad(zr);
        tr->faults.nan_step = -1;
    }
    const int frozen = tera_onebit_frozen(tr); /* 1-bit Adam past its warm-up: the gradients are not summed */
    tera_model_reset_load(m);
    double ce = 0.0, aux = 0.0, z = 0.0;
    int64_t assign = 0, dropped = 0;
    if (tr->topo.pp > 1) { /* the micro-batches flow through the pipeline's schedule */
        double sm[3] = {0, 0, 0};
        int64_t cn[2] = {0, 0};
        void (*gr)(void *, int64_t, int64_t) = frozen ? NULL : tera_zero_grad_ready(zr, 1);
        tera_pipe_step(tr->pipe, &s, A, sm, cn, &r->data_seconds, gr, zr, zr->stage < 2);
        ce = sm[0], aux = sm[1], z = sm[2], assign = cn[0], dropped = cn[1];
    }
    for (int a = 0; a < A && tr->topo.pp == 1; a++) {
        const int64_t g0 = tera_loader_step_sample(tr->samples_consumed, B, a, tr->topo.dp_rank, tr->topo.dp, 0);
        const int32_t *in = tr->tokens, *tg = tr->targets;
        double dw;
        if (tr->prefetch) {
            dw = tera_prefetch_get(tr->prefetch, g0, &in, &tg);
        } else {
            const double td = tera_now();
            for (int b = 0; b < B; b++)
                tera_loader_train_sample(&tr->loader, g0 + b, tr->tokens + (int64_t)b * T, tr->targets + (int64_t)b * T);
            dw = tera_now() - td;
        }
        r->data_seconds += dw;
        tera_prof_seconds[TERA_PROF_DATA] += dw;
        tera_prof_calls[TERA_PROF_DATA]++;
        const double tf = tera_now();
        tera_trace_event(TERA_TRACE_COMPUTE, "data wait", "data", tf - dw, tf, -1);
        tera_model_arm_fused_loss(m, s.ce); /* the loss gradient in the loss's pass over the logits (model.c) */
        if (a > 0) tera_model_weights_unchanged(m); /* the step's weights: bf16 shadow still valid (backend.h) */
        tera_model_forward(m, in, tg);
        const double tb = tera_now();
        tera_trace_event(TERA_TRACE_COMPUTE, "forward", "model", tf, tb, -1);
        /* stage 0: reduce while the last backward runs; ZeRO-2/3: every micro-batch, group by group */
        m->grad_ready = frozen ? NULL : tera_zero_grad_ready(zr, a == A - 1);
        m->grad_ready_ctx = zr;
        tera_model_backward(m, &s);
        tera_trace_event(TERA_TRACE_COMPUTE, "backward", "model", tb, tera_now(), -1);
        m->grad_ready = NULL;
        ce += m->stats.ce_sum;
        aux += m->stats.aux_sum;
        z += m->stats.z_sum;
        assign += m->stats.n_assign;
        dropped += m->stats.n_dropped;
    }
    tera_zero_grads_end(zr); /* what no backward wrote: zeroed */
    /* gradients: wait for the bucket sums (ZeRO-1: each rank sums only its own shard) */
    if (tr->topo.dp > 1 && !frozen) tera_zero_reduce_grads(zr); /* 1-bit Adam: momentum instead */
    const int pp = tr->topo.pp;
    if (tera_comm_size(tr->groups.sg) > 1) {
        /* statistics: one small sum over the data-parallel ranks of every pipeline stage; with a pipeline
         * also each stage's busy and waiting seconds (its first data-parallel rank's) */
        double *sums = tr->step_sums;
        const int ns = 5 + (pp > 1 ? 2 * pp : 0);
        sums[0] = ce, sums[1] = aux, sums[2] = z, sums[3] = (double)assign, sums[4] = (double)dropped;
        for (int i = 5; i < ns; i++) sums[i] = 0.0;
        if (pp > 1 && tr->topo.dp_rank == 0)
            tera_pipe_last(tr->pipe, &sums[5 + tr->topo.pp_rank], &sums[5 + pp + tr->topo.pp_rank]);
        tera_comm_allreduce_f64(tr->groups.sg, sums, ns);
        ce = sums[0], aux = sums[1], z = sums[2], assign = (int64_t)sums[3], dropped = (int64_t)sums[4];
        const int64_t LE = (int64_t)cfg->model.n_layers * cfg->model.n_experts;
        tera_comm_allreduce_i64(tr->groups.sg, m->expert_load, LE);
        tera_comm_allreduce_f64(tr->groups.sg, m->router_entropy, cfg->model.n_layers);
        tera_comm_allreduce_i64(tr->groups.sg, &m->routed_tokens, 1);
    }
    r->pp = pp;
    r->pp_busy_s = pp > 1 ? tr->step_sums + 5 : NULL; /* (sg spans the stages whenever pp > 1) */
    r->pp_wait_s = pp > 1 ? tr->step_sums + 5 + pp : NULL;
    r->ce_loss = ce / (double)(seqs * T);
    r->aux_loss = m->n_moe_layers ? aux / (double)(nmoe * seqs) : 0.0;
    r->z_loss = m->n_moe_layers ? z / (double)((int64_t)nmoe * seqs * T) : 0.0;
    r->loss = r->ce_loss + cfg->model.aux_coef * r->aux_loss + cfg->model.z_coef * r->z_loss;
    r->dropped_frac = assign ? (double)dropped / (double)assign : 0.0;
    r->lr = tera_lr_at(&cfg->training, tr->step) * tera_batch_lr_factor(&cfg->training, A);
    if (tr->step < tr->spike.lr_cut_until) r->lr *= cfg->training.spike_lr_factor;

    double t_opt = tera_now();
    r->grad_norm = sqrt(tera_onebit_frozen(tr) ? tera_onebit_grad_sq(tr) /* unsummed: src/train/onebit.h */
                                               : tera_zero_grad_sq(zr)); /* of the whole model, from every rank's part */
    if (ls != 1.0f) { /* unscale the norms; the gradients themselves are unscaled in the update below */
        r->grad_norm /= ls;
        for (int i = 0; i < m->n_params; i++) zr->grad_sq[i] /= (double)ls * ls;
    }
    if (step_sample == tr->faults.spike_sample) { /* test hook: a gradient blow-up on this batch */
        tera_zero_grad_scale(zr, 100.0f);
        r->grad_norm *= 100.0;
        r->loss *= 10.0;
    }
    if (isfinite(r->loss) && isfinite(r->grad_norm)) r->spike = tera_spike_check(&tr->spike, r->loss, r->grad_norm);
    if (tr->prec.precision == TERA_PREC_FP16) tera_scaler_update(&tr->prec.scaler, isfinite(r->grad_norm));
    if (!isfinite(r->loss) || !isfinite(r->grad_norm)) {
        r->skipped = 1; /* the data position still advances with the step counter (fp16: scale halved) */
        tr->skipped_steps++;
    } else if (r->spike) {
        r->skipped = 1; /* handled after the bookkeeping below: roll back, skip the batch, lower the LR */
    } else {
        const float c = cfg->training.grad_clip;
        const float scale = c > 0.0f && r->grad_norm > c ? c / (float)(r->grad_norm + 1e-6) : 1.0f;
        double sums[2];
        if (tr->onebit) tera_onebit_step(tr, r->lr, scale / ls, sums); /* optimizer.name = onebit_adam */
        else tera_zero_adamw_step(zr, r->lr, scale / ls, &cfg->optimizer, sums);
        r->update_ratio = sums[1] > 0 ? sqrt(sums[0] / sums[1]) : 0.0;
        tera_model_update_router_bias(m);
    }
    tera_prof_seconds[TERA_PROF_OPTIM] += tera_now() - t_opt;
    tera_prof_calls[TERA_PROF_OPTIM]++;
    tera_trace_event(TERA_TRACE_COMPUTE, "optimizer", "optimizer", t_opt, tera_now(), -1);
    tr->step++;
    tr->samples_consumed += seqs;
    r->seconds = tera_now() - t0;
    /* model FLOPs (tera_model_flops_per_token: no recomputation counted) of the job's tokens this step */
    r->model_flops_s = tr->flops_per_token * (double)(seqs * T) / r->seconds;
    r->mfu = cfg->logging.peak_tflops > 0.0f ? r->model_flops_s / (1e12 * cfg->logging.peak_tflops * tr->topo.world) : -1.0;
    r->comm_seconds = tera_comm_traffic_get().blocked_s - blocked0;
    if (r->comm_seconds < 0.0) r->comm_seconds = 0.0; /* the counters were reset during the step */
    tera_comm_step_end(r->seconds);
    tera_trace_event(TERA_TRACE_COMPUTE, "step", "step", t0, t0 + r->seconds, -1);

    if (tera_trainer_open_metrics(tr, "a") != TERA_OK) return TERA_ERR_IO;
    if (tr->log.http || tr->log.tb || (tr->log.metrics && tr->cfg.logging.hardware))
        tera_hw_sample(1.0); /* hardware readings (src/obs/hw.c), at most once a second */
    if (tr->log.metrics) write_metrics(tr, r);
    tera_metrics_http_publish(tr->log.http, tr, r); /* every rank: its /metrics endpoint (no-op when off) */
    tera_tensorboard_step(tr->log.tb, tr, r);       /* logging.tensorboard (world rank 0; no-op when off) */
    tera_trainer_batch_observe(tr, r);
    if (r->spike) return handle_spike(tr, r, step_sample, seqs);
    return TERA_OK;
}

tera_status tera_trainer_eval(tera_trainer *tr, int batches, double *loss) {
    return tera_trainer_eval_acc(tr, batches, loss, NULL);
}

tera_status tera_trainer_eval_acc(tera_trainer *tr, int batches, double *loss, double *acc) {
    return tera_trainer_eval_dataset(tr, -1, batches, loss, acc);
}

/* evaluation's next-token accuracy: the correct predictions of each block of logits the head computes
 * (tera_model.on_logits; the ranks holding the head, tensor-parallel ranks together) */
typedef struct {
    const tera_model *m;
    struct tera_comm *tp;
    float *scratch; /* [2 B T] */
    int64_t correct;
} acc_count;

static void count_logits(void *ctx, const float *logits, const int32_t *targets, int64_t n) {
    acc_count *ac = ctx;
    ac->correct += tera_count_correct(logits, targets, n, ac->m->Vl, ac->m->v0, ac->tp, ac->scratch);
}

tera_status tera_trainer_eval_dataset(tera_trainer *tr, int dataset, int batches, double *loss, double *acc) {
    const tera_config *cfg = &tr->cfg;
    const int B = cfg->training.micro_batch, T = cfg->training.seq_len;
    tera_model *m = &tr->model;
    double sums[3] = {0.0, 0.0, 0.0}; /* cross-entropy, positions, correct next-token predictions */
    acc_count ac = {.m = m, .tp = tr->groups.tp,
                    .scratch = acc ? tera_calloc((size_t)2 * B * T, sizeof(float)) : NULL}; /* once per evaluation */
    if (acc) m->on_logits = count_logits, m->on_logits_ctx = &ac;
    /* the batches are shared out over the ranks; where a forward communicates over the
     * data-parallel ranks (the expert exchange, ZeRO-3's parameter gathers) every rank must run as
     * many forwards as the others (a rank past the end evaluates batch 0 again and does not count it) */
    const int rounds = tr->topo.ep > 1 || tr->sharding->stage >= 3 ? (batches + tr->topo.dp - 1) / tr->topo.dp : 0;
    for (int j = 0, i = tr->topo.dp_rank; i < batches || j < rounds; j++, i += tr->topo.dp) {
        const int counted = i < batches;
        for (int b = 0; b < B; b++) {
            int64_t v = (int64_t)(counted ? i : 0) * B + b;
            int32_t *in = tr->tokens + (int64_t)b * T, *tg = tr->targets + (int64_t)b * T;
            if (dataset >= 0) /* one dataset of a blend (data.paths) */
                tera_loader_val_sample_of(&tr->loader, dataset, v, in, tg);
            else if (tr->loader.n_val > 0)
                tera_loader_val_sample(&tr->loader, v, in, tg);
            else /* no split (data.val_fraction = 0): the whole dataset is evaluation data */
                tera_loader_train_sample(&tr->loader, v, in, tg);
        }
        double ce, pos;
        if (tr->topo.pp > 1) { /* through the pipeline's stages in turn; the last stage has the loss */
            ce = tera_pipe_eval(tr->pipe, tr->tokens, tr->targets, &pos);
        } else {
            tera_model_forward(m, tr->tokens, tr->targets);
            ce = m->stats.ce_sum, pos = (double)m->stats.n_positions;
        }
        if (!counted) {
            ac.correct = 0;
            continue;
        }
        sums[0] += ce;
        sums[1] += pos;
        sums[2] += (double)ac.correct;
        ac.correct = 0;
    }
    m->on_logits = NULL, m->on_logits_ctx = NULL;
    free(ac.scratch);
    tera_comm_allreduce_f64(tr->groups.sg, sums, 3);
    *loss = sums[1] > 0 ? sums[0] / sums[1] : NAN;
    if (acc) *acc = sums[1] > 0 ? sums[2] / sums[1] : NAN;
    return TERA_OK;
}

/* ------------------------------------------------------------------ the run */

static void fmt_eta(char *buf, size_t n, double sec) {
    if (!isfinite(sec) || sec < 0) sec = 0;
    long s = (long)(sec + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
}

/* The run's newest committed checkpoint restored (tera_trainer_resume_dir, src/train/checkpoint.c),
 * then the run directory prepared for appending. */
tera_status tera_trainer_resume(tera_trainer *tr) {
    char dir[TERA_PATH_MAX + 64], path[TERA_PATH_MAX + 64];
    /* every rank looks for the newest checkpoint only once world rank 0's background part of the
     * last save is done (its caller waited for it: tera_trainer_ckpt_close), so all find the same */
    if (tr->topo.world > 1) tera_comm_barrier(tera_comm_world());
    TERA_TRY(tera_ckpt_find_latest(tr->run_dir, dir, sizeof dir));
    TERA_TRY(tera_trainer_resume_dir(tr, dir));
    TERA_TRY(tera_comm_state_load(tr)); /* per-rank error feedback, 1-bit Adam's freeze (src/train/onebit.c) */
    /* every check passed: only now is the run directory written (a refused --resume leaves it as
     * it was): the configuration of the continued run, and metrics.jsonl cut back to its last
     * complete line (a crash or a full disk can leave half a line) before appending */
    tera_status st = TERA_OK;
    if (tr->root) {
        st = tera_ckpt_write_run_config(&tr->cfg, tr->run_dir);
        long dropped = 0;
        snprintf(path, sizeof path, "%s/metrics.jsonl", tr->run_dir);
        if (st == TERA_OK) st = tera_jsonl_repair(path, &dropped);
        if (st == TERA_OK && dropped > 0)
            fprintf(stderr, "tera: warning: %s: removed an incomplete last line (%ld bytes) before appending\n", path,
                    dropped);
        if (st == TERA_OK) st = tera_trainer_open_metrics(tr, "a");
    }
    if (tr->topo.world > 1) { /* every rank learns whether rank 0 could write */
        int64_t failed = st != TERA_OK;
        tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
        if (failed && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "--resume: writing the run directory failed on rank 0");
    }
    return st;
}

/* Rank 0 writes the checkpoint (data-parallel ranks hold the same state); every rank learns
 * whether it worked, so a failure stops all of them instead of leaving some in a collective. */
static tera_status save_checkpoint(tera_trainer *tr) {
    if (tr->cfg.checkpoint.sharded && tr->topo.world > 1) return tera_trainer_save_sharded(tr);
    if (tr->topo.world == 1) return tera_trainer_save_whole(tr); /* its storage is the whole model */
    if (tera_ckpt_save_is_whole(&tr->cfg, &tr->topo)) {
        /* data-parallel replicas without ZeRO: world rank 0's own storage is the whole model, so it
         * snapshots and writes as one process does (its double buffer, in the background); the
         * others only learn whether it worked */
        tera_status st = tr->root ? tera_trainer_save_whole(tr) : TERA_OK;
        int64_t failed = st != TERA_OK;
        tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
        if (failed && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "checkpoint failed on rank 0 (see its message)");
        return st;
    }
    /* several ranks: the whole model is streamed window by window to world rank 0, which writes
     * it; every rank learns whether it worked (no rank holds the whole model) */
    return tera_trainer_save_streamed(tr);
}

/* The communication state, the checkpoint, then the communication state of removed checkpoints. */
tera_status tera_trainer_save(tera_trainer *tr) {
    if (!tr->run_dir[0]) return TERA_OK; /* the same on every rank */
    tera_loader_sync(&tr->loader, tr->groups.dp, tr->samples_consumed); /* streamed data: every dp rank's position */
    TERA_TRY(tera_comm_state_save(tr)); /* per-rank error feedback, 1-bit Adam's freeze (src/train/onebit.c) */
    const tera_status st = save_checkpoint(tr);
    if (st == TERA_OK) tera_comm_state_prune(tr); /* the files of checkpoints retention removed */
    return st;
}

/* Each rank's peak resident memory so far (getrusage), gathered to world rank 0, which prints the
 * maximum, the rank holding it and every rank's figure (field names: tests read them). */
static void report_peak_rss(tera_trainer *tr) {
    struct rusage ru;
    memset(&ru, 0, sizeof ru);
    getrusage(RUSAGE_SELF, &ru);
    int64_t *kib = tera_calloc((size_t)tr->topo.world, sizeof(int64_t));
    kib[tr->topo.rank] = (int64_t)ru.ru_maxrss; /* KiB on Linux */
    if (tr->topo.world > 1) tera_comm_allreduce_i64(tera_comm_world(), kib, tr->topo.world);
    int at = 0;
    for (int r = 1; r < tr->topo.world; r++)
        if (kib[r] > kib[at]) at = r;
    if (tr->root && tr->cfg.logging.progress) {
        char line[8192];
        int n = snprintf(line, sizeof line, "tera: memory: peak_rss_mib %.1f peak_rss_rank %d ranks %d peak_rss_mib_by_rank",
                         (double)kib[at] / 1024.0, at, tr->topo.world);
        for (int r = 0; r < tr->topo.world && n < (int)sizeof line - 32; r++)
            n += snprintf(line + n, sizeof line - (size_t)n, "%s%.1f", r ? "," : " ", (double)kib[r] / 1024.0);
        fprintf(stderr, "%s\n", line);
    }
    if (tr->root && tr->log.metrics) { /* the same as a metrics.jsonl event */
        char *line = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&line, &len);
        if (f) {
            fprintf(f, "{\"step\": %ld, \"event\": \"memory\", \"peak_rss_mib\": %.1f, \"peak_rss_rank\": %d, "
                    "\"peak_rss_mib_by_rank\": [", (long)tr->step - 1, (double)kib[at] / 1024.0, at);
            for (int r = 0; r < tr->topo.world; r++) fprintf(f, "%s%.1f", r ? ", " : "", (double)kib[r] / 1024.0);
            fprintf(f, "]}\n");
            if (fclose(f) == 0) metrics_put(tr, line, len);
            free(line);
        }
    }
    free(kib);
}

tera_status tera_trainer_run(tera_trainer *tr, tera_step_result *last) {
    const tera_config *cfg = &tr->cfg;
    const int64_t S = cfg->training.steps;
    const int tty = isatty(2);
    double tok_s_ema = 0.0;
    tera_step_result r = {0};
    int64_t n_steps = 0, n_nonfinite = 0; /* steps run by this call, and those skipped as not finite */
    tera_heartbeat_beat(tr->topo.rank, tr->step, "ready"); /* tera launch's supervisor (src/elastic/heartbeat.c) */
    while (tr->step < S) {
        TERA_TRY(tera_trainer_step(tr, &r));
        n_steps++;
        n_nonfinite += r.skipped && !r.spike;
        double tps = (double)(r.batch_seqs * cfg->training.seq_len) / r.seconds; /* the step's actual batch */
        tok_s_ema = tok_s_ema == 0.0 ? tps : 0.9 * tok_s_ema + 0.1 * tps;
        const int log_now = cfg->logging.log_every > 0 &&
                            (tr->step % cfg->logging.log_every == 0 || tr->step == S || tr->step == 1);
        if (tr->root && cfg->logging.progress && (log_now || tty)) {
            char eta[32];
            const int64_t step_tokens = r.batch_seqs * cfg->training.seq_len > tr->tokens_per_step
                                         ? r.batch_seqs * cfg->training.seq_len : tr->tokens_per_step; /* grown or full */
            fmt_eta(eta, sizeof eta, (double)(S - tr->step) * step_tokens / tok_s_ema);
            char ls[48] = "", mfu[32] = "";
            if (tr->prec.precision == TERA_PREC_FP16) snprintf(ls, sizeof ls, " | scale %g", r.loss_scale);
            if (r.mfu >= 0.0) /* of the smoothed rate, as tok/s */
                snprintf(mfu, sizeof mfu, " | MFU %.1f%%", 100.0 * r.mfu * tok_s_ema / tps);
            fprintf(stderr, "%sstep %6ld/%ld | loss %.4f | aux %.4f | lr %.2e | gnorm %.3f%s | %8.0f tok/s%s | ETA %s%s%s",
                    tty ? "\r" : "", (long)tr->step, (long)S, r.loss, r.aux_loss, r.lr, r.grad_norm, ls, tok_s_ema, mfu,
                    eta, r.skipped && !r.spike ? " | SKIPPED (non-finite)" : "", (log_now || !tty) ? "\n" : "");
            fflush(stderr);
        }
        if (tr->root && r.skipped && !r.spike) { /* every non-finite skip is reported, logged or not */
            char ls[64] = "";
            if (tr->prec.precision == TERA_PREC_FP16) snprintf(ls, sizeof ls, "; fp16 loss scale now %g", tr->prec.scaler.scale);
            fprintf(stderr, "%stera: step %ld: %s not finite (loss %g, grad norm %g): update skipped on every rank, %ld "
                    "skipped so far%s\n", tty ? "\n" : "", (long)r.step, isfinite(r.loss) ? "gradient" : "loss",
                    r.loss, r.grad_norm, (long)tr->skipped_steps, ls);
        }
        if (cfg->training.eval_every > 0 && tr->step % cfg->training.eval_every == 0) {
            double vl, va;
            TERA_TRY(tera_trainer_eval_acc(tr, cfg->training.eval_batches, &vl, &va));
            if (tr->root) fprintf(stderr, "step %6ld | validation loss %.4f\n", (long)tr->step, vl);
            tera_metrics_http_publish_eval(tr->log.http, tr->step - 1, vl);
            tera_tensorboard_eval(tr->log.tb, tr->step - 1, vl);
            char line[16384]; /* val_loss, val_ppl, val_acc (+ each blended dataset's: collective) */
            size_t n;
            TERA_TRY(tera_trainer_eval_line(tr, tr->step - 1, vl, va, line, sizeof line, &n));
            if (tr->log.metrics) metrics_put(tr, line, n);
        }
        TERA_TRY(tera_sample_hook(tr)); /* logging.sample_every (src/train/sample.c) */
        TERA_TRY(tera_elastic_after_step(tr, &r)); /* training.nan_rollback_after (src/elastic/rank.c) */
        if (cfg->training.stop_at_step > 0 && tr->step == cfg->training.stop_at_step) break; /* saved below */
        const int due_s = tera_elastic_ckpt_due(tr); /* checkpoint.every_s, full_every_s: 1 save, 2 full */
        if (((cfg->checkpoint.every > 0 && tr->step % cfg->checkpoint.every == 0) || due_s) && tr->step < S) {
            const double tc = tera_now();
            tr->ckpt.force_full = due_s == 2;
            TERA_TRY(tera_trainer_save(tr));
            tera_elastic_ckpt_saved(tr);
            tera_trace_event(TERA_TRACE_COMPUTE, "checkpoint save (pause)", "checkpoint", tc, tera_now(), -1);
        }
        tera_heartbeat_beat(tr->topo.rank, tr->step, "step");
    }
    /* nothing trained is a failure, not a result (the same decision on every rank: the skips are global) */
    if (n_steps > 0 && n_nonfinite == n_steps)
        return tera_fail(TERA_ERR_NUMERIC, "all %ld steps were skipped because the loss or the gradient was not finite: "
                         "nothing was trained (check training.init_from's weights, training.lr and the data)",
                         (long)n_steps);
    if (tr->run_dir[0]) {
        tr->ckpt.last = 1;
        const tera_status sv = tera_trainer_save(tr);
        tr->ckpt.last = 0;
        TERA_TRY(sv);
    }
    tera_heartbeat_beat(tr->topo.rank, tr->step, "done");
    report_peak_rss(tr);
    TERA_TRY(tera_trace_finish(tera_comm_world())); /* logging.trace: every rank's part, merged by rank 0 */
    if (tr->log.tb) {
        tera_status tst = tera_tensorboard_close(tr->log.tb);
        tr->log.tb = NULL;
        TERA_TRY(tst);
    }
    if (last) *last = r;
    if (tr->log.metrics && !tr->log.metrics_errno && fflush(tr->log.metrics) != 0) tr->log.metrics_errno = errno ? errno : EIO;
    if (tr->log.metrics_errno)
        return tera_fail(TERA_ERR_IO, "%s/metrics.jsonl is incomplete (%s: see the warning above); the checkpoints "
                         "are complete", tr->run_dir, strerror(tr->log.metrics_errno));
    return TERA_OK;
}
