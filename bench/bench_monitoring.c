/* The monitoring's own work per training step, timed directly on a set-up trainer (docs/MONITORING.md):
 * a whole-step comparison cannot resolve a cost under 1% on a loaded machine, the work itself can.
 * Sets up CONFIG (default configs/bench-s.ini) with everything on: the Prometheus endpoint
 * (logging.metrics_port, a free port), TensorBoard event files and the timeline (all steps) in a
 * scratch directory; runs STEPS training steps (their median time is the reference); then times,
 * REPS times each (median): the endpoint's publish after a step, the TensorBoard step record, one
 * hardware sample (taken at most once a second, so per step it costs sample x min(1, step / 1 s)),
 * the timeline events of one step (counted in the traced steps), and, in the serving thread, one
 * scrape's formatting. Prints one JSON line.
 * Usage: bench_monitoring [-c CONFIG] [--steps N] [--reps N] [--threads N] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tera/comm.h"
#include "tera/hw.h"
#include "tera/metrics_http.h"
#include "tera/profile.h"
#include "tera/tensorboard.h"
#include "tera/trace.h"
#include "tera/train.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini";
    int steps = 5, reps = 2000, threads = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    }
    if (steps < 2 || reps < 10) {
        fprintf(stderr, "bench_monitoring: --steps >= 2, --reps >= 10\n");
        return 2;
    }
    if (tera_comm_init(&argc, &argv) != TERA_OK) return 1;
    char dir[] = "/tmp/tera_bench_monitoring_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK) {
        fprintf(stderr, "bench_monitoring: %s\n", tera_last_error());
        return 1;
    }
    char kv[TERA_PATH_MAX + 64];
    snprintf(kv, sizeof kv, "logging.metrics_port=%d", 20000 + (int)(getpid() % 12000));
    tera_config_set(&cfg, kv);
    snprintf(kv, sizeof kv, "logging.tensorboard=%s/tb", dir);
    tera_config_set(&cfg, kv);
    snprintf(kv, sizeof kv, "logging.trace=%s/trace.json", dir);
    tera_config_set(&cfg, kv);
    tera_config_set(&cfg, "logging.trace_steps=0:100000");
    if (threads > 0) cfg.training.threads = threads;
    cfg.training.steps = steps + 1;
    if (tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_monitoring: %s\n", tera_last_error());
        return 1;
    }
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) {
        fprintf(stderr, "bench_monitoring: %s\n", tera_last_error());
        return 1;
    }
    tera_step_result r;
    double *st = tera_malloc(sizeof(double) * (size_t)steps);
    TERA_ASSERT(tera_trainer_step(&tr, &r) == TERA_OK); /* warm-up */
    const int64_t ev0 = tera_trace_recorded();
    for (int s = 0; s < steps; s++) {
        TERA_ASSERT(tera_trainer_step(&tr, &r) == TERA_OK);
        st[s] = r.seconds;
    }
    const double events_per_step = (double)(tera_trace_recorded() - ev0) / steps;
    const double step_s = median(st, steps);
    double *t = tera_malloc(sizeof(double) * (size_t)reps);
    for (int i = 0; i < reps; i++) {
        const double t0 = tera_now();
        tera_metrics_http_publish(tr.log.http, &tr, &r);
        t[i] = tera_now() - t0;
    }
    const double publish = median(t, reps);
    for (int i = 0; i < reps; i++) {
        const double t0 = tera_now();
        tera_tensorboard_step(tr.log.tb, &tr, &r);
        t[i] = tera_now() - t0;
    }
    const double tb = median(t, reps);
    for (int i = 0; i < reps; i++) {
        const double t0 = tera_now();
        tera_hw_sample(0.0);
        t[i] = tera_now() - t0;
    }
    const double hw = median(t, reps);
    const size_t cap = 1 << 20;
    char *text = tera_malloc(cap);
    size_t text_len = 0;
    for (int i = 0; i < reps; i++) {
        const double t0 = tera_now();
        text_len = tera_metrics_http_render(tr.log.http, text, cap);
        t[i] = tera_now() - t0;
    }
    const double render = median(t, reps);
    /* the timeline: one step's events into a fresh ring (the trainer's own is stopped first) */
    tera_trace_stop();
    const int ne = (int)(events_per_step + 0.5);
    const int trace_reps = reps < 50 ? reps : 50; /* each rep maps a fresh ring */
    for (int i = 0; i < trace_reps; i++) {
        tera_logging_config lc = cfg.logging;
        TERA_ASSERT(tera_trace_start(&lc, cfg.model.n_layers, 0, 1) == TERA_OK);
        tera_trace_step_begin(0);
        const double t0 = tera_now();
        for (int e = 0; e < ne; e++) tera_trace_event(TERA_TRACE_COMPUTE, "op", "op", t0, t0, -1);
        t[i] = tera_now() - t0;
        tera_trace_stop();
    }
    const double trace = median(t, trace_reps);
    const double hw_per_step = hw * (step_s < 1.0 ? step_s : 1.0);
    const double total = publish + tb + hw_per_step + trace;
    printf("{\"bench\": \"monitoring_direct\", \"config\": \"%s\", \"threads\": %d, \"step_ms_median\": %.2f, "
           "\"publish_us\": %.2f, \"tensorboard_us\": %.2f, \"hw_sample_us\": %.2f, \"hw_per_step_us\": %.2f, "
           "\"trace_events_per_step\": %.0f, \"trace_us_per_step\": %.2f, \"step_thread_us\": %.2f, "
           "\"step_fraction\": %.3g, \"scrape_render_us\": %.2f, \"scrape_bytes\": %zu, \"reps\": %d}\n",
           cfg_path, cfg.training.threads, 1e3 * step_s, 1e6 * publish, 1e6 * tb, 1e6 * hw, 1e6 * hw_per_step,
           events_per_step, 1e6 * trace, 1e6 * total, total / step_s, 1e6 * render, text_len, reps);
    free(t);
    free(st);
    free(text);
    tera_trainer_free(&tr);
    tera_comm_finalize();
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_monitoring: could not remove %s\n", dir);
    return 0;
}
