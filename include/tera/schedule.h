/* Pipeline schedules as data: for each pipeline stage (rank), the ordered list of forward and
 * backward operations it runs. Built by pure functions, checked and measured by a simulator, run
 * by one executor (the pipeline issue). Kinds: GPipe (all forwards, then all backwards),
 * 1F1B / PipeDream-Flush, and interleaved 1F1B with v virtual stages (model chunks) per rank. */
#ifndef TERA_SCHEDULE_H
#define TERA_SCHEDULE_H

#include <stdio.h>

#include "tera/status.h"

typedef enum { TERA_SCHED_GPIPE, TERA_SCHED_1F1B, TERA_SCHED_INTERLEAVED } tera_sched_kind;
typedef enum { TERA_OP_FWD, TERA_OP_BWD } tera_op_kind;

typedef struct {
    tera_op_kind kind;
    int micro;          /* micro-batch index, 0 .. m-1 */
    int chunk;          /* model chunk on this rank, 0 .. v-1; virtual stage = chunk * pp + rank */
} tera_sched_op;

typedef struct {
    tera_sched_kind kind;
    int pp, m, v;       /* stages (ranks), micro-batches, chunks per rank (1 unless interleaved) */
    int n_ops;          /* per rank: 2 * m * v */
    tera_sched_op *ops; /* [pp][n_ops] */
} tera_schedule;

/* Builds a schedule. Interleaved needs v >= 2 and m a multiple of pp; the others take v = 1. */
tera_status tera_schedule_build(tera_schedule *s, tera_sched_kind kind, int pp, int m, int v);
void tera_schedule_free(tera_schedule *s);
/* Whether the last rank runs, for micro-batches 0, 1, ..., m-1 in that order, each one's forward of
 * the last virtual stage immediately followed by its backward there (1F1B and interleaved: 1; GPipe
 * with m > 1: 0). parallel.pp_head_split needs it: the head's sums over the first and last stage come
 * in that order on both (src/model/head_split.h). */
int tera_schedule_head_adjacent(const tera_schedule *s);
const tera_sched_op *tera_schedule_rank(const tera_schedule *s, int rank);
tera_status tera_sched_kind_parse(const char *name, tera_sched_kind *kind); /* gpipe | 1f1b | interleaved */
const char *tera_sched_kind_name(tera_sched_kind kind);

typedef struct {
    double makespan;      /* time from the first forward to the last backward */
    double bubble;        /* 1 - busy time / (pp * makespan) */
    double bubble_theory; /* (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved, for tb = tf * 2 */
    int peak_in_flight;   /* the most micro-batches any rank holds activations for at once */
    int peak_in_flight_rank[64]; /* per rank (first 64) */
} tera_sched_stats;

/* Runs the schedule with forward cost tf and backward cost tb per virtual stage, every operation
 * starting when its rank is free and its inputs exist (the forward of the same micro-batch on the
 * previous virtual stage; for a backward, its own forward and the backward on the next virtual
 * stage). Fails with TERA_ERR_NUMERIC naming the stuck operations if the order deadlocks, and
 * checks that every micro-batch is run forward then backward exactly once per virtual stage. */
tera_status tera_schedule_simulate(const tera_schedule *s, double tf, double tb, tera_sched_stats *st);
/* One line per rank: F3.1 = forward of micro-batch 3 on chunk 1 (chunk shown when v > 1). */
void tera_schedule_print(FILE *f, const tera_schedule *s);

#endif
