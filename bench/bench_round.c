/* Operands rounded once (issue 19, docs/PERFORMANCE.md "Operands rounded once"): whole bf16 training
 * steps of one trainer, A/B in one process between four variants that give the same bits:
 *   each   every product rounds both operands on every call (no shadow, no multi ops: the old code)
 *   multi  the several-products ops (q/k/v, w1/w3: the input rounded once), no weight shadow
 *   shadow the weights' bf16 shadow, single products
 *   both   the two together (what tera runs)
 * The variants alternate step by step, in an order rotated every round, so a neighbour's load hits
 * them alike; the shadow (registered here whatever grad_accum, where the trainer registers it only
 * for grad_accum > 1) is switched by set_precision with TERA_BF16_SHADOW, the multi ops by
 * clearing their entries in the backend's table (the model then makes the single calls). After a
 * switch one untimed step touches the shadow's fresh pages. Prints one JSON line: the median wall
 * and CPU (all threads) ms per step of each variant, and the shadow's bytes.
 * --accum A: the config's micro-batch split into A micro-batches of one step (training.grad_accum;
 * the same tokens per step): the shadow then serves A forwards and backwards per rounding.
 * --pair: only multi and both (the shadow's own effect, twice the rounds in the same time).
 * Usage: bench_round [-c CONFIG] [--threads N] [--rounds N] [--accum A] [--pair 1]   (bf16 on the native units) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { V_EACH, V_MULTI, V_SHADOW, V_BOTH, NV };
static const char *const NAMES[NV] = {"each", "multi", "shadow", "both"};

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini";
    int threads = 1, rounds = 5, accum = 1, pair = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--accum")) accum = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--pair")) pair = atoi(argv[i + 1]);
    }
    if (threads < 1 || rounds < 1 || rounds > 1000 || accum < 1) {
        fprintf(stderr, "bench_round: --threads >= 1, --rounds in 1..1000, --accum >= 1\n");
        return 2;
    }
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK) {
        fprintf(stderr, "bench_round: %s\n", tera_last_error());
        return 1;
    }
    snprintf(cfg.training.precision, sizeof cfg.training.precision, "bf16");
    snprintf(cfg.training.bf16_gemm, sizeof cfg.training.bf16_gemm, "native");
    cfg.training.threads = threads;
    if (accum > 1) {
        if (cfg.training.micro_batch % accum) {
            fprintf(stderr, "bench_round: --accum %d does not divide training.micro_batch %d\n", accum,
                    cfg.training.micro_batch);
            return 2;
        }
        cfg.training.micro_batch /= accum;
        cfg.training.grad_accum = accum;
    }
    cfg.training.steps = 1000000;
    cfg.logging.progress = 0;
    cfg.logging.run_dir[0] = '\0';
    if (tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_round: %s\n", tera_last_error());
        return 1;
    }
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) {
        fprintf(stderr, "bench_round: %s\n", tera_last_error());
        return 1;
    }
    tera_backend *be = tr.model.be;
    if (be->precision != TERA_PREC_BF16 || be->bf16_gemm != TERA_BF16_NATIVE) {
        fprintf(stderr, "bench_round: no bf16 products on native units here\n");
        return 1;
    }
    /* the trainer registers the shadow only for grad_accum > 1: here it is there in every case */
    tera_backend_weights_register(be, tr.model.w, tr.model.n_floats);
    const tera_backend_ops ops = be->ops;
    int64_t shadow_bytes = 0;
    double *wall[NV], *cpu[NV];
    for (int v = 0; v < NV; v++) wall[v] = calloc((size_t)rounds, sizeof(double)), cpu[v] = calloc((size_t)rounds, sizeof(double));
    tera_step_result r;
    for (int s = 0; s < 2; s++) tera_trainer_step(&tr, &r); /* warm-up: pages, primitives */
    for (int k = 0; k < rounds; k++) {
        for (int j = 0; j < NV; j++) {
            const int v = (j + k) % NV;
            if (pair && v != V_MULTI && v != V_BOTH) continue;
            const int shadow = v == V_SHADOW || v == V_BOTH, multi = v == V_MULTI || v == V_BOTH;
            if (shadow) unsetenv("TERA_BF16_SHADOW");
            else setenv("TERA_BF16_SHADOW", "0", 1);
            tera_backend_set_precision(be, TERA_PREC_BF16, TERA_BF16_NATIVE); /* the shadow allocated or freed */
            if (shadow) shadow_bytes = tera_backend_weights_shadow_bytes(be);
            be->ops.linear_forward_multi = multi ? ops.linear_forward_multi : NULL;
            be->ops.linear_backward_multi = multi ? ops.linear_backward_multi : NULL;
            tera_trainer_step(&tr, &r); /* untimed: a fresh shadow's pages */
            const double c0 = cpu_now(), t0 = tera_now();
            tera_trainer_step(&tr, &r);
            cpu[v][k] = 1e3 * (cpu_now() - c0), wall[v][k] = 1e3 * (tera_now() - t0);
        }
    }
    printf("{\"config\": \"%s\", \"threads\": %d, \"accum\": %d, \"rounds\": %d, \"shadow_bytes\": %ld, "
           "\"scratch_grows\": %ld", cfg_path, threads, accum, rounds, (long)shadow_bytes, (long)be->ctl.scratch_grows(be));
    for (int v = 0; v < NV; v++)
        if (!pair || v == V_MULTI || v == V_BOTH)
            printf(", \"%s_ms\": %.2f, \"%s_cpu_ms\": %.2f", NAMES[v], median(wall[v], rounds), NAMES[v],
                   median(cpu[v], rounds));
    printf(", \"final_loss\": %.6f}\n", r.loss);
    for (int v = 0; v < NV; v++) free(wall[v]), free(cpu[v]);
    tera_trainer_free(&tr);
    return 0;
}
