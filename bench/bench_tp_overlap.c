/* Tensor parallelism's overlap (parallel.tp_overlap, issue 19): whole training steps of one trainer
 * under mpirun, the backward's input-gradient sums blocking where they are produced (off) against
 * started non-blocking with the weight gradients computed while they are in flight (on), A/B in one
 * job (on: parallel.tp_overlap = --on, default 2: in every precision): the variants alternate step by step, their order swapped every round, so a neighbour's load
 * hits them alike (the same bits either way: tests/cli_layouts.sh). Every timed step starts at a
 * barrier. Per variant, medians over the rounds of:
 *   step_ms     rank 0's wall time of the step
 *   exposed_ms  seconds blocked in communication in the step (src/comm/comm.c's blocked_s: inside
 *               blocking collectives and waits), the mean over the ranks; exposed_max_ms the busiest
 *   cpu_ms      the process CPU time of the step, the mean over the ranks (a wait sleeps after its
 *               first millisecond, so blocked time is mostly not CPU time)
 * and, with overlap on, the sums waited for per step and how many of them were already complete
 * at their wait (rank 0's), and rank 0's per-operation profile (tera_prof, wall ms per step, the mean
 * over the rounds) of the operations the overlap reorders. Prints one JSON line (rank 0).
 * Usage: mpirun -np 2 bench_tp_overlap [-c CONFIG] [--rounds N] [--threads N] [--on 1|2] [--set KEY=VALUE]...
 * (default configs/bench-dist.ini; e.g. --set parallel.tp=2 --set training.micro_batch=16) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "tera/comm.h"
#include "tera/profile.h"
#include "tera/train.h"

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { M_STEP, M_EXPOSED, M_EXPOSED_MAX, M_CPU, NM };

int main(int argc, char **argv) {
    if (tera_comm_init(&argc, &argv) != TERA_OK) {
        fprintf(stderr, "bench_tp_overlap: %s\n", tera_last_error());
        return 1;
    }
    const char *cfg_path = "configs/bench-dist.ini";
    int threads = 1, rounds = 5, on_mode = 2;
    tera_config cfg;
    tera_config_defaults(&cfg);
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
    if (tera_config_load(&cfg, cfg_path) != TERA_OK) {
        fprintf(stderr, "bench_tp_overlap: %s\n", tera_last_error());
        return 1;
    }
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_tp_overlap: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "-c")) continue;
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--on")) on_mode = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--set")) {
            if (tera_config_set(&cfg, argv[i + 1]) != TERA_OK) {
                fprintf(stderr, "bench_tp_overlap: %s\n", tera_last_error());
                return 2;
            }
        } else {
            fprintf(stderr, "usage: mpirun -np P bench_tp_overlap [-c CONFIG] [--rounds N] [--threads N] [--set K=V]...\n");
            return 2;
        }
    }
    if (rounds < 1 || rounds > 1000 || on_mode < 1 || on_mode > 2) {
        fprintf(stderr, "bench_tp_overlap: --rounds must be in 1..1000, --on 1 or 2\n");
        return 2;
    }
    cfg.training.threads = threads;
    cfg.training.steps = 1000000;
    cfg.training.warmup_steps = 0;
    cfg.logging.progress = 0;
    cfg.logging.run_dir[0] = '\0';
    if (tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_tp_overlap: %s\n", tera_last_error());
        return 1;
    }
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) {
        fprintf(stderr, "bench_tp_overlap: %s\n", tera_last_error());
        return 1;
    }
    const int world = tr.topo.world, rank = tr.topo.rank;
    if (tr.topo.tp < 2) {
        if (tr.root) fprintf(stderr, "bench_tp_overlap: parallel.tp is %d: nothing to overlap\n", tr.topo.tp);
        tera_trainer_free(&tr);
        tera_comm_finalize();
        return 2;
    }
    /* [variant][metric][round][rank], summed over the ranks once at the end */
    const size_t per = (size_t)rounds * (size_t)world;
    double *v = calloc(2 * NM * per, sizeof(double));
    int64_t waited[2] = {0, 0}, early[2] = {0, 0};
    static const int prof_ops[] = {TERA_PROF_HEAD_BWD, TERA_PROF_QKV_BWD, TERA_PROF_EXPERT_BWD, TERA_PROF_DENSE_BWD,
                                   TERA_PROF_ROUTER_BWD, TERA_PROF_TP_COMM};
    enum { NP = sizeof prof_ops / sizeof prof_ops[0] };
    double prof[2][NP] = {{0}};
    tera_comm *w = tera_comm_world();
    tera_step_result r;
    for (int s = 0; s < 2; s++) tera_trainer_step(&tr, &r); /* warm-up: pages, primitives, the comm pool */
    for (int k = 0; k < rounds; k++) {
        for (int j = 0; j < 2; j++) {
            const int on = (j + k) % 2 == 0; /* on first in even rounds */
            tera_model_set_tp_overlap(&tr.model, on ? on_mode : 0);
            int64_t e0 = 0;
            const int64_t o0 = tera_model_tp_overlapped(&tr.model, &e0);
            tera_comm_barrier(w);
            double p0[NP];
            for (int i = 0; i < NP; i++) p0[i] = tera_prof_seconds[prof_ops[i]];
            const double b0 = tera_comm_traffic_get().blocked_s, c0 = cpu_now(), t0 = tera_now();
            tera_trainer_step(&tr, &r);
            const double t1 = tera_now(), c1 = cpu_now(), b1 = tera_comm_traffic_get().blocked_s;
            int64_t e1 = 0;
            const int64_t o1 = tera_model_tp_overlapped(&tr.model, &e1);
            waited[on] += o1 - o0, early[on] += e1 - e0;
            for (int i = 0; i < NP; i++) prof[on][i] += tera_prof_seconds[prof_ops[i]] - p0[i];
            double *x = v + (size_t)on * NM * per + (size_t)k * (size_t)world + (size_t)rank;
            x[M_STEP * per] = rank == 0 ? 1e3 * (t1 - t0) : 0.0;
            x[M_EXPOSED * per] = 1e3 * (b1 - b0);
            x[M_CPU * per] = 1e3 * (c1 - c0);
        }
    }
    tera_comm_allreduce_f64(w, v, (int64_t)(2 * NM * per));
    if (tr.root) {
        printf("{\"config\": \"%s\", \"ranks\": %d, \"tp\": %d, \"dp\": %d, \"pp\": %d, \"threads_per_rank\": %d, "
               "\"rounds\": %d, \"precision\": \"%s\", \"on_mode\": %d",
               cfg_path, world, tr.topo.tp, tr.topo.dp, tr.topo.pp, threads, rounds, cfg.training.precision, on_mode);
        double *col = calloc((size_t)rounds, sizeof(double));
        for (int on = 1; on >= 0; on--) {
            const char *name = on ? "on" : "off";
            double med[NM];
            for (int m = 0; m < NM; m++) {
                for (int k = 0; k < rounds; k++) {
                    const double *x = v + (size_t)on * NM * per + (size_t)(m == M_EXPOSED_MAX ? M_EXPOSED : m) * per +
                                      (size_t)k * (size_t)world;
                    double sum = 0.0, mx = 0.0;
                    for (int q = 0; q < world; q++) sum += x[q], mx = x[q] > mx ? x[q] : mx;
                    col[k] = m == M_STEP ? sum : (m == M_EXPOSED_MAX ? mx : sum / world);
                }
                med[m] = median(col, rounds);
            }
            printf(", \"%s_step_ms\": %.2f, \"%s_exposed_ms\": %.2f, \"%s_exposed_max_ms\": %.2f, \"%s_cpu_ms\": %.2f", name,
                   med[M_STEP], name, med[M_EXPOSED], name, med[M_EXPOSED_MAX], name, med[M_CPU]);
            printf(", \"%s_tp_overlapped_per_step\": %.1f, \"%s_tp_done_before_wait_per_step\": %.1f", name,
                   (double)waited[on] / rounds, name, (double)early[on] / rounds);
            printf(", \"%s_prof_ms\": {", name);
            for (int i = 0; i < NP; i++)
                printf("%s\"%s\": %.1f", i ? ", " : "", tera_prof_name(prof_ops[i]), 1e3 * prof[on][i] / rounds);
            printf("}");
        }
        printf(", \"final_loss\": %.4f}\n", r.loss);
        free(col);
    }
    free(v);
    tera_trainer_free(&tr);
    tera_comm_finalize();
    return 0;
}
