/* bf16 operands written by their producers (issue 19; src/kernels/cpu/cpu.h, tera_cpu_prod): whole
 * bf16 training steps of one trainer, A/B in one process, producers on (SwiGLU forward and backward
 * and the cross-entropy write the bf16 copies the next product takes) against off (every product
 * rounds its activation operands itself, as TERA_PRODUCER_BF16=0). Both give the same bits. The two
 * alternate step by step, the order swapped every round, so a neighbour's load hits them alike. Prints
 * one JSON line: per variant the median wall and CPU (all threads) ms per step and the median ms per
 * step of the profile rows the producers touch (experts, SwiGLU, dense FFN, LM head, cross-entropy),
 * and the operands taken from producers per step.
 * --ops 1: the passes alone instead, on the config's shapes (all routed rows x ffn_dim for SwiGLU, the
 * micro-batch's rows x vocabulary for the cross-entropy): each producer with its bf16 copy against the
 * plain pass followed by the separate rounding the product did (tera_round_bf16), alternating, median
 * ms of each.
 * Usage: bench_producer [-c CONFIG] [--threads N] [--rounds N] [--accum A] [--ops 1]   (bf16 on the native units) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "kernels/cpu/cpu.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* --ops: the producers' passes against the plain passes plus the products' separate rounding */
static void ops_bench(const tera_config *cfg, int rounds) {
    const int64_t N = (int64_t)cfg->training.micro_batch * cfg->training.seq_len;
    const int64_t R = N * cfg->model.top_k, F = cfg->model.ffn_dim, V = cfg->model.vocab_size, n = R * F;
    float *a1 = tera_malloc(sizeof(float) * (size_t)n), *a3 = tera_malloc(sizeof(float) * (size_t)n);
    float *g = tera_malloc(sizeof(float) * (size_t)n), *dg = tera_malloc(sizeof(float) * (size_t)n);
    float *da1 = tera_malloc(sizeof(float) * (size_t)n), *da3 = tera_malloc(sizeof(float) * (size_t)n);
    uint16_t *s16 = tera_malloc(sizeof(uint16_t) * (size_t)(2 * n > N * V ? 2 * n : N * V));
    float *logits = tera_malloc(sizeof(float) * (size_t)(N * V)), *d = tera_malloc(sizeof(float) * (size_t)(N * V));
    float *lse = tera_malloc(sizeof(float) * (size_t)N), *tl = tera_malloc(sizeof(float) * (size_t)N);
    int32_t *tg = tera_malloc(sizeof(int32_t) * (size_t)N);
    uint64_t x = 88172645463325252ull;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        a1[i] = (float)(x % 2000) / 500.0f - 2.0f, a3[i] = (float)(x % 1777) / 888.0f - 1.0f, dg[i] = a3[i] * 0.1f;
    }
    for (int64_t i = 0; i < N * V; i++) logits[i] = (float)((i * 2654435761u) % 1000) / 100.0f;
    for (int64_t i = 0; i < N; i++) tg[i] = (int32_t)((i * 7919) % V);
    /* the loss gradient and the LM head's backward through the backend, producers off and on */
    const int64_t D = cfg->model.dim;
    tera_backend *hb = tera_backend_cpu_create(-1);
    tera_backend_set_precision(hb, TERA_PREC_BF16, TERA_BF16_NATIVE);
    tera_backend_reserve(hb, N * (D + V) + D * V + 2, 0);
    float *hx = tera_malloc(sizeof(float) * (size_t)(N * D)), *hw = tera_malloc(sizeof(float) * (size_t)(V * D));
    float *hdx = tera_malloc(sizeof(float) * (size_t)(N * D)), *hdw = tera_malloc(sizeof(float) * (size_t)(V * D));
    for (int64_t i = 0; i < N * D; i++) hx[i] = a1[i % n] * 0.5f;
    for (int64_t i = 0; i < V * D; i++) hw[i] = a3[i % n] * 0.05f, hdw[i] = 0.0f;
    enum { SF, SFP, SB, SBP, CE, CEP, HD, HDP, NK };
    static const char *const K[NK] = {"swiglu_fwd_round", "swiglu_fwd_bf16", "swiglu_bwd_round", "swiglu_bwd_bf16",
                                      "ce_fused_round",   "ce_fused_bf16",   "ce_head_bwd_off",  "ce_head_bwd_on"};
    double *t[NK];
    for (int k = 0; k < NK; k++) t[k] = calloc((size_t)rounds, sizeof(double));
    for (int r = -1; r < rounds; r++) { /* r = -1: warm-up */
        for (int j = 0; j < NK; j++) {
            const int k = r & 1 ? (j ^ 1) : j; /* each pair's order swapped every round */
            const double t0 = tera_now();
            switch (k) {
            case SF: tera_swiglu_forward(g, a1, a3, n), tera_round_bf16(s16, g, n); break;
            case SFP: tera_swiglu_forward_bf16(g, s16, a1, a3, n); break;
            case SB:
                tera_swiglu_backward(da1, da3, dg, a1, a3, n);
                tera_round_bf16(s16, da1, n), tera_round_bf16(s16 + n, da3, n);
                break;
            case SBP: tera_swiglu_backward_bf16(da1, da3, s16, s16 + n, dg, a1, a3, n); break;
            case CE: tera_ce_fused(d, lse, tl, logits, tg, N, V, 0.5f), tera_round_bf16(s16, d, N * V); break;
            case CEP: tera_ce_fused_bf16(d, s16, lse, tl, logits, tg, N, V, 0.5f); break;
            default:
                tera_cpu_producer_bf16(hb->impl, k == HDP);
                hb->ops.ce_fused(hb, d, lse, tl, logits, tg, N, V, 0.5f);
                hb->ops.linear_backward(hb, hdx, hdw, d, hx, hw, N, D, V, 0.0f, 1.0f);
            }
            if (r >= 0) t[k][r] = 1e3 * (tera_now() - t0);
        }
    }
    printf("{\"config\": \"ops\", \"threads\": %d, \"rounds\": %d, \"swiglu_elems\": %ld, \"ce_elems\": %ld",
           cfg->training.threads, rounds, (long)n, (long)(N * V));
    for (int k = 0; k < NK; k++) printf(", \"%s_ms\": %.3f", K[k], median(t[k], rounds));
    printf("}\n");
    for (int k = 0; k < NK; k++) free(t[k]);
    tera_backend_destroy(hb);
    free(hx), free(hw), free(hdx), free(hdw);
    free(a1), free(a3), free(g), free(dg), free(da1), free(da3), free(s16), free(logits), free(d), free(lse), free(tl);
    free(tg);
}

static const int ROWS[] = {TERA_PROF_EXPERT_FWD, TERA_PROF_EXPERT_BWD, TERA_PROF_SWIGLU_FWD, TERA_PROF_SWIGLU_BWD,
                           TERA_PROF_DENSE_FWD,  TERA_PROF_DENSE_BWD,  TERA_PROF_HEAD_BWD,   TERA_PROF_LOSS_FWD,
                           TERA_PROF_LOSS_BWD};
enum { NROWS = sizeof ROWS / sizeof ROWS[0] };

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini";
    int threads = 1, rounds = 5, accum = 1, ops = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--accum")) accum = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--ops")) ops = atoi(argv[i + 1]);
    }
    if (threads < 1 || rounds < 1 || rounds > 1000 || accum < 1) {
        fprintf(stderr, "bench_producer: --threads >= 1, --rounds in 1..1000, --accum >= 1\n");
        return 2;
    }
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK) {
        fprintf(stderr, "bench_producer: %s\n", tera_last_error());
        return 1;
    }
    snprintf(cfg.training.precision, sizeof cfg.training.precision, "bf16");
    snprintf(cfg.training.bf16_gemm, sizeof cfg.training.bf16_gemm, "native");
    cfg.training.threads = threads;
    cfg.training.grad_accum = accum;
    cfg.training.steps = 1000000;
    cfg.logging.progress = 0;
    cfg.logging.run_dir[0] = '\0';
    if (tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_producer: %s\n", tera_last_error());
        return 1;
    }
    if (ops) {
        tera_set_threads(threads);
        ops_bench(&cfg, rounds);
        return 0;
    }
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) {
        fprintf(stderr, "bench_producer: %s\n", tera_last_error());
        return 1;
    }
    tera_backend *be = tr.model.be;
    if (be->precision != TERA_PREC_BF16 || be->bf16_gemm != TERA_BF16_NATIVE) {
        fprintf(stderr, "bench_producer: skip: no bf16 products on native units here\n");
        tera_trainer_free(&tr);
        return 0;
    }
    tera_cpu_matmul *mm = be->impl;
    double *wall[2], *cpu[2], *row[2][NROWS];
    int64_t taken[2] = {0, 0};
    for (int v = 0; v < 2; v++) {
        wall[v] = calloc((size_t)rounds, sizeof(double));
        cpu[v] = calloc((size_t)rounds, sizeof(double));
        for (int k = 0; k < NROWS; k++) row[v][k] = calloc((size_t)rounds, sizeof(double));
    }
    tera_step_result r;
    for (int s = 0; s < 2; s++) tera_trainer_step(&tr, &r); /* warm-up: pages, primitives */
    for (int k = 0; k < rounds; k++) {
        for (int j = 0; j < 2; j++) {
            const int v = (j + k) % 2; /* v = 1: producers on */
            tera_cpu_producer_bf16(mm, v);
            double p0[NROWS];
            for (int q = 0; q < NROWS; q++) p0[q] = tera_prof_seconds[ROWS[q]];
            const int64_t u0 = mm->prod_used;
            const double c0 = cpu_now(), t0 = tera_now();
            tera_trainer_step(&tr, &r);
            cpu[v][k] = 1e3 * (cpu_now() - c0), wall[v][k] = 1e3 * (tera_now() - t0);
            for (int q = 0; q < NROWS; q++) row[v][q][k] = 1e3 * (tera_prof_seconds[ROWS[q]] - p0[q]);
            taken[v] += mm->prod_used - u0;
        }
    }
    printf("{\"config\": \"%s\", \"threads\": %d, \"accum\": %d, \"rounds\": %d, \"scratch_grows\": %ld, "
           "\"operands_taken_per_step\": %.1f",
           cfg_path, threads, accum, rounds, (long)be->ctl.scratch_grows(be), (double)taken[1] / rounds);
    static const char *const NAMES[2] = {"off", "on"};
    for (int v = 0; v < 2; v++) {
        printf(", \"%s_ms\": %.2f, \"%s_cpu_ms\": %.2f", NAMES[v], median(wall[v], rounds), NAMES[v],
               median(cpu[v], rounds));
        for (int q = 0; q < NROWS; q++) {
            char name[64];
            snprintf(name, sizeof name, "%s", tera_prof_name(ROWS[q]));
            for (char *c = name; *c; c++)
                if (*c == ' ' || *c == '/' || *c == '-') *c = '_';
            printf(", \"%s_%s_ms\": %.2f", NAMES[v], name, median(row[v][q], rounds));
        }
    }
    printf(", \"final_loss\": %.6f}\n", r.loss);
    for (int v = 0; v < 2; v++) {
        free(wall[v]), free(cpu[v]);
        for (int q = 0; q < NROWS; q++) free(row[v][q]);
    }
    tera_trainer_free(&tr);
    return 0;
}
