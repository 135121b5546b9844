/* tera schedule: print a pipeline schedule and its simulated bubble and activation footprint. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tera/schedule.h"

int tera_cmd_schedule(int argc, char **argv) {
    const char *kind_s = "1f1b";
    int pp = 4, m = 8, v = 2;
    for (int i = 0; i + 1 < argc; i += 2) {
        const char *k = argv[i], *val = argv[i + 1];
        char *end;
        long n = strtol(val, &end, 10);
        if (!strcmp(k, "--kind")) {
            kind_s = val;
            continue;
        }
        if (*end || n < 1 || n > 4096) {
            tera_fail(TERA_ERR_ARG, "%s '%s' is not an integer in 1..4096", k, val);
            return tera_cli_error();
        }
        if (!strcmp(k, "--pp")) pp = (int)n;
        else if (!strcmp(k, "--micro")) m = (int)n;
        else if (!strcmp(k, "--chunks")) v = (int)n;
        else {
            tera_fail(TERA_ERR_ARG, "unknown option '%s' (--kind gpipe|1f1b|interleaved --pp P --micro M --chunks V)", k);
            return tera_cli_error();
        }
    }
    if (argc % 2) {
        tera_fail(TERA_ERR_ARG, "option '%s' needs a value", argv[argc - 1]);
        return tera_cli_error();
    }
    /* the grid printed holds about 2 x pp x micro x chunks operations (24 bytes each, a line per
     * rank): bounded, so that options each within 1..4096 cannot ask for terabytes */
    if ((int64_t)pp * m * v > (1 << 20)) {
        tera_fail(TERA_ERR_ARG, "--pp %d x --micro %d x --chunks %d = %lld is more than 1048576 (the schedule printed "
                  "would be too large to read)", pp, m, v, (long long)pp * m * v);
        return tera_cli_error();
    }
    tera_sched_kind kind;
    tera_schedule s;
    if (tera_sched_kind_parse(kind_s, &kind) != TERA_OK || tera_schedule_build(&s, kind, pp, m, v) != TERA_OK)
        return tera_cli_error();
    tera_schedule_print(stdout, &s);
    tera_sched_stats st;
    const double scale = s.v > 1 ? 1.0 / s.v : 1.0; /* a chunk holds 1/v of a stage's layers */
    if (tera_schedule_simulate(&s, 1.0 * scale, 2.0 * scale, &st) != TERA_OK) {
        tera_schedule_free(&s);
        return tera_cli_error();
    }
    printf("simulated (backward = 2 x forward): bubble %.4f, formula (p-1)/(%sm+p-1) = %.4f, makespan %.2f "
           "forward-stage units, peak micro-batches in flight: %d (rank 0)\n",
           st.bubble, s.v > 1 ? "v*" : "", st.bubble_theory, st.makespan, st.peak_in_flight_rank[0]);
    tera_schedule_free(&s);
    return 0;
}
