/* Deferred weight gradients (parallel.pp_defer_wgrad; private to src/model).
 *
 * A linear layer's backward is two products: the input gradient dx = dy w, which the layer below
 * needs now, and the weight gradient gw (+)= dy^T x, which nothing needs before the optimizer. In a
 * pipeline the stages wait for one another (the schedule's bubble, the cool-down at a step's end),
 * so the second product can wait for such a gap instead of holding up the first: the idea of the
 * zero-bubble schedules' separate W pass, applied here to the LM head's product, the largest one of
 * a step's last stage (and of the head split's first stage: head_split.h).
 *
 * The queue keeps up to cap such products in arrival order (first in, first out: each destination
 * gets its micro-batches' terms in the order the undeferred backward adds them, so the same bits).
 * It owns their operands: push swaps the caller's dy buffer for one of the queue's (no copy; the
 * caller's next forward writes the fresh one) and copies x. When it is full, push first runs the
 * oldest. */
#ifndef TERA_MODEL_WGRAD_H
#define TERA_MODEL_WGRAD_H

#include <stdint.h>

#include "tera/backend.h"

typedef struct tera_wgrad_item {
    float *gw;             /* [V, D] the destination (not owned) */
    int64_t V;             /* its rows (<= the queue's V) */
    float beta;            /* 0: stored (the step's first term), 1: added */
} tera_wgrad_item;

typedef struct tera_wgrad_queue {
    tera_backend *be;      /* not owned */
    int cap, first, count; /* a ring of cap entries, count of them queued from first */
    int64_t N, D, V;       /* rows, input width, the widest output */
    float **dy, **x;       /* [cap] each: [N, V] and [N, D] buffers (dy's change hands in push) */
    tera_wgrad_item *item; /* [cap] */
    float *block;          /* the buffers' one allocation */
    int64_t bytes;         /* what the queue allocated */
    double run_s;          /* seconds its products ran (the caller's accounting) */
} tera_wgrad_queue;

/* cap >= 1 entries of dy [N, V] and x [N, D] */
tera_wgrad_queue *tera_wgrad_create(tera_backend *be, int cap, int64_t N, int64_t D, int64_t V);
void tera_wgrad_destroy(tera_wgrad_queue *q);
int64_t tera_wgrad_bytes(int cap, int64_t N, int64_t D, int64_t V);

/* Queues gw (+)= dy^T x: *dy [N, Vrows] (the caller's buffer of [N, V] floats) changes hands with
 * one of the queue's; x [N, D] is copied. */
void tera_wgrad_push(tera_wgrad_queue *q, float **dy, const float *x, float *gw, int64_t Vrows, float beta);
/* Runs the oldest queued product; 0 when none was queued. */
int tera_wgrad_run(tera_wgrad_queue *q);
int tera_wgrad_flush(tera_wgrad_queue *q); /* runs every queued product; returns how many */
static inline int tera_wgrad_queued(const tera_wgrad_queue *q) { return q ? q->count : 0; }

#endif
