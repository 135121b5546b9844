/* The LM head's vocabulary split over two pipeline stages (parallel.pp_head_split; private to
 * src/model, driven by the pipeline executor through include/tera/model.h).
 *
 * With a pipeline the last stage runs the LM head and the cross-entropy on top of its layers, a
 * layer's worth of work or more, while the first stage's extra is the embedding (a lookup). The
 * split moves half of the head to the first stage, the idea of vocabulary parallelism in pipeline
 * schedules, without moving its ownership. With tensor parallelism (tp ranks) each of the last stage's
 * tp ranks owns its vocabulary slice [r Vl, (r + 1) Vl) (Vl = V / tp) and pairs with the first stage's
 * tp rank r; everything below is per pair, with Vh = Vl / 2:
 *   - the owner (the last stage) keeps the head's parameters, gradient, optimizer state and
 *     checkpoint; at each step's start it sends its slice's first Vh rows of the weight to the
 *     helper (the first stage), which keeps that copy and the rows' gradient;
 *   - in a training forward the owner sends the final norm's output [N, D] to the helper before its
 *     own product; each computes its rows' logits, and the cross-entropy meets over the vocabulary
 *     as over a tensor-parallel group (the rows' maxima, then their sums of exponentials and target
 *     logits; the gradient over the logits written in the same pass) in three messages each way: the
 *     helper sends its partials, the owner adds them to its own (the helper's first), sums over its
 *     tensor-parallel group if any, and sends the results back (tp_layers.c, tera_tp_init_pair);
 *   - each computes its partial input gradient and its rows' weight gradient; the helper sends its
 *     input gradient to the owner, which adds it before its group's sum and goes on with its backward;
 *     the helper's weight gradient accumulates over the step's micro-batches and goes to the owner's
 *     first Vh rows after the last.
 * With tp = 1 the sums of two are those of an all-reduce over the pair (bit for bit what the split
 * computed before tensor parallelism could join it). The helper never takes part in a collective, so
 * the first stage's tp ranks need not agree on when they serve: each serves its own owner. It serves
 * a micro-batch in three phases (the logits and their maxima; the sums once the maxima over the
 * vocabulary are in; the gradients once the sums are in), one whenever the message it waits for has
 * arrived (tera_head_split_ready), also while it waits for its own neighbours (src/parallel/pipeline.c).
 * With tp = 1 no other rank of its stage can wait for it, so it waits for the owner's answers inside
 * one serve (no turn around the executor between the phases); with tp > 1 it must not (a tp rank of its stage
 * may be waiting for it in a collective while its owner waits for another helper), so serve returns
 * after each phase. The owner's schedule must run each micro-batch's backward of the last chunk right
 * after its forward (1F1B and interleaved do; GPipe does not and is refused by the config). Evaluation (an
 * unarmed forward) runs the whole head on the owner as before. */
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
    tera_tp tp;           /* owner: its tensor-parallel group with the pair (tera_tp_init_pair), rows [v0 + Vh, v0 + Vl) */
    int64_t Vh, D, N;     /* Vh: half of a tensor-parallel rank's vocabulary slice (V / 2 with tp = 1) */
    int64_t v0;           /* the slice's first vocabulary row: the helper's rows are [v0, v0 + Vh) */
    int micro_batches;    /* of the current step */
    int next;             /* helper: the next micro-batch to serve */
    int armed;            /* owner: the last forward went through the split (its backward does too) */
    /* helper */
    int phase;            /* of the micro-batch being served: 0 its input, 1 the maxima, 2 the sums awaited */
    int blocking;         /* tp = 1: the phases in one serve, waiting for the owner between them */
    float *w, *g;         /* [Vh, D] the helper's rows of the head's weight (the owner's copy) and their gradient */
    float *h;             /* [N, D] the owner's final-norm output of the micro-batch being served */
    float *dh;            /* [N, D] the partial input gradient */
    float *logits;        /* [N, Vh] logits of the helper's rows, then their exponentials, then their gradient */
    float *mx, *gmx;      /* [N] the rows' maxima: the helper's, then over the vocabulary (from the owner) */
    float *st, *gst;      /* [2N] sums of exponentials and target logits: the helper's, then the whole (from the owner) */
    tera_comm_req w_req, h_req, g_req, m_req, s_req, mx_send, st_send, dh_send;
    tera_wgrad_queue *wq; /* parallel.pp_defer_wgrad: the rows' weight gradients wait (NULL: computed at once) */
    int g_due;            /* every micro-batch served, the gradient still to send once wq is empty */
    /* owner */
    tera_comm_req w_send, h_send, g_recv;
    int64_t bytes;        /* what the module allocated */
} tera_head_split;

/* role, the pair's group, the model's tensor-parallel layers mtp (its backend, group, ranks, sequence parallelism,
 * overlap, rows N and width D; its vocabulary slice [v0, v0 + Vl), Vl even), the helper's deferral entries */
tera_head_split *tera_head_split_create(int role, tera_comm *group, const tera_tp *mtp, int defer);
void tera_head_split_destroy(tera_head_split *hs);
/* The bytes create allocates for a role (0 for none) with vocabulary V over tp ranks (sp: sequence parallelism):
 * what the planner counts. */
int64_t tera_head_split_bytes(int role, int64_t V, int64_t D, int64_t N, int tp, int sp);

/* A step's start: the owner sends its weight rows [0, Vh) (w: the head's [V, D]) and posts the
 * receive of the helper's gradient into g's rows [0, Vh); the helper posts the matching receive and
 * that of the first micro-batch's input. */
void tera_head_split_begin(tera_head_split *hs, const float *w, float *g, int micro_batches);
/* Helper: the micro-batch being served if the message its next phase needs has arrived, else -1 (also when none
 * is due). */
int tera_head_split_ready(tera_head_split *hs);
/* Helper: the request that message arrives by (NULL when none is due or it is in). */
tera_comm_req *tera_head_split_pending(tera_head_split *hs);
/* Helper: runs the next phase of the micro-batch being served (its message arrived; tp = 1: every phase, waiting
 * for the owner between them): the rows' logits and maxima; the sums of exponentials with the gradient scale
 * ce_scale; the logits' gradient, the partial input gradient sent to the owner, the rows' weight gradient stored
 * (first micro-batch) or added (or queued). After the last micro-batch's, sends the weight gradient. */
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
