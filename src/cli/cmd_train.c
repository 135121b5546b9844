/* tera train / tera eval */
#include <math.h>
#include <string.h>

#include "cli.h"
#include "tera/comm.h"
#include "tera/hf.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

static void print_summary(const tera_trainer *tr) {
    const tera_config *c = &tr->cfg;
    const tera_model *m = &tr->model;
    const double MiB = 1024.0 * 1024.0;
    fprintf(stderr,
            "tera: model %.2fM params (%.2fM active/token), L=%d D=%d H=%d/%d E=%d k=%d F=%d V=%d | %s\n"
            "tera: data %s (%ld tokens, %ld train / %ld val samples of T=%d) | batch %d x %d x accum %d x dp %d = %ld tokens/step | %d threads\n"
            "tera: memory MiB per rank: params %.1f, grads %.1f, optimizer %.1f, activations %.1f (recompute %s), scratch %.1f\n",
            tera_model_total_params(&c->model) / 1e6, tera_model_active_params(&c->model) / 1e6,
            c->model.n_layers, c->model.dim, c->model.n_heads, c->model.n_kv_heads, c->model.n_experts,
            c->model.top_k, c->model.ffn_dim, c->model.vocab_size,
            c->model.capacity_factor > 0 ? "capacity" : "dropless",
            c->data.path[0] ? c->data.path : "embedded default corpus", (long)tr->src.n_tokens,
            (long)tr->loader.n_train, (long)tr->loader.n_val, c->training.seq_len, c->training.micro_batch,
            c->training.seq_len, c->training.grad_accum, tr->world, (long)tr->tokens_per_step, tera_get_threads(),
            m->bytes_params / MiB, m->bytes_grads / MiB, 2.0 * (double)tr->opt.n * sizeof(float) / MiB, m->bytes_acts / MiB,
            c->training.recompute, m->bytes_scratch / MiB);
}

int tera_cmd_train(int argc, char **argv) {
    tera_config cfg;
    static const char *const flags[] = {"force", "resume", NULL};
    int set[2] = {0, 0};
    if (tera_cli_parse(argc, argv, &cfg, flags, set, NULL, NULL)) return 1;
    if (cfg.training.init_from[0]) {
        if (tera_hf_read_config(cfg.training.init_from, &cfg.model) != TERA_OK) return tera_cli_error();
        if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
        if (tera_comm_rank(tera_comm_world()) == 0)
            fprintf(stderr, "tera: model configuration and weights from %s\n", cfg.training.init_from);
    }
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, cfg.logging.run_dir, set[0] || set[1]) != TERA_OK) return tera_cli_error();
    if (set[1]) {
        if (tera_trainer_resume(&tr) != TERA_OK) {
            tera_trainer_free(&tr);
            return tera_cli_error();
        }
        if (tr.rank == 0) fprintf(stderr, "tera: resumed %s at step %ld\n", cfg.logging.run_dir, (long)tr.step);
    }
    if (tr.rank == 0) {
        print_summary(&tr);
        fprintf(stderr, "tera: run directory %s | %d data-parallel rank%s (%s)\n", cfg.logging.run_dir, tr.world,
                tr.world == 1 ? "" : "s", tera_comm_backend());
    }
    tera_prof_reset();
    int64_t step0 = tr.step;
    tera_step_result last;
    tera_status st = tera_trainer_run(&tr, &last);
    if (st != TERA_OK) {
        tera_trainer_free(&tr);
        return tera_cli_error();
    }
    if (cfg.logging.profile && tr.rank == 0) tera_prof_print(stderr, (int)(tr.step - step0));
    if (tr.rank == 0)
        fprintf(stderr, "tera: done: %ld steps, final loss %.4f, checkpoint in %s/checkpoints/step_%08ld\n",
            (long)tr.step, last.loss, cfg.logging.run_dir, (long)tr.step);
    tera_trainer_free(&tr);
    return 0;
}

int tera_cmd_eval(int argc, char **argv) {
    tera_config cfg;
    static const char *const opts[] = {"from", NULL};
    const char *from = NULL;
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, opts, &from)) return 1;
    if (!from) {
        tera_fail(TERA_ERR_ARG, "eval needs --from DIR (a Hugging Face directory or a checkpoint)");
        return tera_cli_error();
    }
    snprintf(cfg.training.init_from, sizeof cfg.training.init_from, "%s", from);
    if (tera_hf_read_config(from, &cfg.model) != TERA_OK) return tera_cli_error();
    if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) return tera_cli_error();
    int batches = cfg.training.eval_batches;
    double loss;
    if (tera_trainer_eval(&tr, batches, &loss) != TERA_OK) {
        tera_trainer_free(&tr);
        return tera_cli_error();
    }
    printf("{\"from\": \"%s\", \"val_loss\": %.6f, \"val_ppl\": %.4f, \"batches\": %d, \"tokens\": %ld}\n", from,
           loss, exp(loss), batches, (long)batches * cfg.training.micro_batch * cfg.training.seq_len);
    tera_trainer_free(&tr);
    return 0;
}
