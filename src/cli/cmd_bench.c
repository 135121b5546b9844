/* tera bench: median tokens/s and MFU of full training steps on a BENCH.md configuration,
 * with the sgemm peak of this machine measured in the same run. */
#include <oneapi/dnnl/dnnl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Peak GFLOP/s of a large square fp32 product (2048^3) through oneDNN: dnnl_sgemm and the matmul
 * primitive (what tera_gemm picks for large products) are both timed, 9 repetitions each, and the
 * best repetition is the peak. The bench measures it before and after the timed steps and keeps the
 * higher, so a slow moment of the machine cannot inflate the MFU. */
static double sgemm_peak_gflops(void) {
    const int n = 2048, reps = 9;
    float *a = tera_malloc(sizeof(float) * n * n), *b = tera_malloc(sizeof(float) * n * n),
          *c = tera_malloc(sizeof(float) * n * n);
    for (int64_t i = 0; i < (int64_t)n * n; i++) a[i] = (float)(i % 13) * 0.01f, b[i] = (float)(i % 7) * 0.01f;
    double g[9], best = 0.0;
    for (int impl = 0; impl < 2; impl++) {
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
            double t0 = tera_now();
            if (impl == 0)
                dnnl_sgemm('N', 'T', n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
            else
                tera_gemm(0, 1, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
            if (r >= 0) g[r] = 2.0 * n * n * (double)n / (tera_now() - t0) / 1e9;
        }
        qsort(g, reps, sizeof(double), cmp_double);
        if (g[reps - 1] > best) best = g[reps - 1];
    }
    free(a);
    free(b);
    free(c);
    return best;
}

/* CPU seconds of this process (all threads): with passive OpenMP waits, the compute done, which
 * other work on the machine slows down far less than it slows wall time. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int tera_cmd_bench(int argc, char **argv) {
    tera_config cfg;
    static const char *const opts[] = {"steps", "warmup", "threads", "name", NULL};
    const char *val[4] = {NULL, NULL, NULL, NULL};
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, opts, val)) return 1;
    int steps = val[0] ? atoi(val[0]) : 10, warmup = val[1] ? atoi(val[1]) : 3;
    if (val[2]) cfg.training.threads = atoi(val[2]);
    if (steps < 1 || warmup < 0 || steps > 1000) {
        tera_fail(TERA_ERR_ARG, "--steps must be in 1..1000 and --warmup >= 0");
        return tera_cli_error();
    }
    cfg.training.steps = steps + warmup;
    cfg.training.warmup_steps = 0;
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) return tera_cli_error();
    double peak = sgemm_peak_gflops();
    double *sec = tera_malloc(sizeof(double) * (size_t)steps);
    tera_step_result r;
    double cpu0 = 0.0;
    for (int s = 0; s < warmup + steps; s++) {
        if (s == warmup) tera_prof_reset(), cpu0 = cpu_seconds();
        if (tera_trainer_step(&tr, &r) != TERA_OK) {
            tera_trainer_free(&tr);
            return tera_cli_error();
        }
        if (s >= warmup) sec[s - warmup] = r.seconds;
    }
    const double cpu_ms = 1e3 * (cpu_seconds() - cpu0) / steps;
    const double peak_after = sgemm_peak_gflops();
    if (peak_after > peak) peak = peak_after;
    qsort(sec, (size_t)steps, sizeof(double), cmp_double);
    const double med = sec[steps / 2];
    const double tps = (double)tr.tokens_per_step / med;
    const double fpt = tera_model_flops_per_token(&cfg.model, cfg.training.seq_len);
    const double gflops = tps * fpt / 1e9;
    tera_prof_print(stderr, steps);
    const tera_model *m = &tr.model;
    fprintf(stderr, "tera bench: memory MiB: params %.1f, grads %.1f, activations %.1f (recompute %s), scratch %.1f\n",
            m->bytes_params / 1048576.0, m->bytes_grads / 1048576.0, m->bytes_acts / 1048576.0,
            cfg.training.recompute, m->bytes_scratch / 1048576.0);
    printf("{\"impl\": \"tera\", \"config\": \"%s\", \"threads\": %d, \"precision\": \"fp32\", "
           "\"tokens_per_s\": %.1f, \"step_ms_median\": %.2f, \"flops_per_token\": %.0f, \"gflops\": %.1f, "
           "\"sgemm_peak_gflops\": %.1f, \"mfu\": %.4f, \"final_loss\": %.4f, \"recompute\": \"%s\", "
           "\"act_bytes\": %lld, \"cpu_ms_per_step\": %.2f}\n",
           val[3] ? val[3] : "custom", tera_get_threads(), tps, 1e3 * med, fpt, gflops, peak, gflops / peak,
           r.loss, cfg.training.recompute, (long long)m->bytes_acts, cpu_ms);
    free(sec);
    tera_trainer_free(&tr);
    return 0;
}
