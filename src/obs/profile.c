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

const char *tera_prof_name(int op) { return op >= 0 && op < TERA_PROF_COUNT ? g_names[op] : "?"; }

void tera_trace_prof(int op, double t0, double t1) {
    tera_trace_event(TERA_TRACE_COMPUTE, g_names[op], op == TERA_PROF_TP_COMM ? "tp" : "op", t0, t1, -1);
}
