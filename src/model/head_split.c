/* The LM head's vocabulary split over two pipeline stages (head_split.h). */
#include "head_split.h"

#include <string.h>

#include "tera/profile.h"

enum { TAG_H = 1, TAG_W = 2, TAG_G = 3 }; /* the pair's own group: no other messages share these */

/* the helper's block: w, g [Vh, D]; h, dh [N, D]; logits [N, Vh]; mx, gmx [N]; st, gst [2N] */
static int64_t helper_floats(int64_t Vh, int64_t D, int64_t N) { return 2 * Vh * D + 2 * N * D + N * Vh + 6 * N; }

int64_t tera_head_split_bytes(int role, int64_t V, int64_t D, int64_t N, int tp, int sp) {
    const int64_t Vh = V / (tp > 1 ? tp : 1) / 2;
    if (role == TERA_HS_OWNER) return tera_tp_pair_bytes(tp, N, D, sp);
    return role == TERA_HS_HELPER ? helper_floats(Vh, D, N) * (int64_t)sizeof(float) : 0;
}

tera_head_split *tera_head_split_create(int role, tera_comm *group, const tera_tp *mtp, int defer) {
    TERA_ASSERTF((role == TERA_HS_HELPER || role == TERA_HS_OWNER) && group && tera_comm_size(group) == 2 &&
                     mtp->Vl % 2 == 0,
                 "head split: role %d, a group of %d, a vocabulary slice of %ld", role,
                 group ? tera_comm_size(group) : 0, (long)mtp->Vl);
    TERA_ASSERTF(tera_comm_rank(group) == (role == TERA_HS_OWNER), "head split: the %s is rank %d of the pair",
                 role == TERA_HS_OWNER ? "owner" : "helper", tera_comm_rank(group));
    tera_head_split *hs = tera_calloc(1, sizeof *hs);
    const int64_t N = mtp->N, D = mtp->D;
    hs->role = role;
    hs->group = group;
    hs->Vh = mtp->Vl / 2, hs->D = D, hs->N = N, hs->v0 = mtp->v0;
    if (role == TERA_HS_OWNER) {
        tera_tp_init_pair(&hs->tp, mtp->be, mtp->tp, mtp->group, (int)(mtp->v0 / mtp->Vl), mtp->v0 + hs->Vh, hs->Vh,
                          N, D, mtp->sp, group);
        hs->tp.overlap = mtp->overlap;
        hs->bytes = hs->tp.bytes;
        return hs;
    }
    hs->blocking = mtp->tp == 1;
    const int64_t n = helper_floats(hs->Vh, D, N);
    hs->w = tera_calloc((size_t)n, sizeof(float)); /* one block */
    hs->g = hs->w + hs->Vh * D;
    hs->h = hs->g + hs->Vh * D;
    hs->dh = hs->h + N * D;
    hs->logits = hs->dh + N * D;
    hs->mx = hs->logits + N * hs->Vh;
    hs->gmx = hs->mx + N;
    hs->st = hs->gmx + N;
    hs->gst = hs->st + 2 * N;
    hs->bytes = n * (int64_t)sizeof(float);
    if (defer > 0) {
        hs->wq = tera_wgrad_create(mtp->be, defer, N, D, hs->Vh);
        hs->bytes += hs->wq->bytes;
    }
    return hs;
}

void tera_head_split_destroy(tera_head_split *hs) {
    if (!hs) return;
    tera_head_split_end(hs);
    tera_comm_wait(&hs->h_req);
    tera_tp_free(&hs->tp);
    tera_wgrad_destroy(hs->wq);
    free(hs->w);
    free(hs);
}

void tera_head_split_begin(tera_head_split *hs, const float *w, float *g, int micro_batches) {
    hs->micro_batches = micro_batches;
    hs->next = 0;
    hs->phase = 0;
    const int64_t n = hs->Vh * hs->D;
    if (hs->role == TERA_HS_OWNER) {
        tera_comm_isend_f32(hs->group, w, n, 0, TAG_W, &hs->w_send);
        tera_comm_irecv_f32(hs->group, g, n, 0, TAG_G, &hs->g_recv); /* rows the owner's backward leaves alone */
        return;
    }
    tera_comm_irecv_f32(hs->group, hs->w, n, 1, TAG_W, &hs->w_req);
    if (micro_batches > 0) tera_comm_irecv_f32(hs->group, hs->h, hs->N * hs->D, 1, TAG_H, &hs->h_req);
}

/* the helper: what the next phase waits for */
static tera_comm_req *awaited(tera_head_split *hs) {
    return hs->phase == 0 ? &hs->h_req : hs->phase == 1 ? &hs->m_req : &hs->s_req;
}

int tera_head_split_ready(tera_head_split *hs) {
    if (hs->role != TERA_HS_HELPER || hs->next >= hs->micro_batches) return -1;
    tera_comm_req *rq = awaited(hs);
    tera_comm_poll(rq, 1);
    return rq->active ? -1 : hs->next;
}

tera_comm_req *tera_head_split_pending(tera_head_split *hs) {
    if (hs->role != TERA_HS_HELPER || hs->next >= hs->micro_batches) return NULL;
    tera_comm_req *rq = awaited(hs);
    return rq->active ? rq : NULL;
}

/* phase 0, the input in: the rows' logits and maxima; the maxima to the owner, whose answers are posted first */
static void serve_logits(tera_head_split *hs, tera_backend *be) {
    const int64_t N = hs->N, D = hs->D, Vh = hs->Vh;
    tera_comm_wait(&hs->w_req); /* the step's weights (arrived long before: sent at the step's start) */
    tera_comm_wait(&hs->mx_send); /* the previous micro-batch's partials (long delivered) */
    tera_comm_wait(&hs->st_send);
    /* outside any weights window (the executor serves between operations): bf16 products round on the fly */
    TERA_PROF(HEAD_FWD, be->ops.linear_forward(be, hs->logits, hs->h, hs->w, N, D, Vh, 0.0f));
    TERA_PROF(LOSS_FWD, be->ops.ce_slice_max(be, hs->mx, hs->logits, N, Vh));
    tera_comm_irecv_f32(hs->group, hs->gmx, N, 1, TERA_PAIR_TAG_MAX, &hs->m_req);
    tera_comm_irecv_f32(hs->group, hs->gst, 2 * N, 1, TERA_PAIR_TAG_SUMS, &hs->s_req);
    TERA_PROF(TP_COMM, tera_comm_isend_f32(hs->group, hs->mx, N, 1, TERA_PAIR_TAG_MAX, &hs->mx_send));
}

/* phase 1, the maxima over the vocabulary in: the rows' exponentials (in place), their sums and target logits */
static void serve_sums(tera_head_split *hs, tera_backend *be, const int32_t *targets) {
    const int64_t N = hs->N;
    TERA_PROF(LOSS_FWD, be->ops.ce_slice_sums(be, hs->st, hs->st + N, hs->logits, hs->logits, hs->gmx, targets, N,
                                              hs->Vh, hs->v0));
    TERA_PROF(TP_COMM, tera_comm_isend_f32(hs->group, hs->st, 2 * N, 1, TERA_PAIR_TAG_SUMS, &hs->st_send));
}

/* phase 2, the sums in: the logits' gradient (the whole loss is the owner's to report); the partial input
 * gradient to the owner; the rows' weight gradient stored at the step's first micro-batch, then added: now, or
 * queued (its operands change hands) */
static void serve_grads(tera_head_split *hs, tera_backend *be, const int32_t *targets, float ce_scale) {
    const int64_t N = hs->N, D = hs->D, Vh = hs->Vh;
    TERA_PROF(LOSS_FWD, be->ops.ce_backward_range(be, hs->logits, hs->logits, hs->gst, targets, N, Vh, hs->v0, ce_scale));
    tera_comm_wait(&hs->dh_send);
    TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, hs->dh, NULL, hs->logits, hs->h, hs->w, N, D, Vh, 0.0f, 1.0f));
    TERA_PROF(TP_COMM, tera_comm_isend_f32(hs->group, hs->dh, N * D, 1, TERA_PAIR_TAG_DX, &hs->dh_send));
    const float beta = hs->next > 0 ? 1.0f : 0.0f;
    if (hs->wq)
        tera_wgrad_push(hs->wq, &hs->logits, hs->h, hs->g, Vh, beta);
    else
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, NULL, hs->g, hs->logits, hs->h, hs->w, N, D, Vh, 0.0f, beta));
    if (++hs->next < hs->micro_batches)
        tera_comm_irecv_f32(hs->group, hs->h, N * D, 1, TAG_H, &hs->h_req);
    else if (hs->wq)
        hs->g_due = 1; /* sent when the queue is through (tera_head_split_work, _finish) */
    else
        tera_comm_isend_f32(hs->group, hs->g, Vh * D, 1, TAG_G, &hs->g_req);
}

void tera_head_split_serve(tera_head_split *hs, tera_backend *be, const int32_t *targets, float ce_scale) {
    TERA_ASSERTF(hs->role == TERA_HS_HELPER && hs->next < hs->micro_batches && !awaited(hs)->active,
                 "head split: serving micro-batch %d of %d (phase %d) before its message", hs->next, hs->micro_batches,
                 hs->phase);
    for (;;) {
        const int phase = hs->phase;
        if (phase == 0)
            serve_logits(hs, be);
        else if (phase == 1)
            serve_sums(hs, be, targets);
        else
            serve_grads(hs, be, targets, ce_scale);
        hs->phase = (phase + 1) % 3;
        if (!hs->blocking || hs->phase == 0) return;
        TERA_PROF(TP_COMM, tera_comm_wait(awaited(hs))); /* tp = 1: the owner's answer, as a collective would wait */
    }
}

static void send_due(tera_head_split *hs) {
    if (!hs->g_due || tera_wgrad_queued(hs->wq)) return;
    hs->g_due = 0;
    tera_comm_isend_f32(hs->group, hs->g, hs->Vh * hs->D, 1, TAG_G, &hs->g_req);
}

int tera_head_split_work(tera_head_split *hs) {
    if (!hs || !hs->wq) return 0;
    const int ran = tera_wgrad_run(hs->wq);
    send_due(hs);
    return ran;
}

int tera_head_split_finish(tera_head_split *hs) {
    if (!hs || !hs->wq) return 0;
    const int n = tera_wgrad_flush(hs->wq);
    send_due(hs);
    return n;
}

void tera_head_split_send_input(tera_head_split *hs, const float *lnf) {
    tera_comm_wait(&hs->h_send); /* the previous micro-batch's (complete: its backward summed with the helper) */
    tera_comm_isend_f32(hs->group, lnf, hs->N * hs->D, 0, TAG_H, &hs->h_send);
    hs->armed = 1;
}

void tera_head_split_grads_in(tera_head_split *hs) { tera_comm_wait(&hs->g_recv); }

void tera_head_split_end(tera_head_split *hs) {
    TERA_ASSERTF(hs->phase == 0, "head split: the step ended in phase %d of a micro-batch", hs->phase);
    TERA_ASSERTF(!tera_wgrad_queued(hs->wq) && !hs->g_due, "head split: the step ended with %d weight gradients "
                 "queued (the executor flushes them: tera_model_wgrad_flush)", tera_wgrad_queued(hs->wq));
    tera_comm_wait(&hs->w_send);
    tera_comm_wait(&hs->h_send);
    tera_comm_wait(&hs->g_recv);
    tera_comm_wait(&hs->w_req);
    tera_comm_wait(&hs->g_req);
    tera_comm_wait(&hs->mx_send);
    tera_comm_wait(&hs->st_send);
    tera_comm_wait(&hs->dh_send);
    hs->armed = 0;
}
