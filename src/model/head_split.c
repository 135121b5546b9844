/* The LM head's vocabulary split over two pipeline stages (head_split.h). */
#include "head_split.h"

#include <string.h>

#include "tera/profile.h"

enum { TAG_H = 1, TAG_W = 2, TAG_G = 3 }; /* the pair's own group: no other messages share these */

static int64_t helper_floats(int64_t V, int64_t D, int64_t N) { return 2 * (V / 2) * D + 2 * N * D + N * (V / 2) + N; }

int64_t tera_head_split_bytes(int role, int64_t V, int64_t D, int64_t N) {
    if (role != TERA_HS_HELPER && role != TERA_HS_OWNER) return 0;
    return tera_tp_scratch_bytes(2, N, D, 0) + (role == TERA_HS_HELPER ? helper_floats(V, D, N) * (int64_t)sizeof(float) : 0);
}

tera_head_split *tera_head_split_create(int role, tera_comm *group, tera_backend *be, int64_t V, int64_t D, int64_t N,
                                        int defer) {
    TERA_ASSERTF((role == TERA_HS_HELPER || role == TERA_HS_OWNER) && group && tera_comm_size(group) == 2 && V % 2 == 0,
                 "head split: role %d, a group of %d, vocabulary %ld", role, group ? tera_comm_size(group) : 0, (long)V);
    TERA_ASSERTF(tera_comm_rank(group) == (role == TERA_HS_OWNER), "head split: the %s is rank %d of the pair",
                 role == TERA_HS_OWNER ? "owner" : "helper", tera_comm_rank(group));
    tera_head_split *hs = tera_calloc(1, sizeof *hs);
    hs->role = role;
    hs->group = group;
    hs->V = V, hs->Vh = V / 2, hs->D = D, hs->N = N;
    tera_tp_init(&hs->tp, be, 2, group, role == TERA_HS_OWNER, V, N, D, 0);
    hs->tp.overlap = 1; /* the input gradient's sum in flight during the weight gradient (fp32 products) */
    hs->bytes = hs->tp.bytes;
    if (role == TERA_HS_HELPER) {
        const int64_t n = helper_floats(V, D, N);
        hs->w = tera_calloc((size_t)n, sizeof(float)); /* one block */
        hs->g = hs->w + hs->Vh * D;
        hs->h = hs->g + hs->Vh * D;
        hs->dh = hs->h + N * D;
        hs->logits = hs->dh + N * D;
        hs->lse = hs->logits + N * hs->Vh;
        hs->bytes += n * (int64_t)sizeof(float);
        if (defer > 0) {
            hs->wq = tera_wgrad_create(be, defer, N, D, hs->Vh);
            hs->bytes += hs->wq->bytes;
        }
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
    const int64_t n = hs->Vh * hs->D;
    if (hs->role == TERA_HS_OWNER) {
        tera_comm_isend_f32(hs->group, w, n, 0, TAG_W, &hs->w_send);
        tera_comm_irecv_f32(hs->group, g, n, 0, TAG_G, &hs->g_recv); /* rows the owner's backward leaves alone */
        return;
    }
    tera_comm_irecv_f32(hs->group, hs->w, n, 1, TAG_W, &hs->w_req);
    if (micro_batches > 0) tera_comm_irecv_f32(hs->group, hs->h, hs->N * hs->D, 1, TAG_H, &hs->h_req);
}

int tera_head_split_ready(tera_head_split *hs) {
    if (hs->role != TERA_HS_HELPER || hs->next >= hs->micro_batches) return -1;
    tera_comm_poll(&hs->h_req, 1);
    return hs->h_req.active ? -1 : hs->next;
}

tera_comm_req *tera_head_split_pending(tera_head_split *hs) {
    return hs->role == TERA_HS_HELPER && hs->next < hs->micro_batches && hs->h_req.active ? &hs->h_req : NULL;
}

void tera_head_split_serve(tera_head_split *hs, tera_backend *be, const int32_t *targets, float ce_scale) {
    TERA_ASSERTF(hs->role == TERA_HS_HELPER && hs->next < hs->micro_batches && !hs->h_req.active,
                 "head split: serving micro-batch %d of %d before its input", hs->next, hs->micro_batches);
    const int64_t N = hs->N, D = hs->D, Vh = hs->Vh;
    tera_comm_wait(&hs->w_req); /* the step's weights (arrived long before: sent at the step's start) */
    /* outside any weights window (the executor serves between operations): bf16 products round on the fly */
    TERA_PROF(HEAD_FWD, be->ops.linear_forward(be, hs->logits, hs->h, hs->w, N, D, Vh, 0.0f));
    double sum = 0.0; /* the whole loss: the owner reports it */
    (void)tera_tp_ce_fused(&hs->tp, hs->logits, hs->lse, NULL, hs->logits, targets, N, ce_scale, &sum);
    /* the partial input gradient summed for the owner (this copy is not used); the rows' weight gradient
     * stored at the step's first micro-batch, then added: now, or queued (its operands change hands) */
    const float beta = hs->next > 0 ? 1.0f : 0.0f;
    tera_tp_head_backward(&hs->tp, hs->dh, hs->wq ? NULL : hs->g, hs->logits, hs->h, hs->w, N, D, Vh, beta);
    if (hs->wq) tera_wgrad_push(hs->wq, &hs->logits, hs->h, hs->g, Vh, beta);
    if (++hs->next < hs->micro_batches)
        tera_comm_irecv_f32(hs->group, hs->h, N * D, 1, TAG_H, &hs->h_req);
    else if (hs->wq)
        hs->g_due = 1; /* sent when the queue is through (tera_head_split_work, _finish) */
    else
        tera_comm_isend_f32(hs->group, hs->g, Vh * D, 1, TAG_G, &hs->g_req);
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
    TERA_ASSERTF(!tera_wgrad_queued(hs->wq) && !hs->g_due, "head split: the step ended with %d weight gradients "
                 "queued (the executor flushes them: tera_model_wgrad_flush)", tera_wgrad_queued(hs->wq));
    tera_comm_wait(&hs->w_send);
    tera_comm_wait(&hs->h_send);
    tera_comm_wait(&hs->g_recv);
    tera_comm_wait(&hs->w_req);
    tera_comm_wait(&hs->g_req);
    hs->armed = 0;
}
