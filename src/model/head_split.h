/* The LM head's vocabulary split over two pipeline stages (parallel.pp_head_split; private to
 * src/model, driven by the pipeline executor through include/tera/model.h).
 *
 * With a pipeline the last stage runs the LM head and the cross-entropy on top of its layers, a
 * layer's worth of work or more, while the first stage's extra is the embedding (a lookup). The
 * split moves half of the head to the first stage, the idea of vocabulary parallelism in pipeline
 * schedules, without moving its ownership:
 *   - the owner (the last stage) keeps the head's parameters, gradient, optimizer state and
 *     checkpoint; at each step's start it sends rows [0, Vh) of the weight (Vh = V / 2) to the
 *     helper (the first stage), which keeps that copy and the rows' gradient;
 *   - in a training forward the owner sends the final norm's output [N, D] to the helper before its
 *     own product; each computes its rows' logits, and the cross-entropy meets over the pair exactly
 *     as over a tensor-parallel group (the rows' maxima, then their sums of exponentials and target
 *     logits: tp_layers.c on a group of two, so the same code and bits as tp = 2's head); the
 *     gradient over the logits is written in the same pass;
 *   - each computes its partial input gradient and its rows' weight gradient; the input gradient is
 *     summed over the pair (the owner's backward goes on with it); the helper's weight gradient
 *     accumulates over the step's micro-batches and goes to the owner's rows [0, Vh) after the last.
 * The pair's collectives for a micro-batch are the forward's two sums then the backward's one, so
 * the owner's schedule must run each micro-batch's backward of the last chunk right after its
 * forward (1F1B and interleaved do; GPipe does not and is refused by the config). The helper serves
 * the micro-batches in order whenever the owner's input has arrived, also while it waits for its
 * own neighbours (src/parallel/pipeline.c). Evaluation (an unarmed forward) runs the whole head on
 * the owner as before. */
#ifndef TERA_MODEL_HEAD_SPLIT_H
#define TERA_MODEL_HEAD_SPLIT_H

#include <stdint.h>

#include "tera/backend.h"
#include "tera/comm.h"
#include "tp_layers.h"
#include "wgrad.h"

enum { TERA_HS_HELPER = 1, TERA_HS_OWNER = 2 };

typedef struct tera_head_split {
    int role;             /* TERA_HS_HELPER or TERA_HS_OWNER */
    tera_comm *group;     /* the pair: helper rank 0, owner rank 1 (not owned) */
    tera_tp tp;           /* the pair as a vocabulary-parallel group: helper rows [0, Vh), owner [Vh, V) */
    int64_t V, Vh, D, N;
    int micro_batches;    /* of the current step */
    int next;             /* helper: the next micro-batch to serve */
    int armed;            /* owner: the last forward went through the split (its backward does too) */
    /* helper */
    float *w, *g;         /* [Vh, D] rows [0, Vh) of the head's weight (the owner's copy) and their gradient */
    float *h;             /* [N, D] the owner's final-norm output of the micro-batch being served */
    float *dh;            /* [N, D] the partial input gradient */
    float *logits;        /* [N, Vh] logits of rows [0, Vh), then their gradient */
    float *lse;           /* [N] */
    tera_comm_req w_req, h_req, g_req;
    tera_wgrad_queue *wq; /* parallel.pp_defer_wgrad: the rows' weight gradients wait (NULL: computed at once) */
    int g_due;            /* every micro-batch served, the gradient still to send once wq is empty */
    /* owner */
    tera_comm_req w_send, h_send, g_recv;
    int64_t bytes;        /* what the module allocated */
} tera_head_split;

/* role, the pair's group, the backend, vocabulary V (even), width D, rows N of a micro-batch */
tera_head_split *tera_head_split_create(int role, tera_comm *group, tera_backend *be, int64_t V, int64_t D, int64_t N,
                                        int defer);
void tera_head_split_destroy(tera_head_split *hs);
/* The bytes create allocates for a role (0 for none): what the planner counts. */
int64_t tera_head_split_bytes(int role, int64_t V, int64_t D, int64_t N);

/* A step's start: the owner sends its weight rows [0, Vh) (w: the head's [V, D]) and posts the
 * receive of the helper's gradient into g's rows [0, Vh); the helper posts the matching receive and
 * that of the first micro-batch's input. */
void tera_head_split_begin(tera_head_split *hs, const float *w, float *g, int micro_batches);
/* Helper: the next micro-batch to serve if its input has arrived, else -1 (also when none is due). */
int tera_head_split_ready(tera_head_split *hs);
/* Helper: the request the next micro-batch's input arrives by (NULL when none is due or it is in). */
tera_comm_req *tera_head_split_pending(tera_head_split *hs);
/* Helper: serves the next micro-batch (its input arrived): the rows' logits, the cross-entropy over
 * the pair with the gradient scale ce_scale, the input gradient summed over the pair, the rows'
 * weight gradient stored (first micro-batch) or added; after the last, sends the gradient. */
void tera_head_split_serve(tera_head_split *hs, tera_backend *be, const int32_t *targets, float ce_scale);
/* Owner, a training forward: sends the final norm's output lnf [N, D] to the helper. */
void tera_head_split_send_input(tera_head_split *hs, const float *lnf);
/* Owner, the backward: the helper's gradient is in (before the head's gradients are handed on). */
void tera_head_split_grads_in(tera_head_split *hs);
/* The step's end: every transfer of the pair complete. */
void tera_head_split_end(tera_head_split *hs);
/* Helper with defer (parallel.pp_defer_wgrad) entries: _work computes the oldest deferred weight
 * gradient (1; 0: none queued) and sends the rows' gradient to the owner once the step's last is done;
 * _finish computes every one left (returns how many) and sends it. Elsewhere: nothing. */
int tera_head_split_work(tera_head_split *hs);
int tera_head_split_finish(tera_head_split *hs);

#endif
