/* tera train / tera eval */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/comm.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/registry.h"
#include "tera/train.h"
#include "tera/zero.h"

static void print_summary(const tera_trainer *tr) {
    const tera_config *c = &tr->cfg;
    const tera_model *m = &tr->model;
    const double MiB = 1024.0 * 1024.0;
    char data_note[128]; /* a streamed source has no token count: its shards are read during training */
    if (tr->src.kind == TERA_SRC_STREAM)
        snprintf(data_note, sizeof data_note, "streamed: tokenized during training, T=%d", c->training.seq_len);
    else
        snprintf(data_note, sizeof data_note, "%ld tokens, %ld train / %ld val samples of T=%d", (long)tr->src.n_tokens,
                 (long)tr->loader.n_train, (long)tr->loader.n_val, c->training.seq_len);
    fprintf(stderr,
            "tera: model %.2fM params (%.2fM active/token), L=%d D=%d H=%d/%d E=%d k=%d F=%d V=%d | %s\n"
            "tera: data %s (%s) | batch %d x %d x accum %d x dp %d = %ld tokens/step | %d threads\n"
            "tera: memory MiB per rank: params %.1f, grads %.1f, optimizer %.1f, activations %.1f (recompute %s), scratch %.1f\n"
            "tera: precision %s%s%s\n",
            tera_model_total_params(&c->model) / 1e6, tera_model_active_params(&c->model) / 1e6,
            c->model.n_layers, c->model.dim, c->model.n_heads, c->model.n_kv_heads, c->model.n_experts,
            c->model.top_k, c->model.ffn_dim, c->model.vocab_size,
            c->model.capacity_factor > 0 ? "capacity" : "dropless",
            c->data.path[0] ? c->data.path : "embedded default corpus", data_note, c->training.micro_batch,
            c->training.seq_len, c->training.grad_accum, tr->topo.dp, (long)tr->tokens_per_step, tera_get_threads(),
            m->bytes_params / MiB, m->bytes_grads / MiB, (double)tera_zero_optimizer_bytes(tr->sharding) / MiB, m->bytes_acts / MiB,
            c->training.recompute, m->bytes_scratch / MiB, tr->prec.precision_note,
            tr->prec.bf16_gemm_note[0] ? " | bf16 products: " : "", tr->prec.bf16_gemm_note);
    tera_cli_wait_policy_note("tera", tera_get_threads());
    tera_data_report(&tr->loader, stderr); /* a blend's datasets, online tokenization's throughput */
    const tera_train_config *t = &c->training;
    static const char *const rules[] = {"sqrt", "linear", "none"};
    if (t->batch_rampup_start > 0 && t->batch_rampup_steps > 0 && t->batch_rampup_start < t->grad_accum)
        fprintf(stderr, "tera: batch ramp-up: accum %d -> %d over %d steps, LR rule %s\n", t->batch_rampup_start,
                t->grad_accum, t->batch_rampup_steps, rules[t->batch_lr_scaling]);
    if (t->batch_grow_gnorm > 0)
        fprintf(stderr, "tera: batch growth: accum x 2 (up to %d) when the mean grad norm of %d steps exceeds %g, "
                "LR rule %s; accum now %d\n", t->batch_grow_max ? t->batch_grow_max : 4 * t->grad_accum,
                t->batch_grow_window, (double)t->batch_grow_gnorm, rules[t->batch_lr_scaling],
                tera_batch_accum(t, &tr->batch, tr->step));
    /* exact figures by category (tests compare them with the formulas of docs/PARALLELISM.md) */
    const int64_t ea = m->bytes_comm_acts; /* the exchange buffers inside the activations */
    int64_t rep = 0, split = 0, expert = 0; /* elements held, by how they are divided among ranks */
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        if (p->expert_stacked)
            expert += p->numel;
        else if (p->tp_dim >= 0)
            split += p->numel;
        else
            rep += p->numel;
    }
    fprintf(stderr, "tera: parameters on this rank: replicated %ld, tensor-parallel %ld, expert %ld elements\n",
            (long)rep, (long)split, (long)expert);
    fprintf(stderr,
            "tera: memory bytes per rank: params %ld (non-expert %ld floats + expert %ld floats) grads %ld optimizer %ld "
            "activations %ld scratch %ld comm %ld\n",
            (long)m->bytes_params, (long)m->n_dense_floats, (long)(m->n_floats - m->n_dense_floats), (long)m->bytes_grads,
            (long)tera_zero_optimizer_bytes(tr->sharding), (long)(m->bytes_acts - ea),
            (long)(m->bytes_scratch - (m->bytes_comm - ea)), (long)(m->bytes_comm + tr->sharding->bytes_staging));
    if (tera_backend_weights_shadow_bytes(m->be) > 0) /* bf16 on the native units (include/tera/backend.h) */
        fprintf(stderr, "tera: bf16 weight shadow %ld bytes per rank (2 per resident parameter, beside the figures "
                "above; TERA_BF16_SHADOW=0: none)\n", (long)tera_backend_weights_shadow_bytes(m->be));
}

/* The run directory's lock (rank 0 takes it, before anything in the directory is touched; every
 * rank learns whether it got it, so a refused start ends on every rank instead of hanging). */
static tera_status lock_run_dir(tera_run_lock *lock, const char *run_dir) {
    tera_comm *w = tera_comm_world();
    const int root = tera_comm_rank(w) == 0;
    lock->fd = -1;
    lock->created_dir = 0;
    tera_status st = root && run_dir[0] ? tera_run_lock_acquire(lock, run_dir) : TERA_OK;
    if (tera_comm_size(w) == 1) return st;
    int64_t failed = st != TERA_OK;
    tera_comm_allreduce_i64(w, &failed, 1);
    if (failed && st == TERA_OK) st = tera_fail(TERA_ERR_EXISTS, "the run directory could not be locked on rank 0 "
                                                "(see rank 0's message)");
    return st;
}

static int train_main(int argc, char **argv, tera_run_lock *lock);

int tera_cmd_train(int argc, char **argv) {
    tera_track_signals_init(); /* before any thread of the run */
    tera_run_lock lock = {.fd = -1};
    const int rc = train_main(argc, argv, &lock);
    tera_run_lock_release(&lock);
    return rc;
}

static int train_main(int argc, char **argv, tera_run_lock *lock) {
    tera_config cfg;
    static const char *const flags[] = {"force", "resume", NULL};
    int set[2] = {0, 0};
    if (tera_cli_parse(argc, argv, &cfg, flags, set, NULL, NULL)) return 1;
    if (cfg.training.init_from[0]) {
        if (tera_config_from_hf(&cfg, cfg.training.init_from) != TERA_OK) return tera_cli_error();
        if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
        if (tera_comm_rank(tera_comm_world()) == 0)
            fprintf(stderr, "tera: model configuration and weights from %s\n", cfg.training.init_from);
    }
    /* a layout that cannot fit the host is refused before anything is allocated or created */
    if (tera_train_memory_check(&cfg) != TERA_OK) return tera_cli_error();
    /* one process at a time in a run directory (also --force and --resume while a run is live) */
    if (lock_run_dir(lock, cfg.logging.run_dir) != TERA_OK) return tera_cli_error();
    tera_trainer tr;
    const int mode = set[1] ? TERA_RUN_CONTINUE : (set[0] ? TERA_RUN_FRESH : 0);
    if (tera_trainer_init(&tr, &cfg, cfg.logging.run_dir, mode) != TERA_OK) return tera_cli_error();
    if (set[1]) {
        if (tera_trainer_resume(&tr) != TERA_OK) {
            tera_trainer_free(&tr);
            return tera_cli_error();
        }
        if (tr.root) fprintf(stderr, "tera: resumed %s at step %ld\n", cfg.logging.run_dir, (long)tr.step);
    }
    if (tr.root) {
        print_summary(&tr);
        fprintf(stderr, "tera: run directory %s | %d data-parallel rank%s (%s)\n", cfg.logging.run_dir, tr.topo.dp,
                tr.topo.dp == 1 ? "" : "s", tera_comm_backend());
        if (tr.topo.world > 1)
            fprintf(stderr,
                    "tera: layout %d ranks = pp %d x dp %d x tp %d, dp %d = edp %d x ep %d, ZeRO %d; world rank = "
                    "(pp_rank * dp + dp_rank) * tp + tp_rank, dp_rank = edp_rank * ep + ep_rank (tp varies fastest, "
                    "pp slowest); ep rank r holds experts [r*%d, (r+1)*%d) of each MoE layer\n",
                    tr.topo.world, tr.topo.pp, tr.topo.dp, tr.topo.tp, tr.topo.dp, tr.topo.edp, tr.topo.ep, tr.sharding->stage ? cfg.parallel.zero : 0,
                    cfg.model.n_experts / tr.topo.ep, cfg.model.n_experts / tr.topo.ep);
    }
    if (tr.topo.pp > 1 && tr.topo.dp_rank == 0 && tr.topo.tp_rank == 0) { /* one line per pipeline stage */
        const tera_model *m = &tr.model;
        char layers[256] = "";
        for (int vs = tr.topo.pp_rank; vs < tr.topo.pp * m->par.v; vs += tr.topo.pp) {
            const size_t k = strlen(layers);
            snprintf(layers + k, sizeof layers - k, "%s[%d, %d)", k ? " " : "", m->layer_first[vs], m->layer_first[vs + 1]);
        }
        const char *head = tr.topo.pp_rank == tr.topo.pp - 1 ? (m->hs ? " + head (vocabulary rows [V/2, V) in training: head split)" : " + head")
                           : m->hs ? " + head split: vocabulary rows [0, V/2) in training" : "";
        fprintf(stderr, "tera: pipeline stage %d of %d (%s): layers %s%s%s, %d activation slot%s, activations %.1f MiB\n",
                tr.topo.pp_rank, tr.topo.pp, cfg.parallel.pp_schedule, layers, tr.topo.pp_rank == 0 ? " + embedding" : "",
                head, m->n_slots, m->n_slots == 1 ? "" : "s", (double)m->bytes_acts / (1024.0 * 1024.0));
    }
    tera_prof_reset();
    int64_t step0 = tr.step;
    if (step0 >= cfg.training.steps) { /* a resumed run that had already finished */
        if (tr.root)
            fprintf(stderr, "tera: nothing to train: %s is already at step %ld and training.steps = %ld (raise "
                    "training.steps to train on); its newest checkpoint is unchanged\n", cfg.logging.run_dir,
                    (long)step0, (long)cfg.training.steps);
        tera_status st = tera_trainer_ckpt_close(&tr);
        tera_trainer_free(&tr);
        return st == TERA_OK ? 0 : tera_cli_error();
    }
    /* the run registry and MLflow (logging.registry, logging.mlflow_uri; world rank 0; never stops training) */
    tera_track *track = tr.root ? tera_track_start(&cfg, argc, argv, step0, tr.topo.world) : NULL;
    tera_step_result last;
    tera_status st = tera_trainer_run(&tr, &last);
    if (st != TERA_OK) {
        tera_track_end(track, "failed", tera_last_error());
        tera_trainer_free(&tr);
        return tera_cli_error();
    }
    if (cfg.logging.profile && tr.root) tera_prof_print(stderr, (int)(tr.step - step0));
    if (tr.topo.pp > 1 && tr.topo.dp_rank == 0 && tr.topo.tp_rank == 0) { /* the measured bubble of each stage */
        double busy, wait, step;
        tera_pipe_times(tr.pipe, &busy, &wait, &step);
        const int m = cfg.training.grad_accum, p = tr.topo.pp, v = cfg.parallel.pp_chunks;
        fprintf(stderr, "tera: pipeline stage %d: step %.1f ms, busy %.1f ms, waiting %.1f ms: idle fraction %.3f "
                "(bubble formula %.3f)\n", tr.topo.pp_rank, 1e3 * step, 1e3 * busy, 1e3 * wait,
                step > 0 ? 1.0 - busy / step : 0.0, (double)(p - 1) / (v * m + p - 1));
        double dw_waits, dw_end; /* parallel.pp_defer_wgrad: within busy */
        int64_t n_waits, n_end;
        tera_pipe_deferred(tr.pipe, &dw_waits, &dw_end, &n_waits, &n_end);
        if (n_waits + n_end > 0)
            fprintf(stderr, "tera: pipeline stage %d: deferred head weight gradients: %ld in waits, %ld at steps' ends "
                    "(%.2f ms a step)\n", tr.topo.pp_rank, (long)n_waits, (long)n_end, 1e3 * (dw_waits + dw_end));
    }
    if (tr.sharding->stage >= 3 && tr.root) {
        int64_t g, pf, un, sh;
        tera_zero_counts(tr.sharding, &g, &pf, &un, &sh);
        fprintf(stderr, "tera: ZeRO-3 layer gathers: %ld, %ld of them prefetched while the previous layer computed "
                "(parallel.zero_prefetch = %d), %ld prefetches unused, %ld in host-shared memory\n", (long)g, (long)pf,
                cfg.parallel.zero_prefetch, (long)un, (long)sh);
    }
    if (tr.root && cfg.logging.run_dir[0])
        fprintf(stderr, "tera: done: %ld steps, final loss %.4f, checkpoint in %s/checkpoints/step_%08ld\n",
            (long)tr.step, last.loss, cfg.logging.run_dir, (long)tr.step);
    else if (tr.root) /* logging.run_dir = "": nothing was written */
        fprintf(stderr, "tera: done: %ld steps, final loss %.4f (logging.run_dir is empty: nothing was saved)\n",
                (long)tr.step, last.loss);
    tera_track_end(track, "finished", NULL);
    tera_trainer_free(&tr);
    return 0;
}

int tera_cmd_eval(int argc, char **argv) {
    for (int i = 0; i < argc; i++) /* multiple-choice / cloze tasks: src/cli/cmd_evaltask.c */
        if (!strncmp(argv[i], "--task", 6) && (argv[i][6] == 0 || argv[i][6] == '=')) return tera_cmd_eval_task(argc, argv);
    tera_config cfg;
    static const char *const opts[] = {"from", NULL};
    const char *from = NULL;
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, opts, &from)) return 1;
    if (!from) {
        tera_fail(TERA_ERR_ARG, "eval needs --from DIR (a Hugging Face directory or a checkpoint)");
        return tera_cli_error();
    }
    /* a run directory (RUN/checkpoints, no manifest or config.json of its own): its newest committed
     * checkpoint that verifies, as tera generate takes it */
    char latest[TERA_PATH_MAX], probe[TERA_PATH_MAX + 32];
    struct stat sb;
    snprintf(probe, sizeof probe, "%s/checkpoints", from);
    const int run_dir = stat(probe, &sb) == 0 && S_ISDIR(sb.st_mode);
    snprintf(probe, sizeof probe, "%s/manifest.json", from);
    const int has_manifest = stat(probe, &sb) == 0;
    snprintf(probe, sizeof probe, "%s/config.json", from);
    if (run_dir && !has_manifest && stat(probe, &sb) != 0) {
        if (tera_ckpt_find_latest(from, latest, sizeof latest) != TERA_OK) {
            tera_fail(TERA_ERR_IO, "--from %s: the run directory has no committed checkpoint that verifies", from);
            return tera_cli_error();
        }
        from = latest;
    }
    snprintf(cfg.training.init_from, sizeof cfg.training.init_from, "%s", from);
    /* fp32 unless this command line says otherwise (a run's config file may say auto or bf16) */
    const int precision_given = tera_cli_given("training.precision");
    if (!precision_given) snprintf(cfg.training.precision, sizeof cfg.training.precision, "fp32");
    if (tera_config_from_hf(&cfg, from) != TERA_OK) return tera_cli_error();
    if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
    tera_trainer tr;
    /* a run's config file may name a metrics port that its training still holds: evaluation serves
     * /metrics only when its own command line asks */
    if (!tera_cli_given("logging.metrics_port")) cfg.logging.metrics_port = 0;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) return tera_cli_error();
    if (tr.root)
        fprintf(stderr, "tera eval: precision %s\n",
                precision_given ? tr.prec.precision_note : "fp32 (the eval default; --training.precision=... changes it)");
    int batches = cfg.training.eval_batches;
    double loss, acc;
    if (tera_trainer_eval_acc(&tr, batches, &loss, &acc) != TERA_OK) {
        tera_trainer_free(&tr);
        return tera_cli_error();
    }
    if (tr.root) { /* every rank has the loss; one prints it (null when not finite: JSON has no NaN) */
        char vl[64], vp[64], va[64];
        cJSON *src = cJSON_CreateString(from); /* the path as a JSON string, escaped */
        char *from_json = src ? cJSON_PrintUnformatted(src) : NULL;
        printf("{\"from\": %s, \"val_loss\": %s, \"val_ppl\": %s, \"val_acc\": %s, \"batches\": %d, \"tokens\": %ld}\n",
               from_json ? from_json : "null", tera_json_num(vl, sizeof vl, "%.6f", loss),
               tera_json_num(vp, sizeof vp, "%.4f", exp(loss)), tera_json_num(va, sizeof va, "%.6f", acc), batches,
               (long)batches * cfg.training.micro_batch * cfg.training.seq_len);
        free(from_json);
        cJSON_Delete(src);
    }
    tera_trainer_free(&tr);
    return 0;
}
