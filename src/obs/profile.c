#include "tera/profile.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tera/trace.h"

double tera_prof_seconds[TERA_PROF_COUNT];
int64_t tera_prof_calls[TERA_PROF_COUNT];

static const char *const g_names[TERA_PROF_COUNT] = {
#define TERA_PROF_NAME(id, name) name,
    TERA_PROF_OPS(TERA_PROF_NAME)
#undef TERA_PROF_NAME
};

void tera_prof_reset(void) {
    memset(tera_prof_seconds, 0, sizeof tera_prof_seconds);
    memset(tera_prof_calls, 0, sizeof tera_prof_calls);
}

static int by_time_desc(const void *a, const void *b) {
    double x = tera_prof_seconds[*(const int *)a], y = tera_prof_seconds[*(const int *)b];
    return (x < y) - (x > y);
}

void tera_prof_print(FILE *f, int steps) {
    int order[TERA_PROF_COUNT];
    double total = 0.0;
    for (int i = 0; i < TERA_PROF_COUNT; i++) {
        order[i] = i;
        total += tera_prof_seconds[i];
    }
    qsort(order, TERA_PROF_COUNT, sizeof(int), by_time_desc);
    if (steps < 1) steps = 1;
    fprintf(f, "per-operation profile (%d steps, %.1f ms/step measured inside ops)\n", steps,
            1e3 * total / steps);
    fprintf(f, "  %-24s %10s %7s\n", "operation", "ms/step", "share");
    for (int i = 0; i < TERA_PROF_COUNT; i++) {
        int op = order[i];
        if (tera_prof_calls[op] == 0) continue;
        fprintf(f, "  %-24s %10.2f %6.1f%%\n", g_names[op], 1e3 * tera_prof_seconds[op] / steps,
                total > 0 ? 100.0 * tera_prof_seconds[op] / total : 0.0);
    }
}

/* sec, calls: [world][TERA_PROF_COUNT]; rows sorted by their largest rank */
static const double *g_rank_max;
static int by_rank_max_desc(const void *a, const void *b) {
    double x = g_rank_max[*(const int *)a], y = g_rank_max[*(const int *)b];
    return (x < y) - (x > y);
}

void tera_prof_print_ranks(FILE *f, int steps, int world, const double *sec, const double *calls) {
    int order[TERA_PROF_COUNT];
    double mx[TERA_PROF_COUNT];
    if (steps < 1) steps = 1;
    for (int i = 0; i < TERA_PROF_COUNT; i++) {
        order[i] = i, mx[i] = -1.0;
        for (int r = 0; r < world; r++)
            if (calls[(int64_t)r * TERA_PROF_COUNT + i] > 0 && sec[(int64_t)r * TERA_PROF_COUNT + i] > mx[i])
                mx[i] = sec[(int64_t)r * TERA_PROF_COUNT + i];
    }
    g_rank_max = mx;
    qsort(order, TERA_PROF_COUNT, sizeof(int), by_rank_max_desc);
    const int cols = world <= 8; /* a column per rank, or the smallest, mean and largest */
    fprintf(f, "per-operation profile by rank (ms/step, %d steps)\n  %-24s", steps, "operation");
    if (cols)
        for (int r = 0; r < world; r++) fprintf(f, " %7s%d", "rank ", r);
    else
        fprintf(f, " %8s %8s %8s", "min", "mean", "max");
    fprintf(f, "\n");
    for (int k = 0; k < TERA_PROF_COUNT; k++) {
        const int op = order[k];
        if (mx[op] < 0.0) continue; /* no rank ran it */
        fprintf(f, "  %-24s", g_names[op]);
        double lo = 1e300, sum = 0.0;
        for (int r = 0; r < world; r++) {
            const double ms = 1e3 * sec[(int64_t)r * TERA_PROF_COUNT + op] / steps;
            if (cols) fprintf(f, " %8.2f", ms);
            lo = ms < lo ? ms : lo, sum += ms;
        }
        if (!cols) fprintf(f, " %8.2f %8.2f %8.2f", lo, sum / world, 1e3 * mx[op] / steps);
        fprintf(f, "\n");
    }
}

const char *tera_prof_name(int op) { return op >= 0 && op < TERA_PROF_COUNT ? g_names[op] : "?"; }

void tera_trace_prof(int op, double t0, double t1) {
    tera_trace_event(TERA_TRACE_COMPUTE, g_names[op], op == TERA_PROF_TP_COMM ? "tp" : "op", t0, t1, -1);
}
