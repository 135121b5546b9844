/* Pipeline schedule builders and the simulator that checks and measures them. */
#include "tera/schedule.h"

#include <math.h>
#include <string.h>

const char *tera_sched_kind_name(tera_sched_kind k) {
    switch (k) {
    case TERA_SCHED_GPIPE: return "gpipe";
    case TERA_SCHED_1F1B: return "1f1b";
    case TERA_SCHED_INTERLEAVED: return "interleaved";
    }
    return "?";
}

tera_status tera_sched_kind_parse(const char *name, tera_sched_kind *kind) {
    for (int k = 0; k < 3; k++)
        if (!strcmp(name, tera_sched_kind_name((tera_sched_kind)k))) {
            *kind = (tera_sched_kind)k;
            return TERA_OK;
        }
    return tera_fail(TERA_ERR_ARG, "schedule '%s' is not one of: gpipe, 1f1b, interleaved", name);
}

const tera_sched_op *tera_schedule_rank(const tera_schedule *s, int rank) { return s->ops + (size_t)rank * s->n_ops; }

static void put(tera_sched_op *ops, int *n, tera_op_kind k, int micro, int chunk) {
    ops[(*n)++] = (tera_sched_op){k, micro, chunk};
}

/* GPipe: every forward, then every backward (in the same micro-batch order). */
static void build_gpipe(tera_sched_op *ops, int m) {
    int n = 0;
    for (int i = 0; i < m; i++) put(ops, &n, TERA_OP_FWD, i, 0);
    for (int i = 0; i < m; i++) put(ops, &n, TERA_OP_BWD, i, 0);
}

/* 1F1B (PipeDream-Flush): p-r-1 warm-up forwards, then one forward / one backward, then the
 * remaining backwards: a rank holds at most p - r micro-batches. */
static void build_1f1b(tera_sched_op *ops, int pp, int m, int r) {
    int warm = pp - r - 1;
    if (warm > m) warm = m;
    int n = 0, f = 0, b = 0;
    for (; f < warm; f++) put(ops, &n, TERA_OP_FWD, f, 0);
    while (f < m) {
        put(ops, &n, TERA_OP_FWD, f++, 0);
        put(ops, &n, TERA_OP_BWD, b++, 0);
    }
    while (b < m) put(ops, &n, TERA_OP_BWD, b++, 0);
}

/* Interleaved 1F1B (Megatron-LM's virtual pipeline): the k-th forward of a rank runs chunk
 * (k / p) % v of micro-batch (k / (p v)) p + k % p; backwards walk the chunks in reverse. */
static void interleaved_op(int k, int pp, int v, int backward, int *micro, int *chunk) {
    int group = k % (pp * v);
    int c = group / pp;
    *chunk = backward ? v - 1 - c : c;
    *micro = (k / (pp * v)) * pp + k % pp;
}

static void build_interleaved(tera_sched_op *ops, int pp, int m, int v, int r) {
    const int total = m * v;
    int warm = (pp - r - 1) * 2 + (v - 1) * pp;
    if (warm > total) warm = total;
    int n = 0, f = 0, b = 0, micro, chunk;
    for (; f < warm; f++) {
        interleaved_op(f, pp, v, 0, &micro, &chunk);
        put(ops, &n, TERA_OP_FWD, micro, chunk);
    }
    while (f < total) {
        interleaved_op(f++, pp, v, 0, &micro, &chunk);
        put(ops, &n, TERA_OP_FWD, micro, chunk);
        interleaved_op(b++, pp, v, 1, &micro, &chunk);
        put(ops, &n, TERA_OP_BWD, micro, chunk);
    }
    while (b < total) {
        interleaved_op(b++, pp, v, 1, &micro, &chunk);
        put(ops, &n, TERA_OP_BWD, micro, chunk);
    }
}

tera_status tera_schedule_build(tera_schedule *s, tera_sched_kind kind, int pp, int m, int v) {
    memset(s, 0, sizeof *s);
    if (pp < 1 || m < 1) return tera_fail(TERA_ERR_CONFIG, "pipeline: stages (%d) and micro-batches (%d) must be >= 1", pp, m);
    if (kind == TERA_SCHED_INTERLEAVED) {
        if (v < 2) return tera_fail(TERA_ERR_CONFIG, "interleaved schedule: virtual stages per rank must be >= 2 (got %d)", v);
        if (m % pp != 0)
            return tera_fail(TERA_ERR_CONFIG, "interleaved schedule: micro-batches (%d) must be a multiple of the stages (%d)", m, pp);
    } else {
        v = 1;
    }
    s->kind = kind;
    s->pp = pp;
    s->m = m;
    s->v = v;
    s->n_ops = 2 * m * v;
    s->ops = tera_malloc(sizeof(tera_sched_op) * (size_t)pp * (size_t)s->n_ops);
    for (int r = 0; r < pp; r++) {
        tera_sched_op *o = s->ops + (size_t)r * s->n_ops;
        if (kind == TERA_SCHED_GPIPE) build_gpipe(o, m);
        else if (kind == TERA_SCHED_1F1B) build_1f1b(o, pp, m, r);
        else build_interleaved(o, pp, m, v, r);
    }
    return TERA_OK;
}

int tera_schedule_head_adjacent(const tera_schedule *s) {
    const tera_sched_op *ops = tera_schedule_rank(s, s->pp - 1);
    int want = 0; /* the next micro-batch whose head comes */
    for (int k = 0; k < s->n_ops; k++) {
        if (ops[k].kind != TERA_OP_FWD || ops[k].chunk != s->v - 1) continue;
        if (ops[k].micro != want++ || k + 1 >= s->n_ops || ops[k + 1].kind != TERA_OP_BWD ||
            ops[k + 1].micro != ops[k].micro || ops[k + 1].chunk != s->v - 1)
            return 0;
    }
    return want == s->m;
}

void tera_schedule_free(tera_schedule *s) {
    free(s->ops);
    memset(s, 0, sizeof *s);
}

/* ----------------------------------------------------------------------------- simulation */

tera_status tera_schedule_simulate(const tera_schedule *s, double tf, double tb, tera_sched_stats *st) {
    const int pp = s->pp, m = s->m, v = s->v, V = pp * v;
    memset(st, 0, sizeof *st);
    /* finish time of F/B of (micro, virtual stage); NAN = not run yet */
    double *fin_f = tera_malloc(sizeof(double) * (size_t)m * V), *fin_b = tera_malloc(sizeof(double) * (size_t)m * V);
    for (int i = 0; i < m * V; i++) fin_f[i] = fin_b[i] = NAN;
    int *next = tera_calloc((size_t)pp, sizeof(int));
    double *free_at = tera_calloc((size_t)pp, sizeof(double)), busy = 0.0, end = 0.0;
    int *held = tera_calloc((size_t)pp, sizeof(int));
    tera_status rc = TERA_OK;
    for (int done = 0; done < pp * s->n_ops;) {
        int progressed = 0;
        for (int r = 0; r < pp; r++) {
            while (next[r] < s->n_ops) {
                const tera_sched_op *o = tera_schedule_rank(s, r) + next[r];
                const int vs = o->chunk * pp + r, idx = o->micro * V + vs;
                double ready;
                if (o->kind == TERA_OP_FWD) {
                    if (!isnan(fin_f[idx])) {
                        rc = tera_fail(TERA_ERR_NUMERIC, "rank %d runs forward of micro-batch %d on virtual stage %d twice", r, o->micro, vs);
                        goto out;
                    }
                    ready = vs == 0 ? 0.0 : fin_f[o->micro * V + vs - 1];
                } else {
                    if (!isnan(fin_b[idx])) {
                        rc = tera_fail(TERA_ERR_NUMERIC, "rank %d runs backward of micro-batch %d on virtual stage %d twice", r, o->micro, vs);
                        goto out;
                    }
                    double own = fin_f[idx], after = vs == V - 1 ? own : fin_b[o->micro * V + vs + 1];
                    ready = isnan(own) || isnan(after) ? NAN : fmax(own, after);
                }
                if (isnan(ready)) break; /* waits for another rank */
                const double t0 = fmax(ready, free_at[r]), cost = o->kind == TERA_OP_FWD ? tf : tb;
                free_at[r] = t0 + cost;
                busy += cost;
                if (o->kind == TERA_OP_FWD) {
                    fin_f[idx] = free_at[r];
                    if (++held[r] > st->peak_in_flight_rank[r < 64 ? r : 63]) st->peak_in_flight_rank[r < 64 ? r : 63] = held[r];
                } else {
                    fin_b[idx] = free_at[r];
                    held[r]--;
                }
                if (free_at[r] > end) end = free_at[r];
                next[r]++;
                done++;
                progressed = 1;
            }
        }
        if (!progressed) {
            char msg[512];
            int n = 0;
            for (int r = 0; r < pp && n < (int)sizeof msg - 64; r++)
                if (next[r] < s->n_ops) {
                    const tera_sched_op *o = tera_schedule_rank(s, r) + next[r];
                    n += snprintf(msg + n, sizeof msg - (size_t)n, " rank %d waits at %c%d.%d;", r,
                                  o->kind == TERA_OP_FWD ? 'F' : 'B', o->micro, o->chunk);
                }
            rc = tera_fail(TERA_ERR_NUMERIC, "%s schedule deadlocks:%s", tera_sched_kind_name(s->kind), msg);
            goto out;
        }
    }
    st->makespan = end;
    st->bubble = end > 0 ? 1.0 - busy / (pp * end) : 0.0;
    st->bubble_theory = (double)(pp - 1) / ((double)v * m + pp - 1);
    for (int r = 0; r < pp && r < 64; r++)
        if (st->peak_in_flight_rank[r] > st->peak_in_flight) st->peak_in_flight = st->peak_in_flight_rank[r];
out:
    free(fin_f);
    free(fin_b);
    free(next);
    free(free_at);
    free(held);
    return rc;
}

void tera_schedule_print(FILE *f, const tera_schedule *s) {
    fprintf(f, "%s schedule: %d stages, %d micro-batches\n", tera_sched_kind_name(s->kind), s->pp, s->m);
    if (s->v > 1) fprintf(f, "(%d model chunks per rank; Fm.c = forward of micro-batch m on chunk c)\n", s->v);
    for (int r = 0; r < s->pp; r++) {
        fprintf(f, "rank %d:", r);
        const tera_sched_op *o = tera_schedule_rank(s, r);
        for (int i = 0; i < s->n_ops; i++) {
            if (s->v > 1) fprintf(f, " %c%d.%d", o[i].kind == TERA_OP_FWD ? 'F' : 'B', o[i].micro, o[i].chunk);
            else fprintf(f, " %c%d", o[i].kind == TERA_OP_FWD ? 'F' : 'B', o[i].micro);
        }
        fputc('\n', f);
    }
}
