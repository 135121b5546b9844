/* The pipeline executor (src/parallel/pipeline.c): runs a schedule (include/tera/schedule.h) on
 * this rank's stage of a model split into virtual stages. It knows the model (this stage's
 * layers), the stages' communicator and two hooks; it does not know the trainer, so it runs in a
 * test with nothing else (tests/test_pipeline.c). */
#ifndef TERA_PIPELINE_H
#define TERA_PIPELINE_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/model.h"
#include "tera/status.h"

typedef struct tera_pipe tera_pipe;

typedef struct {
    tera_model *model;        /* this stage's layers: layer_first[S + 1], par.v chunks, n_slots slots */
    struct tera_comm *group;  /* the stages of one pipeline, comm rank = stage */
    int stage, stages;        /* this stage (pp_rank), pp */
    int micro_batches;        /* per step (m) */
    int micro_batch, seq_len; /* B, T of one micro-batch */
    const char *schedule;     /* parallel.pp_schedule */
    /* Reads micro-batch `micro` (0 .. m-1) of the current step into tokens / targets [B*T]; returns
     * the seconds it took. Every stage reads it (stage 0 embeds, the last stage needs targets). */
    double (*load)(void *ctx, int micro, int32_t *tokens, int32_t *targets);
    /* Optional (NULL: none). Before each operation: its last layer in the order of use (forward: the
     * chunk's last, backward: its first) and the first layer of the next operation (-1: none), for
     * ZeRO-3's prefetch. */
    void (*plan)(void *ctx, int last, int next);
    void *ctx;
} tera_pipe_env;

/* Activation slots a stage needs (before the model exists): the schedule's peak of micro-batches in
 * flight on `stage`; fails if the schedule cannot be built or deadlocks. */
tera_status tera_pipe_slots(const char *schedule, int stages, int stage, int micro_batches, int chunks, int *slots);
/* The executor for env (copied); the model must have been created with n_slots >= tera_pipe_slots. */
tera_status tera_pipe_create(const tera_pipe_env *env, tera_pipe **out);
/* Waits for every send in flight, then frees. NULL: no-op. */
void tera_pipe_destroy(tera_pipe *p);
/* Runs the step's A (= micro_batches) micro-batches through the schedule: sums[3] += cross-entropy,
 * aux, z sums of this stage's layers; counts[2] += assignments, dropped; data_s += reading time.
 * grad_ready(grad_ctx, ...) is the model's gradient callback during each backward (final_only:
 * only during a chunk's last micro-batch). */
void tera_pipe_step(tera_pipe *p, const tera_loss_scales *s, int A, double *sums, int64_t *counts, double *data_s,
                    void (*grad_ready)(void *, int64_t, int64_t), void *grad_ctx, int final_only);
/* One evaluation micro-batch (tokens, targets [B*T]) through the stages in turn: the cross-entropy
 * sum and positions on the last stage (0 elsewhere). */
double tera_pipe_eval(tera_pipe *p, const int32_t *tokens, const int32_t *targets, double *positions);
/* The parameter groups this stage's schedule uses in one step, in order (forward: the embedding on
 * the first stage, its layers, the head on the last; backward: the head, its layers descending):
 * writes at most max, returns the count. */
int tera_pipe_param_uses(const tera_pipe *p, int *uses, int max);
/* Mean seconds per step of this stage: running operations, waiting for neighbours, the whole step
 * (0 before the first step or for NULL). */
void tera_pipe_times(const tera_pipe *p, double *busy, double *wait, double *step);
/* The last step's seconds of this stage running operations and waiting (0 before the first step). */
void tera_pipe_last(const tera_pipe *p, double *busy, double *wait);
/* parallel.pp_defer_wgrad: mean seconds per step of this stage's deferred weight-gradient products run
 * while it waited for a neighbour, and at the step's end, and how many of each over the steps (0
 * without them, before the first step, NULL; the counts' pointers may be NULL). */
void tera_pipe_deferred(const tera_pipe *p, double *in_waits, double *at_end, int64_t *n_waits, int64_t *n_end);
/* Starts those means again from the next step (tera bench: the timed steps only; NULL: nothing). */
void tera_pipe_times_reset(tera_pipe *p);

#endif
