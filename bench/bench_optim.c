/* The optimizer's passes over the parameter, gradient and moment arrays, timed alone on a model's
 * parameter table (docs/PERFORMANCE.md, "Optimizer"): the gradient norm (sum of squares per tensor)
 * and the fused clip + AdamW pass, as the trainer runs them on one rank. A
 * whole-step profile on this shared machine moves by +-15% between runs; the passes alone resolve
 * a change of a few percent. Beside them a STREAM-like triad over arrays of the same size (a[i] =
 * b[i] + s c[i], 12 bytes per element) gives the memory bandwidth the passes are bounded by.
 * Bytes counted: norm 4 per parameter (g read), AdamW 28 (g, w, m, v read; w, m, v written).
 * --clear 1: the pass also clears the gradient (4 bytes more: g written), as it did before the
 * gradients were stored by the next step's first backward instead (tera_model_grads_stale; the
 * trainer's TERA_GRADS_CLEARED=1).
 * Beside the wall times, the process's CPU time over each pass (all threads together; *_cpu_ms):
 * on a machine shared with other jobs a pass's wall time mostly measures the share of the cores it
 * got, its CPU time what it costs.
 * --moments bf16: the moments held as bf16 (optimizer.moments = bf16): AdamW 20 bytes per parameter.
 * --shadow 1: beside each AdamW pass one that also writes the bf16 weight shadow (tera_adamw.w16: the
 * update writes each new weight rounded to bf16, 2 bytes more per parameter; docs/PERFORMANCE.md), the
 * two alternating in order rep by rep (adamw_shadow_ms, adamw_shadow_cpu_ms).
 * The triad runs on the backend's threads (ops.for_ranges) like the passes; an OpenMP triad beside
 * the backend's spinning workers read 1-12 GB/s on this 2-core machine.
 * Usage: bench_optim [-c CONFIG] [--threads N] [--reps N] [--moments fp32|bf16] [--shadow 0|1] [--clear 0|1];
 * prints one JSON line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

typedef struct {
    float *a;
    const float *b, *c;
} triad_ctx;

static void triad_range(void *arg, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const triad_ctx *t = arg;
    float *restrict a = t->a;
    const float *restrict b = t->b, *restrict c = t->c;
    for (int64_t i = lo; i < hi; i++) a[i] = b[i] + 1e-9f * c[i];
}

static double cpu_now(void) { /* the process's CPU time, all threads */
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* the gradients of rep r (the same values for every pass of the rep) */
static void grads_fill(tera_model *m, int64_t n, int r) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) m->g[i] = 1e-3f * (float)((i * 104729 + r) % 1999 - 999) / 999.0f;
}

/* The rep's second AdamW pass (--shadow 1), the one that writes the shadow w16, timed into *cpu, *wall. */
static void shadow_pass(tera_adamw *o, tera_model *m, const tera_config *cfg, double *sq, uint16_t *w16, int clear,
                        double *cpu, double *wall) {
    const double cs = cpu_now(), ts = tera_now();
    o->w16 = w16;
    tera_adamw_step_by_param(o, m, 1e-3f, 0.5f, &cfg->optimizer, clear, NULL, NULL, sq + m->n_params,
                             sq + 2 * m->n_params);
    o->w16 = NULL;
    *cpu = cpu_now() - cs, *wall = tera_now() - ts;
}

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini";
    int threads = 1, reps = 7, bf16 = 0, shadow = 0, clear = 0;
    if (argc % 2 == 0) {
        fprintf(stderr, "bench_optim: option %s without a value\n", argv[argc - 1]);
        return 2;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--moments")) bf16 = !strcmp(argv[i + 1], "bf16");
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--shadow")) shadow = atoi(argv[i + 1]) != 0;
        else if (!strcmp(argv[i], "--clear")) clear = atoi(argv[i + 1]) != 0;
        else {
            fprintf(stderr, "bench_optim: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (threads < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bench_optim: --threads >= 1, --reps in 1..1000\n");
        return 2;
    }
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK || tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_optim: %s\n", tera_last_error());
        return 1;
    }
    tera_set_threads(threads);
    tera_model m;
    memset(&m, 0, sizeof m);
    m.be = tera_backend_cpu_create(threads); /* the passes run on its threads, as in the trainer */
    m.params = tera_param_table(&cfg.model, &m.n_params, &m.n_floats);
    const int64_t n = m.n_floats;
    m.w = tera_malloc(sizeof(float) * (size_t)n);
    m.g = tera_malloc(sizeof(float) * (size_t)n);
    double *sq = tera_calloc((size_t)(3 * m.n_params), sizeof(double));
    for (int64_t i = 0; i < n; i++) m.w[i] = 0.02f * (float)((i * 7919) % 2001 - 1000) / 1000.0f;
    tera_adamw o;
    if (bf16) tera_adamw_init_range_bf16(&o, 0, n, 1);
    else tera_adamw_init(&o, n);
    tera_adamw_plan(&o, &m);
    float *third = bf16 ? tera_calloc((size_t)n, sizeof(float)) : o.m; /* the triad's third array */
    const double adam_bytes = (bf16 ? 20.0 : 28.0) + (clear ? 4.0 : 0.0);
    double *t_sq = tera_malloc(sizeof(double) * (size_t)reps), *t_adam = tera_malloc(sizeof(double) * (size_t)reps);
    double *t_triad = tera_malloc(sizeof(double) * (size_t)reps);
    double *c_sq = tera_malloc(sizeof(double) * (size_t)reps), *c_adam = tera_malloc(sizeof(double) * (size_t)reps);
    double *t_sh = tera_malloc(sizeof(double) * (size_t)reps), *c_sh = tera_malloc(sizeof(double) * (size_t)reps);
    uint16_t *w16 = shadow ? tera_malloc(sizeof(uint16_t) * (size_t)n) : NULL;
    if (w16) memset(w16, 0, sizeof(uint16_t) * (size_t)n); /* pages touched */
    double total = 0.0;
    for (int r = 0; r < reps + 1; r++) { /* the first round warms up (pages touched) */
        double tsh = 0.0, csh = 0.0;
        if (shadow && r % 2 == 0) { /* even rounds: the shadow pass first */
            grads_fill(&m, n, r);
            shadow_pass(&o, &m, &cfg, sq, w16, clear, &csh, &tsh);
        }
        grads_fill(&m, n, r);
        const double c0 = cpu_now(), t0 = tera_now();
        total = tera_adamw_grad_sq(&o, &m, sq);
        const double c1 = cpu_now(), t1 = tera_now();
        tera_adamw_step_by_param(&o, &m, 1e-3f, 0.5f, &cfg.optimizer, clear, NULL, NULL, sq + m.n_params,
                                 sq + 2 * m.n_params);
        const double c2 = cpu_now(), t2 = tera_now();
        if (shadow && r % 2) { /* odd rounds: the shadow pass second */
            grads_fill(&m, n, r);
            shadow_pass(&o, &m, &cfg, sq, w16, clear, &csh, &tsh);
        }
        if (r > 0) c_sq[r - 1] = c1 - c0, c_adam[r - 1] = c2 - c1, t_sh[r - 1] = tsh, c_sh[r - 1] = csh;
        /* triad over three arrays of n floats: g = w + s m (the moments and parameters, rewritten) */
        triad_ctx tc = {.a = m.g, .b = m.w, .c = third};
        const double t3 = tera_now();
        m.be->ops.for_ranges(m.be, n, triad_range, &tc);
        const double t4 = tera_now();
        if (r > 0) t_sq[r - 1] = t1 - t0, t_adam[r - 1] = t2 - t1, t_triad[r - 1] = t4 - t3;
    }
    const double s_sq = median(t_sq, reps), s_adam = median(t_adam, reps), s_triad = median(t_triad, reps);
    const double cs_sq = median(c_sq, reps), cs_adam = median(c_adam, reps);
    const double gb = 1e-9 * (double)n;
    printf("{\"config\": \"%s\", \"threads\": %d, \"params\": %lld, \"tensors\": %d, \"reps\": %d, "
           "\"norm_ms\": %.3f, \"adamw_ms\": %.3f, \"optimizer_ms\": %.2f, \"norm_gbs\": %.1f, \"adamw_gbs\": %.1f, "
           "\"optimizer_gbs\": %.1f, \"triad_gbs\": %.1f, \"optimizer_vs_triad\": %.3f, \"norm_cpu_ms\": %.2f, "
           "\"adamw_cpu_ms\": %.3f, \"grad_sq\": %.6e, \"moments\": \"%s\", \"adamw_shadow_ms\": %.2f, "
           "\"adamw_shadow_cpu_ms\": %.2f, \"clear\": %d}\n",
           cfg_path, threads, (long long)n, m.n_params, reps, 1e3 * s_sq, 1e3 * s_adam, 1e3 * (s_sq + s_adam),
           4.0 * gb / s_sq, adam_bytes * gb / s_adam, (4.0 + adam_bytes) * gb / (s_sq + s_adam), 12.0 * gb / s_triad,
           ((4.0 + adam_bytes) * gb / (s_sq + s_adam)) / (12.0 * gb / s_triad), 1e3 * cs_sq, 1e3 * cs_adam, total,
           bf16 ? "bf16" : "fp32", shadow ? 1e3 * median(t_sh, reps) : 0.0, shadow ? 1e3 * median(c_sh, reps) : 0.0,
           clear);
    free(t_sh), free(c_sh), free(w16);
    free(t_sq), free(t_adam), free(t_triad), free(c_sq), free(c_adam), free(sq);
    if (bf16) free(third);
    tera_adamw_free(&o);
    free(m.w), free(m.g), free(m.params);
    tera_backend_destroy(m.be);
    return 0;
}
